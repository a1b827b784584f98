import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, grads, keep_mask

from ls_fairseq import ops


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (2, 5, 1030)])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_matches_fairseq_activation(activation, shape, p):
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    b = torch.randn(shape[-1], dtype=torch.float64, requires_grad=True)
    mask = keep_mask(shape, p) if p else None
    out = ops.bias_act_dropout(x, b, activation, p, True, mask)
    # fairseq's relu, and its gelu (F.gelu, the exact erf form) evaluated in fp64
    ref = (F.relu if activation == "relu" else F.gelu)(x + b) * (mask.double() / (1 - p) if p else 1)
    assert_close(out, ref)
    dout = torch.randn_like(out)
    for g, e in zip(grads(out, (x, b), dout), grads(ref, (x, b), dout)):
        assert_close(g, e, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_gradcheck(activation):
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    mask = keep_mask((4, 6), 0.25)
    assert torch.autograd.gradcheck(lambda x, b: ops.bias_act_dropout(x, b, activation, 0.25, True, mask), (x, b))


def test_unknown_activation_is_named():
    with pytest.raises(ValueError, match="'swish' is not supported"):
        ops.bias_act_dropout(torch.randn(2, 3), torch.randn(3), "swish")
