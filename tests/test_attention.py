import math

import torch
import torch.nn.functional as F
from helpers import assert_close, grads

from ls_fairseq import ops


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
