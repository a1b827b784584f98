"""Beam search for ls_transformer and ls_transformer_lm with every decision on the device.

The search is fairseq's SequenceGenerator with BeamSearch (fairseq/sequence_generator.py), step
for step: 2 x beam candidates per sentence from the cumulative scores, the end-of-sentence ones
among the first beam of them finished (score divided by length ** lenpen), the first beam that do
not end the sentence continued; a sentence is done when it has beam finished hypotheses or at the
maximum length. The same options (--beam, --nbest at the output, --lenpen, --unnormalized,
--max-len-a/-b, --min-len, --unkpen, --temperature, --no-repeat-ngram-size, --prefix-size, and a
bos_token) and the same output (per sentence the finished hypotheses, best first, as dicts of
tokens, score, positional_scores, empty attention and alignment).

What differs is where it runs. Every step is batched tensor ops with shapes fixed by the batch
(the step itself is read from a device tensor): the model's decode_step on preallocated caches
(generation.DecoderCache: the encoder runs once, its keys and values for all layers once per
batch; the self-attention's keys and values written once, a beam reorder copying a table of slot
numbers), an ordinary step's scores from ops.beam_scores, candidates from ops.beam_select, finished
hypotheses written into per-sentence slots and the survivors' histories reordered by
ops.beam_advance, the sentence's done flag and the stop test as tensors. Nothing in a step reads a
tensor back to the host: no .item(), no boolean-mask indexing, no branch on a value. Every
``sync_every`` steps the host reads the sentences' done flags (one small copy): it stops when all
are done, and when at least ``compact_fraction`` of the batch is done it drops those sentences
(their results kept), as fairseq drops each finished sentence at once; with CUDA graphs at the
next sync point, so that the device works while the host captures. Finished sentences still in
the batch run on without effect until then. On a GPU the batch runs on a stream of its own (the
CUDA graphs' capture stream) and the results are assembled on the caller's.

Sampling (``sampling``; fairseq's search.Sampling with SequenceGenerator) runs in the same loop,
the same steps and graphs: each of the beam hypotheses of a sentence draws its next token from
its own distribution (fairseq's log-probabilities above, temperature included, exponentiated and
not renormalised; at step 0 every hypothesis is the same, so the beam draws are the first beam's,
with replacement), cut to the ``sampling_topk`` most likely tokens, or where ``sampling_topp`` is
set (it overrides top-k) to the smallest set of most likely tokens whose mass reaches p, the one
that crosses p kept. The draw is by the inverse of the kept tokens' cumulative distribution at a
uniform number from torch.rand on the device (``sample_next``): the device's default generator,
which fairseq's --seed seeds, or the ``generator`` given. A hypothesis that draws EOS is finished
(score its cumulative log-probability, with the length penalty) and runs on as a dead one (score
-inf) that never finishes again; a sentence is done with beam finished samples, given back best
first.

A decoder-only model (ls_transformer_lm, --task language_modeling, whose prompts come as prefix
tokens) has no encoder and no cross-attention in its cache. Its prompt is prefilled: the leading
columns that every row's prompt fills (no padding, no EOS) run through the decoder in one pass, their
keys and values written into every beam's slot and their forced log-probabilities added as fairseq's
forced steps add them; the search then starts at the step after them (longer prompts' remaining
tokens forced step by step, as fairseq does).

Two deliberate differences, both where fairseq's own results are not defined by its search:
- the order among candidates of exactly equal score (fairseq's is torch.topk's, unspecified;
  here the lower beam, then the lower token, first; finished hypotheses of equal score keep the
  order in which they finished);
- --no-repeat-ngram-size blocks repeated n-grams as fairseq's CUDA extension does: fairseq's
  Python fallback, used wherever that extension is not built (fairseq's CPU generation, and the
  fairseq-fixed wheel everywhere), compares the last n - 1 entries of its whole token buffer,
  padding, with the hypotheses' n-grams and so blocks nothing (fairseq issue 4709).
"""
import itertools
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ls_fairseq.generation.cache import DecoderCache
from ls_fairseq.cuda_graphs import on_stream
from ls_fairseq.generation.graphs import Buffers, StepGraph, decoding_stream, new_tensor
from ls_fairseq.ops.beam_advance import beam_advance
from ls_fairseq.ops.beam_scores import beam_scores
from ls_fairseq.ops.beam_select import beam_select
from ls_fairseq.ops.embedding import sinusoid_tables_made

