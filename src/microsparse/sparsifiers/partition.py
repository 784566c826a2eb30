"""Splitting the flat gradient vector into per-worker partitions."""

from __future__ import annotations

from typing import NamedTuple

import torch


def contiguous_partitions(numel: int, parts: int) -> list[tuple[int, int]]:
    """Near-equal contiguous half-open ranges covering ``[0, numel)``.

    The first ``numel % parts`` ranges get one extra element, as in MiCRO's reference code.
    When ``numel < parts`` the trailing ranges are empty.

    Example:
        >>> contiguous_partitions(10, 4)
        [(0, 3), (3, 6), (6, 8), (8, 10)]
        >>> contiguous_partitions(2, 3)
        [(0, 1), (1, 2), (2, 2)]
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    quotient, remainder = divmod(numel, parts)
    ranges = []
    start = 0
    for index in range(parts):
        end = start + quotient + (1 if index < remainder else 0)
        ranges.append((start, end))
        start = end
    return ranges


def owned_partition(step: int, rank: int, world_size: int) -> int:
    """The partition that ``rank`` owns at ``step``: (step + rank) mod n.

    Every partition has exactly one owner each step, and ownership rotates with period n.

    Example:
        >>> [owned_partition(step, rank=1, world_size=3) for step in range(4)]
        [1, 2, 0, 1]
    """
    return (step + rank) % world_size


class Segment(NamedTuple):
    """Owned entries as a 2-D view: element (row, col) is flat position base + row·stride + col."""

    view: torch.Tensor
    base: int
    row_stride: int


class ContiguousPartitions:
    """The reference layout: partition p is one contiguous range (``contiguous_partitions``).

    Example:
        >>> ContiguousPartitions(10, 4).size(0)
        3
    """

    kind = "contiguous"

    def __init__(self, numel: int, parts: int) -> None:
        self.ranges = contiguous_partitions(numel, parts)

    def size(self, part: int) -> int:
        start, end = self.ranges[part]
        return end - start

    def range(self, part: int) -> tuple[int, int] | None:
        return self.ranges[part]

    def segments(self, vector: torch.Tensor, part: int) -> list[Segment]:
        start, end = self.ranges[part]
        return [Segment(vector[start:end].unsqueeze(0), start, 0)] if end > start else []

    def positions(self, part: int, indices: torch.Tensor) -> torch.Tensor:
        """Flat positions of ``indices`` into the partition's entries (read as ``segments``).

        Example:
            >>> ContiguousPartitions(10, 4).positions(1, torch.tensor([0, 2])).tolist()
            [3, 5]
        """
        start = self.ranges[part][0]
        return indices + start if start else indices

    def rows(self, part: int) -> tuple[int, torch.Tensor]:
        """As :meth:`InterleavedPartitions.rows`: one row, as long as the vector or longer (a
        power of 2, so that a caller may shift instead of divide), based at its start.

        Example:
            >>> ContiguousPartitions(10, 4).rows(1)
            (16, tensor([3]))
        """
        row = 1 << max(0, self.ranges[-1][1] - 1).bit_length()
        return row, torch.tensor([self.ranges[part][0]])

    def offsets(self, part: int, positions: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`positions`: flat positions of partition ``part`` as indices
        into its entries.

        Example:
            >>> ContiguousPartitions(10, 4).offsets(1, torch.tensor([3, 5])).tolist()
            [0, 2]
        """
        start = self.ranges[part][0]
        return positions - start if start else positions


