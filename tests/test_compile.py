"""torch.compile of the ops, the layers, the HF drop-in and the loss: the ls_fairseq:: custom ops
(schema, fake implementations, autograd), compiled against eager (fp32 on the CPU, tight tolerances;
fp16/bf16 with the kernels on the GPU), graph breaks counted, and the eager path left as it was.
Random inputs come from the test's seed (conftest.py; a failure's report names it)."""
import importlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from ls_fairseq import ops
from ls_fairseq.layers import DecoderLayer, Embedding, EncoderLayer
from ls_fairseq.loss import LabelSmoothedCrossEntropy
from ls_fairseq.ops import dispatch

# the op modules with a compile path: each one's custom ops are <name>_forward_op and <name>_backward_op
OPS = ("layer_norm", "bias_dropout_residual", "bias_dropout_residual_layer_norm", "bias_act_dropout", "qkv", "softmax",
       "attention", "embedding", "cross_entropy")


def module(name):
    return importlib.import_module("ls_fairseq.ops." + name)


def op(name, direction):
    return getattr(module(name), "{}_{}_op".format(name, direction))


def keep(shape, p=0.25, device="cpu"):
    return (torch.rand(shape, device=device) >= p).to(torch.uint8)


def leaf(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device).requires_grad_()


def assert_within(got, want, rel, what):
    """max |got - want| <= rel x max |want| (fp32 math)."""
    diff = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    assert diff <= rel * scale + 1e-12, "{}: max |diff| {:.3g} > {:g} x max |want| {:.3g}".format(
        what, diff, rel, scale)


# ---- (a) the custom ops: schema, fake implementation and autograd (torch.library.opcheck) ----


