import pytest
import torch
from helpers import DTYPES, assert_close, check_kernel, drawn, grads, keep_mask, kernel, poison

from ls_fairseq import ops
from ls_fairseq.ops.bias_dropout_residual import (
    bias_dropout_residual_backward_reference,
    bias_dropout_residual_forward_reference,
)


@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (2, 9, 1030)])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_matches_composition(shape, p):
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    b = torch.randn(shape[-1], dtype=torch.float64, requires_grad=True)
    r = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    mask = keep_mask(shape, p) if p else None
    out = ops.bias_dropout_residual(x, b, r, p, True, mask)
    ref = r + (x + b) * (mask.double() / (1 - p) if p else 1)
    assert_close(out, ref)
    dout = torch.randn_like(out)
    for g, e in zip(grads(out, (x, b, r), dout), grads(ref, (x, b, r), dout)):
        assert_close(g, e)


def test_eval_mode_is_deterministic_and_training_drops():
    x, b, r = torch.randn(4, 8), torch.randn(8), torch.randn(4, 8)
    assert torch.equal(ops.bias_dropout_residual(x, b, r, 0.5, False), (x + b) + r)
    out = ops.bias_dropout_residual(x, b, r, 0.5, True)
    assert (out == r).any() and (out != r).any()


def test_gradcheck():
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, requires_grad=True)
    r = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    mask = keep_mask((3, 5), 0.4)
    assert torch.autograd.gradcheck(lambda x, b, r: ops.bias_dropout_residual(x, b, r, 0.4, True, mask), (x, b, r))


