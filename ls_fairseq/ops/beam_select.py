"""Beam search's candidate selection, the hierarchical way of LightSeq (HARS: hierarchical
auto-regressive search, arXiv 2010.13887).

beam_select(scores [R, M], k) -> (values [R, k], indices [R, k]): the k largest entries of each
row, largest first; equal values in index order, lowest index first (torch.topk's values, with its
unspecified order among ties made one order). For a beam search a row is one sentence's
beams x vocabulary cumulative scores.

The algorithm, which the kernel (csrc/beam_select.cu, one block a row) and the reference (torch
ops) both run:
1. the row is cut into ``groups`` (at least k) runs of consecutive entries, and the maximum of
   each is taken;
2. the k-th largest of these maxima is a threshold at or below the row's k-th largest entry
   (k groups hold an entry at or above it), so every entry of the answer is at or above it;
3. only the entries at or above the threshold are candidates (a kernel writes them into a small
   buffer: at least k, few more in practice), and their k largest, in order, are the answer.

The order among equal values is made total by comparing int64 keys: the float's bits mapped
to an integer of the same order (-0.0 taken as +0.0), then the index, lower first. -inf is an
ordinary value (below every finite one); NaN is not allowed (beam search turns it into -inf
first). Shapes depend on R, M and k only; nothing is read back to the host.
"""
import torch

from ls_fairseq.ops import dispatch
from ls_fairseq.ops.dispatch import _C

_LOW_BITS = (1 << 32) - 1
_MIN_KEY = torch.iinfo(torch.int64).min
DEFAULT_GROUPS = 32


def order_keys(scores):
    """int64 keys [R, M] of float scores, unique within a row: larger value -> larger key, equal
    values -> the lower index has the larger key."""
    bits = (scores.float() + 0.0).view(torch.int32).to(torch.int64)  # + 0.0 turns -0.0 into +0.0
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: larger magnitude, lower key
    index = torch.arange(scores.shape[-1], device=scores.device)
    return ordered * (1 << 32) + (_LOW_BITS - index)


def group_threshold(keys, k, groups):
    """Per row, the k-th largest of the maxima of ``groups`` runs of consecutive keys [R, 1]."""
    R, M = keys.shape
    size = -(-M // groups)
    padded = torch.nn.functional.pad(keys, (0, groups * size - M), value=_MIN_KEY)
    maxima = padded.view(R, -1, size).amax(-1)
    return maxima.topk(k, dim=1).values[:, -1:]


def beam_select_reference(scores, k, groups=DEFAULT_GROUPS):
    keys = order_keys(scores)
    threshold = group_threshold(keys, k, max(min(groups, scores.shape[1]), k))
    candidates = torch.where(keys >= threshold, keys, torch.full_like(keys, _MIN_KEY))
    top = candidates.topk(k, dim=1).values
    indices = _LOW_BITS - (top & _LOW_BITS)
    return scores.gather(1, indices), indices


BEAM_SELECT_ROUTE = dispatch.Route(
    "beam_select",
    kernel=_C.beam_select if _C else None,
    reference=beam_select_reference,
)


def beam_select(scores, k, groups=DEFAULT_GROUPS):
    """The k largest entries of each row of ``scores`` [R, M] (fp32, fp16 or bf16), largest first,
    ties in index order: (values [R, k] in scores' dtype, indices [R, k] int64). ``groups``: how many
    runs the threshold of step 1 is taken over (at least k are)."""
    if scores.dim() != 2 or not 1 <= k <= scores.shape[1]:
        raise ValueError("beam_select: scores {} must be [rows, entries] with 1 <= k = {} <= entries".format(
            tuple(scores.shape), k))
    if scores.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError("beam_select: scores are {}; fp32, fp16 or bf16 expected".format(scores.dtype))
    if scores.shape[1] >= 1 << 32:
        raise ValueError("beam_select: rows of {} entries; fewer than 2^32".format(scores.shape[1]))
    select = BEAM_SELECT_ROUTE.pick(scores)
    if select is not beam_select_reference and max(min(groups, scores.shape[1]), k) > _C.beam_select_max_groups:
        select = beam_select_reference  # the kernel keeps the runs' maxima in shared memory
    return select(scores.contiguous(), k, groups)
