"""Attention softmax with key-padding and causal masks, fused with dropout.

scores [B, heads, Tq, Tk] -> probs (fp32 math, scores' dtype out). A key j is
masked for query i when key_padding_mask[b, j] is set, or, with ``causal``,
when j > i + (Tk - Tq). A row whose keys are all masked gives zeros (never
NaN). Masks are never expanded to [B, heads, Tq, Tk] in memory. The forward
writes its output (with dropout, the kept probabilities alone) and each row's
log-sum-exp [B, heads, Tq] in fp32, the kernel's keep-mask never (its backward
draws the keep-bits again). The backward takes the scores and the log-sum-exp and
computes the probabilities again in fp32, as stock fairseq's softmax keeps them for
its backward: the 16-bit probabilities' rounding, in the row term sum_j dp_j P_j,
gave the cross-attention's query gradients a larger error against fp64 than
stock's (csrc/softmax.cu's header). With dropout, the kernel scales a kept probability
in fp32 and rounds it once; this reference, as stock fairseq, rounds the
probabilities to the scores' dtype first (the two an ulp apart at most).
"""
from typing import Optional

import torch

from ls_fairseq.ops import dispatch
from ls_fairseq.ops.dispatch import _C


def _masked_scores(scores, key_padding_mask, causal):
    s = dispatch.upcast(scores)
    Tq, Tk = s.shape[-2], s.shape[-1]
    masked = torch.zeros((), dtype=torch.bool, device=s.device)
    if key_padding_mask is not None:
        masked = masked | key_padding_mask.bool()[:, None, None, :]
    if causal:
        i = torch.arange(Tq, device=s.device)[:, None]
        j = torch.arange(Tk, device=s.device)[None, :]
        masked = masked | (j > i + (Tk - Tq))
    return s.masked_fill(masked, float("-inf"))


def _probs(scores, key_padding_mask, causal, lse):
    """exp(masked scores - lse) in fp32 (fp64 for fp64 scores); 0 where masked (a fully masked row's lse is -inf)."""
    return torch.exp(_masked_scores(scores, key_padding_mask, causal) - lse.unsqueeze(-1)).nan_to_num(0.0)


def softmax_forward_reference(scores, key_padding_mask, causal, p, mask):
    """(out, lse, mask): out the probabilities, with dropout the kept ones; lse each row's log-sum-exp."""
    lse = torch.logsumexp(_masked_scores(scores, key_padding_mask, causal), dim=-1)
    probs = _probs(scores, key_padding_mask, causal, lse).to(scores.dtype)
    if p > 0 and mask is None:
        mask = dispatch.dropout_mask(scores.shape, p, scores.device)
    out = dispatch.apply_dropout(dispatch.upcast(probs), mask, p).to(scores.dtype) if mask is not None else probs
    return out, lse, mask


def softmax_backward_reference(dout, scores, lse, key_padding_mask, causal, mask, p):
    # with dp = dout * mask / (1 - p) and P = exp(s - lse) in fp32:  dscores = P * (dp - sum_j(dp * P))
    dp = dispatch.apply_dropout(dispatch.upcast(dout), mask, p)
    pf = _probs(scores, key_padding_mask, causal, lse)
    ds = pf * (dp - (dp * pf).sum(-1, keepdim=True))
    return ds.to(dout.dtype)


SOFTMAX_ROUTE = dispatch.Route(
    "softmax",
    kernel=(_C.softmax_forward, _C.softmax_backward) if _C else None,
    reference=(softmax_forward_reference, softmax_backward_reference),
)


class SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, key_padding_mask, causal, p, mask):
        fwd, bwd = SOFTMAX_ROUTE.pick(scores)
        scores = scores.contiguous()
        out, lse, dropout = fwd(scores, key_padding_mask, causal, p, mask)
        ctx.bwd, ctx.causal, ctx.p = bwd, causal, p
        dispatch.save_with_dropout(ctx, (scores, lse, key_padding_mask), dropout)
        return out

    @staticmethod
    def backward(ctx, dout):
        if dout is None:
            return (None,) * 5
        (scores, lse, key_padding_mask), dropout = dispatch.saved_with_dropout(ctx)
        ds = ctx.bwd(dout.contiguous(), scores, lse, key_padding_mask, ctx.causal, dropout, ctx.p)
        return ds, None, None, None, None


