"""Host time of an eager training step: transformer-big's forward, backward and ls_adam's step (GPU).

Without CUDA graphs the host issues every op of a step from Python (about 800
op calls), and at transformer-big's sizes it takes longer to issue a step than
the GPU takes to run it: the host sets the pace. This measures the host's part
alone. Before each timed step a sleep kernel holds the GPU for longer than the
step takes to issue, so the host never waits for the GPU, and the time from the
step's first call to its last return is the host's: the ``issue`` figures, per
step and per phase (forward with the loss, backward, and the optimizer: the
gradient norm and Adam's update, as ls-fairseq-train runs them). A step that
waited for the GPU after all (a host synchronisation, or more launches than the
GPU's queue takes) is counted and reported, not hidden: its time then includes
the sleep. ``wall`` is the time per step of steps run back to back (the
synchronisation before and after excluded), which is the host's time too when
the GPU keeps up.

The step is ls-fairseq-train's with ls_adam: ls_transformer_vaswani_wmt_en_de_big
(shared 32k vocabulary, dropout 0.3), ls_label_smoothed_cross_entropy (0.1),
ls_adam with an fp32 master copy and the device-decided loss scale (--fp16),
one batch of --sentences sentence pairs of random lengths up to --length
tokens, the same batch every step. Run it on two checkouts (the same GPU, one
after the other) to compare their host time:

  python scripts/bench_host.py [--dtype fp16|bf16] [--sentences 256] [--length 32] [--steps 30] [--json FILE]
  python scripts/bench_host.py --device cpu --arch ls_transformer_tiny --steps 2   # a smoke run on the references
"""
import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch
from fairseq.data import Dictionary
from fairseq.models import ARCH_CONFIG_REGISTRY

from ls_fairseq.criterions.ls_label_smoothed_cross_entropy import LSLabelSmoothedCrossEntropyCriterion
from ls_fairseq.models.ls_transformer import LSTransformerModel
from ls_fairseq.ops import dispatch
from ls_fairseq.optim.ls_adam import LSAdam, LSAdamConfig
from ls_fairseq.optim.mixed_precision import DeviceStepAdam

PHASES = ("forward", "backward", "optimizer")


def build(arch, vocab, dtype, device):
    """(model, criterion, optimizer, dictionary) as ls-fairseq-train builds them for --share-all-embeddings."""
    d = Dictionary()
    for i in range(vocab):
        d.add_symbol("w{}".format(i))
    d.pad_to_multiple_(8)
    task = SimpleNamespace(source_dictionary=d, target_dictionary=d, cfg=SimpleNamespace(left_pad_target=False))
    args = argparse.Namespace(share_all_embeddings=True)
    ARCH_CONFIG_REGISTRY[arch](args)
    model = LSTransformerModel.build_model(args, task).to(device, dtype)
    model.train()
    criterion = LSLabelSmoothedCrossEntropyCriterion(task, sentence_avg=False, label_smoothing=0.1)
    cfg = LSAdamConfig(adam_betas="(0.9, 0.98)", lr=[5e-4])
    adam = LSAdam(cfg, list(model.parameters()), fp32_master=dtype != torch.float32)
    scaler = None
    if dtype == torch.float16:  # fairseq's default dynamic loss scale for one GPU
        scaler = dict(init_scale=128.0, scale_window=2**14, scale_floor=0.0, min_loss_scale=1e-4)
    return model, criterion, DeviceStepAdam(cfg, adam, scaler), d


