"""Beam search's bookkeeping after the candidates are chosen, in place on the search's state.

beam_advance(values, indices, t, state, parents, eos, pad, vocab, len_penalty, normalize, advance) for a step of
fairseq's BeamSearch with k beams, after ops.beam_select gave each sentence's 2k best candidates
(``values`` [B, 2k] fp32, the cumulative scores; ``indices`` [B, 2k] int64, beam x vocab + token):
1. finish (fairseq's finalize_hypos): each end-of-sentence candidate among the first k whose
   value is not -inf, of a sentence not yet done, takes the sentence's next free slot while it
   has one; its hypothesis is written whole (the parent beam's tokens before the step, EOS at it,
   padding after; positional scores likewise), with the score divided by (t + 1) ** len_penalty
   where ``normalize``, and the length t + 1. A sentence is done once its k slots are full.
2. advance (``advance``; not at the last step): the first k candidates that do not end the
   sentence continue (fairseq's active_hypos): ``parents`` gets each new hypothesis's parent row,
   the token histories and positional scores are reordered into the new beam order, and the
   candidate's token (at t + 1), its cumulative score (``cum``, and the scores at t) written.
``t`` is the step, a 0-d int64 tensor on the state's device: nothing is read back to the host,
so a CUDA graph of a step replays at every step.

``state``: an object with these tensors (B sentences, k beams, N = B k hypotheses, L positions):
tokens [N, L + 1] int64 (BOS first), scores [N, L] fp32, cum [N] fp32, done [B] bool, count [B]
int64, fin_tokens [B, k + 1, L] int64, fin_positional [B, k + 1, L] fp32, fin_score [B, k + 1] fp32,
fin_length [B, k + 1] int64 (slot k takes what is not kept: its contents are undefined); and
``parents`` [N] int64 (written).

The reference is the search's torch ops: fairseq's steps as batched tensor ops (some 60 small
kernels a step on a GPU); the kernel (csrc/beam_advance.cu) does the same in one launch, one block
a sentence.
"""
import math

import torch

from ls_fairseq.ops import dispatch
from ls_fairseq.ops.dispatch import _C

STATE = ("tokens", "scores", "cum", "done", "count", "fin_tokens", "fin_positional", "fin_score", "fin_length")


def beam_advance_reference(values, indices, t, tokens, scores, cum, done, count, fin_tokens, fin_positional,
                           fin_score, fin_length, parents, eos, pad, vocab, len_penalty, normalize, advance):
    B, k2 = values.shape
    k = k2 // 2
    device = values.device
    beam_offsets = torch.arange(0, B * k, k, device=device)[:, None]
    cand_beams, cand_tokens = indices // vocab, indices % vocab
    eos_mask = cand_tokens.eq(eos) & values.ne(-math.inf)

    # finish: the first k candidates' end-of-sentence ones, in the sentence's next free slots
    new = eos_mask[:, :k] & ~done[:, None]
    rank = count[:, None] + new.cumsum(1) - 1
    slot = torch.where(new & rank.lt(k), rank, k)  # slot k: discarded
    L = fin_tokens.shape[2]
    rows = (cand_beams[:, :k] + beam_offsets).reshape(-1)
    position = torch.arange(L, device=device)
    before, at = position.lt(t), position.eq(t)
    history = tokens[rows, 1 : L + 1].view(B, k, L)
    finished = torch.where(before, history, torch.where(at, eos, pad))
    positional = torch.where(before, scores[rows].view(B, k, L), torch.where(at, values[:, :k, None], 0.0))
    length = t + 1
    # the length penalty in double, rounded once, as fairseq's (step + 1) ** lenpen becomes a float scalar
    score = values[:, :k] / length.double().pow(len_penalty).float() if normalize else values[:, :k]
    where = slot[:, :, None].expand(-1, -1, L)
    fin_tokens.scatter_(1, where, finished)
    fin_positional.scatter_(1, where, positional)
    fin_score.scatter_(1, slot, score)
    fin_length.scatter_(1, slot, length.expand(slot.shape))
    count += (new & rank.lt(k)).sum(1)
    done |= count.ge(k)
    if not advance:
        return

    # advance: the first k candidates that do not end the sentence continue; whole rows of the
    # histories are copied, so that no shape depends on the step
    offsets = torch.arange(k2, device=device)
    active = torch.topk(eos_mask * k2 + offsets, k, dim=1, largest=False).indices
    parents.copy_((cand_beams.gather(1, active) + beam_offsets).view(-1))
    tokens.copy_(tokens.index_select(0, parents))
    tokens.scatter_(1, (t + 1).expand(parents.shape[0], 1), cand_tokens.gather(1, active).view(-1, 1))
    scores.copy_(scores.index_select(0, parents))
    cum.copy_(values.gather(1, active).view(-1))
    scores.scatter_(1, t.expand(parents.shape[0], 1), cum[:, None])


