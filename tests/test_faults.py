"""Faults a long run meets: a worker killed under torchrun, a stuck peer, a crash while
checkpointing, damaged checkpoint files. Real processes, real signals, real files."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import microsparse.ddp as mddp
from distributed import run_ranks
from microsparse import GradientReducer, NonFiniteGradientError
from microsparse_lab.training import checkpoint
from microsparse_lab.training.checkpoint import (
    CheckpointError,
    checkpoint_dir,
    read_meta,
    read_part,
)
from microsparse_lab.training.config import TrainConfig, resume_config

BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _wait_for(condition, seconds: float) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def _steps_done(out: Path) -> int:
    try:
        return sum(1 for _ in open(out / "metrics.jsonl"))
    except FileNotFoundError:
        return 0


def _children(pid: int) -> list[int]:
    listed = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(child) for child in listed.split()]


def _elastic_run(out: Path, kill_after: int | None) -> str:
    """``torchrun --max-restarts 2`` of one command line; optionally SIGKILL rank 1 once
    a checkpoint exists and ``kill_after`` steps are logged. Returns torchrun's stderr."""
    command = [
        str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
        "-m", "microsparse_lab", "train", "--max-steps", "24", "--checkpoint-every", "4",
        "--resume", str(out), "--no-progress",
    ]  # fmt: skip
    agent = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=ENV)  # fmt: skip
    try:
        if kill_after is not None:
            assert _wait_for(
                lambda: (out / "checkpoint" / "meta.json").is_file()
                and _steps_done(out) >= kill_after,
                120,
            ), "the run did not get going"
            os.kill(_children(agent.pid)[-1], signal.SIGKILL)
        _, stderr = agent.communicate(timeout=300)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 0, stderr[-2000:]
    return stderr


@pytest.mark.skipif(shutil.which("pgrep") is None, reason="needs pgrep")
def test_a_worker_killed_under_torchrun_resumes_exactly(tmp_path) -> None:
    """The same command line starts the run and, after a worker is killed, restarts it from its
    last checkpoint: every step logged once, in order, and the same final model."""
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    first = _elastic_run(whole, kill_after=None)
    assert "no checkpoint in" in first and "starting a fresh run" in first
    assert "leaked semaphore" not in first, first[-2000:]
    restarted = _elastic_run(broken, kill_after=10)
    # A worker really died and torchrun restarted the job. torchrun names the first failed
    # worker it finds: rank 1 (SIGKILL, -9) or rank 0, which reports the lost peer and exits
    # with 1 (or, were its teardown to abort after all, -6).
    assert re.search(r"failed \(exitcode: (-9|-6|1)\) local_rank: [01]", restarted), (
        restarted[-2000:]
    )
    steps = [json.loads(line)["step"] for line in open(broken / "metrics.jsonl")]
    assert steps == list(range(24))
    expected = read_part(whole / "checkpoint" / "shared.pt")["model"]
    got = read_part(broken / "checkpoint" / "shared.pt")["model"]
    assert all(torch.equal(expected[name], got[name]) for name in expected)


@pytest.mark.skipif(shutil.which("pgrep") is None, reason="needs pgrep")
def test_a_stopped_peer_ends_the_job_within_the_timeout(tmp_path) -> None:
    out = tmp_path / "run"
    command = [str(BIN / "microsparse"), "train", "--workers", "2", "--max-steps", "2000",
               "--timeout", "4", "--no-progress", "--out", str(out)]  # fmt: skip
    job = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        assert _wait_for(lambda: _steps_done(out) >= 3, 120), "the run did not get going"
        workers = [pid for pid in _children(job.pid)
                   if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]  # fmt: skip
        assert len(workers) == 2
        os.kill(workers[-1], signal.SIGSTOP)
        stopped = time.time()
        _, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 1
    assert time.time() - stopped < 60
    assert "within --timeout 4 s: it is stopped, hung or gone" in stderr, stderr[-2000:]
    assert all(not Path(f"/proc/{pid}").exists() for pid in workers)  # nothing left behind


# ---- atomic checkpoints -----------------------------------------------------------------


def _complete(directory: Path, step: int) -> None:
    directory.mkdir(parents=True)
    torch.save({"step": step}, directory / "shared.pt")
    torch.save({"step": step}, directory / "rank0.pt")
    (directory / "meta.json").write_text(
        json.dumps({"step": step, "world_size": 1, "config": {}})
    )


@pytest.mark.parametrize("crash_at", range(4))
def test_a_crash_anywhere_in_the_swap_leaves_a_checkpoint(crash_at, tmp_path, monkeypatch):
    """Checkpoint 1 exists, checkpoint 2 is complete in checkpoint.new; the swap dies after
    ``crash_at`` of its file operations. What is found must be complete: 1 or 2."""
    _complete(tmp_path / "checkpoint", 1)
    _complete(tmp_path / "checkpoint.new", 2)
    done = []

    def dying(real):
        def operation(*args, **kwargs):
            if len(done) == crash_at:
                raise OSError("power cut")
            done.append(real.__name__)
            return real(*args, **kwargs)

        return operation

    monkeypatch.setattr(checkpoint.shutil, "rmtree", dying(shutil.rmtree))
    monkeypatch.setattr(Path, "rename", dying(Path.rename))
    with pytest.raises(OSError, match="power cut"):
        checkpoint.swap_in(tmp_path / "checkpoint")
    monkeypatch.undo()
    found = checkpoint_dir(tmp_path)
    assert found is not None
    step = read_meta(tmp_path)["step"]
    assert step in (1, 2)
    assert read_part(found / "shared.pt")["step"] == read_part(found / "rank0.pt")["step"] == step


