"""One host of ``microsparse bench cluster``: a gloo rank that times training steps.

The parent (:mod:`microsparse_lab.bench.cluster`) starts one of these per host namespace with
``ip netns exec``. Each joins the process group over the shaped link, then

1. probes the link: a dense all-reduce of a known size, timed, with the bytes the host's link
   actually sent (its ``tx_bytes`` counter), so the achieved rate can be set next to the
   nominal one;
2. for every sparsifier in turn, ``--rounds`` times over: builds the model from the same seed
   as every other rank, runs ``--warmup`` unrecorded steps and its share of ``--steps``
   recorded ones on random CIFAR-shaped
   batches, timing compute (forward + backward), the wait for the slowest worker (a barrier
   before the exchange, so that the exchange is timed on its own), selection, exchange and
   the whole step.
   ``none`` trains the same way without any exchange: the no-communication bound (its
   ranks meet at a barrier before every step, as those of a synchronous step do).

Rank 0 writes every rank's records as one JSON file (``--out``).

Slowly adapting thresholds start settled (``--threshold-start settled``): during warm-up,
a threshold carried from step to step (MiCRO with the paper's ±0.5 %-per-step rules, SAGE's
per-worker λ) is set from the accumulated gradient so that the step selects the target
count. From λ_0 = 1/(2·sqrt(k)) the paper's controller needs hundreds of steps to get there
(ResNet-18 at initialisation: λ_0 selects about 240 times the target), so a short benchmark
would otherwise time a nearly dense exchange. Rules that estimate λ from each step's data
(MiCRO's ``quantile``) are left alone. The fixed hard threshold is never changed.

Example:
    $ ip netns exec NS python -m microsparse_lab.bench.cluster_worker --rank 1 --world-size 2 \\
        --master-addr 10.213.0.1 --interface msp-h1 --sparsifiers dense,micro,none --out r.json
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from microsparse import GradientReducer
from microsparse.comm import all_reduce_bytes
from microsparse_lab.bench.settle import bisect_threshold, kth_magnitude
from microsparse_lab.methods.hooks import attach_method
from microsparse_lab.methods.names import NO_EXCHANGE, parse_method, split_labels
from microsparse_lab.methods.traffic import modelled_bytes
from microsparse_lab.training.launch import leave_process
from microsparse_lab.training.models import build_resnet18, seeded

NO_EXCHANGE = NO_EXCHANGE
"""The method name of the no-communication bound: the same training, no exchange."""
IMAGE_SHAPE = (3, 32, 32)
CLASSES = 10


def tiny_model() -> nn.Module:
    """A 1,514-parameter CNN for CIFAR-shaped input, for smoke tests of the harness."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(8 * 16, CLASSES),
    )


MODELS = {
    "resnet18": lambda seed: build_resnet18(num_classes=CLASSES, seed=seed),
    "tiny": lambda seed: seeded(seed, tiny_model),
}
"""``--model`` choices: name -> builder taking the seed."""


class LinkCounter:
    """Bytes this host's link has sent so far (``/sys/class/net/IF/statistics/tx_bytes``).

    ``ip netns exec`` mounts the namespace's own ``/sys``, so this is the host's veth, with
    every TCP/IP header and retransmission: what went over the shaped wire.
    """

    def __init__(self, interface: str | None) -> None:
        self._path = Path(f"/sys/class/net/{interface}/statistics/tx_bytes") if interface else None

    def read(self) -> int | None:
        if self._path is None:
            return None
        try:
            return int(self._path.read_text())
        except (OSError, ValueError):
            return None


def probe_link(numel: int, repeats: int, link: LinkCounter) -> dict[str, Any]:
    """Time a dense float32 all-reduce of ``numel`` values ``repeats`` times (after one
    untimed warm-up), with the bytes this host's link sent during each."""
    world_size = dist.get_world_size()
    tensor = torch.ones(numel)
    dist.all_reduce(tensor)  # connections and buffers are warm before timing
    seconds, sent = [], []
    for _ in range(repeats):
        dist.barrier()
        before = link.read()
        started = time.perf_counter()
        dist.all_reduce(tensor)
        seconds.append(time.perf_counter() - started)
        after = link.read()
        sent.append(None if before is None or after is None else after - before)
    elapsed = statistics.median(seconds)
    modelled = all_reduce_bytes(numel * tensor.element_size(), world_size)
    wire = statistics.median(sent) if None not in sent else None
    return {
        "numel": numel,
        "payload_bytes": numel * tensor.element_size(),
        "seconds": elapsed,
        "seconds_all": seconds,
        "modelled_bytes": modelled,
        "wire_bytes": wire,
        "modelled_gbit_per_s": modelled * 8 / elapsed / 1e9,
        "wire_gbit_per_s": None if wire is None else wire * 8 / elapsed / 1e9,
    }


