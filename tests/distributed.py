"""Run a function on n real gloo ranks (one process each) and collect what each returns."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_ranks(fn: Callable[..., Any], world_size: int, tmp_path: Path, *args: Any) -> list[Any]:
    """Spawn ``world_size`` gloo ranks; return what ``fn(rank, world_size, *args)`` gave on each.

    ``fn`` must be a module-level function. An exception in any rank fails the caller with that
    rank's traceback.
    """
    tmp_path.mkdir(parents=True, exist_ok=True)
    init = tmp_path / f"init-{os.getpid()}-{id(fn)}-{world_size}"
    init.unlink(missing_ok=True)
    mp.spawn(_worker, args=(world_size, str(init), str(tmp_path), fn, args), nprocs=world_size)
    return [
        torch.load(tmp_path / f"result-{rank}.pt", weights_only=False) for rank in range(world_size)
    ]


def _worker(
    rank: int, world_size: int, init: str, out: str, fn: Callable[..., Any], args: tuple
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
    except BaseException:
        raise RuntimeError(f"rank {rank} failed:\n{traceback.format_exc()}") from None
    # No rank may tear the group down while another still has collectives in flight.
    dist.barrier()
    dist.destroy_process_group()
    torch.save(result, Path(out) / f"result-{rank}.pt")
