"""Parity of ls_fairseq with stock fairseq on real text: same weights, same data, same seed.

1. prepares the embedded corpus (recipes/wmt14_en_de/prepare.sh --from data/lohelp);
2. takes a stock model's initial weights (one stock update at a negligible learning
   rate) and converts them with `python -m ls_fairseq.convert from-fairseq`;
3. trains stock `transformer_wmt_en_de` (fairseq-train --fp16 on a GPU, fp32 on CPU),
   on a GPU first with ls_fairseq's dropout masks (parity_ls_masks: each of its dropouts
   draws the mask the kernels draw at that point of the update), then with its own, and
   with other ones (parity_hooks: the noise floor, how far two runs of one model drift
   apart through dropout alone), and `ls_transformer_wmt_en_de` in each --systems
   precision (ls-fairseq-train) from those weights (optimizer, scheduler, meters and data
   order reset) with dropout on; on a GPU the runs share it, all at once;
4. compares each run with the first stock one (on a GPU the one with ls_fairseq's masks,
   so that an ls run differs from it only by arithmetic): per-interval training losses
   from --compare-from on, final validation losses, BLEU of fairseq-generate on the
   1,200-sentence test set; and the losses of the first --first-steps updates (logged
   every update) with dropout off and, on a GPU, with dropout on: against the run with
   ls_fairseq's masks those agree to rounding only if the masks line up.

  python scripts/parity.py --out DIR [--updates 3000] [--systems ls-fp16-master,ls-bf16-master,...] [-- fairseq-train options]
  python scripts/parity.py --out DIR --rescore    # BLEU of DIR's hypotheses, where sacrebleu is installed

--data DIR reuses a corpus prepared before (prepare.sh skips finished steps), for
machines without sentencepiece; without sacrebleu the hypotheses are kept and
BLEU is left for --rescore.

Systems: ls-fp16 (--memory-efficient-fp16: no master weights, stochastic rounding),
ls-fp16-master (--fp16: fp32 master weights inside ls_adam), ls-fp16-rtn (no master,
--ls-round-to-nearest), ls-bf16, ls-bf16-master, ls-bf16-rtn likewise, ls-fp32.
Bounds (the fused layers issue): losses within 1% from update 200 on, final validation
loss within 1%, BLEU within 0.3. Prints a table and writes DIR/parity.json.

  python scripts/parity.py --out DIR --seeds 1,2,3 [--systems ls-bf16-fp8] [--updates 3000]

runs issue 35's convergence protocol instead: for each seed, stock (--fp16 on a GPU) and each
system from that seed's own initial weights, with that seed's data order and dropout (no shared
masks, no first-steps check). Each run's result is kept as DIR/NAME-sSEED.result.json and reused,
so the seeds may be split over several calls into one DIR; every call reports all the runs DIR
holds, against one-sided bounds (better is never a failure), S being stock's seed-to-seed range:
a system's mean final validation loss at most stock's mean + max(1% of it, S); its mean BLEU at
least stock's mean - max(0.5, stock's BLEU range); its mean training loss at each interval from
--compare-from on at most stock's mean + stock's largest seed-to-seed gap at that interval.
Writes DIR/seeds.md and DIR/seeds.json.
"""
import argparse
import json
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY = {name: [sys.executable, "-m", module] for name, module in (
    ("fairseq-train", "fairseq_cli.train"), ("ls-fairseq-train", "ls_fairseq.train"),
    ("fairseq-generate", "fairseq_cli.generate"))}
