"""ls_fairseq.generation: the device-side beam search against fairseq's SequenceGenerator, and
fairseq-generate / fairseq-interactive through the plugin."""
import contextlib
import logging
import re

import pytest
import torch
from conftest import REPO, USER_DIR, bin_path, run, to_stock
from fairseq import checkpoint_utils
from fairseq.ngram_repeat_block import NGramRepeatBlock
from fairseq.search import BeamSearch
from fairseq.sequence_generator import SequenceGenerator

import ls_fairseq.fairseq_plugin  # noqa: F401 (the plugin: registrations, the generator hook)
from ls_fairseq.generation import LSSequenceGenerator, sequence_generator, unsupported

TRAIN = [
    "--arch", "ls_transformer_tiny", "--share-all-embeddings", "--dropout", "0.1",
    "--criterion", "ls_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--optimizer", "ls_adam", "--adam-betas", "(0.9,0.98)", "--lr", "3e-3", "--lr-scheduler", "inverse_sqrt",
    "--warmup-updates", "50", "--clip-norm", "1.0", "--max-tokens", "2048", "--max-update", "300",
    "--cpu", "--num-workers", "0", "--no-progress-bar", "--log-interval", "100", "--disable-validation",
    "--no-epoch-checkpoints", "--seed", "1",
]


# one worker builds the trained model and the fixtures made from it (scripts/test.sh runs pytest-xdist)
pytestmark = pytest.mark.xdist_group("generate")


@pytest.fixture(scope="session")
def trained(data_bin, tmp_path_factory):
    """A tiny ls_transformer trained for 300 updates on the embedded corpus (its hypotheses end
    with EOS at realistic lengths): the checkpoint's path."""
    save = tmp_path_factory.mktemp("generate_ckpt")
    proc = run([bin_path("fairseq-train"), str(data_bin / "data-bin"), "--user-dir", USER_DIR, "--save-dir", str(save)]
               + TRAIN)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return save / "checkpoint_last.pt"


@pytest.fixture(scope="session")
def loaded(trained):
    """(model, task, the test set's 200 sentences as one batch) of the trained checkpoint, in fp32 on
    the CPU (one batch: the fewest decoding steps for both generators)."""
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([str(trained)])
    model = models[0].eval()
    task.load_dataset("test")
    itr = task.get_batch_iterator(dataset=task.dataset("test"), max_sentences=200, max_positions=model.max_positions())
    batches = list(itr.next_epoch_itr(shuffle=False))
    assert len(batches) == 1 and len(batches[0]["id"]) >= 200
    return model, task, batches


@pytest.fixture(scope="session")
def few(loaded):
    """(model, task, [a batch of the test set's first 40 sentences]) for the checks that need no 200."""
    model, task, _ = loaded
    dataset = task.dataset("test")
    return model, task, [dataset.collater([dataset[i] for i in range(40)])]


class FixedNGramBlock(NGramRepeatBlock):
    """fairseq's Python n-gram blocker given the generated tokens only (tokens[:, :step + 1]), which is
    what its CUDA extension reads; fairseq passes its whole token buffer, padding included, and so
    blocks nothing without the extension (fairseq issue 4709)."""

    def forward(self, tokens, lprobs, bsz, beam_size, step):
        return self._no_repeat_ngram(tokens[:, : step + 1], lprobs, bsz, beam_size, step)


class IndexOrderedBeamSearch(BeamSearch):
    """fairseq's BeamSearch with one order among candidates of equal score, the lower index first (as
    beam_select orders them), where torch.topk's is unspecified. Equal cumulative scores are not rare:
    in fp32 two different continuations of a long hypothesis often round to the same sum."""

    def step(self, step, lprobs, scores, prev_output_tokens=None, original_batch_idxs=None, candidate_multiple=2):
        bsz, beam_size, vocab_size = lprobs.size()
        # step 0: every beam holds the same hypothesis, so only the first beam's candidates count
        cumulative = lprobs[:, :1] if step == 0 else lprobs + scores[:, :, step - 1 : step]
        flat = cumulative.reshape(bsz, -1)
        k = min(candidate_multiple * beam_size, flat.shape[1] - 1)
        values, indices = torch.sort(flat, dim=1, descending=True, stable=True)
        values, indices = values[:, :k], indices[:, :k]
        return values, indices % vocab_size, indices // vocab_size


def stock_generator(model, task, fixed_ngram=True, **options):
    """fairseq's SequenceGenerator, ties in index order (IndexOrderedBeamSearch)."""
    gen = SequenceGenerator([model], task.target_dictionary, search_strategy=IndexOrderedBeamSearch(task.target_dictionary),
                            **options)
    if gen.repeat_ngram_blocker is not None and fixed_ngram:
        gen.repeat_ngram_blocker = FixedNGramBlock(options["no_repeat_ngram_size"], use_extension=False)
    return gen


def translate(generator, model, batches, prefix_size=0, device="cpu"):
    """Every sentence's hypotheses, by sentence id."""
    out = {}
    for batch in batches:
        batch = {k: v.to(device) if torch.is_tensor(v) else {n: t.to(device) for n, t in v.items()} if isinstance(v, dict) else v
                 for k, v in batch.items()}
        prefix = batch["target"][:, :prefix_size] if prefix_size else None
        hypos = generator.generate([model], batch, prefix_tokens=prefix)
        out.update(zip(batch["id"].tolist(), hypos))
    return out


def by_score(hypos):
    """Hypotheses best first, those of equal score by their tokens (fairseq's sort leaves their order open)."""
    return sorted(hypos, key=lambda h: (-float(h["score"]), h["tokens"].tolist()))


def assert_same_nbest(ref, out):
    """Hypothesis for hypothesis: the same tokens, scores and positional scores within 1e-4."""
    assert sorted(ref) == sorted(out)
    for i in ref:
        assert len(ref[i]) == len(out[i]), "sentence {}: {} hypotheses, fairseq {}".format(i, len(out[i]), len(ref[i]))
        assert [float(h["score"]) for h in out[i]] == sorted((float(h["score"]) for h in out[i]), reverse=True)
        for r, o in zip(by_score(ref[i]), by_score(out[i])):
            assert set(r) == set(o)
            assert torch.equal(o["tokens"], r["tokens"]), "sentence {}: {} != fairseq {}".format(i, o["tokens"], r["tokens"])
            assert abs(float(o["score"]) - float(r["score"])) <= 1e-4, (i, float(o["score"]), float(r["score"]))
            torch.testing.assert_close(o["positional_scores"], r["positional_scores"], atol=1e-4, rtol=0)
            assert o["attention"].numel() == 0 and o["alignment"].numel() == 0


