"""Measuring a training step: its time, what the host waits for, what it launches.

Times come from CUDA events around each step (the GPU's clock, so a host that runs ahead of
the GPU is not mistaken for a fast step), on the CPU from ``perf_counter``. CUDA runtime calls
are counted with ``torch.profiler`` on every thread (the DDP hook's callbacks run on the
communication library's threads), inside a named range, so that the synchronisation that ends
the profile is not counted.

Example:
    >>> counts = count_calls(lambda: torch.arange(4.0).nonzero(), steps=2, cuda=False)
    >>> counts["aten_ops_per_step"]["aten::nonzero"]
    1.0
"""

from __future__ import annotations

import re
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

HOST_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy", "cudaMemcpy2D", "cudaMemcpyDtoH", "cuMemcpyDtoH",
              "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize")  # fmt: skip
"""CUDA runtime and driver calls that make the host wait for the GPU (``cudaMemcpy`` is the
synchronous copy; ``cudaMemcpyAsync`` and ``cudaStreamQuery`` do not wait)."""
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel",
            "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")  # fmt: skip
"""Calls that launch kernels (a graph launch counts once)."""
ASYNC_COPIES = ("cudaMemcpyAsync",)
"""Copies that do not make the host wait by themselves."""
SYNCING_OPS = ("aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::masked_select",
               "aten::_unique2", "aten::equal", "aten::bincount", "aten::is_nonzero")  # fmt: skip
"""torch ops whose CUDA implementation waits for the GPU (``.item``, data-dependent shapes)."""
RANGE = "gpu_check.steps"
_SUFFIX = re.compile(r"(_v\d+)?(_ptsz|_ptds)?$")


def time_steps(step: Callable[[], Any], steps: int, device: torch.device) -> dict[str, Any]:
    """Milliseconds of ``steps`` calls of ``step``: the median, every sample, and the wall
    time per step over them all (host included)."""
    _synchronize(device)
    began = time.perf_counter()
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(steps)]  # fmt: skip
        for start, end in events:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize(device)
        samples = [start.elapsed_time(end) for start, end in events]
    else:
        samples = []
        for _ in range(steps):
            started = time.perf_counter()
            step()
            samples.append(1e3 * (time.perf_counter() - started))
    wall = 1e3 * (time.perf_counter() - began) / steps
    return {"step_ms": statistics.median(samples), "wall_step_ms": wall,
            "samples_ms": [round(s, 3) for s in samples]}  # fmt: skip


def count_calls(step: Callable[[], Any], steps: int, cuda: bool = True,
                all_threads: bool = True) -> dict[str, Any]:  # fmt: skip
    """Per step: host syncs, kernel launches and async copies (CUDA calls), syncing torch ops.

    ``cuda=False`` profiles the CPU only (no CUDA calls to count: the torch ops remain).
    ``all_threads``: record torch ops on every thread, where this torch can.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    config, all_threads = _all_threads_config() if all_threads else (None, False)
    with profile(activities=activities, experimental_config=config) as profiler:
        with record_function(RANGE):
            for _ in range(steps):
                step()
        if cuda:
            torch.cuda.synchronize()
    calls, ops = _calls_in_range(profiler.events())
    per_step = {name: round(count / steps, 2) for name, count in sorted(calls.items())}
    return {
        "host_syncs_per_step": sum(calls[name] for name in HOST_SYNCS) / steps,
        "launches_per_step": sum(calls[name] for name in LAUNCHES) / steps,
        "async_copies_per_step": sum(calls[name] for name in ASYNC_COPIES) / steps,
        "cuda_calls_per_step": per_step,
        "aten_ops_per_step": {name: ops[name] / steps for name in SYNCING_OPS if ops[name]},
        "all_threads": all_threads,
        "profiled_steps": steps,
    }


def call_cells(calls: dict[str, Any] | str) -> tuple[str, str]:
    """Host syncs and kernel launches per step as table cells (or why there are none)."""
    if isinstance(calls, str):
        return calls, calls
    if "error" in calls:
        return "profiler failed", "profiler failed"
    return f"{calls['host_syncs_per_step']:.3g}", f"{calls['launches_per_step']:.4g}"


def _all_threads_config() -> tuple[Any, bool]:
    """The profiler's config that records ops on every thread, where this torch has it."""
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True), True
    except (AttributeError, TypeError):
        return None, False


def _calls_in_range(events: list[Any]) -> tuple[Counter[str], Counter[str]]:
    """CUDA API calls (by name without version suffixes) and torch ops inside the range."""
    on_host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    window = next(e for e in on_host if e.name == RANGE).time_range  # not the GPU's annotation
    calls: Counter[str] = Counter()
    ops: Counter[str] = Counter()
    for event in on_host:  # not the kernels and copies as the GPU ran them
        span = event.time_range
        if span.start < window.start or span.end > window.end or event.name == RANGE:
            continue
        if event.name.startswith("aten::"):
            ops[event.name] += 1
        elif event.name.startswith("cu"):
            calls[_SUFFIX.sub("", event.name)] += 1
    return calls, ops


def peak_memory(device: torch.device) -> int | None:
    """Bytes allocated at most since the last :func:`reset_peak` (None on the CPU)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
