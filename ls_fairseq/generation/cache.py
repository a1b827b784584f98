"""The decoder's state across the steps of one batch of beam search.

- Cross-attention: every layer's keys and values of the encoder output, from one GEMM over the
  batch's sentences (not over sentences x beams), computed once per batch.
- Self-attention: the keys and values of each layer in a preallocated buffer
  [capacity, 2, slots, heads, d_head], written once and never reordered: at step p the hypothesis
  in slot n writes position p of slot n. Which slot holds each earlier position of a
  hypothesis is the int32 table ``origin`` [hypotheses, capacity]; a beam reorder copies its rows
  (as the token history is copied), not the keys and values, and ops.decode_attention reads each
  hypothesis's keys and values through its row. The capacity doubles when a step reaches it (up
  to ``limit``, the longest output the search allows), so the output length has no cap of its own.
  When the cache grows, or when at most half of its slots still belong to hypotheses in the batch
  (finished sentences left it), it is rebuilt with one slot per hypothesis, each hypothesis's
  history copied into its own slot: once per growth or compaction, not once per step, and the
  memory of finished sentences is given back. The rebuild goes a layer at a time, each layer's old
  buffer freed once copied, so that it holds the larger of the old and the new cache plus one
  layer's buffer, not both caches.
"""
import torch

from ls_fairseq import ops
from ls_fairseq.ops.decode_attention import decode_attention


