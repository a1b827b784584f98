"""A fairseq --user-dir (with ls-fairseq-train) that profiles one eager training step and
writes, for each kind of runtime call (memsets, kernel launches, copies), how many came from
each chain of calling operators and Python functions: where a step's launches come from.

    LAUNCH_SITES_AT=6 LAUNCH_SITES_OUT=sites.txt python3 -m ls_fairseq.train DATA \\
        --user-dir scripts/launch_sites ...      # the step after update 6 is profiled

It loads the ls_fairseq plugin itself (fairseq takes one --user-dir); nothing else changes.
"""
import collections
import os

import torch
from fairseq.trainer import Trainer
from torch.profiler import ProfilerActivity, profile

import ls_fairseq.fairseq_plugin  # noqa: F401 (registers the plugin)

RUNTIME_CALLS = ("cudaMemsetAsync", "cudaLaunchKernel", "cuLaunchKernelEx", "cuLaunchKernel", "cudaMemcpyAsync")
# frames that say nothing about who made the call
NOISE = ("aten::view", "aten::as_strided", "aten::reshape", "<built-in", "<frozen", "traceback",
         "torch/_functorch", "torch/nn/modules/module.py", "torch/utils/_contextlib")
_train_step = Trainer.train_step


def call_chain(event, depth=7):
    names = []
    parent = event.cpu_parent
    while parent is not None and len(names) < depth:
        if not parent.name.startswith(NOISE):
            names.append(parent.name.replace("autograd::engine::evaluate_function: ", "bw:"))
        parent = parent.cpu_parent
    return " <- ".join(names)


def write_sites(prof, path):
    events = prof.events()
    with open(path, "w") as f:
        for call in RUNTIME_CALLS:
            sites = collections.Counter(call_chain(e) for e in events if e.name == call)
            f.write("== {} total {}\n".format(call, sum(sites.values())))
            for chain, n in sites.most_common(80):
                f.write("{:5d}  {}\n".format(n, chain))
        f.write(prof.key_averages().table(sort_by="count", row_limit=100, max_name_column_width=110))


def _profiled_train_step(self, samples, raise_oom=False):
    if self.get_num_updates() != int(os.environ.get("LAUNCH_SITES_AT", "6")):
        return _train_step(self, samples, raise_oom)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, with_stack=True) as prof:
        out = _train_step(self, samples, raise_oom)
        if cuda:
            torch.cuda.synchronize()
    write_sites(prof, os.environ.get("LAUNCH_SITES_OUT", "launch_sites.txt"))
    return out


Trainer.train_step = _profiled_train_step
