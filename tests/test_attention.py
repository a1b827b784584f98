import math

import pytest

import torch
import torch.nn.functional as F
from helpers import DTYPES, assert_close, check_kernel, grads, kernel

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
def test_fused_softmax_takes_the_lightseq_path(dtype):
    """With ``fused_softmax`` the GPU runs GEMM -> fused masked softmax -> GEMM (probabilities and
    the backward's row term from them), not SDPA: the same dropout draws give the reference's bits."""
    B, H, Tq, Tk, D = 4, 8, 33, 21, 64
    kernel("softmax", torch.empty(1, device="cuda"))
    q = torch.randn(B, H, Tq, D, device="cuda").to(dtype)
    k, v = (torch.randn(B, H, Tk, D, device="cuda").to(dtype) for _ in range(2))
    dout = torch.randn(B, H, Tq, D, device="cuda").to(dtype)
    kpm = torch.zeros(B, Tk, dtype=torch.bool, device="cuda")
    kpm[2, -6:] = True
    runs = []
    for fn in (lambda *a: ops.attention(*a, 0.1, True, fused_softmax=True), lambda *a: attention_reference(*a, 0.1)):
        torch.cuda.manual_seed(5)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, ops.AttentionMask(kpm))
        runs.append([out] + list(torch.autograd.grad(out, leaves, dout)))
    for a, b, name in zip(*runs, ("out", "dq", "dk", "dv")):
        assert torch.equal(a, b), name
