import pytest
import torch
from helpers import DTYPES, assert_close, check_kernel, grads, kernel, poison

from ls_fairseq import ops
from ls_fairseq.ops.qkv import qkv_backward_reference, qkv_forward_reference


@pytest.mark.parametrize("token_major", (False, True))
@pytest.mark.parametrize("B,T,H,D,parts", [(1, 1, 1, 4, 3), (2, 7, 4, 8, 3), (3, 5, 2, 6, 1), (2, 3, 2, 4, 4)])
def test_split_heads_matches_view_permute(B, T, H, D, parts, token_major):
    x = torch.randn(B, T, parts * H * D, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(parts * H * D, dtype=torch.float64, requires_grad=True)
    out = ops.split_heads(x, bias, H, parts, 0.125, token_major)
    ref = [(c.view(B, T, H, D).transpose(1, 2)) for c in (x + bias).chunk(parts, dim=-1)]
    ref[0] = ref[0] * 0.125
    assert len(out) == parts
    # token-major parts merge their heads without a copy: views of [parts, B, T, heads, d_head]
    assert all((o.transpose(1, 2) if token_major else o).is_contiguous() for o in out)
    ups = [torch.randn_like(o) for o in out]
    for o, r in zip(out, ref):
        assert_close(o, r)
    for g, r in zip(grads(out, (x, bias), ups), grads(ref, (x, bias), ups)):
        assert_close(g, r)


def test_merge_heads_inverts_split():
    x = torch.randn(2, 5, 3 * 12, dtype=torch.float64)
    q, k, v = ops.split_heads(x, torch.zeros(36, dtype=torch.float64), 4, 3)
    assert torch.equal(ops.merge_heads(k), x[..., 12:24])


def test_a_part_without_gradient_counts_as_zero():
    x = torch.randn(2, 3, 12, dtype=torch.float64, requires_grad=True)
    b = torch.randn(12, dtype=torch.float64, requires_grad=True)
    q, k, v = ops.split_heads(x, b, 2, 3, 0.5)
    dx, db = torch.autograd.grad((q * 2).sum() + v.sum(), (x, b))
    assert torch.equal(dx[..., 4:8], torch.zeros_like(dx[..., 4:8]))
    assert torch.equal(dx[..., :4], torch.ones_like(dx[..., :4]))  # 2 x the query scale 0.5
    assert torch.equal(db, dx.sum((0, 1)))


def test_gradcheck():
    x = torch.randn(2, 3, 12, dtype=torch.float64, requires_grad=True)
    b = torch.randn(12, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, b: ops.split_heads(x, b, 2, 3, 0.5), (x, b))


def test_indivisible_width_is_an_error():
    with pytest.raises(ValueError, match="divisible by heads"):
        ops.split_heads(torch.randn(1, 2, 30), torch.zeros(30), 4, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("token_major", (False, True))
@pytest.mark.parametrize(
    "B,T,H,D,parts,missing",
    [(2, 7, 4, 64, 3, ()), (3, 33, 16, 64, 1, ()), (1, 1, 2, 6, 2, ()), (4, 257, 16, 64, 12, (5,)),
     (2, 9, 2, 8, 18, (0, 17))],  # 18 parts: two launches (16 parts each at most); missing parts: no gradient
)
def test_kernel_matches_reference(dtype, B, T, H, D, parts, missing, token_major):
    x = torch.randn(B, T, parts * H * D, device="cuda").to(dtype)
    b = torch.randn(parts * H * D, device="cuda").to(dtype)
    dys = [None if k in missing else torch.randn(B, H, T, D, device="cuda").to(dtype) for k in range(parts)]
    ext = kernel("qkv", x)
    poison()
    out = ext.qkv_forward(x, b, H, parts, D**-0.5, token_major)
    poison()
    dx, db = ext.qkv_backward(dys, D**-0.5, None)
    out64 = qkv_forward_reference(x.double(), b.double(), H, parts, D**-0.5, token_major)
    assert [st for st, n in zip(out.stride(), out.shape) if n > 1] == [st for st, n in zip(out64.stride(), out64.shape) if n > 1]
    dx64, db64 = qkv_backward_reference([None if g is None else g.double() for g in dys], D**-0.5)
    out_l = qkv_forward_reference(x, b, H, parts, D**-0.5, token_major)
    dx_l, db_l = qkv_backward_reference(dys, D**-0.5)
    for o, ref, low, name in ((out, out64, out_l, "out"), (dx, dx64, dx_l, "dx"), (db, db64, db_l, "dbias")):
        check_kernel(o, ref, low, name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,H,D", [(2, 7, 4, 64), (3, 5, 2, 6)])  # 16-byte vectors, and the scalar path
def test_kernel_reads_parts_through_their_strides(dtype, B, T, H, D):
    """Parts given as views (as attention backwards return them: [B, heads, T, d_head] over a
    [B, T, heads, d_head] buffer) give the bits of their contiguous copies; a part whose rows of
    d_head are not contiguous is refused by name."""
    views = [torch.randn(B, T, H, D, device="cuda").to(dtype).transpose(1, 2) for _ in range(3)]
    views[1] = torch.randn(H, B, T, D, device="cuda").to(dtype).permute(1, 0, 2, 3)
    ext = kernel("qkv", views[0])
    poison()
    dx, db = ext.qkv_backward(views, D**-0.5, None)
    poison()
    dx_c, db_c = ext.qkv_backward([g.contiguous() for g in views], D**-0.5, None)
    assert torch.equal(dx, dx_c) and torch.equal(db, db_c)
    bad = torch.randn(B, H, D, T, device="cuda").to(dtype).transpose(2, 3)
    with pytest.raises(RuntimeError, match="contiguous rows of d_head"):
        ext.qkv_backward([views[0], bad, views[2]], D**-0.5, None)
