import pytest
import torch
from helpers import DTYPES, assert_close, check_kernel, drawn, grads, keep_mask, kernel, poison

from ls_fairseq import ops
from ls_fairseq.ops.bias_dropout_residual_layer_norm import (
    bias_dropout_residual_layer_norm_backward_reference,
    bias_dropout_residual_layer_norm_forward_reference,
)


def inputs(shape, dtype=torch.float64, device="cpu"):
    """h, bias, residual, weight, ln_bias (all requiring gradients)."""
    d = shape[-1]
    return [torch.randn(s, device=device).to(dtype).requires_grad_() for s in (shape, (d,), shape, (d,), (d,))]


@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (2, 9, 1030)])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_matches_the_two_ops_in_a_row(shape, p):
    h, b, r, w, lb = inputs(shape)
    mask = keep_mask(shape, p) if p else None
    y = ops.bias_dropout_residual_layer_norm(h, b, r, w, lb, p, True, mask=mask)
    ref = ops.layer_norm(ops.bias_dropout_residual(h, b, r, p, True, mask), w, lb)
    assert_close(y, ref)
    dy = torch.randn_like(y)
    for g, e in zip(grads(y, (h, b, r, w, lb), dy), grads(ref, (h, b, r, w, lb), dy)):
        assert_close(g, e)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_the_residual_gradient_handed_to_the_first_gemm_equals_autograds(p):
    """A post-LN block: x -> GEMM -> this op with x as the residual; the GEMM accumulates the
    residual's gradient (LayerNorm's dx) into x's (ops.residual)."""
    torch.manual_seed(0)
    mask = keep_mask((2, 5, 8), p) if p else None

    def block(residual):
        torch.manual_seed(1)
        x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
        wq = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
        _, b, _, w, lb = inputs((2, 5, 8))
        y = ops.bias_dropout_residual_layer_norm(ops.linear(x, wq, residual_grad=residual), b, x, w, lb, p, True,
                                                 mask=mask, residual_grad=residual)
        y.backward(torch.ones_like(y))
        return x.grad, wq.grad

    for g, e in zip(block(ops.ResidualGrad()), block(None)):
        assert_close(g, e)


def test_gradcheck():
    h, b, r, w, lb = inputs((3, 5))
    mask = keep_mask((3, 5), 0.4)
    assert torch.autograd.gradcheck(
        lambda *t: ops.bias_dropout_residual_layer_norm(*t, 0.4, True, mask=mask), (h, b, r, w, lb))


def test_shape_mismatch_is_named():
    with pytest.raises(ValueError, match="ln_bias"):
        ops.bias_dropout_residual_layer_norm(*[torch.randn(s) for s in ((2, 4), (4,), (2, 4), (4,), (5,))])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
# 1030: element by element; 5000: a block a row; 256 .. 1024: LayerNorm's strips (fp16/bf16: 1 to 4 lane vectors a
# row, in two warps at 512 and 1,024; fp32 at 256 and 512), where the bias's backward joins their kernel
@pytest.mark.parametrize("rows,hidden", [(1, 1024), (7, 1030), (8191, 1024), (37, 5000), (300, 768), (129, 512),
                                         (65, 256)])
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_kernel_matches_reference_and_the_two_kernels_bit_for_bit(dtype, rows, hidden, p):
    h, b, r, w, lb = (t.detach() for t in inputs((rows, hidden), dtype, "cuda"))
    ext = kernel("bias_dropout_residual_layer_norm", h)
    poison()
    y, x, mean, rstd, dropout = ext.bias_dropout_residual_layer_norm_forward(h, b, r, w, lb, 1e-5, p, None)
    assert (dropout is None) == (p == 0)
    mask = drawn(dropout)  # the forward's keep-bits, which the backward draws again
    # the two kernels in a row, with the fused kernel's mask: the same bits
    x2, _ = ext.bias_dropout_residual_forward(h, b, r, p, mask)
    y2, mean2, rstd2 = ext.layer_norm_forward(x2, w, lb, 1e-5)
    for a, e, name in ((x, x2, "x"), (y, y2, "y"), (mean, mean2, "mean"), (rstd, rstd2, "rstd")):
        assert torch.equal(a, e), name
    dy = torch.randn(rows, hidden, device="cuda").to(dtype)
    poison()
    dh, dbias, dx, dw, dlb = ext.bias_dropout_residual_layer_norm_backward(dy, x, w, mean, rstd, dropout, p, None,
                                                                           None, None)
    args64 = [t.double() for t in (h, b, r, w, lb)]
    out64 = bias_dropout_residual_layer_norm_forward_reference(*args64, 1e-5, p, mask)
    out_l = bias_dropout_residual_layer_norm_forward_reference(h, b, r, w, lb, 1e-5, p, mask)
    for o, ref, low, name in zip((y, x), out64[:2], out_l[:2], ("y", "x")):
        check_kernel(o, ref, low, name)
    back64 = bias_dropout_residual_layer_norm_backward_reference(dy.double(), out64[1], args64[3], out64[2], out64[3],
                                                                 mask, p)
    back_l = bias_dropout_residual_layer_norm_backward_reference(dy, x, w, mean, rstd, mask, p)
    for o, ref, low, name in zip((dh, dbias, dx, dw, dlb), back64, back_l, ("dh", "dbias", "dx", "dweight", "dln_bias")):
        check_kernel(o, ref, low, name)
    # the column sums (dbias, dweight, dln_bias) in a fixed order: the same bits run to run
    again = ext.bias_dropout_residual_layer_norm_backward(dy, x, w, mean, rstd, dropout, p, None, None, None)
    for o, a, name in zip((dh, dbias, dx, dw, dlb), again, ("dh", "dbias", "dx", "dweight", "dln_bias")):
        assert torch.equal(o, a), name
