"""Splitting the flat gradient vector into per-worker partitions."""

from __future__ import annotations


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
