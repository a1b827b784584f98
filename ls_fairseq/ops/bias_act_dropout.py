"""out = dropout(act(x + bias)), act in {relu, gelu, gelu_accurate}: the FFN's first half.

One pass reads x and bias and writes out; x + bias, act(x + bias) and the
keep-mask are never stored. gelu is the exact erf form that fairseq's ``gelu``
computes; gelu_accurate the tanh form, fairseq's ``gelu_accurate`` and Hugging Face's
``gelu_new`` (GPT-2's): 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))). The kernels
have relu and gelu (``KERNEL_ACTIVATIONS``); gelu_accurate runs the PyTorch reference on
every device until a kernel for it has been tested on a GPU.

What backward keeps (LightSeq2's backward-dependency reuse): for relu only
``out``, which the FFN's second GEMM keeps anyway: out > 0 exactly where
x + bias > 0 and the element was kept (a dropped one is 0), so
dh = dout / (1 - p) * [out > 0] needs neither x nor the keep-bits (and draws
none). gelu keeps x, recomputes x + bias, and its kernel draws the forward's
keep-bits again.
"""
import math
from typing import Optional

import torch

from ls_fairseq.ops import dispatch, workspace
from ls_fairseq.ops.dispatch import _C

ACTIVATIONS = ("relu", "gelu", "gelu_accurate")
KERNEL_ACTIVATIONS = ("relu", "gelu")
_TANH_SCALE = math.sqrt(2.0 / math.pi)


def _check_activation(activation):
    if activation not in ACTIVATIONS:
        raise ValueError(
            "bias_act_dropout: activation {!r} is not supported; choose one of {}".format(
                activation, ", ".join(ACTIVATIONS)
            )
        )


def _route(x, activation):
    """BIAS_ACT_DROPOUT_ROUTE's pick for ``x``, the reference for an activation the kernels lack."""
    if activation not in KERNEL_ACTIVATIONS:
        return BIAS_ACT_DROPOUT_ROUTE.reference
    return BIAS_ACT_DROPOUT_ROUTE.pick(x)


def _act(h, activation):
    if activation == "relu":
        return torch.relu(h)
    if activation == "gelu_accurate":
        return 0.5 * h * (1.0 + torch.tanh(_TANH_SCALE * (h + 0.044715 * h * h * h)))
    return 0.5 * h * (1.0 + torch.erf(h * (1.0 / math.sqrt(2.0))))


def _act_grad(h, activation):
    if activation == "relu":
        return (h > 0).to(h.dtype)
    if activation == "gelu_accurate":
        # d/dh [0.5 h (1 + tanh u)], u = c (h + 0.044715 h^3): 0.5 (1 + tanh u) + 0.5 h (1 - tanh^2 u) du/dh
        t = torch.tanh(_TANH_SCALE * (h + 0.044715 * h * h * h))
        return 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * _TANH_SCALE * (1.0 + 3 * 0.044715 * h * h)
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


def _uses_kernel(x, activation):
    """Whether this call runs the kernels: the route's choice, for an activation they have."""
    return activation in KERNEL_ACTIVATIONS and dispatch.use_kernel("bias_act_dropout", x)


def _route(x, activation):
    """(forward, backward) of BIAS_ACT_DROPOUT_ROUTE for this call: the references for an activation the
    kernels do not have."""
    return BIAS_ACT_DROPOUT_ROUTE.kernel if _uses_kernel(x, activation) else BIAS_ACT_DROPOUT_ROUTE.reference


class BiasActDropoutFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, activation, p, mask):
        fwd, bwd = _route(x, activation)
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
    if dispatch.compiling():
        if p > 0 and mask is None:
            mask = dispatch.dropout_mask(x.shape, p, x.device)
        return bias_act_dropout_forward_op(x, bias, activation, p, mask if p > 0 else None)
    return dispatch.run(BiasActDropoutFunction, x, bias, activation, p, mask if p > 0 else None)


# torch.compile's path: the same route as two custom ops, the keep-mask a tensor of the graph given
# to both; relu's backward from the output, as the eager path's


def _forward(x: torch.Tensor, bias: torch.Tensor, activation: str, p: float,
             mask: Optional[torch.Tensor]) -> torch.Tensor:
    dispatch.check_given_mask("bias_act_dropout", p, mask)
    fwd, _ = _route(x, activation)
    return fwd(x.contiguous(), bias, activation, p, mask)[0]


def _forward_fake(x, bias, activation, p, mask):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _backward_op(dout: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor], mask: Optional[torch.Tensor],
                 activation: str, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    _, bwd = _route(x, activation)
    # every argument: the binding has no defaults
    return bwd(dout.contiguous(), x.contiguous(), bias, dispatch.given_dropout(_uses_kernel(x, activation), mask, p),
               activation, p, None)


def _backward_fake(dout, x, bias, mask, activation, p):
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(x.shape[-1])


def _setup_context(ctx, inputs, output):
    x, bias, ctx.activation, ctx.p, mask = inputs
    # relu: [out > 0] is relu'(x + bias) times the keep-mask, so out alone serves (x, bias, mask: none)
    ctx.save_for_backward(*((output, None, None) if ctx.activation == "relu" else (x, bias, mask)))


def _backward(ctx, dout):
    x, bias, mask = ctx.saved_tensors
    dx, dbias = bias_act_dropout_backward_op(dout, x, bias, mask, ctx.activation, ctx.p)
    return dx, dbias, None, None, None


bias_act_dropout_backward_op = dispatch.custom_op("bias_act_dropout_backward", _backward_op, fake=_backward_fake)
bias_act_dropout_forward_op = dispatch.custom_op("bias_act_dropout_forward", _forward, fake=_forward_fake,
                                                 backward=_backward, setup_context=_setup_context)
