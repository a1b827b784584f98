"""Convert checkpoints between ls_transformer and fairseq's transformer (ls_transformer_lm and
fairseq's transformer_lm likewise), and to CTranslate2.

  python -m ls_fairseq.convert to-fairseq   IN.pt OUT.pt   # ls -> stock (loads without the plugin)
  python -m ls_fairseq.convert from-fairseq IN.pt OUT.pt   # stock -> ls (fine-tune with the plugin)
  python -m ls_fairseq.convert to-ctranslate2 IN.pt OUT_DIR [--data-dir DIR] [--quantization int8]

Weights: ls_transformer names its parameters as fairseq does except for two
fused projections (see ls_fairseq.models.ls_transformer): ``qkv_proj`` =
[q_proj; k_proj; v_proj] and ``decoder.encoder_attn_kv_proj`` = [k_0; v_0;
k_1; v_1; ...] of every decoder layer's encoder_attn. Configuration: the
architecture, criterion and optimizer names gain or lose their ``ls_`` prefix;
everything else is kept. The round trip is exact for both. The optimizer
state is dropped (with a notice): the two optimizers keep different layouts.
The written config holds only plain containers (no argparse.Namespace, no
meters), so the output loads with torch's weights_only=True.

to-ctranslate2 (needs the ``ctranslate2`` package: ``pip install -e '.[ctranslate2]'`` in
this repository) takes an ls or a stock checkpoint and writes a CTranslate2 model directory
through CTranslate2's own fairseq converter. That converter reads the model's configuration
from the checkpoint as an argparse.Namespace and builds a registered stock model, so
the checkpoint is turned into a stock one in memory (as to-fairseq does) and handed to
it in a temporary file whose ``cfg["model"]`` is a Namespace; every load keeps torch's
weights_only on (the Namespace type allowed within the call only). The dictionaries
(``dict.SRC.txt``, ``dict.TGT.txt``) come from ``--data-dir``, else from the
checkpoint's folder, else from the data directory the checkpoint was trained on; where
the checkpoint recorded its dictionaries' fingerprints, those found must match them. A
language model (fairseq's transformer_lm or ls_transformer_lm; ``ctranslate2.Generator`` loads it)
has one dictionary, ``dict.txt``, found in the same places.

What the converter cannot take is refused before anything is written, in one line that names
it, and ``python -m ls_fairseq.convert`` exits with status 2 for every refusal. ls checks what it
knows itself (an ls architecture without a stock counterpart, an architecture fairseq has not
registered, the task, the dictionaries); the model's configuration is then put to CTranslate2's
own configuration check (its converter's ``_get_model_spec``) before the dictionaries are looked
for, and a ValueError or KeyError of the converter becomes a one-line refusal with its message,
so that these checks are CTranslate2's own and cannot drift from them (an ``lstm``, mixed
``--encoder/decoder-normalize-before``, an activation it lacks).
"""
import argparse
import contextlib
import glob
import logging
import os
import pickle
import re
import sys
import tempfile

import torch

from ls_fairseq.checkpoint import fairseq_types_allowed

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
# fairseq's transformer_lm architectures that ls_transformer_lm has (adaptive wiki103/gbw ones: not)
STOCK_LM_ARCHS = (
    "transformer_lm",
    "transformer_lm_big",
    "transformer_lm_gpt",
    "transformer_lm_gpt2_small",
    "transformer_lm_gpt2_tiny",
    "transformer_lm_gpt2_medium",
    "transformer_lm_gpt2_big",
    "transformer_lm_gpt3_small",
    "transformer_lm_gpt3_medium",
    "transformer_lm_gpt3_large",
    "transformer_lm_gpt3_xl",
    "transformer_lm_gpt3_2_7",
    "transformer_lm_gpt3_6_7",
    "transformer_lm_gpt3_13",
    "transformer_lm_gpt3_175",
)
RENAMED = {"criterion": ("label_smoothed_cross_entropy",), "optimizer": ("adam",), "arch": STOCK_ARCHS + STOCK_LM_ARCHS}
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
    """A refusal: the command prints its message on one line and exits with status 2."""


def one_line(text):
    """``text`` with every run of whitespace (newlines included) made one space."""
    return " ".join(str(text).split())


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
                arch, "ls_transformer" if to_ls else "stock transformer", ", ".join(STOCK_ARCHS + STOCK_LM_ARCHS)
            )
        )
    if to_ls:
        used = [k for k in _unsupported_options(target) if cfg.get(k)]
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


def is_language_model(model_state):
    """Whether a state dict (ls or stock) is a decoder-only language model's: it has no encoder."""
    return not any(k.startswith("encoder.") for k in model_state)


