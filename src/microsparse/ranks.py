"""Every rank's state in one ``state_dict``, for frameworks that save the main process's only.

A ``GradientReducer``'s or ``SparseState``'s ``state_dict()`` is one rank's: its residuals differ
from every other rank's. Accelerate's ``register_for_checkpointing`` and Lightning's checkpoints
write what the main process returns, and on resume hand that same dict to every rank, which
would give every rank rank 0's residuals. :class:`EveryRank` gathers all ranks' states on the
main process when saving and lets each rank take its own part back when loading.

Example (Accelerate)::

    state = microsparse.ddp.MicroState(density=0.001)
    model.register_comm_hook(state, microsparse.ddp.micro_hook)     # model from prepare()
    accelerator.register_for_checkpointing(microsparse.EveryRank(state))
    accelerator.save_state("ckpt")        # on every rank, as Accelerate requires
    accelerator.load_state("ckpt")        # every rank gets its own residuals back

``torch.distributed.checkpoint`` (DCP) saves every rank's entries, but takes entries with equal
keys on several ranks for copies of one value and keeps one: :class:`OwnRank` files each rank's
state under a key of its own.
"""

from __future__ import annotations

import io
from typing import Any, Protocol

import torch
import torch.distributed as dist


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class EveryRank:
    """Wraps ``stateful`` so that its ``state_dict`` holds every rank's state (on rank 0).

    :meth:`state_dict` is collective: every rank must call it (frameworks do, when they save).
    Without a process group it is the wrapped state alone, as a group of one.
    """

    def __init__(self, stateful: Stateful, group: dist.ProcessGroup | None = None) -> None:
        self.stateful = stateful
        self.group = group

    def _place(self) -> tuple[int, int]:
        if not (dist.is_available() and dist.is_initialized()):
            return 0, 1
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def state_dict(self) -> dict[str, Any]:
        """``{"world_size": n, "ranks": [state of rank 0, ..., of rank n-1]}`` on rank 0;
        ``ranks`` is None on the other ranks, whose copy frameworks do not save."""
        rank, world_size = self._place()
        own = self.stateful.state_dict()
        if world_size == 1:
            return {"world_size": 1, "ranks": [own]}
        gathered: list[Any] | None = [None] * world_size if rank == 0 else None
        root = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.gather_object(own, gathered, dst=root, group=self.group)
        return {"world_size": world_size, "ranks": gathered}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load this rank's part; raises if the state was saved by another number of ranks."""
        rank, world_size = self._place()
        if state.get("ranks") is None:
            raise ValueError(
                "EveryRank.load_state_dict: this is a non-main process's copy, without the "
                "ranks' states; load the file the main process wrote"
            )
        if state.get("world_size") != world_size:
            raise ValueError(
                f"EveryRank.load_state_dict: saved by {state.get('world_size')} ranks but "
                f"loaded by {world_size}; resume with as many ranks"
            )
        self.stateful.load_state_dict(state["ranks"][rank])


class OwnRank:
    """Wraps ``stateful`` for ``torch.distributed.checkpoint``: each rank's state under its
    own key (``rank<r>``), as one opaque entry, so that DCP neither merges the ranks' states
    nor needs their shapes before loading (a state may learn them at its first backward pass).

    Example::

        dcp.save({"model": model.state_dict(), "sparse": microsparse.OwnRank(state)},
                 checkpoint_id="ckpt")
        dcp.load({"model": model.state_dict(), "sparse": microsparse.OwnRank(state)},
                 checkpoint_id="ckpt")  # every rank gets its own state back
    """

    def __init__(self, stateful: Stateful) -> None:
        self.stateful = stateful

    def _key(self) -> str:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return f"rank{rank}"

    def state_dict(self) -> dict[str, Any]:
        saved = io.BytesIO()
        torch.save(self.stateful.state_dict(), saved)
        saved.seek(0)
        return {self._key(): saved}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get(self._key())
        if not isinstance(saved, io.BytesIO) or not saved.getbuffer().nbytes:
            raise ValueError(
                f"OwnRank.load_state_dict: the checkpoint holds no state for {self._key()}; "
                "resume with as many ranks as it was saved with"
            )
        saved.seek(0)
        self.stateful.load_state_dict(torch.load(saved, weights_only=False))


def check_saved_by(
    saved: tuple[int | None, int | None], rank: int, world_size: int, name: str = "state"
) -> None:
    """Raise if a one-rank state saved by rank ``saved[0]`` of ``saved[1]`` is loaded elsewhere.

    ``name`` is what the user calls the state in the advice (``"state"``, ``"reducer"``). A
    state saved before it knew its rank (``saved[0]`` None) loads anywhere.
    """
    if saved[0] is None or saved == (rank, world_size):
        return
    where = (
        f"load_state_dict: this state was saved by rank {saved[0]} of {saved[1]}, but is loaded "
        f"on rank {rank} of {world_size}"
    )
    if saved[1] != world_size:
        raise ValueError(f"{where}; resume with {saved[1]} ranks, as it was saved")
    # The usual cause: Accelerate's register_for_checkpointing (or any framework that saves
    # the main process's objects only) hands rank 0's state to every rank.
    raise ValueError(
        f"{where}; every rank must load its own state. A framework that saves the main "
        f"process's objects only gives every rank rank 0's: register microsparse.EveryRank("
        f"{name}) instead of the {name} itself, e.g. accelerator.register_for_checkpointing("
        f"microsparse.EveryRank({name})), or save EveryRank({name}).state_dict() on every rank "
        f"and load it with EveryRank({name}).load_state_dict(saved)"
    )
