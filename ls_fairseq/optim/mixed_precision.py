"""ls_adam's mixed-precision step, decided on the device (``ls-fairseq-train``).

fairseq's FP16 wrappers decide on the host whether a step overflowed: they read
the gradient norm every step, and the trainer checks it again, so the host waits
for the GPU once per update. Here the loss scale, the overflow flag, the clip
coefficient and Adam's step count live in one device vector
(``ops.scaled_grad_norm``): a step is one reduction launch and one update launch
(``ops.adam_step`` reads the decision), and the host reads the loss scale only
when fairseq logs it.

What the trainer's precision flags mean with ls_adam here:
- ``--fp16`` / ``--bf16``: fp16/bf16 parameters and gradients in ls_adam's
  workspace and an fp32 master copy inside ls_adam (16 bytes per parameter with
  the moments; fairseq's FP16Optimizer keeps 20);
- ``--memory-efficient-fp16`` / ``--memory-efficient-bf16``: no master copy
  (12 bytes per parameter), unless ``--ls-fp32-master``;
- fp16 has fairseq's dynamic loss scale (``--fp16-init-scale``,
  ``--fp16-scale-window``, ``--threshold-loss-scale``, ``--min-loss-scale``);
  bf16 and fp32 have none.

Differences from fairseq's wrappers, all for the sake of no host sync:
- a step whose gradients are not finite leaves parameters, moments and Adam's
  step count untouched, but fairseq's update counter and learning-rate schedule
  still advance (they live on the host); the ``skipped`` column counts them.
  In bf16 and fp32, where fairseq raises FloatingPointError, it is skipped too;
- ``--min-loss-scale`` is checked whenever the trainer logs, not every step;
- in bf16 and fp32 (no loss scale), a run of ``MAX_NONFINITE_RUN`` consecutive
  updates with non-finite gradients stops training, also checked when the
  trainer logs (the device keeps the longest run since the last check). Both
  stops raise FloatingPointError inside the optimizer step, where fairseq's
  trainer saves ``crash.pt`` (the parameters and moments of the last finite
  step: skipped steps change neither) and reruns the step to name the module
  where a NaN first appears;
- ``--fp16-scale-tolerance`` is not supported (it must stay 0, fairseq's default).

Checkpoints are those of ``fairseq-train --user-dir ls_fairseq/fairseq_plugin`` for the same
flags: the optimizer's recorded name is that of the fairseq optimizer around
ls_adam (``LSAdam`` in fp32, ``FP16Optimizer`` for --fp16/--bf16,
``MemoryEfficientFP16Optimizer`` for the memory-efficient flags), and its state
is ls_adam's there: with ``loss_scale`` in fp16, and under --fp16 in the layout
of fairseq's one flat fp32 parameter (unless --fp16-no-flatten-grads). The fp32
master copy is saved too (fairseq's FP16Optimizer saves none and rebuilds it from
the model; so does DeviceStepAdam when a checkpoint has none), and ls_adam under
FP16Optimizer resumes from it. So either entry point resumes the other's
checkpoints with the update count, learning-rate schedule, moments and loss scale.
"""
import torch
from fairseq.optim import FairseqOptimizer

from ls_fairseq import ops
from ls_fairseq.ops.adam import GRAD_NORM, GRAD_SCALE, GOOD_STEPS, LOSS_SCALE, OVERFLOW, STEP
from ls_fairseq.optim.ls_adam import LSAdam

# bf16/fp32: this many consecutive updates with inf/NaN gradients (all skipped) end the run
MAX_NONFINITE_RUN = 10

# fairseq's names for its legacy data-parallel wrapper: no autograd hooks, the optimizer's all-reduce after backward
LEGACY_DDP_BACKENDS = ("legacy_ddp", "no_c10d")


class DeviceLossScaler:
    """The loss scale as the trainer sees it (``optimizer.scaler.loss_scale``): a device scalar."""

    def __init__(self, state, scale_window, scale_floor, min_loss_scale):
        self.state = state
        self.scale_window = scale_window
        self.scale_floor = scale_floor
        self.min_loss_scale = min_loss_scale

    @property
    def loss_scale(self):
        return self.state[LOSS_SCALE]

    def check(self):
        """fairseq's end of training when the scale collapses (reads the device: call when logging)."""
        scale = self.state[LOSS_SCALE].item()
        if scale <= self.min_loss_scale:
            raise FloatingPointError(
                "Minimum loss scale reached ({}). Your loss is probably exploding. Try lowering the "
                "learning rate, using gradient clipping or increasing the batch size.".format(self.min_loss_scale)
            )


