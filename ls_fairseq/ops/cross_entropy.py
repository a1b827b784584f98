"""Label-smoothed cross-entropy in fairseq's formula, from logits.

Per token, with V = vocab size, eps_i = eps / (V - 1), lse = logsumexp(logits):
  nll    = lse - logit[target]
  smooth = sum_j -log p_j = V * lse - sum_j logit_j
  loss   = (1 - eps - eps_i) * nll + eps_i * smooth
and both are 0 where target == padding_idx. Only lse (fp32, one per token) is
kept for backward: the fp32 [tokens x vocab] log-probabilities are never
materialised by the kernel. With ``overwrite_logits`` the backward writes the
logits' gradient over the logits themselves (LightSeq2 reuses that buffer too):
no second [tokens x vocab] buffer, 1 GiB at 16k tokens and a 32k vocabulary in
fp16. The caller promises that nothing else needs the logits after the loss
(autograd would report a node that saved them: they are modified in place).
"""
from typing import Optional

import torch

from ls_fairseq.ops import dispatch
from ls_fairseq.ops.dispatch import _C


def cross_entropy_forward_reference(logits, target, epsilon, padding_idx):
    # torch's fused log_softmax: lp_j = logit_j - lse, so nll = -lp[target] and smooth = -sum_j lp_j;
    # lse = max_j logit_j - max_j lp_j, where max_j lp_j = -log(sum_j exp(logit_j - max_j logit_j))
    # (logsumexp's own two terms, so no precision is lost)
    x = dispatch.upcast(logits)
    V = x.shape[-1]
    eps_i = epsilon / (V - 1)
    lp = torch.log_softmax(x, dim=-1)
    lse = x.amax(-1) - lp.amax(-1)
    nll = lp.gather(-1, target.unsqueeze(-1)).squeeze(-1).neg_()
    smooth = lp.sum(-1).neg_()
    loss = (1.0 - epsilon - eps_i) * nll + eps_i * smooth
    pad = target.eq(padding_idx)
    return loss.masked_fill_(pad, 0.0), nll.masked_fill_(pad, 0.0), lse


def cross_entropy_backward_reference(dloss, dnll, logits, target, lse, epsilon, padding_idx, out=None):
    # dnll None: the nll loss took no gradient
    # d loss / d logit_j = p_j - eps_i - (1 - eps - eps_i) [j = target]
    #   (the coefficient of p_j is (1 - eps - eps_i) + eps_i * V = 1)
    # d nll / d logit_j = p_j - [j = target]; rows with target == padding_idx get 0
    # so per row: grad_j = w p_j - a - b [j = target] with w = dloss (+ dnll), a = eps_i dloss,
    # b = (1 - eps - eps_i) dloss (+ dnll), all 0 at padding: three passes over the row, written over
    # the logits when ``out`` is they (p = exp(logit - lse) = softmax(logits), torch's fused softmax)
    V = logits.shape[-1]
    eps_i = epsilon / (V - 1)
    x = dispatch.upcast(logits)
    live = target.ne(padding_idx).to(x.dtype)
    dl = dispatch.upcast(dloss) * live
    w, a, b = dl, dl * eps_i, dl * (1.0 - epsilon - eps_i)
    if dnll is not None:
        dn = dispatch.upcast(dnll) * live
        w, b = w + dn, b + dn
    in_place = out is not None and out.dtype == x.dtype
    grad = torch.softmax(x, dim=-1, out=out) if in_place else torch.softmax(x, dim=-1)
    grad.mul_(w.unsqueeze(-1)).sub_(a.unsqueeze(-1)).scatter_add_(-1, target.unsqueeze(-1), b.neg().unsqueeze(-1))
    if in_place:
        return grad
    return grad.to(logits.dtype) if out is None else out.copy_(grad)


