"""y = LayerNorm(residual + dropout(h + bias)): a post-LN block's end in one op.

bias_dropout_residual then layer_norm, with one kernel for both forwards (the
LayerNorm kernel makes each row's values itself: x = residual + dropout(h +
bias) is written once, for backward, and never read back) and one autograd node
for both backwards (LayerNorm's, whose dx is also the residual's gradient, then
bias_dropout_residual's). The same bits as the two ops in a row.
"""
from typing import Optional

import torch

from ls_fairseq.ops import dispatch, workspace
from ls_fairseq.ops.bias_dropout_residual import (
    bias_dropout_residual_backward_reference, bias_dropout_residual_forward_reference,
)
from ls_fairseq.ops.dispatch import _C
from ls_fairseq.ops.layer_norm import layer_norm_backward_reference, layer_norm_forward_reference


def bias_dropout_residual_layer_norm_forward_reference(h, bias, residual, weight, ln_bias, eps, p, mask):
    x, mask = bias_dropout_residual_forward_reference(h, bias, residual, p, mask)
    y, mean, rstd = layer_norm_forward_reference(x, weight, ln_bias, eps)
    return y, x, mean, rstd, mask


def bias_dropout_residual_layer_norm_backward_reference(dy, x, weight, mean, rstd, mask, p, dweight_into=None,
                                                        dln_bias_into=None, dbias_into=None):
    # dx (the residual's gradient) from LayerNorm's backward; dh = dx * mask / (1 - p), dbias its column sum
    dx, dweight, dln_bias = layer_norm_backward_reference(dy, x, weight, mean, rstd, dweight_into, dln_bias_into)
    dh, dbias = bias_dropout_residual_backward_reference(dx, mask, p, dbias_into)
    return dh, dbias, dx, dweight, dln_bias


BIAS_DROPOUT_RESIDUAL_LAYER_NORM_ROUTE = dispatch.Route(
    "bias_dropout_residual_layer_norm",
    kernel=(_C.bias_dropout_residual_layer_norm_forward, _C.bias_dropout_residual_layer_norm_backward) if _C else None,
    reference=(bias_dropout_residual_layer_norm_forward_reference, bias_dropout_residual_layer_norm_backward_reference),
)


class BiasDropoutResidualLayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, bias, residual, weight, ln_bias, eps, p, mask, residual_grad):
        fwd, bwd = BIAS_DROPOUT_RESIDUAL_LAYER_NORM_ROUTE.pick(h)
        y, x, mean, rstd, dropout = fwd(h.contiguous(), bias, residual.contiguous(), weight, ln_bias, eps, p, mask)
        ctx.bwd, ctx.p, ctx.params, ctx.residual_grad = bwd, p, (bias, weight, ln_bias), residual_grad
        dispatch.save_with_dropout(ctx, (x, weight, mean, rstd), dropout)
        return y

    @staticmethod
    def backward(ctx, dy):
        if dy is None:
            return (None,) * 9
        (x, weight, mean, rstd), dropout = dispatch.saved_with_dropout(ctx)
        into = [workspace.grad_in_place(t) for t in ctx.params]
        dh, dbias, dx, dweight, dln_bias = ctx.bwd(dy.contiguous(), x, weight, mean, rstd, dropout, ctx.p, into[1],
                                                    into[2], into[0])
        dresidual = dx
        # the residual's gradient is LayerNorm's new dx, which nothing else holds: the block's first
        # op may take it as it is, even to accumulate into (ops.residual); not when dh is dx itself
        # (the reference without dropout), which the branch's backward still reads
        if (ctx.residual_grad is not None and ctx.residual_grad.claimed is not None and ctx.needs_input_grad[2]
                and dh.data_ptr() != dx.data_ptr()):
            ctx.residual_grad.put(dx)
            dresidual = None
        return (dh, workspace.for_autograd(dbias, into[0]), dresidual, workspace.for_autograd(dweight, into[1]),
                workspace.for_autograd(dln_bias, into[2]), None, None, None, None)


