"""The training step's forward and backward replayed from CUDA graphs, one per batch shape.

On the H200 the host's side of an ls_transformer step (Python, autograd and ~800
kernel launches) takes longer than the GPU's side for transformer-big
(docs/perf-log.md), so the GPU idles. A captured
graph launches the same kernels from one call. ``ls-fairseq-train
--ls-cuda-graphs`` wraps the task's ``train_step`` in ``GraphedTrainStep``:

- the run's first batch runs eagerly on the stream the graphs are captured on,
  which warms up what every capture needs (the per-stream workspaces and handles
  of cuBLAS and cuDNN); after it, a batch shape (every tensor of ``net_input`` and
  ``target``) is captured the first time it comes and replayed from then on.
  What only a new shape needs (kernels not yet loaded, GEMM heuristics) is done
  during its capture: CUDA loads kernels inside a capture since 12.3, so no
  eager step per shape (one more host-bound step each, ~50 of them in a first
  epoch of the benchmark). With ``--required-seq-len-multiple 8`` (or more) most
  batches share a few shapes.
- The graph holds the criterion's ``losses`` (forward and loss) and the
  optimizer's ``backward``: gradients are accumulated into the gradient
  workspace at fixed addresses, dropout draws from torch's generator through
  its graph-safe state (every replay draws new masks), and the loss scale is a
  device tensor, read at replay. What fairseq needs on the host (sample size,
  logging output) comes from the criterion's ``logging_outputs`` for each batch.
- The capture tolerates other threads' CUDA calls (fairseq's data loader pins
  batches in a thread of its own) and, unlike ``torch.cuda.graph``, keeps the
  memory caches: the step's own work never synchronises.
- Every graph allocates from one shared memory pool: only one graph runs at a
  time and the tensors a graph returns stay alive, so no graph's output is
  another graph's scratch. Replays clone the two losses, which fairseq's meters
  keep until they print.
- A replay allocates nothing: the memory its kernels use was allocated in the pool
  at capture. The capture measures the memory its transient tensors took, and
  each replay reports that on top of what is allocated when it starts, for the
  logged peak memory (ls_fairseq/memory.py).
- After ``max_graphs`` shapes, new shapes run eagerly.
"""
import contextlib
import logging

import torch

from ls_fairseq import memory

logger = logging.getLogger(__name__)


def _inputs(sample):
    """(name, tensor) of every tensor a step reads: net_input's in name order, then the target."""
    named = sorted((item for item in sample["net_input"].items() if torch.is_tensor(item[1])), key=lambda i: i[0])
    return named + [("target", sample["target"])]


def _shape_key(sample):
    """Every input tensor's shape and dtype, and the host numbers of net_input (a packed batch's
    longest sentences, which the captured kernels take as arguments)."""
    numbers = tuple(sorted((k, v) for k, v in sample["net_input"].items() if isinstance(v, int)))
    return tuple((name, tuple(t.shape), t.dtype) for name, t in _inputs(sample)) + numbers


@contextlib.contextmanager
def on_stream(stream):
    """Run on ``stream``, ordered after the current stream's work and before its later work."""
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            yield
    finally:  # also after an error: the caller's later work (freeing what the stream reads) waits
        torch.cuda.current_stream().wait_stream(stream)


class _Graph:
    def __init__(self, sample, model, criterion, optimizer, pool, stream):
        # the graph's inputs: copies of this batch's tensors at fixed addresses
        self.sample = dict(sample, net_input=dict(sample["net_input"]))
        for name, t in _inputs(sample):
            (self.sample if name == "target" else self.sample["net_input"])[name] = t.clone()
        self.graph = torch.cuda.CUDAGraph()
        # torch.cuda.graph() would first synchronise and empty the device's and the pinned host
        # memory's caches, at every shape's capture: the steps after it would cudaMalloc again.
        # thread_local: fairseq's data loader pins the next batch in its own thread meanwhile
        # (cudaHostAlloc), which invalidates a capture in CUDA's default (global) mode.
        try:
            with on_stream(stream), memory.Rise() as rise:
                self.graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    loss, nll_loss = criterion.losses(model, self.sample)
                    optimizer.backward(loss)
                finally:
                    self.graph.capture_end()
        except RuntimeError as e:
            # the failing operation's error, not only the capture's end that it invalidated
            cause = e.__context__ or e
            raise RuntimeError("ls_fairseq: capturing the training step in a CUDA graph failed: {}".format(cause)) from cause
        self.loss, self.nll_loss = loss.detach(), nll_loss.detach()
        self.rise = rise.bytes

    def replay(self, sample):
        for (_, static), (_, t) in zip(_inputs(self.sample), _inputs(sample)):
            static.copy_(t)
        memory.replaying(self.rise)
        self.graph.replay()
        return self.loss.clone(), self.nll_loss.clone()


class GraphedTrainStep:
    """A drop-in for ``task.train_step`` (ls criterion, ls_adam's device step, CUDA)."""

    def __init__(self, train_step, max_graphs=256):
        self.train_step = train_step
        self.max_graphs = max_graphs
        self.graphs = {}
        self.warmed = False
        self.pool = None
        self.stream = None

    def __call__(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        key = _shape_key(sample)
        graph = self.graphs.get(key)
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        if ignore_grad or (graph is None and len(self.graphs) >= self.max_graphs):
            return self.train_step(sample, model, criterion, optimizer, update_num, ignore_grad=ignore_grad)
        if not self.warmed:
            self.warmed = True
            with on_stream(self.stream):  # the warm-up for every capture
                return self.train_step(sample, model, criterion, optimizer, update_num)
        model.train()
        model.set_num_updates(update_num)
        if graph is None:
            graph = self.graphs[key] = _Graph(sample, model, criterion, optimizer, self.pool, self.stream)
            self.pool = self.pool or graph.graph.pool()
            logger.info("ls_fairseq: CUDA graph %d captured for the batch shape %s",
                        len(self.graphs), " ".join("{}={}".format(entry[0], list(entry[1]) if len(entry) == 3
                                                                   else entry[1]) for entry in key))
        loss, nll_loss = graph.replay(sample)
        sample_size, logging_output = criterion.logging_outputs(model, sample, loss, nll_loss)
        return loss, sample_size, logging_output
