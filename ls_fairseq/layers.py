"""Transformer layers on ls_fairseq.ops, configured by plain keywords (no fairseq needed):
``EncoderLayer``, ``DecoderLayer`` and ``Embedding``. ls_transformer's layers are these, built from
fairseq's configuration (ls_fairseq/models/layers.py); ls_fairseq.hf puts them into Hugging Face BERT.

Each layer holds only parameters (named as in fairseq's transformer, except the
fused projections) and runs: GEMMs through torch (cuBLAS on the GPU), every
other operation through one fused op. Activations are batch-major [B, T, d], any
batch size and length.

  self-attention:  LN? -> GEMM(qkv) -> split_heads(+bias, q scaled; token-major, so that
                   attention's output merges its heads as a view) -> attention
                   -> GEMM(out, heads merged inside) -> bias_dropout_residual (-> LN: one op)
  FFN:             LN? -> GEMM(fc1) with bias + ReLU in its epilogue (or then bias_act_dropout) -> GEMM(fc2)
                   -> bias_dropout_residual (-> LN: one op)

A decoding step (forward_step) has no split_heads: its attention ops take the GEMM's output as it is
and add the bias and scale the query themselves.

In backward the residual's gradient is not added by autograd: the block's end hands it to
the block's first op on x (post-LN: the first GEMM, which accumulates into it; pre-LN: the
LayerNorm), see ops.residual. Under torch.compile there is no hand-off: autograd adds the residual's
gradient inside the graph, where the compiler can fuse the add.

Under torch.autocast the layers run in the dtypes torch's own layers run in there (Hugging Face's under
the Trainer's fp16/bf16): the GEMMs and what runs between two GEMMs (the projections' biases, the
attention, the activation) in the autocast dtype, the residual stream and its ops (bias_dropout_residual,
the LayerNorms) in x's dtype, as autocast leaves a LayerNorm of an fp32 residual stream in fp32. The fused
ops take one dtype each, so autocast is off inside the layer and the casts are the layer's (``_autocast``);
without autocast every cast is a no-op. The residual's gradient is then autograd's (no hand-off: the
block's first op and its end run in different dtypes).
"""
import contextlib
import math

import torch
import torch.nn as nn

from ls_fairseq import ops
from ls_fairseq.ops import dispatch
from ls_fairseq.ops.beam_attention import beam_attention
from ls_fairseq.ops.bias_act_dropout import ACTIVATIONS


def _xavier_blocks(weight, block_rows, gain):
    """fairseq's init of separate q/k/v projections, applied block by block."""
    for start in range(0, weight.shape[0], block_rows):
        nn.init.xavier_uniform_(weight.data[start : start + block_rows], gain=gain)


