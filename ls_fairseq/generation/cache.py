"""The decoder's state across the steps of one batch of beam search.

- Cross-attention: every layer's keys and values of the encoder output, from one GEMM over the
  batch's sentences (not over sentences x beams), computed once per batch.
- Self-attention: the keys and values of all layers in one preallocated buffer
  [capacity, 2 x layers, slots, heads, d_head], written once and never reordered: at step p the
  hypothesis in slot n writes position p of slot n. Which slot holds each earlier position of a
  hypothesis is the int32 table ``origin`` [hypotheses, capacity]; a beam reorder copies its rows
  (as the token history is copied), not the keys and values, and ops.decode_attention reads each
  hypothesis's keys and values through its row. The capacity doubles when a step reaches it, so
  the output length has no cap of its own.
"""
import torch

from ls_fairseq import ops
from ls_fairseq.ops.decode_attention import decode_attention


class DecoderCache:
    def __init__(self, decoder, encoder_out, beam_size, capacity):
        self.beam_size = beam_size
        self.encoder_kv = list(decoder._encoder_keys_values(encoder_out))
        padding = encoder_out["encoder_padding_mask"]
        self.encoder_padding = padding[0] if padding else None
        self.encoder_mask = ops.AttentionMask(self.encoder_padding)
        B, H, _, D = self.encoder_kv[0].shape
        N = B * beam_size
        self.kv = self.encoder_kv[0].new_empty(capacity, len(self.encoder_kv), N, H, D)
        self.origin = torch.zeros(N, capacity, dtype=torch.int32, device=self.kv.device)
        self.slots = torch.arange(N, dtype=torch.int32, device=self.kv.device)

    def encoder(self, layer):
        """(keys, values, AttentionMask) of the encoder output for ``layer``: [sentences, heads, S, d_head]."""
        return self.encoder_kv[2 * layer], self.encoder_kv[2 * layer + 1], self.encoder_mask

    def begin_step(self, step):
        """Position ``step`` of hypothesis n is written into slot n (growing the cache if it is full)."""
        if step >= self.kv.shape[0]:
            grown = self.kv.new_empty((2 * self.kv.shape[0],) + self.kv.shape[1:])
            grown[: self.kv.shape[0]] = self.kv
            self.kv = grown
            origin = self.origin.new_zeros(self.origin.shape[0], 2 * self.origin.shape[1])
            origin[:, : self.origin.shape[1]] = self.origin
            self.origin = origin
        N = self.origin.shape[0]
        self.origin[:, step] = self.slots[:N]

    def attend(self, layer, step, q, k, v):
        """``layer``'s self-attention at ``step``: writes the keys and values [N, heads, 1, d_head] of
        position ``step`` and returns the attention of q [N, heads, 1, d_head] over positions 0..step."""
        N = q.shape[0]
        self.kv[step, 2 * layer, :N] = k[:, :, 0]
        self.kv[step, 2 * layer + 1, :N] = v[:, :, 0]
        return decode_attention(q, self.kv, layer, self.origin, step + 1)

    def reorder(self, order):
        """Hypothesis n continues hypothesis ``order[n]``; ``order`` may be
        shorter than the current hypotheses when finished sentences leave the batch."""
        self.origin = self.origin.index_select(0, order)

    def keep_sentences(self, keep):
        """Only the sentences ``keep`` (indices) stay in the batch; their hypotheses' rows of ``origin``
        are chosen by the next ``reorder``, whose order names them."""
        self.encoder_kv = [t.index_select(0, keep) for t in self.encoder_kv]
        if self.encoder_padding is not None:
            self.encoder_padding = self.encoder_padding.index_select(0, keep)
        self.encoder_mask = ops.AttentionMask(self.encoder_padding)
