"""Time every GEMM of a transformer-big training step, in bf16, fp16 and FP8 (GPU).

The GEMMs are those ls_transformer_vaswani_wmt_en_de_big runs in one step (d 1024, FFN 4096,
6 + 6 post-LN layers, the recipe's joined 32k vocabulary, shared embeddings), each called the
way ls_fairseq.ops.linear calls it:

  forward  y[M, N] = x[M, K] @ W[N, K]^T           F.linear(x, W)
  dgrad    dx[M, K] = dy[M, N] @ W[N, K]            dy.matmul(W); addmm_(dy, W) into the residual's
                                                    gradient (beta = 1) where the GEMM starts a
                                                    post-LN block (qkv, cross-attention q, fc1)
  wgrad    dW[N, K] += dy[M, N]^T @ x[M, K]         weight.grad.addmm_(dy.t(), x) (ls_adam's workspace)

with M the tokens (target tokens for the decoder, source tokens, by --src-per-tgt, for the
encoder and the decoder's one GEMM of every layer's cross-attention keys and values). Each
shape is also timed as torch._scaled_mm: per-tensor scales, bf16 output, the operands in the
layout it needs (A row-major, B column-major: the dgrad needs W^T and the wgrad dy^T and x^T
as FP8 copies), weights and activations e4m3, gradients e4m3 or e5m2; and fc1's forward as
torch._addmm_activation (bias + ReLU in cuBLASLt's epilogue). Beside each FP8 GEMM: what
producing its FP8 operands with plain torch ops costs (current scaling: amax, scale, cast,
transposed where needed) and, where the model accumulates (beta = 1), the add _scaled_mm's
output then needs: the work a --ls-fp8 without fused casts would add.

Timing: CUDA events around each call, after warm-up; the median of --reps calls, each after
a 256 MiB buffer is zeroed (L2 flushed, the operands start in HBM as in a training step;
--no-flush keeps them warm); a GPU sleep first so that the host queues every call ahead of
the GPU and no launch gap falls between the events. Shapes shared by several GEMMs are
timed once.

  python scripts/bench_gemms.py [--tokens 8192 16384] [--reps 50] [--no-flush]   # writes $OUT/gemms.{json,md}
  python scripts/bench_gemms.py --device cpu --tiny                              # smoke run of the table
"""
import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
FLUSH_BYTES = 256 << 20
SLEEP_CYCLES_PER_REP = 100_000  # ~50 us at the H200's clock: more than the host needs to queue a call


@dataclass
class Gemm:
    """One GEMM of the step: C[m, n] (+)= A[m, k] @ B[k, n] in the model's call ``call``."""
    name: str
    phase: str  # fwd, dgrad, wgrad
    m: int
    n: int
    k: int
    count: int  # calls a step
    call: str  # linear, matmul, addmm_, addmm_t (the wgrad's addmm_(dy.t(), x))
    layout: str

    @property
    def accumulates(self):
        return self.call in ("addmm_", "addmm_t")

    @property
    def flops(self):
        return 2 * self.m * self.n * self.k


def linear_gemms(name, tokens, n_in, n_out, count, residual_start):
    """Forward, input gradient and weight gradient of ops.linear(x [tokens, n_in], W [n_out, n_in])."""
    return [
        Gemm(name, "fwd", tokens, n_out, n_in, count, "linear", "x @ W^T"),
        Gemm(name, "dgrad", tokens, n_in, n_out, count, "addmm_" if residual_start else "matmul", "dy @ W"),
        Gemm(name, "wgrad", n_out, n_in, tokens, count, "addmm_t", "dy^T @ x"),
    ]


