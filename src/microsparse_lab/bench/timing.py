"""Wall-clock medians for benchmarks: repeated calls, untimed set-up, device synchronisation.

Example:
    >>> import torch
    >>> timing = median_time(lambda: torch.ones(1000).sum(), repeats=5)
    >>> len(timing.samples), timing.median > 0
    (5, True)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    """Seconds of each timed call (warm-up calls excluded)."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """(max − min) / median: how noisy the samples were."""
        return (max(self.samples) - min(self.samples)) / self.median if self.median else 0.0


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def choose_clock(device: torch.device | str) -> str:
    """``cpu`` for CPU work on one torch thread, else ``wall``.

    On a machine shared with other jobs, a process gets a varying share of the cores, and wall
    time measures the scheduler as much as the work. With one torch thread every kernel runs
    in the calling thread, so the process's CPU time (user + system, page faults included)
    is the work itself. Several threads (their CPU times add up) and GPUs (asynchronous
    kernels) need wall time.
    """
    if torch.device(device).type == "cpu" and torch.get_num_threads() == 1:
        return "cpu"
    return "wall"


def synchronize(device: torch.device | str | None) -> None:
    """Wait for queued kernels: CUDA runs asynchronously, so time the work, not its launch."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_time(
    work: Callable[[], object],
    repeats: int,
    *,
    warmup: int = 1,
    setup: Callable[[], object] | None = None,
    device: torch.device | str | None = None,
    budget: float | None = None,
    least: int = 3,
    clock: str = "wall",
) -> Timing:
    """Time ``work()`` ``repeats`` times after ``warmup`` untimed calls.

    ``setup()`` runs, untimed, before every call (warm-up calls included): restoring state
    that ``work`` changes, so that every sample measures the same thing. With ``budget``
    (seconds), slow work is repeated fewer times: about ``budget`` seconds' worth, judged by
    the last warm-up call, but at least ``least`` times (and never more than ``repeats``).

    ``clock="cpu"`` measures the CPU time of the process instead of wall time (see
    :func:`choose_clock`).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
    now = CLOCKS[clock]

    def once() -> float:
        if setup is not None:
            setup()
        synchronize(device)
        started = now()
        work()
        synchronize(device)
        return now() - started

    last = 0.0
    for _ in range(warmup):
        last = once()
    if budget is not None and warmup and last > 0:
        repeats = max(min(least, repeats), min(repeats, int(budget / last)))
    return Timing(tuple(once() for _ in range(repeats)))