PRECISION = {
    "ls-fp16": ["--memory-efficient-fp16"],
    "ls-fp16-master": ["--fp16"],
    "ls-bf16": ["--memory-efficient-bf16"],
    "ls-bf16-master": ["--bf16"],
    "ls-fp16-rtn": ["--memory-efficient-fp16", "--ls-round-to-nearest"],
    "ls-bf16-rtn": ["--memory-efficient-bf16", "--ls-round-to-nearest"],
    "ls-fp32": [],
    # lengths to multiples of 8, so that every batch's token count fits the FP8 GEMM (a multiple of 16)
    "ls-bf16-fp8": ["--bf16", "--ls-fp8", "--required-seq-len-multiple", "8"],
    "ls-fp16-fp8": ["--fp16", "--ls-fp8", "--required-seq-len-multiple", "8"],
    # the output projection (the logits) kept in bf16, as FP8 recipes commonly keep a model's last layer
    "ls-bf16-fp8-novocab": ["--bf16", "--ls-fp8", "--ls-fp8-forward", "qkv,kv", "--required-seq-len-multiple", "8"],
    # the default FP8 GEMMs split in two, to tell which costs convergence: the forwards alone, fc2's dgrad alone
    "ls-bf16-fp8-fwd": ["--bf16", "--ls-fp8", "--ls-fp8-dgrad", ",", "--required-seq-len-multiple", "8"],
    "ls-bf16-fp8-dgrad": ["--bf16", "--ls-fp8", "--ls-fp8-forward", ",", "--required-seq-len-multiple", "8"],
    # ls --bf16 on the FP8 systems' batches: the control that tells FP8's arithmetic from the padding's
    "ls-bf16-pad8": ["--bf16", "--required-seq-len-multiple", "8"],
}


def start(cmd, log):
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [REPO, os.environ.get("PYTHONPATH")]))))


def finish(proc, log):
    proc.wait()
    text = open(log).read()
    if proc.returncode != 0:
        raise SystemExit("parity: {} failed, see {}:\n{}".format(proc.args[0], log, text[-2000:]))
    return text


def sh(cmd, log):
    return finish(start(cmd, log), log)


def losses(log):
    return {int(u): float(loss) for loss, u in re.findall(r"train_inner \|.*? loss=([\d.]+),.*?num_updates=(\d+)", log)}


def valid_loss(log):
    found = re.findall(r"valid on 'valid' subset \| loss ([\d.]+)", log)
    return float(found[-1]) if found else None


def start_generate(out, data, checkpoint, name, device, user_dir):
    cmd = ENTRY["fairseq-generate"] + [data + "/data-bin", "--path", checkpoint, "--gen-subset", "test", "--beam", "4",
                                       "--lenpen", "0.6", "--batch-size", "128", "--remove-bpe", "sentencepiece",
                                       "--scoring", "sacrebleu"] + device + user_dir
    log = os.path.join(out, name + ".generate.log")
    return start(cmd, log), log


def keep_hypotheses(out, name, proc, log):
    gen = finish(proc, log)
    hyps = sorted((int(i), h) for i, _, h in re.findall(r"^H-(\d+)\t([^\t]*)\t(.*)$", gen, re.M))
    with open(os.path.join(out, name + ".hyp"), "w") as f:
        f.write("".join(h + "\n" for _, h in hyps))


def bleu(out, data, name):
    """sacrebleu of OUT/NAME.hyp against the raw test text; None where sacrebleu is not installed."""
    try:
        import sacrebleu
    except ImportError:
        return None
    with open(os.path.join(out, name + ".hyp")) as f, open(os.path.join(data, "raw", "test.de")) as r:
        return round(sacrebleu.corpus_bleu(f.read().splitlines(), [r.read().splitlines()]).score, 2)


def rel(a, b):
    return abs(b - a) / abs(a)


def last_quarter(losses):
    """Mean training loss over the intervals of the last quarter of the updates (nan without any)."""
    if not losses:
        return float("nan")
    end = max(losses)
    tail = [v for u, v in losses.items() if u > 0.75 * end]
    return sum(tail) / len(tail)


def run_options(gpu):
    """(common options of every run, stock's, ls's)."""
    common = ["--share-all-embeddings", "--adam-betas", "(0.9,0.98)", "--lr-scheduler", "inverse_sqrt",
              "--warmup-updates", "1000", "--label-smoothing", "0.1", "--max-tokens", "8192",
              "--log-format", "simple", "--seed", "1", "--no-epoch-checkpoints", "--no-progress-bar",
              # validate and save once, at the end
              "--validate-interval", "100000", "--save-interval", "100000"] + ([] if gpu else ["--cpu", "--num-workers", "0"])
    # the stock run loads the plugin only so that torch >= 2.6 can read the initial checkpoint
    # (weights_only); its architecture, criterion and optimizer are fairseq's own
    stock = ["--user-dir", os.path.join(REPO, "ls_fairseq", "fairseq_plugin"), "--arch", "transformer_wmt_en_de",
             "--criterion", "label_smoothed_cross_entropy", "--optimizer", "adam"] + (["--fp16"] if gpu else [])
    ls = ["--user-dir", os.path.join(REPO, "ls_fairseq", "fairseq_plugin"), "--arch", "ls_transformer_wmt_en_de",
          "--criterion", "ls_label_smoothed_cross_entropy", "--optimizer", "ls_adam"]
    return common, stock, ls


