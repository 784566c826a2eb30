"""Faults a long run meets: a worker killed under torchrun, a stuck peer, a crash while
checkpointing, damaged checkpoint files. Real processes, real signals, real files."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from microsparse.training import checkpoint
from microsparse.training.checkpoint import CheckpointError, checkpoint_dir, read_meta, read_part
from microsparse.training.config import TrainConfig, resume_config

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
        "-m", "microsparse", "train", "--max-steps", "24", "--checkpoint-every", "4",
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
    restarted = _elastic_run(broken, kill_after=10)
    assert "exitcode: -9" in restarted  # a worker really died and torchrun restarted the job
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
