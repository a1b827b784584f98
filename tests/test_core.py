"""The fairseq-free core: the layers, the workspace Adam and the fused loss against plain PyTorch, on the
CPU. Imports nothing of fairseq (tests/test_fairseq_plugin.py runs this file where fairseq cannot be
imported)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from ls_fairseq.loss import LabelSmoothedCrossEntropy
from ls_fairseq.layers import DecoderLayer, Embedding, EncoderLayer
from ls_fairseq.ops import AttentionMask
from ls_fairseq.optim.workspace_adam import WorkspaceAdam


def reference_encoder_layer(layer, x, padding_mask, normalize_before, eps=1e-5, causal=False):
    """The layer's math in plain PyTorch: (LN ->) self-attention -> residual (-> LN), then the FFN alike."""
    B, T, d = x.shape
    H = layer.self_attn.num_heads
    act = F.relu if layer.activation_fn == "relu" else F.gelu

    def ln(h, norm):
        return F.layer_norm(h, (d,), norm.weight, norm.bias, eps)

    def block(h, norm, branch):
        out = h + branch(ln(h, norm) if normalize_before else h)
        return out if normalize_before else ln(out, norm)

    def attention(h):
        q, k, v = F.linear(h, layer.self_attn.qkv_proj.weight, layer.self_attn.qkv_proj.bias).chunk(3, dim=-1)
        q, k, v = (t.reshape(B, T, H, d // H).transpose(1, 2) for t in (q, k, v))
        allowed = ~padding_mask[:, None, None, :]
        if causal:
            allowed = allowed & torch.ones(T, T, dtype=torch.bool).tril()
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return F.linear(ctx.transpose(1, 2).reshape(B, T, d), layer.self_attn.out_proj.weight,
                        layer.self_attn.out_proj.bias)

    def ffn(h):
        return F.linear(act(F.linear(h, layer.fc1.weight, layer.fc1.bias)), layer.fc2.weight, layer.fc2.bias)

    return block(block(x, layer.self_attn_layer_norm, attention), layer.final_layer_norm, ffn)


@pytest.mark.parametrize("normalize_before", [False, True])
@pytest.mark.parametrize("activation_fn,eps", [("relu", 1e-5), ("gelu", 1e-12)])
def test_the_encoder_layer_matches_plain_pytorch_with_padding(normalize_before, activation_fn, eps):
    layer = EncoderLayer(24, 3, 40, normalize_before=normalize_before, activation_fn=activation_fn, layer_norm_eps=eps)
    with torch.no_grad():  # LayerNorm parameters away from their init, so that they are tested too
        for norm in (layer.self_attn_layer_norm, layer.final_layer_norm):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    B, T = 3, 7
    padding_mask = torch.zeros(B, T, dtype=torch.bool)
    padding_mask[1, 5:] = True
    padding_mask[2, 2:] = True
    x = torch.randn(B, T, 24, requires_grad=True)
    out = layer(x, AttentionMask(padding_mask))
    want = reference_encoder_layer(layer, x, padding_mask, normalize_before, eps)
    keep = ~padding_mask
    torch.testing.assert_close(out[keep], want[keep], rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(out) * keep[..., None]
    grads = torch.autograd.grad(out, [x] + list(layer.parameters()), dy)
    want_grads = torch.autograd.grad(want, [x] + list(layer.parameters()), dy)
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("normalize_before", [False, True])
def test_the_encoder_layer_under_autocast_keeps_plain_pytorchs_dtypes_within_twice_its_error(normalize_before):
    """bf16 autocast on the CPU: the output in x's dtype (fp32) as the plain PyTorch layer's under the same
    autocast, and the error against an fp64 run at most twice that layer's, output and every gradient (a
    gradient's error by the norm of its difference: the largest entry's error ratio between two layers of equal
    precision passed 2 in 6 of 400 seeded cases, the norm's stayed under 1.71)."""
    layer = EncoderLayer(64, 4, 128, normalize_before=normalize_before, activation_fn="gelu")
    B, T = 4, 9
    padding_mask = torch.zeros(B, T, dtype=torch.bool)
    padding_mask[1, 6:] = True
    keep = ~padding_mask
    x = torch.randn(B, T, 64)
    dy = torch.randn(B, T, 64, dtype=torch.float64) * keep[..., None]
    results = {}
    for name in ("oracle", "plain", "ls"):
        model = layer.double() if name == "oracle" else layer.float()
        inp = x.to(next(model.parameters()).dtype).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=name != "oracle"):
            if name == "ls":
                out = model(inp, AttentionMask(padding_mask))
            else:
                out = reference_encoder_layer(model, inp, padding_mask, normalize_before)
        grads = torch.autograd.grad(out, [inp] + list(model.parameters()), dy.to(out.dtype))
        results[name] = (out.dtype, out[keep].double(), [g.double() for g in grads])
    assert results["ls"][0] == results["plain"][0] == torch.float32, (results["ls"][0], results["plain"][0])
    err = {n: (results[n][1] - results["oracle"][1]).abs().max().item() for n in ("plain", "ls")}
    assert err["ls"] <= 2 * err["plain"] + 1e-6, err
    for i, want in enumerate(results["oracle"][2]):
        err_plain = (results["plain"][2][i] - want).norm().item()
        err_ls = (results["ls"][2][i] - want).norm().item()
        assert err_ls <= 2 * err_plain + 1e-6 * want.norm().item(), (i, err_ls, err_plain)


def test_a_decoder_layer_with_cross_attention_runs_under_autocast():
    """bf16 autocast on the CPU: the cross-attention's GEMMs and attention in bf16 (the encoder's keys and values
    cast to it), the output in x's dtype, within bf16's reach of the fp32 run, gradients for every parameter."""
    layer = DecoderLayer(32, 4, 48, activation_fn="gelu")
    x = torch.randn(2, 5, 32)
    enc_k, enc_v = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    args = (AttentionMask(causal=True), enc_k, enc_v, AttentionMask(torch.zeros(2, 6, dtype=torch.bool)))
    want = layer(x, *args)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x, *args)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, want, rtol=0, atol=0.05 * want.abs().max().item())
    out.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())


