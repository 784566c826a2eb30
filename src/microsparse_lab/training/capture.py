"""Saving each rank's local gradients of the first steps, for offline benchmarks.

Files in the capture directory:

- ``grad-rank{rank}-step{step:06d}.pt``: ``torch.save`` of one float32 1-D tensor, this rank's
  fresh gradient before any averaging, parameters concatenated in ``named_parameters()`` order
  (a parameter without a gradient contributes zeros);
- ``layout.json`` (written by rank 0): ``names``, ``shapes``, ``offsets``, ``numel`` of that
  vector, plus ``task``, ``model``, ``world_size`` and ``steps``.

Example (what ``microsparse train --capture-gradients DIR --capture-steps N`` does)::

    capture = GradientCapture("runs/grads", steps=3, rank=rank)
    capture.write_layout(model, task="mnist", model_name="smallcnn", world_size=4)
    loss.backward()
    capture.save(model, step)  # before the gradients are averaged
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn


def flat_gradient(model: nn.Module) -> torch.Tensor:
    """This rank's gradients as one float32 vector in ``named_parameters()`` order.

    Example:
        >>> model = nn.Linear(3, 2)
        >>> model(torch.ones(1, 3)).sum().backward()
        >>> flat_gradient(model).tolist()
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    """
    pieces = [
        torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        if p.grad is None
        else p.grad.detach().reshape(-1).to(torch.float32)
        for _, p in model.named_parameters()
    ]
    return torch.cat(pieces).cpu()


def gradient_layout(model: nn.Module) -> dict[str, list]:
    """Names, shapes and offsets of :func:`flat_gradient`'s vector, plus its ``numel``."""
    names, shapes, offsets, offset = [], [], [], 0
    for name, parameter in model.named_parameters():
        names.append(name)
        shapes.append(list(parameter.shape))
        offsets.append(offset)
        offset += parameter.numel()
    return {"names": names, "shapes": shapes, "offsets": offsets, "numel": offset}


class GradientCapture:
    """Writes ``grad-rank{rank}-step{step:06d}.pt`` for steps ``0 .. steps - 1``."""

    def __init__(self, directory: str | Path, steps: int, rank: int) -> None:
        self.directory = Path(directory)
        self.steps = steps
        self.rank = rank
        self.directory.mkdir(parents=True, exist_ok=True)

    def write_layout(self, model: nn.Module, task: str, model_name: str, world_size: int) -> None:
        if self.rank != 0:
            return
        layout = {
            **gradient_layout(model),
            "task": task,
            "model": model_name,
            "world_size": world_size,
            "steps": self.steps,
        }
        (self.directory / "layout.json").write_text(json.dumps(layout, indent=1) + "\n")

    def save(self, model: nn.Module, step: int) -> None:
        if step < self.steps:
            path = self.directory / f"grad-rank{self.rank}-step{step:06d}.pt"
            torch.save(flat_gradient(model), path)
