"""Per-parameter error feedback that survives DDP's bucket rebuild.

DDP regroups parameters into new buckets after its first iteration (after its second with
``static_graph=True``), so state keyed by ``bucket.index()`` would attach one layer's residual to
another. Here each bucket *layout* (its tuple of parameters) gets one flat residual buffer, and
every parameter's residual is a view into the buffer of the layout it currently belongs to. When
a new layout appears, its buffer is filled from the parameters' previous views.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from microsparse.sparsifiers.partition import contiguous_partitions


class BucketMemory:
    """Residual and MiCRO ownership plan of one bucket layout.

    The bucket is partitioned parameter by parameter: each parameter is cut into n near-equal
    contiguous slices, and at step t rank r owns slice (t + r) mod n of every parameter. So
    which positions a rank owns never depends on how DDP grouped the parameters.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        world_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.key = tuple(id(p) for p in params)
        sizes = [p.numel() for p in params]
        self.numel = sum(sizes)
        self.residual = torch.zeros(self.numel, dtype=dtype, device=device)
        self.views: list[torch.Tensor] = []
        # Positions grouped by the slice index they belong to, so that the positions a rank
        # owns at a step are one contiguous stretch of ``plan``: no mask over the bucket.
        by_slice: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
        offset = 0
        for size in sizes:
            self.views.append(self.residual[offset : offset + size])
            for index, (start, end) in enumerate(contiguous_partitions(size, world_size)):
                by_slice[index].append(torch.arange(offset + start, offset + end))
            offset += size
        pieces = [
            torch.cat(group) if group else torch.empty(0, dtype=torch.long) for group in by_slice
        ]
        self.plan = torch.cat(pieces).to(device)
        bounds = [0]
        for piece in pieces:
            bounds.append(bounds[-1] + piece.numel())
        self.bounds = bounds

    def owned(self, slice_index: int) -> torch.Tensor:
        """Bucket positions of slice ``slice_index`` of every parameter (ascending)."""
        return self.plan[self.bounds[slice_index] : self.bounds[slice_index + 1]]


class ParameterResiduals:
    """Finds (or builds) the memory of a bucket layout and keeps residuals with their parameters.

    ``order`` lists the parameters in the order the hook first met them; on a fresh DDP model
    that order is fixed by the model definition, which makes it a stable key for checkpoints.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.order: list[torch.Tensor] = []
        self._view_of: dict[int, torch.Tensor] = {}
        self._layouts: dict[tuple[int, ...], BucketMemory] = {}
        self._restored: list[torch.Tensor] | None = None

    def memory(self, params: Sequence[torch.Tensor], dtype: torch.dtype) -> BucketMemory:
        key = tuple(id(p) for p in params)
        found = self._layouts.get(key)
        if found is not None:
            return found
        memory = BucketMemory(params, self.world_size, dtype, params[0].device)
        for param, view in zip(params, memory.views):
            previous = self._view_of.get(id(param))
            if previous is None:
                self._meet(param, view)
            else:
                view.copy_(previous)
            self._view_of[id(param)] = view
        # Layouts that lost a parameter to this one are stale: DDP rebuilt its buckets.
        for stale in [k for k in self._layouts if set(k) & set(key)]:
            del self._layouts[stale]
        self._layouts[key] = memory
        return memory

    def _meet(self, param: torch.Tensor, view: torch.Tensor) -> None:
        if self._restored is not None:
            index = len(self.order)
            if index >= len(self._restored) or self._restored[index].numel() != view.numel():
                raise ValueError(
                    "load_state_dict: the checkpoint's residuals do not match this model's "
                    f"parameters (parameter {index} has {view.numel()} elements); restore into "
                    "the same model definition, before its first backward pass"
                )
            view.copy_(self._restored[index].reshape(-1))
        self.order.append(param)

    def state(self) -> list[torch.Tensor]:
        return [self._view_of[id(p)].detach().clone() for p in self.order]

    def restore(self, residuals: list[torch.Tensor]) -> None:
        if self.order:
            raise RuntimeError("load_state_dict must be called before the first backward pass")
        self._restored = residuals
