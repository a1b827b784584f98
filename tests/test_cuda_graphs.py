"""GraphedTrainStep's bookkeeping on the CPU, with a stand-in for torch's CUDA graphs (the replayed
computation itself is compared with eager steps on the GPU in tests/test_cli.py), and on the GPU each
dropout op replayed from a graph against its eager bits."""
import contextlib

import pytest
import torch

from ls_fairseq import cuda_graphs, ops
from ls_fairseq.cuda_graphs import GraphedTrainStep


class FakeGraph:
    captured = 0

    def __init__(self):
        self.replays = 0
        self.capturing = False

    def capture_begin(self, pool=None, capture_error_mode="global"):
        assert not self.capturing
        self.capturing, self.pool_given, self.mode_given = True, pool, capture_error_mode
        self.stream_given = torch.cuda.current_stream()

    def capture_end(self):
        assert self.capturing
        self.capturing = False
        FakeGraph.captured += 1

    def pool(self):
        return "pool"

    def replay(self):
        self.replays += 1


class FakeStream:
    current = None

    def wait_stream(self, other):
        pass


@contextlib.contextmanager
def fake_stream_context(stream):
    before, FakeStream.current = FakeStream.current, stream
    yield
    FakeStream.current = before


class Criterion:
    def losses(self, model, sample):
        loss = sample["target"].float().sum()
        return loss, loss / 2

    def logging_outputs(self, model, sample, loss, nll_loss):
        return sample["ntokens"], {"loss": loss, "nll_loss": nll_loss, "ntokens": sample["ntokens"]}


class Model:
    def train(self):
        pass

    def set_num_updates(self, n):
        self.updates = n


class Optimizer:
    def __init__(self):
        self.backwards = 0

    def backward(self, loss):
        self.backwards += 1


def sample(B, T, fill):
    tokens = torch.full((B, T), fill)
    return {"net_input": {"src_tokens": tokens, "src_lengths": torch.full((B,), T), "prev_output_tokens": tokens},
            "target": tokens.clone(), "ntokens": B * T + fill}


@pytest.fixture
def graphed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: FakeStream.current)
    monkeypatch.setattr(torch.cuda, "stream", fake_stream_context)
    FakeStream.current = FakeStream()
    FakeGraph.captured = 0
    eager = []

    def train_step(sample, model, criterion, optimizer, update_num, ignore_grad=False):
        eager.append(sample["ntokens"])
        return None, sample["ntokens"], {"eager": True, "stream": torch.cuda.current_stream()}

    return GraphedTrainStep(train_step, max_graphs=2), eager


def test_the_first_batch_eager_then_each_shape_captured_at_first_sight_and_replayed(graphed):
    step, eager = graphed
    model, criterion, optimizer = Model(), Criterion(), Optimizer()
    default = torch.cuda.current_stream()
    _, _, log = step(sample(2, 3, 1), model, criterion, optimizer, 0)
    assert eager == [7] and FakeGraph.captured == 0
    # the run's warm-up ran on the stream the captures will use, and the caller's stream is back
    assert log["stream"] is step.stream and log["stream"] is not default and torch.cuda.current_stream() is default
    loss, size, log = step(sample(2, 3, 2), model, criterion, optimizer, 1)
    assert FakeGraph.captured == 1 and optimizer.backwards == 1 and model.updates == 1
    assert size == 8 and log["ntokens"] == 8 and "eager" not in log
    # a new shape: captured at once, no eager step of its own
    step(sample(4, 3, 0), model, criterion, optimizer, 2)
    assert FakeGraph.captured == 2 and eager == [7]
    loss, size, log = step(sample(2, 3, 5), model, criterion, optimizer, 3)
    graph = step.graphs[cuda_graphs._shape_key(sample(2, 3, 0))]
    assert FakeGraph.captured == 2 and graph.graph.replays == 2 and optimizer.backwards == 2
    # the graph reads the latest batch from its fixed input tensors; host values come from that batch
    assert torch.equal(graph.sample["target"], sample(2, 3, 5)["target"]) and size == 11
    # a replay's losses are copies: fairseq's meters keep them while the next replay runs
    assert loss is not graph.loss and torch.equal(loss, graph.loss)


