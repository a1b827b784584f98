"""The one place that decides, per op and per call, kernel or reference.

Each op module names in one ``Route`` what it calls in the compiled extension
``_C`` (``ls_fairseq._C``; csrc/bindings.cpp binds each kernel under that name)
and the PyTorch references called the same way (the op's contract), e.g.

    LAYER_NORM_ROUTE = dispatch.Route(
        "layer_norm",
        kernel=(_C.layer_norm_forward, _C.layer_norm_backward) if _C else None,
        reference=(layer_norm_forward_reference, layer_norm_backward_reference),
    )

and its autograd Function calls what ``LAYER_NORM_ROUTE.pick(x)`` gives: the kernels
when the extension is loaded, x lives on a CUDA device in a dtype the kernels
store, and the op is not forced onto the reference path; else the references.
Under torch.compile each op's entry function calls the op's ``torch.library`` custom ops
(``ls_fairseq::<op>_forward`` / ``_backward``, registered with their fake implementations and
autograd) instead of ``run``: ``compiling()`` says which. Their implementations go through the same
``Route.pick``, so a compiled graph runs the kernels where eager calls do.
``LS_FAIRSEQ_REFERENCE=all`` forces every op onto its PyTorch reference;
``LS_FAIRSEQ_REFERENCE=layer_norm,softmax`` forces the named ones (for
debugging and for A/B checks on the GPU). The variable is read on every call
(its parsing cached), so tests may change it.
"""
import functools
import glob
import inspect
import logging
import os

import torch

logger = logging.getLogger(__name__)

OPS = (
    "embedding",
    "qkv",
    "softmax",
    "attention",
    "segment_attention",
    "bias_dropout_residual",
    "bias_dropout_residual_layer_norm",
    "bias_act_dropout",
    "layer_norm",
    "cross_entropy",
    "adam",
    "beam_select",
    "beam_scores",
    "beam_advance",
    "decode_attention",
    "beam_attention",
    "fp8_cast",
)


