"""fairseq's Trainer without host synchronisation inside a training step.

``ls-fairseq-train`` runs fairseq-train with this trainer. With ls_adam it
builds ``DeviceStepAdam`` (see ls_fairseq/optim/mixed_precision.py), and removes
the three places where fairseq's trainer reads the GPU every update:
- the finiteness check of the gradient norm before the optimizer step (the
  device decides instead; the trainer's check sees a finite host placeholder);
- the cross-worker comparison of gradient norms (the one all-reduce of the
  gradient workspace leaves every worker the same gradients);
- the per-step rounding of every logged value (``_reduce_and_log_stats``):
  values stay device tensors in fairseq's meters until fairseq prints them;
- under data-parallel training, the sum of the logging outputs over workers
  (``_fast_stat_sync_sum``): fairseq copies the host's numbers to the GPU
  (a copy from pageable memory waits for the stream) and then reads the summed
  sample size back (``sample_size or 1.0``); here the host's numbers are summed
  over a CPU (gloo) group and stay on the host, the losses in one all-reduce on
  the device (``sum_over_workers``).
So the host can queue the next update while the GPU still runs this one. With
any other optimizer it is fairseq's Trainer unchanged. With ``--ls-cuda-graphs``
the task's train_step replays each batch shape's forward and backward from a
CUDA graph (ls_fairseq/cuda_graphs.py). With ``--required-seq-len-multiple``
batches are sized by their padded lengths (ls_fairseq/batching.py).

Logged per interval, as fairseq does: ``gnorm`` (mean over the steps that were
taken), ``clip`` (percentage of those that were clipped), ``loss_scale`` (fp16),
and ``skipped``: the number of steps left out because of inf/NaN gradients; the
validation lines carry validation figures only, as fairseq's do.

Checkpoints hold what fairseq's trainer writes for the same flags: the optimizer
under the name and with the state of fairseq's wrapper around ls_adam
(ls_fairseq/optim/mixed_precision.py), and fairseq's meters: the gradient-norm
sums kept on the device here are saved as fairseq's ``gnorm`` and ``clip``
averages, and read back from them (``as_fairseq_meters``, ``as_device_meters``).
So ``fairseq-train --user-dir ls_fairseq/fairseq_plugin`` and ``ls-fairseq-train`` resume each
other's checkpoints, with the update count, learning-rate schedule, Adam
moments, loss scale and the interval's and epoch's figures.
"""
from itertools import chain

import torch
import torch.distributed as dist
from fairseq.logging import metrics
from fairseq.logging.meters import MetersDict
from fairseq.optim import lr_scheduler
from fairseq.trainer import Trainer

from ls_fairseq.batching import padded_length_datasets
from ls_fairseq.cuda_graphs import GraphedTrainStep
from ls_fairseq.optim.mixed_precision import LEGACY_DDP_BACKENDS, DeviceStepAdam


def _mean_over_taken_steps(key, scale=1.0):
    def derive(meters):
        taken = meters["_steps"].sum - meters["skipped"].sum
        return round(scale * float(meters[key].sum) / float(taken), 3) if taken > 0 else 0.0

    return derive


# LSTrainer's meters of the steps' gradient norms: sums of device values (a skipped step's norm counts
# 0), which the host reads only when fairseq logs; fairseq's trainer keeps host averages instead
DEVICE_METERS = ("_steps", "skipped", "_gnorm", "_clipped")
# fairseq's trainer's averages: key -> (priority, rounding, LSTrainer's sum, scale of one step's value)
FAIRSEQ_AVERAGES = {"gnorm": (400, 3, "_gnorm", 1.0), "clip": (500, 1, "_clipped", 100.0)}


def as_fairseq_meters(meters):
    """One aggregator's saved meters (``MetersDict.state_dict()``: (priority, key, class, state)), with
    LSTrainer's gradient-norm sums as the averages fairseq's trainer keeps over the steps taken (gnorm;
    clip: 100 or 0 per step). The count of skipped steps is left out: fairseq's trainer keeps none."""
    saved = {key: state for _, key, _, state in meters}
    out = [m for m in meters if m[1] not in DEVICE_METERS]
    if "_steps" not in saved:
        return out
    taken = int(float(saved["_steps"]["sum"]) - float(saved["skipped"]["sum"] if "skipped" in saved else 0))
    for key, (priority, digits, total, scale) in FAIRSEQ_AVERAGES.items():
        if total in saved:
            value = scale * float(saved[total]["sum"])
            state = {"val": value / taken if taken else None, "sum": value, "count": taken, "round": digits}
            out.append((priority, key, "AverageMeter", state))
    return out