def lm_model_to_fairseq(state):
    """ls_transformer_lm state dict -> fairseq transformer_lm state dict (new tensors): the q, k, v
    projections split as model_to_fairseq splits them; only the decoder has a version entry."""
    out = model_to_fairseq(state)
    del out["encoder.version"]
    return out


def _convert_model(state, to_ls):
    if to_ls:  # a language model's state has no cross-attention, which model_from_fairseq leaves as it is
        return model_from_fairseq(state)
    return lm_model_to_fairseq(state) if is_language_model(state) else model_to_fairseq(state)


def _unsupported_options(ls_arch):
    """The stock options that the ls model of ``ls_arch`` cannot honour when set (converting such a model
    would change it): ls_transformer_lm's refused ones for language models."""
    if ls_arch in {LS + a for a in STOCK_LM_ARCHS}:
        from ls_fairseq.models.ls_transformer_lm import REFUSED

        return tuple(REFUSED)
    return UNSUPPORTED_IF_SET


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
        "model": _convert_model(state["model"], to_ls),
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


QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16", "float32")


def load_checkpoint(path):
    """A checkpoint file's dict, loaded with weights_only=True; a file torch cannot load so (corrupt,
    truncated, not a checkpoint, pickling other types) is refused with torch's reason."""
    try:
        with fairseq_types_allowed():
            state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as e:
        raise ConversionError("torch.load(weights_only=True) cannot load it ({}: {})".format(
            type(e).__name__, one_line(e)[:300])) from e
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise ConversionError("not a fairseq checkpoint (no 'model' state dict)")
    return state


def _plain(cfg):
    if cfg is None or isinstance(cfg, dict):
        return cfg
    if isinstance(cfg, argparse.Namespace):
        return dict(vars(cfg))
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg)


def _stock_model_cfg(state):
    """A stock checkpoint's model configuration as a plain dict (from ``args`` in old checkpoints)."""
    if state.get("args") is not None:
        return _plain(state["args"])
    model = _plain(state.get("cfg") or {}).get("model")
    if model is None:
        raise ConversionError("the checkpoint has neither 'args' nor cfg['model']: no model configuration")
    return _plain(model)


def dictionary_places(checkpoint, data_dir, recorded_data):
    """The folders to look for a checkpoint's dictionaries in: ``data_dir`` if given, else the
    checkpoint's folder, then ``recorded_data`` (the data the checkpoint was trained on)."""
    if data_dir is not None:
        if not os.path.isdir(data_dir):
            raise ConversionError("--data-dir {}: no such directory".format(data_dir))
        return [data_dir]
    beside = [os.path.dirname(os.path.abspath(checkpoint))]
    return beside + ([recorded_data.split(os.pathsep)[0]] if recorded_data else [])


def find_dictionaries(checkpoint, data_dir, recorded_data, source_lang, target_lang):
    """(folder, source_lang, target_lang): where dict.SRC.txt and dict.TGT.txt are; ``data_dir`` if
    given, else the checkpoint's folder, else ``recorded_data`` (the data the checkpoint was trained
    on). The languages are the given ones, else inferred from fairseq's file names in the folder."""
    places = dictionary_places(checkpoint, data_dir, recorded_data)
    for place in places:
        found = sorted(os.path.basename(f)[len("dict."):-len(".txt")] for f in glob.glob(os.path.join(place, "dict.*.txt")))
        if not found:
            continue
        src, tgt = source_lang, target_lang
        if src is None or tgt is None:
            from fairseq.data.data_utils import infer_language_pair

            inferred = infer_language_pair(place)
            src, tgt = src or inferred[0], tgt or inferred[1]
            if src is None or tgt is None:
                raise ConversionError(
                    "{} holds the dictionaries of {} but no binarized data that says which is the source: give "
                    "--source-lang and --target-lang".format(place, ", ".join(found)))
        missing = [lang for lang in (src, tgt) if lang not in found]
        if missing:
            raise ConversionError("{} has no dict.{}.txt".format(place, missing[0]))
        return place, src, tgt
    raise ConversionError(
        "no dictionaries (dict.SRC.txt, dict.TGT.txt) in {}: give the data-bin directory with --data-dir".format(
            " or ".join(places)))