def step_gemms(tokens, src_tokens, dim=1024, ffn=4096, encoder_layers=6, decoder_layers=6, vocab=32000):
    """Every GEMM of one ls_transformer training step (post-LN: each block's first GEMM accumulates
    the residual's gradient in its dgrad, ops.residual)."""
    e, d = encoder_layers, decoder_layers
    blocks = [
        ("enc.qkv", src_tokens, dim, 3 * dim, e, True),
        ("enc.out", src_tokens, dim, dim, e, False),
        ("enc.fc1", src_tokens, dim, ffn, e, True),
        ("enc.fc2", src_tokens, ffn, dim, e, False),
        ("dec.self_qkv", tokens, dim, 3 * dim, d, True),
        ("dec.self_out", tokens, dim, dim, d, False),
        ("dec.cross_q", tokens, dim, dim, d, True),
        ("dec.cross_kv", src_tokens, dim, 2 * d * dim, 1, False),  # every layer's k, v in one GEMM
        ("dec.cross_out", tokens, dim, dim, d, False),
        ("dec.fc1", tokens, dim, ffn, d, True),
        ("dec.fc2", tokens, ffn, dim, d, False),
        ("vocab", tokens, dim, vocab, 1, False),
    ]
    return [g for b in blocks for g in linear_gemms(*b)]


class Timer:
    """Median time in ms of fn() over reps calls: CUDA events on a GPU, perf_counter on a CPU."""

    def __init__(self, device, reps, warmup, flush):
        self.device, self.reps, self.warmup = device, reps, warmup
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if flush and self.cuda else None

    def __call__(self, fn):
        for _ in range(self.warmup):
            fn()
        if not self.cuda:
            times = []
            for _ in range(self.reps):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1000.0)
            return statistics.median(times)
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        torch.cuda._sleep(SLEEP_CYCLES_PER_REP * self.reps)
        for start, end in zip(starts, ends):
            if self.flush is not None:
                self.flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def rand(shape, dtype, device):
    return torch.randn(*shape, device=device).to(dtype)


def cast_fp8(t, fmt, transpose):
    """t as FP8 with current per-tensor scaling, made with torch ops (amax, scale, one cast that
    also transposes): (FP8 tensor, contiguous; its dequantisation scale)."""
    amax = t.abs().amax().float().clamp(min=1e-12)
    scale = FP8_MAX[fmt] / amax
    src = t.t() if transpose else t
    out = torch.empty(src.shape, dtype=fmt, device=t.device)
    out.copy_(src * scale.to(t.dtype))
    return out, scale.reciprocal()


