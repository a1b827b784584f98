"""Where the time of ls_fairseq's beam search goes: one batch under torch.profiler.

Loads an ls checkpoint and its data-bin (as scripts/bench_generate.py leaves them), translates the
test set's first length-sorted batch of --batch-size sentences with LSSequenceGenerator, and prints
the wall time per decoding step, the GPU's busy time per step (the sum of kernel times), the number
of kernel launches per step, and the kernels that take the most GPU time. A GPU busy far below
the wall time means the host (Python and launches) sets the pace.

  python scripts/profile_generate.py --data-bin D --checkpoint CKPT --beam 4 --batch-size 128

With --sentences N it instead translates the test set's first N sentences as bench_generate.py
times them (its batches, from the input copy to the hypotheses) and splits the time between the
input copies, the encoder, the caches' set-up, the eager decoding steps, the captures, the
replays, the hypotheses' assembly and the rest (the host's reads of the done flags, the
compactions, fairseq's inference_step): the device is synchronised around each part, so the parts
add up to the instrumented total, printed beside the plain one. It runs on the CPU too. With --idle
(on a GPU) a pass of its own, not synchronised, runs under torch.profiler first and says where the GPU
waited: the time between its kernels, each gap charged to what the host was doing then (a capture, a
compaction, the encoder, a read of the flags...).
"""
import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
MEMORY_EVENTS = 1_000_000  # --memory's history: the allocator's last events kept


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-bin", required=True)
    parser.add_argument("--checkpoint", required=True, help="an ls_transformer checkpoint")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--top", type=int, default=20, help="kernels listed")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="every step eager")
    parser.add_argument("--sync-every", type=int, default=None, help="steps between the host's reads of the done "
                        "flags (default: the generator's)")
    parser.add_argument("--compact-fraction", type=float, default=None, help="fraction of the sentences done before "
                        "they leave the batch (default: the generator's)")
    parser.add_argument("--sentences", type=int, default=None,
                        help="the whole-run breakdown over the test set's first N sentences (see above)")
    parser.add_argument("--idle", action="store_true",
                        help="with --sentences, on a GPU: where the GPU waits for the host (see above)")
    parser.add_argument("--memory", action="store_true",
                        help="with --sentences, on a GPU: what the memory held at the translation's peak, by "
                             "the place (file:line) that allocated it (a pass of its own before the timed ones)")
    args = parser.parse_args(argv)
    if args.sentences:
        return breakdown(args)

    import torch
    from fairseq import checkpoint_utils
    from torch.profiler import ProfilerActivity, profile

    import ls_fairseq.fairseq_plugin  # noqa: F401 (the plugin)
    from ls_fairseq.generation import LSSequenceGenerator
    from ls_fairseq.generation.cache import DecoderCache

    if not torch.cuda.is_available():
        sys.exit("profile_generate: needs a GPU")
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([args.checkpoint],
                                                                     arg_overrides={"data": args.data_bin})
    model = models[0].to(device="cuda", dtype=getattr(torch, args.dtype)).eval()
    task.load_dataset("test")
    dataset = task.dataset("test")
    order = dataset.ordered_indices()
    group = dataset.batch_by_size(order, max_sentences=args.batch_size)[len(order) // args.batch_size // 2]
    sample = dataset.collater([dataset[i] for i in group])
    sample = {k: (v.cuda() if torch.is_tensor(v) else {n: t.cuda() for n, t in v.items()} if isinstance(v, dict) else v)
              for k, v in sample.items()}
    generator = LSSequenceGenerator([model], task.target_dictionary, beam_size=args.beam, len_penalty=0.6,
                                    cuda_graphs=not args.no_cuda_graphs, sync_every=args.sync_every,
                                    compact_fraction=args.compact_fraction)
    steps = []
    prepare = DecoderCache.prepare

    def counted(cache, step):  # once a step, also where the step is a graph's replay
        steps.append(step)
        return prepare(cache, step)

    DecoderCache.prepare = counted
    for _ in range(2):
        generator.generate([model], sample)
    torch.cuda.synchronize()
    steps.clear()
    graphs = generator.step_graph
    captured = graphs.captured if graphs else 0
    start = time.perf_counter()
    generator.generate([model], sample)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    n = len(steps)
    captured = (graphs.captured if graphs else 0) - captured
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generator.generate([model], sample)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0)]
    kernels = sorted(events, key=lambda e: -e.self_device_time_total)
    busy_us = sum(e.self_device_time_total for e in kernels)
    launches = sum(e.count for e in kernels if e.self_device_time_total > 0)
    print("profile_generate: {} sentences, beam {}, {}: {} steps, {} captured graphs, wall {:.2f} ms/step "
          "(unprofiled), GPU busy {:.3f} ms/step, {:.0f} kernels/step".format(
              len(group), args.beam, args.dtype, n, captured, 1e3 * wall / n, busy_us / 1e3 / n, launches / n))
    print("| kernel | calls/step | us/step | share |")
    print("| --- | --- | --- | --- |")
    for e in kernels[: args.top]:
        print("| {} | {:.1f} | {:.1f} | {:.1%} |".format(e.key[:90], e.count / n, e.self_device_time_total / n,
                                                        e.self_device_time_total / busy_us))


