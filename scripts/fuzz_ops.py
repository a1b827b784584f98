"""Every kernel against its PyTorch reference on random cases: forward and gradients.

Each case draws its shapes (1, primes, powers of two and their neighbours, sizes that are not
multiples of 8, lengths up to 2,048), dtype (fp32/fp16/bf16), masks and padding, dropout on or
off (the references are given the keep-mask the kernel drew), inputs at an element offset (not
16-byte aligned) and, where a kernel takes them, strided views; accumulation into gradients that
hold values where a backward can add in place. The error rule is the op tests' (tests/helpers.py
``kernel_error``): fp32 within 1e-5 of fp64, fp16/bf16 within twice PyTorch's own error in the same
precision (plus a floor), with the tests' own rules where they have one (LayerNorm's statistics, the
cross-entropy's fp32 losses, Adam's moments and parameters). A kernel that raises on a valid case
counts as a mismatch too.

On a CPU (``--device cpu``) every op runs its reference on both sides: a smoke test of the script.

  python3 scripts/fuzz_ops.py                          # up to 1,000 cases per op on the GPU in 4 minutes
  python3 scripts/fuzz_ops.py --jobs 4 --budget-s 300  # the ops over 4 processes side by side
  python3 scripts/fuzz_ops.py --seed 7 --ops softmax --case 123    # replay one case
  python3 scripts/fuzz_ops.py --device cpu --cases 3

Writes $OUT/fuzz_ops/{results.json,cases.jsonl,fuzz.log} ($OUT defaults to a temporary folder);
prints a table last; exits 1 on any mismatch, naming each failing case's replay command.
"""
import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))
from helpers import kernel_error, poison, rel_error  # noqa: E402 (the tests' rule)

from ls_fairseq import ops  # noqa: E402
from ls_fairseq.ops import adam as adam_op  # noqa: E402
from ls_fairseq.ops import dispatch, segment_attention  # noqa: E402
from ls_fairseq.ops.beam_advance import STATE as BEAM_STATE  # noqa: E402
from ls_fairseq.ops.beam_advance import beam_advance, beam_advance_reference  # noqa: E402
from ls_fairseq.ops.beam_select import beam_select, beam_select_reference  # noqa: E402
from ls_fairseq.ops.beam_scores import beam_scores, beam_scores_reference  # noqa: E402
from ls_fairseq.ops.beam_attention import beam_attention, beam_attention_reference, scaled_query  # noqa: E402
from ls_fairseq.ops.decode_attention import (add_bias, decode_attention, decode_attention_reference,  # noqa: E402
                                             gather_history)
from ls_fairseq.ops.attention import ATTENTION_ROUTE, attention_reference  # noqa: E402
from ls_fairseq.ops.segment_attention import segment_attention_reference  # noqa: E402
from ls_fairseq.ops.bias_act_dropout import BIAS_ACT_DROPOUT_ROUTE, bias_act_dropout_forward_reference  # noqa: E402
from ls_fairseq.ops.bias_act_dropout import bias_act_dropout_backward_reference  # noqa: E402
from ls_fairseq.ops.bias_dropout_residual import BIAS_DROPOUT_RESIDUAL_ROUTE  # noqa: E402
from ls_fairseq.ops.bias_dropout_residual import bias_dropout_residual_backward_reference  # noqa: E402
from ls_fairseq.ops.bias_dropout_residual import bias_dropout_residual_forward_reference  # noqa: E402
from ls_fairseq.ops.bias_dropout_residual_layer_norm import BIAS_DROPOUT_RESIDUAL_LAYER_NORM_ROUTE  # noqa: E402
from ls_fairseq.ops.bias_dropout_residual_layer_norm import (  # noqa: E402
    bias_dropout_residual_layer_norm_backward_reference, bias_dropout_residual_layer_norm_forward_reference,
)
from ls_fairseq.ops.cross_entropy import CROSS_ENTROPY_ROUTE, cross_entropy_backward_reference  # noqa: E402
from ls_fairseq.ops.cross_entropy import cross_entropy_forward_reference  # noqa: E402
from ls_fairseq.ops.embedding import EMBEDDING_ROUTE, embedding_backward_reference  # noqa: E402
from ls_fairseq.ops.embedding import embedding_forward_reference  # noqa: E402
from ls_fairseq.ops.fp8_cast import fp8_cast, fp8_cast_reference  # noqa: E402
from ls_fairseq.ops.layer_norm import LAYER_NORM_ROUTE, layer_norm_backward_reference  # noqa: E402
from ls_fairseq.ops.layer_norm import layer_norm_forward_reference  # noqa: E402
from ls_fairseq.ops.qkv import QKV_ROUTE, qkv_backward_reference, qkv_forward_reference  # noqa: E402
from ls_fairseq.ops.softmax import SOFTMAX_ROUTE, softmax_backward_reference, softmax_forward_reference  # noqa: E402

# CPU tensors take segment_attention's Triton path in Triton's interpreter where TRITON_INTERPRET=1 is set
segment_attention.INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PRIMES = (2, 3, 5, 7, 11, 13, 17, 31, 37, 61, 67, 127, 131, 257, 509, 521, 1021, 1031, 2039, 2053, 4093)
PAD = 1