CAPPED = dict(max_len_a=1.2, max_len_b=10)  # fairseq's usual cap: degenerate hypotheses stop early
OPTIONS = {
    "beam4-defaults": dict(beam_size=4),
    "beam5-lenpen-min-len-unkpen": dict(beam_size=5, len_penalty=0.6, min_len=6, unk_penalty=-5.0, **CAPPED),
    "greedy": dict(beam_size=1, **CAPPED),
    "short-max-len": dict(beam_size=3, max_len_b=4),
    # with --unnormalized fairseq ignores --lenpen; the ls generator must too
    "no-repeat-ngram-unnormalized-temperature": dict(beam_size=4, no_repeat_ngram_size=2, normalize_scores=False,
                                                     temperature=0.7, len_penalty=1.5, **CAPPED),
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_nbest_equals_fairseqs_sequence_generator(loaded, few, name):
    model, task, batches = loaded
    options = OPTIONS[name]
    ref = translate(stock_generator(model, task, **options), model, batches)
    out = translate(LSSequenceGenerator([model], task.target_dictionary, **options), model, batches)
    assert_same_nbest(ref, out)
    lengths = [len(h[0]["tokens"]) for h in out.values()]
    if name == "short-max-len":  # sentences finished at the maximum length
        assert max(lengths) == 5 and min(lengths) < 5
    if name == "beam4-defaults":  # a trained model: most hypotheses end with EOS, far below the maximum length (200)
        assert sum(length < 100 for length in lengths) >= 0.75 * len(lengths) and sum(lengths) / len(lengths) > 3
    if name == "beam5-lenpen-min-len-unkpen":  # both options change hypotheses: none shorter, some with unk
        unk = task.target_dictionary.unk()
        assert min(len(h["tokens"]) for hypos in out.values() for h in hypos) >= 7
        assert any(h["tokens"].eq(unk).any() for hypos in out.values() for h in hypos)
    if name == "no-repeat-ngram-unnormalized-temperature":
        for hypos in out.values():
            for h in hypos:
                t = h["tokens"].tolist()
                assert len(set(zip(t, t[1:]))) == len(t) - 1, t
        _, _, some = few
        without = {key: value for key, value in options.items() if key != "no_repeat_ngram_size"}
        plain = translate(stock_generator(model, task, **without), model, some)
        assert any(not torch.equal(plain[i][0]["tokens"], out[i][0]["tokens"]) for i in plain)
        broken = translate(stock_generator(model, task, fixed_ngram=False, **options), model, some)
        assert all(torch.equal(plain[i][0]["tokens"], broken[i][0]["tokens"]) for i in plain), \
            "fairseq's own CPU n-gram blocker now blocks: drop FixedNGramBlock"


def test_prefix_equals_fairseqs_sequence_generator(loaded):
    """--prefix-size 4: forced tokens, and targets shorter than the prefix, where it ends the sentence."""
    model, task, batches = loaded
    prefix_size = 4
    ref = translate(stock_generator(model, task, beam_size=4, **CAPPED), model, batches, prefix_size)
    out = translate(LSSequenceGenerator([model], task.target_dictionary, beam_size=4, **CAPPED), model, batches,
                    prefix_size)
    assert_same_nbest(ref, out)
    targets = {i: t for b in batches for i, t in zip(b["id"].tolist(), b["target"])}
    for i, hypos in out.items():
        prefix = targets[i][:prefix_size]
        prefix = prefix[prefix.ne(task.target_dictionary.pad())]
        assert all(torch.equal(h["tokens"][: len(prefix)], prefix) for h in hypos)
    assert any(targets[i][:prefix_size].eq(task.target_dictionary.eos()).any() for i in out)


@pytest.mark.parametrize("sync_every,compact_fraction,capacity,deferred", [
    (1, 0.0, 1, False), (3, 0.5, 2, False), (1000, 0.25, 64, False), (1, 0.0, 1, True), (2, 0.25, 64, True)])
def test_sync_points_compaction_and_cache_growth_leave_the_result(few, monkeypatch, sync_every, compact_fraction,
                                                                   capacity, deferred):
    """The host's reads of the done flags, dropping finished sentences from the batch (at once, or
    at the next sync point as on a GPU with CUDA graphs, the flags read there followed through the
    compaction) and the self-attention cache's growth change nothing; the host reads a value only
    at the sync points and once for the results."""
    model, task, batches = few
    monkeypatch.setattr(sequence_generator, "INITIAL_CAPACITY", capacity)
    reads = []
    monkeypatch.setattr(sequence_generator, "host_read", lambda t: reads.append(t.numel()) or t.cpu())
    steps = []
    decode_step = model.decoder.decode_step
    monkeypatch.setattr(model.decoder, "decode_step", lambda *a: steps.append(a[0].shape[0]) or decode_step(*a))
    options = dict(beam_size=4, len_penalty=0.6, **CAPPED)
    ref = translate(stock_generator(model, task, **options), model, batches)
    gen = LSSequenceGenerator([model], task.target_dictionary, sync_every=sync_every, compact_fraction=compact_fraction,
                              deferred_reads=deferred, **options)
    assert_same_nbest(ref, translate(gen, model, batches))
    assert len(batches) <= len(reads) <= len(steps) // sync_every + 2 * len(batches)
    if sync_every == 1000:  # no sync point before the maximum length: the results' read alone, the batch never shrinks
        assert len(reads) == len(batches) and len(set(steps)) <= len(batches)
    else:  # finished sentences left the batch
        assert len(set(steps)) > len(batches)


@pytest.mark.parametrize("buffered", [False, True])
def test_cache_gives_each_hypothesis_its_history_through_reorders_growth_and_compaction(buffered):
    """DecoderCache against the reorder-by-copy it replaces (fairseq's: every layer's keys and values
    index_selected into the new beam order at every step), on random beam orders, with growth past
    the initial capacity and sentences leaving the batch: the same attention at every step, and
    the cache rebuilt with one slot per remaining hypothesis once at most half of its slots are.
    Every rebuild frees the layers' old buffers, also those taken from (and kept by) Buffers."""
    import weakref

    from model_utils import build_pair

    from ls_fairseq.generation.cache import DecoderCache
    from ls_fairseq.generation.graphs import Buffers
    from ls_fairseq.ops import attention

    _, model, task = build_pair(decoder_layers=2, encoder_layers=1)
    d = task.source_dictionary
    B, beam, steps = 6, 3, 23
    src = torch.randint(d.nspecial, len(d), (B, 5))
    encoder_out = model.encoder(src, torch.full((B,), 5))
    cache = DecoderCache(model.decoder, encoder_out, beam, 4, limit=30, buffers=Buffers() if buffered else None)
    rebuilds = 0
    H, D = model.decoder.layers[0].self_attn.num_heads, 32 // model.decoder.layers[0].self_attn.num_heads
    history = [None, None]  # per layer: (keys, values) [N, H, t, D] in the hypotheses' order
    sentences = B
    for step in range(steps):
        N = sentences * beam
        if step > 0:  # each hypothesis continues one of the last step's, of a sentence still in the batch
            parents = alive[torch.randint(0, alive.numel(), (N,))]
            cache.reorder(parents)
            history = [(k.index_select(0, parents), v.index_select(0, parents)) for k, v in history]
        old, generation = [weakref.ref(t) for t in cache.kv], cache.generation
        cache.prepare(step)
        if cache.generation != generation:
            rebuilds += 1
            assert all(ref() is None for ref in old)
        cache.begin_step(torch.tensor(step), step + 1)
        for layer in range(2):
            q, k, v = (torch.randn(N, H, 1, D) for _ in range(3))
            out = cache.attend(layer, q, k, v)
            keys, values = (k, v) if step == 0 else (torch.cat([history[layer][0], k], 2),
                                                      torch.cat([history[layer][1], v], 2))
            history[layer] = (keys, values)
            torch.testing.assert_close(out, attention(q, keys, values, None, 0.0, False), rtol=1e-6, atol=1e-6)
        alive = torch.arange(N)
        if step in (5, 13):  # half of the sentences, then one more, leave the batch (as at a sync point)
            keep = torch.arange(sentences)[: sentences // 2 if step == 5 else sentences - 1]
            cache.keep_sentences(keep)
            alive = (keep[:, None] * beam + torch.arange(beam)).view(-1)
            sentences = keep.numel()
        assert cache.kv[0].shape[0] >= step + 1 and cache.kv[0].shape[0] <= 30
        assert cache.kv[0].shape[2] < 2 * sentences * beam or step in (5, 13)
    assert cache.kv[0].shape[2] == 2 * beam and cache.kv[0].shape[0] == 30
    assert rebuilds >= 4 and len(cache.kv) == 2


def ordinary(gen, step, max_len, prefix_tokens, reorder, k):
    """The steps a CUDA graph of the step could replay: past the prefix, before the maximum length, no
    n-gram blocking (the first step too, and those below the minimum length)."""
    return (step < max_len and gen.no_repeat_ngram_size == 0 and reorder == (k > 1)
            and (prefix_tokens is None or step >= prefix_tokens.shape[1]))


@pytest.mark.parametrize("options", [dict(beam_size=4, min_len=3), dict(beam_size=1), dict(beam_size=4, prefix_size=2)])
def test_an_ordinary_step_reads_the_step_only_from_the_device(few, monkeypatch, options):
    """A graph replay is the captured step with only the device's step tensor changed. Emulated on the
    CPU: every ordinary step runs as the first one of its batch state would be captured (the host's
    step number frozen at that step's, the attention length as a tensor computed from the device's
    step), and the search's state tensors keep their storage from step to step while the batch, its
    sentences and the cache's buffers stay: the same n-best lists as the plain run."""
    model, task, batches = few
    options = dict(options)
    prefix_size = options.pop("prefix_size", 0)
    ref = translate(LSSequenceGenerator([model], task.target_dictionary, **options), model, batches, prefix_size)
    step_fn = LSSequenceGenerator._step
    frozen, emulated, storage = {}, [], {}

    def as_replayed(self, s, cache, parents, t, length, step, max_len, prefix_tokens, reorder):
        state = (id(s), tuple(kv.data_ptr() for kv in cache.kv), cache.origin.shape, parents.data_ptr())
        if not ordinary(self, step, max_len, prefix_tokens, reorder, s.beam_size):
            return step_fn(self, s, cache, parents, t, length, step, max_len, prefix_tokens, reorder)
        first = frozen.setdefault(state, step)
        emulated.append(step != first)
        step_fn(self, s, cache, parents, t, t + 1, first, max_len, prefix_tokens, reorder)
        tensors = [s.tokens, s.scores, s.cum, s.done, s.count, s.fin_tokens, s.fin_positional, s.fin_score,
                   s.fin_length, cache.origin, parents]
        assert storage.setdefault(state, [x.data_ptr() for x in tensors]) == [x.data_ptr() for x in tensors]

    monkeypatch.setattr(LSSequenceGenerator, "_step", as_replayed)
    out = translate(LSSequenceGenerator([model], task.target_dictionary, **options), model, batches, prefix_size)
    assert any(emulated)
    assert_same_nbest(ref, out)


class _ArgumentGraph:
    """StepGraph's part on the CPU: a new key's step runs once and its arguments are kept; a replay
    runs the step again on exactly those (as a CUDA graph's kernels keep the tensors they were
    captured with, whatever the generator's variables hold by then), the length computed anew from
    the step tensor."""

    calls = []

    def __init__(self):
        self.key, self.arguments, self.captured, self.replayed = None, None, [], 0
        self.replayed_first = 0  # replays of a key at a batch's first step (a key of an earlier batch)

    def run(self, key, step, extent):
        if key != self.key:
            step()
            self.key, self.arguments = key, _ArgumentGraph.calls[-1]
            self.captured.append(key)
            return
        gen, s, cache, parents, t, _, *rest = self.arguments
        self.replayed_first += int(t) == 0
        STEP(gen, s, cache, parents, t, t + 1, *rest)
        self.replayed += 1


STEP = LSSequenceGenerator._step


@pytest.mark.parametrize("order", ["length", "two lengths in turn, then prefixes"], ids=["length", "turns"])
def test_a_batch_of_the_last_ones_shapes_replays_its_graph_on_its_own_tensors(loaded, monkeypatch, order):
    """Sentences one at a time: a batch with the shapes of the one before takes that batch's tensors
    (generation.graphs.Buffers) and, until its first growth, replays that batch's graphs (its first
    step's too). Emulated on the CPU with the arguments of a key's first step replayed: the same n-best
    lists as the plain run. In length order fewer batches' keys are captured than batches (the cache,
    growing past 8 positions, adds keys of their batch's own). With two lengths in turn (X, X, Y, X, X,
    ...) an X after a Y makes its buffers anew, so no graph of an earlier X may be replayed (its
    first step's included); nor in batches with a prefix, whose histories _force_prefix replaces.
    (In turns the cache never grows: a growth frees the buffers its batch took, so that the next batch
    makes its own.)"""
    model, task, _ = loaded
    dataset = task.dataset("test")
    ordered = [int(i) for i in dataset.ordered_indices()]
    if order == "length":
        picked = ordered[:24]
    else:  # sentences of two source lengths: X, X, Y, X, X, Y, ...
        sizes = [int(dataset.src_sizes[i]) for i in ordered]
        a, b = ([i for i, n in zip(ordered, sizes) if n == size] for size in sorted(set(sizes))[2:4])
        picked = [i for j in range(min(len(a) // 2, len(b), 5)) for i in (a[2 * j], a[2 * j + 1], b[j])]
    batches = [dataset.collater([dataset[i]]) for i in picked]
    assert len({b["net_input"]["src_tokens"].shape for b in batches}) < len(batches)
    monkeypatch.setattr(sequence_generator, "INITIAL_CAPACITY", 8 if order == "length" else 256)
    options = dict(beam_size=4, len_penalty=0.6)
    prefixes = (0,) if order == "length" else (0, 2)
    refs = [translate(LSSequenceGenerator([model], task.target_dictionary, **options), model, batches, prefix)
            for prefix in prefixes]

    def recorded(*arguments):
        _ArgumentGraph.calls.append(arguments)
        return STEP(*arguments)

    monkeypatch.setattr(LSSequenceGenerator, "_step", recorded)
    monkeypatch.setattr(sequence_generator, "graphs_on", lambda device: True)
    gen = LSSequenceGenerator([model], task.target_dictionary, **options)
    gen.step_graph = _ArgumentGraph()
    for prefix, ref in zip(prefixes, refs):
        assert_same_nbest(ref, translate(gen, model, batches, prefix))
    by_shapes = [key for key in gen.step_graph.captured if key[0] == "shapes"]
    print("{}: {} batches, {} shapes (keys) captured, {} steps of a batch's first key replayed".format(
        order, len(batches), len(by_shapes), gen.step_graph.replayed_first))
    if order == "length":  # a batch of the last one's shapes replays that batch's graph from its first step
        assert len(by_shapes) < len(batches) and gen.step_graph.replayed_first > 0
    else:  # the first X of a pair captures anew (its buffers were made after a Y), the second replays it
        pairs = len(picked) // 3
        assert len(by_shapes) == len(set(by_shapes)) == 2 * pairs and gen.step_graph.replayed_first == pairs


def random_pair(**overrides):
    import sys

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from model_utils import build_pair

    return build_pair(**overrides)


@pytest.mark.parametrize("variant", [
    dict(encoder_normalize_before=True, decoder_normalize_before=True, decoder_learned_pos=True, encoder_learned_pos=True),
    dict(share_decoder_input_output_embed=True, activation_fn="gelu", decoder_layers=1),
])
def test_other_architectures_equal_fairseqs_sequence_generator(variant):
    """Random weights (hypotheses run to the maximum length mostly): pre-LN, learned positions, gelu,
    shared output embedding, with padding in the sources."""
    _, model, task = random_pair(**variant)
    model.eval()
    d = task.source_dictionary
    g = torch.Generator().manual_seed(5)
    src = torch.randint(d.nspecial, len(d), (7, 13), generator=g)
    src[:, -1] = d.eos()
    for b in range(7):
        src[b, : 2 * b] = d.pad()
    batch = {"id": torch.arange(7), "net_input": {"src_tokens": src, "src_lengths": src.ne(d.pad()).sum(1)}}
    for options in (dict(beam_size=4, max_len_b=9), dict(beam_size=2, max_len_b=20, len_penalty=0.3)):
        ref = translate(SequenceGenerator([model], d, **options), model, [batch])
        assert_same_nbest(ref, translate(LSSequenceGenerator([model], d, **options), model, [batch]))


def test_bad_input_gets_a_clear_error(few):
    model, task, batches = few
    d = task.target_dictionary
    with pytest.raises(ValueError, match="min_len cannot be larger than max_len"):
        LSSequenceGenerator([model], d, beam_size=2, min_len=10, max_len_b=5).generate([model], batches[0])
    with pytest.raises(NotImplementedError, match="constraints"):
        LSSequenceGenerator([model], d).generate([model], batches[0], constraints=torch.zeros(1, 1))
    with pytest.raises(ValueError, match="ensemble"):
        LSSequenceGenerator([model, model], d)
    with pytest.raises(ValueError, match="no-repeat-ngram-size 1"):
        LSSequenceGenerator([model], d, no_repeat_ngram_size=1)
    with pytest.raises(ValueError, match="temperature"):
        LSSequenceGenerator([model], d, temperature=0.0)
    with pytest.raises(ValueError, match="require --sampling"):
        LSSequenceGenerator([model], d, sampling_topk=5)
    with pytest.raises(ValueError, match="require --sampling"):
        LSSequenceGenerator([model], d, sampling_topp=0.9)
    with pytest.raises(ValueError, match="--sampling-topk 0"):
        LSSequenceGenerator([model], d, sampling=True, sampling_topk=0)


def test_the_task_builds_the_ls_generator_or_falls_back_with_a_notice(loaded, caplog):
    from argparse import Namespace

    from fairseq.dataclass.configs import GenerationConfig
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf  # noqa: F401 (fairseq's configs load)
    from omegaconf import OmegaConf

    model, task, _ = loaded
    config = OmegaConf.structured(GenerationConfig)
    with caplog.at_level(logging.INFO, logger="ls_fairseq.generation"):
        gen = task.build_generator([model], config, extra_gen_cls_kwargs={"lm_model": None, "lm_weight": 0.0})
    assert isinstance(gen, LSSequenceGenerator) and gen.beam_size == 5
    assert "beam search on the device" in caplog.text
    stock, _, _ = random_pair()
    cases = [
        ([model, model], Namespace(beam=4), "an ensemble of 2 models"),
        ([stock], Namespace(beam=4), "not ls_transformer"),
        ([model], Namespace(beam=4, diversity_rate=0.5), "--diversity-rate 0.5"),
        ([model], Namespace(beam=4, diverse_beam_groups=2), "--diverse-beam-groups 2"),
        ([model], Namespace(beam=4, match_source_len=True), "--match-source-len True"),
        ([model], Namespace(beam=4, constraints="ordered"), "--constraints ordered"),
        ([model], Namespace(beam=4, print_alignment="hard"), "--print-alignment hard"),
        ([model], Namespace(beam=4, no_repeat_ngram_size=1), "--no-repeat-ngram-size 1"),
    ]
    for models, args, reason in cases:
        assert reason in unsupported(models, args, task.target_dictionary)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ls_fairseq.generation"):
            gen = task.build_generator(models, args)
        assert not isinstance(gen, LSSequenceGenerator)
        assert "fairseq's generator (" in caplog.text and reason in caplog.text
    assert "language model" in unsupported([model], Namespace(beam=4), task.target_dictionary,
                                            extra_gen_cls_kwargs={"lm_model": model, "lm_weight": 0.5})
    assert "prefix_allowed_tokens_fn" in unsupported([model], Namespace(beam=4), task.target_dictionary,
                                                     prefix_allowed_tokens_fn=lambda b, t: [])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ls_fairseq.generation"):
        gen = task.build_generator([model], Namespace(beam=4, sampling=True, sampling_topp=0.9, temperature=0.7))
    assert isinstance(gen, LSSequenceGenerator) and gen.sampling and gen.sampling_topp == 0.9
    assert gen.temperature == 0.7 and "ls_fairseq: sampling on the device" in caplog.text
    with pytest.raises(ValueError, match="require --sampling"):
        task.build_generator([model], Namespace(beam=4, sampling_topk=3))
    from fairseq.tasks.translation import TranslationTask

    wrapper = TranslationTask.build_generator
    ls_fairseq.fairseq_plugin.install()  # installing the plugin again wraps nothing twice
    assert TranslationTask.build_generator is wrapper and not hasattr(wrapper.__wrapped__, "__wrapped__")


# sampling (fairseq's search.Sampling) in the ls generator


def test_sampling_top_k_1_is_greedy(loaded):
    """--sampling --sampling-topk 1 --beam 1: greedy's hypotheses and scores, the ls generator's and
    fairseq's (beam 1 and its own Sampling)."""
    from fairseq.search import Sampling

    model, task, batches = loaded
    d = task.target_dictionary
    greedy = translate(LSSequenceGenerator([model], d, beam_size=1, **CAPPED), model, batches)
    sampled = translate(LSSequenceGenerator([model], d, beam_size=1, sampling=True, sampling_topk=1, **CAPPED), model,
                        batches)
    assert_same_nbest(greedy, sampled)
    stock = translate(SequenceGenerator([model], d, beam_size=1, search_strategy=Sampling(d, 1), **CAPPED), model,
                      batches)
    assert_same_nbest(stock, sampled)
    assert_same_nbest(translate(stock_generator(model, task, beam_size=1, **CAPPED), model, batches), sampled)


def next_token_reference(model, task, src_tokens, temperature, unk_penalty, topk, topp):
    """fairseq's Sampling at step 0 (EOS barred by the minimum length) for one source sentence:
    (kept tokens, their probabilities as drawn, normalised), from a full forward pass."""
    d = task.target_dictionary
    with torch.no_grad():
        logits, _ = model(src_tokens[None], torch.tensor([src_tokens.numel()]), torch.tensor([[d.eos()]]))
    return sampling_reference(logits[0, -1:], d, temperature, unk_penalty, topk, topp)


def sampling_reference(logits, d, temperature, unk_penalty, topk, topp):
    """(kept tokens, their probabilities, normalised) of fairseq's draw from one row of ``logits``
    ([1, V]) with EOS barred: the masks of fairseq's SequenceGenerator and search.Sampling's own cut."""
    import math

    from fairseq.search import Sampling

    lprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    lprobs[:, d.pad()] = -math.inf
    lprobs[:, d.unk()] -= unk_penalty
    lprobs[:, d.eos()] = -math.inf
    search = Sampling(d, topk, topp)
    if topp > 0:
        probs, ids = search._sample_topp(lprobs.view(1, 1, -1).clone())
    elif topk > 0:
        top, ids = lprobs.view(1, 1, -1).topk(topk)
        probs = top.exp()
    else:
        probs, ids = lprobs.exp().view(1, 1, -1), torch.arange(len(d)).view(1, 1, -1)
    probs, ids = probs.view(-1).double(), ids.view(-1)
    ids, probs = ids[probs > 0], probs[probs > 0]
    return ids, probs / probs.sum()


def chi_square(counts, expected):
    """(p-value, degrees of freedom) of the counts against the expected ones, the cells expected below
    5 pooled into one."""
    from scipy.stats import chisquare

    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum().view(1)]) if small.any() else counts
    wanted = torch.cat([expected[~small], expected[small].sum().view(1)]) if small.any() else expected
    if small.any() and wanted[-1] < 5:  # the pooled cell itself too small: into the smallest other
        observed, wanted = observed[:-1].clone(), wanted[:-1].clone()
        j = int(wanted.argmin())
        observed[j] += counts[small].sum()
        wanted[j] += expected[small].sum()
    return chisquare(observed.numpy(), wanted.numpy() * observed.sum().item() / wanted.sum().item()).pvalue, \
        observed.numel() - 1


SAMPLING = {
    "plain": dict(),
    "top-k": dict(sampling_topk=20),
    "top-p": dict(sampling_topp=0.8),
    "top-k-overridden-by-top-p": dict(sampling_topk=3, sampling_topp=0.6),
    "temperature-0.6-top-p": dict(temperature=0.6, sampling_topp=0.9),
    "temperature-1.7": dict(temperature=1.7),
}


@pytest.mark.parametrize("name", sorted(SAMPLING))
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_sampling_draws_follow_fairseqs_distribution(few, name, device):
    """100,000 first tokens drawn by the generator (250 copies of one sentence, beam 100: step 0's
    draws with replacement) against fairseq's distribution after its masks (pad, the unk penalty, EOS
    below the minimum length) and its top-k / top-p cut: no token outside the kept set, and a
    chi-square test at a fixed seed. On the GPU from the default generator, so that the draws of
    step 0 replay from a CUDA graph after the first batch."""
    model, task, batches = few
    options = SAMPLING[name]
    d = task.target_dictionary
    src = batches[0]["net_input"]["src_tokens"][3]
    src = src[src.ne(d.pad())]
    copies, beam, rounds = 250, 100, 4
    batch = {"id": torch.arange(copies), "net_input": {"src_tokens": src.repeat(copies, 1).to(device),
                                                       "src_lengths": torch.full((copies,), src.numel()).to(device)}}
    generator = torch.Generator().manual_seed(12345) if device == "cpu" else None
    torch.manual_seed(12345)
    counts = torch.zeros(len(d), dtype=torch.float64)
    try:
        model.to(device)
        gen = LSSequenceGenerator([model], d, beam_size=beam, max_len_a=0, max_len_b=1, min_len=1, unk_penalty=1.0,
                                  sampling=True, generator=generator, **options)
        for _ in range(rounds):
            for hypos in gen.generate([model], batch):
                assert len(hypos) == beam and all(h["tokens"].numel() == 2 and h["tokens"][1] == d.eos()
                                                  for h in hypos)
                counts += torch.bincount(torch.stack([h["tokens"][0] for h in hypos]).cpu(), minlength=len(d)).double()
    finally:
        model.cpu()
    if device == "cuda":
        assert gen.step_graph.captured >= 1
    n = copies * beam * rounds
    assert counts.sum() == n >= 100_000
    ids, probs = next_token_reference(model, task, src, options.get("temperature", 1.0), 1.0,
                                      options.get("sampling_topk", -1), options.get("sampling_topp", -1.0))
    outside = torch.ones(len(d), dtype=torch.bool)
    outside[ids] = False
    assert counts[outside].sum() == 0, "drawn outside the kept set: {}".format(outside.nonzero().view(-1)[
        counts[outside] > 0].tolist())
    if "sampling_topk" in options and "sampling_topp" not in options:
        assert ids.numel() == options["sampling_topk"]
    assert ids.numel() > 1
    p, dof = chi_square(counts[ids], n * probs)
    assert p > 0.001, (p, dof)


def test_sampling_seeds_scores_and_the_order_of_samples(few):
    """The same seed gives the same samples (a generator of one's own, or the default one as fairseq's
    --seed sets it), another seed others; every sentence gets beam finished samples, best first, each
    scored as fairseq scores it: positional scores the model's log-probabilities at the temperature,
    the score their sum over the length ** lenpen."""
    model, task, batches = few
    d = task.target_dictionary
    options = dict(beam_size=4, sampling=True, sampling_topp=0.9, temperature=0.8, len_penalty=0.6, **CAPPED)

    def draw(seed, own=True):
        if not own:
            torch.manual_seed(seed)
        generator = torch.Generator().manual_seed(seed) if own else None
        return translate(LSSequenceGenerator([model], d, generator=generator, **options), model, batches)

    first = draw(7)
    assert_same_nbest(first, draw(7))
    assert_same_nbest(draw(8, own=False), draw(8, own=False))
    other = draw(9)
    assert any(not torch.equal(first[i][0]["tokens"], other[i][0]["tokens"]) for i in first)
    sources = {i: s for b in batches for i, s in zip(b["id"].tolist(), b["net_input"]["src_tokens"])}
    for i, hypos in first.items():
        assert len(hypos) == 4
        assert [float(h["score"]) for h in hypos] == sorted((float(h["score"]) for h in hypos), reverse=True)
        src = sources[i][sources[i].ne(d.pad())]
        for h in hypos:
            tokens = h["tokens"]
            assert tokens[-1] == d.eos() and not tokens[:-1].eq(d.eos()).any()
            prev = torch.cat([torch.tensor([d.eos()]), tokens[:-1]])
            with torch.no_grad():
                logits, _ = model(src[None], torch.tensor([src.numel()]), prev[None])
            lprobs = torch.log_softmax(logits[0].float() / 0.8, dim=-1).gather(1, tokens[:, None]).view(-1)
            torch.testing.assert_close(h["positional_scores"], lprobs, atol=1e-4, rtol=0)
            assert abs(float(h["score"]) - float(lprobs.sum()) / tokens.numel() ** 0.6) <= 1e-4
    # samples, not a search: the 4 of a sentence differ among themselves somewhere
    assert any(len({tuple(h["tokens"].tolist()) for h in hypos}) > 1 for hypos in first.values())


def test_sample_next_keeps_fairseqs_sets_and_draws_by_the_inverse_cdf(monkeypatch):
    """sample_next on hand-made rows: top-p keeps the token that crosses p (also when the mass never
    reaches p), top-k exactly k, -inf tokens never; the draw is the first token whose cumulative weight
    exceeds u x total, for u at the ends of [0, 1)."""
    import math

    from ls_fairseq.generation.sequence_generator import sample_next

    lp = torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0]]).log()
    for u, want in ((0.0, 0), (0.49, 0), (0.51, 1), (1.0 - 2 ** -24, 3)):
        monkeypatch.setattr(torch, "rand", lambda *a, u=u, **k: torch.full(a[0], u))
        tokens, lps = sample_next(lp)
        assert tokens.tolist() == [want] and lps.tolist() == [lp[0, want].item()]
        tokens, _ = sample_next(lp, topp=0.79)
        assert tokens.item() in (0, 1)
        tokens, _ = sample_next(lp, topk=2)
        assert tokens.item() in (0, 1)
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.full(a[0], 1.0 - 2 ** -24))
    assert sample_next(lp, topp=0.81)[0].item() == 2  # the token that crosses p is kept
    assert sample_next(lp, topp=0.96)[0].item() == 3
    assert sample_next(lp, topp=0.999)[0].item() == 3  # the mass never reaches p: all weighted ones
    assert sample_next(lp, topk=3)[0].item() == 2
    masked = torch.tensor([[-math.inf, 0.0, -math.inf]])
    assert sample_next(masked)[0].item() == 1 and sample_next(masked, topk=3)[0].item() == 1


