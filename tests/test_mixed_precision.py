"""ls-fairseq-train's device-decided mixed-precision step (DeviceStepAdam) against
fairseq's host-decided one (MemoryEfficientFP16Optimizer around ls_adam), on CPU and on CUDA."""
import copy
from types import SimpleNamespace

import pytest
import torch
from fairseq.optim.fp16_optimizer import MemoryEfficientFP16Optimizer
from helpers import DEVICES, assert_close
from omegaconf import OmegaConf
from test_ls_adam import data, loss_of, small_model

from ls_fairseq.ops.adam import LOSS_SCALE, OVERFLOW, STEP
from ls_fairseq.ops.workspace import grad_in_place
from ls_fairseq.optim import ls_adam
from ls_fairseq.optim.ls_adam import LSAdam, LSAdamConfig
from ls_fairseq.optim.mixed_precision import DeviceStepAdam

WINDOW, INIT_SCALE = 4, 2.0**10


def adam_cfg():
    # round to nearest: the comparisons with fairseq's optimizers are exact arithmetic
    return OmegaConf.structured(LSAdamConfig(adam_betas="(0.9, 0.98)", adam_eps=1e-6, weight_decay=0.01, lr=[1e-3],
                                             ls_round_to_nearest=True))


def device_step(model, fp16=True, master=False):
    scaler = dict(init_scale=INIT_SCALE, scale_window=WINDOW, scale_floor=0.0, min_loss_scale=1e-4) if fp16 else None
    return DeviceStepAdam(adam_cfg(), LSAdam(adam_cfg(), list(model.parameters()), fp32_master=master), scaler)


def host_step(model):
    cfg = OmegaConf.create({
        "optimizer": None,
        "common": {"fp16_scale_window": WINDOW, "fp16_init_scale": INIT_SCALE, "fp16_scale_tolerance": 0.0,
                   "threshold_loss_scale": None, "min_loss_scale": 1e-4, "bf16": False},
    })
    inner = LSAdam(adam_cfg(), list(model.parameters()))
    return MemoryEfficientFP16Optimizer(cfg, list(inner.params), inner)


def train_step(model, opt, step, clip=1.0):
    """The trainer's sequence: zero, backward, multiply by 1/sample_size, clip, step."""
    p = next(model.parameters())
    x, y = data(step, p.dtype, p.device)
    opt.zero_grad()
    opt.backward(loss_of(model, x, y))
    opt.multiply_grads(1 / 16.0)
    try:
        opt.clip_grad_norm(clip)
        opt.step()
    except OverflowError:  # fairseq's trainer skips the update
        return True
    return False


@pytest.mark.parametrize("device", DEVICES)
def test_device_step_follows_fairseqs_dynamic_loss_scaling(device):
    a = small_model(torch.float16, device)
    b = copy.deepcopy(a)
    host, decided = host_step(a), device_step(b)
    skipped = []
    for step in range(16):
        host_skipped = train_step(a, host, step)
        train_step(b, decided, step)
        assert bool(decided.overflow) == host_skipped, step
        assert decided.scaler.loss_scale.item() == host.scaler.loss_scale, step
        skipped.append(host_skipped)
    assert any(skipped) and not all(skipped)
    assert decided.state[STEP].item() == len(skipped) - sum(skipped)  # Adam's t: taken steps only
    for pa, pb in zip(a.parameters(), b.parameters()):
        # the same fp32 math; the clip coefficients differ by fairseq's 1e-6 in the norm
        assert_close(pb.float(), pa.float(), rtol=0, atol=1e-3)
        assert (pb.float() - pa.float()).abs().mean() < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_loss_scale_it_is_ls_adam_with_clipping(dtype, device):
    a = small_model(dtype, device)
    b = copy.deepcopy(a)
    plain, decided = LSAdam(adam_cfg(), list(a.parameters())), device_step(b, fp16=False)
    for step in range(6):
        x, y = data(step, dtype, device)
        plain.zero_grad()
        plain.backward(loss_of(a, x, y))
        plain.multiply_grads(1 / 16.0)
        plain.clip_grad_norm(1.0)
        plain.step()
        train_step(b, decided, step)
    # bf16: the plain path rounds the gradients to bf16 in multiply_grads and in the clip, the device
    # path folds both into the fp32 update: over six steps parameters may drift apart by two bf16 units,
    # and near zero by one bf16 unit of an update (lr = 1e-3), which the rounded gradient changes
    ulp = 1e-5 if dtype == torch.float32 else 2.0**-6
    atol = 1e-6 if dtype == torch.float32 else 1e-3 * 2.0**-8
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert_close(pb.float(), pa.float(), rtol=ulp, atol=atol)
        assert (pb.float() - pa.float()).abs().mean() < ulp * 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_a_non_finite_step_changes_nothing_but_the_scale(device):
    model = small_model(torch.float16, device)
    opt = device_step(model, master=True)
    train_step(model, opt, 0)
    before = [p.clone() for p in model.parameters()]
    moments = opt.adam.optimizer.exp_avg.clone(), opt.adam.optimizer.master.clone()
    x, y = data(1, torch.float16, device)
    opt.zero_grad()
    opt.backward(loss_of(model, x, y) * float("nan"))
    opt.clip_grad_norm(0.0)
    opt.step()
    assert opt.overflow.item() == 1 and opt.state[STEP].item() == 1
    assert opt.scaler.loss_scale.item() == INIT_SCALE / 2
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert torch.equal(opt.adam.optimizer.exp_avg, moments[0]) and torch.equal(opt.adam.optimizer.master, moments[1])


