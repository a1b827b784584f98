"""ls_transformer_lm against fairseq's transformer_lm on converted weights (CPU, fp64, dropout 0)."""
import argparse
import types

import pytest
import torch
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion
from fairseq.models.transformer_lm import TransformerLanguageModel
from fairseq.models.transformer_lm import base_lm_architecture as stock_base
from helpers import assert_close
from model_utils import dictionary

from ls_fairseq.convert import lm_model_to_fairseq, model_from_fairseq
from ls_fairseq.criterions.ls_label_smoothed_cross_entropy import LSLabelSmoothedCrossEntropyCriterion
from ls_fairseq.models.ls_transformer_lm import LSTransformerLanguageModel
from ls_fairseq.models.ls_transformer_lm import base_lm_architecture as ls_base

# the done-when's four variants: every activation, both position kinds, shared and separate embeddings,
# with and without layernorm_embedding and the final norm (plus the input/output projections and no scaling)
VARIANTS = {
    "relu sinusoidal separate final-norm": dict(activation_fn="relu"),
    "gelu learned shared layernorm-embedding": dict(activation_fn="gelu", decoder_learned_pos=True,
                                                    share_decoder_input_output_embed=True, layernorm_embedding=True),
    "gelu_accurate learned separate no-final-norm no-scale": dict(
        activation_fn="gelu_accurate", decoder_learned_pos=True, no_decoder_final_norm=True, no_scale_embedding=True),
    "gelu_accurate sinusoidal shared in/out projections layernorm-embedding": dict(
        activation_fn="gelu_accurate", share_decoder_input_output_embed=True, decoder_input_dim=24,
        decoder_output_dim=24, layernorm_embedding=True, no_decoder_final_norm=True),
}


def lm_args(**overrides):
    kw = dict(decoder_embed_dim=32, decoder_ffn_embed_dim=48, decoder_layers=3, decoder_attention_heads=4,
              dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, max_target_positions=64)
    kw.update(overrides)
    return kw


def build_lm_pair(dtype=torch.float64, **overrides):
    """(stock transformer_lm, ls_transformer_lm with stock's weights, task)."""
    d = dictionary()
    task = types.SimpleNamespace(source_dictionary=d, target_dictionary=d)
    stock_args = argparse.Namespace(**lm_args(**overrides))
    stock_base(stock_args)
    stock = TransformerLanguageModel.build_model(stock_args, task)
    ls_args = argparse.Namespace(**lm_args(**overrides))
    ls_base(ls_args)
    ls = LSTransformerLanguageModel.build_model(ls_args, task)
    ls.load_state_dict(model_from_fairseq(stock.state_dict()))
    return stock.to(dtype), ls.to(dtype), task


def lm_sample(d, B=4, T=10, padded=True):
    """A language_modeling batch: rows padded at their ends (MonolingualDataset's), target shifted by one."""
    tokens = torch.randint(d.nspecial, len(d), (B, T + 1))
    tokens[:, 0] = d.eos()
    if padded:
        for b in range(1, B):
            tokens[b, T + 1 - 2 * b:] = d.pad()
    src, target = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    target = target.masked_fill(src.eq(d.pad()), d.pad())
    return {"net_input": {"src_tokens": src, "src_lengths": src.ne(d.pad()).sum(1)}, "target": target,
            "ntokens": int(target.ne(d.pad()).sum()), "nsentences": B}


def stock_named_grads(model):
    return model_from_fairseq({n: p.grad for n, p in model.named_parameters() if p.grad is not None})


