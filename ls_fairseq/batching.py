"""Batches sized by the lengths their tensors will have.

With ``--required-seq-len-multiple M`` fairseq's collater pads every batch's
source and target to a multiple of M, but its batching counts each sentence at
its own length: a batch of 17-token sentences is cut at ``--max-tokens`` tokens
and then padded to 24 a sentence, 1.4x the tensors ``--max-tokens`` allowed for,
which raises the peak memory accordingly (docs/perf-log.md). ``ls-fairseq-train``
counts each sentence at its padded length instead, so ``--max-tokens`` bounds the
padded batch, as it bounds an unpadded one.

With ``--ls-packed`` the training split's batches are packed instead
(``PackedDataset``, ls_fairseq.packing): the same sentences as fairseq's batching
puts together, each side's real tokens as one stream. The fairseq plugin has fairseq's
Trainer call ``pack_training_batches``, so fairseq-train --user-dir and ls-fairseq-train
both train packed.
"""
import logging
import weakref

import numpy as np
from fairseq.data import BaseWrapperDataset, FairseqDataset

from ls_fairseq import packing

logger = logging.getLogger(__name__)


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


class PackedDataset(BaseWrapperDataset):
    """A translation ``dataset`` whose batches are collated as fairseq's collater does and then packed
    (ls_fairseq.packing.pack_sample). Batching is the dataset's own: the same sentences per batch.
    From the batches that batch_by_size made, a Buckets fixes the streams' capacities, segment counts
    and longest sentences: the shapes repeat (CUDA graphs), and an eager run packs exactly as a graphed
    one, so both draw the same dropout over the same shapes and end with the same bits."""

    def __init__(self, dataset, pad):
        super().__init__(dataset)
        self.pad, self.buckets = pad, None

    def batch_by_size(self, indices, max_tokens=None, max_sentences=None, required_batch_size_multiple=1):
        batches = self.dataset.batch_by_size(indices, max_tokens, max_sentences, required_batch_size_multiple)
        if getattr(self.dataset, "tgt_sizes", None) is not None:
            src, tgt = self.dataset.src_sizes, self.dataset.tgt_sizes
            self.buckets = packing.Buckets([(src[b], tgt[b]) for b in batches if len(b)])
            logger.info("--ls-packed: source capacities %s, target capacities %s, %d shapes", self.buckets.src,
                        self.buckets.tgt, len(self.buckets.shapes))
        return batches

    def collater(self, samples):
        sample = self.dataset.collater(samples)
        if not sample:
            return sample
        if "prev_output_tokens" not in sample.get("net_input", {}):
            raise ValueError("--ls-packed packs translation batches (source, prev_output_tokens, target); "
                             "this task's batches have {}".format(sorted(sample.get("net_input", sample))))
        return packing.pack_sample(sample, self.pad, self.buckets)


def pack_training_batches(trainer):
    """With --ls-packed (an ls_transformer option): the trainer's training split packed. Checks that
    the criterion can take packed batches."""
    cfg = trainer.cfg
    if not getattr(cfg.model, "ls_packed", False):
        return
    if not hasattr(trainer.criterion, "losses"):
        raise ValueError("--ls-packed needs --criterion ls_label_smoothed_cross_entropy (the criterion reads the "
                         "packed target stream); got {}".format(type(trainer.criterion).__name__))
    task, split = trainer.task, cfg.dataset.train_subset
    task_dataset = task.dataset
    wrapped = weakref.WeakKeyDictionary()

    def dataset(name):
        inner = task_dataset(name)
        if name != split:
            return inner
        if inner not in wrapped:
            wrapped[inner] = PackedDataset(inner, task.target_dictionary.pad())
        return wrapped[inner]

    task.dataset = dataset
    logger.info("--ls-packed: training batches of %s packed (validation stays padded)", split)