class DecoderCache:
    def __init__(self, decoder, encoder_out, beam_size, capacity, limit=None, buffers=None, sentences=None):
        """``buffers``: a generation.graphs.Buffers that the first buffers come from (so that a batch
        of the same shapes as the last one reuses them), or None for new ones. ``encoder_out`` None: a
        decoder-only model (ls_transformer_lm) of ``sentences`` sentences, self-attention alone."""
        self.beam_size = beam_size
        if encoder_out is None:
            self.encoder_kv, self.encoder_padding = [], None
            attn = decoder.layers[0].self_attn
            weight = attn.qkv_proj.weight
            B, H, D = sentences, attn.num_heads, weight.shape[1] // attn.num_heads
        else:
            self.encoder_kv = list(decoder._encoder_keys_values(encoder_out))
            padding = encoder_out["encoder_padding_mask"]
            self.encoder_padding = padding[0] if padding else None
            weight = self.encoder_kv[0]
            B, H, _, D = weight.shape
        shape = (B * beam_size, H, D, len(decoder.layers), weight.dtype, weight.device)
        if buffers is None:
            self.encoder_mask = ops.AttentionMask(self.encoder_padding)
            N, H, D, layers, dtype, device = shape
            self.kv = [torch.empty(capacity, 2, N, H, D, dtype=dtype, device=device) for _ in range(layers)]
            self.origin = torch.zeros(N, capacity, dtype=torch.int32, device=device)
            self.slots = torch.arange(N, dtype=torch.int32, device=device)
        else:
            self._from_buffers(buffers, capacity, shape)
        self.buffers = buffers
        self.limit = limit
        self.generation = 0  # how often the buffers were replaced (a CUDA graph of the step keys on it)

    def _from_buffers(self, buffers, capacity, shape):
        self.encoder_kv = [buffers.holding("encoder_kv{}".format(i), t) for i, t in enumerate(self.encoder_kv)]
        if self.encoder_padding is not None:
            self.encoder_padding = buffers.holding("encoder_padding", self.encoder_padding)
        mask = buffers.kept.get("encoder_mask")
        if mask is not None and mask.key_padding_mask is self.encoder_padding:
            mask.refresh()  # the masks it made before, made again from this batch's padding, in place
        else:
            mask = buffers.kept["encoder_mask"] = ops.AttentionMask(self.encoder_padding)
        self.encoder_mask = mask
        N, H, D, layers, dtype, device = shape
        self.kv = [buffers.take("kv{}".format(i), (capacity, 2, N, H, D), dtype, device) for i in range(layers)]
        self.origin = buffers.take("origin", (N, capacity), torch.int32, device).zero_()
        self.slots = buffers.take("slots", (N,), torch.int32, device)
        torch.arange(N, dtype=torch.int32, out=self.slots)

    def prefill(self, layer, k, v):
        """``layer``'s keys and values [sentences, heads, P, d_head] of a prompt's first P positions, every
        beam of a sentence the same, written at positions 0..P-1 of each hypothesis's own slot."""
        P = k.shape[2]
        for part, value in enumerate((k, v)):
            self.kv[layer][:P, part] = value.permute(2, 0, 1, 3).repeat_interleave(self.beam_size, dim=1)
        self.origin[:, :P] = self.slots[:, None]

    def encoder(self, layer):
        """(keys, values, AttentionMask) of the encoder output for ``layer``: [sentences, heads, S, d_head]."""
        return self.encoder_kv[2 * layer], self.encoder_kv[2 * layer + 1], self.encoder_mask

    @property
    def capacity(self):
        return self.kv[0].shape[0]

    def prepare(self, step):
        """Before step ``step`` (the host's number), the host's decisions: the cache grown if it is
        full, or rebuilt with fewer slots if most of them belong to sentences that left the batch."""
        capacity, N = self.capacity, self.origin.shape[0]
        if step >= capacity:
            self._rebuild(step, max(step + 1, min(2 * capacity, self.limit or 2 * capacity)))
        elif 2 * N <= self.kv[0].shape[2]:
            self._rebuild(step, capacity)

    def begin_step(self, t, length):
        """The step ``t``, a 0-d int64 tensor on the cache's device that every write and read of the
        step uses (so that no shape or index depends on the host's number), and ``length`` = t + 1,
        which decode_attention reads: position t of hypothesis n goes into slot n."""
        N = self.origin.shape[0]
        self.t, self.length = t, length
        self.origin.scatter_(1, t.expand(N, 1), self.slots[:N, None])

    def _rebuild(self, length, capacity):
        """A cache of ``capacity`` positions and one slot per hypothesis holding positions < ``length``
        of each hypothesis's history in its own slot, a layer at a time: each layer's old buffer is
        freed (dropped from the Buffers it came from too) once its history is copied."""
        N = self.origin.shape[0]
        positions = torch.arange(length, device=self.origin.device)[:, None]
        slots = self.origin[:, :length].t().long()
        for layer, old in enumerate(self.kv):
            new = old.new_empty((capacity, 2, N) + old.shape[3:])
            for part in range(2):
                new[:length, part] = old[positions, part, slots]
            self.kv[layer] = new
            if self.buffers is not None and self.buffers.kept.get("kv{}".format(layer)) is old:
                # the next batch takes a new buffer (and so captures its graphs anew): this one is freed now
                del self.buffers.kept["kv{}".format(layer)]
            del old
        self.origin = self.slots[:N, None].expand(N, capacity).contiguous()
        self.generation += 1

    def attend(self, layer, q, k, v, bias=None, scaling=1.0):
        """``layer``'s self-attention at the step: writes the keys and values [N, heads, 1, d_head] of
        its position and returns the attention of q [N, heads, 1, d_head] over positions 0..step. Given
        ``bias``, q, k and v are the projection's output without it (ops.decode_attention adds it and
        scales q by ``scaling``)."""
        return decode_attention(q, self.kv[layer], 0, self.origin, self.length, k, v, bias, scaling)

    def reorder(self, order):
        """Hypothesis n continues hypothesis ``order[n]``; ``order`` may be
        shorter than the current hypotheses when finished sentences leave the batch."""
        picked = self.origin.index_select(0, order)
        if picked.shape == self.origin.shape:
            self.origin.copy_(picked)  # in place: the table keeps its memory while the batch does
        else:
            self.origin = picked
            self.generation += 1

    def keep_sentences(self, keep):
        """Only the sentences ``keep`` (indices) stay in the batch; their hypotheses' rows of ``origin``
        are chosen by the next ``reorder``, whose order names them."""
        self.encoder_kv = [t.index_select(0, keep) for t in self.encoder_kv]
        self.generation += 1
        if self.encoder_padding is not None:
            self.encoder_padding = self.encoder_padding.index_select(0, keep)
        self.encoder_mask = ops.AttentionMask(self.encoder_padding)
