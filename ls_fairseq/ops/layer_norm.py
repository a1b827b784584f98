"""LayerNorm over the last dimension, one reduction pass (LightSeq2).

The kernel's forward reduces sum(x - s) and sum((x - s)^2) together, with s =
the row's first element as a shift: var = E[(x-s)^2] - E[x-s]^2 stays accurate
when |mean| >> std (the cancellation guard), and the row is read once. The
reference is torch's fused LayerNorm on the fp32 (fp64) values. eps is
fairseq's 1e-5. Statistics (mean, rstd) are fp32; backward needs x, gamma and
them, nothing else.
"""
import torch

from ls_fairseq.ops import dispatch, workspace
from ls_fairseq.ops.dispatch import _C


def layer_norm_forward_reference(x, weight, bias, eps):
    # torch's fused LayerNorm on the math dtype's values, each row shifted by its first element first:
    # LayerNorm does not change under a shift, and torch's CPU statistics lose about three digits of
    # rstd in fp32 when a row's mean is 1e5 times its spread; the shifted row's mean is near zero
    stat = x.shape[:-1]
    xm = dispatch.upcast(x)
    shift = xm[..., :1]
    y, mean, rstd = torch.native_layer_norm(xm - shift, (x.shape[-1],), dispatch.upcast(weight),
                                            dispatch.upcast(bias), eps)
    mean = mean + shift
    return y.to(x.dtype), mean.reshape(stat), rstd.reshape(stat)


def layer_norm_backward_reference(dy, x, weight, mean, rstd, dweight_into=None, dbias_into=None):
    # xhat = (x - mean) * rstd, g = dy * gamma
    # dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    # dgamma = sum_tokens dy * xhat, dbeta = sum_tokens dy   (torch's fused LayerNorm backward)
    stat = x.shape[:-1] + (1,)
    w = dispatch.upcast(weight)
    dx, dweight, dbias = torch.ops.aten.native_layer_norm_backward(
        dispatch.upcast(dy), dispatch.upcast(x), (x.shape[-1],), mean.reshape(stat), rstd.reshape(stat), w, w,
        [True, True, True])
    return (
        dx.to(x.dtype),
        dispatch.gradient(dweight, weight.dtype, dweight_into),
        dispatch.gradient(dbias, weight.dtype, dbias_into),
    )


LAYER_NORM_ROUTE = dispatch.Route(
    "layer_norm",
    kernel=(_C.layer_norm_forward, _C.layer_norm_backward) if _C else None,
    reference=(layer_norm_forward_reference, layer_norm_backward_reference),
)


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, residual_grad):
        fwd, bwd = LAYER_NORM_ROUTE.pick(x)
        x = x.contiguous()
        y, mean, rstd = fwd(x, weight, bias, eps)
        ctx.bwd, ctx.bias, ctx.residual_grad = bwd, bias, residual_grad
        if residual_grad is not None:
            residual_grad.claim("read")
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        into = workspace.grad_in_place(weight), workspace.grad_in_place(ctx.bias)
        dx, dweight, dbias = ctx.bwd(dy.contiguous(), x, weight, mean, rstd, *into)
        dres = ctx.residual_grad.take() if ctx.residual_grad is not None else None
        if dres is not None:
            dx = dx.add_(dres)  # dx is this backward's own new tensor
        return dx, workspace.for_autograd(dweight, into[0]), workspace.for_autograd(dbias, into[1]), None, None


def layer_norm(x, weight, bias, eps=1e-5, residual_grad=None):
    """LayerNorm of x's last dimension; ``residual_grad`` (an ops.ResidualGrad): x is also a residual
    connection's input, whose gradient backward adds to x's."""
    if x.shape[-1] != weight.numel() or weight.shape != bias.shape:
        raise ValueError(
            "layer_norm: x's last dimension {} must equal weight {} and bias {}".format(
                x.shape[-1], tuple(weight.shape), tuple(bias.shape)
            )
        )
    if dispatch.compiling():
        return layer_norm_forward_op(x, weight, bias, eps)[0]
    return dispatch.run(LayerNormFunction, x, weight, bias, eps, residual_grad)


# torch.compile's path: the same route as two custom ops, autograd between them; no residual
# gradient hand-off and no in-place parameter gradients (autograd adds both, inside the graph)


def _layer_norm_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    fwd, _ = LAYER_NORM_ROUTE.pick(x)
    y, mean, rstd = fwd(x.contiguous(), weight, bias, eps)
    return y, mean.reshape(x.shape[:-1]), rstd.reshape(x.shape[:-1])


def _layer_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
                         rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, bwd = LAYER_NORM_ROUTE.pick(x)
    return bwd(dy.contiguous(), x, weight, mean, rstd, None, None)  # every argument: the binding has no defaults


def _setup_context(ctx, inputs, output):
    x, weight, _, _ = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)  # kept for the backward only
    ctx.save_for_backward(x.contiguous(), weight, mean, rstd)


def _backward(ctx, dy, dmean, drstd):
    dx, dweight, dbias = layer_norm_backward_op(dy, *ctx.saved_tensors)
    return dx, dweight, dbias, None


layer_norm_backward_op = dispatch.custom_op("layer_norm_backward", _layer_norm_backward,
                                            fake=layer_norm_backward_reference)
layer_norm_forward_op = dispatch.custom_op("layer_norm_forward", _layer_norm_forward,
                                           fake=layer_norm_forward_reference, backward=_backward,
                                           setup_context=_setup_context)
