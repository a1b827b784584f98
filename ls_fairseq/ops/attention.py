"""Scaled dot-product attention over split heads: q, k, v [B, heads, T, d_head].

q arrives already scaled (the qkv op folds 1/sqrt(d_head) in). Three paths:
- the fused kernel (csrc/attention.cu) for the short rows of translation
  batches (fp16/bf16, d_head and both lengths within the extension's
  ``attention_head_dim`` / ``attention_max_len``): one block per (batch, head)
  runs both GEMMs, the masked softmax and dropout, never writing the Tq x Tk
  scores; its backward recomputes them from each row's log-sum-exp, forms the
  softmax's row term from the fp32 probabilities and dP, and adds nothing
  with atomics, so it is deterministic;
- the LightSeq path: GEMM (cuBLAS) -> fused masked softmax + dropout -> GEMM;
  the reference on CPU and the oracle everywhere (fp32 on CPU without dropout
  takes torch's scaled_dot_product_attention, the same function in one kernel). On the GPU, for rows beyond
  the fused kernel where SDPA is not taken (below), it keeps only q, k, v and
  the dropout's state: its backward runs the scores' GEMM and the softmax
  again (the same keep-bits), because keeping the probabilities costs two
  [B, heads, Tq, Tk] tensors a layer, which set the memory peak of batches of
  long sentences (docs/perf-log.md);
- torch's scaled_dot_product_attention for longer rows, which never writes the
  Tq x Tk scores either. Taken on CUDA unless the ``attention`` op is forced to
  the reference (LS_FAIRSEQ_REFERENCE), a deterministic training step is asked
  for (FlashAttention's backward accumulates dq with atomic adds, so two runs
  differ in the last bits; the LightSeq path's GEMMs and kernels do not), or
  the caller asks for the exact row term (``exact_row_term``): SDPA's backward
  forms the softmax's row term sum_j P_ij dP_ij as rowsum(dO * O) from the
  fp16/bf16 output, the fused kernel and the LightSeq path from the fp32
  probabilities and dP. ls_transformer asks for it in cross-attention, where
  stock fairseq computes the probabilities explicitly in fp32 (its
  self-attention goes through SDPA, as ours does beyond the fused kernel's
  rows), because SDPA's 16-bit row term gave the top decoder layer's
  cross-attention query gradients a larger error against fp64 than stock's
  (docs/perf-log.md). SDPA runs with its FlashAttention and memory-efficient
  kernels only: torch prefers cuDNN's attention on Hopper, which builds an
  execution plan on the host for every new batch shape, so a first epoch,
  where nearly every batch has a new shape, ran several times slower than the
  next.
"""
import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

try:  # torch >= 2.3; older versions have no cuDNN attention to avoid
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def _backends():
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

except ImportError:
    _backends = contextlib.nullcontext

from ls_fairseq.ops import dispatch
from ls_fairseq.ops.dispatch import _C
from ls_fairseq.ops.softmax import SOFTMAX_ROUTE, lse_dtype, softmax


