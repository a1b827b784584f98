"""A beam search step's candidate scores from the decoder's logits, in one pass.

beam_scores(logits [N, V], cum [N] fp32, t, pad, unk, unk_penalty, eos, min_len) -> [N, V] fp32
(fp64 for fp64 logits, the tests' oracle):
fairseq's per-step log-probabilities of an ordinary step (log-softmax in fp32, NaN -> -inf, no pad,
the unk penalty, end-of-sentence barred while the step ``t`` is below ``min_len``) plus each
hypothesis's cumulative score, what beam_select then reads. ``t``: an int, or a 0-d int64 tensor on
the logits' device (read there, so that a CUDA graph of the step replays at every step).

In torch ops that is a log_softmax, a nan_to_num, two or three column writes and an add: five or
more launches and four passes over an [N, V] fp32 array. The reference is that sequence, the one
LSSequenceGenerator ran before; a kernel reads each row of logits twice (its maximum and sum, then
the scores) and writes the scores once.
"""
import math

import torch
import torch.nn.functional as F

from ls_fairseq.ops import dispatch
from ls_fairseq.ops.dispatch import _C


def beam_scores_reference(logits, cum, t, pad, unk, unk_penalty, eos, min_len):
    lprobs = F.log_softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))  # fp64 stays
    torch.nan_to_num_(lprobs, nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    lprobs[:, pad] = -math.inf
    if unk_penalty:
        lprobs[:, unk] -= unk_penalty
    if min_len > 0:
        barred = t < min_len if torch.is_tensor(t) else torch.tensor(t < min_len, device=lprobs.device)
        lprobs[:, eos].masked_fill_(barred, -math.inf)
    return lprobs.add_(cum[:, None])


def beam_scores_kernel(logits, cum, t, pad, unk, unk_penalty, eos, min_len):
    on_device = torch.is_tensor(t)
    return _C.beam_scores(logits.contiguous(), cum.contiguous(), t.view(1) if on_device else None,
                          0 if on_device else int(t), pad, unk, unk_penalty, eos, min_len)


BEAM_SCORES_ROUTE = dispatch.Route(
    "beam_scores",
    kernel=beam_scores_kernel if _C else None,
    reference=beam_scores_reference,
)


def beam_scores(logits, cum, t, pad, unk, unk_penalty, eos, min_len):
    """See the module docstring."""
    if logits.dim() != 2 or cum.shape != logits.shape[:1] or cum.dtype != torch.float32:
        raise ValueError("beam_scores: logits {} must be [hypotheses, vocabulary] and cum {} {} float32 [{}]".format(
            tuple(logits.shape), cum.dtype, tuple(cum.shape), logits.shape[0]))
    if not all(0 <= i < logits.shape[1] for i in (pad, unk, eos)):
        raise ValueError("beam_scores: pad {}, unk {} and eos {} must be columns of {}".format(
            pad, unk, eos, logits.shape[1]))
    if torch.is_tensor(t) and (t.dtype != torch.int64 or t.numel() != 1 or t.device != logits.device):
        raise ValueError("beam_scores: a step tensor must be one int64 on {}, got {} {} on {}".format(
            logits.device, t.dtype, tuple(t.shape), t.device))
    return BEAM_SCORES_ROUTE.pick(logits)(logits, cum, t, pad, unk, float(unk_penalty), eos, int(min_len))
