"""Collectives over a ``torch.distributed`` process group (gloo on CPU, NCCL on CUDA).

Every rank issues the same collectives in the same order with the same sizes: sizes that
depend on data (the number of selected indices) are agreed on first, through a small
fixed-size header that every rank sends, so a rank that disagrees is detected, not waited on.

Wire bytes are modelled for ring algorithms: an all-gather of an m-byte message sends
(n − 1)·m bytes per rank, an all-reduce of p bytes sends 2·(n − 1)/n·p bytes per rank, and a
(pipelined chain) broadcast of m bytes sends m bytes from every rank but the last; each rank
reports m, the leader's cost and an upper bound for the others.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from microsparse.errors import ConfigMismatchError

# ``all_gather_into_tensor`` was renamed ``all_gather_single`` (the old name warns on every call
# in recent torch); both gather equal-size inputs of every rank into one flat output.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_bytes(message_bytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-gather of ``message_bytes`` per rank."""
    return (world_size - 1) * message_bytes


def all_reduce_bytes(payload_bytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``payload_bytes``."""
    return 2 * (world_size - 1) * payload_bytes // world_size


def broadcast_bytes(message_bytes: int, world_size: int) -> int:
    """Bytes one rank sends (at most) in a pipelined broadcast of ``message_bytes``."""
    return message_bytes if world_size > 1 else 0


def index_dtype(numel: int) -> torch.dtype:
    """The narrowest integer type that holds every position of a vector of ``numel`` entries.

    Example:
        >>> index_dtype(1000), index_dtype(2**31 + 1)
        (torch.int32, torch.int64)
    """
    return torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64


class Communicator:
    """The collectives one reducer uses, bound to one process group.

    Without an initialised default process group it acts as a group of one: every
    collective is the identity, so the same code serves single-process training.

    Example:
        >>> comm = Communicator()          # no process group: a group of one
        >>> comm.rank, comm.world_size
        (0, 1)
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
        else:
            self.group = None
            self.rank = 0
            self.world_size = 1

    def all_gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        """Stack every rank's equally shaped 1-D ``row`` into an (n, len) tensor."""
        if self.world_size == 1:
            return row.unsqueeze(0)
        out = row.new_empty(self.world_size * row.numel())
        all_gather_flat(out, row.contiguous(), group=self.group)
        return out.view(self.world_size, row.numel())

    def check_agreement(self, what: str, values: Sequence[int], device: torch.device) -> None:
        """Raise ``ConfigMismatchError`` on every rank unless all ranks pass equal ``values``."""
        row = torch.tensor(list(values), dtype=torch.long, device=device)
        rows = self.all_gather_rows(row).tolist()
        if any(r != rows[0] for r in rows):
            listing = "; ".join(f"rank {rank}: {r}" for rank, r in enumerate(rows))
            raise ConfigMismatchError(f"ranks disagree on {what} ({listing})")

    def gather_indices(
        self, local: torch.Tensor, counts: Sequence[int], numel: int, unique: bool
    ) -> tuple[torch.Tensor, int]:
        """Every rank's selected positions, concatenated in rank order (or deduplicated).

        ``counts[r]`` must be rank r's selection size, already known to all ranks. Messages
        are padded to the largest count because gloo's all-gather needs equal sizes. Returns
        the positions (int64) and the bytes this rank sent. ``numel`` is the vector length,
        which decides the index width of the message (int32 whenever positions fit).
        """
        longest = max(counts)
        if self.world_size == 1 or longest == 0:  # counts are agreed: all ranks skip together
            return local, 0
        message = torch.zeros(longest, dtype=index_dtype(numel), device=local.device)
        message[: local.numel()] = local
        rows = self.all_gather_rows(message)
        pieces = [rows[rank, :count] for rank, count in enumerate(counts) if count]
        positions = torch.cat(pieces).long()
        if unique:
            positions = torch.unique(positions, sorted=True)
        sent = all_gather_bytes(longest * message.element_size(), self.world_size)
        return positions, sent

    def sum_(self, values: torch.Tensor) -> int:
        """All-reduce ``values`` in place (sum). Returns the bytes this rank sent.

        The length of ``values`` must be agreed by all ranks; an empty vector is skipped.
        """
        if self.world_size == 1 or values.numel() == 0:
            return 0
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.group)
        return all_reduce_bytes(values.numel() * values.element_size(), self.world_size)

    def broadcast_(self, message: torch.Tensor, source: int) -> int:
        """Overwrite ``message`` on every rank with rank ``source``'s. Returns bytes sent."""
        if self.world_size == 1:
            return 0
        root = source if self.group is None else dist.get_global_rank(self.group, source)
        dist.broadcast(message, src=root, group=self.group)
        return broadcast_bytes(message.numel() * message.element_size(), self.world_size)
