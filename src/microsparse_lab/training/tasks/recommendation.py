"""Recommendation: NeuMF on MovieLens-100K (in recbole) or MovieLens-20M; HR@10 and NDCG@10."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from microsparse_lab.training.data.common import find_files, shard_batches
from microsparse_lab.training.data.ratings import (
    ML20M_FORMAT,
    RatingsData,
    movielens_20m,
    movielens_100k,
    training_instances,
)
from microsparse_lab.training.models import NeuMF
from microsparse_lab.training.tasks.base import Epoch, EpochSlice, Metric, Recipe, Task

TOP_K = 10
# The paper's MovieLens-20M recipe (docs/METHOD.md, "The paper's recipes"), with the Adam
# betas and the 2^20 global batch (at the paper's 4 workers) of the NCF recipe that its
# learning rate comes from.
PAPER_RECIPE = Recipe(
    epochs=30, batch_size=2**18, optimizer="adam", lr=0.0045, betas=(0.25, 0.9949)
)
# MovieLens-100K has 1/200 of the interactions: smaller batches, fewer epochs.
EMBEDDED_RECIPE = Recipe(
    epochs=5, batch_size=1024, optimizer="adam", lr=0.0045, betas=(0.25, 0.9949)
)


def _neumf(
    data: RatingsData,
    factors: int = 64,
    mlp: tuple[int, ...] = (256, 256, 128, 64),
    dropout: float = 0.5,
) -> nn.Module:
    return NeuMF(data.users, data.items, factors, tuple(mlp), dropout)


def hit_ratio_and_ndcg(scores: torch.Tensor, k: int = TOP_K) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``scores`` (column 0: the held-out item, then negatives): HR@k and NDCG@k.

    The held-out item's rank counts every negative scored at least as high (ties count
    against it, so a constant model scores 0): a hit if rank < k, gain 1 / log2(rank + 2).

    Example:
        >>> hit, gain = hit_ratio_and_ndcg(torch.tensor([[0.9, 0.1, 0.5], [0.2, 0.3, 0.4]]), k=2)
        >>> hit.tolist(), gain.tolist()
        ([1.0, 0.0], [1.0, 0.0])
    """
    rank = (scores[:, 1:] >= scores[:, :1]).sum(dim=1)
    hit = (rank < k).float()
    return hit, hit / torch.log2(rank.float() + 2)


class RecommendationEpoch(Epoch):
    """Shuffled batches of positives and sampled negatives, with binary cross-entropy."""

    def __init__(
        self, instances: tuple[torch.Tensor, torch.Tensor, torch.Tensor], device: torch.device
    ) -> None:
        self.users, self.items, self.labels = instances
        self.steps, self.device = len(self.users), device

    def loss(self, model: nn.Module, step: int) -> torch.Tensor:
        users, items, labels = (
            t[step].to(self.device) for t in (self.users, self.items, self.labels)
        )
        return F.binary_cross_entropy_with_logits(model(users, items), labels)


class RecommendationTask(Task):
    name = "recommendation"
    description = (
        "implicit-feedback recommendation: MovieLens-100K shipped in recbole, or MovieLens-20M "
        "ratings.csv from --data-dir; leave-one-out, 99 sampled negatives per test user"
    )
    models = {"neumf": _neumf}
    default_model = "neumf"
    metrics = (Metric(f"hr@{TOP_K}", True), Metric(f"ndcg@{TOP_K}", True))
    options = {"negatives": 4, "eval_negatives": 99}

    def check_data_dir(self, data_dir: str | None) -> None:
        if data_dir is not None:
            find_files(data_dir, ["ratings.csv"], ML20M_FORMAT, ("ml-20m",))

    def load(self, data_dir: str | None, options: dict[str, Any]) -> RatingsData:
        if data_dir is None:
            return movielens_100k(options["eval_negatives"])
        return movielens_20m(data_dir, options["eval_negatives"])

    def recipe(self, data_dir: str | None) -> Recipe:
        return EMBEDDED_RECIPE if data_dir is None else PAPER_RECIPE

    def steps_per_epoch(
        self, data: RatingsData, options: dict[str, Any], world_size: int, batch_size: int
    ) -> int:
        return (1 + options["negatives"]) * len(data.train_users) // (batch_size * world_size)

    def epoch(
        self, data: RatingsData, options: dict[str, Any], part: EpochSlice
    ) -> RecommendationEpoch:
        count = (1 + options["negatives"]) * len(data.train_users)
        batches = shard_batches(
            count, part.batch_size, part.rank, part.world_size, part.seed, part.epoch
        )
        instances = training_instances(
            data, options["negatives"], batches, part.seed, part.epoch, part.rank
        )
        return RecommendationEpoch(instances, part.device)

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, data: RatingsData, options: dict[str, Any]
    ) -> dict[str, float]:
        device = next(model.parameters()).device
        hits, gains = [], []
        for users, items in zip(data.test_users.split(1024), data.test_items.split(1024)):
            users = users.to(device)[:, None].expand_as(items)
            scores = model(users.reshape(-1), items.to(device).reshape(-1)).view(items.shape)
            hit, gain = hit_ratio_and_ndcg(scores)
            hits.append(hit)
            gains.append(gain)
        hit_ratio, ndcg = torch.cat(hits).mean().item(), torch.cat(gains).mean().item()
        return {f"hr@{TOP_K}": hit_ratio, f"ndcg@{TOP_K}": ndcg if math.isfinite(ndcg) else 0.0}


RECOMMENDATION = RecommendationTask()
