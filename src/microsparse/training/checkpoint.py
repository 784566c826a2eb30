"""Checkpoints that resume a run exactly: ``OUT/checkpoint/``.

- ``shared.pt`` (rank 0): model parameters and buffers, optimiser state, the data position
  (epoch, batch within it, steps done), the run's seconds so far and its config;
- ``rank{r}.pt`` (every rank): the averaging state (``GradientReducer.state_dict()`` or the
  DDP hook state's), the RNG states, the model's buffers on that rank (batch-norm statistics
  differ between ranks) and what the epoch carries between steps (an LSTM's hidden state);
- ``meta.json``: the position and config, for people and for ``microsparse train --resume``.

Only tensors, numbers, strings, lists and dicts are stored, so ``torch.load(...,
weights_only=True)`` reads them. A new checkpoint is written next to the old one and renamed
over it once every rank has finished, so an interrupted save leaves the previous one intact.
Every rank must see ``OUT`` (one machine, or a shared file system).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

CHECKPOINT = "checkpoint"


@dataclass(frozen=True)
class Position:
    """Where a run stands: ``batch`` batches of ``epoch`` done, ``step`` steps in all."""

    epoch: int = 0
    batch: int = 0
    step: int = 0


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save_checkpoint(
    out: str | Path,
    shared: dict[str, Any],
    own: dict[str, Any],
    meta: dict[str, Any],
) -> None:
    """Collective: every rank writes ``own``; rank 0 also ``shared`` and ``meta``."""
    rank = dist.get_rank()
    final, staging = Path(out, CHECKPOINT), Path(out, CHECKPOINT + ".new")
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    torch.save(own, staging / f"rank{rank}.pt")
    if rank == 0:
        torch.save(shared, staging / "shared.pt")
        (staging / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
    dist.barrier()


def load_checkpoint(out: str | Path, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shared, this rank's) parts of ``OUT/checkpoint``."""
    directory = Path(out, CHECKPOINT)
    shared = torch.load(directory / "shared.pt", map_location="cpu", weights_only=True)
    own = torch.load(directory / f"rank{rank}.pt", map_location="cpu", weights_only=True)
    return shared, own


def read_meta(out: str | Path) -> dict[str, Any]:
    """``OUT/checkpoint/meta.json``: position, world size and config of the last checkpoint.

    Raises FileNotFoundError naming the file if there is none.
    """
    path = Path(out, CHECKPOINT, "meta.json")
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: no checkpoint to resume (train with --checkpoint-every)"
        )
    return json.loads(path.read_text())


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class Resumable:
    """What a training rank checkpoints: the model, its optimiser and its gradient averaging."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    averaging: Stateful
    device: torch.device

    def save(
        self,
        out: str | Path,
        position: Position,
        epoch_state: dict[str, Any] | None,
        seconds: float,
        config: dict[str, Any],
    ) -> None:
        """Collective: checkpoint this rank at ``position`` into ``OUT/checkpoint``."""
        shared = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "position": asdict(position),
            "seconds": seconds,
            "config": config,
        }
        own = {
            "averaging": self.averaging.state_dict(),
            "rng": rng_state(self.device),
            "buffers": dict(self.model.named_buffers()),
            "epoch": epoch_state,
        }
        meta = {**asdict(position), "world_size": dist.get_world_size(), "config": config}
        save_checkpoint(out, shared, own, meta)

    def restore(
        self, shared: dict[str, Any], own: dict[str, Any]
    ) -> tuple[Position, dict[str, Any] | None, float]:
        """Load a checkpoint's states; returns its position, epoch state and seconds so far."""
        self.optimizer.load_state_dict(shared["optimizer"])
        self.averaging.load_state_dict(own["averaging"])
        set_rng_state(own["rng"], self.device)
        return Position(**shared["position"]), own["epoch"], float(shared["seconds"])


def load_model(model: nn.Module, shared: dict[str, Any], own: dict[str, Any]) -> None:
    """Rank 0's saved parameters and buffers, then this rank's own buffers, into ``model``."""
    model.load_state_dict(shared["model"])
    buffers = dict(model.named_buffers())
    for name, value in own["buffers"].items():
        buffers[name].copy_(value)
