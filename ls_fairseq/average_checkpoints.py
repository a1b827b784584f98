"""``python -m ls_fairseq.average_checkpoints OUT IN [IN ...]``: average model weights.

The mean of the inputs' model parameters (accumulated in fp32, stored in each
parameter's dtype) with the other fields of the last input; the optimizer
state is dropped. Loads with weights_only (the plugin allowlists fairseq's
checkpoint types) and writes atomically.
"""
import argparse
import sys

import torch

from ls_fairseq.checkpoint import fairseq_types_allowed
from ls_fairseq.convert import save_atomic


def average(paths):
    states = [torch.load(p, map_location="cpu", weights_only=True) for p in paths]
    keys = list(states[0]["model"])
    for p, s in zip(paths, states):
        if list(s["model"]) != keys:
            raise ValueError("{} holds other parameters than {}".format(p, paths[0]))
    out = dict(states[-1])
    out["model"] = {
        k: (sum(s["model"][k].float() for s in states) / len(states)).to(states[0]["model"][k].dtype)
        if states[0]["model"][k].is_floating_point() else states[-1]["model"][k]
        for k in keys
    }
    out["last_optimizer_state"] = None
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ls_fairseq.average_checkpoints", description=__doc__.split("\n\n")[0])
    parser.add_argument("output")
    parser.add_argument("inputs", nargs="+")
    args = parser.parse_args(argv)
    with fairseq_types_allowed():
        averaged = average(args.inputs)
    save_atomic(averaged, args.output)
    print("averaged {} checkpoints into {}".format(len(args.inputs), args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
