"""ls_fairseq's fused encoder layer in Hugging Face BERT models (``pip install -e '.[hf]'`` in the
repository: the package is not on PyPI).

    from ls_fairseq.hf import replace_bert_layers, restore_bert_layers
    replace_bert_layers(model)   # every BertLayer of the model becomes an LSBertLayer, weights copied
    ...                          # fine-tune as usual
    restore_bert_layers(model)   # plain BertLayers again, with the trained weights
    model.save_pretrained(path)  # an ordinary Hugging Face checkpoint

Supported: transformers 5.x (``SUPPORTED_MAJOR``), whose BertLayer is called as
``layer(hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask=..., cache=...,
**kwargs)`` and returns the hidden states. ``LSBertLayer`` subclasses ``BertLayer``, so that
Hugging Face still records every layer's output (``output_hidden_states``) and checkpoints the
layers' activations (``gradient_checkpointing_enable``): both go by the layer's class. It honours
``layer_norm_eps``, the exact (erf) GELU and the dropouts of the model's config, and takes every
attention mask Hugging Face hands a layer, reduced to a key padding mask by the mask's kind alone
(no branch on its values): sdpa's boolean [B, 1, T, T] (True: attend), eager's additive
[B, 1, T, T] (0 or the dtype's minimum), flash attention's [B, T] (1: a token), or None. A
decoder (``is_decoder``), cross-attention, ``output_attentions`` and an activation the fused
kernels do not have fail with an error that names them.
"""
import torch
import torch.nn as nn

from ls_fairseq import ops
from ls_fairseq.layers import EncoderLayer
from ls_fairseq.ops.bias_act_dropout import ACTIVATIONS

try:
    import transformers
    from transformers.models.bert.modeling_bert import BertLayer
except ImportError as e:  # the optional extra
    raise ImportError("ls_fairseq.hf needs transformers 5.x: pip install -e '.[hf]' in ls_fairseq's repository "
                      "(or pip install 'transformers>=5,<6')") from e

SUPPORTED_MAJOR = (5,)

if int(transformers.__version__.split(".")[0]) not in SUPPORTED_MAJOR:
    raise ImportError("ls_fairseq.hf supports transformers {}.x; {} is installed".format(
        "/".join(map(str, SUPPORTED_MAJOR)), transformers.__version__))


def check_config(config):
    """Raise ValueError naming what of a BertConfig the fused layer does not implement."""
    if config.is_decoder or config.add_cross_attention:
        raise ValueError("ls_fairseq.hf: is_decoder / add_cross_attention (a BERT decoder with cross-attention) "
                         "is not supported: the ls layer is an encoder layer")
    if config.hidden_act not in ACTIVATIONS:
        raise ValueError("ls_fairseq.hf: hidden_act {!r} is not an activation the fused kernels have ({}; gelu is "
                         "the exact erf form)".format(config.hidden_act, ", ".join(ACTIVATIONS)))


def key_padding_mask(attention_mask):
    """The [B, T] key padding mask (True at padding) of a mask as Hugging Face passes it to a layer, or None.
    A padding mask masks every query row alike, so the first row holds it."""
    if attention_mask is None:
        return None
    if not torch.is_tensor(attention_mask):
        raise ValueError("ls_fairseq.hf: attention mask of type {} (flex attention?) is not supported; use "
                         "attn_implementation sdpa, eager or flash".format(type(attention_mask).__name__))
    if attention_mask.dim() == 2:  # flash attention: 1 at tokens
        return attention_mask == 0
    if attention_mask.dim() != 4:
        raise ValueError("ls_fairseq.hf: attention mask of shape {} is none of [B, T] and [B, 1, Tq, Tk]".format(
            list(attention_mask.shape)))
    first_row = attention_mask[:, 0, 0, :]
    if first_row.dtype == torch.bool:  # sdpa: True where a query may attend
        return ~first_row
    return first_row < 0  # eager: 0 where it may attend, the dtype's minimum elsewhere