def _check_dictionaries(state, recorded, folder, src, tgt):
    """The dictionaries in ``folder`` are the ones ``state`` was trained with: the embedding tables'
    sizes, and ``recorded``, the fingerprints an ls_fairseq checkpoint records (extra_state)."""
    import hashlib

    from fairseq.data import Dictionary

    for side, lang, key in (("source", src, "encoder.embed_tokens.weight"), ("target", tgt, "decoder.embed_tokens.weight")):
        path = os.path.join(folder, "dict.{}.txt".format(lang))
        d = Dictionary.load(path)
        rows = state["model"][key].shape[0] if key in state["model"] else len(d)
        if rows != len(d):
            raise ConversionError("{} has {} entries, the checkpoint's {} {} rows: another dictionary".format(
                path, len(d), key, rows))
        sha = hashlib.sha256("\n".join(d.symbols).encode()).hexdigest()[:16]
        if side in recorded and recorded[side] != {"size": len(d), "sha256": sha}:
            raise ConversionError("{} is not the {} dictionary the checkpoint was trained with (sha256 {} there, "
                                  "{} here)".format(path, side, recorded[side]["sha256"], sha))


@contextlib.contextmanager
def ctranslate2_refusals():
    """CTranslate2's fairseq converter refuses a model with a ValueError that lists its reasons as
    "- " items (a KeyError where a name is missing from a registry, NotImplementedError where it has
    no converter for the model): re-raised as a ConversionError of one line with CTranslate2's own
    reasons, so that the refusals follow whatever the installed CTranslate2 checks."""
    try:
        yield
    except (ValueError, KeyError, NotImplementedError) as e:
        reasons = str(e).split("\n- ")[1:] if isinstance(e, ValueError) else []
        what = "; ".join(one_line(r) for r in reasons) or "{}: {}".format(type(e).__name__, one_line(e))
        raise ConversionError("CTranslate2 cannot convert this model: {}".format(what)) from e


def check_ctranslate2_config(model_cfg):
    """CTranslate2's own check of a stock model configuration (``model_cfg``, a dict of a registered
    architecture), the first step of its converter's load, run before the dictionaries are looked for
    so that an unsupported model is refused first. Options the configuration lacks get their
    architecture's defaults first, as fairseq gives them when it parses a command line."""
    try:
        from ctranslate2.converters.fairseq import _get_model_spec
    except ImportError:  # a CTranslate2 that renamed it: its converter runs the same check later
        return
    from fairseq.models import ARCH_CONFIG_REGISTRY

    args = argparse.Namespace(**model_cfg)
    ARCH_CONFIG_REGISTRY[args.arch](args)  # sets only the options that args lacks
    with ctranslate2_refusals():
        _get_model_spec(args)


def ctranslate2_input(state, checkpoint, data_dir=None, source_lang=None, target_lang=None):
    """(stock checkpoint dict that CTranslate2's fairseq converter reads, dictionaries' folder): a
    stock one with cfg["model"] an argparse.Namespace (``args`` None) that names the dictionaries'
    folder, languages and the translation task."""
    recorded = (state.get("extra_state") or {}).get("ls_dictionaries", {})
    if any(".qkv_proj." in k for k in state["model"]):
        state = convert(dict(state, last_optimizer_state=None), to_ls=False)  # no notice about an unused state
    model_cfg = _stock_model_cfg(state)
    task_cfg = _plain(state.get("cfg") or {}).get("task") or {}
    arch = model_cfg.get("arch") or model_cfg.get("_name")
    task = model_cfg.get("task") or task_cfg.get("_name") or "translation"
    if task not in ("translation", "language_modeling"):
        raise ConversionError("the checkpoint's task is {!r}; to-ctranslate2 converts translation models and "
                              "language models".format(task))
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    if arch not in ARCH_MODEL_NAME_REGISTRY:
        raise ConversionError("architecture {!r} is not one that fairseq registers; to-ctranslate2 converts "
                              "fairseq's transformer and transformer_lm architectures and ls_fairseq's".format(arch))
    check_ctranslate2_config(dict(model_cfg, arch=arch))
    if task == "language_modeling":
        return _lm_ctranslate2_input(state, checkpoint, data_dir, model_cfg, task_cfg, arch)
    folder, src, tgt = find_dictionaries(
        checkpoint, data_dir, model_cfg.get("data") or task_cfg.get("data"),
        source_lang or model_cfg.get("source_lang") or task_cfg.get("source_lang"),
        target_lang or model_cfg.get("target_lang") or task_cfg.get("target_lang"))
    _check_dictionaries(state, recorded, folder, src, tgt)
    model_cfg.update(arch=arch, _name=arch, task="translation", data=folder, source_lang=src, target_lang=tgt,
                     user_dir=None)
    cfg = dict(_plain(state.get("cfg") or {}), model=argparse.Namespace(**model_cfg))
    return {"args": None, "cfg": cfg, "model": state["model"]}, folder


