"""The beam search's ordinary decoding step replayed from a CUDA graph.

A decoding step launches ~430 kernels (the decoder's layers and the search's bookkeeping), and on
the H200 the host's side of them takes several times the GPU's (docs/perf-log.md): the GPU idles.
``LSSequenceGenerator`` runs its steps through ``StepGraph.run`` where a step is ordinary (past the
prefix, before the maximum length, without n-gram blocking; the first step too): every such
step of a batch does the same work on the same tensors, reading the step from a device tensor, so
one capture serves them all.

- A key names the state the step works on (the batch, the sentences still in it, the cache's
  buffers). The first step with a new key is captured and replayed, every later one only
  replayed. Only where the step's ``extent`` (the cache's capacity) is larger than any before does
  the first step run eagerly on the capture stream instead, and the next one is captured: what a
  capture must find made is then made (cuBLAS's workspace for the stream, the sinusoid table of
  that many positions), not first allocated and filled inside a capture.
- The graphs of one generator allocate from one memory pool; only the newest is replayed, since a
  key is never seen again once it has changed. The one before it is kept until the next capture
  has ended: the caching allocator frees a pool once no graph holds it, and a capture into a
  freed pool fails (an internal assert of PyTorch's).
- Capture keeps the memory caches and tolerates other threads' CUDA calls, as the training
  step's graphs do (ls_fairseq.cuda_graphs).
- A batch's tensors come from ``Buffers``: a batch with the shapes of the one before it (at batch
  size 1, every sentence of the same source length as the last) takes the same tensors, so that
  until its first growth or compaction its steps have the key of that batch's and replay its graph.
"""
import threading

import torch

from ls_fairseq.cuda_graphs import on_stream


_STREAMS = {}  # (device index, thread) -> stream
_STREAMS_LOCK = threading.Lock()


def decoding_stream(device):
    """The stream that the generators of this thread run their batches on ``device``: every stream
    that runs a cuBLAS GEMM gets its own workspace (33 MiB on an H200), which lives as long as the
    process, so the encoder, the eager steps and the captures all use this one. One per thread, so
    that no thread's work lands on a stream another thread is capturing."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, threading.get_ident())
    with _STREAMS_LOCK:
        if key not in _STREAMS:
            _STREAMS[key] = torch.cuda.Stream(device=index)
        return _STREAMS[key]


class StepGraph:
    def __init__(self):
        self.key = None
        self.graph = None
        self.previous = None  # the last graph replayed, kept for its hold on the pool
        self.pool = None
        self.stream = None  # the stream its steps run and are captured on (the generator sets it)
        self.warmed = 0  # the largest extent a step ran eagerly at
        self.captured = 0  # graphs captured so far (tests and benchmarks read it)

    def run(self, key, step, extent):
        """Run ``step()`` (no arguments, all its tensors at fixed addresses while ``key`` stays);
        ``extent``: the size its buffers are made for (see the module's docstring)."""
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        if key != self.key:
            if self.graph is not None:
                self.previous = self.graph
            self.key, self.graph = key, None
            if extent > self.warmed:
                self.warmed = extent
                with on_stream(self.stream):
                    step()
                return
        if self.graph is None:
            graph = torch.cuda.CUDAGraph()
            try:
                with on_stream(self.stream):
                    graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                    try:
                        step()
                    finally:
                        graph.capture_end()
            except RuntimeError as e:
                cause = e.__context__ or e
                raise RuntimeError("ls_fairseq: capturing a decoding step in a CUDA graph failed: {}".format(
                    cause)) from cause
            self.graph, self.previous, self.pool = graph, None, self.pool or graph.pool()
            self.captured += 1
        self.graph.replay()


class Buffers:
    """Tensors that keep their memory from one batch to the next. ``take(name, shape, dtype, device)``
    gives the tensor last taken under ``name`` when shape, dtype and device match (its values are
    the caller's to set), else a new one, kept for the next call. Nothing that a batch returns may
    come from here: the next batch overwrites it."""

    def __init__(self):
        self.kept = {}
        self.made = 0  # tensors made so far: a graph of tensors taken before a change of it is stale

    def take(self, name, shape, dtype, device):
        kept = self.kept.get(name)
        if kept is None or kept.shape != torch.Size(shape) or kept.dtype != dtype or kept.device != device:
            kept = self.kept[name] = torch.empty(shape, dtype=dtype, device=device)
            self.made += 1
        return kept

    def holding(self, name, tensor):
        """``tensor``'s values in the tensor taken under ``name`` for its shape."""
        return self.take(name, tensor.shape, tensor.dtype, tensor.device).copy_(tensor)


def new_tensor(name, shape, dtype, device):
    """``Buffers.take``'s signature for a batch whose tensors need not outlive it (no graphs)."""
    return torch.empty(shape, dtype=dtype, device=device)
