"""Where it plugs in: any registered sparsifier as a ``DistributedDataParallel`` comm hook.

Example:
    >>> state = microsparse.ddp.MicroState(density=0.001)               # doctest: +SKIP
    >>> ddp_model.register_comm_hook(state, microsparse.ddp.micro_hook)  # doctest: +SKIP
"""

from microsparse.ddp.hook import micro_hook, sparse_hook
from microsparse.ddp.state import MicroState, SparseState

__all__ = ["MicroState", "SparseState", "micro_hook", "sparse_hook"]
