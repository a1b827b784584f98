"""ops.ResidualGrad: a residual connection's gradient handed from a block's end to the block's
first op, which adds it into x's gradient (the GEMM by accumulating into it)."""
import pytest
import torch
from helpers import assert_close
from torch.profiler import ProfilerActivity, profile

from ls_fairseq import ops

MASK = torch.rand(2, 5, 8, generator=torch.Generator().manual_seed(1)).gt(0.1).to(torch.uint8)


def block(x, w, b, ln_w, ln_b, first, residual, p=0.1):
    """x + dropout(branch(x)) with a fixed mask: post-LN (branch = GEMM, LayerNorm after, one op at
    the end) or pre-LN (branch = LayerNorm then GEMM)."""
    mask = MASK if p else None
    if first == "layer_norm":
        h = ops.linear(ops.layer_norm(x, ln_w, ln_b, residual_grad=residual), w)
        return ops.bias_dropout_residual(h, b, x, p, True, mask=mask, residual_grad=residual)
    h = ops.linear(x, w, residual_grad=residual)
    return ops.bias_dropout_residual_layer_norm(h, b, x, ln_w, ln_b, p, True, mask=mask, residual_grad=residual)


def leaves(frozen=False):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 8, dtype=torch.float64, requires_grad=not frozen)
    rest = [torch.randn(8, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    return [x, w] + rest


@pytest.mark.parametrize("first", ["linear", "layer_norm"])
@pytest.mark.parametrize("frozen", [False, True])  # a frozen weight: a plain GEMM, the residual back to autograd
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_gradients_equal_autograds_sum(first, frozen, p):
    a, b = leaves(frozen), leaves(frozen)
    up = torch.randn(2, 5, 8, dtype=torch.float64)
    kept = up.clone()
    residual = ops.ResidualGrad()
    block(*a, first, residual, p).backward(up)
    assert torch.equal(up, kept), "the caller's gradient was modified"
    block(*b, first, None, p).backward(up)
    for t, u in zip(a, b):
        assert (t.grad is None) == (u.grad is None)
        if t.grad is not None:
            assert_close(t.grad, u.grad)
    assert residual.grad is None
    assert residual.claimed == {"layer_norm": "read", "linear": None if frozen else "accumulate"}[first]


@pytest.mark.parametrize("first", ["linear", "layer_norm"])
def test_the_first_op_adds_the_residual_and_autograd_does_not(first):
    """Post-LN: the GEMM accumulates (one add fewer); pre-LN: LayerNorm's add replaces autograd's."""
    def adds(residual):
        x, w, b, ln_w, ln_b = leaves()
        out = block(x, w, b, ln_w, ln_b, first, residual)
        up = torch.ones_like(out)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out.backward(up)
        return sum(e.count for e in prof.key_averages() if e.key in ("aten::add", "aten::add_"))

    assert adds(ops.ResidualGrad()) == adds(None) - (1 if first == "linear" else 0)


def test_a_gemm_claim_at_a_bias_dropout_residual_end_is_left_to_autograd():
    """The GEMM would accumulate into autograd's d_out: bias_dropout_residual keeps it."""
    x, w, b, _, _ = leaves()
    residual = ops.ResidualGrad()
    out = ops.bias_dropout_residual(ops.linear(x, w, residual_grad=residual), b, x, 0.0, True, residual_grad=residual)
    up = torch.ones_like(out)
    out.backward(up)
    assert_close(x.grad, torch.ones_like(x) + torch.ones_like(x) @ w)
    assert torch.equal(up, torch.ones_like(out))


def test_a_residual_gradient_does_not_go_with_heads():
    with pytest.raises(ValueError, match="not with heads"):
        ops.linear(torch.randn(1, 2, 3, 4), torch.randn(8, 8), heads=True, residual_grad=ops.ResidualGrad())
