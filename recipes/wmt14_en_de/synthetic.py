"""Synthetic binarized en-de data with WMT14-like lengths (no download needed).

Lengths after 32k BPE are drawn log-normal (mean about 28 source / 30 target
tokens, long tail, clipped to 2..250), tokens uniformly from a joined 32k
dictionary. Speed depends on shapes, not on words, so this is what the speed
benchmark trains on.

  python synthetic.py --out DIR [--pairs 12000] [--vocab 32000] [--seed 1]
"""
import argparse
import os

import numpy as np
import torch
from fairseq.data import Dictionary, indexed_dataset


def lengths(rng, n, mean, sigma=0.6):
    mu = np.log(mean) - sigma**2 / 2
    return np.clip(np.round(rng.lognormal(mu, sigma, n)), 2, 250).astype(np.int64)


def write_split(out, split, src_len, tgt_len, dictionary, rng):
    for lang, lens in (("en", src_len), ("de", tgt_len)):
        prefix = os.path.join(out, "{}.en-de.{}".format(split, lang))
        builder = indexed_dataset.make_builder(prefix + ".bin", impl="mmap", vocab_size=len(dictionary))
        for n in lens:
            tokens = rng.integers(dictionary.nspecial, len(dictionary), n - 1)
            builder.add_item(torch.from_numpy(np.append(tokens, dictionary.eos()).astype(np.int64)))
        builder.finalize(prefix + ".idx")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--pairs", type=int, default=12000)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    d = Dictionary()
    for i in range(args.vocab - d.nspecial):
        d.add_symbol("w{}".format(i))
    for lang in ("en", "de"):
        d.save(os.path.join(args.out, "dict.{}.txt".format(lang)))
    for split, n in (("train", args.pairs), ("valid", max(64, args.pairs // 50))):
        src = lengths(rng, n, 28.0)
        tgt = np.clip(np.round(src * rng.normal(30.0 / 28.0, 0.1, n)), 2, 250).astype(np.int64)
        write_split(args.out, split, src, tgt, d, rng)
    print("synthetic: {} pairs, vocab {} in {}".format(args.pairs, len(d), args.out))


if __name__ == "__main__":
    main()
