"""Training speed on CPU: stock fairseq against ls_fairseq, same data and flags, side by side.

Runs ``fairseq-train`` (as scripts/run_example.sh does on CPU) for stock ``transformer_tiny``
with fairseq's label_smoothed_cross_entropy and adam, and for ``ls_transformer_tiny`` with the
plugin's criterion and optimizer (``--user-dir ls_fairseq/fairseq_plugin``), alternating the two ``--repeats``
times, and prints a Markdown table: updates/s over the steady log intervals (every interval but
the first, which holds the start-up), and the wall time of the whole command. Extra model flags
(``--model-args``) go to both, e.g. a larger model:

  python scripts/bench_cpu.py --data /tmp/cpuspeed-data/data-bin
  python scripts/bench_cpu.py --data DIR --model-args "--encoder-layers 3 --decoder-layers 3
      --encoder-embed-dim 256 --encoder-ffn-embed-dim 1024 --encoder-attention-heads 4
      --decoder-attention-heads 4"

The data: ``bash recipes/wmt14_en_de/prepare.sh --from data/lohelp --work DIR --vocab-size 2000
--ratio 2.5`` (DIR/data-bin). Run it alone on the machine (under torchlock where that exists).
"""
import argparse
import os
import re
import shlex
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# run_example.sh's CPU flags, less the time budget, checkpoints and TensorBoard
COMMON = [
    "--max-tokens", "4096", "--dropout", "0.1", "--cpu", "--num-workers", "0", "--share-all-embeddings",
    "--label-smoothing", "0.1", "--adam-betas", "(0.9,0.98)", "--lr", "2e-3", "--lr-scheduler", "inverse_sqrt",
    "--warmup-updates", "200", "--clip-norm", "1.0", "--no-save", "--disable-validation", "--log-format", "simple",
    "--seed", "1",
]
SYSTEMS = {
    "stock": ["--arch", "transformer_tiny", "--criterion", "label_smoothed_cross_entropy", "--optimizer", "adam"],
    "ls": ["--user-dir", os.path.join(REPO, "ls_fairseq", "fairseq_plugin"), "--arch", "ls_transformer_tiny",
           "--criterion", "ls_label_smoothed_cross_entropy", "--optimizer", "ls_adam"],
}
UPS = re.compile(r"\| train_inner \|.*?\bups=([0-9.]+)")


def run(system, args):
    cmd = ["fairseq-train", args.data] + SYSTEMS[system] + COMMON + [
        "--max-update", str(args.updates), "--log-interval", str(args.log_interval)] + shlex.split(args.model_args)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.time()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.time() - start
    if proc.returncode != 0:
        sys.exit("bench_cpu: {} failed ({}):\n{}".format(system, proc.returncode, proc.stdout[-3000:]))
    ups = [float(u) for u in UPS.findall(proc.stdout)]
    if len(ups) < 2:
        sys.exit("bench_cpu: {} logged {} train_inner lines; raise --updates".format(system, len(ups)))
    steady = ups[1:]
    return sum(steady) / len(steady), wall, cmd


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a fairseq data-bin (prepare.sh's DIR/data-bin)")
    parser.add_argument("--updates", type=int, default=150, help="--max-update of each run")
    parser.add_argument("--log-interval", type=int, default=50, help="--log-interval of each run")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each system, alternating")
    parser.add_argument("--model-args", default="", help="extra flags for both models (one string)")
    parser.add_argument("--systems", default="stock,ls", help="comma-separated: stock, ls")
    args = parser.parse_args()
    systems = args.systems.split(",")
    rows = []
    for rep in range(args.repeats):
        for system in systems:
            ups, wall, cmd = run(system, args)
            rows.append((system, rep + 1, ups, wall))
            print("bench_cpu: {} run {}: {:.2f} updates/s, {:.1f} s".format(system, rep + 1, ups, wall), flush=True)
    print("\ncommand (ls): " + " ".join(shlex.quote(c) for c in cmd if c != args.data))
    print("\n| system | run | updates/s (intervals 2..) | wall s ({} updates) |".format(args.updates))
    print("| --- | --- | --- | --- |")
    for system, rep, ups, wall in rows:
        print("| {} | {} | {:.2f} | {:.1f} |".format(system, rep, ups, wall))
    means = {s: sum(r[2] for r in rows if r[0] == s) / args.repeats for s in systems}
    if "stock" in means and "ls" in means:
        print("\nls / stock updates/s: {:.2f}".format(means["ls"] / means["stock"]))


if __name__ == "__main__":
    main()
