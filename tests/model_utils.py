"""Build a stock fairseq transformer and an ls_transformer with the same weights."""
import argparse
import types

import torch
from fairseq.data import Dictionary
from fairseq.models.transformer import TransformerModel
from fairseq.models.transformer import base_architecture as stock_base

from ls_fairseq.convert import model_from_fairseq
from ls_fairseq.models.ls_transformer import LSTransformerModel
from ls_fairseq.models.ls_transformer import base_architecture as ls_base


def dictionary(n=40):
    d = Dictionary()
    for i in range(n):
        d.add_symbol("w{}".format(i))
    return d


def model_args(**overrides):
    kw = dict(
        encoder_embed_dim=32, encoder_ffn_embed_dim=48, encoder_layers=2, encoder_attention_heads=4,
        decoder_embed_dim=32, decoder_ffn_embed_dim=48, decoder_layers=3, decoder_attention_heads=4,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    )
    kw.update(overrides)
    return kw


def build_pair(dtype=torch.float32, left_pad_target=None, **overrides):
    """(stock, ls, task): both built from the same options, ls loaded with stock's weights;
    ``left_pad_target`` becomes the task's option (None: a task without it)."""
    d = dictionary()
    task = types.SimpleNamespace(source_dictionary=d, target_dictionary=d)
    if left_pad_target is not None:
        task.cfg = types.SimpleNamespace(left_pad_target=left_pad_target)
    stock_args = argparse.Namespace(**model_args(**overrides))
    stock_base(stock_args)
    stock = TransformerModel.build_model(stock_args, task)
    ls_args = argparse.Namespace(**model_args(**overrides))
    ls_base(ls_args)
    ls = LSTransformerModel.build_model(ls_args, task)
    ls.load_state_dict(model_from_fairseq(stock.state_dict()))
    return stock.to(dtype), ls.to(dtype), task


def batch(task, B=4, S=9, T=7, seed=None):
    """Left-padded source, right-padded prev_output_tokens and target, lengths varied."""
    d = task.source_dictionary
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    src = torch.randint(d.nspecial, len(d), (B, S), generator=g)
    prev = torch.randint(d.nspecial, len(d), (B, T), generator=g)
    prev[:, 0] = d.eos()
    for b in range(B):
        src[b, : b % S] = d.pad()
        src[b, -1] = d.eos()
        if b:
            prev[b, T - b % (T - 1) :] = d.pad()
    target = torch.cat([prev[:, 1:], torch.full((B, 1), d.eos())], dim=1).masked_fill(prev.eq(d.pad()), d.pad())
    lengths = src.ne(d.pad()).sum(1)
    return {"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": prev}, target


def grads_by_stock_name(model, is_ls):
    named = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return named if is_ls else model_from_fairseq(named)
