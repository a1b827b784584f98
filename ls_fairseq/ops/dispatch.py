"""The one place that decides, per op and per call, kernel or reference.

An op takes the compiled kernel when the extension ``ls_fairseq._C`` is loaded,
its input lives on a CUDA device, and the op is not forced onto the reference
path. ``LS_FAIRSEQ_REFERENCE=all`` forces every op onto its PyTorch reference;
``LS_FAIRSEQ_REFERENCE=layer_norm,softmax`` forces the named ones (for
debugging and for A/B checks on the GPU). The variable is read on every call (its parsing cached),
so tests may change it.
"""
import functools
import logging
import os

import torch

logger = logging.getLogger(__name__)

OPS = (
    "embedding",
    "qkv",
    "softmax",
    "attention",
    "bias_dropout_residual",
    "bias_act_dropout",
    "layer_norm",
    "cross_entropy",
    "adam",
)

_ext = None
_ext_error = None


def _load_extension():
    global _ext, _ext_error
    if _ext is not None or _ext_error is not None:
        return _ext
    try:
        from ls_fairseq import _C

        _ext = _C
    except ImportError as e:
        _ext_error = str(e)
        if torch.cuda.is_available():
            logger.warning(
                "ls_fairseq: CUDA extension not loaded (%s); every op uses its PyTorch reference", e
            )
    return _ext


def extension():
    """The compiled extension module, or None when it is not built/loadable."""
    return _load_extension()


def extension_error():
    _load_extension()
    return _ext_error


@functools.lru_cache(maxsize=8)
def _forced_names(value):
    names = frozenset(v.strip() for v in value.split(",") if v.strip())
    unknown = names - set(OPS) - {"all"}
    if unknown:
        raise ValueError(
            "LS_FAIRSEQ_REFERENCE names unknown op(s) {}; known: all, {}".format(sorted(unknown), ", ".join(OPS))
        )
    return names


def forced_reference(op):
    names = _forced_names(os.environ.get("LS_FAIRSEQ_REFERENCE", "").strip())
    return "all" in names or op in names


KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def use_kernel(op, tensor):
    """True when ``op`` on ``tensor`` should run the compiled kernel (CUDA, a dtype the
    kernels store: fp32, fp16 or bf16; fp64 stays on the reference)."""
    assert op in OPS, op
    return (
        tensor.is_cuda
        and tensor.dtype in KERNEL_DTYPES
        and not forced_reference(op)
        and _load_extension() is not None
    )


def kernel_path(op):
    """'kernel' or 'reference': the path ``op`` takes for CUDA tensors on this machine."""
    cuda = torch.cuda.is_available()
    if cuda and not forced_reference(op) and _load_extension() is not None:
        return "kernel"
    return "reference"


def implementation(op, tensor, reference_forward, reference_backward):
    """(forward, backward) for ``op`` on ``tensor``: the kernel pair
    ``_C.<op>_forward`` / ``_C.<op>_backward`` or the reference pair, which
    share one signature (the op's contract)."""
    if use_kernel(op, tensor):
        ext = _load_extension()
        return getattr(ext, op + "_forward"), getattr(ext, op + "_backward")
    return reference_forward, reference_backward


def upcast(t):
    """The math dtype of the references: fp32 for fp16/bf16/fp32 storage, fp64 stays fp64
    (so that references can be checked against independent formulations in fp64)."""
    return t if t.dtype == torch.float64 else t.float()


def dropout_mask(shape, p, device):
    """A keep-mask (uint8, 1 = keep) drawn from torch's generator, so ``--seed``
    fixes it. Kernels draw theirs from the same generator's Philox state."""
    return torch.empty(shape, dtype=torch.uint8, device=device).bernoulli_(1.0 - p)


def apply_dropout(x, mask, p):
    """x * mask / (1 - p) in x's dtype (fp32 math for half inputs is the caller's choice).

    No mask: every element kept and scaled (as the kernels do), for callers whose dropped
    elements are already zero (relu's backward from its output)."""
    if mask is None:
        return x if p == 0 else x * (1.0 / (1.0 - p))
    return x * mask.to(x.dtype) * (1.0 / (1.0 - p))
