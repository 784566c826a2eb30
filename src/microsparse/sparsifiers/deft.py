"""DEFT: layer fragments, k shared by norm, a leader's bin packing, top-k per fragment."""

from __future__ import annotations

import math

import torch

from microsparse.comm.collectives import index_dtype
from microsparse.comm.framing import Framing, Padded
from microsparse.layout import Layout
from microsparse.sparsifiers.base import Sparsifier
from microsparse.sparsifiers.partition import contiguous_partitions
from microsparse.sparsifiers.registry import register_sparsifier

Fragment = tuple[int, int]  # half-open [start, end) of the flat vector


def layer_fragments(layout: Layout, world_size: int) -> list[Fragment]:
    """One fragment per parameter; a parameter larger than d/n is cut into n near-equal chunks.

    Example:
        >>> layout = Layout.of([("w", torch.zeros(10)), ("b", torch.zeros(2))])
        >>> layer_fragments(layout, 2)
        [(0, 5), (5, 10), (10, 12)]
    """
    fragments = []
    for offset, size in zip(layout.offsets, layout.sizes):
        pieces = (
            contiguous_partitions(size, world_size)
            if size > layout.numel / world_size
            else [(0, size)]
        )
        fragments += [(offset + start, offset + end) for start, end in pieces if end > start]
    return fragments


def allocate_k(norms: list[float], sizes: list[int], target: int) -> list[int]:
    """Share k among fragments in proportion to their norms, largest norm first (reference rule).

    Each fragment gets at least 1 and at most its size, so the total can exceed k slightly.

    Example:
        >>> allocate_k([3.0, 1.0, 0.0], [100, 100, 5], target=8)
        [6, 2, 1]
    """
    k = [0] * len(norms)
    remaining_k, remaining_norm = target, sum(norms)
    for index in sorted(range(len(norms)), key=lambda i: -norms[i]):
        share = int(remaining_k * (norms[index] / remaining_norm)) if remaining_norm > 0 else 0
        k[index] = sizes[index] if sizes[index] < share else max(1, share)
        remaining_k -= k[index]
        remaining_norm -= norms[index]
    return k


def pack_bins(k: list[int], sizes: list[int], bins: int) -> list[int]:
    """Greedy bin packing of fragments by top-k cost size·log2(k): heaviest first, into the
    lightest bin. A fragment sent whole (k = size) needs no top-k and weighs nothing.

    Example:
        >>> pack_bins([4, 2, 1], [100, 60, 50], bins=2)
        [0, 1, 1]
    """
    weight = [size * math.log2(count) if count > 1 else size for count, size in zip(k, sizes)]
    load = [0.0] * bins
    assignment = [0] * len(k)
    for index in sorted(range(len(k)), key=lambda i: -weight[i]):
        lightest = load.index(min(load))
        assignment[index] = lightest
        if k[index] < sizes[index]:
            load[lightest] += weight[index]
    return assignment


@register_sparsifier
class Deft(Sparsifier):
    """DEFT (docs/METHOD.md, "Baselines"), with the leader's plan broadcast to everyone.

    1. The flat vector is cut at parameter boundaries; parameters larger than d/n are cut
       into n chunks (:func:`layer_fragments`, once).
    2. Every step the leader, rank t mod n, computes each fragment's norm of its own
       accumulated gradient, shares k among fragments in proportion (:func:`allocate_k`) and
       packs the fragments into n bins (:func:`pack_bins`). It broadcasts one fixed-size plan,
       (bin, k) per fragment, so every rank knows every rank's count.
    3. Rank r takes bin (t + r) mod n and runs top-k in each of its fragments. Bins are
       disjoint: no build-up, and the exchange is MiCRO's.

    Unlike the reference code, every rank uses the leader's k per fragment (there each rank
    recomputes k from its own norms, so the bins were packed for counts it does not send),
    and fragments sent whole go to a bin like the others instead of being added by every
    rank (same positions, a few more index bytes).

    Example:
        >>> reducer = GradientReducer(params, sparsifier="deft", density=0.001)  # doctest: +SKIP
    """

    name = "deft"
    framing_class = Padded
    planned = True

    def bind(self, layout: Layout, rank: int, world_size: int, target: int | None = None) -> None:
        super().bind(layout, rank, world_size, target)
        self._fragments = layer_fragments(layout, world_size)
        self._sizes = [end - start for start, end in self._fragments]
        self._magnitude: torch.Tensor | None = None

    def framing(self) -> Framing:
        return Padded(self.layout.numel)

    def empty_plan(self, device: torch.device) -> torch.Tensor:
        return torch.empty(
            2 * len(self._fragments), dtype=index_dtype(self.layout.numel), device=device
        )

    def make_plan(self, accumulated: torch.Tensor, step: int) -> torch.Tensor:
        norms = [torch.linalg.vector_norm(accumulated[start:end]) for start, end in self._fragments]
        # A NaN or Inf norm still gets a share (its top-k sends the non-finite value, which the
        # engine then reports on every rank); it must not break the leader's arithmetic alone.
        norms = torch.stack(norms).nan_to_num_(nan=math.inf).clamp_(max=torch.finfo().max / 4)
        k = allocate_k(norms.tolist(), self._sizes, self.target)
        assignment = pack_bins(k, self._sizes, self.world_size)
        return torch.tensor(
            assignment + k, dtype=index_dtype(self.layout.numel), device=accumulated.device
        )

    def adopt_plan(self, plan: torch.Tensor, step: int) -> list[int]:
        values = plan.tolist()
        assignment, self._k = values[: len(self._fragments)], values[len(self._fragments) :]
        members = [[] for _ in range(self.world_size)]  # type: list[list[int]]
        for index, bin_index in enumerate(assignment):
            members[bin_index].append(index)
        self._bin = (step + self.rank) % self.world_size
        self._members = members[self._bin]
        return [
            sum(self._k[i] for i in members[(step + r) % self.world_size])
            for r in range(self.world_size)
        ]

    def select(
        self, accumulated: torch.Tensor, step: int, scratch: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self._magnitude is None or self._magnitude.shape != accumulated.shape:
            self._magnitude = torch.empty_like(accumulated)
        pieces = [torch.empty(0, dtype=torch.long, device=accumulated.device)]
        for index in self._members:
            (start, end), k = self._fragments[index], self._k[index]
            if k == end - start:
                pieces.append(torch.arange(start, end, device=accumulated.device))
                continue
            magnitude = torch.abs(accumulated[start:end], out=self._magnitude[start:end])
            pieces.append(torch.topk(magnitude, k, sorted=False).indices.add_(start))
        return torch.cat(pieces)

    def report(self) -> dict[str, int]:
        return {"bin": self._bin, "fragments_selected": len(self._members)}
