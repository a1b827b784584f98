"""The GPU's peak allocated memory over each log interval (the logged ``gpu_peak_gib``), kept on the
host: no host-device synchronisation.

torch's caching allocator counts its allocated bytes, and their peak, on the host. Two things hide a
training step's peak from a reading of that peak in the criterion's ``reduce_metrics``:

- fairseq's trainer reads and resets the peak after every update (for its ``gb_free``), just before
  it calls ``reduce_metrics``. The fairseq plugin (ls_fairseq.fairseq_plugin) wraps
  ``torch.cuda.reset_peak_memory_stats`` so that every reset, fairseq's included, first folds the
  peak so far into this module's (``fold_peak_before_reset``);
- a CUDA graph's replay allocates nothing: the tensors its kernels make live in the graph's private
  memory pool, allocated once, at capture (ls_fairseq/cuda_graphs.py). So a capture measures how far
  allocations rose above what stays allocated after it (``Rise``), and each replay counts the bytes
  allocated when it starts plus that rise (``replaying``).

``take()`` returns the peak since the previous take, the largest of both kinds. ``log_peak()`` logs
it, in GiB, as the maximum over each of fairseq's aggregators (the log interval, the epoch). Without
CUDA in use in this process, nothing is measured or logged.
"""
import torch

_peak = {"bytes": 0}  # the largest allocated bytes seen since the last take(), besides torch's peak


def _in_use():
    return torch.cuda.is_initialized()


def _on_current_device(device):
    if device is None:
        return True
    index = device if isinstance(device, int) else torch.device(device).index
    return index is None or index == torch.cuda.current_device()


def _fold(nbytes):
    _peak["bytes"] = max(_peak["bytes"], nbytes)


def fold_peak_before_reset(device=None):
    """Keep torch's peak so far on ``device`` here, as a reset of torch's peak statistics is about to
    clear it (what the plugin's wrapper of ``torch.cuda.reset_peak_memory_stats`` calls first)."""
    if _in_use() and _on_current_device(device):
        _fold(torch.cuda.max_memory_allocated(device))


def take():
    """The peak of allocated bytes on the current device since the previous take (None without CUDA in
    use): torch's peak since its last reset, the peaks folded at resets and those of graph replays.
    Resets torch's peak, so the next take covers what comes after this one."""
    if not _in_use():
        return None
    _fold(torch.cuda.max_memory_allocated())
    torch.cuda.reset_peak_memory_stats()
    peak, _peak["bytes"] = _peak["bytes"], 0
    return peak


class Rise:
    """``with Rise() as rise:`` measures in ``rise.bytes`` how far allocated memory rose inside the block
    above what stays allocated at its end: the memory its transient tensors took at their peak (torch's
    peak statistics are reset at the start, the peak so far kept first)."""

    def __enter__(self):
        self.bytes = 0
        if _in_use():
            _fold(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc):
        if _in_use():
            self.bytes = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        return False


def replaying(rise):
    """Count a CUDA graph replay starting now, whose capture's transient tensors took ``rise`` bytes
    (``Rise``): the replay's kernels use that memory of the graph's pool on top of what is allocated."""
    if _in_use():
        _fold(torch.cuda.memory_allocated() + rise)


def log_peak(key="gpu_peak_gib", priority=10, round=2):
    """Log ``take()`` in GiB as the maximum over each active aggregator since its last reset. fairseq's
    AverageMeter updated with weight 0 shows its latest value: given the maximum of the value it holds
    and the new one, it shows the maximum, and checkpoints keep fairseq's own meter type."""
    from fairseq.logging import meters, metrics

    peak = take()
    if peak is None:
        return
    gib = peak / 2**30
    for agg in metrics.get_active_aggregators():
        if key not in agg:
            agg.add_meter(key, meters.AverageMeter(round=round), priority)
        meter = agg[key]
        meter.update(gib if meter.val is None else max(meter.val, gib), 0)
