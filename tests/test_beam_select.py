"""The beam_select op (HARS candidate selection) against torch.topk and a stable sort, on the CPU
reference and the CUDA kernel: values, indices, ties in index order, -inf rows, bad input."""
import math

import pytest
import torch

from ls_fairseq.ops.beam_select import beam_select, beam_select_reference, group_threshold, order_keys


def sort_reference(scores, k):
    """The k largest by a stable descending sort: equal values in index order."""
    values, indices = torch.sort(scores.float(), dim=1, descending=True, stable=True)
    return values[:, :k], indices[:, :k]


@pytest.mark.parametrize("rows,entries,k,groups", [(1, 1, 1, 32), (3, 7, 2, 32), (5, 1000, 8, 32), (4, 4 * 611, 8, 7),
                                                   (2, 33, 33, 4), (6, 130, 10, 130)])
@pytest.mark.parametrize("kind", ["normal", "ties", "inf"])
def test_beam_select_equals_topk(rows, entries, k, groups, kind):
    x = torch.randn(rows, entries)
    if kind == "ties":  # few distinct values, +0.0 and -0.0 among them
        x = torch.randint(-3, 3, (rows, entries)).float() / 2
        x[x.eq(0) & torch.rand_like(x).lt(0.5)] = -0.0
    if kind == "inf":  # -inf everywhere but a few entries (fewer finite ones than k in some rows)
        x = torch.where(torch.rand_like(x) < 0.9, torch.tensor(-math.inf), x)
        x[0] = -math.inf
    values, indices = beam_select(x, k, groups)
    ref_values, ref_indices = sort_reference(x, k)
    assert indices.dtype == torch.int64 and values.dtype == x.dtype
    assert torch.equal(values, torch.topk(x, k, dim=1).values)
    assert torch.equal(values, ref_values)
    assert torch.equal(indices, ref_indices)
    assert torch.equal(x.gather(1, indices), values)
    # the HARS threshold: never above the k-th largest, and at least k candidates reach it
    keys = order_keys(x)
    threshold = group_threshold(keys, k, max(min(groups, entries), k))
    kth = keys.topk(k, dim=1).values[:, -1:]
    assert (threshold <= kth).all() and (keys >= threshold).sum(1).ge(k).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_beam_select_half_precision(dtype):
    x = (torch.randn(4, 300) * 4).to(dtype)
    values, indices = beam_select(x, 9)
    ref_values, ref_indices = sort_reference(x, 9)
    assert values.dtype == dtype and torch.equal(values.float(), ref_values) and torch.equal(indices, ref_indices)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,entries,k,groups", [(1, 1, 1, 32), (3, 7, 2, 32), (5, 4 * 32003, 8, 32),
                                                   (128, 5 * 611, 10, 32), (2, 33, 33, 4), (6, 3000, 64, 1024)])
@pytest.mark.parametrize("kind", ["normal", "ties", "inf", "constant"])
def test_beam_select_kernel_equals_the_reference(dtype, rows, entries, k, groups, kind):
    """The HARS kernel against the reference and a stable sort: the same values and indices, ties in
    index order; "constant" rows put every entry of the first k runs above the threshold, more than
    the kernel's candidate buffer at 128,012 entries (its k-pass path)."""
    from helpers import kernel

    x = torch.randn(rows, entries, device="cuda")
    if kind == "ties":
        x = torch.randint(-3, 3, (rows, entries), device="cuda").float() / 2
        x[x.eq(0) & torch.rand_like(x).lt(0.5)] = -0.0
    if kind == "inf":
        x = torch.where(torch.rand_like(x) < 0.9, torch.tensor(-math.inf, device="cuda"), x)
        x[0] = -math.inf
    if kind == "constant":
        x = torch.full((rows, entries), -1.25, device="cuda")
    x = x.to(dtype)
    kernel("beam_select", x)
    values, indices = beam_select(x, k, groups)
    ref_values, ref_indices = beam_select_reference(x, k, groups)
    assert values.dtype == dtype and indices.dtype == torch.int64
    assert torch.equal(indices, ref_indices) and torch.equal(values, ref_values)
    sorted_values, sorted_indices = sort_reference(x, k)
    assert torch.equal(indices, sorted_indices.to(indices.device)) and torch.equal(values.float(), sorted_values)


def test_beam_select_rejects_bad_input():
    with pytest.raises(ValueError, match="k = 5"):
        beam_select(torch.zeros(2, 4), 5)
    with pytest.raises(ValueError, match="rows, entries"):
        beam_select(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="float64"):
        beam_select(torch.zeros(2, 4, dtype=torch.float64), 1)