# fairseq-generate and fairseq-interactive through the plugin


def hypotheses(output):
    """{id: (hypothesis, score)} from H- lines."""
    found = {}
    for line in output.splitlines():
        if line.startswith("H-"):
            i, score, text = line[2:].split("\t")
            found.setdefault(int(i), []).append((text, float(score)))
    return found


def assert_same_output(ls, stock):
    assert sorted(ls) == sorted(stock) and ls
    for i in stock:
        assert [t for t, _ in ls[i]] == [t for t, _ in stock[i]], i
        assert all(abs(a - b) <= 1e-4 for (_, a), (_, b) in zip(ls[i], stock[i])), (ls[i], stock[i])


@pytest.fixture(scope="session")
def stock_checkpoint(trained, tmp_path_factory):
    return to_stock(trained, tmp_path_factory.mktemp("generate_stock"))


@pytest.mark.slow
def test_fairseq_generate_runs_the_ls_generator_and_equals_stock(data_bin, trained, stock_checkpoint):
    args = ["--cpu", "--gen-subset", "test", "--beam", "4", "--nbest", "2", "--lenpen", "0.6", "--max-len-b", "30",
            "--batch-size", "64",
            "--remove-bpe", "sentencepiece"]
    ls = run([bin_path("fairseq-generate"), str(data_bin / "data-bin"), "--user-dir", USER_DIR, "--path", str(trained)]
             + args)
    assert ls.returncode == 0, ls.stderr[-3000:]
    assert "ls_fairseq: beam search on the device" in ls.stdout + ls.stderr
    stock = run([bin_path("fairseq-generate"), str(data_bin / "data-bin"), "--path", str(stock_checkpoint)] + args)
    assert stock.returncode == 0, stock.stderr[-3000:]
    found = hypotheses(ls.stdout)
    assert len(found) == 200 and all(len(h) == 2 for h in found.values())
    assert_same_output(found, hypotheses(stock.stdout))
    assert re.search(r"BLEU4? = \d+\.\d+", ls.stdout + ls.stderr)

    unknown = run([bin_path("fairseq-generate"), str(data_bin / "data-bin"), "--user-dir", USER_DIR, "--path",
                   str(trained), "--no-such-option", "3"] + args)
    assert unknown.returncode != 0 and "unrecognized arguments: --no-such-option" in unknown.stderr


