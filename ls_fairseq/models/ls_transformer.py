"""ls_transformer: fairseq's Transformer (Vaswani et al.) on fused ops.

Numerically fairseq's ``transformer`` (post-LN or pre-LN, relu or gelu,
sinusoidal or learned positions, shared embeddings), with the parameter names
of fairseq's except for the fused projections:
  - ``*.self_attn.qkv_proj`` = fairseq's q_proj, k_proj, v_proj stacked [q; k; v];
  - ``decoder.encoder_attn_kv_proj`` = every decoder layer's encoder_attn
    k_proj and v_proj stacked [k_0; v_0; k_1; v_1; ...], so the keys and values
    of the encoder output for all layers are one GEMM (LightSeq2).
``python -m ls_fairseq.convert`` maps between the two layouts.

Activations are batch-major: the encoder's ``encoder_out["encoder_out"][0]``
is [batch, src_len, dim] (fairseq's own transformer uses [src_len, batch, dim]).
"""
import logging
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import (
    FairseqEncoder,
    FairseqEncoderDecoderModel,
    FairseqIncrementalDecoder,
)

from ls_fairseq import ops, packing
from ls_fairseq.checkpoint import check_model_state
from ls_fairseq.flops import training_flops_per_target_token
from ls_fairseq.models.layers import DecoderLayer, EncoderLayer
from ls_fairseq.packing import Packed

logger = logging.getLogger(__name__)

DEFAULT_MAX_POSITIONS = 1024
FP8_GEMMS = ("qkv", "out", "q", "kv", "fc1", "fc2", "vocab")
# --arch name -> the function that sets its defaults; ls_fairseq.fairseq_plugin registers each with fairseq
ARCHITECTURES = {}


def architecture(name):
    def record(fn):
        ARCHITECTURES[name] = fn
        return fn

    return record


def fp8_recipe(args):
    """The model's Fp8Recipe for --ls-fp8 (None without it), after checking the GEMM names."""
    if not getattr(args, "ls_fp8", False):
        return None
    chosen = {}
    for flag in ("ls_fp8_forward", "ls_fp8_dgrad"):
        names = [n.strip() for n in str(getattr(args, flag)).split(",") if n.strip()]
        unknown = sorted(set(names) - set(FP8_GEMMS))
        if unknown:
            raise ValueError("--{} names unknown GEMM(s) {}; known: {}".format(
                flag.replace("_", "-"), unknown, ",".join(FP8_GEMMS)))
        chosen[flag] = names
    return ops.Fp8Recipe(args.ls_fp8_history, args.ls_fp8_grad_format == "e5m2",
                         chosen["ls_fp8_forward"], chosen["ls_fp8_dgrad"])