def bias_dropout_residual_layer_norm(h, bias, residual, weight, ln_bias, p=0.0, training=True, eps=1e-5, mask=None,
                                     residual_grad=None):
    """LayerNorm(residual + dropout(h + bias)) over the last dimension (weight, ln_bias: the
    LayerNorm's); ``mask`` (uint8 keep-mask) fixes the dropout; ``residual_grad`` (an
    ops.ResidualGrad): the residual's gradient goes there, for the block's first op."""
    hidden = h.shape[-1]
    if h.shape != residual.shape or any(t.numel() != hidden for t in (bias, weight, ln_bias)):
        raise ValueError(
            "bias_dropout_residual_layer_norm: h {} and residual {} must match; bias {}, weight {} and ln_bias {} "
            "must equal h's last dimension".format(tuple(h.shape), tuple(residual.shape), tuple(bias.shape),
                                                   tuple(weight.shape), tuple(ln_bias.shape))
        )
    p = p if training else 0.0
    if dispatch.compiling():
        if p > 0 and mask is None:
            mask = dispatch.dropout_mask(h.shape, p, h.device)
        return bias_dropout_residual_layer_norm_forward_op(h, bias, residual, weight, ln_bias, eps, p,
                                                           mask if p > 0 else None)[0]
    return dispatch.run(BiasDropoutResidualLayerNormFunction, h, bias, residual, weight, ln_bias, eps, p,
                                                      mask if p > 0 else None, residual_grad)


# torch.compile's path: the same route as two custom ops, the keep-mask a tensor of the graph given
# to both; the residual's gradient (LayerNorm's dx) goes back to autograd (no hand-off)


def _forward(h: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, ln_bias: torch.Tensor,
             eps: float, p: float, mask: Optional[torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dispatch.check_given_mask("bias_dropout_residual_layer_norm", p, mask)
    fwd, _ = BIAS_DROPOUT_RESIDUAL_LAYER_NORM_ROUTE.pick(h)
    y, x, mean, rstd, _ = fwd(h.contiguous(), bias, residual.contiguous(), weight, ln_bias, eps, p, mask)
    return y, x, mean.reshape(h.shape[:-1]), rstd.reshape(h.shape[:-1])


def _forward_fake(h, bias, residual, weight, ln_bias, eps, p, mask):
    y = torch.empty_like(h, memory_format=torch.contiguous_format)
    stat = h.new_empty(h.shape[:-1], dtype=torch.float64 if h.dtype == torch.float64 else torch.float32)
    return y, torch.empty_like(y), stat, torch.empty_like(stat)


def _backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                 mask: Optional[torch.Tensor], p: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    kernel = dispatch.use_kernel("bias_dropout_residual_layer_norm", x)
    _, bwd = BIAS_DROPOUT_RESIDUAL_LAYER_NORM_ROUTE.pick(x)
    # every argument: the binding has no defaults
    out = bwd(dy.contiguous(), x, weight, mean, rstd, dispatch.given_dropout(kernel, mask, p), p, None, None, None)
    return dispatch.unaliased(out, (dy, x, weight, mean, rstd, mask))


def _backward_fake(dy, x, weight, mean, rstd, mask, p):
    dh = torch.empty_like(x)
    return dh, x.new_empty(x.shape[-1]), torch.empty_like(dh), torch.empty_like(weight), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    _, _, _, weight, _, _, ctx.p, mask = inputs
    _, x, mean, rstd = output
    ctx.mark_non_differentiable(x, mean, rstd)  # kept for the backward only
    ctx.save_for_backward(x, weight, mean, rstd, mask)


def _backward(ctx, dy, dx_out, dmean, drstd):
    x, weight, mean, rstd, mask = ctx.saved_tensors
    dh, dbias, dx, dweight, dln_bias = bias_dropout_residual_layer_norm_backward_op(dy, x, weight, mean, rstd, mask,
                                                                                   ctx.p)
    return dh, dbias, dx, dweight, dln_bias, None, None, None


bias_dropout_residual_layer_norm_backward_op = dispatch.custom_op("bias_dropout_residual_layer_norm_backward",
                                                                  _backward_op, fake=_backward_fake)
bias_dropout_residual_layer_norm_forward_op = dispatch.custom_op("bias_dropout_residual_layer_norm_forward", _forward,
                                                                 fake=_forward_fake, backward=_backward,
                                                                 setup_context=_setup_context)
