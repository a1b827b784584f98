"""One decoding step's self-attention over a key/value cache that beam search never reorders.

decode_attention(q, cache, layer, origin, length, k=None, v=None, bias=None, scaling=1.0)
-> [N, heads, 1, d_head]:
- q [N, heads, 1, d_head]: the query of each of N hypotheses at this step, already scaled unless
  ``bias`` or ``scaling`` are given (below);
- cache [capacity, 2 x layers, slots, heads, d_head]: at position p and slot s, the keys (2 x layer)
  and values (2 x layer + 1) that the hypothesis in slot s at step p wrote;
- origin int32 [>= N, >= length]: hypothesis n's position p is in slot origin[n, p];
- length: an int, or a 0-d int64 tensor on q's device (read by the kernel there, so that a CUDA
  graph of a decoding step replays at any step; the reference reads it on the host).
- k, v (both or neither), laid out as q: the step's own keys and values, first written into the
  cache at position length - 1 of slots 0..N-1 (where ``origin`` must then place them), so that
  the cache write is part of the kernel and not a launch of its own.
- bias [3 x heads x d_head] (with k and v only) and ``scaling`` (q is multiplied by it, with or
  without a bias): q, k and v are then the qkv projection's output without its bias (views of one [N, 3 x heads x d_head] GEMM output): the op
  adds q's, k's and v's part of the bias and scales q, in fp32, each rounded to the dtype as
  ops.split_heads does, so the step needs no split_heads launch and gets the same values.
Each hypothesis attends to its positions 0..length-1 through its own row of ``origin``.

Beam search reorders hypotheses at every step. Copying the cache into the new order (fairseq's
reorder_incremental_state, an index_select of every layer's keys and values) moves the whole
cache once a step, a cost that grows with the square of the output length. Here the step copies
``origin`` instead (4 bytes a position, not 4 x layers x width), and the kernel
(csrc/decode_attention.cu) gathers each hypothesis's keys and values as it reads them. The
reference gathers them with indexing and calls ``ops.attention``.
"""
import torch

from ls_fairseq.ops import dispatch
from ls_fairseq.ops.attention import attention
from ls_fairseq.ops.dispatch import _C


def gather_history(cache, layer, origin, length):
    """(keys, values) [N, heads, length, d_head] of each hypothesis, gathered through ``origin``."""
    N = origin.shape[0]
    slots = origin[:, :length].long()
    positions = torch.arange(length, device=cache.device).expand(N, length)
    keys = cache[positions, 2 * layer, slots].permute(0, 2, 1, 3)
    values = cache[positions, 2 * layer + 1, slots].permute(0, 2, 1, 3)
    return keys, values


def write_step(cache, layer, k, v, length):
    """k and v [N, heads, 1, d_head] into ``cache`` at position length - 1 of slots 0..N-1 (a device
    length is not read on the host)."""
    N = k.shape[0]
    at = (length - 1).view(1) if torch.is_tensor(length) else torch.tensor([length - 1], device=cache.device)
    for part, t in ((0, k), (1, v)):
        cache.select(1, 2 * layer + part)[:, :N].index_copy_(0, at, t[None, :, :, 0])


def add_bias(q, k, v, bias, scaling):
    """(q + its bias) x scaling, k + its bias, v + its bias, computed in fp32 (at least) and rounded to
    the dtype as ops.split_heads's reference does."""
    N, H, _, D = q.shape
    parts = dispatch.upcast(bias).view(3, 1, H, 1, D)
    return tuple(((dispatch.upcast(t) + b) * s).to(t.dtype) for t, b, s in zip((q, k, v), parts, (scaling, 1, 1)))


def decode_attention_reference(q, cache, layer, origin, length, k=None, v=None, bias=None, scaling=1.0):
    if bias is not None:
        q, k, v = add_bias(q, k, v, bias, scaling)
    elif scaling != 1.0:
        q = (dispatch.upcast(q) * scaling).to(q.dtype)
    if k is not None:
        write_step(cache, layer, k, v, length)
    keys, values = gather_history(cache, layer, origin[: q.shape[0]], int(length))
    return attention(q, keys, values, None, 0.0, False)


