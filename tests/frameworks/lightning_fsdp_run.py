"""One Lightning ``ModelParallelStrategy`` run on 4 ranks torchrun started, 2 replicas × 2 shards.

``configure_model`` builds a (replicate, shard) mesh of its own (Lightning's is (data_parallel,
tensor_parallel); its sampler splits the data over ``data_parallel``, here all 4 ranks, as
hybrid sharding needs). Writes every rank's full parameters to OUT/params-rank{r}.pt and its
exchange's facts to OUT/facts-rank{r}.json. Modes: ``hybrid`` (fully_shard over the 2-D mesh:
torch's hybrid sharding), ``dense`` (sparsify at density 1), ``sparse`` (density 0.01).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils.data import DataLoader, TensorDataset

import microsparse

STEPS = 4  # 128 samples, 4 ranks, batches of 8: one epoch

parser = argparse.ArgumentParser()
parser.add_argument("--mode", required=True, choices=("hybrid", "dense", "sparse"))
parser.add_argument("--out", required=True)
ARGS = parser.parse_args()


class Net(pl.LightningModule):
    def __init__(self, mode: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
        self.mode = mode
        self.sparse: microsparse.fsdp.ShardedState | None = None

    def configure_model(self) -> None:
        if isinstance(self.net, FSDPModule):  # Lightning may call it again
            return
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        shard = mesh if self.mode == "hybrid" else mesh["shard"]
        for block in (self.net[0], self.net[2]):
            fully_shard(block, mesh=shard)
        fully_shard(self.net, mesh=shard)
        if self.mode != "hybrid":
            density = 1.0 if self.mode == "dense" else 0.01
            self.sparse = microsparse.fsdp.sparsify(self.net, mesh["replicate"], density=density)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        inputs, labels = batch
        return nn.functional.cross_entropy(self.net(inputs), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(args: argparse.Namespace) -> None:
    out = Path(args.out)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(128, 20, generator=generator),
                         torch.randint(0, 4, (128,), generator=generator))  # fmt: skip
    strategy = ModelParallelStrategy(data_parallel_size=4, tensor_parallel_size=1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = Net(args.mode)
    trainer.fit(model, DataLoader(data, batch_size=8))
    rank = trainer.global_rank
    params = [p.full_tensor().detach() for p in model.net.parameters()]  # collective
    out.mkdir(parents=True, exist_ok=True)
    torch.save(params, out / f"params-rank{rank}.pt")
    if model.sparse is not None:
        last = model.sparse.last_step
        facts = {"steps": model.sparse.step, "selected": last.selected, "target": last.target}
        (out / f"facts-rank{rank}.json").write_text(json.dumps(facts))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a DeviceMesh on gloo can abort in the interpreter's teardown (docs/FSDP.md)


if __name__ == "__main__":
    main(ARGS)
