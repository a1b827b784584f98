"""Time each fused kernel against the PyTorch composition it replaces (GPU).

Sizes of transformer-big at 8,192 tokens (hidden 1024, FFN 4096, 16 heads,
vocab 32k; attention rows of 16 heads x 256 sentences of length 32); the
composition is what stock fairseq's layer runs for the same job in the same
dtype. Each timing is the GPU kernel time per call, summed from the profiler
over many calls after warm-up (host launch gaps excluded: they are the
subject of the training benchmark), rotating among input sets that together
exceed the 60 MB L2 cache; a backward's time is its own kernels', the forwards
it differentiates run before the profiled region. Achieved
bandwidth counts the fewest bytes the op must move (each input read once, each
output written once; no dropout mask, which the kernels draw again in backward or
store as bits) against the card's measured device-to-device copy bandwidth.

  python scripts/bench_ops.py [--dtype fp16|bf16] [--dropout P] [--json FILE]
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss
from fairseq.optim.adam import Adam as FairseqAdamImpl

from ls_fairseq import ops
from ls_fairseq.ops import dispatch
from ls_fairseq.ops.embedding import sinusoidal
from ls_fairseq.ops.segment_attention import blocks_attention

TOKENS, HIDDEN, FFN, HEADS, VOCAB, SENT_LEN = 8192, 1024, 4096, 16, 32000, 32
L2_BYTES = 60 << 20


def kernel_ms(fn, sets, iters=20, by_name=None):
    """GPU kernel time per call of fn(set), from the profiler (the sum of every kernel's device
    time, so host-side launch gaps do not count), and the number of kernels per call; with a dict
    ``by_name``, each kernel's time per call (us) added to it under its name."""
    for s in sets[:2]:
        fn(s)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            fn(sets[i % len(sets)])
        torch.cuda.synchronize()
    kernels = [(e.name, e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
               for e in prof.events() if e.device_type == DeviceType.CUDA]
    for name, us in kernels if by_name is not None else ():
        by_name[name] = by_name.get(name, 0.0) + us / iters
    return sum(us for _, us in kernels) / iters / 1000.0, len(kernels) / iters


def copy_bandwidth():
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms, _ = kernel_ms(lambda _: b.copy_(a), [None], iters=10)
    return 2 * a.numel() / ms / 1e6


def same_size_copy_ms(nbytes):
    """Kernel time of a device-to-device copy that reads nbytes / 2 and writes nbytes / 2 (the
    op's byte count), rotating among buffers larger than L2: at these sizes a copy reaches only
    part of the 1 GiB copy's bandwidth (ramp-up and tail of one kernel), the ceiling an op of
    the same size can approach."""
    half = max(int(nbytes) // 2, 1)
    pairs = [(torch.empty(half, dtype=torch.uint8, device="cuda"), torch.empty(half, dtype=torch.uint8, device="cuda"))
             for _ in range(max(2, 2 * L2_BYTES // half + 1))]
    ms, _ = kernel_ms(lambda pair: pair[1].copy_(pair[0]), pairs)
    return ms


def make_sets(make, bytes_per_set):
    return [make() for _ in range(max(2, 2 * L2_BYTES // max(bytes_per_set, 1) + 1))]


def rand(*shape, dtype):
    return torch.randn(*shape, device="cuda").to(dtype)


def benches(dtype, p):
    s = torch.finfo(dtype).bits // 8
    n = TOKENS * HIDDEN
    rows = []

    # layer_norm
    def ln_inputs():
        return [rand(TOKENS, HIDDEN, dtype=dtype).requires_grad_(), rand(HIDDEN, dtype=dtype).requires_grad_(),
                rand(HIDDEN, dtype=dtype).requires_grad_(), rand(TOKENS, HIDDEN, dtype=dtype)]

    rows.append(("layer_norm", ln_inputs, 2 * n * s, 3 * n * s,
                 lambda x, w, b, dy: F.layer_norm(x, (HIDDEN,), w, b, 1e-5),
                 lambda x, w, b, dy: ops.layer_norm(x, w, b)))

    # bias_dropout_residual
    def bdr_inputs():
        return [rand(TOKENS, HIDDEN, dtype=dtype).requires_grad_(), rand(HIDDEN, dtype=dtype).requires_grad_(),
                rand(TOKENS, HIDDEN, dtype=dtype).requires_grad_(), rand(TOKENS, HIDDEN, dtype=dtype)]

    rows.append(("bias_dropout_residual", bdr_inputs, n * 3 * s, n * 2 * s,
                 lambda x, b, r, dy: r + F.dropout(x + b, p),
                 lambda x, b, r, dy: ops.bias_dropout_residual(x, b, r, p)))

    # bias_dropout_residual_layer_norm: post-LN's block end
    def bdrln_inputs():
        return [rand(TOKENS, HIDDEN, dtype=dtype).requires_grad_(), rand(HIDDEN, dtype=dtype).requires_grad_(),
                rand(TOKENS, HIDDEN, dtype=dtype).requires_grad_(), rand(HIDDEN, dtype=dtype).requires_grad_(),
                rand(HIDDEN, dtype=dtype).requires_grad_(), rand(TOKENS, HIDDEN, dtype=dtype)]

    rows.append(("bias_dropout_residual_layer_norm", bdrln_inputs, n * 4 * s, n * 4 * s,
                 lambda x, b, r, w, lb, dy: F.layer_norm(r + F.dropout(x + b, p), (HIDDEN,), w, lb, 1e-5),
                 lambda x, b, r, w, lb, dy: ops.bias_dropout_residual_layer_norm(x, b, r, w, lb, p)))

    # bias_act_dropout (relu, FFN width)
    m = TOKENS * FFN

    def bad_inputs():
        return [rand(TOKENS, FFN, dtype=dtype).requires_grad_(), rand(FFN, dtype=dtype).requires_grad_(),
                rand(TOKENS, FFN, dtype=dtype)]

    rows.append(("bias_act_dropout", bad_inputs, m * 2 * s, m * 3 * s,
                 lambda x, b, dy: F.dropout(F.relu(x + b), p),
                 lambda x, b, dy: ops.bias_act_dropout(x, b, "relu", p)))

    # softmax: [B, heads, T, T] with key padding, attention dropout
    B = TOKENS // SENT_LEN
    a = B * HEADS * SENT_LEN * SENT_LEN

    def sm_inputs():
        kpm = torch.zeros(B, SENT_LEN, dtype=torch.bool, device="cuda")
        kpm[::3, -4:] = True
        return [rand(B, HEADS, SENT_LEN, SENT_LEN, dtype=dtype).requires_grad_(), kpm,
                rand(B, HEADS, SENT_LEN, SENT_LEN, dtype=dtype)]

    # forward: the scores read, the output and each row's fp32 log-sum-exp written; backward: dout and
    # the scores read (the probabilities computed again from the log-sum-exp), the gradient written
    lse_bytes = a // SENT_LEN * 4
    rows.append(("softmax", sm_inputs, a * 2 * s + lse_bytes, a * 3 * s + lse_bytes,
                 lambda x, kpm, dy: F.dropout(torch.softmax(x.masked_fill(kpm[:, None, None, :], float("-inf")).float(), -1).type_as(x), p),
                 lambda x, kpm, dy: ops.softmax(x, kpm, False, p)))

    # attention: self-attention of [B, heads, T, d_head] views of token-major storage (split_heads' layout) with
    # key padding and attention dropout; stock: torch's SDPA with the padding as an additive mask (the
    # memory-efficient kernel: FlashAttention takes no mask), as fairseq's and our longer rows run it
    def attn_inputs():
        kpm = torch.zeros(B, SENT_LEN, dtype=torch.bool, device="cuda")
        kpm[::3, -4:] = True
        additive = torch.zeros(B, 1, 1, SENT_LEN, dtype=dtype, device="cuda").masked_fill(kpm[:, None, None, :], float("-inf"))
        return [rand(B, SENT_LEN, HEADS, HIDDEN // HEADS, dtype=dtype).requires_grad_() for _ in range(3)] + [
            kpm, additive, rand(B, HEADS, SENT_LEN, HIDDEN // HEADS, dtype=dtype)]

    def attn_stock(q, k, v, kpm, additive, dy):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  attn_mask=additive, dropout_p=p, scale=1.0)

    rows.append(("attention", attn_inputs, 4 * n * s, 7 * n * s, attn_stock,
                 lambda q, k, v, kpm, additive, dy: ops.attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                  v.transpose(1, 2), ops.AttentionMask(kpm), p)))

    # segment_attention: the same self-attention as packed streams (--ls-packed: sentences of SENT_LEN - 4 and
    # SENT_LEN tokens one after another, no padding) without dropout, which the GPU runs through varlen
    # FlashAttention; stock: the op's blocks path on the same streams (the sentences gathered into padded
    # blocks for the padded attention and scattered back), what the packed step runs with attention dropout
    lengths = torch.tensor([SENT_LEN - 4 if b % 3 == 0 else SENT_LEN for b in range(B)])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32).cuda()
    packed_rows = int(lengths.sum())
    seg_mask = ops.SegmentMask(offsets, offsets, SENT_LEN, SENT_LEN)

    def seg_inputs():
        return [rand(1, packed_rows, HEADS, HIDDEN // HEADS, dtype=dtype).requires_grad_() for _ in range(3)] + [
            rand(1, HEADS, packed_rows, HIDDEN // HEADS, dtype=dtype)]

    def heads(*streams):
        return (t.transpose(1, 2) for t in streams)

    rows.append(("segment_attention", seg_inputs, 4 * packed_rows * HIDDEN * s, 7 * packed_rows * HIDDEN * s,
                 lambda q, k, v, dy: blocks_attention(*heads(q, k, v), seg_mask, 0.0, True, False, False),
                 lambda q, k, v, dy: ops.attention(*heads(q, k, v), seg_mask)))

    # qkv: bias add + head split of [B, T, 3d]
    def qkv_inputs():
        return [rand(B, SENT_LEN, 3 * HIDDEN, dtype=dtype).requires_grad_(), rand(3 * HIDDEN, dtype=dtype).requires_grad_(),
                rand(3, B, HEADS, SENT_LEN, HIDDEN // HEADS, dtype=dtype)]

    def qkv_stock(x, b, dy):
        q, k, v = (x + b).chunk(3, dim=-1)
        return tuple(t.reshape(B, SENT_LEN, HEADS, -1).transpose(1, 2).contiguous()
                     for t in (q * (HIDDEN // HEADS) ** -0.5, k, v))

    # stock: fairseq's three contiguous head tensors; ls: three views of the op's [3, B, heads, T, d_head]
    # buffer, whose gradients its backward takes one by one (no copy either way)
    rows.append(("qkv", qkv_inputs, 2 * 3 * n * s, 2 * 3 * n * s, qkv_stock,
                 lambda x, b, dy: ops.split_heads(x, b, HEADS, 3, (HIDDEN // HEADS) ** -0.5)))

    # embedding: scaled lookup + sinusoidal positions + dropout; ids uniform, or Zipf-distributed as
    # in real text (id r with probability ~ 1/r: the most frequent ids fill runs of hundreds of tokens)
    zipf = 1.0 / torch.arange(1, VOCAB - 3, device="cuda", dtype=torch.float64)

    def emb_inputs(zipfian=False):
        if zipfian:
            tokens = (torch.multinomial(zipf, B * SENT_LEN, replacement=True) + 4).view(B, SENT_LEN)
        else:
            tokens = torch.randint(4, VOCAB, (B, SENT_LEN), device="cuda")
        return [tokens, ops.make_positions(tokens, 1), rand(VOCAB, HIDDEN, dtype=dtype).requires_grad_(),
                rand(B, SENT_LEN, HIDDEN, dtype=dtype)]

    table = sinusoidal(torch.arange(1100, device="cuda"), HIDDEN, 1).to(dtype)

    # backward writes the whole dense table gradient (zeros where no token), as stock's does
    def emb_stock(t, pos, w, dy):
        return F.dropout(HIDDEN**0.5 * F.embedding(t, w, padding_idx=1) + table.index_select(0, pos.view(-1)).view(B, SENT_LEN, -1), p)

    def emb_ls(t, pos, w, dy):
        return ops.embedding(t, pos, w, None, HIDDEN**0.5, 1, p)

    for name, zipfian in (("embedding", False), ("embedding (Zipf ids)", True)):
        rows.append((name, lambda zipfian=zipfian: emb_inputs(zipfian), n * 2 * s,
                     n * 2 * s + VOCAB * HIDDEN * s, emb_stock, emb_ls))

    # cross_entropy: logits [tokens, vocab]
    v = TOKENS * VOCAB

    def ce_inputs():
        target = torch.randint(0, VOCAB, (TOKENS,), device="cuda")
        return [rand(TOKENS, VOCAB, dtype=dtype).requires_grad_(), target, None]

    def ce_stock(x, target, _):
        loss, _ = label_smoothed_nll_loss(F.log_softmax(x.float(), -1), target, 0.1, ignore_index=1)
        return loss

    def ce_ls(x, target, _):
        loss, _ = ops.label_smoothed_cross_entropy(x, target, 0.1, 1)
        return loss.sum()

    rows.append(("cross_entropy", ce_inputs, v * s, 2 * v * s, ce_stock, ce_ls))
    return rows


def bench_forward_backward(name, make, fwd_bytes, bwd_bytes, stock, ours, copy_bw):
    sets = make_sets(make, fwd_bytes + bwd_bytes)
    results, fwd_us, bwd_us = {}, {}, {}
    for label, fn in (("stock", stock), ("ls", ours)):
        def fwd(args, fn=fn):
            with torch.no_grad():
                fn(*args)

        def forward_for_backward(args, fn=fn):
            """(outputs, inputs, gradients) of one forward with autograd, for bwd to differentiate."""
            out, dy = fn(*args), args[-1]
            if isinstance(out, tuple):  # parts of dy, stacked on its first dimension
                outs, grads = out, dy.unbind(0)
            else:
                outs, grads = (out,), (dy if dy is not None and dy.shape == out.shape else torch.ones_like(out),)
            return outs, [a for a in args if torch.is_tensor(a) and a.requires_grad], grads

        def bwd(graph):
            torch.autograd.grad(*graph, retain_graph=True)

        f_ms, f_k = kernel_ms(fwd, sets, by_name=fwd_us if label == "ls" else None)
        # the backward's own kernels: the forwards run before the profiled region (timing forward and
        # backward together and subtracting the forward's time charged the backward with the
        # difference between two runs of the forward kernels, up to ~2 us at these sizes)
        graphs = [forward_for_backward(s) for s in sets]
        b_ms, b_k = kernel_ms(bwd, graphs, by_name=bwd_us if label == "ls" else None)
        del graphs
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        bwd(forward_for_backward(sets[0]))  # one forward and backward: the memory the op takes beyond its inputs
        peak = torch.cuda.max_memory_allocated() - base
        results[label] = dict(fwd_ms=f_ms, bwd_ms=b_ms, peak_extra_mb=peak / 2**20, fwd_kernels=f_k, bwd_kernels=b_k)
    ls, st = results["ls"], results["stock"]
    copy_fwd, copy_bwd = same_size_copy_ms(fwd_bytes), same_size_copy_ms(bwd_bytes)
    return dict(
        ls_kernels_us=dict(forward=fwd_us, backward=bwd_us),
        fwd_same_size_copy_pct=100 * copy_fwd / ls["fwd_ms"], bwd_same_size_copy_pct=100 * copy_bwd / ls["bwd_ms"],
        op=name, stock_fwd_ms=st["fwd_ms"], ls_fwd_ms=ls["fwd_ms"], stock_bwd_ms=st["bwd_ms"], ls_bwd_ms=ls["bwd_ms"],
        fwd_speedup=st["fwd_ms"] / ls["fwd_ms"], bwd_speedup=st["bwd_ms"] / ls["bwd_ms"],
        fwd_bw_pct=100 * fwd_bytes / ls["fwd_ms"] / 1e6 / copy_bw, bwd_bw_pct=100 * bwd_bytes / ls["bwd_ms"] / 1e6 / copy_bw,
        stock_peak_mb=st["peak_extra_mb"], ls_peak_mb=ls["peak_extra_mb"],
        kernels="{:.0f}+{:.0f} / {:.0f}+{:.0f}".format(st["fwd_kernels"], st["bwd_kernels"], ls["fwd_kernels"], ls["bwd_kernels"]),
    )


def bench_adam(dtype, copy_bw):
    """Whole-model update: ls_adam's one launch over an fp16/bf16 workspace vs fairseq's adam
    on the flat fp32 master parameter that --fp16 (FP16Optimizer) hands it."""
    n = 210_000_000  # transformer-big with shared embeddings
    s = torch.finfo(dtype).bits // 8
    p, g = rand(n, dtype=dtype), rand(n, dtype=dtype)
    m, v = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    ls_ms, ls_k = kernel_ms(lambda _: ops.adam_step(p, g, m, v, lr=1e-4, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.0, step=5), [None], 10)
    del p, g
    flat = torch.nn.Parameter(torch.zeros(n, device="cuda"))
    flat.grad = torch.randn(n, device="cuda")
    stock = FairseqAdamImpl([flat], lr=1e-4, betas=(0.9, 0.98))
    stock_ms, stock_k = kernel_ms(lambda _: stock.step(), [None], 10)
    bytes_ = n * (3 * s + 16)
    return dict(op="adam", stock_fwd_ms=stock_ms, ls_fwd_ms=ls_ms, fwd_speedup=stock_ms / ls_ms,
                fwd_bw_pct=100 * bytes_ / ls_ms / 1e6 / copy_bw, kernels="{:.0f} / {:.0f}".format(stock_k, ls_k))


def bench_grad_norm(dtype, copy_bw):
    """The gradient norm over the whole workspace (fp16/bf16, as ls_adam holds it) vs the norm
    fairseq's FP16Optimizer takes of its flat fp32 gradient."""
    n = 210_000_000
    g = rand(n, dtype=dtype)
    ls_ms, ls_k = kernel_ms(lambda _: ops.grad_norm(g), [None], 10)
    del g
    flat = torch.randn(n, device="cuda")
    stock_ms, stock_k = kernel_ms(lambda _: torch.norm(flat, p=2, dtype=torch.float32), [None], 10)
    return dict(op="grad_norm", stock_fwd_ms=stock_ms, ls_fwd_ms=ls_ms, fwd_speedup=stock_ms / ls_ms,
                fwd_bw_pct=100 * n * (torch.finfo(dtype).bits // 8) / ls_ms / 1e6 / copy_bw,
                kernels="{:.0f} / {:.0f}".format(stock_k, ls_k))


def bench_linear(dtype):
    """The FFN's first GEMM, forward and backward, with the weight's gradient already allocated
    (ls_adam's workspace): autograd's mm into a new tensor plus an add into .grad, against
    ops.linear's in-place accumulation (addmm_, beta = 1). Time of the three GEMMs and the add."""
    from ls_fairseq.ops.workspace import accumulate_in_place

    x, dy = rand(TOKENS, HIDDEN, dtype=dtype).requires_grad_(), rand(TOKENS, FFN, dtype=dtype)
    results = {}
    for label, fn in (("stock", torch.nn.functional.linear), ("ls", ops.linear)):
        w = rand(FFN, HIDDEN, dtype=dtype).requires_grad_()
        w.grad = torch.zeros_like(w)
        if label == "ls":
            accumulate_in_place([w])
        results[label] = kernel_ms(lambda _: fn(x, w).backward(dy), [None])
    (st_ms, st_k), (ls_ms, ls_k) = results["stock"], results["ls"]
    return dict(op="linear (fwd+bwd)", stock_fwd_ms=st_ms, ls_fwd_ms=ls_ms, fwd_speedup=st_ms / ls_ms,
                fwd_bw_pct=None, kernels="{:.0f} / {:.0f}".format(st_k, ls_k))  # GEMMs: compute-bound


def bench_linear_bias_act(dtype):
    """The FFN's first GEMM with its bias and ReLU, forward and backward: fairseq's (F.linear with the bias,
    then relu) against ops.linear_bias_act (bias + ReLU in the GEMM's epilogue, the bias's gradient with
    the ReLU's), both weights' gradients allocated as ls_adam has them. Time of all the kernels."""
    from ls_fairseq.ops.workspace import accumulate_in_place

    x, dy = rand(TOKENS, HIDDEN, dtype=dtype).requires_grad_(), rand(TOKENS, FFN, dtype=dtype)
    results = {}
    for label, fn in (("stock", lambda x, w, b: torch.relu(torch.nn.functional.linear(x, w, b))),
                      ("ls", ops.linear_bias_act)):
        w, b = rand(FFN, HIDDEN, dtype=dtype).requires_grad_(), rand(FFN, dtype=dtype).requires_grad_()
        w.grad, b.grad = torch.zeros_like(w), torch.zeros_like(b)
        if label == "ls":
            accumulate_in_place([w, b])
        results[label] = kernel_ms(lambda _: fn(x, w, b).backward(dy), [None])
    (st_ms, st_k), (ls_ms, ls_k) = results["stock"], results["ls"]
    return dict(op="linear_bias_act (fwd+bwd)", stock_fwd_ms=st_ms, ls_fwd_ms=ls_ms, fwd_speedup=st_ms / ls_ms,
                fwd_bw_pct=None, kernels="{:.0f} / {:.0f}".format(st_k, ls_k))  # GEMMs: compute-bound


def bench_fp8_cast(dtype, copy_bw):
    """An activation [tokens, hidden] cast to e4m3 for an FP8 GEMM: torch ops with current scaling
    (abs, amax, the scale, multiply, clamp, cast) against fp8_cast's one pass with the delayed scale."""
    from ls_fairseq.ops.fp8_cast import fp8_cast

    x = rand(TOKENS, HIDDEN, dtype=dtype)
    state = torch.zeros(18, device="cuda")
    state[0] = 4.0

    def torch_ops(_):
        s = 448.0 / x.abs().amax().float()
        return (x.float() * s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), 1.0 / s

    stock_ms, stock_k = kernel_ms(torch_ops, [None])
    ls_ms, ls_k = kernel_ms(lambda _: fp8_cast(x, state), [None])
    bytes_ = x.numel() * (x.element_size() + 1)
    return dict(op="fp8_cast (activation, e4m3)", stock_fwd_ms=stock_ms, ls_fwd_ms=ls_ms, fwd_speedup=stock_ms / ls_ms,
                fwd_bw_pct=100 * bytes_ / ls_ms / 1e6 / copy_bw, kernels="{:.0f} / {:.0f}".format(stock_k, ls_k))


def bench_linear_fp8(dtype, name, n_in, n_out):
    """One linear layer's forward and backward through ops.linear: in ``dtype`` against --ls-fp8's
    forward and input gradient in FP8 (the casts of x, W and dy included; the weight gradient stays in
    ``dtype``), weight gradients allocated as ls_adam has them."""
    from ls_fairseq.ops.fp8_cast import Fp8Recipe
    from ls_fairseq.ops.workspace import accumulate_in_place

    x, dy = rand(TOKENS, n_in, dtype=dtype).requires_grad_(), rand(TOKENS, n_out, dtype=dtype)
    recipe = Fp8Recipe(forward=["l"], dgrad=["l"])
    gemm = recipe.gemm("l")
    recipe.begin(x.device)
    results = {}
    for label, fp8 in (("stock", None), ("ls", gemm)):
        w = (rand(n_out, n_in, dtype=dtype) * 0.05).requires_grad_()
        w.grad = torch.zeros_like(w)
        accumulate_in_place([w])
        ops.linear(x, w, fp8=fp8).backward(dy)  # the calibrating pass
        recipe.begin(x.device)
        results[label] = kernel_ms(lambda _: ops.linear(x, w, fp8=fp8).backward(dy), [None])
    (st_ms, st_k), (ls_ms, ls_k) = results["stock"], results["ls"]
    return dict(op="linear {} {} vs FP8 fwd+dgrad (fwd+bwd)".format(name, str(dtype)[6:]), stock_fwd_ms=st_ms,
                ls_fwd_ms=ls_ms, fwd_speedup=st_ms / ls_ms, fwd_bw_pct=None, kernels="{:.0f} / {:.0f}".format(st_k, ls_k))


def bench_decode_attention(dtype, copy_bw, hypotheses=512, length=100, layers=6):
    """One decoding step's self-attention of one layer in a transformer-big beam search (128 sentences x
    beam 4, the step at position ``length``): fairseq's way, the reorder of the layer's keys and values
    into the new beam order (an index_select of the cache) and then attention over them, against
    decode_attention over the cache as written, through a table of slot numbers, given the qkv GEMM's
    output and its bias as the generator's call is (it adds the bias, scales q and writes the step's
    keys and values into the cache)."""
    from ls_fairseq.ops.decode_attention import decode_attention

    D, s = HIDDEN // HEADS, torch.finfo(dtype).bits // 8
    cache = rand(length, 2 * layers, hypotheses, HEADS, D, dtype=dtype)
    q, k, v = rand(hypotheses, 1, 3 * HEADS * D, dtype=dtype).view(hypotheses, 3, HEADS, 1, D).unbind(1)
    bias = rand(3 * HEADS * D, dtype=dtype)
    order = torch.randint(0, hypotheses, (hypotheses,), device="cuda")
    origin = torch.randint(0, hypotheses, (hypotheses, length), dtype=torch.int32, device="cuda")
    origin[:, length - 1] = torch.arange(hypotheses, dtype=torch.int32, device="cuda")
    keys = cache[:, :2].permute(2, 0, 1, 3, 4)  # [hypotheses, length, 2, heads, D]: fairseq's per-layer cache

    def stock(_):
        k, v = keys.index_select(0, order).unbind(2)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), scale=D**-0.5)

    stock_ms, stock_k = kernel_ms(stock, [None])
    ls_ms, ls_k = kernel_ms(lambda _: decode_attention(q, cache, 0, origin, length, k, v, bias, D**-0.5), [None])
    bytes_ = 2 * hypotheses * length * HEADS * D * s
    return dict(op="decode_attention (reorder + attention)", stock_fwd_ms=stock_ms, ls_fwd_ms=ls_ms,
                fwd_speedup=stock_ms / ls_ms, fwd_bw_pct=100 * bytes_ / ls_ms / 1e6 / copy_bw,
                kernels="{:.0f} / {:.0f}".format(stock_k, ls_k))


def bench_beam_attention(dtype, copy_bw, sentences=128, beam=4, source=30):
    """One decoding step's cross-attention of one layer in a transformer-big beam search (128 sentences
    x beam 4, a source of ``source`` tokens): fairseq's way, the query scaled (after the projection's
    bias, which its GEMM adds) and attention of each hypothesis over its own copy of the sentence's
    keys and values, against beam_attention on the query projection's output without bias, each
    sentence's keys and values read once for its beams."""
    from ls_fairseq import ops
    from ls_fairseq.ops.beam_attention import beam_attention

    D, s, N = HIDDEN // HEADS, torch.finfo(dtype).bits // 8, sentences * beam
    q = rand(sentences, beam, HEADS, D, dtype=dtype).transpose(1, 2)
    bias = rand(HEADS * D, dtype=dtype)
    k, v = rand(2, sentences, HEADS, source, D, dtype=dtype).unbind(0)
    pad = torch.zeros(sentences, source, dtype=torch.bool, device="cuda")
    pad[1::2, :5] = True
    mask = ops.AttentionMask(pad)
    per_hypothesis = [t.repeat_interleave(beam, 0) for t in (k, v)]  # fairseq's encoder output per hypothesis
    additive = torch.zeros(N, 1, 1, source, dtype=dtype, device="cuda").masked_fill_(
        pad.repeat_interleave(beam, 0)[:, None, None], float("-inf"))
    q_stock = q.transpose(1, 2).reshape(N, HEADS, 1, D)

    def stock(_):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(q_stock * D**-0.5, *per_hypothesis, attn_mask=additive, scale=1.0)

    stock_ms, stock_k = kernel_ms(stock, [None])
    ls_ms, ls_k = kernel_ms(lambda _: beam_attention(q, k, v, mask, bias, D**-0.5), [None])
    bytes_ = 2 * sentences * source * HEADS * D * s
    return dict(op="beam_attention (cross, decoding)", stock_fwd_ms=stock_ms, ls_fwd_ms=ls_ms,
                fwd_speedup=stock_ms / ls_ms, fwd_bw_pct=100 * bytes_ / ls_ms / 1e6 / copy_bw,
                kernels="{:.0f} / {:.0f}".format(stock_k, ls_k))


def bench_beam_select(copy_bw, sentences=128, beam=4, vocab=VOCAB):
    """One decoding step's candidate selection in a beam search of ``sentences`` x ``beam`` over the
    vocabulary: fairseq's torch.topk of the 2 x beam best of each sentence's beam x vocabulary
    cumulative scores (fp32), against beam_select's HARS kernel on the same scores."""
    from ls_fairseq.ops.beam_select import beam_select

    scores = rand(sentences, beam * vocab, dtype=torch.float32)
    stock_ms, stock_k = kernel_ms(lambda _: torch.topk(scores, 2 * beam, dim=1), [None])
    ls_ms, ls_k = kernel_ms(lambda _: beam_select(scores, 2 * beam), [None])
    return dict(op="beam_select (top 2 x beam)", stock_fwd_ms=stock_ms, ls_fwd_ms=ls_ms,
                fwd_speedup=stock_ms / ls_ms, fwd_bw_pct=100 * scores.numel() * 4 / ls_ms / 1e6 / copy_bw,
                kernels="{:.0f} / {:.0f}".format(stock_k, ls_k))


def bench_beam_scores(dtype, copy_bw, sentences=128, beam=4, vocab=VOCAB):
    """One decoding step's candidate scores of ``sentences`` x ``beam`` hypotheses from the logits:
    the generator's torch ops (log_softmax in fp32, nan_to_num, the pad column, the minimum length's
    EOS column, the cumulative add) against beam_scores's kernel."""
    from ls_fairseq.ops.beam_scores import beam_scores, beam_scores_reference

    logits = rand(sentences * beam, vocab, dtype=dtype)
    cum = rand(sentences * beam, dtype=torch.float32)
    t = torch.tensor(3, device="cuda")
    stock_ms, stock_k = kernel_ms(lambda _: beam_scores_reference(logits, cum, t, 1, 3, 0.0, 2, 1), [None])
    ls_ms, ls_k = kernel_ms(lambda _: beam_scores(logits, cum, t, 1, 3, 0.0, 2, 1), [None])
    bytes_ = logits.numel() * (logits.element_size() + 4)
    return dict(op="beam_scores (log-probs + cum)", stock_fwd_ms=stock_ms, ls_fwd_ms=ls_ms,
                fwd_speedup=stock_ms / ls_ms, fwd_bw_pct=100 * bytes_ / ls_ms / 1e6 / copy_bw,
                kernels="{:.0f} / {:.0f}".format(stock_k, ls_k))


def bench_beam_advance(sentences=128, beam=4, positions=201):
    """One decoding step's bookkeeping after the candidates in a beam search of ``sentences`` x ``beam``
    (hypotheses finished into their slots, the survivors' histories reordered): the search's torch
    ops (beam_advance's reference, what ran before the kernel) against the beam_advance kernel, on a
    state where a fifth of the candidates end their sentence."""
    from types import SimpleNamespace

    from ls_fairseq.ops.beam_advance import STATE, beam_advance, beam_advance_reference

    B, k, L, V = sentences, beam, positions, VOCAB
    N, dev = B * k, "cuda"
    s = SimpleNamespace(tokens=torch.randint(3, V, (N, L + 1), device=dev), scores=torch.randn(N, L, device=dev),
                        cum=torch.randn(N, device=dev), done=torch.zeros(B, dtype=torch.bool, device=dev),
                        count=torch.zeros(B, dtype=torch.long, device=dev),
                        fin_tokens=torch.ones(B, k + 1, L, dtype=torch.long, device=dev),
                        fin_positional=torch.zeros(B, k + 1, L, device=dev),
                        fin_score=torch.zeros(B, k + 1, device=dev), fin_length=torch.zeros(B, k + 1, dtype=torch.long,
                                                                                            device=dev))
    values = torch.randn(B, 2 * k, device=dev).sort(dim=1, descending=True).values
    tokens = torch.where(torch.rand(B, 2 * k, device=dev) < 0.2, 2, torch.randint(3, V, (B, 2 * k), device=dev))
    indices = torch.randint(0, k, (B, 2 * k), device=dev) * V + tokens
    t, parents = torch.tensor(L // 2, device=dev), torch.zeros(N, dtype=torch.long, device=dev)
    tensors = [getattr(s, n) for n in STATE]

    def reference(_):
        s.count.zero_()  # the same work every call: no sentence fills its slots
        s.done.zero_()
        beam_advance_reference(values, indices, t, *tensors, parents, 2, 1, V, 0.6, True, True)

    def kernel(_):
        s.count.zero_()
        s.done.zero_()
        beam_advance(values, indices, t, s, parents, 2, 1, V, 0.6, True, True)

    stock_ms, stock_k = kernel_ms(reference, [None])
    ls_ms, ls_k = kernel_ms(kernel, [None])
    return dict(op="beam_advance (torch ops / kernel)", stock_fwd_ms=stock_ms, ls_fwd_ms=ls_ms,
                fwd_speedup=stock_ms / ls_ms, fwd_bw_pct=None, kernels="{:.0f} / {:.0f}".format(stock_k, ls_k))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    parser.add_argument("--dropout", type=float, default=0.1,
                        help="dropout probability of every op that has one (0: no keep-bits drawn, which shows "
                             "what drawing them costs)")
    parser.add_argument("--json", help="write the raw numbers here")
    args = parser.parse_args()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    assert dispatch.extension() is not None, "the CUDA extension is not loaded: {}".format(dispatch.extension_error())
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    results = [bench_forward_backward(*row, copy_bw=copy_bw) for row in benches(dtype, args.dropout)]
    torch.cuda.empty_cache()
    results.append(bench_linear(dtype))
    results.append(bench_linear_bias_act(dtype))
    results.append(bench_fp8_cast(dtype, copy_bw))
    results.append(bench_linear_fp8(dtype, "qkv", HIDDEN, 3 * HIDDEN))
    results.append(bench_linear_fp8(dtype, "fc2", FFN, HIDDEN))
    results.append(bench_adam(dtype, copy_bw))
    results.append(bench_grad_norm(dtype, copy_bw))
    results.append(bench_decode_attention(dtype, copy_bw))
    results.append(bench_beam_attention(dtype, copy_bw))
    results.append(bench_beam_select(copy_bw))
    results.append(bench_beam_scores(dtype, copy_bw))
    results.append(bench_beam_advance())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(dtype=args.dtype, dropout=args.dropout, copy_gbps=copy_bw, device=torch.cuda.get_device_name(), results=results), f, indent=1)
    print("\n{} on {}, copy bandwidth {:.0f} GB/s (transformer-big sizes, 8192 tokens, dropout {})".format(
        args.dtype, torch.cuda.get_device_name(), copy_bw, args.dropout))
    print("GPU kernel time per call (profiler); kernels per call as fwd+bwd, stock / ls")
    print("% copy bw: the op's fewest bytes over its time, against the 1 GiB copy's bandwidth (in parentheses: "
          "against a copy of the same number of bytes)")
    print("| op | stock fwd ms | ls fwd ms | fwd x | ls fwd % copy bw | stock bwd ms | ls bwd ms | bwd x | ls bwd % copy bw | extra MB stock / ls | kernels |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print("| {op} | {a:.3f} | {b:.3f} | {c:.2f} | {d} | {e} | {f} | {g} | {h} | {i} |".format(
            op=r["op"], a=r["stock_fwd_ms"], b=r["ls_fwd_ms"], c=r["fwd_speedup"],
            d="-" if r["fwd_bw_pct"] is None else "{:.0f}%".format(r["fwd_bw_pct"]) + (
                " ({:.0f}%)".format(r["fwd_same_size_copy_pct"]) if "fwd_same_size_copy_pct" in r else ""),
            e="{:.3f}".format(r["stock_bwd_ms"]) if "stock_bwd_ms" in r else "-",
            f="{:.3f}".format(r["ls_bwd_ms"]) if "ls_bwd_ms" in r else "-",
            g="{:.2f}".format(r["bwd_speedup"]) if "bwd_speedup" in r else "-",
            h="{:.0f}% ({:.0f}%)".format(r["bwd_bw_pct"], r["bwd_same_size_copy_pct"]) if "bwd_bw_pct" in r else "-",
            i="{:.0f} / {:.0f}".format(r["stock_peak_mb"], r["ls_peak_mb"]) if "ls_peak_mb" in r else "-")
            + " {} |".format(r["kernels"]))
    print("\nls kernels per call (us): forward; backward")
    for r in results:
        for phase, kernels in r.get("ls_kernels_us", {}).items():
            print("{} {}: {}".format(r["op"], phase, "; ".join(
                "{} {:.1f}".format(name[:60], us) for name, us in sorted(kernels.items(), key=lambda kv: -kv[1]))))


if __name__ == "__main__":
    main()
