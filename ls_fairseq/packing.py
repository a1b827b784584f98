"""Packed batches: a translation batch's real tokens as two streams, without padding.

``pack_sample`` turns a batch as fairseq's translation collater makes it (padded
[sentences, length] tensors, sources left-padded, targets right-padded by default)
into the packed layout that ls_transformer trains on with ``--ls-packed``: each
side's real tokens one sentence after another as one row [1, capacity] (the
capacity at least the real count, a multiple of 16; the rows after the real ones,
the tail, hold the padding index and are never seen by a real token), the segments'
offsets (int32 [segments + 1]), each token's position (as fairseq's make_positions
gives it: padding_idx + 1 onwards within its sentence) and the longest segment.
The same sentences in the same order: ``id``, ``nsentences`` and ``ntokens`` stay.
Done on the host, in the data loader, so the training step reads no size back.

For CUDA graphs a batch's shapes must repeat: ``Buckets`` rounds each stream up to
one of a few capacities chosen from the epoch's batches (``capacities``: the
partition of the sorted sizes that wastes the fewest rows), and fixes per pair of
capacities the segment count (empty segments at the end) and the longest segment.
"""
import numpy as np
import torch

from ls_fairseq import ops

MULTIPLE = 16  # every capacity: FP8 GEMMs (cuBLASLt) need M % 16 == 0, and tensor-core tiles like it

# the packed sample's extra net_input entries, read by ls_transformer's forward
KEYS = ("ls_src_positions", "ls_tgt_positions", "ls_src_offsets", "ls_tgt_offsets", "ls_src_max_len",
        "ls_tgt_max_len")


def round_up(n, multiple=MULTIPLE):
    return (int(n) + multiple - 1) // multiple * multiple


def capacities(sizes, count=8, multiple=MULTIPLE):
    """At most ``count`` capacities (multiples of ``multiple``) covering ``sizes`` (an array of stream
    lengths), chosen to minimise the sum of (capacity - size) over the sizes: the exact optimum of
    this one-dimensional partition, by dynamic programming over the distinct rounded sizes."""
    rounded = np.array(sorted(set(round_up(s, multiple) for s in sizes)), dtype=np.int64)
    if len(rounded) == 0:
        return []
    sizes = np.sort(np.asarray(sizes, dtype=np.int64))
    # cost(i, j): the rows wasted when every size in (rounded[i-1], rounded[j]] gets capacity rounded[j]
    upto = np.searchsorted(sizes, rounded, side="right")
    below = np.concatenate([[0], upto[:-1]])  # the first size of group i
    prefix = np.concatenate([[0], np.cumsum(sizes)])

    def costs(j):  # cost(i, j) for i = 0 .. j
        lo = below[: j + 1]
        return (upto[j] - lo) * rounded[j] - (prefix[upto[j]] - prefix[lo])

    m, k = len(rounded), min(count, len(rounded))
    best = np.full((k + 1, m), np.inf)  # best[c, j]: the least waste of sizes up to rounded[j] in c groups
    first = np.zeros((k + 1, m), dtype=np.int64)  # the first distinct size of the last group
    for j in range(m):
        best[1, j] = costs(j)[0]
    for c in range(2, k + 1):
        for j in range(c - 1, m):
            total = best[c - 1, : j] + costs(j)[1:]  # the last group starts at i = 1 .. j
            i = int(np.argmin(total))
            best[c, j], first[c, j] = total[i], i + 1
    c = int(np.argmin(best[1:, m - 1])) + 1
    chosen, j = [], m - 1
    while c >= 1:
        chosen.append(int(rounded[j]))
        if c == 1:
            break
        j, c = first[c, j] - 1, c - 1
    return sorted(chosen)


def bucket(size, capacity_list):
    """The smallest capacity of ``capacity_list`` (sorted) holding ``size``; beyond the largest, the
    size rounded up (a batch the epoch's capacities did not foresee)."""
    i = int(np.searchsorted(capacity_list, size))
    return int(capacity_list[i]) if i < len(capacity_list) else round_up(size)


class Buckets:
    """Fixed shapes for CUDA graphs: each stream's capacity from its own ``capacities`` of the epoch's
    batches; per pair of capacities, the segment count (a multiple of 8) and each stream's longest
    segment, the largest over the batches of that pair. ``batches``: one (source lengths, target
    lengths) pair of arrays per batch."""

    def __init__(self, batches, count=8):
        src_sizes = [int(np.sum(s)) for s, _ in batches]
        tgt_sizes = [int(np.sum(t)) for _, t in batches]
        self.src, self.tgt = capacities(src_sizes, count), capacities(tgt_sizes, count)
        self.shapes = {}
        for s, t in batches:
            key = self.key(int(np.sum(s)), int(np.sum(t)))
            segments, src_max, tgt_max = self.shapes.get(key, (0, 0, 0))
            self.shapes[key] = (max(segments, round_up(len(s), 8)), max(src_max, int(np.max(s))),
                                max(tgt_max, int(np.max(t))))

    def key(self, src_size, tgt_size):
        return bucket(src_size, self.src), bucket(tgt_size, self.tgt)

    def shape(self, src_lengths, tgt_lengths):
        """(source capacity, target capacity, segments, longest source, longest target) of a batch."""
        key = self.key(int(np.sum(src_lengths)), int(np.sum(tgt_lengths)))
        segments, src_max, tgt_max = self.shapes.get(key, (0, 0, 0))
        return key + (max(segments, len(src_lengths)), max(src_max, int(np.max(src_lengths))),
                      max(tgt_max, int(np.max(tgt_lengths))))