def test_an_unfinished_new_checkpoint_is_never_taken(tmp_path) -> None:
    _complete(tmp_path / "checkpoint", 1)
    (tmp_path / "checkpoint.new").mkdir()
    torch.save({"step": 2}, tmp_path / "checkpoint.new" / "shared.pt")  # no meta.json yet
    assert checkpoint_dir(tmp_path) == tmp_path / "checkpoint"


def test_damaged_files_are_named_with_the_fix(tmp_path) -> None:
    _complete(tmp_path / "checkpoint", 1)
    shared = tmp_path / "checkpoint" / "shared.pt"
    shared.write_bytes(shared.read_bytes()[:20])  # truncated
    with pytest.raises(CheckpointError, match=rf"{shared} cannot be read .* delete "):
        read_part(shared)
    meta = tmp_path / "checkpoint" / "meta.json"
    meta.write_text('{"step": 1, "wor')
    with pytest.raises(CheckpointError, match=rf"{meta} cannot be read"):
        read_meta(tmp_path)


def test_resuming_keeps_the_saved_stop_unless_told_otherwise() -> None:
    saved = {"task": "mnist", "max_steps": 40}
    assert resume_config(saved, {}, "runs/x").max_steps == 40
    assert resume_config(saved, {"max_steps": 60}, "runs/x").max_steps == 60
    assert resume_config(saved, {"timeout": 30.0}, "runs/x").timeout == 30.0
    assert TrainConfig().timeout is None


# ---- non-finite steps that can be skipped ---------------------------------------------------


def _skip_worker(
    rank: int, n: int, skip_at: int | None, nonfinite: str, sparsifier: str = "micro",
    options: dict | None = None,
) -> list[dict]:
    """Six steps of made-up gradients; at ``skip_at`` rank 0's gradient has an Inf in the
    smallest entries (where no selection would look). ``skip_at=None`` leaves that step out."""
    params = [torch.zeros(600, requires_grad=True), torch.zeros(40, 10, requires_grad=True)]
    reducer = GradientReducer(params, sparsifier, 0.02, nonfinite=nonfinite, **(options or {}))
    records = []
    for step in range(6):
        if skip_at is None and step == 2:
            continue
        generator = torch.Generator().manual_seed(10 * step + rank)
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        if step == skip_at and rank == 0:
            params[0].grad[17] = math.inf
        try:
            stats = reducer.synchronize()
            raised, skipped = False, stats.skipped
        except NonFiniteGradientError as error:
            raised, skipped = str(error).startswith(f"step {step}: NaN or Inf gradient"), None
        records.append({
            "raised": raised,
            "skipped": skipped,
            "grads": [p.grad.clone() for p in params],
            "residual": reducer.residual.clone(),
            "step": reducer.step,
        })  # fmt: skip
    return records


def test_a_raised_step_leaves_no_trace(tmp_path) -> None:
    """With nonfinite="raise" an Inf anywhere on one rank raises on every rank in that step
    and leaves the state as if the step had never been taken; p.grad is left as it was."""
    skipped = run_ranks(_skip_worker, 2, tmp_path / "a", 2, "raise")
    never = run_ranks(_skip_worker, 2, tmp_path / "b", None, "raise")
    for rank in range(2):
        assert [r["raised"] for r in skipped[rank]] == [False, False, True, False, False, False]
        assert torch.isinf(skipped[rank][2]["grads"][0]).any() == (rank == 0)  # untouched
        assert skipped[rank][2]["step"] == 2  # not counted
        assert torch.equal(skipped[rank][2]["residual"], skipped[rank][1]["residual"])
        after = skipped[rank][:2] + skipped[rank][3:]
        for got, want in zip(after, never[rank]):
            assert torch.equal(got["residual"], want["residual"])
            assert all(torch.equal(a, b) for a, b in zip(got["grads"], want["grads"]))


def test_a_skipped_step_keeps_every_residual_without_a_host_read(tmp_path) -> None:
    """By default the step with an Inf on rank 0 is skipped on every rank on the device: no
    residual changes, the average is NaN where it would be (the same positions everywhere),
    the statistics say so, and the next steps train on."""
    ranks = run_ranks(_skip_worker, 2, tmp_path, 2, "skip")
    for records in ranks:
        assert [r["skipped"] for r in records] == [False, False, True, False, False, False]
        assert torch.equal(records[2]["residual"], records[1]["residual"])
        assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
        assert all(torch.isfinite(g).all() for r in records[3:] for g in r["grads"])
    nan = [torch.cat([g.isnan().flatten() for g in records[2]["grads"]]) for records in ranks]
    assert torch.equal(nan[0], nan[1]) and int(nan[0].sum()) == 20  # k = ⌊0.02 · 1000⌋


