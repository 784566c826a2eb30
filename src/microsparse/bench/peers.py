"""A GradientReducer for rank r of n in one process, with the network taken out.

:class:`SymmetricPeers` stands in for the process group: the n − 1 other ranks are assumed
to send exactly what this rank sends. An all-gather returns this rank's message n times (a
view: no receive copy), a sum multiplies by n, a broadcast from this rank is a no-op. So
``GradientReducer.synchronize()`` runs its own code for everything but the wire (compensate,
the header, selection, padding and unpacking the index message, the union, gathering values,
writing the average back, forgetting the residual), with message sizes as for n ranks.

What the symmetry implies: exclusive sparsifiers see K = n·k_r (every partition as full as
this one); union sparsifiers deduplicate n·k_r indices (the sort is paid in full) down to
k_r, the least the union can be, so their O(K) work after the union is a lower bound.

Example:
    >>> reducer = reducer_with_peers(params, "micro", 0.001,  # doctest: +SKIP
    ...                              rank=0, world_size=64)
    >>> reducer.synchronize().selected  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch

from microsparse import reducer as reducer_module
from microsparse.comm.collectives import Communicator, all_reduce_bytes, broadcast_bytes
from microsparse.reducer import GradientReducer, ParameterSource


class SymmetricPeers(Communicator):
    """Collectives of a group of ``world_size`` identical ranks, computed locally."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.group = None
        self.rank = rank
        self.world_size = world_size

    def all_gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        return row.unsqueeze(0).expand(self.world_size, row.numel())

    def sum_(self, values: torch.Tensor) -> int:
        if self.world_size == 1 or values.numel() == 0:
            return 0
        values.mul_(self.world_size)
        return all_reduce_bytes(values.numel() * values.element_size(), self.world_size)

    def broadcast_(self, message: torch.Tensor, source: int) -> int:
        if source != self.rank:
            raise RuntimeError(
                f"SymmetricPeers can only time steps that rank {self.rank} leads, not {source}'s"
            )
        return broadcast_bytes(message.numel() * message.element_size(), self.world_size)


def reducer_with_peers(
    params: ParameterSource,
    sparsifier: str,
    density: float,
    rank: int,
    world_size: int,
    **options: Any,
) -> GradientReducer:
    """A GradientReducer acting as ``rank`` of ``world_size`` over :class:`SymmetricPeers`.

    With ``world_size`` 1 it is an ordinary reducer without a process group.
    """
    if world_size == 1:
        return GradientReducer(params, sparsifier, density, **options)
    peers = SymmetricPeers(rank, world_size)
    with mock.patch.object(reducer_module, "Communicator", lambda group: peers):
        return GradientReducer(params, sparsifier, density, **options)
