import pytest
import torch
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss
from helpers import DTYPES, assert_close, check_kernel, grads, kernel, poison, rel_error

from ls_fairseq import ops
from ls_fairseq.ops.cross_entropy import cross_entropy_backward_reference, cross_entropy_forward_reference

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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,V", [(1, 32003), (7, 1000), (8191, 32003)])
def test_kernel_matches_reference(dtype, N, V):
    logits = (torch.randn(N, V, device="cuda") * 2).to(dtype)
    target = torch.randint(0, V, (N,), device="cuda")
    target[::5] = PAD
    dloss, dnll = torch.rand(N, device="cuda"), torch.rand(N, device="cuda")
    ext = kernel("cross_entropy", logits)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    poison()
    torch.cuda.reset_peak_memory_stats()
    loss, nll, lse = ext.cross_entropy_forward(logits, target, 0.1, PAD)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < N * V * 4 // 4 + (1 << 20), "cross-entropy forward used {} extra bytes".format(extra)
    poison()
    grad = ext.cross_entropy_backward(dloss, dnll, logits, target, lse, 0.1, PAD, None)
    overwritten = logits.clone()
    in_place = ext.cross_entropy_backward(dloss, dnll, overwritten, target, lse, 0.1, PAD, overwritten)
    assert in_place.data_ptr() == overwritten.data_ptr() and torch.equal(in_place, grad)
    ref64 = cross_entropy_forward_reference(logits.double(), target, 0.1, PAD)
    g64 = cross_entropy_backward_reference(dloss.double(), dnll.double(), logits.double(), target, ref64[2], 0.1, PAD)
    ref_l = cross_entropy_forward_reference(logits, target, 0.1, PAD)
    g_l = cross_entropy_backward_reference(dloss, dnll, logits, target, ref_l[2], 0.1, PAD)
    for o, ref, low, name in zip((loss, nll, lse), ref64, ref_l, ("loss", "nll", "lse")):
        assert rel_error(o, ref) < 1e-5, name  # fp32 outputs whatever the logits' dtype
    check_kernel(grad, g64, g_l, "dlogits")
    # a sum's gradient (one value for every row: stride 0) read where it is, and no nll gradient (None):
    # the same values as both given in full
    one = torch.rand((), device="cuda")
    summed = ext.cross_entropy_backward(one.expand(N), None, logits, target, lse, 0.1, PAD, None)
    full = ext.cross_entropy_backward(one.expand(N).contiguous(), torch.zeros(N, device="cuda"), logits, target, lse,
                                      0.1, PAD, None)
    assert torch.equal(summed, full)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_nll_of_a_confident_row_keeps_its_digits(dtype):
    """Two classes, the target the larger logit (by ~11 on average, up to ~40): nll is down to ~1e-17,
    and lse - x_t (two numbers near the logit) would lose it; the kernel's nll and loss by the fp32 rule against PyTorch's own."""
    logits = (torch.randn(7, 2, device="cuda") * 10).sort(dim=1, descending=True).values.to(dtype)
    target = torch.zeros(7, dtype=torch.long, device="cuda")  # class 0, the larger (1 is the padding index)
    ext = kernel("cross_entropy", logits)
    loss, nll, _ = ext.cross_entropy_forward(logits, target, 0.0, PAD)
    ref64 = cross_entropy_forward_reference(logits.double(), target, 0.0, PAD)
    ref_l = cross_entropy_forward_reference(logits, target, 0.0, PAD)
    check_kernel(loss, ref64[0], ref_l[0], "loss")
    check_kernel(nll, ref64[1], ref_l[1], "nll")


def test_overwrite_logits_puts_the_gradient_in_their_place():
    """The criterion's setting: the logits' gradient is written over the logits (no second
    [tokens x vocab] buffer), equal to the gradient computed into a new tensor."""
    logits = torch.randn(2, 5, 11, dtype=torch.float64)
    target = torch.randint(0, 11, (2, 5))
    target[0, -2:] = PAD
    expected = []
    for overwrite in (False, True):
        x = logits.clone().requires_grad_()
        y = x * 1.0  # the logits as a model's last op makes them: a non-leaf the criterion receives
        seen = []
        y.register_hook(lambda g: seen.append(g))
        loss, nll = ops.label_smoothed_cross_entropy(y, target, 0.1, PAD, overwrite_logits=overwrite)
        (loss.sum() + 0.5 * nll.sum()).backward()
        expected.append(x.grad)
        if overwrite:
            assert seen[0].data_ptr() == y.data_ptr()  # the gradient lives where the logits were
    assert_close(expected[1], expected[0], rtol=1e-12, atol=1e-12)


def test_backward_without_an_nll_gradient_is_with_a_zero_one():
    logits, target = torch.randn(6, 11, dtype=torch.float64), torch.tensor([1, PAD, 3, 4, 5, 6])
    lse = torch.logsumexp(logits, -1)
    dloss = torch.rand(()).expand(6)
    none = cross_entropy_backward_reference(dloss, None, logits, target, lse, 0.1, PAD)
    zero = cross_entropy_backward_reference(dloss, torch.zeros(6, dtype=torch.float64), logits, target, lse, 0.1, PAD)
    assert torch.equal(none, zero)
