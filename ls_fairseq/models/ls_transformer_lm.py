"""ls_transformer_lm: fairseq's decoder-only transformer_lm on the fused decoder layers.

Numerically fairseq's ``transformer_lm`` (its TransformerDecoder without encoder attention:
pre-LN, as stock's base_lm_architecture always sets; relu, gelu or gelu_accurate; learned or
sinusoidal positions; shared or separate input/output embeddings; --no-scale-embedding,
--layernorm-embedding, --no-decoder-final-norm, --decoder-input-dim/--decoder-output-dim
projections), with fairseq's parameter names except ``*.self_attn.qkv_proj`` = fairseq's
q_proj, k_proj, v_proj stacked [q; k; v]. ``python -m ls_fairseq.convert`` maps the two.

Options of stock transformer_lm that this model does not implement are accepted on the command line
only to be refused by name when the model is built (``REFUSED``): a run never silently trains
another model than the one asked for.
"""
import math
from dataclasses import dataclass, field
from typing import Optional

import torch.nn as nn
import torch.nn.functional as F
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.models import FairseqIncrementalDecoder, FairseqLanguageModel
from fairseq.utils import safe_getattr
from omegaconf import II

from ls_fairseq import layers, ops
from ls_fairseq.checkpoint import CheckpointMismatchError, check_model_state
from ls_fairseq.models.ls_transformer import LSTransformerConfig, _embedding
from ls_fairseq.ops.bias_act_dropout import ACTIVATIONS
from ls_fairseq.ops.embedding import sinusoidal

DEFAULT_MAX_TARGET_POSITIONS = 1024
ARCHITECTURES = {}  # --arch name -> the function that sets its defaults (registered by ls_fairseq.fairseq_plugin)
STOCK_LM_KEY = "decoder.layers.0.self_attn.q_proj.weight"


def architecture(name):
    def record(fn):
        ARCHITECTURES[name] = fn
        return fn

    return record


def _ls_option(name):
    """The field of ls_transformer's option ``name``, same default and help."""
    f = LSTransformerConfig.__dataclass_fields__[name]
    return field(default=f.default, metadata=dict(f.metadata))


def _refused(default, what):
    return field(default=default, metadata={"help": "stock transformer_lm's {}: refused by ls_transformer_lm".format(what)})


# option -> (the value that means off, its one-line refusal)
REFUSED = {
    "adaptive_input": (False, "--adaptive-input: adaptive input embeddings are not implemented (use a plain "
                              "embedding table; transformer_lm_wiki103's architectures need it)"),
    "adaptive_softmax_cutoff": (None, "--adaptive-softmax-cutoff: adaptive softmax is not implemented (the "
                                      "output projection is one fused GEMM and loss)"),
    "tie_adaptive_weights": (False, "--tie-adaptive-weights: adaptive input/softmax are not implemented"),
    "character_embeddings": (False, "--character-embeddings: character embeddings are not implemented"),
    "quant_noise_pq": (0.0, "--quant-noise-pq: quant-noise is not implemented"),
    "quant_noise_scalar": (0.0, "--quant-noise-scalar: quant-noise is not implemented"),
    "base_layers": (0, "--base-layers: BASE layers are not implemented"),
    "scale_fc": (False, "--scale-fc: the fused FFN has no LayerNorm between its GEMMs"),
    "scale_attn": (False, "--scale-attn: the fused attention block has no LayerNorm after attention"),
    "scale_heads": (False, "--scale-heads: per-head scale coefficients are not implemented"),
    "scale_resids": (False, "--scale-resids: residual scale coefficients are not implemented"),
    "decoder_xformers_att_config": (None, "--decoder-xformers-att-config: xFormers attention is not used "
                                          "(attention runs through ls_fairseq's fused ops)"),
    "decoder_layerdrop": (0.0, "--decoder-layerdrop: LayerDrop is not implemented"),
    "decoder_layers_to_keep": (None, "--decoder-layers-to-keep: layer pruning is not implemented"),
    "no_token_positional_embeddings": (False, "--no-token-positional-embeddings: the fused embedding always "
                                              "adds positions"),
    "checkpoint_activations": (False, "--checkpoint-activations: activation checkpointing is not implemented"),
    "offload_activations": (False, "--offload-activations: activation checkpointing is not implemented"),
    "ls_packed": (False, "--ls-packed: packed streams are for translation batches; for language models use "
                         "--sample-break-mode none, whose blocks hold no padding"),
}


