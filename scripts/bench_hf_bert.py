"""BERT-base training steps on one GPU: Hugging Face's own layers against ls_fairseq.hf's fused layers,
each eager and under torch.compile, in fp16 and bf16, at sequence lengths 128 and 512, in one run.

    python scripts/bench_hf_bert.py [--batch-tokens 16384] [--steps 20] [--dtypes bf16] [--json out.json]

A step is forward, backward and AdamW on BertForSequenceClassification (random init, the
bert-base-uncased shape, dropout 0.1, one sentence in eight padded to half length); the figure is
the median step time over ``--steps`` after 5 warm-up steps (torch.compile's compilation among
them), with the peak allocated memory. A configuration that fails (torch.compile of the ls layers
may) is reported with its error and the others still run.
"""
import argparse
import json
import statistics
import time

import torch


def bert_base(attn):
    from transformers import BertConfig

    config = BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                        intermediate_size=3072, num_labels=2)
    config._attn_implementation = attn
    return config


def one_configuration(layers, compiled, dtype, seq, batch_tokens, steps):
    from transformers import BertForSequenceClassification

    from ls_fairseq.hf import replace_bert_layers

    torch.manual_seed(0)
    model = BertForSequenceClassification(bert_base("eager" if layers == "hf-eager" else "sdpa"))
    if layers == "ls":
        replace_bert_layers(model)
    model = model.cuda().to(dtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    step_model = torch.compile(model) if compiled else model
    B = max(1, batch_tokens // seq)
    ids = torch.randint(1000, 30000, (B, seq), device="cuda")
    mask = torch.ones(B, seq, dtype=torch.long, device="cuda")
    mask[::8, seq // 2:] = 0
    labels = torch.randint(0, 2, (B,), device="cuda")
    times = []
    torch.cuda.reset_peak_memory_stats()
    for i in range(5 + steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step_model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= 5:
            times.append(time.perf_counter() - start)
    return {"step_ms": 1e3 * statistics.median(times), "tokens_per_s": B * seq / statistics.median(times),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "batch": B, "loss": loss.item()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", default=None)
    parser.add_argument("--dtypes", default="fp16,bf16", help="comma-separated, from fp16 and bf16")
    parser.add_argument("--seqs", default="128,512", help="sequence lengths, comma-separated")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_hf_bert: needs a CUDA GPU")
    results = []
    print("| layers | compiled | dtype | seq | batch | step ms | tokens/s | peak GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    for name in args.dtypes.split(","):
        if name not in dtypes:
            parser.error("--dtypes: {!r} is not one of fp16, bf16".format(name))
    for dtype in [dtypes[name] for name in args.dtypes.split(",")]:
        for seq in [int(s) for s in args.seqs.split(",")]:
            for layers in ("hf-eager", "hf-sdpa", "ls"):
                for compiled in (False, True):
                    row = {"layers": layers, "compiled": compiled, "dtype": str(dtype).split(".")[1], "seq": seq}
                    try:
                        row.update(one_configuration(layers, compiled, dtype, seq, args.batch_tokens, args.steps))
                        print("| {layers} | {compiled} | {dtype} | {seq} | {batch} | {step_ms:.1f} | {tokens_per_s:.0f} "
                              "| {peak_gib:.2f} |".format(**row), flush=True)
                    except Exception as e:  # one configuration's failure (a compile error) is a result too
                        row["error"] = "{}: {}".format(type(e).__name__, str(e).splitlines()[0][:200])
                        print("| {layers} | {compiled} | {dtype} | {seq} | failed: {error} |".format(**row), flush=True)
                    results.append(row)
                    torch._dynamo.reset()
                    torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