@pytest.mark.slow
def test_fairseq_generate_and_interactive_sample_with_the_ls_generator(data_bin, trained):
    """--sampling --sampling-topk 1 --beam 1 through the plugin: the ls generator says so in one line
    and gives greedy's hypotheses."""
    args = ["--cpu", "--beam", "1", "--max-len-b", "30", "--remove-bpe", "sentencepiece"]
    common = [str(data_bin / "data-bin"), "--user-dir", USER_DIR, "--path", str(trained)] + args
    sampled = run([bin_path("fairseq-generate")] + common + ["--gen-subset", "test", "--batch-size", "64", "--sampling",
                                                             "--sampling-topk", "1"])
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    log = sampled.stdout + sampled.stderr
    assert log.count("ls_fairseq: sampling on the device") == 1 and "fairseq's generator" not in log
    greedy = run([bin_path("fairseq-generate")] + common + ["--gen-subset", "test", "--batch-size", "64"])
    assert greedy.returncode == 0, greedy.stderr[-3000:]
    assert len(hypotheses(sampled.stdout)) == 200
    assert_same_output(hypotheses(sampled.stdout), hypotheses(greedy.stdout))
    lines = (data_bin / "spm_text" / "test.en").read_text(encoding="utf-8").splitlines()[:8]
    interactive = run([bin_path("fairseq-interactive")] + common + ["--source-lang", "en", "--target-lang", "de",
                                                                    "--sampling", "--sampling-topp", "0.9"],
                      input="\n".join(lines) + "\n")
    assert interactive.returncode == 0, interactive.stderr[-3000:]
    log = interactive.stdout + interactive.stderr
    assert log.count("ls_fairseq: sampling on the device") == 1 and len(hypotheses(interactive.stdout)) == 8


