"""Shared checks for the op tests."""
import pytest
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


def drawn(dropout):
    """The keep-mask a kernel's dropout drew (``_C.Dropout.mask()``; None without dropout): the mask
    the references are given, so that they apply the kernel's dropout."""
    return None if dropout is None else dropout.mask()


def kernel(op, like):
    """The compiled extension, after asserting that ``op`` on ``like`` really dispatches to it:
    on a GPU machine without the extension the GPU tests fail instead of testing the reference."""
    from ls_fairseq.ops import dispatch

    ext = dispatch.extension()
    assert ext is not None, "the CUDA extension did not load: {}".format(dispatch.extension_error())
    assert dispatch.use_kernel(op, like), "op {} does not dispatch to the kernel".format(op)
    return ext


def poison():
    """Fill the caching allocator's free blocks with NaN, so that an output element a kernel
    forgets to write reads as NaN."""
    blocks = [torch.full((n,), float("nan"), device="cuda") for n in [64 << 20] + [1 << 16] * 16 + [1 << 10] * 64]
    del blocks


def kernel_error(out, ref64, lowp, what, floor=1e-6):
    """(ratio, message) by check_kernel's rule: the error divided by what the rule allows (at most 1
    passes; inf for non-finite elements), and a sentence saying what was measured."""
    if not torch.isfinite(out.float()).all():
        return float("inf"), "{}: non-finite (unwritten?) elements".format(what)
    err = rel_error(out, ref64.to(out.device))
    if out.dtype in (torch.float32, torch.float64):
        # 1e-5, or twice PyTorch's own fp32 error where that is larger: a sum of thousands of terms
        # into a few elements, or a difference of two close fp32 values, is not exact to 1e-5 in fp32
        torch_err = 0.0 if lowp is None else rel_error(lowp, ref64.to(lowp.device))
        return err / max(1e-5, 2 * torch_err), "{}: fp32 relative error {:.3g} (PyTorch's fp32: {:.3g})".format(
            what, err, torch_err)
    torch_err = rel_error(lowp, ref64.to(lowp.device))
    return err / (2 * torch_err + floor), "{}: relative error {:.3g} > 2 x PyTorch's {:.3g} + {}".format(
        what, err, torch_err, floor)


def check_kernel(out, ref64, lowp, what, floor=1e-6):
    """fp32: relative error against fp64 at most 1e-5, or twice PyTorch's own fp32 error (``lowp``)
    where that is larger. fp16/bf16: at most twice the error of PyTorch in the same precision
    (``lowp``), plus a floor."""
    if out is None and ref64 is None:
        return
    ratio, message = kernel_error(out, ref64, lowp, what, floor)
    assert ratio <= 1, message


LOW_PRECISION = (torch.float16, torch.bfloat16)
DTYPES = (torch.float32,) + LOW_PRECISION
# the same test on CPU (the references) and, where a GPU is, on CUDA (the kernels)
DEVICES = ("cpu", pytest.param("cuda", marks=pytest.mark.gpu))
