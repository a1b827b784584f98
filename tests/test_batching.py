"""Batches sized by their padded lengths under --required-seq-len-multiple (ls_fairseq/batching.py)."""
import re

import numpy as np
import pytest
import torch
from conftest import bin_path, run
from fairseq.data import Dictionary, LanguagePairDataset

from ls_fairseq.batching import PaddedLengthDataset, padded_length_datasets


def pairs(n, multiple, seed=0):
    rng = np.random.default_rng(seed)
    d = Dictionary()
    for i in range(50):
        d.add_symbol("w{}".format(i))
    src_len, tgt_len = rng.integers(2, 40, n), rng.integers(2, 40, n)
    src = [torch.randint(d.nspecial, len(d), (int(k),)) for k in src_len]
    tgt = [torch.randint(d.nspecial, len(d), (int(k),)) for k in tgt_len]
    return LanguagePairDataset(src, src_len, d, tgt, tgt_len, d, shuffle=False, pad_to_multiple=multiple)


def padded_batch_tokens(dataset, batches):
    """The largest source and target tensors (sentences x padded length) the collater builds."""
    sizes = []
    for batch in batches:
        sample = dataset.collater([dataset[i] for i in batch])
        sizes.append(max(sample["net_input"]["src_tokens"].numel(), sample["target"].numel()))
    return max(sizes)


def test_padded_batches_stay_within_max_tokens():
    inner = pairs(600, 8)
    indices = inner.ordered_indices()
    # fairseq's own batching counts unpadded lengths: its padded batches pass --max-tokens
    assert padded_batch_tokens(inner, inner.batch_by_size(indices, max_tokens=256)) > 256
    wrapped = PaddedLengthDataset(inner, 8)
    batches = wrapped.batch_by_size(indices, max_tokens=256)
    assert padded_batch_tokens(inner, batches) <= 256
    assert sorted(np.concatenate(batches).tolist()) == sorted(indices.tolist())  # every sentence, once
    assert wrapped.num_tokens(0) % 8 == 0 and wrapped.num_tokens(0) >= inner.num_tokens(0)
    assert (wrapped.num_tokens_vec(indices) == [wrapped.num_tokens(i) for i in indices]).all()


def test_the_task_sees_one_wrapper_per_dataset():
    datasets = {"train": pairs(20, 8), "valid": pairs(20, 8, seed=1)}
    dataset = padded_length_datasets(datasets.__getitem__, 8)
    train = dataset("train")
    assert isinstance(train, PaddedLengthDataset) and train.dataset is datasets["train"]
    assert dataset("train") is train and dataset("valid") is not train  # fairseq keys epoch iterators on it


@pytest.mark.slow
def test_ls_fairseq_train_sizes_batches_by_padded_length(data_bin, tmp_path):
    """ls-fairseq-train with --required-seq-len-multiple cuts an epoch into more batches than
    fairseq-train (each sentence counted at its padded length)."""
    from test_cli import TRAIN

    args = [str(data_bin / "data-bin")] + TRAIN + ["--required-seq-len-multiple", "32", "--max-update", "5",
                                                   "--disable-validation", "--no-save"]
    batches = {}
    for tool in ("ls-fairseq-train", "fairseq-train"):
        extra = [] if tool == "ls-fairseq-train" else ["--user-dir", __import__("conftest").USER_DIR]
        proc = run([bin_path(tool)] + args + extra + ["--save-dir", str(tmp_path / tool)])
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log[-3000:]
        batches[tool] = int(re.search(r"epoch 001:\s+\d+ / (\d+)", log).group(1))
    assert batches["ls-fairseq-train"] > batches["fairseq-train"], batches


def test_the_first_batch_is_collated_once_while_it_stays_the_same(monkeypatch):
    """fairseq's trainer reads the epoch iterator's first batch at every epoch: collated once, equal to
    fairseq's, and collated again when fairseq rebuilds its batch list (a new first batch)."""
    from fairseq.data import iterators

    from ls_fairseq.fairseq_plugin.hooks import first_batch_once

    dataset = pairs(60, 8)
    calls = []

    def collate(samples):
        calls.append(len(samples))
        return dataset.collater(samples)

    def batch_sampler(data, epoch):  # fairseq's callable form: rebuilt when the epoch changes
        return dataset.batch_by_size(dataset.ordered_indices(), max_tokens=64 + epoch)

    stock = vars(iterators.EpochBatchIterator)["first_batch"]
    stock = property(getattr(stock.fget, "__wrapped__", stock.fget))  # fairseq's own, the plugin installed or not
    monkeypatch.setattr(iterators.EpochBatchIterator, "first_batch", stock)
    iterator = iterators.EpochBatchIterator(dataset, collate, batch_sampler)
    want = iterator.first_batch
    monkeypatch.setattr(iterators.EpochBatchIterator, "first_batch", first_batch_once(stock))
    calls.clear()
    got = [iterator.first_batch for _ in range(3)]
    assert len(calls) == 1 and all(g is got[0] for g in got)
    assert torch.equal(got[0]["net_input"]["src_tokens"], want["net_input"]["src_tokens"])
    for _ in iterator.next_epoch_itr():  # epoch 1, then epoch 2: fairseq rebuilds the batch list
        pass
    iterator.next_epoch_itr()
    calls.clear()
    again = iterator.first_batch
    assert len(calls) == 1 and again is not got[0] and iterator.first_batch is again
    assert again["id"].tolist() == iterator.frozen_batches[0].tolist()
