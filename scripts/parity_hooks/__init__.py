"""A fairseq --user-dir for the noise-floor run of scripts/parity.py: stock fairseq
with its dropout stream moved and nothing else changed.

fairseq seeds torch before every update with --seed + the update number; this
adds 10,000 to that seed, so the run sees the same data in the same order from
the same weights, with other dropout masks: how far two runs of one model drift
apart through dropout alone, which is what separates ls_fairseq's run (its
kernels draw their own masks) from stock's. It loads ls_fairseq only for its
checkpoint allowlist (torch >= 2.6 reads the initial checkpoint weights-only).
"""
from fairseq import utils

import ls_fairseq.fairseq_plugin  # noqa: F401

SEED_OFFSET = 10_000
_set_torch_seed = utils.set_torch_seed


def _moved_torch_seed(seed):
    return _set_torch_seed(seed + SEED_OFFSET)


utils.set_torch_seed = _moved_torch_seed
