"""out = residual + dropout(x + bias): the tail of every attention and FFN block.

One pass reads x, bias, residual and writes out, and the keep-mask as bits; x + bias
is never stored. Backward needs only the dropout (the kernel reads its keep-bits);
the residual's gradient goes back to autograd, or to the block's first op
(ops.residual).
"""
from typing import Optional

import torch

from ls_fairseq.ops import dispatch, workspace
from ls_fairseq.ops.dispatch import _C


def bias_dropout_residual_forward_reference(x, bias, residual, p, mask):
    if p > 0 and mask is None:
        mask = dispatch.dropout_mask(x.shape, p, x.device)
    y = dispatch.apply_dropout(dispatch.upcast(x) + dispatch.upcast(bias), mask, p).add_(dispatch.upcast(residual))
    return y.to(x.dtype), mask


def bias_dropout_residual_backward_reference(dout, mask, p, dbias_into=None):
    # d residual = dout; d x = dout * mask / (1 - p); d bias = sum over tokens of d x
    dx = dispatch.apply_dropout(dispatch.upcast(dout), mask, p)
    return dispatch.with_bias_gradient(dx, dout.dtype, dbias_into)


BIAS_DROPOUT_RESIDUAL_ROUTE = dispatch.Route(
    "bias_dropout_residual",
    kernel=(_C.bias_dropout_residual_forward, _C.bias_dropout_residual_backward) if _C else None,
    reference=(bias_dropout_residual_forward_reference, bias_dropout_residual_backward_reference),
)


class BiasDropoutResidualFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual, p, mask, residual_grad):
        fwd, bwd = BIAS_DROPOUT_RESIDUAL_ROUTE.pick(x)
        out, dropout = fwd(x.contiguous(), bias, residual.contiguous(), p, mask)
        ctx.bwd, ctx.p, ctx.bias, ctx.residual_grad = bwd, p, bias, residual_grad
        dispatch.save_with_dropout(ctx, (), dropout)
        return out

    @staticmethod
    def backward(ctx, dout):
        if dout is None:
            return (None,) * 6
        dout = dout.contiguous()
        into = workspace.grad_in_place(ctx.bias)
        _, dropout = dispatch.saved_with_dropout(ctx)
        dx, dbias = ctx.bwd(dout, dropout, ctx.p, into)
        # dout goes to a first op that only reads it (pre-LN's LayerNorm): one that accumulates into
        # it would need a copy, which costs what autograd's add does
        handoff = (ctx.residual_grad is not None and ctx.residual_grad.claimed == "read"
                   and ctx.needs_input_grad[2])
        if handoff:
            ctx.residual_grad.put(dout)
        return dx, workspace.for_autograd(dbias, into), None if handoff else dout, None, None, None


def bias_dropout_residual(x, bias, residual, p=0.0, training=True, mask=None, residual_grad=None):
    """residual + dropout(x + bias); ``mask`` (uint8 keep-mask) fixes the dropout; ``residual_grad``
    (an ops.ResidualGrad): the residual's gradient goes there, for the block's first op."""
    if x.shape != residual.shape or x.shape[-1] != bias.numel():
        raise ValueError(
            "bias_dropout_residual: x {} and residual {} must match, bias {} must equal x's last dimension".format(
                tuple(x.shape), tuple(residual.shape), tuple(bias.shape)
            )
        )
    p = p if training else 0.0
    if dispatch.compiling():
        if p > 0 and mask is None:
            mask = dispatch.dropout_mask(x.shape, p, x.device)
        return bias_dropout_residual_forward_op(x, bias, residual, p, mask if p > 0 else None)
    return dispatch.run(BiasDropoutResidualFunction, x, bias, residual, p, mask if p > 0 else None, residual_grad)


# torch.compile's path: the same route as two custom ops, the keep-mask a tensor of the graph given
# to both; the residual's gradient goes back to autograd (no hand-off), the bias's too


def _bias_dropout_residual_forward(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, p: float,
                                   mask: Optional[torch.Tensor]) -> torch.Tensor:
    dispatch.check_given_mask("bias_dropout_residual", p, mask)
    fwd, _ = BIAS_DROPOUT_RESIDUAL_ROUTE.pick(x)
    return fwd(x.contiguous(), bias, residual.contiguous(), p, mask)[0]


def _forward_fake(x, bias, residual, p, mask):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _bias_dropout_residual_backward(dout: torch.Tensor, mask: Optional[torch.Tensor],
                                    p: float) -> tuple[torch.Tensor, torch.Tensor]:
    kernel = dispatch.use_kernel("bias_dropout_residual", dout)
    _, bwd = BIAS_DROPOUT_RESIDUAL_ROUTE.pick(dout)
    # every argument: the binding has no defaults
    dx, dbias = bwd(dout.contiguous(), dispatch.given_dropout(kernel, mask, p), p, None)
    return dispatch.unaliased((dx, dbias), (dout,))


def _backward_fake(dout, mask, p):
    return torch.empty_like(dout, memory_format=torch.contiguous_format), dout.new_empty(dout.shape[-1])


def _setup_context(ctx, inputs, output):
    _, _, _, ctx.p, mask = inputs
    ctx.save_for_backward(mask)


def _backward(ctx, dout):
    (mask,) = ctx.saved_tensors
    dx, dbias = bias_dropout_residual_backward_op(dout, mask, ctx.p)
    return dx, dbias, dout, None, None


bias_dropout_residual_backward_op = dispatch.custom_op("bias_dropout_residual_backward",
                                                       _bias_dropout_residual_backward, fake=_backward_fake)
bias_dropout_residual_forward_op = dispatch.custom_op("bias_dropout_residual_forward", _bias_dropout_residual_forward,
                                                      fake=_forward_fake, backward=_backward,
                                                      setup_context=_setup_context)
