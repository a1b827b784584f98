"""ls_fairseq.hf: Hugging Face BERT with every BertLayer replaced by the fused layer, against the same
model with its own layers (fp32 on the CPU; fp16/bf16 on the GPU): every mask, the model's state kept
by replace and restore, saving under Hugging Face's names."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import BertConfig, BertForSequenceClassification, BertModel  # noqa: E402
from transformers.models.bert.modeling_bert import BertLayer  # noqa: E402

from ls_fairseq.hf import (  # noqa: E402
    LSBertLayer, _LSLayer, _to_hf, replace_bert_layers, replace_layers, restore_bert_layers, restore_layers,
)


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
    """Every gradient of ``model`` (Hugging Face layers or ls layers, any family) by Hugging Face's parameter name."""
    grads = {}
    ls_layers = {name: m for name, m in model.named_modules() if isinstance(m, _LSLayer)}
    for name, p in model.named_parameters():
        if not any(name.startswith(prefix + ".") for prefix in ls_layers) and p.grad is not None:
            grads[name] = p.grad
    for prefix, layer in ls_layers.items():
        params = dict(layer.named_parameters())
        for ours, theirs, how in layer.PARAMETERS:
            for name, g in zip(theirs, _to_hf(params[ours].grad, how, len(theirs))):
                grads["{}.{}".format(prefix, name)] = g
    return grads


def assert_grads_within(got, want, rel=1e-5):
    assert set(got) == set(want) and len(want) > 20, set(got) ^ set(want)
    largest = max(g.abs().max().item() for g in want.values())
    for name in want:
        diff = (got[name] - want[name]).abs().max().item()
        assert diff <= rel * largest, "{}: max |diff| {:.3g} > {:g} x {:.3g}".format(name, diff, rel, largest)


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
    assert_grads_within(layer_grads(ls), layer_grads(hf))


def test_every_mask_form_a_layer_is_handed_gives_the_same_output():
    """Called directly (no model, so no padding handed): flash's [B, T] mask, sdpa's boolean and eager's additive
    [B, 1, T, T] padding masks (the general path) give one output."""
    ids, mask = batch()
    boolean = (mask[:, None, None, :].bool()).expand(-1, 1, ids.shape[1], -1)  # sdpa: True where it may attend
    additive = torch.zeros(boolean.shape).masked_fill(~boolean, torch.finfo(torch.float32).min)  # eager
    layer = LSBertLayer(tiny_config()).eval()
    x = torch.randn(*ids.shape, 32)
    keep = mask.bool()
    outs = [layer(x, form) for form in (mask, boolean, additive)]  # flash, sdpa, eager
    for out in outs[1:]:
        torch.testing.assert_close(out[keep], outs[0][keep], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer(x, None), layer(x, torch.ones_like(mask)))


def run_both(hf, ls, **inputs):
    """(HF's output, ls's output, HF's gradients, ls's gradients) of the last hidden state against one random dy."""
    out_hf = hf(**inputs).last_hidden_state
    out_ls = ls(**inputs).last_hidden_state
    dy = torch.randn_like(out_hf)
    (out_hf * dy).sum().backward()
    (out_ls * dy).sum().backward()
    return out_hf, out_ls, layer_grads(hf), layer_grads(ls)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_packed_batch_is_computed_exactly(attn):
    """position_ids restarting inside a row (no attention_mask): Hugging Face makes a block-diagonal mask; the
    ls layers take it as it is (the general path), so the second sequence is no padding."""
    hf = BertModel(tiny_config(attn), add_pooling_layer=False).eval()
    ls = replace_bert_layers(copy.deepcopy(hf))
    ids, _ = batch(B=2, T=10)
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    out_hf, out_ls, g_hf, g_ls = run_both(hf, ls, input_ids=ids, position_ids=position_ids)
    assert_within(out_ls, out_hf, 1e-5, "packed output")
    assert_grads_within(g_ls, g_hf)
    # the mask mattered: the same rows unpacked give another output
    unpacked = ls(ids, position_ids=torch.arange(10).expand(2, -1)).last_hidden_state
    assert (unpacked - out_ls).abs().max() > 1e-3


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_custom_4d_mask_is_computed_exactly(attn):
    hf = BertModel(tiny_config(attn), add_pooling_layer=False).eval()
    ls = replace_bert_layers(copy.deepcopy(hf))
    ids, _ = batch(B=3, T=9)
    allowed = torch.rand(3, 1, 9, 9) < 0.6
    allowed |= torch.eye(9, dtype=torch.bool)  # every query sees a key
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    mask = allowed if attn == "sdpa" else additive
    out_hf, out_ls, g_hf, g_ls = run_both(hf, ls, input_ids=ids, attention_mask=mask)
    assert_within(out_ls, out_hf, 1e-5, "custom mask output")
    assert_grads_within(g_ls, g_hf)