def refusal(args):
    """The one-line error for the first refused option set in ``args``, or None."""
    for name, (off, message) in REFUSED.items():
        value = safe_getattr(args, name, off)
        if value is not None and value != off and not (off is None and value in ("", "None")):
            return "ls_transformer_lm: " + message
    return None


@dataclass
class LSTransformerLanguageModelConfig(FairseqDataclass):
    activation_fn: ChoiceEnum(list(ACTIVATIONS)) = field(
        default="relu", metadata={"help": "activation function of the FFN (gelu: the exact erf form; gelu_accurate: "
                                          "the tanh form, GPT-2's)"}
    )
    dropout: float = field(default=0.1, metadata={"help": "dropout probability"})
    attention_dropout: float = field(default=0.0, metadata={"help": "dropout probability for attention weights"})
    activation_dropout: float = field(default=0.0, metadata={"help": "dropout probability after activation in FFN."})
    relu_dropout: float = field(
        default=0.0, metadata={"help": "dropout probability after activation in FFN, where --activation-dropout is 0"}
    )
    decoder_embed_dim: int = field(default=512, metadata={"help": "decoder embedding dimension"})
    decoder_output_dim: int = field(default=512, metadata={"help": "decoder output dimension"})
    decoder_input_dim: int = field(default=512, metadata={"help": "decoder input dimension"})
    decoder_ffn_embed_dim: int = field(default=2048, metadata={"help": "decoder embedding dimension for FFN"})
    decoder_layers: int = field(default=6, metadata={"help": "num decoder layers"})
    decoder_attention_heads: int = field(default=8, metadata={"help": "num decoder attention heads"})
    decoder_normalize_before: bool = field(
        default=False,
        metadata={"help": "apply layernorm before each decoder block (every named architecture sets it, as stock's do)"},
    )
    no_decoder_final_norm: bool = field(
        default=False, metadata={"help": "don't add an extra layernorm after the last decoder block"}
    )
    share_decoder_input_output_embed: bool = field(
        default=False, metadata={"help": "share decoder input and output embeddings"}
    )
    decoder_learned_pos: bool = field(default=False, metadata={"help": "use learned positional embeddings in the decoder"})
    layernorm_embedding: bool = field(default=False, metadata={"help": "add layernorm to embedding"})
    no_scale_embedding: bool = field(default=False, metadata={"help": "if True, dont scale embeddings"})
    adaptive_input: bool = _refused(False, "adaptive input")
    adaptive_softmax_cutoff: Optional[str] = _refused(None, "adaptive softmax")
    tie_adaptive_weights: bool = _refused(False, "adaptive weight tying")
    character_embeddings: bool = _refused(False, "character embeddings")
    quant_noise_pq: float = _refused(0.0, "quant-noise")
    quant_noise_scalar: float = _refused(0.0, "scalar quant-noise")
    base_layers: Optional[int] = _refused(0, "BASE layers")
    scale_fc: Optional[bool] = _refused(False, "LayerNorm between the FFN's layers")
    scale_attn: Optional[bool] = _refused(False, "LayerNorm after attention")
    scale_heads: Optional[bool] = _refused(False, "per-head scales")
    scale_resids: Optional[bool] = _refused(False, "residual scales")
    decoder_xformers_att_config: Optional[str] = _refused(None, "xFormers attention")
    decoder_layerdrop: float = _refused(0.0, "LayerDrop")
    decoder_layers_to_keep: Optional[str] = _refused(None, "layer pruning")
    no_token_positional_embeddings: bool = _refused(False, "no positions")
    checkpoint_activations: bool = _refused(False, "activation checkpointing")
    offload_activations: bool = _refused(False, "activation offloading")
    ls_deterministic: bool = _ls_option("ls_deterministic")
    ls_cuda_graphs: bool = _ls_option("ls_cuda_graphs")
    ls_packed: bool = _refused(False, "ls_transformer's packed batches")
    add_bos_token: bool = II("task.add_bos_token")
    tokens_per_sample: int = II("task.tokens_per_sample")
    max_target_positions: Optional[int] = II("task.max_target_positions")


