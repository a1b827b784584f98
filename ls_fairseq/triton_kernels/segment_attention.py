"""segment_attention's Triton kernels: attention inside the segments of packed streams, by the offsets.

What it fuses: the scores' GEMM, the masked softmax (fp32, exp2), attention dropout and the GEMM
with v in one forward kernel; the backward in two kernels, dq (with the softmax's row term) and
dk/dv, each recomputing the probabilities from the forward's log-sum-exp.
What it never writes to memory: the scores, the probabilities, the keep-mask (drawn again from
a Philox counter in the backward: LightSeq2's "dropout masks drawn again"), the padding of
ops.segment_attention's blocks path (no gather or scatter: q, k and v are read by stride
straight from the qkv/kv GEMMs' outputs, the output written token-major as the out projection
reads it).
Tile waste: a program per (segment, block of 32 or 64 query rows, head), its key loop bounded
by its own segment's length (and, causal, by its rows), so a ~30-token sentence costs one tile,
not a 128-row one as in varlen FlashAttention. No atomics: the dq kernel owns its query rows,
the dk/dv kernel its key rows, so results are bit-identical run to run (--ls-deterministic
needs nothing more). The tail rows past the last offset are written as zeros by the programs of
a last, extra "segment", in the same launch.

The softmax's row term D_i = sum_j P_ij dP_ij is formed from the fp32 probabilities and dP in a
first pass of the dq kernel (as ls's fused attention kernel and stock fairseq's fp32 probabilities
do), never as FlashAttention's rowsum(dO * O) from the 16-bit output: on an H100 the pass cost
nothing measurable (the kernels are bound by memory), and the 16-bit row term failed the 2x rule on
dq and dk (ratio up to 1.73) for short sentences with dropout (docs/perf-log.md, 2026-12-06).

With TRITON_INTERPRET=1 in the environment before triton is imported (the tests' conftest sets it
where no GPU is), Triton's interpreter runs these kernels on CPU tensors, so the CPU tests check the
very code the GPU runs.
"""
import os

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit(do_not_specialize=["NQ", "S", "MAXK"])
def _fwd(Q, K, V, O, LSE, QOFF, KOFF, SEED,
         sqh, sqn, skh, skn, svh, svn,
         NQ, S, MAXK, p_drop, drop_scale,
         H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
         CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr):
    s = tl.program_id(0)
    mb = tl.program_id(1)
    h = tl.program_id(2)
    d = tl.arange(0, D)
    if s == S:  # the tail: zeros
        for r0 in range(tl.load(QOFF + S) + mb * BM, NQ, tl.num_programs(1) * BM):
            rows = r0 + tl.arange(0, BM)
            tl.store(O + rows[:, None] * (H * D) + h * D + d[None, :], tl.zeros([BM, D], O.dtype.element_ty),
                     mask=(rows < NQ)[:, None])
    else:
        q0 = tl.load(QOFF + s)
        q_len = tl.load(QOFF + s + 1) - q0
        k0 = tl.load(KOFF + s)
        k_len = tl.load(KOFF + s + 1) - k0
        if mb * BM < q_len:
            rows = mb * BM + tl.arange(0, BM)
            rmask = rows < q_len
            q = tl.load(Q + h * sqh + (q0 + rows)[:, None] * sqn + d[None, :], mask=rmask[:, None], other=0.0)
            m = tl.full([BM], float("-inf"), tl.float32)
            l_sum = tl.zeros([BM], tl.float32)
            acc = tl.zeros([BM, D], tl.float32)
            end = k_len
            if CAUSAL:
                end = tl.minimum(k_len, (mb + 1) * BM)
            for n0 in range(0, end, BN):
                cols = n0 + tl.arange(0, BN)
                cmask = cols < k_len
                k = tl.load(K + h * skh + (k0 + cols)[:, None] * skn + d[None, :], mask=cmask[:, None], other=0.0)
                sc = tl.dot(q, tl.trans(k), input_precision=PREC) * LOG2E
                seen = cmask[None, :] & rmask[:, None]
                if CAUSAL:
                    seen = seen & (cols[None, :] <= rows[:, None])
                sc = tl.where(seen, sc, float("-inf"))
                m_new = tl.maximum(m, tl.max(sc, 1))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m - m_use)
                p = tl.exp2(sc - m_use[:, None])
                l_sum = l_sum * alpha + tl.sum(p, 1)
                if DROPOUT:
                    keep = tl.rand(tl.load(SEED), (h * NQ + q0 + rows)[:, None] * MAXK + cols[None, :]) >= p_drop
                    p = tl.where(keep, p * drop_scale, 0.0)
                v = tl.load(V + h * svh + (k0 + cols)[:, None] * svn + d[None, :], mask=cmask[:, None], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
                m = m_new
            l_safe = tl.where(l_sum > 0, l_sum, 1.0)
            out = acc / l_safe[:, None]
            # a row that sees no key (a segment without keys) gives zeros; its +inf log-sum-exp makes every
            # recomputed probability of it zero in the backward
            lse = tl.where(l_sum > 0, m + tl.log2(l_safe), float("inf"))
            tl.store(O + (q0 + rows)[:, None] * (H * D) + h * D + d[None, :], out.to(O.dtype.element_ty),
                     mask=rmask[:, None])
            tl.store(LSE + h * NQ + q0 + rows, lse, mask=rmask)


@triton.jit(do_not_specialize=["NQ", "S", "MAXK"])
def _bwd_dq(Q, K, V, DO, DQ, LSE, DELTA, QOFF, KOFF, SEED,
            sqh, sqn, skh, skn, svh, svn, sdoh, sdon,
            NQ, S, MAXK, p_drop, drop_scale,
            H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
            CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr, SHORT: tl.constexpr):
    s = tl.program_id(0)
    mb = tl.program_id(1)
    h = tl.program_id(2)
    d = tl.arange(0, D)
    if s == S:
        for r0 in range(tl.load(QOFF + S) + mb * BM, NQ, tl.num_programs(1) * BM):
            rows = r0 + tl.arange(0, BM)
            tl.store(DQ + rows[:, None] * (H * D) + h * D + d[None, :], tl.zeros([BM, D], DQ.dtype.element_ty),
                     mask=(rows < NQ)[:, None])
    else:
        q0 = tl.load(QOFF + s)
        q_len = tl.load(QOFF + s + 1) - q0
        k0 = tl.load(KOFF + s)
        k_len = tl.load(KOFF + s + 1) - k0
        todo = q_len
        if SHORT:  # segments within one tile each way are _bwd_short's
            todo = tl.where((q_len <= BM) & (k_len <= BN), 0, q_len)
        if mb * BM < todo:
            rows = mb * BM + tl.arange(0, BM)
            rmask = rows < q_len
            q = tl.load(Q + h * sqh + (q0 + rows)[:, None] * sqn + d[None, :], mask=rmask[:, None], other=0.0)
            do = tl.load(DO + h * sdoh + (q0 + rows)[:, None] * sdon + d[None, :], mask=rmask[:, None], other=0.0)
            lse = tl.load(LSE + h * NQ + q0 + rows, mask=rmask, other=float("inf"))
            end = k_len
            if CAUSAL:
                end = tl.minimum(k_len, (mb + 1) * BM)
            # the row term from the fp32 probabilities and dP: a first pass over the keys
            delta = tl.zeros([BM], tl.float32)
            for n0 in range(0, end, BN):
                cols = n0 + tl.arange(0, BN)
                cmask = cols < k_len
                k = tl.load(K + h * skh + (k0 + cols)[:, None] * skn + d[None, :], mask=cmask[:, None], other=0.0)
                v = tl.load(V + h * svh + (k0 + cols)[:, None] * svn + d[None, :], mask=cmask[:, None], other=0.0)
                seen = cmask[None, :] & rmask[:, None]
                if CAUSAL:
                    seen = seen & (cols[None, :] <= rows[:, None])
                p = tl.where(seen, tl.exp2(tl.dot(q, tl.trans(k), input_precision=PREC) * LOG2E - lse[:, None]), 0.0)
                dp = tl.dot(do, tl.trans(v), input_precision=PREC)
                if DROPOUT:
                    keep = tl.rand(tl.load(SEED), (h * NQ + q0 + rows)[:, None] * MAXK + cols[None, :]) >= p_drop
                    dp = tl.where(keep, dp * drop_scale, 0.0)
                delta += tl.sum(p * dp, 1)
            tl.store(DELTA + h * NQ + q0 + rows, delta, mask=rmask)
            dq = tl.zeros([BM, D], tl.float32)
            for n0 in range(0, end, BN):
                cols = n0 + tl.arange(0, BN)
                cmask = cols < k_len
                k = tl.load(K + h * skh + (k0 + cols)[:, None] * skn + d[None, :], mask=cmask[:, None], other=0.0)
                v = tl.load(V + h * svh + (k0 + cols)[:, None] * svn + d[None, :], mask=cmask[:, None], other=0.0)
                seen = cmask[None, :] & rmask[:, None]
                if CAUSAL:
                    seen = seen & (cols[None, :] <= rows[:, None])
                p = tl.where(seen, tl.exp2(tl.dot(q, tl.trans(k), input_precision=PREC) * LOG2E - lse[:, None]), 0.0)
                dp = tl.dot(do, tl.trans(v), input_precision=PREC)
                if DROPOUT:
                    keep = tl.rand(tl.load(SEED), (h * NQ + q0 + rows)[:, None] * MAXK + cols[None, :]) >= p_drop
                    dp = tl.where(keep, dp * drop_scale, 0.0)
                ds = p * (dp - delta[:, None])
                dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
            tl.store(DQ + (q0 + rows)[:, None] * (H * D) + h * D + d[None, :], dq.to(DQ.dtype.element_ty),
                     mask=rmask[:, None])


@triton.jit(do_not_specialize=["NQ", "NK", "S", "MAXK"])
def _bwd_dkv(Q, K, V, DO, DK, DV, LSE, DELTA, QOFF, KOFF, SEED,
             sqh, sqn, skh, skn, svh, svn, sdoh, sdon,
             NQ, NK, S, MAXK, p_drop, drop_scale,
             H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr, SHORT: tl.constexpr):
    s = tl.program_id(0)
    nb = tl.program_id(1)
    h = tl.program_id(2)
    d = tl.arange(0, D)
    if s == S:
        for c0 in range(tl.load(KOFF + S) + nb * BN, NK, tl.num_programs(1) * BN):
            cols = c0 + tl.arange(0, BN)
            at = cols[:, None] * (H * D) + h * D + d[None, :]
            tl.store(DK + at, tl.zeros([BN, D], DK.dtype.element_ty), mask=(cols < NK)[:, None])
            tl.store(DV + at, tl.zeros([BN, D], DV.dtype.element_ty), mask=(cols < NK)[:, None])
    else:
        q0 = tl.load(QOFF + s)
        q_len = tl.load(QOFF + s + 1) - q0
        k0 = tl.load(KOFF + s)
        k_len = tl.load(KOFF + s + 1) - k0
        todo = k_len
        if SHORT:
            todo = tl.where((q_len <= BM) & (k_len <= BN), 0, k_len)
        if nb * BN < todo:
            cols = nb * BN + tl.arange(0, BN)
            cmask = cols < k_len
            k = tl.load(K + h * skh + (k0 + cols)[:, None] * skn + d[None, :], mask=cmask[:, None], other=0.0)
            v = tl.load(V + h * svh + (k0 + cols)[:, None] * svn + d[None, :], mask=cmask[:, None], other=0.0)
            dk = tl.zeros([BN, D], tl.float32)
            dv = tl.zeros([BN, D], tl.float32)
            start = 0
            if CAUSAL:
                start = (nb * BN // BM) * BM
            for m0 in range(start, q_len, BM):
                rows = m0 + tl.arange(0, BM)
                rmask = rows < q_len
                q = tl.load(Q + h * sqh + (q0 + rows)[:, None] * sqn + d[None, :], mask=rmask[:, None], other=0.0)
                do = tl.load(DO + h * sdoh + (q0 + rows)[:, None] * sdon + d[None, :], mask=rmask[:, None],
                             other=0.0)
                lse = tl.load(LSE + h * NQ + q0 + rows, mask=rmask, other=float("inf"))
                delta = tl.load(DELTA + h * NQ + q0 + rows, mask=rmask, other=0.0)
                seen = cmask[None, :] & rmask[:, None]
                if CAUSAL:
                    seen = seen & (cols[None, :] <= rows[:, None])
                p = tl.where(seen, tl.exp2(tl.dot(q, tl.trans(k), input_precision=PREC) * LOG2E - lse[:, None]), 0.0)
                dp = tl.dot(do, tl.trans(v), input_precision=PREC)
                kept = p
                if DROPOUT:
                    keep = tl.rand(tl.load(SEED), (h * NQ + q0 + rows)[:, None] * MAXK + cols[None, :]) >= p_drop
                    kept = tl.where(keep, p * drop_scale, 0.0)
                    dp = tl.where(keep, dp * drop_scale, 0.0)
                dv += tl.dot(tl.trans(kept.to(do.dtype)), do, input_precision=PREC)
                ds = p * (dp - delta[:, None])
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC)
            at = (k0 + cols)[:, None] * (H * D) + h * D + d[None, :]
            tl.store(DK + at, dk.to(DK.dtype.element_ty), mask=cmask[:, None])
            tl.store(DV + at, dv.to(DV.dtype.element_ty), mask=cmask[:, None])


@triton.jit(do_not_specialize=["NQ", "S", "MAXK"])
def _bwd_short(Q, K, V, DO, DQ, DK, DV, LSE, QOFF, KOFF, SEED,
               sqh, sqn, skh, skn, svh, svn, sdoh, sdon,
               NQ, S, MAXK, p_drop, drop_scale,
               H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr):
    """The whole backward of a segment whose queries and keys fit one tile each (ByteTransformer's and
    MLPerf BERT's short-row attention): a program per (segment, head) computes the probabilities and dP
    once and gives dq, dk and dv from them, where the two kernels above compute them three times."""
    s = tl.program_id(0)
    h = tl.program_id(2)
    d = tl.arange(0, D)
    q0 = tl.load(QOFF + s)
    q_len = tl.load(QOFF + s + 1) - q0
    k0 = tl.load(KOFF + s)
    k_len = tl.load(KOFF + s + 1) - k0
    if (q_len <= BM) & (k_len <= BN):
        rows = tl.arange(0, BM)
        cols = tl.arange(0, BN)
        rmask = rows < q_len
        cmask = cols < k_len
        q = tl.load(Q + h * sqh + (q0 + rows)[:, None] * sqn + d[None, :], mask=rmask[:, None], other=0.0)
        do = tl.load(DO + h * sdoh + (q0 + rows)[:, None] * sdon + d[None, :], mask=rmask[:, None], other=0.0)
        k = tl.load(K + h * skh + (k0 + cols)[:, None] * skn + d[None, :], mask=cmask[:, None], other=0.0)
        v = tl.load(V + h * svh + (k0 + cols)[:, None] * svn + d[None, :], mask=cmask[:, None], other=0.0)
        lse = tl.load(LSE + h * NQ + q0 + rows, mask=rmask, other=float("inf"))
        seen = cmask[None, :] & rmask[:, None]
        if CAUSAL:
            seen = seen & (cols[None, :] <= rows[:, None])
        p = tl.where(seen, tl.exp2(tl.dot(q, tl.trans(k), input_precision=PREC) * LOG2E - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        kept = p
        if DROPOUT:
            keep = tl.rand(tl.load(SEED), (h * NQ + q0 + rows)[:, None] * MAXK + cols[None, :]) >= p_drop
            kept = tl.where(keep, p * drop_scale, 0.0)
            dp = tl.where(keep, dp * drop_scale, 0.0)
        ds = p * (dp - tl.sum(p * dp, 1)[:, None])
        dq = tl.dot(ds.to(k.dtype), k, input_precision=PREC)
        dk = tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC)
        dv = tl.dot(tl.trans(kept.to(do.dtype)), do, input_precision=PREC)
        tl.store(DQ + (q0 + rows)[:, None] * (H * D) + h * D + d[None, :], dq.to(DQ.dtype.element_ty),
                 mask=rmask[:, None])
        at = (k0 + cols)[:, None] * (H * D) + h * D + d[None, :]
        tl.store(DK + at, dk.to(DK.dtype.element_ty), mask=cmask[:, None])
        tl.store(DV + at, dv.to(DV.dtype.element_ty), mask=cmask[:, None])


@triton.jit
def _keep(KEEP, QOFF, KOFF, SEED, NQ, NK, S, MAXK, p_drop, H: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """The keep-mask [heads, NQ, NK] (bytes) the kernels draw, for the tests' oracle: a program per
    (segment, block of query rows, head) writes its rows' keys of its segment."""
    s = tl.program_id(0)
    mb = tl.program_id(1)
    h = tl.program_id(2)
    q0 = tl.load(QOFF + s)
    q_len = tl.load(QOFF + s + 1) - q0
    k0 = tl.load(KOFF + s)
    k_len = tl.load(KOFF + s + 1) - k0
    rows = mb * BM + tl.arange(0, BM)
    for n0 in range(0, k_len, BN):
        cols = n0 + tl.arange(0, BN)
        keep = tl.rand(tl.load(SEED), (h * NQ + q0 + rows)[:, None] * MAXK + cols[None, :]) >= p_drop
        tl.store(KEEP + (h * NQ + q0 + rows)[:, None] * NK + k0 + cols[None, :], keep.to(tl.int8),
                 mask=(rows < q_len)[:, None] & (cols < k_len)[None, :])


# Segments within one tile each way take _bwd_short (one kernel, the probabilities computed once) instead
# of the dq and dk/dv kernels where LS_FAIRSEQ_TRITON_SHORT_BACKWARD=1, with tiles of 64 rows, so that
# nearly every WMT sentence fits one: 0.33 against 0.46 ms a layer forward + backward with 32-row tiles
# and two kernels (scripts/bench_segment_attention.py, H200, 2026-12-06); with 32-row tiles it was
# slower for causal attention. Off until its training benchmark and GPU tests at 64 rows.
SHORT_BACKWARD = os.environ.get("LS_FAIRSEQ_TRITON_SHORT_BACKWARD") == "1"


def block_rows(rows, segments):
    """The tile's rows (query rows of a program, keys of a step): 32 for streams of short segments
    (WMT's ~30-token sentences fill one such tile), 64 where segments average 48 rows or more, and 64
    with the one-kernel short backward. From the stream's shape alone (a host int each), so that a CUDA
    graph's shape fixes it."""
    return 64 if SHORT_BACKWARD or rows >= 48 * segments else 32


def fits(q, k, v, mask):
    """Whether these kernels run these inputs: CUDA (or the CPU's interpreter) tensors of fp16, bf16
    or fp32, d_head a power of two from 16 to 128, rows of d_head contiguous, and the keep-mask's
    Philox counter (heads x query rows x max keys) within int32."""
    D = q.shape[-1]
    return (q.dtype in (torch.float16, torch.bfloat16, torch.float32) and k.dtype == v.dtype == q.dtype
            and 16 <= D <= 128 and D & (D - 1) == 0 and all(t.stride(-1) == 1 for t in (q, k, v))
            and q.shape[1] * q.shape[2] * mask.max_k < 2**31)


def _common(q, mask, block):
    _, H, NQ, D = q.shape
    S = mask.segments
    B = block or block_rows(NQ, S)
    return H, NQ, D, S, B, dict(H=H, D=D, BM=B, BN=B, CAUSAL=mask.causal,
                                PREC="ieee" if q.dtype == torch.float32 else None)


def _launch(kernel, grid, *args, **constants):
    kernel[grid](*args, **constants)


def _dropout_arguments(p):
    return float(p), (1.0 / (1.0 - p)) if p < 1 else 0.0


def forward(q, k, v, mask, p, seed, block=None):
    """(out [1, heads, Nq, d_head], a view of token-major [Nq, heads, d_head] storage; the log-sum-exp
    [heads, Nq] fp32 in base 2) of attention inside ``mask``'s segments (a SegmentMask), dropout ``p``
    drawn from ``seed`` (an int64 tensor [1] on the device; any tensor without dropout)."""
    H, NQ, D, S, B, constants = _common(q, mask, block)
    out = torch.empty(NQ, H, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(H, NQ, dtype=torch.float32, device=q.device)
    _launch(_fwd, (S + 1, triton.cdiv(mask.max_q, B), H),
            q, k, v, out, lse, mask.q_offsets, mask.k_offsets, seed,
            q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2),
            NQ, S, mask.max_k, *_dropout_arguments(p), DROPOUT=p > 0, **constants)
    return out.unsqueeze(0).transpose(1, 2), lse


def backward(dout, q, k, v, lse, mask, p, seed, block=None):
    """(dq, dk, dv), each [1, heads, rows, d_head] of token-major storage, the tail rows zero."""
    H, NQ, D, S, B, constants = _common(q, mask, block)
    NK = k.shape[2]
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    dq = torch.empty(NQ, H, D, dtype=q.dtype, device=q.device)
    dk = torch.empty(NK, H, D, dtype=k.dtype, device=q.device)
    dv = torch.empty(NK, H, D, dtype=v.dtype, device=q.device)
    delta = torch.empty(H, NQ, dtype=torch.float32, device=q.device)
    strides = (q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2),
               dout.stride(1), dout.stride(2))
    dropout = _dropout_arguments(p)
    short = SHORT_BACKWARD
    if short:
        _launch(_bwd_short, (S, 1, H), q, k, v, dout, dq, dk, dv, lse, mask.q_offsets, mask.k_offsets, seed,
                *strides, NQ, S, mask.max_k, *dropout, DROPOUT=p > 0, **constants)
    _launch(_bwd_dq, (S + 1, triton.cdiv(mask.max_q, B), H),
            q, k, v, dout, dq, lse, delta, mask.q_offsets, mask.k_offsets, seed, *strides,
            NQ, S, mask.max_k, *dropout, DROPOUT=p > 0, SHORT=short, **constants)
    _launch(_bwd_dkv, (S + 1, triton.cdiv(mask.max_k, B), H),
            q, k, v, dout, dk, dv, lse, delta, mask.q_offsets, mask.k_offsets, seed, *strides,
            NQ, NK, S, mask.max_k, *dropout, DROPOUT=p > 0, SHORT=short, **constants)
    return tuple(g.unsqueeze(0).transpose(1, 2) for g in (dq, dk, dv))


def keep_mask(q, k, mask, p, seed):
    """The keep-mask [1, heads, Nq, Nk] (bool) the kernels draw with ``seed`` over ``mask``'s segments
    (False outside them): the tests' oracle applies it."""
    H, NQ, _, S, B, _ = _common(q, mask, None)
    NK = k.shape[2]
    keep = torch.zeros(H, NQ, NK, dtype=torch.int8, device=q.device)
    _launch(_keep, (S, triton.cdiv(mask.max_q, B), H),
            keep, mask.q_offsets, mask.k_offsets, seed, NQ, NK, S, mask.max_k, float(p), H=H, BM=B, BN=B)
    return keep.bool().unsqueeze(0)