@pytest.mark.slow
def test_fairseq_interactive_runs_the_ls_generator_and_equals_stock(data_bin, trained, stock_checkpoint):
    lines = (data_bin / "spm_text" / "test.en").read_text(encoding="utf-8").splitlines()[:20]
    text = "\n".join(lines[:10] + [""] + lines[10:]) + "\n"  # an empty line among them
    args = ["--cpu", "--beam", "4", "--max-len-b", "30", "--source-lang", "en", "--target-lang", "de", "--buffer-size", "8",
            "--batch-size", "8", "--remove-bpe", "sentencepiece"]
    ls = run([bin_path("fairseq-interactive"), str(data_bin / "data-bin"), "--user-dir", USER_DIR, "--path",
              str(trained)] + args, input=text)
    assert ls.returncode == 0, ls.stderr[-3000:]
    assert "ls_fairseq: beam search on the device" in ls.stdout + ls.stderr
    stock = run([bin_path("fairseq-interactive"), str(data_bin / "data-bin"), "--path", str(stock_checkpoint)] + args,
                input=text)
    assert stock.returncode == 0, stock.stderr[-3000:]
    found = hypotheses(ls.stdout)
    assert len(found) == 21
    assert_same_output(found, hypotheses(stock.stdout))

    # a sentence longer than the model's positions: fairseq's error, naming the option that skips it
    long = " ".join(["▁the"] * 1100) + "\n"
    proc = run([bin_path("fairseq-interactive"), str(data_bin / "data-bin"), "--user-dir", USER_DIR, "--path",
                str(trained)] + args, input=long)
    assert proc.returncode != 0 and "skip-invalid-size-inputs-valid-test" in proc.stdout + proc.stderr
    proc = run([bin_path("fairseq-interactive"), str(data_bin / "data-bin"), "--user-dir", USER_DIR, "--path",
                str(trained), "--skip-invalid-size-inputs-valid-test"] + args, input=long + text)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_output(hypotheses(proc.stdout), {i + 1: h for i, h in hypotheses(stock.stdout).items()})