def as_device_meters(meters):
    """The inverse of ``as_fairseq_meters``: fairseq's trainer's gnorm and clip averages as LSTrainer's
    sums (every step they count was taken)."""
    out = [m for m in meters if not (m[1] in FAIRSEQ_AVERAGES and m[2] == "AverageMeter")]
    for _, key, cls, state in meters:
        if key in FAIRSEQ_AVERAGES and cls == "AverageMeter":
            _, _, total, scale = FAIRSEQ_AVERAGES[key]
            out.append((10, total, "SumMeter", {"sum": state["sum"] / scale, "round": None}))
            if key == "gnorm":
                out.append((10, "_steps", "SumMeter", {"sum": state["count"], "round": None}))
    return out


def sum_over_workers(data, device, group=None, host_group=None):
    """``data`` (name -> number or tensor) summed over the workers of ``group``: host numbers
    (Python numbers, tensors not on ``device``) over ``host_group`` (a CPU backend: the host waits
    only for the other workers' hosts) and returned as floats; tensors on ``device`` in one
    all-reduce over ``group``, queued on the stream and returned as float64 tensors there, which
    the host does not wait for."""
    on_host = [k for k, v in data.items() if not torch.is_tensor(v) or v.device.type != device.type]
    on_device = [k for k in data if k not in on_host]
    out = {}
    if on_host:
        buf = torch.tensor([float(data[k]) for k in on_host], dtype=torch.float64)
        dist.all_reduce(buf, group=host_group)
        out.update(zip(on_host, buf.tolist()))
    if on_device:
        buf = torch.cat([data[k].detach().reshape(-1).to(torch.float64) for k in on_device])
        dist.all_reduce(buf, group=group)
        for k, part in zip(on_device, buf.split([data[k].numel() for k in on_device])):
            out[k] = part.view_as(data[k])
    return {k: out[k] for k in data}