def test_shape_mismatch_is_named():
    with pytest.raises(ValueError, match="residual"):
        ops.bias_dropout_residual(torch.randn(2, 4), torch.randn(4), torch.randn(3, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
# row chunks (at most one wave of blocks, so device-dependent; on an H200): one; two groups, the last
# one short (3000 x 1030); 17 groups (20000 x 512); the most, 512, in 32 groups (20000 x 24)
@pytest.mark.parametrize("rows,hidden", [(1, 1024), (7, 1030), (3000, 1030), (8191, 1024), (20000, 512), (20000, 24)])
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_kernel_matches_reference(dtype, rows, hidden, p):
    x, r, dout = (torch.randn(rows, hidden, device="cuda").to(dtype) for _ in range(3))
    b = torch.randn(hidden, device="cuda").to(dtype)
    ext = kernel("bias_dropout_residual", x)
    poison()
    out, dropout = ext.bias_dropout_residual_forward(x, b, r, p, None)
    assert (dropout is None) == (p == 0)
    poison()
    dx, db = ext.bias_dropout_residual_backward(dout, dropout, p, None)
    assert torch.equal(db, ext.bias_dropout_residual_backward(dout, dropout, p, None)[1]), "dbias must be deterministic"
    mask = drawn(dropout)  # the forward's keep-bits, which the backward drew again
    out64, _ = bias_dropout_residual_forward_reference(x.double(), b.double(), r.double(), p, mask)
    dx64, db64 = bias_dropout_residual_backward_reference(dout.double(), mask, p)
    out_l, _ = bias_dropout_residual_forward_reference(x, b, r, p, mask)
    dx_l, db_l = bias_dropout_residual_backward_reference(dout, mask, p)
    for o, ref, low, name in ((out, out64, out_l, "out"), (dx, dx64, dx_l, "dx"), (db, db64, db_l, "dbias")):
        check_kernel(o, ref, low, name)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols", [(3, 70000), (130, 1030)])
def test_kernel_bias_gradient_of_any_width(rows, cols):
    """The column reduction takes any number of columns (70,000: a strip's blocks once counted
    themselves in with counters for 63,520 at most) and of rows (130: chunks of 44, 44 and 42 rows)."""
    dout = torch.randn(rows, cols, device="cuda")
    ext = kernel("bias_dropout_residual", dout)
    poison()
    dx, db = ext.bias_dropout_residual_backward(dout, None, 0.0, None)
    assert torch.equal(dx, dout)
    check_kernel(db, dout.double().sum(0), None, "dbias")


@pytest.mark.gpu
# more rows than a grid's y dimension holds (65,535), and one row of more column blocks than it holds
# (one element a thread, 256 a block: two launches)
@pytest.mark.parametrize("rows,hidden", [(70000, 8), (1, 65535 * 256 + 1)])
def test_kernel_forward_of_any_shape(rows, hidden):
    x, r = (torch.randn(rows, hidden, device="cuda") for _ in range(2))
    b = torch.randn(hidden, device="cuda")
    ext = kernel("bias_dropout_residual", x)
    poison()
    out, dropout = ext.bias_dropout_residual_forward(x, b, r, 0.1, None)
    mask = drawn(dropout)
    assert 0.89 < mask.float().mean().item() < 0.91
    ref, _ = bias_dropout_residual_forward_reference(x.double(), b.double(), r.double(), 0.1, mask)
    check_kernel(out, ref, None, "out")


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [1024, 1023])  # 16-byte vectors; the one-element path
def test_kernel_dropout_rate_seed_and_given_mask(hidden):
    x, r = torch.randn(4096, hidden, device="cuda"), torch.zeros(4096, hidden, device="cuda")
    b = torch.zeros(hidden, device="cuda")
    ext = kernel("bias_dropout_residual", x)
    x = torch.rand_like(x) + 1.0  # no zeros: an element is zero exactly where it is dropped
    torch.cuda.manual_seed(5)
    a, drop_a = ext.bias_dropout_residual_forward(x, b, r, 0.3, None)
    _, drop_b = ext.bias_dropout_residual_forward(x, b, r, 0.3, None)
    torch.cuda.manual_seed(5)
    _, drop_c = ext.bias_dropout_residual_forward(x, b, r, 0.3, None)
    mask_a, mask_b, mask_c = drawn(drop_a), drawn(drop_b), drawn(drop_c)
    assert torch.equal((a != 0).to(torch.uint8), mask_a), "the mask written out is not the one the forward applied"
    assert torch.equal(mask_a, mask_c) and not torch.equal(mask_a, mask_b)
    assert abs(mask_a.float().mean().item() - 0.7) < 0.003
    # neighbours are independent: equal with probability 0.7^2 + 0.3^2
    flat = mask_a.flatten()
    assert abs((flat[1:] == flat[:-1]).float().mean().item() - 0.58) < 0.003
    given_mask = keep_mask(x.shape, 0.3, "cuda")
    given, dropout = ext.bias_dropout_residual_forward(x, b, r, 0.3, given_mask)
    wrong = (given == 0) != (given_mask == 0)
    assert not wrong.any(), "{} elements ignore the given mask, first at {}".format(int(wrong.sum()), wrong.nonzero()[:4].tolist())
    dx, _ = ext.bias_dropout_residual_backward(torch.ones_like(x), dropout, 0.3, None)
    assert torch.equal((dx != 0).to(torch.uint8), given_mask), "the backward must apply the given mask"


@pytest.mark.gpu
def test_kernel_backward_checks_the_dropout_it_is_given():
    x = torch.randn(8, 64, device="cuda")
    ext = kernel("bias_dropout_residual", x)
    _, dropout = ext.bias_dropout_residual_forward(x, x[0], x, 0.3, None)
    assert dropout.p == 0.3
    with pytest.raises(RuntimeError, match=r"dropout was drawn over shape \[8, 64\], the gradient has shape \[4, 64\]"):
        ext.bias_dropout_residual_backward(x[:4].contiguous(), dropout, 0.3, None)
    with pytest.raises(RuntimeError, match="dropout was drawn at p = 0.3, the backward was given p = 0.1"):
        ext.bias_dropout_residual_backward(x, dropout, 0.1, None)


def test_no_zero_gradient_is_made():
    """autograd must not fill a zero gradient for the Function's outputs (a kernel per call on the
    GPU)."""
    from torch.profiler import ProfilerActivity, profile

    x, r = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    out = ops.bias_dropout_residual(x, b, r, 0.3, True)
    up = torch.randn_like(out)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out.backward(up)
    made = {e.key for e in prof.key_averages()} & {"aten::zeros_like", "aten::zero_", "aten::zeros"}
    assert not made, made
