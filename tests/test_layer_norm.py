import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPES, assert_close, check_kernel, grads, kernel, poison, rel_error

from ls_fairseq import ops
from ls_fairseq.ops.layer_norm import layer_norm_backward_reference, layer_norm_forward_reference


@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (2, 5, 512), (3, 1030)])
def test_forward_and_backward_match_torch_layer_norm(shape):
    H = shape[-1]
    x = (torch.randn(shape, dtype=torch.float64) * 3 + 1).requires_grad_()
    w = torch.randn(H, dtype=torch.float64, requires_grad=True)
    b = torch.randn(H, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(shape, dtype=torch.float64)
    y = ops.layer_norm(x, w, b)
    ref = F.layer_norm(x, (H,), w, b, eps=1e-5)
    assert_close(y, ref, what="forward")
    for g, r, name in zip(grads(y, (x, w, b), dy), grads(ref, (x, w, b), dy), ("dx", "dgamma", "dbeta")):
        assert_close(g, r, rtol=1e-9, atol=1e-9, what=name)


def test_one_pass_statistics_survive_a_large_mean():
    # mean 1e4, std 1e-1: E[x^2] - E[x]^2 without the shift loses every digit in fp32
    x = (torch.randn(16, 1024, dtype=torch.float64) * 0.1 + 1e4)
    w, b = torch.ones(1024, dtype=torch.float64), torch.zeros(1024, dtype=torch.float64)
    ref = F.layer_norm(x, (1024,), w, b, eps=1e-5)
    y, mean, rstd = layer_norm_forward_reference(x.float(), w.float(), b.float(), 1e-5)
    assert (y.double() - ref).abs().max() < 2e-2
    assert_close(rstd.double(), 1 / (x.var(-1, unbiased=False) + 1e-5).sqrt(), rtol=1e-3, atol=0, what="rstd")


def test_gradcheck():
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: ops.layer_norm(*a), (x, w, b))


def test_backward_reference_is_the_explicit_formula():
    x = torch.randn(5, 33, dtype=torch.float64)
    w, b = torch.randn(33, dtype=torch.float64), torch.randn(33, dtype=torch.float64)
    dy = torch.randn(5, 33, dtype=torch.float64)
    _, mean, rstd = layer_norm_forward_reference(x, w, b, 1e-5)
    dx, dw, db = layer_norm_backward_reference(dy, x, w, mean, rstd)
    xr = x.clone().requires_grad_()
    wr, br = w.clone().requires_grad_(), b.clone().requires_grad_()
    ref = grads(F.layer_norm(xr, (33,), wr, br, eps=1e-5), (xr, wr, br), dy)
    for g, r in zip((dx, dw, db), ref):
        assert_close(g, r, rtol=1e-9, atol=1e-9)


def test_shape_errors_name_the_problem():
    with pytest.raises(ValueError, match="last dimension 8 must equal weight"):
        ops.layer_norm(torch.randn(2, 8), torch.ones(7), torch.zeros(7))



@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
# the one-pass backward takes rows of 1 to 4 x 32 vectors of 16 bytes (256 .. 1024 in fp16/bf16,
# 128 .. 512 in fp32) in strips of rows (more than 32 rows a strip past 16,384 rows); others the two-pass one
@pytest.mark.parametrize("rows,hidden", [(1, 512), (7, 1030), (8191, 1024), (33, 768), (5, 256), (20000, 512),
                                         (40, 2048)])
def test_kernel_matches_reference(dtype, rows, hidden):
    x = (torch.randn(rows, hidden, device="cuda") * 3 + 2).to(dtype)
    w = (torch.rand(hidden, device="cuda") + 0.5).to(dtype)
    b = torch.randn(hidden, device="cuda").to(dtype)
    dy = torch.randn(rows, hidden, device="cuda").to(dtype)
    ext = kernel("layer_norm", x)
    poison()
    y, mean, rstd = ext.layer_norm_forward(x, w, b, 1e-5)
    poison()
    dx, dw, db = ext.layer_norm_backward(dy, x, w, mean, rstd, None, None)
    assert torch.equal(dw, ext.layer_norm_backward(dy, x, w, mean, rstd, None, None)[1]), "dgamma must be deterministic"
    x64, w64, b64, dy64 = (t.double() for t in (x, w, b, dy))
    y64, mean64, rstd64 = layer_norm_forward_reference(x64, w64, b64, 1e-5)
    dx64, dw64, db64 = layer_norm_backward_reference(dy64, x64, w64, mean64, rstd64)
    # PyTorch's own: torch's layer norm in the same precision (what fairseq's LayerNorm runs)
    xl, wl, bl = (t.clone().requires_grad_() for t in (x, w, b))
    yl = F.layer_norm(xl, (hidden,), wl, bl, 1e-5)
    dxl, dwl, dbl = torch.autograd.grad(yl, (xl, wl, bl), dy)
    for out, ref, low, name in zip((y, dx, dw, db), (y64, dx64, dw64, db64), (yl, dxl, dwl, dbl), ("y", "dx", "dgamma", "dbeta")):
        check_kernel(out, ref, low, name)
    assert rel_error(mean, mean64) < 1e-5 and rel_error(rstd, rstd64) < 1e-4
