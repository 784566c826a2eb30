"""Process launching: n local workers through ``torch.multiprocessing.spawn``, or one per
process under ``torchrun`` (which is how the same command scales to several machines)."""

from __future__ import annotations

import os
import socket
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.queues import SimpleQueue
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException, ProcessRaisedException
from tqdm import tqdm

from microsparse_lab.training.config import TrainConfig
from microsparse_lab.training.loop import train
from microsparse_lab.training.rundir import MARKER

_MAX_MESSAGE = 2000  # characters of a worker's error that are passed back to the parent


class WorkerError(RuntimeError):
    """A worker process failed; the message names its rank and its exception."""


@dataclass(frozen=True)
class TorchrunEnv:
    """The process's place in a job started by ``torchrun``."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def torchrun_env(environ: dict[str, str] | None = None) -> TorchrunEnv | None:
    """The torchrun variables of ``environ`` (default ``os.environ``), or None if absent.

    Example:
        >>> torchrun_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h"})
        TorchrunEnv(rank=1, world_size=2, local_rank=1, local_world_size=2)
        >>> torchrun_env({}) is None
        True
    """
    environ = dict(os.environ) if environ is None else environ
    if not all(name in environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")):
        return None
    world_size = int(environ["WORLD_SIZE"])
    return TorchrunEnv(
        rank=int(environ["RANK"]),
        world_size=world_size,
        local_rank=int(environ["LOCAL_RANK"]),
        local_world_size=int(environ.get("LOCAL_WORLD_SIZE", world_size)),
    )


def launch(config: TrainConfig, workers: int, data: Any = None) -> None:
    """Run :func:`~.loop.train` on every rank; raise WorkerError if one fails.

    Under torchrun this process is one rank and ``workers`` is ignored (the caller checks it
    against WORLD_SIZE); otherwise ``workers`` local processes are spawned. ``data``, the
    task's loaded data, is handed to them in shared memory (each loads its own if None).

    Example:
        >>> launch(TrainConfig(max_steps=5, out="runs/smoke"), workers=2)  # doctest: +SKIP
    """
    env = torchrun_env()
    if env is None:
        _spawn(config, workers, data)
        return
    try:
        _run_rank(
            config, env.local_rank, env.local_world_size, "env://", env.rank, env.world_size, data
        )
    except Exception as error:
        raise WorkerError(_describe(env.rank, error, config.timeout)) from error


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _spawn(config: TrainConfig, workers: int, data: Any) -> None:
    errors = mp.get_context("spawn").SimpleQueue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    try:
        context = mp.start_processes(_spawned, args=(config, workers, init_method, errors, data),
                                     nprocs=workers, join=False, start_method="spawn")  # fmt: skip
        # Once one worker has failed, the others get 5 s to stop before SIGTERM, then SIGKILL
        # (a stopped or hung worker ignores SIGTERM).
        while not context.join(grace_period=5):
            pass
    except ProcessException as failure:
        # Blame the rank that exited first: the others often fail only because it vanished.
        rank = failure.error_index
        reports: dict[int, str] = {}
        while not errors.empty():
            reporter, text = errors.get()
            reports.setdefault(reporter, text)
        last_line = str(failure).strip().splitlines()[-1]  # e.g. "terminated with signal ..."
        message = reports.get(rank, f"rank {rank}: {last_line}")
        log = Path(config.out, "error.log")
        # Never over a user's error.log: only a new one, or one in a directory a run claimed.
        ours = not log.exists() or Path(config.out, MARKER).is_file()
        if isinstance(failure, ProcessRaisedException) and ours:
            log.write_text(str(failure), encoding="utf-8")
            message += f" (traceback in {log})"
        raise WorkerError(message) from None


def _spawned(
    local_rank: int,
    config: TrainConfig,
    workers: int,
    init_method: str,
    errors: SimpleQueue,
    data: Any,
) -> None:
    try:
        _run_rank(config, local_rank, workers, init_method, local_rank, workers, data)
    except BaseException as error:
        errors.put((local_rank, _describe(local_rank, error, config.timeout)))
        raise
    leave_process(0)  # every file of the run is closed by now


def leave_process(code: int) -> None:
    """End this worker process with ``code`` at once, without the interpreter's teardown.

    Gloo's threads can still hold tensors (DDP's buckets, a hook's futures) when Python
    finalizes; freeing them then takes the GIL from a dying interpreter and aborts the
    process (SIGABRT, "terminate called without an active exception") at random, more often
    under load, failing a worker that had finished. Call it once everything the process had
    to say is written. ``microsparse train``'s workers leave this way (spawned ones from
    :func:`launch`, torchrun's from the ``microsparse`` program); their progress bar takes a
    thread lock (:func:`_run_rank`), as a multiprocessing one would be left to the resource
    tracker, which warns of a leaked semaphore.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BrokenPipeError:  # its reader has gone (`| head`): nothing left to tell it
            pass
    os._exit(code)


def _run_rank(
    config: TrainConfig,
    local_rank: int,
    local_workers: int,
    init_method: str,
    rank: int,
    world_size: int,
    data: Any = None,
) -> None:
    # spawn does not set OMP_NUM_THREADS: without this every worker would use every core.
    # One the caller set (a test bed sharing the cores among hosts) is kept.
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_workers))
    backend = "gloo"
    if config.device == "cuda":
        torch.cuda.set_device(local_rank)
        backend = "nccl"
    # One bar per process needs no lock across processes, and tqdm's default one (a
    # multiprocessing lock) would outlive a worker that ends without the teardown.
    tqdm.set_lock(threading.RLock())
    _init_process_group(backend, init_method, rank, world_size, config.timeout)
    try:
        train(config, local_rank, data)
    finally:
        dist.destroy_process_group()


def _init_process_group(
    backend: str, init_method: str, rank: int, world_size: int, timeout: float | None
) -> None:
    wait = None if timeout is None else timedelta(seconds=timeout)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if init_method != "env://" or restart is None:
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=wait)  # fmt: skip
        return
    # Under torchrun, restarted workers share the agent's store with the attempt before:
    # unprefixed, they may read its dead workers' addresses and fail to connect (or hang).
    extra = {"timeout": wait} if wait else {}
    store, rank, world_size = next(dist.rendezvous(init_method, rank, world_size, **extra))
    store = dist.PrefixStore(f"microsparse/attempt-{restart}/", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=wait)


def _describe(rank: int, error: BaseException, timeout: float | None = None) -> str:
    text = " ".join(str(error).split()) or "(no message)"
    if timeout is not None and "timed out" in text.lower():
        text += (
            f" (a peer did not take part in a collective within --timeout {timeout:g} s: it "
            "is stopped, hung or gone)"
        )
    return f"rank {rank}: {type(error).__name__}: {text}"[:_MAX_MESSAGE]
