"""ls_fairseq's fused layers in Hugging Face models: BERT, GPT-2 and ViT (``pip install -e '.[hf]'`` in
the repository: the package is not on PyPI).

    from ls_fairseq.hf import replace_layers, restore_layers
    replace_layers(model)        # every BertLayer / GPT2Block / ViTLayer becomes its ls layer, weights copied
    ...                          # fine-tune, generate, save_pretrained as usual
    restore_layers(model)        # plain Hugging Face layers again, with the trained weights

Supported: transformers 5.x (``SUPPORTED_MAJOR``). Each ls layer subclasses the layer it replaces, so that
Hugging Face still records every layer's output (``output_hidden_states``) and checkpoints the layers'
activations (``gradient_checkpointing_enable``): both go by the layer's class.

- BERT (``LSBertLayer``): post-LN encoder layer; ``hidden_act`` relu, gelu (erf) or gelu_new.
- GPT-2 (``LSGPT2Block``): pre-LN, causal, gelu_new (the tanh form, fairseq's gelu_accurate); Hugging Face's
  KV cache (``generate``); Conv1D weights copied transposed.
- ViT (``LSViTLayer``): pre-LN encoder layer with exact GELU, no mask.

Replacing and restoring keep each parameter's requires_grad, the layer's training mode, dtype, device and
gradient checkpointing. A model with ls layers saves under Hugging Face's names (``state_dict`` hooks), so
``save_pretrained`` writes an ordinary checkpoint that reloads as a plain model, and a Hugging Face state dict
loads into the ls layers.

Masks, exactly, for every mask Hugging Face hands a layer:
- the common case, a [B, T] padding mask given to the model: a forward pre-hook on the model hands the layers
  its key padding mask (keyword ``ls_padding``), and the layers take the fast path (``ops.AttentionMask``:
  key padding, causal for GPT-2) without reading the [B, 1, Tq, Tk] mask Hugging Face made from it, so
  without a host synchronisation;
- any other 4D mask (a custom one, packed sequences' block-diagonal one): the general path
  (``ops.DenseMask``: torch's SDPA with the mask as it is, boolean as sdpa takes it, additive as eager);
- flash attention: its [B, Tk] mask (key padding), its ``cu_seq_lens_q/k`` and ``max_length_q/k`` (the
  batch as one stream of segments, ``ops.SegmentMask``), or packed ``position_ids`` with a batch of one
  (segments found as Hugging Face's flash path finds them, a host synchronisation there too).
What cannot be computed exactly fails with an error that names it: flex attention's block masks,
``output_attentions``, cross-attention, and the configurations each ``check_*_config`` lists.
"""
import functools
import inspect

import torch
import torch.nn as nn

from ls_fairseq import ops
from ls_fairseq.layers import DecoderLayer, EncoderLayer

try:
    import transformers
    from transformers.models.bert.modeling_bert import BertLayer, BertModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block, GPT2Model
    from transformers.models.vit.modeling_vit import ViTLayer
except ImportError as e:  # the optional extra
    raise ImportError("ls_fairseq.hf needs transformers 5.x: pip install -e '.[hf]' in ls_fairseq's repository "
                      "(or pip install 'transformers>=5,<6')") from e

SUPPORTED_MAJOR = (5,)

if int(transformers.__version__.split(".")[0]) not in SUPPORTED_MAJOR:
    raise ImportError("ls_fairseq.hf supports transformers {}.x; {} is installed".format(
        "/".join(map(str, SUPPORTED_MAJOR)), transformers.__version__))

# Hugging Face's activation names -> the fused ops' (gelu_new and gelu_pytorch_tanh: the tanh form)
HF_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_accurate", "gelu_pytorch_tanh": "gelu_accurate"}
FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _activation(name, option):
    if name not in HF_ACTIVATIONS:
        raise ValueError("ls_fairseq.hf: {} {!r} is not an activation the fused kernels have ({}; gelu is the exact "
                         "erf form, gelu_new the tanh form)".format(option, name, ", ".join(HF_ACTIVATIONS)))
    return HF_ACTIVATIONS[name]