def test_other_shapes_ignored_gradients_and_the_cap(graphed):
    step, eager = graphed
    args = (Model(), Criterion(), Optimizer())
    for shape in ((2, 3), (2, 3), (4, 3), (4, 3), (2, 5), (2, 5)):
        step(sample(*shape, 0), *args, 0)
    assert len(step.graphs) == 2 and FakeGraph.captured == 2  # (2, 5) is past max_graphs: eager both times
    assert len(eager) == 3  # the run's first batch, and (2, 5) twice
    step(sample(2, 3, 0), *args, 0, ignore_grad=True)  # a dummy batch (loss x 0): eager
    assert len(eager) == 4
    assert all(g.graph.pool_given == (None if i == 0 else "pool") for i, g in enumerate(step.graphs.values()))
    # every capture on the one stream the run's first batch warmed up, blind to other threads' CUDA calls
    assert all(g.graph.stream_given is step.stream for g in step.graphs.values()) and step.stream is not None
    assert all(g.graph.mode_given == "thread_local" for g in step.graphs.values())


def test_a_failed_capture_ends_the_capture_and_names_the_operation_that_failed(graphed, monkeypatch):
    step, _ = graphed

    class Failing(Criterion):
        def losses(self, model, sample):
            raise RuntimeError("operation not permitted when stream is capturing")

    def invalidated_end(graph):
        graph.capturing = False
        raise RuntimeError("operation failed due to a previous error during capture")

    monkeypatch.setattr(FakeGraph, "capture_end", invalidated_end)
    args = (Model(), Failing(), Optimizer())
    step(sample(2, 3, 0), *args, 0)
    with pytest.raises(RuntimeError, match="capturing the training step in a CUDA graph failed: operation not permitted"):
        step(sample(2, 3, 0), *args, 1)


def _dropout_ops():
    """op -> (the input whose gradient is checked, the op as a function of it), dropout 0.3, fp16 on the GPU."""
    dev, dt = "cuda", torch.float16

    def rand(*shape, grad=False):
        return torch.randn(*shape, device=dev).to(dt).requires_grad_(grad)

    b, r, w, lb = rand(512), rand(64, 512), rand(512), rand(512)
    tokens = torch.randint(4, 100, (4, 16), device=dev)
    tokens[0, -3:] = 1
    positions = ops.make_positions(tokens, 1)
    return {
        "softmax": (rand(2, 4, 16, 16, grad=True), lambda t: ops.softmax(t, None, True, 0.3)),
        "bias_dropout_residual": (rand(64, 512, grad=True), lambda t: ops.bias_dropout_residual(t, b, r, 0.3)),
        "bias_act_dropout": (rand(64, 512, grad=True), lambda t: ops.bias_act_dropout(t, b, "gelu", 0.3)),
        # hidden 512 in fp16: LayerNorm's strip kernel, which draws the keep-bits for the bias's gradient
        "bias_dropout_residual_layer_norm": (rand(64, 512, grad=True),
                                             lambda t: ops.bias_dropout_residual_layer_norm(t, b, r, w, lb, 0.3)),
        "embedding": (rand(100, 512, grad=True), lambda t: ops.embedding(tokens, positions, t, None, 22.6, 1, 0.3)),
    }


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["softmax", "bias_dropout_residual", "bias_act_dropout",
                                "bias_dropout_residual_layer_norm", "embedding"])
def test_dropout_ops_replay_their_eager_bits(op):
    """Forward and backward captured in a CUDA graph draw the keep-bits at replay from the generator's
    graph-safe Philox state, the backward again from the forward's: a replay after reseeding gives the
    eager call's output and gradient bit for bit, and the next replay other masks."""
    from helpers import kernel

    x, fn = _dropout_ops()[op]
    kernel(op, x)
    up = torch.randn_like(fn(x))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up away from the default stream, as capture wants
        for _ in range(2):
            x.grad = None
            fn(x).backward(up)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.manual_seed(11)
    x.grad = None
    eager = fn(x)
    eager.backward(up)
    eager, eager_grad = eager.detach().clone(), x.grad.clone()
    graph = torch.cuda.CUDAGraph()
    x.grad = None
    with torch.cuda.graph(graph):
        out = fn(x)
        out.backward(up)
    torch.cuda.manual_seed(11)
    graph.replay()
    assert torch.equal(out, eager), "the replayed forward differs from the eager one"
    assert torch.equal(x.grad, eager_grad), "the replayed backward differs from the eager one"
    graph.replay()
    assert not torch.equal(out, eager), "a second replay must draw other masks"
