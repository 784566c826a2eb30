"""The collectives of one step, as requests, and who runs them.

A sparse step (``microsparse.engine``) never calls ``torch.distributed`` itself: it *yields*
:class:`Collective` requests and is sent their results. Anything with the small
:class:`Collectives` protocol can run them: :class:`ProcessGroupCollectives` over a real
process group (gloo on CPU, NCCL on CUDA), blocking or as futures for the DDP hook, and the
in-process groups of ``microsparse.comm.local`` for the simulator and the benchmarks.

Every rank issues the same requests in the same order with the same sizes: sizes that depend
on data (the number of selected indices) are agreed on first, through a small fixed-size
header that every rank sends, so a rank that disagrees is detected, not waited on.

Wire bytes are modelled for ring algorithms: an all-gather of an m-byte message sends
(n − 1)·m bytes per rank, an all-reduce of p bytes sends 2·(n − 1)/n·p bytes per rank, and a
(pipelined chain) broadcast of m bytes sends m bytes from every rank but the last; each rank
reports m, the leader's cost and an upper bound for the others.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.distributed as dist

from microsparse.errors import ConfigMismatchError

# ``all_gather_into_tensor`` was renamed ``all_gather_single`` (the old name warns on every call
# in recent torch); both gather equal-size inputs of every rank into one flat output.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

Kind = Literal["all_gather", "all_reduce", "broadcast"]


def all_gather_bytes(message_bytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-gather of ``message_bytes`` per rank."""
    return (world_size - 1) * message_bytes