class LSTrainer(Trainer):
    _host_group = None  # the CPU (gloo) group of the data-parallel stat sums, made at the first one

    def __init__(self, cfg, task, *args, **kwargs):
        super().__init__(cfg, task, *args, **kwargs)
        if cfg.dataset.required_seq_len_multiple > 1 and not getattr(cfg.model, "ls_packed", False):
            task.dataset = padded_length_datasets(task.dataset, cfg.dataset.required_seq_len_multiple)

    @property
    def device_step(self):
        return isinstance(self.optimizer, DeviceStepAdam)

    def _build_optimizer(self):
        if self.cfg.optimizer._name != "ls_adam" or self.cfg.common.amp or self.is_fsdp:
            return super()._build_optimizer()
        params = [p for p in chain(self.model.parameters(), self.criterion.parameters()) if p.requires_grad]
        self._optimizer = DeviceStepAdam.build_optimizer(self.cfg, params)
        # as fairseq does: the scheduler right after the optimizer, so the initial lr is set
        self._lr_scheduler = lr_scheduler.build_lr_scheduler(self.cfg.lr_scheduler, self.optimizer)
        self._lr_scheduler.step_update(0)

    def clip_grad_norm(self, clip_norm):
        norm = super().clip_grad_norm(clip_norm)
        if not self.device_step:
            return norm
        return torch.zeros(())  # fairseq's host-side isfinite check: the device already decided

    def _check_grad_norms(self, grad_norm):
        if not self.device_step:
            super()._check_grad_norms(grad_norm)

    def train_step(self, samples, raise_oom=False):
        if getattr(self.cfg.model, "ls_cuda_graphs", False) and not isinstance(self.task.train_step, GraphedTrainStep):
            self._check_cuda_graphs()
            self.task.train_step = GraphedTrainStep(self.task.train_step)
        if self.device_step:
            # on the updates fairseq logs at, the optimizer's step reads back whether the run diverged
            # (DeviceStepAdam.check); raised inside the step, fairseq's handler saves crash.pt
            self.optimizer.check_at_step = (self.get_num_updates() + 1) % self.cfg.common.log_interval == 0
        return super().train_step(samples, raise_oom)

    def _check_cuda_graphs(self):
        """--ls-cuda-graphs captures what must stay on the device: say which option stands in the way."""
        needs = "--ls-cuda-graphs needs "
        if self.cfg.common.cpu or not torch.cuda.is_available():
            raise ValueError(needs + "a CUDA GPU")
        if not self.device_step:
            raise ValueError(needs + "--optimizer ls_adam (its loss scale and step decided on the device)")
        if not hasattr(self.criterion, "losses"):
            raise ValueError(needs + "--criterion ls_label_smoothed_cross_entropy")
        if getattr(self.criterion, "report_accuracy", False):
            raise ValueError(needs + "no --report-accuracy (it reads the counts back to the host every step)")
        if self.data_parallel_world_size > 1 and self.cfg.distributed_training.ddp_backend not in LEGACY_DDP_BACKENDS:
            raise ValueError(needs + "--ddp-backend legacy_ddp with several GPUs (one all-reduce after backward)")

    def _fast_stat_sync_sum(self, logging_outputs, *extra_stats_to_sum, ignore=False):
        """fairseq's sum of the logging outputs (and the trainer's extra numbers: sample size,
        OOMs, training time) over the data-parallel workers, through ``sum_over_workers``."""
        if not self.device_step or self.data_parallel_world_size != dist.get_world_size():
            return super()._fast_stat_sync_sum(logging_outputs, *extra_stats_to_sum, ignore=ignore)
        if self._host_group is None:
            # every worker reaches its first stat sum at the same update: the group is made collectively
            self._host_group = dist.new_group(backend="gloo")
        data = {"extra_stats_{}".format(i): stat for i, stat in enumerate(extra_stats_to_sum)}
        keys = list(logging_outputs[0]) if logging_outputs else []
        for k in keys:
            v = sum(log[k] for log in logging_outputs if k in log)
            data["logging_outputs_" + k] = (torch.zeros_like(v) if torch.is_tensor(v) else 0) if ignore else v
        data = sum_over_workers(data, self.device, group=self.data_parallel_process_group, host_group=self._host_group)
        logging_outputs = [{k: data["logging_outputs_" + k] for k in keys}] if logging_outputs else []
        return logging_outputs, [data["extra_stats_{}".format(i)] for i in range(len(extra_stats_to_sum))]

    def state_dict(self):
        state = super().state_dict()
        if self.device_step:
            saved = state["extra_state"]["metrics"]
            state["extra_state"]["metrics"] = type(saved)((name, as_fairseq_meters(m)) for name, m in saved.items())
        return state

    def load_checkpoint(self, *args, **kwargs):
        extra_state = super().load_checkpoint(*args, **kwargs)
        if extra_state is not None and self.device_step:  # the meters of fairseq's trainer as LSTrainer's
            for name in metrics.state_dict():
                meters = metrics.get_meters(name)
                if any(not isinstance(meters[k], MetersDict._DerivedMeter) for k in ("gnorm", "clip") if k in meters):
                    meters.load_state_dict(as_device_meters(meters.state_dict()))
        return extra_state

    def _reduce_and_log_stats(self, logging_outputs, sample_size, grad_norm=None):
        if not self.device_step:
            return super()._reduce_and_log_stats(logging_outputs, sample_size, grad_norm)
        if grad_norm is not None:  # a training step's (validation passes none)
            opt = self.optimizer
            metrics.log_speed("ups", 1.0, priority=100, round=2)
            metrics.log_scalar_sum("_steps", 1)
            metrics.log_scalar_sum("skipped", opt.overflow, priority=450, round=0)
            norm = torch.nan_to_num(opt.grad_norm, nan=0.0, posinf=0.0, neginf=0.0)
            metrics.log_scalar_sum("_gnorm", norm)
            metrics.log_derived("gnorm", _mean_over_taken_steps("_gnorm"), priority=FAIRSEQ_AVERAGES["gnorm"][0])
            if self.cfg.optimization.clip_norm > 0:
                metrics.log_scalar_sum("_clipped", (norm > self.cfg.optimization.clip_norm).float())
                clip = _mean_over_taken_steps("_clipped", 100.0)
                metrics.log_derived("clip", clip, priority=FAIRSEQ_AVERAGES["clip"][0])
        self.task.reduce_metrics(logging_outputs, self.get_criterion())
        return {"sample_size": sample_size}