CROSS_ENTROPY_ROUTE = dispatch.Route(
    "cross_entropy",
    kernel=(_C.cross_entropy_forward, _C.cross_entropy_backward) if _C else None,
    reference=(cross_entropy_forward_reference, cross_entropy_backward_reference),
)


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, epsilon, padding_idx, overwrite_logits):
        fwd, bwd = CROSS_ENTROPY_ROUTE.pick(logits)
        logits = logits.contiguous()
        loss, nll, lse = fwd(logits, target, epsilon, padding_idx)
        ctx.bwd, ctx.epsilon, ctx.padding_idx, ctx.overwrite_logits = bwd, epsilon, padding_idx, overwrite_logits
        ctx.save_for_backward(logits, target, lse)
        return loss, nll

    @staticmethod
    def backward(ctx, dloss, dnll):
        logits, target, lse = ctx.saved_tensors
        # the criterion sums the losses: dloss comes as one value for every row (a stride-0 view), which
        # the kernel reads as it is, and the nll loss (logged only) takes no gradient: no copy, no fill
        dloss = torch.zeros_like(lse) if dloss is None else dloss
        if dloss.dim() != 1 or dloss.stride(0) not in (0, 1):
            dloss = dloss.contiguous()
        dnll = None if dnll is None else dnll.contiguous()
        out = logits if ctx.overwrite_logits else None
        grad = ctx.bwd(dloss, dnll, logits, target, lse, ctx.epsilon, ctx.padding_idx, out)
        return grad, None, None, None, None


def label_smoothed_cross_entropy(logits, target, epsilon, padding_idx, overwrite_logits=False):
    """Per-token (loss, nll_loss), fp32, zero at padding; logits [..., V], target [...].
    ``overwrite_logits``: backward writes the gradient over the logits (see above)."""
    V = logits.shape[-1]
    if V < 2:
        raise ValueError("label_smoothed_cross_entropy: vocabulary size must be at least 2, got {}".format(V))
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            "label_smoothed_cross_entropy: logits {} must be target {} plus a vocabulary dimension".format(
                tuple(logits.shape), tuple(target.shape)
            )
        )
    if dispatch.compiling():  # the logits' memory stays the graph's: overwrite_logits has no effect here
        loss, nll, _ = cross_entropy_forward_op(logits.reshape(-1, V), target.reshape(-1), float(epsilon), padding_idx)
        return loss.view(target.shape), nll.view(target.shape)
    loss, nll = dispatch.run(CrossEntropyFunction,
        logits.reshape(-1, V), target.reshape(-1), float(epsilon), padding_idx, bool(overwrite_logits)
    )
    return loss.view(target.shape), nll.view(target.shape)


# torch.compile's path: the same route as two custom ops


def _forward(logits: torch.Tensor, target: torch.Tensor, epsilon: float,
             padding_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    fwd, _ = CROSS_ENTROPY_ROUTE.pick(logits)
    return fwd(logits.contiguous(), target.contiguous(), epsilon, padding_idx)


def _forward_fake(logits, target, epsilon, padding_idx):
    rows = logits.new_empty(logits.shape[0], dtype=torch.float64 if logits.dtype == torch.float64 else torch.float32)
    return rows, torch.empty_like(rows), torch.empty_like(rows)


def _backward_op(dloss: torch.Tensor, dnll: Optional[torch.Tensor], logits: torch.Tensor, target: torch.Tensor,
                 lse: torch.Tensor, epsilon: float, padding_idx: int) -> torch.Tensor:
    _, bwd = CROSS_ENTROPY_ROUTE.pick(logits)
    dnll = None if dnll is None else dnll.contiguous()
    # every argument: the binding has no defaults
    return bwd(dloss.contiguous(), dnll, logits.contiguous(), target.contiguous(), lse, epsilon, padding_idx, None)


def _backward_fake(dloss, dnll, logits, target, lse, epsilon, padding_idx):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    logits, target, ctx.epsilon, ctx.padding_idx = inputs
    ctx.mark_non_differentiable(output[2])  # lse: kept for the backward only
    ctx.set_materialize_grads(False)  # the nll loss, logged only, gives no gradient
    ctx.save_for_backward(logits, target, output[2])


def _backward(ctx, dloss, dnll, dlse):
    logits, target, lse = ctx.saved_tensors
    dloss = torch.zeros_like(lse) if dloss is None else dloss
    return cross_entropy_backward_op(dloss, dnll, logits, target, lse, ctx.epsilon, ctx.padding_idx), None, None, None


cross_entropy_backward_op = dispatch.custom_op("cross_entropy_backward", _backward_op, fake=_backward_fake)
cross_entropy_forward_op = dispatch.custom_op("cross_entropy_forward", _forward, fake=_forward_fake,
                                              backward=_backward, setup_context=_setup_context)
