"""ls_adam: fairseq's ``adam`` over one contiguous parameter workspace.

At construction every parameter's storage moves into one flat buffer (its
``.data`` becomes a view of it) and every gradient into a second one, so a step
is one ``ops.adam_step`` over the whole model, gradient scaling and clipping
are one operation each, and a distributed all-reduce is one collective.
Semantics are fairseq's adam (AdamW-style decoupled weight decay, bias
correction, ``--adam-betas``/``--adam-eps``/``--weight-decay``), math in fp32.

It works under plain fp32, ``--fp16`` (fairseq's FP16Optimizer hands it one
flat fp32 master parameter: ``supports_flat_params``) and
``--memory-efficient-fp16`` (fp16 parameters updated in place with fp32 math:
``supports_memory_efficient_fp16``); ``supports_step_with_scale`` lets the
loss-scale division happen inside the update instead of as a separate pass.
"""
import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, List

import torch
import torch.distributed as dist
from fairseq.dataclass import FairseqDataclass
from fairseq.optim import FairseqOptimizer, register_optimizer
from omegaconf import II, OmegaConf

from ls_fairseq import ops
from ls_fairseq.ops.workspace import accumulate_in_place

logger = logging.getLogger(__name__)

ALIGN = 16  # elements: every parameter's view starts 32-byte aligned (fp16) or 64-byte (fp32)


@dataclass
class LSAdamConfig(FairseqDataclass):
    adam_betas: Any = field(default=(0.9, 0.999), metadata={"help": "betas for Adam optimizer"})
    adam_eps: float = field(default=1e-8, metadata={"help": "epsilon for Adam optimizer"})
    weight_decay: float = field(default=0.0, metadata={"help": "weight decay"})
    ls_fp32_master: bool = field(
        default=False,
        metadata={
            "help": "keep an fp32 master copy of fp16/bf16 parameters inside ls_adam "
            "(4 more bytes per parameter; small updates then survive rounding)"
        },
    )
    ls_round_to_nearest: bool = field(
        default=False,
        metadata={
            "help": "without an fp32 master copy, round the updated fp16/bf16 parameters to nearest (as LightSeq2 "
            "does) instead of stochastically, which keeps updates below half a unit of precision in expectation"
        },
    )
    lr: List[float] = II("optimization.lr")


class Workspace:
    """Flat parameter and gradient buffers; each parameter and its gradient become views."""

    def __init__(self, params):
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(
                "ls_adam: all parameters must share one dtype and device, got dtypes {} on devices {}".format(
                    sorted(str(d) for d in dtypes), sorted(str(d) for d in devices)
                )
            )
        self.params = params
        self.offsets = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += (p.numel() + ALIGN - 1) // ALIGN * ALIGN
        dtype, device = params[0].dtype, params[0].device
        self.param = torch.zeros(total, dtype=dtype, device=device)
        self.grad = torch.zeros(total, dtype=dtype, device=device)
        with torch.no_grad():
            for p, off in zip(params, self.offsets):
                view = self.param[off : off + p.numel()].view_as(p)
                view.copy_(p.data)
                p.data = view
                if p.grad is not None:
                    self.grad[off : off + p.numel()].view_as(p).copy_(p.grad)
        self.attach_grads()

    def attach_grads(self):
        for p, off in zip(self.params, self.offsets):
            p.grad = self.grad[off : off + p.numel()].view_as(p)

    def zero_grad(self):
        self.grad.zero_()
        self.attach_grads()