def breakdown(args):
    """The whole-run split of translating the first --sentences sentences (module docstring)."""
    import torch
    from fairseq import checkpoint_utils

    import ls_fairseq.fairseq_plugin  # noqa: F401 (the plugin)
    from ls_fairseq.generation import LSSequenceGenerator, sequence_generator
    from ls_fairseq.generation.cache import DecoderCache
    from ls_fairseq.generation.graphs import StepGraph

    sys.path.insert(0, os.path.join(REPO, "scripts"))
    from bench_generate import batches, move

    device = "cuda" if torch.cuda.is_available() else "cpu"
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([args.checkpoint],
                                                                     arg_overrides={"data": args.data_bin})
    model = models[0].to(device)
    if device == "cuda":
        model = model.to(getattr(torch, args.dtype))
    model.eval()
    task.load_dataset("test")
    samples = batches(task, model, args.sentences, args.batch_size)
    generator = LSSequenceGenerator([model], task.target_dictionary, beam_size=args.beam, len_penalty=0.6,
                                    cuda_graphs=not args.no_cuda_graphs, sync_every=args.sync_every,
                                    compact_fraction=args.compact_fraction)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def run_all():
        sync()
        start = time.perf_counter()
        for sample in samples:
            task.inference_step(generator, [model], move(sample, device))
        sync()
        return time.perf_counter() - start

    memory = args.memory and device == "cuda"
    if memory:  # from the first batch on, the one-time set-up included; a pass of its own (recording is slow)
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=MEMORY_EVENTS)
    for sample in samples[:2]:  # untimed, as bench_generate: one-time set-up
        task.inference_step(generator, [model], move(sample, device))
    if memory:
        run_all()
        print_memory_peak(torch.cuda.memory._snapshot(), args.top)
        torch.cuda.memory._record_memory_history(enabled=None)
    plain = run_all()
    if args.idle and device == "cuda":
        print_idle(run_all, args.top, task, model)

    parts, counts, inside = {}, {}, [False]

    def begin():
        sync()
        return time.perf_counter()

    def add(name, start):
        sync()
        parts[name] = parts.get(name, 0.0) + time.perf_counter() - start
        counts[name] = counts.get(name, 0) + 1

    def timed(name, fn):
        def wrapper(*a, **kw):
            if inside[0]:  # a part within a part (a step inside a graph's run): the outer one counts it
                return fn(*a, **kw)
            inside[0], start = True, begin()
            try:
                return fn(*a, **kw)
            finally:
                add(name, start)
                inside[0] = False
        return wrapper

    encoder = type(model.encoder)
    patched = [(encoder, "forward_torchscript"), (DecoderCache, "__init__"), (LSSequenceGenerator, "_step"),
               (sequence_generator._State, "results"), (StepGraph, "run")]
    saved = [(cls, name, cls.__dict__.get(name)) for cls, name in patched]  # None: inherited
    encoder.forward_torchscript = timed("encoder", encoder.forward_torchscript)
    DecoderCache.__init__ = timed("caches' set-up", DecoderCache.__init__)
    LSSequenceGenerator._step = timed("eager steps", LSSequenceGenerator._step)
    sequence_generator._State.results = timed("hypotheses' assembly", sequence_generator._State.results)
    graph_run = StepGraph.run

    def classified_run(self, key, step, *rest):
        """A graph's run, timed as a capture (with its first replay), an eager warm-up or a replay."""
        captured, fresh = self.captured, key != self.key
        inside[0], start = True, begin()
        try:
            return graph_run(self, key, step, *rest)
        finally:
            add("captures" if self.captured > captured else "eager steps" if fresh else "replays", start)
            inside[0] = False

    StepGraph.run = classified_run
    timed_move = timed("input copies", move)

    sync()
    start = time.perf_counter()
    for sample in samples:
        task.inference_step(generator, [model], timed_move(sample, device))
    sync()
    total = time.perf_counter() - start
    restore(saved)
    parts["the rest"] = total - sum(parts.values())
    print("profile_generate: {} sentences in {} batches of up to {}, beam {}, {} on {}{}: {:.1f} ms plain, "
          "{:.1f} ms instrumented".format(args.sentences, len(samples), args.batch_size, args.beam,
                                          str(next(model.parameters()).dtype).replace("torch.", ""), device,
                                          "" if generator.step_graph and device == "cuda" else " (eager)",
                                          1e3 * plain, 1e3 * total))
    print("| part | ms | share | calls |")
    print("| --- | --- | --- | --- |")
    for name, seconds in sorted(parts.items(), key=lambda item: -item[1]):
        print("| {} | {:.1f} | {:.1%} | {} |".format(name, 1e3 * seconds, seconds / total, counts.get(name, "-")))