def _autocast(x):
    """(the dtype of the GEMMs and of what runs between them, the context to run the layer in): under
    torch.autocast on x's device its dtype and autocast switched off (module docstring), else x's dtype and
    nothing."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device), torch.autocast(device, enabled=False)
    return x.dtype, contextlib.nullcontext()


class SelfAttention(nn.Module):
    """Parameters of one self-attention block: fused qkv_proj ([q; k; v]) and out_proj."""

    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.scaling = (embed_dim // num_heads) ** -0.5
        self.qkv_proj = nn.Linear(embed_dim, 3 * embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        _xavier_blocks(self.qkv_proj.weight, embed_dim, 1 / math.sqrt(2))
        nn.init.uniform_(self.qkv_proj.bias, -(embed_dim**-0.5), embed_dim**-0.5)
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.constant_(self.out_proj.bias, 0.0)


class CrossAttention(nn.Module):
    """Query and output projections of one cross-attention block; the keys and
    values of all layers come from the decoder's single encoder_attn_kv_proj."""

    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.scaling = (embed_dim // num_heads) ** -0.5
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        nn.init.xavier_uniform_(self.q_proj.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.constant_(self.out_proj.bias, 0.0)


class _Layer(nn.Module):
    def __init__(self, embed_dim, num_heads, ffn_dim, normalize_before=False, activation_fn="relu", layer_norm_eps=1e-5,
                 dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, deterministic=False, fp8=None,
                 gemms=None):
        """``fp8``: an ops.Fp8Recipe (FP8 training GEMMs) or None; ``gemms``: this layer's linear layers,
        each with the recipe's name for it."""
        super().__init__()
        if embed_dim % num_heads != 0:
            raise ValueError("{}: embed_dim {} is not divisible by num_heads {}".format(
                type(self).__name__, embed_dim, num_heads))
        if activation_fn not in ACTIVATIONS:
            raise ValueError("{}: activation_fn {!r} is not one the fused kernels have ({})".format(
                type(self).__name__, activation_fn, ", ".join(ACTIVATIONS)))
        self.fp8 = {key: fp8.gemm(name) for key, name in gemms.items()} if fp8 is not None else {}
        self.normalize_before = normalize_before
        self.layer_norm_eps = layer_norm_eps
        self.dropout = dropout
        self.attention_dropout = attention_dropout
        self.activation_dropout = activation_dropout
        self.activation_fn = activation_fn
        self.deterministic = deterministic
        self.self_attn = SelfAttention(embed_dim, num_heads)
        self.self_attn_layer_norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps)
        self.fc1 = nn.Linear(embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, embed_dim)
        self.final_layer_norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps)

    def _fp8(self, name):
        """The Fp8Gemm of linear layer ``name`` in training, else None (evaluation stays in the run's dtype)."""
        return self.fp8.get(name) if self.training else None

    def _block_output(self, out, bias, x, ln, residual):
        """The block's end: x + dropout(out + bias), then LN post-LN (one op), in x's dtype (out cast to it)."""
        out, bias = out.to(x.dtype), bias.to(x.dtype)
        if self.normalize_before:
            return ops.bias_dropout_residual(out, bias, x, self.dropout, self.training, residual_grad=residual)
        return ops.bias_dropout_residual_layer_norm(out, bias, x, ln.weight, ln.bias, self.dropout, self.training,
                                                    eps=self.layer_norm_eps, residual_grad=residual)

    def _block_input(self, x, ln, dtype):
        """(h, residual, gemm_residual) for a block on x: h its branch's input in ``dtype`` (the GEMMs': x, or
        LN(x) pre-LN, the LayerNorm in x's dtype); residual the ops.ResidualGrad that hands the residual's
        gradient from the block's end to its first op on x (pre-LN: the LayerNorm; post-LN: the first GEMM,
        given gemm_residual)."""
        # under torch.compile autograd adds the residual's gradient, in the graph (no hand-off); under autocast too
        residual = None if dispatch.compiling() or dtype != x.dtype else ops.ResidualGrad()
        if self.normalize_before:
            h = ops.layer_norm(x, ln.weight, ln.bias, self.layer_norm_eps, residual_grad=residual)
            return h.to(dtype), residual, None
        return x.to(dtype), residual, residual

    def _self_attention(self, x, mask, dtype, cache=None):
        attn = self.self_attn
        h, residual, gemm_residual = self._block_input(x, self.self_attn_layer_norm, dtype)
        qkv = ops.linear(h, attn.qkv_proj.weight.to(dtype), residual_grad=gemm_residual, fp8=self._fp8("qkv"))
        q, k, v = ops.split_heads(qkv, attn.qkv_proj.bias.to(dtype), attn.num_heads, 3, attn.scaling,
                                  token_major=True)
        if callable(cache):  # an external cache (Hugging Face's): it appends the new keys and values, gives all
            k, v = cache(k, v)
        elif cache is not None:
            if "k" in cache:
                k = torch.cat([cache["k"], k], dim=2)
                v = torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        ctx = ops.attention(q, k, v, mask, self.attention_dropout, self.training, self.deterministic)
        out = ops.linear(ctx, attn.out_proj.weight.to(dtype), heads=True, fp8=self._fp8("out"))
        return self._block_output(out, attn.out_proj.bias, x, self.self_attn_layer_norm, residual)

    def _ffn(self, x, dtype):
        h, residual, gemm_residual = self._block_input(x, self.final_layer_norm, dtype)
        h = ops.linear_bias_act(h, self.fc1.weight.to(dtype), self.fc1.bias.to(dtype), self.activation_fn,
                                self.activation_dropout, self.training, residual_grad=gemm_residual,
                                fp8=self._fp8("fc1"))
        return self._block_output(ops.linear(h, self.fc2.weight.to(dtype), fp8=self._fp8("fc2")), self.fc2.bias, x,
                                  self.final_layer_norm, residual)


