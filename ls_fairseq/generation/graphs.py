"""The beam search's ordinary decoding step replayed from a CUDA graph.

A decoding step launches ~430 kernels (the decoder's layers and the search's bookkeeping), and on
the H200 the host's side of them takes several times the GPU's (docs/perf-log.md): the GPU idles.
``LSSequenceGenerator`` runs its steps through ``StepGraph.run`` where a step is ordinary (past the
minimum length and the prefix, before the maximum length, without n-gram blocking): every such
step of a batch does the same work on the same tensors, reading the step from a device tensor, so
one capture serves them all.

- A key names the state the step works on (the batch, the sentences still in it, the cache's
  buffers). The first step with a new key runs eagerly on the capture stream (what the capture
  needs is then warmed up: cuBLAS's per-stream workspace, the sinusoid table of the cache's size);
  the next one is captured and replayed, and every later one with that key only replayed.
- The graphs of one generator allocate from one memory pool; only the newest is replayed, since a
  key is never seen again once it has changed. The one before it is kept until the next capture
  has ended: the caching allocator frees a pool once no graph holds it, and a capture into a
  freed pool fails (an internal assert of PyTorch's).
- Capture keeps the memory caches and tolerates other threads' CUDA calls, as the training
  step's graphs do (ls_fairseq.cuda_graphs).
"""
import torch

from ls_fairseq.cuda_graphs import on_stream


class StepGraph:
    def __init__(self):
        self.key = None
        self.graph = None
        self.previous = None  # the last graph replayed, kept for its hold on the pool
        self.pool = None
        self.stream = None
        self.captured = 0  # graphs captured so far (tests and benchmarks read it)

    def run(self, key, step):
        """Run ``step()`` (no arguments, all its tensors at fixed addresses while ``key`` stays)."""
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        if key != self.key:
            if self.graph is not None:
                self.previous = self.graph
            self.key, self.graph = key, None
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
