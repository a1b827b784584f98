"""A fairseq --user-dir for the speed benchmark that only measures:

- peak GPU memory over the whole run: fairseq resets the peak statistics every
  step, so the peak is read just before each reset and the maximum is kept;
- GPU activities per training step (kernels, memsets, copies; ``kernels_per_step``)
  and of them kernel launches: torch.profiler over a few steps of the last
  epoch, in steady state (counting kernels inside replayed CUDA graphs too);
  the profiled update numbers are recorded so that the benchmark leaves their
  log intervals out of its wps;
- GPU time per step, from the same profile, and host synchronisations per step
  (torch's sync debug mode over the same steps: each time the host waited for
  the GPU inside the step), with the Python call chain that made each;
- the GPU's idle time per step (``gpu_idle_ms_per_step``): over IDLE_STEPS
  steps just before that profile (a log interval's synchronisation among
  them), traced on the GPU alone so that the tracing adds no host time; the
  idle time is the window less the union of the GPU activities' intervals,
  and its longest gaps, with the activities either side, go to the
  .profile.txt file;
- the optimizer's GPU time per update (gradient clipping + the optimizer step,
  between CUDA events, over the same steps);
- where the time of those steps goes: the host's operators by self CPU time,
  the kernels by GPU time and by count, and the operators by input shape
  (tables written beside the JSON file, .profile.txt);
- what each epoch boundary costs (``epoch_boundaries``): on the host, from the
  end of an epoch's last step to the next epoch's begin_epoch (fairseq's
  end-of-epoch logging, which waits for the GPU, and the next iterator) and
  from there to its first step (the first batch's loading); on the GPU, the
  time between the last step's work and the first step's (CUDA events).

Results go to the JSON file named by $BENCH_HOOKS_OUT at exit (rank 0's, under
data-parallel training; the other ranks' beside it, as NAME.rankN.json). With
$BENCH_WITH_LS=1 it also loads the ls_fairseq plugin (fairseq takes one
--user-dir). With $BENCH_MEMORY_HISTORY=FILE it also records every allocation
and free with its call stack (torch.cuda.memory._record_memory_history, which
slows the run: not for timing) and writes the snapshot to FILE at exit, for
finding what is alive at the peak (scripts/memory_peak.py). Nothing
else about training changes.
"""
import atexit
import json
import os
import time
import traceback
import warnings

import torch

if os.environ.get("BENCH_WITH_LS") == "1":
    import ls_fairseq.fairseq_plugin  # noqa: F401 (registers the plugin)

from fairseq.tasks import FairseqTask  # noqa: E402
from fairseq.trainer import Trainer  # noqa: E402

PROFILE_SKIP, IDLE_STEPS, PROFILE_STEPS = 5, 25, 3  # into the last epoch: its data loader has started
_stats = {"peak_bytes": 0, "profiled_updates": []}
_reset = torch.cuda.reset_peak_memory_stats


def _record_then_reset(*args, **kwargs):
    if torch.cuda.is_available():
        _stats["peak_bytes"] = max(_stats["peak_bytes"], torch.cuda.max_memory_allocated())
    return _reset(*args, **kwargs)


torch.cuda.reset_peak_memory_stats = _record_then_reset
if os.environ.get("BENCH_MEMORY_HISTORY") and torch.cuda.is_available():
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
_train_step, _begin_epoch = Trainer.train_step, Trainer.begin_epoch
_profiler = {"prof": None, "steps": 0, "from": None}
_idle = {"prof": None, "steps": 0, "gaps": []}


_boundary = {"step_end": None, "step_event": None, "begin": None, "pending": []}


def _begin_last_epoch(self, epoch):
    if epoch == self.cfg.optimization.max_epoch:
        _profiler["from"] = self.get_num_updates() + PROFILE_SKIP + IDLE_STEPS
    _boundary["begin"] = (epoch, time.perf_counter())
    return _begin_epoch(self, epoch)


def _event():
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _timed_boundaries(step):
    """``step`` with the epoch boundaries' host and GPU times recorded around it."""
    def timed(self, samples, raise_oom=False):
        begin, cuda = _boundary["begin"], torch.cuda.is_available()
        if begin is not None and _boundary["step_end"] is not None:
            epoch, begun = begin
            _boundary["pending"].append(dict(
                epoch=epoch, end_to_begin_ms=1000 * (begun - _boundary["step_end"]),
                begin_to_first_step_ms=1000 * (time.perf_counter() - begun),
                events=(_boundary["step_event"], _event()) if cuda else None))
        _boundary["begin"] = None
        out = step(self, samples, raise_oom)
        _boundary["step_end"] = time.perf_counter()
        _boundary["step_event"] = _event() if cuda else None
        return out
    return timed


def _call_chain(limit=4):
    """The innermost frames outside torch and this module: who made the call."""
    frames = [f for f in traceback.extract_stack()[:-1]
              if "/torch/" not in f.filename and "/warnings.py" not in f.filename and f.filename != __file__]
    return " < ".join("{}:{} {}".format(os.path.basename(f.filename), f.lineno, f.name) for f in reversed(frames[-limit:]))


