"""Checkpoints that resume a run exactly: ``OUT/checkpoint/``.

- ``shared.pt`` (rank 0): model parameters and buffers, optimiser state, the data position
  (epoch, batch within it, steps done), the run's seconds so far and its config;
- ``rank{r}.pt`` (every rank): the averaging state (``GradientReducer.state_dict()``, the
  DDP hook state's, or PowerSGD's: :class:`microsparse_lab.methods.powersgd.PowerSGD`), the RNG
  states, the model's buffers on that rank (batch-norm statistics differ between ranks) and
  what the epoch carries between steps (an LSTM's hidden state);
- ``meta.json``: the position and config, for people and for ``microsparse train --resume``.

A model sharded by FSDP2 (``--integration fsdp``) has no whole copy to put in ``shared.pt``:
its parameters, the optimiser's state and every rank's averaging state are written by
``torch.distributed.checkpoint`` (DCP: ``.metadata`` and ``__<rank>_<n>.distcp`` files beside the
others; the averaging state through :class:`microsparse.OwnRank`, under each rank's own key).
``shared.pt`` then holds the position, seconds, config and the mesh's shape (``mesh``, also in
``meta.json``); ``rank{r}.pt`` the RNG states, buffers and epoch state as above. A resumed run
must shard the model alike: another mesh is refused, naming the ``--shards`` to resume with.

Only tensors, numbers, strings, lists and dicts are stored, so ``torch.load(...,
weights_only=True)`` reads them. Every rank must see ``OUT`` (one machine, or a shared file
system).

Saving is atomic: a new checkpoint is written into ``checkpoint.new`` (every file flushed to
disk, ``meta.json`` last, once every rank's file is there), then the old one is renamed to
``checkpoint.old``, the new one to ``checkpoint``, and the old one removed. A crash at any
moment leaves at least one complete checkpoint, and :func:`checkpoint_dir` finds it: the first
complete one of ``checkpoint``, ``checkpoint.new`` (complete but not yet renamed) and
``checkpoint.old``. A damaged file raises :class:`CheckpointError` naming it. A checkpoint
folder is deleted only if it holds nothing but checkpoint files; anything else there is a
user's, and saving stops with :class:`~microsparse_lab.training.rundir.ForeignFileError` naming it.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from microsparse import OwnRank
from microsparse_lab.training.rundir import (
    ForeignFileError,
    describe_foreign,
    foreign_in_checkpoint,
)

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


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated or not what this run wrote; names the file."""


def checkpoint_dir(out: str | Path) -> Path | None:
    """The complete checkpoint in ``out`` to resume from, or None if there is none (see the
    module docstring: an interrupted save may have left it under another name)."""
    for name in (CHECKPOINT, CHECKPOINT + ".new", CHECKPOINT + ".old"):
        directory = Path(out, name)
        if (directory / "meta.json").is_file():
            return directory
    return None


def save_checkpoint(
    out: str | Path,
    shared: dict[str, Any],
    own: dict[str, Any],
    meta: dict[str, Any],
    sharded: dict[str, Any] | None = None,
) -> None:
    """Collective: every rank writes ``own`` (and its part of ``sharded``, a DCP state dict);
    rank 0 also ``shared`` and ``meta``."""
    rank = dist.get_rank()
    final = Path(out, CHECKPOINT)
    staging = final.with_name(CHECKPOINT + ".new")
    if rank == 0:
        _refuse_foreign(staging)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    _write(staging / f"rank{rank}.pt", lambda f: torch.save(own, f))
    if sharded is not None:  # collective; DCP's writer flushes its files to disk
        dcp.save(sharded, checkpoint_id=staging)
    dist.barrier()  # every rank's file is on disk before meta.json says the whole is
    if rank == 0:
        _write(staging / "shared.pt", lambda f: torch.save(shared, f))
        _write(staging / "meta.json", lambda f: f.write(json.dumps(meta, indent=1).encode()))
        _sync_directory(staging)
        swap_in(final)
    dist.barrier()


def swap_in(final: Path) -> None:
    """Make ``checkpoint.new`` the checkpoint; at every point one complete checkpoint exists."""
    staging, old = final.with_name(CHECKPOINT + ".new"), final.with_name(CHECKPOINT + ".old")
    for directory in (final, old):  # both are deleted below (final once renamed to old)
        _refuse_foreign(directory)
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    staging.rename(final)
    _sync_directory(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def remove_checkpoints(out: str | Path) -> None:
    """Delete every checkpoint folder in ``out`` (an earlier run's, when a new run starts
    there), refusing with ForeignFileError if one holds what is not a checkpoint's."""
    for name in (CHECKPOINT, CHECKPOINT + ".new", CHECKPOINT + ".old"):
        directory = Path(out, name)
        _refuse_foreign(directory)
        shutil.rmtree(directory, ignore_errors=True)


def _refuse_foreign(directory: Path) -> None:
    """ForeignFileError if checkpoint folder ``directory`` holds what is not a checkpoint's."""
    if directory.exists() or directory.is_symlink():
        foreign = foreign_in_checkpoint(directory)
        if foreign is not None:
            raise ForeignFileError(describe_foreign(foreign, directory.parent, "--out"))


def _write(path: Path, write: Any) -> None:
    with open(path, "wb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())


def _sync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def load_checkpoint(out: str | Path, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shared, this rank's) parts of the checkpoint in ``out``."""
    directory = checkpoint_dir(out)
    if directory is None:
        raise CheckpointError(f"{Path(out, CHECKPOINT)} does not exist: no checkpoint to resume")
    return read_part(directory / "shared.pt"), read_part(directory / f"rank{rank}.pt")


def read_part(path: Path) -> dict[str, Any]:
    """One checkpoint file, or CheckpointError naming it and the fix."""
    try:
        part = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is missing: the checkpoint is incomplete; delete {path.parent} to start "
            "afresh, or restore it from a copy"
        ) from None
    except Exception as error:  # noqa: BLE001 - pickle and zip errors of every kind
        raise CheckpointError(
            f"{path} cannot be read ({type(error).__name__}: {str(error)[:200]}): the file is "
            f"damaged; delete {path.parent} to start afresh, or restore it from a copy"
        ) from None
    if not isinstance(part, dict):
        raise CheckpointError(f"{path} does not hold a checkpoint part (a dict)")
    return part


def read_meta(out: str | Path) -> dict[str, Any] | None:
    """The meta.json of the checkpoint in ``out`` (position, world size, config), or None if
    there is no checkpoint. Raises CheckpointError naming a damaged file."""
    directory = checkpoint_dir(out)
    if directory is None:
        return None
    path = directory / "meta.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(
            f"{path} cannot be read ({error}): the checkpoint is damaged; delete {directory} "
            "to start afresh, or restore it from a copy"
        ) from None
    missing = {"world_size", "config", "step"} - set(meta if isinstance(meta, dict) else {})
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(sorted(missing))}: not a checkpoint's")
    return meta


