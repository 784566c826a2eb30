"""The real PyTorch Lightning and Hugging Face Accelerate, 2 gloo processes under torchrun.

Each run is a script in ``tests/frameworks/``; these tests start it and compare what every
rank wrote: the hook really applied (the weights differ from plain DDP's, every rank's are
identical), exact resume through each framework's own checkpoints, gradient accumulation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch

import microsparse.ddp as mddp
from microsparse import GradientReducer

SCRIPTS = Path(__file__).parent / "frameworks"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def _run(script: str, mode: str, root: Path) -> list[list[torch.Tensor]]:
    out = root / mode
    command = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(SCRIPTS / script),
               "--mode", mode, "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=root)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [torch.load(out / f"params-rank{r}.pt") for r in range(2)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@cache
def _lightning(root: Path) -> dict[str, list[list[torch.Tensor]]]:
    pytest.importorskip("pytorch_lightning")
    modes = ("sparse", "resume", "plain", "accumulate", "bf16", "manual", "manual-resume")
    return {mode: _run("lightning_run.py", mode, root) for mode in modes}


@cache
def _accelerate(root: Path) -> dict[str, list[list[torch.Tensor]]]:
    pytest.importorskip("accelerate")
    modes = ("hook", "hook-resume", "reducer", "reducer-resume", "accumulate", "plain")
    return {mode: _run("accelerate_run.py", mode, root) for mode in modes}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("frameworks")


def test_lightning_strategy_applies_the_hook_on_cpu(root) -> None:
    runs = _lightning(root)
    for mode, (rank0, rank1) in runs.items():
        assert _same(rank0, rank1), f"{mode}: the ranks' weights differ"
    assert not _same(runs["sparse"][0], runs["plain"][0])  # the hook was really called
    facts = json.loads((root / "sparse" / "facts.json").read_text())
    assert facts == {"steps": 8, "selected": 80, "target": 80}  # exact k, every pass
    logged = (root / "sparse" / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "microsparse/density" in logged


def test_lightning_resumes_exactly_from_its_own_checkpoint(root) -> None:
    runs = _lightning(root)
    assert _same(runs["resume"][0], runs["sparse"][0])
    assert _same(runs["resume"][1], runs["sparse"][1])


def test_lightning_accumulation_bf16_and_manual_optimisation(root) -> None:
    runs = _lightning(root)
    accumulated = json.loads((root / "accumulate" / "facts.json").read_text())
    assert accumulated["steps"] == 8  # one hook pass per optimiser step, not per batch
    assert all(p.dtype == torch.bfloat16 and torch.isfinite(p).all() for p in runs["bf16"][0])
    assert not _same(runs["manual"][0], runs["plain"][0])  # the reducer, not DDP, averaged
    assert _same(runs["manual-resume"][0], runs["manual"][0])  # the documented resume recipe


def test_accelerate_with_the_hook_and_the_reducer_resumes_exactly(root) -> None:
    runs = _accelerate(root)
    for mode, (rank0, rank1) in runs.items():
        assert _same(rank0, rank1), f"{mode}: the ranks' weights differ"
    for mode in ("hook", "reducer", "accumulate"):
        assert not _same(runs[mode][0], runs["plain"][0]), mode
    assert _same(runs["hook-resume"][0], runs["hook"][0])
    assert _same(runs["reducer-resume"][0], runs["reducer"][0])


def test_a_reducer_built_before_the_process_group_refuses(monkeypatch) -> None:
    """Built in a LightningModule's __init__ or before Accelerator(), it would train alone."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2 .* call torch.distributed.init_proc"):
        GradientReducer(torch.nn.Linear(3, 2), "micro", 0.5)
    mddp.MicroState(density=0.5)  # the hook's state binds at the first backward: fine now


def test_a_state_loaded_on_another_rank_refuses() -> None:
    reducer = GradientReducer(torch.nn.Linear(3, 2), "micro", 0.5)
    state = {**reducer.state_dict(), "rank": 1, "world_size": 2}
    with pytest.raises(ValueError, match="saved by rank 1 of 2, but is loaded on rank 0 of 1"):
        reducer.load_state_dict(state)
