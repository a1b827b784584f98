"""Parity of ls_fairseq with stock fairseq on real text: same weights, same data, same seed.

1. prepares the embedded corpus (recipes/wmt14_en_de/prepare.sh --from data/lohelp);
2. takes a stock model's initial weights (one stock update at a negligible learning
   rate) and converts them with `python -m ls_fairseq.convert from-fairseq`;
3. trains stock `transformer_wmt_en_de` and `ls_transformer_wmt_en_de` from those
   weights (optimizer, scheduler, meters and data order reset) with dropout on;
4. compares the per-interval training losses from --compare-from on, the final
   validation losses, and BLEU of fairseq-generate on the 1,200-sentence test set.

  python scripts/parity.py --out DIR [--updates 1000] [--ls-precision fp16|bf16] [-- extra fairseq-train options]

Bounds (the fused layers issue): losses within 1% from update 200 on, final validation
loss within 1%, BLEU within 0.3. Prints a table and writes DIR/parity.json.
"""
import argparse
import json
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def sh(cmd, log):
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=REPO))
    text = open(log).read()
    if proc.returncode != 0:
        raise SystemExit("parity: {} failed, see {}:\n{}".format(cmd[0], log, text[-2000:]))
    return text


def losses(log):
    return {int(u): float(loss) for loss, u in re.findall(r"train_inner \|.*? loss=([\d.]+),.*?num_updates=(\d+)", log)}


def valid_loss(log):
    found = re.findall(r"valid on 'valid' subset \| loss ([\d.]+)", log)
    return float(found[-1]) if found else None