def beam_advance_kernel(values, indices, t, tokens, scores, cum, done, count, fin_tokens, fin_positional, fin_score,
                        fin_length, parents, eos, pad, vocab, len_penalty, normalize, advance):
    _C.beam_advance(values, indices, t.view(1), tokens, scores, cum, done, count, fin_tokens, fin_positional, fin_score,
                    fin_length, parents, eos, pad, vocab, float(len_penalty), bool(normalize), bool(advance))


# an extension built before this op (dispatch warns that it is older than its sources): the reference
BEAM_ADVANCE_ROUTE = dispatch.Route(
    "beam_advance",
    kernel=beam_advance_kernel if _C is not None and hasattr(_C, "beam_advance") else None,
    reference=beam_advance_reference,
)


def beam_advance(values, indices, t, state, parents, eos, pad, vocab, len_penalty=1.0, normalize=True, advance=True):
    """See the module docstring."""
    tensors = [getattr(state, name) for name in STATE]
    B, k2 = values.shape if values.dim() == 2 else (0, 0)
    k = k2 // 2
    if B == 0 or k2 % 2 or indices.shape != values.shape or values.dtype != torch.float32 or indices.dtype != torch.int64:
        raise ValueError("beam_advance: values {} {} and indices {} {} must be fp32 and int64 [sentences, 2 x beam]".format(
            values.dtype, tuple(values.shape), indices.dtype, tuple(indices.shape)))
    tokens, fin_tokens = state.tokens, state.fin_tokens
    N, L = B * k, fin_tokens.shape[-1]
    expected = dict(tokens=(N, L + 1), scores=(N, L), cum=(N,), done=(B,), count=(B,), fin_tokens=(B, k + 1, L),
                    fin_positional=(B, k + 1, L), fin_score=(B, k + 1), fin_length=(B, k + 1))
    for name, tensor in zip(STATE, tensors):
        if tuple(tensor.shape) != expected[name] or tensor.device != values.device:
            raise ValueError("beam_advance: state.{} {} on {}; expected {} on {}".format(
                name, tuple(tensor.shape), tensor.device, expected[name], values.device))
    if tuple(parents.shape) != (N,) or t.dim() != 0 or t.dtype != torch.int64:
        raise ValueError("beam_advance: parents {} must be [{}] and t a 0-d int64 tensor, got {} {}".format(
            tuple(parents.shape), N, t.dtype, tuple(t.shape)))
    run = BEAM_ADVANCE_ROUTE.pick(values)
    if run is not beam_advance_reference and (k > _C.beam_advance_max_beam
                                              or not all(x.is_contiguous() for x in tensors + [values, indices, parents])):
        run = beam_advance_reference  # the kernel: contiguous tensors, beams that fit its fixed shared arrays
    run(values, indices, t, *tensors, parents, eos, pad, vocab, len_penalty, normalize, advance)