INITIAL_CAPACITY = 64  # self-attention cache positions before the first doubling
_BATCHES = itertools.count()  # a number per batch, in the keys of the step's CUDA graphs


def graphs_on(device):
    """Whether the ordinary steps on ``device`` run through the generator's StepGraph: on GPUs."""
    return device.type == "cuda"


def host_read(tensor):
    """The generator's only reads of device values, at its sync points (tests count them)."""
    return tensor.cpu()


class _PendingRead:
    """A copy of a small device tensor to the host, queued now and read later: on a GPU into pinned
    memory behind an event, so that the host goes on while the device catches up. ``rows``: which of
    the copy's entries the batch's sentences are now (None: all, in order), after compactions."""

    def __init__(self, tensor):
        self.rows = None
        if tensor.device.type != "cuda":
            self.copy, self.event = tensor.clone(), None
            return
        self.copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.copy.copy_(tensor, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(tensor.device))  # the stream the copy is queued on

    def keep(self, kept):
        """Only the sentences ``kept`` (host indices into the current ones) stay in the batch."""
        self.rows = kept if self.rows is None else self.rows[kept]

    def value(self):
        if self.event is not None:
            self.event.synchronize()
        values = host_read(self.copy)
        return values if self.rows is None else values[self.rows]


def to_device(host_tensor, device):
    """A small host tensor on ``device`` without waiting for the device: a copy from pageable host
    memory is synchronous, one from pinned memory is queued on the stream."""
    if device.type != "cuda":
        return host_tensor.to(device)
    return host_tensor.pin_memory().to(device, non_blocking=True)


