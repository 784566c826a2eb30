"""Where it plugs in: any registered sparsifier as a ``DistributedDataParallel`` comm hook.

Example:
    >>> state = microsparse.ddp.MicroState(density=0.001)               # doctest: +SKIP
    >>> ddp_model.register_comm_hook(state, microsparse.ddp.micro_hook)  # doctest: +SKIP

``CHOICE_PASS`` is the backward pass at which a state given ``min_speedup`` has chosen between
the sparse and the dense exchange: a measurement must record steps after it.
"""

from microsparse.ddp.choice import CHOICE_PASS
from microsparse.ddp.hook import micro_hook, sparse_hook
from microsparse.ddp.state import MicroState, SparseState

__all__ = ["CHOICE_PASS", "MicroState", "SparseState", "micro_hook", "sparse_hook"]