def _projection(in_dim, out_dim):
    """fairseq's Linear without bias: xavier-uniform weight."""
    m = nn.Linear(in_dim, out_dim, bias=False)
    nn.init.xavier_uniform_(m.weight)
    return m


class LSTransformerLMDecoder(FairseqIncrementalDecoder):
    """fairseq's TransformerDecoder(no_encoder_attn=True) on the fused decoder layers; batch-major."""

    def __init__(self, cfg, dictionary, embed_tokens, right_padded=False):
        """``right_padded``: the task pads rows at the end only (language_modeling's batches do), so the
        causal self-attention needs no padding mask (ops.AttentionMask)."""
        super().__init__(dictionary)
        dim = cfg.decoder_embed_dim
        input_dim, output_dim = embed_tokens.embedding_dim, cfg.decoder_output_dim
        self.right_padded = right_padded
        self.embed_tokens = embed_tokens
        self.padding_idx = embed_tokens.padding_idx
        self.embed_scale = 1.0 if cfg.no_scale_embedding else math.sqrt(dim)
        self.dropout = cfg.dropout
        self.max_target_positions = cfg.max_target_positions
        self.project_in_dim = _projection(input_dim, dim) if input_dim != dim else None
        pad = self.padding_idx
        self.embed_positions = (
            _embedding(cfg.max_target_positions + pad + 1, dim, pad) if cfg.decoder_learned_pos else None
        )
        self.layernorm_embedding = nn.LayerNorm(dim) if cfg.layernorm_embedding else None
        activation_dropout = cfg.activation_dropout or safe_getattr(cfg, "relu_dropout", 0.0) or 0.0
        self.layers = nn.ModuleList([
            layers.DecoderLayer(dim, cfg.decoder_attention_heads, cfg.decoder_ffn_embed_dim, cross_attention=False,
                                normalize_before=cfg.decoder_normalize_before, activation_fn=cfg.activation_fn,
                                dropout=cfg.dropout, attention_dropout=cfg.attention_dropout,
                                activation_dropout=activation_dropout, deterministic=cfg.ls_deterministic)
            for _ in range(cfg.decoder_layers)
        ])
        final_norm = cfg.decoder_normalize_before and not cfg.no_decoder_final_norm
        self.layer_norm = nn.LayerNorm(dim) if final_norm else None
        self.project_out_dim = _projection(dim, output_dim) if output_dim != dim else None
        self.output_projection = nn.Linear(output_dim, len(dictionary), bias=False)
        if cfg.share_decoder_input_output_embed:
            self.output_projection.weight = embed_tokens.weight
        else:
            nn.init.normal_(self.output_projection.weight, mean=0, std=output_dim**-0.5)

    def max_positions(self):
        return self.max_target_positions

    def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None, features_only=False,
                full_context_alignment=False, alignment_layer=None, alignment_heads=None, src_lengths=None,
                return_all_hiddens=False):
        x, extra = self.extract_features(prev_output_tokens, incremental_state=incremental_state)
        if not features_only:
            x = self.output_layer(x)
        return x, extra

    def _embed(self, tokens, positions, max_position):
        """stock's: dropout(LN?(scale * table[token] (projected in) + position)); the fused op where
        nothing stands between the sum and the dropout."""
        pos_weight = self.embed_positions.weight if self.embed_positions is not None else None
        if self.project_in_dim is None and self.layernorm_embedding is None:
            return ops.embedding(tokens, positions, self.embed_tokens.weight, pos_weight, self.embed_scale,
                                 self.padding_idx, self.dropout, self.training, max_position=max_position)
        if self.project_in_dim is None:
            x = ops.embedding(tokens, positions, self.embed_tokens.weight, pos_weight, self.embed_scale,
                              self.padding_idx, 0.0, self.training, max_position=max_position)
        else:
            x = ops.linear(F.embedding(tokens, self.embed_tokens.weight, self.padding_idx) * self.embed_scale,
                           self.project_in_dim.weight)
            if pos_weight is not None:
                x = x + F.embedding(positions, pos_weight, self.padding_idx)
            else:
                x = x + sinusoidal(positions, x.shape[-1], self.padding_idx).to(x.dtype)
        if self.layernorm_embedding is not None:
            x = ops.layer_norm(x, self.layernorm_embedding.weight, self.layernorm_embedding.bias)
        return F.dropout(x, self.dropout, self.training)

    def extract_features(self, prev_output_tokens, encoder_out=None, incremental_state=None, **unused):
        pad = self.padding_idx
        positions = ops.make_positions(prev_output_tokens, pad)
        max_position = pad + prev_output_tokens.shape[1]  # make_positions' largest, also for the last token alone
        cache = None
        if incremental_state is not None:
            cache = self.get_incremental_state(incremental_state, "cache")
            if cache is None:
                cache = {}
                self.set_incremental_state(incremental_state, "cache", cache)
            # the tokens not yet in the cache: one a step, or the whole prompt at once (prefill)
            done = cache["layer0"]["k"].shape[2] if "layer0" in cache else 0
            prev_output_tokens, positions = prev_output_tokens[:, done:], positions[:, done:]
            mask = ops.AttentionMask(causal=True)
        else:
            mask = ops.AttentionMask(prev_output_tokens.eq(pad), causal=True, right_padded=self.right_padded)
        x = self._embed(prev_output_tokens, positions, max_position)
        inner_states = [x]
        for i, layer in enumerate(self.layers):
            x = layer(x, mask, cache=cache.setdefault("layer{}".format(i), {}) if cache is not None else None)
            inner_states.append(x)
        if self.layer_norm is not None:
            x = ops.layer_norm(x, self.layer_norm.weight, self.layer_norm.bias)
        if self.project_out_dim is not None:
            x = ops.linear(x, self.project_out_dim.weight)
        return x, {"attn": [None], "inner_states": inner_states}

    def output_layer(self, features):
        return ops.linear(features, self.output_projection.weight)

    def prefill(self, tokens, cache):
        """A prompt's first tokens [sentences, P] (from position 0) in one pass: every layer's keys and values
        written into ``cache`` (a generation.DecoderCache, each beam's slot) at positions 0..P-1. Returns the
        logits [sentences, P, vocab]."""
        state = {}
        logits, _ = self.forward(tokens, incremental_state=state)
        layer_caches = self.get_incremental_state(state, "cache")
        for i in range(len(self.layers)):
            entry = layer_caches["layer{}".format(i)]
            cache.prefill(i, entry["k"], entry["v"])
        return logits

    def decode_step(self, tokens, cache):
        """One step of incremental decoding on preallocated caches (ls_fairseq.generation), as
        LSTransformerDecoder.decode_step: ``tokens`` [N, 1] at the cache's step; returns the logits [N, vocab]."""
        positions = (cache.t + (self.padding_idx + 1)).expand(tokens.shape).contiguous()
        x = self._embed(tokens, positions, self.padding_idx + cache.capacity)
        for i, layer in enumerate(self.layers):
            x = layer.forward_step(x, cache, i)
        if self.layer_norm is not None:
            x = ops.layer_norm(x, self.layer_norm.weight, self.layer_norm.bias)
        if self.project_out_dim is not None:
            x = ops.linear(x, self.project_out_dim.weight)
        return self.output_layer(x)[:, 0]

    def reorder_incremental_state(self, incremental_state, new_order):
        cache = self.get_incremental_state(incremental_state, "cache")
        if cache is None:
            return
        for value in cache.values():
            for name in value:
                value[name] = value[name].index_select(0, new_order)
        self.set_incremental_state(incremental_state, "cache", cache)