def _stream(tokens, pad, capacity):
    """(stream [1, capacity], positions [1, capacity], lengths) of a padded [sentences, length] batch."""
    real = tokens.ne(pad)
    lengths = real.sum(1)
    stream = torch.full((1, capacity), pad, dtype=tokens.dtype)
    positions = torch.full((1, capacity), pad, dtype=torch.long)
    n = int(lengths.sum())
    stream[0, :n] = tokens[real]
    # make_positions: padding_idx + 1 onwards within each sentence, wherever its padding is
    positions[0, :n] = (torch.cumsum(real, 1) + pad)[real]
    return stream, positions, lengths


def _offsets(lengths, segments):
    offsets = torch.zeros(segments + 1, dtype=torch.int32)
    offsets[1 : len(lengths) + 1] = torch.cumsum(lengths, 0)
    offsets[len(lengths) + 1 :] = offsets[len(lengths)]  # empty segments after the batch's sentences
    return offsets


def pack_sample(sample, pad, buckets=None):
    """The packed form of a collated translation ``sample`` (see the module docstring); ``buckets``: a
    Buckets for fixed shapes, else each stream rounded up to a multiple of 16 with one segment per
    sentence."""
    net_input = sample["net_input"]
    src, prev, target = net_input["src_tokens"], net_input["prev_output_tokens"], sample["target"]
    src_lengths, tgt_lengths = src.ne(pad).sum(1), target.ne(pad).sum(1)
    if not torch.equal(prev.ne(pad).sum(1), tgt_lengths):
        raise ValueError("pack_sample: prev_output_tokens and target hold different token counts per sentence")
    if buckets is None:
        shape = (round_up(src_lengths.sum()), round_up(tgt_lengths.sum()), len(src_lengths),
                 int(src_lengths.max()), int(tgt_lengths.max()))
    else:
        shape = buckets.shape(src_lengths.numpy(), tgt_lengths.numpy())
    src_capacity, tgt_capacity, segments, src_max, tgt_max = shape
    src_stream, src_positions, _ = _stream(src, pad, src_capacity)
    prev_stream, tgt_positions, _ = _stream(prev, pad, tgt_capacity)
    target_stream, _, _ = _stream(target, pad, tgt_capacity)
    packed = dict(sample)
    packed["target"] = target_stream
    packed["net_input"] = dict(
        net_input,
        src_tokens=src_stream,
        prev_output_tokens=prev_stream,
        ls_src_positions=src_positions,
        ls_tgt_positions=tgt_positions,
        ls_src_offsets=_offsets(src_lengths, segments),
        ls_tgt_offsets=_offsets(tgt_lengths, segments),
        ls_src_max_len=src_max,
        ls_tgt_max_len=tgt_max,
    )
    ls, lt = src_lengths.double(), tgt_lengths.double()
    # host figures of the real tokens for the model FLOPs (ls_transformer.training_flops)
    packed["ls_lengths"] = {"src": float(ls.sum()), "tgt": float(lt.sum()), "src_sq": float((ls * ls).sum()),
                            "tgt_sq": float((lt * lt).sum()), "cross": float((ls * lt).sum())}
    return packed


class Packed:
    """A packed batch's streams as the layers see them (from pack_sample's net_input entries): each side's positions
    and longest sentence, and the masks of the encoder's and the decoder's self-attention and of the
    cross-attention, shared by every layer; ``triton``: the masks send segment attention to ls's Triton
    kernels where they run (ops.segment_attention)."""

    def __init__(self, ls_src_positions, ls_tgt_positions, ls_src_offsets, ls_tgt_offsets, ls_src_max_len,
                 ls_tgt_max_len, triton=True):
        self.src_positions, self.tgt_positions = ls_src_positions, ls_tgt_positions
        self.src_max_len, self.tgt_max_len = int(ls_src_max_len), int(ls_tgt_max_len)
        self.encoder_mask = ops.SegmentMask(ls_src_offsets, ls_src_offsets, self.src_max_len, self.src_max_len,
                                            triton=triton)
        self.decoder_mask = ops.SegmentMask(ls_tgt_offsets, ls_tgt_offsets, self.tgt_max_len, self.tgt_max_len,
                                            causal=True, triton=triton)
        self.cross_mask = ops.SegmentMask(ls_tgt_offsets, ls_src_offsets, self.tgt_max_len, self.src_max_len,
                                          triton=triton)


def is_packed(sample):
    return "ls_src_offsets" in sample.get("net_input", {})
