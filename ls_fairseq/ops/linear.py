"""A bias-free linear layer, y = x W^T, whose backward writes the weight gradient
straight into ``weight.grad`` when ls_adam holds the weight (ops.workspace):
the GEMM accumulates in place (``addmm_``, cuBLAS beta = 1) and autograd gets no
gradient for the weight. The bias is not here: the fused op after the GEMM (qkv,
bias_act_dropout, bias_dropout_residual) adds it. Same math on CPU and GPU.

  dX = dY W (+ the residual's gradient: ops.residual);  dW (+)= dY^T X   (rows of X, Y flattened
  over batch and time)
"""
import torch
import torch.nn.functional as F

from ls_fairseq.ops import workspace
from ls_fairseq.ops.qkv import merge_heads


class LinearFunction(torch.autograd.Function):
    """``heads``: x is attention's output [B, heads, T, d_head], merged into [B, T, d] for the
    GEMM: a view when x is token-major (self-attention: split_heads(token_major=True) and
    scaled_dot_product_attention keep that layout), else a copy, which is not kept: backward
    merges again, while x itself costs nothing, since the attention keeps it for its own
    backward (LightSeq2's backward-dependency reuse: 2 bytes x tokens x d per attention block
    less at the peak)."""

    @staticmethod
    def forward(ctx, x, weight, heads, residual_grad):
        ctx.heads, ctx.residual_grad = heads, residual_grad
        if residual_grad is not None:
            residual_grad.claim("accumulate")
        ctx.save_for_backward(x, weight)
        return F.linear(merge_heads(x) if heads else x, weight)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx, dw = linear_backward(dy, x, weight, ctx.heads, ctx.residual_grad, ctx.needs_input_grad[:2])
        return dx, dw, None, None


def linear_backward(dy, x, weight, heads, residual_grad, needs):
    """(dx, dW) of y = x W^T for ``dy``, each None where ``needs`` (for x, for W) says so; dx with the
    residual's gradient added (``residual_grad``, claimed in forward), dW added into ``weight.grad``
    in place where ls_adam holds the weight (then None)."""
    dx = None
    if needs[0]:
        dres = residual_grad.take() if residual_grad is not None else None
        if dres is not None:  # x's residual gradient, accumulated into by the GEMM (beta = 1)
            dx = dres.view(-1, dres.shape[-1]).addmm_(dy.reshape(-1, dy.shape[-1]), weight).view(dres.shape)
        else:
            dx = dy.matmul(weight)
        if heads:
            B, H, T, D = x.shape
            dx = dx.view(B, T, H, D).transpose(1, 2)
    if not needs[1]:
        return dx, None
    x2 = (merge_heads(x) if heads else x).reshape(-1, weight.shape[1])
    dy2 = dy.reshape(-1, dy.shape[-1])
    into = workspace.grad_in_place(weight)
    if into is not None:
        into.addmm_(dy2.t(), x2)
        return dx, None
    return dx, dy2.t().mm(x2)


def linear(x, weight, heads=False, residual_grad=None):
    """x [..., in] @ weight [out, in]^T, without bias. ``heads``: x is attention's output
    [B, heads, T, d_head], whose heads are merged (in = heads * d_head) first. ``residual_grad``
    (an ops.ResidualGrad, x [..., in] only): x is also a residual connection's input, whose
    gradient the GEMM of backward accumulates into x's."""
    features = x.shape[1] * x.shape[3] if heads else x.shape[-1]
    if (heads and x.dim() != 4) or features != weight.shape[1]:
        raise ValueError("linear: input has {} features ({}), weight {} expects {}".format(
            features, "[B, heads, T, d_head] " + str(tuple(x.shape)) if heads else tuple(x.shape),
            tuple(weight.shape), weight.shape[1]))
    if heads and residual_grad is not None:
        raise ValueError("linear: a residual gradient goes with an input of [..., in], not with heads")
    if torch.is_grad_enabled() and weight.requires_grad:
        return LinearFunction.apply(x, weight, heads, residual_grad)
    return F.linear(merge_heads(x) if heads else x, weight)
