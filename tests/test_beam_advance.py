"""ops.beam_advance: beam search's bookkeeping after the candidates, against a sentence-by-sentence
loop over fairseq's rules (the reference) and against the reference (the kernel, on a GPU), on
random states: sentences done or not, end-of-sentence candidates, -inf
values, steps at the start and the end, rows of 1 to 301 positions."""
import math
from types import SimpleNamespace

import pytest
import torch
from helpers import DEVICES

from ls_fairseq.ops.beam_advance import STATE, beam_advance, beam_advance_reference

EOS, PAD = 2, 1


def random_state(B, k, L, V, device, eos_rate=0.3, done_rate=0.2):
    """A search's state and a step's candidates as ops.beam_select leaves them (values sorted, some
    -inf), with the step t."""
    N = B * k
    done = torch.rand(B) < done_rate
    s = SimpleNamespace(
        tokens=torch.randint(3, V, (N, L + 1)),
        scores=torch.randn(N, L),
        cum=torch.randn(N),
        done=done,
        count=torch.where(done, torch.full((B,), k), torch.randint(0, k, (B,))),
        fin_tokens=torch.randint(0, V, (B, k + 1, L)),
        fin_positional=torch.randn(B, k + 1, L),
        fin_score=torch.randn(B, k + 1),
        fin_length=torch.randint(0, L, (B, k + 1)),
    )
    values = torch.randn(B, 2 * k).sort(dim=1, descending=True).values
    values[torch.rand(B, 2 * k) < 0.1] = -math.inf
    tokens = torch.where(torch.rand(B, 2 * k) < eos_rate, EOS, torch.randint(0, V, (B, 2 * k)))
    indices = torch.randint(0, k, (B, 2 * k)) * V + tokens
    t = torch.tensor(int(torch.randint(0, L, ())))
    for name in STATE:
        setattr(s, name, getattr(s, name).to(device))
    return s, values.to(device), indices.to(device), t.to(device), torch.zeros(N, dtype=torch.long, device=device)


def copy_state(s):
    return SimpleNamespace(**{name: getattr(s, name).clone() for name in STATE})


def loop_oracle(values, indices, t, s, V, len_penalty, normalize, advance):
    """fairseq's finalize_hypos and active_hypos, a sentence and a candidate at a time: (state, parents)."""
    s = copy_state(s)
    B, k2 = values.shape
    k, L, t = k2 // 2, s.fin_tokens.shape[2], int(t)
    old_tokens, old_scores = s.tokens.clone(), s.scores.clone()
    parents = torch.zeros(B * k, dtype=torch.long)
    for b in range(B):
        ends = [int(indices[b, j]) % V == EOS and float(values[b, j]) != -math.inf for j in range(k2)]
        if not bool(s.done[b]):
            for j in range(k):
                if ends[j] and int(s.count[b]) < k:
                    slot, row = int(s.count[b]), b * k + int(indices[b, j]) // V
                    s.fin_tokens[b, slot] = PAD
                    s.fin_tokens[b, slot, :t] = old_tokens[row, 1 : t + 1]
                    s.fin_tokens[b, slot, t] = EOS
                    s.fin_positional[b, slot] = 0.0
                    s.fin_positional[b, slot, :t] = old_scores[row, :t]
                    s.fin_positional[b, slot, t] = values[b, j]
                    penalty = float(torch.tensor((t + 1) ** len_penalty, dtype=torch.float64).float())
                    s.fin_score[b, slot] = values[b, j] / penalty if normalize else values[b, j]
                    s.fin_length[b, slot] = t + 1
                    s.count[b] += 1
            s.done[b] = bool(s.count[b] >= k)
        if not advance:
            continue
        active = ([j for j in range(k2) if not ends[j]] + [j for j in range(k2) if ends[j]])[:k]
        for i, j in enumerate(active):
            n, parent = b * k + i, b * k + int(indices[b, j]) // V
            parents[n] = parent
            s.tokens[n] = old_tokens[parent]
            s.tokens[n, t + 1] = int(indices[b, j]) % V
            s.scores[n] = old_scores[parent]
            s.scores[n, t] = values[b, j]
            s.cum[n] = values[b, j]
    return s, parents


