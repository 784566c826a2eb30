"""``microsparse simulate``'s default stays small, shows its progress, and shares the union."""

from __future__ import annotations

import torch

from microsparse.bench.virtual import SharedUnion, VirtualCluster
from microsparse.bench.workload import model_layout
from microsparse.sparsifiers.threshold import initial_threshold


def test_union_is_shared_yet_each_worker_keeps_its_own_counts():
    """hard_threshold's ranks pick different counts; the union computed once must still be
    every rank's own: each residual forgets exactly the union, counts are each rank's."""
    numel, world_size, density = 20_000, 4, 0.01
    cluster = VirtualCluster("hard_threshold", density, model_layout(numel), world_size)
    assert all(isinstance(engine.framing, SharedUnion) for engine in cluster.engines)
    threshold = initial_threshold(cluster.target)
    scale = threshold / 2.5  # about 1 % of entries pass, a different count on every rank

    def gradient(rank: int) -> torch.Tensor:
        return torch.randn(numel, generator=torch.Generator().manual_seed(rank)) * scale

    def gradient_for(rank: int, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(gradient(rank))

    record = cluster.step(gradient_for)
    passing = [gradient(rank).abs() >= threshold for rank in range(world_size)]
    union = torch.stack(passing).any(dim=0)
    assert record.counts == [int(p.sum()) for p in passing]
    assert len(set(record.counts)) > 1
    assert record.selected == int(union.sum()) < sum(record.counts)
    for rank in range(world_size):
        expected = torch.where(union, torch.zeros(numel), gradient(rank))
        assert torch.equal(cluster.residual(rank), expected)