@dataclass
class LSTransformerConfig(FairseqDataclass):
    activation_fn: ChoiceEnum(["relu", "gelu"]) = field(
        default="relu", metadata={"help": "activation function of the FFN (gelu: the exact erf form, as fairseq's)"}
    )
    dropout: float = field(default=0.1, metadata={"help": "dropout probability"})
    attention_dropout: float = field(default=0.0, metadata={"help": "dropout probability for attention weights"})
    activation_dropout: float = field(
        default=0.0, metadata={"help": "dropout probability after activation in FFN"}
    )
    encoder_embed_dim: int = field(default=512, metadata={"help": "encoder embedding dimension"})
    encoder_ffn_embed_dim: int = field(default=2048, metadata={"help": "encoder embedding dimension for FFN"})
    encoder_layers: int = field(default=6, metadata={"help": "num encoder layers"})
    encoder_attention_heads: int = field(default=8, metadata={"help": "num encoder attention heads"})
    encoder_normalize_before: bool = field(
        default=False, metadata={"help": "apply layernorm before each encoder block (pre-LN)"}
    )
    encoder_learned_pos: bool = field(default=False, metadata={"help": "use learned positional embeddings in the encoder"})
    decoder_embed_dim: int = field(default=512, metadata={"help": "decoder embedding dimension"})
    decoder_ffn_embed_dim: int = field(default=2048, metadata={"help": "decoder embedding dimension for FFN"})
    decoder_layers: int = field(default=6, metadata={"help": "num decoder layers"})
    decoder_attention_heads: int = field(default=8, metadata={"help": "num decoder attention heads"})
    decoder_normalize_before: bool = field(
        default=False, metadata={"help": "apply layernorm before each decoder block (pre-LN)"}
    )
    decoder_learned_pos: bool = field(default=False, metadata={"help": "use learned positional embeddings in the decoder"})
    share_decoder_input_output_embed: bool = field(
        default=False, metadata={"help": "share decoder input and output embeddings"}
    )
    share_all_embeddings: bool = field(
        default=False,
        metadata={"help": "share encoder, decoder and output embeddings (requires shared dictionary and embed dim)"},
    )
    no_scale_embedding: bool = field(default=False, metadata={"help": "if True, dont scale embeddings"})
    max_source_positions: int = field(
        default=DEFAULT_MAX_POSITIONS, metadata={"help": "Maximum input length supported by the encoder"}
    )
    max_target_positions: int = field(
        default=DEFAULT_MAX_POSITIONS, metadata={"help": "Maximum output length supported by the decoder"}
    )
    ls_deterministic: bool = field(
        default=False,
        metadata={
            "help": "bit-identical reruns and resumes on the GPU: attention in training through cuBLAS and the "
            "fused masked softmax, as LightSeq2 does, instead of FlashAttention, whose backward adds with atomics"
        },
    )
    ls_flash_cross_attention: bool = field(
        default=False,
        metadata={
            "help": "cross-attention in training through FlashAttention (SDPA; with --ls-packed torch's varlen "
            "kernel) like self-attention, its softmax row term formed from the 16-bit output; by default it keeps "
            "the fp32 row term, as stock fairseq's explicit fp32 probabilities do, and with --ls-packed that takes "
            "the slower blocks path. Experimental: its speed and convergence are not yet measured"
        },
    )
    ls_cuda_graphs: bool = field(
        default=False,
        metadata={
            "help": "ls-fairseq-train on a GPU: capture each batch shape's forward and backward in a CUDA graph "
            "at its first occurrence (after the run's first, eager, step) and replay it from then on (one launch instead of ~800 from the host); "
            "pair with --required-seq-len-multiple 8 or more so that batches share shapes"
        },
    )
    ls_packed: bool = field(
        default=False,
        metadata={
            "help": "train on packed batches: each side's real tokens as one stream with sentence offsets (the "
            "same sentences per batch as fairseq's batching), each stream rounded up to one of 8 capacities "
            "(multiples of 16) chosen from the epoch's batches, so the only padding is the stream's tail (1 to "
            "2.5 percent of the FLOPs at 16,384-4,096 tokens, scripts/padding_cost.py), the same shapes eager or with "
            "--ls-cuda-graphs; attention through ls's Triton segment kernels on the GPU; validation and "
            "translation stay padded"
        },
    )
    ls_fp8: bool = field(
        default=False,
        metadata={
            "help": "experimental (its convergence is not yet shown, docs/parity.md): training GEMMs in FP8, "
            "each operand scaled by its delayed per-tensor scale and rounded to float8 (e4m3; output gradients "
            "e5m2 by default), saturating; on FP8 tensor cores (sm_89 and later) with fp32 accumulation, on the "
            "CPU a reference that rounds through torch's float8 dtypes the same way and multiplies the rounded "
            "values in fp32; the rest of the step in the run's dtype; only GEMMs whose M (the batch's tokens), "
            "K and N are multiples of 16 (the first step's log names each GEMM and its shape); the first step, "
            "validation and translation stay in the run's dtype; which GEMMs: the two options below"
        },
    )
    ls_fp8_forward: str = field(
        default="qkv,kv,vocab",
        metadata={
            "help": "with --ls-fp8, the linear layers whose forward GEMM (x W^T) runs in FP8, comma-separated "
            "of " + ",".join(FP8_GEMMS) + " (out: both attention output projections; q: the cross-attention's "
            "query; kv: the encoder output's keys and values; vocab: the output projection)"
        },
    )
    ls_fp8_dgrad: str = field(
        default="fc2",
        metadata={"help": "with --ls-fp8, the linear layers whose input-gradient GEMM (dY W) runs in FP8 (same names)"},
    )
    ls_fp8_history: int = field(
        default=16, metadata={"help": "with --ls-fp8, the steps of amax history that each tensor's scale is taken from"}
    )
    ls_fp8_grad_format: ChoiceEnum(["e5m2", "e4m3"]) = field(
        default="e5m2", metadata={"help": "with --ls-fp8, the FP8 format of output gradients"}
    )


