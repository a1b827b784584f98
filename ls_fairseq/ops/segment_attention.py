"""Attention inside the segments of packed token streams (training without padding).

A packed batch holds each side's real tokens as one stream of rows, sentence after
sentence; ``offsets`` (int32, on the device, [segments + 1]) say where each sentence
starts, and the rows after the last offset (the tail, up to the stream's capacity)
belong to no sentence. q [1, heads, Nq, d_head] and k, v [1, heads, Nk, d_head] are
split_heads' outputs of such streams; query row i of segment s sees the keys of
segment s (and, ``causal``, only those at or before its own place in the segment).
The output has q's shape, laid out as [1, Nq, heads, d_head] storage (so the out
projection merges its heads as a view), with the tail rows exactly zero.

Three paths:
- triton (``SegmentMask(triton=True)``, as the packed step's masks are made): ls's Triton kernels
  (ls_fairseq/triton_kernels/segment_attention.py) read q, k and v by stride and the offsets, a
  program per (segment, block of query rows, head), nothing padded or gathered, no atomics; dropout
  (drawn again in the backward), ``deterministic`` and the fp32 row term always. On CUDA where
  triton is installed, unless the op is forced onto its reference; on the CPU only where a test asks
  for Triton's interpreter (``INTERPRET``). Wherever it does not run, the two paths below do;
- blocks (every device; the CPU's path): each segment's rows are gathered into a
  block of ``max_q`` (``max_k``) rows (on the CPU the batch's own longest segments,
  SegmentMask.block_lengths), [segments, heads, max, d_head], and the
  blocks go through ``ops.attention`` with a key padding mask: its fused kernel, the
  LightSeq path or SDPA on the GPU, its reference on the CPU. So attention dropout,
  ``deterministic`` and the fp32 row term (``exact_row_term``) are honoured as in the
  padded step; the padding of the blocks costs attention FLOPs only, never a GEMM's.
  Every block row sees at least the block's first key (an empty segment too), so no
  softmax row is fully masked and every gradient stays finite.
- varlen (CUDA, fp16/bf16): torch's FlashAttention over the offsets
  (``torch.nn.attention.varlen.varlen_attn``), no padding at all. It has no dropout,
  its backward adds with atomics and forms the softmax's row term from the 16-bit
  output, so it is taken only without attention dropout, outside deterministic mode
  and where the exact row term is not asked for; the blocks path runs otherwise. It
  leaves the tail rows of its output and of its gradients unwritten: they are set to
  zero here.
``LS_FAIRSEQ_REFERENCE=segment_attention`` keeps the GPU on the blocks path (SEGMENT_ATTENTION_ROUTE).
Each path logs once, at its first call for each kind of attention, that it runs.
"""
import functools
import inspect
import logging

import torch

from ls_fairseq.ops import dispatch
from ls_fairseq.ops.attention import AttentionMask, attention

try:  # torch >= 2.10, CUDA only
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _log_path(path, kind):
    logger.info("segment_attention: %s through the %s path", kind, path)


def _kind(mask):
    if mask.causal:
        return "causal self-attention"
    return "self-attention" if mask.q_offsets is mask.k_offsets else "cross-attention"


@functools.lru_cache(maxsize=None)
def _triton_kernels():
    """The Triton kernels' module, imported at the first call that takes them (triton is imported only
    then), or None where triton is not installed."""
    try:
        from ls_fairseq.triton_kernels import segment_attention as kernels
    except ImportError:
        return None
    return kernels


# Tests set this to run the Triton path on CPU tensors, in Triton's interpreter (which needs
# TRITON_INTERPRET=1 in the environment before triton is imported; tests/conftest.py sets it).
INTERPRET = False


