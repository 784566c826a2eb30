"""Each rank's first ``count`` slots of a gathered table, kept without reading anything back.

Example:
    >>> kept = KeptSlots()
    >>> kept.index([2, 0, 1], width=3).tolist()           # rows of 3 slots: r · 3 + i
    [0, 1, 6]
    >>> kept.index([2, 0, 1], width=3, first=1).tolist()  # slot i at column i + 1
    [1, 2, 7]
"""

from __future__ import annotations

import torch


class KeptSlots:
    """The flat index of every rank's first ``counts[r]`` slots in an (n, ``width``) table,
    made once per pattern of counts (with quotas they rotate with the step: a few per rank),
    so that a gather keeps them at sizes the host knew before the exchange."""

    def __init__(self) -> None:
        self._known: dict[tuple[tuple[int, ...], int, int, torch.device], torch.Tensor] = {}

    def index(
        self, counts: list[int], width: int, first: int = 0, device: torch.device | None = None
    ) -> torch.Tensor:
        """Rank r's slot i at ``r · width + first + i``, for i below ``counts[r]`` (int64)."""
        device = torch.device("cpu") if device is None else device
        key = (tuple(counts), width, first, device)
        index = self._known.get(key)
        if index is None:
            if len(self._known) > 4 * len(counts):
                self._known.clear()
            flat = [r * width + first + i for r, count in enumerate(counts) for i in range(count)]
            index = self._known[key] = torch.tensor(flat, dtype=torch.long, device=device)
        return index
