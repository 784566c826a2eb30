"""The q largest entries of a long vector, exactly, with every size fixed in advance so that
the host never waits for the device.

``torch.topk`` over d entries costs many passes over them. But every one of the q largest
entries lies in one of the q blocks with the largest maxima (a block outside them has q
blocks at least as large, each holding an entry at least as large as any of its own). So
the vector is read once, into the maxima of blocks of 32 entries
(:meth:`~microsparse.sparsifiers.base.Candidates.maxima`; the last entries, past the last
full chunk of blocks, are always candidates), the q largest of the d/32 maxima pick q
blocks, and the q largest of their 32·q entries are the answer (two ``torch.topk`` of
about d/32 entries each, instead of one of d). Both small selections have sizes fixed by q
alone: nothing depends on the data but the values.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from microsparse.sparsifiers.base import Candidates


def top_indices(values: torch.Tensor, quota: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the ``quota`` largest of the 1-D ``values`` (ties: any of them; NaN counts
    as the largest), and the values there; no host synchronisation.

    Example:
        >>> indices, taken = top_indices(torch.tensor([0.5, 3.0, 1.0, 3.0, 2.0]), 3)
        >>> sorted(indices.tolist()), taken.min().item()
        ([1, 3, 4], 2.0)
    """
    top = torch.topk(values, quota, sorted=False)
    return top.indices, top.values


class LargestFinder:
    """Exact top-q of contiguous 1-D magnitude vectors, without host synchronisation.

    Example:
        >>> finder = LargestFinder()
        >>> values = torch.randn(100_000, generator=torch.Generator().manual_seed(0)).abs_()
        >>> found = finder.largest(values, 50)
        >>> torch.equal(found.sort().values, values.topk(50).indices.sort().values)
        True
        >>> finder.smallest_taken().item() == values.topk(50).values.min().item()
        True
    """

    SMALL = 64 * 1024
    """Vectors shorter than this are searched directly."""

    def __init__(self) -> None:
        self._candidates = Candidates()
        self._taken: torch.Tensor | float = math.nan
        self._kept: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def smallest_taken(self) -> torch.Tensor | float:
        """The smallest magnitude the last call took (its threshold), NaN before any: a 0-d
        tensor, whose kernel runs only when this is asked for."""
        return self._taken if isinstance(self._taken, float) else self._taken.amin()

    def smallest_taken_reader(self) -> Callable[[], float]:
        """A function that reads the last call's :meth:`smallest_taken` (later, on the host):
        no kernel runs until it is called."""
        taken = self._taken
        return lambda: taken if isinstance(taken, float) else taken.amin().item()

    def largest_taken(self) -> torch.Tensor | None:
        """The largest magnitude the last call took, a one-element tensor (None if it took
        none): from the values the search kept anyway, one small reduction."""
        taken = self._taken
        return taken.amax().view(1) if isinstance(taken, torch.Tensor) and taken.numel() else None

    def largest(self, magnitude: torch.Tensor, quota: int) -> torch.Tensor:
        """Indices of the ``quota`` largest entries of ``magnitude`` (ties: any of them;
        NaN counts as the largest)."""
        size = magnitude.numel()
        if quota >= size:
            self._taken = magnitude.clone() if size else math.nan  # a buffer reused later
            return _arange(size, magnitude.device)
        lanes, chunk, depth = Candidates.LANES, Candidates.CHUNK, Candidates.DEPTH
        if size < self.SMALL or 2 * depth * quota >= size:  # no fewer candidates by blocks
            indices, self._taken = top_indices(magnitude, quota)
            return indices
        maxima = self._candidates.maxima(magnitude)
        blocks, _ = top_indices(maxima, quota)
        # Block (c, l) holds entries c·chunk + l + j·lanes, j < depth.
        first = torch.div(blocks, lanes, rounding_mode="floor").mul_(chunk).add_(blocks % lanes)
        entries, values = self._buffers(magnitude, quota, maxima.numel() // lanes * chunk)
        blocked = entries[: quota * depth].view(quota, depth)
        torch.add(first.unsqueeze(1), _arange(depth, magnitude.device), alpha=lanes, out=blocked)
        chosen, self._taken = top_indices(torch.index_select(magnitude, 0, entries, out=values),
                                          quota)  # fmt: skip
        return entries.index_select(0, chosen)

    def _buffers(
        self, magnitude: torch.Tensor, quota: int, covered: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The candidates' positions and values, kept from step to step: ``depth`` entries
        for each of ``quota`` blocks, then every entry past the last full chunk (``covered``
        on), always a candidate, written once. A slab's rotating partitions and quotas take
        a few sizes, each kept (O(k) memory)."""
        key = (magnitude.numel(), quota, magnitude.device, magnitude.dtype)
        found = self._kept.get(key)
        if found is None:
            if len(self._kept) >= 8:
                self._kept.clear()
            size, device, blocked = magnitude.numel(), magnitude.device, quota * Candidates.DEPTH
            entries = torch.empty(blocked + size - covered, dtype=torch.long, device=device)
            torch.arange(covered, size, out=entries[blocked:])
            values = torch.empty(entries.numel(), dtype=magnitude.dtype, device=device)
            found = self._kept[key] = (entries, values)
        return found


_aranges: dict[tuple[int, torch.device], torch.Tensor] = {}


def _arange(size: int, device: torch.device) -> torch.Tensor:
    """``torch.arange(size)`` on ``device``, made once (read-only)."""
    key = (size, device)
    found = _aranges.get(key)
    if found is None:
        found = _aranges[key] = torch.arange(size, device=device)
    return found
