"""Translation speed: fairseq-generate's beam search against ls_fairseq's, on the same weights.

For each architecture, trains an ls_transformer briefly on the embedded corpus (data/lohelp, so
that output lengths are realistic; the recipe's prepare.sh makes the data), converts it to a stock
fairseq transformer (ls_fairseq.convert) and translates the test set with
  stock          fairseq's SequenceGenerator on the stock model: what fairseq-generate runs;
  ls             ls_fairseq.generation.LSSequenceGenerator on the ls model (ls-fp16-eager: without
                 its CUDA graphs of the decoding step);
  fairseq-on-ls  fairseq's SequenceGenerator on the ls model (fairseq-generate on an ls model
                 without this generator),
each in fp16 on a GPU (ls in bf16 too; stock fairseq-generate has no bf16 on GPUs) and fp32 on
the CPU (fairseq-on-ls with --fairseq-on-ls only). Every system is timed the same way: batches as fairseq-generate makes them (the task's
length-sorted batches of --batch-size sentences), from the first batch to the last hypothesis,
the GPU synchronised at both ends, after an untimed pass over the first batches (CUDA's and
cuBLAS's one-time set-up), --repeats times in turn (rates the median, the ratio over stock the median of
each round's ratio, with its range); target tokens counted as fairseq-generate counts them (the best
hypothesis's, EOS included). Per point also BLEU (sacrebleu, detokenized) and the peak GPU memory
of the system as if it were alone on the GPU: its model's weights and the most its translation held
besides (the other systems' copies of the weights, resident for the benchmark, are not counted).
Writes the logs of data preparation and training, results.json (after every point, so an
interrupted run keeps what it measured), results.md (the table, printed last) and speedup.png into
--out (default $OUT, else a new folder under /tmp). Points are measured in the order given; once
--budget seconds have passed since the start, the remaining ones are listed as skipped.

  python scripts/bench_generate.py                # GPU: big then base, the issue's points (one H200: ~9 min)
  python scripts/bench_generate.py --smoke --cpu  # anywhere: a tiny model, small points
  python scripts/bench_generate.py --data-bin D --checkpoint ARCH=CKPT  # no prepare, no training
"""
import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

ARCHS = {"base": "ls_transformer_wmt_en_de", "big": "ls_transformer_vaswani_wmt_en_de_big",
         "tiny": "ls_transformer_tiny"}
# (beam, batch size, sentences), in the order they are measured: the targets' points first
POINTS = [(4, 128, 1000), (4, 1, 200), (4, 32, 1000), (1, 128, 1000), (5, 128, 1000)]
SMOKE_POINTS = [(4, 8, 24), (1, 8, 24)]
START = time.perf_counter()
TRAIN = [
    "--share-all-embeddings", "--criterion", "ls_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--optimizer", "ls_adam", "--adam-betas", "(0.9,0.98)", "--lr-scheduler", "inverse_sqrt", "--clip-norm", "1.0",
    "--disable-validation", "--no-epoch-checkpoints", "--save-interval", "1000000",
    "--log-format", "simple", "--log-interval", "100", "--seed", "1", "--num-workers", "0",
]
# learning rate, warm-up and dropout per architecture: base has the main job's (scripts/run_example.sh), big
# the same at half the rate (post-LN transformer-big does not train at base's rate in so few updates, and an
# untrained model's hypotheses all run to the maximum length), tiny the CPU smoke test's
SCHEDULE = {"base": ("1e-3", "1000", "0.3"), "big": ("5e-4", "1000", "0.3"), "tiny": ("1e-3", "300", "0.1")}
LENPEN = 0.6


def logged(cmd, log_path):
    """Run ``cmd`` with its output in ``log_path``; on failure, the log's end on stderr and the error."""
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        with open(log_path) as log:
            sys.stderr.write(log.read()[-3000:])
        raise subprocess.CalledProcessError(proc.returncode, cmd)


def prepare(out, vocab):
    work = os.path.join(out, "data-{}".format(vocab))
    if not os.path.isdir(os.path.join(work, "data-bin")):
        logged(["bash", os.path.join(REPO, "recipes", "wmt14_en_de", "prepare.sh"), "--from",
                os.path.join(REPO, "data", "lohelp"), "--work", work, "--vocab-size", str(vocab), "--ratio", "2.5"],
               os.path.join(out, "prepare.log"))
    return os.path.join(work, "data-bin")


