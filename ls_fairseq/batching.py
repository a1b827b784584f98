"""Batches sized by the lengths their tensors will have.

With ``--required-seq-len-multiple M`` fairseq's collater pads every batch's
source and target to a multiple of M, but its batching counts each sentence at
its own length: a batch of 17-token sentences is cut at ``--max-tokens`` tokens
and then padded to 24 a sentence, 1.4x the tensors ``--max-tokens`` allowed for,
which raises the peak memory accordingly (docs/perf-log.md). ``ls-fairseq-train``
counts each sentence at its padded length instead, so ``--max-tokens`` bounds the
padded batch, as it bounds an unpadded one.
"""
import weakref

import numpy as np
from fairseq.data import BaseWrapperDataset, FairseqDataset


def round_up(n, multiple):
    return (n + multiple - 1) // multiple * multiple


class PaddedLengthDataset(BaseWrapperDataset):
    """``dataset`` with its sentences' token counts rounded up to ``multiple``, for batching."""

    def __init__(self, dataset, multiple):
        super().__init__(dataset)
        self.multiple = multiple

    def num_tokens(self, index):
        return round_up(self.dataset.num_tokens(index), self.multiple)

    def num_tokens_vec(self, indices):
        return round_up(np.asarray(self.dataset.num_tokens_vec(indices)), self.multiple)

    def batch_by_size(self, indices, max_tokens=None, max_sentences=None, required_batch_size_multiple=1):
        # fairseq's batching over this dataset's counts (the wrapper's default would ask the inner dataset)
        return FairseqDataset.batch_by_size(self, indices, max_tokens, max_sentences, required_batch_size_multiple)


def padded_length_datasets(task_dataset, multiple):
    """A drop-in for ``task.dataset`` giving each split's dataset as a ``PaddedLengthDataset``,
    the same wrapper for the same dataset (fairseq keeps an epoch iterator per dataset object)."""
    wrapped = weakref.WeakKeyDictionary()

    def dataset(split):
        inner = task_dataset(split)
        if inner not in wrapped:
            wrapped[inner] = PaddedLengthDataset(inner, multiple)
        return wrapped[inner]

    return dataset
