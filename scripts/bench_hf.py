"""Hugging Face training steps on one GPU: each family's own layers against ls_fairseq.hf's fused layers,
eager and under torch.compile, bf16, in one run.

    python scripts/bench_hf.py [--families bert128,bert512,gpt2,vit] [--configs hf-eager,...] [--quick]
                               [--budget-s 300] [--json out.json] [--tiny]

Families (random init from configs: nothing is downloaded):
- bert128, bert512: BertForSequenceClassification, the bert-base shape, sequence 128 batch 128 and sequence
  512 batch 32, one sentence in eight padded to half length;
- gpt2: GPT2LMHeadModel, GPT-2 small (124M), sequence 1,024, batch 8, labels the inputs, an all-ones
  attention_mask (run_clm's batches: HF's sdpa reads it on the host and takes FlashAttention, ls does not read it);
- vit: ViTForImageClassification, ViT-B/16 at 224x224 (197 tokens), batch 64, 1,000 classes.
Configurations: hf-eager (HF's eager attention), hf-sdpa, hf-compile (HF sdpa under torch.compile), ls-eager
(every layer replaced: ls_fairseq.hf.replace_layers), ls-compile (the same under torch.compile).

A step is forward, backward and AdamW on the model in bf16 (parameters and activations; dropout as the config
has it). A run is ``--steps`` steps after ``--warmup`` steps (torch.compile's compilation among the first run's);
its figure is the median step time. Eager configurations make ``--runs`` runs (the median and the range of their
figures), compiled ones one. Peak memory: torch.cuda.max_memory_allocated over the configuration. Eager
configurations of every family run first, then the compiled ones; a configuration that fails (a compile error,
out of memory) or does not finish within what is left of ``--budget-s`` is a row of the table with its error,
and the others still run. The full table, then a short one (family x configuration, median ms), print last.

``--tiny``: tiny models (2 layers, 32 wide, short rows) on the CPU when there is no GPU, to check the script end to
end (``--compile-backend aot_eager`` keeps torch.compile's time there short).
"""
import argparse
import json
import math
import platform
import signal
import statistics
import time

import torch

FAMILIES = ("bert128", "bert512", "gpt2", "vit")
CONFIGS = ("hf-eager", "hf-sdpa", "hf-compile", "ls-eager", "ls-compile")
SHAPES = {"bert128": (128, 128), "bert512": (512, 32), "gpt2": (1024, 8), "vit": (197, 64)}  # (tokens, batch)
TINY_SHAPES = {"bert128": (16, 4), "bert512": (32, 2), "gpt2": (32, 2), "vit": (17, 2)}


class OutOfTime(Exception):
    pass


def make_model(family, attn, tiny):
    """The family's model (random init) with ``attn`` attention."""
    from transformers import (BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel, ViTConfig,
                              ViTForImageClassification)

    small = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64) if tiny else {}
    if family.startswith("bert"):
        config = BertConfig(**dict(dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                        intermediate_size=3072, num_labels=2), **small))
        model_class = BertForSequenceClassification
    elif family == "gpt2":
        config = GPT2Config(**(dict(n_layer=2, n_embd=32, n_head=4, n_positions=64) if tiny else {}))
        model_class = GPT2LMHeadModel
    else:
        config = ViTConfig(**dict(dict(num_labels=1000), **(dict(small, image_size=16, patch_size=4) if tiny else {})))
        model_class = ViTForImageClassification
    config._attn_implementation = attn
    return model_class(config)