def _embedding(num_embeddings, embedding_dim, padding_idx):
    """fairseq's Embedding init: N(0, dim^-0.5), padding row zero."""
    m = nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx)
    nn.init.normal_(m.weight, mean=0, std=embedding_dim**-0.5)
    nn.init.constant_(m.weight[padding_idx], 0)
    return m


class _EmbeddingMixin:
    """Token + positional embedding through ops.embedding, with fairseq's
    parameter names (``embed_tokens``, ``embed_positions``) on the encoder/decoder."""

    def _init_embedding(self, embed_tokens, max_positions, learned_pos, no_scale, dropout):
        self.embed_tokens = embed_tokens
        self.padding_idx = embed_tokens.padding_idx
        dim = embed_tokens.embedding_dim
        self.embed_scale = 1.0 if no_scale else dim**0.5
        self.embed_dropout = dropout
        self.max_embed_positions = max_positions
        self.embed_positions = (
            _embedding(max_positions + self.padding_idx + 1, dim, self.padding_idx) if learned_pos else None
        )

    def _embed(self, tokens, positions, max_position=None):
        pos_weight = self.embed_positions.weight if self.embed_positions is not None else None
        return ops.embedding(
            tokens, positions, self.embed_tokens.weight, pos_weight, self.embed_scale, self.padding_idx,
            self.embed_dropout, self.training, max_position=max_position,
        )

    def max_positions(self):
        return self.max_embed_positions


class LSTransformerEncoder(_EmbeddingMixin, FairseqEncoder):
    def __init__(self, cfg, dictionary, embed_tokens, fp8=None):
        """``fp8``: the model's ops.Fp8Recipe (--ls-fp8), or None."""
        super().__init__(dictionary)
        self._init_embedding(
            embed_tokens, cfg.max_source_positions, cfg.encoder_learned_pos, cfg.no_scale_embedding, cfg.dropout
        )
        self.layers = nn.ModuleList([EncoderLayer(cfg, fp8) for _ in range(cfg.encoder_layers)])
        self.layer_norm = nn.LayerNorm(cfg.encoder_embed_dim) if cfg.encoder_normalize_before else None

    def forward(self, src_tokens, src_lengths=None, return_all_hiddens=False, token_embeddings=None, packed=None):
        """``packed``: a Packed batch (src_tokens then its source stream [1, capacity]), else padded rows."""
        if packed is not None:
            padding_mask, mask = None, packed.encoder_mask
            x = self._embed(src_tokens, packed.src_positions, self.padding_idx + packed.src_max_len)
        else:
            padding_mask = src_tokens.eq(self.padding_idx)
            x = self._embed(src_tokens, ops.make_positions(src_tokens, self.padding_idx))
            mask = ops.AttentionMask(padding_mask)
        states = [x] if return_all_hiddens else []
        for layer in self.layers:
            x = layer(x, mask)
            if return_all_hiddens:
                states.append(x)
        if self.layer_norm is not None:
            x = ops.layer_norm(x, self.layer_norm.weight, self.layer_norm.bias)
        return {
            "encoder_out": [x],
            "encoder_padding_mask": [padding_mask] if padding_mask is not None else [],
            "encoder_embedding": [],
            "encoder_states": states,
            "src_tokens": [],
            "src_lengths": [src_lengths] if src_lengths is not None else [],
        }

    def reorder_encoder_out(self, encoder_out, new_order):
        def pick(key, dim=0):
            return [t.index_select(dim, new_order) for t in encoder_out[key]]

        return {
            "encoder_out": pick("encoder_out"),
            "encoder_padding_mask": pick("encoder_padding_mask"),
            "encoder_embedding": pick("encoder_embedding"),
            "encoder_states": pick("encoder_states"),
            "src_tokens": pick("src_tokens"),
            "src_lengths": pick("src_lengths"),
        }

