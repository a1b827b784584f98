import math

import pytest

import torch
import torch.nn.functional as F
from helpers import DTYPES, LOW_PRECISION, assert_close, check_kernel, drawn, grads, kernel, poison

from ls_fairseq import ops
from ls_fairseq.ops.attention import attention_reference


def test_attention_matches_sdpa_in_fp64():
    B, H, T, S, D = 2, 3, 5, 7, 8
    q = torch.randn(B, H, T, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, H, S, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, H, S, D, dtype=torch.float64, requires_grad=True)
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1, -2:] = True
    out = ops.attention(q, k, v, ops.AttentionMask(kpm))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=~kpm[:, None, None, :], scale=1.0)
    assert_close(out, ref, what="attention")
    dout = torch.randn_like(out)
    got = grads(out, (q, k, v), dout)
    for g, r in zip(got, grads(ref, (q, k, v), dout)):
        assert_close(g, r, rtol=1e-9, atol=1e-9)
    # the keys' gradient in rows of d_head, as the qkv op's backward takes it without a copy
    assert got[1].stride(-1) == 1


def test_causal_attention_matches_sdpa():
    q, k, v = (torch.randn(2, 2, 9, 4, dtype=torch.float64) for _ in range(3))
    out = ops.attention(q / math.sqrt(4), k, v, ops.AttentionMask(causal=True))
    assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), what="causal")


@pytest.mark.parametrize("causal,Tq", [(False, 6), (True, 6), (True, 2)])
def test_mask_for_the_gpu_path_is_the_references_mask(causal, Tq):
    """The additive mask AttentionMask builds for scaled_dot_product_attention (padding, causal,
    and causal with a cache: Tq < Tk) gives the reference's result; made once per shape."""
    B, H, Tk, D = 3, 2, 6, 4
    q = torch.randn(B, H, Tq, D, dtype=torch.float64)
    k, v = torch.randn(B, H, Tk, D, dtype=torch.float64), torch.randn(B, H, Tk, D, dtype=torch.float64)
    kpm = torch.zeros(B, Tk, dtype=torch.bool)
    kpm[1, -2:] = True
    kpm[2, 0] = True
    mask = ops.AttentionMask(kpm, causal)
    attn_mask, is_causal = mask.sdpa_arguments(Tq, Tk, q.dtype, q.device)
    assert attn_mask.stride(-2) % 16 == 0  # aligned rows: torch uses it without a padded copy
    assert mask.sdpa_arguments(Tq, Tk, q.dtype, q.device)[0] is attn_mask
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=1.0)
    assert_close(out, attention_reference(q, k, v, mask), rtol=1e-10, atol=1e-12, what="sdpa mask")


def test_right_padded_causal_keys_need_no_padding_mask():
    """Targets padded at the end: with the causal mask no real query sees a pad key, so the
    padding mask is dropped (plain causal attention) and the real rows are unchanged."""
    B, H, T, D = 3, 2, 7, 4
    q, k, v = (torch.randn(B, H, T, D, dtype=torch.float64) for _ in range(3))
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[1, -3:] = True
    kpm[2, -1:] = True
    dropped = ops.AttentionMask(kpm, causal=True, right_padded=True)
    assert dropped.key_padding_mask is None and dropped.sdpa_arguments(T, T, q.dtype, q.device) == (None, True)
    assert ops.AttentionMask(kpm, causal=False, right_padded=True).key_padding_mask is kpm
    full = attention_reference(q, k, v, ops.AttentionMask(kpm, causal=True))
    fast = attention_reference(q, k, v, dropped)
    real = ~kpm[:, None, :, None].expand(B, H, T, D)
    assert_close(fast[real], full[real], rtol=1e-12, atol=1e-12, what="real rows")


@pytest.mark.parametrize("Tq,Tk,causal", [(7, 7, False), (7, 7, True), (3, 9, True), (5, 11, False), (1, 6, True)])
def test_cpu_fp32_attention_matches_the_fp64_reference(Tq, Tk, causal):
    """fp32 on CPU without dropout takes torch's fused attention: the fp64 reference's output and
    gradients, with padded keys (left and right), causal masks with a cache (Tq < Tk), odd sizes."""
    B, H, D = 3, 2, 5
    q, k, v = torch.randn(B, H, Tq, D), torch.randn(B, H, Tk, D), torch.randn(B, H, Tk, D)
    dout = torch.randn(B, H, Tq, D)
    kpm = torch.zeros(B, Tk, dtype=torch.bool)
    kpm[1, -2:] = True
    kpm[2, : Tk - Tq] = True  # left padding that still leaves every causal row a key
    mask = ops.AttentionMask(kpm, causal)
    runs = []
    for dtype in (torch.float32, torch.float64):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = ops.attention(*leaves, mask, 0.0, True)
        runs.append([out] + list(torch.autograd.grad(out, leaves, dout.to(dtype))))
    assert runs[0][0].grad_fn is not None and "Scaled" in type(runs[0][0].grad_fn).__name__
    for a, b, name in zip(*runs, ("out", "dq", "dk", "dv")):
        assert_close(a, b, rtol=1e-5, atol=1e-5, what=name)


