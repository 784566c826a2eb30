"""Where a step writes the averaged gradient: a flat tensor, or every ``p.grad`` of a model.

The average is sparse: K of d entries are non-zero. It is written by adding the values into
zeros (``index_add_``): positions are distinct, and a writer that hands every output every
slot (a slab spread over several buckets) points the slots that are not its own at position
0 with the value 0, which changes nothing. Writing it must not cost a dense pass when
it need not: :class:`SparseOutput` keeps one flat buffer, clears only the previous step's K
positions, and falls back to one zeroing pass only when something else wrote into it in
between (which its version counter shows: autograd accumulating into it,
``zero_grad(set_to_none=False)``, clipping). :class:`GradientOutput` makes its views the
parameters' gradients; the DDP hook returns one to DDP, which copies it into the gradients.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from microsparse.feedback import Fresh
from microsparse.layout import FlatVector, Layout


def as_dtype(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` in ``dtype``; where they are already, not even a no-op operator (each
    costs host time on a GPU's hot path).

    Example:
        >>> values = torch.ones(2)
        >>> as_dtype(values, torch.float32) is values, as_dtype(values, torch.float16).dtype
        (True, torch.float16)
    """
    return values if values.dtype == dtype else values.to(dtype)


class FlatOutput:
    """A flat tensor that receives the average (a DDP bucket's buffer), zeroed every step.

    Example:
        >>> out = FlatOutput(torch.full((5,), 9.0))
        >>> out.write(torch.tensor([1, 3]), torch.tensor([0.5, -1.0]))
        >>> out.data.tolist()
        [0.0, 0.5, 0.0, -1.0, 0.0]
    """

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    def write(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        self.data.zero_()
        self.data.index_add_(0, positions, as_dtype(values, self.data.dtype))

    def poison(self) -> None:
        self.data.fill_(math.nan)

    def dense(self, fresh: Fresh) -> torch.Tensor:
        if fresh is not self.data:
            raise ValueError("a flat output averages its own tensor: pass it as the gradient")
        return self.data


class SparseOutput:
    """A flat buffer that holds the sparse average, rewritten in O(K) per step.

    Only the previous step's K positions are cleared, unless something else wrote into the
    buffer in between (its version counter shows it), which costs one zeroing pass.

    Example:
        >>> out = SparseOutput(torch.zeros(5))
        >>> out.write(torch.tensor([1, 3]), torch.tensor([0.5, -1.0]))
        >>> out.write(torch.tensor([0]), torch.tensor([2.0]))
        >>> out.data.tolist()
        [2.0, 0.0, 0.0, 0.0, 0.0]
    """

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self._written = torch.empty(0, dtype=torch.long, device=data.device)
        self._version = data._version

    def write(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        data = self.data
        if data._version == self._version:  # untouched since our last write: clear those only
            data.index_fill_(0, self._written, 0)
        else:
            data.zero_()
        data.index_add_(0, positions, as_dtype(values, data.dtype))
        self._written = positions
        self._written_by_us()

    def _written_by_us(self) -> None:
        self._version = self.data._version

    def poison(self) -> None:
        """Fill with NaN: a skipped step, which ``torch.amp.GradScaler`` then skips too."""
        self.data.fill_(math.nan)
        self._written_by_us()
        self._version = -1  # every entry written: the next write must zero the whole buffer

    def dense(self, fresh: Fresh) -> torch.Tensor:
        self.data.copy_(fresh if isinstance(fresh, torch.Tensor) else torch.cat(
            [g.reshape(-1) for g in fresh]))  # fmt: skip
        self._version = -1  # every entry written: a sparse write must zero the whole buffer
        return self.data


class GradientOutput(SparseOutput):
    """Every parameter's ``p.grad`` as a view of one flat :class:`SparseOutput` buffer.

    Parameters whose dtype differs from the buffer's (a model mixing dtypes) get a copy
    instead of a view.

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(2, 2))
        >>> out = GradientOutput([w], Layout.of([("w", w)]))
        >>> out.write(torch.tensor([3]), torch.tensor([1.5]))
        >>> w.grad.tolist()
        [[0.0, 0.0], [0.0, 1.5]]
    """

    def __init__(self, params: Sequence[torch.Tensor], layout: Layout) -> None:
        dtypes = {p.dtype for p in params}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        self._params = list(params)
        self._buffer = FlatVector(layout, dtype, params[0].device)
        super().__init__(self._buffer.data)

    def _written_by_us(self) -> None:
        self._attach()
        super()._written_by_us()

    def dense(self, fresh: Fresh) -> torch.Tensor:
        if isinstance(fresh, torch.Tensor):
            self.data.copy_(fresh)
        else:
            for view, gradient in zip(self._buffer.views, fresh):
                if gradient is None:
                    view.zero_()
                elif gradient is not view:
                    view.copy_(gradient)
        self._attach()
        self._version = -1
        return self.data

    def _attach(self) -> None:
        for param, view in zip(self._params, self._buffer.views):
            if param.grad is view:
                continue
            if view.dtype == param.dtype:
                param.grad = view
            elif param.grad is None:
                param.grad = view.to(param.dtype)
            else:
                param.grad.copy_(view)


class DiscardOutput:
    """Writes nothing: for simulations that need residuals and counts, not the average.

    Example:
        >>> DiscardOutput().write(torch.tensor([0]), torch.tensor([1.0]))
    """

    def write(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        pass

    def dense(self, fresh: Fresh) -> torch.Tensor:
        if not isinstance(fresh, torch.Tensor):
            raise ValueError("a discarded dense average needs a flat gradient")
        return fresh