def decode_attention_kernel(q, cache, layer, origin, length, k=None, v=None, bias=None, scaling=1.0):
    if torch.is_tensor(length):
        return _C.decode_attention(q, cache, layer, origin, min(cache.shape[0], origin.shape[1]), length.view(1), k, v,
                                   bias, scaling)
    return _C.decode_attention(q, cache, layer, origin, length, None, k, v, bias, scaling)


DECODE_ATTENTION_ROUTE = dispatch.Route(
    "decode_attention",
    kernel=decode_attention_kernel if _C else None,
    reference=decode_attention_reference,
)

HEAD_DIMS = (32, 64, 128, 256)  # the kernel's; others take the reference


def laid_out_for_kernel(t):
    """Whether ``t`` [N, heads, 1, d_head] has the kernel's layout: heads x d_head contiguous, 16-byte rows."""
    return (t.shape[3] in HEAD_DIMS and t.stride(3) == 1 and t.stride(1) == t.shape[3] and t.stride(0) % 8 == 0
            and t.data_ptr() % 16 == 0)


def decode_attention(q, cache, layer, origin, length, k=None, v=None, bias=None, scaling=1.0):
    """See the module docstring."""
    if q.dim() != 4 or q.shape[2] != 1 or cache.dim() != 5 or cache.shape[3:] != q.shape[1:2] + q.shape[3:]:
        raise ValueError("decode_attention: q {} must be [hypotheses, heads, 1, d_head] and cache {} [capacity, "
                         "2 x layers, slots, heads, d_head]".format(tuple(q.shape), tuple(cache.shape)))
    if (k is None) != (v is None):
        raise ValueError("decode_attention: the step's k and v come together")
    if k is not None and (k.shape != q.shape or v.shape != q.shape or q.shape[0] > cache.shape[2]
                          or k.dtype != cache.dtype or v.dtype != cache.dtype):
        raise ValueError("decode_attention: k {} and v {} must be {} like q, for at most the cache's {} slots".format(
            tuple(k.shape), tuple(v.shape), tuple(q.shape), cache.shape[2]))
    if bias is not None and k is None:
        raise ValueError("decode_attention: a bias comes with the step's k and v")
    if bias is not None and (bias.shape != (3 * q.shape[1] * q.shape[3],) or bias.dtype != q.dtype
                             or bias.device != q.device):
        raise ValueError("decode_attention: bias {} {} on {} must be [3 x heads x d_head = {}], {} on {}".format(
            tuple(bias.shape), bias.dtype, bias.device, 3 * q.shape[1] * q.shape[3], q.dtype, q.device))
    if torch.is_tensor(length):
        if length.dtype != torch.int64 or length.numel() != 1 or length.device != q.device:
            raise ValueError("decode_attention: a length tensor must be one int64 on {}, got {} {} on {}".format(
                q.device, length.dtype, tuple(length.shape), length.device))
        bound = cache.shape[0]  # the value itself is checked by nobody: the host does not read it
    else:
        bound = length
    if not 0 <= layer < cache.shape[1] // 2 or not 1 <= bound <= cache.shape[0]:
        raise ValueError("decode_attention: layer {} of {}, length {} of a capacity of {}".format(
            layer, cache.shape[1] // 2, length, cache.shape[0]))
    if origin.dtype != torch.int32 or origin.dim() != 2 or origin.shape[0] < q.shape[0] or origin.shape[1] < bound:
        raise ValueError("decode_attention: origin {} {} must be int32 [>= {}, >= {}]".format(
            origin.dtype, tuple(origin.shape), q.shape[0], bound))
    run = DECODE_ATTENTION_ROUTE.pick(q)
    if run is not decode_attention_reference and not (
            laid_out_for_kernel(q) and (k is None or k.stride() == v.stride() and laid_out_for_kernel(k))
            and (bias is None or bias.is_contiguous())):
        run = decode_attention_reference
    return run(q, cache, layer, origin, length, k, v, bias, scaling)
