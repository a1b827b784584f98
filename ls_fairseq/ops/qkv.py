"""Bias add + split into heads, and its inverse (LightSeq2's QKV transform).

split_heads: x [B, T, parts * d] (a projection GEMM's output, bias not yet
added) -> ``parts`` tensors [B, heads, T, d / heads]; the first is multiplied
by ``first_scale`` (1/sqrt(d_head) for a query, folded in here as fairseq
scales q after its bias). parts = 3 gives q, k, v of self-attention; parts = 2L
gives the keys and values of all L decoder layers' cross-attention from one
GEMM. x + bias is never stored. merge_heads is the inverse layout change for
the attention output (ops.linear(..., heads=True) applies it inside the output
projection, keeping only the unmerged output).
"""
import torch

from ls_fairseq.ops import dispatch


def qkv_forward_reference(x, bias, num_heads, num_parts, first_scale):
    B, T, C = x.shape
    d = C // num_parts
    y = (dispatch.upcast(x) + dispatch.upcast(bias)).view(B, T, num_parts, num_heads, d // num_heads)
    y = y.permute(2, 0, 3, 1, 4)
    scale = torch.ones(num_parts, 1, 1, 1, 1, device=x.device)
    scale[0] = first_scale
    return (y * scale).to(x.dtype).contiguous()


def qkv_backward_reference(dy, first_scale, dbias_into=None):
    # dy [parts, B, heads, T, d_head] -> dx [B, T, parts * d]; dbias = sum over B, T of dx
    P, B, H, T, D = dy.shape
    scale = torch.ones(P, 1, 1, 1, 1, device=dy.device)
    scale[0] = first_scale
    dx = (dispatch.upcast(dy) * scale).permute(1, 3, 0, 2, 4).reshape(B, T, P * H * D)
    return dispatch.with_bias_gradient(dx, dy.dtype, dbias_into)


class QKVFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, num_heads, num_parts, first_scale):
        fwd, bwd = dispatch.implementation("qkv", x, qkv_forward_reference, qkv_backward_reference)
        ctx.bwd, ctx.first_scale, ctx.bias = bwd, first_scale, bias
        return fwd(x.contiguous(), bias, num_heads, num_parts, first_scale)

    @staticmethod
    def backward(ctx, dy):
        into = dispatch.grad_in_place(ctx.bias)
        dx, dbias = ctx.bwd(dy.contiguous(), ctx.first_scale, into)
        return dx, dispatch.for_autograd(dbias, into), None, None, None


def split_heads(x, bias, num_heads, num_parts, first_scale=1.0):
    """[B, T, parts*d] + bias -> tuple of ``parts`` tensors [B, heads, T, d_head]."""
    if x.dim() != 3 or x.shape[-1] % (num_parts * num_heads) != 0 or bias.numel() != x.shape[-1]:
        raise ValueError(
            "split_heads: x {} must be [batch, len, parts*d] with parts={} and d divisible by heads={}, bias {} of size parts*d".format(
                tuple(x.shape), num_parts, num_heads, tuple(bias.shape)
            )
        )
    y = QKVFunction.apply(x, bias, num_heads, num_parts, first_scale)
    # one part: a view, whose gradient is a view too (unbind's backward would stack one tensor: a copy)
    return (y.squeeze(0),) if num_parts == 1 else y.unbind(0)


def merge_heads(x):
    """[B, heads, T, d_head] -> [B, T, heads * d_head]."""
    B, H, T, D = x.shape
    return x.transpose(1, 2).reshape(B, T, H * D)