def batch(d, sentences, length, device, seed=0):
    """fairseq's translation sample: sources left-padded, targets right-padded, lengths 1/2 to 1 x ``length``."""
    g = torch.Generator().manual_seed(seed)
    src = torch.full((sentences, length), d.pad())
    prev = torch.full((sentences, length), d.pad())
    target = torch.full((sentences, length), d.pad())
    for b in range(sentences):
        s, t = (int(torch.randint(length // 2, length + 1, (1,), generator=g)) for _ in range(2))
        src[b, length - s:] = torch.randint(d.nspecial, len(d), (s,), generator=g)
        src[b, -1] = d.eos()
        words = torch.randint(d.nspecial, len(d), (t - 1,), generator=g)
        prev[b, 0], prev[b, 1:t] = d.eos(), words
        target[b, : t - 1], target[b, t - 1] = words, d.eos()
    net_input = {"src_tokens": src, "src_lengths": src.ne(d.pad()).sum(1), "prev_output_tokens": prev}
    return {"net_input": {k: v.to(device) for k, v in net_input.items()}, "target": target.to(device),
            "ntokens": int(target.ne(d.pad()).sum())}


def train_step(model, criterion, optimizer, sample, clock):
    """One step as ls-fairseq-train takes it; ``clock()`` read at the start and after each phase."""
    times = [clock()]
    optimizer.zero_grad()
    loss, _ = criterion.losses(model, sample)
    times.append(clock())
    optimizer.backward(loss)
    times.append(clock())
    optimizer.multiply_grads(1.0 / sample["ntokens"])
    optimizer.clip_grad_norm(0.0)
    optimizer.step()
    times.append(clock())
    return [1e3 * (b - a) for a, b in zip(times, times[1:])]


def sleep_cycles_per_ms():
    """GPU clock cycles of torch.cuda._sleep per millisecond, from a timed sleep."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 50_000_000
    torch.cuda._sleep(cycles // 10)  # warm-up
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def summary(values):
    return dict(median=statistics.median(values), mean=statistics.fmean(values), min=min(values), max=max(values))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="ls_transformer_vaswani_wmt_en_de_big")
    parser.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default="fp16")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--sentences", type=int, default=256, help="sentence pairs in the batch")
    parser.add_argument("--length", type=int, default=32, help="the longest sentence, in tokens (source and target)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps of each kind")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--sleep-ms", type=float, default=500.0,
                        help="how long the GPU is held before each issue-timed step (longer than a step's issue)")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run on the references (issue = wall)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        assert dispatch.extension() is not None, "the CUDA extension is not loaded: " + str(dispatch.extension_error())
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    torch.manual_seed(1)
    model, criterion, optimizer, d = build(args.arch, args.vocab, dtype, device)
    sample = batch(d, args.sentences, args.length, device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(args.warmup):
        train_step(model, criterion, optimizer, sample, time.perf_counter)
    sync()

    issue, waited = [], 0
    cycles = int(args.sleep_ms * sleep_cycles_per_ms()) if cuda else 0
    for _ in range(args.steps):
        if cuda:
            torch.cuda._sleep(cycles)
        phases = train_step(model, criterion, optimizer, sample, time.perf_counter)
        if cuda:
            done = torch.cuda.Event()
            done.record()
            # the step waited for the GPU if the sleep was over by the time the host had issued it
            waited += done.query() or sum(phases) >= 0.9 * args.sleep_ms
        sync()
        issue.append(phases)

    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        train_step(model, criterion, optimizer, sample, time.perf_counter)
    sync()
    wall = 1e3 * (time.perf_counter() - t0) / args.steps

    result = dict(
        device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__, arch=args.arch,
        dtype=args.dtype, sentences=args.sentences, length=args.length, target_tokens=sample["ntokens"],
        steps=args.steps, waited_for_gpu=int(waited), wall_ms_per_step=wall,
        issue_ms=summary([sum(p) for p in issue]),
        issue_phase_ms={name: summary([p[i] for p in issue]) for i, name in enumerate(PHASES)},
    )
    print("{} {}, {} on {}: {} sentence pairs up to {} tokens ({} target tokens), {} steps".format(
        args.arch, args.dtype, "eager", result["device"], args.sentences, args.length, sample["ntokens"], args.steps))
    s = result["issue_ms"]
    print("host issue time a step: median {median:.2f} ms, mean {mean:.2f}, min {min:.2f}, max {max:.2f}".format(**s))
    print("  " + ", ".join("{} {:.2f}".format(n, result["issue_phase_ms"][n]["median"]) for n in PHASES)
          + " ms (medians)")
    print("wall time a step, back to back: {:.2f} ms".format(wall))
    if waited:
        print("WARNING: {} of {} issue-timed steps waited for the GPU (a host synchronisation, or a GPU launch "
              "queue too short for a step): their time includes the sleep".format(waited, args.steps))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