class AttentionMask:
    """Which keys each query may see, for every layer of one forward pass: key padding
    (``key_padding_mask`` [batch, keys], True = pad) and/or ``causal``.

    Built once per forward and shared by the layers, so the GPU path builds its
    additive mask once (in storage aligned for the memory-efficient kernel, so
    torch does not pad a copy per call) instead of once per layer and call.
    ``right_padded``: padding only at the end of each row (fairseq's targets,
    unless --left-pad-target). With ``causal`` no real query can then see a pad
    key, so the padding mask is dropped and the GPU path runs the plain causal
    (FlashAttention) kernel; the pad query rows, whose outputs fairseq ignores,
    see the pad keys before them.
    """

    def __init__(self, key_padding_mask=None, causal=False, right_padded=False):
        self.key_padding_mask = None if causal and right_padded else key_padding_mask
        self.causal = causal
        self._sdpa = {}

    def sdpa_arguments(self, Tq, Tk, dtype, device):
        """(attn_mask, is_causal) for scaled_dot_product_attention, made once per shape and dtype."""
        key = (Tq, Tk, dtype, device)
        if key not in self._sdpa:
            self._sdpa[key] = self._make_sdpa_arguments(Tq, Tk, dtype, device)
        return self._sdpa[key]

    def refresh(self):
        """After new values were copied into ``key_padding_mask`` in place: the additive masks made so
        far are made again where they are (a CUDA graph that read them reads the new ones)."""
        for (Tq, Tk, dtype, device), (mask, _) in self._sdpa.items():
            if mask is not None:
                mask.zero_().masked_fill_(self._hidden(Tq, Tk, device), float("-inf"))

    def _hidden(self, Tq, Tk, device):
        """Where a query of Tq may not see a key of Tk (broadcastable to [batch, 1, Tq, Tk]), None for
        nowhere."""
        kpm = self.key_padding_mask
        if not self.causal or (kpm is None and Tq == Tk):
            return None if kpm is None else kpm.bool()[:, None, None, :]
        # causal with padding, or with a cache (Tq < Tk): query i sees keys j <= i + Tk - Tq
        i = torch.arange(Tq, device=device)[:, None]
        hidden = torch.arange(Tk, device=device)[None, :] > i + (Tk - Tq)
        return hidden if kpm is None else hidden | kpm.bool()[:, None, None, :]

    def _make_sdpa_arguments(self, Tq, Tk, dtype, device):
        hidden = self._hidden(Tq, Tk, device)
        if hidden is None:
            return None, self.causal
        aligned = torch.zeros(hidden.shape[:-1] + ((Tk + 15) // 16 * 16,), dtype=dtype, device=device)
        mask = aligned[..., :Tk]
        mask.masked_fill_(hidden, float("-inf"))
        return mask, False


class DenseMask:
    """An arbitrary mask of every (query, key) pair: ``mask`` [batch, 1 or heads, Tq, Tk], boolean (True: the
    query may attend the key) or additive (added to the scores: 0, or a large negative number), as Hugging Face
    hands its layers a mask it could not leave to a key padding mask (packed sequences, a custom 4D mask). The
    general path: torch's scaled_dot_product_attention takes it as it is on every device (no kernel of ours
    reads a dense mask), so it computes what Hugging Face's sdpa (boolean) or eager (additive) attention does."""

    def __init__(self, mask):
        if not torch.is_tensor(mask) or mask.dim() != 4:
            raise ValueError("DenseMask: the mask must be a 4D tensor [batch, 1 or heads, Tq, Tk], got {}".format(
                tuple(mask.shape) if torch.is_tensor(mask) else type(mask).__name__))
        self.mask = mask


class SegmentMask:
    """Segments of a query stream and a key stream: ``q_offsets``, ``k_offsets`` int32 [segments + 1]
    (segment s: query rows q_offsets[s] .. q_offsets[s + 1], keys k_offsets[s] .. k_offsets[s + 1]);
    ``max_q``, ``max_k``: host ints at least every segment's length (a CUDA graph fixes them per
    stream capacity); ``causal``: a query sees the keys up to its own place (self-attention: q and k
    the same stream); ``triton``: segment_attention takes its Triton kernels (on CUDA; on the CPU under
    Triton's interpreter) instead of varlen or the blocks path. The blocks path's indices are made once
    per forward and shared by the layers."""

    def __init__(self, q_offsets, k_offsets, max_q, max_k, causal=False, triton=False):
        if q_offsets.dim() != 1 or q_offsets.shape != k_offsets.shape or q_offsets.numel() < 2:
            raise ValueError("SegmentMask: offsets {} and {} must be [segments + 1] each, with at least one segment"
                             .format(tuple(q_offsets.shape), tuple(k_offsets.shape)))
        if max_q < 1 or max_k < 1:
            raise ValueError("SegmentMask: max_q {} and max_k {} must be at least 1".format(max_q, max_k))
        if causal and (q_offsets is not k_offsets or max_q != max_k):
            raise ValueError("SegmentMask: causal attention is self-attention: one stream's offsets for q and k")
        self.q_offsets, self.k_offsets = q_offsets, k_offsets
        self.max_q, self.max_k, self.causal, self.triton = int(max_q), int(max_k), causal, triton
        self._blocks = {}
        self._block_lengths = None

    @property
    def segments(self):
        return self.q_offsets.numel() - 1

    def tail(self, rows, keys=False):
        """Which of the query stream's ``rows`` rows (``keys``: the key stream's) lie past the last segment,
        bool [rows]."""
        offsets = self.k_offsets if keys else self.q_offsets
        return torch.arange(rows, device=offsets.device) >= offsets[-1]

    def block_lengths(self):
        """(query rows, keys) of the blocks path's blocks: ``max_q`` and ``max_k`` on the GPU (no host
        synchronisation; a CUDA graph's shapes), the batch's own longest segments on the CPU, where the
        packing buckets' longest sentences made the blocks several times larger than the batch's (a
        packed step ran 3-4x slower than the padded one)."""
        if self.q_offsets.is_cuda:
            return self.max_q, self.max_k
        if self._block_lengths is None:
            self._block_lengths = tuple(max(1, int((o[1:] - o[:-1]).max())) for o in (self.q_offsets, self.k_offsets))
        return self._block_lengths

    def blocks(self, nq):
        """(q_index, k_index [segments x max rows], key padding mask [segments, max_k], keyless [segments,
        1, 1, 1], unpack [nq]) of the blocks path for a query stream of ``nq`` rows, made once: block row j
        of segment s holds stream row offsets[s] + j (row 0 past the segment's end, masked as a key,
        dropped as a query); keyless: the segments without keys, whose queries get zeros; unpack gives
        each stream row its place in the flattened query blocks (0 for the tail)."""
        if nq not in self._blocks:
            max_q, max_k = self.block_lengths()
            q_index, _ = _block_rows(self.q_offsets, max_q)
            k_index, k_valid = _block_rows(self.k_offsets, max_k)
            keyless = ~k_valid[:, 0, None, None, None]
            hidden = ~k_valid
            hidden[:, 0] = False  # every row sees a key, so every softmax row is finite (keyless ones are zeroed)
            rows = torch.arange(nq, device=self.q_offsets.device)
            starts = self.q_offsets[:-1].long()
            segment = torch.searchsorted(self.q_offsets[1:].long(), rows, right=True).clamp_(max=self.segments - 1)
            unpack = torch.where(self.tail(nq), 0, segment * max_q + rows - starts[segment])
            self._blocks[nq] = (q_index.reshape(-1), k_index.reshape(-1), hidden, keyless, unpack)
        return self._blocks[nq]


def _block_rows(offsets, length):
    """(stream row of every block slot [segments, length], int64, row 0 where invalid; valid slots)."""
    starts = offsets[:-1].long()[:, None]
    j = torch.arange(length, device=offsets.device)[None, :]
    valid = j < offsets[1:].long()[:, None] - starts
    return torch.where(valid, starts + j, 0), valid


class ScoresFunction(torch.autograd.Function):
    """q k^T over [B, heads, T, d_head]. Backward gives dk = dS^T q as [B, heads, Tk, d_head] rows
    (a batched GEMM's own output), where matmul's autograd gives the transpose of q^T dS, whose
    d_head is strided: the qkv op's backward would copy it (a kernel per cross-attention layer)."""

    @staticmethod
    def forward(ctx, q, k):
        ctx.save_for_backward(q, k)
        return torch.matmul(q, k.transpose(-1, -2))

    @staticmethod
    def backward(ctx, ds):
        q, k = ctx.saved_tensors
        dq = torch.matmul(ds, k) if ctx.needs_input_grad[0] else None
        dk = torch.matmul(ds.transpose(-1, -2), q) if ctx.needs_input_grad[1] else None
        return dq, dk


def _fully_masked_row(mask, Tq, Tk):
    """Whether some query row of ``mask`` (an AttentionMask or None) sees no key. Under the causal mask
    query i sees keys j <= i + Tk - Tq, so the first row sees the fewest: keys 0 .. Tk - Tq."""
    kpm, causal = (mask.key_padding_mask, mask.causal) if mask is not None else (None, False)
    if causal and Tq > Tk:
        return True
    if kpm is None:
        return False
    return bool(kpm[:, : Tk - Tq + 1 if causal else Tk].bool().all(-1).any())


def attention_reference(q, k, v, mask=None, p=0.0, training=True, dropout_mask=None):
    if (q.device.type == "cpu" and q.dtype == torch.float32 and (p == 0 or not training)
            and not _fully_masked_row(mask, q.shape[-2], k.shape[-2])):
        # fp32 on CPU without dropout: torch's fused attention computes this function in one kernel
        # a direction (never writing the Tq x Tk probabilities), its backward's softmax row term
        # rowsum(dO * O) in fp32 as well; a row that sees no key (zeros here) stays on the path below
        attn_mask, is_causal = (mask.sdpa_arguments(q.shape[-2], k.shape[-2], q.dtype, q.device) if mask is not None
                                else (None, False))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=1.0)
    scores = dispatch.run(ScoresFunction, q, k)
    kpm, causal = (mask.key_padding_mask, mask.causal) if mask is not None else (None, False)
    probs = softmax(scores, kpm, causal, p, training, dropout_mask)
    return torch.matmul(probs, v)


# the kernel side is the fused kernel's pair (AttentionFunction) where the rows fit it, else the LightSeq path
# (SOFTMAX_ROUTE's kernels between cuBLAS GEMMs) or torch's scaled_dot_product_attention; the reference side is
# attention_reference as a whole
ATTENTION_ROUTE = dispatch.Route(
    "attention",
    kernel=(_C.attention_forward, _C.attention_backward) if _C else None,
    reference=attention_reference,
)


class AttentionFunction(torch.autograd.Function):
    """The fused kernel's attention (``kernel``: ATTENTION_ROUTE's pair): saves q, k, v and each query
    row's log-sum-exp (the output's consumer, the out projection, keeps the output itself)."""

    @staticmethod
    def forward(ctx, q, k, v, key_padding_mask, causal, p, kernel):
        fwd, ctx.bwd = kernel
        out, lse, dropout = fwd(q, k, v, key_padding_mask, causal, p)
        ctx.save_for_backward(q, k, v, lse, key_padding_mask)
        ctx.causal, ctx.p, ctx.dropout = causal, p, dropout
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, lse, key_padding_mask = ctx.saved_tensors
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()
        dq, dk, dv = ctx.bwd(dout, q, k, v, lse, key_padding_mask, ctx.causal, ctx.dropout, ctx.p)
        return dq, dk, dv, None, None, None, None


def _keep_mask(dropout):
    """The keep-mask a forward's dropout applied (None without dropout): the reference's mask
    itself, or the kernel's keep-bits drawn again into bytes."""
    return dropout if dropout is None or torch.is_tensor(dropout) else dropout.mask()


class RecomputedAttentionFunction(torch.autograd.Function):
    """The LightSeq path keeping q, k, v and the dropout's state only: the backward computes the
    scores and the softmax again, giving the same probabilities (the same GEMM and kernel on the
    same inputs) and the forward's dropout (its keep-mask given back to the softmax)."""

    @staticmethod
    def forward(ctx, q, k, v, key_padding_mask, causal, p):
        fwd, bwd = SOFTMAX_ROUTE.pick(q)
        dropped, _, dropout = fwd(torch.matmul(q, k.transpose(-1, -2)), key_padding_mask, causal, p, None)
        ctx.fwd, ctx.bwd, ctx.causal, ctx.p = fwd, bwd, causal, p
        dispatch.save_with_dropout(ctx, (q, k, v, key_padding_mask), dropout)
        return torch.matmul(dropped, v)

    @staticmethod
    def backward(ctx, dout):
        (q, k, v, key_padding_mask), dropout = dispatch.saved_with_dropout(ctx)
        scores = torch.matmul(q, k.transpose(-1, -2))
        dropped, lse, given = ctx.fwd(scores, key_padding_mask, ctx.causal, ctx.p, _keep_mask(dropout))
        dv = torch.matmul(dropped.transpose(-1, -2), dout)
        ds = ctx.bwd(torch.matmul(dout, v.transpose(-1, -2)), scores, lse, key_padding_mask, ctx.causal, given, ctx.p)
        # dk as [B, heads, Tk, d_head] rows (as ScoresFunction gives it)
        return torch.matmul(ds, k), torch.matmul(ds.transpose(-1, -2), q), dv, None, None, None


def _fused_kernel_fits(q, k, v):
    """Whether the fused kernel runs these inputs: 16-bit, its d_head, rows of d_head contiguous at
    16-byte boundaries (any strides over batch, heads and length), both lengths within its rows."""
    rows_aligned = all(t.stride(-1) == 1 and all(s % 8 == 0 for s in t.stride()[:-1]) and t.data_ptr() % 16 == 0
                       for t in (q, k, v))
    return (q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] == _C.attention_head_dim and rows_aligned
            and 1 <= q.shape[-2] <= _C.attention_max_len and 1 <= k.shape[-2] <= _C.attention_max_len)