def verify_checkpoint(out: str | Path, world_size: int) -> None:
    """Read every file of the checkpoint in ``out`` once, so that a damaged one is named
    before any worker starts."""
    directory = checkpoint_dir(out)
    assert directory is not None
    for name in ["shared.pt"] + [f"rank{r}.pt" for r in range(world_size)]:
        read_part(directory / name)
    if "mesh" in read_part(directory / "shared.pt"):  # a sharded model's: DCP's index too
        try:
            dcp.FileSystemReader(directory).read_metadata()
        except Exception as error:  # noqa: BLE001 - missing, truncated, unpicklable
            raise CheckpointError(
                f"{directory / '.metadata'} cannot be read ({type(error).__name__}): the "
                f"checkpoint is damaged; delete {directory} to start afresh, or restore it "
                "from a copy"
            ) from None


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class Resumable:
    """What a training rank checkpoints: the model, its optimiser and its gradient averaging.

    ``mesh``: the (replicate, shard) sizes of a model sharded by FSDP2, saved through DCP (see
    the module docstring); None for a whole model on every rank.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    averaging: Stateful
    device: torch.device
    mesh: dict[str, int] | None = None

    def save(
        self,
        out: str | Path,
        position: Position,
        epoch_state: dict[str, Any] | None,
        seconds: float,
        config: dict[str, Any],
    ) -> None:
        """Collective: checkpoint this rank at ``position`` into ``OUT/checkpoint``."""
        shared: dict[str, Any] = {"position": asdict(position), "seconds": seconds,
                                  "config": config}  # fmt: skip
        own = {
            "rng": rng_state(self.device),
            "buffers": dict(self.model.named_buffers()),
            "epoch": epoch_state,
        }
        meta = {**asdict(position), "world_size": dist.get_world_size(), "config": config}
        if self.mesh is not None:
            shared["mesh"] = meta["mesh"] = self.mesh
            save_checkpoint(out, shared, own, meta, self._sharded())
            return
        shared = {"model": self.model.state_dict(),
                  "optimizer": self.optimizer.state_dict(), **shared}  # fmt: skip
        save_checkpoint(out, shared, {"averaging": self.averaging.state_dict(), **own}, meta)

    def restore(
        self, shared: dict[str, Any], own: dict[str, Any], out: str | Path | None = None
    ) -> tuple[Position, dict[str, Any] | None, float]:
        """Load a checkpoint's states (a sharded model's too, from ``out``'s checkpoint);
        returns its position, epoch state and seconds so far."""
        if self.mesh is None:
            self.optimizer.load_state_dict(shared["optimizer"])
            self.averaging.load_state_dict(own["averaging"])
        else:
            assert out is not None
            self._load_sharded(shared, own, out)
        set_rng_state(own["rng"], self.device)
        return Position(**shared["position"]), own["epoch"], float(shared["seconds"])

    def _sharded(self) -> dict[str, Any]:
        """This rank's shards of the model and optimiser state, and its averaging state under
        its own key, as DCP saves and loads them in place."""
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer, "averaging": OwnRank(self.averaging)}

    def _load_sharded(self, shared: dict[str, Any], own: dict[str, Any], out: str | Path) -> None:
        saved = shared.get("mesh")
        if saved != self.mesh:
            raise CheckpointError(_other_mesh(saved, self.mesh))
        state = self._sharded()
        dcp.load(state, checkpoint_id=checkpoint_dir(out))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])  # fmt: skip
        # DCP kept one rank's copy of each (unsharded) buffer; batch-norm statistics differ.
        buffers = dict(self.model.named_buffers())
        for name, value in own["buffers"].items():
            buffers[name].copy_(value)


def _other_mesh(saved: dict[str, int] | None, mesh: dict[str, int]) -> str:
    if saved is None:
        return (
            "the checkpoint holds a whole model, not one sharded by FSDP2: resume it with the "
            "--integration it was written with"
        )
    return (
        f"the checkpoint's model is sharded with --shards {saved['shard']} "
        f"({saved['replicate']} replicas), this run's with --shards {mesh['shard']} "
        f"({mesh['replicate']} replicas), whose shards would not match; resume with --shards "
        f"{saved['shard']} and {saved['replicate'] * saved['shard']} ranks"
    )


def load_model(model: nn.Module, shared: dict[str, Any], own: dict[str, Any]) -> None:
    """Rank 0's saved parameters and buffers, then this rank's own buffers, into ``model``."""
    model.load_state_dict(shared["model"])
    buffers = dict(model.named_buffers())
    for name, value in own["buffers"].items():
        buffers[name].copy_(value)
