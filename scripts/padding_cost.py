"""How much of a training step's work is padding, on the speed benchmark's data.

The benchmark (recipes/wmt14_en_de/bench.py) trains on synthetic.py's WMT14-like lengths; fairseq
batches them as fairseq-train does (sorted by target then source length, --max-tokens counting
the longer side of each pair times the sentences, --required-batch-size-multiple 8) and pads each
side to its longest sentence, then to --required-seq-len-multiple. Every GEMM and attention kernel
works on the padded [sentences, length] tensors, so the padding's share of the FLOPs is the share
of the step it costs. FLOPs per sentence as ls_fairseq.flops counts them (transformer-big by
default): the linears per token of each side, attention per pair of positions.

Then the packed step's (--ls-packed with --ls-cuda-graphs): each side's real tokens as one stream,
rounded up to one of at most 8 capacities per side chosen from the epoch's batches
(ls_fairseq.packing.Buckets, the trainer's own function). Its only waste is the tail past the real
tokens, which the GEMMs and per-token ops run over (attention skips it): the tail's share of the
step's FLOPs, against the bounds of at most 3% at 8,192 and 16,384 tokens and 5% at 4,096, and the
number of shapes (CUDA graphs).

  python scripts/padding_cost.py                    # the benchmark's 24,000 pairs, 4k/8k/16k tokens
  python scripts/padding_cost.py --pairs 200000 --max-tokens 8192
"""
import argparse
import os
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "recipes", "wmt14_en_de"))


def pair_lengths(pairs, seed):
    """synthetic.py's train split lengths (source, target), EOS included, drawn as it draws them."""
    from synthetic import lengths

    rng = np.random.default_rng(seed)
    src = lengths(rng, pairs, 28.0)
    tgt = np.clip(np.round(src * rng.normal(30.0 / 28.0, 0.1, pairs)), 2, 250).astype(np.int64)
    return src, tgt


def batches(src, tgt, max_tokens, seed):
    from fairseq.data import data_utils

    order = np.random.default_rng(seed).permutation(len(src)).astype(np.int64)
    order = order[np.argsort(tgt[order], kind="mergesort")]
    order = order[np.argsort(src[order], kind="mergesort")]
    sizes = np.maximum(src, tgt)
    return data_utils.batch_by_size(order, num_tokens_fn=None, num_tokens_vec=sizes[order], max_tokens=max_tokens,
                                    required_batch_size_multiple=8)


def flops(ls, lt, d, ffn, layers, vocab):
    """Forward FLOPs of sentences with source lengths ``ls`` and target lengths ``lt`` (arrays)."""
    encoder = layers * (ls * (4 * d * d + 2 * d * ffn) + 2 * ls * ls * d)
    decoder = layers * (lt * (6 * d * d + 2 * d * ffn) + 2 * ls * d * d + 2 * lt * lt * d + 2 * lt * ls * d)
    return 2 * (encoder + decoder + lt * d * vocab)


def ceil_to(n, multiple):
    return -(-n // multiple) * multiple


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=24000, help="training pairs (bench.py's default)")
    parser.add_argument("--max-tokens", default="4096,8192,16384")
    parser.add_argument("--multiples", default="1,8", help="--required-seq-len-multiple values")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    src, tgt = pair_lengths(args.pairs, args.seed)
    model = dict(d=args.dim, ffn=args.ffn, layers=args.layers, vocab=args.vocab)
    print("| max-tokens | seq-len multiple | batches | tokens padded (src + tgt) | FLOPs on padding | "
          "of the linears' | of attention's | shapes (sentences, src, tgt) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    groups_by_budget = []
    for max_tokens in (int(t) for t in args.max_tokens.split(",")):
        groups = batches(src, tgt, max_tokens, args.seed)
        groups_by_budget.append((max_tokens, groups))
        for multiple in (int(m) for m in args.multiples.split(",")):
            real = padded = real_lin = padded_lin = 0.0
            tokens = padded_tokens = 0
            shapes = set()
            for g in groups:
                ls, lt = src[g].astype(np.float64), tgt[g].astype(np.float64)
                ps, pt = ceil_to(int(ls.max()), multiple), ceil_to(int(lt.max()), multiple)
                shapes.add((len(g), ps, pt))
                real += flops(ls, lt, **model).sum()
                padded += len(g) * flops(np.float64(ps), np.float64(pt), **model)
                real_lin += (flops(ls, lt, **model) - attention(ls, lt, **model)).sum()
                padded_lin += len(g) * (flops(np.float64(ps), np.float64(pt), **model)
                                        - attention(np.float64(ps), np.float64(pt), **model))
                tokens += int(ls.sum() + lt.sum())
                padded_tokens += len(g) * (ps + pt)
            waste = 1 - real / padded
            lin_waste = 1 - real_lin / padded_lin
            att_waste = 1 - (real - real_lin) / (padded - padded_lin)
            print("| {} | {} | {} | {:.1%} | {:.1%} | {:.1%} | {:.1%} | {} |".format(
                max_tokens, multiple, len(groups), 1 - tokens / padded_tokens, waste, lin_waste, att_waste,
                len(shapes)))
    if not packed_table(src, tgt, groups_by_budget, model):
        sys.exit("padding_cost: the packed step's tail or capacities exceed their bounds")


def linear_per_token(d, ffn, layers, vocab):
    """Forward FLOPs of one source token's and one target token's linears (``flops`` without attention)."""
    return 2 * layers * (4 * d * d + 2 * d * ffn + 2 * d * d), 2 * (layers * (6 * d * d + 2 * d * ffn) + d * vocab)


TAIL_BOUND = {4096: 0.05}  # the tail's largest share of the step's FLOPs; 3% at larger budgets


def packed_table(src, tgt, groups_by_budget, model):
    """The packed step's tail and shapes per --max-tokens; returns whether every bound holds."""
    from ls_fairseq.packing import Buckets

    print("\n| max-tokens | batches | source capacities | target capacities | shapes | tail tokens (src + tgt) | "
          "tail FLOPs of the step | bound |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    src_token, tgt_token = linear_per_token(**model)
    ok = True
    for max_tokens, groups in groups_by_budget:
        buckets = Buckets([(src[g], tgt[g]) for g in groups])
        real_flops = tail_flops = real_tokens = tail_tokens = 0.0
        for g in groups:
            cs, ct = buckets.key(int(src[g].sum()), int(tgt[g].sum()))
            ls, lt = src[g].astype(np.float64), tgt[g].astype(np.float64)
            real_flops += flops(ls, lt, **model).sum()
            tail_flops += (cs - ls.sum()) * src_token + (ct - lt.sum()) * tgt_token
            real_tokens += ls.sum() + lt.sum()
            tail_tokens += cs + ct - ls.sum() - lt.sum()
        share = tail_flops / (real_flops + tail_flops)
        bound = TAIL_BOUND.get(max_tokens, 0.03)
        ok &= share <= bound and len(buckets.src) <= 8 and len(buckets.tgt) <= 8
        print("| {} | {} | {} | {} | {} | {:.1%} | {:.2%} | {}{:.0%} |".format(
            max_tokens, len(groups), len(buckets.src), len(buckets.tgt), len(buckets.shapes),
            tail_tokens / (real_tokens + tail_tokens), share, "<= " if share <= bound else "OVER ", bound))
    return ok


def attention(ls, lt, d, ffn, layers, vocab):
    """The attention part of ``flops`` (scores and weighted sums), which grows with length squared."""
    return 2 * layers * (2 * ls * ls * d + 2 * lt * lt * d + 2 * lt * ls * d)


if __name__ == "__main__":
    main()
