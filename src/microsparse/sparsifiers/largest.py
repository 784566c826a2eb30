"""The q largest entries of a long vector, exactly, for about the cost of one compare.

``torch.topk`` over d entries costs many passes over them. But the q-th largest can be
bracketed from a small sample. The vector is read once, into the maxima of blocks of 32
entries (:class:`~microsparse.sparsifiers.base.Candidates`; the last entries, past the last
full chunk of blocks, are compared directly). Of B block maxima, s are
sampled: the j-th largest sample has about j·B/s maxima at or above it, and choosing j a few
standard deviations above q·s/B makes that at least q with near certainty, so at least q
entries are at or above this edge. Only the blocks whose maximum reaches the edge are then
compared entry by entry, which leaves a little more than q candidates (NaN included), and an
exact top-q over those is cheap. If the edge was too high (fewer than q candidates: rare), the
next try takes a sample rank four times larger (a compare over the maxima only), ending in an
exact top-q over everything. The result is the exact top-q whatever the sample: the sample
only decides the cost.

When q is so large that nearly every block holds one of the q largest (q·32 near the length,
as MiCRO's share at a density of a few per cent), the block maxima cannot bracket the q-th
largest. The edge is then taken from a sample of the entries themselves, fixed positions
drawn once: the j-th largest of s sampled entries has about j·d/s entries at or above it, and
one compare of every entry against it leaves a little more than q candidates.
"""

from __future__ import annotations

import math

import torch

from microsparse.sparsifiers.base import Candidates, passing

SAMPLE = 4096
"""Entries sampled per call (fixed positions, drawn once)."""


def sample_rank(quota: int, size: int, samples: int) -> int:
    """The rank j of the sample order statistic that has >= ``quota`` entries above it.

    With μ = quota·samples/size expected samples among the quota largest, j solves
    j − 3·√j = μ: three standard deviations of the (Poisson) count in hand.

    Example:
        >>> sample_rank(quota=100, size=1_000_000, samples=4096)
        10
        >>> sample_rank(quota=100_000, size=1_000_000, samples=4096)
        475
    """
    mu = quota * samples / size
    root = (3.0 + math.sqrt(9.0 + 4.0 * mu)) / 2.0
    return math.ceil(root * root)


class LargestFinder:
    """Exact top-q of contiguous 1-D magnitude vectors of up to ``size`` entries.

    Example:
        >>> finder = LargestFinder(size=100_000)
        >>> values = torch.randn(100_000, generator=torch.Generator().manual_seed(0)).abs_()
        >>> found = finder.largest(values, 50)
        >>> torch.equal(found.sort().values, values.topk(50).indices.sort().values)
        True
        >>> finder.smallest_taken == values.topk(50).values.min().item()
        True
    """

    def __init__(self, size: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        blocks = max(1, size // Candidates.CHUNK * Candidates.LANES)
        count = min(SAMPLE, blocks)
        self._sample = torch.randint(blocks, (count,), generator=generator).sort().values
        entries = torch.randint(max(1, size), (min(SAMPLE, max(1, size)),), generator=generator)
        self._entries = entries.sort().values
        self._entries_size, self._entries_below = -1, self._entries
        self._candidates = Candidates()
        self._taken: torch.Tensor | None = None
        self._sample_size, self._sample_below = -1, self._sample

    @property
    def smallest_taken(self) -> float:
        """The smallest magnitude the last call took (its threshold), NaN before any."""
        return math.nan if self._taken is None else self._taken.min().item()

    def largest(self, magnitude: torch.Tensor, quota: int) -> torch.Tensor:
        """Indices of the ``quota`` largest entries of ``magnitude`` (ties: any of them)."""
        size = magnitude.numel()
        if quota >= size:
            self._taken = magnitude if size else None
            return torch.arange(size, device=magnitude.device)
        if size <= 4 * SAMPLE or 8 * quota >= size:  # small enough for topk itself
            return self._top(magnitude, None, quota)
        if self._sample.device != magnitude.device:
            self._sample, self._sample_size = self._sample.to(magnitude.device), -1
        maxima = self._candidates.maxima(magnitude)
        sample = maxima.index_select(0, self._within(maxima.numel()))
        rank = sample_rank(quota, maxima.numel(), sample.numel())
        if rank > sample.numel():  # a share in nearly every block: bracket from the entries
            return self._from_entries(magnitude, quota)
        while rank <= sample.numel():
            edge = torch.topk(sample, rank, sorted=False).values.min().item()
            if edge > 0 or math.isnan(edge):
                found = self._candidates.at_least(magnitude, edge, maxima)
                if found.numel() >= quota:
                    return self._top(magnitude, found, quota)
            rank *= 4
        return self._top(magnitude, None, quota)

    def _from_entries(self, magnitude: torch.Tensor, quota: int) -> torch.Tensor:
        """Top-``quota`` with the edge taken from sampled entries: one compare of every entry."""
        size = magnitude.numel()
        if self._entries.device != magnitude.device:
            self._entries, self._entries_size = self._entries.to(magnitude.device), -1
        if self._entries_size != size:
            self._entries_below = self._entries[self._entries < size]
            self._entries_size = size
        sample = magnitude.index_select(0, self._entries_below)
        rank = sample_rank(quota, size, sample.numel())
        while rank <= sample.numel():
            edge = torch.topk(sample, rank, sorted=False).values.min().item()
            if edge > 0 or math.isnan(edge):
                found = passing(magnitude, edge)
                if found.numel() >= quota:
                    return self._top(magnitude, found, quota)
            rank *= 4
        return self._top(magnitude, None, quota)

    def _within(self, size: int) -> torch.Tensor:
        """The sampled block numbers below ``size`` (partitions differ by a block at most)."""
        if self._sample_size != size:
            self._sample_below, self._sample_size = self._sample[self._sample < size], size
        return self._sample_below

    def _top(self, magnitude: torch.Tensor, among: torch.Tensor | None, quota: int) -> torch.Tensor:
        values = magnitude if among is None else magnitude.index_select(0, among)
        top = torch.topk(values, quota, sorted=False)
        self._taken = top.values
        return top.indices if among is None else among.index_select(0, top.indices)
