"""The decoder's state across the steps of one batch of beam search.

- Cross-attention: every layer's keys and values of the encoder output, from one GEMM over the
  batch's sentences (not over sentences x beams), computed once per batch.
- Self-attention: the keys and values of all layers in one preallocated buffer
  [capacity, 2 x layers, hypotheses, heads, d_head], position-major, so that the positions written
  so far are one contiguous prefix: a beam reorder is one index_select over that prefix into a
  second buffer (no temporaries), and attention reads a layer's keys as a view. The capacity
  doubles when a step reaches it, so the output length has no cap of its own.
"""
import torch

from ls_fairseq import ops


class DecoderCache:
    def __init__(self, decoder, encoder_out, beam_size, capacity):
        self.beam_size = beam_size
        self.encoder_kv = list(decoder._encoder_keys_values(encoder_out))
        padding = encoder_out["encoder_padding_mask"]
        self.encoder_padding = padding[0] if padding else None
        self.encoder_mask = ops.AttentionMask(self.encoder_padding)
        B, H, _, D = self.encoder_kv[0].shape
        self.kv = self.encoder_kv[0].new_empty(capacity, len(self.encoder_kv), B * beam_size, H, D)
        self.spare = None

    def encoder(self, layer):
        """(keys, values, AttentionMask) of the encoder output for ``layer``: [sentences, heads, S, d_head]."""
        return self.encoder_kv[2 * layer], self.encoder_kv[2 * layer + 1], self.encoder_mask

    def append(self, layer, step, k, v):
        """Write ``layer``'s keys and values [N, heads, 1, d_head] of position ``step``; return its keys
        and values of positions 0..step as views [N, heads, step + 1, d_head]."""
        if step >= self.kv.shape[0]:
            grown = self.kv.new_empty((2 * self.kv.shape[0],) + self.kv.shape[1:])
            grown[: self.kv.shape[0]] = self.kv
            self.kv, self.spare = grown, None
        self.kv[step, 2 * layer] = k[:, :, 0]
        self.kv[step, 2 * layer + 1] = v[:, :, 0]
        keys = self.kv[: step + 1, 2 * layer].permute(1, 2, 0, 3)
        return keys, self.kv[: step + 1, 2 * layer + 1].permute(1, 2, 0, 3)

    def reorder(self, order, length):
        """Hypothesis n continues hypothesis ``order[n]`` (positions < ``length``); ``order`` may be
        shorter than the current hypotheses when finished sentences leave the batch."""
        shape = (self.kv.shape[0], self.kv.shape[1], order.numel()) + self.kv.shape[3:]
        if self.spare is None or self.spare.shape != shape:
            self.spare = self.kv.new_empty(shape)
        torch.index_select(self.kv[:length], 2, order, out=self.spare[:length])
        self.kv, self.spare = self.spare, self.kv

    def keep_sentences(self, keep):
        """Only the sentences ``keep`` (indices) stay in the batch; their hypotheses' self-attention
        rows are chosen by the next ``reorder``, whose order names them."""
        self.encoder_kv = [t.index_select(0, keep) for t in self.encoder_kv]
        if self.encoder_padding is not None:
            self.encoder_padding = self.encoder_padding.index_select(0, keep)
        self.encoder_mask = ops.AttentionMask(self.encoder_padding)
