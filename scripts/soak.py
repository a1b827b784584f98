"""A long training run through ls-fairseq-train, watched for memory growth, speed drift and NaN.

Trains transformer-big (``ls_transformer_vaswani_wmt_en_de_big``) at --max-tokens 8192, fp16,
--ls-cuda-graphs on synthetic binarized data with WMT14-like lengths
(recipes/wmt14_en_de/synthetic.py; 200,000 pairs with --required-seq-len-multiple 4 give about 800
batches an epoch in about 170 distinct (sentences, source length, target length) shapes, each
captured as a graph in the first epoch). The training is ls_fairseq.train's (fairseq-train's main
with the plugin's trainer) in a child process, with hooks on the trainer that record, every
--report-every updates and at each epoch's end: torch.cuda.memory_reserved/allocated, words (target
tokens) per second over the interval, the captured graphs, the distinct batch shapes seen, the
steps skipped for inf/NaN gradients and the count of non-finite losses. It stops at --updates or
when its training time reaches --budget-s (fairseq's --stop-time-hours), with the figures so far.

At the end it prints: reserved memory's growth after the first epoch (target < 2%), each steady
stretch of --report-every updates' wps against their median (target within 5%; stretches in the
first epoch or in which a graph was captured are left out), non-finite losses, and the number of
captured graphs. ``--summarize RECORDS`` prints the summary of a finished run's records.jsonl again.

  python3 scripts/soak.py                              # on the GPU: 20,000 updates, ~7-8 min
  python3 scripts/soak.py --cpu --updates 12           # a smoke test: tiny model, a few updates

Writes $OUT/soak/{records.jsonl,train.log,summary.json} ($OUT defaults to a temporary folder);
exits 1 when a target is missed or the training fails.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYNTHETIC = os.path.join(REPO, "recipes", "wmt14_en_de", "synthetic.py")


def training_command(args, data, records):
    """ls-fairseq-train's arguments (after the program name) for the soak."""
    cmd = [data, "--arch", args.arch, "--share-all-embeddings", "--criterion", "ls_label_smoothed_cross_entropy",
           "--label-smoothing", "0.1", "--optimizer", "ls_adam", "--adam-betas", "(0.9,0.98)", "--lr", "5e-4",
           "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4000", "--dropout", "0.3",
           "--max-tokens", str(args.max_tokens), "--max-update", str(args.updates),
           "--stop-time-hours", repr(args.budget_s / 3600.0), "--required-seq-len-multiple", str(args.seq_len_multiple),
           "--no-save", "--disable-validation", "--log-format", "simple", "--log-interval", str(args.log_interval),
           "--num-workers", "2", "--seed", str(args.seed)]
    if args.cpu:
        cmd += ["--cpu", "--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "32",
                "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
                "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]
    else:
        cmd += ["--fp16", "--ls-cuda-graphs"]
    return cmd


# ------------------------------------------------------------------------------- the child process


def install_hooks(records_path, report_every):
    """Wraps LSTrainer.train_step and lr_step (the end of an epoch) and the criterion's
    logging_outputs (every step's loss, eager or replayed) to record the soak's figures. Nothing
    here reads the GPU inside a step: the losses are summed on the device, read at a report."""
    import torch

    from ls_fairseq.criterions.ls_label_smoothed_cross_entropy import LSLabelSmoothedCrossEntropyCriterion
    from ls_fairseq.cuda_graphs import GraphedTrainStep
    from ls_fairseq.trainer import LSTrainer

    state = dict(tokens=0, shapes=set(), epoch_shapes=None, t=None, nonfinite=None, skipped=None, epoch=1,
                 graphs_at_last=0, steps=0)
    out = open(records_path, "a", buffering=1)

    logging_outputs = LSLabelSmoothedCrossEntropyCriterion.logging_outputs

    def counting_logging_outputs(self, model, sample, loss, nll_loss):
        bad = (~torch.isfinite(loss.detach().float())).sum()
        state["nonfinite"] = bad if state["nonfinite"] is None else state["nonfinite"] + bad
        return logging_outputs(self, model, sample, loss, nll_loss)

    LSLabelSmoothedCrossEntropyCriterion.logging_outputs = counting_logging_outputs

    def graphs(trainer):
        step = trainer.task.train_step
        return len(step.graphs) if isinstance(step, GraphedTrainStep) else 0

    def sync(trainer):
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()

    def record(trainer, kind):
        sync(trainer)
        now = time.monotonic()
        cuda = trainer.device.type == "cuda"
        n = graphs(trainer)
        rec = dict(kind=kind, update=trainer.get_num_updates(), epoch=state["epoch"], time=now,
                   seconds=now - state["t"], tokens=state["tokens"], steps=state["steps"],
                   wps=state["tokens"] / max(now - state["t"], 1e-9),
                   reserved=torch.cuda.memory_reserved() if cuda else 0,
                   allocated=torch.cuda.memory_allocated() if cuda else 0,
                   graphs=n, captured_in_interval=n - state["graphs_at_last"], shapes=len(state["shapes"]),
                   nonfinite_losses=int(state["nonfinite"].item()) if state["nonfinite"] is not None else 0,
                   skipped_steps=int(state["skipped"].item()) if torch.is_tensor(state["skipped"]) else 0)
        out.write(json.dumps(rec) + "\n")
        state.update(t=time.monotonic(), tokens=0, steps=0, graphs_at_last=n)

    train_step = LSTrainer.train_step

    def watched_train_step(self, samples, raise_oom=False):
        if state["t"] is None:
            sync(self)
            state["t"] = time.monotonic()
        for sample in samples:
            if sample:
                state["tokens"] += int(sample["ntokens"])
                state["shapes"].add((tuple(sample["net_input"]["src_tokens"].shape), tuple(sample["target"].shape)))
        result = train_step(self, samples, raise_oom)
        state["steps"] += 1
        state["trainer"] = self
        overflow = getattr(self.optimizer, "overflow", None)
        if torch.is_tensor(overflow):
            overflow = overflow.detach().float().sum()
            state["skipped"] = overflow if state["skipped"] is None else state["skipped"] + overflow
        if self.get_num_updates() % report_every == 0:
            record(self, "interval")
        return result

    LSTrainer.train_step = watched_train_step

    lr_step = LSTrainer.lr_step

    def watched_lr_step(self, epoch, val_loss=None):
        # fairseq calls it once before training (loading the checkpoint), then at each epoch's end
        if state["t"] is not None:
            if state["steps"]:
                record(self, "epoch_end")
            else:  # the epoch ended on a report: the memory figures of its end
                cuda = self.device.type == "cuda"
                out.write(json.dumps(dict(kind="epoch_end", update=self.get_num_updates(), epoch=state["epoch"],
                                          reserved=torch.cuda.memory_reserved() if cuda else 0,
                                          allocated=torch.cuda.memory_allocated() if cuda else 0,
                                          graphs=graphs(self), shapes=len(state["shapes"]))) + "\n")
            state["epoch"] = epoch + 1
        return lr_step(self, epoch, val_loss)

    LSTrainer.lr_step = watched_lr_step

    def finish():
        """The last, partial interval (fairseq stops inside an epoch without ending it)."""
        if state["steps"]:
            record(state["trainer"], "final")

    return finish


def worker(argv, records, report_every):
    finish = install_hooks(records, report_every)
    from ls_fairseq import train

    sys.argv = ["ls-fairseq-train"] + argv
    train.cli_main()
    finish()


# ------------------------------------------------------------------------------- the parent process


def windows(records):
    """wps over each stretch of --report-every updates, from one "interval" record to the next: the
    tokens and seconds of every record in between added up (an epoch's end starts a new count, so
    with epochs shorter than the stretch no single record spans it), with the epoch it ends in and
    the graphs captured in it."""
    out, tokens, seconds, captured, start = [], 0, 0.0, 0, None
    for r in records:
        tokens, seconds = tokens + r.get("tokens", 0), seconds + r.get("seconds", 0.0)
        captured += r.get("captured_in_interval", 0)
        if r["kind"] == "interval":
            if start is not None and seconds > 0:
                out.append(dict(start=start, update=r["update"], epoch=r["epoch"], wps=tokens / seconds,
                                captured=captured))
            tokens, seconds, captured, start = 0, 0.0, 0, r["update"]
    return out


def summarize(records, args):
    ends = [r for r in records if r["kind"] == "epoch_end"]
    every = [r for r in records if "reserved" in r]
    last = every[-1] if every else None
    s = dict(updates=last["update"] if last else 0, epochs_done=len(ends), graphs=last["graphs"] if last else 0,
             distinct_shapes=last["shapes"] if last else 0,
             nonfinite_losses=max([r.get("nonfinite_losses", 0) for r in records] or [0]),
             skipped_steps=max([r.get("skipped_steps", 0) for r in records] or [0]))
    if ends:
        first = ends[0]
        later = [r for r in every if r["update"] > first["update"]]
        s["reserved_after_epoch1_gib"] = first["reserved"] / 2**30
        s["shapes_in_epoch1"] = first["shapes"]
        if later and first["reserved"]:
            peak = max(r["reserved"] for r in later)
            s["reserved_max_later_gib"] = peak / 2**30
            s["reserved_growth"] = peak / first["reserved"] - 1
            s["allocated_growth"] = (max(r["allocated"] for r in later) / first["allocated"] - 1
                                     if first["allocated"] else None)
    steady = [w for w in windows(records) if w["epoch"] > 1 and w["captured"] == 0]
    if steady:
        median = statistics.median(r["wps"] for r in steady)
        s["wps_median"] = median
        s["wps_steady_stretches"] = len(steady)
        s["wps_worst_deviation"] = max(abs(r["wps"] / median - 1) for r in steady)
    checks = dict(
        reserved_growth_below_2pct=s.get("reserved_growth") is not None and s["reserved_growth"] < 0.02,
        wps_within_5pct_of_median=s.get("wps_worst_deviation") is not None and s["wps_worst_deviation"] <= 0.05,
        no_nonfinite_loss=s["nonfinite_losses"] == 0,
        distinct_shapes_at_least_150=s["distinct_shapes"] >= 150,
    )
    if args.cpu:  # the smoke run has no GPU memory, no graphs and a handful of shapes
        checks = dict(no_nonfinite_loss=checks["no_nonfinite_loss"], trained=s["updates"] > 0)
    s["checks"] = checks
    return s


def report(records, s):
    """Print the records' table and the summary ``s``; 1 when a target is missed or training failed."""
    # wps: over the stretch since the previous row (the first row and the last, partial one: their own)
    stretch = {w["update"]: w["wps"] for w in windows(records)}
    print("\n{:>7} {:>5} {:>9} {:>9} {:>9} {:>6} {:>6} {:>8} {:>8}".format(
        "update", "epoch", "wps", "reserved", "alloc", "graphs", "shapes", "nonfin", "skipped"))
    for r in records:
        if r["kind"] in ("interval", "final"):
            own = r.get("wps", float("nan"))
            wps = stretch.get(r["update"], own) if r["kind"] == "interval" else own
            print("{:>7} {:>5} {:>9.0f} {:>8.2f}G {:>8.2f}G {:>6} {:>6} {:>8} {:>8}".format(
                r["update"], r["epoch"], wps, r["reserved"] / 2**30, r["allocated"] / 2**30,
                r["graphs"], r["shapes"], r.get("nonfinite_losses", "-"), r.get("skipped_steps", "-")))

    def pct(key):
        return "{:+.2f}%".format(100 * s[key]) if s.get(key) is not None else "n/a"

    print("\nsoak: {} updates, {} epochs done in {}s (rc {})".format(s["updates"], s["epochs_done"],
                                                                     s.get("wall_s", "?"), s.get("rc", "?")))
    print("reserved memory growth after the first epoch: {} (target < 2%; after epoch 1 {:.2f} GiB)".format(
        pct("reserved_growth"), s.get("reserved_after_epoch1_gib", float("nan"))))
    print("wps median {:.0f} over {} steady stretches, worst deviation {} (target within 5%)".format(
        s.get("wps_median", float("nan")), s.get("wps_steady_stretches", 0),
        "{:.2f}%".format(100 * s["wps_worst_deviation"]) if "wps_worst_deviation" in s else "n/a"))
    print("non-finite losses {}, skipped steps (inf/NaN gradients) {}".format(s["nonfinite_losses"],
                                                                             s["skipped_steps"]))
    print("captured graphs {}, distinct batch shapes {}".format(s["graphs"], s["distinct_shapes"]))
    print("checks: " + ", ".join("{} {}".format(k, "ok" if v else "MISSED") for k, v in s["checks"].items()))
    failed = s.get("rc", 0) != 0 or not all(s["checks"].values()) or math.isnan(s.get("wps_median", 0.0))
    return 1 if failed else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=20000)
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="training time (fairseq's --stop-time-hours) after which the run stops with its figures")
    parser.add_argument("--report-every", type=int, default=1000, help="updates between records")
    parser.add_argument("--arch", default="ls_transformer_vaswani_wmt_en_de_big")
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--pairs", type=int, default=200000, help="synthetic sentence pairs (WMT14-like lengths)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-len-multiple", type=int, default=4, help="--required-seq-len-multiple")
    parser.add_argument("--log-interval", type=int, default=500)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--data", default=None, help="a binarized data-bin to use instead of the synthetic one")
    parser.add_argument("--cpu", action="store_true",
                        help="smoke test: a tiny model on the CPU, 300 pairs of 200 words, no fp16 or graphs")
    parser.add_argument("--out", default=None, help="folder for the logs (default $OUT/soak)")
    parser.add_argument("--summarize", metavar="RECORDS", help="no training: the summary of a run's records.jsonl")
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.summarize:
        with open(args.summarize) as f:
            records = [json.loads(line) for line in f if line.strip()]
        return report(records, summarize(records, args))
    out = args.out or os.path.join(os.environ.get("OUT") or tempfile.mkdtemp(prefix="soak_"), "soak")
    records_path = os.path.join(out, "records.jsonl")
    if args.worker is not None:
        return worker(args.worker, records_path, args.report_every)
    if args.cpu:
        args.arch = "ls_transformer" if args.arch == parser.get_default("arch") else args.arch
        if args.pairs == parser.get_default("pairs"):
            args.pairs, args.vocab = 300, 200
        args.max_tokens = min(args.max_tokens, 512)
    os.makedirs(out, exist_ok=True)
    if os.path.exists(records_path):
        os.remove(records_path)
    start = time.monotonic()
    data = args.data
    if data is None:
        data = os.path.join(out, "data-bin")
        if not os.path.exists(os.path.join(data, "train.en-de.de.idx")):
            subprocess.run([sys.executable, SYNTHETIC, "--out", data, "--pairs", str(args.pairs), "--vocab",
                            str(args.vocab), "--seed", str(args.seed)], check=True, stdout=subprocess.DEVNULL)
    prepared = time.monotonic() - start
    cmd = [sys.executable, os.path.abspath(__file__), "--report-every", str(args.report_every), "--out", out,
           "--worker"] + training_command(args, data, records_path)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    print("soak: data ready in {:.0f}s; training: {}".format(prepared, " ".join(cmd[cmd.index("--worker") + 1:])),
          flush=True)
    # the budget is training time; start-up, the first epoch's captures and the exit come on top
    limit = args.budget_s + 150
    with open(os.path.join(out, "train.log"), "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = "timed out after {:.0f}s".format(limit)
    records = []
    if os.path.exists(records_path):
        with open(records_path) as f:
            records = [json.loads(line) for line in f if line.strip()]
    s = summarize(records, args)
    s.update(rc=rc, wall_s=round(time.monotonic() - start, 1), prepare_s=round(prepared, 1), arch=args.arch,
             max_tokens=args.max_tokens, pairs=args.pairs, seq_len_multiple=args.seq_len_multiple)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(s, f, indent=1)
    if rc != 0:
        with open(os.path.join(out, "train.log")) as f:
            print("soak: training failed ({}); the log's end:\n{}".format(rc, "".join(f.readlines()[-30:])))
    return report(records, s)


if __name__ == "__main__":
    sys.exit(main())
