"""Language modelling: the Wikipedia extract in gensim, or WikiText-2 (validation perplexity)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from microsparse_lab.training.data.common import find_files
from microsparse_lab.training.data.text import (
    WIKITEXT_FILES,
    WIKITEXT_FORMAT,
    TextData,
    embedded_text,
    wikitext,
)
from microsparse_lab.training.models import LSTMLanguageModel
from microsparse_lab.training.tasks.base import Epoch, EpochSlice, Metric, Recipe, Task

# The paper's WikiText-2 recipe (docs/METHOD.md, "The paper's recipes"): plain SGD, clipping
# of the averaged gradient.
PAPER_RECIPE = Recipe(
    epochs=90, batch_size=32, optimizer="sgd", lr=2.5, lr_reference_batch=64, warmup_epochs=5,
    decay_epochs=(60, 80), clip=0.4,
)  # fmt: skip
EMBEDDED_TRAIN_TOKENS = 120_000
# Shortened for the ~490 k-token embedded extract and the small default model.
EMBEDDED_RECIPE = replace(
    PAPER_RECIPE, epochs=4, batch_size=16, lr=20.0, warmup_epochs=0.5, decay_epochs=()
)


def _lstm(data: TextData, units: int = 650, layers: int = 3, dropout: float = 0.4) -> nn.Module:
    return LSTMLanguageModel(data.vocab_size, units, layers, dropout)


def _small_lstm(
    data: TextData, units: int = 64, layers: int = 2, dropout: float = 0.2
) -> nn.Module:
    return LSTMLanguageModel(data.vocab_size, units, layers, dropout)


def batchify(stream: torch.Tensor, columns: int) -> torch.Tensor:
    """``stream`` cut into ``columns`` contiguous pieces, side by side: (rows, columns).

    Example:
        >>> batchify(torch.arange(7), 2).tolist()
        [[0, 3], [1, 4], [2, 5]]
    """
    rows = len(stream) // columns
    return stream[: rows * columns].view(columns, rows).t().contiguous()


def _module(model: nn.Module) -> LSTMLanguageModel:
    return getattr(model, "module", model)  # unwrap DistributedDataParallel


class LanguageEpoch(Epoch):
    """A rank's contiguous share of the stream as ``batch_size`` columns, read ``bptt`` rows
    at a time; the hidden state flows from one step to the next (truncated backpropagation)."""

    def __init__(self, tokens: torch.Tensor, bptt: int, device: torch.device) -> None:
        self.tokens, self.bptt, self.device = tokens, bptt, device
        self.steps = (len(tokens) - 1) // bptt
        self.hidden: tuple[torch.Tensor, torch.Tensor] | None = None

    def loss(self, model: nn.Module, step: int) -> torch.Tensor:
        start = step * self.bptt
        rows = self.tokens[start : start + self.bptt + 1].to(self.device)
        if self.hidden is None:
            self.hidden = _module(model).initial_hidden(rows.shape[1])
        logits, hidden = model(rows[:-1], self.hidden)
        self.hidden = (hidden[0].detach(), hidden[1].detach())
        return F.cross_entropy(logits.flatten(0, 1), rows[1:].flatten())

    def state_dict(self) -> dict[str, Any]:
        return {"hidden": None if self.hidden is None else list(self.hidden)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        hidden = state["hidden"]
        if hidden is not None:
            self.hidden = (hidden[0].to(self.device), hidden[1].to(self.device))


class LanguageTask(Task):
    name = "lm"
    description = (
        "word-level language modelling: a Wikipedia extract shipped in gensim (~490 k tokens), "
        "or WikiText-2 token files from --data-dir"
    )
    models = {"lstm-small": _small_lstm, "lstm": _lstm}
    default_model = "lstm-small"
    metrics = (Metric("valid_perplexity", higher_is_better=False),)
    options = {"vocab_size": None, "train_tokens": None, "bptt": 30, "eval_batch_size": 10}
    """``vocab_size``: most frequent training words kept, the rest become ``<unk>`` (None:
    10,000 for the extract, all for WikiText-2). ``train_tokens``: train on the first this many
    tokens (None: 120,000 of the extract's ~490 k, to keep the default run short; all of
    WikiText-2). ``bptt``: tokens per sequence. ``eval_batch_size``: validation columns."""

    def check_data_dir(self, data_dir: str | None) -> None:
        if data_dir is not None:
            find_files(data_dir, WIKITEXT_FILES, WIKITEXT_FORMAT, ("wikitext-2",))

    def load(self, data_dir: str | None, options: dict[str, Any]) -> TextData:
        if data_dir is None:
            data = embedded_text(options["vocab_size"])
            limit = options["train_tokens"] or EMBEDDED_TRAIN_TOKENS
        else:
            data = wikitext(data_dir, options["vocab_size"])
            limit = options["train_tokens"]
        return replace(data, train=data.train[:limit])

    def recipe(self, data_dir: str | None) -> Recipe:
        return EMBEDDED_RECIPE if data_dir is None else PAPER_RECIPE

    def steps_per_epoch(
        self, data: TextData, options: dict[str, Any], world_size: int, batch_size: int
    ) -> int:
        rows = len(data.train) // world_size // batch_size
        return max(rows - 1, 0) // options["bptt"]

    def epoch(self, data: TextData, options: dict[str, Any], part: EpochSlice) -> LanguageEpoch:
        share = len(data.train) // part.world_size
        tokens = batchify(data.train[part.rank * share : (part.rank + 1) * share], part.batch_size)
        return LanguageEpoch(tokens, options["bptt"], part.device)

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, data: TextData, options: dict[str, Any]
    ) -> dict[str, float]:
        device = next(model.parameters()).device
        tokens = batchify(data.valid, options["eval_batch_size"]).to(device)
        hidden = _module(model).initial_hidden(tokens.shape[1])
        loss_sum, count = 0.0, 0
        for start in range(0, len(tokens) - 1, options["bptt"]):
            rows = tokens[start : start + options["bptt"] + 1]
            logits, hidden = model(rows[:-1], hidden)
            loss_sum += F.cross_entropy(logits.flatten(0, 1), rows[1:].flatten(), reduction="sum")
            count += rows[1:].numel()
        loss = float(loss_sum) / max(count, 1)
        return {"valid_perplexity": math.exp(min(loss, 700.0)), "valid_loss": loss}


LANGUAGE = LanguageTask()
