"""The logged gpu_peak_gib (ls_fairseq/memory.py): on the CPU with a stand-in for torch's CUDA allocator
statistics, through fairseq's meters, the criterion's reduce_metrics and GraphedTrainStep's capture and
replays; on the GPU (tests/test_cli.py) against the allocator's peak measured beside the trainer."""
import pytest
import torch
from fairseq.logging import metrics
from fairseq.logging.meters import MetersDict

from ls_fairseq import cuda_graphs, memory
from ls_fairseq.criterions.ls_label_smoothed_cross_entropy import LSLabelSmoothedCrossEntropyCriterion
from ls_fairseq.fairseq_plugin import install

GIB = 2**30


class Allocator:
    """torch's caching-allocator statistics for one device: allocated bytes and their peak since the
    last reset; ``resets`` counts the resets that reached it."""

    def __init__(self):
        self.allocated = self.peak = self.resets = 0

    def alloc(self, nbytes):
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def free(self, nbytes):
        self.allocated -= nbytes

    def reset(self, device=None):
        self.resets += 1
        self.peak = self.allocated


@pytest.fixture
def allocator(monkeypatch):
    fake = Allocator()
    monkeypatch.setattr(memory, "_peak", {"bytes": 0})
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: fake.allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: fake.peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset)  # put back after the test
    install()  # the plugin's wrapper of the stand-in reset
    wrapper = torch.cuda.reset_peak_memory_stats
    install()  # a second install does not wrap the wrapper
    assert torch.cuda.reset_peak_memory_stats is wrapper and wrapper.__wrapped__ == fake.reset
    return fake


def fairseq_step(allocator, rise, keep=0):
    """One update as fairseq's trainer sees it: the step's tensors rise ``rise`` bytes above what was
    allocated and ``keep`` of them stay; the trainer reads and resets the peak (its gb_free), then
    calls the criterion's reduce_metrics, which logs gpu_peak_gib."""
    allocator.alloc(rise)
    allocator.free(rise - keep)
    torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    LSLabelSmoothedCrossEntropyCriterion.reduce_metrics([{"loss": 1.0, "nll_loss": 1.0, "ntokens": 8,
                                                          "nsentences": 2, "sample_size": 8}])


def test_the_logged_peak_is_the_intervals_largest_step_though_fairseq_resets_the_peak_every_step(allocator):
    allocator.alloc(3 * GIB)  # parameters and optimizer state
    with metrics.aggregate("test_epoch"):
        logged = []
        for rises in ((5, 2, 1), (1, 4, 2)):  # two log intervals of three steps
            with metrics.aggregate("test_interval"):
                for rise in rises:
                    fairseq_step(allocator, rise * GIB)
            logged.append(metrics.get_smoothed_values("test_interval")["gpu_peak_gib"])
            metrics.reset_meters("test_interval")
        epoch = metrics.get_smoothed_values("test_epoch")["gpu_peak_gib"]
    assert logged == [8.0, 7.0] and epoch == 8.0  # not the 3.0 GiB that stays allocated
    # a step that keeps memory: counted in the next steps' allocations, not twice
    with metrics.aggregate("test_interval"):
        fairseq_step(allocator, GIB // 2, keep=GIB // 2)
        fairseq_step(allocator, GIB // 4)
    assert metrics.get_smoothed_values("test_interval")["gpu_peak_gib"] == 3.75
    # fairseq's own meter type, so that plain fairseq loads the checkpointed meters
    saved = MetersDict()
    saved.load_state_dict(metrics.get_meters("test_interval").state_dict())
    assert saved.get_smoothed_value("gpu_peak_gib") == 3.75
    metrics.reset_meters("test_interval")


def test_take_covers_the_time_since_the_last_take_and_keeps_other_resets_peaks(allocator):
    allocator.alloc(GIB)
    allocator.free(GIB)
    torch.cuda.reset_peak_memory_stats()  # anybody's reset: the peak is kept first
    allocator.alloc(GIB // 2)
    assert memory.take() == GIB
    assert memory.take() == GIB // 2  # what is allocated now: nothing rose since the last take
    resets = allocator.resets
    memory.take()
    assert allocator.resets == resets + 1  # through torch's (wrapped) reset


def test_without_cuda_in_use_nothing_is_measured_or_logged(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert memory.take() is None
    with memory.Rise() as rise:
        pass
    assert rise.bytes == 0
    memory.replaying(GIB)
    with metrics.aggregate("test_cpu"):
        LSLabelSmoothedCrossEntropyCriterion.reduce_metrics([{"loss": 1.0, "nll_loss": 1.0, "ntokens": 8,
                                                              "nsentences": 2, "sample_size": 8}])
        assert "gpu_peak_gib" not in metrics.get_smoothed_values("test_cpu")


class Graph:
    """torch.cuda.CUDAGraph's stand-in: captures a step whose transient tensors take STEP_BYTES (as
    memory from the graph's pool, counted by the allocator during the capture alone) and keeps
    KEPT_BYTES of outputs; replays allocate nothing."""

    STEP_BYTES, KEPT_BYTES = 6 * GIB, 512
    allocator = None

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self.allocator.alloc(self.KEPT_BYTES + self.STEP_BYTES)

    def capture_end(self):
        self.allocator.free(self.STEP_BYTES)

    def pool(self):
        return "pool"

    def replay(self):
        pass


class Stream:
    def wait_stream(self, other):
        pass


class Criterion:
    def losses(self, model, sample):
        loss = sample["target"].float().sum()
        return loss, loss

    def logging_outputs(self, model, sample, loss, nll_loss):
        return sample["ntokens"], {"loss": loss, "nll_loss": nll_loss, "ntokens": sample["ntokens"],
                                   "nsentences": 2, "sample_size": sample["ntokens"]}


class Model:
    def train(self):
        pass

    def set_num_updates(self, n):
        pass


class Optimizer:
    def backward(self, loss):
        pass


def test_graph_replays_count_the_memory_their_capture_took(allocator, monkeypatch):
    import contextlib

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    Graph.allocator = allocator

    def eager_step(sample, model, criterion, optimizer, update_num, ignore_grad=False):
        allocator.alloc(Graph.STEP_BYTES)
        allocator.free(Graph.STEP_BYTES)
        return None, 8, {}

    step = cuda_graphs.GraphedTrainStep(eager_step)
    tokens = torch.ones(2, 4, dtype=torch.long)
    batch = {"net_input": {"src_tokens": tokens, "prev_output_tokens": tokens}, "target": tokens, "ntokens": 8}
    allocator.alloc(2 * GIB)  # parameters and optimizer state
    peaks = []
    for update in range(4):  # the eager warm-up, the capture, two replays
        with metrics.aggregate("test_interval"):
            step(batch, Model(), Criterion(), Optimizer(), update)
            torch.cuda.reset_peak_memory_stats()  # fairseq's, after the step
            LSLabelSmoothedCrossEntropyCriterion.reduce_metrics([{"loss": 1.0, "nll_loss": 1.0, "ntokens": 8,
                                                                  "nsentences": 2, "sample_size": 8}])
        peaks.append(metrics.get_smoothed_values("test_interval")["gpu_peak_gib"])
        metrics.reset_meters("test_interval")
    graph = next(iter(step.graphs.values()))
    assert graph.rise == Graph.STEP_BYTES  # the outputs that stay are allocated anyway: not in the rise
    assert peaks == [8.0, 8.0, 8.0, 8.0]  # the replays too, though the allocator saw nothing rise
