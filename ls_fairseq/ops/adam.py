"""Adam over one contiguous workspace (LightSeq2's workspace optimizer).

``param``/``grad`` are flat buffers holding every parameter / gradient of the
model (fp32, fp16 or bf16); ``exp_avg``/``exp_avg_sq`` (and the optional
``master`` copy) are fp32. One call updates the whole model, math in fp32, as
fairseq's ``adam`` does (decoupled weight decay: p -= lr * wd * p), or with
L2 decay added to the gradient when ``decoupled`` is False:

  g = grad * grad_scale (+ wd * p if not decoupled)
  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
  p -= lr * wd * p (if decoupled);  p -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)

``grad_scale`` (a float or a device scalar, so no host sync is needed to
read it) folds the loss-scale division and a clip coefficient into the update. When ``noop_flag`` (a device scalar) is non-zero the step leaves
everything untouched, with no host synchronisation to decide that.
"""
import math

import torch

from ls_fairseq.ops import dispatch


def adam_step_reference(
    param, grad, exp_avg, exp_avg_sq, master, lr, beta1, beta2, eps, weight_decay, step, grad_scale, decoupled, noop_flag
):
    p = master if master is not None else param.float()
    g = grad.float() * grad_scale
    if weight_decay != 0 and not decoupled:
        g = g + weight_decay * p
    m = exp_avg * beta1 + (1 - beta1) * g
    v = exp_avg_sq * beta2 + (1 - beta2) * g * g
    step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
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
    param.copy_(new_p)


def grad_norm_reference(grad):
    """L2 norm of the whole gradient workspace, fp32 0-d tensor (inf/NaN propagate)."""
    return grad.float().norm()


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
):
    """One Adam update of the whole workspace, in place."""
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("master", master)):
        if t is not None and t.numel() != param.numel():
            raise ValueError("adam_step: {} has {} elements, param has {}".format(name, t.numel(), param.numel()))
    for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("master", master)):
        if t is not None and t.dtype != torch.float32:
            raise ValueError("adam_step: {} must be fp32, got {}".format(name, t.dtype))
    impl = dispatch.extension().adam_step if dispatch.use_kernel("adam", param) else adam_step_reference
    impl(
        param, grad, exp_avg, exp_avg_sq, master, float(lr), float(beta1), float(beta2), float(eps),
        float(weight_decay), int(step), grad_scale, bool(decoupled), noop_flag,
    )


def grad_norm(grad):
    impl = dispatch.extension().grad_norm if dispatch.use_kernel("adam", grad) else grad_norm_reference
    return impl(grad)