class Bench:
    def __init__(self, timer, device):
        self.timer, self.device, self.memo = timer, device, {}

    def once(self, key, measure):
        if key not in self.memo:
            self.memo[key] = measure()
        return self.memo[key]

    def model_call(self, g, dtype):
        """ms of g as the model calls it, in dtype."""
        def measure():
            dev = self.device
            if g.call == "linear":  # x [m, k], W [n, k]
                x, w = rand((g.m, g.k), dtype, dev), rand((g.n, g.k), dtype, dev)
                return self.timer(lambda: F.linear(x, w))
            if g.call in ("matmul", "addmm_"):  # dy [m, k], W [k, n]
                dy, w = rand((g.m, g.k), dtype, dev), rand((g.k, g.n), dtype, dev)
                if g.call == "matmul":
                    return self.timer(lambda: dy.matmul(w))
                into = rand((g.m, g.n), dtype, dev)
                return self.timer(lambda: into.addmm_(dy, w))
            dy, x = rand((g.k, g.m), dtype, dev), rand((g.k, g.n), dtype, dev)  # addmm_t: dy [tokens, m]
            into = rand((g.m, g.n), dtype, dev)
            return self.timer(lambda: into.addmm_(dy.t(), x))
        return self.once(("model", dtype, g.m, g.n, g.k, g.call), measure)

    def scaled_mm(self, g, a_fmt, b_fmt, fast_accum=False):
        """ms of torch._scaled_mm on g's shape: A [m, k] row-major in a_fmt, B [k, n] column-major
        (stored [n, k]) in b_fmt, bf16 output; None where this torch refuses it."""
        def measure():
            a, b = rand((g.m, g.k), a_fmt, self.device), rand((g.n, g.k), b_fmt, self.device)
            one = torch.ones((), device=self.device)
            try:
                return self.timer(lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16,
                                                           use_fast_accum=fast_accum))
            except (RuntimeError, NotImplementedError) as e:
                print("bench_gemms: _scaled_mm {} x {} on {}: {}".format(a_fmt, b_fmt, (g.m, g.n, g.k), e))
                return None
        return self.once(("scaled_mm", a_fmt, b_fmt, fast_accum, g.m, g.n, g.k), measure)

    def fp8_operands(self, g, grad_fmt):
        """(A's, B's) source in the model (bf16 tensor shape, transposed?, format) for g as _scaled_mm."""
        if g.phase == "fwd":  # x [m, k], W [n, k]: both as they are
            return ((g.m, g.k), False, E4M3), ((g.n, g.k), False, E4M3)
        if g.phase == "dgrad":  # dy [m, k] as it is; W [k, n] stored transposed as [n, k]
            return ((g.m, g.k), False, grad_fmt), ((g.k, g.n), True, E4M3)
        return ((g.k, g.m), True, grad_fmt), ((g.k, g.n), True, E4M3)  # wgrad: dy^T and x^T copies

    def fp8_prep(self, g, grad_fmt):
        """ms of making g's FP8 operands from bf16 with torch ops, plus the add of the output into
        the accumulator where the model's GEMM accumulates (beta = 1, which _scaled_mm lacks)."""
        total = 0.0
        for shape, transpose, fmt in self.fp8_operands(g, grad_fmt):
            def measure(shape=shape, transpose=transpose, fmt=fmt):
                t = rand(shape, torch.bfloat16, self.device)
                return self.timer(lambda: cast_fp8(t, fmt, transpose))
            total += self.once(("cast", shape, transpose, fmt), measure)
        if g.accumulates:
            def measure_add():
                into, c = rand((g.m, g.n), torch.bfloat16, self.device), rand((g.m, g.n), torch.bfloat16, self.device)
                return self.timer(lambda: into.add_(c))
            total += self.once(("add", g.m, g.n), measure_add)
        return total

    def addmm_activation(self, g, dtype):
        """fc1's forward with bias and ReLU: cuBLASLt's epilogue, and addmm then relu_."""
        def measure():
            x, w, bias = rand((g.m, g.k), dtype, self.device), rand((g.n, g.k), dtype, self.device), rand((g.n,), dtype, self.device)
            return dict(epilogue=self.timer(lambda: torch._addmm_activation(bias, x, w.t())),
                        addmm_relu=self.timer(lambda: torch.addmm(bias, x, w.t()).relu_()))
        return self.once(("addmm_act", dtype, g.m, g.n, g.k), measure)


def tflops(flops, ms):
    return None if ms is None or ms <= 0 else flops / ms / 1e9


def measure_rows(bench, gemms):
    rows = []
    for g in gemms:
        r = asdict(g)
        r.update(flops=g.flops, accumulates=g.accumulates)
        for label, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            r[label + "_ms"] = bench.model_call(g, dtype)
        r["e4m3_ms"] = bench.scaled_mm(g, E4M3, E4M3)
        r["e4m3_prep_ms"] = bench.fp8_prep(g, E4M3)
        if g.phase == "fwd":
            r["e4m3_fast_ms"] = bench.scaled_mm(g, E4M3, E4M3, fast_accum=True)
            if g.name.endswith("fc1"):
                for label, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
                    act = bench.addmm_activation(g, dtype)
                    r[label + "_bias_relu_epilogue_ms"] = act["epilogue"]
                    r[label + "_addmm_relu_ms"] = act["addmm_relu"]
        else:  # the gradient dy in e5m2 (A of both: dy, dy^T), the other operand e4m3
            r["e5m2_ms"] = bench.scaled_mm(g, E5M2, E4M3)
            r["e5m2_prep_ms"] = bench.fp8_prep(g, E5M2)
        for key in [k for k in r if k.endswith("_ms") and "prep" not in k]:
            r[key[:-3] + "_tflops"] = tflops(g.flops, r[key])
        rows.append(r)
    return rows


