"""One Hugging Face Accelerate run on 4 ranks torchrun started, 2 replicas × 2 shards.

Accelerate's FSDP2 plugin does not run on CPU (docs/FRAMEWORKS.md), so the model is sharded by
hand over a (replicate, shard) mesh and ``accelerator.prepare`` takes the optimizer and the data
loader only (the loader split over all 4 ranks). Writes every rank's full parameters to
OUT/params-rank{r}.pt and its exchange's facts to OUT/facts-rank{r}.json. Modes: ``hybrid``
(fully_shard over the 2-D mesh: torch's hybrid sharding), ``dense`` (sparsify at density 1),
``sparse`` (density 0.01).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import microsparse


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True, choices=("hybrid", "dense", "sparse"))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    shard = mesh if args.mode == "hybrid" else mesh["shard"]
    for block in (model[0], model[2]):
        fully_shard(block, mesh=shard)
    fully_shard(model, mesh=shard)
    state = None
    if args.mode != "hybrid":
        density = 1.0 if args.mode == "dense" else 0.01
        state = microsparse.fsdp.sparsify(model, mesh["replicate"], density=density)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(128, 20, generator=generator),
                         torch.randint(0, 4, (128,), generator=generator))  # fmt: skip
    optimizer, loader = accelerator.prepare(optimizer, DataLoader(data, batch_size=8))
    for inputs, labels in loader:  # 4 steps: 128 samples, 4 ranks, batches of 8
        accelerator.backward(nn.functional.cross_entropy(model(inputs), labels))
        optimizer.step()
        optimizer.zero_grad()
    rank = accelerator.process_index
    params = [p.full_tensor().detach() for p in model.parameters()]  # collective
    out.mkdir(parents=True, exist_ok=True)
    torch.save(params, out / f"params-rank{rank}.pt")
    if state is not None:
        last = state.last_step
        facts = {"steps": state.step, "selected": last.selected, "target": last.target}
        (out / f"facts-rank{rank}.json").write_text(json.dumps(facts))
    accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a DeviceMesh on gloo can abort in the interpreter's teardown (docs/FSDP.md)


if __name__ == "__main__":
    main()
