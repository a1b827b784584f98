import pytest
import torch
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss
from helpers import assert_close, grads

from ls_fairseq import ops

PAD = 1


@pytest.mark.parametrize("N,V", [(1, 2), (7, 11), (64, 1031), (5, 32003)])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_matches_fairseq_label_smoothed_nll_loss(N, V, eps):
    logits = (torch.randn(N, V, dtype=torch.float64) * 3).requires_grad_()
    target = torch.randint(0, V, (N,))
    target[::3] = PAD
    loss, nll = ops.label_smoothed_cross_entropy(logits, target, eps, PAD)
    ref_loss, ref_nll = label_smoothed_nll_loss(torch.log_softmax(logits, -1), target, eps, ignore_index=PAD, reduce=False)
    assert_close(loss, ref_loss.squeeze(-1), what="loss")
    assert_close(nll, ref_nll.squeeze(-1), what="nll")
    assert torch.equal(loss[::3], torch.zeros_like(loss[::3]))
    gl, gn = torch.randn(N, dtype=torch.float64), torch.randn(N, dtype=torch.float64)
    ours = grads((loss, nll), logits, (gl, gn))[0]
    ref = grads((ref_loss.squeeze(-1), ref_nll.squeeze(-1)), logits, (gl, gn))[0]
    assert_close(ours, ref, rtol=1e-9, atol=1e-12, what="dlogits")


def test_batched_shape_and_gradcheck():
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([[2, 3, PAD], [4, 0, 2]])
    loss, nll = ops.label_smoothed_cross_entropy(logits, target, 0.1, PAD)
    assert loss.shape == target.shape and nll.shape == target.shape
    assert torch.autograd.gradcheck(lambda x: ops.label_smoothed_cross_entropy(x, target, 0.1, PAD), (logits,))


def test_shape_errors_are_named():
    with pytest.raises(ValueError, match="plus a vocabulary dimension"):
        ops.label_smoothed_cross_entropy(torch.randn(4, 5), torch.zeros(3, dtype=torch.long), 0.1, PAD)