class LSTransformerDecoder(_EmbeddingMixin, FairseqIncrementalDecoder):
    def __init__(self, cfg, dictionary, embed_tokens, right_padded_targets=False, fp8=None):
        """``right_padded_targets``: the task pads target rows at the end (fairseq's translation
        default); the causal self-attention then needs no padding mask (see ops.AttentionMask).
        ``fp8``: the model's ops.Fp8Recipe (--ls-fp8), or None."""
        super().__init__(dictionary)
        self.right_padded_targets = right_padded_targets
        dim = cfg.decoder_embed_dim
        self._init_embedding(
            embed_tokens, cfg.max_target_positions, cfg.decoder_learned_pos, cfg.no_scale_embedding, cfg.dropout
        )
        self.num_heads = cfg.decoder_attention_heads
        self.layers = nn.ModuleList([DecoderLayer(cfg, fp8) for _ in range(cfg.decoder_layers)])
        self.fp8 = {name: fp8.gemm(name) for name in ("kv", "vocab")} if fp8 is not None else {}
        # keys and values of the encoder output for all layers: one GEMM (LightSeq2)
        self.encoder_attn_kv_proj = nn.Linear(cfg.encoder_embed_dim, 2 * len(self.layers) * dim)
        for start in range(0, self.encoder_attn_kv_proj.weight.shape[0], dim):
            nn.init.xavier_uniform_(self.encoder_attn_kv_proj.weight.data[start : start + dim], gain=2**-0.5)
        bound = cfg.encoder_embed_dim**-0.5
        nn.init.uniform_(self.encoder_attn_kv_proj.bias, -bound, bound)
        self.layer_norm = nn.LayerNorm(dim) if cfg.decoder_normalize_before else None
        self.output_projection = nn.Linear(dim, len(dictionary), bias=False)
        if cfg.share_decoder_input_output_embed:
            self.output_projection.weight = embed_tokens.weight
        else:
            nn.init.normal_(self.output_projection.weight, mean=0, std=dim**-0.5)

    def _encoder_keys_values(self, encoder_out, token_major=False):
        """Every layer's cross-attention keys and values from one GEMM: 2L views [B, heads, S, d_head]
        of one tensor. Kept as views: the qkv op's backward takes each view's gradient as it comes,
        where indexing a stacked copy would give each layer's slice a gradient of the full stack's size
        (a fill, a copy and an add of 2L x tokens x d per layer). ``token_major`` (packed streams):
        views of [2L, B, S, heads, d_head] storage, each layer's rows contiguous for varlen attention."""
        enc = encoder_out["encoder_out"][0]
        return ops.split_heads(
            ops.linear(enc, self.encoder_attn_kv_proj.weight, fp8=self.fp8.get("kv") if self.training else None),
            self.encoder_attn_kv_proj.bias,
            self.num_heads, 2 * len(self.layers), token_major=token_major,
        )

    def forward(
        self,
        prev_output_tokens,
        encoder_out=None,
        incremental_state=None,
        features_only=False,
        full_context_alignment=False,
        alignment_layer=None,
        alignment_heads=None,
        src_lengths=None,
        return_all_hiddens=False,
        packed=None,
    ):
        x, extra = self.extract_features(prev_output_tokens, encoder_out, incremental_state, packed=packed)
        if not features_only:
            x = self.output_layer(x)
        return x, extra

    def extract_features(self, prev_output_tokens, encoder_out=None, incremental_state=None, packed=None, **unused):
        """``packed``: a Packed batch (training only; prev_output_tokens then its target stream)."""
        if packed is not None:
            return self._packed_features(prev_output_tokens, encoder_out, packed)
        pad = self.padding_idx
        positions = ops.make_positions(prev_output_tokens, pad)
        cache = self.get_incremental_state(incremental_state, "cache") if incremental_state is not None else None
        max_position = pad + prev_output_tokens.shape[1]  # make_positions' largest, also for the last token alone
        if incremental_state is not None:
            prev_output_tokens, positions = prev_output_tokens[:, -1:], positions[:, -1:]
            if cache is None:  # decoding: one tensor, which a beam reorder selects from
                cache = {"encoder_kv": torch.stack(self._encoder_keys_values(encoder_out))}
                self.set_incremental_state(incremental_state, "cache", cache)
            encoder_kv, self_mask = cache["encoder_kv"], ops.AttentionMask(causal=True)
        else:
            encoder_kv = self._encoder_keys_values(encoder_out)
            self_mask = ops.AttentionMask(prev_output_tokens.eq(pad), causal=True, right_padded=self.right_padded_targets)
        enc_mask = ops.AttentionMask(encoder_out["encoder_padding_mask"][0] if encoder_out["encoder_padding_mask"] else None)
        x = self._embed(prev_output_tokens, positions, max_position)
        inner_states = [x]
        for i, layer in enumerate(self.layers):
            layer_cache = None
            if cache is not None:
                layer_cache = cache.setdefault("layer{}".format(i), {})
            x = layer(x, self_mask, encoder_kv[2 * i], encoder_kv[2 * i + 1], enc_mask, layer_cache)
            inner_states.append(x)
        if self.layer_norm is not None:
            x = ops.layer_norm(x, self.layer_norm.weight, self.layer_norm.bias)
        return x, {"attn": [None], "inner_states": inner_states}

    def _packed_features(self, prev_output_tokens, encoder_out, packed):
        encoder_kv = self._encoder_keys_values(encoder_out, token_major=True)
        x = self._embed(prev_output_tokens, packed.tgt_positions, self.padding_idx + packed.tgt_max_len)
        inner_states = [x]
        for i, layer in enumerate(self.layers):
            x = layer(x, packed.decoder_mask, encoder_kv[2 * i], encoder_kv[2 * i + 1], packed.cross_mask)
            inner_states.append(x)
        if self.layer_norm is not None:
            x = ops.layer_norm(x, self.layer_norm.weight, self.layer_norm.bias)
        return x, {"attn": [None], "inner_states": inner_states}

    def output_layer(self, features):
        return ops.linear(features, self.output_projection.weight,
                          fp8=self.fp8.get("vocab") if self.training else None)

    def reorder_incremental_state(self, incremental_state, new_order):
        cache = self.get_incremental_state(incremental_state, "cache")
        if cache is None:
            return
        # the encoder's keys/values differ only between sentences: a reorder that keeps the
        # batch size permutes beams of one sentence and leaves them valid (as fairseq's does)
        if cache["encoder_kv"].shape[1] != new_order.numel():
            cache["encoder_kv"] = cache["encoder_kv"].index_select(1, new_order)
        for key, value in cache.items():
            if key.startswith("layer"):
                for name in value:
                    value[name] = value[name].index_select(0, new_order)
        self.set_incremental_state(incremental_state, "cache", cache)

    def decode_step(self, tokens, cache):
        """One step of incremental decoding on preallocated caches (ls_fairseq.generation): ``tokens``
        [N, 1] the token of every hypothesis at the step that ``cache`` (a generation.DecoderCache of
        this decoder) was given by its begin_step, whose device copy sets the position. Returns the
        logits [N, vocab]. Numerically the incremental path of ``forward`` (positions padding_idx + 1
        + step, as make_positions gives a hypothesis, which holds no padding)."""
        positions = (cache.t + (self.padding_idx + 1)).expand(tokens.shape).contiguous()
        x = self._embed(tokens, positions, self.padding_idx + cache.capacity)
        for i, layer in enumerate(self.layers):
            x = layer.forward_step(x, cache, i)
        if self.layer_norm is not None:
            x = ops.layer_norm(x, self.layer_norm.weight, self.layer_norm.bias)
        return self.output_layer(x)[:, 0]