_LAYER_GEMMS = {"qkv": "qkv", "out": "out", "fc1": "fc1", "fc2": "fc2"}


class EncoderLayer(_Layer):
    """A Transformer encoder layer: self-attention, then the FFN, each a residual block, post-LN (fairseq's
    and BERT's default) or pre-LN (``normalize_before``). x [B, T, embed_dim]; ``mask`` an
    ops.AttentionMask (``ops.AttentionMask(key_padding_mask)``, True at padding; or None)."""

    def __init__(self, embed_dim, num_heads, ffn_dim, **kwargs):
        """Keyword options: normalize_before (False), activation_fn ("relu", "gelu": the exact erf form, or
        "gelu_accurate": the tanh form),
        layer_norm_eps (1e-5), dropout, attention_dropout, activation_dropout (0.0), deterministic (False:
        bit-identical reruns on the GPU), fp8 (an ops.Fp8Recipe or None)."""
        super().__init__(embed_dim, num_heads, ffn_dim, gemms=_LAYER_GEMMS, **kwargs)

    def forward(self, x, mask):
        dtype, autocast_off = _autocast(x)
        with autocast_off:
            return self._ffn(self._self_attention(x, mask, dtype), dtype)


class DecoderLayer(_Layer):
    """A Transformer decoder layer: causal self-attention, cross-attention, then the FFN (options as
    EncoderLayer's). The cross-attention's keys and values come from the caller, projected from the
    encoder output once for all layers (LightSeq2: ls_transformer's decoder.encoder_attn_kv_proj);
    ``cross_attention=False`` makes a decoder-only layer (then ``forward(x, self_mask)``)."""

    def __init__(self, embed_dim, num_heads, ffn_dim, cross_attention=True, exact_cross_attention=True, **kwargs):
        """``exact_cross_attention``: the cross-attention's backward forms the softmax's row term from the fp32
        probabilities (never SDPA/FlashAttention, whose row term comes from the 16-bit output), as stock fairseq
        computes cross-attention; False lets it take FlashAttention like self-attention."""
        super().__init__(embed_dim, num_heads, ffn_dim, gemms=dict(_LAYER_GEMMS, q="q", cross_out="out"), **kwargs)
        self.exact_cross_attention = exact_cross_attention
        self.encoder_attn = CrossAttention(embed_dim, num_heads) if cross_attention else None
        self.encoder_attn_layer_norm = nn.LayerNorm(embed_dim, eps=self.layer_norm_eps) if cross_attention else None

    def forward(self, x, self_mask, enc_k=None, enc_v=None, enc_mask=None, cache=None):
        """enc_k/enc_v: this layer's keys and values of the encoder output [B, heads, S, d_head];
        ``cache`` (a dict) holds the self-attention keys/values in incremental decoding (x then the
        new tokens alone, ``self_mask`` ops.AttentionMask(causal=True)); or a function (k, v) -> (k, v)
        that appends the new keys and values [B, heads, T, d_head] to a cache of its own and gives all."""
        dtype, autocast_off = _autocast(x)
        with autocast_off:
            x = self._self_attention(x, self_mask, dtype, cache=cache)
            if self.encoder_attn is not None:
                x = self._cross_attention(x, enc_k.to(dtype), enc_v.to(dtype), enc_mask, dtype)
            return self._ffn(x, dtype)

    def _cross_attention(self, x, enc_k, enc_v, enc_mask, dtype):
        attn = self.encoder_attn
        h, residual, gemm_residual = self._block_input(x, self.encoder_attn_layer_norm, dtype)
        q = ops.linear(h, attn.q_proj.weight.to(dtype), residual_grad=gemm_residual, fp8=self._fp8("q"))
        (q,) = ops.split_heads(q, attn.q_proj.bias.to(dtype), attn.num_heads, 1, attn.scaling)
        ctx = ops.attention(q, enc_k, enc_v, enc_mask, self.attention_dropout, self.training, self.deterministic,
                            exact_row_term=self.exact_cross_attention)
        out = ops.linear(ctx, attn.out_proj.weight.to(dtype), heads=True, fp8=self._fp8("cross_out"))
        return self._block_output(out, attn.out_proj.bias, x, self.encoder_attn_layer_norm, residual)

    def forward_step(self, x, cache, index):
        """One step of incremental decoding (ls_fairseq.generation): x [N, 1, d] for the token at the
        cache's step of N = sentences x beams hypotheses. This layer's self-attention keys and
        values go into ``cache`` (a generation.DecoderCache; ``index`` this layer's number) at
        the step and the query attends to positions 0..step; the cross-attention takes the cache's
        keys and values of the encoder output (computed once per batch, one row per sentence) with
        the beams of a sentence as one block of queries, so they are never copied per beam. Both
        attention ops take their projection's GEMM output as it is, adding the bias and scaling
        the query themselves (no split_heads launch). It runs in x's dtype (the generator's; autocast
        is not read)."""
        attn = self.self_attn
        h, residual, _ = self._block_input(x, self.self_attn_layer_norm, x.dtype)
        q, k, v = ops.linear(h, attn.qkv_proj.weight).view(x.shape[0], 3, attn.num_heads, 1, -1).unbind(1)
        ctx = cache.attend(index, q, k, v, attn.qkv_proj.bias, attn.scaling)
        x = self._block_output(ops.linear(ctx, attn.out_proj.weight, heads=True), attn.out_proj.bias, x,
                               self.self_attn_layer_norm, residual)
        if self.encoder_attn is None:  # a decoder-only layer
            return self._ffn(x, x.dtype)
        attn = self.encoder_attn
        h, residual, _ = self._block_input(x, self.encoder_attn_layer_norm, x.dtype)
        enc_k, enc_v, enc_mask = cache.encoder(index)
        N, B, H = x.shape[0], enc_k.shape[0], attn.num_heads
        q = ops.linear(h, attn.q_proj.weight).view(B, N // B, H, -1).transpose(1, 2)
        ctx = beam_attention(q, enc_k, enc_v, enc_mask, attn.q_proj.bias, attn.scaling)
        out = ops.linear(ctx, attn.out_proj.weight, heads=True).reshape(N, 1, -1)
        x = self._block_output(out, attn.out_proj.bias, x, self.encoder_attn_layer_norm, residual)
        return self._ffn(x, x.dtype)


class Embedding(nn.Module):
    """Token embedding plus positions, scaled and dropped out in one fused op (ops.embedding): x =
    dropout(scale * table[token] + position_embedding), zero at padding. Positions are fairseq's
    (padding_idx + 1 onwards; ops.make_positions), from a learned table (``learned_positions``, one
    row per position up to ``max_positions``) or fairseq's sinusoids (any length). ``scale``: None
    is sqrt(embedding_dim) (fairseq's default). tokens [B, T] -> [B, T, embedding_dim]."""

    def __init__(self, num_embeddings, embedding_dim, padding_idx, learned_positions=False, max_positions=1024,
                 scale=None, dropout=0.0):
        super().__init__()
        self.padding_idx = padding_idx
        self.scale = embedding_dim**0.5 if scale is None else scale
        self.dropout = dropout
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        nn.init.normal_(self.weight, mean=0, std=embedding_dim**-0.5)
        self.positions = None
        if learned_positions:
            self.positions = nn.Parameter(torch.empty(max_positions + padding_idx + 1, embedding_dim))
            nn.init.normal_(self.positions, mean=0, std=embedding_dim**-0.5)
        with torch.no_grad():
            for table in (self.weight, self.positions):
                if table is not None:
                    table[padding_idx].zero_()

    def forward(self, tokens):
        positions = ops.make_positions(tokens, self.padding_idx)
        return ops.embedding(tokens, positions, self.weight, self.positions, self.scale, self.padding_idx,
                             self.dropout, self.training)
