"""A bias-free linear layer, y = x W^T, whose backward writes the weight gradient
straight into ``weight.grad`` (LightSeq2's layers write into the gradient workspace).

autograd would compute dW into a new tensor and then add it to the existing
``weight.grad`` (ls_adam keeps every gradient alive as a view of its workspace):
one more kernel, one more weight-sized temporary and one more autograd node per
weight and step. Here the GEMM accumulates in place (``addmm_``, cuBLAS beta = 1)
and autograd gets no gradient for the weight. The bias is not here: the fused
op after the GEMM (qkv, bias_act_dropout, bias_dropout_residual) adds it.

The in-place path is taken for weights that ls_adam keeps in its gradient
workspace (it sets ``weight.ls_grad_in_workspace``; ``.backward()`` is then the
only way their gradients are taken in training), when ``weight.grad`` exists
with the weight's dtype and layout and torch.distributed is not initialised
(DistributedDataParallel learns that a gradient is ready from autograd's
accumulation of it). Otherwise the weight's gradient goes back to autograd as
usual, so ``torch.autograd.grad`` and other optimizers see nothing different.
Same math on CPU and GPU.

  dX = dY W;  dW (+)= dY^T X   (rows of X, Y flattened over batch and time)
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F


IN_WORKSPACE = "ls_grad_in_workspace"  # the attribute ls_adam sets on the parameters it holds


def accumulates_in_place(weight):
    grad = weight.grad
    return (
        getattr(weight, IN_WORKSPACE, False)
        and grad is not None
        and grad.dtype == weight.dtype
        and grad.shape == weight.shape
        and grad.is_contiguous()
        and not (dist.is_available() and dist.is_initialized())
    )


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
        if accumulates_in_place(weight):
            weight.grad.addmm_(dy2.t(), x2)
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