class LSTransformerLanguageModel(FairseqLanguageModel):
    """fairseq's transformer_lm on LightSeq2-style fused layers (see the module docstring)."""

    @classmethod
    def build_model(cls, args, task):
        message = refusal(args)
        if message is not None:
            raise ValueError(message)
        if safe_getattr(args, "max_target_positions", None) is None:
            args.max_target_positions = safe_getattr(args, "tokens_per_sample", DEFAULT_MAX_TARGET_POSITIONS)
        if args.decoder_embed_dim % args.decoder_attention_heads != 0:
            raise ValueError("ls_transformer_lm: --decoder-embed-dim {} is not divisible by --decoder-attention-heads "
                             "{}".format(args.decoder_embed_dim, args.decoder_attention_heads))
        if args.share_decoder_input_output_embed and args.decoder_input_dim != args.decoder_output_dim:
            raise ValueError("ls_transformer_lm: --share-decoder-input-output-embed needs --decoder-input-dim ({}) "
                             "equal to --decoder-output-dim ({})".format(args.decoder_input_dim,
                                                                         args.decoder_output_dim))
        d = task.source_dictionary
        embed_tokens = _embedding(len(d), args.decoder_input_dim, d.pad())
        return cls(LSTransformerLMDecoder(args, task.target_dictionary, embed_tokens,
                                          right_padded=_right_padded(task)))

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        if strict and STOCK_LM_KEY in state_dict:
            raise CheckpointMismatchError(
                "this is a checkpoint of fairseq's transformer_lm (separate q_proj, k_proj, v_proj), not of "
                "ls_transformer_lm: convert it first with python -m ls_fairseq.convert from-fairseq IN.pt OUT.pt")
        if strict:
            check_model_state(self, state_dict)
        return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)

    def training_flops(self, sample):
        """Model FLOPs of a training step on ``sample`` (host-side shapes only): per token 3 x 2 x the
        multiply-adds of the layers' GEMMs (4 d^2 + 2 d f), of causal attention's scores and context
        (T d: T/2 keys on average, two products; recipes/lm/bench.py counts the same) and of the output
        projection (d V)."""
        decoder = self.decoder
        layer = decoder.layers[0]
        dim, ffn = layer.fc1.in_features, layer.fc1.out_features
        T = sample["target"].shape[1]
        per_layer = 4 * dim * dim + 2 * dim * ffn + T * dim
        per_token = 3 * 2 * (len(decoder.layers) * per_layer + decoder.output_projection.in_features
                             * decoder.output_projection.out_features)
        return per_token * sample["ntokens"]


