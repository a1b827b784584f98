"""A bias-free linear layer, y = x W^T, whose backward writes the weight gradient
straight into ``weight.grad`` when ls_adam holds the weight (dispatch.grad_in_place):
the GEMM accumulates in place (``addmm_``, cuBLAS beta = 1) and autograd gets no
gradient for the weight. The bias is not here: the fused op after the GEMM (qkv,
bias_act_dropout, bias_dropout_residual) adds it. Same math on CPU and GPU.

  dX = dY W;  dW (+)= dY^T X   (rows of X, Y flattened over batch and time)
"""
import torch
import torch.nn.functional as F

from ls_fairseq.ops import dispatch


class LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return dx, None
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        into = dispatch.grad_in_place(weight)
        if into is not None:
            into.addmm_(dy2.t(), x2)
            return dx, None
        return dx, dy2.t().mm(x2)


def linear(x, weight):
    """x [..., in] @ weight [out, in]^T, without bias."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError("linear: input has {} features, weight {} expects {}".format(
            x.shape[-1], tuple(weight.shape), weight.shape[1]))
    if torch.is_grad_enabled() and weight.requires_grad:
        return LinearFunction.apply(x, weight)
    return F.linear(x, weight)
