"""segment_attention's paths on one GPU, forward + backward, transformer-big's heads (16 x 64), about
16,384 tokens of WMT-like sentences (lengths drawn log-normal around 27 tokens, 1 to 250): the
Triton kernels (32- and 64-row tiles, the one-kernel backward of short segments or not), torch's varlen
FlashAttention, and what the padded step runs on the same sentences (ops.attention on [B, heads, T,
d_head], the sentences sorted by length into 8 batches, each padded to a multiple of 8: the sum of
the 8 calls). Median of triton.testing.do_bench (CUDA events), in ms.

    python3 scripts/bench_segment_attention.py [--tokens 16384] [--seed 1]
"""
import argparse
import math

import torch
import triton

from ls_fairseq import ops
from ls_fairseq.ops import segment_attention as seg
from ls_fairseq.triton_kernels import segment_attention as kernels


def lengths_for(tokens, generator):
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(min(250, max(1, round(math.exp(torch.randn(1, generator=generator).item() * 0.5
                                                            + math.log(27.0)))))))
    return torch.tensor(lengths)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    generator = torch.Generator().manual_seed(args.seed)
    H, D = 16, 64
    lengths = lengths_for(args.tokens, generator)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    offsets[1:] = lengths.cumsum(0)
    n = int(offsets[-1])
    capacity = (n + 15) // 16 * 16
    offsets = offsets.cuda()
    longest = int(lengths.max())
    B = len(lengths)
    print("{} sentences, {} tokens (capacity {}), longest {}, mean {:.1f}".format(B, n, capacity, longest, n / B))

    def stream(rows):
        return torch.randn(1, rows, H, D, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()

    def timed(fn, q, k, v):
        dout = torch.randn(q.shape, device="cuda", dtype=dtype)

        def step():
            out = fn(q, k, v)
            torch.autograd.grad(out, (q, k, v), dout)

        fwd = triton.testing.do_bench(lambda: fn(q, k, v), warmup=50, rep=300, return_mode="median")
        both = triton.testing.do_bench(step, warmup=50, rep=300, return_mode="median")
        return fwd, both

    rows = []
    for causal in (True, False):
        kind = "causal self" if causal else "self/cross"
        q, k, v = stream(capacity), stream(capacity), stream(capacity)
        for label, triton_mask, p, exact in (("triton", True, 0.0, True), ("triton dropout 0.1", True, 0.1, True),
                                             ("varlen FlashAttention", False, 0.0, False)):
            mask = ops.SegmentMask(offsets, offsets, longest, longest, causal=causal, triton=triton_mask)
            if not triton_mask and not seg.varlen_fits(q, p, True, False, exact):
                continue
            for block, short in (((32, False), (64, False), (32, True), (64, True)) if triton_mask else ((None, False),)):
                if triton_mask:
                    original = kernels.block_rows
                    kernels.block_rows = lambda rows, segments, b=block: b
                    kernels.SHORT_BACKWARD = short
                try:
                    fwd, both = timed(lambda q, k, v: ops.attention(q, k, v, mask, p, True, exact_row_term=exact), q, k, v)
                finally:
                    if triton_mask:
                        kernels.block_rows = original
                        kernels.SHORT_BACKWARD = False
                rows.append((kind, label + ("" if block is None else " ({} rows{})".format(
                    block, ", one-kernel backward of short segments" if short else "")), fwd, both))
        # the padded step's attention on the same sentences as fairseq batches them: sorted by length and
        # cut into 8 batches, each padded to its own longest sentence (a multiple of 8); the sum of the 8
        ordered = lengths.sort().values
        for label, exact in (("padded ops.attention, 8 length-sorted batches", False),
                             ("padded ops.attention, 8 length-sorted batches, exact row term", True)):
            fwd = both = 0.0
            for part in ordered.chunk(8):
                T = (int(part.max()) + 7) // 8 * 8
                kpm = torch.arange(T)[None, :] >= part[:, None]
                mask = ops.AttentionMask(kpm.cuda(), causal=causal, right_padded=True)
                qp, kp, vp = (torch.randn(len(part), T, H, D, device="cuda", dtype=dtype).transpose(1, 2)
                              .requires_grad_() for _ in range(3))
                f, b = timed(lambda q, k, v: ops.attention(q, k, v, mask, 0.0, True, exact_row_term=exact), qp, kp, vp)
                fwd, both = fwd + f, both + b
            rows.append((kind, label, fwd, both))
    print("| attention | path | forward ms | forward + backward ms |")
    print("| --- | --- | --- | --- |")
    for kind, label, fwd, both in rows:
        print("| {} | {} | {:.3f} | {:.3f} |".format(kind, label, fwd, both))


if __name__ == "__main__":
    main()