class LSTransformerModel(FairseqEncoderDecoderModel):
    """fairseq's Transformer on LightSeq2-style fused layers (see the module docstring)."""

    @classmethod
    def add_args(cls, parser):
        # no defaults here, so that architecture functions can set them (as fairseq's transformer does)
        gen_parser_from_dataclass(parser, LSTransformerConfig(), delete_default=True, with_prefix="")

    @classmethod
    def build_model(cls, args, task):
        base_architecture(args)
        for side in ("encoder", "decoder"):
            dim, heads = getattr(args, side + "_embed_dim"), getattr(args, side + "_attention_heads")
            if dim % heads != 0:
                raise ValueError(
                    "ls_transformer: --{0}-embed-dim {1} is not divisible by --{0}-attention-heads {2}".format(
                        side, dim, heads
                    )
                )
        src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
        encoder_embed = _embedding(len(src_dict), args.encoder_embed_dim, src_dict.pad())
        if args.share_all_embeddings:
            if src_dict != tgt_dict:
                raise ValueError("--share-all-embeddings requires a joined dictionary")
            if args.encoder_embed_dim != args.decoder_embed_dim:
                raise ValueError("--share-all-embeddings requires --encoder-embed-dim to match --decoder-embed-dim")
            args.share_decoder_input_output_embed = True
            decoder_embed = encoder_embed
        else:
            decoder_embed = _embedding(len(tgt_dict), args.decoder_embed_dim, tgt_dict.pad())
        fp8 = fp8_recipe(args)
        encoder = LSTransformerEncoder(args, src_dict, encoder_embed, fp8)
        # fairseq's translation task pads targets at the end unless --left-pad-target
        right_padded = getattr(getattr(task, "cfg", None), "left_pad_target", None) is False
        decoder = LSTransformerDecoder(args, tgt_dict, decoder_embed, right_padded_targets=right_padded, fp8=fp8)
        model = cls(encoder, decoder)
        model.fp8 = fp8
        return model

    def forward(self, src_tokens, src_lengths, prev_output_tokens, **kwargs):
        """fairseq's forward; a packed batch (ls_fairseq.packing: net_input's ``ls_*`` entries) runs on
        its streams."""
        if self.training and getattr(self, "fp8", None) is not None:
            self.fp8.begin(src_tokens.device)
        if "ls_src_offsets" in kwargs:
            packed = Packed(**{key: kwargs.pop(key) for key in packing.KEYS})
            encoder_out = self.encoder(src_tokens, src_lengths=src_lengths, packed=packed, **kwargs)
            return self.decoder(prev_output_tokens, encoder_out=encoder_out, packed=packed, **kwargs)
        return super().forward(src_tokens, src_lengths, prev_output_tokens, **kwargs)

    def max_positions(self):
        return (self.encoder.max_positions(), self.decoder.max_positions())

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        if strict:  # a checkpoint that does not fit: say how (another architecture, dictionary, stock transformer)
            check_model_state(self, state_dict)
        return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)

    def training_flops(self, sample):
        """Model FLOPs of a training step on ``sample`` (ls_fairseq.flops), from host-side shapes only."""
        src, target, ntokens = sample["net_input"]["src_tokens"], sample["target"], sample["ntokens"]
        if "ls_lengths" in sample:  # packed: the real sentences' lengths (ls_fairseq.packing)
            n = sample["ls_lengths"]
            lengths = dict(src_len=n["src_sq"] / max(n["src"], 1), tgt_len=n["tgt_sq"] / max(n["tgt"], 1),
                           cross_len=n["cross"] / max(n["tgt"], 1), src_per_tgt=n["src"] / max(n["tgt"], 1))
        else:
            lengths = dict(src_len=src.shape[1], tgt_len=target.shape[1],
                           src_per_tgt=src.shape[1] / max(target.shape[1], 1))
        fc1 = self.encoder.layers[0].fc1 if len(self.encoder.layers) else self.decoder.layers[0].fc1
        per_token = training_flops_per_target_token(
            dim=self.decoder.embed_tokens.embedding_dim, ffn=fc1.out_features,
            encoder_layers=len(self.encoder.layers), decoder_layers=len(self.decoder.layers),
            vocab=self.decoder.output_projection.out_features, **lengths,
        )
        return per_token * ntokens