@pytest.mark.parametrize("right_padded", [False, True])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_loss_and_gradients_equal_stock(variant, right_padded):
    """The done-when: loss within 1e-6 relative, every gradient within 1e-5 of its largest entry, through
    the criteria fairseq-train uses (label smoothing 0). right_padded: language_modeling's batches let the
    causal self-attention drop the padding mask."""
    stock, ls, task = build_lm_pair(**VARIANTS[variant])
    ls.decoder.right_padded = right_padded
    sample = lm_sample(task.source_dictionary)
    stock.train()
    ls.train()
    stock_crit = LabelSmoothedCrossEntropyCriterion(task, sentence_avg=False, label_smoothing=0.0)
    ls_crit = LSLabelSmoothedCrossEntropyCriterion(task, sentence_avg=False, label_smoothing=0.0)
    loss_stock, _, _ = stock_crit(stock, sample)
    loss_ls, _, _ = ls_crit(ls, sample)
    assert abs(loss_ls.item() - loss_stock.item()) <= 1e-6 * abs(loss_stock.item()), (loss_ls, loss_stock)
    loss_stock.backward()
    loss_ls.backward()
    g_stock = stock_named_grads(stock)
    g_ls = {n: p.grad for n, p in ls.named_parameters() if p.grad is not None}
    assert set(g_stock) == set(g_ls)
    for name, g in g_stock.items():
        err = (g_ls[name] - g).abs().max().item()
        assert err <= 1e-5 * g.abs().max().item(), (name, err, g.abs().max().item())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_incremental_decoding_and_prefill_equal_stock(variant):
    """Step by step with beam reorders as fairseq's SequenceGenerator makes them, stock and ls alike; and a
    prompt run in one pass into an empty incremental state (prefill), then steps, equal to stock's steps."""
    stock, ls, task = build_lm_pair(**VARIANTS[variant])
    stock.eval()
    ls.eval()
    d = task.source_dictionary
    tokens = torch.randint(d.nspecial, len(d), (4, 8))
    tokens[:, 0] = d.eos()
    reorders = {3: torch.tensor([1, 1, 3, 2]), 5: torch.tensor([0, 2])}
    with torch.no_grad():
        state_stock, state_ls, prefill = {}, {}, {}
        logits = ls.decoder(tokens[:, :4], incremental_state=prefill)[0]
        assert_close(logits, ls.decoder(tokens[:, :4])[0], rtol=1e-9, atol=1e-9, what="prefill vs full")
        for t in range(tokens.shape[1]):
            if t in reorders:
                order = reorders[t]
                tokens = tokens[order]
                for model, state in ((stock, state_stock), (ls, state_ls), (ls, prefill)):
                    model.decoder.reorder_incremental_state_scripting(state, order)
            step_stock = stock.decoder(tokens[:, : t + 1], incremental_state=state_stock)[0]
            step_ls = ls.decoder(tokens[:, : t + 1], incremental_state=state_ls)[0]
            assert_close(step_ls, step_stock, rtol=1e-6, atol=1e-6, what="step {}".format(t))
            if t >= 4:
                step_prefilled = ls.decoder(tokens[:, : t + 1], incremental_state=prefill)[0]
                assert_close(step_prefilled, step_stock, rtol=1e-6, atol=1e-6, what="prefilled step {}".format(t))


def test_conversion_round_trip_loads_in_stock_and_back():
    stock, ls, _ = build_lm_pair(**VARIANTS["gelu learned shared layernorm-embedding"])
    converted = lm_model_to_fairseq(ls.state_dict())
    assert "encoder.version" not in converted
    stock.load_state_dict(converted)  # strict: the keys are stock's
    back = model_from_fairseq(converted)
    for name, value in ls.state_dict().items():
        assert torch.equal(back[name], value), name


@pytest.mark.parametrize("option,value,named", [
    ("adaptive_input", True, "--adaptive-input"),
    ("adaptive_softmax_cutoff", "10,20", "--adaptive-softmax-cutoff"),
    ("character_embeddings", True, "--character-embeddings"),
    ("quant_noise_pq", 0.1, "--quant-noise-pq"),
    ("base_layers", 1, "--base-layers"),
    ("scale_fc", True, "--scale-fc"),
    ("scale_heads", True, "--scale-heads"),
    ("decoder_xformers_att_config", "{}", "--decoder-xformers-att-config"),
    ("decoder_layerdrop", 0.1, "--decoder-layerdrop"),
    ("ls_packed", True, "--ls-packed"),
])
def test_unsupported_stock_options_are_refused_by_name(option, value, named):
    d = dictionary()
    args = argparse.Namespace(**lm_args(**{option: value}))
    ls_base(args)
    with pytest.raises(ValueError, match="^ls_transformer_lm: " + named + ": [^\n]+$"):
        LSTransformerLanguageModel.build_model(args, types.SimpleNamespace(source_dictionary=d, target_dictionary=d))


def test_bad_dimensions_are_clear_errors():
    d = dictionary()
    task = types.SimpleNamespace(source_dictionary=d, target_dictionary=d)
    args = argparse.Namespace(**lm_args(decoder_embed_dim=30))
    ls_base(args)
    with pytest.raises(ValueError, match="--decoder-embed-dim 30 is not divisible by --decoder-attention-heads 4"):
        LSTransformerLanguageModel.build_model(args, task)
    args = argparse.Namespace(**lm_args(share_decoder_input_output_embed=True, decoder_input_dim=16))
    ls_base(args)
    with pytest.raises(ValueError, match="--decoder-input-dim \\(16\\) equal to --decoder-output-dim \\(32\\)"):
        LSTransformerLanguageModel.build_model(args, task)


def test_a_stock_checkpoint_is_named_as_such():
    stock, ls, _ = build_lm_pair()
    with pytest.raises(ValueError, match="fairseq's transformer_lm .* convert it first"):
        ls.load_state_dict(stock.state_dict())