def _right_padded(task):
    """Whether ``task``'s batches pad each row at its end: fairseq's language_modeling task does
    (MonolingualDataset's collater), any other is not assumed to."""
    try:
        from fairseq.tasks.language_modeling import LanguageModelingTask
    except ImportError:
        return False
    return isinstance(task, LanguageModelingTask)


def base_lm_architecture(args):
    """Stock's base_lm_architecture, which every named architecture chains to. Like stock's, it is not
    --arch ls_transformer_lm's: that one is the model's own name, whose defaults are the dataclass's
    (fairseq registers it so; post-LN there, as stock's --arch transformer_lm)."""
    args.dropout = safe_getattr(args, "dropout", 0.1)
    args.attention_dropout = safe_getattr(args, "attention_dropout", 0.0)
    args.activation_dropout = safe_getattr(args, "activation_dropout", 0.0)
    args.relu_dropout = safe_getattr(args, "relu_dropout", 0.0)
    args.decoder_embed_dim = safe_getattr(args, "decoder_embed_dim", 512)
    args.decoder_ffn_embed_dim = safe_getattr(args, "decoder_ffn_embed_dim", 2048)
    args.decoder_layers = safe_getattr(args, "decoder_layers", 6)
    args.decoder_attention_heads = safe_getattr(args, "decoder_attention_heads", 8)
    args.decoder_learned_pos = safe_getattr(args, "decoder_learned_pos", False)
    args.activation_fn = safe_getattr(args, "activation_fn", "relu")
    args.add_bos_token = safe_getattr(args, "add_bos_token", False)
    args.share_decoder_input_output_embed = safe_getattr(args, "share_decoder_input_output_embed", False)
    args.decoder_output_dim = safe_getattr(args, "decoder_output_dim", args.decoder_embed_dim)
    args.decoder_input_dim = safe_getattr(args, "decoder_input_dim", args.decoder_embed_dim)
    # stock's base_lm_architecture: always pre-LN
    args.decoder_normalize_before = True
    args.no_decoder_final_norm = safe_getattr(args, "no_decoder_final_norm", False)
    args.no_scale_embedding = safe_getattr(args, "no_scale_embedding", False)
    args.layernorm_embedding = safe_getattr(args, "layernorm_embedding", False)
    for name, (off, _) in REFUSED.items():
        setattr(args, name, safe_getattr(args, name, off))
    args.ls_deterministic = safe_getattr(args, "ls_deterministic", False)
    args.ls_cuda_graphs = safe_getattr(args, "ls_cuda_graphs", False)