def fp8_ms(r, grad):
    """The row's FP8 GEMM time: e4m3 forward; grad ('e4m3' or 'e5m2') for the gradients' GEMMs."""
    return r["e4m3_ms"] if r["phase"] == "fwd" else r[grad + "_ms"]


def fp8_prep_ms(r, grad):
    return r["e4m3_prep_ms"] if r["phase"] == "fwd" else r[grad + "_prep_ms"]


def summarise(rows):
    """Per-step sums, shares and the FP8 scenarios' savings against bf16 and fp16."""
    total = {dt: sum(r["count"] * r[dt + "_ms"] for r in rows) for dt in ("bf16", "fp16")}
    for r in rows:
        for dt in ("bf16", "fp16"):
            r[dt + "_step_ms"] = r["count"] * r[dt + "_ms"]
            r[dt + "_share"] = r[dt + "_step_ms"] / total[dt]
        e4 = r["e4m3_ms"]
        r["e4m3_speedup_vs_bf16"] = r["bf16_ms"] / e4 if e4 else None
        r["e4m3_speedup_vs_fp16"] = r["fp16_ms"] / e4 if e4 else None
        if "e5m2_ms" in r:
            r["e5m2_speedup_vs_bf16"] = r["bf16_ms"] / r["e5m2_ms"] if r["e5m2_ms"] else None
    out = dict(gemm_tflop_per_step=sum(r["count"] * r["flops"] for r in rows) / 1e12,
               bf16_step_ms=total["bf16"], fp16_step_ms=total["fp16"], scenarios={})
    for scope, phases in (("fwd+dgrad", ("fwd", "dgrad")), ("fwd+dgrad+wgrad", ("fwd", "dgrad", "wgrad"))):
        for grad in ("e4m3", "e5m2"):
            picked = [r for r in rows if r["phase"] in phases]
            if any(fp8_ms(r, grad) is None for r in picked):
                continue
            gemm = sum(r["count"] * fp8_ms(r, grad) for r in picked)
            prep = sum(r["count"] * fp8_prep_ms(r, grad) for r in picked)
            for dt in ("bf16", "fp16"):
                rest = sum(r["count"] * r[dt + "_ms"] for r in rows if r["phase"] not in phases)
                out["scenarios"]["{} fp8 (grads {}) vs {}".format(scope, grad, dt)] = dict(
                    step_ms=gemm + rest, saved_ms=total[dt] - gemm - rest, prep_ms=prep,
                    saved_with_torch_casts_ms=total[dt] - gemm - rest - prep)
    fc1 = [r for r in rows if "bf16_bias_relu_epilogue_ms" in r]
    for dt in ("bf16", "fp16"):
        out[dt + "_fc1_epilogue_vs_addmm_relu_saved_ms"] = sum(
            r["count"] * (r[dt + "_addmm_relu_ms"] - r[dt + "_bias_relu_epilogue_ms"]) for r in fc1)
    return out


def fmt(x, spec="{:.3f}"):
    return "-" if x is None else spec.format(x)


def fmt_tf(x):
    """TFLOP/s: whole numbers, two significant digits below 10 (the CPU's smoke run)."""
    return "-" if x is None else "{:.0f}".format(x) if x >= 10 else "{:.2g}".format(x)


