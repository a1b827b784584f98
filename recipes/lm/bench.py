"""Language-model training speed on one GPU: stock fairseq vs ls_fairseq, transformer_lm_gpt
(GPT-2 small's shape: 768 wide, 12 layers, 12 heads) at 1,024 tokens per sample.

Both systems train the same architecture on the same synthetic token stream (uniform random
tokens over a GPT-2-sized vocabulary, 50,304 types: the model's speed does not depend on the text)
with --sample-break-mode none, so every batch is --max-tokens / 1,024 full blocks without padding,
for --updates updates through fairseq-train as users run it; the first --warmup updates are left out.
stock: fairseq-train --fp16 (stock --bf16 takes fairseq's TPU path); ls: ls-fairseq-train --bf16
--ls-cuda-graphs with the plugin's criterion and optimizer. Reports per system the steady wps (mean
of the log intervals after the warm-up), the peak GPU memory and the MFU:

  MFU = wps x (6 x N + 6 x L x T x d) / peak

N the parameters of the GEMMs (per layer 4 d^2 + 2 d f, and the output projection d V; the
embedding lookup is no GEMM), 6 x L x T x d causal attention's scores and context (forward 2 x T/2
keys x d multiply-adds per token and layer, training 3 x forward), T = 1,024, peak --peak-tflops
(989: H100/H200 dense bf16).

  python recipes/lm/bench.py --out results/DATE [--max-tokens 16384] [--updates 60]
  python recipes/lm/bench.py --dry-run    # print the commands, run nothing
"""
import argparse
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
T, DIM, FFN, LAYERS, VOCAB = 1024, 768, 3072, 12, 50304
COMMON = ["--task", "language_modeling", "--tokens-per-sample", str(T), "--sample-break-mode", "none",
          "--adam-betas", "(0.9,0.98)", "--lr", "6e-4", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "100",
          "--share-decoder-input-output-embed", "--no-save", "--disable-validation", "--log-format", "json",
          "--log-interval", "10", "--seed", "1", "--num-workers", "2"]
SYSTEMS = {
    "stock-fp16": [sys.executable, "-m", "fairseq_cli.train", "--arch", "transformer_lm_gpt", "--criterion",
                   "cross_entropy", "--optimizer", "adam", "--fp16"],
    "ls-bf16-graphs": [sys.executable, "-m", "ls_fairseq.train", "--arch", "ls_transformer_lm_gpt", "--criterion",
                       "ls_label_smoothed_cross_entropy", "--label-smoothing", "0", "--optimizer", "ls_adam", "--bf16",
                       "--ls-cuda-graphs"],
}


def flops_per_token():
    params = LAYERS * (4 * DIM * DIM + 2 * DIM * FFN) + DIM * VOCAB
    return 6 * params + 6 * LAYERS * T * DIM


def synthetic_data(folder, tokens):
    """folder/data-bin: ``tokens`` uniform random tokens of VOCAB - 4 types as lines of 512, binarized."""
    import numpy as np

    bin_dir = os.path.join(folder, "data-bin")
    if os.path.isfile(os.path.join(bin_dir, "train.bin")):
        return bin_dir
    rng = np.random.default_rng(1)
    text = os.path.join(folder, "train.txt")
    with open(text, "w") as f:
        for _ in range(tokens // 512):
            f.write(" ".join("t{}".format(i) for i in rng.integers(0, VOCAB - 4, 512)) + "\n")
    subprocess.run(["fairseq-preprocess", "--only-source", "--trainpref", text, "--destdir", bin_dir,
                    "--padding-factor", "16", "--workers", "4"], check=True)
    return bin_dir


def commands(bin_dir, args):
    return {name: cmd + [bin_dir] + COMMON + ["--max-tokens", str(args.max_tokens), "--max-update", str(args.updates)]
            for name, cmd in SYSTEMS.items()}


def steady(log, warmup):
    """(mean wps of the log intervals after ``warmup`` updates, the largest gpu_peak_gib logged after them or
    None: the plugin's criterion logs it, stock's does not)."""
    rows = [json.loads(m.group(1)) for m in re.finditer(r"\| train_inner \| (\{.*\})", log)]
    kept = [r for r in rows if int(r["num_updates"]) > warmup]
    if not kept:
        raise RuntimeError("no train_inner log line after update {}".format(warmup))
    peak = [float(r["gpu_peak_gib"]) for r in kept if "gpu_peak_gib" in r]
    return sum(float(r["wps"]) for r in kept) / len(kept), max(peak) if peak else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="folder of the data and results.json")
    parser.add_argument("--max-tokens", type=int, default=16384, help="tokens per GPU batch (a multiple of 1,024)")
    parser.add_argument("--updates", type=int, default=60, help="updates per system")
    parser.add_argument("--warmup", type=int, default=20, help="updates left out at the start")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = parser.parse_args()
    if args.max_tokens % T:
        parser.error("--max-tokens {} is not a multiple of {} (whole blocks)".format(args.max_tokens, T))
    bin_dir = os.path.join(args.out, "data-bin")
    if args.dry_run:
        for name, cmd in commands(bin_dir, args).items():
            print(name + ": " + " ".join(cmd))
        return 0
    os.makedirs(args.out, exist_ok=True)
    bin_dir = synthetic_data(args.out, 2 * args.max_tokens * args.updates)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    results = {"flops_per_token": flops_per_token(), "max_tokens": args.max_tokens, "systems": {}}
    for name, cmd in commands(bin_dir, args).items():
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode:
            sys.stderr.write(proc.stderr[-3000:])
            return proc.returncode
        wps, peak = steady(proc.stdout + proc.stderr, args.warmup)
        results["systems"][name] = {"wps": wps, "gpu_peak_gib": peak,
                                    "mfu": wps * flops_per_token() / (args.peak_tflops * 1e12)}
        print("{}: {:.0f} wps, MFU {:.1%}, peak {} GiB".format(name, wps, results["systems"][name]["mfu"], peak))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