@architecture("ls_transformer_lm_big")
def transformer_lm_big(args):
    args.decoder_layers = safe_getattr(args, "decoder_layers", 12)
    args.decoder_embed_dim = safe_getattr(args, "decoder_embed_dim", 1024)
    args.decoder_ffn_embed_dim = safe_getattr(args, "decoder_ffn_embed_dim", 4096)
    args.decoder_attention_heads = safe_getattr(args, "decoder_attention_heads", 16)
    base_lm_architecture(args)


def _gpt(args, dim, ffn, layers_, heads):
    """The GPT architectures' shared defaults (stock's transformer_lm_gpt*): gelu, dropout 0.1 everywhere."""
    args.decoder_embed_dim = safe_getattr(args, "decoder_embed_dim", dim)
    args.decoder_ffn_embed_dim = safe_getattr(args, "decoder_ffn_embed_dim", ffn)
    args.decoder_layers = safe_getattr(args, "decoder_layers", layers_)
    args.decoder_attention_heads = safe_getattr(args, "decoder_attention_heads", heads)
    args.dropout = safe_getattr(args, "dropout", 0.1)
    args.attention_dropout = safe_getattr(args, "attention_dropout", 0.1)
    args.activation_fn = safe_getattr(args, "activation_fn", "gelu")
    base_lm_architecture(args)


@architecture("ls_transformer_lm_gpt")
def transformer_lm_gpt(args):
    _gpt(args, 768, 3072, 12, 12)


@architecture("ls_transformer_lm_gpt2_small")
def transformer_lm_gpt2_small(args):
    _gpt(args, 1024, 4096, 24, 16)


@architecture("ls_transformer_lm_gpt2_tiny")
def transformer_lm_gpt2_tiny(args):
    _gpt(args, 64, 64, 2, 1)


@architecture("ls_transformer_lm_gpt2_medium")
def transformer_lm_gpt2_medium(args):
    _gpt(args, 1280, 5120, 36, 20)


@architecture("ls_transformer_lm_gpt2_big")
def transformer_lm_gpt2_big(args):
    _gpt(args, 1600, 6400, 48, 25)


def base_gpt3_architecture(args):
    """Stock's base_gpt3_architecture: input/output dims = embed dim, FFN 4 d, learned positions,
    no dropout, gelu, shared input/output embeddings."""
    args.decoder_input_dim = args.decoder_embed_dim
    args.decoder_output_dim = args.decoder_embed_dim
    args.decoder_ffn_embed_dim = safe_getattr(args, "decoder_ffn_embed_dim", args.decoder_embed_dim * 4)
    args.decoder_learned_pos = safe_getattr(args, "decoder_learned_pos", True)
    args.dropout = safe_getattr(args, "dropout", 0.0)
    args.attention_dropout = safe_getattr(args, "attention_dropout", 0.0)
    args.activation_fn = safe_getattr(args, "activation_fn", "gelu")
    args.share_decoder_input_output_embed = True
    base_lm_architecture(args)


def _gpt3(name, layers_, dim, heads):
    """Registers ls_``name``: stock's transformer_lm_gpt3_* of (layers, embed dim, heads)."""
    def arch(args):
        args.decoder_layers = safe_getattr(args, "decoder_layers", layers_)
        args.decoder_embed_dim = safe_getattr(args, "decoder_embed_dim", dim)
        args.decoder_attention_heads = safe_getattr(args, "decoder_attention_heads", heads)
        base_gpt3_architecture(args)

    arch.__name__ = name
    architecture("ls_" + name)(arch)


for _name, _shape in {
    "transformer_lm_gpt3_small": (12, 768, 12),
    "transformer_lm_gpt3_medium": (24, 1024, 16),
    "transformer_lm_gpt3_large": (24, 1536, 16),
    "transformer_lm_gpt3_xl": (24, 2048, 32),
    "transformer_lm_gpt3_2_7": (32, 2560, 32),
    "transformer_lm_gpt3_6_7": (32, 4096, 32),
    "transformer_lm_gpt3_13": (40, 5120, 40),
    "transformer_lm_gpt3_175": (96, 12288, 96),
}.items():
    _gpt3(_name, *_shape)