def test_flash_attentions_cu_seq_lens_run_each_sequence_alone():
    """Called directly, as flash attention calls a layer: one stream of 3 sequences and cu_seq_lens_q/k, against
    Hugging Face's layer with the block-diagonal mask; incomplete keywords are refused by name."""
    config = tiny_config("sdpa")
    hf_layer = BertLayer(config).eval()
    layer = LSBertLayer.from_bert_layer(hf_layer, config)
    lengths = [4, 1, 6]
    offsets = torch.tensor([0, 4, 5, 11], dtype=torch.int32)
    x = torch.randn(1, 11, 32, requires_grad=True)
    segment = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    block = (segment[:, None] == segment[None, :])[None, None]
    want = hf_layer(x, block)
    got = layer(x, None, cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=6, max_length_k=6)
    assert_within(got, want, 1e-5, "flash segments")
    dy = torch.randn_like(want)
    (dx_want,) = torch.autograd.grad(want, x, dy)
    (dx_got,) = torch.autograd.grad(got, x, dy)
    assert_within(dx_got, dx_want, 1e-5, "flash segments dx")
    with pytest.raises(ValueError, match="cu_seq_lens_q, cu_seq_lens_k given without max_length_q, max_length_k"):
        layer(x, None, cu_seq_lens_q=offsets, cu_seq_lens_k=offsets)
    # without the keywords, flash finds the sequences in restarting position_ids (a batch of one)
    flash = LSBertLayer.from_bert_layer(hf_layer, tiny_config("flash_attention_2"))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    assert_within(flash(x, None, position_ids=position_ids), want, 1e-5, "flash position_ids")


def test_a_padding_mask_given_to_the_model_takes_the_fast_path(monkeypatch):
    """The model's [B, T] mask reaches the layers as a key padding mask (ops.AttentionMask), never the general
    path's dense mask; a custom 4D mask takes the general path."""
    from ls_fairseq import ops

    seen = []
    real = ops.attention

    def spy(q, k, v, mask=None, *args, **kwargs):
        seen.append(type(mask).__name__)
        return real(q, k, v, mask, *args, **kwargs)

    monkeypatch.setattr("ls_fairseq.layers.ops.attention", spy)
    for attn in ("sdpa", "eager"):
        model = replace_bert_layers(BertModel(tiny_config(attn), add_pooling_layer=False)).eval()
        ids, mask = batch()
        model(ids, attention_mask=mask)
        assert seen == ["AttentionMask"] * 3, (attn, seen)
        seen.clear()
        model(ids, attention_mask=mask[:, None, None, :].bool().expand(-1, 1, ids.shape[1], -1))
        assert seen == ["DenseMask"] * 3, (attn, seen)
        seen.clear()