@pytest.mark.parametrize("device", DEVICES)
def test_resume_is_bit_identical_with_the_loss_scale(device):
    a = small_model(torch.float16, device)
    opt_a = device_step(a, master=True)
    for step in range(10):
        train_step(a, opt_a, step)
        if step == 4:
            saved_model, saved_opt = copy.deepcopy(a.state_dict()), copy.deepcopy(opt_a.state_dict())
    assert saved_opt["loss_scale"] != INIT_SCALE  # the scale moved, and is saved
    b = small_model(torch.float16, device)
    b.load_state_dict(saved_model)
    opt_b = device_step(b, master=True)
    opt_b.load_state_dict(saved_opt)
    for step in range(5, 10):
        train_step(b, opt_b, step)
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters()))
    assert torch.equal(opt_a.state[[LOSS_SCALE, STEP]], opt_b.state[[LOSS_SCALE, STEP]])


def test_minimum_loss_scale_stops_training_when_checked():
    model = small_model(torch.float16)
    opt = device_step(model)
    opt.scaler.min_loss_scale = INIT_SCALE
    opt.state[LOSS_SCALE] = INIT_SCALE
    with pytest.raises(FloatingPointError, match="Minimum loss scale reached"):
        opt.scaler.check()


def test_precision_flags_choose_master_weights_and_scaling(monkeypatch):
    def build(dtype, ddp_backend="legacy_ddp", **common):
        flags = dict(fp16=False, bf16=False, memory_efficient_fp16=False, memory_efficient_bf16=False,
                     fp16_scale_window=None, fp16_init_scale=128, fp16_scale_tolerance=0.0, threshold_loss_scale=None,
                     min_loss_scale=1e-4, model_parallel_size=1)
        flags.update(common)
        cfg = OmegaConf.create({"common": flags, "optimizer": adam_cfg(),
                                "distributed_training": {"distributed_world_size": 2, "ddp_backend": ddp_backend},
                                "optimization": {"update_freq": [4]}})
        return DeviceStepAdam.build_optimizer(cfg, list(small_model(dtype).parameters()))

    fp16 = build(torch.float16, fp16=True)
    assert fp16.adam.optimizer.master is not None  # --fp16: fp32 master weights, as fairseq's FP16Optimizer
    assert fp16.scaler.scale_window == 2**14 // 2 // 4 and fp16.scaler.loss_scale.item() == 128
    assert build(torch.float16, fp16=True, memory_efficient_fp16=True).adam.optimizer.master is None
    bf16 = build(torch.bfloat16, bf16=True, memory_efficient_bf16=True)
    assert bf16.scaler is None and bf16.adam.optimizer.master is None
    assert build(torch.bfloat16, bf16=True).adam.optimizer.master is not None
    with pytest.raises(ValueError, match="--fp16-scale-tolerance"):
        build(torch.float16, fp16=True, fp16_scale_tolerance=0.25)
    # under data-parallel training with legacy_ddp no autograd hook watches the gradients, so the ops may
    # accumulate them in place; torch's DistributedDataParallel (c10d) needs autograd's accumulation
    monkeypatch.setattr(ls_adam, "dist", SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True))
    legacy = build(torch.float16, fp16=True)
    assert all(grad_in_place(p) is p.grad for p in legacy.adam.optimizer.workspace.params)
    c10d = build(torch.float16, ddp_backend="c10d", fp16=True)
    assert all(grad_in_place(p) is None for p in c10d.adam.optimizer.workspace.params)


@pytest.mark.parametrize("master,limit", [(False, 12), (True, 16)])
def test_bytes_per_parameter(master, limit):
    """Parameters + gradients + optimizer state: 12 bytes per fp16 parameter, 16 with the fp32
    master copy (fairseq's FP16Optimizer: 20); the workspace's alignment padding included."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1000, 999), torch.nn.Linear(999, 1001)).half()
    count = sum(p.numel() for p in model.parameters())
    opt = device_step(model, master=master)
    adam = opt.adam.optimizer
    buffers = [opt.workspace.param, opt.workspace.grad, adam.exp_avg, adam.exp_avg_sq, adam.master]
    total = sum(t.numel() * t.element_size() for t in buffers if t is not None)
    assert limit - 0.01 < total / count <= limit + 0.01