def _lm_ctranslate2_input(state, checkpoint, data_dir, model_cfg, task_cfg, arch):
    """ctranslate2_input for a language model: its one dictionary (``dict.txt``) found as a translation
    model's are, and the language_modeling task's options beside the model's, since CTranslate2's
    converter sets the task up from the model's configuration alone."""
    places = dictionary_places(checkpoint, data_dir, model_cfg.get("data") or task_cfg.get("data"))
    folder = next((p for p in places if os.path.isfile(os.path.join(p, "dict.txt"))), None)
    if folder is None:
        raise ConversionError("no dictionary (dict.txt) in {}: give the data-bin directory with --data-dir".format(
            " or ".join(places)))
    from fairseq.data import Dictionary

    rows, size = state["model"]["decoder.embed_tokens.weight"].shape[0], len(Dictionary.load(
        os.path.join(folder, "dict.txt")))
    if rows != size:
        raise ConversionError("{} has {} entries, the checkpoint's decoder.embed_tokens.weight {} rows: another "
                              "dictionary".format(os.path.join(folder, "dict.txt"), size, rows))
    merged = {k: v for k, v in task_cfg.items() if k != "_name"}
    merged.update(model_cfg)
    merged.update(arch=arch, _name=arch, task="language_modeling", data=folder, user_dir=None)
    cfg = dict(_plain(state.get("cfg") or {}), model=argparse.Namespace(**merged))
    return {"args": None, "cfg": cfg, "model": state["model"]}, folder


def to_ctranslate2(checkpoint, output_dir, data_dir=None, quantization=None, source_lang=None, target_lang=None,
                   force=False):
    """Write the CTranslate2 model of ``checkpoint`` (ls or stock) to ``output_dir``; returns it."""
    try:
        from ctranslate2.converters import FairseqConverter
    except ImportError as e:
        raise ConversionError("to-ctranslate2 needs CTranslate2: pip install ctranslate2 (or pip install -e "
                              "'.[ctranslate2]' in ls_fairseq's repository) ({})".format(e)) from e
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ConversionError("--quantization {}: one of {}".format(quantization, ", ".join(QUANTIZATIONS)))
    if os.path.exists(output_dir) and not force:
        raise ConversionError("{} exists (--force replaces it)".format(output_dir))
    state, folder = ctranslate2_input(load_checkpoint(checkpoint), checkpoint, data_dir, source_lang, target_lang)
    with tempfile.TemporaryDirectory(prefix="ls_fairseq_ct2_") as tmp:
        stock = os.path.join(tmp, "stock.pt")
        torch.save(state, stock)
        del state
        converter = FairseqConverter(model_path=stock, data_dir=folder)
        with fairseq_types_allowed(), ctranslate2_refusals():
            return converter.convert(output_dir, quantization=quantization, force=force)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ls_fairseq.convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="direction", required=True, metavar="{to-fairseq,from-fairseq,to-ctranslate2}")
    for name, what in (("to-fairseq", "ls_transformer -> fairseq's transformer"),
                       ("from-fairseq", "fairseq's transformer -> ls_transformer")):
        p = sub.add_parser(name, help=what, description=what)
        p.add_argument("input", help="the checkpoint")
        p.add_argument("output", help="the converted checkpoint's path")
    p = sub.add_parser("to-ctranslate2", help="an ls or stock checkpoint -> a CTranslate2 model directory",
                       description="An ls or stock fairseq checkpoint -> a CTranslate2 model directory "
                                   "(ctranslate2.Translator loads it).")
    p.add_argument("input", help="the checkpoint (ls_transformer or fairseq's transformer; ls_transformer_lm or "
                                  "fairseq's transformer_lm)")
    p.add_argument("output", help="the CTranslate2 model directory to write")
    p.add_argument("--data-dir", help="the folder of dict.SRC.txt and dict.TGT.txt, or a language model's "
                                      "dict.txt (default: the checkpoint's folder, else the data-bin it was "
                                      "trained on)")
    p.add_argument("--quantization", choices=QUANTIZATIONS,
                   help="the weights' type (default: as in the checkpoint); int8 for CPUs, float16/bfloat16 or "
                        "int8_float16 for GPUs")
    p.add_argument("--source-lang", help="the source language (default: the checkpoint's, else the data-bin's)")
    p.add_argument("--target-lang", help="the target language (default: as the source)")
    p.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if not os.path.isfile(args.input):
            raise ConversionError("no such checkpoint")
        if args.direction == "to-ctranslate2":
            to_ctranslate2(args.input, args.output, args.data_dir, args.quantization, args.source_lang,
                           args.target_lang, args.force)
        else:
            out = convert(load_checkpoint(args.input), to_ls=args.direction == "from-fairseq")
            save_atomic(out, args.output)
    except ConversionError as e:
        print("convert: {}: {}".format(args.input, one_line(e)), file=sys.stderr)
        return 2  # argparse's status for a usage error: every refusal of the command exits with it
    logger.info("convert: wrote %s (%s)", args.output, args.direction)
    return 0


if __name__ == "__main__":
    sys.exit(main())