def bleu(out, data, checkpoint, name, device, user_dir):
    gen = sh([os.path.join(BIN, "fairseq-generate"), data + "/data-bin", "--path", checkpoint, "--gen-subset", "test",
              "--beam", "4", "--lenpen", "0.6", "--batch-size", "128", "--remove-bpe", "sentencepiece"] + device + user_dir,
             os.path.join(out, name + ".generate.log"))
    hyps = sorted((int(i), h) for i, _, h in re.findall(r"^H-(\d+)\t([^\t]*)\t(.*)$", gen, re.M))
    hyp_file = os.path.join(out, name + ".hyp")
    with open(hyp_file, "w") as f:
        f.write("".join(h + "\n" for _, h in hyps))
    score = subprocess.run([os.path.join(BIN, "sacrebleu"), data + "/raw/test.de", "-i", hyp_file, "-m", "bleu", "-b"],
                           capture_output=True, text=True, check=True)
    return float(score.stdout.strip())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--updates", type=int, default=1000)
    parser.add_argument("--compare-from", type=int, default=200)
    parser.add_argument("--ls-precision", choices=["fp16", "bf16", "fp32"], default="fp16")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("extra", nargs="*", help="options for both fairseq-train runs (after --)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    data = os.path.join(args.out, "data")
    sh(["bash", os.path.join(REPO, "recipes", "wmt14_en_de", "prepare.sh"), "--from", os.path.join(REPO, "data", "lohelp"),
        "--work", data, "--vocab-size", str(args.vocab_size), "--ratio", "2.5"], os.path.join(args.out, "prepare.log"))
    import torch

    gpu = torch.cuda.is_available()
    common = ["--share-all-embeddings", "--adam-betas", "(0.9,0.98)", "--lr-scheduler", "inverse_sqrt",
              "--warmup-updates", "400", "--dropout", "0.3", "--label-smoothing", "0.1", "--max-tokens", "8192",
              "--log-format", "simple", "--log-interval", "50", "--seed", "1", "--no-epoch-checkpoints",
              "--no-progress-bar"] + ([] if gpu else ["--cpu", "--num-workers", "0"]) + args.extra
    # the stock run loads the plugin only so that torch >= 2.6 can read the initial checkpoint
    # (weights_only); its architecture, criterion and optimizer are fairseq's own
    stock = ["--user-dir", os.path.join(REPO, "ls_fairseq"), "--arch", "transformer_wmt_en_de",
             "--criterion", "label_smoothed_cross_entropy", "--optimizer", "adam"]
    ls = ["--user-dir", os.path.join(REPO, "ls_fairseq"), "--arch", "ls_transformer_wmt_en_de",
          "--criterion", "ls_label_smoothed_cross_entropy", "--optimizer", "ls_adam"]
    precision = {"fp16": ["--fp16"], "bf16": ["--memory-efficient-bf16"], "fp32": []}
    init_dir = os.path.join(args.out, "init")
    sh([os.path.join(BIN, "fairseq-train"), data + "/data-bin", "--save-dir", init_dir, "--max-update", "1",
        "--lr", "1e-12", "--disable-validation"] + stock + common, os.path.join(args.out, "init.log"))
    ls_init = os.path.join(args.out, "init_ls.pt")
    sh([sys.executable, "-m", "ls_fairseq.convert", "from-fairseq", os.path.join(init_dir, "checkpoint_last.pt"), ls_init],
       os.path.join(args.out, "convert.log"))
    restart = ["--reset-optimizer", "--reset-lr-scheduler", "--reset-meters", "--reset-dataloader",
               "--max-update", str(args.updates), "--lr", "1e-3"]
    runs = {}
    for name, system, init, prec, entry in (
        ("stock-fp16" if gpu else "stock-fp32", stock, os.path.join(init_dir, "checkpoint_last.pt"),
         precision["fp16"] if gpu else [], "fairseq-train"),
        ("ls-" + (args.ls_precision if gpu else "fp32"), ls, ls_init, precision[args.ls_precision] if gpu else [],
         "ls-fairseq-train"),
    ):
        save = os.path.join(args.out, name)
        log = sh([os.path.join(BIN, entry), data + "/data-bin", "--save-dir", save, "--restore-file", init] + system + prec
                 + restart + common, os.path.join(args.out, name + ".train.log"))
        user_dir = system[:2]
        runs[name] = dict(losses=losses(log), valid_loss=valid_loss(log),
                          bleu=bleu(args.out, data, os.path.join(save, "checkpoint_last.pt"), name,
                                    ["--fp16"] if gpu else ["--cpu"], user_dir))
    (a, ra), (b, rb) = runs.items()
    shared = sorted(u for u in set(ra["losses"]) & set(rb["losses"]) if u >= args.compare_from)
    worst = max((abs(rb["losses"][u] - ra["losses"][u]) / ra["losses"][u] for u in shared), default=float("nan"))
    report = dict(
        runs=runs, compared_updates=shared, worst_loss_rel_diff=worst,
        valid_rel_diff=abs(rb["valid_loss"] - ra["valid_loss"]) / ra["valid_loss"] if ra["valid_loss"] else None,
        bleu_diff=abs(rb["bleu"] - ra["bleu"]),
    )
    report["within_bounds"] = bool(shared) and worst <= 0.01 and (report["valid_rel_diff"] or 0) <= 0.01 and report["bleu_diff"] <= 0.3
    with open(os.path.join(args.out, "parity.json"), "w") as f:
        json.dump(report, f, indent=1)
    print("| update | {} loss | {} loss | rel. diff |".format(a, b))
    print("| --- | --- | --- | --- |")
    for u in sorted(set(ra["losses"]) & set(rb["losses"])):
        print("| {} | {:.3f} | {:.3f} | {:.2%} |".format(u, ra["losses"][u], rb["losses"][u],
                                                          abs(rb["losses"][u] - ra["losses"][u]) / ra["losses"][u]))
    print("valid loss: {} {} / {} {}; BLEU: {} {:.2f} / {} {:.2f}".format(a, ra["valid_loss"], b, rb["valid_loss"], a,
                                                                         ra["bleu"], b, rb["bleu"]))
    print("worst loss difference from update {}: {:.2%}; within bounds: {}".format(args.compare_from, worst,
                                                                                  report["within_bounds"]))


if __name__ == "__main__":
    main()
