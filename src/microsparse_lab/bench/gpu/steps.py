"""Training steps of real models on one device, averaged by each method, world size 1.

A step is ``zero_grad(set_to_none=True)``, forward, loss, backward, the method's averaging
and ``optimizer.step()``. Per model and method: warm-up steps (PowerSGD's vanilla start among
them), timed steps (median, and the ratio to the method's baseline), the peak memory of the
timed steps, then a few profiled steps (CUDA only). Every method trains a fresh copy of the
same model and is measured in its own ``try``: one failure is recorded and the rest go on.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from microsparse_lab.bench.gpu.budget import Budget
from microsparse_lab.bench.gpu.measure import (
    call_cells,
    count_calls,
    peak_memory,
    reset_peak,
    time_steps,
)
from microsparse_lab.bench.gpu.methods import MICRO, STOCK, Method, methods
from microsparse_lab.bench.gpu.models import Workload, workloads


@dataclass(frozen=True)
class Plan:
    """Steps per method: untimed warm-up, timed, profiled (the profile runs on CUDA only)."""

    warmup: int = 8
    timed: int = 20
    profiled: int = 3


QUICK = Plan(warmup=3, timed=4, profiled=2)
PROFILE_AFTER = 12
"""Steps before a method is profiled: DDP times its first 10 iterations with events it waits
for (and every 100th), which would count as host syncs."""
FIRST_METHOD_SECONDS = 20.0
"""What a method is assumed to take before one of its model was measured (then: 1.5 × the
median of those measured; the first also pays the profiler's set-up)."""


def bench_models(device: torch.device, quick: bool, budget: Budget,
                 save: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:  # fmt: skip
    """Every model × method on one process group of one rank (NCCL on CUDA, else gloo).

    ``save`` is called with the results so far after every method.
    """
    plan = QUICK if quick else Plan()
    backend = "nccl" if device.type == "cuda" else "gloo"
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group(backend, init_method=f"file://{folder}/init", rank=0,
                                world_size=1, timeout=timedelta(seconds=120))  # fmt: skip
        try:
            for build in workloads(quick):
                results.append({"model": build.__name__})
                _bench_model(results[-1], build, device, plan, budget, lambda: save(results))
                save(results)
        finally:
            dist.destroy_process_group()
    return results


def _bench_model(model: dict[str, Any], build: Callable[[], Workload | str],
                 device: torch.device, plan: Plan, budget: Budget,
                 save: Callable[[], None]) -> None:  # fmt: skip
    """Fill ``model`` with the model's description and a row per method, saving each row."""
    began = time.perf_counter()
    try:
        workload = build()
    except Exception:  # noqa: BLE001 - the next model still runs
        model["error"] = _last_lines(traceback.format_exc())
        return
    if isinstance(workload, str):
        model["skipped"] = workload
        return
    model.update(model=workload.name, description=workload.description,
                 numel=workload.numel, backend=dist.get_backend(), plan=vars(plan),
                 rows=[])  # fmt: skip
    print(f"{workload.name}: d = {workload.numel:,}, built in "
          f"{time.perf_counter() - began:.1f} s", flush=True)  # fmt: skip
    spent: list[float] = []
    listed = methods(device)
    # Every method is timed before any is profiled (a profiler leaves the process slower for
    # a while after it stops); stock DDP and the MiCRO hook are timed again last, which shows
    # how much the process itself drifted meanwhile.
    again = [replace(m, label=f"{m.label}, again") for m in listed if m.label in (STOCK, MICRO)]
    for method in [*listed, *again]:
        if not budget.allows(1.5 * (statistics.median(spent) if spent else FIRST_METHOD_SECONDS)):
            model["rows"].append({"method": method.label, "skipped": "out of time"})
            continue
        started = time.perf_counter()
        row = _bench_method(workload, method, device, plan)
        spent.append(time.perf_counter() - started)
        row["seconds"] = round(spent[-1], 1)
        model["rows"].append(row)
        add_comparisons(model)
        print(progress_line(workload.name, row), flush=True)
        save()
    rows = {row["method"]: row for row in model["rows"]}
    for method in listed:
        row = rows[method.label]
        if "step_ms" in row and budget.allows(0.5 * statistics.median(spent)):
            row["calls"] = _profiled(workload, method, device, plan)
    save()


def _bench_method(workload: Workload, method: Method, device: torch.device,
                  plan: Plan) -> dict[str, Any]:  # fmt: skip
    row: dict[str, Any] = {"method": method.label, "baseline": method.baseline}
    try:
        _free(device)  # what the method before left (a CUDA error there fails this one too)
        if device.type == "cuda":
            row["allocated_before_bytes"] = torch.cuda.memory_allocated(device)
        row.update(_measure(workload, method, device, plan))
    except Exception:  # noqa: BLE001 - one method's failure must not hide the others
        row["error"] = _last_lines(traceback.format_exc())
    return row


def _measure(workload: Workload, method: Method, device: torch.device,
             plan: Plan) -> dict[str, Any]:  # fmt: skip
    step, averaging = _stepper(workload, method, device)
    for _ in range(plan.warmup):
        step()
    reset_peak(device)
    measured = time_steps(step, plan.timed, device)
    measured["peak_bytes"] = peak_memory(device)
    measured["calls"] = "not profiled" if device.type == "cuda" else "needs CUDA"
    stats = averaging.stats()
    if stats is not None:
        measured["density"] = getattr(stats, "density", None)
    return measured


def _profiled(workload: Workload, method: Method, device: torch.device,
              plan: Plan) -> dict[str, Any] | str:  # fmt: skip
    """The method's calls per step, on a fresh copy after a short warm-up."""
    if device.type != "cuda":
        return "needs CUDA"
    try:
        _free(device)
        step, _ = _stepper(workload, method, device)
        for _ in range(PROFILE_AFTER):
            step()
        return _calls(step, plan.profiled, device)
    except Exception:  # noqa: BLE001 - the timing stands without the counts
        return {"error": _last_lines(traceback.format_exc())}


def _stepper(workload: Workload, method: Method,
             device: torch.device) -> tuple[Callable[[], None], Any]:  # fmt: skip
    """One training step of a fresh copy of the model, averaged by ``method``."""
    model, batch = workload.fresh(device)
    averaging = method.attach(model, device)
    optimizer = workload.optimizer(list(model.parameters()))
    autocast = (torch.autocast(device.type, dtype=workload.autocast)
                if workload.autocast is not None and device.type == "cuda"
                else contextlib.nullcontext())  # fmt: skip

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = workload.loss(averaging.module, batch)
        loss.backward()
        averaging.after_backward()
        optimizer.step()

    return step, averaging


def _calls(step: Callable[[], None], steps: int, device: torch.device) -> dict[str, Any] | str:
    """The profiled counts, on every thread, else on the profiler's default threads; a
    profiler that fails loses them, not the step's timing."""
    if device.type != "cuda":
        return "needs CUDA"
    try:
        return count_calls(step, steps)
    except Exception:  # noqa: BLE001 - the timing above stands without the counts
        failed = _last_lines(traceback.format_exc())
    try:
        return {**count_calls(step, steps, all_threads=False), "all_threads_error": failed}
    except Exception:  # noqa: BLE001
        return {"error": _last_lines(traceback.format_exc()), "all_threads_error": failed}


def add_comparisons(model: dict[str, Any]) -> None:
    """Each row's step time over its baseline's, and its own peak memory (what it allocated
    at most beyond what was allocated before it began) over stock DDP's."""
    rows = {row["method"]: row for row in model["rows"]}
    unit = 4 * model["numel"]
    stock = rows.get(STOCK, {})
    for row in model["rows"]:
        base = rows.get(row.get("baseline", ""), {})
        if "step_ms" in row and "step_ms" in base:
            row["ratio"] = row["step_ms"] / base["step_ms"]
        if _own_peak(row) is not None and _own_peak(stock) is not None:
            row["peak_over_stock_d_floats"] = (_own_peak(row) - _own_peak(stock)) / unit


def _own_peak(row: dict[str, Any]) -> int | None:
    if row.get("peak_bytes") is None or row.get("allocated_before_bytes") is None:
        return None
    return row["peak_bytes"] - row["allocated_before_bytes"]


def progress_line(model: str, row: dict[str, Any]) -> str:
    """One line per method, for a log that keeps only its end."""
    if "step_ms" not in row:
        return f"{model} / {row['method']}: {row.get('skipped') or row.get('error', '')[-300:]}"
    syncs, launches = call_cells(row.get("calls", "not profiled"))
    calls = syncs if syncs == launches else f"{syncs} host syncs, {launches} launches per step"
    peak = "" if row["peak_bytes"] is None else f", peak {row['peak_bytes'] / 2**20:.0f} MiB"
    ratio = f" ({row['ratio']:.3g} ×)" if "ratio" in row else ""
    return (
        f"{model} / {row['method']}: {row['step_ms']:.2f} ms{ratio}, {calls}{peak} "
        f"[{row['seconds']} s]"
    )


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _last_lines(text: str, lines: int = 8) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
