"""LayerNorm over the last dimension, one reduction pass (LightSeq2).

Forward reduces sum(x - s) and sum((x - s)^2) together, with s = the row's
first element as a shift: var = E[(x-s)^2] - E[x-s]^2 stays accurate when
|mean| >> std (the cancellation guard), and the row is read once. eps is
fairseq's 1e-5. Statistics (mean, rstd) are fp32; backward needs x, gamma and
them, nothing else.
"""
import torch

from ls_fairseq.ops import dispatch, workspace
from ls_fairseq.ops.dispatch import _C


def layer_norm_forward_reference(x, weight, bias, eps):
    xf = dispatch.upcast(x)
    shift = xf[..., :1]
    d = xf - shift
    m1 = d.mean(-1, keepdim=True)
    m2 = (d * d).mean(-1, keepdim=True)
    var = (m2 - m1 * m1).clamp_min(0.0)
    mean = m1 + shift
    rstd = torch.rsqrt(var + eps)
    y = (xf - mean) * rstd * dispatch.upcast(weight) + dispatch.upcast(bias)
    return y.to(x.dtype), mean.squeeze(-1), rstd.squeeze(-1)


def layer_norm_backward_reference(dy, x, weight, mean, rstd, dweight_into=None, dbias_into=None):
    # xhat = (x - mean) * rstd, g = dy * gamma
    # dx = rstd * (g - mean(g) - xhat * mean(g * xhat))   (both means in one pass)
    # dgamma = sum_tokens dy * xhat, dbeta = sum_tokens dy
    H = x.shape[-1]
    dyf = dispatch.upcast(dy).reshape(-1, H)
    xhat = (dispatch.upcast(x).reshape(-1, H) - mean.reshape(-1, 1)) * rstd.reshape(-1, 1)
    g = dyf * dispatch.upcast(weight)
    dx = rstd.reshape(-1, 1) * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    dweight = (dyf * xhat).sum(0)
    dbias = dyf.sum(0)
    return (
        dx.reshape(x.shape).to(x.dtype),
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
    return LayerNormFunction.apply(x, weight, bias, eps, residual_grad)