def triton_runs(q, k, v, mask):
    """Whether the Triton path runs: asked for (``mask.triton``), triton installed, CUDA tensors and the op
    not forced onto its reference (CPU tensors: ``INTERPRET``), and shapes the kernels take."""
    if not mask.triton:
        return False
    on_device = (q.is_cuda and not dispatch.forced_reference("segment_attention")) or (not q.is_cuda and INTERPRET)
    return on_device and _triton_kernels() is not None and _triton_kernels().fits(q, k, v, mask)


class TritonSegmentAttention(torch.autograd.Function):
    """The Triton kernels' attention: keeps q, k, v, the log-sum-exps and the dropout's seed (the backward
    draws the keep-mask again). Its backward always forms the fp32 row term (exact_row_term's)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, p):
        # torch's generator draws the seed (so --seed fixes it), on the device (so a CUDA graph draws anew)
        seed = torch.randint(2**62, (1,), device=q.device) if p > 0 else mask.q_offsets
        out, lse = _triton_kernels().forward(q, k, v, mask, p, seed)
        ctx.save_for_backward(q, k, v, lse, seed)
        ctx.mask, ctx.p = mask, p
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, lse, seed = ctx.saved_tensors
        dq, dk, dv = _triton_kernels().backward(dout, q, k, v, lse, ctx.mask, ctx.p, seed)
        return dq, dk, dv, None, None


@functools.lru_cache(maxsize=None)
def _causal_arguments(function):
    """``function``'s (varlen_attn's) causal argument: ``window_size=(-1, 0)`` (torch >= 2.11) or
    ``is_causal=True`` (2.10); read once, not at every attention call."""
    parameters = inspect.signature(function).parameters
    return {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}


def _rows(x):
    """[1, heads, N, d_head] -> [N, heads, d_head] (a view)."""
    return x[0].transpose(0, 1)


def _as_heads(rows):
    """[N, heads, d_head] -> [1, heads, N, d_head], a view of the rows' storage."""
    return rows.unsqueeze(0).transpose(1, 2)


def blocks_attention(q, k, v, mask, p, training, deterministic, exact_row_term):
    q_index, k_index, hidden, keyless, unpack = mask.blocks(q.shape[2])
    S, H, D = mask.segments, q.shape[1], q.shape[3]

    def gather(x, index, length):
        return _rows(x).index_select(0, index).view(S, length, H, D).transpose(1, 2)

    max_q, max_k = mask.block_lengths()
    blocks_mask = AttentionMask(hidden, causal=mask.causal, right_padded=True)
    out = attention(gather(q, q_index, max_q), gather(k, k_index, max_k), gather(v, k_index, max_k),
                    blocks_mask, p, training, deterministic, exact_row_term)
    rows = torch.where(keyless, 0.0, out).transpose(1, 2).reshape(S * max_q, H, D).index_select(0, unpack)
    return _as_heads(torch.where(mask.tail(rows.shape[0])[:, None, None], 0.0, rows))


class _TailGradZeroed(torch.autograd.Function):
    """The rows [N, heads, d_head] as they are; backward zeroes the gradient's rows at ``tail`` (bool [N]).
    FlashAttention's varlen backward makes dq, dk and dv with torch.empty and writes only the rows inside
    the offsets, so their tail rows hold whatever the memory held."""

    @staticmethod
    def forward(ctx, rows, tail):
        ctx.save_for_backward(tail)
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad):
        (tail,) = ctx.saved_tensors
        return torch.where(tail[:, None, None], 0.0, grad), None


def _varlen_attention(q, k, v, mask):
    causal = _causal_arguments(varlen_attn) if mask.causal else {}
    q_tail, k_tail = mask.tail(q.shape[2]), mask.tail(k.shape[2], keys=True)
    q_rows, k_rows, v_rows = (dispatch.run(_TailGradZeroed, _rows(x), tail).contiguous()
                              for x, tail in ((q, q_tail), (k, k_tail), (v, k_tail)))
    rows = varlen_attn(q_rows, k_rows, v_rows, mask.q_offsets, mask.k_offsets, mask.max_q, mask.max_k, scale=1.0,
                       **causal)
    # FlashAttention leaves the tail unwritten: whatever the memory held there must not reach a gradient
    return _as_heads(torch.where(q_tail[:, None, None], 0.0, rows))


