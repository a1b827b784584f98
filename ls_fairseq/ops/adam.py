"""Adam over one contiguous workspace (LightSeq2's workspace optimizer).

``param``/``grad`` are flat buffers holding every parameter / gradient of the
model (fp32, fp16 or bf16); ``exp_avg``/``exp_avg_sq`` (and the optional
``master`` copy) are fp32. One call updates the whole model, math in fp32, as
fairseq's ``adam`` does (decoupled weight decay: p -= lr * wd * p), or with
L2 decay added to the gradient when ``decoupled`` is False:

  g = grad * grad_scale (+ wd * p if not decoupled)
  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
  p -= lr * wd * p (if decoupled);  p -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)

``grad_scale`` and ``step`` (each a number or a device scalar, so no host sync
is needed to read them) fold the loss-scale division and a clip coefficient into
the update and give the bias correction's t. When ``noop_flag`` (a device
scalar) is non-zero the step leaves everything untouched, with no host
synchronisation to decide that.

``scaled_grad_norm`` is the one reduction of a mixed-precision step: the norm of
the (loss-scaled) gradient workspace and, from it, on the device, the decision
the update reads. Its state is one fp32 vector (slots below); with a dynamic
scale (``scale_window`` > 0) it is fairseq's DynamicLossScaler without a host:

  norm = |grad| * factor / loss_scale;  overflow = not isfinite(norm)
  grad_scale = factor / loss_scale * min(1, max_norm / (norm + 1e-6))  (no clip: 1)
  step += 1 unless overflow
  overflow: loss_scale = max(loss_scale / 2, scale_floor), good_steps = 0
  else: good_steps += 1, and at scale_window: loss_scale *= 2, good_steps = 0
"""
import torch

from ls_fairseq.ops import dispatch
from ls_fairseq.ops.dispatch import _C

# slots of the state vector of scaled_grad_norm; COUNTER belongs to the kernel (kept zero)
LOSS_SCALE, GOOD_STEPS, GRAD_NORM, GRAD_SCALE, OVERFLOW, STEP, COUNTER = range(7)


def round_stochastic_reference(x, dtype):
    """fp32 ``x`` to fp16/bf16, up or down to its two neighbours lo, hi in ``dtype`` with
    P(hi) = (x - lo) / (hi - lo): the expected result is x itself (torch's generator draws)."""
    y = x.to(dtype)
    bits = y.view(torch.int16)  # +-1 on the bits: one unit outward / inward, either sign
    above = y.float().abs() > x.abs()
    lo = torch.where(above, bits - 1, bits).view(dtype)
    hi = torch.where(above, bits, bits + 1).view(dtype)
    flo = lo.float()
    frac = (x - flo) / (hi.float() - flo)
    rounded = torch.where(torch.rand_like(x) < frac, hi, lo)
    return torch.where(torch.isfinite(x) & (y.float() != x), rounded, y)


def adam_step_reference(
    param, grad, exp_avg, exp_avg_sq, master, lr, beta1, beta2, eps, weight_decay, step, grad_scale, decoupled, noop_flag,
    stochastic_rounding,
):
    p = master if master is not None else param.float()
    g = grad.float() * grad_scale
    if weight_decay != 0 and not decoupled:
        g = g + weight_decay * p
    m = exp_avg * beta1 + (1 - beta1) * g
    v = exp_avg_sq * beta2 + (1 - beta2) * g * g
    step_size = lr * (1 - beta2**step) ** 0.5 / (1 - beta1**step)
    new_p = p
    if weight_decay != 0 and decoupled:
        new_p = new_p - lr * weight_decay * new_p
    new_p = new_p - step_size * m / (v.sqrt() + eps)
    if noop_flag is not None:
        skip = noop_flag.bool()
        m, v, new_p = torch.where(skip, exp_avg, m), torch.where(skip, exp_avg_sq, v), torch.where(skip, p, new_p)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if master is not None:
        master.copy_(new_p)
    param.copy_(round_stochastic_reference(new_p, param.dtype) if stochastic_rounding else new_p)


