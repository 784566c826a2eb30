"""One PyTorch Lightning run on the ranks torchrun started (``tests/test_frameworks.py``).

Writes every rank's final parameters to OUT/params-rank{r}.pt and rank 0's hook facts to
OUT/facts.json. Modes: ``sparse`` (SparseDDPStrategy, a checkpoint every 4 steps), ``resume``
(the same, from OUT's step-4 checkpoint), ``plain`` (stock DDP), ``accumulate`` (2 batches per
step), ``bf16`` (bf16-true precision), ``manual`` (manual optimisation with a GradientReducer)
and ``manual-resume`` (the same, from the manual run's step-4 checkpoint). ``--package`` is the
Lightning package the run imports, ``pytorch_lightning`` or ``lightning.pytorch``; the script
imports no other, so ``SparseDDPStrategy`` is the strategy of that package.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from microsparse import EveryRank, GradientReducer
from microsparse.lightning import SparseDDPStrategy

STEPS = 8  # two epochs of 4 steps: 128 samples, 2 ranks, batches of 16

parser = argparse.ArgumentParser()
parser.add_argument("--mode", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--package", default="pytorch_lightning")
ARGS = parser.parse_args()
pl = importlib.import_module(ARGS.package)  # before the LightningModule below subclasses it
ModelCheckpoint = importlib.import_module(f"{ARGS.package}.callbacks").ModelCheckpoint
CSVLogger = importlib.import_module(f"{ARGS.package}.loggers").CSVLogger


class Net(pl.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
        self.automatic_optimization = not manual
        self.reducer: GradientReducer | None = None
        self._loaded: dict | None = None

    def setup(self, stage: str) -> None:
        if not self.automatic_optimization:  # after the process group exists
            self.reducer = GradientReducer(self.net, "micro", 0.05)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        inputs, labels = batch
        loss = nn.functional.cross_entropy(self.net(inputs).float(), labels)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        with self.trainer.model.no_sync():  # DDP must not average: the reducer does
            self.manual_backward(loss)
        self.reducer.synchronize()
        optimizer.step()
        return loss

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self.reducer is not None:
            checkpoint["reducer"] = EveryRank(self.reducer).state_dict()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self._loaded = checkpoint.get("reducer")

    def on_train_start(self) -> None:  # a resume has restored the checkpoint by now
        if self._loaded is not None:
            EveryRank(self.reducer).load_state_dict(self._loaded)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(128, 20, generator=generator)
    labels = torch.randint(0, 4, (128,), generator=generator)
    return DataLoader(TensorDataset(inputs, labels), batch_size=16)


def main(args: argparse.Namespace) -> None:
    out = Path(args.out)
    strategy: object = SparseDDPStrategy(density=0.05)
    options: dict = {}
    if args.mode in ("plain", "manual", "manual-resume"):
        strategy = "ddp"
    if args.mode == "accumulate":
        options["accumulate_grad_batches"] = 2
    if args.mode == "bf16":
        options["precision"] = "bf16-true"
    checkpoints = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=4, save_top_k=-1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, max_epochs=-1,
        callbacks=[checkpoints], logger=CSVLogger(out), log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False, **options,
    )  # fmt: skip
    model = Net(manual=args.mode.startswith("manual"))
    resume = None
    if args.mode.endswith("resume"):
        saved = "manual" if args.mode == "manual-resume" else "sparse"
        resume = next(Path(out.parent, saved, "ckpt").glob("*step=4.ckpt"))
    trainer.fit(model, loader(), ckpt_path=resume)
    rank = trainer.global_rank
    torch.save([p.detach() for p in model.net.parameters()], out / f"params-rank{rank}.pt")
    hook = getattr(trainer.strategy, "hook_state", None)
    if rank == 0 and hook is not None:
        facts = {"steps": hook.step, "selected": hook.last_step.selected,
                 "target": hook.last_step.target}  # fmt: skip
        (out / "facts.json").write_text(json.dumps(facts))
    # Tear the group down and leave without the interpreter's teardown, as accelerate_run.py
    # does: gloo's threads can still hold tensors when Python finalizes, which now and then
    # aborts a finished process ("terminate called without an active exception").
    trainer.strategy.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(ARGS)