def test_cpu_fp32_attention_with_a_row_that_sees_no_key_is_zero():
    """A query row whose keys are all masked gives zeros on the fp32 CPU path too (the explicit path)."""
    q, k, v = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 5, 4), torch.randn(2, 1, 5, 4)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[1] = True
    out = ops.attention(q, k, v, ops.AttentionMask(kpm))
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isfinite(out).all()
    causal = ops.AttentionMask(causal=True)  # Tq > Tk: the first rows see no key
    out = ops.attention(torch.randn(1, 1, 4, 4), k[:1, :, :2], v[:1, :, :2], causal)
    assert torch.equal(out[0, 0, :2], torch.zeros(2, 4)) and torch.isfinite(out).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_attention_matches_reference(dtype, causal):
    B, H, T, D = 3, 4, 37, 64
    q, k, v = (torch.randn(B, H, T, D, device="cuda").to(dtype) for _ in range(3))
    kpm = torch.zeros(B, T, dtype=torch.bool, device="cuda")
    kpm[1, -5:] = True
    dout = torch.randn(B, H, T, D, device="cuda").to(dtype)
    kernel("attention", q)

    def run(q, k, v, fn):
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        out = fn(q * D**-0.5, k, v, ops.AttentionMask(kpm, causal))
        return (out,) + torch.autograd.grad(out, (q, k, v), dout.to(out.dtype))

    ours = run(q, k, v, ops.attention)
    ref64 = run(q.double(), k.double(), v.double(), attention_reference)
    low = run(q, k, v, attention_reference)
    for o, r, lo, name in zip(ours, ref64, low, ("out", "dq", "dk", "dv")):
        check_kernel(o, r, lo, name)