@architecture("ls_transformer")
def base_architecture(args):
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", 512)
    args.encoder_ffn_embed_dim = getattr(args, "encoder_ffn_embed_dim", 2048)
    args.encoder_layers = getattr(args, "encoder_layers", 6)
    args.encoder_attention_heads = getattr(args, "encoder_attention_heads", 8)
    args.encoder_normalize_before = getattr(args, "encoder_normalize_before", False)
    args.encoder_learned_pos = getattr(args, "encoder_learned_pos", False)
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", args.encoder_embed_dim)
    args.decoder_ffn_embed_dim = getattr(args, "decoder_ffn_embed_dim", args.encoder_ffn_embed_dim)
    args.decoder_layers = getattr(args, "decoder_layers", 6)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", 8)
    args.decoder_normalize_before = getattr(args, "decoder_normalize_before", False)
    args.decoder_learned_pos = getattr(args, "decoder_learned_pos", False)
    args.attention_dropout = getattr(args, "attention_dropout", 0.0)
    args.activation_dropout = getattr(args, "activation_dropout", 0.0)
    args.activation_fn = getattr(args, "activation_fn", "relu")
    args.dropout = getattr(args, "dropout", 0.1)
    args.share_decoder_input_output_embed = getattr(args, "share_decoder_input_output_embed", False)
    args.share_all_embeddings = getattr(args, "share_all_embeddings", False)
    args.no_scale_embedding = getattr(args, "no_scale_embedding", False)
    args.max_source_positions = getattr(args, "max_source_positions", None) or DEFAULT_MAX_POSITIONS
    args.max_target_positions = getattr(args, "max_target_positions", None) or DEFAULT_MAX_POSITIONS
    args.ls_deterministic = getattr(args, "ls_deterministic", False)
    args.ls_cuda_graphs = getattr(args, "ls_cuda_graphs", False)
    args.ls_flash_cross_attention = getattr(args, "ls_flash_cross_attention", False)
    args.ls_packed = getattr(args, "ls_packed", False)
    args.ls_fp8 = getattr(args, "ls_fp8", False)
    args.ls_fp8_forward = getattr(args, "ls_fp8_forward", "qkv,kv,vocab")
    args.ls_fp8_dgrad = getattr(args, "ls_fp8_dgrad", "fc2")
    args.ls_fp8_history = getattr(args, "ls_fp8_history", 16)
    args.ls_fp8_grad_format = getattr(args, "ls_fp8_grad_format", "e5m2")


