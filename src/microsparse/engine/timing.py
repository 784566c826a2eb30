"""Marks in time that make no host wait: the host's clock on a CPU, CUDA events on a GPU.

A GPU runs its kernels after the host has queued them, so the host's clock times the queueing,
and reading an event's time makes the host wait for the device. A :func:`mark` is therefore
an event recorded in the current stream on a GPU, and :func:`elapsed` between two marks is
read (waiting) only when asked.

Example:
    >>> begin = mark(torch.device("cpu"))
    >>> seconds = elapsed(begin, mark(torch.device("cpu")))   # a float on a CPU
    >>> seconds >= 0.0
    True
"""

from __future__ import annotations

import time

import torch

from microsparse.stats import Pending

Mark = float | torch.cuda.Event
"""What :func:`mark` returns: seconds on the host's clock, or a recorded CUDA event."""


def mark(device: torch.device) -> Mark:
    """Now: ``time.perf_counter()`` for a CPU; for a GPU an event recorded in the current
    stream, which the host does not wait for."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def seconds_between(begin: Mark, end: Mark) -> float:
    """Seconds from ``begin`` to ``end``, two marks of one device (waits for ``end`` on a
    GPU)."""
    if isinstance(begin, float):
        return end - begin  # type: ignore[operator]
    end.synchronize()  # type: ignore[union-attr]
    return begin.elapsed_time(end) / 1e3


def elapsed(begin: Mark, end: Mark) -> float | Pending:
    """:func:`seconds_between`, read only when asked on a GPU (a :class:`Pending`)."""
    if isinstance(begin, float):
        return seconds_between(begin, end)
    return Pending(lambda: seconds_between(begin, end))
