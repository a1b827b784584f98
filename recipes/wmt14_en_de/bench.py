"""LightSeq2's training-speed experiment on one GPU: stock fairseq vs ls_fairseq.

Trains transformer-big (and base) with the scaling_nmt hyper-parameters on the
same synthetic WMT14-like data (synthetic.py), sweeping --max-tokens, through
fairseq-train as users run it. Four epochs: the first is the warm-up (its wps
is reported: a per-shape cost shows there), those from --steady-from-epoch give
the steady state (mean wps of their log intervals), and a few steps of the last
are profiled (bench_hooks: kernel launches, GPU time, host synchronisations and
optimizer time per step, host and kernel tables). The steady state ends where
the profiler starts: the steps after a profile run slower too (stock fairseq's;
docs/perf-log.md), so the last epoch counts only up to it. Intervals in which a CUDA graph
was captured (graphed systems) are left out as well.
Per point also: ups, the wall time of a step, peak GPU memory over the run,
MFU, and the speed-up over stock fairseq --fp16 (its fastest setting). Writes
results.json, a Markdown table (printed last), a PNG plot and TensorBoard
scalars.

  python bench.py --out results/DATE                       # core points: big, 4096/8192/16384
  python bench.py --out results/DATE --full                # 512 .. 16384, big and base
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)
from ls_fairseq.flops import training_flops_per_target_token  # noqa: E402 (the checkout's package)
PEAK_TFLOPS = 989.0  # dense fp16/bf16, H100/H200
CAPTURED = "ls_fairseq: CUDA graph "  # ls_fairseq.cuda_graphs' log line for each capture

LOG_INTERVAL = 10
# NVLink multicast stays off in NCCL, PyTorch and NVSHMEM (shared multi-GPU hosts)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
COMMON = [
    "--share-all-embeddings", "--adam-betas", "(0.9,0.98)", "--lr", "5e-4", "--lr-scheduler", "inverse_sqrt",
    "--warmup-updates", "4000", "--dropout", "0.3", "--label-smoothing", "0.1", "--no-save", "--disable-validation",
    "--log-format", "simple", "--log-interval", str(LOG_INTERVAL), "--num-workers", "2", "--seed", "1",
]
LS = ("ls_", "ls_label_smoothed_cross_entropy", "ls_adam")
SYSTEMS = {
    # name: (architecture prefix, criterion, optimizer, precision flags, entry point)
    # ls-fairseq-train (python -m ls_fairseq.train) is fairseq-train with the plugin and its trainer
    # (device-decided optimizer step; bf16 kept on the GPU)
    "stock-fp16": ("", "label_smoothed_cross_entropy", "adam", ["--fp16"], "fairseq_cli.train"),
    "ls-fp16": LS + (["--memory-efficient-fp16"], "ls_fairseq.train"),
    "ls-fp16-master": LS + (["--fp16"], "ls_fairseq.train"),
    # forward and backward replayed from a CUDA graph per batch shape (captured at a shape's first batch;
    # lengths padded to multiples of 8 so that batches share shapes): see --steady-from-epoch
    "ls-fp16-graphs": LS + (["--fp16", "--ls-cuda-graphs", "--required-seq-len-multiple", "8"], "ls_fairseq.train"),
    "ls-bf16-graphs": LS + (["--bf16", "--ls-cuda-graphs", "--required-seq-len-multiple", "8"], "ls_fairseq.train"),
    # lengths padded to multiples of 4: about half the padding's wasted work, about twice the shapes to capture
    "ls-fp16-graphs4": LS + (["--fp16", "--ls-cuda-graphs", "--required-seq-len-multiple", "4"], "ls_fairseq.train"),
    # no length padding: ~10% fewer FLOPs than multiples of 8 at 16,384 tokens (scripts/padding_cost.py),
    # and a graph for nearly every batch's shape in the first epoch
    "ls-fp16-graphs1": LS + (["--fp16", "--ls-cuda-graphs"], "ls_fairseq.train"),
    # FP8 GEMMs (--ls-fp8, its default choice of GEMMs); MFU stays against the dense bf16 peak (half of it
    # against the FP8 peak)
    "ls-bf16-fp8-graphs": LS + (["--bf16", "--ls-fp8", "--ls-cuda-graphs", "--required-seq-len-multiple", "8"],
                                "ls_fairseq.train"),
    "ls-fp16-fp8-graphs": LS + (["--fp16", "--ls-fp8", "--ls-cuda-graphs", "--required-seq-len-multiple", "8"],
                                "ls_fairseq.train"),
    # the input gradients of kv and vocab in FP8 too (their weights' two FP8 layouts come from one pass)
    "ls-bf16-fp8-dgrad3-graphs": LS + (["--bf16", "--ls-fp8", "--ls-fp8-dgrad", "fc2,kv,vocab", "--ls-cuda-graphs",
                                        "--required-seq-len-multiple", "8"], "ls_fairseq.train"),
    # packed batches (--ls-packed): no padding in any GEMM or fused op; with graphs, each stream rounded up to
    # one of 8 capacities per side (no --required-seq-len-multiple: packing drops the padding anyway)
    "ls-fp16-packed": LS + (["--fp16", "--ls-packed"], "ls_fairseq.train"),
    "ls-bf16-packed": LS + (["--bf16", "--ls-packed"], "ls_fairseq.train"),
    "ls-fp16-packed-graphs": LS + (["--fp16", "--ls-packed", "--ls-cuda-graphs"], "ls_fairseq.train"),
    "ls-bf16-packed-graphs": LS + (["--bf16", "--ls-packed", "--ls-cuda-graphs"], "ls_fairseq.train"),
    # cross-attention through FlashAttention as well (--ls-flash-cross-attention): padded and packed
    "ls-bf16-fcross-graphs": LS + (["--bf16", "--ls-flash-cross-attention", "--ls-cuda-graphs",
                                    "--required-seq-len-multiple", "8"], "ls_fairseq.train"),
    "ls-bf16-packed-fcross-graphs": LS + (["--bf16", "--ls-packed", "--ls-flash-cross-attention", "--ls-cuda-graphs"],
                                          "ls_fairseq.train"),
    "ls-bf16-fp8-packed": LS + (["--bf16", "--ls-fp8", "--ls-packed"], "ls_fairseq.train"),
    "ls-bf16-fp8-packed-graphs": LS + (["--bf16", "--ls-fp8", "--ls-packed", "--ls-cuda-graphs"], "ls_fairseq.train"),
    "ls-bf16": LS + (["--memory-efficient-bf16"], "ls_fairseq.train"),
    "ls-bf16-master": LS + (["--bf16"], "ls_fairseq.train"),
    # the plugin under plain fairseq-train --user-dir: fairseq's FP16Optimizer and host-side checks
    "ls-fp16-fairseq-train": LS + (["--fp16"], "fairseq_cli.train"),
}
ARCHS = {"big": "transformer_vaswani_wmt_en_de_big", "base": "transformer_wmt_en_de"}
DIMS = {"big": (1024, 4096, 6, 6), "base": (512, 2048, 6, 6)}


def flops_per_target_token(arch, vocab=32000, length=30.0):
    """Training FLOPs per target token (ls_fairseq.flops) at WMT14-like lengths."""
    d, f, enc, dec = DIMS[arch]
    return training_flops_per_target_token(d, f, enc, dec, vocab, length * 28.0 / 30.0, length, 28.0 / 30.0)


def log_intervals(log):
    """(epoch, fields, captured) of each log interval (train_inner line) in ``log``: its numbers by
    name, and whether a CUDA graph was captured during it (a capture line logged after the previous
    interval's line, whichever rank logged either)."""
    done, captures = 0, set()
    for line in log.splitlines():
        if CAPTURED in line:
            captures.add(done + 1)
        m = re.search(r"\| train_inner \| epoch (\d+):.*", line)
        if m:
            fields = dict(re.findall(r"(\w+)=([\d.]+)", m.group(0)))
            update = int(fields["num_updates"])
            done = max(done, update)
            yield int(m.group(1)), fields, within(update, captures)


def within(update, updates):
    """Whether any of ``updates`` falls in the log interval that ends at ``update``."""
    return any(update - LOG_INTERVAL < u <= update for u in updates)


def before_profile(update, profiled):
    """Whether the log interval that ends at ``update`` ends before the first ``profiled`` update
    (all of the run's when none was profiled)."""
    return not profiled or update < min(profiled)


def steady_intervals(log, profiled, steady_from):
    """The fields of the log intervals that make the steady state: from epoch ``steady_from`` on, up
    to the first of the ``profiled`` updates, without those during which a CUDA graph was captured
    (at several GPUs each rank captures the shapes it meets, some of them only in later epochs, and
    the other ranks wait for it)."""
    return [fields for epoch, fields, captured in log_intervals(log)
            if epoch >= steady_from and not captured and before_profile(int(fields["num_updates"]), profiled)]


def first_updates_wps(log, profiled, updates=200):
    """wps over the first ``updates`` updates (target tokens over wall time, from the log intervals
    that end by then and before the profile; each update once, whichever rank logged it)."""
    tokens = seconds = 0.0
    seen = set()
    for _, fields, _ in log_intervals(log):
        update = int(fields["num_updates"])
        if update > updates or update in seen or not before_profile(update, profiled):
            continue
        seen.add(update)
        interval = LOG_INTERVAL / float(fields["ups"])
        seconds += interval
        tokens += float(fields["wps"]) * interval
    return tokens / seconds if seconds else None


def distributed_options(gpus, with_ls):
    """fairseq-train's data-parallel options for ``gpus`` GPUs, the same for both systems but the
    plugin's backend: the world size always (fairseq-train otherwise takes every visible GPU); with
    several GPUs, --grouped-shuffling (each update's batches are neighbours in fairseq's length-sorted
    batch list, so every rank's step takes about as long and none waits for a longer batch at the
    all-reduce) with --update-epoch-batch-itr False (fairseq ties it to --grouped-shuffling: it would
    build a new batch iterator every epoch, whose new data loader's workers replace the old ones,
    a wait of many seconds at each epoch's start), and for the plugin legacy_ddp (one
    all-reduce over ls_adam's gradient workspace)."""
    options = ["--distributed-world-size", str(gpus)]
    if gpus > 1:
        options += ["--grouped-shuffling", "--update-epoch-batch-itr", "False"]
        if with_ls:
            options += ["--ddp-backend", "legacy_ddp"]
    return options


def run(system, arch, max_tokens, gpus, data, epochs, work, steady_from=2):
    """One fairseq-train run; ``gpus`` > 1: fairseq's data-parallel training over that many GPUs
    (--max-tokens per GPU), the plugin's gradients all-reduced over its workspace (legacy_ddp)."""
    prefix, criterion, optimizer, precision, entry = SYSTEMS[system]
    with_ls = prefix == "ls_"
    name = "{}-{}-{}".format(arch, system, max_tokens) + ("-{}gpus".format(gpus) if gpus > 1 else "")
    hooks_out = os.path.join(work, name + ".hooks.json")
    distributed = distributed_options(gpus, with_ls)
    cmd = [sys.executable, "-m", entry, data, "--user-dir", os.path.join(HERE, "bench_hooks"),
           "--arch", prefix + ARCHS[arch], "--criterion", criterion, "--optimizer", optimizer,
           "--max-tokens", str(max_tokens), "--max-epoch", str(epochs),
           "--tensorboard-logdir", os.path.join(work, "tensorboard", name)] + precision + COMMON
    cmd += distributed
    env = dict(os.environ, BENCH_HOOKS_OUT=hooks_out, BENCH_WITH_LS="1" if with_ls else "0",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for key, value in NO_MULTICAST.items():
        env.setdefault(key, value)
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    log = proc.stdout + proc.stderr
    with open(os.path.join(work, name + ".log"), "w") as f:
        f.write(log)
    result = dict(system=system, arch=arch, max_tokens=max_tokens, gpus=gpus, seconds=time.time() - start,
                  rc=proc.returncode)
    if proc.returncode != 0:
        result["error"] = log.strip().splitlines()[-1] if log.strip() else "no output"
        return result
    hooks = {}
    if os.path.exists(hooks_out):
        with open(hooks_out) as f:
            hooks = json.load(f)
    steady = steady_intervals(log, hooks.get("profiled_updates", []), steady_from)
    first_epoch = re.search(r"\| train \| epoch 001 \|.*? wps ([\d.]+)", log)
    if not steady:
        result["error"] = ("no steady-state log interval from epoch {} to the profile in the last epoch: each "
                           "one capturing a CUDA graph or after the profile (more --epochs)".format(steady_from))
    else:
        result["wps"] = sum(float(v["wps"]) for v in steady) / len(steady)
        result["ups"] = sum(float(v["ups"]) for v in steady) / len(steady)
        result["step_ms"] = 1000.0 / result["ups"]
    result["first_epoch_wps"] = float(first_epoch.group(1)) if first_epoch else None
    result["first200_wps"] = first_updates_wps(log, hooks.get("profiled_updates", []))
    if hooks:
        result["peak_gib"] = hooks["peak_bytes"] / 2**30
        for key in ("kernels_per_step", "kernel_launches_per_step", "gpu_ms_per_step", "host_syncs_per_step",
                    "host_sync_sites", "optimizer_ms_per_step", "epoch_boundaries", "gpu_idle_ms_per_step"):
            result[key] = hooks.get(key)
    if "wps" in result:
        result["mfu"] = result["wps"] * flops_per_target_token(arch) / (PEAK_TFLOPS * 1e12 * gpus)
    return result


def table(results):
    """Markdown table; speed-up against stock fairseq at the same size and GPU count, scaling
    efficiency (wps over GPUs x the same system's one-GPU wps) where both were run."""
    lines = ["| arch | max-tokens | GPUs | system | wps (steady) | speed-up | scaling | ups | step ms | first-epoch wps | "
             "first 200 updates wps (x steady) | peak GiB | kernels/step | kernel launches/step | GPU ms/step | "
             "GPU idle ms/step | host syncs/step | optimizer ms/step | MFU |",
             "| --- " * 19 + "|"]
    wps = {(r["arch"], r["max_tokens"], r.get("gpus", 1), r["system"]): r.get("wps") for r in results}
    for r in results:
        gpus = r.get("gpus", 1)
        if "wps" not in r:
            lines.append("| {} | {} | {} | {} | failed: {} |".format(r["arch"], r["max_tokens"], gpus, r["system"],
                                                                      r.get("error", "?")) + " |" * 14)
            continue
        ref = wps.get((r["arch"], r["max_tokens"], gpus, "stock-fp16"))
        one = wps.get((r["arch"], r["max_tokens"], 1, r["system"]))

        def fmt(key, spec):
            return spec.format(r[key]) if r.get(key) is not None else "-"

        first = r.get("first200_wps")
        lines.append("| {} | {} | {} | {} | {:.0f} | {} | {} | {:.1f} | {:.1f} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1%} |".format(
            r["arch"], r["max_tokens"], gpus, r["system"], r["wps"], "{:.2f}x".format(r["wps"] / ref) if ref else "-",
            "{:.1%}".format(r["wps"] / (gpus * one)) if gpus > 1 and one else "-",
            r["ups"], r["step_ms"], fmt("first_epoch_wps", "{:.0f}"),
            "{:.0f} ({:.2f}x)".format(first, first / r["wps"]) if first else "-",
            fmt("peak_gib", "{:.1f}"), fmt("kernels_per_step", "{:.0f}"), fmt("kernel_launches_per_step", "{:.0f}"),
            fmt("gpu_ms_per_step", "{:.1f}"),
            fmt("gpu_idle_ms_per_step", "{:.1f}"),
            fmt("host_syncs_per_step", "{:.0f}"),
            fmt("optimizer_ms_per_step", "{:.2f}"), r["mfu"]))
    return "\n".join(lines)


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in results if r.get("gpus", 1) == 1]  # one GPU: the sweep over --max-tokens
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for (arch, system) in sorted({(r["arch"], r["system"]) for r in results}):
        pts = sorted((r["max_tokens"], r) for r in results if r["arch"] == arch and r["system"] == system and "wps" in r)
        base = {r["max_tokens"]: r["wps"] for r in results if r["arch"] == arch and r["system"] == "stock-fp16" and "wps" in r}
        xs = [m for m, _ in pts]
        ax1.plot(xs, [r["wps"] / base[m] if m in base else float("nan") for m, r in pts], marker="o", label="{} {}".format(arch, system))
        ax2.plot(xs, [r.get("peak_gib", float("nan")) for _, r in pts], marker="o", label="{} {}".format(arch, system))
    for ax, title in ((ax1, "speed-up over stock fairseq --fp16"), (ax2, "peak GPU memory (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("--max-tokens")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def tensorboard(results, logdir):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(logdir)
    for r in results:
        if "wps" in r:
            tag = "{}/{}".format(r["arch"], r["system"]) + ("/{}gpus".format(r["gpus"]) if r.get("gpus", 1) > 1 else "")
            writer.add_scalar(tag + "/wps", r["wps"], r["max_tokens"])
            writer.add_scalar(tag + "/peak_gib", r.get("peak_gib", 0.0), r["max_tokens"])
            writer.add_scalar(tag + "/mfu", r["mfu"], r["max_tokens"])
    writer.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="results folder")
    parser.add_argument("--full", action="store_true", help="max-tokens 512..16384, big and base")
    parser.add_argument("--max-tokens", default="4096,8192,16384")
    parser.add_argument("--archs", default="big")
    parser.add_argument("--systems", default="stock-fp16,ls-fp16-master,ls-bf16-master", help=", ".join(SYSTEMS))
    parser.add_argument("--epochs", type=int, default=4,
                        help="the last is profiled, and counts toward the steady state only up to the profile")
    parser.add_argument("--steady-from-epoch", type=int, default=2,
                        help="steady state: the log intervals from this epoch on (those that captured a CUDA graph "
                        "left out). The graphed systems capture a shape at its first batch; fairseq repeats an "
                        "epoch's batches (shuffled), so on one GPU every step of epoch 2 replays (the synthetic data "
                        "at 8,192 tokens: 107 batches per epoch, 66 shapes): use 3. On N GPUs --grouped-shuffling "
                        "gives each rank the same batches every epoch, so the same holds")
    parser.add_argument("--pairs", type=int, default=24000)
    parser.add_argument("--gpus", default="1", help="GPU counts, e.g. 1,2 (data-parallel, --max-tokens per GPU)")
    args = parser.parse_args()
    if not 2 <= args.steady_from_epoch <= args.epochs:
        parser.error("--steady-from-epoch must be at least 2 (after a warm-up epoch) and at most --epochs")
    if args.full:
        args.max_tokens, args.archs = "512,1024,2048,4096,8192,16384", "big,base"
    os.makedirs(args.out, exist_ok=True)
    work = os.path.join(args.out, "runs")
    os.makedirs(work, exist_ok=True)
    data = os.path.join(work, "data-bin")
    if not os.path.exists(os.path.join(data, "train.en-de.de.idx")):
        subprocess.run([sys.executable, os.path.join(HERE, "synthetic.py"), "--out", data, "--pairs", str(args.pairs)], check=True)
    results = []
    points = [(arch, int(m), int(g)) for arch in args.archs.split(",") for m in args.max_tokens.split(",")
              for g in args.gpus.split(",")]
    for arch, max_tokens, gpus in points:
        for system in args.systems.split(","):
            r = run(system, arch, max_tokens, gpus, data, args.epochs, work, args.steady_from_epoch)
            results.append(r)
            print(json.dumps(r), flush=True)
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump(results, f, indent=1)
    md = table(results)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(md + "\n")
    plot(results, os.path.join(args.out, "speedup.png"))
    tensorboard(results, os.path.join(args.out, "tensorboard"))
    print(md)


if __name__ == "__main__":
    main()
