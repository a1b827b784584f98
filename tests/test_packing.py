"""--ls-packed: the packed training step against the padded one (loss and every parameter gradient),
the packing of fairseq's batches, and the capacities that fix the shapes for CUDA graphs."""
import argparse
import types

import numpy as np
import pytest
import torch
from model_utils import dictionary, model_args

from ls_fairseq import ops, packing
from ls_fairseq.criterions.ls_label_smoothed_cross_entropy import LSLabelSmoothedCrossEntropyCriterion
from ls_fairseq.models.ls_transformer import LSTransformerModel
from ls_fairseq.models.ls_transformer import base_architecture as ls_base
from ls_fairseq.ops import segment_attention as seg

VARIANTS = {
    "post-ln relu sinusoidal shared": dict(share_all_embeddings=True),
    "pre-ln gelu learned": dict(encoder_normalize_before=True, decoder_normalize_before=True,
                                activation_fn="gelu", encoder_learned_pos=True, decoder_learned_pos=True),
    "post-ln separate embeddings learned": dict(encoder_learned_pos=True, decoder_learned_pos=True),
    "pre-ln shared decoder in/out": dict(encoder_normalize_before=True, decoder_normalize_before=True,
                                         share_decoder_input_output_embed=True, no_scale_embedding=True),
}
MAX_POSITIONS = 16


def build(dtype=torch.float64, **overrides):
    d = dictionary()
    task = types.SimpleNamespace(source_dictionary=d, target_dictionary=d,
                                 cfg=types.SimpleNamespace(left_pad_target=False))
    args = argparse.Namespace(**model_args(max_source_positions=MAX_POSITIONS, max_target_positions=MAX_POSITIONS,
                                           **overrides))
    ls_base(args)
    model = LSTransformerModel.build_model(args, task).to(dtype)
    model.train()
    return model, task


def collate(task, src_lengths, tgt_lengths, generator):
    """A batch as fairseq's translation collater makes it: sources left-padded, prev_output_tokens and
    targets right-padded, sentences in the given order."""
    d = task.source_dictionary
    B, S, T = len(src_lengths), max(src_lengths), max(tgt_lengths)
    src = torch.full((B, S), d.pad())
    prev = torch.full((B, T), d.pad())
    target = torch.full((B, T), d.pad())
    for b, (ls, lt) in enumerate(zip(src_lengths, tgt_lengths)):
        src[b, S - ls :] = torch.randint(d.nspecial, len(d), (ls,), generator=generator)
        src[b, -1] = d.eos()
        words = torch.randint(d.nspecial, len(d), (lt,), generator=generator)
        words[-1] = d.eos()
        target[b, :lt] = words
        prev[b, 0] = d.eos()
        prev[b, 1:lt] = words[:-1]
    return {"id": torch.arange(B), "nsentences": B, "ntokens": int(sum(tgt_lengths)),
            "net_input": {"src_tokens": src, "src_lengths": src.ne(d.pad()).sum(1), "prev_output_tokens": prev},
            "target": target}


