"""The real PyTorch Lightning and Hugging Face Accelerate, 2 gloo processes under torchrun.

Each run is a script in ``tests/frameworks/``; these tests start it and compare what every
rank wrote: the hook really applied (the weights differ from plain DDP's, every rank's are
identical), exact resume through each framework's own checkpoints, gradient accumulation.
Lightning runs with both of its packages, ``pytorch_lightning`` and ``lightning.pytorch``.

Sharded training: ``microsparse.fsdp`` under Lightning's ``ModelParallelStrategy`` and under an
Accelerate loop, 4 gloo processes as 2 replicas × 2 shards, against hybrid sharding.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
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


LIGHTNING_MODES = {
    "pytorch_lightning": ("sparse", "resume", "plain", "accumulate", "bf16", "manual",
                          "manual-resume"),
    # The same strategy on the other base class: the hook and the resume, the slow runs kept few.
    "lightning.pytorch": ("sparse", "resume", "plain"),
}  # fmt: skip
PACKAGES = list(LIGHTNING_MODES)


def _run(script: str, mode: str, root: Path, *options: str,
         ranks: int = 2) -> list[list[torch.Tensor]]:  # fmt: skip
    out = root / mode
    root.mkdir(parents=True, exist_ok=True)
    command = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(ranks), str(SCRIPTS / script),
               "--mode", mode, "--out", str(out), *options]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=root)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [torch.load(out / f"params-rank{r}.pt") for r in range(ranks)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@cache
def _lightning(root: Path, package: str) -> dict[str, list[list[torch.Tensor]]]:
    pytest.importorskip(package)
    return {mode: _run("lightning_run.py", mode, root / package, "--package", package)
            for mode in LIGHTNING_MODES[package]}  # fmt: skip


@cache
def _accelerate(root: Path) -> dict[str, list[list[torch.Tensor]]]:
    pytest.importorskip("accelerate")
    modes = ("hook", "hook-resume", "reducer", "reducer-resume", "accumulate", "plain")
    return {mode: _run("accelerate_run.py", mode, root) for mode in modes}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("frameworks")


@pytest.mark.parametrize("package", PACKAGES)
def test_lightning_strategy_applies_the_hook_on_cpu(root, package) -> None:
    runs = _lightning(root, package)
    for mode, (rank0, rank1) in runs.items():
        assert _same(rank0, rank1), f"{mode}: the ranks' weights differ"
    assert not _same(runs["sparse"][0], runs["plain"][0])  # the hook was really called
    facts = json.loads((root / package / "sparse" / "facts.json").read_text())
    assert facts == {"steps": 8, "selected": 80, "target": 80}  # exact k, every pass
    logs = root / package / "sparse" / "lightning_logs" / "version_0" / "metrics.csv"
    assert "microsparse/density" in logs.read_text()


@pytest.mark.parametrize("package", PACKAGES)
def test_lightning_resumes_exactly_from_its_own_checkpoint(root, package) -> None:
    runs = _lightning(root, package)
    assert _same(runs["resume"][0], runs["sparse"][0])
    assert _same(runs["resume"][1], runs["sparse"][1])


def test_lightning_accumulation_bf16_and_manual_optimisation(root) -> None:
    runs = _lightning(root, "pytorch_lightning")
    accumulated = json.loads((root / "pytorch_lightning" / "accumulate" / "facts.json").read_text())
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


FSDP_SCRIPTS = {"lightning": ("lightning_fsdp_run.py", "lightning.pytorch"),
                "accelerate": ("accelerate_fsdp_run.py", "accelerate")}  # fmt: skip


@cache
def _sharded(root: Path, framework: str) -> dict[str, list[list[torch.Tensor]]]:
    script, package = FSDP_SCRIPTS[framework]
    pytest.importorskip(package)
    return {mode: _run(script, mode, root / f"{framework}-fsdp", ranks=4)
            for mode in ("hybrid", "dense", "sparse")}  # fmt: skip


@pytest.mark.parametrize("framework", list(FSDP_SCRIPTS))
def test_sharded_training_under_the_framework_is_hybrid_sharding_at_density_one(
    root, framework
) -> None:
    """2 replicas × 2 shards: density 1 equals hybrid sharding bit for bit; at density 0.01
    exactly k entries a step over the model, and every rank (both replicas) ends with the same
    weights, which differ from hybrid sharding's (the exchange really ran)."""
    runs = _sharded(root, framework)
    for mode, ranks in runs.items():
        assert all(_same(ranks[0], other) for other in ranks[1:]), f"{mode}: the ranks differ"
    assert _same(runs["dense"][0], runs["hybrid"][0])
    assert not _same(runs["sparse"][0], runs["hybrid"][0])
    for rank in range(4):
        facts = json.loads((root / f"{framework}-fsdp" / "sparse" / f"facts-rank{rank}.json")
                           .read_text())  # fmt: skip
        assert facts["steps"] == 4 and facts["selected"] == facts["target"] > 0, facts


def test_the_strategy_is_that_of_the_imported_lightning_package(monkeypatch) -> None:
    """Each Trainer takes only its own package's strategies: the one imported decides."""
    bases = {package: pytest.importorskip(f"{package}.strategies").DDPStrategy
             for package in PACKAGES}  # fmt: skip
    lightning = importlib.import_module("microsparse.lightning")
    with pytest.raises(RuntimeError, match="both lightning.pytorch and pytorch_lightning .* use "
                       "microsparse.lightning.LightningSparseDDPStrategy"):  # fmt: skip
        lightning.SparseDDPStrategy(density=0.05)
    for package, other in zip(PACKAGES, reversed(PACKAGES)):
        with monkeypatch.context() as only:
            only.delitem(sys.modules, other)  # as in a program that imported one of them
            strategy = lightning.SparseDDPStrategy(density=0.05)
        assert isinstance(strategy, bases[package]) and not isinstance(strategy, bases[other])
        assert isinstance(strategy, lightning.SparseDDPStrategy)
        assert type(pickle.loads(pickle.dumps(strategy))) is type(strategy)  # spawn pickles it
    explicit = lightning.PyTorchLightningSparseDDPStrategy(density=0.05)  # both imported: fine
    assert isinstance(explicit, bases["pytorch_lightning"])
    assert isinstance(lightning.LightningSparseDDPStrategy(), bases["lightning.pytorch"])


def test_the_strategy_names_what_to_subclass_and_what_to_install(monkeypatch) -> None:
    lightning = importlib.import_module("microsparse.lightning")

    class Mine(lightning.SparseDDPStrategy):
        pass

    with pytest.raises(TypeError, match="subclass microsparse.lightning.LightningSparseDDP"):
        Mine()

    class Yours(lightning.LightningSparseDDPStrategy):
        pass

    assert Yours(density=0.05).lightning_package == "lightning.pytorch"
    for name in ("lightning", "pytorch_lightning"):
        monkeypatch.setitem(sys.modules, name, None)  # None: "not installed" to the importer
    monkeypatch.delitem(sys.modules, "microsparse.lightning")  # imported afresh
    with pytest.raises(ModuleNotFoundError, match=r"pip install microsparse\[frameworks\]"):
        importlib.import_module("microsparse.lightning")


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
