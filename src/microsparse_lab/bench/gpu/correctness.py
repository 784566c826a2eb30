"""Correctness on the device: the same averaged gradients and residuals as on the CPU.

Every check returns a dict with ``ok`` and the rows it compared, so that a report can say
which sparsifier or option set differed.
"""

from __future__ import annotations

import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import microsparse.ddp as mddp
from microsparse import GradientReducer
from microsparse.comm import all_gather_flat
from microsparse_lab.training.launch import leave_process

REFERENCE = {"selection": "threshold", "threshold_rule": "as_coded",
             "partitioning": "contiguous", "index_message": "padded"}  # fmt: skip
"""MiCRO's option set closest to the authors' reference code."""
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("micro", {}),  # the compact wire
    ("micro", {"wire": "plain"}),
    ("micro", REFERENCE),
    ("micro", {"selection": "threshold"}),
    ("micro", {"value_dtype": torch.bfloat16}),
    ("micro", {"nonfinite": "raise"}),
    ("topk", {}), ("cltk", {}), ("hard_threshold", {}), ("sage", {"seed": 1}), ("deft", {}),
    ("dense", {}),
]  # fmt: skip
RANDOM_ON_DEVICE = {"sage"}
"""Sparsifiers that draw positions from the device's generator: on CUDA they draw others."""
TIMEOUT = timedelta(seconds=60)
"""How long a collective of the checks may wait for a peer before it fails (never hang)."""


def _params(device: torch.device) -> list[torch.Tensor]:
    shapes = [(300,), (40, 50), (7,), (2000,)]
    return [torch.zeros(s, dtype=torch.float64, device=device, requires_grad=True) for s in shapes]


