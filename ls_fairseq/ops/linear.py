"""A bias-free linear layer, y = x W^T, whose backward writes the weight gradient
straight into ``weight.grad`` when ls_adam holds the weight (ops.workspace):
the GEMM accumulates in place (``addmm_``, cuBLAS beta = 1) and autograd gets no
gradient for the weight. The bias is not here: the fused op after the GEMM (qkv,
bias_act_dropout, bias_dropout_residual) adds it. Same math on CPU and GPU.

  dX = dY W (+ the residual's gradient: ops.residual);  dW (+)= dY^T X   (rows of X, Y flattened
  over batch and time)

With ``fp8`` (an ops.fp8_cast.Fp8Gemm: ls_transformer's --ls-fp8) the forward GEMM and/or the input
gradient's run on FP8 tensor cores: x and W cast to e4m3 (W transposed for dX), dY to e5m2, each by
ops.fp8_cast with its delayed scale, the product in fp32 and then in x's dtype. The weight gradient
stays in x's dtype. A GEMM whose M, K or N is not a multiple of 16 runs in x's dtype (cuBLASLt's FP8
rule, kept on every device), as does every GEMM of the recipe's calibrating first pass.
"""
import torch
import torch.nn.functional as F

from ls_fairseq.ops import dispatch, workspace
from ls_fairseq.ops.fp8_cast import fp8_cast, fp8_fits, fp8_mm
from ls_fairseq.ops.qkv import merge_heads


class LinearFunction(torch.autograd.Function):
    """``heads``: x is attention's output [B, heads, T, d_head], merged into [B, T, d] for the
    GEMM: a view when x is token-major (self-attention: split_heads(token_major=True) and
    scaled_dot_product_attention keep that layout), else a copy, which is not kept: backward
    merges again, while x itself costs nothing, since the attention keeps it for its own
    backward (LightSeq2's backward-dependency reuse: 2 bytes x tokens x d per attention block
    less at the peak)."""

    @staticmethod
    def forward(ctx, x, weight, heads, residual_grad, fp8):
        ctx.heads, ctx.residual_grad, ctx.fp8 = heads, residual_grad, fp8
        if residual_grad is not None:
            residual_grad.claim("accumulate")
        y, w8t = _forward(x, weight, heads, fp8)
        ctx.save_for_backward(x, weight, w8t)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, w8t = ctx.saved_tensors
        dx, dw = linear_backward(dy, x, weight, ctx.heads, ctx.residual_grad, ctx.needs_input_grad[:2], ctx.fp8, w8t)
        return dx, dw, None, None, None


def _forward(x, weight, heads, fp8):
    """(x W^T, W in FP8 transposed for the input gradient or None)."""
    x = merge_heads(x) if heads else x
    if fp8 is None:
        return F.linear(x, weight), None
    recipe, row = fp8.recipe, fp8.first
    x2 = x.reshape(-1, x.shape[-1])
    if recipe.calibrating or not fp8_fits(*x2.shape, weight.shape[0]):
        if recipe.calibrating:
            if fp8.forward:
                recipe.observe(row, x2)
                recipe.note(fp8, "forward", *x2.shape, weight.shape[0])
            recipe.observe(row + 1, weight)
        return F.linear(x, weight), None
    w8, w8t = fp8_cast(weight, recipe.row(row + 1), rowwise=fp8.forward, transposed=fp8.dgrad)
    if fp8.forward:
        x8, _ = fp8_cast(x2, recipe.row(row))
        y = fp8_mm(x8, recipe.row(row), w8.t(), recipe.row(row + 1), x.dtype).view(*x.shape[:-1], -1)
    else:
        y = F.linear(x, weight)
    return y, (w8t if fp8.dgrad else None)


def _input_gradient(dy, weight, fp8, w8t):
    """dy W: in FP8 where the forward cast W for it (w8t), else in dy's dtype."""
    dy2 = dy.reshape(-1, dy.shape[-1])
    if w8t is None or not fp8_fits(*dy2.shape, weight.shape[1]):
        if fp8 is not None and fp8.dgrad and fp8.recipe.calibrating:
            fp8.recipe.observe(fp8.first + 2, dy2)
            fp8.recipe.note(fp8, "dgrad", *dy2.shape, weight.shape[1])
        return None
    recipe, row = fp8.recipe, fp8.first
    dy8, _ = fp8_cast(dy2, recipe.row(row + 2), e5m2=recipe.grad_e5m2)
    return fp8_mm(dy8, recipe.row(row + 2), w8t.t(), recipe.row(row + 1), dy.dtype)


def linear_backward(dy, x, weight, heads, residual_grad, needs, fp8=None, w8t=None):
    """(dx, dW) of y = x W^T for ``dy``, each None where ``needs`` (for x, for W) says so; dx with the
    residual's gradient added (``residual_grad``, claimed in forward), dW added into ``weight.grad``
    in place where ls_adam holds the weight (then None). ``fp8``, ``w8t``: the forward's Fp8Gemm and
    its transposed FP8 weight (module docstring)."""
    dx = None
    if needs[0]:
        dres = residual_grad.take() if residual_grad is not None else None
        product = _input_gradient(dy, weight, fp8, w8t)
        if product is not None:
            dx = product.view(*dy.shape[:-1], -1)
            if dres is not None:
                dx = dres.add_(dx)
        elif dres is not None:  # x's residual gradient, accumulated into by the GEMM (beta = 1)
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


_refuse_fp8 = dispatch.refusal("linear: --ls-fp8 / fp8 GEMMs are not supported under torch.compile")


def linear(x, weight, heads=False, residual_grad=None, fp8=None):
    """x [..., in] @ weight [out, in]^T, without bias. ``heads``: x is attention's output
    [B, heads, T, d_head], whose heads are merged (in = heads * d_head) first. ``residual_grad``
    (an ops.ResidualGrad, x [..., in] only): x is also a residual connection's input, whose
    gradient the GEMM of backward accumulates into x's. ``fp8``: an Fp8Gemm (module docstring)."""
    features = x.shape[1] * x.shape[3] if heads else x.shape[-1]
    if (heads and x.dim() != 4) or features != weight.shape[1]:
        raise ValueError("linear: input has {} features ({}), weight {} expects {}".format(
            features, "[B, heads, T, d_head] " + str(tuple(x.shape)) if heads else tuple(x.shape),
            tuple(weight.shape), weight.shape[1]))
    if heads and residual_grad is not None:
        raise ValueError("linear: a residual gradient goes with an input of [..., in], not with heads")
    fp8 = fp8 if fp8 is not None and fp8.active else None
    if dispatch.compiling():  # torch's GEMM, its gradients autograd's (no hand-off, no in-place weight gradient)
        if fp8 is not None:
            _refuse_fp8(x)
        return F.linear(merge_heads(x) if heads else x, weight)
    if torch.is_grad_enabled() and weight.requires_grad:
        return LinearFunction.apply(x, weight, heads, residual_grad, fp8)
    return _forward(x, weight, heads, fp8)[0]