def test_a_decoder_only_layer_is_causal_and_decodes_incrementally():
    layer = DecoderLayer(16, 2, 24, cross_attention=False, normalize_before=True, activation_fn="gelu")
    x = torch.randn(2, 5, 16)
    full = layer(x, AttentionMask(causal=True))
    no_padding = torch.zeros(2, 5, dtype=torch.bool)
    want = reference_encoder_layer(layer, x, no_padding, True, causal=True)
    torch.testing.assert_close(full, want, rtol=1e-5, atol=1e-5)
    cache = {}
    steps = [layer(x[:, t : t + 1], AttentionMask(causal=True), cache=cache) for t in range(5)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_bad_layer_options_are_named():
    with pytest.raises(ValueError, match="activation_fn 'swish' is not one the fused kernels have"):
        EncoderLayer(16, 2, 24, activation_fn="swish")
    with pytest.raises(ValueError, match="embed_dim 30 is not divisible by num_heads 4"):
        EncoderLayer(30, 4, 24)


@pytest.mark.parametrize("learned_positions", [False, True])
def test_the_embedding_is_scaled_tokens_plus_positions(learned_positions):
    pad = 1
    emb = Embedding(13, 8, pad, learned_positions=learned_positions, max_positions=10, scale=2.0)
    tokens = torch.randint(2, 13, (3, 6))
    tokens[1, 4:] = pad
    out = emb(tokens)
    positions = torch.cumsum(tokens.ne(pad), 1) * tokens.ne(pad) + pad
    if learned_positions:
        pos = emb.positions[positions]
    else:  # fairseq's sinusoids: [sin | cos] of position x 10000^(-i / (half - 1))
        freq = torch.exp(torch.arange(4.0) * -(torch.log(torch.tensor(10000.0)) / 3))
        angle = positions[..., None].float() * freq
        pos = torch.cat([angle.sin(), angle.cos()], -1)
    want = (2.0 * emb.weight[tokens] + pos) * tokens.ne(pad)[..., None]
    torch.testing.assert_close(out, want)


def fairseq_adam_reference(params, grads_per_step, lr, betas, eps, weight_decay):
    """fairseq's adam (decoupled weight decay) in plain PyTorch, fp64."""
    params = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for step, grads in enumerate(grads_per_step, 1):
        for p, g, m_, v_ in zip(params, grads, m, v):
            g = g.double()
            m_.mul_(betas[0]).add_(g, alpha=1 - betas[0])
            v_.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
            step_size = lr * (1 - betas[1] ** step) ** 0.5 / (1 - betas[0] ** step)
            if weight_decay:
                p.add_(p, alpha=-weight_decay * lr)
            p.addcdiv_(m_, v_.sqrt().add_(eps), value=-step_size)
    return params


def test_the_workspace_adam_is_a_torch_optimizer_with_fairseqs_adam():
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    start = [p.detach().clone() for p in model.parameters()]
    opt = WorkspaceAdam(model.parameters(), lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
    assert isinstance(opt, torch.optim.Optimizer)
    grads = []
    for _ in range(5):
        loss = model(torch.randn(4, 6)).square().sum()
        loss.backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        assert all(p.grad.abs().max() == 0 for p in model.parameters())
    want = fairseq_adam_reference(start, grads, 1e-2, (0.9, 0.98), 1e-8, 0.01)
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.detach().double(), w, rtol=1e-5, atol=1e-6)
    # the parameters live in the one workspace
    assert all(p.untyped_storage().data_ptr() == opt.workspace.param.untyped_storage().data_ptr()
               for p in model.parameters())


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_the_label_smoothed_loss_module_matches_fairseqs_formula(reduction):
    V, pad, eps = 11, 1, 0.1
    logits = torch.randn(3, 5, V, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, V, (3, 5))
    target[0, 3:] = pad
    loss, nll = LabelSmoothedCrossEntropy(pad, eps, reduction=reduction)(logits, target)
    lp = torch.log_softmax(logits, -1)
    want_nll = -lp.gather(-1, target[..., None]).squeeze(-1)
    eps_i = eps / (V - 1)
    want = (1 - eps - eps_i) * want_nll - eps_i * lp.sum(-1)
    live = target.ne(pad)
    want, want_nll = want * live, want_nll * live
    if reduction == "sum":
        want, want_nll = want.sum(), want_nll.sum()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(nll, want_nll)
    (g,) = torch.autograd.grad(loss.sum(), logits)
    (want_g,) = torch.autograd.grad(want.sum(), logits)
    torch.testing.assert_close(g, want_g)
    with pytest.raises(ValueError, match="reduction must be 'sum' or 'none', got 'mean'"):
        LabelSmoothedCrossEntropy(pad, reduction="mean")


def test_importing_the_core_imports_neither_fairseq_nor_dynamo_and_changes_no_attribute_of_torch():
    """A fresh interpreter imports torch alone, snapshots every attribute of torch's loaded modules (and of
    their classes), imports the core and compares: registering the ls_fairseq:: custom ops is all it may do.
    (torch._dynamo, which the compile refusals once imported, wraps torch.manual_seed and costs ~0.9 s.)"""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = textwrap.dedent("""
        import json, sys
        import torch
        import attributes
        before = attributes.snapshot({"torch"})
        manual_seed = torch.manual_seed
        import ls_fairseq.ops, ls_fairseq.layers
        after = attributes.snapshot({"torch"})
        print(json.dumps({"checked": len(before), "changed": sorted(map(repr, attributes.changes(before, after))),
                          "manual_seed": torch.manual_seed is manual_seed,
                          "imported": sorted(m for m in sys.modules
                                             if m.split(".")[0] in ("fairseq", "fairseq_cli") or
                                             m.startswith("torch._dynamo"))}))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.path.join(repo, "tests")]))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=repo,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["checked"] > 1000, out["checked"]
    assert out == {"checked": out["checked"], "changed": [], "manual_seed": True, "imported": []}, out
