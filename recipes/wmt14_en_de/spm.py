"""SentencePiece steps of the recipes: train a joint model, encode, clean.

  python spm.py train  --model PREFIX --vocab-size N FILE...
  python spm.py encode --model PREFIX.model < raw > pieces
  python spm.py clean  --max-len 250 --ratio 1.5 SRC_IN TGT_IN SRC_OUT TGT_OUT
"""
import argparse
import sys

import sentencepiece as spm


def train(args):
    spm.SentencePieceTrainer.train(
        input=",".join(args.files),
        model_prefix=args.model,
        vocab_size=args.vocab_size,
        character_coverage=1.0,
        model_type="unigram",
        input_sentence_size=args.input_sentence_size,
        shuffle_input_sentence=True,
        hard_vocab_limit=False,
        bos_id=-1,
        eos_id=-1,
        pad_id=-1,
        unk_id=0,
        num_threads=args.threads,
    )


def encode(args):
    sp = spm.SentencePieceProcessor(model_file=args.model)
    for line in sys.stdin:
        sys.stdout.write(" ".join(sp.encode(line.rstrip("\n"), out_type=str)) + "\n")


def clean(args):
    kept = dropped = 0
    with open(args.src_in, encoding="utf-8") as fs, open(args.tgt_in, encoding="utf-8") as ft, open(
        args.src_out, "w", encoding="utf-8"
    ) as os_, open(args.tgt_out, "w", encoding="utf-8") as ot:
        for s, t in zip(fs, ft):
            ns, nt = len(s.split()), len(t.split())
            if 1 <= ns <= args.max_len and 1 <= nt <= args.max_len and max(ns, nt) <= args.ratio * min(ns, nt):
                os_.write(s)
                ot.write(t)
                kept += 1
            else:
                dropped += 1
    print("clean: kept {} pairs, dropped {}".format(kept, dropped), file=sys.stderr)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("train")
    p.add_argument("--model", required=True)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--input-sentence-size", type=int, default=10000000)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("files", nargs="+")
    p = sub.add_parser("encode")
    p.add_argument("--model", required=True)
    p = sub.add_parser("clean")
    p.add_argument("--max-len", type=int, default=250)
    p.add_argument("--ratio", type=float, default=1.5)
    for name in ("src_in", "tgt_in", "src_out", "tgt_out"):
        p.add_argument(name)
    args = parser.parse_args()
    {"train": train, "encode": encode, "clean": clean}[args.cmd](args)


if __name__ == "__main__":
    main()