RESTART = ["--reset-optimizer", "--reset-lr-scheduler", "--reset-meters", "--reset-dataloader", "--lr", "5e-4"]


def initial_weights(args, data, stock, common, tag="", seed=()):
    """(stock's initial checkpoint, its conversion for ls_transformer): one stock update at a negligible
    learning rate, made once per ``tag`` (a seed's)."""
    init_dir = os.path.join(args.out, "init" + tag)
    stock_init, ls_init = os.path.join(init_dir, "checkpoint_last.pt"), os.path.join(args.out, "init_ls" + tag + ".pt")
    if not os.path.exists(ls_init):
        sh(ENTRY["fairseq-train"] + [data + "/data-bin", "--save-dir", init_dir, "--max-update", "1", "--lr", "1e-12",
                                     "--disable-validation"] + stock + common + args.extra + list(seed),
           os.path.join(args.out, "init" + tag + ".log"))
        sh([sys.executable, "-m", "ls_fairseq.convert", "from-fairseq", stock_init, ls_init],
           os.path.join(args.out, "convert" + tag + ".log"))
    return stock_init, ls_init


def train_seeds(args, data):
    """Issue 35's protocol: the runs of each seed of --seeds that OUT does not hold yet, trained (all at
    once on a GPU), translated and scored; each kept as OUT/NAME.result.json."""
    import torch

    gpu = torch.cuda.is_available()
    systems = args.systems.split(",") if gpu else ["ls-fp32"]
    common, stock, ls = run_options(gpu)
    stock_name = "stock-fp16" if gpu else "stock-fp32"
    runs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        tag, seeded = "-s{}".format(seed), ["--seed", str(seed)]
        stock_init, ls_init = initial_weights(args, data, stock, common, tag, seeded)
        for name, entry, system, init in [(stock_name, "fairseq-train", stock, stock_init)] + [
                (n, "ls-fairseq-train", ls + PRECISION[n], ls_init) for n in systems]:
            if not os.path.exists(os.path.join(args.out, name + tag + ".result.json")):
                runs.append((name + tag, entry, system, seeded, init))
    procs = []
    for name, entry, system, seeded, init in runs:
        log = os.path.join(args.out, name + ".train.log")
        # the seed last, so that it overrides common's
        cmd = ENTRY[entry] + [data + "/data-bin", "--save-dir", os.path.join(args.out, name), "--restore-file", init] \
            + system + RESTART + common + ["--dropout", "0.3", "--max-update", str(args.updates), "--log-interval",
                                           "50"] + args.extra + seeded
        procs.append((name, start(cmd, log), log))
        if not gpu:
            finish(procs[-1][1], log)
    logs = {name: finish(proc, log) for name, proc, log in procs}
    generating = [(name, start_generate(args.out, data, os.path.join(args.out, name, "checkpoint_last.pt"), name,
                                        ["--fp16"] if gpu else ["--cpu"], system[:2])) for name, _, system, _, _ in runs]
    for name, (proc, log) in generating:
        keep_hypotheses(args.out, name, proc, log)
        with open(os.path.join(args.out, name + ".result.json"), "w") as f:
            json.dump(dict(losses=losses(logs[name]), valid_loss=valid_loss(logs[name]), bleu=bleu(args.out, data, name)), f)