@pytest.mark.slow
def test_bench_generate_smoke(data_bin, trained, tmp_path):
    """scripts/bench_generate.py on the CPU with the trained tiny model: every system and point, the
    ls generator's hypotheses (BLEU) those of fairseq's on the same model, a table and a plot."""
    import json
    import sys

    proc = run([sys.executable, "scripts/bench_generate.py", "--out", str(tmp_path), "--smoke", "--cpu", "--fairseq-on-ls",
                "--data-bin", str(data_bin / "data-bin"), "--checkpoint", "tiny={}".format(trained), "--repeats", "2"],
               cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())
    assert {(r["system"], r["beam"], r["batch"]) for r in rows} == {
        (s, beam, 8) for s in ("stock-fp32", "ls-fp32", "fairseq-on-ls-fp32") for beam in (4, 1)}
    by = {(r["system"], r["beam"]): r for r in rows}
    for beam in (4, 1):
        assert by[("stock-fp32", beam)]["speedup"] == 1.0 and by[("ls-fp32", beam)]["sentences"] == 24
        low, high = by[("ls-fp32", beam)]["speedup_range"]
        assert by[("ls-fp32", beam)]["runs"] == 2 and low <= by[("ls-fp32", beam)]["speedup"] <= high
        assert by[("ls-fp32", beam)]["bleu"] == by[("fairseq-on-ls-fp32", beam)]["bleu"]
        assert all(r["tokens_per_s"] > 0 for r in rows)
    assert "| tiny | 4 | 8 |" in (tmp_path / "results.md").read_text() and ", 2 runs)" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "speedup.png").is_file() or "no matplotlib" in proc.stderr