def _opcheck_cases():
    B, T, d, H = 2, 3, 8, 2
    x, w, b = leaf(B, T, d), leaf(d), leaf(d)
    mean, rstd = op("layer_norm", "forward")(x.detach(), w.detach(), b.detach(), 1e-5)[1:]
    m = keep((B, T, d))
    yield "layer_norm_forward", op("layer_norm", "forward"), (x, w, b, 1e-5)
    yield "layer_norm_backward", op("layer_norm", "backward"), (torch.randn(B, T, d), x.detach(), w.detach(), mean,
                                                                 rstd)
    for p, mask in ((0.0, None), (0.25, m)):
        yield "bias_dropout_residual_forward p={}".format(p), op("bias_dropout_residual", "forward"), (
            leaf(B, T, d), leaf(d), leaf(B, T, d), p, mask)
        yield "bias_dropout_residual_backward p={}".format(p), op("bias_dropout_residual", "backward"), (
            torch.randn(B, T, d), mask, p)
        yield "bias_dropout_residual_layer_norm_forward p={}".format(p), op("bias_dropout_residual_layer_norm",
                                                                            "forward"), (
            leaf(B, T, d), leaf(d), leaf(B, T, d), leaf(d), leaf(d), 1e-5, p, mask)
        _, xs, mean2, rstd2 = op("bias_dropout_residual_layer_norm", "forward")(
            torch.randn(B, T, d), torch.randn(d), torch.randn(B, T, d), w.detach(), b.detach(), 1e-5, p, mask)
        yield "bias_dropout_residual_layer_norm_backward p={}".format(p), op("bias_dropout_residual_layer_norm",
                                                                             "backward"), (
            torch.randn(B, T, d), xs, w.detach(), mean2, rstd2, mask, p)
        for act in ("relu", "gelu"):
            yield "bias_act_dropout_forward {} p={}".format(act, p), op("bias_act_dropout", "forward"), (
                leaf(B, T, d), leaf(d), act, p, mask)
        yield "bias_act_dropout_backward gelu p={}".format(p), op("bias_act_dropout", "backward"), (
            torch.randn(B, T, d), torch.randn(B, T, d), torch.randn(d), mask, "gelu", p)
    yield "bias_act_dropout_backward relu from its output", op("bias_act_dropout", "backward"), (
        torch.randn(B, T, d), torch.randn(B, T, d).relu(), None, None, "relu", 0.25)
    for token_major in (False, True):
        yield "qkv_forward token_major={}".format(token_major), op("qkv", "forward"), (
            leaf(B, T, 3 * d), leaf(3 * d), H, 3, 0.5, token_major)
    yield "qkv_backward", op("qkv", "backward"), (torch.randn(3, B, H, T, d // H), 0.5)
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[1, 2:] = True
    q, k, v = leaf(B, H, T, 4), leaf(B, H, T + 1, 4), leaf(B, H, T + 1, 4)
    kpm_k = torch.zeros(B, T + 1, dtype=torch.bool)
    kpm_k[0, 3:] = True
    for p in (0.0, 0.25):
        sm = keep((B, H, T, T)) if p else None
        am = keep((B, H, T, T + 1)) if p else None
        for causal in (False, True):
            yield "softmax_forward causal={} p={}".format(causal, p), op("softmax", "forward"), (
                leaf(B, H, T, T), kpm, causal, p, sm)
            yield "attention_forward causal={} p={}".format(causal, p), op("attention", "forward"), (
                q, k, v, kpm_k, causal, p, am)
        scores = torch.randn(B, H, T, T)
        lse = op("softmax", "forward")(scores, kpm, True, 0.0, None)[1]
        yield "softmax_backward p={}".format(p), op("softmax", "backward"), (
            torch.randn(B, H, T, T), scores, lse, kpm, True, sm, p)
        lse = op("attention", "forward")(q.detach(), k.detach(), v.detach(), None, False, p, am)[1]
        yield "attention_backward p={}".format(p), op("attention", "backward"), (
            torch.randn(B, H, T, 4), q.detach(), k.detach(), v.detach(), lse, None, False, p, am)
    tokens = torch.tensor([[3, 4, 5], [6, 7, 1]])
    positions = ops.make_positions(tokens, 1)
    for learned in (False, True):
        pos = leaf(10, d) if learned else None
        for p, mask in ((0.0, None), (0.25, m)):
            yield "embedding_forward learned={} p={}".format(learned, p), op("embedding", "forward"), (
                tokens, positions, leaf(9, d), pos, 2.0, 1, p, mask, None)
            yield "embedding_backward learned={} p={}".format(learned, p), op("embedding", "backward"), (
                torch.randn(B, T, d), tokens, positions, mask, 2.0, 1, p, 9, 10 if learned else 0)
    logits, target = leaf(5, 7), torch.tensor([1, 2, 0, 6, 0])
    yield "cross_entropy_forward", op("cross_entropy", "forward"), (logits, target, 0.1, 0)
    lse = op("cross_entropy", "forward")(logits.detach(), target, 0.1, 0)[2]
    for dnll in (None, torch.randn(5)):
        yield "cross_entropy_backward dnll={}".format(dnll is not None), op("cross_entropy", "backward"), (
            torch.randn(5), dnll, logits.detach(), target, lse, 0.1, 0)


def test_every_custom_op_passes_opcheck():
    """Schema, fake implementation (against the real one's shapes, dtypes and strides), registered
    autograd and AOT dispatch of every custom op, dropout (a given keep-mask) included."""
    names = []
    for name, custom, args in _opcheck_cases():
        names.append(name)
        try:
            torch.library.opcheck(custom, args)
        except Exception as e:
            raise AssertionError("opcheck of {}: {}".format(name, e)) from e
    registered = {n for n in dir(torch.ops.ls_fairseq) if n.endswith(("_forward", "_backward"))}
    checked = {n.split()[0] for n in names}
    assert registered == checked, registered ^ checked


def test_a_forward_custom_op_with_dropout_needs_its_keep_mask():
    """Else its backward, which applies the given mask, would apply none."""
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="bias_dropout_residual_forward: dropout p = 0.1 needs its keep-mask"):
        op("bias_dropout_residual", "forward")(x, torch.zeros(8), x, 0.1, None)
    with pytest.raises(ValueError, match="attention_forward: dropout p = 0.1 needs its keep-mask"):
        q = torch.randn(1, 2, 3, 4)
        op("attention", "forward")(q, q, q, None, False, 0.1, None)


def _binding_arities():
    """{kernel name: number of parameters} of every function csrc/bindings.cpp binds (pybind11 without py::arg
    defaults: every one must be passed)."""
    import os
    import re

    path = os.path.join(os.path.dirname(module("layer_norm").__file__), "..", "csrc", "bindings.cpp")
    with open(path) as f:
        source = f.read()
    arities = {}
    for name in re.findall(r'm\.def\("(\w+)", &(\w+)', source):
        match = re.search(r"\b{}\(([^)]*)\)\s*{{".format(re.escape(name[1])), source)
        params = match.group(1)
        depth, count = 0, 1 if params.strip() else 0
        for ch in params:
            depth += ch in "<([" and 1 or ch in ">)]" and -1 or 0
            count += ch == "," and depth == 0
        arities[name[0]] = count
    return arities


def test_the_compile_path_passes_every_argument_each_kernel_binding_declares(monkeypatch):
    """On the CPU, with each route's kernels replaced by the references behind a check of the kernel's arity:
    a compiled training step (forward and backward of every custom op) calls each kernel with all its
    arguments (the GPU run found the backwards called with fewer: pybind11 rejects them). A route's kernel that
    is a Python function calling the binding (``<op>_<direction>_kernel`` in the op's module: the embedding's
    forward, which makes the sinusoid table first) is checked against its own signature."""
    import inspect

    arities = _binding_arities()
    routes = {"layer_norm": "LAYER_NORM_ROUTE", "bias_dropout_residual": "BIAS_DROPOUT_RESIDUAL_ROUTE",
              "bias_dropout_residual_layer_norm": "BIAS_DROPOUT_RESIDUAL_LAYER_NORM_ROUTE",
              "bias_act_dropout": "BIAS_ACT_DROPOUT_ROUTE", "qkv": "QKV_ROUTE", "softmax": "SOFTMAX_ROUTE",
              "embedding": "EMBEDDING_ROUTE", "cross_entropy": "CROSS_ENTROPY_ROUTE"}
    calls = []

    def strict(fn, op_name, name):
        wrapper = getattr(module(op_name), name + "_kernel", None)

        def call(*args):
            calls.append(name)
            if wrapper is not None:
                inspect.signature(wrapper).bind(*args)  # TypeError where the wrapper would reject them
            else:
                assert len(args) == arities[name], "{} called with {} arguments, the binding takes {}".format(
                    name, len(args), arities[name])
            return fn(*args)
        return call

    for op_name, route_name in routes.items():
        route = getattr(module(op_name), route_name)
        kernel = tuple(strict(fn, op_name, "{}_{}".format(op_name, d)) for fn, d in zip(route.reference,
                                                                                         ("forward", "backward")))
        monkeypatch.setattr(route, "kernel", kernel)
    # these routes pick their (strict) kernels; the fused attention kernel stays out (it has no reference pair)
    monkeypatch.setattr(dispatch, "use_kernel", lambda op, tensor: op in routes)
    model = TinyModel().train()
    loss = torch.compile(model, fullgraph=True)(*_batch())
    loss.backward()
    assert {"layer_norm_backward", "bias_dropout_residual_layer_norm_backward", "qkv_backward",
            "embedding_backward", "cross_entropy_backward"} <= set(calls), sorted(set(calls))


# ---- (e) eager calls stay on dispatch.run ----


def test_eager_calls_never_reach_the_custom_ops(monkeypatch):
    """With every custom op replaced by one that raises, eager forwards and backwards of the layers, the
    embedding and the loss (TinyModel: every op of the compile path) run as before: the custom ops are
    torch.compile's path alone."""
    def refuse(*args, **kwargs):
        raise AssertionError("an eager call reached a custom op")

    for name in OPS:
        for direction in ("forward", "backward"):
            monkeypatch.setattr(module(name), "{}_{}_op".format(name, direction), refuse)
    model = TinyModel(dropout=0.1).train()
    model(*_batch()).backward()
    assert all(p.grad is not None for p in model.parameters())
    with torch.no_grad():
        model.eval()(*_batch())


# ---- (b) eval: the layers under torch.compile(fullgraph=True) match eager ----


def _encoder_input(B=2, T=5, d=16):
    x = torch.randn(B, T, d)
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[1, T - 2:] = True
    return x, kpm


def _compare_eval(layer, args_fn, rel=1e-5):
    layer.eval()
    compiled = torch.compile(layer, fullgraph=True)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            got, want = compiled(*args_fn()), layer(*args_fn())
        assert_within(got, want, rel, "grad {}".format(grad))


@pytest.mark.parametrize("normalize_before,activation", [(False, "relu"), (True, "gelu")])
def test_encoder_layer_compiles_whole_in_eval(normalize_before, activation):
    layer = EncoderLayer(16, 4, 32, normalize_before=normalize_before, activation_fn=activation, dropout=0.1,
                         attention_dropout=0.1, activation_dropout=0.1)
    x, kpm = _encoder_input()
    _compare_eval(layer, lambda: (x, ops.AttentionMask(kpm)))


def test_encoder_layer_compiles_once_for_several_shapes_with_dynamic_shapes():
    """dynamic=True: the fake implementations take symbolic sizes; three batch shapes, no recompile."""
    from torch._dynamo.testing import CompileCounterWithBackend

    layer = EncoderLayer(16, 4, 32).eval()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    compiles = []
    with torch.no_grad():
        for B, T in ((2, 5), (3, 7), (4, 4)):
            x, kpm = _encoder_input(B, T)
            assert_within(compiled(x, ops.AttentionMask(kpm)), layer(x, ops.AttentionMask(kpm)), 1e-5, (B, T))
            compiles.append(counter.frame_count)
    assert compiles[0] == compiles[-1], compiles  # no recompile after the first shape


def test_decoder_layer_with_cross_attention_compiles_whole_in_eval():
    layer = DecoderLayer(16, 4, 32, activation_fn="gelu")
    x, _ = _encoder_input(T=4)
    enc_k, enc_v = torch.randn(2, 4, 6, 4), torch.randn(2, 4, 6, 4)
    enc_kpm = torch.zeros(2, 6, dtype=torch.bool)
    enc_kpm[0, 4:] = True
    _compare_eval(layer, lambda: (x, ops.AttentionMask(causal=True), enc_k, enc_v, ops.AttentionMask(enc_kpm)))


@pytest.mark.parametrize("learned", [False, True])
def test_embedding_compiles_whole_in_eval(learned):
    layer = Embedding(20, 16, 1, learned_positions=learned, max_positions=8, dropout=0.1)
    tokens = torch.randint(2, 20, (2, 6))
    tokens[1, 4:] = 1
    _compare_eval(layer, lambda: (tokens,))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_hf_bert_with_ls_layers_compiles_whole_in_eval(attn):
    """Hugging Face's masks of either kind reduce to a key padding mask inside the graph."""
    pytest.importorskip("transformers")
    from test_hf import batch, tiny_config
    from transformers import BertModel

    from ls_fairseq.hf import replace_bert_layers

    model = replace_bert_layers(BertModel(tiny_config(attn))).eval()
    ids, mask = batch()
    compiled = torch.compile(model, fullgraph=True)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            got = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
            want = model(input_ids=ids, attention_mask=mask).last_hidden_state
        assert_within(got, want, 1e-5, "grad {}".format(grad))


def test_hf_bert_training_step_compiled_matches_eager_without_dropout():
    pytest.importorskip("transformers")
    from test_hf import batch, tiny_config
    from transformers import BertForSequenceClassification

    from ls_fairseq.hf import replace_bert_layers

    model = replace_bert_layers(BertForSequenceClassification(tiny_config())).train()
    ids, mask = batch()
    labels = torch.tensor([0, 1, 2, 1])
    eager = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    eager.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    loss = torch.compile(model, fullgraph=True)(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    assert_within(loss, eager, 1e-5, "loss")
    assert want.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        if name in want:
            assert_within(p.grad, want[name], 1e-5, name)


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_hf_models_under_autocast_compile_whole_within_twice_hfs_error(family):
    """bf16 autocast on the CPU: the ls layers' casts and autocast switched off inside them trace into one graph,
    whose outputs and gradients keep the eager layers' 2x rule against HF (test_hf_families)."""
    pytest.importorskip("transformers")
    from test_hf_families import assert_autocast_within_twice_hfs_error

    assert_autocast_within_twice_hfs_error(family, "cpu", torch.bfloat16, compiled=True)


# ---- (d) training: forward and backward compiled against eager, graph breaks counted ----


class TinyModel(torch.nn.Module):
    """Embedding, a post-LN encoder layer, a pre-LN decoder layer with cross-attention, logits tied to the
    embedding and the fused loss: every op of the compile path in one training step."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.embed = Embedding(20, 16, 1, learned_positions=True, max_positions=8, dropout=dropout)
        self.encoder = EncoderLayer(16, 4, 32, dropout=dropout, attention_dropout=dropout,
                                    activation_dropout=dropout)
        self.kv_proj = torch.nn.Linear(16, 32)
        self.decoder = DecoderLayer(16, 4, 32, normalize_before=True, activation_fn="gelu", dropout=dropout,
                                    attention_dropout=dropout, activation_dropout=dropout)
        self.loss = LabelSmoothedCrossEntropy(1, eps=0.1)

    def forward(self, tokens, target):
        pad = ops.AttentionMask(tokens.eq(1))
        x = self.encoder(self.embed(tokens), pad)
        enc_k, enc_v = ops.split_heads(ops.linear(x, self.kv_proj.weight), self.kv_proj.bias, 4, 2)
        y = self.decoder(self.embed(target), ops.AttentionMask(causal=True), enc_k, enc_v, pad)
        loss, _ = self.loss(F.linear(y, self.embed.weight), target)
        return loss


def _batch():
    tokens, target = torch.randint(2, 20, (2, 6)), torch.randint(2, 20, (2, 5))
    tokens[1, 4:] = 1
    target[0, 3:] = 1
    return tokens, target


def test_training_step_compiled_matches_eager_without_dropout_and_has_no_graph_break():
    """dropout 0: the compiled forward's loss and every parameter's gradient match eager within 1e-5 of the
    largest; dynamo makes one graph (no hand-off needs a break: autograd adds the residual's gradient)."""
    model = TinyModel().train()
    tokens, target = _batch()
    eager_loss = model(tokens, target)
    eager_loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss = torch.compile(model, fullgraph=True)(tokens, target)
    loss.backward()
    assert_within(loss, eager_loss, 1e-5, "loss")
    for name, p in model.named_parameters():
        assert_within(p.grad, want[name], 1e-5, name)
    explained = torch._dynamo.explain(model)(tokens, target)
    assert explained.graph_break_count == 0, explained.break_reasons
    graph = "\n".join(g.code for g in explained.graphs)
    for name in ("layer_norm", "bias_dropout_residual", "bias_dropout_residual_layer_norm", "bias_act_dropout",
                 "qkv", "attention", "embedding", "cross_entropy"):
        assert "ls_fairseq.{}_forward".format(name) in graph, name


def test_training_with_dropout_compiles_and_drops_at_rate_p():
    model = TinyModel(dropout=0.1).train()
    tokens, target = _batch()
    loss = torch.compile(model, fullgraph=True)(tokens, target)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)

    def step(x, bias, residual):
        return ops.bias_dropout_residual(x, bias, residual, 0.3)

    x = torch.ones(64, 256, requires_grad=True)
    out = torch.compile(step, fullgraph=True)(x, torch.zeros(256), torch.zeros(64, 256))
    dropped = out.eq(0)
    assert abs(dropped.float().mean().item() - 0.3) < 0.02
    assert torch.equal(out[~dropped], torch.full_like(out[~dropped], 1 / 0.7))
    (dx,) = torch.autograd.grad(out.sum(), x)
    assert torch.equal(dx.eq(0), dropped)  # the backward applies the forward's keep-mask


@pytest.mark.parametrize("fullgraph", [True, False])
def test_fp8_gemms_and_packed_attention_are_refused_under_compile(fullgraph):
    """A clear error, with fullgraph or without (where dynamo would otherwise run the frame eagerly)."""
    fp8 = SimpleNamespace(active=True)
    expected = torch._dynamo.exc.Unsupported if fullgraph else NotImplementedError
    with pytest.raises(expected, match="fp8 GEMMs are not supported under torch.compile"):
        torch.compile(lambda x, w: ops.linear(x, w, fp8=fp8), fullgraph=fullgraph)(torch.randn(2, 4),
                                                                                     torch.randn(3, 4))
    offsets = torch.tensor([0, 2, 4], dtype=torch.int32)
    mask = ops.SegmentMask(offsets, offsets, 2, 2)
    q = torch.randn(1, 2, 4, 4)
    with pytest.raises(expected, match="segment_attention .* not supported under torch.compile"):
        torch.compile(lambda q: ops.attention(q, q, q, mask), fullgraph=fullgraph)(q)


# ---- (f) on the GPU, with the kernels ----


def _use_kernels(monkeypatch):
    """Count the calls of these routes' kernels (forward and backward), eager and compiled."""
    from helpers import kernel

    kernel("layer_norm", torch.empty(1, device="cuda"))
    calls = {}
    for name, route in (("layer_norm", "LAYER_NORM_ROUTE"), ("bias_act_dropout", "BIAS_ACT_DROPOUT_ROUTE"),
                        ("qkv", "QKV_ROUTE"), ("attention", "ATTENTION_ROUTE"),
                        ("bias_dropout_residual_layer_norm", "BIAS_DROPOUT_RESIDUAL_LAYER_NORM_ROUTE")):
        r = getattr(module(name), route)

        def counted(fn, key):
            def call(*args):
                calls[key] = calls.get(key, 0) + 1
                return fn(*args)
            return call

        monkeypatch.setattr(r, "kernel", (counted(r.kernel[0], name + "_forward"),
                                          counted(r.kernel[1], name + "_backward")))
    return calls


@pytest.mark.gpu
def test_gpu_every_custom_op_passes_opcheck_with_the_kernels():
    """The CPU cases on the GPU (fp32: the kernels store it): the fake implementations' shapes, dtypes and strides
    against the kernels' outputs, and the registered autograd, where a mismatch would make a compiled graph read
    the kernels' outputs with the wrong layout."""
    def cuda(a):
        return a.detach().cuda().requires_grad_(a.requires_grad) if torch.is_tensor(a) else a

    for name, custom, args in _opcheck_cases():
        try:
            torch.library.opcheck(custom, tuple(cuda(a) for a in args))
        except Exception as e:
            raise AssertionError("opcheck of {} on the GPU: {}".format(name, e)) from e


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_compiled_encoder_layer_runs_the_kernels_and_matches_eager(dtype, monkeypatch):
    """fp16/bf16 with the kernels: the compiled post-LN gelu layer's output and gradients match eager's
    (the same kernels: within a few ulps of the largest), and the custom ops' CUDA paths ran the kernels
    (the fused attention kernel too: d_head 64, 40 rows)."""
    calls = _use_kernels(monkeypatch)
    layer = EncoderLayer(256, 4, 1024, activation_fn="gelu").cuda().to(dtype).train()
    x = torch.randn(8, 40, 256, device="cuda", dtype=dtype, requires_grad=True)
    kpm = torch.zeros(8, 40, dtype=torch.bool, device="cuda")
    kpm[3, 30:] = True
    dy = torch.randn_like(x)
    out = layer(x, ops.AttentionMask(kpm))
    want = torch.autograd.grad(out, [x] + list(layer.parameters()), dy)
    eager_calls = dict(calls)
    got_out = torch.compile(layer, fullgraph=True)(x, ops.AttentionMask(kpm))
    got = torch.autograd.grad(got_out, [x] + list(layer.parameters()), dy)
    assert_within(got_out, out, 1e-2, "output")
    for g, w in zip(got, want):
        assert_within(g, w, 2e-2, "gradient")
    # a post-LN layer's LayerNorms are bias_dropout_residual_layer_norm's; no layer_norm op runs in it
    for key in ("bias_act_dropout", "qkv", "attention", "bias_dropout_residual_layer_norm"):
        for direction in ("_forward", "_backward"):
            assert calls.get(key + direction, 0) > eager_calls.get(key + direction, 0), key + direction


@pytest.mark.gpu
def test_gpu_compiled_graph_routes_each_call_at_run_time(monkeypatch):
    """The custom ops pick kernel or reference on each call (LS_FAIRSEQ_REFERENCE too): the same compiled
    graph runs the references once the variable forces them."""
    calls = _use_kernels(monkeypatch)
    layer = EncoderLayer(256, 4, 1024).cuda().half().eval()
    x = torch.randn(4, 40, 256, device="cuda", dtype=torch.float16)
    compiled = torch.compile(layer, fullgraph=True)
    with torch.no_grad():
        want = compiled(x, None)
        counted = sum(calls.values())
        assert counted > 0
        monkeypatch.setenv("LS_FAIRSEQ_REFERENCE", "all")
        assert dispatch.forced_reference("layer_norm")
        got = compiled(x, None)
    assert sum(calls.values()) == counted
    assert_within(got, want, 1e-2, "references against kernels")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_compiled_hf_bert_matches_eager_by_the_2x_rule(dtype):
    """The compiled ls BERT's error against an fp64 run is at most twice eager HF's own, as the eager ls
    BERT's is (test_hf), and twice the eager ls BERT's. The errors print (-rA shows them). No bound on
    compiled - eager beyond these: in bf16 the two differ by rounding, not exactness (H100, 2026-12-06:
    against fp64 HF 0.0655, ls eager 0.0945, ls compiled 0.0945, compiled - eager 0.078, 2.5 units in
    bf16's last place at 4.7), as Inductor rounds the HF ops around the ls layers its own way."""
    pytest.importorskip("transformers")
    from test_hf import gpu_berts

    oracle, hf, ls, ids, mask = gpu_berts(dtype)
    rows = mask.bool()
    with torch.no_grad():
        want = oracle(ids, attention_mask=mask).last_hidden_state[rows]
        err_hf = (hf(ids, attention_mask=mask).last_hidden_state[rows].double() - want).abs().max().item()
        eager = ls(ids, attention_mask=mask).last_hidden_state[rows]
        got = torch.compile(ls, fullgraph=True)(ids, attention_mask=mask).last_hidden_state[rows]
    err_ls = (got.double() - want).abs().max().item()
    err_eager = (eager.double() - want).abs().max().item()
    print("{}: error against fp64: HF {:.3g}, ls eager {:.3g}, ls compiled {:.3g}; compiled - eager {:.3g}".format(
        dtype, err_hf, err_eager, err_ls, (got.double() - eager.double()).abs().max().item()))
    assert err_ls <= 2 * err_hf + 1e-6, (err_ls, err_hf)
    assert err_ls <= 2 * err_eager + 1e-6, (err_ls, err_eager)  # no less exact than the eager ls BERT


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_compiled_dropout_kernels_apply_one_mask_in_both_directions(dtype):
    """The graph's keep-mask goes to the forward kernel as its given mask and to the backward kernel
    through _C.dropout_from_mask: an element's gradient is zero exactly where its output was dropped."""
    from helpers import kernel

    x = torch.ones(64, 1024, device="cuda", dtype=dtype, requires_grad=True)
    bias = torch.zeros(1024, device="cuda", dtype=dtype)
    kernel("bias_dropout_residual", x)
    steps = (("bias_dropout_residual", lambda x: ops.bias_dropout_residual(x, bias, torch.zeros_like(x), 0.3)),
             ("bias_act_dropout gelu", lambda x: ops.bias_act_dropout(x, bias, "gelu", 0.3)))
    for name, step in steps:
        out = torch.compile(step, fullgraph=True)(x)
        dropped = out.eq(0)
        assert abs(dropped.float().mean().item() - 0.3) < 0.02, name
        (dx,) = torch.autograd.grad(out.float().sum(), x)
        assert torch.equal(dx.eq(0), dropped), name


@pytest.mark.gpu
def test_gpu_training_with_dropout_and_kernels_compiles():
    model = TinyModel(dropout=0.1).cuda().half().train()
    tokens, target = (t.cuda() for t in _batch())
    loss = torch.compile(model, fullgraph=True)(tokens, target)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_compiled_hf_bert_under_autocast_within_twice_hfs_error(dtype):
    pytest.importorskip("transformers")
    from test_hf_families import assert_autocast_within_twice_hfs_error

    assert_autocast_within_twice_hfs_error("bert", "cuda", dtype, compiled=True)