def test_replace_and_restore_keep_requires_grad_mode_dtype_and_checkpointing():
    model = BertForSequenceClassification(tiny_config()).double().train()
    model.gradient_checkpointing_enable()
    first = model.bert.encoder.layer[0]
    for name in ("query", "key", "value"):
        getattr(first.attention.self, name).requires_grad_(False)
    first.output.LayerNorm.bias.requires_grad_(False)
    model.bert.encoder.layer[1].eval()
    replace_bert_layers(model)
    layers = model.bert.encoder.layer
    assert all(type(layer) is LSBertLayer for layer in layers)
    ls0 = layers[0].layer
    assert not ls0.self_attn.qkv_proj.weight.requires_grad and not ls0.self_attn.qkv_proj.bias.requires_grad
    assert not ls0.final_layer_norm.bias.requires_grad and ls0.final_layer_norm.weight.requires_grad
    assert [layer.training for layer in layers] == [True, False, True]
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert all(layer.gradient_checkpointing for layer in layers)
    calls = []
    func = layers[0]._gradient_checkpointing_func
    for layer in layers:
        layer._gradient_checkpointing_func = lambda *a, **k: calls.append(1) or func(*a, **k)
    ids, mask = batch()
    model(ids, attention_mask=mask, labels=torch.tensor([0, 1, 2, 1])).loss.backward()
    assert len(calls) == 2  # the layers in training mode were checkpointed
    for layer in layers:
        layer._gradient_checkpointing_func = func
    restore_bert_layers(model)
    layers = model.bert.encoder.layer
    assert all(type(layer) is BertLayer for layer in layers)
    attn = layers[0].attention.self
    assert not any(getattr(attn, n).weight.requires_grad for n in ("query", "key", "value"))
    assert not layers[0].output.LayerNorm.bias.requires_grad and layers[0].output.LayerNorm.weight.requires_grad
    assert [layer.training for layer in layers] == [True, False, True]
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert all(layer.gradient_checkpointing for layer in layers)
    first = model.bert.encoder.layer[0]
    first.attention.self.query.requires_grad_(True)
    with pytest.raises(ValueError, match="partly frozen"):
        replace_bert_layers(model)
    assert all(type(layer) is BertLayer for layer in model.bert.encoder.layer)  # nothing changed


def test_a_model_with_ls_layers_saves_under_hf_names_and_reloads_as_a_plain_model(tmp_path):
    ls = replace_bert_layers(BertForSequenceClassification(tiny_config())).eval()
    ids, mask = batch()
    want = ls(ids, attention_mask=mask).logits
    ls.save_pretrained(tmp_path)
    plain = BertForSequenceClassification.from_pretrained(tmp_path).eval()
    assert all(type(layer) is BertLayer for layer in plain.bert.encoder.layer)
    torch.testing.assert_close(plain(ids, attention_mask=mask).logits, want, rtol=1e-5, atol=1e-5)
    assert set(ls.state_dict()) == set(plain.state_dict())
    fresh = replace_bert_layers(BertForSequenceClassification(tiny_config())).eval()
    fresh.load_state_dict(plain.state_dict())  # a Hugging Face state dict into ls layers
    torch.testing.assert_close(fresh(ids, attention_mask=mask).logits, want, rtol=1e-5, atol=1e-5)


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
    with pytest.raises(ValueError, match="hidden_act 'silu' is not an activation the fused kernels have"):
        replace_bert_layers(BertModel(tiny_config(hidden_act="silu")))
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


@pytest.mark.gpu
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_gpu_a_tokenizers_padding_mask_takes_no_host_synchronisation(attn):
    """The common case (a [B, T] mask given to the model) runs the ls layers' forward and backward under
    torch.cuda.set_sync_debug_mode("error"): the key padding reaches the layers without reading the 4D mask."""
    config = tiny_config(attn, hidden_size=256, num_attention_heads=4, intermediate_size=1024,
                         max_position_embeddings=128)
    model = replace_bert_layers(BertModel(config, add_pooling_layer=False)).cuda().half().train()
    ids, mask = batch(B=8, T=100, device="cuda")
    embeddings = model.embeddings(ids).detach().requires_grad_()  # the layers alone: the embeddings are HF's
    layers = model.encoder
    from transformers.masking_utils import create_bidirectional_mask

    from ls_fairseq.hf import PaddingHint

    full = create_bidirectional_mask(config=config, inputs_embeds=embeddings, attention_mask=mask)
    hint = PaddingHint(mask == 0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = layers(embeddings, attention_mask=full, ls_padding=hint).last_hidden_state
        out.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out).all()
