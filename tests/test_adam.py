"""The adam op: the workspace update kernel against its reference (GPU), and the
reference's own contract (CPU: see also test_ls_adam.py for fairseq parity)."""
import pytest
import torch
from helpers import DEVICES, DTYPES, kernel, rel_error

from ls_fairseq import ops
from ls_fairseq.ops.adam import (
    GOOD_STEPS, GRAD_NORM, GRAD_SCALE, LOSS_SCALE, OVERFLOW, STEP, adam_step_reference, grad_norm_reference,
    scaled_grad_norm_reference,
)


def state(n, dtype, device, master):
    p = torch.randn(n, device=device).to(dtype)
    return dict(
        param=p, grad=(torch.randn(n, device=device) * 100).to(dtype), exp_avg=torch.randn(n, device=device) * 0.1,
        exp_avg_sq=torch.rand(n, device=device) * 0.1, master=p.float().clone() if master else None,
    )


ARGS = dict(lr=1e-3, beta1=0.9, beta2=0.98, eps=1e-8, step=7)


def tensors(s):
    """A state's tensors in the order of the adam_step binding and its reference."""
    return s["param"], s["grad"], s["exp_avg"], s["exp_avg_sq"], s["master"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 15, 4097, 1000003])
@pytest.mark.parametrize("master,decoupled,wd", [(False, True, 0.0), (True, True, 0.01), (False, False, 0.01)])
def test_kernel_matches_reference(dtype, n, master, decoupled, wd):
    a = state(n, dtype, "cuda", master)
    b = {k: (v.clone() if v is not None else None) for k, v in a.items()}
    # exp_avg = beta1 m + (1 - beta1) g (+ wd p) may cancel (few elements: by chance): its error is
    # bounded by the terms' sizes, each rounded in fp32, not by the result's
    g = a["grad"].float() / 100.0 + (0 if decoupled else wd * a["param"].float().abs())
    terms = ARGS["beta1"] * a["exp_avg"].abs() + (1 - ARGS["beta1"]) * g.abs()
    ext = kernel("adam", a["param"])
    scale = torch.tensor(1 / 100.0, device="cuda")  # a device scalar: no host sync
    hyper = (ARGS["lr"], ARGS["beta1"], ARGS["beta2"], ARGS["eps"], wd, ARGS["step"])
    ext.adam_step(*tensors(a), *hyper, scale, decoupled, None, False)
    adam_step_reference(*tensors(b), *hyper, 1 / 100.0, decoupled, None, False)
    assert (a["exp_avg"] - b["exp_avg"]).double().norm() < 1e-5 * terms.double().norm(), "exp_avg"
    for key in ("exp_avg_sq", "master"):
        if a[key] is not None:
            assert rel_error(a[key], b[key]) < 1e-5, key
    # parameters: at most one rounding step apart in the storage precision
    ulp = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    assert ((a["param"].float() - b["param"].float()).abs() <= ulp * b["param"].float().abs() + 1e-6).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_noop_flag_leaves_everything_untouched(dtype):
    a = state(10001, dtype, "cuda", True)
    before = {k: v.clone() for k, v in a.items()}
    ext = kernel("adam", a["param"])
    ext.adam_step(*tensors(a), 1e-3, 0.9, 0.98, 1e-8, 0.01, 3, 1.0, True, torch.ones((), device="cuda"), False)
    for k in a:
        assert torch.equal(a[k], before[k]), k


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 4097, 10_000_019])
@pytest.mark.parametrize("offset", [0, 1])  # 16-byte loads and a tail; an unaligned start: element by element
def test_kernel_grad_norm(dtype, n, offset):
    g = torch.randn(n + offset, device="cuda").to(dtype)[offset:]
    ext = kernel("adam", g)
    assert rel_error(ext.grad_norm(g), grad_norm_reference(g.double())) < 1e-5
    g[n // 2] = float("inf")
    assert torch.isinf(ext.grad_norm(g))


SCALER_CASES = [  # factor, max_norm, scale_window, scale_floor, loss_scale, good_steps, inf
    (1 / 300.0, 0.0, 0, 0.0, 1.0, 0, False),  # bf16/fp32: no scale, no clip
    (1 / 300.0, 0.5, 4, 0.0, 1024.0, 1, False),  # clipped, counting good steps
    (1 / 300.0, 1e9, 4, 0.0, 1024.0, 3, False),  # not clipped, the scale doubles
    (1 / 300.0, 0.5, 4, 512.0, 1024.0, 2, True),  # overflow: halved (to the floor), not stepped
    (1 / 300.0, 0.5, 4, 1000.0, 1024.0, 2, True),  # the floor stops the halving
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 4097, 10_000_019])
@pytest.mark.parametrize("case", SCALER_CASES)
def test_kernel_scaled_grad_norm_matches_reference(dtype, n, case):
    factor, max_norm, window, floor, scale, good, inf = case
    g = (torch.randn(n, device="cuda") * scale).to(dtype)
    if inf:
        g[n // 3] = float("inf") if n % 2 else float("nan")
    ext = kernel("adam", g)
    for _ in range(2):  # the second call checks that the kernel left its block counter at zero
        a = ops.new_scaler_state(scale, "cuda")
        a[GOOD_STEPS], a[STEP] = good, 5
        b = a.double().clone()
        ext.scaled_grad_norm(g, a, factor, max_norm, float(window), floor)
        scaled_grad_norm_reference(g.double(), b, factor, max_norm, window, floor)
        assert a[-1] == 0, "block counter not reset"
        for slot in (LOSS_SCALE, GOOD_STEPS, OVERFLOW, STEP):
            assert a[slot].item() == b[slot].item(), slot
        if not inf:
            assert rel_error(a[GRAD_NORM], b[GRAD_NORM]) < 1e-5
            assert rel_error(a[GRAD_SCALE], b[GRAD_SCALE]) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_step_count_from_the_device(dtype):
    a = state(4097, dtype, "cuda", True)
    b = {k: v.clone() for k, v in a.items()}
    ext = kernel("adam", a["param"])
    args = (1e-3, 0.9, 0.98, 1e-8, 0.01)
    ext.adam_step(*tensors(a), *args, torch.tensor(7.0, device="cuda"), 0.01, True, None, False)
    ext.adam_step(*tensors(b), *args, 7, 0.01, True, None, False)
    assert rel_error(a["master"], b["master"]) < 1e-6
    assert torch.equal(a["exp_avg"], b["exp_avg"])


@pytest.mark.gpu
def test_a_device_decided_step_is_two_launches_and_no_host_sync():
    """ls-fairseq-train's optimizer step: one reduction, one update, nothing read by the host."""
    from torch.profiler import ProfilerActivity, profile

    model = torch.nn.Linear(257, 129).cuda().half()
    opt = device_step_adam(model)
    loss = model(torch.randn(33, 257, device="cuda").half()).float().pow(2).sum()
    opt.backward(loss)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            opt.multiply_grads(1 / 33.0)
            opt.clip_grad_norm(1.0)
            opt.step()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 2 and "grad_norm" in kernels[0] and "adam" in kernels[1], kernels


def device_step_adam(model):
    from omegaconf import OmegaConf

    from ls_fairseq.optim.ls_adam import LSAdam, LSAdamConfig
    from ls_fairseq.optim.mixed_precision import DeviceStepAdam

    cfg = OmegaConf.structured(LSAdamConfig(lr=[1e-3]))
    scaler = dict(init_scale=128.0, scale_window=100, scale_floor=0.0, min_loss_scale=1e-4)
    return DeviceStepAdam(cfg, LSAdam(cfg, list(model.parameters())), scaler)


def test_reference_noop_flag_and_sizes_on_cpu():
    a = state(33, torch.float16, "cpu", False)
    before = {k: v.clone() for k, v in a.items() if v is not None}
    ops.adam_step(a["param"], a["grad"], a["exp_avg"], a["exp_avg_sq"], weight_decay=0.0, noop_flag=torch.ones(()), **ARGS)
    for k in before:
        assert torch.equal(a[k], before[k])
    with pytest.raises(ValueError, match="exp_avg has 3 elements"):
        ops.adam_step(a["param"], a["grad"], torch.zeros(3), a["exp_avg_sq"], weight_decay=0.0, **ARGS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,spacing", [(torch.float16, 2.0**-11), (torch.bfloat16, 2.0**-8)])
def test_stochastic_rounding_keeps_updates_below_half_a_unit_in_expectation(device, dtype, spacing):
    """1.0 minus an update of 0.3 units (the spacing below 1.0): round-to-nearest loses it every time;
    stochastic rounding lands on 1 - spacing with probability 0.3 and on 1.0 otherwise, nothing else."""
    n = 1_000_003  # a scalar tail after the 16-byte body
    results = {}
    for rounding in (False, True):
        p = torch.ones(n, dtype=dtype, device=device)
        m, v = torch.zeros(n, device=device), torch.zeros(n, device=device)
        ops.adam_step(p, torch.ones_like(p), m, v, lr=0.3 * spacing, beta1=0.9, beta2=0.98, eps=1e-12, weight_decay=0.0,
                      step=1, stochastic_rounding=rounding)
        results[rounding] = p.float()
    assert torch.equal(results[False], torch.ones(n, device=device))
    sr = results[True]
    down = sr == 1.0 - spacing
    assert (down | (sr == 1.0)).all()
    assert abs(down.float().mean().item() - 0.3) < 5 * (0.21 / n) ** 0.5
    assert not torch.equal(down[: n // 2], down[n // 2 :])  # elements draw independently


def test_stochastic_rounding_needs_low_precision_without_a_master_copy():
    p, m, v = torch.ones(4, dtype=torch.float16), torch.zeros(4), torch.zeros(4)
    with pytest.raises(ValueError, match="without an fp32 master copy"):
        ops.adam_step(p, p.clone(), m, v, master=p.float(), stochastic_rounding=True, **ARGS, weight_decay=0.0)
    with pytest.raises(ValueError, match="got torch.float32"):
        ops.adam_step(p.float(), p.float(), m, v, stochastic_rounding=True, **ARGS, weight_decay=0.0)