def _profiled_train_step(self, samples, raise_oom=False):
    _stats.setdefault("rank", self.data_parallel_rank)  # under data-parallel training only rank 0 reports
    step = self.get_num_updates()
    if step == _profiler["from"] and _profiler["prof"] is None and torch.cuda.is_available():
        torch.cuda.synchronize()
        _profiler["prof"] = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA], record_shapes=True)
        _profiler["prof"].__enter__()
    prof = _profiler["prof"]
    if prof is None or _profiler["steps"] >= PROFILE_STEPS:
        return _train_step(self, samples, raise_oom)
    syncs = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *args, **kwargs: (
            syncs.append(_call_chain()) if "synchroniz" in str(message) else None)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = _train_step(self, samples, raise_oom)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    _stats["profiled_updates"].append(step + 1)
    _stats["host_syncs_per_step"] = _stats.get("host_syncs_per_step", 0) + len(syncs) / PROFILE_STEPS
    _stats["host_sync_sites"] = sorted(set(_stats.get("host_sync_sites", [])) | set(syncs))
    _profiler["steps"] += 1
    if _profiler["steps"] == PROFILE_STEPS:
        torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        # GPU-side events, less the record_function ranges fairseq marks on the GPU timeline
        kernels = [e for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
        _stats["kernels_per_step"] = len(kernels) / PROFILE_STEPS
        # of them kernel launches: not the memsets (cuBLAS zeroes its GEMMs' workspace) and copies
        launches = [e for e in kernels if not e.name.startswith(("Memset", "Memcpy"))]
        _stats["kernel_launches_per_step"] = len(launches) / PROFILE_STEPS
        _stats["gpu_ms_per_step"] = sum(e.device_time_total for e in kernels) / PROFILE_STEPS / 1000.0
        path = _out_path(".profile.txt")
        if path:
            with open(path, "w") as f:
                f.write("GPU idle over {} steps ({:.1f} ms a step), the longest gaps (us, the activity before -> "
                        "after):\n".format(IDLE_STEPS, _stats["gpu_idle_ms_per_step"]))
                for gap, before, after in sorted(_idle["gaps"], key=lambda g: g[0], reverse=True)[:30]:
                    f.write("{:10.1f}  {} -> {}\n".format(gap, before[:70], after[:70]))
            averages = prof.key_averages()
            with open(path, "a") as f:
                for key, rows in (("self_cpu_time_total", 40), ("self_device_time_total", 40), ("count", 80)):
                    f.write(averages.table(sort_by=key, row_limit=rows, max_name_column_width=90) + "\n")
                # which tensors the small glue ops (fills, copies, adds, concatenations) work on
                by_shape = prof.key_averages(group_by_input_shape=True)
                f.write(by_shape.table(sort_by="self_device_time_total", row_limit=60, max_name_column_width=40,
                                       max_shapes_column_width=100) + "\n")
        pairs = _optimizer_spans["pairs"]
        if pairs:
            _stats["optimizer_ms_per_step"] = sum(a.elapsed_time(b) for a, b in pairs) / len(pairs)
    return out


def _idle_window(step):
    """``step`` traced on the GPU alone over IDLE_STEPS steps before the profile: the GPU's idle time."""
    def traced(self, samples, raise_oom=False):
        first = _profiler["from"] is not None and self.get_num_updates() == _profiler["from"] - IDLE_STEPS
        if first and _idle["prof"] is None and torch.cuda.is_available():
            torch.cuda.synchronize()
            _idle["prof"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            _idle["prof"].__enter__()
        if _idle["prof"] is None or _idle["steps"] >= IDLE_STEPS:
            return step(self, samples, raise_oom)
        out = step(self, samples, raise_oom)
        _stats["profiled_updates"].append(self.get_num_updates())
        _idle["steps"] += 1
        if _idle["steps"] == IDLE_STEPS:
            torch.cuda.synchronize()
            _idle["prof"].__exit__(None, None, None)
            _idle["gaps"] = _gaps([e for e in _idle["prof"].events()
                                   if e.device_type == torch.autograd.DeviceType.CUDA
                                   and not getattr(e, "is_user_annotation", False)])
            _stats["gpu_idle_ms_per_step"] = sum(g for g, _, _ in _idle["gaps"]) / IDLE_STEPS / 1000.0
        return out
    return traced


def _gaps(activities):
    """(idle us, the activity before, the one after) for each stretch with no GPU activity between
    the first activity's start and the last one's end (activities on any stream overlap)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in activities)
    gaps, end, last = [], None, None
    for start, stop, name in spans:
        if end is not None and start > end:
            gaps.append((start - end, last, name))
        if end is None or stop > end:
            end, last = stop, name
    return gaps


Trainer.train_step = _timed_boundaries(_idle_window(_profiled_train_step))
Trainer.begin_epoch = _begin_last_epoch
_clip_grad_norm, _optimizer_step = Trainer.clip_grad_norm, FairseqTask.optimizer_step
_optimizer_spans = {"start": None, "pairs": []}


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


def _out_path(ext):
    """$BENCH_HOOKS_OUT with ``ext`` for rank 0, with ``.rankN`` before it for the other data-parallel
    ranks; None in a process that did not train (fairseq's launcher of the workers)."""
    path, rank = os.environ.get("BENCH_HOOKS_OUT"), _stats.get("rank")
    if not path or rank is None:
        return None
    return os.path.splitext(path)[0] + ("" if rank == 0 else ".rank{}".format(rank)) + ext


@atexit.register
def _write():
    if torch.cuda.is_available():
        _stats["peak_bytes"] = max(_stats["peak_bytes"], torch.cuda.max_memory_allocated())
        torch.cuda.synchronize()
    _stats["epoch_boundaries"] = [
        dict({k: v for k, v in b.items() if k != "events"},
             gpu_gap_ms=b["events"][0].elapsed_time(b["events"][1]) if b["events"] else None)
        for b in _boundary["pending"]]
    path = _out_path(".json")
    if path:
        with open(path, "w") as f:
            json.dump(_stats, f)
        if os.environ.get("BENCH_MEMORY_HISTORY"):
            torch.cuda.memory._dump_snapshot(os.environ["BENCH_MEMORY_HISTORY"])
