"""The selection primitives against brute force: exact top-q, and NaN-safe candidates."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from microsparse.sparsifiers.base import Candidates
from microsparse.sparsifiers.largest import LargestFinder, top_indices


def streams() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    size = 200_003  # not a multiple of 8: the mask's padding words
    gaussian = torch.randn(size, generator=generator).abs_()
    tail = torch.empty(size).exponential_(generator=generator) ** 4  # heavy tail
    sparse = gaussian.clone()
    sparse[torch.rand(size, generator=generator) < 0.995] = 0  # mostly zeros (embeddings)
    scales = torch.tensor([1e-6, 1.0, 1e3])
    layered = gaussian * scales.repeat_interleave(torch.tensor([100_000, 90_000, 10_003]))
    ties = torch.randint(0, 5, (size,), generator=generator).float()  # many equal values
    return [("gaussian", gaussian), ("tail", tail), ("sparse", sparse), ("layered", layered),
            ("ties", ties)]  # fmt: skip


@pytest.mark.parametrize("quota", [1, 7, 200, 3_000, 8_000, 30_000])  # 8,000: by entries
def test_largest_finder_is_exact_topk(quota: int) -> None:
    finder = LargestFinder()
    for name, values in streams():
        found = finder.largest(values, quota)
        assert found.numel() == quota and found.unique().numel() == quota, name
        kth = torch.topk(values, quota).values[-1]
        # Exactly a top-q set: everything taken is >= the q-th largest, everything left <= it.
        taken = torch.zeros_like(values, dtype=torch.bool)
        taken[found] = True
        assert bool((values[taken] >= kth).all()) and bool((values[~taken] <= kth).all()), name
        assert finder.smallest_taken().item() == kth.item(), name


class FreshBytes(TorchDispatchMode):
    """Bytes of the new tensors the operators make (outputs that share no input's storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        given = {t.untyped_storage().data_ptr() for t in [*args, *kwargs.values()]
                 if isinstance(t, torch.Tensor)}  # fmt: skip
        out = func(*args, **kwargs)
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            fresh = isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr()
            if fresh and fresh not in given:
                self.bytes += tensor.untyped_storage().nbytes()
        return out


def test_largest_finder_keeps_its_candidates_from_step_to_step() -> None:
    """A slab's rotating partitions differ in size and its quotas by one: every call stays
    exact, and once each shape was seen a call makes O(quota) bytes of new tensors, not the
    32 candidates a block (positions and values) nor anything of the vector's size."""
    generator = torch.Generator().manual_seed(3)
    vectors = [torch.randn(size, generator=generator).abs_() for size in (300_017, 300_016)]
    finder, shapes = LargestFinder(), [(0, 1000), (1, 1001), (0, 1001), (1, 1000)]
    for round_ in range(3):
        for which, quota in shapes:
            values = vectors[which]
            counter = FreshBytes()
            with counter:
                found = finder.largest(values, quota)
            kth = torch.topk(values, quota).values[-1]
            assert found.unique().numel() == quota and bool((values[found] >= kth).all())
            if round_:  # steady: a few tensors of quota entries (the two top-q's, the blocks'
                # first positions, the answer), not the candidates' 32 · quota (12 bytes each)
                assert counter.bytes <= 64 * quota, (which, quota, counter.bytes)


@pytest.mark.parametrize("quota", [1, 5, 64, 999, 1000])
def test_top_indices_takes_ties_in_any_order_but_exactly_quota(quota: int) -> None:
    values = torch.randint(0, 7, (1000,), generator=torch.Generator().manual_seed(quota)).float()
    indices, taken = top_indices(values, quota)
    assert indices.unique().numel() == quota
    assert torch.equal(values[indices].sort().values, values.topk(quota).values.sort().values)
    assert taken.min().item() == values.topk(quota).values.min().item()


def test_largest_finder_takes_nan_first() -> None:
    values = torch.randn(100_000, generator=torch.Generator().manual_seed(1)).abs_()
    values[[5, 77_777]] = math.nan
    found = LargestFinder().largest(values, 10)
    assert {5, 77_777} <= set(found.tolist())


@pytest.mark.parametrize("fraction", [0.0001, 0.01, 0.3])
def test_candidates_match_nonzero_with_nan_counted(fraction: float) -> None:
    generator = torch.Generator().manual_seed(2)
    candidates = Candidates()
    for size in (1, 8, 13, 50_001, 300_001):
        values = torch.rand(size, generator=generator)
        values[torch.rand(size, generator=generator) < 0.001] = math.nan
        threshold = 1 - fraction
        expected = torch.nonzero((values >= threshold) | values.isnan()).squeeze(1)
        for _ in range(2):  # the word scan, then (after a dense call) the plain one
            found = candidates.at_least(values, threshold).sort().values
            assert torch.equal(found, expected), size
