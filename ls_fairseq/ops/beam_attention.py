"""Cross-attention of every beam of a sentence to that sentence's keys and values, in decoding.

q [B, heads, beams, d_head] (each beam one query), k, v [B, heads, S, d_head] (one row per
sentence, never copied per beam), ``mask`` an AttentionMask over the keys -> [B, heads, beams,
d_head]. On the kernel path one attention call with the beams as the query rows, which reads the
keys and values once per sentence. On the reference path one call per beam, each computing a single
query as incremental decoding of one hypothesis does (one query row per hypothesis, against keys
and values repeated per hypothesis), so that the two agree bit for bit: a matrix product of several
query rows at once may round differently from one of a single row.
"""
import torch

from ls_fairseq.ops.attention import ATTENTION_ROUTE, attention, attention_reference


def beam_attention(q, k, v, mask=None):
    if q.dim() != 4 or k.shape[0] != q.shape[0]:
        raise ValueError("beam_attention: q {} must be [sentences, heads, beams, d_head] with k {} of as many "
                         "sentences".format(tuple(q.shape), tuple(k.shape)))
    if ATTENTION_ROUTE.pick(q) is not attention_reference:
        return attention(q, k, v, mask, 0.0, False, exact_row_term=True)
    return torch.cat([attention(q[:, :, j : j + 1], k, v, mask, 0.0, False) for j in range(q.shape[2])], dim=2)
