"""Checks of binarized data against its dictionary, once, on the host, as fairseq loads it.

A token id at or past the dictionary's size (data binarized with another
dictionary, a dict.txt replaced afterwards) would reach the embedding's gather:
on a GPU the kernel reads outside the table (no error, or an illegal memory
access later), on CPU torch's indexing fails without saying which data is at
fault. The fairseq plugin (ls_fairseq.fairseq_plugin) wraps fairseq's
``data_utils.load_indexed_dataset`` (what the translation task, and fairseq's other tasks, load
every split with) with ``check_tokens``: each
memory-mapped dataset it returns (fairseq's default ``mmap`` format) is checked
in one pass over its token buffer with numpy, before training starts (WMT14's
train split: about 150M tokens a side, well under a second), so the training
steps check nothing and never wait for the GPU. Data in fairseq's legacy
formats (``--dataset-impl lazy``/``cached``/``raw``) is not checked here.

Empty lines (fairseq-preprocess keeps one as the end-of-sentence token alone)
are valid input: the split's count of them is logged as a warning.
"""
import logging

import numpy as np

logger = logging.getLogger(__name__)


class DataError(ValueError):
    pass


def _token_buffers(dataset):
    """(token ids, sentence sizes) of each memory-mapped part of ``dataset`` (numpy views, no copy)."""
    from fairseq.data.concat_dataset import ConcatDataset
    from fairseq.data.indexed_dataset import MMapIndexedDataset

    if isinstance(dataset, MMapIndexedDataset):
        return [(np.frombuffer(dataset._bin_buffer, dtype=dataset._index.dtype), dataset._index.sizes)]
    if isinstance(dataset, ConcatDataset):
        return [b for d in dataset.datasets for b in _token_buffers(d)]
    return []


def check_tokens(dataset, dictionary, path):
    """Raise DataError naming ``path``, the first bad id and its sentence if a token id of ``dataset``
    lies outside ``dictionary``; warn with the count of empty sentences."""
    size, empty, total = len(dictionary), 0, 0
    for ids, sizes in _token_buffers(dataset):
        total += len(sizes)
        empty += int(np.count_nonzero(sizes <= 1))
        if ids.size == 0:
            continue
        if int(ids.max()) < size and (ids.dtype.kind == "u" or int(ids.min()) >= 0):
            continue
        bad = np.flatnonzero((ids >= size) | (ids < 0))
        sentence = int(np.searchsorted(np.cumsum(sizes), bad[0], side="right"))
        raise DataError(
            "{}: token id {} in sentence {} is outside the dictionary ({} entries, ids 0-{}); {} token(s) in this "
            "split are. The data was binarized with another dictionary than the data-bin's dict.*.txt: binarize it "
            "again with this dictionary (fairseq-preprocess --srcdict/--tgtdict) or restore the dictionary it was "
            "made with.".format(path, int(ids[bad[0]]), sentence, size, size - 1, len(bad))
        )
    if empty:
        logger.warning("%s: %d of %d sentences are empty (end-of-sentence token only); they are trained on as they are",
                       path, empty, total)
