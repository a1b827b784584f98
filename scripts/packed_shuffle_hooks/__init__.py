"""A fairseq --user-dir for scripts/packed_parity.py's control run: ls_fairseq with the sentences of
each collated batch in another order (the same permutation of every per-sentence tensor) and nothing
else changed. The padded step's arithmetic then sums in another order: the validation loss moves by
the rounding of that order alone, the yardstick for the packed step's difference.
PACKED_SHUFFLE_SEED=N (default 0) draws another set of permutations."""
import os

import numpy as np
import torch
from fairseq.data import LanguagePairDataset

import ls_fairseq.fairseq_plugin  # noqa: F401

_COLLATER = LanguagePairDataset.collater


def _shuffled_collater(self, samples, *args, **kwargs):
    batch = _COLLATER(self, samples, *args, **kwargs)
    if not batch:
        return batch
    rows = len(batch["id"])
    seed = int(batch["id"].sum()) + 1_000_003 * int(os.environ.get("PACKED_SHUFFLE_SEED", "0"))
    order = torch.from_numpy(np.random.default_rng(seed).permutation(rows))
    batch["id"] = batch["id"][order]
    batch["target"] = batch["target"][order]
    batch["net_input"] = {k: v[order] if torch.is_tensor(v) and v.shape[:1] == (rows,) else v
                          for k, v in batch["net_input"].items()}
    return batch


LanguagePairDataset.collater = _shuffled_collater
