"""FP8 GEMM operands with delayed scaling: the cast, the scaled GEMM, and the scaling state.

fp8_cast(x [rows, cols], state, e5m2=False, rowwise=True, transposed=False) -> (q, qT)
  q = x s rounded to float8_e4m3fn (float8_e5m2 with ``e5m2``: gradients), [rows, cols] when
  ``rowwise``, and/or its transpose qT [cols, rows] when ``transposed`` (the other an empty tensor).
  Finite values saturate at the format's largest (448 / 57344); inf and NaN stay non-finite, so that
  an fp16 run's overflow check still sees them. ``state`` is the tensor's row of an Fp8Recipe, fp32
  [history + 2]: s = largest / max(history) (at most FLT_MAX; 1 while the history is all zero). The
  call raises state[history] to x's amax over its finite values and writes 1 / s to
  state[history + 1]: the scale a GEMM dequantises the result with.

fp8_mm(a, a_state, b, b_state, out_dtype) -> a @ b in out_dtype: a [M, K] row-major and b [K, N]
  column-major FP8 (b = w.t() for a row-major w [N, K]), times both inverse scales, fp32 accumulation.
  On the GPU ``torch._scaled_mm`` (cuBLASLt; FP8 tensor cores, sm_89 and later); the reference
  dequantises and multiplies in fp32.

Delayed scaling: a tensor's scale comes from the amaxes of the steps before, so the kernel that
casts needs no second pass over x (current scaling reads x once for its amax, once to cast), and a
CUDA graph replays it: the scale is never on the host. Fp8Recipe.begin, at each training forward,
moves every tensor's step amax into its history. The first forward pass of a run (and of a resume:
the state is not saved) finds no history: the layers then run their GEMMs in the run's dtype and
only record amaxes (``calibrating``). That pass also notes each chosen GEMM's shape, and the next
``begin`` logs them, one line a layer name: which GEMMs run in FP8 at which [M, K, N], and which do
not fit (a size that is not a multiple of 16).
"""
import logging

import torch

from ls_fairseq.ops import dispatch
from ls_fairseq.ops.dispatch import _C

logger = logging.getLogger(__name__)

LARGEST = {False: 448.0, True: 57344.0}  # float8_e4m3fn, float8_e5m2
FP8_DTYPE = {False: torch.float8_e4m3fn, True: torch.float8_e5m2}


def _scale(state, e5m2):
    m = state[:-2].max()
    s = torch.clamp(torch.tensor(LARGEST[e5m2], device=state.device) / m, max=torch.finfo(torch.float32).max)
    return torch.where(m > 0, s, torch.ones_like(s))


def finite_amax(x, chunk=1 << 24):
    """max |x| over x's finite elements in fp32 (0 for none), ``chunk`` elements at a time: the fp32
    temporaries of one pass over the whole of a large x (the logits' gradient at 16,384 tokens holds
    half a billion) would add gigabytes to the calibrating step's peak."""
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    for part in x.reshape(-1).split(chunk) if x.numel() else ():
        a = part.float().abs()
        amax = torch.maximum(amax, torch.where(torch.isfinite(a), a, 0.0).amax())
    return amax


def fp8_cast_reference(x, state, e5m2=False, rowwise=True, transposed=False):
    s = _scale(state, e5m2)
    xf = x.float()
    y = xf * s
    largest = LARGEST[e5m2]
    # e4m3 has no inf: a non-finite x becomes NaN (torch's cast would saturate inf)
    q = torch.where(torch.isfinite(xf), y.clamp(-largest, largest), y if e5m2 else y.new_tensor(float("nan")))
    q = q.to(FP8_DTYPE[e5m2])
    state[-2] = torch.maximum(state[-2], finite_amax(x))
    state[-1] = 1.0 / s
    empty = q.new_empty((0, 0))
    return (q if rowwise else empty), (q.t().contiguous() if transposed else empty)


def fp8_mm_reference(a, a_state, b, b_state, out_dtype):
    product = a.float() @ b.float()
    return (product * (a_state[-1] * b_state[-1])).to(out_dtype)


