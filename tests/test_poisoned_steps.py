"""Poisoned steps: inf/NaN in the loss or the gradients of chosen updates of ls-fairseq-train's
device step (DeviceStepAdam). The step is skipped with parameters, Adam's moments and step count
bit-identical, training goes on as if the batch had not come; fp16 halves its loss scale; a run of
MAX_NONFINITE_RUN non-finite updates in bf16/fp32 stops training with crash.pt saved."""
import copy
import os
import re

import pytest
import torch
from conftest import REPO, bin_path, run
from helpers import DEVICES
from test_ls_adam import data, loss_of, small_model
from test_mixed_precision import INIT_SCALE, device_step, train_step

import ls_fairseq.fairseq_plugin  # noqa: F401 (the checkpoint allowlist for torch.load below)
from ls_fairseq.ops.adam import OVERFLOW, STEP
from ls_fairseq.optim.mixed_precision import MAX_NONFINITE_RUN

HOOKS = os.path.join(REPO, "tests", "poison_hooks")


def snapshot(model, opt):
    inner = opt.adam.optimizer
    kept = [p.detach().clone() for p in model.parameters()] + [inner.exp_avg.clone(), inner.exp_avg_sq.clone()]
    return kept + ([inner.master.clone()] if inner.master is not None else []) + [opt.state[STEP].clone()]


def poisoned_step(model, opt, step, poison):
    """train_step's sequence with NaN times the loss, or +inf in one gradient element."""
    p = next(model.parameters())
    x, y = data(step, p.dtype, p.device)
    opt.zero_grad()
    opt.backward(loss_of(model, x, y) * (float("nan") if poison == "loss" else 1.0))
    if poison == "grad":
        opt.workspace.grad.view(-1)[17] = float("inf")
    opt.multiply_grads(1 / 16.0)
    opt.clip_grad_norm(1.0)
    opt.step()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("poison", ["loss", "grad"])
