"""out = dropout(act(x + bias)), act in {relu, gelu}: the FFN's first half.

One pass reads x and bias and writes out; x + bias, act(x + bias) and the
keep-mask are never stored. gelu is the exact erf form that fairseq's ``gelu``
computes.

What backward keeps (LightSeq2's backward-dependency reuse): for relu only
``out``, which the FFN's second GEMM keeps anyway: out > 0 exactly where
x + bias > 0 and the element was kept (a dropped one is 0), so
dh = dout / (1 - p) * [out > 0] needs neither x nor the keep-bits (and draws
none). gelu keeps x, recomputes x + bias, and its kernel draws the forward's
keep-bits again.
"""
import math

import torch

from ls_fairseq.ops import dispatch, workspace
from ls_fairseq.ops.dispatch import _C

ACTIVATIONS = ("relu", "gelu")


def _check_activation(activation):
    if activation not in ACTIVATIONS:
        raise ValueError(
            "bias_act_dropout: activation {!r} is not supported; choose one of {}".format(
                activation, ", ".join(ACTIVATIONS)
            )
        )


def _act(h, activation):
    if activation == "relu":
        return torch.relu(h)
    return 0.5 * h * (1.0 + torch.erf(h * (1.0 / math.sqrt(2.0))))


def _act_grad(h, activation):
    if activation == "relu":
        return (h > 0).to(h.dtype)
    # d/dh [h * Phi(h)] = Phi(h) + h * phi(h)
    cdf = 0.5 * (1.0 + torch.erf(h * (1.0 / math.sqrt(2.0))))
    pdf = torch.exp(-0.5 * h * h) * (1.0 / math.sqrt(2.0 * math.pi))
    return cdf + h * pdf


def bias_act_dropout_forward_reference(x, bias, activation, p, mask):
    if p > 0 and mask is None:
        mask = dispatch.dropout_mask(x.shape, p, x.device)
    y = dispatch.apply_dropout(_act(dispatch.upcast(x) + dispatch.upcast(bias), activation), mask, p)
    return y.to(x.dtype), mask


def bias_act_dropout_backward_reference(dout, x, bias, mask, activation, p, dbias_into=None):
    # dh = dout * mask / (1 - p) * act'(x + bias); dx = dh; dbias = sum over tokens of dh (bias None: zero)
    h = dispatch.upcast(x) if bias is None else dispatch.upcast(x) + dispatch.upcast(bias)
    dh = dispatch.apply_dropout(dispatch.upcast(dout), mask, p) * _act_grad(h, activation)
    return dispatch.with_bias_gradient(dh, x.dtype, dbias_into)


BIAS_ACT_DROPOUT_ROUTE = dispatch.Route(
    "bias_act_dropout",
    kernel=(_C.bias_act_dropout_forward, _C.bias_act_dropout_backward) if _C else None,
    reference=(bias_act_dropout_forward_reference, bias_act_dropout_backward_reference),
)


class BiasActDropoutFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, activation, p, mask):
        fwd, bwd = BIAS_ACT_DROPOUT_ROUTE.pick(x)
        x = x.contiguous()
        out, dropout = fwd(x, bias, activation, p, mask)
        ctx.bwd, ctx.activation, ctx.p, ctx.bias = bwd, activation, p, bias
        ctx.from_output = activation == "relu"
        dispatch.save_with_dropout(ctx, (out if ctx.from_output else x,), None if ctx.from_output else dropout)
        return out

    @staticmethod
    def backward(ctx, dout):
        if dout is None:
            return (None,) * 5
        into = workspace.grad_in_place(ctx.bias)
        if ctx.from_output:  # relu'(x + bias) * keep = [out > 0]: the backward with x = out, bias = 0, no dropout
            (out,), _ = dispatch.saved_with_dropout(ctx)
            dx, dbias = ctx.bwd(dout.contiguous(), out, None, None, "relu", ctx.p, into)
        else:
            (x,), dropout = dispatch.saved_with_dropout(ctx)
            dx, dbias = ctx.bwd(dout.contiguous(), x, ctx.bias, dropout, ctx.activation, ctx.p, into)
        return dx, workspace.for_autograd(dbias, into), None, None, None


def bias_act_dropout(x, bias, activation="relu", p=0.0, training=True, mask=None):
    """dropout(act(x + bias)); ``mask`` (uint8 keep-mask) fixes the dropout."""
    _check_activation(activation)
    if x.shape[-1] != bias.numel():
        raise ValueError(
            "bias_act_dropout: bias {} must equal x's last dimension {}".format(tuple(bias.shape), x.shape[-1])
        )
    p = p if training else 0.0
    return dispatch.run(BiasActDropoutFunction, x, bias, activation, p, mask if p > 0 else None)