def test_bench_generate_systems_are_chosen_by_name_with_stock_kept():
    """--systems keeps the named systems in their order and refuses an unknown name or a choice without
    the stock system that the others are measured against."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_generate", REPO + "/scripts/bench_generate.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert [s[0] for s in bench.chosen_systems(True, False, "ls-fp16,stock-fp16")] == ["stock-fp16", "ls-fp16"]
    assert len(bench.chosen_systems(True, True, None)) == 5
    for wanted in ("stock-fp16,ls-fp8", "ls-fp16,ls-bf16"):
        with pytest.raises(SystemExit, match="--systems"):
            bench.chosen_systems(True, False, wanted)


def test_profile_generate_breakdown_parts_add_up(data_bin, trained):
    """scripts/profile_generate.py --sentences on the CPU: the whole run split into parts (eager steps,
    encoder, ...) whose times add up to the instrumented total."""
    import sys

    proc = run([sys.executable, "scripts/profile_generate.py", "--data-bin", str(data_bin / "data-bin"),
                "--checkpoint", str(trained), "--sentences", "12", "--batch-size", "4"],
               cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    head = re.search(r"12 sentences in 3 batches of up to 4, beam 4, float32 on cpu \(eager\): [0-9.]+ ms plain, "
                     r"([0-9.]+) ms instrumented", proc.stdout)
    assert head, proc.stdout[-2000:]
    parts = dict(re.findall(r"^\| ([a-z][a-z' -]*) \| (-?[0-9.]+) \|", proc.stdout, re.M))
    assert {"eager steps", "encoder", "caches' set-up", "hypotheses' assembly", "input copies", "the rest"} <= set(parts)
    assert abs(sum(float(v) for v in parts.values()) - float(head.group(1))) < 0.5


# on the GPU (run on an H200)


def bleu(hypos, task, batches):
    import sacrebleu

    d = task.target_dictionary
    refs = {i: d.string(t[t.ne(d.pad())], "sentencepiece") for b in batches for i, t in zip(b["id"].tolist(), b["target"])}
    ids = sorted(refs)
    return sacrebleu.corpus_bleu([d.string(hypos[i][0]["tokens"].cpu(), "sentencepiece") for i in ids],
                                 [[refs[i] for i in ids]]).score


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_generation_runs_the_kernels(few, monkeypatch, dtype):
    """On the GPU in fp16/bf16 every op the generator's steps call takes its kernel path: the
    candidate selection is the beam_select kernel, every step."""
    from ls_fairseq.ops import dispatch

    model, task, batches = few
    picked = []  # (op, whether it took its kernel) of every Route decision
    pick = dispatch.Route.pick

    def recorded(route, tensor):
        found = pick(route, tensor)
        picked.append((route.op, route.kernel is not None and found is route.kernel))
        return found

    monkeypatch.setattr(dispatch.Route, "pick", recorded)
    steps = []
    model = model.cuda().to(dtype)
    decode_step = model.decoder.decode_step
    monkeypatch.setattr(model.decoder, "decode_step", lambda *a: steps.append(1) or decode_step(*a))
    try:
        out = translate(LSSequenceGenerator([model], task.target_dictionary, beam_size=4, len_penalty=0.6), model,
                        batches, device="cuda")
    finally:
        model.float().cpu()
    assert len(out) == 40 and all(out.values())
    assert steps and all(kernel for _, kernel in picked), sorted({op for op, kernel in picked if not kernel})
    ops_run = [op for op, _ in picked]
    assert ops_run.count("beam_select") == len(steps)
    assert {"embedding", "attention"} <= set(ops_run), set(ops_run)


def eager_and_graphed(model, task, batches, dtype, **options):
    """(the graphed generator, the eager run's n-best lists, the graphed run's) of ``batches`` on the GPU
    in ``dtype``; the model is back on the CPU in fp32 after."""
    model = model.cuda().to(dtype)
    try:
        eager = translate(LSSequenceGenerator([model], task.target_dictionary, cuda_graphs=False, **options), model,
                          batches, device="cuda")
        gen = LSSequenceGenerator([model], task.target_dictionary, **options)
        return gen, eager, translate(gen, model, batches, device="cuda")
    finally:
        model.float().cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("capacity", [4, 64])
def test_gpu_step_graphs_give_the_eager_steps_results(loaded, monkeypatch, dtype, capacity):
    """The ordinary steps replayed from CUDA graphs: the n-best lists of every step run eagerly, while
    sentences leave the batch (each time a new capture) and the cache grows past 4 positions."""
    model, task, batches = loaded
    monkeypatch.setattr(sequence_generator, "INITIAL_CAPACITY", capacity)
    gen, eager, graphed = eager_and_graphed(model, task, batches, dtype, beam_size=4, len_penalty=0.6, sync_every=4,
                                            compact_fraction=0.1)
    assert gen.step_graph.captured >= 2
    assert_same_nbest(eager, graphed)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_sentences_one_at_a_time_replay_the_last_ones_graphs(loaded, dtype):
    """Batches of one sentence in length order on the GPU: those of the last one's shapes replay its
    graphs (first step and later steps) on the tensors they take over, with the eager run's n-best."""
    model, task, _ = loaded
    dataset = task.dataset("test")
    batches = [dataset.collater([dataset[int(i)]]) for i in dataset.ordered_indices()[:40]]
    gen, eager, graphed = eager_and_graphed(model, task, batches, dtype, beam_size=4, len_penalty=0.6)
    assert gen.step_graph.captured < len(batches)
    assert_same_nbest(eager, graphed)


