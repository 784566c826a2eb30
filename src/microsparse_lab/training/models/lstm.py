"""The LSTM language model of the paper's WikiText-2 workload, in plain PyTorch."""

from __future__ import annotations

import torch
from torch import nn

Hidden = tuple[torch.Tensor, torch.Tensor]
"""(h, c) of every layer, each of shape (layers, batch, units)."""


class LSTMLanguageModel(nn.Module):
    """Embedding, a stacked LSTM and a softmax decoder whose weight is the embedding's (tied).

    The paper's model is ``LSTMLanguageModel(vocab, units=650, layers=3, dropout=0.4)`` over
    sequences of 30 tokens (BPTT 30). Inputs and outputs are sequence-first: tokens of shape
    (steps, batch) give logits of shape (steps, batch, vocab).

    Example:
        >>> model = LSTMLanguageModel(vocab=100, units=16, layers=2)
        >>> tokens = torch.zeros(30, 4, dtype=torch.long)
        >>> logits, hidden = model(tokens, model.initial_hidden(4))
        >>> logits.shape, hidden[0].shape
        (torch.Size([30, 4, 100]), torch.Size([2, 4, 16]))
    """

    def __init__(self, vocab: int, units: int = 650, layers: int = 3, dropout: float = 0.4) -> None:
        super().__init__()
        self.units, self.layers = units, layers
        self.dropout = nn.Dropout(dropout)
        self.embedding = nn.Embedding(vocab, units)
        self.lstm = nn.LSTM(units, units, layers, dropout=dropout if layers > 1 else 0.0)
        self.decoder = nn.Linear(units, vocab)
        self.decoder.weight = self.embedding.weight  # tied: one parameter, listed once
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def initial_hidden(self, batch: int) -> Hidden:
        weight = self.embedding.weight  # a plain tensor even where FSDP2 shards the weight
        zeros = torch.zeros(self.layers, batch, self.units, dtype=weight.dtype,
                            device=weight.device)  # fmt: skip
        return zeros, zeros.clone()

    def forward(self, tokens: torch.Tensor, hidden: Hidden) -> tuple[torch.Tensor, Hidden]:
        out, hidden = self.lstm(self.dropout(self.embedding(tokens)), hidden)
        return self.decoder(self.dropout(out)), hidden