def train(out, data_bin, arch, updates, cuda):
    save = os.path.join(out, "ckpt-" + arch)
    path = os.path.join(save, "checkpoint_last.pt")
    if not os.path.isfile(path):
        device = ["--fp16", "--max-tokens", "8192"] if cuda else ["--cpu", "--max-tokens", "2048"]
        cmd = [sys.executable, "-m", "fairseq_cli.train", data_bin, "--user-dir", os.path.join(REPO, "ls_fairseq"),
               "--arch", ARCHS[arch], "--max-update", str(updates), "--save-dir", save] + TRAIN + device
        lr, warmup, dropout = SCHEDULE[arch]
        cmd += ["--lr", lr, "--warmup-updates", warmup, "--dropout", dropout]
        logged(cmd, os.path.join(out, "train-{}.log".format(arch)))
    return path


def to_stock(ls_path):
    """The stock fairseq checkpoint of the same weights, next to the ls one."""
    import torch

    from ls_fairseq.convert import convert, save_atomic

    path = ls_path[: -len(".pt")] + ".stock.pt"
    if not os.path.isfile(path):
        save_atomic(convert(torch.load(ls_path, map_location="cpu", weights_only=True), to_ls=False), path)
    return path


def batches(task, model, sentences, batch_size):
    """fairseq-generate's batches (length-sorted, --batch-size sentences) of the test set's first ``sentences``."""
    import numpy as np

    dataset = task.dataset("test")
    order = dataset.ordered_indices()
    indices = np.asarray(order[order < sentences], dtype=np.int64)
    groups = dataset.batch_by_size(indices, max_sentences=batch_size)
    return [dataset.collater([dataset[i] for i in group]) for group in groups]


def move(sample, device):
    if isinstance(sample, dict):
        return {k: move(v, device) for k, v in sample.items()}
    return sample.to(device) if hasattr(sample, "to") else sample


def synchronize(device):
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def time_system(generator, model, task, samples, device):
    """(seconds, sentences, target tokens, BLEU, peak MiB) of translating ``samples``."""
    import gc

    import sacrebleu
    import torch

    others = 0
    if device == "cuda":
        # memory that is not this system's, taken before its warm-up (whose buffers are its own): the
        # other systems' weights (the collection frees an earlier generator held by a reference cycle).
        # cuBLAS's workspaces (one per stream that ran a GEMM, ~33 MiB each on an H200) are released
        # first, so each system pays for those of the streams it uses, as if alone in the process
        gc.collect()
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        others = torch.cuda.memory_allocated() - sum(p.numel() * p.element_size() for p in model.parameters())
    for sample in samples[:2]:  # untimed: one-time set-up
        task.inference_step(generator, [model], move(sample, device))
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    synchronize(device)
    start = time.perf_counter()
    results, tokens = [], 0
    for sample in samples:
        hypos = task.inference_step(generator, [model], move(sample, device))
        tokens += sum(len(h[0]["tokens"]) for h in hypos)
        results.append((sample, hypos))
    synchronize(device)
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() - others) / 2**20 if device == "cuda" else 0.0
    d = task.target_dictionary
    hyps, refs = [], []
    for sample, hypos in results:
        for target, h in zip(sample["target"], hypos):
            refs.append(d.string(target[target.ne(d.pad())], "sentencepiece"))
            hyps.append(d.string(h[0]["tokens"].cpu(), "sentencepiece"))
    return seconds, len(hyps), tokens, sacrebleu.corpus_bleu(hyps, [refs]).score, peak


def systems(cuda, fairseq_on_ls):
    """(name, which model: 'stock' or 'ls', generator: 'ls', 'ls-eager' (no CUDA graphs) or 'fairseq', dtype
    name), stock first"""
    if not cuda:
        found = [("stock-fp32", "stock", "fairseq", "float32"), ("ls-fp32", "ls", "ls", "float32")]
        return found + ([("fairseq-on-ls-fp32", "ls", "fairseq", "float32")] if fairseq_on_ls else [])
    found = [("stock-fp16", "stock", "fairseq", "float16"), ("ls-fp16", "ls", "ls", "float16"),
             ("ls-bf16", "ls", "ls", "bfloat16"), ("ls-fp16-eager", "ls", "ls-eager", "float16")]
    return found + ([("fairseq-on-ls-fp16", "ls", "fairseq", "float16")] if fairseq_on_ls else [])


