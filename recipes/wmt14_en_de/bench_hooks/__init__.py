"""A fairseq --user-dir for the speed benchmark that only measures:

- peak GPU memory over the whole run: fairseq resets the peak statistics every
  step, so the peak is read just before each reset and the maximum is kept;
- kernel launches per training step: torch.profiler over a few steps of the
  warm-up epoch (counting kernels inside replayed CUDA graphs too);
- GPU time per step, from the same profile, and host synchronisations per step
  (torch's sync debug mode over the same steps: each time the host waited for
  the GPU inside the step), and the source lines that made them;
- the optimizer's GPU time per update (gradient clipping + the optimizer step,
  between CUDA events, over the same steps);
- where the time of those steps goes: the host's operators by self CPU time and
  the kernels by GPU time (tables written beside the JSON file, .profile.txt).

Results go to the JSON file named by $BENCH_HOOKS_OUT at exit. With
$BENCH_WITH_LS=1 it also loads the ls_fairseq plugin (fairseq takes one
--user-dir). Nothing else about training changes.
"""
import atexit
import json
import os
import warnings

import torch

if os.environ.get("BENCH_WITH_LS") == "1":
    import ls_fairseq  # noqa: F401 (registers the plugin)

from fairseq.tasks import FairseqTask  # noqa: E402
from fairseq.trainer import Trainer  # noqa: E402

PROFILE_FROM, PROFILE_STEPS = int(os.environ.get("BENCH_PROFILE_FROM", "15")), 3
_stats = {"peak_bytes": 0}
_reset = torch.cuda.reset_peak_memory_stats


def _record_then_reset(*args, **kwargs):
    if torch.cuda.is_available():
        _stats["peak_bytes"] = max(_stats["peak_bytes"], torch.cuda.max_memory_allocated())
    return _reset(*args, **kwargs)


torch.cuda.reset_peak_memory_stats = _record_then_reset
_train_step = Trainer.train_step
_profiler = {"prof": None, "steps": 0}


def _profiled_train_step(self, samples, raise_oom=False):
    step = self.get_num_updates()
    if step == PROFILE_FROM and _profiler["prof"] is None and torch.cuda.is_available():
        torch.cuda.synchronize()
        _profiler["prof"] = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
        _profiler["prof"].__enter__()
    prof = _profiler["prof"]
    if prof is None or _profiler["steps"] >= PROFILE_STEPS:
        return _train_step(self, samples, raise_oom)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = _train_step(self, samples, raise_oom)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    _stats["host_syncs_per_step"] = _stats.get("host_syncs_per_step", 0) + len(syncs) / PROFILE_STEPS
    # where they come from: the Python line that made each synchronising call
    sites = set(_stats.get("host_sync_sites", [])) | {"{}:{}".format(w.filename, w.lineno) for w in syncs}
    _stats["host_sync_sites"] = sorted(sites)
    _profiler["steps"] += 1
    if _profiler["steps"] == PROFILE_STEPS:
        torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        # GPU-side events, less the record_function ranges fairseq marks on the GPU timeline
        kernels = [e for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
        _stats["kernels_per_step"] = len(kernels) / PROFILE_STEPS
        _stats["gpu_ms_per_step"] = sum(e.device_time_total for e in kernels) / PROFILE_STEPS / 1000.0
        path = os.environ.get("BENCH_HOOKS_OUT")
        if path:
            averages = prof.key_averages()
            with open(os.path.splitext(path)[0] + ".profile.txt", "w") as f:
                for key in ("self_cpu_time_total", "self_device_time_total"):
                    f.write(averages.table(sort_by=key, row_limit=30, max_name_column_width=90) + "\n")
        pairs = _optimizer_spans["pairs"]
        if pairs:
            _stats["optimizer_ms_per_step"] = sum(a.elapsed_time(b) for a, b in pairs) / len(pairs)
    return out


Trainer.train_step = _profiled_train_step
_clip_grad_norm, _optimizer_step = Trainer.clip_grad_norm, FairseqTask.optimizer_step
_optimizer_spans = {"start": None, "pairs": []}


def _event():
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _timing():
    return _profiler["prof"] is not None and _profiler["steps"] < PROFILE_STEPS


def _timed_clip_grad_norm(self, clip_norm):
    _optimizer_spans["start"] = _event() if _timing() else None
    return _clip_grad_norm(self, clip_norm)


def _timed_optimizer_step(self, *args, **kwargs):
    out = _optimizer_step(self, *args, **kwargs)
    if _timing() and _optimizer_spans["start"] is not None:  # an overflow skips the step: no span
        _optimizer_spans["pairs"].append((_optimizer_spans["start"], _event()))
    return out


Trainer.clip_grad_norm = _timed_clip_grad_norm
FairseqTask.optimizer_step = _timed_optimizer_step


@atexit.register
def _write():
    if torch.cuda.is_available():
        _stats["peak_bytes"] = max(_stats["peak_bytes"], torch.cuda.max_memory_allocated())
    path = os.environ.get("BENCH_HOOKS_OUT")
    if path:
        with open(path, "w") as f:
            json.dump(_stats, f)
