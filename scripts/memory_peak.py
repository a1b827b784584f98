"""What is alive at the peak of a run's GPU memory, from its allocation history.

The benchmark's hooks record every allocation and free with its Python call
stack when $BENCH_MEMORY_HISTORY names a file (recipes/wmt14_en_de/bench_hooks);
this replays that history to its highest point and groups the live blocks by
the innermost frames outside torch (the op or module that allocated them).

  BENCH_MEMORY_HISTORY=/tmp/mem.pickle python3 recipes/wmt14_en_de/bench.py ...
  python3 scripts/memory_peak.py /tmp/mem.pickle [--top 30]
"""
import argparse
import collections
import pickle


def where(event, depth=3):
    frames = [f for f in event.get("frames", []) if f["filename"].endswith(".py") and "/torch/" not in f["filename"]]
    return " < ".join("{}:{} {}".format(f["filename"].split("/")[-1], f["line"], f["name"]) for f in frames[:depth]) or "?"


def live_at_peak(trace):
    """(peak bytes, index of the event that reached it, the blocks alive then: address -> alloc event)."""
    live, current, peak, peak_at = {}, 0, 0, -1
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            current += event["size"]
        elif event["action"] == "free_completed" and live.pop(event["addr"], None) is not None:
            current -= event["size"]
        if current > peak:
            peak, peak_at = current, i
    live = {}
    for event in trace[: peak_at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    return peak, peak_at, live


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("snapshot")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    with open(args.snapshot, "rb") as f:
        snapshot = pickle.load(f)
    for device, trace in enumerate(snapshot["device_traces"]):
        if not trace:
            continue
        peak, peak_at, live = live_at_peak(trace)
        print("device {}: {} events; peak {:.2f} GiB at event {} ({})".format(
            device, len(trace), peak / 2**30, peak_at, where(trace[peak_at], 6)))
        groups = collections.defaultdict(lambda: [0, 0])
        for event in live.values():
            group = groups[where(event)]
            group[0] += event["size"]
            group[1] += 1
        print("{:>10} {:>7}  allocated at".format("MiB", "blocks"))
        for site, (size, blocks) in sorted(groups.items(), key=lambda kv: -kv[1][0])[: args.top]:
            print("{:10.1f} {:7d}  {}".format(size / 2**20, blocks, site))


if __name__ == "__main__":
    main()
