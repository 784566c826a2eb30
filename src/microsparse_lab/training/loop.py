"""The per-worker training loop: any registered task, averaged by a sparsifier.

One step: forward and backward on this rank's batch; optionally save the local gradient;
average the gradients (``GradientReducer.synchronize()``, or DDP's hook during backward); clip
the average if the recipe says so; ``optimizer.step()`` on the average. Rank 0 evaluates after
every epoch and writes ``metrics.jsonl``, ``epochs.jsonl`` and ``summary.json`` in ``out``.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from microsparse import GradientReducer, SparseOptions
from microsparse.comm import all_reduce_bytes
from microsparse.ddp import SparseState, sparse_hook
from microsparse.engine import dense_stats
from microsparse.fsdp import ShardedState
from microsparse.stats import StepStats
from microsparse_lab.methods.hooks import attach_method
from microsparse_lab.methods.names import parse_method
from microsparse_lab.methods.traffic import peer_bytes
from microsparse_lab.training.capture import GradientCapture
from microsparse_lab.training.checkpoint import Position, Resumable, load_checkpoint, load_model
from microsparse_lab.training.config import TrainConfig
from microsparse_lab.training.log import RunLog
from microsparse_lab.training.optim import build_optimizer, learning_rate
from microsparse_lab.training.pending import PendingSteps
from microsparse_lab.training.sharding import HybridSharding, mesh_of, mesh_shape, sharded
from microsparse_lab.training.tasks import EpochSlice, Task, get_task

__all__ = ["TrainConfig", "train"]


def train(config: TrainConfig, local_rank: int = 0, data: Any = None) -> None:
    """Train on this rank of an initialised process group; rank 0 writes the run's files.

    Every rank must call it with the same config. ``data`` is the task's loaded data (loaded
    here if None).

    Example:
        >>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29500",  # doctest: +SKIP
        ...                         rank=0, world_size=1)
        >>> train(TrainConfig(task="lm", max_steps=5, out="runs/smoke"))  # doctest: +SKIP
    """
    started = time.perf_counter()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    config = config.resolved(config.averaging_ranks(world_size))
    task = get_task(config.task)
    device = torch.device("cuda", local_rank) if config.device == "cuda" else torch.device("cpu")
    if data is None:
        data = task.load(config.data_dir, config.task_options)
    model = _same_model_everywhere(task, config, data, rank, device)
    if config.resume:
        shared, own = load_checkpoint(config.out, rank)
        if "model" in shared:  # parameters first: DDP broadcasts rank 0's when it wraps the model
            load_model(model, shared, own)  # (a sharded model's load once sharded, in restore)
    steps_per_epoch = steps_in_epoch(task, data, config, world_size)
    averaging = Averaging(model, config, steps_per_epoch)
    optimizer = build_optimizer(model, config)
    run = Resumable(model, optimizer, averaging, device, averaging.mesh)
    start, carried, seconds_before = Position(), None, 0.0
    if config.resume:
        start, carried, seconds_before = run.restore(shared, own, config.out)
    total_steps = config.epochs * steps_per_epoch
    total_steps = total_steps if config.max_steps is None else min(total_steps, config.max_steps)
    capture = None
    if config.capture_gradients and config.capture_steps:
        capture = GradientCapture(config.capture_gradients, config.capture_steps, rank)
        capture.write_layout(model, config.task, config.model, world_size)
    log = None
    if rank == 0:
        log = RunLog(config, task.metrics, total_steps, start if config.resume else None)
    assert config.log_every is not None  # resolved
    pending = PendingSteps(config.log_every, device, log, averaging.stops_on_nonfinite)

    def checkpoint(at: Position, epoch_state: dict[str, Any] | None) -> None:
        seconds = seconds_before + time.perf_counter() - started
        run.save(config.out, at, epoch_state, seconds, asdict(config))

    position, step, batches = start, start.step, None
    for epoch in range(start.epoch, config.epochs):
        if step >= total_steps:
            break
        part = EpochSlice(epoch, rank, world_size, config.batch_size, config.seed, device)
        batches = task.epoch(data, config.task_options, part)
        first = start.batch if epoch == start.epoch else 0
        if epoch == start.epoch and carried is not None:
            batches.load_state_dict(carried)
        last = min(batches.steps, first + total_steps - step)
        for index in range(first, last):
            lr = learning_rate(config, step, steps_per_epoch, world_size)
            for group in optimizer.param_groups:
                group["lr"] = lr
            began = pending.mark()
            optimizer.zero_grad()
            loss = batches.loss(averaging.model, index)
            loss.backward()
            if capture is not None:
                capture.save(model, step)
            backward = pending.mark()
            stats = averaging.synchronize()
            if config.clip:
                nn.utils.clip_grad_norm_(model.parameters(), config.clip)
            optimizer.step()
            pending.add(step, epoch, loss, lr, (began, backward, pending.mark()), stats)
            step += 1
            position = Position(epoch, index + 1, step)
            if config.checkpoint_every and step % config.checkpoint_every == 0:
                pending.read()  # a diverged step raises before its checkpoint is written
                checkpoint(position, batches.state_dict())
        pending.read()
        if log or config.integration == "fsdp":  # a sharded model's forward needs every rank
            model.eval()
            scores = task.evaluate(model, data, config.task_options)
            model.train()
            if log:
                log.epoch(epoch, step, scores)
        dist.barrier()  # the other ranks wait while rank 0 evaluates
        if last == batches.steps:
            position = Position(epoch + 1, 0, step)
            if config.checkpoint_per_epoch:
                checkpoint(position, None)
    if config.checkpointing:
        if position.batch == 0:
            checkpoint(position, None)
        else:  # stopped mid-epoch (or resumed there with nothing left to run)
            checkpoint(position, carried if batches is None else batches.state_dict())
    if log:
        wall = seconds_before + time.perf_counter() - started
        parameters = sum(p.numel() for p in model.parameters())
        log.finish(averaging.options(), world_size, wall, parameters, averaging.speed_choice())


def _same_model_everywhere(
    task: Task, config: TrainConfig, data: Any, rank: int, device: torch.device
) -> nn.Module:
    """The task's model, with rank 0's initial weights on every rank; this rank's RNG seeded
    for what follows (dropout and augmentation differ per rank)."""
    torch.manual_seed(config.seed * 65_537 + rank)
    model = task.build_model(config.model, data, config.seed, config.model_options).to(device)
    for parameter in model.parameters():  # identical start on every rank, whatever its RNG did
        dist.broadcast(parameter.data, src=0)
    return model


def steps_in_epoch(task: Task, data: Any, config: TrainConfig, world_size: int) -> int:
    """Steps per epoch, the same on every rank; ValueError if the global batch is too large."""
    steps = task.steps_per_epoch(data, config.task_options, world_size, config.batch_size)
    if steps == 0:
        raise ValueError(
            f"batch_size {config.batch_size} x {world_size} workers is larger than one epoch "
            f"of task {task.name}'s training data; use a smaller batch_size or fewer workers"
        )
    return steps


class Averaging:
    """How gradients are averaged: ``GradientReducer`` after backward, DDP's comm hook, FSDP2
    with sparse averaging across replicas, or for comparison DDP with one of torch's hooks
    (``ddp_hook``, :class:`PeerAveraging`) or FSDP2's own hybrid sharding.

    With ``ddp`` the exchange overlaps the backward pass, so the step's compute time includes
    what of it was not hidden, and the statistics come from the hook's state.
    """

    def __init__(self, model: nn.Module, config: TrainConfig, steps_per_epoch: int) -> None:
        self.model = model
        self._reducer: GradientReducer | None = None
        self._state: SparseState | ShardedState | None = None
        self._peer: PeerAveraging | HybridSharding | None = None
        self.mesh: dict[str, int] | None = None  # a sharded model's (replicate, shard) sizes
        options: dict[str, Any] = config.sparsifier_options()
        self.stops_on_nonfinite = config.ddp_hook == "microsparse" and config.min_speedup is None
        """A run that diverges stops with an error on every rank (not with ``min_speedup``,
        whose dense passes are DDP's own, nor with a peer hook: neither can raise)."""
        if self.stops_on_nonfinite and config.device != "cuda":
            # On the CPU nothing waits for a device: the library's own check, read on the host,
            # costs nothing and stops the step itself. On a GPU the step keeps its verdict on
            # the device ("skip") and the loop stops at its next read (PendingSteps); either
            # way the choice follows the device, so a resumed run may read at another cadence.
            options["nonfinite"] = "raise"
        if config.momentum_correction:  # the optimiser then runs without momentum
            options.update(momentum_correction=config.momentum, momentum_nesterov=config.nesterov)
        if config.adam_correction:  # the optimiser is then plain SGD at Adam's rate
            options["adam_correction"] = (*config.betas, 1e-8)  # torch's Adam's eps
        if config.value_dtype is not None:
            options["value_dtype"] = SparseOptions.value_dtype_named(config.value_dtype)
        if config.density_warmup is not None:
            start, epochs = config.density_warmup
            options["density_warmup"] = (start, max(1, round(epochs * steps_per_epoch)))
        if config.ddp_hook != "microsparse":
            self._peer = PeerAveraging(model, config.ddp_hook)
            self.model = self._peer.model
        elif config.integration == "fsdp":
            mesh = mesh_of(config.shards, next(model.parameters()).device)
            self.mesh = mesh_shape(mesh)
            averaging = sharded(model, mesh, config.sparsifier, density=config.density,
                                one_exchange=config.one_exchange, **options)  # fmt: skip
            if isinstance(averaging, HybridSharding):
                self._peer = averaging
            else:
                self._state = averaging
        elif config.integration == "ddp":
            self._state = SparseState(
                config.sparsifier, config.density, timeout=config.timeout,
                one_exchange=config.one_exchange, min_speedup=config.min_speedup,
                **options,
            )  # fmt: skip
            self.model = DistributedDataParallel(model)
            self.model.register_comm_hook(self._state, sparse_hook)
        else:
            self._reducer = GradientReducer(
                model.named_parameters(), config.sparsifier, config.density, **options
            )

    def synchronize(self) -> StepStats:
        if self._peer is not None:
            return self._peer.step()
        if self._reducer is not None:
            return self._reducer.synchronize()
        assert self._state is not None and self._state.last_step is not None
        return self._state.last_step

    def options(self) -> dict[str, Any]:
        if self._peer is not None:
            return {"ddp_hook": self._peer.name}
        if self._reducer is not None:
            return self._reducer.sparsifier.options()
        assert self._state is not None
        return dict(self._state.sparse_options.options)

    def speed_choice(self) -> dict[str, Any] | None:
        """The hook's ``min_speedup`` choice and every rank's medians, if it has one."""
        speed = getattr(self._state, "speed", None)
        return None if speed is None else speed.state_dict()

    def state_dict(self) -> dict[str, Any]:
        if self._peer is not None:
            return self._peer.state_dict()
        source = self._reducer if self._reducer is not None else self._state
        assert source is not None
        return source.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._peer is not None:
            self._peer.load_state_dict(state)
            return
        source = self._reducer if self._reducer is not None else self._state
        assert source is not None
        source.load_state_dict(state)


POWERSGD_START = 2
"""Steps of plain all-reduce before PowerSGD compresses (torch's ``start_powerSGD_iter``),
unless its name sets ``start=``."""


class PeerAveraging:
    """DDP with one of torch's hooks (or none: stock DDP), for comparison with microsparse.

    They report no selection, so each step's :class:`StepStats` is the model's:
    every entry averaged, the bytes of :func:`microsparse_lab.methods.traffic.peer_bytes`.
    PowerSGD runs as :func:`~microsparse_lab.methods.hooks.attach_method` sets it up: one
    bucket holding the whole model (torch's hook raced on gloo with DDP's buckets), a plain
    all-reduce for the first ``POWERSGD_START`` steps or the name's ``start=`` (counted as
    dense bytes) and compression from then on, its state kept per parameter so that
    checkpoints resume it
    (:class:`microsparse_lab.methods.powersgd.PowerSGD`).
    """

    def __init__(self, model: nn.Module, name: str) -> None:
        self.name = name
        method = parse_method(name)
        self.model, self._powersgd = attach_method(
            method, model, density=1.0, start=POWERSGD_START, checkpointable=True
        )
        powersgd = method.sparsifier == "powersgd"
        self._start = method.compresses_from(POWERSGD_START) if powersgd else 0
        self.steps = 0
        shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
        self._numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self._world_size = dist.get_world_size()
        self._bytes = peer_bytes(name, shapes, self._world_size)
        self._dense = all_reduce_bytes(4 * self._numel, self._world_size)

    def state_dict(self) -> dict[str, Any]:
        """The step count and PowerSGD's state (the other hooks keep none)."""
        state: dict[str, Any] = {"steps": self.steps}
        if self._powersgd is not None:
            state["powersgd"] = self._powersgd.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        if self._powersgd is not None:
            self._powersgd.load_state_dict(state["powersgd"])

    def step(self) -> StepStats:
        d, n = self._numel, self._world_size
        sent = self._bytes if self.steps >= self._start else self._dense
        stats = dense_stats(self.steps, d, n, target=d, bytes_sent=sent, dense_bytes=self._dense)
        self.steps += 1
        return stats


