"""How it is exchanged: the collectives of one step, and what they cost on the wire."""

from microsparse.comm.collectives import (
    Communicator,
    all_gather_bytes,
    all_gather_flat,
    all_reduce_bytes,
)

__all__ = ["Communicator", "all_gather_bytes", "all_gather_flat", "all_reduce_bytes"]