def make_batch(family, tiny, device):
    tokens, batch = (TINY_SHAPES if tiny else SHAPES)[family]
    if family == "vit":
        size = 16 if tiny else 224
        return dict(pixel_values=torch.randn(batch, 3, size, size, device=device, dtype=torch.bfloat16),
                    labels=torch.randint(0, 1000, (batch,), device=device))
    vocab = 30522 if family.startswith("bert") else 50257
    ids = torch.randint(1000, vocab, (batch, tokens), device=device)
    mask = torch.ones(batch, tokens, dtype=torch.long, device=device)
    if family == "gpt2":
        return dict(input_ids=ids, attention_mask=mask, labels=ids)
    mask[::8, tokens // 2:] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=torch.randint(0, 2, (batch,), device=device))


def synchronize(device):
    if device == "cuda":
        torch.cuda.synchronize()


def one_configuration(family, config, args, device):
    """{runs_ms: each run's median step, first_step_s, peak_gib, loss} of one configuration."""
    from ls_fairseq.hf import replace_layers

    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: seconds less a configuration on the GPU
        model = make_model(family, "eager" if config == "hf-eager" else "sdpa", args.tiny)
    if config.startswith("ls"):
        replace_layers(model)
    model = model.to(device, torch.bfloat16).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    compiled = config.endswith("compile")
    step_model = torch.compile(model, backend=args.compile_backend) if compiled else model
    inputs = make_batch(family, args.tiny, device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def step():
        loss = step_model(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    runs, first_step_s = [], None
    for run in range(1 if compiled else args.runs):
        times = []
        for i in range((args.warmup if run == 0 else 1) + args.steps):
            synchronize(device)
            start = time.perf_counter()
            loss = step()
            synchronize(device)
            times.append(time.perf_counter() - start)
        first_step_s = first_step_s if first_step_s is not None else times[0]
        runs.append(1e3 * statistics.median(times[-args.steps:]))
    loss = loss.item()
    if not math.isfinite(loss):
        raise FloatingPointError("loss {}".format(loss))
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    return {"runs_ms": runs, "first_step_s": first_step_s, "peak_gib": peak, "loss": loss}


def run_within(seconds, fn, *args):
    """fn(*args), interrupted by OutOfTime after ``seconds`` (SIGALRM: Python code, such as torch.compile's,
    is interrupted between bytecodes; a kernel in flight finishes first)."""
    if math.isinf(seconds):
        return fn(*args)

    def alarm(signum, frame):
        raise OutOfTime("did not finish within the {:.0f} s left of --budget-s".format(seconds))

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def timed_out(error):
    """Whether ``error`` is, or was raised from, run_within's OutOfTime (torch.compile wraps it in its own)."""
    while error is not None:
        if isinstance(error, OutOfTime):
            return True
        error = error.__cause__ or error.__context__
    return False


def cell(row):
    if "error" in row:
        return row["status"]
    if len(row["runs_ms"]) > 1:
        return "{:.1f} ({:.1f}-{:.1f})".format(row["step_ms"], min(row["runs_ms"]), max(row["runs_ms"]))
    return "{:.1f}".format(row["step_ms"])


def tables(rows, families, configs):
    """(the full table, the short one) in markdown."""
    full = ["| family | tokens x batch | configuration | runs | ms/step: median (range) | first step s | peak GiB "
            "| note |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        if "error" in row:
            full.append("| {family} | {shape} | {config} | 0 | {status} | | | {error} |".format(**row))
        else:
            peak = "-" if math.isnan(row["peak_gib"]) else "{:.2f}".format(row["peak_gib"])  # the CPU's: none
            full.append("| {family} | {shape} | {config} | {n} | {cell} | {first_step_s:.1f} | {peak} | |".format(
                n=len(row["runs_ms"]), cell=cell(row), peak=peak, **row))
    short = ["| ms/step | " + " | ".join(configs) + " |", "| --- |" + " --- |" * len(configs)]
    by = {(r["family"], r["config"]): r for r in rows}
    for family in families:
        cells = [cell(by[(family, c)]) if (family, c) in by else "not run" for c in configs]
        short.append("| {} ({}) | ".format(family, by_shape(family, rows)) + " | ".join(cells) + " |")
    return "\n".join(full), "\n".join(short)


def by_shape(family, rows):
    return next((r["shape"] for r in rows if r["family"] == family), "")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated, from " + ", ".join(FAMILIES))
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, from " + ", ".join(CONFIGS))
    parser.add_argument("--steps", type=int, default=10, help="timed steps a run")
    parser.add_argument("--warmup", type=int, default=5, help="steps before the first run (compilation among them)")
    parser.add_argument("--runs", type=int, default=3, help="runs of an eager configuration")
    parser.add_argument("--quick", action="store_true", help="--steps 5 --warmup 3 --runs 1")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="the whole run's time: a configuration still running then fails, the rest are not run")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--tiny", action="store_true", help="tiny models (the CPU without a GPU): the script's check")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup, args.runs = 5, 3, 1
    families, configs = args.families.split(","), args.configs.split(",")
    for given, known, option in ((families, FAMILIES, "--families"), (configs, CONFIGS, "--configs")):
        for name in given:
            if name not in known:
                parser.error("{}: {!r} is not one of {}".format(option, name, ", ".join(known)))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        raise SystemExit("bench_hf: needs a CUDA GPU (or --tiny)")
    import transformers

    print("bench_hf: {}, torch {}, transformers {}, python {}".format(
        torch.cuda.get_device_name() if device == "cuda" else "CPU", torch.__version__, transformers.__version__,
        platform.python_version()), flush=True)
    started = time.perf_counter()
    order = [(f, c) for c in configs if not c.endswith("compile") for f in families]
    order += [(f, c) for f in families for c in configs if c.endswith("compile")]
    rows = []
    for family, config in order:
        tokens, batch = (TINY_SHAPES if args.tiny else SHAPES)[family]
        row = {"family": family, "config": config, "shape": "{} x {}".format(tokens, batch)}
        left = args.budget_s - (time.perf_counter() - started)
        try:
            if left < 5:
                raise OutOfTime("--budget-s spent")
            row.update(run_within(left, one_configuration, family, config, args, device))
            row["step_ms"] = statistics.median(row["runs_ms"])
            print("{family} {config}: {step_ms:.1f} ms/step, runs {runs}, peak {peak_gib:.2f} GiB".format(
                runs=" ".join("{:.1f}".format(t) for t in row["runs_ms"]), **row), flush=True)
        except Exception as e:  # one configuration's failure (a compile error, out of memory) is a result too
            row["status"] = ("not run" if left < 5 else "out of time") if timed_out(e) else "failed"
            row["error"] = "{}: {}".format(type(e).__name__, (str(e).strip().splitlines() or [""])[0][:160])
            row["error"] = row["error"].replace("|", "/")
            print("{family} {config}: {error}".format(**row), flush=True)
        rows.append(row)
        torch._dynamo.reset()
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    rows.sort(key=lambda r: (families.index(r["family"]), configs.index(r["config"])))
    full, short = tables(rows, families, configs)
    print("\n" + full + "\n\n" + short, flush=True)


if __name__ == "__main__":
    main()