def markdown(result):
    lines = ["# GEMMs of a transformer-big training step", "",
             "{device}, torch {torch}; {timing}".format(**result["meta"]), "",
             "ms: median per call; TF/s: 2mnk over it; step ms: count x bf16 ms; share: of the step's "
             "summed bf16 GEMM time; x: bf16 ms over _scaled_mm's (e4m3 operands; for the gradients' GEMMs "
             "also dy in e5m2); fast-accum: e4m3 forward with use_fast_accum; prep: torch-op FP8 casts of the operands (+ the beta = 1 add) a call; "
             "fc1 fwd epilogue: _addmm_activation (bias + ReLU) / addmm then relu_, bf16.", ""]
    for size in result["sizes"]:
        s = size["summary"]
        lines += ["## {tokens} target tokens, {src_tokens} source tokens".format(**size), "",
                  "| GEMM | pass | (M, N, K) | layout, call | n | bf16 ms | TF/s | fp16 ms | TF/s | step ms | share "
                  "| e4m3 ms | TF/s | x | fast-accum ms | e5m2 dy ms | x | prep ms | fc1 epilogue / addmm+relu ms |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
                  "| --- | --- | --- |"]
        for r in size["rows"]:
            lines.append("| {} | {} | ({}, {}, {}) | {}, {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} "
                         "| {} | {} | {} | {} |".format(
                             r["name"], r["phase"], r["m"], r["n"], r["k"], r["layout"], r["call"], r["count"],
                             fmt(r["bf16_ms"]), fmt_tf(r["bf16_tflops"]), fmt(r["fp16_ms"]),
                             fmt_tf(r["fp16_tflops"]), fmt(r["bf16_step_ms"], "{:.2f}"),
                             fmt(100 * r["bf16_share"], "{:.1f}%"), fmt(r["e4m3_ms"]), fmt_tf(r["e4m3_tflops"]),
                             fmt(r["e4m3_speedup_vs_bf16"], "{:.2f}"), fmt(r.get("e4m3_fast_ms")), fmt(r.get("e5m2_ms")),
                             fmt(r.get("e5m2_speedup_vs_bf16"), "{:.2f}"), fmt(fp8_prep_ms(r, "e4m3")),
                             "{} / {}".format(fmt(r["bf16_bias_relu_epilogue_ms"]), fmt(r["bf16_addmm_relu_ms"]))
                             if "bf16_bias_relu_epilogue_ms" in r else "-"))
        lines += ["", "GEMMs a step: {:.2f} TFLOP; bf16 {:.2f} ms ({} TF/s), fp16 {:.2f} ms ({} TF/s). "
                  "fc1's bias + ReLU epilogue against addmm then relu_ saves {:.3f} ms a step (bf16), {:.3f} (fp16).".format(
                      s["gemm_tflop_per_step"], s["bf16_step_ms"], fmt_tf(tflops(s["gemm_tflop_per_step"] * 1e12, s["bf16_step_ms"])),
                      s["fp16_step_ms"], fmt_tf(tflops(s["gemm_tflop_per_step"] * 1e12, s["fp16_step_ms"])),
                      s["bf16_fc1_epilogue_vs_addmm_relu_saved_ms"], s["fp16_fc1_epilogue_vs_addmm_relu_saved_ms"]), "",
                  ] + scenario_lines(s) + [""]
    return "\n".join(lines)


def scenario_lines(summary):
    lines = ["| FP8 scenario | GEMM ms a step | saved ms | torch-op casts ms | saved with them ms |",
             "| --- | --- | --- | --- | --- |"]
    for name, sc in summary["scenarios"].items():
        lines.append("| {} | {:.2f} | {:.2f} | {:.2f} | {:.2f} |".format(
            name, sc["step_ms"], sc["saved_ms"], sc["prep_ms"], sc["saved_with_torch_casts_ms"]))
    return lines


