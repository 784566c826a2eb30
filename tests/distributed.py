"""Run a function on n real gloo ranks (one process each) and collect what each returns."""

from __future__ import annotations

import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessExitedException

from microsparse_lab.training.launch import leave_process


def run_ranks(fn: Callable[..., Any], world_size: int, tmp_path: Path, *args: Any) -> list[Any]:
    """Spawn ``world_size`` gloo ranks; return what ``fn(rank, world_size, *args)`` gave on each.

    ``fn`` must be a module-level function. An exception in any rank fails the caller with that
    rank's traceback.
    """
    tmp_path.mkdir(parents=True, exist_ok=True)
    run = tmp_path / f"ranks-{uuid.uuid4().hex[:12]}"
    run.mkdir()
    try:
        mp.spawn(_worker, args=(world_size, str(run), fn, args), nprocs=world_size)
    except ProcessExitedException:
        failures = sorted(run.glob("error-*.txt"))
        if failures:
            raise RuntimeError(failures[0].read_text(encoding="utf-8")) from None
        raise
    return [torch.load(run / f"result-{rank}.pt", weights_only=False) for rank in range(world_size)]


def _worker(rank: int, world_size: int, run: str, fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(1)
    init = f"file://{Path(run, 'init')}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
    except BaseException:
        report = f"rank {rank} failed:\n{traceback.format_exc()}"
        Path(run, f"error-{rank}.txt").write_text(report, encoding="utf-8")
        leave_process(1)
    torch.save(result, Path(run, f"result-{rank}.pt"))
    # No rank may leave while another still has collectives in flight.
    dist.barrier()
    leave_process(0)  # every result is on disk by now