def check_config(config):
    """Raise ValueError naming what of a BertConfig the fused layer does not implement."""
    if config.is_decoder or config.add_cross_attention:
        raise ValueError("ls_fairseq.hf: is_decoder / add_cross_attention (a BERT decoder with cross-attention) "
                         "is not supported: the ls layer is an encoder layer")
    _activation(config.hidden_act, "hidden_act")


def check_gpt2_config(config):
    """Raise ValueError naming what of a GPT2Config the fused block does not implement."""
    for option, unsupported in (("scale_attn_by_inverse_layer_idx", True), ("reorder_and_upcast_attn", True),
                                ("scale_attn_weights", False), ("add_cross_attention", True)):
        if bool(getattr(config, option)) == unsupported:
            raise ValueError("ls_fairseq.hf: GPT-2's {}={} is not supported: the ls block scales the scores by "
                             "1/sqrt(d_head) in the run's dtype, without cross-attention".format(option, unsupported))
    _activation(config.activation_function, "activation_function")


def check_vit_config(config):
    """Raise ValueError naming what of a ViTConfig the fused layer does not implement."""
    if not config.qkv_bias:
        raise ValueError("ls_fairseq.hf: ViT's qkv_bias=False is not supported: the fused projection has a bias")
    _activation(config.hidden_act, "hidden_act")


class PaddingHint:
    """The key padding mask (bool [B, Tk], True at padding; None: no padding) of the [B, Tk] attention_mask
    a model was called with, which Hugging Face expands into the layers' 4D masks: the model's forward
    pre-hook (``_hand_padding``) passes it to the layers as the keyword ``ls_padding``. The layers'
    ops.AttentionMask is made once per forward and shared (``mask``)."""

    def __init__(self, key_padding_mask):
        self.key_padding_mask = key_padding_mask
        self._masks = {}

    def mask(self, causal):
        if causal not in self._masks:
            self._masks[causal] = ops.AttentionMask(self.key_padding_mask, causal=causal)
        return self._masks[causal]


def _parameter_places(cls):
    """{name: position among the positional arguments} of ``cls.forward``'s parameters (after self)."""
    names = list(inspect.signature(cls.forward).parameters)[1:]
    return {name: i for i, name in enumerate(names)}


def _argument(places, args, kwargs, name):
    if name in kwargs:
        return kwargs[name]
    place = places.get(name)
    return args[place] if place is not None and place < len(args) else None


def _hand_padding(places, module, args, kwargs):
    """The base model's forward pre-hook (``places``: its forward's ``_parameter_places``, read when the hook is
    registered): where its 4D masks come from a [B, Tk] attention_mask (or from none, and no position_ids that
    could make a packed mask), hand the layers that padding (``PaddingHint``)."""
    mask = _argument(places, args, kwargs, "attention_mask")
    if torch.is_tensor(mask) and mask.dim() == 2:
        hint = PaddingHint(mask == 0)
    elif mask is None and _argument(places, args, kwargs, "position_ids") is None:
        hint = PaddingHint(None)
    else:
        return None
    return args, dict(kwargs, ls_padding=hint)


def _is_flash(config):
    return "flash" in (config._attn_implementation or "")