def seed_report(out, compare_from):
    """(report, Markdown) of every OUT/NAME-sSEED.result.json: each system's seeds against stock's, by
    issue 35's one-sided bounds (the module docstring)."""
    by_system = {}
    for f in sorted(os.listdir(out)):
        m = re.match(r"(.+)-s(\d+)\.result\.json$", f)
        if m:
            with open(os.path.join(out, f)) as fh:
                r = json.load(fh)
            r["losses"] = {int(u): v for u, v in r["losses"].items()}
            by_system.setdefault(m.group(1), {})[int(m.group(2))] = r
    stock_name = next((n for n in by_system if n.startswith("stock")), None)
    if stock_name is None:
        raise SystemExit("parity: no stock run in {} to compare with".format(out))

    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    def spread(values):
        values = [v for v in values if v is not None]
        return max(values) - min(values) if values else 0.0

    stock = by_system[stock_name]
    s_valid, s_bleu = mean(r["valid_loss"] for r in stock.values()), mean(r["bleu"] for r in stock.values())
    valid_bound = s_valid + max(0.01 * s_valid, spread(r["valid_loss"] for r in stock.values())) if s_valid else None
    bleu_bound = s_bleu - max(0.5, spread(r["bleu"] for r in stock.values())) if s_bleu is not None else None
    lines = ["| system | seeds | mean valid loss (bound) | mean BLEU (bound) | worst interval: mean loss - bound | "
             "within bounds |", "| --- | --- | --- | --- | --- | --- |",
             "| {} | {} | {} | {} | - | - |".format(stock_name, ",".join(map(str, sorted(stock))),
                                                 _fmt(s_valid, "{:.3f}"), _fmt(s_bleu, "{:.2f}"))]
    report = dict(stock=stock_name, valid_bound=valid_bound, bleu_bound=bleu_bound, runs=by_system, systems={})
    for name, seeds in by_system.items():
        if name == stock_name:
            continue
        valid, score = mean(r["valid_loss"] for r in seeds.values()), mean(r["bleu"] for r in seeds.values())
        intervals = sorted(u for u in set.intersection(*(set(r["losses"]) for r in list(stock.values()) + list(seeds.values())))
                           if u >= compare_from)
        margins = {u: mean(r["losses"][u] for r in seeds.values()) - mean(r["losses"][u] for r in stock.values())
                   - spread(r["losses"][u] for r in stock.values()) for u in intervals}
        worst = max(margins.items(), key=lambda kv: kv[1]) if margins else None
        ok = dict(valid=valid is not None and valid_bound is not None and valid <= valid_bound,
                  bleu=score is not None and bleu_bound is not None and score >= bleu_bound,
                  losses=worst is not None and worst[1] <= 0)
        report["systems"][name] = dict(seeds=sorted(seeds), mean_valid=valid, mean_bleu=score, intervals=intervals,
                                       worst_interval=worst, within=ok, within_bounds=all(ok.values()))
        lines.append("| {} | {} | {} ({}) | {} ({}) | {} | {} |".format(
            name, ",".join(map(str, sorted(seeds))), _fmt(valid, "{:.3f}"), _fmt(valid_bound, "<= {:.3f}"),
            _fmt(score, "{:.2f}"), _fmt(bleu_bound, ">= {:.2f}"),
            "-" if worst is None else "update {}: {:+.3f}".format(*worst),
            all(ok.values()) if all(ok.values()) else "no: " + ", ".join(k for k, v in ok.items() if not v)))
    return report, "\n".join(lines)


def _fmt(value, spec):
    return "-" if value is None else spec.format(value)