def _fp8_mm_kernel(a, a_state, b, b_state, out_dtype):
    if torch.cuda.get_device_capability(a.device) < (8, 9):
        raise RuntimeError("ls_fairseq FP8 GEMMs need FP8 tensor cores (sm_89 or later); {} is sm_{}{}".format(
            torch.cuda.get_device_name(a.device), *torch.cuda.get_device_capability(a.device)))
    # cuBLASLt's FP8 GEMM refuses (CUBLAS_STATUS_NOT_SUPPORTED) a scale whose address is not 16-byte
    # aligned: Fp8Recipe's rows place the inverse scale on a 16-byte boundary; another state's is copied
    scales = [s[-1] if s[-1].data_ptr() % 16 == 0 else s[-1].clone() for s in (a_state, b_state)]
    return torch._scaled_mm(a, b, scale_a=scales[0], scale_b=scales[1], out_dtype=out_dtype)


FP8_CAST_ROUTE = dispatch.Route(
    "fp8_cast",
    kernel=(_C.fp8_cast, _fp8_mm_kernel) if _C else None,
    reference=(fp8_cast_reference, fp8_mm_reference),
)


def fp8_cast(x, state, e5m2=False, rowwise=True, transposed=False):
    """See the module docstring."""
    if x.dim() != 2:
        raise ValueError("fp8_cast: x must be [rows, cols], got {}".format(tuple(x.shape)))
    if state.dtype != torch.float32 or state.dim() != 1 or state.numel() < 3 or state.device != x.device:
        raise ValueError("fp8_cast: state must be float32 [history + 2] on {}, got {} {} on {}".format(
            x.device, state.dtype, tuple(state.shape), state.device))
    if not (rowwise or transposed):
        raise ValueError("fp8_cast: asked for neither layout (rowwise, transposed)")
    cast, _ = FP8_CAST_ROUTE.pick(x)
    return cast(x.contiguous(), state, bool(e5m2), bool(rowwise), bool(transposed))


