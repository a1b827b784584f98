"""Fused Transformer ops: one module per op, each with its PyTorch reference,
its autograd Function and one ``dispatch.Route`` to its kernel or reference, and
the ``ls_fairseq::`` custom ops that torch.compile calls instead (dispatch.py);
``workspace`` says which parameter gradients the backwards add into in place."""
from ls_fairseq.ops.adam import adam_step, grad_norm, new_scaler_state, scaled_grad_norm
from ls_fairseq.ops.attention import AttentionMask, DenseMask, SegmentMask, attention
from ls_fairseq.ops.bias_act_dropout import bias_act_dropout
from ls_fairseq.ops.bias_dropout_residual import bias_dropout_residual
from ls_fairseq.ops.bias_dropout_residual_layer_norm import bias_dropout_residual_layer_norm
from ls_fairseq.ops.cross_entropy import label_smoothed_cross_entropy
from ls_fairseq.ops.embedding import embedding, make_positions
from ls_fairseq.ops.fp8_cast import Fp8Recipe
from ls_fairseq.ops.layer_norm import layer_norm
from ls_fairseq.ops.linear import linear
from ls_fairseq.ops.linear_bias_act import linear_bias_act
from ls_fairseq.ops.qkv import merge_heads, split_heads
from ls_fairseq.ops.residual import ResidualGrad
from ls_fairseq.ops.softmax import softmax

__all__ = [
    "AttentionMask",
    "DenseMask",
    "Fp8Recipe",
    "ResidualGrad",
    "SegmentMask",
    "adam_step",
    "attention",
    "bias_act_dropout",
    "bias_dropout_residual",
    "bias_dropout_residual_layer_norm",
    "embedding",
    "grad_norm",
    "label_smoothed_cross_entropy",
    "layer_norm",
    "linear",
    "linear_bias_act",
    "make_positions",
    "merge_heads",
    "new_scaler_state",
    "scaled_grad_norm",
    "softmax",
    "split_heads",
]
