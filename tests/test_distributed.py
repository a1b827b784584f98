"""ls_adam's all-reduce over the gradient workspace, two CPU processes over gloo.

fairseq's own CPU distributed mode does not start workers, so torch.distributed
drives the plugin directly, as fairseq's trainer does under --ddp-backend legacy_ddp:
backward, optimizer.all_reduce_grads(model), step.
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ls_fairseq.ops.workspace import grad_in_place
from ls_fairseq.optim.ls_adam import LSAdam, LSAdamConfig
from ls_fairseq.optim.mixed_precision import DeviceStepAdam
from ls_fairseq.trainer import sum_over_workers


def model_and_optimizer(device_step=False):
    """``device_step``: ls_adam as ls-fairseq-train runs it, the update decided on the device."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.Tanh(), torch.nn.Linear(17, 5))
    cfg = LSAdamConfig(adam_betas="(0.9, 0.98)", weight_decay=0.01, lr=[1e-2])
    adam = LSAdam(cfg, list(model.parameters()))
    return model, DeviceStepAdam(cfg, adam) if device_step else adam


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 9, generator=g), torch.randn(8, 5, generator=g)


def loss_of(model, x, y):
    return ((model(x) - y) ** 2).sum()


def worker(rank, init_file, out, device_step):
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=2)
    model, opt = model_and_optimizer(device_step)
    summed = []
    for step in range(5):
        x, y = batch(step)
        half = slice(4 * rank, 4 * rank + 4)
        opt.zero_grad()
        opt.backward(loss_of(model, x[half], y[half]))
        opt.all_reduce_grads(model)
        opt.all_reduce_grads(model)  # a second call in the same step (criterion with parameters) is a no-op
        summed.append(opt.workspace.grad.clone())
        opt.step()
    torch.save(([p.detach().clone() for p in model.parameters()], summed), "{}.{}".format(out, rank))
    dist.destroy_process_group()


@pytest.mark.parametrize("device_step", [False, True])
def test_two_ranks_end_identical_and_equal_one_process_on_the_whole_batch(tmp_path, device_step):
    out = str(tmp_path / "params")
    mp.spawn(worker, args=(str(tmp_path / "init"), out, device_step), nprocs=2, join=True)
    (rank0, grads0), (rank1, grads1) = torch.load(out + ".0"), torch.load(out + ".1")
    for a, b in zip(rank0 + grads0, rank1 + grads1):
        assert torch.equal(a, b)
    # the device step's all-reduce leaves the sum of the workers' gradients (their average's 1/2 is
    # applied inside the update, with no pass of its own); plain ls_adam's leaves the average
    model, opt = model_and_optimizer()
    opt.zero_grad()
    x, y = batch(0)
    ((1.0 if device_step else 0.5) * loss_of(model, x, y)).backward()
    torch.testing.assert_close(grads0[0], opt.workspace.grad, rtol=1e-5, atol=1e-6)
    for step in range(5):
        x, y = batch(step)
        opt.zero_grad()
        (0.5 * loss_of(model, x, y)).backward()  # the all-reduce averages over the two workers
        opt.step()
    for a, b in zip(rank0, model.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)


def stats_worker(rank, init_file, out):
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=2)
    data = {"ntokens": 10 + rank, "train_time": 0.5 * (rank + 1), "ooms": rank,
            "loss": torch.tensor([1.5, -2.0]) * (rank + 1), "nll_loss": torch.tensor(3.0 + rank, dtype=torch.float16)}
    # the CPU stands for the GPU here: its tensors take the device's all-reduce
    summed = sum_over_workers(data, torch.device("cpu"), host_group=dist.new_group(backend="gloo"))
    # while distributed, ls_adam's gradients are accumulated in place only when no autograd hook watches them
    cfg = LSAdamConfig(lr=[1e-2])
    in_place = []
    for grad_hooks in (None, False):
        p = torch.nn.Parameter(torch.zeros(3))
        LSAdam(cfg, [p], grad_hooks=grad_hooks)
        in_place.append(grad_in_place(p) is p.grad)
    torch.save((summed, in_place), "{}.{}".format(out, rank))
    dist.destroy_process_group()


def test_stats_summed_over_workers_and_gradients_in_place_without_hooks(tmp_path):
    out = str(tmp_path / "stats")
    mp.spawn(stats_worker, args=(str(tmp_path / "init"), out), nprocs=2, join=True)
    for rank in (0, 1):
        summed, in_place = torch.load(out + ".{}".format(rank))
        assert in_place == [False, True]
        assert list(summed) == ["ntokens", "train_time", "ooms", "loss", "nll_loss"]
        assert summed["ntokens"] == 21.0 and summed["train_time"] == 1.5 and summed["ooms"] == 1.0
        assert all(isinstance(summed[k], float) for k in ("ntokens", "train_time", "ooms"))
        assert torch.equal(summed["loss"], torch.tensor([4.5, -6.0], dtype=torch.float64))
        assert summed["nll_loss"].shape == () and summed["nll_loss"].item() == 7.0
