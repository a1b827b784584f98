"""ops.linear_bias_act: relu(x W^T + bias) with the bias and ReLU in the GEMM's epilogue, against
ops.bias_act_dropout after ops.linear (and fp64); the other activations and dropout take that path."""
import pytest
import torch
from helpers import DEVICES, assert_close

from ls_fairseq import ops
from ls_fairseq.ops.workspace import accumulate_in_place


def params(device, dtype, n_in=13, n_out=37):
    """x [3, 7, n_in], W and a bias, from the test's seed (conftest)."""
    w = (torch.randn(n_out, n_in, dtype=torch.float64) / n_in**0.5).to(device, dtype)
    b = torch.randn(n_out, dtype=torch.float64).to(device, dtype)
    x = torch.randn(3, 7, n_in, dtype=torch.float64).to(device, dtype)
    return x, w, b


def grads(fn, x, w, b, dy, in_place=False):
    """(out, dx, dW, dbias) of fn(x, w, b) for the upstream gradient dy; with ``in_place`` W and the
    bias held as ls_adam holds them (gradients added into .grad, which starts at ones)."""
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    if in_place:
        accumulate_in_place([w, b])
        w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
    out = fn(x, w, b)
    out.backward(dy)
    return out.detach(), x.grad, w.grad, b.grad


def composed(x, w, b):
    return ops.bias_act_dropout(ops.linear(x, w), b, "relu", 0.0, True)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("n_in,n_out", [(13, 37), (1, 8), (64, 3)])
def test_equals_linear_then_bias_act_dropout_in_fp64(in_place, n_in, n_out):
    x, w, b = params("cpu", torch.float64, n_in, n_out)
    dy = torch.randn(3, 7, n_out, dtype=torch.float64)
    fused = grads(ops.linear_bias_act, x, w, b, dy, in_place)
    plain = grads(composed, x, w, b, dy, in_place)
    for f, p in zip(fused, plain):
        assert_close(f, p, rtol=1e-12, atol=1e-12)
    assert (fused[0] == 0).any() and (fused[0] > 0).any()  # both sides of the ReLU were taken


def test_the_residual_gradient_is_accumulated_into_dx():
    x, w, b = params("cpu", torch.float64)
    dy, dres = torch.randn(3, 7, 37, dtype=torch.float64), torch.randn(3, 7, 13, dtype=torch.float64)
    residual = ops.ResidualGrad()
    x = x.requires_grad_()
    out = ops.linear_bias_act(x, w, b, residual_grad=residual)
    assert residual.claimed == "accumulate"
    residual.put(dres.clone())
    out.backward(dy)
    _, dx, _, _ = grads(composed, x, w, b, dy)
    assert_close(x.grad, dx + dres, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("activation,p,training", [("gelu", 0.0, True), ("relu", 0.1, True)])
def test_other_activations_and_dropout_take_linear_then_bias_act_dropout(activation, p, training):
    x, w, b = params("cpu", torch.float64)
    torch.manual_seed(3)
    a = ops.linear_bias_act(x, w, b, activation, p, training)
    torch.manual_seed(3)
    assert torch.equal(a, ops.bias_act_dropout(ops.linear(x, w), b, activation, p, training))


def test_at_inference_dropout_is_off_and_the_epilogue_runs():
    x, w, b = params("cpu", torch.float32)
    with torch.no_grad():
        out = ops.linear_bias_act(x, w, b, "relu", 0.3, training=False)
    assert_close(out, torch.relu(x.double() @ w.double().t() + b.double()).float(), rtol=1e-5, atol=1e-5)


def test_mismatched_shapes_are_named():
    x, w, b = params("cpu", torch.float32)
    with pytest.raises(ValueError, match="linear_bias_act: input .* weight .* bias"):
        ops.linear_bias_act(x, w, b[:-1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_error_at_most_twice_pytorchs(device, dtype):
    """fp16/bf16 against fp64: the output and every gradient at most twice as far off as PyTorch's
    own F.linear, bias and relu in the same precision (odd sizes; a relu edge on both sides)."""
    if device == "cpu" and dtype == torch.float16:
        pytest.skip("fp16 GEMMs on CPU are not what training uses")
    x, w, b = params(device, dtype, 67, 257)
    dy = torch.randn(3, 7, 257, device=device, dtype=dtype)
    exact = grads(lambda x, w, b: torch.relu(torch.nn.functional.linear(x, w, b)), *(t.double() for t in (x, w, b)),
                  dy.double())
    ours = grads(ops.linear_bias_act, x, w, b, dy)
    torchs = grads(lambda x, w, b: torch.relu(torch.nn.functional.linear(x, w, b)), x, w, b, dy)
    for name, e, o, t in zip(("out", "dx", "dW", "dbias"), exact, ours, torchs):
        ours_err = (o.double() - e).abs().max().item()
        torch_err = (t.double() - e).abs().max().item()
        assert ours_err <= 2 * torch_err + 1e-6 * e.abs().max().item(), (name, ours_err, torch_err)