def layer_mask(config, attention_mask, kwargs, shape, past, causal):
    """(the ops mask for a layer's self-attention, whether the batch runs as one stream of segments) from what
    Hugging Face hands the layer: ``attention_mask``, the flash keywords and ``ls_padding`` among ``kwargs``;
    ``shape`` (B, T) the layer's input, ``past`` the keys cached before it."""
    B, T = shape
    given = [name for name in FLASH_KWARGS if kwargs.get(name) is not None]
    if given:
        if len(given) < len(FLASH_KWARGS):
            raise ValueError("ls_fairseq.hf: flash attention's {} given without {}".format(
                ", ".join(given), ", ".join(n for n in FLASH_KWARGS if n not in given)))
        if attention_mask is not None or past:
            raise ValueError("ls_fairseq.hf: flash attention's cu_seq_lens_q/k with an attention_mask or a KV cache "
                             "is not supported")
        q_offsets, k_offsets = kwargs["cu_seq_lens_q"].int(), kwargs["cu_seq_lens_k"].int()
        if causal:  # one stream for queries and keys (self-attention)
            if not torch.equal(q_offsets, k_offsets):
                raise ValueError("ls_fairseq.hf: causal attention with cu_seq_lens_q != cu_seq_lens_k is not supported")
            k_offsets = q_offsets
        return ops.SegmentMask(q_offsets, k_offsets, int(kwargs["max_length_q"]), int(kwargs["max_length_k"]),
                               causal=causal), True
    if attention_mask is None:
        position_ids = kwargs.get("position_ids")
        if _is_flash(config) and position_ids is not None and B == 1 and T > 1 and not past:
            # Hugging Face's flash path: several increasing runs of positions are packed sequences, each starting
            # at the smallest position (modeling_flash_attention_utils; reading them synchronises, as there)
            positions = position_ids.reshape(-1)
            first = positions.min()
            if bool((torch.arange(T, device=positions.device) + first - positions).abs().sum()):
                starts = (positions == first).nonzero().view(-1).int()
                offsets = torch.cat([starts, starts.new_tensor([T])])
                return ops.SegmentMask(offsets, offsets, T, T, causal=causal), True
        return ops.AttentionMask(causal=causal), False
    if not torch.is_tensor(attention_mask):
        raise ValueError("ls_fairseq.hf: attention mask of type {} (flex attention?) is not supported; use "
                         "attn_implementation sdpa, eager or flash".format(type(attention_mask).__name__))
    if attention_mask.dim() == 2:  # flash attention: 1 at tokens
        if tuple(attention_mask.shape) != (B, past + T):
            raise ValueError("ls_fairseq.hf: a [B, T] attention mask of shape {} for {} keys".format(
                list(attention_mask.shape), past + T))
        return ops.AttentionMask(attention_mask == 0, causal=causal), False
    if attention_mask.dim() != 4:
        raise ValueError("ls_fairseq.hf: attention mask of shape {} is none of [B, T] and [B, 1, Tq, Tk]".format(
            list(attention_mask.shape)))
    hint = kwargs.get("ls_padding")
    padding = None if hint is None else hint.key_padding_mask
    if hint is not None and (padding is None or tuple(padding.shape) == (B, attention_mask.shape[-1])):
        return hint.mask(causal), False
    return ops.DenseMask(attention_mask), False


def _check_call(kwargs, encoder_hidden_states=None):
    if encoder_hidden_states is not None:
        raise ValueError("ls_fairseq.hf: cross-attention (encoder_hidden_states) is not supported")
    if kwargs.get("output_attentions"):
        raise ValueError("ls_fairseq.hf: output_attentions is not supported: the fused attention never forms "
                         "the attention probabilities")


def _run(layer, x, mask, packed, **options):
    """``layer`` on x [B, T, d]; a SegmentMask runs the batch as one stream of B x T rows (flash's layout). Under
    torch.autocast the layer runs as Hugging Face's would (ls_fairseq.layers: GEMMs in the autocast dtype, the
    residual stream and LayerNorms in x's)."""
    if not packed:
        return layer(x, mask, **options)
    B, T, d = x.shape
    return layer(x.reshape(1, B * T, d), mask, **options).view(B, T, d)


# Each ls layer's parameter map: (ls parameter, its Hugging Face parameters, how): "same" one tensor, "cat"
# the ls one is the concatenation of the Hugging Face ones (q, k, v), "t" the transpose (GPT-2's Conv1D).


def _linear(ls, hf, how="same"):
    return [("{}.{}".format(ls, p), ["{}.{}".format(h, p) for h in hf], how if p == "weight" else
             ("cat" if how == "cat" else "same")) for p in ("weight", "bias")]


def _to_ls(tensors, how):
    return torch.cat(tensors) if how == "cat" else tensors[0].t() if how == "t" else tensors[0]


def _to_hf(tensor, how, count):
    if how == "cat":
        return [t.clone() for t in tensor.chunk(count)]  # clones: a checkpoint's tensors may share no storage
    return [tensor.t().contiguous()] if how == "t" else [tensor]


