"""Shared checks for the op tests."""
import torch


def assert_close(actual, expected, rtol=1e-10, atol=1e-10, what=""):
    assert actual.shape == expected.shape, "{}: shape {} != {}".format(what, tuple(actual.shape), tuple(expected.shape))
    assert torch.isfinite(actual).all() or not torch.isfinite(expected).all(), "{}: non-finite values".format(what)
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol, msg=lambda m: "{}: {}".format(what, m))


def grads(outputs, inputs, upstream):
    """Gradients of sum(outputs * upstream) w.r.t. inputs (None where unused)."""
    return torch.autograd.grad(outputs, inputs, upstream, allow_unused=True)


def rel_error(x, ref):
    """||x - ref|| / ||ref|| in fp64."""
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_low_precision_close(out, ref64, torch_out, what, floor=1e-6):
    """flash-attention's rule: the error against an fp64 reference may be at most
    twice the error that PyTorch itself makes in the same precision, plus a floor."""
    err, torch_err = rel_error(out, ref64), rel_error(torch_out, ref64)
    assert err <= 2 * torch_err + floor, "{}: relative error {:.3g} > 2 x PyTorch's {:.3g} + {}".format(
        what, err, torch_err, floor
    )


def keep_mask(shape, p, device="cpu"):
    return (torch.rand(shape, device=device) >= p).to(torch.uint8)