# the kernel side is torch's varlen FlashAttention (where varlen_fits), the reference side the blocks path
SEGMENT_ATTENTION_ROUTE = dispatch.Route(
    "segment_attention",
    kernel=_varlen_attention if varlen_attn is not None else None,
    reference=blocks_attention,
)


def varlen_fits(q, p, training, deterministic, exact_row_term):
    """Whether the varlen (FlashAttention) path runs: the route picks the kernel side (CUDA, the op not
    forced onto its reference, torch's varlen_attn present), fp16/bf16, and nothing asked that it
    cannot give (see the module docstring)."""
    return (SEGMENT_ATTENTION_ROUTE.pick(q) is not blocks_attention and q.dtype in (torch.float16, torch.bfloat16)
            and (p == 0 or not training) and not deterministic and not exact_row_term)


def segment_attention(q, k, v, mask, p=0.0, training=True, deterministic=False, exact_row_term=False):
    """softmax(q k^T) v inside the segments of ``mask`` (a SegmentMask), dropout ``p`` on the
    probabilities; q [1, heads, Nq, d_head], k and v [1, heads, Nk, d_head] (any strides)."""
    if not (q.dim() == k.dim() == v.dim() == 4 and q.shape[0] == k.shape[0] == v.shape[0] == 1) or \
            q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2] or q.shape[1] != k.shape[1]:
        raise ValueError("segment_attention: q {}, k {}, v {} must be packed streams [1, heads, rows, d_head] with "
                         "matching heads, d_head and k/v rows".format(tuple(q.shape), tuple(k.shape), tuple(v.shape)))
    p = p if training else 0.0
    if triton_runs(q, k, v, mask):
        _log_path("triton", _kind(mask))
        return dispatch.run(TritonSegmentAttention, q, k, v, mask, p)
    if varlen_fits(q, p, training, deterministic, exact_row_term):
        _log_path("varlen", _kind(mask))
        return _varlen_attention(q, k, v, mask)
    _log_path("blocks" if varlen_attn is not None else "blocks (this torch has no varlen_attn)", _kind(mask))
    return blocks_attention(q, k, v, mask, p, training, deterministic, exact_row_term)


def segment_attention_reference(q, k, v, mask, p=0.0, training=True, dropout_mask=None):
    """The tests' oracle, independent of both paths: attention over the whole streams with a dense
    block-diagonal mask (a query sees the keys of its own segment; ``causal``: up to its place), computed
    in the inputs' dtype as PyTorch computes attention in it (fp16/bf16: each GEMM's and the softmax's
    result rounded to it, as ops.attention's reference does), so that in fp64 it is the exact oracle
    and in fp16/bf16 PyTorch's own error for the 2x rule; a row that sees no key (the tail, an empty
    segment) gives zeros. ``dropout_mask``: a keep-mask [1, heads, Nq, Nk]."""
    def segment_and_place(offsets, rows):
        r = torch.arange(rows, device=offsets.device)
        segment = torch.searchsorted(offsets[1:].long(), r, right=True)
        inside = segment < offsets.numel() - 1
        place = r - offsets[:-1].long()[segment.clamp(max=offsets.numel() - 2)]
        return torch.where(inside, segment, -1), place, inside

    sq, pq, iq = segment_and_place(mask.q_offsets, q.shape[2])
    sk, pk, ik = segment_and_place(mask.k_offsets, k.shape[2])
    seen = (sq[:, None] == sk[None, :]) & iq[:, None] & ik[None, :]
    if mask.causal:
        seen &= pk[None, :] <= pq[:, None]
    scores = torch.matmul(q, k.transpose(-1, -2)).masked_fill(~seen, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    if p > 0 and training:
        probs = dispatch.apply_dropout(probs, dropout_mask, p)
    return torch.matmul(probs, v)