_refuse_segments = dispatch.refusal("attention: segment_attention (a SegmentMask: the packed training step) is not "
                                    "supported under torch.compile")


def attention(q, k, v, mask=None, p=0.0, training=True, deterministic=False, exact_row_term=False):
    """softmax(q k^T + masks) v with dropout ``p`` on the probabilities; ``mask`` an AttentionMask, a
    SegmentMask for packed streams (ops.segment_attention) or a DenseMask (torch's SDPA with it);
    ``deterministic``: bit-identical results run to run, in training too; ``exact_row_term``: the
    backward forms the softmax's row term from fp32 probabilities (the fused kernel where the rows
    fit, the LightSeq path beyond them; never SDPA)."""
    if not (q.dim() == k.dim() == v.dim() == 4) or q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ValueError(
            "attention: q {}, k {}, v {} must be [batch, heads, len, d_head] with matching d_head and k/v lengths".format(
                tuple(q.shape), tuple(k.shape), tuple(v.shape)
            )
        )
    if isinstance(mask, SegmentMask):
        from ls_fairseq.ops.segment_attention import segment_attention  # the packed step's op (imports this module)

        if dispatch.compiling():
            _refuse_segments(q)
        return segment_attention(q, k, v, mask, p, training, deterministic, exact_row_term)
    p = p if training else 0.0
    if isinstance(mask, DenseMask):
        dense = mask.mask if mask.mask.dtype == torch.bool else mask.mask.to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, dropout_p=p, scale=1.0)
    if dispatch.compiling():
        kpm, causal = (mask.key_padding_mask, mask.causal) if mask is not None else (None, False)
        keep = dispatch.dropout_mask(q.shape[:-1] + k.shape[-2:-1], p, q.device) if p > 0 else None
        return attention_forward_op(q, k, v, kpm, causal, p, keep)[0]
    picked = ATTENTION_ROUTE.pick(q)
    if picked is attention_reference:
        return attention_reference(q, k, v, mask, p, training)
    kpm, causal = (mask.key_padding_mask, mask.causal) if mask is not None else (None, False)
    if _fused_kernel_fits(q, k, v):
        return dispatch.run(AttentionFunction, q, k, v, kpm, causal, p, picked)
    if exact_row_term or (deterministic and training):
        return dispatch.run(RecomputedAttentionFunction, q, k, v, kpm, causal, p)
    attn_mask, is_causal = mask.sdpa_arguments(q.shape[-2], k.shape[-2], q.dtype, q.device) if mask else (None, False)
    with _backends():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p, is_causal=is_causal, scale=1.0)


