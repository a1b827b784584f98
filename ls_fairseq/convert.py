"""Convert checkpoints between ls_transformer and fairseq's transformer.

  python -m ls_fairseq.convert to-fairseq   IN.pt OUT.pt   # ls -> stock (loads without the plugin)
  python -m ls_fairseq.convert from-fairseq IN.pt OUT.pt   # stock -> ls (fine-tune with the plugin)

Weights: ls_transformer names its parameters as fairseq does except for two
fused projections (see ls_fairseq.models.ls_transformer): ``qkv_proj`` =
[q_proj; k_proj; v_proj] and ``decoder.encoder_attn_kv_proj`` = [k_0; v_0;
k_1; v_1; ...] of every decoder layer's encoder_attn. Configuration: the
architecture, criterion and optimizer names gain or lose their ``ls_`` prefix;
everything else is kept. The round trip is exact for both. The optimizer
state is dropped (with a notice): the two optimizers keep different layouts.
The written config holds only plain containers (no argparse.Namespace, no
meters), so the output loads with torch's weights_only=True.
"""
import argparse
import logging
import os
import re
import sys

import torch

logger = logging.getLogger("ls_fairseq.convert")

LS = "ls_"
# registered names that the two sides share up to the ls_ prefix
STOCK_ARCHS = (
    "transformer",
    "transformer_tiny",
    "transformer_iwslt_de_en",
    "transformer_wmt_en_de",
    "transformer_vaswani_wmt_en_de_big",
    "transformer_vaswani_wmt_en_fr_big",
    "transformer_wmt_en_de_big",
    "transformer_wmt_en_de_big_t2t",
)
RENAMED = {"criterion": ("label_smoothed_cross_entropy",), "optimizer": ("adam",), "arch": STOCK_ARCHS}
# stock model options ls_transformer cannot honour: converting such a model would change it
UNSUPPORTED_IF_SET = (
    "adaptive_softmax_cutoff",
    "adaptive_input",
    "layernorm_embedding",
    "no_token_positional_embeddings",
    "cross_self_attention",
    "no_cross_attention",
    "encoder_layers_to_keep",
    "decoder_layers_to_keep",
    "quant_noise_pq",
    "quant_noise_scalar",
    "merge_src_tgt_embed",
    "no_decoder_final_norm",
    "tie_adaptive_weights",
)
CLASS_NAMES = {"LabelSmoothedCrossEntropyCriterion": "LSLabelSmoothedCrossEntropyCriterion", "FairseqAdam": "LSAdam"}
_QKV = re.compile(r"^(.*\.self_attn)\.qkv_proj\.(weight|bias)$")
_STOCK_QKV = re.compile(r"^(.*\.self_attn)\.([qkv])_proj\.(weight|bias)$")
_STOCK_CROSS_KV = re.compile(r"^decoder\.layers\.(\d+)\.encoder_attn\.([kv])_proj\.(weight|bias)$")
_VERSION = ("encoder.version", "decoder.version")


class ConversionError(ValueError):
    pass


def _rename(value, to_ls, kind):
    if not isinstance(value, str):
        return value
    if to_ls:
        if value in RENAMED[kind]:
            return LS + value
        return value
    if value.startswith(LS) and value[len(LS):] in RENAMED[kind]:
        return value[len(LS):]
    return value


def _convert_model_cfg(model_cfg, to_ls):
    cfg = dict(vars(model_cfg)) if isinstance(model_cfg, argparse.Namespace) else dict(model_cfg)
    arch = cfg.get("arch") or cfg.get("_name")
    target = _rename(arch, to_ls, "arch")
    if target == arch:
        raise ConversionError(
            "architecture {!r} has no {} counterpart; supported: {}".format(
                arch, "ls_transformer" if to_ls else "stock transformer", ", ".join(STOCK_ARCHS)
            )
        )
    if to_ls:
        used = [k for k in UNSUPPORTED_IF_SET if cfg.get(k)]
        if used:
            raise ConversionError("ls_transformer does not support these options of this model: {}".format(used))
    for key in ("arch", "_name"):
        if key in cfg:
            cfg[key] = _rename(cfg[key], to_ls, "arch")
    for kind in ("criterion", "optimizer"):
        if kind in cfg:
            cfg[kind] = _rename(cfg[kind], to_ls, kind)
    if not to_ls:
        cfg = {k: v for k, v in cfg.items() if not k.startswith(LS)}
        cfg["user_dir"] = None
    return cfg


def _convert_cfg(cfg, to_ls):
    out = {}
    for section, value in cfg.items():
        if section == "model":
            value = _convert_model_cfg(value, to_ls)
        elif section in ("criterion", "optimizer") and isinstance(value, dict):
            value = dict(value)
            value["_name"] = _rename(value.get("_name"), to_ls, section)
            if not to_ls:
                value = {k: v for k, v in value.items() if not k.startswith(LS)}
        elif section == "common" and isinstance(value, dict) and not to_ls:
            value = dict(value, user_dir=None)
        elif isinstance(value, argparse.Namespace):
            value = dict(vars(value))
        out[section] = value
    return out


