"""A fairseq --user-dir for the poisoned-step tests: loads the ls_fairseq plugin and makes chosen
updates of ls-fairseq-train's device step non-finite.

``LS_TEST_POISON="loss:3,grad:6-9"``: update 3's loss is multiplied by NaN before its backward
(eager steps only: a replayed CUDA graph runs no Python), updates 6 to 9 get +inf in their first
gradient element after the backward (also under --ls-cuda-graphs: the gradient workspace is
written after the graph's replay)."""
import os

from fairseq.trainer import Trainer

import ls_fairseq.fairseq_plugin  # noqa: F401 (registers the plugin)
from ls_fairseq.optim.mixed_precision import DeviceStepAdam


def _updates(kind):
    chosen = set()
    for item in os.environ.get("LS_TEST_POISON", "").split(","):
        name, _, span = item.partition(":")
        if name == kind:
            first, _, last = span.partition("-")
            chosen.update(range(int(first), int(last or first) + 1))
    return chosen


_update = [0]  # the update the trainer is computing now (1 = the first)
_train_step, _backward, _clip = Trainer.train_step, DeviceStepAdam.backward, DeviceStepAdam.clip_grad_norm


def _train_step_counted(self, samples, raise_oom=False):
    _update[0] = self.get_num_updates() + 1
    return _train_step(self, samples, raise_oom)


def _backward_poisoned(self, loss):
    return _backward(self, loss * float("nan") if _update[0] in _updates("loss") else loss)


def _clip_poisoned(self, max_norm, aggregate_norm_fn=None):
    if _update[0] in _updates("grad"):
        self.workspace.grad.view(-1)[0] = float("inf")
    return _clip(self, max_norm, aggregate_norm_fn)


Trainer.train_step = _train_step_counted
DeviceStepAdam.backward = _backward_poisoned
DeviceStepAdam.clip_grad_norm = _clip_poisoned
