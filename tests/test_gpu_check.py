"""The prepared device check (``make gpu-check``): kept working here, run for real on a GPU."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from microsparse_lab.bench import gpu_check
from microsparse_lab.bench.gpu import correctness, measure, steps
from microsparse_lab.bench.gpu.budget import Budget
from microsparse_lab.bench.gpu.methods import methods
from microsparse_lab.bench.gpu.selection import bench_selection


def test_the_device_check_runs_on_cpu(tmp_path) -> None:
    """The dry run: every part that does not need CUDA runs (gloo stands in for NCCL)."""
    assert gpu_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu-check.json").read_text())
    checks = {check["name"]: check for check in result["checks"]}
    assert set(checks) == {"same results as on CPU", "2 gloo ranks with device tensors",
                           "NCCL (gloo on CPU), world size 1: loop, hook, resume"}  # fmt: skip
    assert all(check["ok"] for check in checks.values())
    assert all(row["equal"] for row in checks["same results as on CPU"]["rows"])
    gloo = checks["2 gloo ranks with device tensors"]["rows"]
    assert [row.get("mode") for row in gloo][-1] == "deterministic algorithms"
    process_group = checks["NCCL (gloo on CPU), world size 1: loop, hook, resume"]
    assert process_group["hook"]["equal"] and process_group["resume"]["equal"]

    models = result["models"]["results"]
    assert [model["model"] for model in models] == ["tiny CNN", "tiny transformer"]
    labels = [method.label for method in methods(torch.device("cpu"))]
    labels += ["stock DDP, again", "micro_hook, again"]
    for model in models:
        assert [row["method"] for row in model["rows"]] == labels
        for row in model["rows"]:
            assert row["step_ms"] > 0 and row["ratio"] > 0, row
            assert row["calls"] == "needs CUDA"
    selection = result["selection"]["rows"]
    assert {row["world_size"] for row in selection} == {1, 4, 16, 64}
    assert all(row["quota_per_topk"] > 0 and row["reference_select_ms"] > 0
               and row["hook_step_passes"] > 0 for row in selection)  # fmt: skip

    report = (tmp_path / "gpu-check.md").read_text()
    assert report.count("| method | step ms | × stock DDP") == 2
    assert "| d | n |" in report and "cudaStreamSynchronize" in report


def test_parts_that_do_not_fit_the_budget_are_skipped() -> None:
    """Out of time, methods and sizes are skipped, and say so, instead of being started."""
    saved = []
    models = steps.bench_models(torch.device("cpu"), True, Budget(0.0), saved.append)
    assert saved and all(row == {"method": row["method"], "skipped": "out of time"}
                         for model in models for row in model["rows"])  # fmt: skip
    selection = bench_selection(torch.device("cpu"), (200_000,), (1, 4), Budget(0.0))
    assert selection == {"rows": [], "skipped_sizes": [200_000]}


def test_a_residual_is_traced_per_step() -> None:
    """Each step's residual is its own copy, not the live buffer of the last step."""
    residuals = [step[-1] for step in correctness.trace("micro", {}, torch.device("cpu"))]
    assert not torch.equal(residuals[0], residuals[-1])


def test_only_host_calls_inside_the_steps_are_counted() -> None:
    """CUDA calls by name without version suffix, inside the host's range of the steps: not
    the GPU's copy of that range, not the kernels, not the sync that ends the profile."""
    cpu, gpu = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def event(name: str, device: torch.autograd.DeviceType, start: float, end: float) -> Any:
        return SimpleNamespace(name=name, device_type=device,
                               time_range=SimpleNamespace(start=start, end=end))  # fmt: skip

    events = [
        event(measure.RANGE, gpu, 50, 300), event(measure.RANGE, cpu, 0, 100),
        event("cudaStreamSynchronize", cpu, 10, 20), event("cudaLaunchKernel_v7000", cpu, 30, 31),
        event("aten::nonzero", cpu, 9, 21), event("cudaLaunchKernel", gpu, 40, 45),
        event("cudaDeviceSynchronize", cpu, 150, 160),
    ]  # fmt: skip
    calls, ops = measure._calls_in_range(events)
    assert calls == {"cudaStreamSynchronize": 1, "cudaLaunchKernel": 1}
    assert ops == {"aten::nonzero": 1}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_host_sync_is_counted() -> None:
    tensor = torch.ones(8, device="cuda")
    counts = measure.count_calls(lambda: tensor.sum().item(), steps=2)
    assert counts["host_syncs_per_step"] >= 1 and counts["launches_per_step"] >= 1, counts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_gives_the_same_results_as_cpu() -> None:
    outcome = correctness.same_as_cpu(torch.device("cuda"))
    assert outcome["ok"], [row for row in outcome["rows"] if not row["equal"]]