def train_all(args, data, write):
    """Runs stock and each ls system; returns their results (losses, validation loss; BLEU when scorable).
    ``write(results)`` reports them once trained (BLEU pending) and again when scored."""
    import torch

    gpu = torch.cuda.is_available()
    systems = args.systems.split(",") if gpu else ["ls-fp32"]
    common, stock, ls = run_options(gpu)
    stock_init, ls_init = initial_weights(args, data, stock, common)
    stock_name = "stock-fp16" if gpu else "stock-fp32"
    reseeded = ["--user-dir", os.path.join(REPO, "scripts", "parity_hooks")] + stock[2:]
    ls_masks = ["--user-dir", os.path.join(REPO, "scripts", "parity_ls_masks")] + stock[2:]
    # the first run is the reference of every comparison
    runs = [(stock_name + "-ls-masks", "fairseq-train", ls_masks, stock_init)] if gpu else []
    if args.noise_floor or not gpu:  # on CPU stock's own run is the reference
        runs += [(stock_name, "fairseq-train", stock, stock_init)]
    if args.noise_floor:
        runs += [(stock_name + "-reseeded", "fairseq-train", reseeded, stock_init)]
    runs += [(name, "ls-fairseq-train", ls + PRECISION[name], ls_init) for name in systems]
    # every run of a phase at once on a GPU (they share it); one after another on CPU
    phases = [("", ["--dropout", "0.3", "--max-update", str(args.updates), "--log-interval", "50"])]
    if args.first_steps:
        # a small initial loss scale: stock fairseq does not count an overflowing fp16 step as an update, the
        # device-decided step of ls-fairseq-train does, and a skipped step would shift the two curves apart
        first = ["--max-update", str(args.first_steps), "--log-interval", "1", "--fp16-init-scale", "4"]
        phases.append((".first", ["--dropout", "0"] + first))
        if gpu:  # against the run with ls_fairseq's masks: rounding-level differences show the masks line up
            phases.append((".first-dropout", ["--dropout", "0.3"] + first))
    logs = {}
    for suffix, options in phases:
        procs = []
        for name, entry, system, init in runs:
            log = os.path.join(args.out, name + suffix + ".train.log")
            cmd = ENTRY[entry] + [data + "/data-bin", "--save-dir", os.path.join(args.out, name + suffix),
                                  "--restore-file", init] + system + RESTART + common + options + args.extra
            procs.append((name + suffix, start(cmd, log), log))
            if not gpu:
                finish(procs[-1][1], log)
        for name, proc, log in procs:
            logs[name] = finish(proc, log)
    results = {name: dict(losses=losses(logs[name]), valid_loss=valid_loss(logs[name]),
                          first_losses=losses(logs.get(name + ".first", "")),
                          first_dropout_losses=losses(logs.get(name + ".first-dropout", "")), bleu=None)
               for name, _, _, _ in runs}
    write(results)
    generating = [(name, start_generate(args.out, data, os.path.join(args.out, name, "checkpoint_last.pt"), name,
                                        ["--fp16"] if gpu else ["--cpu"], system[:2])) for name, _, system, _, _ in runs]
    for name, (proc, log) in generating:
        keep_hypotheses(args.out, name, proc, log)
        results[name]["bleu"] = bleu(args.out, data, name)
    return results


def compare(results, compare_from, first_steps):
    """Each run against the first stock one: the report (for parity.json) and its Markdown table."""
    stock_name = next(n for n in results if n.startswith("stock"))  # the first: the reference run
    ref = results[stock_name]
    systems = [n for n in results if n != stock_name]
    report = dict(runs=results, comparisons={})
    lines = ["| system | updates | worst loss diff from {} | last quarter's mean loss | first {} steps, dropout off | "
             "first {} steps, dropout on | valid loss | BLEU | within bounds |".format(compare_from, first_steps,
                                                                                      first_steps),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
             "| {} | {} | - | {:.3f} | - | - | {} | {} | - |".format(stock_name, max(ref["losses"], default=0),
                                                                 last_quarter(ref["losses"]), ref["valid_loss"],
                                                                 ref["bleu"])]
    for name in systems:
        r = results[name]
        shared = sorted(u for u in set(ref["losses"]) & set(r["losses"]) if u >= compare_from)
        first = sorted(set(ref["first_losses"]) & set(r["first_losses"]))
        first_dropout = sorted(set(ref.get("first_dropout_losses", {})) & set(r.get("first_dropout_losses", {})))
        scored = r["bleu"] is not None and ref["bleu"] is not None
        c = dict(
            compared_updates=shared,
            worst_loss_rel_diff=max((rel(ref["losses"][u], r["losses"][u]) for u in shared), default=float("nan")),
            last_quarter_rel_diff=rel(last_quarter(ref["losses"]), last_quarter(r["losses"])),
            first_steps_worst_rel_diff=max((rel(ref["first_losses"][u], r["first_losses"][u]) for u in first), default=None),
            first_steps_dropout_worst_rel_diff=max((rel(ref["first_dropout_losses"][u], r["first_dropout_losses"][u])
                                                    for u in first_dropout), default=None),
            valid_rel_diff=rel(ref["valid_loss"], r["valid_loss"]) if ref["valid_loss"] and r["valid_loss"] else None,
            bleu_diff=abs(r["bleu"] - ref["bleu"]) if scored else None,
        )
        c["within_bounds"] = bool(shared) and c["worst_loss_rel_diff"] <= 0.01 and c["valid_rel_diff"] is not None \
            and c["valid_rel_diff"] <= 0.01 and scored and c["bleu_diff"] <= 0.3
        report["comparisons"][name] = c
        lines.append("| {} | {} | {:.2%} | {:.3f} ({:.2%}) | {} | {} | {} ({}) | {} | {} |".format(
            name, max(r["losses"], default=0), c["worst_loss_rel_diff"], last_quarter(r["losses"]),
            c["last_quarter_rel_diff"],
            "-" if c["first_steps_worst_rel_diff"] is None else "{:.3%}".format(c["first_steps_worst_rel_diff"]),
            "-" if c["first_steps_dropout_worst_rel_diff"] is None
            else "{:.3%}".format(c["first_steps_dropout_worst_rel_diff"]),
            r["valid_loss"], "-" if c["valid_rel_diff"] is None else "{:.2%}".format(c["valid_rel_diff"]),
            "not scored" if not scored else "{:.2f} ({:+.2f})".format(r["bleu"], r["bleu"] - ref["bleu"]),
            c["within_bounds"]))
    names = [stock_name] + systems
    curve = ["| update | " + " | ".join(names) + " |", "| --- " * (len(names) + 1) + "|"]
    for u in sorted(ref["losses"]):
        curve.append("| {} | ".format(u) + " | ".join(
            "{:.3f}".format(results[n]["losses"][u]) if u in results[n]["losses"] else "-" for n in names) + " |")
    return report, "\n".join(curve + [""] + lines)


