"""torch's PowerSGD hook with its state kept per parameter, so that a checkpoint resumes it.

torch's ``PowerSGDState`` keys its state by bucket index and lays it out in the bucket's
parameter order: one flat error-feedback tensor per bucket, and the warm-start factors P and
Q matrix after matrix. DDP regroups its buckets after the first iteration of every run, a
resumed one included. A state saved after the regrouping and restored into a fresh DDP model
would therefore meet its parameters in another order, adding one layer's error to another
layer's gradient. An uninterrupted run never meets this, because the hook may only start
compressing after the regrouping (``start_powerSGD_iter`` ≥ 2).

:class:`PowerSGD` wraps the state. Before torch's hook runs on a bucket, it compares the
bucket's parameters with the order its state was laid out in, and when they differ it
rearranges the state parameter by parameter. It saves and loads the state per parameter, in
the types ``torch.load(..., weights_only=True)`` reads (torch's own pickling keeps a NumPy
generator, which such a load refuses).

Example:
    >>> from torch import nn
    >>> powersgd = PowerSGD(nn.Linear(8, 8).parameters(), rank=1, start=2)
    >>> saved = powersgd.state_dict()
    >>> saved["iter"], saved["error"], saved["rng"]["keys"].shape
    (0, {}, torch.Size([624]))
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from microsparse_lab.methods.traffic import powersgd_factors

Pieces = dict[str, dict[int, torch.Tensor]]
"""Per-parameter state: ``error``, ``p`` and ``q`` pieces keyed by the parameter's number."""


class PowerSGD:
    """torch's ``PowerSGDState`` (error feedback, warm start) for the trainable ``params``,
    whose order numbers them in checkpoints; :meth:`attach` registers the hook on a DDP model.

    Made for one bucket holding the model, as ``train`` runs PowerSGD. With several buckets
    a regrouping is seen when the first changed bucket arrives, and the buckets that ran
    before it in that pass are taken apart while their all-reduces may still be in flight.
    """

    def __init__(self, params: Iterable[torch.Tensor], rank: int, start: int) -> None:
        self.torch_state = torch_powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=start,
            use_error_feedback=True, warm_start=True,
        )  # fmt: skip
        self._params = [p for p in params if p.requires_grad]
        self._number = {id(p): number for number, p in enumerate(self._params)}
        self._orders: dict[int, tuple[int, ...]] = {}  # bucket index → its state's layout
        self._pool: Pieces = {"error": {}, "p": {}, "q": {}}  # pieces awaiting their bucket

    def attach(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        ddp.register_comm_hook(self, _hook)

    def arrive(self, bucket: Any) -> None:
        """Lay ``bucket``'s state out in its parameters' present order (the hook calls this)."""
        index = bucket.index()
        order = tuple(self._number[id(p)] for p in bucket.parameters())
        if self._orders.get(index, order) != order:  # DDP regrouped: take every bucket apart
            self._take_apart()
        if index not in self.torch_state.error_dict and self._pool["error"]:
            self._assemble(index, order)
        self._orders[index] = order

    def state_dict(self) -> dict[str, Any]:
        """The step count, the per-parameter error feedback and factors, the RNG that seeds
        a new Q, and torch's compression statistics."""
        state = self.torch_state
        pieces = self._pieces()
        kind, keys, position, has_gauss, cached = state.rng.get_state()
        return {
            "iter": state.iter,
            "error": pieces["error"],
            "p_memory": pieces["p"],
            "q_memory": pieces["q"],
            "rng": {
                "keys": torch.from_numpy(keys.astype("int64")),
                "position": int(position),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },  # fmt: skip
            "numel": [state.total_numel_before_compression, state.total_numel_after_compression],
            "next_stats_report": state.next_stats_report,
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; each bucket takes its pieces when it next arrives."""
        import numpy as np

        state = self.torch_state
        state.iter = int(saved["iter"])
        rng = saved["rng"]
        state.rng.set_state(("MT19937", rng["keys"].numpy().astype(np.uint32), rng["position"],
                             rng["has_gauss"], rng["cached_gaussian"]))  # fmt: skip
        state.total_numel_before_compression, state.total_numel_after_compression = saved["numel"]
        state.next_stats_report = int(saved["next_stats_report"])
        for table in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
            table.clear()
        self._orders.clear()
        device = self._params[0].device if self._params else torch.device("cpu")
        self._pool = {
            name: {int(number): piece.to(device) for number, piece in saved[key].items()}
            for name, key in (("error", "error"), ("p", "p_memory"), ("q", "q_memory"))
        }

    def _factors(self, order: tuple[int, ...]) -> list[tuple[int, int, int]]:
        """(parameter, P entries, Q entries) in the order torch's hook lays the factors out:
        the compressed matrices grouped by shape, the shapes in order of first appearance."""
        by_shape: dict[torch.Size, list[tuple[int, int, int]]] = {}
        for number in order:
            shape = self._params[number].shape
            factors = powersgd_factors(shape, self.torch_state.matrix_approximation_rank,
                                       self.torch_state.min_compression_rate)  # fmt: skip
            if factors is not None:
                by_shape.setdefault(shape, []).append((number, *factors))
        return [entry for group in by_shape.values() for entry in group]

    def _pieces(self) -> Pieces:
        """Every bucket's state cut into per-parameter pieces (copies), with the pool's."""
        pieces: Pieces = {name: dict(pool) for name, pool in self._pool.items()}
        state = self.torch_state
        for index, error in state.error_dict.items():
            order = self._orders[index]
            sizes = [self._params[number].numel() for number in order]
            pieces["error"].update(zip(order, (p.clone() for p in error.split(sizes))))
            factors = self._factors(order)
            for name, memory, column in (("p", state.p_memory_dict, 1),
                                         ("q", state.q_memory_dict, 2)):  # fmt: skip
                sizes = [entry[column] for entry in factors]
                split = memory[index].split(sizes)
                pieces[name].update((entry[0], p.clone()) for entry, p in zip(factors, split))
        return pieces

    def _take_apart(self) -> None:
        self._pool = self._pieces()
        for table in (self.torch_state.error_dict, self.torch_state.p_memory_dict,
                      self.torch_state.q_memory_dict):  # fmt: skip
            table.clear()
        self._orders.clear()

    def _assemble(self, index: int, order: tuple[int, ...]) -> None:
        """Bucket ``index``'s state from the pool, if the pool holds all of it; otherwise the
        bucket starts afresh, as torch's hook starts a bucket it has not met."""
        pool, state = self._pool, self.torch_state
        factors = self._factors(order)
        if not all(number in pool["error"] for number in order):
            return
        if not all(entry[0] in pool["p"] and entry[0] in pool["q"] for entry in factors):
            return
        like = pool["error"][order[0]]
        state.error_dict[index] = torch.cat([pool["error"].pop(number) for number in order])
        for name, memory in (("p", state.p_memory_dict), ("q", state.q_memory_dict)):
            parts = [pool[name].pop(entry[0]) for entry in factors]
            memory[index] = torch.cat(parts) if parts else like.new_empty(0)


def _hook(powersgd, bucket):  # type: ignore[no-untyped-def]
    """torch's ``powerSGD_hook`` after :meth:`PowerSGD.arrive`. (Unannotated: DDP checks a
    hook's annotations as objects, and this module's are strings.)"""
    powersgd.arrive(bucket)
    return torch_powersgd.powerSGD_hook(powersgd.torch_state, bucket)
