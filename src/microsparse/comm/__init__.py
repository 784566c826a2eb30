"""How it is exchanged: collective requests, who runs them, the index framings, wire bytes."""

from microsparse.comm.collectives import (
    Collective,
    Collectives,
    ProcessGroupCollectives,
    all_gather_bytes,
    all_gather_flat,
    all_reduce_bytes,
    broadcast_bytes,
)
from microsparse.comm.framing import Dense, Fixed, Framing, Padded, Shared

__all__ = [
    "Collective",
    "Collectives",
    "Dense",
    "Fixed",
    "Framing",
    "Padded",
    "ProcessGroupCollectives",
    "Shared",
    "all_gather_bytes",
    "all_gather_flat",
    "all_reduce_bytes",
    "broadcast_bytes",
]