@pytest.mark.gpu
def test_deterministic_attention_repeats_bit_for_bit():
    B, H, T, D = 8, 16, 257, 64
    kernel("softmax", torch.empty(1, device="cuda"))
    q, k, v, dout = (torch.randn(B, H, T, D, device="cuda", dtype=torch.float16) for _ in range(4))
    kpm = torch.zeros(B, T, dtype=torch.bool, device="cuda")
    kpm[1, -40:] = True
    runs = []
    for _ in range(2):
        torch.cuda.manual_seed(3)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ops.attention(*leaves, ops.AttentionMask(kpm), 0.1, True, deterministic=True)
        runs.append([out] + list(torch.autograd.grad(out, leaves, dout)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_row_term_beyond_the_fused_kernel_takes_the_lightseq_path(dtype):
    """With ``exact_row_term`` and keys longer than the fused kernel's rows, the GPU runs GEMM -> fused
    masked softmax -> GEMM (the backward's row term from the probabilities), not SDPA, keeping no
    probabilities (its backward computes them again): the same dropout draws give the reference's bits."""
    B, H, Tq, D = 4, 8, 33, 64
    Tk = kernel("attention", torch.empty(1, device="cuda")).attention_max_len + 16
    q = torch.randn(B, H, Tq, D, device="cuda").to(dtype)
    k, v = (torch.randn(B, H, Tk, D, device="cuda").to(dtype) for _ in range(2))
    dout = torch.randn(B, H, Tq, D, device="cuda").to(dtype)
    kpm = torch.zeros(B, Tk, dtype=torch.bool, device="cuda")
    kpm[2, -6:] = True
    runs = []
    for fn in (lambda *a: ops.attention(*a, 0.1, True, exact_row_term=True), lambda *a: attention_reference(*a, 0.1)):
        torch.cuda.manual_seed(5)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        before = torch.cuda.memory_allocated()
        out = fn(*leaves, ops.AttentionMask(kpm))
        held = torch.cuda.memory_allocated() - before
        runs.append([out] + list(torch.autograd.grad(out, leaves, dout)) + [held])
    assert type(runs[0][0].grad_fn).__name__ == "RecomputedAttentionFunctionBackward"
    for a, b, name in zip(runs[0][:4], runs[1][:4], ("out", "dq", "dk", "dv")):
        assert torch.equal(a, b), name
    # after the forward it holds its output, not the probabilities (the stored path: two more [B, H, Tq, Tk])
    size = runs[0][0].element_size()
    out_bytes, probs_bytes = runs[0][0].numel() * size, B * H * Tq * Tk * size
    kept = [r[-1] for r in runs]
    assert kept[0] < out_bytes + probs_bytes // 2 < kept[1], kept


@pytest.mark.parametrize("causal,p", [(False, 0.0), (False, 0.2), (True, 0.1)])
def test_recomputed_attention_is_the_lightseq_path(causal, p):
    """The LightSeq path that keeps only q, k, v (its backward runs the scores and the softmax again)
    gives the stored-probabilities path's output and gradients, with the same dropout draws."""
    from ls_fairseq.ops.attention import RecomputedAttentionFunction

    B, H, Tq, Tk, D = 3, 2, 7, 9, 8
    q = torch.randn(B, H, Tq, D, dtype=torch.float64)
    k, v = (torch.randn(B, H, Tk, D, dtype=torch.float64) for _ in range(2))
    kpm = torch.zeros(B, Tk, dtype=torch.bool)
    kpm[1, -3:] = True
    kpm[2, :2] = True
    dout = torch.randn(B, H, Tq, D, dtype=torch.float64)
    runs = []
    for fn in (lambda *a: RecomputedAttentionFunction.apply(*a, kpm, causal, p),
               lambda *a: attention_reference(*a, ops.AttentionMask(kpm, causal), p)):
        torch.manual_seed(7)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        runs.append([out] + list(torch.autograd.grad(out, leaves, dout)))
    for a, b, name in zip(*runs, ("out", "dq", "dk", "dv")):
        assert_close(a, b, rtol=1e-12, atol=1e-12, what=name)


def _heads(B, H, T, D, dtype, token_major):
    """Random [B, heads, T, d_head]: a view of token-major storage (as split_heads gives) or contiguous."""
    if token_major:
        return torch.randn(B, T, H, D, device="cuda").to(dtype).transpose(1, 2)
    return torch.randn(B, H, T, D, device="cuda").to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("B,H,Tq,Tk,causal,p", [
    (3, 4, 37, 37, False, 0.1),  # encoder self-attention: padded keys
    (2, 16, 64, 64, True, 0.1),  # the longest rows, causal
    (5, 3, 33, 21, False, 0.2),  # cross-attention shapes, lengths not multiples of 16
    (4, 2, 1, 7, True, 0.0),  # one query (a decoding step), causal with Tq < Tk
    (2, 2, 17, 64, True, 0.3),
])
def test_fused_kernel_matches_the_reference_with_its_dropout(dtype, B, H, Tq, Tk, causal, p):
    """The fused kernel (forward and backward) against the LightSeq path in fp64 given the kernel's own
    keep-mask, by the 2x-PyTorch rule; outputs poisoned first, so an unwritten element fails."""
    D = 64
    ext = kernel("attention", torch.empty(1, device="cuda", dtype=dtype))
    q = _heads(B, H, Tq, D, dtype, True) * D**-0.5
    k, v = _heads(B, H, Tk, D, dtype, True), _heads(B, H, Tk, D, dtype, False)
    kpm = torch.zeros(B, Tk, dtype=torch.bool, device="cuda")
    kpm[1, -min(5, Tk - 1):] = Tk > 1
    kpm[0, :2] = Tk > 2  # left padding too (fairseq's sources)
    dout = _heads(B, H, Tq, D, dtype, True)
    poison()
    out, lse, dropout = ext.attention_forward(q, k, v, kpm, causal, p)
    assert (dropout is None) == (p == 0) and out.shape == (B, H, Tq, D) and lse.shape == (B, H, Tq)
    # token-major output: the out projection merges its heads by a view
    assert out.transpose(1, 2).is_contiguous()
    poison()
    got = (out,) + ext.attention_backward(dout, q, k, v, lse, kpm, causal, dropout, p)
    mask = drawn(dropout)

    def reference(dt):
        leaves = [t.to(dt).requires_grad_() for t in (q, k, v)]
        o = attention_reference(*leaves, ops.AttentionMask(kpm, causal), p, True, mask)
        return (o,) + torch.autograd.grad(o, leaves, dout.to(dt))

    for g, r64, low, name in zip(got, reference(torch.float64), reference(dtype), ("out", "dq", "dk", "dv")):
        assert g.dtype == dtype and g.shape == r64.shape, name
        check_kernel(g, r64, low, name)
    if p > 0:
        keep = mask.float().mean().item()
        assert abs(keep - (1 - p)) < 0.05, "kept fraction {:.3f} for p = {}".format(keep, p)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_takes_the_fused_kernel_and_repeats_bit_for_bit(causal):
    """ops.attention on short fp16 rows runs the fused kernel (its autograd node), in deterministic
    training too: two runs with the same seed agree bit for bit; longer rows take SDPA."""
    B, H, T, D = 6, 16, 45, 64
    kernel("attention", torch.empty(1, device="cuda", dtype=torch.float16))
    q, k, v, dout = (_heads(B, H, T, D, torch.float16, True) for _ in range(4))
    kpm = torch.zeros(B, T, dtype=torch.bool, device="cuda")
    kpm[2, -9:] = True
    runs = []
    for _ in range(2):
        torch.cuda.manual_seed(11)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ops.attention(*leaves, ops.AttentionMask(kpm, causal), 0.1, True, deterministic=True)
        assert type(out.grad_fn).__name__ == "AttentionFunctionBackward"
        runs.append([out] + list(torch.autograd.grad(out, leaves, dout)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    long_q = torch.randn(2, 4, 65, D, device="cuda", dtype=torch.float16, requires_grad=True)
    assert type(ops.attention(long_q, long_q, long_q, None, 0.0).grad_fn).__name__ != "AttentionFunctionBackward"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_cross_attention_rows_take_the_fused_kernel(dtype):
    """Cross-attention (``exact_row_term``, queries and keys of different lengths, the keys a view of
    all layers' keys as ls_transformer makes them) runs the fused kernel where its rows fit, and its
    gradients agree with the LightSeq path given the same keep-mask, by the 2x-PyTorch rule."""
    B, H, Tq, Tk, D, p = 5, 16, 29, 41, 64, 0.1
    kernel("attention", torch.empty(1, device="cuda", dtype=dtype))
    q = _heads(B, H, Tq, D, dtype, False) * D**-0.5
    kv = torch.randn(4, B, H, Tk, D, device="cuda").to(dtype)
    k, v = kv[1], kv[2]
    kpm = torch.zeros(B, Tk, dtype=torch.bool, device="cuda")
    kpm[0, :3] = True
    kpm[3, -11:] = True
    mask = ops.AttentionMask(kpm)
    dout = _heads(B, H, Tq, D, dtype, True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ops.attention(*leaves, mask, p, True, exact_row_term=True)
    assert type(out.grad_fn).__name__ == "AttentionFunctionBackward"
    keep = drawn(out.grad_fn.dropout)
    got = (out,) + torch.autograd.grad(out, leaves, dout)

    def reference(dt):
        leaves = [t.to(dt).requires_grad_() for t in (q, k, v)]
        o = attention_reference(*leaves, mask, p, True, keep)
        return (o,) + torch.autograd.grad(o, leaves, dout.to(dt))

    for g, r64, low, name in zip(got, reference(torch.float64), reference(dtype), ("out", "dq", "dk", "dv")):
        check_kernel(g, r64, low, name)


@pytest.mark.gpu
def test_fused_kernel_rejects_what_it_cannot_run():
    ext = kernel("attention", torch.empty(1, device="cuda"))
    q = torch.randn(2, 2, 8, 64, device="cuda")
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        ext.attention_forward(q, q, q, None, False, 0.0)
    long = torch.randn(2, 2, 65, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="lengths"):
        ext.attention_forward(long, long, long, None, False, 0.0)
    wide = torch.randn(2, 2, 8, 80, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="d_head contiguous"):
        ext.attention_forward(wide, wide, wide, None, False, 0.0)


@pytest.mark.parametrize("causal,Tq,Tk", [(False, 1, 9), (True, 3, 9), (True, 9, 9)])
def test_a_refreshed_mask_equals_a_new_one_in_the_same_memory(causal, Tq, Tk):
    """AttentionMask.refresh after new padding was copied into its key_padding_mask: the additive masks
    it made before hold the new padding's values, where they were (a CUDA graph keeps reading them)."""
    padding = torch.zeros(2, Tk, dtype=torch.bool)
    padding[0, :3] = True
    mask = ops.AttentionMask(padding, causal=causal)
    before, _ = mask.sdpa_arguments(Tq, Tk, torch.float32, "cpu")
    where = before.data_ptr()
    padding.copy_(torch.flip(padding, [0]))
    mask.refresh()
    after, _ = mask.sdpa_arguments(Tq, Tk, torch.float32, "cpu")
    fresh, _ = ops.AttentionMask(padding.clone(), causal=causal).sdpa_arguments(Tq, Tk, torch.float32, "cpu")
    assert after.data_ptr() == where and torch.equal(after, fresh) and not torch.equal(fresh[0], fresh[1])
