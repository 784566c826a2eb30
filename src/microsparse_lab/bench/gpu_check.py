"""``make gpu-check``: correctness on CUDA and NCCL, and what sparse averaging costs on a GPU.

One prepared script for a machine with one GPU, about 4 minutes, needing nothing but torch
(the package itself from ``src/``, no downloads; torchvision and transformers if present)::

    PYTHONPATH=src python -m microsparse_lab.bench.gpu_check --out "$OUT"

It writes ``gpu-check.json`` (everything, with the machine and versions) and ``gpu-check.md``
(a short report) into ``--out`` (default ``$OUT``, else ``runs/gpu-check``), rewriting both
after every part so that a run cut short leaves what it measured, and exits 1 if a
correctness check failed or a part crashed. The parts, in order:

1. **Correctness** (``microsparse_lab.bench.gpu.correctness``): every sparsifier and MiCRO option
   set gives bit for bit the same averaged gradients and residuals on CUDA as on the CPU
   (SAGE draws other positions from the CUDA generator: reported, not failed); on NCCL at
   world size 1 the loop API does too, the DDP hook equals the reducer and resuming is exact;
   2 gloo ranks with CUDA tensors match the same run on CPU tensors.
2. **Training steps** (``microsparse_lab.bench.gpu.steps``): torchvision's ResNet-50 (batch 64,
   fp32, SGD; skipped without torchvision) and GPT-2 small (transformers', else a plain-torch
   decoder of its size; 8 × 512 tokens, bf16 autocast, AdamW) in DDP on NCCL at world size 1,
   averaged by stock DDP, torch's fp16 / bf16 compression and PowerSGD hooks, ``micro_hook``
   (its default, each bucket's step started on the hook's own thread; also on autograd's
   thread, with ``one_exchange``, and on DDP buckets of 100 MB instead of 25: fewer, larger
   slabs), ``sparse_hook`` with top-k, and the loop API
   (``GradientReducer``) beside a loop that all-reduces every gradient. Per method: the
   median step time and its ratio to stock DDP (the loop API's to the all-reduce loop), host
   syncs, kernel launches and async copies per step (CUDA runtime calls counted by
   ``torch.profiler`` on every thread), and the peak memory over stock DDP's, in units of
   4 bytes × d.
3. **Selection** (``microsparse_lab.bench.gpu.selection``): MiCRO's quota selection and the
   reference option set's compare against ``torch.topk(|a|, k)`` at d = 11.2 M and 100 M,
   n = 1, 4, 16, 64, and one slab's whole engine step in device-to-device copies of d floats.

``--budget`` seconds (default 240) bound the run: a part that would not fit is skipped and
says so, and a run still going 40 s after the budget dumps its stacks and exits 1 (never
hang). ``--device cpu --quick`` runs everything that does not need CUDA on tiny models and
sizes, with gloo for NCCL (the test suite's dry run, well under a minute); ``--quick`` on
CUDA is the same on the GPU.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib.metadata
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from microsparse_lab.bench.gpu import correctness, measure, report
from microsparse_lab.bench.gpu.budget import Budget
from microsparse_lab.bench.gpu.selection import bench_selection
from microsparse_lab.bench.gpu.steps import bench_models
from microsparse_lab.bench.workload import RESNET18_NUMEL

SIZES = (RESNET18_NUMEL, 100_000_000)
QUICK_SIZES = (200_000,)
PARTITIONS = (1, 4, 16, 64)
SELECTION_SECONDS = 30.0
"""Kept for the selection while the models run (the selection skips sizes that won't fit)."""
OVERRUN_SECONDS = 40.0
"""How long past its budget the run may go before it is stopped."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m microsparse_lab.bench.gpu_check")
    parser.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu-check")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny models and sizes")
    parser.add_argument("--budget", type=float, default=240.0, help="seconds (see above)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; use --device cpu for a dry run", file=sys.stderr)
        return 2
    faulthandler.dump_traceback_later(args.budget + OVERRUN_SECONDS, exit=True)
    try:
        result = run(_device(args.device), args.quick, Budget(args.budget), Path(args.out))
    finally:
        faulthandler.cancel_dump_traceback_later()
    print(report.markdown(result), flush=True)
    failed = [check for check in result["checks"] if not check["ok"]]
    failed += [result[part] for part in ("models", "selection") if not result[part]["ok"]]
    return 1 if failed else 0


def run(device: torch.device, quick: bool, budget: Budget, out: Path) -> dict[str, Any]:
    """Every part in order, saving the results after each; returns them."""
    started = time.perf_counter()
    result: dict[str, Any] = {
        "environment": _environment(device),
        "counted_calls": {"host_syncs": measure.HOST_SYNCS, "launches": measure.LAUNCHES,
                          "async_copies": measure.ASYNC_COPIES,
                          "syncing_ops": measure.SYNCING_OPS},
        "checks": [],
    }  # fmt: skip

    def save() -> None:
        result["seconds"] = round(time.perf_counter() - started, 1)
        report.save(result, out)

    for name, check in [
        ("same results as on CPU", lambda: correctness.same_as_cpu(device)),
        ("NCCL (gloo on CPU), world size 1: loop, hook, resume",
         lambda: correctness.process_group(device)),
        ("2 gloo ranks with device tensors", lambda: correctness.gloo_ranks(device)),
    ]:  # fmt: skip
        result["checks"].append({"name": name, **_part(name, check)})
        save()
    result["models"] = {"results": []}

    def models_so_far(results: list[dict[str, Any]]) -> None:
        result["models"]["results"] = results
        save()

    budget.reserve = SELECTION_SECONDS
    result["models"].update(_part("training steps", lambda: {
        "results": bench_models(device, quick, budget, models_so_far)}))  # fmt: skip
    save()
    budget.reserve = 0.0
    sizes = QUICK_SIZES if quick else SIZES
    result["selection"] = _part(
        "selection", lambda: bench_selection(device, sizes, PARTITIONS, budget)
    )
    result["finished"] = True
    save()
    return result


def _part(name: str, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one part; a crash is recorded with the end of its traceback, and the next runs."""
    began = time.perf_counter()
    try:
        outcome = {"ok": True, **work()}
    except Exception:  # noqa: BLE001 - one broken part must not hide the others
        outcome = {"ok": False, "error": traceback.format_exc()[-3000:]}
    outcome["seconds"] = round(time.perf_counter() - began, 1)
    print(f"{name}: {'ok' if outcome['ok'] else 'FAILED'} ({outcome['seconds']} s)", flush=True)
    return outcome


def _device(kind: str) -> torch.device:
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _environment(device: torch.device) -> dict[str, Any]:
    info = {"device": str(device), "python": sys.version.split()[0], "torch": torch.__version__}
    if device.type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                    nccl=".".join(map(str, torch.cuda.nccl.version())))  # fmt: skip
    for package in ("torchvision", "transformers"):
        try:
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            info[package] = "absent"
    return info


if __name__ == "__main__":
    sys.exit(main())