def prompts(d, B=6, P=7, seed=3):
    """A language_modeling generation batch: each row's prompt (prefix tokens, at least 3 long, padded at
    the end as fairseq-generate's --prefix-size takes them from the targets)."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(d.nspecial, len(d), (B, P), generator=g)
    for b in range(B):
        prefix[b, 3 + b % (P - 2):] = d.pad()
    src = torch.cat([torch.full((B, 1), d.eos()), prefix], dim=1)
    return {"id": torch.arange(B), "net_input": {"src_tokens": src, "src_lengths": src.ne(d.pad()).sum(1)}}, prefix


@pytest.mark.parametrize("options", [dict(beam_size=1, max_len_b=12), dict(beam_size=4, max_len_b=12),
                                     dict(beam_size=3, max_len_b=10, len_penalty=0.5, temperature=0.8, unk_penalty=1.0)],
                         ids=["greedy", "beam4", "beam3-lenpen-temperature-unkpen"])
@pytest.mark.parametrize("variant", ["relu sinusoidal separate final-norm",
                                     "gelu_accurate sinusoidal shared in/out projections layernorm-embedding"])
def test_device_generator_with_prefill_equals_fairseqs_generator(variant, options, monkeypatch):
    """LSSequenceGenerator on ls_transformer_lm, the prompts' common part run in one pass (prefill), the
    rest of each prompt forced step by step, then decoded on the preallocated cache: fairseq's
    SequenceGenerator's hypotheses on the stock model (ties in index order, as the ls generator's)."""
    from fairseq.sequence_generator import SequenceGenerator
    from test_generate import IndexOrderedBeamSearch, assert_same_nbest

    from ls_fairseq.generation import LSSequenceGenerator

    stock, ls, task = build_lm_pair(torch.float32, **VARIANTS[variant])
    stock.eval()
    ls.eval()
    d = task.target_dictionary
    sample, prefix = prompts(d)
    prefilled = []
    real = type(ls.decoder).prefill
    monkeypatch.setattr(type(ls.decoder), "prefill",
                        lambda self, tokens, cache: prefilled.append(tokens.shape) or real(self, tokens, cache))
    ref = SequenceGenerator([stock], d, search_strategy=IndexOrderedBeamSearch(d), **options).generate(
        [stock], sample, prefix_tokens=prefix, bos_token=d.eos())
    out = LSSequenceGenerator([ls], d, **options).generate([ls], sample, prefix_tokens=prefix, bos_token=d.eos())
    assert prefilled == [torch.Size([6, 3])]  # bos and the first 2 of the 3 prompt tokens every row has
    assert_same_nbest(dict(enumerate(ref)), dict(enumerate(out)))
    assert all(torch.equal(h["tokens"][:3], prefix[i, :3]) for i, hypos in enumerate(out) for h in hypos)


@pytest.mark.parametrize("options", [dict(), dict(sampling_topk=20, temperature=0.6), dict(sampling_topp=0.7)],
                         ids=["plain", "top-k-temperature", "top-p"])
def test_sampling_after_a_prefilled_prompt_follows_fairseqs_distribution(options):
    """20,000 tokens sampled after one 3-token prompt (2,000 copies, beam 1, 10 rounds; the prompt prefilled,
    EOS barred by the minimum length, one token drawn before the forced EOS) against fairseq's distribution
    after the stock model's full forward pass, its masks (pad, the unk penalty, EOS) and its top-k / top-p
    cut: no token outside the kept set, and a chi-square test at a fixed seed."""
    from test_generate import chi_square, sampling_reference

    from ls_fairseq.generation import LSSequenceGenerator

    stock, ls, task = build_lm_pair(torch.float32, activation_fn="gelu_accurate", decoder_learned_pos=True)
    stock.eval()
    ls.eval()
    d = task.target_dictionary
    prompt = torch.tensor([d.nspecial + 5, d.nspecial + 17, d.nspecial + 2])
    copies, rounds = 2000, 10
    src = torch.cat([torch.tensor([d.eos()]), prompt]).repeat(copies, 1)
    sample = {"id": torch.arange(copies), "net_input": {"src_tokens": src, "src_lengths": torch.full((copies,), 4)}}
    temperature = options.get("temperature", 1.0)
    gen = LSSequenceGenerator([ls], d, beam_size=1, max_len_b=4, min_len=4, unk_penalty=1.0, sampling=True,
                              generator=torch.Generator().manual_seed(2024), **options)
    counts = torch.zeros(len(d), dtype=torch.float64)
    for _ in range(rounds):
        hypos = gen.generate([ls], sample, prefix_tokens=prompt.repeat(copies, 1), bos_token=d.eos())
        drawn = torch.stack([h[0]["tokens"] for h in hypos])
        assert torch.equal(drawn[:, :3], prompt.repeat(copies, 1)) and drawn[:, 4].eq(d.eos()).all()
        counts += torch.bincount(drawn[:, 3], minlength=len(d)).double()
    n = copies * rounds
    with torch.no_grad():
        logits, _ = stock(src[:1])
    ids, probs = sampling_reference(logits[0, -1:], d, temperature, 1.0, options.get("sampling_topk", -1),
                                    options.get("sampling_topp", -1.0))
    outside = torch.ones(len(d), dtype=torch.bool)
    outside[ids] = False
    assert counts[outside].sum() == 0, outside.nonzero().view(-1)[counts[outside] > 0].tolist()
    assert ids.numel() > 1
    p, dof = chi_square(counts[ids], n * probs)
    assert p > 0.001, (p, dof)


def test_the_language_modeling_task_builds_the_device_generator():
    import ls_fairseq.fairseq_plugin  # noqa: F401 (the generator hook)
    from fairseq.tasks.language_modeling import LanguageModelingTask

    from ls_fairseq.generation import LSSequenceGenerator

    _, ls, task = build_lm_pair(torch.float32)
    lm_task = LanguageModelingTask.__new__(LanguageModelingTask)
    lm_task.output_dictionary = lm_task.dictionary = task.target_dictionary
    gen = lm_task.build_generator([ls], argparse.Namespace(beam=2, sampling=False))
    assert isinstance(gen, LSSequenceGenerator)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpu_training_step_in_each_precision_is_near_fp64(variant, dtype):
    """On the GPU (fused kernels; gelu_accurate on its reference): the loss and gradients in ``dtype``
    against fp64 on the same weights, within a bound scaled to the dtype's rounding (the model's ops in
    16 bits against stock's own error in the same precision would be the sharper check; this one
    catches a wrong kernel path)."""
    _, ls, task = build_lm_pair(torch.float64, **VARIANTS[variant])
    low = LSTransformerLanguageModel.build_model(ls_args_for(VARIANTS[variant]), task)
    low.load_state_dict(ls.state_dict())
    ls, low = ls.cuda().train(), low.cuda().to(dtype).train()
    sample = lm_sample(task.source_dictionary)
    sample = dict(sample, net_input={k: v.cuda() for k, v in sample["net_input"].items()}, target=sample["target"].cuda())
    crit = LSLabelSmoothedCrossEntropyCriterion(task, sentence_avg=False, label_smoothing=0.0)
    losses = []
    for model in (ls, low):
        loss, _, _ = crit(model, sample)
        loss.backward()
        losses.append(loss.double().item())
    bound = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}[dtype]
    assert abs(losses[1] - losses[0]) <= bound * abs(losses[0])
    for (name, p), q in zip(ls.named_parameters(), low.parameters()):
        err = (q.grad.double() - p.grad).abs().max().item()
        assert err <= bound * p.grad.abs().max().item() + 1e-6, (name, err)


def ls_args_for(overrides):
    args = argparse.Namespace(**lm_args(**overrides))
    ls_base(args)
    return args


@pytest.mark.gpu
@pytest.mark.parametrize("options", [dict(beam_size=4, max_len_b=12), dict(beam_size=1, max_len_b=30)])
def test_gpu_generation_with_graphs_equals_the_cpus(options):
    """The device generator on the GPU (prefill, then the ordinary steps from CUDA graphs) gives the CPU's
    hypotheses, fp32."""
    from test_generate import assert_same_nbest

    from ls_fairseq.generation import LSSequenceGenerator

    _, ls, task = build_lm_pair(torch.float32, **VARIANTS["gelu learned shared layernorm-embedding"])
    ls.eval()
    d = task.target_dictionary
    sample, prefix = prompts(d)
    cpu = LSSequenceGenerator([ls], d, **options).generate([ls], sample, prefix_tokens=prefix, bos_token=d.eos())
    ls.cuda()
    gpu_sample = dict(sample, net_input={k: v.cuda() for k, v in sample["net_input"].items()})
    gen = LSSequenceGenerator([ls], d, **options)
    for _ in range(2):  # the second batch replays the first one's graphs
        gpu = gen.generate([ls], gpu_sample, prefix_tokens=prefix.cuda(), bos_token=d.eos())
        assert_same_nbest(dict(enumerate(cpu)), {i: [{k: v.cpu() if torch.is_tensor(v) else v for k, v in h.items()}
                                                    for h in hypos] for i, hypos in enumerate(gpu)})