def prepare(args, data):
    sh(["bash", os.path.join(REPO, "recipes", "wmt14_en_de", "prepare.sh"), "--from",
        os.path.join(REPO, "data", "lohelp"), "--work", data, "--vocab-size", str(args.vocab_size), "--ratio", "2.5"],
       os.path.join(args.out, "prepare.log"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--data", help="prepared corpus folder (default: OUT/data, prepared here)")
    # 2,000 updates left stock fairseq at 8.9 BLEU on the test set (2026-11-29); the fused-layers issue asks for >= 10
    parser.add_argument("--updates", type=int, default=3000)
    parser.add_argument("--compare-from", type=int, default=200)
    parser.add_argument("--first-steps", type=int, default=20, help="dropout-off check length (0: skip it)")
    parser.add_argument("--systems", default="ls-fp16-master,ls-bf16-master", help=", ".join(PRECISION))
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--no-noise-floor", dest="noise_floor", action="store_false",
                        help="leave out the stock runs with their own and with other dropout masks (on a GPU the "
                             "reference draws ls_fairseq's masks): two runs fewer, for a shorter call")
    parser.add_argument("--rescore", action="store_true", help="only score OUT's hypotheses and report again")
    parser.add_argument("--seeds", help="issue 35's protocol over these seeds, e.g. 1,2,3 (the module docstring)")
    parser.add_argument("extra", nargs="*", help="options for every fairseq-train run (after --)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    data = args.data or os.path.join(args.out, "data")

    def write(results):
        report, text = compare(results, args.compare_from, args.first_steps)
        with open(os.path.join(args.out, "parity.json"), "w") as f:
            json.dump(report, f, indent=1)
        with open(os.path.join(args.out, "parity.md"), "w") as f:
            f.write(text + "\n")
        return text

    if args.seeds:
        prepare(args, data)
        train_seeds(args, data)
        report, text = seed_report(args.out, args.compare_from)
        with open(os.path.join(args.out, "seeds.json"), "w") as f:
            json.dump(report, f, indent=1)
        with open(os.path.join(args.out, "seeds.md"), "w") as f:
            f.write(text + "\n")
        print(text)
        return
    if args.rescore:
        with open(os.path.join(args.out, "parity.json")) as f:
            results = json.load(f)["runs"]
        for name, r in results.items():
            r["bleu"] = bleu(args.out, data, name)
            for key in ("losses", "first_losses", "first_dropout_losses"):
                r[key] = {int(u): v for u, v in r.get(key, {}).items()}
    else:
        prepare(args, data)
        results = train_all(args, data, write)
    print(write(results))


if __name__ == "__main__":
    main()