def fp8_mm(a, a_state, b, b_state, out_dtype):
    """See the module docstring."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0] or a.stride(1) != 1 or b.stride(0) != 1:
        raise ValueError("fp8_mm: a {} must be row-major [M, K] and b {} column-major [K, N]".format(
            tuple(a.shape), tuple(b.shape)))
    _, mm = FP8_CAST_ROUTE.pick(a_state)  # by the fp32 state: the route takes no FP8 tensor to the kernels
    return mm(a, a_state, b, b_state, out_dtype)


def fp8_fits(*sizes):
    """True when every size is a multiple of 16, as the FP8 GEMM (cuBLASLt) needs of M, K and N. The rule
    holds on every device, so that the reference takes the same path as the GPU."""
    return all(n % 16 == 0 and n > 0 for n in sizes)


def _unfit(m, k, n):
    """The sizes of an [m, k] x [k, n] product that keep it off the FP8 GEMM, e.g. "N = 2008"."""
    return ["{} = {}".format(d, v) for d, v in zip("MKN", (m, k, n)) if not fp8_fits(v)]


def _describe(name, kind, shapes):
    """The layer ``name``'s GEMMs of one kind (``kind``: "forward x W^T" or "dgrad dY W"; ``shapes``:
    {(m, k, n): count}) as the log says them."""
    fit = {s: c for s, c in shapes.items() if fp8_fits(*s)}
    listed = ", ".join("{}x{}x{}{}".format(*s, " (x{})".format(c) if c > 1 else "") for s, c in shapes.items())
    if len(fit) == len(shapes):
        return "{} in FP8 at [M x K x N] {}".format(kind, listed)
    static = sorted({u for s in shapes for u in _unfit(*s) if not u.startswith("M")})
    if static:
        why = " and ".join(static) + " not a multiple of 16"
        if name == "vocab":
            why += " (the dictionary's size: fairseq-preprocess --padding-factor 16 makes it fit)"
        return "{} asked for FP8 but in the run's dtype: {} ([M x K x N] {})".format(kind, why, listed)
    first = sorted({m for m, _, _ in shapes if not fp8_fits(m)})
    return ("{} in FP8 where the batch's token count M is a multiple of 16 (every batch's with "
            "--required-seq-len-multiple 16; not the first batch's M = {}): [M x K x N] {}".format(
                kind, ", ".join(map(str, first)), listed))


class Fp8Recipe:
    """The delayed-scaling state of a model's FP8 tensors: one fp32 row [history, step amax, inverse
    scale] a tensor, reserved at construction (``reserve``) and allocated on the device of the first
    training forward (never saved: a resumed run calibrates again). ``begin`` at each training forward
    moves each tensor's step amax into its history, newest first (a tensor that recorded nothing
    since keeps its history); every update is in place, so CUDA graphs capture it. ``state`` is a view
    [rows, history + 2] into rows padded to 16 bytes, each starting where its inverse scale lands on a
    16-byte boundary, as cuBLASLt's FP8 GEMM needs of a scale's address."""

    def __init__(self, history=16, grad_e5m2=True, forward=(), dgrad=()):
        if history < 1:
            raise ValueError("Fp8Recipe: the amax history needs at least one step, got {}".format(history))
        self.history, self.grad_e5m2 = history, grad_e5m2
        self.forward, self.dgrad = frozenset(forward), frozenset(dgrad)
        self.rows, self.state, self.passes = 0, None, 0
        self.shapes, self.logged = {}, False  # the first pass's {name: {kind: {(m, k, n): count}}}

    def gemm(self, name):
        """A new Fp8Gemm for the linear layer ``name`` of the model (its rows reserved), or None when
        neither of its GEMMs is chosen (``forward``, ``dgrad``: the chosen names)."""
        if name not in self.forward and name not in self.dgrad:
            return None
        return Fp8Gemm(self, name, name in self.forward, name in self.dgrad)

    def reserve(self, n):
        """The first of ``n`` new rows."""
        first, self.rows = self.rows, self.rows + n
        return first

    def begin(self, device):
        """A training forward starts on ``device``."""
        if self.state is None or self.state.device != device:
            H = self.history
            lead = -(H + 1) % 4  # floats before the history, so that the inverse scale's index is a multiple of 4
            storage = torch.zeros(self.rows, (lead + H + 2 + 3) // 4 * 4, device=device)
            self.state, self.passes = storage[:, lead : lead + H + 2], 0
        elif self.passes > 0:
            H = self.history
            amax = self.state[:, H]
            shifted = torch.cat([amax[:, None], self.state[:, : H - 1]], dim=1)
            self.state[:, :H].copy_(torch.where((amax > 0)[:, None], shifted, self.state[:, :H]))
            self.state[:, H].zero_()
            if not self.logged:
                self.log_gemms()
        self.passes += 1

    def note(self, gemm, kind, m, k, n):
        """The run's first pass runs ``gemm``'s ``kind`` GEMM ("forward" or "dgrad") at [m, k] x [k, n]."""
        if self.passes == 1 and not self.logged:
            counts = self.shapes.setdefault(gemm.name, {}).setdefault(kind, {})
            counts[(m, k, n)] = counts.get((m, k, n), 0) + 1

    def log_gemms(self):
        """Logs the first pass's GEMMs, one line a layer name (the module docstring), once."""
        self.logged = True
        for name, kinds in sorted(self.shapes.items()):
            logger.info("--ls-fp8: {}: {}".format(name, "; ".join(
                _describe(name, "forward x W^T" if kind == "forward" else "dgrad dY W", shapes)
                for kind, shapes in sorted(kinds.items(), key=lambda kv: kv[0] != "forward"))))

    @property
    def calibrating(self):
        """True during the first forward pass and its backward: no history yet, GEMMs in the run's dtype."""
        return self.passes <= 1

    def row(self, i):
        return self.state[i]

    def observe(self, i, x):
        """Raises row ``i``'s step amax to x's (the calibrating pass, whose GEMMs cast nothing)."""
        self.state[i, self.history] = torch.maximum(self.state[i, self.history], finite_amax(x))


class Fp8Gemm:
    """One linear layer's FP8 choice and its rows in an Fp8Recipe: ``forward`` (x and W in e4m3 for
    y = x W^T) and ``dgrad`` (dy in e5m2, or e4m3, and W for dx = dy W). Rows: x, W, dy."""

    def __init__(self, recipe, name, forward, dgrad):
        self.recipe, self.name, self.forward, self.dgrad = recipe, name, forward, dgrad
        self.first = recipe.reserve(3)

    @property
    def active(self):
        return self.forward or self.dgrad