def step(model, criterion, sample):
    model.zero_grad(set_to_none=True)
    loss, sample_size, log = criterion(model, sample)
    loss.backward()
    return loss.detach(), sample_size, log, {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_step(padded, packed):
    (loss, size, log, grads), (ploss, psize, plog, pgrads) = padded, packed
    assert abs(ploss.item() - loss.item()) <= 1e-6 * abs(loss.item()), (ploss.item(), loss.item())
    assert psize == size and plog["nsentences"] == log["nsentences"] and plog["ntokens"] == log["ntokens"]
    assert set(grads) == set(pgrads)
    for name, g in grads.items():
        err = (pgrads[name] - g).abs().max() / g.abs().max().clamp_min(1e-300)
        assert err <= 1e-5, (name, err.item())


BATCHES = {
    "mixed lengths": ([9, 3, 7, 1, 12], [7, 5, 1, 8, 4]),
    "one sentence": ([6], [4]),
    "length 1": ([1, 1, 1], [1, 1, 1]),
    "maximum length": ([MAX_POSITIONS, 2, MAX_POSITIONS], [MAX_POSITIONS, MAX_POSITIONS, 3]),
}


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_step_equals_padded_step(variant, batch, request):
    """fp64, dropout 0, the same batch: the same loss and the same gradient of every parameter."""
    model, task = build(**VARIANTS[variant])
    criterion = LSLabelSmoothedCrossEntropyCriterion(task, False, 0.1)
    generator = torch.Generator().manual_seed(request.node.ls_seed)
    sample = collate(task, *BATCHES[batch], generator)
    pad = task.source_dictionary.pad()
    packed = packing.pack_sample(sample, pad)
    assert packed["net_input"]["src_tokens"].shape[1] % 16 == 0
    assert packed["target"].ne(pad).sum() == sample["ntokens"]
    assert_same_step(step(model, criterion, sample), step(model, criterion, packed))


def test_sentence_average_and_ignored_prefix_count_as_padded(request):
    model, task = build()
    criterion = LSLabelSmoothedCrossEntropyCriterion(task, True, 0.1, ignore_prefix_size=2, report_accuracy=True)
    sample = collate(task, [5, 8, 3], [6, 2, 9], torch.Generator().manual_seed(request.node.ls_seed))
    padded, packed = step(model, criterion, sample), step(model, criterion, packing.pack_sample(sample, 1))
    assert padded[1] == packed[1] == 3
    assert padded[2]["n_correct"] == packed[2]["n_correct"] and padded[2]["total"] == packed[2]["total"]
    assert_same_step(padded, packed)


class _JunkTailGradient(torch.autograd.Function):
    """x as it is; the backward leaves the gradient's rows at ``tail`` as whatever the memory held (NaN
    here), as FlashAttention's varlen backward does with dq, dk and dv."""

    @staticmethod
    def forward(ctx, x, tail):
        ctx.tail = tail
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.masked_fill(ctx.tail[:, None, None], float("nan")), None


def fake_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=None, window_size=(-1, -1)):
    """FlashAttention's contract on the CPU: real rows attended within their segments, the rows past
    the last offset of the output and of the three gradients left as whatever the memory held (NaN here)."""
    assert scale == 1.0 and cu_seq_q.dtype == torch.int32 and query.is_contiguous()
    lengths = (cu_seq_q[1:] - cu_seq_q[:-1]).max().item(), (cu_seq_k[1:] - cu_seq_k[:-1]).max().item()
    assert lengths[0] <= max_q and lengths[1] <= max_k
    mask = ops.SegmentMask(cu_seq_q, cu_seq_k, max_q, max_k, causal=window_size == (-1, 0))
    q_tail, k_tail = mask.tail(query.shape[0]), mask.tail(key.shape[0], keys=True)
    query, key, value = (_JunkTailGradient.apply(x, tail) for x, tail in ((query, q_tail), (key, k_tail),
                                                                           (value, k_tail)))
    out = seg.segment_attention_reference(query.transpose(0, 1)[None], key.transpose(0, 1)[None],
                                          value.transpose(0, 1)[None], mask)[0].transpose(0, 1)
    return out.masked_fill(q_tail[:, None, None], float("nan"))


@pytest.mark.parametrize("attention", ["varlen", "triton"])
def test_bucketed_step_with_junk_tail_equals_padded_step(attention, monkeypatch, request):
    """Stream capacities, segment counts and longest segments fixed larger than the batch needs (as
    for CUDA graphs), the tail tokens random words instead of padding, and the attention of the
    varlen path (FlashAttention's contract, NaN in the rows of the output and the gradients it does not
    write) or of the Triton kernels (the GPU's path, here in Triton's interpreter): the same loss and
    gradients as the padded step."""
    if attention == "triton":
        if seg._triton_kernels() is None:
            pytest.skip("triton is not installed")
        monkeypatch.setattr(seg, "INTERPRET", True)
    model, task = build(**VARIANTS["pre-ln gelu learned"])
    criterion = LSLabelSmoothedCrossEntropyCriterion(task, False, 0.1)
    generator = torch.Generator().manual_seed(request.node.ls_seed)
    sample = collate(task, [9, 3, 7, 1, 12], [7, 5, 1, 8, 4], generator)
    buckets = packing.Buckets([(np.array([14, 14, 14, 9, 9, 9, 1, 1]), np.array([14, 14, 14, 14, 14, 9, 9, 1]))])
    packed = packing.pack_sample(sample, task.source_dictionary.pad(), buckets)
    net = packed["net_input"]
    assert net["src_tokens"].shape == (1, 80) and net["ls_src_offsets"].shape == (9,) and net["ls_src_max_len"] == 14
    for key in ("src_tokens", "prev_output_tokens"):
        tail = net[key].eq(1)
        net[key] = torch.where(tail, torch.randint(4, 40, tail.shape, generator=generator), net[key])
    if attention == "varlen":
        monkeypatch.setattr(seg, "varlen_fits", lambda *args: True)
        monkeypatch.setattr(seg, "varlen_attn", fake_varlen)
    assert_same_step(step(model, criterion, sample), step(model, criterion, packed))


