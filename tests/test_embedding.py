import pytest
import torch
from fairseq import utils
from fairseq.modules import PositionalEmbedding
from helpers import DTYPES, assert_close, check_kernel, drawn, grads, keep_mask, kernel, poison

from ls_fairseq import ops
from ls_fairseq.ops.embedding import (
    embedding_backward_reference,
    embedding_forward_kernel,
    embedding_forward_reference,
)

PAD = 1


def tokens_with_padding(B, T, V, left_pad):
    tokens = torch.randint(PAD + 1, V, (B, T))
    for b in range(1, B):
        n = min(T - 1, 2 * b)
        if left_pad:
            tokens[b, :n] = PAD
        else:
            tokens[b, T - n :] = PAD
    return tokens


@pytest.mark.parametrize("learned", [False, True])
@pytest.mark.parametrize("left_pad", [False, True])
@pytest.mark.parametrize("B,T,V,D", [(1, 1, 5, 4), (3, 7, 11, 8), (2, 33, 50, 15)])
def test_matches_fairseq_modules(learned, left_pad, B, T, V, D):
    tokens = tokens_with_padding(B, T, V, left_pad)
    table = torch.nn.Embedding(V, D, padding_idx=PAD).double()
    pos = PositionalEmbedding(64, D, PAD, learned=learned).double()
    scale = D**0.5
    positions = ops.make_positions(tokens, PAD)
    assert torch.equal(positions, utils.make_positions(tokens, PAD))
    out = ops.embedding(tokens, positions, table.weight, pos.weight if learned else None, scale, PAD)
    ref = (scale * table(tokens) + pos(tokens)).masked_fill(tokens.eq(PAD).unsqueeze(-1), 0)
    assert_close(out, ref, rtol=1e-6, atol=1e-6, what="embedding")  # fairseq's sinusoids are fp32
    params = [table.weight] + ([pos.weight] if learned else [])
    dout = torch.randn_like(out)
    ours = grads(out, params, dout)
    for g, r in zip(ours, grads(ref, params, dout)):
        assert_close(g, r, what="table gradient")
    assert torch.equal(ours[0][PAD], torch.zeros(D, dtype=torch.float64))


def test_dropout_uses_the_given_mask():
    tokens = tokens_with_padding(2, 5, 9, True)
    w = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    positions = ops.make_positions(tokens, PAD)
    mask = keep_mask((2, 5, 6), 0.3)
    out = ops.embedding(tokens, positions, w, None, 2.0, PAD, 0.3, True, mask)
    plain = ops.embedding(tokens, positions, w, None, 2.0, PAD)
    assert_close(out, plain * mask.double() / 0.7)
    dout = torch.randn_like(out)
    assert_close(grads(out, w, dout)[0], grads(plain, w, dout * mask.double() / 0.7)[0])


def test_gradcheck_learned():
    tokens = tokens_with_padding(2, 4, 7, False)
    w = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    pw = torch.randn(10, 3, dtype=torch.float64, requires_grad=True)
    pos = ops.make_positions(tokens, PAD)
    assert torch.autograd.gradcheck(lambda w, pw: ops.embedding(tokens, pos, w, pw, 1.5, PAD), (w, pw))


def test_too_long_for_learned_positions_is_an_error():
    tokens = torch.full((1, 9), 4)
    with pytest.raises(ValueError, match="max-source-positions"):
        ops.embedding(tokens, ops.make_positions(tokens, PAD), torch.randn(5, 2), torch.randn(8, 2), 1.0, PAD)


def stand_in_kernel(rows_seen):
    """A CPU stand-in for ``_C`` whose embedding_forward looks the positions up in the table it is given
    (an IndexError when the table is too short, where the kernel would read past it)."""
    import types

    def forward(tokens, positions, weight, pos_weight, scale, padding_idx, p, mask):
        rows_seen.append(pos_weight.shape[0])
        x = (weight[tokens].double() * scale + pos_weight[positions].double()).to(weight.dtype)
        return x.masked_fill(tokens.eq(padding_idx).unsqueeze(-1), 0.0), None

    return types.SimpleNamespace(embedding_forward=forward)


