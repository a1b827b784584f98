"""ls_transformer's encoder and decoder layers: the core layers (ls_fairseq/layers.py) built from
fairseq's configuration (``cfg``: the model's arguments) and the model's FP8 recipe."""
from ls_fairseq import layers


def _options(cfg, side, fp8):
    return dict(normalize_before=getattr(cfg, side + "_normalize_before"), activation_fn=cfg.activation_fn,
                dropout=cfg.dropout, attention_dropout=cfg.attention_dropout,
                activation_dropout=cfg.activation_dropout, deterministic=cfg.ls_deterministic, fp8=fp8)


def _decoder_options(cfg, fp8):
    return dict(_options(cfg, "decoder", fp8), exact_cross_attention=not cfg.ls_flash_cross_attention)


class EncoderLayer(layers.EncoderLayer):
    def __init__(self, cfg, fp8=None):
        super().__init__(cfg.encoder_embed_dim, cfg.encoder_attention_heads, cfg.encoder_ffn_embed_dim,
                         **_options(cfg, "encoder", fp8))


class DecoderLayer(layers.DecoderLayer):
    def __init__(self, cfg, fp8=None):
        super().__init__(cfg.decoder_embed_dim, cfg.decoder_attention_heads, cfg.decoder_ffn_embed_dim,
                         **_decoder_options(cfg, fp8))
