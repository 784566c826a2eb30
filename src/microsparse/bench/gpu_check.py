"""``make gpu-check``: the CUDA and NCCL paths run for real, host syncs counted, GPU timings.

One prepared script for a machine with one GPU, within minutes, needing nothing but torch
(the package itself from ``src/``, no downloads)::

    PYTHONPATH=src python -m microsparse.bench.gpu_check --out "$OUT"

It writes ``gpu-check.json`` and ``gpu-check.md`` into ``--out`` (default ``$OUT``, else
``runs/gpu-check``) and exits 1 if a check failed. The checks:

1. **Same results on CUDA as on CPU** (world size 1, no process group): every sparsifier and
   MiCRO's option sets (float64 gradients, several steps): averaged gradients and residuals
   equal bit for bit. Then on NCCL (world size 1) the loop API and the DDP hook (one slab: the
   hook must equal the reducer bit for bit), and exact resume. Then 2 ranks of gloo with CUDA
   tensors on the one GPU, against the same run on CPU tensors; which collectives gloo refuses
   on CUDA tensors is recorded (and the runs they break reported as differing).
2. **Host synchronisations per step**, counted with ``torch.cuda.set_sync_debug_mode``: the
   loop API's ``synchronize()`` and the hook's step of one slab. Fails if more than
   :data:`EXPECTED_SYNCS` (what the code is known to do: see its comments).
3. **Timings** with CUDA events, medians after warm-up: MiCRO's selection (quotas, and the
   reference's compare at the same count) against ``torch.topk(|a|, k)`` at d = 11.2 M and
   100 M, n = 1, 4, 16, 64; the whole per-step overhead of both drivers in passes over d (one
   device-to-device copy of d floats as the unit).

``--device cpu`` runs the same code on the CPU (gloo for NCCL; the sync count, which needs
CUDA, is skipped and says so): the test suite uses it to keep the script working where there
is no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from microsparse import GradientReducer
from microsparse.bench.workload import RESNET18_NUMEL, calibrate, model_layout, synthetic_gradient
from microsparse.comm import all_gather_flat
from microsparse.comm.local import SymmetricPeers
from microsparse.engine import SparseOutput, SparseStep, run_blocking
from microsparse.feedback import ErrorFeedback
from microsparse.sparsifiers import create_sparsifier
from microsparse.sparsifiers.threshold import initial_threshold

REFERENCE = {"selection": "threshold", "threshold_rule": "as_coded",
             "partitioning": "contiguous", "index_message": "padded"}  # fmt: skip
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("micro", {}),
    ("micro", REFERENCE),
    ("micro", {"selection": "threshold"}),
    ("micro", {"value_dtype": torch.bfloat16}),
    ("micro", {"transactional": True}),
    ("topk", {}), ("cltk", {}), ("hard_threshold", {}), ("sage", {"seed": 1}), ("deft", {}),
    ("dense", {}),
]  # fmt: skip
EXPECTED_SYNCS = {
    # The loop API, MiCRO's default (quotas, fixed message), per synchronize(): the sampled
    # edge (.item), the two compares' nonzero (hit blocks, entries in them), the header and
    # counts of the index message (.tolist), the position list when some message is one
    # short (boolean indexing), the finiteness of the sum (bool), the threshold for the
    # statistics (.item).
    "loop": 8,
    # The same step on one slab, as the hook runs it.
    "hook": 8,
}
SIZES = (RESNET18_NUMEL, 100_000_000)
PARTITIONS = (1, 4, 16, 64)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m microsparse.bench.gpu_check")
    parser.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu-check")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; use --device cpu for a dry run", file=sys.stderr)
        return 2
    started = time.perf_counter()
    device = torch.device(args.device)
    result: dict[str, Any] = {"environment": _environment(device), "checks": []}
    sizes = (200_000,) if args.quick else SIZES
    for name, check in [
        ("same results as on CPU", lambda: _same_as_cpu(device)),
        ("NCCL (gloo on CPU), world size 1: loop, hook, resume", lambda: _process_group(device)),
        ("2 gloo ranks with device tensors", lambda: _gloo_ranks(device)),
        ("host syncs per step", lambda: _syncs(device, sizes[0])),
        ("timings", lambda: _timings(device, sizes, PARTITIONS)),
    ]:
        began = time.perf_counter()
        try:
            outcome = check()
        except Exception:  # noqa: BLE001 - one broken check must not hide the others
            outcome = {"ok": False, "error": traceback.format_exc()[-3000:]}
        outcome.update(name=name, seconds=round(time.perf_counter() - began, 1))
        result["checks"].append(outcome)
        print(f"{name}: {'ok' if outcome.get('ok', True) else 'FAILED'} "
              f"({outcome['seconds']} s)", flush=True)  # fmt: skip
    result["seconds"] = round(time.perf_counter() - started, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-check.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / "gpu-check.md").write_text(markdown(result) + "\n")
    print(markdown(result))
    return 0 if all(check.get("ok", True) for check in result["checks"]) else 1


def _environment(device: torch.device) -> dict[str, Any]:
    info = {"torch": torch.__version__, "python": sys.version.split()[0], "device": str(device)}
    if device.type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                    nccl=".".join(map(str, torch.cuda.nccl.version())))  # fmt: skip
    return info


# ---- 1. correctness ------------------------------------------------------------------------


def _params(device: torch.device) -> list[torch.Tensor]:
    shapes = [(300,), (40, 50), (7,), (2000,)]
    return [torch.zeros(s, dtype=torch.float64, device=device, requires_grad=True) for s in shapes]


def _gradients(step: int, rank: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    scales = (0.01, 1.0, 0.3, 2.0)
    return [torch.randn(p.shape, generator=generator, dtype=torch.float64) * scale
            for p, scale in zip(params, scales)]  # fmt: skip


def _trace(name: str, options: dict[str, Any], device: torch.device, rank: int = 0,
           steps: int = 5) -> list[list[torch.Tensor]]:  # fmt: skip
    params = _params(device)
    options = dict(options)
    reducer_options = {key: options.pop(key) for key in ("value_dtype", "transactional")
                       if key in options}  # fmt: skip
    reducer = GradientReducer(params, name, 0.02, **reducer_options, **options)
    trace = []
    for step in range(steps):
        for p, g in zip(params, _gradients(step, rank, params)):
            p.grad = g.to(device)
        reducer.synchronize()
        trace.append([p.grad.detach().cpu().clone() for p in params] + [reducer.residual.cpu()])
    return trace


def _same_as_cpu(device: torch.device) -> dict[str, Any]:
    rows = []
    for name, options in CONFIGS:
        cpu = _trace(name, options, torch.device("cpu"))
        got = _trace(name, options, device)
        equal = all(torch.equal(a, b) for step_a, step_b in zip(cpu, got)
                    for a, b in zip(step_a, step_b))  # fmt: skip
        rows.append({"sparsifier": name, "options": str(options), "equal": equal})
    return {"ok": all(row["equal"] for row in rows), "rows": rows}


def _process_group(device: torch.device) -> dict[str, Any]:
    backend = "nccl" if device.type == "cuda" else "gloo"  # the CPU dry run exercises the code
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group(backend, init_method=f"file://{folder}/init", rank=0,
                                world_size=1)  # fmt: skip
        try:
            loop = _same_as_cpu(device)
            hook = _hook_equals_reducer(device)
            resume = _resume_is_exact(device)
        finally:
            dist.destroy_process_group()
    ok = loop["ok"] and hook["equal"] and resume["equal"]
    return {"ok": ok, "backend": backend, "loop": loop, "hook": hook, "resume": resume}


def _hook_equals_reducer(device: torch.device) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import microsparse.ddp as mddp

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
        return [p.grad.cpu() for p in params] + [reducer.residual.cpu()]

    return {"equal": all(torch.equal(a, b) for a, b in zip(run(None), run(3)))}


def _gloo_ranks(device: torch.device) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_gloo_rank, args=(2, folder, device.type), nprocs=2)
        ranks = [torch.load(Path(folder, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    refused = sorted({kind for rank in ranks for kind in rank["refused"]})
    rows = ranks[0]["rows"]
    return {"ok": all(row.get("equal", True) for row in rows), "rows": rows,
            "refused_by_gloo_on_cuda": refused}  # fmt: skip


def _gloo_rank(rank: int, world_size: int, folder: str, device_type: str) -> None:
    device = torch.device(device_type)
    dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank,
                            world_size=world_size)  # fmt: skip
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
    rows = []
    for name, options in [("micro", {}), ("micro", REFERENCE), ("topk", {}), ("cltk", {})]:
        try:
            got = _trace(name, options, device, rank, steps=3)
            cpu = _trace(name, options, torch.device("cpu"), rank, steps=3)
            equal = all(torch.allclose(a, b, rtol=1e-12, atol=0) for s, t in zip(cpu, got)
                        for a, b in zip(s, t))  # fmt: skip
            rows.append({"sparsifier": name, "options": str(options), "equal": equal})
        except Exception as error:  # noqa: BLE001
            rows.append({"sparsifier": name, "options": str(options), "equal": False,
                         "error": str(error)[:300]})  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()
    torch.save({"refused": refused, "rows": rows}, Path(folder, f"rank{rank}.pt"))


# ---- 2. host syncs --------------------------------------------------------------------------


def _syncs(device: torch.device, numel: int) -> dict[str, Any]:
    if device.type != "cuda":
        return {"skipped": "needs CUDA"}
    layout = model_layout(numel)
    gradient = synthetic_gradient(layout, torch.Generator().manual_seed(0), device)
    params = [torch.nn.Parameter(torch.zeros(s, device=device)) for s in layout.shapes]
    fresh = [g.view(s).clone() for g, s in zip(gradient.split(list(layout.sizes)), layout.shapes)]
    reducer = GradientReducer(params, "micro", 0.001, collectives=SymmetricPeers(0, 16))

    def loop() -> None:
        for p, g in zip(params, fresh):
            p.grad = g
        reducer.synchronize()

    engine, bucket, output = _slab_step(layout, device, 16)

    def hook() -> None:
        bucket.copy_(gradient)
        run_blocking(engine.run(0, bucket, output), SymmetricPeers(0, 16))

    counts = {"loop": _count_syncs(loop), "hook": _count_syncs(hook)}
    ok = all(counts[name] <= EXPECTED_SYNCS[name] for name in counts)
    return {"ok": ok, "counts": counts, "expected_at_most": EXPECTED_SYNCS}


def _count_syncs(step: Callable[[], None]) -> int:
    step()  # warm-up: buffers, first-use allocations
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _slab_step(layout: Any, device: torch.device, n: int) -> tuple[SparseStep, Any, Any]:
    sparsifier = create_sparsifier("micro", 0.001)
    sparsifier.bind(layout, 0, n)
    engine = SparseStep(sparsifier, ErrorFeedback(layout, torch.float32, device))
    bucket = torch.empty(layout.numel, device=device)
    return engine, bucket, SparseOutput(torch.zeros(layout.numel, device=device))


# ---- 3. timings -----------------------------------------------------------------------------


def _timings(device: torch.device, sizes: tuple[int, ...], partitions: tuple[int, ...]) -> dict:
    return {"rows": [row for numel in sizes for row in _timings_at(numel, device, partitions)]}


def _timings_at(numel: int, device: torch.device, partitions: tuple[int, ...]) -> list[dict]:
    layout = model_layout(numel)
    gradient = synthetic_gradient(layout, torch.Generator().manual_seed(0), device)
    target = max(1, int(0.001 * numel))
    calibrate(gradient, 0.001, initial_threshold(target))
    scratch = torch.empty_like(gradient)
    unit = _median_ms(lambda: scratch.copy_(gradient), device)
    topk = _median_ms(lambda: torch.topk(torch.abs(gradient, out=scratch), target), device)
    rows = []
    for n in partitions:
        quota = create_sparsifier("micro", 0.001)
        quota.bind(layout, 0, n)
        reference = create_sparsifier("micro", 0.001, **REFERENCE)
        reference.bind(layout, 0, n)
        start, end = reference.partition(0)
        owned = gradient[start:end].abs()
        reference.settle(torch.topk(owned, min(quota.quota(0), owned.numel())).values[-1].item())
        row = {
            "numel": numel, "world_size": n, "copy_ms": unit, "topk_ms": topk,
            "quota_select_ms": _median_ms(lambda: quota.select(gradient, 0), device),  # noqa: B023
            "reference_select_ms": _median_ms(
                lambda: reference.select(gradient, 0), device  # noqa: B023
            ),
            "hook_step_ms": _hook_step_ms(layout, gradient, device, n),
        }  # fmt: skip
        row["quota_per_topk"] = row["quota_select_ms"] / topk
        row["hook_step_passes"] = row["hook_step_ms"] / unit
        rows.append(row)
    return rows


def _hook_step_ms(layout: Any, gradient: torch.Tensor, device: torch.device, n: int) -> float:
    engine, bucket, output = _slab_step(layout, device, n)
    peers = SymmetricPeers(0, n)

    def step() -> None:
        run_blocking(engine.run(0, bucket, output), peers)

    return _median_ms(step, device, setup=lambda: bucket.copy_(gradient))


def _median_ms(work: Callable[[], Any], device: torch.device, repeats: int = 21,
               setup: Callable[[], Any] | None = None) -> float:  # fmt: skip
    samples = []
    for index in range(repeats + 3):
        if setup is not None:
            setup()
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            work()
            end.record()
            torch.cuda.synchronize()
            elapsed = begin.elapsed_time(end)
        else:
            started = time.perf_counter()
            work()
            elapsed = 1e3 * (time.perf_counter() - started)
        if index >= 3:
            samples.append(elapsed)
    return statistics.median(samples)


def markdown(result: dict[str, Any]) -> str:
    """The checks as a list, the timings as a table."""
    env = result["environment"]
    lines = [f"Device check: {', '.join(f'{k} {v}' for k, v in env.items())}; "
             f"{result['seconds']} s.", ""]  # fmt: skip
    for check in result["checks"]:
        state = "skipped: " + check["skipped"] if "skipped" in check else (
            "ok" if check.get("ok", True) else "FAILED")  # fmt: skip
        lines.append(f"- {check['name']}: {state}")
        if "counts" in check:
            lines.append(f"  - syncs per step {check['counts']} (at most "
                         f"{check['expected_at_most']})")  # fmt: skip
        if check.get("refused_by_gloo_on_cuda"):
            lines.append(f"  - gloo refused on CUDA tensors: {check['refused_by_gloo_on_cuda']}")
        for row in check.get("rows", []):
            if row.get("equal") is False:
                lines.append(f"  - differs: {row['sparsifier']} {row['options']}")
        if "error" in check:
            lines.append("  - " + check["error"].strip().splitlines()[-1])
    timings = next((c for c in result["checks"] if c["name"] == "timings"), {})
    if timings.get("rows"):
        lines += ["", "| d | n | quota selection ms | × topk | reference compare ms | hook step "
                  "(d2d copies) |", "|---|---|---|---|---|---|"]  # fmt: skip
        for row in timings["rows"]:
            lines.append(
                f"| {row['numel']:,} | {row['world_size']} | {row['quota_select_ms']:.4g} | "
                f"{row['quota_per_topk']:.3g} | {row['reference_select_ms']:.4g} | "
                f"{row['hook_step_passes']:.3g} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