def chosen_systems(cuda, fairseq_on_ls, wanted):
    """systems(), only those named in ``wanted`` (a comma-separated list; None: all). The stock system
    stays first, as the one the others are measured against."""
    found = systems(cuda, fairseq_on_ls)
    if wanted is None:
        return found
    names = wanted.split(",")
    known = [f[0] for f in found]
    unknown = [n for n in names if n not in known]
    if unknown or known[0] not in names:
        raise SystemExit("bench_generate: --systems {!r}: choose among {} and include {} (the others are measured "
                         "against it)".format(wanted, ", ".join(known), known[0]))
    return [f for f in found if f[0] in names]


def bench_arch(arch, ls_path, data_bin, points, cuda, names, budget, rows, out, compact_fraction, repeats=1):
    import torch
    from fairseq import checkpoint_utils
    from fairseq.sequence_generator import SequenceGenerator

    from ls_fairseq.generation import LSSequenceGenerator

    device = "cuda" if cuda else "cpu"
    paths = {"ls": ls_path, "stock": to_stock(ls_path)}
    loaded = {name: checkpoint_utils.load_model_ensemble_and_task([p], arg_overrides={"data": data_bin})
              for name, p in paths.items()}
    task = loaded["ls"][2]
    task.load_dataset("test")
    # each system its own copy of the fp32 weights in its dtype (converting one model from dtype to dtype
    # would round fp16 weights through bf16)
    models = {name: copy.deepcopy(loaded[which][0][0]).to(device=device, dtype=getattr(torch, dtype)).eval()
              for name, which, _, dtype in names}
    found = []
    for beam, batch_size, sentences in points:  # every system at a point before the next point
        if time.perf_counter() - START > budget:
            print("bench_generate: {} beam {} batch {} skipped (--budget {} s passed)".format(
                arch, beam, batch_size, budget), file=sys.stderr)
            found.append(dict(arch=arch, system="skipped", beam=beam, batch=batch_size))
            continue
        timed = {name: [] for name, _, _, _ in names}  # per system: (seconds, sentences, tokens, BLEU, peak) a run
        for _ in range(repeats):  # the systems in turn, so that a change in the machine's speed meets them all
            for name, _, gen, _ in names:
                model = models[name]
                if gen == "fairseq":
                    generator = SequenceGenerator([model], task.target_dictionary, beam_size=beam, len_penalty=LENPEN)
                else:
                    generator = LSSequenceGenerator([model], task.target_dictionary, beam_size=beam,
                                                    len_penalty=LENPEN, cuda_graphs=gen == "ls",
                                                    compact_fraction=compact_fraction)
                timed[name].append(time_system(generator, model, task, batches(task, model, sentences, batch_size),
                                               device))
        stock = timed[names[0][0]]
        if stock[0][3] < 1:
            print("bench_generate: {} scores BLEU {:.2f}: not trained enough, so its hypotheses have no realistic "
                  "lengths (more --max-update)".format(arch, stock[0][3]), file=sys.stderr, flush=True)
        for name, _, _, _ in names:
            runs = timed[name]
            seconds = statistics.median(r[0] for r in runs)
            n, tokens, score = runs[0][1:4]
            # each run's rate over stock's in the same round, then the median of those
            ratios = sorted((r[2] / r[0]) / (st[2] / st[0]) for r, st in zip(runs, stock))
            row = dict(arch=arch, system=name, beam=beam, batch=batch_size, sentences=n, seconds=round(seconds, 3),
                       sentences_per_s=round(n / seconds, 2), tokens_per_s=round(tokens / seconds, 1),
                       bleu=round(score, 2), peak_mib=round(max(r[4] for r in runs), 1),
                       speedup=round(statistics.median(ratios), 2), runs=len(runs),
                       speedup_range=[round(ratios[0], 2), round(ratios[-1], 2)])
            print(json.dumps(row), flush=True)
            found.append(row)
            with open(os.path.join(out, "results.json"), "w") as f:
                json.dump(rows + found, f, indent=1)
    return found


