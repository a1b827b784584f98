import copy

import pytest
import torch
from fairseq import utils
from fairseq.optim.adam import FairseqAdam, FairseqAdamConfig
from fairseq.optim.fp16_optimizer import MemoryEfficientFP16Optimizer
from helpers import DEVICES, assert_close
from omegaconf import OmegaConf

from ls_fairseq import ops
from ls_fairseq.optim.ls_adam import LSAdam, LSAdamConfig


def small_model(dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.ReLU(), torch.nn.Linear(31, 7)).to(device, dtype)


def optimizers(model_a, model_b, lr=1e-2, wd=0.0):
    fairseq_cfg = FairseqAdamConfig(adam_betas="(0.9, 0.98)", adam_eps=1e-6, weight_decay=wd, lr=[lr])
    # round to nearest, as fairseq's adam writes its fp16 parameters back
    ls_cfg = LSAdamConfig(adam_betas="(0.9, 0.98)", adam_eps=1e-6, weight_decay=wd, lr=[lr], ls_round_to_nearest=True)
    return FairseqAdam(fairseq_cfg, list(model_a.parameters())), LSAdam(ls_cfg, list(model_b.parameters()))


def loss_of(model, x, y):
    return ((model(x) - y) ** 2).sum()


def data(step, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 13, generator=g).to(device, dtype), torch.randn(16, 7, generator=g).to(device, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_fp32_trajectory_equals_fairseq_adam(wd, device):
    a = small_model(device=device)
    b = copy.deepcopy(a)
    opt_a, opt_b = optimizers(a, b, wd=wd)
    for step in range(12):
        x, y = data(step, device=device)
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            loss_of(model, x, y).backward()
            opt.set_lr(1e-2 / (1 + step))
            opt.step()
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert_close(pb, pa, rtol=1e-6, atol=1e-7, what="step {}".format(step))


def test_parameters_live_in_one_workspace_and_gradients_accumulate_there():
    model = small_model()
    _, opt = optimizers(small_model(), model)
    ws = opt.workspace
    for p in model.parameters():
        assert p.data.untyped_storage().data_ptr() == ws.param.untyped_storage().data_ptr()
    opt.zero_grad()
    x, y = data(0)
    loss_of(model, x[:8], y[:8]).backward()
    loss_of(model, x[8:], y[8:]).backward()  # --update-freq 2
    accumulated = ws.grad.clone()
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    loss_of(ref, x, y).backward()
    expected = torch.cat([torch.cat([p.grad.reshape(-1), p.grad.new_zeros(-p.numel() % 16)]) for p in ref.parameters()])
    assert_close(accumulated, expected, rtol=1e-5, atol=1e-6)
    for p in model.parameters():
        assert p.grad.untyped_storage().data_ptr() == ws.grad.untyped_storage().data_ptr()


@pytest.mark.parametrize("device", DEVICES)
def test_clip_and_multiply_match_fairseq(device):
    a = small_model(device=device)
    b = copy.deepcopy(a)
    opt_a, opt_b = optimizers(a, b)
    x, y = data(3, device=device)
    for model, opt in ((a, opt_a), (b, opt_b)):
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.multiply_grads(0.5)
    norm_a = utils.clip_grad_norm_(list(a.parameters()), 0.1)
    norm_b = opt_b.clip_grad_norm(0.1)
    assert_close(norm_b, norm_a, rtol=1e-6, atol=0)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert_close(pb.grad, pa.grad, rtol=1e-5, atol=1e-8)


def test_flat_fp32_master_parameter_as_fp16_optimizer_hands_it():
    # fairseq's FP16Optimizer (--fp16) gives the optimizer one flat fp32 parameter with a grad
    flat_a = torch.randn(1000, requires_grad=True)
    flat_b = flat_a.detach().clone().requires_grad_()
    opt_a = FairseqAdam(FairseqAdamConfig(adam_betas="(0.9, 0.98)", lr=[1e-3]), [flat_a])
    opt_b = LSAdam(LSAdamConfig(adam_betas="(0.9, 0.98)", lr=[1e-3]), [flat_b])
    assert opt_b.supports_flat_params
    for step in range(10):
        g = torch.randn(1000)
        flat_a.grad = g.clone()
        flat_b.grad.copy_(g)  # FP16Optimizer copies into the existing grad
        opt_a.step()
        opt_b.step()
        assert_close(flat_b, flat_a, rtol=1e-6, atol=1e-7)


def mem_efficient_fp16(optimizer):
    cfg = OmegaConf.create({
        "optimizer": None,
        "common": {"fp16_scale_window": 4, "fp16_init_scale": 2.0**10, "fp16_scale_tolerance": 0.0,
                   "threshold_loss_scale": None, "min_loss_scale": 1e-4, "bf16": False},
    })
    return MemoryEfficientFP16Optimizer(cfg, list(optimizer.params), optimizer)


@pytest.mark.parametrize("device", DEVICES)
def test_memory_efficient_fp16_follows_fairseq_adam(device):
    a = small_model(torch.float16, device)
    b = copy.deepcopy(a)
    inner_a, inner_b = optimizers(a, b, lr=1e-3, wd=0.01)
    assert inner_b.supports_memory_efficient_fp16 and inner_b.supports_step_with_scale
    opt_a, opt_b = mem_efficient_fp16(inner_a), mem_efficient_fp16(inner_b)
    skipped = []
    for step in range(12):
        x, y = data(step, torch.float16, device)
        overflow = []
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            opt.backward(loss_of(model, x, y))
            try:
                opt.clip_grad_norm(1.0)
                opt.step()
                overflow.append(False)
            except OverflowError:  # fairseq's trainer skips the update
                overflow.append(True)
        assert overflow[0] == overflow[1]
        skipped.append(overflow[0])
        assert opt_a.scaler.loss_scale == opt_b.scaler.loss_scale
    assert any(skipped) and not all(skipped)
    for pa, pb in zip(a.parameters(), b.parameters()):
        # the loss-scale division happens in fp32 inside ls_adam, in fp16 before fairseq's adam
        assert_close(pb.float(), pa.float(), rtol=0, atol=3e-3)
        assert (pb.float() - pa.float()).abs().mean() < 2e-4


def test_state_dict_resume_is_bit_identical():
    a = small_model()
    b = copy.deepcopy(a)
    _, opt_a = optimizers(small_model(), a, wd=0.01)
    for step in range(10):
        x, y = data(step)
        opt_a.zero_grad()
        loss_of(a, x, y).backward()
        opt_a.step()
        if step == 4:
            saved_model, saved_opt = copy.deepcopy(a.state_dict()), copy.deepcopy(opt_a.state_dict())
    b.load_state_dict(saved_model)
    _, opt_b = optimizers(small_model(), b, wd=0.01)
    opt_b.load_state_dict(saved_opt)
    for step in range(5, 10):
        x, y = data(step)
        opt_b.zero_grad()
        loss_of(b, x, y).backward()
        opt_b.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_state_in_the_flat_layout_of_fp16_optimizers_fp32_parameter():
    """fairseq's FP16Optimizer (--fp16) hands ls_adam the model's parameters as one flat fp32 parameter,
    so ls_adam there writes its state laid out as their concatenation. A workspace over the parameters
    themselves writes that layout too (state_dict(flat=True)) and reads it: a resume from it goes on as
    the flat one does, bit for bit."""
    model = small_model()
    _, per_param = optimizers(small_model(), model, wd=0.01)
    flat = torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    _, over_flat = optimizers(small_model(), torch.nn.ParameterList([flat]), wd=0.01)
    sizes = [p.numel() for p in model.parameters()]
    assert len(set(sizes)) > 1 and any(n % 16 for n in sizes)  # the two layouts differ

    def step(i, models_and_optimizers):
        x, y = data(i)
        for m, opt in models_and_optimizers:
            opt.zero_grad()
            loss_of(m, x, y).backward()
            over_flat.optimizer.workspace.grad[: sum(sizes)] += torch.cat([p.grad.reshape(-1) for p in m.parameters()])
            opt.step()
        over_flat.step()
        over_flat.zero_grad()

    for i in range(4):
        step(i, [(model, per_param)])
    written, expected = per_param.optimizer.state_dict(flat=True), over_flat.state_dict()
    assert written["param_groups"] == expected["param_groups"] and set(written["state"]) == set(expected["state"])
    for k, v in expected["state"].items():
        assert torch.equal(written["state"][k], v) if torch.is_tensor(v) else written["state"][k] == v, k

    resumed = small_model()
    resumed.load_state_dict(model.state_dict())
    _, reader = optimizers(small_model(), resumed, wd=0.01)
    reader.load_state_dict(copy.deepcopy(over_flat.state_dict()))
    for i in range(4, 6):
        step(i, [(resumed, reader)])
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in resumed.parameters()]), flat.detach())
    assert torch.equal(reader.optimizer.state_dict(flat=True)["state"]["exp_avg_sq"], over_flat.optimizer.exp_avg_sq)


