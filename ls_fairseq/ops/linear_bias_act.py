"""act(x W^T + bias), with dropout after it: the FFN's first half, its GEMM included.

Where the activation is relu and no dropout follows it (transformer-big's FFN: fairseq's
--activation-dropout 0, or any model at inference), the bias and the ReLU run in the GEMM's
epilogue (``torch._addmm_activation``: cuBLASLt's bias + ReLU epilogue on GPUs, addmm + relu on
CPUs): the pass that ops.bias_act_dropout makes after a plain GEMM (reading and writing tokens x
ffn elements) is not made, and the sum is rounded once. Backward as ops.bias_act_dropout's from
its output (dh = dout [out > 0], the bias's gradient the sum of dh, by that op's route) and then
ops.linear's (dX = dh W plus the residual's gradient, dW added in place where ls_adam holds W).
Saved for backward: x and out, which ops.linear would keep for this GEMM and the next anyway.
Other activations, dropout after the activation, or an FP8 GEMM (``fp8``, as ops.linear's: torch's FP8
GEMM has no ReLU epilogue): ops.bias_act_dropout after ops.linear.
"""
import torch
import torch.nn.functional as F

from ls_fairseq.ops import dispatch, workspace
from ls_fairseq.ops.bias_act_dropout import BIAS_ACT_DROPOUT_ROUTE, bias_act_dropout
from ls_fairseq.ops.linear import linear, linear_backward


def _relu_gemm(x, weight, bias):
    out = torch._addmm_activation(bias, x.reshape(-1, x.shape[-1]), weight.t())
    return out.view(*x.shape[:-1], weight.shape[0])


class LinearBiasReluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, residual_grad):
        ctx.residual_grad, ctx.bias = residual_grad, bias
        if residual_grad is not None:
            residual_grad.claim("accumulate")
        out = _relu_gemm(x, weight, bias)
        ctx.save_for_backward(x, weight, out)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight, out = ctx.saved_tensors
        _, bwd = BIAS_ACT_DROPOUT_ROUTE.pick(out)
        into = workspace.grad_in_place(ctx.bias)
        # relu'(x W^T + bias) = [out > 0]: bias_act_dropout's backward with x = out, no bias, no dropout
        dh, dbias = bwd(dout.contiguous(), out, None, None, "relu", 0.0, into)
        dx, dw = linear_backward(dh, x, weight, False, ctx.residual_grad, ctx.needs_input_grad[:2])
        return dx, dw, workspace.for_autograd(dbias, into), None


def linear_bias_act(x, weight, bias, activation="relu", p=0.0, training=True, residual_grad=None, fp8=None):
    """dropout(act(x [..., in] @ weight [out, in]^T + bias)); ``residual_grad`` and ``fp8`` as ops.linear's."""
    if activation != "relu" or (p > 0 and training) or (fp8 is not None and fp8.active):
        return bias_act_dropout(linear(x, weight, residual_grad=residual_grad, fp8=fp8), bias, activation, p, training)
    if x.shape[-1] != weight.shape[1] or bias.shape != weight.shape[:1]:
        raise ValueError("linear_bias_act: input {}, weight {} and bias {} do not fit: [..., in], [out, in], "
                         "[out]".format(tuple(x.shape), tuple(weight.shape), tuple(bias.shape)))
    if dispatch.compiling():  # torch's GEMM with the bias, then relu: the graph's to fuse; autograd's gradients
        return torch.relu(F.linear(x, weight, bias))
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad):
        return LinearBiasReluFunction.apply(x, weight, bias, residual_grad)
    return _relu_gemm(x, weight, bias)