SELF_SETTLING_RULES = ("quantile",)
"""Threshold rules that estimate λ from the current step's data: they need no settling."""


def needs_settling(reducer: GradientReducer) -> bool:
    """Whether the sparsifier carries a threshold from step to step that it adapts slowly."""
    sparsifier = reducer.sparsifier
    rule = sparsifier.options().get("threshold_rule")
    return "threshold" in sparsifier.state_dict() and rule not in SELF_SETTLING_RULES


def settle_threshold(reducer: GradientReducer, params: list[torch.Tensor]) -> None:
    """Set an adaptive sparsifier's threshold so that this step selects the target count.

    Call after ``backward()``, before ``synchronize()``, on every rank. Per-worker thresholds
    over the whole vector (SAGE: ``union`` exchange): each rank's own k-th largest |a|. A λ
    shared by all ranks (MiCRO): bisection on the global count of the sparsifier's own
    selection, so it holds for any partitioning and leaves λ identical on every rank.
    """
    sparsifier = reducer.sparsifier
    grads = torch.cat([p.grad.reshape(-1) for p in params]).to(reducer.residual.dtype)
    accumulated = reducer.residual + grads
    k = sparsifier.target
    if sparsifier.framing().label == "union":  # every rank selects over the whole vector
        sparsifier.settle(kth_magnitude(accumulated, k))
        return

    def global_count(threshold: float) -> int:
        sparsifier.settle(threshold)
        count = torch.tensor([sparsifier.select(accumulated, reducer.step).numel()])
        dist.all_reduce(count)
        return int(count.item())

    largest = accumulated.abs().max().reshape(1)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    low, high = largest.item() * 1e-6 + 1e-30, largest.item() + 1e-30
    # A count costs an all-reduce: stop within 1 % above k, and keep count(λ) >= k.
    low, _ = bisect_threshold(global_count, k, low, high, rounds=40, within=1.01)
    sparsifier.settle(low)


def measure_in_rounds(args: argparse.Namespace, link: LinkCounter) -> list[dict[str, Any]]:
    """Every sparsifier in turn, ``args.rounds`` times over, sharing ``args.steps`` recorded
    steps between the rounds; one merged record per sparsifier.

    On a shared machine load comes in bursts: rounds spread a burst over all sparsifiers
    instead of letting it fall on one.
    """
    merged: dict[str, dict[str, Any]] = {}
    for round_index in range(args.rounds):
        steps = args.steps // args.rounds + (round_index < args.steps % args.rounds)
        for name in args.sparsifiers:
            run = measure(name, args, link, steps)
            for record in run["steps"]:
                record["round"] = round_index
            if name not in merged:
                merged[name] = run
                continue
            merged[name]["steps"] += run["steps"]
            if None in (merged[name]["wire_bytes"], run["wire_bytes"]):
                merged[name]["wire_bytes"] = None
            else:
                merged[name]["wire_bytes"] += run["wire_bytes"]
    for run in merged.values():
        wire = run.pop("wire_bytes")
        run["wire_bytes_per_step"] = None if wire is None else wire / len(run["steps"])
    return list(merged.values())