@architecture("ls_transformer_tiny")
def ls_transformer_tiny(args):
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", 64)
    args.encoder_ffn_embed_dim = getattr(args, "encoder_ffn_embed_dim", 64)
    args.encoder_layers = getattr(args, "encoder_layers", 2)
    args.encoder_attention_heads = getattr(args, "encoder_attention_heads", 2)
    args.decoder_layers = getattr(args, "decoder_layers", 2)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", 2)
    base_architecture(args)


@architecture("ls_transformer_iwslt_de_en")
def ls_transformer_iwslt_de_en(args):
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", 512)
    args.encoder_ffn_embed_dim = getattr(args, "encoder_ffn_embed_dim", 1024)
    args.encoder_attention_heads = getattr(args, "encoder_attention_heads", 4)
    args.encoder_layers = getattr(args, "encoder_layers", 6)
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", 512)
    args.decoder_ffn_embed_dim = getattr(args, "decoder_ffn_embed_dim", 1024)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", 4)
    args.decoder_layers = getattr(args, "decoder_layers", 6)
    base_architecture(args)


@architecture("ls_transformer_wmt_en_de")
def ls_transformer_wmt_en_de(args):
    base_architecture(args)


@architecture("ls_transformer_vaswani_wmt_en_de_big")
def ls_transformer_vaswani_wmt_en_de_big(args):
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", 1024)
    args.encoder_ffn_embed_dim = getattr(args, "encoder_ffn_embed_dim", 4096)
    args.encoder_attention_heads = getattr(args, "encoder_attention_heads", 16)
    args.encoder_normalize_before = getattr(args, "encoder_normalize_before", False)
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", 1024)
    args.decoder_ffn_embed_dim = getattr(args, "decoder_ffn_embed_dim", 4096)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", 16)
    args.dropout = getattr(args, "dropout", 0.3)
    base_architecture(args)


@architecture("ls_transformer_vaswani_wmt_en_fr_big")
def ls_transformer_vaswani_wmt_en_fr_big(args):
    args.dropout = getattr(args, "dropout", 0.1)
    ls_transformer_vaswani_wmt_en_de_big(args)


@architecture("ls_transformer_wmt_en_de_big")
def ls_transformer_wmt_en_de_big(args):
    args.attention_dropout = getattr(args, "attention_dropout", 0.1)
    ls_transformer_vaswani_wmt_en_de_big(args)


@architecture("ls_transformer_wmt_en_de_big_t2t")
def ls_transformer_wmt_en_de_big_t2t(args):
    args.encoder_normalize_before = getattr(args, "encoder_normalize_before", True)
    args.decoder_normalize_before = getattr(args, "decoder_normalize_before", True)
    args.attention_dropout = getattr(args, "attention_dropout", 0.1)
    args.activation_dropout = getattr(args, "activation_dropout", 0.1)
    ls_transformer_vaswani_wmt_en_de_big(args)
