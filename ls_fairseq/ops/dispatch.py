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
import torch.distributed as dist

logger = logging.getLogger(__name__)

OPS = (
    "embedding",
    "qkv",
    "softmax",
    "attention",
    "bias_dropout_residual",
    "bias_dropout_residual_layer_norm",
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


IN_WORKSPACE = "ls_grad_in_workspace"  # the attribute ls_adam sets on the parameters it holds
# set by ls-fairseq-train's optimizer when no autograd hook watches the gradients under
# data-parallel training (one, or --ddp-backend legacy_ddp: ls_adam all-reduces its workspace)
NO_GRAD_HOOKS = "ls_grad_without_hooks"


def grad_in_place(param):
    """``param.grad`` when a backward should add ``param``'s gradient to it in place, else None.

    LightSeq2's layers write parameter gradients straight into the gradient workspace.
    autograd would compute each into a new tensor and then add it to the existing
    ``.grad`` (ls_adam keeps every gradient alive as a view of its workspace): one more
    kernel, one more temporary and one more autograd node per parameter and step. So
    for parameters that ls_adam holds (it sets ``IN_WORKSPACE`` on them; ``.backward()``
    is then the only way their gradients are taken in training), whose ``.grad`` exists
    with the parameter's dtype and layout, and while torch.distributed is not initialised
    (DistributedDataParallel learns that a gradient is ready from autograd's accumulation
    of it) unless the parameter is marked ``NO_GRAD_HOOKS`` (ls-fairseq-train's optimizer
    under ``--ddp-backend legacy_ddp``, whose one all-reduce runs after backward), the op's
    backward accumulates into ``.grad`` and gives autograd None.
    Otherwise the gradient goes back to autograd as usual, so ``torch.autograd.grad``
    and other optimizers see nothing different.
    """
    grad = param.grad
    if (
        getattr(param, IN_WORKSPACE, False)
        and grad is not None
        and grad.dtype == param.dtype
        and grad.shape == param.shape
        and grad.is_contiguous()
        and (getattr(param, NO_GRAD_HOOKS, False) or not (dist.is_available() and dist.is_initialized()))
    ):
        return grad
    return None


def for_autograd(grad, into):
    """What a backward returns for a parameter: None when its gradient went into ``into``."""
    return None if into is not None else grad


def gradient(value, dtype, into=None):
    """A parameter gradient computed in fp32 (or fp64) ``value``: in ``dtype``, or added to
    ``into`` in place (rounding once, as the kernels do) and ``into`` returned."""
    if into is None:
        return value.to(dtype)
    return into.copy_(upcast(into) + value)


def with_bias_gradient(d, dtype, into=None):
    """(``d`` in ``dtype``, the gradient of the bias added before it: the sum of ``d`` over every
    position but the last dimension, through ``gradient``)."""
    return d.to(dtype), gradient(d.reshape(-1, d.shape[-1]).sum(0), dtype, into)


def upcast(t):
    """The math dtype of the references: fp32 for fp16/bf16/fp32 storage, fp64 stays fp64
    (so that references can be checked against independent formulations in fp64)."""
    return t if t.dtype == torch.float64 else t.float()


def dropout_mask(shape, p, device):
    """A keep-mask (uint8, 1 = keep) drawn from torch's generator, so ``--seed``
    fixes it: 1 where a uniform integer in [0, 2^31) is below (1 - p) 2^31 (one integer
    an element: half the time of ``bernoulli_`` on CPU). Kernels draw theirs from the same
    generator's Philox state."""
    bits = torch.empty(shape, dtype=torch.int32, device=device).random_()
    return torch.lt(bits, round((1.0 - p) * 2**31)).view(torch.uint8)


def save_with_dropout(ctx, tensors, dropout):
    """``ctx.save_for_backward(*tensors)`` and what the backward needs to apply the forward's dropout:
    the reference's uint8 keep-mask, saved with the tensors, or the kernel's ``_C.Dropout`` (the
    Philox state the forward drew with, which the backward kernel draws the keep-bits again from,
    and the keep-bits where the forward stored them, a bit an element), kept on ``ctx``; None
    without dropout. Autograd makes no zero gradient for an unused
    output (backward then receives None). ``saved_with_dropout`` gives both back."""
    ctx.mask_saved = torch.is_tensor(dropout)
    ctx.save_for_backward(*tensors, *((dropout,) if ctx.mask_saved else ()))
    ctx.dropout = None if ctx.mask_saved else dropout
    ctx.set_materialize_grads(False)


def saved_with_dropout(ctx):
    """(the tensors, the dropout) that ``save_with_dropout`` kept."""
    saved = ctx.saved_tensors
    return (saved[:-1], saved[-1]) if ctx.mask_saved else (saved, ctx.dropout)


def apply_dropout(x, mask, p):
    """x * mask / (1 - p) in x's dtype (fp32 math for half inputs is the caller's choice).

    No mask: every element kept and scaled (as the kernels do), for callers whose dropped
    elements are already zero (relu's backward from its output)."""
    if mask is None:
        return x if p == 0 else x * (1.0 / (1.0 - p))
    return (x * mask).mul_(1.0 / (1.0 - p))