class LSSequenceGenerator(nn.Module):
    def __init__(
        self,
        models,
        tgt_dict,
        beam_size=1,
        max_len_a=0,
        max_len_b=200,
        max_len=0,
        min_len=1,
        normalize_scores=True,
        len_penalty=1.0,
        unk_penalty=0.0,
        temperature=1.0,
        no_repeat_ngram_size=0,
        sync_every=None,
        compact_fraction=None,
        cuda_graphs=True,
        deferred_reads=None,
        sampling=False,
        sampling_topk=-1,
        sampling_topp=-1.0,
        generator=None,
    ):
        """``models``: one ls_transformer model; the other arguments as fairseq's SequenceGenerator's.
        ``sync_every``: steps between the host's reads of the done flags (default: 1 for a model on
        the CPU, where a read costs nothing, else 8); ``compact_fraction``: the fraction of the
        batch's sentences that must be done before they are dropped at a sync point (default: any
        on the CPU, as fairseq drops them, else a quarter: dropping copies the caches once);
        ``cuda_graphs``: on a GPU, replay the ordinary steps from a CUDA graph (generation.graphs);
        ``deferred_reads``: make a compaction decided at a sync point at the next one, and read that
        one's flags only once the step after it is launched (default: where the steps run through
        CUDA graphs), so that the device runs an interval's steps while the host compacts the batch
        and captures the next step's graph, instead of waiting idle for them. ``sampling``,
        ``sampling_topk``, ``sampling_topp``: fairseq's sampling instead of beam search (see the module
        docstring); ``generator``: the torch.Generator on the model's device it draws from (default:
        the device's default one; on a GPU a generator of its own runs the steps without CUDA graphs)."""
        super().__init__()
        if len(models) != 1:
            raise ValueError("LSSequenceGenerator: one model, not an ensemble of {}".format(len(models)))
        if no_repeat_ngram_size == 1 or no_repeat_ngram_size < 0:
            raise ValueError("LSSequenceGenerator: --no-repeat-ngram-size {} (0 or at least 2)".format(
                no_repeat_ngram_size))
        if temperature <= 0:
            raise ValueError("--temperature must be greater than 0")
        if not sampling and (sampling_topk > 0 or sampling_topp > 0):
            raise ValueError("--sampling-topk and --sampling-topp require --sampling (got --sampling-topk {}, "
                             "--sampling-topp {})".format(sampling_topk, sampling_topp))
        if sampling_topk == 0 or sampling_topk < -1:
            raise ValueError("--sampling-topk {}: a positive number of tokens, or -1 for all".format(sampling_topk))
        self.model = models[0]
        self.tgt_dict = tgt_dict
        self.pad, self.unk, self.eos = tgt_dict.pad(), tgt_dict.unk(), tgt_dict.eos()
        self.symbols_to_strip_from_output = {self.eos}
        self.vocab_size = len(tgt_dict)
        self.beam_size = min(beam_size, self.vocab_size - 1)
        self.sampling, self.sampling_topk, self.sampling_topp = sampling, sampling_topk, sampling_topp
        self.generator = generator
        if not sampling and 2 * self.beam_size > self.vocab_size - 1:
            raise ValueError("LSSequenceGenerator: beam {} needs a vocabulary of more than {} symbols ({})".format(
                self.beam_size, 2 * self.beam_size + 1, self.vocab_size))
        self.max_len_a, self.max_len_b, self.min_len = max_len_a, max_len_b, min_len
        self.max_len = max_len or self.model.max_decoder_positions()
        self.normalize_scores, self.len_penalty = normalize_scores, len_penalty
        self.unk_penalty, self.temperature = unk_penalty, temperature
        self.no_repeat_ngram_size = no_repeat_ngram_size
        self.sync_every, self.compact_fraction = sync_every, compact_fraction
        self.deferred_reads = deferred_reads
        self.step_graph = StepGraph() if cuda_graphs else None
        self.buffers = Buffers()  # a batch's tensors, kept for the next batch of the same shapes
        self.model.eval()

    @classmethod
    def from_args(cls, models, tgt_dict, args):
        """From fairseq's generation options, with the defaults of FairseqTask.build_generator."""
        return cls(
            models, tgt_dict,
            beam_size=getattr(args, "beam", 5),
            max_len_a=getattr(args, "max_len_a", 0),
            max_len_b=getattr(args, "max_len_b", 200),
            min_len=getattr(args, "min_len", 1),
            normalize_scores=not getattr(args, "unnormalized", False),
            len_penalty=getattr(args, "lenpen", 1),
            unk_penalty=getattr(args, "unkpen", 0),
            temperature=getattr(args, "temperature", 1.0),
            no_repeat_ngram_size=getattr(args, "no_repeat_ngram_size", 0),
            sampling=getattr(args, "sampling", False),
            sampling_topk=getattr(args, "sampling_topk", -1),
            sampling_topp=getattr(args, "sampling_topp", -1.0),
        )

    def cuda(self):
        self.model.cuda()
        return self

    @torch.no_grad()
    def forward(self, sample, prefix_tokens=None, bos_token=None):
        return self._generate(sample, prefix_tokens, bos_token=bos_token)

    @torch.no_grad()
    def generate(self, models, sample, **kwargs):
        """fairseq's generator interface (``models`` is the generator's own model)."""
        return self._generate(sample, **kwargs)

    def _generate(self, sample, prefix_tokens=None, constraints=None, bos_token=None):
        if constraints is not None:
            raise NotImplementedError("Target-side constraints were provided, but search method doesn't support them")
        device = sample["net_input"]["src_tokens"].device
        max_len = self._max_len(sample)
        if self.min_len > max_len:
            raise ValueError("min_len cannot be larger than max_len, please adjust these! (--min-len {}, "
                             "maximum length {})".format(self.min_len, max_len))
        sync_every = self.sync_every or (1 if device.type == "cpu" else 8)
        compact_fraction = self.compact_fraction
        if compact_fraction is None:
            compact_fraction = 0.0 if device.type == "cpu" else 0.25

        graph = self.step_graph if graphs_on(device) else None
        if self.sampling and self.generator is not None:
            graph = None  # a capture replays the default generator's draws only
        if graph is None or device.type != "cuda":
            return self._search(sample, prefix_tokens, bos_token, graph, sync_every, compact_fraction).results()
        # the whole batch on the graphs' stream (one cuBLAS workspace, not one per stream); the results
        # assembled on the caller's, after that stream's work
        stream = decoding_stream(device)
        graph.stream = stream
        with on_stream(stream):
            s = self._search(sample, prefix_tokens, bos_token, graph, sync_every, compact_fraction)
        return s.results()

    def _search(self, sample, prefix_tokens, bos_token, graph, sync_every, compact_fraction):
        """The beam search over ``sample``'s batch (its steps through ``graph``, a StepGraph, or all
        eager where None); returns the final _State."""
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        B, src_len = src_tokens.shape[:2]
        k, device = self.beam_size, src_tokens.device
        max_len = self._max_len(sample)
        deferred = self.deferred_reads if self.deferred_reads is not None else graph is not None
        buffers = self.buffers if graph is not None else None
        take = buffers.take if buffers is not None else new_tensor
        decoder_only = getattr(self.model, "encoder", None) is None  # ls_transformer_lm
        encoder_out = None if decoder_only else self.model.encoder.forward_torchscript(net_input)
        prefilled = self._prompt_length(prefix_tokens, max_len) if decoder_only else 0
        cache = DecoderCache(self.model.decoder, encoder_out, k, max(min(INITIAL_CAPACITY, max_len + 1), prefilled),
                             max_len + 1, buffers, sentences=B)
        s = _State.start(B, k, max_len + 1, device, self.pad, take, every_beam=self.sampling)
        s.tokens[:, 0] = self.eos if bos_token is None else bos_token
        parents = take("parents", (B * k,), torch.long, device).zero_()  # each hypothesis's, for the next step
        if prefilled:
            self._prefill(s, cache, prefix_tokens[:, :prefilled])
            # every hypothesis holds its sentence's prompt in its own slot: the next step continues each as it is
            torch.arange(B * k, out=parents)
        t = take("t", (), torch.long, device)  # the step, where the step's ops read it
        # step 0 reorders too (by the zeros in parents: no history to move yet), so that it is an
        # ordinary step like the later ones and shares their graph
        reorder, batch, phase = k > 1, next(_BATCHES), 0
        # until the batch's first growth or compaction its tensors are the buffers of its shapes (not with
        # a prefix: _force_prefix replaces the histories), and the key of those shapes lets a batch like
        # the last one replay the last one's graph. The key also holds what such a graph reads besides:
        # the buffers as taken (none made since), the weights where they are, the sinusoid tables as made
        shapes = None
        if buffers is not None and prefix_tokens is None:
            weights = hash(tuple(p.data_ptr() for p in self.model.parameters()))
            shapes = ("shapes", B, src_len, max_len, cache.capacity, cache.encoder_padding is None, buffers.made,
                      weights, sinusoid_tables_made())
        pending = None  # flags read where a compaction was made, consumed once the next step is launched
        scheduled = None  # the sentences to keep at the next sync point (a compaction decided at this one)
        for step in range(prefilled, max_len + 1):
            t.fill_(step)
            cache.prepare(step)
            if graph is not None and self._ordinary(step, max_len, prefix_tokens):
                key = shapes if shapes and phase == 0 and cache.generation == 0 else (batch, phase, cache.generation)
                graph.run(key, lambda: self._step(
                    s, cache, parents, t, t + 1, step, max_len, prefix_tokens, reorder),
                    cache.capacity)
            else:
                self._step(s, cache, parents, t, step + 1, step, max_len, prefix_tokens, reorder)
            if step == max_len:
                break

            read = None
            if pending is not None:
                read, pending = pending, None
            elif (step + 1) % sync_every == 0:
                read = _PendingRead(s.done)
                if scheduled is not None:
                    # the compaction decided at the last sync point, made while the device runs this
                    # interval's steps; its flags are read once the next step (a capture) is launched
                    s, cache, parents, prefix_tokens = self._compact(s, cache, parents, prefix_tokens, scheduled)
                    read.keep(scheduled)
                    pending, read, scheduled, phase = read, None, None, phase + 1
            if read is None:
                continue
            done = read.value()
            if bool(done.all()):
                break
            if int(done.sum()) >= max(1, compact_fraction * done.numel()):
                kept = (~done).nonzero().view(-1)
                if deferred:
                    scheduled = kept
                else:
                    s, cache, parents, prefix_tokens = self._compact(s, cache, parents, prefix_tokens, kept)
                    phase += 1
        return s

    def _prompt_length(self, prefix_tokens, max_len):
        """How many of a decoder-only model's prompt tokens ``_prefill`` forces in one pass: the leading
        columns of ``prefix_tokens`` with no padding and no EOS in any row (a shorter prompt's sentence
        decodes from its end on, and an EOS finishes a hypothesis: the steps do those), at most ``max_len``
        (fairseq forces the prefix before the maximum length only). None with n-gram blocking, which may
        bar a prompt token at a step (fairseq blocks after forcing)."""
        if prefix_tokens is None or self.no_repeat_ngram_size > 0 or prefix_tokens.shape[1] == 0:
            return 0
        ordinary = host_read(prefix_tokens.ne(self.pad) & prefix_tokens.ne(self.eos)).all(0)
        return min(int(ordinary.cumprod(0).sum()), max_len)

    def _prefill(self, s, cache, prompt):
        """Steps 0..P-1 of a decoder-only model whose tokens ``prompt`` [sentences, P] are forced, in one
        pass of the decoder (``prefill``: the keys and values of positions 0..P-1 into every beam's slot)
        instead of P steps: each hypothesis's tokens, positional scores and cumulative score as fairseq's
        forced steps leave them (the forced token's log-probability after the temperature, the padding
        and unk rules, added step by step; at step 0 beam search continues the first beam only, so the
        other beams stay at -inf)."""
        B, P = prompt.shape
        k = s.beam_size
        inputs = torch.cat([s.tokens.view(B, k, -1)[:, 0, :1], prompt[:, :-1]], dim=1)
        logits = self.model.decoder.prefill(inputs, cache)
        if self.temperature != 1.0:
            logits = logits / self.temperature
        lprobs = F.log_softmax(logits, dim=-1, dtype=torch.float32)
        torch.nan_to_num_(lprobs, nan=-math.inf, posinf=math.inf, neginf=-math.inf)
        lprobs[:, :, self.pad] = -math.inf
        if self.unk_penalty:
            lprobs[:, :, self.unk] -= self.unk_penalty
        forced = lprobs.gather(2, prompt[:, :, None])[:, :, 0]
        cum = s.cum.view(B, k)
        scores = s.scores.view(B, k, -1)
        for i in range(P):  # one addition a step, as the steps round them
            cum.add_(forced[:, i : i + 1])
            scores[:, :, i] = cum
        s.tokens.view(B, k, -1)[:, :, 1 : P + 1] = prompt[:, None, :]

    def _compact(self, s, cache, parents, prefix_tokens, kept):
        """Only the sentences ``kept`` (host indices) stay in the batch, the others' results saved:
        (state, cache, parents, prefix_tokens) for the rest of the search."""
        k, device = s.beam_size, parents.device
        leave = torch.ones(s.done.numel(), dtype=torch.bool)
        leave[kept] = False
        keep = to_device(kept, device)
        s = s.keep(keep, to_device(leave.nonzero().view(-1), device))
        cache.keep_sentences(keep)
        # the kept hypotheses' reorder now, and an identity for the next step's: that step then works
        # on the buffers of the steps after it (one CUDA graph serves them all)
        cache.reorder(parents.view(-1, k)[keep].view(-1))
        parents = torch.arange(keep.numel() * k, device=device)
        if prefix_tokens is not None:
            prefix_tokens = prefix_tokens[keep]
        return s, cache, parents, prefix_tokens

    def _max_len(self, sample):
        """The longest output of ``sample``'s batch (fairseq's: max_len_a x source length + max_len_b,
        within the model's positions)."""
        src_len = sample["net_input"]["src_tokens"].shape[1]
        return min(int(self.max_len_a * src_len + self.max_len_b), self.max_len - 1)

    def _ordinary(self, step, max_len, prefix_tokens):
        """Whether step ``step`` does what every other ordinary step does, on the device alone: past
        the prefix, before the maximum length, no n-gram blocking (whose windows the host counts).
        The minimum length is the device's test of the step tensor."""
        return (step < max_len and self.no_repeat_ngram_size == 0
                and (prefix_tokens is None or step >= prefix_tokens.shape[1]))

    def _step(self, s, cache, parents, t, length, step, max_len, prefix_tokens, reorder):
        """One step of the search, on the device: the hypotheses continue their ``parents`` (when
        ``reorder``), the decoder runs at step ``t`` (a 0-d tensor; ``length`` = step + 1, which
        decode_attention reads), candidates are chosen, the finished ones written, and ``parents`` and
        the state ``s`` updated in place. ``step``, the host's number of the step, is read only where
        the step is special (minimum and maximum length, prefix, n-gram blocking)."""
        k, V = s.beam_size, self.vocab_size
        if reorder:
            cache.reorder(parents)
        cache.begin_step(t, length)
        logits = self.model.decoder.decode_step(s.tokens.gather(1, t.expand(s.tokens.shape[0], 1)), cache)
        if self.sampling:
            tokens, lp = sample_next(self._log_probs(logits, t, step, max_len, s, prefix_tokens), self.sampling_topk,
                                     self.sampling_topp, self.generator)
            # candidates for beam_advance: each hypothesis's draw (an EOS finishes it), then the same draws
            # at -inf, which continue in the place of those finished as dead hypotheses
            values = (s.cum + lp).view(-1, k)
            index = torch.arange(k, device=tokens.device) * V + tokens.view(-1, k)
            values = torch.cat([values, torch.full_like(values, -math.inf)], dim=1)
            beam_advance(values, torch.cat([index, index], dim=1), t, s, parents, self.eos, self.pad, V,
                         self.len_penalty, self.normalize_scores, advance=step != max_len)
            return
        if self.temperature == 1.0 and self._ordinary(step, max_len, prefix_tokens):
            # the log-probabilities' rules of an ordinary step and the cumulative scores in one op
            scores = beam_scores(logits, s.cum, t, self.pad, self.unk, self.unk_penalty, self.eos, self.min_len)
        else:
            scores = self._log_probs(logits, t, step, max_len, s, prefix_tokens) + s.cum[:, None]

        # 2 x beam candidates per sentence; at step 0 only the first beam's (the others start at -inf)
        values, index = beam_select(scores.view(-1, k * V), 2 * k)
        # the finished ones written, the first beam that do not end the sentence continued (fairseq's
        # finalize_hypos and active_hypos), the state updated in place: its tensors keep their memory
        beam_advance(values, index, t, s, parents, self.eos, self.pad, V, self.len_penalty, self.normalize_scores,
                     advance=step != max_len)

    def _log_probs(self, logits, t, step, max_len, s, prefix_tokens):
        """fairseq's per-step log-probabilities: temperature, log-softmax in fp32, NaN -> -inf, no pad,
        the unk penalty, only EOS at the maximum length, then the prefix or the minimum length (EOS
        barred while the step tensor ``t`` is below it, a test on the device), then n-gram blocking."""
        if self.temperature != 1.0:
            logits = logits.div_(self.temperature)
        lprobs = F.log_softmax(logits, dim=-1, dtype=torch.float32)
        torch.nan_to_num_(lprobs, nan=-math.inf, posinf=math.inf, neginf=-math.inf)  # one kernel, not isnan's two
        lprobs[:, self.pad] = -math.inf
        if self.unk_penalty:
            lprobs[:, self.unk] -= self.unk_penalty
        if step >= max_len:
            lprobs[:, : self.eos] = -math.inf
            lprobs[:, self.eos + 1 :] = -math.inf
        if prefix_tokens is not None and step < prefix_tokens.shape[1] and step < max_len:
            lprobs = self._force_prefix(lprobs, step, s, prefix_tokens)
        elif self.min_len > 0:
            lprobs[:, self.eos].masked_fill_(t < self.min_len, -math.inf)
        if self.no_repeat_ngram_size > 0:
            self._block_ngrams(lprobs, s.tokens, step)
        return lprobs

    def _force_prefix(self, lprobs, step, s, prefix_tokens):
        """fairseq's _prefix_tokens: a hypothesis whose prefix token here is not padding may only take
        it; where the prefix ends the sentence, every beam becomes a copy of the first."""
        k = s.beam_size
        forced = prefix_tokens[:, step].repeat_interleave(k)[:, None]
        only = torch.full_like(lprobs, -math.inf).scatter_(1, forced, lprobs.gather(1, forced))
        lprobs = torch.where(forced.ne(self.pad), only, lprobs)
        ends = forced.view(-1, k)[:, 0].eq(self.eos)

        def first_beam(t):
            t3 = t.view(ends.numel(), k, -1)
            return torch.where(ends[:, None, None], t3[:, :1], t3).view(t.shape)

        s.tokens = first_beam(s.tokens)
        s.scores = first_beam(s.scores)
        if step > 0:  # at step 0 fairseq's search reads only the first beam
            s.cum = first_beam(s.cum[:, None]).view(-1)
        return first_beam(lprobs)

    def _block_ngrams(self, lprobs, tokens, step):
        """-inf for every token that would repeat an n-gram of the hypothesis (BOS included, as fairseq's
        CUDA extension does): windows of n - 1 tokens equal to the last n - 1 ban the token after them."""
        n = self.no_repeat_ngram_size
        windows = step + 2 - n
        if windows <= 0:
            return
        seen = tokens[:, : step + 1]
        match = seen.unfold(1, n - 1, 1)[:, :windows].eq(seen[:, None, step + 2 - n :]).all(-1)
        after = seen[:, n - 1 : n - 1 + windows]
        lprobs.scatter_add_(1, after, torch.where(match, -math.inf, 0.0))