def table(rows):
    lines = ["| arch | beam | batch | sentences | system | sentences/s | target tokens/s | over stock | BLEU | peak MiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["system"] == "skipped":
            lines.append("| {arch} | {beam} | {batch} | - | skipped (--budget) | - | - | - | - | - |".format(**r))
            continue
        spread = " ({}-{}, {} runs)".format(*r["speedup_range"], r["runs"]) if r.get("runs", 1) > 1 else ""
        lines.append("| {arch} | {beam} | {batch} | {sentences} | {system} | {sentences_per_s} | {tokens_per_s} | "
                     "{speedup}x{spread} | {bleu} | {peak_mib} |".format(spread=spread, **r))
    return "\n".join(lines)


def plot(rows, path):
    """speedup.png, where matplotlib is installed (it is not among the requirements)."""
    try:
        import matplotlib
    except ImportError:
        print("bench_generate: no matplotlib, so no {}".format(path), file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["system"] != "skipped"]
    names = sorted({r["system"] for r in rows})
    points = sorted({(r["arch"], r["beam"], r["batch"]) for r in rows})
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(points)), 4))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        speed = {(r["arch"], r["beam"], r["batch"]): r["speedup"] for r in rows if r["system"] == name}
        ax.bar([i + j * width for i in range(len(points))], [speed.get(p, 0) for p in points], width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(points))])
    ax.set_xticklabels(["{} beam {}\nbatch {}".format(*p) for p in points], fontsize=8)
    ax.set_ylabel("target tokens/s over stock")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_points(text):
    """'4:128:1000,4:1:200' -> [(4, 128, 1000), (4, 1, 200)] (beam:batch:sentences)."""
    try:
        points = [tuple(int(v) for v in p.split(":")) for p in text.split(",") if p]
    except ValueError:
        points = []
    if not points or any(len(p) != 3 or min(p) < 1 for p in points):
        raise argparse.ArgumentTypeError("--points: BEAM:BATCH:SENTENCES[,...] of positive integers, got {!r}".format(text))
    return points


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT"),
                        help="folder for the logs, data, checkpoints and results (default $OUT, else a new /tmp folder)")
    parser.add_argument("--archs", default="big,base",
                        help="comma-separated, in the order measured: big, base, tiny (big first: the targets are "
                             "on it, and --budget skips what comes last)")
    parser.add_argument("--max-update", type=int, default=2500, help="training updates per architecture")
    parser.add_argument("--points", type=parse_points, help="BEAM:BATCH:SENTENCES,... in the order measured "
                        "(default {})".format(",".join("{}:{}:{}".format(*p) for p in POINTS)))
    parser.add_argument("--budget", type=float, default=540,
                        help="seconds from the start after which the remaining points are skipped")
    parser.add_argument("--fairseq-on-ls", action="store_true",
                        help="also time fairseq's generator on the ls model")
    parser.add_argument("--vocab-size", type=int, default=8000, help="SentencePiece vocabulary of the data")
    parser.add_argument("--data-bin", help="a prepared data-bin of the embedded corpus (skips prepare.sh)")
    parser.add_argument("--checkpoint", action="append", default=[],
                        help="ARCH=PATH: an ls checkpoint to benchmark instead of training one (repeatable)")
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny architecture, 50 updates, a 1,000-piece vocabulary and small points")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even where a GPU is")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed runs of every system at each point, in turn: rates are medians, the ratio over "
                             "stock the median of the runs' ratios (with their range)")
    parser.add_argument("--systems", help="comma-separated: only these systems (the stock one among them; default all)")
    parser.add_argument("--compact-fraction", type=float, default=None,
                        help="the ls generator's: fraction of a batch's sentences done before they leave it "
                             "(default the generator's; above 1: never)")
    args = parser.parse_args(argv)
    import torch

    import ls_fairseq.fairseq_plugin  # noqa: F401 (the plugin: model, checkpoint types)

    cuda = torch.cuda.is_available() and not args.cpu
    names = chosen_systems(cuda, args.fairseq_on_ls, args.systems)
    if args.repeats < 1:
        parser.error("--repeats {}: at least 1".format(args.repeats))
    args.out = args.out or tempfile.mkdtemp(prefix="bench_generate.")
    os.makedirs(args.out, exist_ok=True)
    print("bench_generate: logs and results in {}".format(args.out), flush=True)
    archs = ["tiny"] if args.smoke else args.archs.split(",")
    given = dict(c.split("=", 1) for c in args.checkpoint)
    data_bin = args.data_bin or prepare(args.out, 1000 if args.smoke else args.vocab_size)
    points = args.points or (SMOKE_POINTS if args.smoke else POINTS)
    rows = []
    for arch in archs:
        path = given.get(arch) or train(args.out, data_bin, arch, 50 if args.smoke else args.max_update, cuda)
        rows += bench_arch(arch, path, data_bin, points, cuda, names, args.budget, rows, args.out, args.compact_fraction,
                           args.repeats)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table(rows) + "\n")
    if any(r["system"] != "skipped" for r in rows):
        plot(rows, os.path.join(args.out, "speedup.png"))
    print(table(rows))


if __name__ == "__main__":
    main()