class WorkspaceAdam(torch.optim.Optimizer):
    supports_memory_efficient_fp16 = True
    supports_flat_params = True
    supports_step_with_scale = True

    def __init__(self, params, lr, betas, eps, weight_decay, fp32_master=False, stochastic_rounding=False):
        params = [p for p in params if p.requires_grad]
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        if len(self.param_groups) != 1:
            raise ValueError("ls_adam: one parameter group expected, got {}".format(len(self.param_groups)))
        self.workspace = Workspace(self.param_groups[0]["params"])
        n = self.workspace.param.numel()
        device = self.workspace.param.device
        self.exp_avg = torch.zeros(n, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(n, dtype=torch.float32, device=device)
        self.master = None
        if fp32_master and self.workspace.param.dtype != torch.float32:
            self.master = self.workspace.param.float()
        low_precision = self.workspace.param.dtype in (torch.float16, torch.bfloat16)
        self.stochastic_rounding = stochastic_rounding and low_precision and self.master is None
        self.num_steps = 0
        self.grads_reduced = False

    def zero_grad(self, set_to_none=False):
        self.workspace.zero_grad()
        self.grads_reduced = False

    @torch.no_grad()
    def step(self, closure=None, scale=1.0, device_decision=None):
        """One update of the whole workspace; gradients are divided by ``scale`` inside it.

        ``device_decision``: (grad_scale, step, noop_flag) device scalars of a step
        decided on the device (ops.scaled_grad_norm); they replace 1 / scale, the
        host's step count and the always-taken step."""
        loss = closure() if closure is not None else None
        group = self.param_groups[0]
        self.num_steps += 1
        grad_scale, step, noop_flag = device_decision or (1.0 / scale, self.num_steps, None)
        ops.adam_step(
            self.workspace.param,
            self.workspace.grad,
            self.exp_avg,
            self.exp_avg_sq,
            lr=group["lr"],
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            step=step,
            grad_scale=grad_scale,
            master=self.master,
            noop_flag=noop_flag,
            stochastic_rounding=self.stochastic_rounding,
        )
        return loss

    def state_dict(self):
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        groups[0]["params"] = list(range(len(self.workspace.params)))
        state = {"step": self.num_steps, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.master is not None:
            state["master"] = self.master
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        state = state_dict["state"]
        if set(state) - {"step", "exp_avg", "exp_avg_sq", "master"} or state["exp_avg"].numel() != self.exp_avg.numel():
            raise ValueError(
                "ls_adam: the optimizer state in this checkpoint does not match this model's workspace "
                "({} elements expected); use --reset-optimizer to start a fresh optimizer".format(self.exp_avg.numel())
            )
        self.num_steps = int(state["step"])
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
        if self.master is not None:
            if "master" in state:
                self.master.copy_(state["master"])
            else:
                self.master.copy_(self.workspace.param)
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})


@register_optimizer("ls_adam", dataclass=LSAdamConfig)
class LSAdam(FairseqOptimizer):
    """fairseq's adam (decoupled weight decay) over one contiguous workspace.

    The ops' backwards add the gradients into the workspace in place (ops.workspace) unless
    ``grad_hooks``: autograd hooks watch them. None: whenever torch.distributed is initialised,
    as fairseq's trainer then wraps the model in torch's DistributedDataParallel, which learns
    that a gradient is ready from autograd's accumulation of it."""

    def __init__(self, cfg: LSAdamConfig, params, fp32_master=None, grad_hooks=None):
        super().__init__(cfg)
        fp32_master = cfg.ls_fp32_master if fp32_master is None else fp32_master
        self._optimizer = WorkspaceAdam(
            params, fp32_master=fp32_master, stochastic_rounding=not cfg.ls_round_to_nearest, **self.optimizer_config
        )
        if grad_hooks is None:
            grad_hooks = dist.is_available() and dist.is_initialized()
        if not grad_hooks:
            accumulate_in_place(self.workspace.params)

    @property
    def optimizer_config(self):
        return {
            "lr": self.cfg.lr[0] if isinstance(self.cfg.lr, Collection) else self.cfg.lr,
            "betas": eval(self.cfg.adam_betas)
            if isinstance(self.cfg.adam_betas, str)
            else OmegaConf.to_container(self.cfg.adam_betas)
            if OmegaConf.is_config(self.cfg.adam_betas)
            else self.cfg.adam_betas,
            "eps": self.cfg.adam_eps,
            "weight_decay": self.cfg.weight_decay,
        }

    @property
    def workspace(self):
        return self._optimizer.workspace

    def zero_grad(self):
        self._optimizer.zero_grad()

    def multiply_grads(self, c):
        self.workspace.grad.mul_(c)

    def clip_grad_norm(self, max_norm, aggregate_norm_fn=None):
        total_norm = ops.grad_norm(self.workspace.grad)
        if aggregate_norm_fn is not None:
            total_norm = aggregate_norm_fn(total_norm)
        if max_norm > 0:
            clip_coef = (float(max_norm) / (total_norm + 1e-6)).clamp_(max=1)
            self.workspace.grad.mul_(clip_coef)
        return total_norm

    def all_reduce_grads(self, module):
        """Average the gradients over workers in one collective over the whole workspace.

        fairseq calls this under ``--ddp-backend legacy_ddp``, once for the model and
        once for a criterion with parameters: the workspace holds both, so only the
        first call of a step reduces."""
        workers = self.sum_grads_over_workers()
        if workers > 1:
            self.workspace.grad.div_(workers)

    def sum_grads_over_workers(self):
        """Sum the gradients over workers in one all-reduce of the workspace, at the first call of
        a step; returns how many workers' gradients the workspace now holds the sum of (1: none
        summed by this call)."""
        if self._optimizer.grads_reduced or not (dist.is_available() and dist.is_initialized()):
            return 1
        self._optimizer.grads_reduced = True
        world_size = dist.get_world_size()
        if world_size > 1:
            dist.all_reduce(self.workspace.grad)
        return world_size