# torch.compile's path: two custom ops. Without dropout, the fused kernel where it runs these
# inputs (its alignment checked at run time); else, and with dropout (whose keep-mask [B, heads, Tq,
# Tk] the graph draws and gives to both), the LightSeq path: a GEMM, the softmax route's forward (the
# backward computes it again, as RecomputedAttentionFunction does) and a GEMM. Exact row term and
# deterministic on every path; SDPA is not used. Outputs and input gradients token-major, as the
# fused kernel gives them.


def _fused(q, k, v, mask):
    return mask is None and dispatch.use_kernel("attention", q) and _fused_kernel_fits(q, k, v)


def _token_major(t):
    """t [B, heads, T, d] in a token-major copy (rows of [B, T, heads, d] storage)."""
    B, H, T, D = t.shape
    return t.new_empty(B, T, H, D).transpose(1, 2).copy_(t)


def _attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: Optional[torch.Tensor],
                       causal: bool, p: float, mask: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    dispatch.check_given_mask("attention", p, mask)
    key_padding_mask = None if key_padding_mask is None else key_padding_mask.contiguous()
    if _fused(q, k, v, mask):
        out, lse, _ = ATTENTION_ROUTE.kernel[0](q, k, v, key_padding_mask, causal, 0.0)
        return out, lse
    fwd, _ = SOFTMAX_ROUTE.pick(q)
    probs, lse, _ = fwd(torch.matmul(q, k.transpose(-1, -2)), key_padding_mask, causal, p, mask)
    return _token_major(torch.matmul(probs, v)), lse