class _LSLayer:
    """What the ls layers share: weights copied from and to their Hugging Face layer (``PARAMETERS``), and the
    state dict under Hugging Face's names."""

    PARAMETERS = ()
    HF_CLASS = None

    def _hf_names_in_state_dict(self):
        self.register_state_dict_post_hook(_state_dict_as_hf)
        self.register_load_state_dict_pre_hook(_load_state_dict_from_hf)

    @classmethod
    def from_hf(cls, hf_layer, config):
        """The ls layer with ``hf_layer``'s weights (their requires_grad too), on its device, in its dtype,
        training mode and gradient checkpointing."""
        hf_params = dict(hf_layer.named_parameters())
        covered = {name for _, names, _ in cls.PARAMETERS for name in names}
        if set(hf_params) != covered:
            raise ValueError("ls_fairseq.hf: {} has parameters the ls layer does not hold: {}".format(
                type(hf_layer).__name__, sorted(set(hf_params) - covered)))
        kinds = {(p.dtype, p.device) for p in hf_params.values()}
        if len(kinds) != 1:
            raise ValueError("ls_fairseq.hf: a {} with parameters in several dtypes or on several devices ({}) is "
                             "not supported".format(type(hf_layer).__name__, sorted(map(str, kinds))))
        dtype, device = kinds.pop()
        # the layer's number, where Hugging Face keeps it (GPT-2: its attention's; the KV cache's index)
        layer_idx = next((m.layer_idx for m in hf_layer.modules() if getattr(m, "layer_idx", None) is not None), None)
        layer = cls(config, layer_idx).to(device, dtype)
        ls_params = dict(layer.named_parameters())
        with torch.no_grad():
            for ours, theirs, how in cls.PARAMETERS:
                tensors = [hf_params[name] for name in theirs]
                frozen = {t.requires_grad for t in tensors}
                if len(frozen) != 1:
                    raise ValueError("ls_fairseq.hf: {} are partly frozen; the ls layer holds them as one parameter"
                                     .format(", ".join(theirs)))
                ls_params[ours].copy_(_to_ls(tensors, how)).requires_grad_(frozen.pop())
        _copy_checkpointing(hf_layer, layer)
        return layer.train(hf_layer.training)

    def to_hf(self, config):
        """The plain Hugging Face layer with this layer's weights, their requires_grad, device, dtype, training mode
        and gradient checkpointing."""
        ls_params = dict(self.named_parameters())
        weight = next(iter(ls_params.values()))
        hf_layer = self._make_hf(config).to(weight.device, weight.dtype)
        hf_params = dict(hf_layer.named_parameters())
        with torch.no_grad():
            for ours, theirs, how in self.PARAMETERS:
                for name, value in zip(theirs, _to_hf(ls_params[ours], how, len(theirs))):
                    hf_params[name].copy_(value).requires_grad_(ls_params[ours].requires_grad)
        _copy_checkpointing(self, hf_layer)
        return hf_layer.train(self.training)


def _copy_checkpointing(source, target):
    for name in ("gradient_checkpointing", "_gradient_checkpointing_func"):
        if name in source.__dict__:
            setattr(target, name, source.__dict__[name])


def _state_dict_as_hf(module, state_dict, prefix, local_metadata):
    for ours, theirs, how in module.PARAMETERS:
        value = state_dict.pop(prefix + ours)
        value = value if how == "same" else value.detach()
        for name, part in zip(theirs, _to_hf(value, how, len(theirs))):
            state_dict[prefix + name] = part


def _load_state_dict_from_hf(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                             error_msgs):
    for ours, theirs, how in module.PARAMETERS:
        keys = [prefix + name for name in theirs]
        if all(key in state_dict for key in keys):
            state_dict[prefix + ours] = _to_ls([state_dict.pop(key) for key in keys], how)


