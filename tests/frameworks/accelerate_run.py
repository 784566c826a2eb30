"""One Hugging Face Accelerate run on the ranks torchrun started (``tests/test_frameworks.py``).

Eight steps; ``accelerator.save_state`` after step 4. Writes every rank's final parameters to
OUT/params-rank{r}.pt. Modes: ``hook`` (MicroState on the prepared DDP model), ``hook-resume``
(load_state of the hook run's step-4 state, then steps 5-8), ``reducer`` and
``reducer-resume`` (a GradientReducer under ``accelerator.no_sync``), ``accumulate`` (the hook,
2 batches per step with ``accelerator.accumulate``), ``plain`` (Accelerate's own DDP).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import microsparse.ddp as mddp
from microsparse import EveryRank, GradientReducer

STEPS, SAVE_AT = 8, 4


def _refuse_dense(state: object, bucket: object) -> None:
    raise AssertionError("DDP averaged a bucket densely beside the reducer")


# DDP checks a hook's annotations as objects (this file's are strings).
_refuse_dense.__annotations__ = {"state": object, "bucket": torch.distributed.GradBucket,
                                 "return": torch.futures.Future[torch.Tensor]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    mode, out = args.mode, Path(args.out)
    accumulation = 2 if mode == "accumulate" else 1
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 20, generator=generator),
                         torch.randint(0, 4, (256,), generator=generator))  # fmt: skip
    loader = DataLoader(data, batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    reducer = None
    if mode.startswith("hook") or mode == "accumulate":
        state = mddp.MicroState(density=0.05)
        model.register_comm_hook(state, mddp.micro_hook)
        accelerator.register_for_checkpointing(EveryRank(state))
    elif mode.startswith("reducer"):
        reducer = GradientReducer(model.module, "micro", 0.05)
        accelerator.register_for_checkpointing(EveryRank(reducer))
        model.register_comm_hook(None, _refuse_dense)
    first = 0
    if mode.endswith("-resume"):
        accelerator.load_state(str(out.parent / mode.replace("-resume", "") / "state"))
        first = SAVE_AT
    batches = iter(loader)
    for _ in range(first * accumulation):  # the batches the saved run had used
        next(batches)
    for step in range(first, STEPS):
        for _ in range(accumulation):
            inputs, labels = next(batches)
            with accelerator.accumulate(model):
                if reducer is None:
                    accelerator.backward(nn.functional.cross_entropy(model(inputs), labels))
                else:
                    # DDP must not average, the reducer does; DDP decides that in the forward
                    # pass, so the forward pass too runs inside no_sync.
                    with accelerator.no_sync(model):
                        loss = nn.functional.cross_entropy(model(inputs), labels)
                        accelerator.backward(loss)
                    reducer.synchronize()
                optimizer.step()
                optimizer.zero_grad()
        if step + 1 == SAVE_AT and not mode.endswith("-resume"):
            accelerator.save_state(str(out / "state"))
    params = [p.detach() for p in accelerator.unwrap_model(model).parameters()]
    out.mkdir(parents=True, exist_ok=True)
    torch.save(params, out / f"params-rank{accelerator.process_index}.pt")
    # Tear the group down and leave without the interpreter's teardown: gloo's threads can
    # still hold tensors (DDP's buckets, the hook's futures) when Python finalizes, which now
    # and then aborts a finished process ("terminate called without an active exception").
    accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