def _warn_if_older_than_sources(module_file):
    """A notice when the extension was built before the last change of a CUDA source beside it
    (``pip install -e .`` or ``setup.py build_ext --inplace`` builds it into the tree): it may not
    be what the tree's ops expect. By file times, so a checkout that rewrote a source with the same
    bytes also shows it; the extension is used all the same. Not for an installed package (no
    setup.py above it), whose files' times are those of the installation."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isfile(os.path.join(package, "..", "setup.py")):
        return
    sources = glob.glob(os.path.join(package, "csrc", "*"))
    built = os.path.getmtime(module_file)
    newer = sorted(os.path.basename(f) for f in sources if os.path.getmtime(f) > built)
    if newer:
        logger.warning(
            "ls_fairseq: the CUDA extension %s is older than %s in ls_fairseq/csrc; rebuild it "
            "(pip install -e . or python setup.py build_ext --inplace) if those sources changed", module_file,
            ", ".join(newer),
        )


try:
    import ls_fairseq._C as _C

    _C_ERROR = None
    _warn_if_older_than_sources(inspect.getfile(_C))
except ImportError as e:
    _C, _C_ERROR = None, str(e)
    if torch.cuda.is_available():
        logger.warning("ls_fairseq: CUDA extension not loaded (%s); every op uses its PyTorch reference", e)


def extension():
    """The compiled extension module ``_C``, or None when it is not built/loadable."""
    return _C


def extension_error():
    """Why the extension did not load; None when it did."""
    return _C_ERROR


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
    return tensor.is_cuda and tensor.dtype in KERNEL_DTYPES and _C is not None and not forced_reference(op)


def kernel_path(op):
    """'kernel' or 'reference': the path ``op`` takes for CUDA tensors on this machine."""
    cuda = torch.cuda.is_available()
    if cuda and not forced_reference(op) and _C is not None:
        return "kernel"
    return "reference"


class Route:
    """How ``op`` reaches its kernel or its reference: ``kernel`` is what it calls in ``_C``
    (None when the extension is not loaded), ``reference`` the PyTorch function(s) with the
    same signatures; ``pick(tensor)`` gives one of the two."""

    __slots__ = ("op", "kernel", "reference")

    def __init__(self, op, kernel, reference):
        if op not in OPS:
            raise ValueError("Route: unknown op {!r}; known: {}".format(op, ", ".join(OPS)))
        self.op, self.kernel, self.reference = op, kernel, reference

    def pick(self, tensor):
        """``kernel`` when the op runs its kernel on ``tensor`` (``use_kernel``), else ``reference``."""
        return self.kernel if use_kernel(self.op, tensor) else self.reference


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


class _ForwardOnly:
    """The ``ctx`` of an autograd Function's forward run without autograd: what it would keep for
    the backward is dropped."""

    needs_input_grad = ()

    def save_for_backward(self, *tensors):
        pass

    def set_materialize_grads(self, value):
        pass


def run(function, *args):
    """``function.apply(*args)`` where autograd records the op (grad mode on and a tensor argument
    that requires a gradient), else its forward alone: autograd's bookkeeping costs the host ~20 us
    a call, which translation pays ~170 times in every eager decoding step and graph capture."""
    if torch.is_grad_enabled() and any(torch.is_tensor(a) and a.requires_grad for a in args):
        return function.apply(*args)
    return function.forward(_ForwardOnly(), *args)


def dropout_mask(shape, p, device):
    """A keep-mask (uint8, 1 = keep) drawn from torch's generator, so ``--seed``
    fixes it: 1 where a uniform integer in [0, 2^31) is below (1 - p) 2^31 (one integer
    an element: half the time of ``bernoulli_`` on CPU). Kernels draw theirs from the same
    generator's Philox state. Under torch.compile, where dynamo does not trace ``Tensor.random_``,
    1 where a uniform float in [0, 1) is at least p (``torch.rand``, drawn inside the graph)."""
    if compiling():  # converted, not viewed, to uint8: Inductor cannot lower a bool tensor's view as uint8
        return torch.rand(shape, device=device).ge(p).to(torch.uint8)
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


# True while torch.compile traces the caller: the ops' entry functions then call their custom ops
# (torch.compiler.is_compiling itself, so that an eager call pays for no frame of ours)
compiling = torch.compiler.is_compiling

LIBRARY = "ls_fairseq"


def refusal(message):
    """A function of one tensor that raises NotImplementedError(message), called where torch.compile does not
    support a path (``dispatch.compiling()``). It calls the custom op ``ls_fairseq::unsupported_under_compile``,
    whose fake implementation raises while dynamo traces the call, with fullgraph or without (dynamo does not
    run a frame eagerly after such an error), so the message reaches the caller. Importing torch._dynamo
    for ``torch.compiler.disable`` instead would cost every import of the core ~0.9 s and change torch
    (dynamo wraps torch.manual_seed); docs/perf-log.md has the lazy forms of that which failed."""
    def refuse(like):
        _unsupported_op(like, message)

    return refuse


def _unsupported(like: torch.Tensor, message: str) -> torch.Tensor:
    raise NotImplementedError(message)


def custom_op(name, impl, fake, backward=None, setup_context=None):
    """``impl`` (annotated with its schema's types) registered as the custom op ``ls_fairseq::name``
    that torch.compile calls as one opaque node: ``fake`` gives its outputs' shapes, dtypes and
    strides on fake tensors (those ``impl`` gives on every path, kernel or reference), ``backward``
    and ``setup_context`` its autograd (torch.library.register_autograd)."""
    op = torch.library.custom_op("{}::{}".format(LIBRARY, name), impl, mutates_args=())
    op.register_fake(fake)
    if backward is not None:
        op.register_autograd(backward, setup_context=setup_context)
    return op


def unaliased(outputs, inputs):
    """``outputs`` (a tuple of tensors), each cloned where it shares memory with a tensor of ``inputs``
    or an earlier output: a custom op's outputs may alias neither (the references give their input
    back where a step is the identity, e.g. dropout at p = 0)."""
    seen = {t.untyped_storage()._cdata for t in inputs if torch.is_tensor(t)}
    result = []
    for t in outputs:
        key = t.untyped_storage()._cdata
        result.append(t.clone() if key in seen else t)
        seen.add(key)
    return tuple(result)


def check_given_mask(op, p, mask):
    """A forward custom op with dropout takes its keep-mask as an input (the graph draws it), so that its
    backward applies the same one: one that drew its own would have the backward apply none."""
    if p > 0 and mask is None:
        raise ValueError("{}::{}_forward: dropout p = {} needs its keep-mask as an input (the entry function "
                         "draws it under torch.compile)".format(LIBRARY, op, p))


def given_dropout(kernel, mask, p):
    """What a backward takes for the forward's dropout when the forward was given ``mask`` (the keep-mask
    a compiled graph draws, or None): the mask itself for a reference, for a kernel (``kernel``) the
    ``_C.Dropout`` that reads it (None without dropout)."""
    if mask is None or p == 0:
        return None
    if not kernel:
        return mask
    return _C.dropout_from_mask(mask, p)


# every refusal's op (``refusal``): both implementations raise
_unsupported_op = custom_op("unsupported_under_compile", _unsupported, fake=_unsupported)
