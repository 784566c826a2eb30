"""How it is exchanged: collective requests, who runs them, the index framings, wire bytes.

For measuring: ``Kind``, ``index_dtype``, ``Proposal``, ``Exchange``, ``Exchanged``,
``SymmetricPeers`` and ``run_together`` are exported so that benchmarks and the
simulator can drive the framings and the step without a process group, and ``eliasfano`` so
that a count of host syncs can run its device path on the CPU (``eliasfano.HOST_SORT``); a
training loop needs none of them.
"""

from microsparse.comm import eliasfano
from microsparse.comm.collectives import (
    Collective,
    Collectives,
    Kind,
    ProcessGroupCollectives,
    all_gather_bytes,
    all_gather_flat,
    all_reduce_bytes,
    broadcast_bytes,
    index_dtype,
)
from microsparse.comm.framing import (
    Compact,
    Dense,
    Exchange,
    Exchanged,
    Fixed,
    FixedUnion,
    Framing,
    Padded,
    Proposal,
    Shared,
)
from microsparse.comm.local import SymmetricPeers, run_together

__all__ = [
    "Collective", "Collectives", "Compact", "Dense", "Exchange", "Exchanged", "Fixed",
    "FixedUnion", "Framing", "Kind", "Padded", "ProcessGroupCollectives", "Proposal", "Shared",
    "SymmetricPeers", "all_gather_bytes", "all_gather_flat", "all_reduce_bytes",
    "broadcast_bytes", "eliasfano", "index_dtype", "run_together",
]