def test_packing_keeps_sentences_tokens_and_positions():
    task = types.SimpleNamespace(source_dictionary=dictionary())
    sample = collate(task, [4, 2, 5], [3, 6, 1], torch.Generator().manual_seed(0))
    packed = packing.pack_sample(sample, 1)
    net = packed["net_input"]
    src, prev = sample["net_input"]["src_tokens"], sample["net_input"]["prev_output_tokens"]
    assert torch.equal(net["src_tokens"][0, :11], src[src.ne(1)]) and net["src_tokens"][0, 11:].eq(1).all()
    assert torch.equal(net["prev_output_tokens"][0, :10], prev[prev.ne(1)])
    assert net["ls_src_offsets"].tolist() == [0, 4, 6, 11] and net["ls_tgt_offsets"].tolist() == [0, 3, 9, 10]
    assert net["ls_src_offsets"].dtype == torch.int32
    assert net["ls_src_positions"][0, :11].tolist() == [2, 3, 4, 5, 2, 3, 2, 3, 4, 5, 6]
    assert (net["ls_src_max_len"], net["ls_tgt_max_len"]) == (5, 6)
    assert packed["id"] is sample["id"] and packed["ntokens"] == 10 and packed["nsentences"] == 3
    with pytest.raises(ValueError, match="different token counts"):
        bad = dict(sample, target=sample["target"][:, :2])
        packing.pack_sample(bad, 1)


def brute_force_waste(sizes, count, multiple=16):
    import itertools

    options = sorted(set(packing.round_up(s, multiple) for s in sizes))
    best = None
    for k in range(1, min(count, len(options)) + 1):
        for chosen in itertools.combinations(options, k):
            if chosen[-1] != options[-1]:
                continue
            waste = sum(packing.bucket(s, list(chosen)) - s for s in sizes)
            best = waste if best is None else min(best, waste)
    return best


@pytest.mark.parametrize("count", [1, 2, 3, 8])
def test_capacities_are_the_least_wasteful_partition(count, request):
    rng = np.random.default_rng(request.node.ls_seed)
    sizes = rng.integers(1, 200, rng.integers(1, 40))
    chosen = packing.capacities(sizes, count)
    assert len(chosen) <= count and all(c % 16 == 0 for c in chosen) and chosen == sorted(chosen)
    assert max(sizes) <= chosen[-1]
    assert sum(packing.bucket(s, chosen) - s for s in sizes) == brute_force_waste(sizes, count)


def test_buckets_fix_segments_and_longest_sentences():
    batches = [(np.array([5, 3]), np.array([4, 4])), (np.array([2, 2, 2]), np.array([3, 1, 1])),
               (np.array([30]), np.array([29]))]
    buckets = packing.Buckets(batches, count=1)
    assert buckets.src == [32] and buckets.tgt == [32]
    assert buckets.shape(np.array([5, 3]), np.array([4, 4])) == (32, 32, 8, 30, 29)
    # a batch larger than the epoch's: rounded up, its own segment count and lengths
    assert buckets.shape(np.array([40] * 9), np.array([1] * 9)) == (368, 32, 9, 40, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("variant", ["post-ln relu sinusoidal shared", "pre-ln gelu learned"])
def test_packed_step_on_the_gpu_meets_the_2x_rule_against_the_padded_step(variant, dtype, request):
    """The packed step on the GPU (varlen attention where it fits, the blocks path in cross-attention)
    against fp64: its loss and every gradient at most twice as far as the padded step's in the same
    precision, plus a floor."""
    from helpers import kernel_error

    model64, task = build(**VARIANTS[variant])
    criterion = LSLabelSmoothedCrossEntropyCriterion(task, False, 0.1)
    sample = collate(task, [9, 3, 7, 1, 12, 16, 2, 5], [7, 5, 1, 8, 4, 16, 3, 9],
                     torch.Generator().manual_seed(request.node.ls_seed))
    packed = packing.pack_sample(sample, task.source_dictionary.pad())
    ref = step(model64, criterion, packed)
    model = model64.to("cuda", dtype)
    on_gpu = [torch.utils._pytree.tree_map(lambda t: t.cuda() if torch.is_tensor(t) else t, s) for s in (sample, packed)]
    padded, got = step(model, criterion, on_gpu[0]), step(model, criterion, on_gpu[1])
    ratio, message = kernel_error(got[0].reshape(1), ref[0].reshape(1), padded[0].reshape(1), "loss", floor=1e-4)
    assert ratio <= 1, message
    for name in ref[3]:
        ratio, message = kernel_error(got[3][name], ref[3][name], padded[3][name], name, floor=1e-4)
        assert ratio <= 1, message