def _gradients(step: int, rank: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    scales = (0.01, 1.0, 0.3, 2.0)
    return [torch.randn(p.shape, generator=generator, dtype=torch.float64) * scale
            for p, scale in zip(params, scales)]  # fmt: skip


def trace(name: str, options: dict[str, Any], device: torch.device, rank: int = 0,
          steps: int = 5) -> list[list[torch.Tensor]]:  # fmt: skip
    """Every step's averaged gradients and residual (CPU copies) of one sparsifier."""
    params = _params(device)
    options = dict(options)
    reducer_options = {key: options.pop(key) for key in ("value_dtype", "nonfinite")
                       if key in options}  # fmt: skip
    reducer = GradientReducer(params, name, 0.02, **reducer_options, **options)
    steps_seen = []
    for step in range(steps):
        for p, g in zip(params, _gradients(step, rank, params)):
            p.grad = g.to(device)
        reducer.synchronize()
        # clone: on the CPU .cpu() returns the live buffer, which the next step rewrites
        steps_seen.append([p.grad.detach().cpu().clone() for p in params]
                          + [reducer.residual.detach().cpu().clone()])  # fmt: skip
    return steps_seen


def same_as_cpu(device: torch.device) -> dict[str, Any]:
    """Every sparsifier and MiCRO option set gives the same results on ``device`` as on CPU.

    Sparsifiers in :data:`RANDOM_ON_DEVICE` are reported but may differ on CUDA.
    """
    rows = []
    for name, options in CONFIGS:
        cpu = trace(name, options, torch.device("cpu"))
        got = trace(name, options, device)
        equal = all(torch.equal(a, b) for step_a, step_b in zip(cpu, got)
                    for a, b in zip(step_a, step_b))  # fmt: skip
        must = not (name in RANDOM_ON_DEVICE and device.type == "cuda")
        rows.append({"sparsifier": name, "options": str(options), "equal": equal,
                     "must_equal": must})  # fmt: skip
    return {"ok": all(row["equal"] or not row["must_equal"] for row in rows), "rows": rows}


def process_group(device: torch.device) -> dict[str, Any]:
    """On NCCL (gloo for a CPU device), world size 1: loop API, hook = reducer, resume."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group(backend, init_method=f"file://{folder}/init", rank=0,
                                world_size=1, timeout=TIMEOUT)  # fmt: skip
        try:
            loop = same_as_cpu(device)
            hook = _hook_equals_reducer(device)
            resume = _resume_is_exact(device)
        finally:
            dist.destroy_process_group()
    ok = loop["ok"] and hook["equal"] and resume["equal"]
    return {"ok": ok, "backend": backend, "loop": loop, "hook": hook, "resume": resume}


def _hook_equals_reducer(device: torch.device) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    def net() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.ReLU(),
                                   torch.nn.Linear(40, 4)).double().to(device)  # fmt: skip

    hooked, plain = net(), net()
    ddp = DDP(hooked, bucket_cap_mb=100)
    state = mddp.SparseState("micro", 0.05)
    params = list(hooked.parameters())
    state.load_state_dict({  # pin the slab to the rebuilt bucket's order (see tests/test_ddp.py)
        **state.state_dict(), "rank": 0, "world_size": 1,
        "slabs": {"residuals": [torch.zeros(p.numel(), dtype=p.dtype) for p in params],
                  "slabs": [list(range(len(params) - 1, -1, -1))], "states": [{}]},
    })  # fmt: skip
    ddp.register_comm_hook(state, mddp.sparse_hook)
    reducer = GradientReducer(list(reversed(list(plain.parameters()))), "micro", 0.05)
    equal = True
    for step in range(5):
        x = torch.randn(6, 12, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
        for model in (ddp, plain):
            model.zero_grad()
            model(x.to(device)).pow(2).mean().backward()
        reducer.synchronize()
        equal &= all(torch.equal(a.grad, b.grad) for a, b in zip(hooked.parameters(),
                                                               plain.parameters()))  # fmt: skip
    return {"equal": bool(equal)}


def _resume_is_exact(device: torch.device) -> dict[str, Any]:
    def run(stop: int | None) -> list[torch.Tensor]:
        params = _params(device)
        reducer = GradientReducer(params, "micro", 0.02)
        for step in range(6):
            if step == stop:
                saved = reducer.state_dict()
                params = _params(device)
                reducer = GradientReducer(params, "micro", 0.02)
                reducer.load_state_dict(saved)
            for p, g in zip(params, _gradients(step, 0, params)):
                p.grad = g.to(device)
            reducer.synchronize()
        return [p.grad.cpu().clone() for p in params] + [reducer.residual.cpu().clone()]

    return {"equal": all(torch.equal(a, b) for a, b in zip(run(None), run(3)))}


def gloo_ranks(device: torch.device) -> dict[str, Any]:
    """2 gloo ranks with tensors on ``device`` give the same results as with CPU tensors."""
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_gloo_rank, args=(2, folder, device.type), nprocs=2)
        ranks = [torch.load(Path(folder, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    refused = sorted({kind for rank in ranks for kind in rank["refused"]})
    rows = ranks[0]["rows"]
    return {"ok": all(row["equal"] for row in rows), "rows": rows,
            "refused_by_gloo_on_cuda": refused}  # fmt: skip


def _gloo_rank(rank: int, world_size: int, folder: str, device_type: str) -> None:
    torch.set_num_threads(1)
    device = torch.device(device_type)
    dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank,
                            world_size=world_size, timeout=TIMEOUT)  # fmt: skip
    refused: list[str] = []
    for kind, work in (
        ("all_gather (flat)", lambda t: all_gather_flat(t.new_empty(world_size * t.numel()), t)),
        ("all_reduce", lambda t: dist.all_reduce(t)),
        ("broadcast", lambda t: dist.broadcast(t, 0)),
    ):  # fmt: skip
        try:
            work(torch.ones(4, device=device))
        except Exception as error:  # noqa: BLE001 - what gloo does not support is the finding
            refused.append(f"{kind}: {str(error).splitlines()[0][:200]}")
    rows = [_compared(name, options, device, rank) for name, options in
            [("micro", {}), ("micro", REFERENCE), ("topk", {}), ("cltk", {})]]  # fmt: skip
    # Users who ask torch for reproducible kernels must still be able to run the default.
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        rows.append(_compared("micro", {}, device, rank, "deterministic algorithms"))
    finally:
        torch.use_deterministic_algorithms(deterministic)
    dist.barrier()
    dist.destroy_process_group()
    torch.save({"refused": refused, "rows": rows}, Path(folder, f"rank{rank}.pt"))
    leave_process(0)  # gloo's threads can abort a finished rank's teardown


def _compared(name: str, options: dict[str, Any], device: torch.device, rank: int,
              mode: str = "") -> dict[str, Any]:  # fmt: skip
    """One sparsifier's steps on ``device`` against the same steps on CPU tensors."""
    row: dict[str, Any] = {"sparsifier": name, "options": str(options)}
    if mode:
        row["mode"] = mode
    try:
        got = trace(name, options, device, rank, steps=3)
        cpu = trace(name, options, torch.device("cpu"), rank, steps=3)
        row["equal"] = all(torch.allclose(a, b, rtol=1e-12, atol=0) for s, t in zip(cpu, got)
                           for a, b in zip(s, t))  # fmt: skip
    except Exception as error:  # noqa: BLE001 - reported per row, the others still run
        row.update(equal=False, error=str(error)[:300])
    return row
