"""Cross-attention of every beam of a sentence to that sentence's keys and values, in decoding.

beam_attention(q, k, v, mask=None, bias=None, scaling=1.0) -> [B, heads, beams, d_head]:
- q [B, heads, beams, d_head]: each beam one query, already scaled, or, given ``bias``
  [heads x d_head], the query projection's output without its bias (a view of the GEMM's output):
  the op adds the bias and scales by ``scaling`` in fp32, rounding to the dtype as ops.split_heads
  does, so the step needs no split_heads launch;
- k, v [B, heads, S, d_head]: one row per sentence, never copied per beam;
- mask: an AttentionMask over the keys (its key padding).

The kernel (csrc/beam_attention.cu) gives a warp each (sentence, head) and up to four of its beams:
each key and value row is read once for them, and it returns a view of token-major storage, which
the out projection reads as merged heads. Where it does not apply (a d_head other than 32, 64, 128
or 256, keys and values not 16-byte aligned or none, a causal mask) the GPU runs ops.attention with
the beams as the query rows. A sentence whose keys are all padding gets zeros, as from
ops.attention (fairseq's sources end in EOS, so generation never has one). The reference
runs one attention call per beam, each computing a single query as incremental decoding of one
hypothesis does (one query row per hypothesis, against keys and values repeated per hypothesis), so
that the two agree bit for bit: a matrix product of several query rows at once may round
differently from one of a single row.
"""
import torch

from ls_fairseq.ops import dispatch
from ls_fairseq.ops.attention import attention
from ls_fairseq.ops.dispatch import _C

HEAD_DIMS = (32, 64, 128, 256)  # the kernel's


def scaled_query(q, bias, scaling):
    """(q + bias) x scaling in fp32 (at least), rounded to q's dtype as split_heads's reference does."""
    if bias is None and scaling == 1.0:
        return q
    b = 0 if bias is None else dispatch.upcast(bias).view(1, q.shape[1], 1, q.shape[3])
    return ((dispatch.upcast(q) + b) * scaling).to(q.dtype)


def beam_attention_reference(q, k, v, mask=None, bias=None, scaling=1.0):
    q = scaled_query(q, bias, scaling)
    return torch.cat([attention(q[:, :, j : j + 1], k, v, mask, 0.0, False) for j in range(q.shape[2])], dim=2)


def beam_attention_kernel(q, k, v, mask=None, bias=None, scaling=1.0):
    kpm = mask.key_padding_mask if mask is not None else None
    return _C.beam_attention(q, k.contiguous(), v.contiguous(), None if kpm is None else kpm.bool().contiguous(),
                             bias, scaling)


BEAM_ATTENTION_ROUTE = dispatch.Route(
    "beam_attention",
    kernel=beam_attention_kernel if _C else None,
    reference=beam_attention_reference,
)


def _kernel_fits(q, k, v, mask):
    """The kernel's cases: its d_head, a unit stride along it, keys (at least one) and values in
    16-byte aligned storage (the binding's contiguous copies keep a view's offset), key padding only."""
    return (q.shape[3] in HEAD_DIMS and q.stride(3) == 1 and k.shape[2] > 0 and k.data_ptr() % 16 == 0
            and v.data_ptr() % 16 == 0 and (mask is None or not mask.causal))


def beam_attention(q, k, v, mask=None, bias=None, scaling=1.0):
    """See the module docstring."""
    if q.dim() != 4 or k.dim() != 4 or k.shape[0] != q.shape[0] or k.shape != v.shape or \
            k.shape[1] != q.shape[1] or k.shape[3] != q.shape[3]:
        raise ValueError("beam_attention: q {} must be [sentences, heads, beams, d_head] with k {} and v {} "
                         "[sentences, heads, keys, d_head]".format(tuple(q.shape), tuple(k.shape), tuple(v.shape)))
    if bias is not None and (bias.shape != (q.shape[1] * q.shape[3],) or bias.dtype != q.dtype
                             or bias.device != q.device):
        raise ValueError("beam_attention: bias {} {} on {} must be [heads x d_head = {}], {} on {}".format(
            tuple(bias.shape), bias.dtype, bias.device, q.shape[1] * q.shape[3], q.dtype, q.device))
    run = BEAM_ATTENTION_ROUTE.pick(q)
    if run is beam_attention_reference:
        return run(q, k, v, mask, bias, scaling)
    if not _kernel_fits(q, k, v, mask):
        return attention(scaled_query(q, bias, scaling), k, v, mask, 0.0, False, exact_row_term=True)
    return run(q, k, v, mask, None if bias is None else bias.contiguous(), scaling)