def sample_next(lprobs, topk=-1, topp=-1.0, generator=None):
    """fairseq's Sampling draw, one token per row of ``lprobs`` [N, V] (fp32 log-probabilities after
    the temperature and the masks): (tokens [N] int64, their log-probabilities [N]). The weights are
    exp(lprobs), not renormalised; where ``topp`` > 0 only the smallest set of most likely tokens
    whose cumulative mass (in descending order, as fairseq sums it) reaches ``topp``, the token that
    crosses it included; else where ``topk`` > 0 the ``topk`` most likely. The token is the first
    whose cumulative weight exceeds u x the total, u uniform in [0, 1) from torch.rand on lprobs's
    device with ``generator``: batched tensor ops, nothing read back to the host."""
    if topp > 0:
        weights, ids = lprobs.exp().sort(dim=1, descending=True)
        mass = weights.cumsum(dim=1)
        # kept: the first token, and every one after a position where the mass is still below p
        kept = torch.cat([torch.ones_like(mass[:, :1], dtype=torch.bool), mass[:, :-1].lt(topp)], dim=1)
        weights = weights.masked_fill(~kept, 0.0)
    elif topk > 0:
        weights, ids = lprobs.topk(min(topk, lprobs.shape[1]), dim=1)
        weights = weights.exp()
    else:
        weights, ids = lprobs.exp(), None
    cdf = weights.cumsum(dim=1)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, generator=generator, device=lprobs.device, dtype=cdf.dtype)
    # below the total, so that the token found has a weight above 0
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    pos = torch.searchsorted(cdf, x, right=True).clamp_max_(cdf.shape[1] - 1)
    tokens = pos if ids is None else ids.gather(1, pos)
    return tokens.view(-1), lprobs.gather(1, tokens).view(-1)


