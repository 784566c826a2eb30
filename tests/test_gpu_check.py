"""The prepared device check (``make gpu-check``): kept working here, run for real on a GPU."""

from __future__ import annotations

import json

import pytest
import torch

from microsparse.bench import gpu_check


def test_the_device_check_runs_on_cpu(tmp_path) -> None:
    """The dry run: every check that does not need CUDA runs (gloo stands in for NCCL)."""
    assert gpu_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu-check.json").read_text())
    checks = {check["name"]: check for check in result["checks"]}
    assert checks["same results as on CPU"]["ok"]
    assert all(row["equal"] for row in checks["same results as on CPU"]["rows"])
    process_group = checks["NCCL (gloo on CPU), world size 1: loop, hook, resume"]
    assert process_group["hook"]["equal"] and process_group["resume"]["equal"]
    assert checks["host syncs per step"] == {**checks["host syncs per step"],
                                             "skipped": "needs CUDA"}  # fmt: skip
    assert {row["world_size"] for row in checks["timings"]["rows"]} == {1, 4, 16, 64}
    assert "| d | n |" in (tmp_path / "gpu-check.md").read_text()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_gives_the_same_results_as_cpu() -> None:
    outcome = gpu_check._same_as_cpu(torch.device("cuda"))
    assert outcome["ok"], [row for row in outcome["rows"] if not row["equal"]]