def grad_norm_reference(grad):
    """L2 norm of the whole gradient workspace, fp32 0-d tensor (inf/NaN propagate)."""
    return grad.float().norm()


def scaled_grad_norm_reference(grad, state, factor, max_norm, scale_window, scale_floor):
    scale = state[LOSS_SCALE].clone()
    norm = grad.float().norm() * factor / scale
    overflow = ~torch.isfinite(norm)
    clip = (max_norm / (norm + 1e-6)).clamp(max=1) if max_norm > 0 else 1.0
    state[GRAD_NORM] = norm
    state[GRAD_SCALE] = factor / scale * clip
    state[OVERFLOW] = overflow.float()
    state[STEP] += (~overflow).float()
    if scale_window > 0:
        good = state[GOOD_STEPS] + 1
        grow = ~overflow & (good >= scale_window)
        state[LOSS_SCALE] = torch.where(overflow, (scale * 0.5).clamp(min=scale_floor), torch.where(grow, scale * 2, scale))
        state[GOOD_STEPS] = torch.where(overflow | grow, torch.zeros_like(good), good)


# the three kernels of the "adam" op, each with its reference
ADAM_STEP_ROUTE = dispatch.Route("adam", kernel=_C.adam_step if _C else None, reference=adam_step_reference)
GRAD_NORM_ROUTE = dispatch.Route("adam", kernel=_C.grad_norm if _C else None, reference=grad_norm_reference)
SCALED_GRAD_NORM_ROUTE = dispatch.Route(
    "adam", kernel=_C.scaled_grad_norm if _C else None, reference=scaled_grad_norm_reference
)


def new_scaler_state(loss_scale, device):
    """The state vector of scaled_grad_norm: the given loss scale, Adam's step count 0."""
    state = torch.zeros(COUNTER + 1, dtype=torch.float32, device=device)
    state[LOSS_SCALE] = loss_scale
    return state


def adam_step(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    *,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    step,
    grad_scale=1.0,
    master=None,
    decoupled=True,
    noop_flag=None,
    stochastic_rounding=False,
):
    """One Adam update of the whole workspace, in place. ``stochastic_rounding``: fp16/bf16
    ``param`` without ``master`` is rounded stochastically (unbiased) instead of to nearest."""
    if stochastic_rounding and (master is not None or param.dtype not in (torch.float16, torch.bfloat16)):
        raise ValueError("adam_step: stochastic rounding is for fp16/bf16 parameters without an fp32 master copy, "
                         "got {} parameters{}".format(param.dtype, " with a master copy" if master is not None else ""))
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("master", master)):
        if t is not None and t.numel() != param.numel():
            raise ValueError("adam_step: {} has {} elements, param has {}".format(name, t.numel(), param.numel()))
    for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("master", master)):
        if t is not None and t.dtype != torch.float32:
            raise ValueError("adam_step: {} must be fp32, got {}".format(name, t.dtype))
    ADAM_STEP_ROUTE.pick(param)(
        param, grad, exp_avg, exp_avg_sq, master, float(lr), float(beta1), float(beta2), float(eps),
        float(weight_decay), step if torch.is_tensor(step) else int(step), grad_scale, bool(decoupled), noop_flag,
        bool(stochastic_rounding),
    )


def grad_norm(grad):
    return GRAD_NORM_ROUTE.pick(grad)(grad)


def scaled_grad_norm(grad, state, *, factor=1.0, max_norm=0.0, scale_window=0, scale_floor=0.0):
    """The norm of ``grad`` and the step's loss-scale/clip decision, written into ``state`` (one launch)."""
    if state.dtype != torch.float32 or state.shape != (COUNTER + 1,):
        raise ValueError("scaled_grad_norm: state must be new_scaler_state's fp32 vector of {} slots, got {} {}".format(
            COUNTER + 1, state.dtype, tuple(state.shape)))
    SCALED_GRAD_NORM_ROUTE.pick(grad)(
        grad, state, float(factor), float(max_norm), float(scale_window), float(scale_floor)
    )