class InterleavedPartitions:
    """Blocks of ``block`` entries dealt round-robin: partition p owns blocks p, p + n, p + 2n, ...

    Contiguous partitions of a real model are unbalanced: layers differ in gradient magnitude,
    so one partition may hold most of the entries above the threshold, and the padded index
    exchange pays for the largest count n times. Dealing small blocks round-robin gives every
    partition a slice of every layer. The owned blocks form one strided 2-D view (plus the
    short tail block for one partition), so selection is still a single pass over d/n entries.

    Example:
        >>> partitions = InterleavedPartitions(10, parts=2, block=2)
        >>> [partitions.size(p) for p in range(2)]
        [6, 4]
        >>> [s.view.tolist() for s in partitions.segments(torch.arange(10.0), 0)]
        [[[0.0, 1.0], [4.0, 5.0], [8.0, 9.0]]]
    """

    kind = "interleaved"

    def __init__(self, numel: int, parts: int, block: int | None = None) -> None:
        # At least ~64 blocks per partition where the vector allows, at most 4096 entries per
        # block (16 KB of float32: long enough runs that strided access costs little).
        self.block = block or max(1, min(4096, numel // (64 * parts)))
        self.numel = numel
        self.parts = parts
        self.full_blocks, self.tail = divmod(numel, self.block)
        self._row_bases: dict[tuple[int, torch.device], torch.Tensor] = {}

    def _rows(self, part: int) -> int:
        return len(range(part, self.full_blocks, self.parts))

    def _owns_tail(self, part: int) -> bool:
        return self.tail > 0 and self.full_blocks % self.parts == part

    def size(self, part: int) -> int:
        return self._rows(part) * self.block + (self.tail if self._owns_tail(part) else 0)

    def range(self, part: int) -> tuple[int, int] | None:
        return None  # not one range

    def segments(self, vector: torch.Tensor, part: int) -> list[Segment]:
        if self.parts == 1:  # every block, in order: the vector itself
            return [Segment(vector.unsqueeze(0), 0, 0)]
        blocks = vector[: self.full_blocks * self.block].view(self.full_blocks, self.block)
        segments = []
        if self._rows(part):
            rows = blocks[part :: self.parts]
            segments.append(Segment(rows, part * self.block, self.parts * self.block))
        if self._owns_tail(part):
            start = self.full_blocks * self.block
            segments.append(Segment(vector[start:].unsqueeze(0), start, 0))
        return segments

    def positions(self, part: int, indices: torch.Tensor) -> torch.Tensor:
        """Flat positions of ``indices`` into the partition's entries (read as ``segments``):
        row ``i // block`` starts at a known flat position, the tail being one more row.

        Example:
            >>> partitions = InterleavedPartitions(10, parts=2, block=2)
            >>> partitions.positions(0, torch.tensor([0, 3, 5])).tolist()
            [0, 5, 9]
        """
        if self.parts == 1:  # every block, in order: the entries are the positions
            return indices
        bases = self._bases(part, indices.device)
        rows = torch.div(indices, self.block, rounding_mode="floor")
        return bases.index_select(0, rows).add_(indices)

    def rows(self, part: int) -> tuple[int, torch.Tensor]:
        """Entries per row of partition ``part`` (its blocks) and each row's base: entry i is
        at flat position ``bases[i // row] + i`` (row j starts at ``bases[j] + j · row``).

        Example:
            >>> InterleavedPartitions(10, parts=2, block=2).rows(0)   # rows start at 0, 4, 8
            (2, tensor([0, 2, 4]))
            >>> InterleavedPartitions(5, parts=4, block=2).rows(3)   # no full block, no tail
            (2, tensor([], dtype=torch.int64))
        """
        return self.block, self._bases(part, torch.device("cpu"))

    def _bases(self, part: int, device: torch.device) -> torch.Tensor:
        bases = self._row_bases.get((part, device))
        if bases is None:
            # Row j is block part + j · parts (the tail block too, where this partition owns
            # it); a vector with fewer full blocks than parts leaves the last partitions none.
            count = self._rows(part) + self._owns_tail(part)
            rows = torch.arange(count) * ((self.parts - 1) * self.block) + part * self.block
            bases = self._row_bases[(part, device)] = rows.to(device)
        return bases

    def offsets(self, part: int, positions: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`positions`: block b = p // block of partition ``part`` is its
        row (b − part) / parts (the tail block too: the partition that owns it is
        full_blocks mod parts).

        Example:
            >>> InterleavedPartitions(10, parts=2, block=2).offsets(0, torch.tensor([0, 5, 9]))
            tensor([0, 3, 5])
        """
        if self.parts == 1:
            return positions
        blocks = torch.div(positions, self.block, rounding_mode="floor")
        rows = blocks.sub_(part).div_(self.parts, rounding_mode="floor")
        return rows.mul_(self.block).add_(positions % self.block)


PARTITIONINGS = {"contiguous": ContiguousPartitions, "interleaved": InterleavedPartitions}