def _attention_forward_fake(q, k, v, key_padding_mask, causal, p, mask):
    B, H, Tq, _ = q.shape
    return q.new_empty(B, Tq, H, v.shape[-1]).transpose(1, 2), q.new_empty(B, H, Tq, dtype=lse_dtype(q))


def _attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                        key_padding_mask: Optional[torch.Tensor], causal: bool, p: float,
                        mask: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    key_padding_mask = None if key_padding_mask is None else key_padding_mask.contiguous()
    if _fused(q, k, v, mask):
        return ATTENTION_ROUTE.kernel[1](dout, q, k, v, lse, key_padding_mask, causal, None, 0.0)
    fwd, bwd = SOFTMAX_ROUTE.pick(q)
    scores = torch.matmul(q, k.transpose(-1, -2))
    dropped, _, _ = fwd(scores, key_padding_mask, causal, p, mask)
    dv = torch.matmul(dropped.transpose(-1, -2), dout)
    given = dispatch.given_dropout(dispatch.use_kernel("softmax", q), mask, p)
    ds = bwd(torch.matmul(dout, v.transpose(-1, -2)), scores, lse, key_padding_mask, causal, given, p)
    return (_token_major(torch.matmul(ds, k)), _token_major(torch.matmul(ds.transpose(-1, -2), q)),
            _token_major(dv))


def _attention_backward_fake(dout, q, k, v, lse, key_padding_mask, causal, p, mask):
    def like(t):
        B, H, T, D = t.shape
        return t.new_empty(B, T, H, D).transpose(1, 2)

    return like(q), like(k), like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, key_padding_mask, ctx.causal, ctx.p, mask = inputs
    ctx.mark_non_differentiable(output[1])  # lse: kept for the backward only
    ctx.save_for_backward(q, k, v, output[1], key_padding_mask, mask)


def _backward(ctx, dout, dlse):
    q, k, v, lse, key_padding_mask, mask = ctx.saved_tensors
    dq, dk, dv = attention_backward_op(dout, q, k, v, lse, key_padding_mask, ctx.causal, ctx.p, mask)
    return dq, dk, dv, None, None, None, None


attention_backward_op = dispatch.custom_op("attention_backward", _attention_backward, fake=_attention_backward_fake)
attention_forward_op = dispatch.custom_op("attention_forward", _attention_forward, fake=_attention_forward_fake,
                                          backward=_backward, setup_context=_setup_context)
