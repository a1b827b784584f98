"""ls_adam: fairseq's ``adam`` over one contiguous parameter workspace: ``WorkspaceAdam``
(ls_fairseq/optim/workspace_adam.py) as a fairseq optimizer, registered by the fairseq plugin
(ls_fairseq/fairseq_plugin). Gradient scaling and clipping are one operation each, and a
distributed all-reduce is one collective.
Semantics are fairseq's adam (AdamW-style decoupled weight decay, bias
correction, ``--adam-betas``/``--adam-eps``/``--weight-decay``), math in fp32.

It works under plain fp32, ``--fp16`` (fairseq's FP16Optimizer hands it one
flat fp32 master parameter: ``supports_flat_params``) and
``--memory-efficient-fp16`` (fp16 parameters updated in place with fp32 math:
``supports_memory_efficient_fp16``); ``supports_step_with_scale`` lets the
loss-scale division happen inside the update instead of as a separate pass.
"""
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, List

import torch.distributed as dist
from fairseq.dataclass import FairseqDataclass
from fairseq.optim import FairseqOptimizer
from omegaconf import II, OmegaConf

from ls_fairseq import ops
from ls_fairseq.ops.workspace import accumulate_in_place
from ls_fairseq.optim.workspace_adam import WorkspaceAdam


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
