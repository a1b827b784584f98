"""--ls-packed against the padded step on the embedded corpus (CPU or GPU), issue 51's protocol.

The main job's CPU model (ls_transformer 128 wide, FFN 256, 2+2 layers, 4 heads, 2,000 pieces,
--max-tokens 4096, lr 4e-3) trained --updates updates by ls-fairseq-train, validated at the end:
1. dropout 0, seed 1: padded, packed, and padded with the sentences of every batch in another order
   (packed_shuffle_hooks): the packed run's final validation loss must be within 1e-3 relative of
   the padded run's, or within the padded run's own change under the shuffle, whichever is larger;
2. the default dropout 0.1, --seeds: padded and packed each; the packed runs' mean validation loss
   must lie within the padded runs' seed-to-seed range.
Each run's result is kept as OUT/NAME.json and reused, so the runs can be split over calls
(--max-runs N: at most N new runs in this call, then exit status 3 while runs remain).

  python scripts/packed_parity.py --out DIR [--updates 300] [--seeds 1,2,3] [--data DIR] [--max-runs N]
Writes OUT/packed.md (a table and the verdicts) and OUT/packed.json.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--arch", "ls_transformer", "--encoder-embed-dim", "128", "--encoder-ffn-embed-dim", "256",
         "--encoder-layers", "2", "--decoder-layers", "2", "--encoder-attention-heads", "4",
         "--decoder-attention-heads", "4", "--max-tokens", "4096", "--lr", "4e-3", "--warmup-updates", "200",
         "--share-all-embeddings", "--criterion", "ls_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
         "--optimizer", "ls_adam", "--adam-betas", "(0.9,0.98)", "--lr-scheduler", "inverse_sqrt",
         "--clip-norm", "1.0", "--no-save", "--log-format", "simple", "--log-interval", "50"]


def prepare(data):
    if not os.path.isdir(os.path.join(data, "data-bin")):
        subprocess.run(["bash", os.path.join(REPO, "recipes", "wmt14_en_de", "prepare.sh"), "--from",
                        os.path.join(REPO, "data", "lohelp"), "--work", data, "--vocab-size", "2000", "--ratio",
                        "2.5"], check=True)
    return os.path.join(data, "data-bin")


class MoreToRun(Exception):
    pass


def train(name, data_bin, out, updates, seed, dropout, packed=False, user_dir=None, budget=None):
    path = os.path.join(out, name + ".json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    if budget is not None:
        if budget[0] == 0:
            raise MoreToRun
        budget[0] -= 1
    import torch

    device = [] if torch.cuda.is_available() else ["--cpu", "--num-workers", "0"]
    cmd = [sys.executable, "-m", "ls_fairseq.train", data_bin] + MODEL + device + [
        "--max-update", str(updates), "--seed", str(seed), "--dropout", str(dropout)]
    cmd += ["--ls-packed"] if packed else []
    cmd += ["--user-dir", user_dir] if user_dir else []
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO))
    log = proc.stdout + proc.stderr
    with open(os.path.join(out, name + ".log"), "w") as f:
        f.write(" ".join(cmd) + "\n" + log)
    valid = re.findall(r"valid on 'valid' subset \| loss ([0-9.]+)", log)
    if proc.returncode != 0 or not valid:
        sys.exit("packed_parity: run {} failed; see {}".format(name, os.path.join(out, name + ".log")))
    result = {"name": name, "valid_loss": float(valid[-1]), "seconds": round(time.time() - start, 1),
              "command": " ".join(cmd[2:])}
    with open(path, "w") as f:
        json.dump(result, f)
    print("packed_parity: {} valid loss {} ({:.0f} s)".format(name, result["valid_loss"], result["seconds"]), flush=True)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--updates", type=int, default=300)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--data", default=None, help="a prepared corpus folder (default OUT/data-2000)")
    parser.add_argument("--max-runs", type=int, default=None, help="new runs in this call at most")
    args = parser.parse_args()
    try:
        report(args)
    except MoreToRun:
        print("packed_parity: --max-runs {} done; more runs remain".format(args.max_runs))
        sys.exit(3)


def report(args):
    os.makedirs(args.out, exist_ok=True)
    data_bin = prepare(args.data or os.path.join(args.out, "data-2000"))
    seeds = [int(s) for s in args.seeds.split(",")]
    u = args.updates
    hooks = os.path.join(REPO, "scripts", "packed_shuffle_hooks")
    budget = None if args.max_runs is None else [args.max_runs]
    padded = train("padded-d0", data_bin, args.out, u, 1, 0.0, budget=budget)
    packed = train("packed-d0", data_bin, args.out, u, 1, 0.0, packed=True, budget=budget)
    shuffled = train("padded-shuffled-d0", data_bin, args.out, u, 1, 0.0, user_dir=hooks, budget=budget)
    runs = {"padded": [], "packed": []}
    for seed in seeds:
        runs["padded"].append(train("padded-s{}".format(seed), data_bin, args.out, u, seed, 0.1, budget=budget))
        runs["packed"].append(train("packed-s{}".format(seed), data_bin, args.out, u, seed, 0.1, packed=True,
                                    budget=budget))
    ref = padded["valid_loss"]
    own = abs(shuffled["valid_loss"] - ref)
    bound = max(1e-3 * ref, own)
    diff = abs(packed["valid_loss"] - ref)
    p_losses = [r["valid_loss"] for r in runs["padded"]]
    k_losses = [r["valid_loss"] for r in runs["packed"]]
    k_mean = sum(k_losses) / len(k_losses)
    verdicts = {
        "dropout 0": diff <= bound,
        "seeds": min(p_losses) <= k_mean <= max(p_losses),
    }
    lines = ["| run | valid loss | seconds |", "| --- | --- | --- |"]
    for r in [padded, packed, shuffled] + runs["padded"] + runs["packed"]:
        lines.append("| {} | {:.4f} | {:.0f} |".format(r["name"], r["valid_loss"], r["seconds"]))
    lines += ["", "- dropout 0: |packed - padded| = {:.5f}, bound max(1e-3 x {:.4f}, shuffle's own change {:.5f}) = "
              "{:.5f}: {}".format(diff, ref, own, bound, "PASS" if verdicts["dropout 0"] else "FAIL"),
              "- dropout 0.1, seeds {}: packed mean {:.4f}, padded range [{:.4f}, {:.4f}]: {}".format(
                  args.seeds, k_mean, min(p_losses), max(p_losses), "PASS" if verdicts["seeds"] else "FAIL")]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(args.out, "packed.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "packed.json"), "w") as f:
        json.dump({"updates": u, "seeds": seeds, "verdicts": verdicts, "bound": bound, "difference": diff,
                   "padded_range": [min(p_losses), max(p_losses)], "packed_mean": k_mean}, f, indent=1)
    sys.exit(0 if all(verdicts.values()) else 1)


if __name__ == "__main__":
    main()