def softmax(scores, key_padding_mask=None, causal=False, p=0.0, training=True, mask=None):
    """Masked softmax over the last dim of [B, heads, Tq, Tk] scores, then dropout."""
    if scores.dim() != 4:
        raise ValueError("softmax: scores must be [batch, heads, tgt_len, src_len], got {}".format(tuple(scores.shape)))
    if key_padding_mask is not None and (
        key_padding_mask.shape != (scores.shape[0], scores.shape[-1])
    ):
        raise ValueError(
            "softmax: key_padding_mask {} must be [batch, src_len] = {}".format(
                tuple(key_padding_mask.shape), (scores.shape[0], scores.shape[-1])
            )
        )
    p = p if training else 0.0
    if dispatch.compiling():
        if p > 0 and mask is None:
            mask = dispatch.dropout_mask(scores.shape, p, scores.device)
        return softmax_forward_op(scores, key_padding_mask, causal, p, mask if p > 0 else None)[0]
    return dispatch.run(SoftmaxFunction, scores, key_padding_mask, causal, p, mask if p > 0 else None)


# torch.compile's path: the same route as two custom ops, the keep-mask a tensor of the graph given to both


def _forward(scores: torch.Tensor, key_padding_mask: Optional[torch.Tensor], causal: bool, p: float,
             mask: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    dispatch.check_given_mask("softmax", p, mask)
    fwd, _ = SOFTMAX_ROUTE.pick(scores)
    key_padding_mask = None if key_padding_mask is None else key_padding_mask.contiguous()
    out, lse, _ = fwd(scores.contiguous(), key_padding_mask, causal, p, mask)
    return out, lse


def _forward_fake(scores, key_padding_mask, causal, p, mask):
    return (torch.empty_like(scores, memory_format=torch.contiguous_format),
            scores.new_empty(scores.shape[:-1], dtype=lse_dtype(scores)))


def lse_dtype(scores):
    """The dtype of the log-sum-exp of ``scores``' rows: fp32, fp64 for fp64 scores (the references' math)."""
    return torch.float64 if scores.dtype == torch.float64 else torch.float32


def _backward_op(dout: torch.Tensor, scores: torch.Tensor, lse: torch.Tensor, key_padding_mask: Optional[torch.Tensor],
                 causal: bool, mask: Optional[torch.Tensor], p: float) -> torch.Tensor:
    kernel = dispatch.use_kernel("softmax", scores)
    _, bwd = SOFTMAX_ROUTE.pick(scores)
    key_padding_mask = None if key_padding_mask is None else key_padding_mask.contiguous()
    return bwd(dout.contiguous(), scores.contiguous(), lse, key_padding_mask, causal,
               dispatch.given_dropout(kernel, mask, p), p)


def _backward_fake(dout, scores, lse, key_padding_mask, causal, mask, p):
    return torch.empty_like(dout, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    scores, key_padding_mask, ctx.causal, ctx.p, mask = inputs
    ctx.mark_non_differentiable(output[1])  # lse: kept for the backward only
    ctx.save_for_backward(scores, output[1], key_padding_mask, mask)


def _backward(ctx, dout, dlse):
    scores, lse, key_padding_mask, mask = ctx.saved_tensors
    return softmax_backward_op(dout, scores, lse, key_padding_mask, ctx.causal, mask, ctx.p), None, None, None, None


softmax_backward_op = dispatch.custom_op("softmax_backward", _backward_op, fake=_backward_fake)
softmax_forward_op = dispatch.custom_op("softmax_forward", _forward, fake=_forward_fake, backward=_backward,
                                        setup_context=_setup_context)