class DeviceStepAdam(FairseqOptimizer):
    """ls_adam whose loss scaling, clipping and overflow skipping happen on the device.

    ``flat_state``: the state is written in the layout of ls_adam under fairseq's FP16Optimizer,
    which hands it the parameters as one flat fp32 parameter (--fp16)."""

    def __init__(self, cfg, adam: LSAdam, scaler_args=None, flat_state=False):
        super().__init__(cfg)
        self.adam = adam
        self._optimizer = adam.optimizer
        self.flat_state = flat_state
        device = adam.workspace.grad.device
        self.state = ops.new_scaler_state(scaler_args["init_scale"] if scaler_args else 1.0, device)
        self.scaler = None
        if scaler_args:
            self.scaler = DeviceLossScaler(
                self.state, scaler_args["scale_window"], scaler_args["scale_floor"], scaler_args["min_loss_scale"]
            )
        self.factor = 1.0
        self.reduced = False
        self.nonfinite_run = torch.zeros(2, device=device)  # [the current run, the longest since the last check]
        self.check_at_step = False  # set by the trainer on the updates it logs at

    @classmethod
    def build_optimizer(cls, cfg, params):
        """From fairseq's whole config: the precision flags decide master weights and loss scaling."""
        common = cfg.common
        memory_efficient = common.memory_efficient_fp16 or common.memory_efficient_bf16
        fp32_master = cfg.optimizer.ls_fp32_master or ((common.fp16 or common.bf16) and not memory_efficient)
        # fairseq's legacy wrapper watches no gradient (ls_adam all-reduces its workspace after backward): the
        # ops may accumulate in place also under data-parallel training (torch's DistributedDataParallel needs
        # autograd's own accumulation, which LSAdam leaves it whenever torch.distributed is initialised)
        legacy = cfg.distributed_training.ddp_backend in LEGACY_DDP_BACKENDS
        adam = LSAdam(cfg.optimizer, params, fp32_master=fp32_master, grad_hooks=False if legacy else None)
        named = NAMED_AS_FAIRSEQ[fairseq_optimizer_name(common)]
        if not common.fp16:
            return named(cfg.optimizer, adam)
        if common.fp16_scale_tolerance:
            raise ValueError("ls-fairseq-train's device loss scaler needs --fp16-scale-tolerance 0 (fairseq's default)")
        scale_window = common.fp16_scale_window
        if scale_window is None:  # fairseq's default for its own scaler
            data_parallel = int(cfg.distributed_training.distributed_world_size / common.model_parallel_size)
            scale_window = int(2**14 / data_parallel / cfg.optimization.update_freq[0])
        return named(
            cfg.optimizer,
            adam,
            dict(
                init_scale=common.fp16_init_scale,
                scale_window=scale_window,
                scale_floor=common.threshold_loss_scale or 0.0,
                min_loss_scale=common.min_loss_scale,
            ),
            flat_state=not memory_efficient and not common.fp16_no_flatten_grads,
        )

    @property
    def workspace(self):
        return self.adam.workspace

    @property
    def grad_norm(self):
        return self.state[GRAD_NORM]

    @property
    def overflow(self):
        return self.state[OVERFLOW]

    def backward(self, loss):
        if self.scaler is not None:
            loss = loss * self.state[LOSS_SCALE]
        loss.backward()

    def multiply_grads(self, c):
        self.factor *= c  # applied inside the update

    def clip_grad_norm(self, max_norm, aggregate_norm_fn=None):
        if aggregate_norm_fn is not None:
            raise NotImplementedError("ls_adam's device step does not support sharded (FSDP) gradient norms")
        ops.scaled_grad_norm(
            self.workspace.grad,
            self.state,
            factor=self.factor,
            max_norm=max_norm,
            scale_window=self.scaler.scale_window if self.scaler else 0,
            scale_floor=self.scaler.scale_floor if self.scaler else 0.0,
        )
        self.reduced = True
        return self.grad_norm

    def step(self, closure=None, scale=1.0, groups=None):
        if not self.reduced:
            self.clip_grad_norm(0.0)
        slot = lambda i: self.state[i : i + 1]  # noqa: E731
        self._optimizer.step(closure, device_decision=(slot(GRAD_SCALE), slot(STEP), slot(OVERFLOW)))
        self.factor = 1.0
        self.reduced = False
        if self.scaler is None:
            run, overflow = self.nonfinite_run[:1], slot(OVERFLOW)
            torch.addcmul(overflow, run, overflow, out=run)  # (run + 1) * overflow: 0 after a finite update
            torch.maximum(self.nonfinite_run[1:], run, out=self.nonfinite_run[1:])
        if self.check_at_step:
            self.check()

    def check(self):
        """Stop a diverged run (reads the device: the trainer has it called when it logs): fp16 at
        ``--min-loss-scale``, bf16/fp32 after ``MAX_NONFINITE_RUN`` consecutive non-finite updates."""
        if self.scaler is not None:
            return self.scaler.check()
        longest = int(self.nonfinite_run[1].item())
        self.nonfinite_run[1] = self.nonfinite_run[0]
        if longest >= MAX_NONFINITE_RUN:
            raise FloatingPointError(
                "{} consecutive updates had inf/NaN gradients (the limit is {}); each was skipped, so the parameters "
                "are those of the last finite update. Your loss is probably exploding: try a lower learning rate, "
                "gradient clipping or checking the data.".format(longest, MAX_NONFINITE_RUN)
            )

    def zero_grad(self):
        self.adam.zero_grad()
        self.factor = 1.0
        self.reduced = False

    def all_reduce_grads(self, module):
        # the sum over workers; the average's 1 / workers joins the factor the update applies (a
        # pass over the whole workspace less than dividing first; an fp16 sum that overflows is
        # a skipped step and a lower loss scale, as any overflow is)
        self.factor /= self.adam.sum_grads_over_workers()

    def state_dict(self):
        """What ls_adam under fairseq's wrapper for the same flags writes: ls_adam's state (here with the
        fp32 master copy, which fairseq's FP16Optimizer does not save and rebuilds from the model) and,
        with a loss scale, ``loss_scale``; and ``good_steps``, the steps since the scale last changed,
        which fairseq's scaler does not save (it counts anew after a resume) and its readers ignore."""
        self._optimizer.num_steps = int(self.state[STEP].item())
        state_dict = self._optimizer.state_dict(flat=self.flat_state)
        if self.scaler is not None:
            state_dict["loss_scale"] = self.state[LOSS_SCALE].item()
            state_dict["good_steps"] = self.state[GOOD_STEPS].item()
        return state_dict

    def load_state_dict(self, state_dict, optimizer_overrides=None):
        """Reads what ``state_dict`` writes and what ls_adam under fairseq's wrappers writes."""
        state_dict = dict(state_dict)
        loss_scale = state_dict.pop("loss_scale", None)
        good_steps = state_dict.pop("good_steps", 0.0)
        super().load_state_dict(state_dict, optimizer_overrides)
        self.state[STEP] = self._optimizer.num_steps
        if self.scaler is not None and loss_scale is not None:
            self.state[LOSS_SCALE] = loss_scale
            self.state[GOOD_STEPS] = good_steps


def fairseq_optimizer_name(common):
    """The class name of the optimizer that fairseq's trainer builds around ls_adam for the precision
    flags of ``common`` (its checkpoints record it; a resume needs the same name)."""
    if common.fp16 or common.bf16:
        if common.memory_efficient_fp16 or common.memory_efficient_bf16:
            return "MemoryEfficientFP16Optimizer"
        return "FP16Optimizer"
    return "LSAdam"


# fairseq's trainer records an optimizer by its class name (``optimizer_history``) and resumes a
# checkpoint only under an optimizer of the same name. DeviceStepAdam, under each precision flag, takes
# the name of the optimizer that fairseq-train builds for that flag around ls_adam and writes that
# one's state, so that fairseq-train --user-dir ls_fairseq/fairseq_plugin and ls-fairseq-train resume each other.
NAMED_AS_FAIRSEQ = {
    name: type(name, (DeviceStepAdam,), {"__doc__": "DeviceStepAdam, named as fairseq-train's " + name})
    for name in ("LSAdam", "FP16Optimizer", "MemoryEfficientFP16Optimizer")
}