@pytest.mark.gpu
def test_gpu_fp32_nbest_equals_fairseqs_sequence_generator(loaded):
    """fp32 on the GPU: the same n-best lists but for near-ties, which other kernels' rounding can order
    differently (at most 2 of 200 sentences, and then the best scores within 1e-4)."""
    model, task, batches = loaded
    model = model.cuda()
    try:
        options = dict(beam_size=4, len_penalty=0.6)
        ref = translate(stock_generator(model, task, **options), model, batches, device="cuda")
        out = translate(LSSequenceGenerator([model], task.target_dictionary, **options), model, batches, device="cuda")
        differ = [i for i in ref if [h["tokens"].tolist() for h in ref[i]] != [h["tokens"].tolist() for h in out[i]]]
        assert len(differ) <= 2, differ
        for i in differ:
            assert abs(float(ref[i][0]["score"]) - float(out[i][0]["score"])) <= 1e-4
        assert_same_nbest({i: ref[i] for i in ref if i not in differ}, {i: out[i] for i in ref if i not in differ})
    finally:
        model.cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_half_precision_bleu_within_a_tenth_of_fairseqs(loaded, dtype):
    model, task, batches = loaded
    model = model.cuda().to(dtype)
    try:
        options = dict(beam_size=4, len_penalty=0.6)
        ref = translate(stock_generator(model, task, **options), model, batches, device="cuda")
        out = translate(LSSequenceGenerator([model], task.target_dictionary, **options), model, batches, device="cuda")
        assert abs(bleu(out, task, batches) - bleu(ref, task, batches)) <= 0.1
    finally:
        model.float().cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("options", [dict(), dict(sampling=True, sampling_topp=0.9, temperature=0.8),
                                     dict(sampling=True, sampling_topk=10)])
def test_gpu_no_host_synchronisation_inside_the_decoding_steps(loaded, monkeypatch, options):
    """CUDA's sync debug mode raises at any synchronising call from the first decoding step on, but
    at the generator's sync points; beam search and sampling."""
    model, task, batches = loaded
    model = model.cuda()
    decode_step = model.decoder.decode_step

    def strict_step(*args):
        torch.cuda.set_sync_debug_mode("error")
        return decode_step(*args)

    def read(t):
        torch.cuda.set_sync_debug_mode("default")
        try:
            return t.cpu()
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(model.decoder, "decode_step", strict_step)
    monkeypatch.setattr(sequence_generator, "host_read", read)
    try:
        gen = LSSequenceGenerator([model], task.target_dictionary, beam_size=4, sync_every=8, **options)
        batch = {k: v.cuda() if torch.is_tensor(v) else {n: t.cuda() for n, t in v.items()} if isinstance(v, dict) else v
                 for k, v in batches[0].items()}
        hypos = gen.generate([model], batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        model.cpu()
    assert len(hypos) == len(batch["id"]) and all(hypos)


class _StandInGraph:
    """torch.cuda.CUDAGraph's part that StepGraph uses, recording what happened (on the CPU)."""

    log = []
    alive = set()

    def __init__(self):
        _StandInGraph.alive.add(id(self))

    def __del__(self):
        _StandInGraph.alive.discard(id(self))

    def capture_begin(self, pool=None, capture_error_mode="global"):
        # a capture into a pool that no live graph holds is what PyTorch's allocator refuses
        assert pool is None or _StandInGraph.alive - {id(self)}, "capture into a freed pool"
        self.log.append("capture")

    def capture_end(self):
        pass

    def pool(self):
        return "pool"

    def replay(self):
        self.log.append("replay")


def test_step_graph_warms_up_only_at_a_larger_extent_and_holds_its_pool(monkeypatch):
    """StepGraph on the CPU with a stand-in for CUDA graphs: a new key is captured at once unless the
    step's extent is larger than any before (then one eager step first); the graph of the previous
    key lives until the next capture, so that the pool is never captured into once freed."""
    from ls_fairseq.generation import graphs

    monkeypatch.setattr(graphs.torch.cuda, "CUDAGraph", _StandInGraph)
    monkeypatch.setattr(graphs.torch.cuda, "Stream", lambda: None)
    monkeypatch.setattr(graphs, "on_stream", lambda stream: contextlib.nullcontext())
    _StandInGraph.log = []
    graph = graphs.StepGraph()

    def step():
        _StandInGraph.log.append("eager")

    runs = [("a", 64), ("a", 64), ("a", 64), ("b", 64), ("b", 64), ("c", 128), ("c", 128), ("d", 64)]
    for key, extent in runs:
        graph.run(key, step, extent)
    assert _StandInGraph.log == ["eager", "capture", "eager", "replay", "replay",  # a: warm-up at 64
                                 "capture", "eager", "replay", "replay",  # b: captured at once
                                 "eager", "capture", "eager", "replay",  # c: 128 warms up
                                 "capture", "eager", "replay"]  # d: 64 was warmed
    assert graph.captured == 4


@pytest.mark.gpu
def test_gpu_sampling_replays_from_graphs_and_repeats_with_the_seed(loaded):
    """Sampling on the GPU with CUDA graphs: every sentence gets beam finished samples, best first, and
    the same seed (fairseq's --seed: the default generator) gives the same samples, another seed others."""
    model, task, batches = loaded
    model = model.cuda()
    try:
        gen = LSSequenceGenerator([model], task.target_dictionary, beam_size=4, sampling=True, sampling_topp=0.9,
                                  **CAPPED)

        def draw(seed):
            torch.manual_seed(seed)
            return translate(gen, model, batches, device="cuda")

        first = draw(3)
        assert gen.step_graph.captured >= 1
        assert_same_nbest(first, draw(3))
        other = draw(4)
        assert any(not torch.equal(first[i][0]["tokens"], other[i][0]["tokens"]) for i in first)
        assert all(len(h) == 4 for h in first.values())
    finally:
        model.cpu()
