"""Collectives without a network, for the simulator and the benchmarks.

- :class:`SymmetricPeers`: one rank of n identical ranks. The n − 1 others are assumed to
  send exactly what this rank sends: an all-gather returns this rank's message n times (a
  view: no receive copy), a sum multiplies by n, a broadcast from this rank is a no-op. A
  ``GradientReducer(..., collectives=SymmetricPeers(0, n))`` then runs all its own code but
  the wire, with message sizes as for n ranks.
- :func:`run_together`: n ranks' step protocols in one process, in lockstep. Each round takes
  every rank's request, checks that they agree (kind, size, root), and answers each rank with
  the real combination of all of them: every rank's own residual, selection and exchange, as
  on a cluster, and a protocol that would deadlock on one is reported instead.

What the symmetry of :class:`SymmetricPeers` implies: exclusive sparsifiers see K = n·k_r
(every partition as full as this one); union sparsifiers deduplicate n·k_r indices (the sort
is paid in full) down to k_r, the least the union can be, so their O(K) work after the union
is a lower bound.

Example:
    >>> import torch
    >>> peers = SymmetricPeers(rank=0, world_size=4)
    >>> peers.run(Collective("all_reduce", torch.ones(2))).tolist()
    [4.0, 4.0]
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import torch

from microsparse.comm.collectives import Collective
from microsparse.errors import ConfigMismatchError


class SymmetricPeers:
    """Collectives of a group of ``world_size`` identical ranks, computed locally."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    def run(self, request: Collective) -> torch.Tensor:
        tensor, n = request.tensor, self.world_size
        if request.kind == "all_gather":
            return tensor.unsqueeze(0).expand(n, tensor.numel())
        if request.kind == "all_reduce":
            return tensor.mul_(n) if n > 1 else tensor
        if request.root != self.rank:
            raise RuntimeError(
                f"SymmetricPeers can only time steps that rank {self.rank} leads, not "
                f"{request.root}'s"
            )
        return tensor


def run_together(protocols: Sequence[Generator[Collective, torch.Tensor, Any]]) -> list[Any]:
    """Drive rank r's protocol ``protocols[r]`` for every r together; return what each gave.

    Each rank's protocol runs up to its first request before the next rank's starts, so a
    caller may prepare rank r's inputs just before handing its protocol over (the simulator
    writes rank r's gradient into a shared buffer).
    """
    requests: list[Collective | None] = []
    results: list[Any] = [None] * len(protocols)
    for rank, protocol in enumerate(protocols):
        requests.append(_advance(protocol, None, rank, results, first=True))
    while any(request is not None for request in requests):
        answers = _combine(requests)
        requests = [
            _advance(protocol, answer, rank, results)
            for rank, (protocol, answer) in enumerate(zip(protocols, answers))
        ]
    return results


def _advance(
    protocol: Generator[Collective, torch.Tensor, Any],
    answer: torch.Tensor | None,
    rank: int,
    results: list[Any],
    first: bool = False,
) -> Collective | None:
    try:
        return next(protocol) if first else protocol.send(answer)  # type: ignore[arg-type]
    except StopIteration as done:
        results[rank] = done.value
        return None


def _combine(requests: Sequence[Collective | None]) -> list[torch.Tensor]:
    if any(request is None for request in requests):
        ended = [rank for rank, request in enumerate(requests) if request is None]
        raise ConfigMismatchError(f"ranks {ended} ended their step while the others went on")
    shapes = {(r.kind, r.tensor.numel(), r.tensor.dtype, r.root) for r in requests}  # type: ignore[union-attr]
    if len(shapes) > 1:
        raise ConfigMismatchError(f"the ranks' requests differ: {sorted(map(str, shapes))}")
    first: Collective = requests[0]  # type: ignore[assignment]
    tensors = [request.tensor for request in requests]  # type: ignore[union-attr]
    if first.kind == "all_gather":
        rows = torch.stack([t.reshape(-1) for t in tensors])
        return [rows] * len(tensors)
    if first.kind == "all_reduce":
        total = torch.stack(tensors).sum(dim=0) if len(tensors) > 1 else tensors[0]
        for tensor in tensors:
            tensor.copy_(total)
        return tensors
    for tensor in tensors:
        tensor.copy_(tensors[first.root])
    return tensors
