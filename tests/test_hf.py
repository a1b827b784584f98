"""ls_fairseq.hf: Hugging Face BERT with every BertLayer replaced by the fused layer, against the same
model with its own layers (fp32 on the CPU; fp16/bf16 on the GPU)."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import BertConfig, BertForSequenceClassification, BertModel  # noqa: E402
from transformers.models.bert.modeling_bert import BertLayer  # noqa: E402

from ls_fairseq.hf import LSBertLayer, _pairs, key_padding_mask, replace_bert_layers, restore_bert_layers  # noqa: E402


def tiny_config(attn="sdpa", **overrides):
    options = dict(vocab_size=61, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48,
                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, hidden_act="gelu", layer_norm_eps=1e-12,
                   max_position_embeddings=64, num_labels=3)
    options.update(overrides)
    config = BertConfig(**options)
    config._attn_implementation = attn
    return config


def batch(B=4, T=11, vocab=61, device="cpu"):
    ids = torch.randint(1, vocab, (B, T), device=device)
    mask = torch.ones(B, T, dtype=torch.long, device=device)
    for b, n in enumerate([T, T - 3, 5, 1][:B]):  # padding of several lengths, one sentence of one token
        mask[b, n:] = 0
    return ids, mask


def layer_grads(model):
    """Every gradient of ``model`` (HF layers or ls layers) in HF's layout, by HF's parameter name."""
    grads = {}
    for name, p in model.named_parameters():
        if ".layer." not in name and p.grad is not None:
            grads[name] = p.grad
    for i, layer in enumerate(model.encoder.layer):
        if isinstance(layer, LSBertLayer):
            hf = BertLayer(model.config)
            for part in ("weight", "bias"):
                q, k, v = getattr(layer.layer.self_attn.qkv_proj, part).grad.chunk(3)
                for n, g in zip(("query", "key", "value"), (q, k, v)):
                    grads["encoder.layer.{}.attention.self.{}.{}".format(i, n, part)] = g
            names = {id(p): n for n, p in hf.named_parameters()}
            for ours, theirs in _pairs(layer, hf):
                grads["encoder.layer.{}.{}".format(i, names[id(theirs)])] = ours.grad
        else:
            for n, p in layer.named_parameters():
                grads["encoder.layer.{}.{}".format(i, n)] = p.grad
    return grads


def assert_within(got, want, rel, what):
    diff = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    assert diff <= rel * scale, "{}: max |diff| {:.3g} > {:g} x max |reference| {:.3g}".format(what, diff, rel, scale)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_every_layer_replaced_matches_hf_outputs_hidden_states_and_gradients(attn):
    hf = BertModel(tiny_config(attn), add_pooling_layer=False).eval()
    ls = replace_bert_layers(copy.deepcopy(hf))
    assert all(type(layer) is LSBertLayer for layer in ls.encoder.layer)
    ids, mask = batch()
    keep = mask.bool()
    out_hf = hf(ids, attention_mask=mask, output_hidden_states=True)
    out_ls = ls(ids, attention_mask=mask, output_hidden_states=True)
    assert len(out_ls.hidden_states) == len(out_hf.hidden_states) == 4  # the embeddings and every layer
    for i, (a, b) in enumerate(zip(out_ls.hidden_states, out_hf.hidden_states)):
        assert_within(a[keep], b[keep], 1e-5, "hidden state {}".format(i))
    assert_within(out_ls.last_hidden_state[keep], out_hf.last_hidden_state[keep], 1e-5, "output")
    dy = torch.randn_like(out_hf.last_hidden_state) * keep[..., None]
    (out_hf.last_hidden_state * dy).sum().backward()
    (out_ls.last_hidden_state * dy).sum().backward()
    want, got = layer_grads(hf), layer_grads(ls)
    assert set(got) == set(want) and len(want) > 40
    largest = max(g.abs().max().item() for g in want.values())
    for name in want:
        diff = (got[name] - want[name]).abs().max().item()
        assert diff <= 1e-5 * largest, "{}: max |diff| {:.3g} > 1e-5 x {:.3g}".format(name, diff, largest)


def test_every_mask_form_gives_the_same_key_padding():
    ids, mask = batch()
    pad = mask == 0
    boolean = (mask[:, None, None, :].bool()).expand(-1, 1, ids.shape[1], -1)  # sdpa: True where it may attend
    additive = torch.zeros(boolean.shape).masked_fill(~boolean, torch.finfo(torch.float32).min)  # eager
    for form in (mask, boolean, additive, additive.half().masked_fill(~boolean, torch.finfo(torch.float16).min)):
        assert torch.equal(key_padding_mask(form), pad)
    assert key_padding_mask(None) is None
    layer = LSBertLayer(tiny_config()).eval()
    x = torch.randn(*ids.shape, 32)
    keep = mask.bool()
    outs = [layer(x, form) for form in (mask, boolean, additive)]  # flash, sdpa, eager
    for out in outs[1:]:
        torch.testing.assert_close(out[keep], outs[0][keep])
    torch.testing.assert_close(layer(x, None), layer(x, torch.ones_like(mask)))


def test_fifty_adamw_steps_give_hf_s_losses_and_restoring_gives_hf_layers_with_the_trained_weights(tmp_path):
    hf = BertForSequenceClassification(tiny_config())
    ls = replace_bert_layers(copy.deepcopy(hf))
    hf.train()
    ls.train()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (hf, ls)]
    ids, mask = batch(B=4, T=9)
    labels = torch.randint(0, 3, (4,))
    losses = {"hf": [], "ls": []}
    for _ in range(50):
        for name, model, opt in (("hf", hf, opts[0]), ("ls", ls, opts[1])):
            loss = model(ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
    diff = max(abs(a - b) for a, b in zip(losses["hf"], losses["ls"]))
    assert diff <= 1e-4, (diff, losses["hf"][-3:], losses["ls"][-3:])
    assert losses["hf"][-1] < losses["hf"][0] * 0.5  # it trained
    ls.eval()
    trained = ls(ids, attention_mask=mask).logits
    restored = restore_bert_layers(ls)
    assert all(type(layer) is BertLayer for layer in restored.bert.encoder.layer)
    torch.testing.assert_close(restored(ids, attention_mask=mask).logits, trained, rtol=1e-5, atol=1e-5)
    restored.save_pretrained(tmp_path)
    again = BertForSequenceClassification.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(again(ids, attention_mask=mask).logits, trained, rtol=1e-5, atol=1e-5)


def test_what_the_fused_layer_does_not_implement_is_named():
    model = BertModel(tiny_config("eager"), add_pooling_layer=False)
    replace_bert_layers(model)
    ids, mask = batch()
    with pytest.raises(ValueError, match="output_attentions is not supported"):
        model(ids, attention_mask=mask, output_attentions=True)
    with pytest.raises(ValueError, match="hidden_act 'gelu_new' is not an activation the fused kernels have"):
        replace_bert_layers(BertModel(tiny_config(hidden_act="gelu_new")))
    with pytest.raises(ValueError, match="is_decoder / add_cross_attention"):
        replace_bert_layers(BertModel(tiny_config(is_decoder=True, add_cross_attention=True)))
    with pytest.raises(ValueError, match="cross-attention"):
        model.encoder.layer[0](torch.randn(2, 3, 32), None, torch.randn(2, 4, 32))


def gpu_berts(dtype):
    """(an fp64 BERT, the same in dtype, the same with ls layers in dtype, ids, attention mask) of a 4-layer
    BERT 256 wide on the GPU, and a batch of 8 sentences of up to 100 tokens."""
    config = tiny_config("sdpa", hidden_size=256, num_attention_heads=4, intermediate_size=1024, num_hidden_layers=4,
                         max_position_embeddings=128)
    base = BertModel(config, add_pooling_layer=False).cuda().eval()
    ids, mask = batch(B=8, T=100, device="cuda")
    return (copy.deepcopy(base).double(), copy.deepcopy(base).to(dtype),
            replace_bert_layers(copy.deepcopy(base)).to(dtype), ids, mask)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_ls_layers_against_hfs_own_by_the_2x_rule(dtype):
    """In fp16/bf16 the ls BERT's error against an fp64 run of the same model is at most twice HF's own
    (outputs and gradients), with the kernels."""
    oracle, hf, ls, ids, mask = gpu_berts(dtype)
    keep = mask.bool()
    dy = torch.randn(8, 100, 256, device="cuda", dtype=torch.float64) * keep[..., None]
    results = {}
    for name, model in (("oracle", oracle), ("hf", hf), ("ls", ls)):
        out = model(ids, attention_mask=mask).last_hidden_state
        (out * dy.to(out.dtype)).sum().backward()
        results[name] = (out[keep].double(), {k: g.double() for k, g in layer_grads(model).items()})
    for name in ("hf", "ls"):
        results[name + "_err"] = (results[name][0] - results["oracle"][0]).abs().max().item()
    assert results["ls_err"] <= 2 * results["hf_err"] + 1e-6, (results["ls_err"], results["hf_err"])
    for key, want in results["oracle"][1].items():
        err_hf = (results["hf"][1][key] - want).abs().max().item()
        err_ls = (results["ls"][1][key] - want).abs().max().item()
        assert err_ls <= 2 * err_hf + 1e-6 * want.abs().max().item(), (key, err_ls, err_hf)
