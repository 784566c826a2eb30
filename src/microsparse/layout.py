"""The flat gradient vector: where each parameter lives in it, and buffers laid out like it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["FlatVector", "Layout"]


@dataclass(frozen=True)
class Layout:
    """Parameters concatenated in the order given, as one vector of length ``numel``.

    Example:
        >>> layout = Layout.of([("w", torch.zeros(2, 3)), ("b", torch.zeros(3))])
        >>> layout.offsets, layout.numel, layout.locate(7)
        ((0, 6), 9, 'b')
    """

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int

    @classmethod
    def of(cls, named: list[tuple[str, torch.Tensor]]) -> Layout:
        offsets, offset = [], 0
        for _, tensor in named:
            offsets.append(offset)
            offset += tensor.numel()
        return cls(
            tuple(name for name, _ in named),
            tuple(t.shape for _, t in named),
            tuple(offsets),
            offset,
        )

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(math.prod(shape) for shape in self.shapes)

    def locate(self, position: int) -> str:
        """Name of the parameter that holds flat ``position``."""
        for name, offset, size in zip(self.names, self.offsets, self.sizes):
            if offset <= position < offset + size:
                return name
        raise IndexError(f"position {position} outside [0, {self.numel})")


class FlatVector:
    """One preallocated flat tensor plus a view of it shaped like each parameter."""

    def __init__(self, layout: Layout, dtype: torch.dtype, device: torch.device) -> None:
        self.data = torch.zeros(layout.numel, dtype=dtype, device=device)
        self.views = [
            self.data[offset : offset + size].view(shape)
            for offset, size, shape in zip(layout.offsets, layout.sizes, layout.shapes)
        ]
