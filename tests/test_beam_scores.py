"""The beam_scores op (an ordinary step's log-probabilities with fairseq's rules, plus the cumulative
scores): the reference against the generator's torch ops written out, and the CUDA kernel against
the reference in fp64 by the error rule, with NaN, -inf and +inf rows, odd vocabularies and a step
read from the device."""
import math

import pytest
import torch
from helpers import kernel, poison

from ls_fairseq.ops.beam_scores import BEAM_SCORES_ROUTE, beam_scores, beam_scores_reference


def written_out(logits, cum, t, pad, unk, unk_penalty, eos, min_len):
    """fairseq's per-step rules one by one, in fp64."""
    lprobs = torch.log_softmax(logits.double(), dim=-1)
    lprobs[lprobs.isnan()] = -math.inf
    lprobs[:, pad] = -math.inf
    lprobs[:, unk] -= unk_penalty
    if int(t) < min_len:
        lprobs[:, eos] = -math.inf
    return lprobs + cum.double()[:, None]


def inputs(rows, vocab, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype).to(device)
    cum = (-torch.rand(rows, generator=g) * 10).to(device)
    return logits, cum


@pytest.mark.parametrize("t,min_len,unk_penalty", [(0, 1, 0.0), (3, 2, 0.5), (1, 5, 2.0)])
def test_reference_applies_fairseqs_rules(t, min_len, unk_penalty):
    logits, cum = inputs(6, 37, torch.float64)
    logits[2, 5] = float("nan")  # a NaN row: every score -inf, as fairseq's NaN -> -inf makes it
    for step in (t, torch.tensor(t)):
        out = beam_scores(logits, cum, step, 1, 3, unk_penalty, 2, min_len)
        torch.testing.assert_close(out, written_out(logits, cum, t, 1, 3, unk_penalty, 2, min_len), rtol=1e-12,
                                   atol=1e-12)
    assert out[2].eq(-math.inf).all()


def test_rejects_bad_input():
    logits, cum = inputs(3, 10)
    with pytest.raises(ValueError, match="cum"):
        beam_scores(logits, cum[:2], 0, 1, 3, 0.0, 2, 1)
    with pytest.raises(ValueError, match="columns"):
        beam_scores(logits, cum, 0, 1, 10, 0.0, 2, 1)
    with pytest.raises(ValueError, match="step"):
        beam_scores(logits, cum, torch.tensor(0.0), 1, 3, 0.0, 2, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 8), (7, 37), (512, 8000), (20, 44_001), (3, 5)])
def test_kernel_against_fp64(dtype, rows, vocab):
    """The kernel's scores against the rules in fp64 on the same (rounded) logits: within twice what
    torch's own log_softmax in fp32 over the same logits errs by (the reference path), and exactly -inf
    where fairseq's are; a step on the device equals the same step given as an int."""
    seed = torch.randint(0, 2**31, ()).item()
    print("seed", seed)
    logits, cum = inputs(rows, vocab, dtype, "cuda", seed)
    if rows >= 7:
        logits[1, 3] = float("nan")
        logits[2] = -math.inf
        logits[3, :2] = -math.inf
        logits[4, 1] = math.inf
    kernel("beam_scores", logits)
    assert BEAM_SCORES_ROUTE.pick(logits) is not beam_scores_reference
    pad, unk, eos = 1 % vocab, 3 % vocab, 2 % vocab
    poison()
    for t, min_len in ((0, 1), (4, 2)):
        out = beam_scores(logits, cum, torch.tensor(t, device="cuda"), pad, unk, 0.7, eos, min_len)
        assert torch.equal(out, beam_scores(logits, cum, t, pad, unk, 0.7, eos, min_len))
        ref64 = written_out(logits.cpu(), cum.cpu(), t, pad, unk, 0.7, eos, min_len)
        ref32 = beam_scores_reference(logits, cum, t, pad, unk, 0.7, eos, min_len).double().cpu()
        got = out.double().cpu()
        assert torch.equal(got.isinf() & (got < 0), ref64.isinf() & (ref64 < 0))
        finite = ref64.isfinite()
        err, torch_err = (got - ref64)[finite].abs().max(), (ref32 - ref64)[finite].abs().max()
        assert err <= 2 * torch_err + 1e-6, (err, torch_err)