def short_table(result):
    """What main prints: the GEMMs in fewer columns, the totals and the FP8 scenarios (gemms.md has all)."""
    lines = [result["meta"]["timing"]]
    for size in result["sizes"]:
        s = size["summary"]
        lines += ["", "{tokens} tokens ({src_tokens} source): bf16 {bf16:.2f} ms, fp16 {fp16:.2f} ms of GEMMs a step, "
                  "{tflop:.2f} TFLOP".format(bf16=s["bf16_step_ms"], fp16=s["fp16_step_ms"], tflop=s["gemm_tflop_per_step"], **size),
                  "| GEMM | pass | (M, N, K) | n | bf16 ms | TF/s | share | e4m3 TF/s | x | e5m2 dy x |", "| - | - | - | - | - | - | - | - | - | - |"]
        for r in size["rows"]:
            lines.append("| {} | {} | {},{},{} | {} | {} | {} | {} | {} | {} | {} |".format(
                r["name"], r["phase"], r["m"], r["n"], r["k"], r["count"], fmt(r["bf16_ms"]), fmt_tf(r["bf16_tflops"]),
                fmt(100 * r["bf16_share"], "{:.1f}%"), fmt_tf(r["e4m3_tflops"]), fmt(r["e4m3_speedup_vs_bf16"], "{:.2f}"),
                fmt(r.get("e5m2_speedup_vs_bf16"), "{:.2f}")))
        lines += scenario_lines(s)
    return "\n".join(lines)


def run(args):
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gemms: no CUDA device; use --device cpu --tiny for a smoke run")
    if device.type == "cpu" and not args.tiny:
        raise SystemExit("bench_gemms: --device cpu is a smoke run of the table only; add --tiny")
    dims = dict(dim=64, ffn=256, vocab=512) if args.tiny else dict(dim=1024, ffn=4096, vocab=args.vocab)
    tokens = args.tokens or ([64, 128] if args.tiny else [8192, 16384])
    reps, warmup = (args.reps or (3 if args.tiny else 50)), (1 if args.tiny else 10)
    timer = Timer(device, reps, warmup, flush=not args.no_flush)
    bench = Bench(timer, device)
    torch.manual_seed(0)
    sizes = []
    for t in tokens:
        src = max(16, int(round(t * args.src_per_tgt / 16)) * 16)
        gemms = step_gemms(t, src, encoder_layers=6, decoder_layers=6, **dims)
        rows = measure_rows(bench, gemms)
        sizes.append(dict(tokens=t, src_tokens=src, rows=rows, summary=summarise(rows)))
    timing = "CUDA events, {} warm-up calls, median of {} calls, {}".format(
        warmup, reps, "L2 flushed before each (256 MiB zeroed)" if timer.flush is not None else "L2 not flushed") \
        if device.type == "cuda" else "CPU perf_counter, median of {} calls".format(reps)
    meta = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", torch=torch.__version__,
                cuda=torch.version.cuda, timing=timing, dims=dims, tiny=args.tiny, src_per_tgt=args.src_per_tgt)
    return dict(meta=meta, sizes=sizes)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke run with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="64-wide model, 64 and 128 tokens: checks the table only")
    parser.add_argument("--tokens", type=int, nargs="+", help="target tokens a step (default 8192 16384)")
    parser.add_argument("--src-per-tgt", type=float, default=1.0,
                        help="source tokens per target token (the encoder's and the cross-attention k/v GEMMs' M)")
    parser.add_argument("--vocab", type=int, default=32000, help="joined dictionary size (the recipe's 32k pieces)")
    parser.add_argument("--reps", type=int, help="timed calls per GEMM (default 50; 3 with --tiny)")
    parser.add_argument("--no-flush", action="store_true", help="do not flush L2 before each timed call")
    parser.add_argument("--out", default=os.environ.get("OUT") or tempfile.mkdtemp(prefix="bench_gemms_"),
                        help="folder for gemms.json and gemms.md (default $OUT)")
    args = parser.parse_args(argv)
    start = time.time()
    result = run(args)
    result["meta"]["seconds"] = time.time() - start
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gemms.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "gemms.md"), "w") as f:
        f.write(markdown(result) + "\n")
    print(short_table(result))
    print("bench_gemms: {:.0f} s; gemms.json and gemms.md in {}".format(result["meta"]["seconds"], args.out))
    return result


if __name__ == "__main__":
    main()