def measure(name: str, args: argparse.Namespace, link: LinkCounter, steps: int) -> dict[str, Any]:
    """Warm up, then time ``steps`` training steps with method ``name``
    (:mod:`~microsparse_lab.methods.names`).

    The loop API's rows wait for the slowest worker before the exchange, so that it is timed
    on its own. Under DDP (microsparse's hook and the peers) the exchange overlaps the backward
    pass: the step starts with the wait for the slowest worker, and compute includes whatever
    of the exchange was not hidden.
    """
    method = parse_method(name)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = MODELS[args.model](args.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9)
    reducer, trained, state = None, model, None
    if method.kind == "loop":
        reducer = GradientReducer(model.named_parameters(), method.sparsifier,
                                  **method.amount(args.density), **method.value_options(),
                                  **method.options)  # fmt: skip
    elif method.uses_ddp:
        trained, state = attach_method(method, model, args.density, args.warmup)
    settle = reducer is not None and args.threshold_start == "settled" and needs_settling(reducer)
    peer_bytes = modelled_bytes(method, model, world_size)
    numel = sum(p.numel() for p in params)
    generator = torch.Generator().manual_seed(args.seed * 1009 + rank)
    records: list[dict[str, Any]] = []
    sent_before = None
    dist.barrier()
    for step in range(args.warmup + steps):
        if step == args.warmup:
            dist.barrier()  # every rank starts the recorded steps together
            sent_before = link.read()
        images = torch.randn(args.batch_size, *IMAGE_SHAPE, generator=generator)
        labels = torch.randint(CLASSES, (args.batch_size,), generator=generator)
        started = time.perf_counter()
        if method.kind != "loop":  # the loop API's rows meet before their exchange instead
            # DDP: the exchange happens inside backward, so wait for everyone first. The bound
            # too keeps the ranks in step, as every exchange does: left to run free, ranks that
            # share cores drift apart, and the last ones run alone, faster than any rank of a
            # synchronous step could (docs/results/runs/2026-12-02_cluster-floor.md).
            dist.barrier()
        ready = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        F.cross_entropy(trained(images), labels).backward()
        computed = time.perf_counter()
        stats, waited = None, computed
        if reducer is not None:
            if step < args.warmup and settle:
                settle_threshold(reducer, params)
            # Wait for the slowest worker here, so that the exchange is timed on its own.
            dist.barrier()
            waited = time.perf_counter()
            stats = reducer.synchronize()
        elif method.kind == "hook":
            stats = state.last_step
        optimizer.step()
        finished = time.perf_counter()
        if step < args.warmup:
            continue
        select = stats.select_seconds if stats and reducer is not None else 0.0
        exchange = stats.exchange_seconds if stats and reducer is not None else 0.0
        sent = stats.bytes_sent if stats else (peer_bytes or 0)
        records.append(
            {
                "total": finished - started,
                "compute": computed - ready,
                "wait": ready - started + waited - computed,
                "select": select,
                "exchange": exchange,
                "other": finished - waited - select - exchange,
                "selected": stats.selected if stats else (numel if method.kind == "peer" else 0),
                "target": stats.target if stats else (numel if method.kind == "peer" else 0),
                "bytes_sent": sent,
                "dense_bytes": all_reduce_bytes(4 * numel, world_size),
            }
        )
    sent_after = link.read()
    wire = None if sent_before is None or sent_after is None else sent_after - sent_before
    return {
        "sparsifier": name,
        "kind": method.kind,
        "parameters": numel,
        "steps": records,
        "wire_bytes": wire,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # A crash inside torch's C++ (an abort, a segfault) leaves no Python traceback: have one
    # printed into this host's log, so the parent's error says where the worker was.
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master_addr}:{args.master_port}",
        rank=args.rank,
        world_size=args.world_size,
        timeout=timedelta(seconds=args.timeout),
    )
    try:
        link = LinkCounter(args.interface)
        report = {
            "rank": args.rank,
            "probe": probe_link(args.probe_numel, args.probe_repeats, link),
            "runs": measure_in_rounds(args, link),
        }
        reports: list[Any] = [None] * args.world_size
        dist.all_gather_object(reports, report)
        if args.rank == 0:
            _write_json(Path(args.out), {"world_size": args.world_size, "ranks": reports})
    finally:
        dist.destroy_process_group()
    return 0


def _write_json(path: Path, data: dict[str, Any]) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(partial, path)  # a reader never sees half a file


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m microsparse_lab.bench.cluster_worker",
        description="One host of `microsparse bench cluster` (started by it, not by hand).",
    )
    add = parser.add_argument
    add("--rank", type=int, required=True)
    add("--world-size", type=int, required=True)
    add("--master-addr", required=True)
    add("--master-port", type=int, default=29500)
    add("--interface", default=None, help="this host's link, for its tx_bytes counter")
    add("--sparsifiers", type=split_labels, required=True,
        help="methods (microsparse_lab.methods.names), by commas")  # fmt: skip
    add("--density", type=float, default=0.001)
    add("--steps", type=int, default=8, help="recorded steps per sparsifier, all rounds")
    add("--warmup", type=int, default=2, help="unrecorded steps before every round")
    add("--rounds", type=int, default=2)
    add("--model", choices=sorted(MODELS), default="resnet18")
    add("--batch-size", type=int, default=8)
    add("--lr", type=float, default=0.01)
    add("--seed", type=int, default=1)
    add("--threshold-start", choices=("settled", "cold"), default="settled")
    add("--probe-numel", type=int, default=2_000_000)
    add("--probe-repeats", type=int, default=3)
    add("--threads", type=int, default=1)
    add("--timeout", type=float, default=300.0, help="gloo collective timeout, seconds")
    add("--out", required=True, help="rank 0's JSON file")
    return parser


if __name__ == "__main__":  # a gloo rank: no interpreter teardown (see leave_process)
    leave_process(main())