def all_reduce_bytes(payload_bytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``payload_bytes``."""
    return 2 * (world_size - 1) * payload_bytes // world_size


def broadcast_bytes(message_bytes: int, world_size: int) -> int:
    """Bytes one rank sends (at most) in a pipelined broadcast of ``message_bytes``."""
    return message_bytes if world_size > 1 else 0


WIRE_BYTES = {"all_gather": all_gather_bytes, "all_reduce": all_reduce_bytes,
              "broadcast": broadcast_bytes}  # fmt: skip


def index_dtype(numel: int) -> torch.dtype:
    """The narrowest integer type that holds every position of a vector of ``numel`` entries.

    Example:
        >>> index_dtype(1000), index_dtype(2**31 + 1)
        (torch.int32, torch.int64)
    """
    return torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64


@dataclass(frozen=True)
class Collective:
    """One request of the step protocol: what every rank must run next, with equal sizes.

    ``all_gather``: ``tensor`` is this rank's 1-D row; the result stacks every rank's row into
    an (n, len) tensor. ``all_reduce``: ``tensor`` is summed over ranks in place and is the
    result. ``broadcast``: ``tensor`` is overwritten with rank ``root``'s and is the result.
    ``what`` names the message (``header``, ``indices``, ``values``, ``plan``, ``agreement``).

    Example:
        >>> request = Collective("all_reduce", torch.zeros(10), what="values")
        >>> request.wire_bytes(world_size=4)   # 40 bytes, ring all-reduce: 2 · 3/4 · 40
        60
    """

    kind: Kind
    tensor: torch.Tensor
    what: str = ""
    root: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of this rank's tensor: its row of an all-gather, the vector of the others."""
        return self.tensor.numel() * self.tensor.element_size()

    def wire_bytes(self, world_size: int) -> int:
        """Bytes this rank sends for it, modelled for ring algorithms (0 for one worker)."""
        if world_size == 1:
            return 0
        return WIRE_BYTES[self.kind](self.nbytes, world_size)

    def payload_bytes(self, world_size: int) -> int:
        """Bytes of what it carries, each rank's message counted once: every rank's row of an
        all-gather, the one vector of an all-reduce or a broadcast.

        Example:
            >>> Collective("all_gather", torch.zeros(10, dtype=torch.int32)).payload_bytes(4)
            160
        """
        return self.nbytes * world_size if self.kind == "all_gather" else self.nbytes


class Collectives(Protocol):
    """What a driver needs to run a step's requests: a rank, a size and :meth:`run`."""

    rank: int
    world_size: int

    def run(self, request: Collective) -> torch.Tensor:
        """Run ``request`` to completion and return its result (see :class:`Collective`)."""
        ...


class ProcessGroupCollectives:
    """:class:`Collective` requests on a ``torch.distributed`` process group.

    Without an initialised default process group it is a group of one: every request is the
    identity, so the same code serves single-process training.

    Example:
        >>> comm = ProcessGroupCollectives()      # no process group: a group of one
        >>> comm.rank, comm.world_size
        (0, 1)
        >>> comm.run(Collective("all_gather", torch.tensor([7]))).tolist()
        [[7]]
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        if dist.is_available() and dist.is_initialized():
            self.group = process_group
            self.rank = dist.get_rank(process_group)
            self.world_size = dist.get_world_size(process_group)
        elif process_group is not None:
            raise ValueError(
                "process_group was given but torch.distributed is not initialised; "
                "call torch.distributed.init_process_group first"
            )
        elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # Built too early (e.g. in a LightningModule's __init__, before Accelerator()),
            # it would silently train this rank alone.
            raise RuntimeError(
                f"WORLD_SIZE={os.environ['WORLD_SIZE']} says this process is one of several, but "
                "torch.distributed is not initialised yet: call "
                "torch.distributed.init_process_group first (in Lightning, build it in setup(); "
                "with Accelerate, after Accelerator())"
            )
        else:
            self.group = None
            self.rank = 0
            self.world_size = 1

    def run(self, request: Collective) -> torch.Tensor:
        work, result = self._issue(request, async_op=False)
        return result

    def start(self, request: Collective) -> torch.futures.Future[torch.Tensor]:
        """Issue ``request`` without waiting; the future completes with its result."""
        work, result = self._issue(request, async_op=True)
        if work is None:
            # A future that carries CUDA tensors must name their device.
            devices = [result.device] if result.is_cuda else None
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=devices)
            done.set_result(result)
            return done
        return work.get_future().then(lambda _: result)

    def _issue(self, request: Collective, async_op: bool) -> tuple[dist.Work | None, torch.Tensor]:
        tensor, n = request.tensor, self.world_size
        if request.kind == "all_gather":
            if n == 1 or tensor.numel() == 0:
                return None, tensor.unsqueeze(0).expand(n, tensor.numel())
            out = tensor.new_empty(n * tensor.numel())
            work = all_gather_flat(out, tensor.contiguous(), group=self.group, async_op=async_op)
            return work, out.view(n, tensor.numel())
        if n == 1 or tensor.numel() == 0:
            return None, tensor
        if request.kind == "all_reduce":
            return dist.all_reduce(tensor, group=self.group, async_op=async_op), tensor
        root = request.root
        if self.group is not None:
            root = dist.get_global_rank(self.group, root)
        return dist.broadcast(tensor, src=root, group=self.group, async_op=async_op), tensor


def check_agreement(
    collectives: Collectives,
    what: str,
    values: Sequence[int],
    device: torch.device,
    described: Mapping[str, object] | None = None,
) -> None:
    """Raise ``ConfigMismatchError`` on every rank unless all ranks pass equal ``values``.

    ``values`` are small integers (sizes, checksums) compared in one all-gather. Where they
    differ and ``described`` maps each option to its value, every rank then gathers the
    descriptions (this path runs only on a mismatch) and the error names each option that
    differs with its value on every rank, not a checksum.
    """
    row = torch.tensor(list(values), dtype=torch.long, device=device)
    rows = collectives.run(Collective("all_gather", row, "agreement")).tolist()
    if all(r == rows[0] for r in rows):
        return
    if described is not None and isinstance(collectives, ProcessGroupCollectives):
        everyone: list[Mapping[str, object] | None] = [None] * collectives.world_size
        dist.all_gather_object(everyone, dict(described), group=collectives.group)
        differing = describe_differences(everyone)
        if differing:
            raise ConfigMismatchError(
                f"ranks disagree on {what}: {differing}; every rank must pass the same values"
            )
    listing = "; ".join(f"rank {rank}: {r}" for rank, r in enumerate(rows))
    raise ConfigMismatchError(f"ranks disagree on {what} ({listing})")


def describe_differences(everyone: Sequence[Mapping[str, object] | None]) -> str:
    """The options whose values differ between ranks, each with every rank's value.

    Example:
        >>> describe_differences([{"density": 0.01, "x": 1}, {"density": 0.02, "x": 1}])
        'density (rank 0: 0.01, rank 1: 0.02)'
    """
    keys = dict.fromkeys(key for options in everyone for key in (options or {}))
    missing = "(not set)"

    def shown(value: object) -> str:
        text = str(value)
        return text if len(text) <= 80 else text[:77] + "..."

    parts = []
    for key in keys:
        values = [(options or {}).get(key, missing) for options in everyone]
        if any(v != values[0] for v in values):
            ranks = ", ".join(f"rank {r}: {shown(v)}" for r, v in enumerate(values))
            parts.append(f"{key} ({ranks})")
    return "; ".join(parts)


def check_steps(steps: Sequence[int], what: str = "synchronize()") -> None:
    """Raise ``ConfigMismatchError`` unless every rank is at the same step."""
    if len(set(steps)) > 1:
        raise ConfigMismatchError(
            f"ranks called {what} a different number of times (steps per rank: {list(steps)}); "
            "every rank must call it exactly once per training step"
        )
