import pytest
import torch
from helpers import assert_close, grads, keep_mask

from ls_fairseq import ops


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