def test_a_saved_master_copy_is_taken_by_fp32_parameters():
    """ls-fairseq-train --fp16 saves its fp32 master copy; ls_adam under fairseq's FP16Optimizer, whose fp32
    copy of the parameters is ls_adam's own workspace, resumes from it instead of the rounded fp16 model."""
    half = small_model(torch.float16)
    opt = LSAdam(LSAdamConfig(lr=[1e-3]), list(half.parameters()), fp32_master=True)
    x, y = data(0, torch.float16)
    opt.zero_grad()
    loss_of(half, x, y).backward()
    opt.step()
    saved = opt.state_dict()
    assert not torch.equal(saved["state"]["master"], opt.workspace.param.float())  # the master is finer
    fp32 = small_model()
    reader = LSAdam(LSAdamConfig(lr=[1e-3]), list(fp32.parameters()))
    reader.load_state_dict(saved)
    assert torch.equal(reader.workspace.param, saved["state"]["master"])
    again = LSAdam(LSAdamConfig(lr=[1e-3]), list(small_model(torch.float16).parameters()), fp32_master=True)
    del saved["state"]["master"]
    again.load_state_dict(saved)  # none saved: rebuilt from the parameters
    assert torch.equal(again.optimizer.master, again.workspace.param.float())


def test_mismatched_state_is_a_clear_error():
    _, opt = optimizers(small_model(), small_model())
    state = opt.state_dict()
    state["state"]["exp_avg"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"checkpoint \(3 elements over 4 parameters\).*--reset-optimizer"):
        opt.load_state_dict(state)
    state = opt.state_dict()
    state["state"]["momentum_buffer"] = torch.zeros(3)
    with pytest.raises(ValueError, match="holds momentum_buffer.*--reset-optimizer"):
        opt.load_state_dict(state)


