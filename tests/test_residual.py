"""ops.ResidualGrad: a residual connection's gradient handed from bias_dropout_residual's backward
to the block's first op, which adds it into x's gradient (the GEMM by accumulating into it)."""
import pytest
import torch
from helpers import assert_close
from torch.profiler import ProfilerActivity, profile

from ls_fairseq import ops


MASK = torch.rand(2, 5, 8, generator=torch.Generator().manual_seed(1)).gt(0.1).to(torch.uint8)


def block(x, w, b, ln_w, ln_b, first, residual):
    """out = x + dropout(branch(x)) (a fixed mask): branch = GEMM (post-LN style) or LayerNorm then GEMM
    (pre-LN style)."""
    if first == "layer_norm":
        h = ops.linear(ops.layer_norm(x, ln_w, ln_b, residual_grad=residual), w)
    else:
        h = ops.linear(x, w, residual_grad=residual)
    return ops.bias_dropout_residual(h, b, x, 0.1, True, mask=MASK, residual_grad=residual)


def leaves(frozen=False):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 8, dtype=torch.float64, requires_grad=not frozen)
    rest = [torch.randn(8, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    return [x, w] + rest


@pytest.mark.parametrize("first", ["linear", "layer_norm"])
@pytest.mark.parametrize("frozen", [False, True])  # a frozen weight: a plain GEMM, the residual back to autograd
def test_gradients_equal_autograds_sum(first, frozen):
    a, b = leaves(frozen), leaves(frozen)
    up = torch.randn(2, 5, 8, dtype=torch.float64)
    kept = up.clone()
    residual = ops.ResidualGrad()
    block(*a, first, residual).backward(up)
    assert torch.equal(up, kept), "the caller's gradient was modified"
    block(*b, first, None).backward(up)
    for p, q in zip(a, b):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert_close(p.grad, q.grad)
    assert residual.grad is None
    assert residual.claimed == {"layer_norm": "read", "linear": None if frozen else "accumulate"}[first]


def test_the_gemm_accumulates_the_residual_and_autograd_adds_nothing():
    def adds(residual):
        x, w, b, ln_w, ln_b = leaves()
        out = block(x, w, b, ln_w, ln_b, "linear", residual)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out.backward(torch.ones_like(out))
        return sum(e.count for e in prof.key_averages() if e.key in ("aten::add", "aten::add_"))

    assert adds(ops.ResidualGrad()) == adds(None) - 1


def test_without_dropout_the_gemm_does_not_add_into_what_it_reads():
    """Without dropout the reference's branch gradient is d_out itself: the GEMM accumulates into a
    copy of d_out, not into the gradient it multiplies."""
    x, w, b, _, _ = leaves()
    residual = ops.ResidualGrad()
    out = ops.bias_dropout_residual(ops.linear(x, w, residual_grad=residual), b, x, 0.0, True, residual_grad=residual)
    out.backward(torch.ones_like(out))
    assert_close(x.grad, torch.ones_like(x) + torch.ones_like(x) @ w)


def test_a_residual_gradient_does_not_go_with_heads():
    with pytest.raises(ValueError, match="not with heads"):
        ops.linear(torch.randn(1, 2, 3, 4), torch.randn(8, 8), heads=True, residual_grad=ops.ResidualGrad())