@pytest.fixture
def kernel_path_on_cpu(monkeypatch):
    """The embedding's kernel path on the CPU, through the stand-in: the rows of each sinusoid table it got."""
    import importlib

    from ls_fairseq.ops import dispatch

    embedding = importlib.import_module("ls_fairseq.ops.embedding")  # the module (ops.embedding is the function)
    rows = []
    monkeypatch.setattr(embedding, "_C", stand_in_kernel(rows))
    monkeypatch.setattr(embedding, "_sinusoid_tables", {})
    monkeypatch.setattr(embedding.EMBEDDING_ROUTE, "kernel",
                        (embedding.embedding_forward_kernel, embedding.embedding_backward_reference))
    use_kernel = dispatch.use_kernel
    monkeypatch.setattr(dispatch, "use_kernel", lambda op, t: op == "embedding" or use_kernel(op, t))
    return rows


def test_sinusoid_table_has_a_row_for_every_position_of_incremental_decoding(kernel_path_on_cpu):
    """One token at position padding_idx + 1 + step (incremental decoding: T = 1) far beyond the
    table's first 1024 rows: the kernel path's table is sized from the positions' bound, not the length."""
    V, D, step = 11, 8, 1500
    w = torch.randn(V, D, dtype=torch.float64)
    tokens = torch.randint(PAD + 1, V, (3, 1))
    positions = torch.full_like(tokens, PAD + 1 + step)
    out = ops.embedding(tokens, positions, w, None, D**0.5, PAD, max_position=PAD + 1 + step)
    assert kernel_path_on_cpu and kernel_path_on_cpu[-1] > PAD + 1 + step
    ref, _ = embedding_forward_reference(tokens, positions, w, None, D**0.5, PAD, 0.0, None)
    assert_close(out, ref, rtol=1e-6, atol=1e-6, what="embedding at step 1500")
    # without the bound the kernel path sizes the table for make_positions' positions of T tokens
    tokens = tokens_with_padding(2, 5, V, left_pad=True)
    ops.embedding(tokens, ops.make_positions(tokens, PAD), w, None, D**0.5, PAD)
    with pytest.raises(ValueError, match="length 1501 exceeds the learned position table"):
        ops.embedding(tokens[:1, :1], positions[:1], w, torch.randn(1026, D), 1.0, PAD, max_position=PAD + 1 + step)


def test_decoder_steps_beyond_1024_positions_read_inside_the_sinusoid_table(kernel_path_on_cpu):
    """ls_transformer's incremental paths (fairseq's, and decode_step of ls_fairseq.generation) give the
    embedding the bound of the position they decode."""
    import sys

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from model_utils import build_pair

    from ls_fairseq.generation.cache import DecoderCache

    _, model, task = build_pair(max_target_positions=2048, decoder_layers=1, encoder_layers=1)
    model.eval()
    d = task.source_dictionary
    src = torch.randint(d.nspecial, len(d), (2, 6))
    src[:, -1] = d.eos()
    encoder_out = model.encoder(src, src.ne(d.pad()).sum(1))
    prev = torch.randint(d.nspecial, len(d), (2, 1500))
    with torch.no_grad():
        logits, _ = model.decoder(prev, encoder_out, incremental_state={})
        assert kernel_path_on_cpu[-1] > PAD + 1500
        cache = DecoderCache(model.decoder, encoder_out, 1, 2048)
        cache.prepare(1499)
        cache.begin_step(torch.tensor(1499), 1500)
        step_logits = model.decoder.decode_step(prev[:, -1:], cache)
    assert kernel_path_on_cpu[-1] > PAD + 1500
    # the step's cache holds no earlier steps (uninitialised rows), so only its shape is checked here
    assert torch.isfinite(logits).all() and step_logits.shape[0] == 2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_sinusoids_at_positions_beyond_the_first_table(dtype):
    """The kernel at single tokens far past 1024 positions (incremental decoding): the values of
    fairseq's sinusoids there, not of rows past the end of a 1024-row table."""
    import importlib

    importlib.import_module("ls_fairseq.ops.embedding")._sinusoid_tables.clear()
    V, D = 50, 512
    w = torch.randn(V, D, device="cuda").to(dtype)
    kernel("embedding", w)
    for step in (3, 1500, 5000):
        tokens = torch.randint(PAD + 1, V, (8, 1), device="cuda")
        positions = torch.full_like(tokens, PAD + 1 + step)
        out = ops.embedding(tokens, positions, w, None, D**0.5, PAD, training=False, max_position=PAD + 1 + step)
        out64, _ = embedding_forward_reference(tokens, positions, w.double(), None, D**0.5, PAD, 0.0, None)
        out_l, _ = embedding_forward_reference(tokens, positions, w, None, D**0.5, PAD, 0.0, None)
        check_kernel(out, out64, out_l, "out at step {}".format(step))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("learned", [False, True])