class _State:
    """The search's tensors for the sentences still in the batch (``sentence``: their numbers in the
    batch as given) and the output buffers, where sentences' results go when they leave it."""

    RESULTS = ("fin_tokens", "fin_positional", "fin_score", "fin_length", "count")

    def __init__(self, beam_size, **tensors):
        self.beam_size = beam_size
        self.__dict__.update(tensors)

    @classmethod
    def start(cls, B, k, L, device, pad, take=new_tensor, every_beam=False):
        """The state at step 0; ``take``: where its tensors come from (generation.graphs.Buffers.take
        when they must keep their memory from batch to batch); ``every_beam``: every beam starts alive
        (sampling), not only the first (beam search)."""
        N = B * k
        cum = take("cum", (N,), torch.float32, device)
        cum.view(B, k)[:, 0] = 0.0
        cum.view(B, k)[:, 1:] = 0.0 if every_beam else -math.inf
        s = cls(
            k,
            tokens=take("tokens", (N, L + 1), torch.long, device).fill_(pad),
            scores=take("scores", (N, L), torch.float32, device).zero_(),
            cum=cum,
            done=take("done", (B,), torch.bool, device).zero_(),
            count=take("count", (B,), torch.long, device).zero_(),
            # k + 1 slots: the last takes the candidates that are not kept
            fin_tokens=take("fin_tokens", (B, k + 1, L), torch.long, device).fill_(pad),
            fin_positional=take("fin_positional", (B, k + 1, L), torch.float32, device).zero_(),
            fin_score=take("fin_score", (B, k + 1), torch.float32, device).fill_(-math.inf),
            fin_length=take("fin_length", (B, k + 1), torch.long, device).zero_(),
            sentence=torch.arange(B, device=device),
        )
        s.out = [torch.empty_like(getattr(s, name)) for name in cls.RESULTS]
        return s

    def _save(self, rows):
        """Copy the results of the sentences at ``rows`` into the output buffers."""
        where = self.sentence[rows]
        for out, name in zip(self.out, self.RESULTS):
            out.index_copy_(0, where, getattr(self, name)[rows])

    def keep(self, keep, leave):
        """The state of the sentences at ``keep`` only; the results of those at ``leave`` saved."""
        self._save(leave)
        k = self.beam_size
        rows = (keep[:, None] * k + torch.arange(k, device=keep.device)).view(-1)
        new = _State(k, tokens=self.tokens[rows], scores=self.scores[rows], cum=self.cum[rows])
        for name in ("done", "sentence") + self.RESULTS:
            setattr(new, name, getattr(self, name)[keep])
        new.out = self.out
        return new

    def results(self):
        """fairseq's output: per sentence its finished hypotheses, best first."""
        self._save(torch.arange(self.sentence.numel(), device=self.sentence.device))
        tokens, positional, score, length, count = self.out
        k = self.beam_size
        score, order = score[:, :k].sort(dim=1, descending=True, stable=True)
        tokens = tokens[:, :k].gather(1, order[:, :, None].expand(-1, -1, tokens.shape[2]))
        positional = positional[:, :k].gather(1, order[:, :, None].expand(-1, -1, positional.shape[2]))
        positional = torch.cat([positional[:, :, :1], positional[:, :, 1:] - positional[:, :, :-1]], dim=2)
        length = length[:, :k].gather(1, order)
        host = host_read(torch.cat([count[:, None], length], dim=1)).numpy()
        # every hypothesis's tokens and positional scores are views of one flat tensor each, cut by one
        # split (a view a hypothesis made by indexing costs the host several times as much); the flat
        # tensors' positions come from the lengths the host has read, so nothing else waits for the GPU
        counts = host[:, 0]
        found = np.arange(k)[None, :] < counts[:, None]
        lengths = host[:, 1:][found]
        rows = np.flatnonzero(found)  # sentence * k + rank of each hypothesis found
        first = rows * tokens.shape[2] - (np.cumsum(lengths) - lengths)
        index = to_device(torch.from_numpy(np.repeat(first, lengths) + np.arange(lengths.sum())), count.device)
        cut = lengths.tolist()
        tokens = tokens.reshape(-1).index_select(0, index).split(cut)
        positional = positional.reshape(-1).index_select(0, index).split(cut)
        score = score.reshape(-1).index_select(0, to_device(torch.from_numpy(rows), count.device)).unbind(0)
        empty = torch.empty(0)
        out, n = [], 0
        for c in counts.tolist():
            out.append([{"tokens": tokens[i], "score": score[i], "attention": empty, "alignment": empty,
                         "positional_scores": positional[i]} for i in range(n, n + c)])
            n += c
        return out
