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
    out = ops.attention(q, k, v, kpm)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=~kpm[:, None, None, :], scale=1.0)
    assert_close(out, ref, what="attention")
    dout = torch.randn_like(out)
    for g, r in zip(grads(out, (q, k, v), dout), grads(ref, (q, k, v), dout)):
        assert_close(g, r, rtol=1e-9, atol=1e-9)


def test_causal_attention_matches_sdpa():
    q, k, v = (torch.randn(2, 2, 9, 4, dtype=torch.float64) for _ in range(3))
    out = ops.attention(q / math.sqrt(4), k, v, causal=True)
    assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), what="causal")


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
        out = fn(q * D**-0.5, k, v, kpm, causal)
        return (out,) + torch.autograd.grad(out, (q, k, v), dout.to(out.dtype))

    ours = run(q, k, v, ops.attention)
    ref64 = run(q.double(), k.double(), v.double(), attention_reference)
    low = run(q, k, v, attention_reference)
    for o, r, lo, name in zip(ours, ref64, low, ("out", "dq", "dk", "dv")):
        check_kernel(o, r, lo, name)