# tokens: up to 12,288 the rank sort orders the ids (slices of 256: 1, 200 and 231 fill part of one; 12,288 the
# most), more go to cub's device-wide sort (12,800)
@pytest.mark.parametrize("B,T,D,p", [(1, 1, 512, 0.0), (5, 40, 200, 0.1), (7, 33, 1030, 0.1), (64, 128, 1024, 0.1),
                                     (72, 128, 64, 0.1), (96, 128, 64, 0.1), (100, 128, 64, 0.1)])
def test_kernel_matches_reference(dtype, learned, B, T, D, p):
    V = 32003
    tokens = tokens_with_padding(B, T, V, left_pad=True).cuda()
    tokens[0, -1] = 5
    tokens[:, T // 2] = 7  # a frequent token: a long run in the sorted backward
    positions = ops.make_positions(tokens, PAD)
    w = torch.randn(V, D, device="cuda").to(dtype)
    pw = torch.randn(T + PAD + 1, D, device="cuda").to(dtype) if learned else None
    dout = torch.randn(B, T, D, device="cuda").to(dtype)
    ext = kernel("embedding", w)
    poison()
    out, dropout = embedding_forward_kernel(tokens, positions, w, pw, D**0.5, PAD, p, None)
    mask = drawn(dropout)  # the forward's keep-bits, which the backward draws again
    poison()
    dw, dpw = ext.embedding_backward(dout, tokens, positions, dropout, D**0.5, PAD, p, V, pw.shape[0] if learned else 0, None, None)
    dw2, _ = ext.embedding_backward(dout, tokens, positions, dropout, D**0.5, PAD, p, V, pw.shape[0] if learned else 0, None, None)
    assert torch.equal(dw, dw2), "the table gradient must be deterministic"
    pw64 = pw.double() if learned else None
    out64, _ = embedding_forward_reference(tokens, positions, w.double(), pw64, D**0.5, PAD, p, mask)
    grads64 = embedding_backward_reference(dout.double(), tokens, positions, mask, D**0.5, PAD, p, V, pw.shape[0] if learned else 0)
    out_l, _ = embedding_forward_reference(tokens, positions, w, pw, D**0.5, PAD, p, mask)
    grads_l = embedding_backward_reference(dout, tokens, positions, mask, D**0.5, PAD, p, V, pw.shape[0] if learned else 0)
    check_kernel(out, out64, out_l, "out")
    for o, ref, low, name in zip((dw, dpw), grads64, grads_l, ("dweight", "dpos")):
        check_kernel(o, ref, low, name)


# a given mask: the backward's keep-bits are drawn from its bytes, the last byte's from as many as
# there are (3 x 7 x 10 = 210 elements: two past the last full byte)
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,D", [(3, 7, 10), (5, 40, 200)])
def test_kernel_uses_the_given_mask(dtype, B, T, D):
    V, p = 50, 0.3
    tokens = tokens_with_padding(B, T, V, left_pad=False).cuda()
    positions = ops.make_positions(tokens, PAD)
    w = torch.randn(V, D, device="cuda").to(dtype)
    dout = torch.randn(B, T, D, device="cuda").to(dtype)
    mask = keep_mask((B, T, D), p, "cuda")
    ext = kernel("embedding", w)
    poison()
    out, dropout = embedding_forward_kernel(tokens, positions, w, None, D**0.5, PAD, p, mask)
    poison()
    dw, _ = ext.embedding_backward(dout, tokens, positions, dropout, D**0.5, PAD, p, V, 0, None, None)
    out64, _ = embedding_forward_reference(tokens, positions, w.double(), None, D**0.5, PAD, p, mask)
    (dw64, _) = embedding_backward_reference(dout.double(), tokens, positions, mask, D**0.5, PAD, p, V, 0)
    out_l, _ = embedding_forward_reference(tokens, positions, w, None, D**0.5, PAD, p, mask)
    (dw_l, _) = embedding_backward_reference(dout, tokens, positions, mask, D**0.5, PAD, p, V, 0)
    check_kernel(out, out64, out_l, "out")
    check_kernel(dw, dw64, dw_l, "dweight")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
# long runs across chunks (a frequent token in every sentence), odd widths (1030: the per-element path)
@pytest.mark.parametrize("B,T,D", [(5, 40, 200), (7, 33, 1030), (64, 128, 1024)])
def test_kernel_accumulates_into_a_gradient_that_holds_values(dtype, B, T, D):
    """Into ls_adam's workspace the table gradient is added to what the gradient holds: every
    present row (whole runs, runs across chunks) added once, absent and padding rows untouched."""
    V, p = 32003, 0.1
    tokens = tokens_with_padding(B, T, V, left_pad=False).cuda()
    tokens[:, T // 2] = 7
    positions = ops.make_positions(tokens, PAD)
    w = torch.randn(V, D, device="cuda").to(dtype)
    dout = torch.randn(B, T, D, device="cuda").to(dtype)
    ext = kernel("embedding", w)
    _, dropout = embedding_forward_kernel(tokens, positions, w, None, D**0.5, PAD, p, None)
    mask = drawn(dropout)
    held = torch.randn(V, D, device="cuda").to(dtype)
    into = held.clone()
    dw, _ = ext.embedding_backward(dout, tokens, positions, dropout, D**0.5, PAD, p, V, 0, into, None)
    assert dw.data_ptr() == into.data_ptr(), "the gradient must be accumulated in place"
    absent = torch.ones(V, dtype=torch.bool, device="cuda")
    absent[tokens.reshape(-1)] = False
    absent[PAD] = True
    assert torch.equal(dw[absent], held[absent]), "rows without a token must keep what they held"
    d64, _ = embedding_backward_reference(dout.double(), tokens, positions, mask, D**0.5, PAD, p, V, 0)
    dlow, _ = embedding_backward_reference(dout, tokens, positions, mask, D**0.5, PAD, p, V, 0)
    check_kernel(dw, held.double() + d64, held + dlow, "dweight accumulated")


@pytest.mark.gpu
def test_kernel_gradient_of_an_empty_batch_is_zero():
    V, D = 50, 64
    w = torch.randn(V, D, device="cuda")
    tokens = torch.empty(0, 7, dtype=torch.long, device="cuda")
    ext = kernel("embedding", w)
    poison()
    dw, _ = ext.embedding_backward(torch.randn(0, 7, D, device="cuda"), tokens, tokens, None, 1.0, PAD, 0.0, V, 0, None,
                                   None)
    assert torch.equal(dw, torch.zeros_like(dw))