def assert_same(a, pa, b, pb, exact_scores=True):
    """Two states equal (the discard slot k of the finished buffers aside) and the parents; the finished
    scores within 1e-6 unless ``exact_scores`` (a GPU's pow of the length penalty may differ by an ulp)."""
    for name in STATE:
        x, y = getattr(a, name), getattr(b, name)
        if name.startswith("fin_"):
            x, y = x[:, :-1], y[:, :-1]
        if name == "fin_score" and not exact_scores:
            torch.testing.assert_close(x.cpu(), y.cpu(), rtol=1e-6, atol=0, msg=name)
        else:
            assert torch.equal(x.cpu(), y.cpu()), name
    assert torch.equal(pa.cpu(), pb.cpu())


@pytest.mark.parametrize("B,k,L", [(1, 1, 1), (3, 4, 9), (7, 5, 201), (2, 2, 300)])
@pytest.mark.parametrize("normalize,advance", [(True, True), (False, True), (True, False)])
def test_reference_follows_fairseqs_rules_a_sentence_at_a_time(B, k, L, normalize, advance):
    V = 11
    s, values, indices, t, parents = random_state(B, k, L, V, "cpu")
    expected, expected_parents = loop_oracle(values, indices, t, s, V, 0.6, normalize, advance)
    beam_advance(values, indices, t, s, parents, EOS, PAD, V, 0.6, normalize, advance)
    assert_same(s, parents, expected, expected_parents)


def test_a_full_sentence_takes_no_more_hypotheses_and_is_done():
    """Two free slots and three end-of-sentence candidates among the first beam: the first two are
    kept in order, the sentence is done, and the third is dropped."""
    V, k = 11, 4
    s, values, indices, t, parents = random_state(1, k, 6, V, "cpu", done_rate=0.0)
    s.count[0] = 2
    indices[0, :k] = torch.tensor([EOS, V + EOS, 5, 2 * V + EOS])
    values[0] = torch.arange(2 * k, 0, -1).float()
    beam_advance(values, indices, t, s, parents, EOS, PAD, V, 1.0, False, True)
    assert int(s.count[0]) == 4 and bool(s.done[0])
    assert s.fin_score[0, 2:4].tolist() == values[0, [0, 1]].tolist()
    assert int(s.fin_length[0, 2]) == int(t) + 1 and int(s.fin_tokens[0, 2, int(t)]) == EOS


def test_bad_shapes_are_named():
    s, values, indices, t, parents = random_state(2, 3, 5, 11, "cpu")
    s.cum = s.cum[:-1]
    with pytest.raises(ValueError, match=r"beam_advance: state.cum \(5,\)"):
        beam_advance(values, indices, t, s, parents, EOS, PAD, 11)
    with pytest.raises(ValueError, match="must be fp32 and int64"):
        beam_advance(values.double(), indices, t, s, parents, EOS, PAD, 11)


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "cpu"])
@pytest.mark.parametrize("B,k,L", [(1, 1, 1), (13, 4, 201), (5, 5, 129), (3, 32, 300), (128, 4, 64)])
@pytest.mark.parametrize("normalize,advance", [(True, True), (False, True), (True, False)])
def test_kernel_equals_the_reference(device, B, k, L, normalize, advance):
    from ls_fairseq.ops import dispatch

    V = 32000
    s, values, indices, t, parents = random_state(B, k, L, V, device)
    ref, ref_parents = copy_state(s), parents.clone()
    beam_advance_reference(values, indices, t, *(getattr(ref, n) for n in STATE), ref_parents, EOS, PAD, V, 0.6,
                           normalize, advance)
    assert dispatch.use_kernel("beam_advance", values)
    beam_advance(values, indices, t, s, parents, EOS, PAD, V, 0.6, normalize, advance)
    assert_same(s, parents, ref, ref_parents, exact_scores=False)
