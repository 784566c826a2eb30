"""NeuMF (neural matrix factorisation, He et al. 2017), the paper's recommendation model."""

from __future__ import annotations

import torch
from torch import nn


class NeuMF(nn.Module):
    """Generalised matrix factorisation and an MLP over user and item embeddings, fused.

    The GMF path multiplies ``factors``-wide user and item embeddings elementwise; the MLP path
    concatenates ``mlp[0] / 2``-wide embeddings and runs them through ``mlp`` (ReLU and dropout
    after each layer); one linear layer maps both paths' outputs to a logit of "user interacted
    with item". The paper's: ``factors=64, mlp=(256, 256, 128, 64), dropout=0.5``.

    Example:
        >>> model = NeuMF(users=10, items=20)
        >>> model(torch.tensor([0, 9]), torch.tensor([3, 19])).shape
        torch.Size([2])
    """

    def __init__(
        self,
        users: int,
        items: int,
        factors: int = 64,
        mlp: tuple[int, ...] = (256, 256, 128, 64),
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        if mlp[0] % 2:
            raise ValueError(f"mlp[0] must be even (user and item halves), got {mlp[0]}")
        self.gmf_user = nn.Embedding(users, factors)
        self.gmf_item = nn.Embedding(items, factors)
        self.mlp_user = nn.Embedding(users, mlp[0] // 2)
        self.mlp_item = nn.Embedding(items, mlp[0] // 2)
        layers: list[nn.Module] = []
        for width_in, width_out in zip(mlp, mlp[1:]):
            layers += [nn.Linear(width_in, width_out), nn.ReLU(), nn.Dropout(dropout)]
        self.mlp = nn.Sequential(*layers)
        self.predict = nn.Linear(factors + mlp[-1], 1)
        for embedding in (self.gmf_user, self.gmf_item, self.mlp_user, self.mlp_item):
            nn.init.normal_(embedding.weight, std=0.01)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        gmf = self.gmf_user(users) * self.gmf_item(items)
        mlp = self.mlp(torch.cat([self.mlp_user(users), self.mlp_item(items)], dim=1))
        return self.predict(torch.cat([gmf, mlp], dim=1)).squeeze(1)