class LSBertLayer(_LSLayer, BertLayer):
    """A BertLayer that runs ls_fairseq's fused post-LN encoder layer (``self.layer``)."""

    HF_CLASS = BertLayer
    PARAMETERS = tuple(
        _linear("layer.self_attn.qkv_proj", ["attention.self.query", "attention.self.key", "attention.self.value"],
                "cat")
        + _linear("layer.self_attn.out_proj", ["attention.output.dense"])
        + _linear("layer.self_attn_layer_norm", ["attention.output.LayerNorm"])
        + _linear("layer.fc1", ["intermediate.dense"]) + _linear("layer.fc2", ["output.dense"])
        + _linear("layer.final_layer_norm", ["output.LayerNorm"]))

    def __init__(self, config, layer_idx=None):
        check_config(config)
        nn.Module.__init__(self)  # not BertLayer's: the ls layer holds the parameters
        self.config = config
        self.chunk_size_feed_forward = config.chunk_size_feed_forward
        self.seq_len_dim = 1
        self.is_decoder = False
        self.add_cross_attention = False
        self.layer_idx = layer_idx
        self.layer = EncoderLayer(config.hidden_size, config.num_attention_heads, config.intermediate_size,
                                  normalize_before=False, activation_fn=_activation(config.hidden_act, "hidden_act"),
                                  layer_norm_eps=config.layer_norm_eps, dropout=config.hidden_dropout_prob,
                                  attention_dropout=config.attention_probs_dropout_prob)
        self._hf_names_in_state_dict()

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                cache=None, **kwargs):
        _check_call(kwargs, encoder_hidden_states)
        mask, packed = layer_mask(self.config, attention_mask, kwargs, hidden_states.shape[:2], 0, causal=False)
        return _run(self.layer, hidden_states, mask, packed)

    def _make_hf(self, config):
        return BertLayer(config, layer_idx=self.layer_idx)

    @classmethod
    def from_bert_layer(cls, bert_layer, config):
        return cls.from_hf(bert_layer, config)

    def to_bert_layer(self, config):
        return self.to_hf(config)


class LSGPT2Block(_LSLayer, GPT2Block):
    """A GPT2Block that runs ls_fairseq's fused pre-LN causal layer (``self.layer``, a decoder-only
    DecoderLayer); Hugging Face's KV cache holds its keys and values."""

    HF_CLASS = GPT2Block
    PARAMETERS = tuple(
        _linear("layer.self_attn_layer_norm", ["ln_1"]) + _linear("layer.self_attn.qkv_proj", ["attn.c_attn"], "t")
        + _linear("layer.self_attn.out_proj", ["attn.c_proj"], "t") + _linear("layer.final_layer_norm", ["ln_2"])
        + _linear("layer.fc1", ["mlp.c_fc"], "t") + _linear("layer.fc2", ["mlp.c_proj"], "t"))

    def __init__(self, config, layer_idx=None):
        check_gpt2_config(config)
        nn.Module.__init__(self)
        self.config = config
        self.layer_idx = layer_idx
        inner = config.n_inner if config.n_inner is not None else 4 * config.hidden_size
        self.layer = DecoderLayer(config.hidden_size, config.num_attention_heads, inner, cross_attention=False,
                                  normalize_before=True,
                                  activation_fn=_activation(config.activation_function, "activation_function"),
                                  layer_norm_eps=config.layer_norm_epsilon, dropout=config.resid_pdrop,
                                  attention_dropout=config.attn_pdrop)
        self._hf_names_in_state_dict()

    def forward(self, hidden_states, cache=None, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, use_cache=False, **kwargs):
        _check_call(kwargs, encoder_hidden_states)
        cache = kwargs.pop("past_key_values", cache)
        past = cache.get_seq_length(self.layer_idx) if cache is not None else 0
        mask, packed = layer_mask(self.config, attention_mask, kwargs, hidden_states.shape[:2], past, causal=True)
        update = None if cache is None else functools.partial(_cache_update, cache, self.layer_idx)
        return _run(self.layer, hidden_states, mask, packed, cache=update)

    def _make_hf(self, config):
        return GPT2Block(config, layer_idx=self.layer_idx)


def _cache_update(cache, layer_idx, k, v):
    return cache.update(k, v, layer_idx)


