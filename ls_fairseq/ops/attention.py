"""Scaled dot-product attention over split heads: q, k, v [B, heads, T, d_head].

q arrives already scaled (the qkv op folds 1/sqrt(d_head) in). Two paths:
- the LightSeq path: GEMM (cuBLAS) -> fused masked softmax + dropout -> GEMM;
  the reference on CPU and the oracle everywhere;
- torch's scaled_dot_product_attention, which never writes the Tq x Tk
  scores. Taken on CUDA unless the ``attention`` op is forced to the
  reference (LS_FAIRSEQ_REFERENCE). Its FlashAttention and memory-efficient
  kernels only: torch prefers cuDNN's attention on Hopper, which builds an
  execution plan for every new batch shape (about 10 ms of host time per call,
  measured on the H200: docs/perf-log.md), so a first epoch, where nearly
  every batch has a new shape, ran 7x slower than the next.
"""
import contextlib

import torch
import torch.nn.functional as F

try:  # torch >= 2.3; older versions have no cuDNN attention to avoid
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def _backends():
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

except ImportError:
    _backends = contextlib.nullcontext

from ls_fairseq.ops import dispatch
from ls_fairseq.ops.softmax import softmax


def attention_reference(q, k, v, key_padding_mask=None, causal=False, p=0.0, training=True, mask=None):
    scores = torch.matmul(q, k.transpose(-1, -2))
    probs = softmax(scores, key_padding_mask, causal, p, training, mask)
    return torch.matmul(probs, v)


def _sdpa(q, k, v, key_padding_mask, causal, p):
    Tq, Tk = q.shape[-2], k.shape[-2]
    allowed = None
    if key_padding_mask is not None:
        allowed = ~key_padding_mask.bool()[:, None, None, :]
    if causal and (allowed is not None or Tq != Tk):
        i = torch.arange(Tq, device=q.device)[:, None]
        j = torch.arange(Tk, device=q.device)[None, :]
        future = j <= i + (Tk - Tq)
        allowed = future if allowed is None else allowed & future
        causal = False
    with _backends():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=p, is_causal=causal, scale=1.0)


def attention(q, k, v, key_padding_mask=None, causal=False, p=0.0, training=True):
    """softmax(q k^T + masks) v with dropout ``p`` on the probabilities."""
    if not (q.dim() == k.dim() == v.dim() == 4) or q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ValueError(
            "attention: q {}, k {}, v {} must be [batch, heads, len, d_head] with matching d_head and k/v lengths".format(
                tuple(q.shape), tuple(k.shape), tuple(v.shape)
            )
        )
    p = p if training else 0.0
    if dispatch.use_kernel("attention", q):
        return _sdpa(q, k, v, key_padding_mask, causal, p)
    return attention_reference(q, k, v, key_padding_mask, causal, p, training)
