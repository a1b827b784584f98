"""segment_attention (packed streams) against its oracle, a dense block-diagonal mask in fp64: random
segments with lengths 0 (empty), 1 and odd sizes, a tail past the last offset, causal self-attention
and cross-attention, forward and gradients; dropout against the padded op on the same blocks."""
import pytest
import torch
from helpers import DEVICES, LOW_PRECISION, check_kernel

from ls_fairseq import ops
from ls_fairseq.ops import segment_attention as seg


def random_segments(generator, segments, longest, tail, device):
    lengths = torch.randint(0, longest + 1, (segments,), generator=generator)
    lengths[0] = 1  # a segment of one token
    lengths[-1] = longest
    offsets = torch.zeros(segments + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(lengths, 0)
    return offsets.to(device), int(offsets[-1]) + tail


def streams(generator, device, dtype, causal, H=4, D=16, segments=7):
    q_offsets, nq = random_segments(generator, segments, 13, 5, device)
    k_offsets, nk = (q_offsets, nq) if causal else random_segments(generator, segments, 11, 3, device)
    mask = ops.SegmentMask(q_offsets, k_offsets, 13, 13 if causal else 11, causal=causal)
    # token-major, as split_heads gives them: [1, heads, rows, d_head] views of [1, rows, heads, d_head]
    q, k, v = (torch.randn(1, n, H, D, generator=generator).to(device, dtype).transpose(1, 2) * 0.5
               for n in (nq, nk, nk))
    return q, k, v, mask


def run(fn, q, k, v, dout, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    return (out,) + torch.autograd.grad(out, leaves, dout.to(dtype))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_segment_attention_against_block_diagonal_reference(dtype, device, causal, request):
    if device == "cpu" and dtype in LOW_PRECISION:
        pytest.skip("the CPU path runs fp32 (the references' math)")
    generator = torch.Generator().manual_seed(request.node.ls_seed)
    q, k, v, mask = streams(generator, device, dtype, causal)
    dout = torch.randn(q.shape, generator=generator).to(device)
    got = run(lambda *t: ops.attention(*t, mask), q, k, v, dout, dtype)
    ref64 = run(lambda *t: seg.segment_attention_reference(*t, mask), q, k, v, dout, torch.float64)
    low = run(lambda *t: seg.segment_attention_reference(*t, mask), q, k, v, dout, dtype)
    tail = mask.tail(q.shape[2])
    assert got[0][0][:, tail].eq(0).all(), "the tail rows are exactly zero"
    assert got[0].transpose(1, 2).is_contiguous(), "the output is token-major (the out projection merges a view)"
    for g, r64, lp, name in zip(got, ref64, low, ("out", "dq", "dk", "dv")):
        assert torch.isfinite(g).all(), name
        check_kernel(g, r64, lp, name)


@pytest.mark.parametrize("exact_row_term", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_dropout_is_the_padded_ops_on_the_same_blocks(device, exact_row_term, request):
    """With attention dropout the blocks path is ops.attention on each segment's rows gathered into
    blocks (a key padding mask past each segment's end): the same random numbers give the same output
    and gradients as that op on blocks gathered by hand."""
    dtype = torch.float32 if device == "cpu" else torch.float16
    generator = torch.Generator().manual_seed(request.node.ls_seed)
    q, k, v, mask = streams(generator, device, dtype, causal=False)
    dout = torch.randn(q.shape, generator=generator).to(device, dtype)

    def by_hand(q, k, v):
        blocks = []
        max_q, max_k = mask.block_lengths()
        for x, offsets, length in ((q, mask.q_offsets, max_q), (k, mask.k_offsets, max_k),
                                   (v, mask.k_offsets, max_k)):
            rows = x[0].transpose(0, 1)
            block = rows.new_zeros(mask.segments, length, *rows.shape[1:])
            for s in range(mask.segments):
                a, b = int(offsets[s]), int(offsets[s + 1])
                block[s, : b - a] = rows[a:b]
            blocks.append(block.transpose(1, 2))
        kpm = torch.arange(max_k, device=device)[None] >= (mask.k_offsets[1:] - mask.k_offsets[:-1])[:, None]
        kpm[:, 0] = False
        out = ops.attention(*blocks, ops.AttentionMask(kpm), 0.3, True, exact_row_term=exact_row_term)
        rows = torch.zeros_like(q[0].transpose(0, 1))
        for s in range(mask.segments):
            a, b = int(mask.q_offsets[s]), int(mask.q_offsets[s + 1])
            rows[a:b] = out[s].transpose(0, 1)[: b - a]
        return rows.unsqueeze(0).transpose(1, 2)

    torch.manual_seed(request.node.ls_seed)
    got = run(lambda *t: ops.attention(*t, mask, 0.3, True, exact_row_term=exact_row_term), q, k, v, dout, dtype)
    torch.manual_seed(request.node.ls_seed)
    want = run(by_hand, q, k, v, dout, dtype)
    for g, w, name in zip(got, want, ("out", "dq", "dk", "dv")):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=name)


def test_bad_streams_and_masks_are_refused():
    offsets = torch.tensor([0, 3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="causal attention is self-attention"):
        ops.SegmentMask(offsets, offsets.clone(), 3, 3, causal=True)
    with pytest.raises(ValueError, match="must be \\[segments \\+ 1\\]"):
        ops.SegmentMask(offsets, offsets[:2], 3, 3)
    q = torch.randn(2, 4, 5, 8)
    with pytest.raises(ValueError, match="packed streams"):
        ops.attention(q, q, q, ops.SegmentMask(offsets, offsets, 3, 3))


def many_causal_segments(seed, dtype, longest, triton):
    """500 causal segments of 1 to ``longest`` tokens and a tail of 13 rows on the GPU, 16 heads of 64:
    (offsets, mask, q, k, v, dout)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (500,), generator=generator)
    offsets = torch.zeros(501, dtype=torch.int32)
    offsets[1:] = torch.cumsum(lengths, 0)
    offsets = offsets.cuda()
    n = int(offsets[-1]) + 13
    mask = ops.SegmentMask(offsets, offsets, longest, longest, causal=True, triton=triton)
    q, k, v = (torch.randn(1, n, 16, 64, generator=generator).cuda().to(dtype).transpose(1, 2) for _ in range(3))
    return offsets, mask, q, k, v, torch.randn(q.shape, generator=generator).cuda()


def assert_identical_runs(mask, q, k, v, dout, dtype, seed):
    """Two runs with dropout 0.1 in deterministic mode from one seed: bit-identical outputs and gradients."""
    runs = []
    for _ in range(2):
        torch.manual_seed(seed)
        runs.append(run(lambda *t: ops.attention(*t, mask, 0.1, True, deterministic=True), q, k, v, dout, dtype))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_many_segments_deterministic_mode_gives_identical_runs(dtype, request):
    """500 segments of lengths 1-40 with dropout in deterministic mode (the blocks path's kernels):
    two runs from one seed are bit-identical, and without dropout the output meets the 2x rule."""
    _, mask, q, k, v, dout = many_causal_segments(request.node.ls_seed, dtype, 40, triton=False)
    assert_identical_runs(mask, q, k, v, dout, dtype, request.node.ls_seed)
    got = run(lambda *t: ops.attention(*t, mask), q, k, v, dout, dtype)
    ref64 = run(lambda *t: seg.segment_attention_reference(*t, mask), q, k, v, dout, torch.float64)
    low = run(lambda *t: seg.segment_attention_reference(*t, mask), q, k, v, dout, dtype)
    for g, r64, lp, name in zip(got, ref64, low, ("out", "dq", "dk", "dv")):
        check_kernel(g, r64, lp, name)


@pytest.mark.gpu
def test_varlen_path_runs_where_it_fits():
    q = torch.zeros(1, 2, 16, 64, device="cuda", dtype=torch.bfloat16)
    assert seg.varlen_attn is not None, "torch without torch.nn.attention.varlen"
    assert seg.varlen_fits(q, 0.0, True, False, False)
    assert not seg.varlen_fits(q, 0.1, True, False, False)  # dropout
    assert not seg.varlen_fits(q, 0.0, True, True, False)  # deterministic
    assert not seg.varlen_fits(q, 0.0, True, False, True)  # the fp32 row term


# The Triton path (the packed step's): on the GPU, and on the CPU in Triton's interpreter (conftest sets
# TRITON_INTERPRET=1 where no GPU is; seg.INTERPRET lets CPU tensors take the path), which runs fp32 only.
needs_triton = pytest.mark.skipif(seg._triton_kernels() is None, reason="triton is not installed")


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setattr(seg, "INTERPRET", True)


def triton_streams(generator, device, dtype, causal, H, D, segments, longest):
    """Streams of ``segments`` segments over up to two tiles of rows: one of length 1, an empty one, one of
    the longest, the others random; a tail past the last offset of each stream."""
    def offsets(longest, tail):
        lengths = torch.randint(0, longest + 1, (segments,), generator=generator)
        lengths[0], lengths[1], lengths[-1] = 1, 0, longest
        offsets = torch.zeros(segments + 1, dtype=torch.int32)
        offsets[1:] = torch.cumsum(lengths, 0)
        return offsets.to(device), int(offsets[-1]) + tail

    q_offsets, nq = offsets(longest, 5)
    k_offsets, nk = (q_offsets, nq) if causal else offsets(longest - 7, 3)
    mask = ops.SegmentMask(q_offsets, k_offsets, longest, longest if causal else longest - 7, causal=causal,
                           triton=True)
    q, k, v = (torch.randn(1, n, H, D, generator=generator).to(device, dtype).transpose(1, 2) * 0.5
               for n in (nq, nk, nk))
    return q, k, v, mask


def nan_empty(monkeypatch, device):
    """Outputs that the kernels forget to write read as NaN: the caching allocator's free blocks filled
    with NaN on the GPU, torch.empty giving NaN-filled tensors on the CPU."""
    if device == "cuda":
        from helpers import poison

        poison()
        return
    empty = torch.empty

    def filled(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", filled)


@needs_triton
@pytest.mark.parametrize("short_backward", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("exact_row_term", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_path_against_block_diagonal_reference(dtype, device, causal, exact_row_term, p, short_backward,
                                                      request, monkeypatch, interpret):
    """Random segments (one of length 1, an empty one, one of the longest) over two tiles of rows, a
    tail, token-major q/k/v views; forward and gradients against the fp64 oracle, with the kernels' own
    keep-mask under dropout; every output element written, the tail rows exactly zero. ``short_backward``:
    64-row tiles, the segments within one take the one-kernel backward (SHORT_BACKWARD), the others the
    two; otherwise 32-row tiles."""
    if device == "cpu" and dtype in LOW_PRECISION:
        pytest.skip("Triton's interpreter runs fp32")
    kernels_module = seg._triton_kernels()
    generator = torch.Generator().manual_seed(request.node.ls_seed)
    H, D = (2, 16) if device == "cpu" else (8, 64)
    # the longest segments over two tiles, so that both backwards run where the short one is on
    q, k, v, mask = triton_streams(generator, device, dtype, causal, H, D, segments=9,
                                   longest=90 if short_backward else 45)
    dout = torch.randn(q.shape, generator=generator).to(device)
    assert seg.triton_runs(q, k, v, mask)
    torch.manual_seed(request.node.ls_seed)
    seed = torch.randint(2**62, (1,), device=device)
    keep = seg._triton_kernels().keep_mask(q, k, mask, p, seed) if p > 0 else None

    def kernels(*t):
        torch.manual_seed(request.node.ls_seed)  # the same seed as keep's
        return ops.attention(*t, mask, p, True, exact_row_term=exact_row_term)

    with monkeypatch.context() as patched:
        nan_empty(patched, device)
        patched.setattr(kernels_module, "SHORT_BACKWARD", short_backward)
        assert kernels_module.block_rows(q.shape[2], mask.segments) == (64 if short_backward else 32)
        got = run(kernels, q, k, v, dout, dtype)
    ref64 = run(lambda *t: seg.segment_attention_reference(*t, mask, p, True, keep), q, k, v, dout, torch.float64)
    low = run(lambda *t: seg.segment_attention_reference(*t, mask, p, True, keep), q, k, v, dout, dtype)
    assert got[0].transpose(1, 2).is_contiguous(), "the output is token-major (the out projection merges a view)"
    for g, offsets in zip(got, (mask.q_offsets, mask.q_offsets, mask.k_offsets, mask.k_offsets)):
        assert g[0][:, int(offsets[-1]):].eq(0).all(), "the tail rows are exactly zero"
    for g, r64, lp, name in zip(got, ref64, low, ("out", "dq", "dk", "dv")):
        check_kernel(g, r64, lp, name)


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_triton_keep_mask_drops_at_the_rate_and_only_inside_segments(device, request, interpret):
    generator = torch.Generator().manual_seed(request.node.ls_seed)
    q, k, v, mask = triton_streams(generator, device, torch.float32, False, 2, 16, segments=9, longest=45)
    seed = torch.randint(2**62, (1,), generator=generator).to(device)
    keep = seg._triton_kernels().keep_mask(q, k, mask, 0.25, seed)
    q_seg = torch.searchsorted(mask.q_offsets[1:].long().cpu(), torch.arange(q.shape[2]), right=True)
    k_seg = torch.searchsorted(mask.k_offsets[1:].long().cpu(), torch.arange(k.shape[2]), right=True)
    same = (q_seg[:, None] == k_seg[None, :]) & (q_seg[:, None] < mask.segments)
    keep = keep[0].cpu()
    assert not keep[:, ~same].any(), "keep bits outside the segments"
    rate = 1 - keep[:, same].float().mean().item()
    assert abs(rate - 0.25) < 0.05, rate
    again = seg._triton_kernels().keep_mask(q, k, mask, 0.25, seed)[0].cpu()
    assert torch.equal(keep, again), "one seed, one mask"


@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_triton_many_segments_bit_identical_runs_and_2x_rule(dtype, request):
    """500 WMT-like segments (1-120 tokens) causal with dropout, 16 heads of 64: two runs from one seed are
    bit-identical (no atomics). Without dropout, on the first 120 segments and 4 heads (the dense fp64
    oracle holds [heads, rows, rows]), the output and gradients meet the 2x rule."""
    offsets, mask, q, k, v, dout = many_causal_segments(request.node.ls_seed, dtype, 120, triton=True)
    assert_identical_runs(mask, q, k, v, dout, dtype, request.node.ls_seed)
    small_offsets = offsets[:121]
    small = ops.SegmentMask(small_offsets, small_offsets, 120, 120, causal=True, triton=True)
    rows = int(offsets[120]) + 13
    q, k, v, dout = (t[:, :4, :rows] for t in (q, k, v, dout))
    got = run(lambda *t: ops.attention(*t, small), q, k, v, dout, dtype)
    ref64 = run(lambda *t: seg.segment_attention_reference(*t, small), q, k, v, dout, torch.float64)
    low = run(lambda *t: seg.segment_attention_reference(*t, small), q, k, v, dout, dtype)
    for g, r64, lp, name in zip(got, ref64, low, ("out", "dq", "dk", "dv")):
        check_kernel(g, r64, lp, name)
