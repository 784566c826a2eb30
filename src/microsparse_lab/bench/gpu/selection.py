"""MiCRO's selection against ``torch.topk(|a|, k)`` on the same vector, and one slab's step.

Per size d and partition count n, medians of CUDA-event times (``perf_counter`` on the CPU):
quota selection (MiCRO's default), the reference option set's compare at the same count,
``torch.topk``, and the whole per-step engine cost of one slab as the DDP hook runs it, in
units of one device-to-device copy of d floats.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from microsparse.comm import SymmetricPeers
from microsparse.engine import SparseOutput, SparseStep, run_blocking
from microsparse.feedback import ErrorFeedback
from microsparse.layout import Layout
from microsparse.sparsifiers import create_sparsifier, initial_threshold
from microsparse_lab.bench.gpu.budget import Budget
from microsparse_lab.bench.gpu.correctness import REFERENCE
from microsparse_lab.bench.workload import calibrate, model_layout, synthetic_gradient

DENSITY = 0.001
SECONDS_PER_ENTRY = 1e-7
"""About how long one size takes on a GPU per entry of d (at least 10 s): a size that would
not fit the budget is skipped."""


def bench_selection(device: torch.device, sizes: tuple[int, ...], partitions: tuple[int, ...],
                    budget: Budget) -> dict[str, Any]:  # fmt: skip
    """Rows for every size × partition count; a size that does not fit the budget is skipped."""
    rows: list[dict[str, Any]] = []
    skipped = []
    for numel in sizes:
        if not budget.allows(max(10.0, SECONDS_PER_ENTRY * numel)):
            skipped.append(numel)
            continue
        rows += _at_size(numel, device, partitions)
        print(f"selection at d = {numel:,}: done", flush=True)
    return {"rows": rows, **({"skipped_sizes": skipped} if skipped else {})}


def _at_size(numel: int, device: torch.device, partitions: tuple[int, ...]) -> list[dict]:
    layout = model_layout(numel)
    # generated on the CPU (a CPU generator cannot drive the device's randn), then moved
    gradient = synthetic_gradient(layout, torch.Generator().manual_seed(0)).to(device)
    target = max(1, int(DENSITY * numel))
    calibrate(gradient, DENSITY, initial_threshold(target))
    scratch = torch.empty_like(gradient)
    unit = median_ms(lambda: scratch.copy_(gradient), device)
    topk = median_ms(lambda: torch.topk(torch.abs(gradient, out=scratch), target), device)
    rows = []
    for n in partitions:
        row = {"numel": numel, "world_size": n, "copy_ms": unit, "topk_ms": topk}
        for key, timing in (("quota_select_ms", _quota_ms),
                            ("reference_select_ms", _reference_ms),
                            ("hook_step_ms", _hook_step_ms)):  # fmt: skip
            try:
                row[key] = timing(layout, gradient, device, n)
            except Exception as error:  # noqa: BLE001 - the row's other timings still count
                row[key.replace("_ms", "_error")] = f"{type(error).__name__}: {error}"[:300]
        if "quota_select_ms" in row:
            row["quota_per_topk"] = row["quota_select_ms"] / topk
        if "hook_step_ms" in row:
            row["hook_step_passes"] = row["hook_step_ms"] / unit
        rows.append(row)
    return rows


def _quota_ms(layout: Layout, gradient: torch.Tensor, device: torch.device, n: int) -> float:
    """MiCRO's default selection (quotas) by rank 0 of n."""
    quota = create_sparsifier("micro", DENSITY)
    quota.bind(layout, 0, n)
    return median_ms(lambda: quota.select(gradient, 0), device)


def _reference_ms(layout: Layout, gradient: torch.Tensor, device: torch.device, n: int) -> float:
    """The reference option set's compare, its threshold settled at the quota's count."""
    reference = create_sparsifier("micro", DENSITY, **REFERENCE)
    reference.bind(layout, 0, n)
    quota = create_sparsifier("micro", DENSITY)
    quota.bind(layout, 0, n)
    start, end = reference.partition(0)
    owned = gradient[start:end].abs()
    reference.settle(torch.topk(owned, min(quota.quota(0), owned.numel())).values[-1].item())
    return median_ms(lambda: reference.select(gradient, 0), device)


def _hook_step_ms(layout: Layout, gradient: torch.Tensor, device: torch.device, n: int) -> float:
    """One slab's whole step (compensate, select, exchange, write) among n equal ranks."""
    sparsifier = create_sparsifier("micro", DENSITY)
    sparsifier.bind(layout, 0, n)
    engine = SparseStep(sparsifier, ErrorFeedback(layout, torch.float32, device))
    bucket = torch.empty(layout.numel, device=device)
    output = SparseOutput(torch.zeros(layout.numel, device=device))
    peers = SymmetricPeers(0, n)

    def step() -> None:
        run_blocking(engine.run(0, bucket, output), peers)

    return median_ms(step, device, setup=lambda: bucket.copy_(gradient))


def median_ms(work: Callable[[], Any], device: torch.device, repeats: int = 21,
              setup: Callable[[], Any] | None = None, warmup: int = 3) -> float:  # fmt: skip
    """Median milliseconds of ``work`` after ``warmup`` calls; ``setup`` runs untimed first."""
    samples = []
    for index in range(repeats + warmup):
        if setup is not None:
            setup()
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            work()
            end.record()
            torch.cuda.synchronize(device)
            elapsed = begin.elapsed_time(end)
        else:
            started = time.perf_counter()
            work()
            elapsed = 1e3 * (time.perf_counter() - started)
        if index >= warmup:
            samples.append(elapsed)
    return statistics.median(samples)
