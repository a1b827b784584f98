import argparse

import pytest
import torch
from helpers import assert_close, rel_error
from model_utils import batch, build_pair, grads_by_stock_name

from ls_fairseq.ops.linear import IN_WORKSPACE

VARIANTS = {
    "post-ln relu sinusoidal shared": dict(share_all_embeddings=True),
    "pre-ln gelu learned": dict(encoder_normalize_before=True, decoder_normalize_before=True,
                                activation_fn="gelu", encoder_learned_pos=True, decoder_learned_pos=True),
    "post-ln separate embeddings": dict(share_decoder_input_output_embed=False),
    "pre-ln shared decoder in/out": dict(encoder_normalize_before=True, decoder_normalize_before=True,
                                         share_decoder_input_output_embed=True, no_scale_embedding=True),
}


def nonpad(x, prev, pad):
    return x[prev.ne(pad)]


@pytest.mark.parametrize("left_pad_target", [None, False])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_training_forward_and_gradients_equal_stock(variant, left_pad_target):
    """In fp64, where the differences left are stock's: fairseq's attention softmax runs in fp32,
    which leaves relative errors (norm of the difference over stock's norm) up to about 3e-6
    (cross-attention gradients, 16 seeds); the bound keeps a 10x margin. left_pad_target False
    (fairseq's default): the decoder self-attention drops its padding mask."""
    stock, ls, task = build_pair(torch.float64, left_pad_target=left_pad_target, **VARIANTS[variant])
    assert ls.decoder.right_padded_targets == (left_pad_target is False)
    pad = task.source_dictionary.pad()
    net_input, _ = batch(task)
    stock.train()
    ls.train()
    out_stock, _ = stock(**net_input)
    out_ls, _ = ls(**net_input)
    prev = net_input["prev_output_tokens"]
    assert rel_error(nonpad(out_ls, prev, pad), nonpad(out_stock, prev, pad)) < 3e-5, "logits"
    upstream = torch.randn_like(out_stock) * prev.ne(pad).unsqueeze(-1)
    out_stock.backward(upstream)
    out_ls.backward(upstream)
    g_stock, g_ls = grads_by_stock_name(stock, False), grads_by_stock_name(ls, True)
    assert set(g_stock) == set(g_ls)
    for name in g_stock:
        assert rel_error(g_ls[name], g_stock[name]) < 3e-5, (name, rel_error(g_ls[name], g_stock[name]))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_incremental_decoding_equals_stock_and_full_forward(variant):
    stock, ls, task = build_pair(**VARIANTS[variant])
    stock.eval()
    ls.eval()
    net_input, _ = batch(task, B=2, T=7)
    # two sentences x two beams, as fairseq's SequenceGenerator lays them out
    src = net_input["src_tokens"].repeat_interleave(2, dim=0)
    prev = torch.randint(4, 40, (4, 7))
    reorders = {3: torch.tensor([1, 1, 3, 2]), 5: torch.tensor([0, 2])}  # a beam reorder, then a sentence finishes
    with torch.no_grad():
        enc_stock, enc_ls = stock.encoder(src), ls.encoder(src)
        full_ls, _ = ls.decoder(prev, enc_ls)
        state_stock, state_ls = {}, {}
        for t in range(prev.shape[1]):
            if t in reorders:
                order = reorders[t]
                prev, full_ls = prev[order], full_ls[order]
                if t == 5:
                    enc_stock = stock.encoder.reorder_encoder_out(enc_stock, order)
                    enc_ls = ls.encoder.reorder_encoder_out(enc_ls, order)
                stock.decoder.reorder_incremental_state_scripting(state_stock, order)
                ls.decoder.reorder_incremental_state_scripting(state_ls, order)
            step_stock, _ = stock.decoder(prev[:, : t + 1], enc_stock, incremental_state=state_stock)
            step_ls, _ = ls.decoder(prev[:, : t + 1], enc_ls, incremental_state=state_ls)
            assert_close(step_ls, step_stock, rtol=1e-5, atol=1e-5, what="step {}".format(t))
            if t < 3:
                assert_close(step_ls[:, 0], full_ls[:, t], rtol=1e-5, atol=1e-5, what="step {} vs full".format(t))


def test_two_models_in_one_process_keep_separate_state():
    _, a, task = build_pair()
    _, b, _ = build_pair()
    a.eval()
    b.eval()
    net_input, _ = batch(task, B=2, T=4)
    prev = net_input["prev_output_tokens"].clone()
    prev[prev.eq(task.source_dictionary.pad())] = 5
    with torch.no_grad():
        state = {}
        enc_a = a.encoder(net_input["src_tokens"])
        enc_b = b.encoder(net_input["src_tokens"])
        out_a, _ = a.decoder(prev[:, :1], enc_a, incremental_state=state)
        out_b, _ = b.decoder(prev[:, :1], enc_b, incremental_state=state)
        assert not torch.allclose(out_a, out_b)
        assert_close(a.decoder(prev[:, :2], enc_a, incremental_state=state)[0][:, 0],
                     a.decoder(prev[:, :2], enc_a)[0][:, 1], rtol=1e-5, atol=1e-5)


def test_indivisible_heads_is_a_clear_error():
    from model_utils import dictionary, model_args

    from ls_fairseq.models.ls_transformer import LSTransformerModel

    d = dictionary()
    task = argparse.Namespace(source_dictionary=d, target_dictionary=d)
    with pytest.raises(ValueError, match="encoder-embed-dim 30 is not divisible by --encoder-attention-heads 4"):
        LSTransformerModel.build_model(argparse.Namespace(**model_args(encoder_embed_dim=30)), task)


def test_dropout_changes_training_output_and_eval_is_deterministic():
    _, ls, task = build_pair(dropout=0.3, attention_dropout=0.1, activation_dropout=0.1)
    net_input, _ = batch(task)
    ls.train()
    a, b = ls(**net_input)[0], ls(**net_input)[0]
    assert not torch.allclose(a, b)
    ls.eval()
    assert torch.equal(ls(**net_input)[0], ls(**net_input)[0])


def test_gradients_accumulated_in_place_equal_autograds():
    """With the gradients already allocated (ls_adam keeps them in its workspace), the linear
    layers accumulate their weight gradients in place: the same as autograd's, also summed over
    two backward passes (--update-freq 2)."""
    _, ls, task = build_pair(torch.float64)
    ls.eval()  # no dropout: the passes see the same function
    net_input, _ = batch(task)
    out, _ = ls(**net_input)
    upstream = torch.randn_like(out)
    out.backward(upstream)
    autograd = {name: p.grad.clone() for name, p in ls.named_parameters()}
    for p in ls.parameters():  # as ls_adam's workspace leaves them
        p.grad = torch.zeros_like(p)
        setattr(p, IN_WORKSPACE, True)
    for _ in range(2):
        out, _ = ls(**net_input)
        out.backward(upstream)
    for name, p in ls.named_parameters():
        assert_close(p.grad, 2 * autograd[name], rtol=1e-10, atol=1e-12, what=name)
