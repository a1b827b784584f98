"""The linear op: y = x W^T with the weight gradient written into weight.grad in place."""
import pytest
import torch
from helpers import DEVICES, assert_close

from ls_fairseq import ops
from ls_fairseq.ops.workspace import accumulate_in_place
from ls_fairseq.optim import ls_adam


def inputs(device, dtype=torch.float64):
    """x and a weight whose gradient the ops accumulate in place, as ls_adam has it for its workspace."""
    x = torch.randn(3, 7, 13, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(5, 13, device=device, dtype=dtype, requires_grad=True)
    accumulate_in_place([w])
    return x, w


@pytest.mark.parametrize("device", DEVICES)
def test_accumulates_into_an_existing_gradient_without_autograd(device):
    x, w = inputs(device)
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    old = torch.randn_like(w)
    w.grad, w_ref.grad = old.clone(), old.clone()
    storage = w.grad.data_ptr()
    dy = torch.randn(3, 7, 5, device=device, dtype=x.dtype)
    y = ops.linear(x, w)
    with torch.profiler.profile() as prof:
        y.backward(dy)
    (torch.nn.functional.linear(x_ref, w_ref) * dy).sum().backward()
    assert_close(w.grad, w_ref.grad, rtol=1e-12, atol=1e-12)
    assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    names = [e.name for e in prof.events()]
    # dW accumulated by the GEMM itself: no separate add into the gradient, no weight-sized temporary
    assert w.grad.data_ptr() == storage and "aten::addmm_" in names and "aten::add_" not in names, names


@pytest.mark.parametrize("device", DEVICES)
def test_without_a_gradient_it_is_autograd_as_usual(device):
    x, w = inputs(device)
    assert torch.autograd.gradcheck(ops.linear, (x, w))
    ops.linear(x, w).sum().backward()
    assert_close(w.grad, torch.ones(3 * 7, 5, device=device, dtype=x.dtype).t() @ x.detach().reshape(-1, 13),
                 rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_in_place_is_at_least_as_accurate_as_autograd(device, dtype):
    """fp16/bf16: one rounding of old + dY^T X (the GEMM's epilogue) against autograd's two."""
    if device == "cpu" and dtype == torch.float16:
        pytest.skip("fp16 GEMMs on CPU are not what training uses")
    x, w = (t.detach().to(dtype).requires_grad_() for t in inputs(device, torch.float32))
    accumulate_in_place([w])
    old = torch.randn_like(w)
    w.grad = old.clone()
    dy = torch.randn(3, 7, 5, device=device, dtype=dtype)
    (ops.linear(x, w) * dy).sum().backward()
    exact = old.double() + dy.double().reshape(-1, 5).t() @ x.detach().double().reshape(-1, 13)
    autograd = old + (dy.reshape(-1, 5).t() @ x.detach().reshape(-1, 13))
    assert (w.grad.double() - exact).norm() <= (autograd.double() - exact).norm() * 1.01 + 1e-12


def test_distributed_training_keeps_autograds_accumulation(monkeypatch):
    """DistributedDataParallel learns that a gradient is ready from autograd's hooks: ls_adam built while
    torch.distributed is initialised leaves its gradients to autograd."""
    from types import SimpleNamespace

    monkeypatch.setattr(ls_adam, "dist", SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True))
    x = torch.randn(3, 7, 13, dtype=torch.float64, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(5, 13, dtype=torch.float64))
    ls_adam.LSAdam(ls_adam.LSAdamConfig(lr=[1e-3]), [w])
    assert w.grad is not None  # a view of the workspace
    y = ops.linear(x, w)
    with torch.profiler.profile() as prof:
        y.sum().backward()
    names = [e.name for e in prof.events()]
    assert "aten::addmm_" not in names and "aten::add_" in names, names


def test_shape_error_names_the_sizes():
    with pytest.raises(ValueError, match="input has 4 features"):
        ops.linear(torch.randn(2, 4), torch.randn(3, 5))


def test_other_weights_and_autograd_grad_see_plain_autograd():
    """Only weights in ls_adam's workspace take the in-place path: torch.autograd.grad on any
    other weight returns its gradient as usual, even with a .grad allocated."""
    x = torch.randn(4, 6, dtype=torch.float64)
    w = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    w.grad = torch.zeros_like(w)
    (g,) = torch.autograd.grad(ops.linear(x, w).sum(), [w])
    assert_close(g, torch.ones(4, 3, dtype=torch.float64).t() @ x, rtol=1e-12, atol=1e-12)
    assert not w.grad.any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_place", [False, True])
def test_heads_input_merges_inside_and_keeps_only_the_unmerged_output(device, in_place):
    """linear(ctx, W, heads=True) = merge_heads(ctx) @ W^T with the same gradients, and the only
    activation it keeps is ctx itself (which the attention keeps anyway), not a merged copy."""
    ctx = torch.randn(2, 4, 5, 3, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.randn(7, 12, dtype=torch.float64, device=device, requires_grad=True)
    if in_place:
        accumulate_in_place([w])
        w.grad = torch.zeros_like(w)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = ops.linear(ctx, w, heads=True)
    assert len(saved) == 2 and saved[0] is ctx and saved[1] is w
    ref = ops.merge_heads(ctx.detach()) @ w.detach().t()
    assert_close(y, ref, rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert_close(ctx.grad, (dy @ w.detach()).view(2, 5, 4, 3).transpose(1, 2), rtol=1e-12, atol=1e-12)
    assert_close(w.grad, dy.reshape(-1, 7).t() @ ops.merge_heads(ctx.detach()).reshape(-1, 12), rtol=1e-12, atol=1e-12)


def test_a_freed_parameter_leaves_the_workspace():
    """The workspace holds parameters by id(): a freed one's id must not stay held for a later tensor."""
    import gc

    from ls_fairseq.ops import workspace

    before = len(workspace._held)
    w = torch.nn.Parameter(torch.zeros(2))
    accumulate_in_place([w, w])
    assert len(workspace._held) == before + 1
    del w
    gc.collect()
    assert len(workspace._held) == before