@pytest.mark.parametrize("dtype,master", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_a_poisoned_step_is_skipped_and_training_goes_on_as_without_it(dtype, master, poison, device):
    a = small_model(dtype, device)
    b = copy.deepcopy(a)
    opt_a, opt_b = device_step(a, fp16=False, master=master), device_step(b, fp16=False, master=master)
    for step in range(8):
        if step in (3, 4):
            before = snapshot(a, opt_a)
            poisoned_step(a, opt_a, step, poison)
            assert opt_a.overflow.item() == 1
            assert all(torch.equal(t, u) for t, u in zip(snapshot(a, opt_a), before)), "step {} changed state".format(step)
            continue
        train_step(a, opt_a, step)
        train_step(b, opt_b, step)  # b never sees batches 3 and 4
        assert opt_a.overflow.item() == 0
    assert all(torch.equal(t, u) for t, u in zip(snapshot(a, opt_a), snapshot(b, opt_b)))
    assert opt_a.state[STEP].item() == 6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("poison", ["loss", "grad"])
def test_an_fp16_poisoned_step_is_skipped_and_halves_the_scale(poison, device):
    model = small_model(torch.float16, device)
    opt = device_step(model, master=True)
    train_step(model, opt, 0)
    before = snapshot(model, opt)
    poisoned_step(model, opt, 1, poison)
    assert opt.overflow.item() == 1 and opt.scaler.loss_scale.item() == INIT_SCALE / 2
    assert all(torch.equal(t, u) for t, u in zip(snapshot(model, opt), before))
    train_step(model, opt, 2)
    assert opt.overflow.item() == 0 and opt.state[STEP].item() == 2
    assert not all(torch.equal(t, u) for t, u in zip(snapshot(model, opt)[:4], before[:4]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_run_of_non_finite_updates_stops_training_when_checked(dtype, device):
    model = small_model(dtype, device)
    opt = device_step(model, fp16=False)
    for step in range(MAX_NONFINITE_RUN - 1):  # one short of the limit, then a finite step
        poisoned_step(model, opt, step, "grad")
    train_step(model, opt, 99)
    opt.check()
    for step in range(MAX_NONFINITE_RUN - 3):  # a run that goes on across a check
        poisoned_step(model, opt, step, "loss")
    opt.check()
    kept = snapshot(model, opt)
    for step in range(3):
        poisoned_step(model, opt, step, "grad")
    with pytest.raises(FloatingPointError, match=r"^{} consecutive updates had inf/NaN gradients \(the limit is {}\)"
                       .format(MAX_NONFINITE_RUN, MAX_NONFINITE_RUN)):
        opt.check()
    assert all(torch.equal(t, u) for t, u in zip(snapshot(model, opt), kept))


def test_the_check_runs_inside_the_logged_steps(monkeypatch):
    model = small_model()
    opt = device_step(model, fp16=False)
    checked = []
    monkeypatch.setattr(type(opt), "check", lambda self: checked.append(self.state[OVERFLOW].item()))
    for step in range(3):
        opt.check_at_step = step == 1
        train_step(model, opt, step)
    assert checked == [0.0]


TRAIN = [
    "--user-dir", HOOKS, "--arch", "ls_transformer_tiny", "--share-all-embeddings",
    "--encoder-layers", "1", "--decoder-layers", "1",
    "--criterion", "ls_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--optimizer", "ls_adam", "--adam-betas", "(0.9,0.98)", "--lr", "1e-3", "--clip-norm", "1.0",
    "--max-tokens", "512", "--num-workers", "0", "--no-progress-bar", "--log-interval", "1", "--seed", "1",
    "--save-interval-updates", "4", "--no-epoch-checkpoints", "--disable-validation",
]


def poisoned_run(data_bin, save_dir, poison, *extra):
    cmd = [bin_path("ls-fairseq-train"), data_bin] + TRAIN + ["--save-dir", str(save_dir)] + list(extra)
    return run(cmd, env={"LS_TEST_POISON": poison})


def skipped_by_update(log):
    return {int(m.group(1)): int(m.group(2)) for m in re.finditer(r"num_updates=(\d+), [^\n]*?skipped=(\d+)", log)}


def states(path):
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state["model"], state["last_optimizer_state"]["state"]


def assert_same_state(path_a, path_b):
    (model_a, opt_a), (model_b, opt_b) = states(path_a), states(path_b)
    assert model_a.keys() == model_b.keys() and all(torch.equal(model_a[k], model_b[k]) for k in model_a)
    assert all(torch.equal(opt_a[k], opt_b[k]) for k in ("exp_avg", "exp_avg_sq")) and opt_a["step"] == opt_b["step"]


@pytest.fixture(scope="module")
def small_data_bin(tmp_path_factory):
    import sys

    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import fault_checkpoints

    return fault_checkpoints.make_data_bin(str(tmp_path_factory.mktemp("poison")))


@pytest.mark.slow
def test_poisoned_updates_on_cpu_are_skipped_and_a_run_of_them_stops_with_crash_pt(small_data_bin, tmp_path):
    proc = poisoned_run(small_data_bin, tmp_path / "a", "loss:3,grad:6", "--cpu", "--max-update", "8")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    skipped = skipped_by_update(proc.stdout)
    assert skipped == {u: int(u in (3, 6)) for u in range(1, 9)}, skipped
    assert states(tmp_path / "a" / "checkpoint_last.pt")[1]["step"] == 6  # Adam's t: the finite steps

    proc = poisoned_run(small_data_bin, tmp_path / "b", "grad:5-40", "--cpu", "--max-update", "40")
    assert proc.returncode != 0
    assert "FloatingPointError: {} consecutive updates had inf/NaN gradients".format(MAX_NONFINITE_RUN) in proc.stderr
    assert max(skipped_by_update(proc.stdout)) == 4 + MAX_NONFINITE_RUN - 1  # stopped at the check of the 10th
    assert_same_state(tmp_path / "b" / "crash.pt", tmp_path / "b" / "checkpoint_1_4.pt")  # nothing lost


def scales_by_update(log):
    # the training lines' loss scale by update (fairseq's config dump also prints min_loss_scale=...)
    return {int(m.group(1)): float(m.group(2))
            for m in re.finditer(r"num_updates=(\d+), [^\n]*?\bloss_scale=([\d.]+)", log)}


@pytest.mark.slow
def test_fp16_poisoned_updates_on_cpu_halve_the_logged_scale(small_data_bin, tmp_path):
    proc = poisoned_run(small_data_bin, tmp_path / "a", "grad:3,grad:6", "--fp16", "--cpu", "--max-update", "8")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert skipped_by_update(proc.stdout) == {u: int(u in (3, 6)) for u in range(1, 9)}
    scales = scales_by_update(proc.stdout)
    assert sorted(scales) == list(range(1, 9)), scales
    assert [scales[u] / scales[u - 1] for u in range(2, 9)] == [1, 0.5, 1, 1, 0.5, 1, 1], scales


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["--fp16", "--bf16"])
@pytest.mark.parametrize("graphs", [[], ["--ls-cuda-graphs", "--required-seq-len-multiple", "8"]])
def test_poisoned_gradients_on_the_gpu(small_data_bin, tmp_path, precision, graphs):
    """Gradient poisoning on updates 3 and 6 (with graphs: replayed steps, the first one being eager)."""
    gpu = [precision, "--distributed-world-size", "1", "--max-update", "8"] + graphs
    proc = poisoned_run(small_data_bin, tmp_path / "a", "grad:3,grad:6", *gpu)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    skipped = skipped_by_update(proc.stdout)
    assert skipped == {u: int(u in (3, 6)) for u in range(1, 9)}, skipped
    assert states(tmp_path / "a" / "checkpoint_last.pt")[1]["step"] == 6
    if precision == "--fp16":
        scales = scales_by_update(proc.stdout)
        assert scales[3] == scales[2] / 2 and scales[6] == scales[5] / 2, scales
        return
    proc = poisoned_run(small_data_bin, tmp_path / "b", "grad:5-40", precision, "--distributed-world-size", "1",
                        "--max-update", "40", *graphs)
    assert proc.returncode != 0 and "consecutive updates had inf/NaN gradients" in proc.stderr, proc.stderr[-3000:]
    assert_same_state(tmp_path / "b" / "crash.pt", tmp_path / "b" / "checkpoint_1_4.pt")