def test_top_ks_fixed_wire_skips_on_the_device_too(tmp_path) -> None:
    """Top-k's fixed union has every size known, so its guard's verdict stays on the device as
    MiCRO's does: the step with an Inf on rank 0 changes no residual, and the average is NaN
    at the union's positions, the same on every rank."""
    ranks = run_ranks(_skip_worker, 2, tmp_path, 2, "skip", "topk", {"wire": "fixed"})
    for records in ranks:
        assert [r["skipped"] for r in records] == [False, False, True, False, False, False]
        assert torch.equal(records[2]["residual"], records[1]["residual"])
        assert all(torch.isfinite(g).all() for r in records[3:] for g in r["grads"])
    nan = [torch.cat([g.isnan().flatten() for g in records[2]["grads"]]) for records in ranks]
    assert torch.equal(nan[0], nan[1]) and 20 <= int(nan[0].sum()) <= 40  # the union of 2 · k


def _scaler_worker(rank: int, n: int, integration: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
    if integration.startswith("ddp"):
        one = integration == "ddp-one-exchange"  # over several buckets, each poisoned
        trained = DDP(model, bucket_cap_mb=0.001 if one else 25)
        trained.register_comm_hook(
            mddp.MicroState(density=0.05, grad_scaler=scaler, one_exchange=one), mddp.micro_hook
        )
        reducer = None
    else:
        trained = model
        reducer = GradientReducer(model, "micro", 0.05, grad_scaler=scaler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    scales, moved = [], []
    for step in range(10):
        optimizer.zero_grad()
        x = torch.randn(8, 16, generator=generator)
        if step == 4 and rank == 1:
            x *= 3e37  # the scaled loss overflows on this rank only
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(trained(x).pow(2).mean()).backward()
        if reducer is not None:
            reducer.synchronize()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        moved.append(any(not torch.equal(a, b) for a, b in zip(before, model.parameters())))
    return {"scales": scales, "moved": moved, "params": [p.detach() for p in model.parameters()]}


@pytest.mark.parametrize("integration", ["loop", "ddp", "ddp-one-exchange"])
def test_grad_scaler_skips_an_overflow_on_every_rank_and_training_goes_on(integration, tmp_path):
    first, second = run_ranks(_scaler_worker, 2, tmp_path, integration)
    for result in (first, second):
        assert result["moved"][4] is False  # the overflowing step changed nothing, anywhere
        assert all(result["moved"][:4]) and all(result["moved"][5:])
        assert result["scales"][4] == result["scales"][3] / 2  # the scaler backed off
    assert first["scales"] == second["scales"]
    for a, b in zip(first["params"], second["params"]):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_the_residual_holds_unscaled_gradients_whatever_the_scale() -> None:
    """The residual keeps gradients in their own units, so that a change of the scaler's scale
    needs no pass over it; the average is written in the scaler's units."""
    param = torch.zeros(1000, requires_grad=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    scaler.scale(torch.ones(()))  # the scaler makes its scale tensor lazily
    reducer = GradientReducer([param], "micro", 0.01, grad_scaler=scaler, wire="plain")  # exact
    gradient = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    param.grad = gradient * 256
    reducer.synchronize()
    sent = param.grad != 0
    assert torch.equal(param.grad[sent], gradient[sent] * 256)  # scaled, as the scaler expects
    assert torch.equal(reducer.residual[~sent], gradient[~sent])  # unscaled
    before = reducer.residual.clone()
    scaler.update(new_scale=1024.0)
    param.grad = torch.zeros(1000)
    reducer.synchronize()
    kept = reducer.residual != 0
    assert int(kept.sum()) == 1000 - 20  # the 10 sent in each step are gone
    assert torch.equal(reducer.residual[kept], before[kept])


def _hook_skip_worker(rank: int, n: int, skip_at: int | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    ddp = DDP(model, bucket_cap_mb=0.001)  # several slabs, rolled back together
    state = mddp.MicroState(density=0.05, nonfinite="raise")
    ddp.register_comm_hook(state, mddp.micro_hook)
    residuals = []
    for step in range(6):
        if skip_at is None and step == 2:
            continue
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        if step == skip_at and rank == 1:
            x[0, 0] = math.inf
        model.zero_grad()
        try:
            ddp(x).pow(2).mean().backward()
        except NonFiniteGradientError:
            assert step == skip_at and state.step == 2
        residuals.append(torch.cat([state.residual(p) for p in model.parameters()]).clone())
    return residuals


def test_a_hook_pass_that_raises_leaves_no_trace(tmp_path) -> None:
    skipped = run_ranks(_hook_skip_worker, 2, tmp_path / "a", 2)
    never = run_ranks(_hook_skip_worker, 2, tmp_path / "b", None)
    for rank in range(2):
        assert torch.equal(skipped[rank][2], skipped[rank][1])  # the failed pass left nothing
        after = skipped[rank][:2] + skipped[rank][3:]
        assert all(torch.equal(a, b) for a, b in zip(after, never[rank]))