def _convert_history(entry, to_ls):
    """The last optimizer_history entry, as a plain dict with the other side's class names."""
    names = CLASS_NAMES if to_ls else {v: k for k, v in CLASS_NAMES.items()}
    out = dict(entry)
    for key in ("criterion_name", "optimizer_name"):
        out[key] = names.get(out.get(key), out.get(key))
    return out


def model_to_fairseq(state):
    """ls_transformer state dict -> fairseq transformer state dict (new tensors)."""
    out = {}
    num_dec = len({m.group(1) for m in (re.match(r"decoder\.layers\.(\d+)\.", k) for k in state) if m})
    for key, value in state.items():
        m = _QKV.match(key)
        if m:
            for name, part in zip("qkv", value.chunk(3, dim=0)):
                out["{}.{}_proj.{}".format(m.group(1), name, m.group(2))] = part.clone()
        elif key.startswith("decoder.encoder_attn_kv_proj."):
            kind = key.rsplit(".", 1)[1]
            for i, part in enumerate(value.chunk(2 * num_dec, dim=0)):
                out["decoder.layers.{}.encoder_attn.{}_proj.{}".format(i // 2, "kv"[i % 2], kind)] = part.clone()
        else:
            out[key] = value.clone()
    for key in _VERSION:
        out[key] = torch.Tensor([3])
    return out


def model_from_fairseq(state):
    """fairseq transformer state dict -> ls_transformer state dict (new tensors)."""
    out, qkv, cross = {}, {}, {}
    for key, value in state.items():
        m, c = _STOCK_QKV.match(key), _STOCK_CROSS_KV.match(key)
        if key in _VERSION:
            continue
        if m:
            qkv.setdefault((m.group(1), m.group(3)), {})[m.group(2)] = value
        elif c:
            cross.setdefault(c.group(3), {})[(int(c.group(1)), c.group(2))] = value
        elif ".embed_positions._float_tensor" in key:
            continue
        else:
            out[key] = value.clone()
    for (prefix, kind), parts in qkv.items():
        out["{}.qkv_proj.{}".format(prefix, kind)] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    for kind, parts in cross.items():
        layers = sorted({i for i, _ in parts})
        out["decoder.encoder_attn_kv_proj." + kind] = torch.cat([parts[(i, kv)] for i in layers for kv in "kv"], dim=0)
    return out


def convert(state, to_ls):
    """Convert a whole checkpoint dict; returns a new dict."""
    if state.get("cfg") is None:
        raise ConversionError("the checkpoint has no 'cfg' (fairseq < 0.10 checkpoints are not supported)")
    is_ls = any(".qkv_proj." in k for k in state["model"])
    if is_ls == to_ls:
        raise ConversionError(
            "this is already {} checkpoint".format("an ls_transformer" if is_ls else "a stock fairseq transformer")
        )
    cfg = state["cfg"]
    if hasattr(cfg, "items") and not isinstance(cfg, dict):
        from omegaconf import OmegaConf

        cfg = OmegaConf.to_container(cfg)
    out = {
        "args": None,
        "cfg": _convert_cfg(cfg, to_ls),
        "model": model_from_fairseq(state["model"]) if to_ls else model_to_fairseq(state["model"]),
        "criterion": state.get("criterion"),
        "optimizer_history": [_convert_history(h, to_ls) for h in state.get("optimizer_history", [])[-1:]],
        "task_state": state.get("task_state", {}),
        "extra_state": {},
        "last_optimizer_state": None,
    }
    if state.get("last_optimizer_state") is not None:
        logger.warning("convert: the optimizer state is dropped (resume with --reset-optimizer)")
    return out


def save_atomic(state, path):
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ls_fairseq.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("direction", choices=["to-fairseq", "from-fairseq"])
    parser.add_argument("input")
    parser.add_argument("output")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from ls_fairseq.checkpoint import FAIRSEQ_CHECKPOINT_TYPES

    if not os.path.isfile(args.input):
        parser.error("no such checkpoint: {}".format(args.input))
    try:
        with torch.serialization.safe_globals(list(FAIRSEQ_CHECKPOINT_TYPES)):  # the types fairseq checkpoints hold
            state = torch.load(args.input, map_location="cpu", weights_only=True)
        out = convert(state, to_ls=args.direction == "from-fairseq")
    except ConversionError as e:
        print("convert: {}: {}".format(args.input, e), file=sys.stderr)
        return 1
    save_atomic(out, args.output)
    logger.info("convert: wrote %s (%s)", args.output, args.direction)
    return 0


if __name__ == "__main__":
    sys.exit(main())