class Case:
    """One case: its random draws (``rng``, and torch's generators seeded from the same seed), its
    parameters (for the log and the replay), and the checks made, each as error / allowed."""

    def __init__(self, seed, device, max_elements):
        self.rng = random.Random(seed)
        self.device = device
        self.max_elements = max_elements
        self.params = {}
        self.checks = {}
        torch.manual_seed(seed)

    # draws
    def dim(self, hi, favourites=()):
        """A size in [1, hi]: 1, a prime, a power of two or a neighbour of one, a favourite, any."""
        r = self.rng.random()
        if r < 0.1:
            n = 1
        elif r < 0.3:
            n = self.rng.choice([p for p in PRIMES if p <= hi] or [1])
        elif r < 0.5:
            n = 2 ** self.rng.randint(0, max(0, int(math.log2(hi)))) + self.rng.choice((-1, 0, 0, 1))
        elif r < 0.65 and favourites:
            n = self.rng.choice(favourites)
        else:
            n = self.rng.randint(1, hi)
        return max(1, min(hi, n))

    def rows_for(self, per_row, hi):
        """A row count whose rows of ``per_row`` elements fit the element budget."""
        return self.dim(max(1, min(hi, self.max_elements // max(1, per_row))))

    def pick(self, name, choices):
        value = self.rng.choice(choices)
        self.params[name] = value
        return value

    def dtype(self, names=("fp32", "fp16", "bf16")):
        return DTYPES[self.pick("dtype", names)]

    def tensor(self, shape, dtype, scale=1.0, shift=0.0, offset=0, kind="randn"):
        """Random values in ``dtype`` on the device, starting ``offset`` elements into a buffer (a
        contiguous view that is not 16-byte aligned when offset > 0)."""
        n = math.prod(shape)
        draw = torch.randn if kind == "randn" else torch.rand
        flat = (draw(n + offset, device=self.device) * scale + shift).to(dtype)
        return flat[offset:].view(shape)

    def dropout_p(self):
        return self.pick("p", (0.0, 0.0, 0.1, 0.3))

    def offset(self):
        return self.pick("offset", (0, 0, 0, 1, 3))

    # checks
    def kernel(self, name, out, ref64, low):
        """The tests' rule (check_kernel)."""
        self.checks[name] = kernel_error(out, ref64, low, name)

    def relative(self, name, out, ref, bound):
        finite = bool(torch.isfinite(out.float()).all())
        err = rel_error(out, ref) if finite else float("inf")
        self.checks[name] = (err / bound, "{}: relative error {:.3g} (at most {:g})".format(name, err, bound))

    def equal(self, name, a, b):
        same = torch.equal(a, b)
        self.checks[name] = (0.0 if same else float("inf"), "{}: {}".format(name, "equal" if same else "differ"))


def fill_free_memory(c):
    """On the GPU, NaN in the caching allocator's free blocks (tests' ``poison``): an output element a
    kernel forgets to write reads as NaN."""
    if c.device != "cpu":
        poison()


def keep_mask(dropout):
    """The keep-mask a forward's dropout applied: the reference's own tensor, the kernel's keep-bits
    written out (``_C.Dropout.mask()``), or None without dropout."""
    return dropout if dropout is None or torch.is_tensor(dropout) else dropout.mask()


def held_gradient(c, shape, dtype):
    """None (the backward makes a new gradient) or a gradient holding values (it adds into it)."""
    if not c.pick("accumulate", (False, True)):
        return None
    return c.tensor(shape, dtype)


def accumulated(into, ref64, low):
    """The fp64 reference and PyTorch's own with ``into``'s values added (when given)."""
    if into is None:
        return ref64, low
    return into.double() + ref64, (into + low) if low is not None else None


def copy(t):
    return None if t is None else t.clone()


# ---------------------------------------------------------------------------------------------- ops


def case_layer_norm(c):
    dtype = c.dtype()
    # at least 8 elements a row: over fewer the normalised row is nearly constant (over 1 or 2 exactly:
    # 0, or -1 and 1), so the input's gradient cancels to (nearly) zero and fp32 rounding alone exceeds
    # the rule's 1e-5, in torch's own fp32 LayerNorm too. Means of 2 (the test's) to 10 (wider rows),
    # spread 3
    hidden = max(8, c.dim(4096, (128, 256, 512, 768, 1024, 2048, 1030)))
    rows = c.rows_for(hidden, 20000)
    shift = c.pick("mean", (2.0, 2.0, -2.0, 10.0 if hidden >= 32 else 2.0))
    off = c.offset()
    c.params.update(rows=rows, hidden=hidden)
    x = c.tensor((rows, hidden), dtype, 3.0, shift, off)
    w = c.tensor((hidden,), dtype, 1.0, 0.5, off, "rand")
    b = c.tensor((hidden,), dtype)
    dy = c.tensor((rows, hidden), dtype, offset=off)
    dw_into, db_into = held_gradient(c, (hidden,), dtype), None
    if dw_into is not None:
        db_into = c.tensor((hidden,), dtype)
    fwd, bwd = LAYER_NORM_ROUTE.pick(x)
    fill_free_memory(c)
    y, mean, rstd = fwd(x, w, b, 1e-5)
    fill_free_memory(c)
    dx, dw, db = bwd(dy, x, w, mean, rstd, copy(dw_into), copy(db_into))
    x64, w64, b64, dy64 = (t.double() for t in (x, w, b, dy))
    y64, mean64, rstd64 = layer_norm_forward_reference(x64, w64, b64, 1e-5)
    dx64, dw64, db64 = layer_norm_backward_reference(dy64, x64, w64, mean64, rstd64)
    low = (None,) * 4
    if dtype != torch.float32:  # PyTorch's own: torch's layer norm in the same precision
        xl, wl, bl = (t.clone().requires_grad_() for t in (x, w, b))
        yl = F.layer_norm(xl, (hidden,), wl, bl, 1e-5)
        low = (yl,) + torch.autograd.grad(yl, (xl, wl, bl), dy)
    dw64, dwl = accumulated(dw_into, dw64, low[2])
    db64, dbl = accumulated(db_into, db64, low[3])
    for name, out, ref, lo in (("y", y, y64, low[0]), ("dx", dx, dx64, low[1]), ("dgamma", dw, dw64, dwl),
                               ("dbeta", db, db64, dbl)):
        c.kernel(name, out, ref, lo)
    c.relative("mean", mean, mean64, 1e-5)
    c.relative("rstd", rstd, rstd64, 1e-4)


def padding_mask(c, B, T, device):
    """A key-padding mask [B, T] (True = pad): none, right or left padding of random lengths, now and
    then a row that is all padding; bool or uint8."""
    kind = c.pick("padding", ("none", "right", "left", "right", "left_with_empty"))
    if kind == "none":
        return None
    lengths = [c.rng.randint(1, T) for _ in range(B)]
    if kind == "left_with_empty" and B > 1:
        lengths[c.rng.randrange(B)] = 0
    pos = torch.arange(T, device=device)[None, :]
    n = torch.tensor(lengths, device=device)[:, None]
    mask = pos >= n if kind == "right" else pos < T - n
    return mask.to(torch.uint8) if c.pick("mask_dtype", ("bool", "bool", "uint8")) == "uint8" else mask


def case_softmax(c):
    dtype = c.dtype()
    Tk = c.dim(2048, (32, 64, 128, 256, 384, 512, 1024, 1030))
    causal = c.pick("causal", (False, True))
    Tq = min(Tk, c.dim(256)) if causal and c.rng.random() < 0.8 else c.dim(256)
    H = c.dim(16, (4, 8, 16))
    B = c.rows_for(H * Tq * Tk, 64)
    c.params.update(B=B, H=H, Tq=Tq, Tk=Tk)
    p, off = c.dropout_p(), c.offset()
    scores = c.tensor((B, H, Tq, Tk), dtype, c.pick("scale", (1.0, 3.0, 10.0)), 0.0, off)
    kpm = padding_mask(c, B, Tk, c.device)
    dout = c.tensor((B, H, Tq, Tk), dtype, offset=off)
    fwd, bwd = SOFTMAX_ROUTE.pick(scores)
    fill_free_memory(c)
    out, lse, dropout = fwd(scores, kpm, causal, p, None)
    fill_free_memory(c)
    ds = bwd(dout, scores, lse, kpm, causal, dropout, p)
    mask = keep_mask(dropout)
    out64, lse64, _ = softmax_forward_reference(scores.double(), kpm, causal, p, mask)
    ds64 = softmax_backward_reference(dout.double(), scores.double(), lse64, kpm, causal, mask, p)
    out_l, lse_l, _ = softmax_forward_reference(scores, kpm, causal, p, mask)
    ds_l = softmax_backward_reference(dout, scores, lse_l, kpm, causal, mask, p)
    c.kernel("out", out, out64, out_l)
    c.kernel("dscores", ds, ds64, ds_l)
    # a row that sees no key has lse -inf (exactly there); the others by the fp32 rule
    seen = torch.isfinite(lse64)
    c.equal("lse_masked_rows", torch.isfinite(lse), seen)
    if seen.any():
        c.kernel("lse", lse[seen], lse64[seen], None)


def case_attention(c):
    """The fused attention kernel (fp16/bf16, its d_head, rows within its length)."""
    dtype = c.dtype(("fp16", "bf16"))
    ext = dispatch.extension()
    D = ext.attention_head_dim if ext is not None and c.device != "cpu" else 64
    max_len = ext.attention_max_len if ext is not None and c.device != "cpu" else 64
    Tq, Tk = c.dim(max_len), c.dim(max_len)
    causal = c.pick("causal", (False, True))
    H = c.dim(16, (4, 8, 16))
    B = c.rows_for(H * max(Tq, Tk) * D, 64)
    p = c.dropout_p()
    layout = c.pick("layout", ("token_major", "contiguous", "kv_slices"))
    c.params.update(B=B, H=H, Tq=Tq, Tk=Tk, D=D)

    def heads(T, token_major):
        if token_major:  # a view of [B, T, heads, d_head] storage, as split_heads(token_major=True) gives
            return c.tensor((B, T, H, D), dtype).transpose(1, 2)
        return c.tensor((B, H, T, D), dtype)

    q = heads(Tq, layout == "token_major") * D**-0.5
    if layout == "kv_slices":  # keys and values views of all layers' [parts, B, heads, T, d_head]
        kv = c.tensor((4, B, H, Tk, D), dtype)
        k, v = kv[1], kv[2]
    else:
        k, v = heads(Tk, layout == "token_major"), heads(Tk, False)
    kpm = padding_mask(c, B, Tk, c.device)
    dout = heads(Tq, True)
    if c.device == "cpu":
        # the reference on both sides: attention_reference through autograd, its own keep-mask
        mask = dispatch.dropout_mask((B, H, Tq, Tk), p, c.device) if p > 0 else None
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o = attention_reference(*leaves, ops.AttentionMask(kpm, causal), p, True, mask)
        got = (o,) + torch.autograd.grad(o, leaves, dout)
    else:
        fwd, bwd = ATTENTION_ROUTE.pick(q)
        fill_free_memory(c)
        out, lse, dropout = fwd(q, k, v, kpm, causal, p)
        fill_free_memory(c)
        got = (out,) + tuple(bwd(dout, q, k, v, lse, kpm, causal, dropout, p))
        mask = keep_mask(dropout)

    def reference(dt):
        leaves = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        o = attention_reference(*leaves, ops.AttentionMask(kpm, causal), p, True, mask)
        return (o,) + torch.autograd.grad(o, leaves, dout.to(dt))

    for g, r64, low, name in zip(got, reference(torch.float64), reference(dtype), ("out", "dq", "dk", "dv")):
        c.kernel(name, g, r64, low)


def case_segment_attention(c):
    """Packed streams (--ls-packed): segments of random lengths (empty ones and ones of length 1 too) and
    a tail past the last offset, causal self-attention or cross-attention, against the block-diagonal
    oracle. The path: the Triton kernels (``triton``, on the GPU; on the CPU under TRITON_INTERPRET=1),
    else varlen's FlashAttention where it fits on the GPU, else the blocks path; ``deterministic`` and
    ``exact_row_term`` as the layers pass them; q, k and v ``strided`` as views of one fused projection's
    output (as split_heads gives them) or of streams of their own; dropout where the kernels' keep-mask
    is known to the oracle (the Triton path)."""
    dtype = c.dtype(("fp16", "bf16") if c.device != "cpu" else ("fp32",))
    causal = c.pick("causal", (False, True))
    H, D = c.dim(16, (4, 8, 16)), c.pick("D", (32, 64, 128))
    segments = c.dim(300, (1, 2, 64, 128))

    def stream(longest):
        lengths = [c.rng.choice((0, 1, c.rng.randint(1, longest))) for _ in range(segments)]
        lengths[-1] = longest
        offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32).to(c.device)
        return offsets, int(offsets[-1]) + c.rng.choice((0, 0, 1, 15))

    # the last segments are the longest, at least 2 keys long: where every query sees one key, dq and dk are
    # exactly zero and a relative error against them measures nothing but rounding
    longest_q = max(2, c.dim(max(1, min(512, c.max_elements // (segments * H * D) or 1)), (1, 31, 64)))
    q_offsets, nq = stream(longest_q)
    if causal:
        k_offsets, nk, longest_k = q_offsets, nq, longest_q
    else:
        longest_k = max(2, c.dim(max(1, min(512, c.max_elements // (segments * H * D) or 1)), (1, 33, 64)))
        k_offsets, nk = stream(longest_k)
    triton = c.pick("triton", (False, True))
    deterministic, exact_row_term = c.pick("deterministic", (False, True)), c.pick("exact_row_term", (False, True))
    strided = c.pick("strided", (False, True))
    c.params.update(segments=segments, H=H, nq=nq, nk=nk, longest_q=longest_q, longest_k=longest_k)
    mask = ops.SegmentMask(q_offsets, k_offsets, longest_q, longest_k, causal=causal, triton=triton)
    if strided and causal:  # q, k, v: views of one [rows, 3, heads, d_head] projection output
        fused = c.tensor((1, nq, 3, H, D), dtype)
        q, k, v = (fused[:, :, i].transpose(1, 2) for i in range(3))
    elif strided:  # q a stream of its own, k and v views of one [rows, 2, heads, d_head] output
        q = c.tensor((1, nq, H, D), dtype, scale=D**-0.5).transpose(1, 2)
        fused = c.tensor((1, nk, 2, H, D), dtype)
        k, v = (fused[:, :, i].transpose(1, 2) for i in range(2))
    else:
        q, k, v = (c.tensor((1, n, H, D), dtype, scale=D**-0.5 if n == nq else 1.0).transpose(1, 2)
                   for n in (nq, nk, nk))
    dout = c.tensor((1, nq, H, D), dtype).transpose(1, 2)
    p = c.pick("dropout", (0.0, 0.1)) if segment_attention.triton_runs(q, k, v, mask) else 0.0
    c.params.update(path="triton" if segment_attention.triton_runs(q, k, v, mask) else "varlen or blocks", p=p)
    seed = c.rng.randint(0, 2**62)
    keep = None
    if p > 0:
        torch.manual_seed(seed)
        keep = segment_attention._triton_kernels().keep_mask(q, k, mask, p, torch.randint(2**62, (1,), device=c.device))

    def run(fn, dt):
        leaves = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        o = fn(*leaves)
        return (o,) + torch.autograd.grad(o, leaves, dout.to(dt))

    def kernels(q, k, v):
        torch.manual_seed(seed)  # the seed the keep-mask was drawn with
        return ops.attention(q, k, v, mask, p, True, deterministic, exact_row_term)

    def oracle(q, k, v):
        return segment_attention_reference(q, k, v, mask, p, True, keep)

    fill_free_memory(c)
    got = run(kernels, dtype)
    for g, r64, low, name in zip(got, run(oracle, torch.float64), run(oracle, dtype), ("out", "dq", "dk", "dv")):
        c.kernel(name, g, r64, low)


def case_bias_dropout_residual(c):
    dtype = c.dtype()
    hidden = c.dim(4096, (24, 512, 1024, 1030))
    rows = c.rows_for(hidden, 70000)
    p, off = c.dropout_p(), c.offset()
    c.params.update(rows=rows, hidden=hidden)
    x, r, dout = (c.tensor((rows, hidden), dtype, offset=off) for _ in range(3))
    b = c.tensor((hidden,), dtype, offset=off)
    into = held_gradient(c, (hidden,), dtype)
    fwd, bwd = BIAS_DROPOUT_RESIDUAL_ROUTE.pick(x)
    fill_free_memory(c)
    out, dropout = fwd(x, b, r, p, None)
    fill_free_memory(c)
    dx, db = bwd(dout, dropout, p, copy(into))
    mask = keep_mask(dropout)
    out64, _ = bias_dropout_residual_forward_reference(x.double(), b.double(), r.double(), p, mask)
    dx64, db64 = bias_dropout_residual_backward_reference(dout.double(), mask, p)
    out_l, _ = bias_dropout_residual_forward_reference(x, b, r, p, mask)
    dx_l, db_l = bias_dropout_residual_backward_reference(dout, mask, p)
    db64, db_l = accumulated(into, db64, db_l)
    for name, o, ref, low in (("out", out, out64, out_l), ("dx", dx, dx64, dx_l), ("dbias", db, db64, db_l)):
        c.kernel(name, o, ref, low)


def case_bias_dropout_residual_layer_norm(c):
    dtype = c.dtype()
    hidden = max(8, c.dim(5000, (256, 512, 768, 1024, 1030, 5000)))  # as layer_norm's
    rows = c.rows_for(hidden, 20000)
    p, off = c.dropout_p(), c.offset()
    c.params.update(rows=rows, hidden=hidden)
    h, r, dy = (c.tensor((rows, hidden), dtype, offset=off) for _ in range(3))
    b, w, lb = (c.tensor((hidden,), dtype, offset=off) for _ in range(3))
    fwd, bwd = BIAS_DROPOUT_RESIDUAL_LAYER_NORM_ROUTE.pick(h)
    fill_free_memory(c)
    y, x, mean, rstd, dropout = fwd(h, b, r, w, lb, 1e-5, p, None)
    fill_free_memory(c)
    dh, dbias, dx, dw, dlb = bwd(dy, x, w, mean, rstd, dropout, p, None, None, None)
    mask = keep_mask(dropout)
    args64 = [t.double() for t in (h, b, r, w, lb)]
    out64 = bias_dropout_residual_layer_norm_forward_reference(*args64, 1e-5, p, mask)
    out_l = bias_dropout_residual_layer_norm_forward_reference(h, b, r, w, lb, 1e-5, p, mask)
    for o, ref, low, name in zip((y, x), out64[:2], out_l[:2], ("y", "x")):
        c.kernel(name, o, ref, low)
    back64 = bias_dropout_residual_layer_norm_backward_reference(dy.double(), out64[1], args64[3], out64[2],
                                                                 out64[3], mask, p)
    back_l = bias_dropout_residual_layer_norm_backward_reference(dy, x, w, mean, rstd, mask, p)
    for o, ref, low, name in zip((dh, dbias, dx, dw, dlb), back64, back_l,
                                 ("dh", "dbias", "dx", "dweight", "dln_bias")):
        c.kernel(name, o, ref, low)


def case_bias_act_dropout(c):
    dtype = c.dtype()
    hidden = c.dim(4096, (1030, 2048, 4096))
    rows = c.rows_for(hidden, 20000)
    activation = c.pick("activation", ("relu", "gelu"))
    p, off = c.dropout_p(), c.offset()
    # relu's backward as the op runs it: from the output alone (out > 0: kept and x + bias > 0)
    from_output = activation == "relu" and c.pick("backward_from_output", (False, True))
    c.params.update(rows=rows, hidden=hidden)
    x, dout = (c.tensor((rows, hidden), dtype, offset=off) for _ in range(2))
    b = c.tensor((hidden,), dtype, offset=off)
    into = held_gradient(c, (hidden,), dtype)
    fwd, bwd = BIAS_ACT_DROPOUT_ROUTE.pick(x)
    fill_free_memory(c)
    out, dropout = fwd(x, b, activation, p, None)
    fill_free_memory(c)
    if from_output:
        dx, db = bwd(dout, out, None, None, "relu", p, copy(into))
    else:
        dx, db = bwd(dout, x, b, dropout, activation, p, copy(into))
    mask = keep_mask(dropout)
    out64, _ = bias_act_dropout_forward_reference(x.double(), b.double(), activation, p, mask)
    dx64, db64 = bias_act_dropout_backward_reference(dout.double(), x.double(), b.double(), mask, activation, p)
    out_l, _ = bias_act_dropout_forward_reference(x, b, activation, p, mask)
    dx_l, db_l = bias_act_dropout_backward_reference(dout, x, b, mask, activation, p)
    db64, db_l = accumulated(into, db64, db_l)
    for name, o, ref, low in (("out", out, out64, out_l), ("dx", dx, dx64, dx_l), ("dbias", db, db64, db_l)):
        c.kernel(name, o, ref, low)


def case_embedding(c):
    dtype = c.dtype()
    D = c.dim(1030, (64, 200, 512, 1024, 1030))
    learned = c.pick("learned", (False, True))
    if not learned:
        D = max(D, 4)  # fairseq's sinusoids divide by half the width minus one
    T = c.dim(2048, (33, 128, 257))
    B = c.rows_for(T, 128)
    B = max(1, min(B, (c.max_elements // 8) // max(1, T * D) or 1))
    V = c.dim(max(PAD + 2, min(32003, c.max_elements // D)), (PAD + 2, 50, 32003))
    V = max(V, PAD + 2)
    p = c.dropout_p()
    left_pad = c.pick("left_pad", (False, True))
    c.params.update(B=B, T=T, D=D, V=V)
    tokens = torch.randint(PAD + 1, V, (B, T), device=c.device)
    if c.pick("frequent_token", (False, True)):  # a long run in the sorted backward
        tokens[:, T // 2] = PAD + 1
    for row in range(1, B):
        n = c.rng.randint(0, T - 1)
        if n and left_pad:
            tokens[row, :n] = PAD
        elif n:
            tokens[row, T - n:] = PAD
    positions = ops.make_positions(tokens, PAD)
    w = c.tensor((V, D), dtype)
    pw = c.tensor((T + PAD + 1, D), dtype) if learned else None
    dout = c.tensor((B, T, D), dtype)
    into = held_gradient(c, (V, D), dtype)
    pos_into = c.tensor(pw.shape, dtype) if learned and into is not None else None
    npos = pw.shape[0] if learned else 0
    fwd, bwd = EMBEDDING_ROUTE.pick(w)
    fill_free_memory(c)
    out, dropout = fwd(tokens, positions, w, pw, D**0.5, PAD, p, None)
    fill_free_memory(c)
    dw, dpw = bwd(dout, tokens, positions, dropout, D**0.5, PAD, p, V, npos, copy(into), copy(pos_into))
    mask = keep_mask(dropout)
    out64, _ = embedding_forward_reference(tokens, positions, w.double(), None if pw is None else pw.double(), D**0.5,
                                           PAD, p, mask)
    dw64, dpw64 = embedding_backward_reference(dout.double(), tokens, positions, mask, D**0.5, PAD, p, V, npos)
    out_l, _ = embedding_forward_reference(tokens, positions, w, pw, D**0.5, PAD, p, mask)
    dw_l, dpw_l = embedding_backward_reference(dout, tokens, positions, mask, D**0.5, PAD, p, V, npos)
    dw64, dw_l = accumulated(into, dw64, dw_l)
    c.kernel("out", out, out64, out_l)
    c.kernel("dweight", dw, dw64, dw_l)
    if learned:
        dpw64, dpw_l = accumulated(pos_into, dpw64, dpw_l)
        c.kernel("dpos", dpw, dpw64, dpw_l)


def case_qkv(c):
    dtype = c.dtype()
    parts = c.pick("parts", (1, 2, 3, 3, 4, 12, 18))
    D = c.dim(128, (8, 64, 64, 6))
    H = c.dim(16, (1, 2, 4, 16))
    T = c.dim(2048, (7, 33, 257))
    B = c.rows_for(T * parts * H * D, 64)
    token_major = c.pick("token_major", (False, True))
    missing = [k for k in range(1, parts) if c.rng.random() < 0.15]  # a part without gradient (not all)
    if missing and c.rng.random() < 0.5:
        missing = [0] + missing[1:]
    layout = c.pick("dy_layout", ("contiguous", "token_major_views", "head_major_views"))
    off = c.offset()
    c.params.update(B=B, T=T, H=H, D=D, missing=missing)
    x = c.tensor((B, T, parts * H * D), dtype, offset=off)
    b = c.tensor((parts * H * D,), dtype, offset=off)

    def dy():
        # attention backwards give views: [B, heads, T, d_head] over [B, T, heads, d_head] or [heads, B, T, d_head]
        if layout == "token_major_views":
            return c.tensor((B, T, H, D), dtype).transpose(1, 2)
        if layout == "head_major_views":
            return c.tensor((H, B, T, D), dtype).permute(1, 0, 2, 3)
        return c.tensor((B, H, T, D), dtype)

    dys = [None if k in missing else dy() for k in range(parts)]
    into = held_gradient(c, (parts * H * D,), dtype)
    fwd, bwd = QKV_ROUTE.pick(x)
    fill_free_memory(c)
    out = fwd(x, b, H, parts, D**-0.5, token_major)
    fill_free_memory(c)
    dx, db = bwd(dys, D**-0.5, copy(into))
    out64 = qkv_forward_reference(x.double(), b.double(), H, parts, D**-0.5, token_major)
    dx64, db64 = qkv_backward_reference([None if g is None else g.double() for g in dys], D**-0.5)
    out_l = qkv_forward_reference(x, b, H, parts, D**-0.5, token_major)
    dx_l, db_l = qkv_backward_reference(dys, D**-0.5)
    db64, db_l = accumulated(into, db64, db_l)
    for name, o, ref, low in (("out", out, out64, out_l), ("dx", dx, dx64, dx_l), ("dbias", db, db64, db_l)):
        c.kernel(name, o, ref, low)


def case_cross_entropy(c):
    dtype = c.dtype()
    V = c.dim(50000, (2, 1000, 32003, 32000))
    V = max(V, 2)
    N = c.rows_for(V, 16384)
    eps = c.pick("epsilon", (0.0, 0.1))
    scale = c.pick("scale", (1.0, 2.0, 10.0))
    grads = c.pick("upstream", ("both", "sum_no_nll", "loss_only"))
    off = c.offset()
    c.params.update(N=N, V=V)
    logits = c.tensor((N, V), dtype, scale, 0.0, off)
    target = torch.randint(0, V, (N,), device=c.device)
    target[torch.rand(N, device=c.device) < 0.2] = PAD
    if grads == "sum_no_nll":  # the criterion's: one value for every row (stride 0), no nll gradient
        dloss, dnll = torch.rand((), device=c.device).expand(N), None
    else:
        dloss = torch.rand(N, device=c.device)
        dnll = torch.rand(N, device=c.device) if grads == "both" else None
    fwd, bwd = CROSS_ENTROPY_ROUTE.pick(logits)
    fill_free_memory(c)
    loss, nll, lse = fwd(logits, target, eps, PAD)
    fill_free_memory(c)
    grad = bwd(dloss, dnll, logits, target, lse, eps, PAD, None)
    overwritten = logits.clone()
    in_place = bwd(dloss, dnll, overwritten, target, lse, eps, PAD, overwritten)
    ref64 = cross_entropy_forward_reference(logits.double(), target, eps, PAD)
    dnll64 = None if dnll is None else dnll.double()
    g64 = cross_entropy_backward_reference(dloss.double(), dnll64, logits.double(), target, ref64[2], eps, PAD)
    ref_l = cross_entropy_forward_reference(logits, target, eps, PAD)
    g_l = cross_entropy_backward_reference(dloss, dnll, logits, target, ref_l[2], eps, PAD)
    for o, ref, low, name in zip((loss, nll, lse), ref64, ref_l, ("loss", "nll", "lse")):
        c.kernel(name, o, ref, low)  # fp32 outputs whatever the logits' dtype: the fp32 rule
    c.kernel("dlogits", grad, g64, g_l)
    c.equal("dlogits_over_the_logits", in_place, grad)


def case_adam(c):
    """adam_step (moments and parameters by test_adam's rules), grad_norm, scaled_grad_norm."""
    dtype = c.dtype()
    n = c.dim(min(1 << 20, c.max_elements), (1, 15, 4097, 1000003))
    master = dtype != torch.float32 and c.pick("master", (False, True))
    decoupled = c.pick("decoupled", (True, False))
    wd = c.pick("weight_decay", (0.0, 0.01))
    step = c.rng.randint(1, 5000)
    device_step = c.pick("device_scalars", (False, True))
    noop = c.pick("noop", (False, False, False, True))
    off = c.offset()
    c.params.update(n=n, step=step)
    lr, b1, b2, eps = 1e-3, 0.9, 0.98, 1e-8
    p = c.tensor((n,), dtype, offset=off)
    s = dict(param=p, grad=c.tensor((n,), dtype, 100.0, offset=off), exp_avg=c.tensor((n,), torch.float32, 0.1, 0.0, off),
             exp_avg_sq=c.tensor((n,), torch.float32, 0.1, 0.0, off, "rand"),
             master=p.float().clone() if master else None)
    ref = {k: copy(v) for k, v in s.items()}
    g = s["grad"].float() / 100.0 + (0 if decoupled else wd * s["param"].float().abs())
    terms = b1 * s["exp_avg"].abs() + (1 - b1) * g.abs()
    scale = torch.tensor(1 / 100.0, device=c.device) if device_step else 1 / 100.0
    step_arg = torch.tensor(float(step), device=c.device) if device_step else step
    flag = torch.tensor(1.0 if noop else 0.0, device=c.device) if noop or device_step else None
    args = (lr, b1, b2, eps, wd)
    order = ("param", "grad", "exp_avg", "exp_avg_sq", "master")
    adam_op.ADAM_STEP_ROUTE.pick(p)(*(s[k] for k in order), *args, step_arg, scale, decoupled, flag, False)
    adam_op.adam_step_reference(*(ref[k] for k in order), *args, step, 1 / 100.0, decoupled, flag, False)
    moved = (s["exp_avg"] - ref["exp_avg"]).double().norm().item()
    bound = 1e-5 * terms.double().norm().item()
    c.checks["exp_avg"] = (moved / bound if bound else (0.0 if moved == 0 else float("inf")),
                           "exp_avg: error {:.3g} (at most {:.3g})".format(moved, bound))
    for key in ("exp_avg_sq", "master"):
        if s[key] is not None:
            c.relative(key, s[key], ref[key], 1e-5)
    ulp = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    a, e = s["param"].float(), ref["param"].float()
    worst = ((a - e).abs() / (ulp * e.abs() + 1e-6)).max().item() if torch.isfinite(a).all() else float("inf")
    c.checks["param"] = (worst, "param: {:.3g} rounding steps apart at most".format(worst))
    # the norm and the loss-scale decision over the same gradient (an inf in it now and then)
    grad = s["grad"]
    if c.pick("inf_in_grad", (False, False, False, True)):
        grad[c.rng.randrange(n)] = float("inf") if c.rng.random() < 0.5 else float("nan")
    norm = adam_op.GRAD_NORM_ROUTE.pick(grad)(grad)
    if torch.isfinite(grad.float()).all():
        c.relative("grad_norm", norm, adam_op.grad_norm_reference(grad.double()), 1e-5)
    else:
        c.equal("grad_norm_non_finite", torch.isfinite(norm), torch.zeros((), dtype=torch.bool, device=c.device))
    factor, max_norm = 1 / 300.0, c.pick("max_norm", (0.0, 0.5, 1e9))
    window, floor = c.pick("scale_window", (0, 4)), c.pick("scale_floor", (0.0, 512.0, 1000.0))
    state = ops.new_scaler_state(1024.0, c.device)
    state[adam_op.GOOD_STEPS], state[adam_op.STEP] = c.rng.randint(0, 3), 5
    ref_state = state.double().clone()
    adam_op.SCALED_GRAD_NORM_ROUTE.pick(grad)(grad, state, factor, max_norm, float(window), floor)
    adam_op.scaled_grad_norm_reference(grad.double(), ref_state, factor, max_norm, window, floor)
    slots = [adam_op.LOSS_SCALE, adam_op.GOOD_STEPS, adam_op.OVERFLOW, adam_op.STEP]
    c.equal("scaler_slots", state[slots].double(), ref_state[slots])
    c.equal("block_counter", state[-1], torch.zeros((), device=c.device))
    if torch.isfinite(grad.float()).all():
        for slot, name in ((adam_op.GRAD_NORM, "scaled_norm"), (adam_op.GRAD_SCALE, "grad_scale")):
            c.relative(name, state[slot], ref_state[slot], 1e-5)


def case_beam_select(c):
    """beam_select against its reference, exactly (values and indices), and torch.topk's values."""
    dtype = c.dtype()
    k = c.dim(16, (4, 5, 8, 10))
    M = max(k, c.dim(200000, (4 * 32000, 5 * 32000, 32000, 4 * 8000)))
    R = c.rows_for(M, 256)
    groups = c.pick("groups", (1, 8, 32, 128))
    values = c.pick("values", ("distinct", "ties", "some -inf"))
    off = c.offset()
    c.params.update(R=R, M=M, k=k)
    scores = c.tensor((R, M), dtype, 4.0, -10.0, off)
    if values == "ties":  # few distinct values: the order among equal ones decides
        scores = (scores * 2).round() / 2
    elif values == "some -inf":
        scores = scores.masked_fill(torch.rand(R, M, device=c.device) < 0.5, float("-inf"))
    fill_free_memory(c)
    got_v, got_i = beam_select(scores, k, groups)
    ref_v, ref_i = beam_select_reference(scores, k, groups)
    c.equal("values", got_v, ref_v)
    c.equal("indices", got_i, ref_i)
    c.equal("values_as_topk", got_v, scores.topk(k, dim=1).values)



def case_beam_scores(c):
    """beam_scores against its reference in fp64 (the error rule on the finite scores, the -inf ones
    exactly where the reference has them); the step on the device half the time."""
    dtype = c.dtype()
    V = c.dim(60000, (8000, 32000, 44001, 5))
    R = c.rows_for(V, 2048)
    pad, unk, eos = (c.rng.randrange(V) for _ in range(3))
    min_len, t = c.rng.randrange(4), c.rng.randrange(4)
    c.params.update(R=R, V=V, pad=pad, unk=unk, eos=eos, min_len=min_len, t=t)
    logits = c.tensor((R, V), dtype, 4.0)
    cum = c.tensor((R,), torch.float32, 5.0, -5.0)
    step = torch.tensor(t, device=c.device) if c.pick("step_on_device", (False, True)) else t
    fill_free_memory(c)
    out = beam_scores(logits, cum, step, pad, unk, 0.5, eos, min_len)
    ref64 = beam_scores_reference(logits.double(), cum.double(), t, pad, unk, 0.5, eos, min_len)
    low = beam_scores_reference(logits, cum, t, pad, unk, 0.5, eos, min_len)
    barred = ref64.isinf()
    c.equal("-inf", out.isinf(), barred)
    c.kernel("scores", out.masked_fill(barred, 0.0), ref64.masked_fill(barred, 0.0), low.masked_fill(barred, 0.0))


def case_beam_advance(c):
    """beam_advance against its reference: the state after the step exactly (the finished scores
    within 1e-6), the finished buffers' discard slot aside."""
    from types import SimpleNamespace

    k = c.dim(32, (1, 4, 5, 8))
    L = c.dim(2048, (64, 128, 129, 201, 256))
    B = c.rows_for(k * (L + 1) * 4, 256)
    V = c.dim(40000, (8000, 32000))
    eos = min(2, V - 1)
    normalize, advance = c.pick("normalize", (True, False)), c.pick("advance", (True, True, False))
    eos_rate = c.pick("eos_rate", (0.0, 0.2, 0.6, 1.0))
    c.params.update(B=B, k=k, L=L, V=V)
    N, dev = B * k, c.device
    done = torch.rand(B, device=dev) < 0.2
    state = dict(tokens=torch.randint(0, V, (N, L + 1), device=dev), scores=torch.randn(N, L, device=dev),
                 cum=torch.randn(N, device=dev), done=done,
                 count=torch.where(done, k, torch.randint(0, k, (B,), device=dev)),
                 fin_tokens=torch.randint(0, V, (B, k + 1, L), device=dev),
                 fin_positional=torch.randn(B, k + 1, L, device=dev), fin_score=torch.randn(B, k + 1, device=dev),
                 fin_length=torch.randint(0, L + 1, (B, k + 1), device=dev))
    values = torch.randn(B, 2 * k, device=dev).sort(dim=1, descending=True).values
    values = values.masked_fill(torch.rand(B, 2 * k, device=dev) < 0.1, float("-inf"))
    tokens = torch.where(torch.rand(B, 2 * k, device=dev) < eos_rate, eos, torch.randint(0, V, (B, 2 * k), device=dev))
    indices = torch.randint(0, k, (B, 2 * k), device=dev) * V + tokens
    t = torch.randint(0, L, (), device=dev)
    got, ref = SimpleNamespace(**{n: x.clone() for n, x in state.items()}), {n: x.clone() for n, x in state.items()}
    got_parents, ref_parents = torch.zeros(N, dtype=torch.long, device=dev), torch.zeros(N, dtype=torch.long, device=dev)
    fill_free_memory(c)
    beam_advance(values, indices, t, got, got_parents, eos, 1, V, 0.6, normalize, advance)
    beam_advance_reference(values, indices, t, *(ref[n] for n in BEAM_STATE), ref_parents, eos, 1, V, 0.6, normalize,
                           advance)
    for name in BEAM_STATE:
        a, b = getattr(got, name), ref[name]
        if name.startswith("fin_"):
            a, b = a[:, :-1], b[:, :-1]
        if name == "fin_score":  # the length penalty's pow may differ by an ulp between devices
            c.relative(name, a, b, 1e-6)
        else:  # copies of values and tokens: exact, -inf included
            c.equal(name, a, b)
    c.equal("parents", got_parents, ref_parents)


def case_decode_attention(c):
    """decode_attention over a cache read through a random origin table (positions from random slots,
    more rows and slots than hypotheses), q as split_heads leaves it; lengths past one 1,024 chunk; two
    thirds of the cases also give the step's k and v, which the kernel writes into the cache and attends
    to, half of those as the qkv projection's output without its bias, which the kernel adds."""
    dtype = c.dtype()
    D = c.pick("D", (32, 64, 128, 256))
    H = c.dim(16, (4, 8, 16))
    T = c.dim(2048, (1, 30, 200, 1024, 1025))
    layers = c.dim(6, (1, 6))
    layer = c.rng.randrange(layers)
    N = c.rows_for(2 * T * H * D, 512)
    slots = N + c.dim(8)
    c.params.update(N=N, H=H, T=T, layers=layers, layer=layer, slots=slots)
    qkv = c.tensor((3, N, 1, H, D), dtype)
    q = (qkv[0] * D**-0.5).transpose(1, 2)
    cache = c.tensor((T + 2, 2 * layers, slots, H, D), dtype)
    origin = torch.randint(0, slots, (N + c.dim(3) - 1, T + c.dim(4) - 1), dtype=torch.int32, device=c.device)
    step = c.pick("step_kv", ("none", "kv", "kv+bias"))
    given, raw_q = (), q
    if step != "none":  # the generator's step: position T - 1 of hypothesis n in slot n, written by the call
        origin[:N, T - 1] = torch.arange(N, dtype=torch.int32, device=c.device)
        k, v = qkv[1].transpose(1, 2), qkv[2].transpose(1, 2)
        given = (k, v)
        if step == "kv+bias":  # the qkv projection's [N, 3 x d] rows without their bias, as the generator's
            bias = c.tensor((3 * H * D,), dtype)
            raw_q, k, v = c.tensor((N, 1, 3 * H * D), dtype).view(N, 3, H, 1, D).unbind(1)
            given = (k, v, bias, D**-0.5)
            q, k, v = add_bias(raw_q, k, v, bias, D**-0.5)  # what the op attends with and writes
        written = cache.clone()
        written[T - 1, 2 * layer, :N], written[T - 1, 2 * layer + 1, :N] = k[:, :, 0], v[:, :, 0]
    fill_free_memory(c)
    out = decode_attention(raw_q, cache, layer, origin, T, *given)
    if step != "none":
        c.equal("cache", cache, written)
    ref64 = decode_attention_reference(q.double(), cache.double(), layer, origin, T)
    keys, values = gather_history(cache, layer, origin[:N], T)
    low = torch.nn.functional.scaled_dot_product_attention(q, keys, values, scale=1.0) if c.device != "cpu" else \
        decode_attention_reference(q, cache, layer, origin, T)
    c.kernel("out", out, ref64, low)


def case_beam_attention(c):
    """beam_attention as the generator calls it (the query projection's output as a view, its bias and
    the scaling) over one sentence's keys and values for all its beams; left padding of random
    lengths, none, or a sentence of only padding; beams past one warp's four, sources past one chunk
    of 32 keys."""
    dtype = c.dtype()
    D = c.pick("D", (32, 64, 128, 256))
    H = c.dim(16, (4, 8, 16))
    S = c.dim(1100, (1, 21, 32, 33, 200))
    beams = c.pick("beams", (1, 2, 4, 5, 9))
    B = c.rows_for(2 * S * H * D, 128)
    c.params.update(B=B, H=H, S=S, beams=beams, D=D)
    q = c.tensor((B, beams, H, D), dtype).transpose(1, 2)
    bias = c.tensor((H * D,), dtype)
    kv = c.tensor((2, B, H, S, D), dtype)
    padding = c.pick("padding", ("left", "left", "none", "left_with_empty"))
    lengths = torch.tensor([S if padding == "none" else c.rng.randint(1, S) for _ in range(B)], device=c.device)
    if padding == "left_with_empty":  # a sentence of only padding: zeros, as ops.attention gives
        lengths[c.rng.randrange(B)] = 0
    pad = torch.arange(S, device=c.device)[None, :] < S - lengths[:, None]
    mask = None if padding == "none" else ops.AttentionMask(pad)
    fill_free_memory(c)
    out = beam_attention(q, kv[0], kv[1], mask, bias, D**-0.5)
    sq = scaled_query(q, bias, D**-0.5)
    ref64 = beam_attention_reference(sq.double(), kv[0].double(), kv[1].double(), mask)
    # torch's attention in the same precision; its NaN rows (a sentence of only padding) are the zeros
    # the op's contract gives there
    low = F.scaled_dot_product_attention(sq, kv[0], kv[1], attn_mask=~pad[:, None, None, :],
                                         scale=1.0).nan_to_num(0.0) if c.device != "cpu" else \
        beam_attention_reference(sq, kv[0], kv[1], mask)
    c.kernel("out", out, ref64, low)

def case_fp8_cast(c):
    """fp8_cast against its reference, bit for bit (NaN where the reference has NaN): both layouts or
    one, odd sizes, an unaligned x, inf and NaN among the values, an empty or a full amax history."""
    dtype = c.dtype()
    cols = c.dim(8192, (1024, 4096, 64, 63))
    rows = c.rows_for(cols, 65536)
    e5m2 = c.pick("e5m2", (False, True))
    layouts = c.pick("layouts", ("r", "r", "t", "rt"))
    history = c.pick("history", ("empty", "full"))
    c.params.update(rows=rows, cols=cols)
    x = c.tensor((rows, cols), dtype, 10.0 ** c.rng.uniform(-4, 3), offset=c.offset())
    flat = x.view(-1)
    for value in c.rng.sample((float("inf"), float("-inf"), float("nan"), 1e30, 0.0), c.rng.randint(0, 3)):
        flat[c.rng.randrange(flat.numel())] = value
    state = torch.zeros(c.rng.randint(1, 20) + 2, device=c.device)
    if history == "full":
        state[:-2] = torch.rand(state.numel() - 2, device=c.device) * 10.0 ** c.rng.uniform(-6, 4)
    state[-2] = c.rng.random()
    ref_state = state.clone()
    fill_free_memory(c)
    got = fp8_cast(x, state, e5m2, "r" in layouts, "t" in layouts)
    ref = fp8_cast_reference(x, ref_state, e5m2, "r" in layouts, "t" in layouts)
    for name, a, b in zip(("q", "qT"), got, ref):
        nan = b.float().isnan()
        c.equal(name + " NaN", a.float().isnan(), nan)
        c.equal(name, a.view(torch.uint8)[~nan], b.view(torch.uint8)[~nan])
    c.equal("state", state, ref_state)


CASES = {
    "embedding": case_embedding,
    "qkv": case_qkv,
    "softmax": case_softmax,
    "attention": case_attention,
    "segment_attention": case_segment_attention,
    "bias_dropout_residual": case_bias_dropout_residual,
    "bias_dropout_residual_layer_norm": case_bias_dropout_residual_layer_norm,
    "bias_act_dropout": case_bias_act_dropout,
    "layer_norm": case_layer_norm,
    "cross_entropy": case_cross_entropy,
    "adam": case_adam,
    "beam_select": case_beam_select,
    "beam_scores": case_beam_scores,
    "beam_advance": case_beam_advance,
    "decode_attention": case_decode_attention,
    "beam_attention": case_beam_attention,
    "fp8_cast": case_fp8_cast,
}
assert tuple(CASES) == dispatch.OPS, "fuzz every op of dispatch.OPS, in its order"


def case_seed(seed, op, index):
    """Each case's own seed, from the run's seed, the op and the case's index (for a replay)."""
    return (seed * 1_000_003 + dispatch.OPS.index(op) * 7_919_993 + index) % 2**32


def run_case(seed, op, index, device, max_elements):
    c = Case(case_seed(seed, op, index), device, max_elements)
    try:
        CASES[op](c)
        error = None
    except Exception as e:  # a kernel that raises on a valid case is a failure too
        error = "{}: {}".format(type(e).__name__, str(e).strip().splitlines()[0] if str(e).strip() else "")
        c.params["traceback"] = traceback.format_exc(limit=4)
    ratio = max((r for r, _ in c.checks.values()), default=0.0)
    if math.isnan(ratio):
        ratio = float("inf")
    failed = [m for r, m in c.checks.values() if not r <= 1]
    return dict(op=op, case=index, params=c.params, ratio=ratio, error=error, failed=failed,
                mismatch=bool(error or failed), checks={k: r for k, (r, _) in c.checks.items()})


def fuzz(args, names, max_elements, out_dir):
    """Each op of ``names`` in turn, in this process: {op: its results}; logs into ``out_dir``."""
    start = time.monotonic()
    results = {}
    log = open(os.path.join(out_dir, "fuzz.log"), "w")
    with open(os.path.join(out_dir, "cases.jsonl"), "w") as cases_log:
        for i, op in enumerate(names):
            # each op's share of what is left, so an op that finishes early leaves its time to the next
            deadline = time.monotonic() + (args.budget_s - (time.monotonic() - start)) / (len(names) - i)
            shard, shards = args.shard
            indices = [args.case] if args.case is not None else range(shard, args.cases, shards)
            r = dict(cases=0, mismatches=0, worst_ratio=0.0, worst_case=None, failures=[], stopped_by_budget=False)
            op_start = time.monotonic()
            for index in indices:
                if r["cases"] and time.monotonic() > deadline:
                    r["stopped_by_budget"] = True
                    break
                res = run_case(args.seed, op, index, args.device, max_elements)
                r["cases"] += 1
                cases_log.write(json.dumps(res, default=str) + "\n")
                if res["ratio"] >= r["worst_ratio"]:
                    r["worst_ratio"], r["worst_case"] = res["ratio"], index
                if res["mismatch"]:
                    r["mismatches"] += 1
                    failure = dict(case=index, params={k: v for k, v in res["params"].items() if k != "traceback"},
                                   error=res["error"], failed=res["failed"], replay=replay_command(args, op, index))
                    if len(r["failures"]) < 20:
                        r["failures"].append(failure)
                    line = "MISMATCH {} case {}: {} {}\n  params {}\n  replay: {}".format(
                        op, index, res["error"] or "", "; ".join(res["failed"]), json.dumps(failure["params"]),
                        failure["replay"])
                    print(line, flush=True)
                    log.write(line + "\n" + res["params"].get("traceback", "") + "\n")
            if args.device != "cpu":
                torch.cuda.synchronize()
            r["seconds"] = round(time.monotonic() - op_start, 2)
            results[op] = r
            line = "{}: {} cases in {:.1f}s, {} mismatches, worst ratio {:.3g} (case {}){}".format(
                op, r["cases"], r["seconds"], r["mismatches"], r["worst_ratio"], r["worst_case"],
                ", stopped by the budget" if r["stopped_by_budget"] else "")
            print(line, flush=True)
            log.write(line + "\n")
    log.close()
    return results


def fuzz_in_workers(args, names, max_elements, out_dir):
    """The ops split over ``args.jobs`` processes of this script side by side, or, with fewer ops than
    processes, every op's cases split among them by index (the cases are drawn from the run's seed, the
    op and the index, so they are the same cases however they are split), each process with the whole
    budget; their logs joined into ``out_dir``: {op: its results, summed over the processes}."""
    import subprocess

    if len(names) >= args.jobs:
        groups = [(names[i :: args.jobs], "0/1") for i in range(args.jobs)]
    else:
        groups = [(names, "{}/{}".format(i, args.jobs)) for i in range(args.jobs)]
    for name in ("cases.jsonl", "fuzz.log"):
        open(os.path.join(out_dir, name), "w").close()
    procs = []
    for i, (group, shard) in enumerate(groups):
        cmd = [sys.executable, os.path.abspath(__file__), "--seed", str(args.seed), "--cases", str(args.cases),
               "--ops", ",".join(group), "--budget-s", str(args.budget_s), "--device", args.device,
               "--max-elements", str(max_elements), "--shard", shard,
               "--out", os.path.join(out_dir, "worker{}".format(i))]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    found = {}
    for i, proc in enumerate(procs):
        output = proc.communicate()[0]
        part = os.path.join(out_dir, "worker{}".format(i))
        try:
            with open(os.path.join(part, "results.json")) as f:
                for op, r in json.load(f)["ops"].items():
                    found[op] = merged(found[op], r) if op in found else r
        except (OSError, ValueError):
            raise SystemExit("fuzz_ops: worker {} ({}) wrote no results (exit {}):\n{}".format(
                i, ",".join(groups[i][0]), proc.returncode, output[-3000:]))
        print("".join(line + "\n" for line in output.splitlines() if line.startswith(("MISMATCH", "  "))), end="")
        for name in ("cases.jsonl", "fuzz.log"):
            with open(os.path.join(part, name)) as src, open(os.path.join(out_dir, name), "a") as dst:
                dst.write(src.read())
    for op in names:  # the order asked for
        r = found[op]
        print("{}: {} cases in {:.1f}s, {} mismatches, worst ratio {:.3g} (case {}){}".format(
            op, r["cases"], r["seconds"], r["mismatches"], r["worst_ratio"], r["worst_case"],
            ", stopped by the budget" if r["stopped_by_budget"] else ""), flush=True)
    return {op: found[op] for op in names}


def merged(a, b):
    """One op's results from two processes that ran different cases of it."""
    worst = a if a["worst_ratio"] >= b["worst_ratio"] else b
    return dict(cases=a["cases"] + b["cases"], mismatches=a["mismatches"] + b["mismatches"],
                worst_ratio=worst["worst_ratio"], worst_case=worst["worst_case"],
                failures=(a["failures"] + b["failures"])[:20],
                stopped_by_budget=a["stopped_by_budget"] or b["stopped_by_budget"],
                seconds=max(a["seconds"], b["seconds"]))


def shard_arg(text):
    """``i/n``: this process runs the case indices congruent to i modulo n."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError("--shard {}: expected i/n, e.g. 0/4".format(text))
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError("--shard {}: i must be in 0..n-1".format(text))
    return i, n


def replay_command(args, op, index):
    return "python3 scripts/fuzz_ops.py --seed {} --ops {} --case {} --device {}".format(args.seed, op, index,
                                                                                        args.device)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=None, help="the run's seed (default: a new one, printed)")
    parser.add_argument("--cases", type=int, default=1000, help="cases per op")
    parser.add_argument("--ops", default=",".join(CASES), help="ops to fuzz, comma-separated")
    parser.add_argument("--case", type=int, default=None, help="run only this case index (a replay)")
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="wall-clock seconds for all ops; each op stops at its share and reports the cases run")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda: the kernels; cpu: the references on both sides (a smoke test)")
    parser.add_argument("--max-elements", type=int, default=None,
                        help="largest tensor of a case (default 2^21 on the GPU, 2^13 on the CPU)")
    parser.add_argument("--out", default=None, help="folder for the logs (default $OUT/fuzz_ops)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="processes side by side, each with the whole --budget-s: the ops split among them, "
                             "or with fewer ops than processes, each op's cases")
    parser.add_argument("--shard", type=shard_arg, default=(0, 1),
                        help="i/n: run only the case indices congruent to i modulo n (set by --jobs)")
    args = parser.parse_args()
    if args.seed is None:
        args.seed = int.from_bytes(os.urandom(4), "little")
    names = [n.strip() for n in args.ops.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if args.jobs < 1:
        parser.error("--jobs {}: at least 1".format(args.jobs))
    if unknown:
        parser.error("unknown op(s) {}; known: {}".format(", ".join(unknown), ", ".join(CASES)))
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA GPU here")
        if dispatch.extension() is None:
            parser.error("the CUDA extension did not load ({}): build it with python3 setup.py build_ext "
                         "--inplace".format(dispatch.extension_error()))
        if os.environ.get("LS_FAIRSEQ_REFERENCE", "").strip():
            parser.error("LS_FAIRSEQ_REFERENCE is set: the ops would run their references, not the kernels")
    max_elements = args.max_elements or (1 << 21 if args.device != "cpu" else 1 << 13)
    out_dir = args.out or os.path.join(os.environ.get("OUT") or tempfile.mkdtemp(prefix="fuzz_ops_"), "fuzz_ops")
    os.makedirs(out_dir, exist_ok=True)
    print("fuzz_ops: seed {} (--seed {} replays), {} cases per op, budget {:.0f}s, device {}, logs in {}".format(
        args.seed, args.seed, args.cases if args.case is None else 1, args.budget_s, args.device, out_dir), flush=True)
    start = time.monotonic()
    if args.jobs > 1 and args.case is None:
        results = fuzz_in_workers(args, names, max_elements, out_dir)
    else:
        results = fuzz(args, names, max_elements, out_dir)
    summary = dict(seed=args.seed, device=args.device, cases_per_op=args.cases, budget_s=args.budget_s,
                   max_elements=max_elements, seconds=round(time.monotonic() - start, 1), ops=results,
                   gpu=torch.cuda.get_device_name() if args.device != "cpu" else None)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print("\nfuzz_ops: seed {}, {:.0f}s; error ratio = error / what the rule allows (mismatch above 1)".format(
        args.seed, summary["seconds"]))
    print("{:<34} {:>6} {:>10} {:>12}".format("op", "cases", "mismatches", "worst ratio"))
    for op, r in results.items():
        print("{:<34} {:>6} {:>10} {:>12.3g}{}".format(op, r["cases"], r["mismatches"], r["worst_ratio"],
                                                        "  (budget)" if r["stopped_by_budget"] else ""))
    return 1 if any(r["mismatches"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