@pytest.mark.parametrize("n", [1, 15, 4097])
def test_adam_op_skips_on_the_flag_and_folds_the_scale(n):
    p = torch.randn(n, dtype=torch.float16)
    g = torch.randn(n, dtype=torch.float16)
    m, v = torch.rand(n), torch.rand(n)
    before = [t.clone() for t in (p, m, v)]
    kw = dict(lr=1e-1, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.0, step=3)
    ops.adam_step(p, g, m, v, grad_scale=0.5, noop_flag=torch.tensor(1), **kw)
    for t, b in zip((p, m, v), before):
        assert torch.equal(t, b)
    ops.adam_step(p, g, m, v, grad_scale=0.5, noop_flag=torch.tensor(0), **kw)
    p2, m2, v2 = before[0].clone(), before[1].clone(), before[2].clone()
    ops.adam_step(p2, (g.float() * 0.5).half(), m2, v2, **kw)
    assert_close(m, m2, rtol=1e-6, atol=1e-7)
    # the step ran on the parameters too: fp16 without a master copy rounds stochastically, so each
    # value is one of the two fp16 neighbours of the same step taken in fp32
    p3 = before[0].float()
    ops.adam_step(p3, g.float() * 0.5, before[1].clone(), before[2].clone(), **kw)
    fp16 = torch.finfo(torch.float16)
    ulp = (fp16.eps * torch.exp2(torch.floor(torch.log2(p3.abs())))).clamp(min=fp16.smallest_normal * fp16.eps)
    assert ((p.float() - p3).abs() <= ulp).all()


def test_adam_op_l2_weight_decay_mode():
    p, g = torch.randn(50), torch.randn(50)
    m, v = torch.zeros(50), torch.zeros(50)
    ops.adam_step(p.clone(), g, m, v, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=1, decoupled=False)
    g_l2 = g + 0.1 * p
    assert_close(m, 0.1 * g_l2, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype,master,rounding", [
    (torch.float16, False, True), (torch.bfloat16, False, True), (torch.float16, True, False), (torch.float32, False, False),
])
def test_stochastic_rounding_is_the_default_without_master_weights(dtype, master, rounding):
    """fp16/bf16 parameters without an fp32 copy are rounded stochastically unless --ls-round-to-nearest;
    with a master copy, or in fp32, there is nothing to round."""
    params = list(small_model(dtype).parameters())
    cfg = LSAdamConfig(lr=[1e-3])
    assert LSAdam(cfg, params, fp32_master=master)._optimizer.stochastic_rounding == rounding
    cfg.ls_round_to_nearest = True
    assert not LSAdam(cfg, params, fp32_master=master)._optimizer.stochastic_rounding