class LSViTLayer(_LSLayer, ViTLayer):
    """A ViTLayer that runs ls_fairseq's fused pre-LN encoder layer (``self.layer``)."""

    HF_CLASS = ViTLayer
    PARAMETERS = tuple(
        _linear("layer.self_attn.qkv_proj", ["attention.q_proj", "attention.k_proj", "attention.v_proj"], "cat")
        + _linear("layer.self_attn.out_proj", ["attention.o_proj"])
        + _linear("layer.self_attn_layer_norm", ["layernorm_before"])
        + _linear("layer.fc1", ["mlp.fc1"]) + _linear("layer.fc2", ["mlp.fc2"])
        + _linear("layer.final_layer_norm", ["layernorm_after"]))

    def __init__(self, config, layer_idx=None):
        check_vit_config(config)
        nn.Module.__init__(self)
        self.config = config
        self.layer = EncoderLayer(config.hidden_size, config.num_attention_heads, config.intermediate_size,
                                  normalize_before=True, activation_fn=_activation(config.hidden_act, "hidden_act"),
                                  layer_norm_eps=config.layer_norm_eps, dropout=config.hidden_dropout_prob,
                                  attention_dropout=config.attention_probs_dropout_prob)
        self._hf_names_in_state_dict()

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        _check_call(kwargs)
        mask, packed = layer_mask(self.config, attention_mask, kwargs, hidden_states.shape[:2], 0, causal=False)
        return _run(self.layer, hidden_states, mask, packed)

    def _make_hf(self, config):
        return ViTLayer(config)


# (Hugging Face layer class, ls layer class, config check, the base model whose forward hands the padding or None)
FAMILIES = ((BertLayer, LSBertLayer, check_config, BertModel), (GPT2Block, LSGPT2Block, check_gpt2_config, GPT2Model),
            (ViTLayer, LSViTLayer, check_vit_config, None))


def _layer_lists(model, hf_class, ls_class):
    """Every ModuleList of the model that holds layers of the family."""
    return [m for m in model.modules()
            if isinstance(m, nn.ModuleList) and any(isinstance(x, (hf_class, ls_class)) for x in m)]


def _families(model):
    return [family for family in FAMILIES if _layer_lists(model, family[0], family[1])]


_HOOK = "_ls_fairseq_padding_hook"


def replace_layers(model):
    """Replace every BertLayer, GPT2Block and ViTLayer of a transformers model by its ls layer with its weights,
    in place; returns the model. Fails before changing anything where the config has what the ls layers do not
    implement (``check_config``, ``check_gpt2_config``, ``check_vit_config``) or a layer cannot be copied."""
    families = _families(model)
    if not families:
        raise ValueError("ls_fairseq.hf: {} has no BertLayer, GPT2Block or ViTLayer to replace".format(
            type(model).__name__))
    replaced = []
    for hf_class, ls_class, check, base in families:
        check(model.config)
        for layers in _layer_lists(model, hf_class, ls_class):
            replaced += [(layers, i, ls_class.from_hf(layer, model.config)) for i, layer in enumerate(layers)
                         if not isinstance(layer, ls_class)]
        for module in model.modules():
            if base is not None and isinstance(module, base) and not hasattr(module, _HOOK):
                hook = functools.partial(_hand_padding, _parameter_places(type(module)))
                setattr(module, _HOOK, module.register_forward_pre_hook(hook, with_kwargs=True))
    for layers, i, layer in replaced:  # every layer made before any is put in place
        layers[i] = layer
    return model


def restore_layers(model):
    """Put plain Hugging Face layers with the current weights back in place of every ls layer; returns the model."""
    for hf_class, ls_class, _, base in FAMILIES:
        for layers in _layer_lists(model, hf_class, ls_class):
            for i, layer in enumerate(layers):
                if isinstance(layer, ls_class):
                    layers[i] = layer.to_hf(model.config)
    for module in model.modules():
        if hasattr(module, _HOOK):
            getattr(module, _HOOK).remove()
            delattr(module, _HOOK)
    return model


def replace_bert_layers(model):
    """``replace_layers`` for a BERT model (its config checked first)."""
    check_config(model.config)
    return replace_layers(model)


restore_bert_layers = restore_layers

