"""torch.compile with each integration, on real gloo ranks, with inductor (the default backend).

What a user compiles: the model that DDP then wraps (the hook runs on DDP's buckets as without
compile), a whole training step that calls ``GradientReducer.synchronize()`` (which runs
eagerly inside it: a graph break of its own), and the blocks of a model sharded by FSDP2. The
loop and FSDP2 must train as their eager runs do (to the last bits of inductor's own kernels);
the hook must conserve error feedback; the sparse step must have run every step and sent k
entries, the replicas must stay identical, and nothing may compile again after the first steps.
"""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import microsparse
from distributed import run_ranks
from microsparse import GradientReducer
from microsparse.ddp import SparseState, sparse_hook

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="inductor compiles C++ on the CPU: needs a C++ compiler",
)
STEPS = 5


def mlp(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 10))  # fmt: skip


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(16, 32, generator=generator)
    return x, torch.randint(0, 10, (16,), generator=generator)


def graphs() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["stats"].values())


def run(integration: str, compiled: bool, rank: int) -> dict:
    torch._dynamo.reset()
    if integration == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = mlp(32)
        for number, layer in enumerate(model):
            if isinstance(layer, nn.Linear):
                if compiled:  # each block compiled, then sharded (as torchtitan does)
                    model[number] = layer = torch.compile(layer)
                fully_shard(layer, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        state = microsparse.fsdp.sparsify(model, mesh["replicate"], density=0.05)
    else:
        model = mlp(64)
        state = GradientReducer(model.named_parameters(), "micro", 0.05)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if isinstance(state, GradientReducer):
            state.synchronize()
        optimizer.step()

    if integration == "loop" and compiled:  # the whole step, the exchange inside it
        step = torch.compile(step)
    start = torch.cat([_local(p).reshape(-1) for p in model.parameters()])
    sent, settled = [], 0
    for number in range(STEPS):
        step(*batch(number, rank))
        stats = state.last_step
        sent.append((stats.selected, stats.target))
        if number == 1:
            settled = graphs()
    flat = torch.cat([_local(p).reshape(-1) for p in model.parameters()])
    return {"params": flat, "start": start, "sent": sent, "steps": state.step,
            "compiled": settled, "recompiled": graphs() - settled}  # fmt: skip


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local().detach() if hasattr(p, "to_local") else p.detach()


def worker(rank: int, n: int, integration: str) -> dict:
    eager, compiled = run(integration, False, rank), run(integration, True, rank)
    rows = [torch.empty_like(compiled["params"]) for _ in range(n)]
    dist.all_gather(rows, compiled["params"])
    compiled["replicas"] = rows
    return {"eager": eager, "compiled": compiled}


@pytest.mark.parametrize(("integration", "ranks"), [("loop", 2), ("fsdp", 4)])
def test_a_compiled_model_trains_as_the_eager_one(integration, ranks, tmp_path) -> None:
    for rank, result in enumerate(run_ranks(worker, ranks, tmp_path, integration)):
        eager, compiled = result["eager"], result["compiled"]
        assert compiled["steps"] == eager["steps"] == STEPS
        assert compiled["sent"] == eager["sent"]
        assert all(selected == target for selected, target in compiled["sent"])
        torch.testing.assert_close(compiled["params"], eager["params"], rtol=1e-5, atol=1e-6)
        assert not torch.equal(eager["params"], eager["start"])  # it trained
        # every replica of this rank's shard (or of the whole model) holds the same weights
        rows = compiled["replicas"]
        replicas = [rows[r] for r in range(len(rows)) if r % 2 == rank % 2] if ranks == 4 else rows
        assert all(torch.equal(row, replicas[0]) for row in replicas)
        assert compiled["compiled"] > 0 and compiled["recompiled"] == 0  # once, not each step


def ddp_worker(rank: int, n: int) -> dict:
    """DDP(torch.compile(model)) with the hook: each pass's local gradients (what the buckets
    held before the hook), residuals and averages. (On this torch, torch.compile(ddp) and
    model.compile() under DDP capture no graph: they run eagerly and would test nothing.)"""
    torch._dynamo.reset()
    model = mlp(512)  # 2.1 MB of gradients in 1 MB buckets: several buckets, several slabs
    state = SparseState("micro", 0.01, wire="plain")
    ddp = DistributedDataParallel(torch.compile(model), bucket_cap_mb=1)
    params = list(model.parameters())
    local: dict[int, torch.Tensor] = {}

    def watching_hook(state, bucket):  # unannotated: DDP checks annotations as objects
        offset = 0
        for p in bucket.parameters():
            local[id(p)] = bucket.buffer()[offset : offset + p.numel()].double().clone()
            offset += p.numel()
        return sparse_hook(state, bucket)

    ddp.register_comm_hook(state, watching_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    passes, settled = [], 0
    for number in range(STEPS):
        before = [state.residual(p).double().clone() if number else torch.zeros(p.numel(),
                  dtype=torch.float64) for p in params]  # fmt: skip
        optimizer.zero_grad()
        x, y = batch(number, rank)
        nn.functional.cross_entropy(ddp(x), y).backward()
        passes.append({
            "had": torch.cat([local[id(p)] + e for p, e in zip(params, before)]),
            "kept": torch.cat([state.residual(p).double() for p in params]),
            "average": torch.cat([p.grad.reshape(-1).double() for p in params]),
            "sent": (state.last_step.selected, state.last_step.target),
        })  # fmt: skip
        optimizer.step()
        if number == 1:
            settled = graphs()
    return {"passes": passes, "compiled": settled, "recompiled": graphs() - settled}


def test_the_hook_on_a_compiled_ddp_model_conserves_and_sends_k(tmp_path) -> None:
    """A compiled backward hands DDP its gradients in another order (its buckets after the
    rebuild differ from eager's, so its selections do too): held to the invariants instead."""
    ranks = run_ranks(ddp_worker, 2, tmp_path)
    for result in ranks:
        assert result["compiled"] > 0 and result["recompiled"] == 0
    for step in range(STEPS):
        passes = [rank["passes"][step] for rank in ranks]
        average = passes[0]["average"]
        assert torch.equal(passes[1]["average"], average)  # every rank the same average
        selected, target = passes[0]["sent"]
        assert selected == target == int((average != 0).sum()), step
        # Conservation of error feedback: Σ_r (g_r + e_r before) = n · average + Σ_r e_r after
        had = sum(p["had"] for p in passes)
        kept = sum(p["kept"] for p in passes)
        torch.testing.assert_close(had, 2 * average + kept, rtol=1e-6, atol=1e-7)