def restore(saved):
    """Undoes patches recorded as (class, name, the class's own attribute before, None if inherited)."""
    for cls, name, fn in reversed(saved):
        if fn is None:
            delattr(cls, name)
        else:
            setattr(cls, name, fn)


SHORT_GAP_US = 20  # shorter gaps are counted together, not charged to a part
IDLE_PARTS = ("capture", "eager step", "replay", "compaction", "read of the done flags", "caches' set-up",
              "hypotheses' assembly", "encoder", "batch")  # the innermost first where parts nest


def print_idle(run_all, top, task, model):
    """Runs ``run_all`` under torch.profiler with each of IDLE_PARTS in a labelled range and prints the
    GPU's busy time (the union of its kernels and copies) against the wall time, and each gap between
    them charged to the innermost part the host was in at the gap's middle (those under SHORT_GAP_US
    together)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    from ls_fairseq.generation import sequence_generator
    from ls_fairseq.generation.cache import DecoderCache
    from ls_fairseq.generation.graphs import StepGraph

    saved = []

    def label(cls, name, text):
        inner = getattr(cls, name)

        def wrapper(*a, **kw):
            with record_function("ls:" + text):
                return inner(*a, **kw)
        saved.append((cls, name, cls.__dict__.get(name)))  # None: inherited
        setattr(cls, name, wrapper)

    label(sequence_generator.LSSequenceGenerator, "_compact", "compaction")
    label(sequence_generator._PendingRead, "value", "read of the done flags")
    label(DecoderCache, "__init__", "caches' set-up")
    label(sequence_generator._State, "results", "hypotheses' assembly")
    label(type(model.encoder), "forward_torchscript", "encoder")
    label(type(task), "inference_step", "batch")
    graph_run = StepGraph.run

    def classified_run(self, key, step, extent):
        fresh = key != self.key
        kind = "eager step" if fresh and extent > self.warmed else "capture" if fresh or self.graph is None else "replay"
        with record_function("ls:" + kind):
            return graph_run(self, key, step, extent)
    saved.append((StepGraph, "run", StepGraph.__dict__["run"]))
    StepGraph.run = classified_run
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall = run_all()
    finally:
        restore(saved)
    events = prof.events()
    device = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
    ranges = [(e.time_range.start, e.time_range.end, e.name[3:]) for e in events
              if e.device_type == DeviceType.CPU and e.name.startswith("ls:")]
    batches = [r for r in ranges if r[2] == "batch"]
    if not device or not batches:
        print("profile_generate: the profiler recorded no kernels")
        return
    order = {text: i for i, text in enumerate(IDLE_PARTS)}
    begin, end = min(r[0] for r in batches), max(r[1] for r in batches)
    busy, idle, gaps, last = 0.0, {}, {}, begin
    for start, stop in device + [(end, end)]:
        start, stop = max(start, begin), min(stop, end)
        if start > last:
            middle = (last + start) / 2
            inside = [r[2] for r in ranges if r[0] <= middle <= r[1]] if start - last >= SHORT_GAP_US else None
            part = "gaps under {} us (between a graph's kernels)".format(SHORT_GAP_US) if inside is None else \
                min(inside, key=order.get) if inside else "between batches"
            idle[part] = idle.get(part, 0.0) + start - last
            gaps[part] = gaps.get(part, 0) + 1
        if stop > last:
            busy += stop - max(start, last)
            last = stop
    span = end - begin
    print("profile_generate: under torch.profiler {:.1f} ms wall, batches {:.1f} ms, GPU busy {:.1f} ms ({:.1%}), "
          "idle {:.1f} ms".format(1e3 * wall, span / 1e3, busy / 1e3, busy / span, (span - busy) / 1e3))
    print("| the GPU waits during | ms | share of the batches' time | gaps |")
    print("| --- | --- | --- | --- |")
    for part, us in sorted(idle.items(), key=lambda item: -item[1])[:top]:
        print("| {} | {:.1f} | {:.1%} | {} |".format(part, us / 1e3, us / span, gaps[part]))


def print_memory_peak(snapshot, top):
    """The allocations live at the peak of a recorded memory history (blocks made before the recording
    began are not in it: the weights), grouped by the innermost frame of the repository or fairseq
    that made them, largest first. A cuBLAS workspace is charged to the GEMM that first needed it on
    its stream (the line of an ops/linear*.py call)."""
    import torch

    trace = snapshot["device_traces"][torch.cuda.current_device()]
    if len(trace) >= MEMORY_EVENTS:
        print("profile_generate: the memory history kept only its last {} events: the peak below misses "
              "what was allocated before them (fewer --sentences)".format(MEMORY_EVENTS))
    live, total, peak, at_peak = {}, 0, 0, {}
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
        if total > peak:
            peak, at_peak = total, dict(live)
    groups = {}
    for event in at_peak.values():
        frames = [f for f in event.get("frames", []) if "ls_fairseq" in f["filename"] or "fairseq" in f["filename"]]
        if frames:
            place = "{}:{} ({})".format(os.path.relpath(frames[0]["filename"], REPO), frames[0]["line"], frames[0]["name"])
        else:
            place = "no Python frame, stream {}".format(event["stream"])
        size, count = groups.get(place, (0, 0))
        groups[place] = (size + event["size"], count + 1)
    print("profile_generate: peak {:.1f} MiB above what was allocated before the recording".format(peak / 2**20))
    print("| allocated at | MiB | blocks |")
    print("| --- | --- | --- |")
    for place, (size, count) in sorted(groups.items(), key=lambda item: -item[1][0])[:top]:
        print("| {} | {:.2f} | {} |".format(place, size / 2**20, count))


if __name__ == "__main__":
    main()