class LSBertLayer(BertLayer):
    """A BertLayer that runs ls_fairseq's fused post-LN encoder layer (``self.layer``)."""

    def __init__(self, config, layer_idx=None):
        check_config(config)
        nn.Module.__init__(self)  # not BertLayer's: the ls layer holds the parameters
        self.chunk_size_feed_forward = config.chunk_size_feed_forward
        self.seq_len_dim = 1
        self.is_decoder = False
        self.add_cross_attention = False
        self.layer_idx = layer_idx
        self.layer = EncoderLayer(config.hidden_size, config.num_attention_heads, config.intermediate_size,
                                  normalize_before=False, activation_fn=config.hidden_act,
                                  layer_norm_eps=config.layer_norm_eps, dropout=config.hidden_dropout_prob,
                                  attention_dropout=config.attention_probs_dropout_prob)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                cache=None, **kwargs):
        if encoder_hidden_states is not None:
            raise ValueError("ls_fairseq.hf: cross-attention (encoder_hidden_states) is not supported")
        if kwargs.get("output_attentions"):
            raise ValueError("ls_fairseq.hf: output_attentions is not supported: the fused attention never forms "
                             "the attention probabilities")
        return self.layer(hidden_states, ops.AttentionMask(key_padding_mask(attention_mask)))

    @classmethod
    def from_bert_layer(cls, bert_layer, config):
        """An LSBertLayer with ``bert_layer``'s weights, on its device, in its dtype and training mode."""
        weight = bert_layer.attention.self.query.weight
        layer = cls(config, getattr(bert_layer.attention.self, "layer_idx", None)).to(weight.device, weight.dtype)
        ls, attn = layer.layer, bert_layer.attention
        with torch.no_grad():
            for part in ("weight", "bias"):
                getattr(ls.self_attn.qkv_proj, part).copy_(torch.cat(
                    [getattr(getattr(attn.self, name), part) for name in ("query", "key", "value")]))
            for ours, theirs in _pairs(layer, bert_layer):
                ours.copy_(theirs)
        return layer.train(bert_layer.training)

    def to_bert_layer(self, config):
        """A plain BertLayer with this layer's weights, on its device, in its dtype and training mode."""
        weight = self.layer.self_attn.qkv_proj.weight
        bert_layer = BertLayer(config, layer_idx=self.layer_idx).to(weight.device, weight.dtype)
        with torch.no_grad():
            for part in ("weight", "bias"):
                q, k, v = getattr(self.layer.self_attn.qkv_proj, part).chunk(3)
                for name, value in zip(("query", "key", "value"), (q, k, v)):
                    getattr(getattr(bert_layer.attention.self, name), part).copy_(value)
            for ours, theirs in _pairs(self, bert_layer):
                theirs.copy_(ours)
        return bert_layer.train(self.training)


def _pairs(layer, bert_layer):
    """(ls parameter, BertLayer parameter) of every part but the query/key/value projections."""
    ls = layer.layer
    modules = [(ls.self_attn.out_proj, bert_layer.attention.output.dense),
               (ls.self_attn_layer_norm, bert_layer.attention.output.LayerNorm),
               (ls.fc1, bert_layer.intermediate.dense), (ls.fc2, bert_layer.output.dense),
               (ls.final_layer_norm, bert_layer.output.LayerNorm)]
    return [(getattr(a, part), getattr(b, part)) for a, b in modules for part in ("weight", "bias")]


def _layer_lists(model):
    """Every ModuleList of the model that holds BertLayers (its encoder's ``layer``)."""
    return [m for m in model.modules() if isinstance(m, nn.ModuleList) and any(isinstance(x, BertLayer) for x in m)]


def replace_bert_layers(model):
    """Replace every BertLayer of a transformers model (BertModel, BertForSequenceClassification, ...) by an
    LSBertLayer with its weights, in place; returns the model. Fails before changing anything where
    the config has what the ls layer does not implement (``check_config``)."""
    check_config(model.config)
    for layers in _layer_lists(model):
        for i, bert_layer in enumerate(layers):
            if not isinstance(bert_layer, LSBertLayer):
                layers[i] = LSBertLayer.from_bert_layer(bert_layer, model.config)
    return model


def restore_bert_layers(model):
    """Put plain BertLayers with the current weights back in place of every LSBertLayer; returns the model
    (which ``save_pretrained`` then writes as an ordinary Hugging Face model)."""
    for layers in _layer_lists(model):
        for i, layer in enumerate(layers):
            if isinstance(layer, LSBertLayer):
                layers[i] = layer.to_bert_layer(model.config)
    return model
