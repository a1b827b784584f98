"""Bias add + split into heads, and its inverse (LightSeq2's QKV transform).

split_heads: x [B, T, parts * d] (a projection GEMM's output, bias not yet
added) -> ``parts`` tensors [B, heads, T, d / heads]; the first is multiplied
by ``first_scale`` (1/sqrt(d_head) for a query, folded in here as fairseq
scales q after its bias). ``token_major``: the parts are views of
[parts, B, T, heads, d_head] storage, the layout FlashAttention and the
memory-efficient kernel work in: their output then keeps it, and merging its
heads for the out projection is a view, not a copy (forward and backward).
parts = 3 gives q, k, v of self-attention; parts = 2L gives the keys and values
of all L decoder layers' cross-attention from one GEMM. x + bias is never
stored. merge_heads is the inverse layout change for the attention output
(ops.linear(..., heads=True) applies it inside the output projection, keeping
only the unmerged output).
"""
import torch

from ls_fairseq.ops import dispatch, workspace
from ls_fairseq.ops.dispatch import _C


def qkv_forward_reference(x, bias, num_heads, num_parts, first_scale, token_major=False):
    B, T, C = x.shape
    d = C // num_parts
    y = (dispatch.upcast(x) + dispatch.upcast(bias)).view(B, T, num_parts, num_heads, d // num_heads)
    scale = torch.ones(num_parts, 1, 1, device=x.device)
    scale[0] = first_scale
    y = (y * scale).to(x.dtype)
    if token_major:
        return y.permute(2, 0, 1, 3, 4).contiguous().transpose(2, 3)
    return y.permute(2, 0, 3, 1, 4).contiguous()


def qkv_backward_reference(dys, first_scale, dbias_into=None):
    # dys: each part's dy [B, heads, T, d_head] (None: zero) -> dx [B, T, parts * d]; dbias = sum over B, T of dx
    like = next(g for g in dys if g is not None)
    dy = torch.stack([dispatch.upcast(like.new_zeros(like.shape) if g is None else g) for g in dys])
    P, B, H, T, D = dy.shape
    scale = torch.ones(P, 1, 1, 1, 1, device=dy.device, dtype=dy.dtype)
    scale[0] = first_scale
    dx = (dy * scale).permute(1, 3, 0, 2, 4).reshape(B, T, P * H * D)
    return dispatch.with_bias_gradient(dx, like.dtype, dbias_into)


QKV_ROUTE = dispatch.Route(
    "qkv",
    kernel=(_C.qkv_forward, _C.qkv_backward) if _C else None,
    reference=(qkv_forward_reference, qkv_backward_reference),
)


class QKVFunction(torch.autograd.Function):
    """Returns the parts as separate outputs (views of one [parts, B, heads, T, d_head] buffer), so that
    backward receives each part's gradient as autograd made it: unbinding outside would have autograd
    stack them into one new tensor first (a copy of all of dy, and one more kernel, per call)."""

    @staticmethod
    def forward(ctx, x, bias, num_heads, num_parts, first_scale, token_major):
        fwd, bwd = QKV_ROUTE.pick(x)
        ctx.bwd, ctx.first_scale, ctx.bias = bwd, first_scale, bias
        ctx.set_materialize_grads(False)  # a part without gradient arrives as None, not as zeros
        return fwd(x.contiguous(), bias, num_heads, num_parts, first_scale, token_major).unbind(0)

    @staticmethod
    def backward(ctx, *dys):
        if all(g is None for g in dys):
            return None, None, None, None, None, None
        into = workspace.grad_in_place(ctx.bias)
        # any layout of the parts' (B, heads, T) (attention backwards give views); rows of d_head contiguous
        dys = [g if g is None or g.stride(-1) == 1 else g.contiguous() for g in dys]
        dx, dbias = ctx.bwd(dys, ctx.first_scale, into)
        return dx, workspace.for_autograd(dbias, into), None, None, None, None


def split_heads(x, bias, num_heads, num_parts, first_scale=1.0, token_major=False):
    """[B, T, parts*d] + bias -> tuple of ``parts`` tensors [B, heads, T, d_head]; ``token_major``:
    views of [parts, B, T, heads, d_head] storage (for scaled_dot_product_attention)."""
    if x.dim() != 3 or x.shape[-1] % (num_parts * num_heads) != 0 or bias.numel() != x.shape[-1]:
        raise ValueError(
            "split_heads: x {} must be [batch, len, parts*d] with parts={} and d divisible by heads={}, bias {} of size parts*d".format(
                tuple(x.shape), num_parts, num_heads, tuple(bias.shape)
            )
        )
    if dispatch.compiling():
        return qkv_forward_op(x, bias, num_heads, num_parts, first_scale, token_major).unbind(0)
    return dispatch.run(QKVFunction, x, bias, num_heads, num_parts, first_scale, token_major)


def merge_heads(x):
    """[B, heads, T, d_head] -> [B, T, heads * d_head]."""
    B, H, T, D = x.shape
    return x.transpose(1, 2).reshape(B, T, H * D)


# torch.compile's path: the same route as two custom ops; the parts are one output
# [parts, B, heads, T, d_head] (token-major: of [parts, B, T, heads, d_head] storage) that the
# graph unbinds, so its backward receives their gradients stacked


def _forward(x: torch.Tensor, bias: torch.Tensor, num_heads: int, num_parts: int, first_scale: float,
             token_major: bool) -> torch.Tensor:
    fwd, _ = QKV_ROUTE.pick(x)
    return fwd(x.contiguous(), bias, num_heads, num_parts, first_scale, token_major)


def _forward_fake(x, bias, num_heads, num_parts, first_scale, token_major):
    B, T, C = x.shape
    D = C // num_parts // num_heads
    if token_major:
        return x.new_empty(num_parts, B, T, num_heads, D).transpose(2, 3)
    return x.new_empty(num_parts, B, num_heads, T, D)


def _backward_op(dy: torch.Tensor, first_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    _, bwd = QKV_ROUTE.pick(dy)
    dys = [g if g.stride(-1) == 1 else g.contiguous() for g in dy.unbind(0)]
    return bwd(dys, first_scale, None)  # every argument: the binding has no defaults


def _backward_fake(dy, first_scale):
    P, B, H, T, D = dy.shape
    return dy.new_empty(B, T, P * H * D), dy.new_empty(P * H * D)


def _setup_context(ctx, inputs, output):
    ctx.first_scale = inputs[4]


def _backward(ctx, dy):
    dx, dbias = qkv_backward_op(dy, ctx.first_scale)
    return dx, dbias, None, None, None, None


qkv_backward_op = dispatch.custom_op("qkv_backward", _backward_op, fake=_backward_fake)
qkv_forward_op = dispatch.custom_op("qkv_forward", _forward, fake=_forward_fake, backward=_backward,
                                    setup_context=_setup_context)
