"""Convergence of ls_transformer_lm against stock transformer_lm on the embedded corpus's German side.

  python scripts/lm_parity.py --out DIR [--seeds 1,2,3] [--work data/lm_lohelp] [-- extra fairseq-train options]

For each seed, recipes/lm/train.sh trains both (ls with the plugin's criterion at label smoothing 0 and
ls_adam; stock with cross_entropy and adam; 300 updates of transformer_lm_gpt2_tiny, dropout 0.1, each seed
its own initial weights, data order and dropout), after recipes/lm/prepare.sh --lohelp where DIR's data is
missing. Reads each run's last validation loss (base 2, at update 300). The bound, fixed before any run: the
mean of ls's validation losses lies within the range of stock's (min to max over the seeds). Prints a table,
writes DIR/lm_parity.json and exits 1 when the bound fails. Each run's log is kept as DIR/SYSTEM-sSEED.log
and reused where it holds a final validation loss.
"""
import argparse
import json
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VALID = re.compile(r"valid on 'valid' subset \| loss ([0-9.]+) .*\| num_updates ([0-9]+)")


def last_valid_loss(log):
    """(loss, num_updates) of the last validation in a fairseq-train log, or None."""
    found = VALID.findall(log)
    return (float(found[-1][0]), int(found[-1][1])) if found else None


def run(system, seed, work, out, extra):
    path = os.path.join(out, "{}-s{}.log".format(system, seed))
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            kept = last_valid_loss(f.read())
        if kept is not None:
            return kept
    save = os.path.join(out, "checkpoints-{}-s{}".format(system, seed))
    cmd = ["bash", os.path.join(REPO, "recipes", "lm", "train.sh"), "--work", work, "--save", save]
    cmd += (["--baseline"] if system == "stock" else []) + ["--", "--seed", str(seed)] + extra
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    with open(path, "w", encoding="utf-8") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        sys.exit("lm_parity: {} seed {} failed; see {}".format(system, seed, path))
    return last_valid_loss(proc.stdout + proc.stderr)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where the logs, checkpoints and lm_parity.json go")
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated seeds (default: 1,2,3)")
    parser.add_argument("--work", default=os.path.join(REPO, "data", "lm_lohelp"),
                        help="prepare.sh's work folder (default: data/lm_lohelp, prepared if missing)")
    parser.add_argument("extra", nargs="*", help="after --: extra fairseq-train options for both systems")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if not os.path.isdir(os.path.join(args.work, "data-bin")):
        subprocess.run(["bash", os.path.join(REPO, "recipes", "lm", "prepare.sh"), "--lohelp", "--work", args.work,
                        "--vocab-size", "8000"], check=True, env=dict(os.environ, PYTHON=sys.executable))
    seeds = [int(s) for s in args.seeds.split(",")]
    losses = {system: {seed: run(system, seed, args.work, args.out, args.extra) for seed in seeds}
              for system in ("stock", "ls")}
    stock = [loss for loss, _ in losses["stock"].values()]
    ls_mean = sum(loss for loss, _ in losses["ls"].values()) / len(seeds)
    ok = min(stock) <= ls_mean <= max(stock)
    print("| system | " + " | ".join("seed {}".format(s) for s in seeds) + " | mean |")
    print("| --- |" + " --- |" * (len(seeds) + 1))
    for system in ("stock", "ls"):
        values = [losses[system][s][0] for s in seeds]
        print("| {} | ".format(system) + " | ".join("{:.4f}".format(v) for v in values)
              + " | {:.4f} |".format(sum(values) / len(values)))
    print("lm_parity: ls's mean validation loss {:.4f} {} stock's range {:.4f}-{:.4f} (updates: {})".format(
        ls_mean, "within" if ok else "OUTSIDE", min(stock), max(stock),
        sorted({n for system in losses.values() for _, n in system.values()})))
    with open(os.path.join(args.out, "lm_parity.json"), "w", encoding="utf-8") as f:
        json.dump({"losses": {system: {str(s): v for s, v in runs.items()} for system, runs in losses.items()},
                   "ls_mean": ls_mean, "stock_range": [min(stock), max(stock)], "pass": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
