"""``microsparse bench overhead``: what one step costs on the rank, against its floor.

For each d and n, one thread, process CPU time, median of repeated calls:

- **loop**: one ``GradientReducer.synchronize()`` over
  :class:`~microsparse.comm.SymmetricPeers` (the network taken out), every ``p.grad``
  set to a fresh tensor first, as after ``zero_grad()`` and backward;
- **hook**: the DDP hook's step of one slab holding the whole model (the engine with DDP's
  bucket as the gradient and the slab's O(K) buffer as the result);
- **index exchange**: the variant's framing alone, encoding this rank's selected positions
  and decoding every rank's (all ranks answered this rank's message): for the compact wire
  its encode + decode, for the fixed message its copy and gather;
- **selection**: the sparsifier's selection alone, in passes over the rank's own d/n
  entries, for MiCRO's quotas and for the reference's plain compare, the latter at a
  threshold that selects exactly the same count (the q-th largest of the owned partition),
  so both are timed doing the same job;

all in units of one read pass over d floats (``a.sum()``) and, at n = 1, of ``torch.topk``.
The loop, the hook and the loopback ranks run ``variant``, MiCRO with options
(``micro(wire=compact)``); the selection is MiCRO's own whatever the options.
Then ``microsparse_lab.bench.loopback``: n gloo ranks on loopback, one ``synchronize()`` against
a dense all-reduce of the same gradient, in CPU time, and MiCRO's two rounds (index
all-gather, value all-reduce) alone at its step's sizes, in wall time.

Example:
    >>> result = run(OverheadConfig(sizes=(100_000,), partitions=(1, 4)))  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from microsparse import GradientReducer
from microsparse.comm import Proposal, SymmetricPeers
from microsparse.engine import SparseOutput, SparseStep, run_blocking
from microsparse.feedback import ErrorFeedback
from microsparse.layout import Layout
from microsparse.sparsifiers import create_sparsifier, initial_threshold
from microsparse_lab.bench import loopback
from microsparse_lab.bench.output import describe_machine, machine, markdown_table, significant
from microsparse_lab.bench.output import write_results as _write_results
from microsparse_lab.bench.timing import median_time
from microsparse_lab.bench.workload import (
    RESNET18_NUMEL,
    calibrate,
    model_layout,
    synthetic_gradient,
)
from microsparse_lab.methods.names import find_variants

REFERENCE = loopback.REFERENCE
COLUMNS = ["n", "loop step", "hook step", "index exchange", "quota selection",
           "reference compare", "count"]  # fmt: skip


@dataclass(frozen=True)
class OverheadConfig:
    sizes: tuple[int, ...] = (RESNET18_NUMEL,)
    partitions: tuple[int, ...] = (1, 4, 16, 64)
    density: float = 0.001
    repeats: int = 15
    loopback_ranks: int = 4  # 0: skip the gloo part
    loopback_repeats: int = 15
    seed: int = 0
    variant: str = "micro"
    """MiCRO with options, as the harness names variants: ``micro(wire=compact)``."""

    def options(self) -> dict[str, Any]:
        """The variant's MiCRO options; ValueError unless it is a variant of micro."""
        variant = find_variants((self.variant,), self.density)[0]
        if variant.name != "micro":
            raise ValueError(f"variant: must be micro with options, got {self.variant!r}")
        return dict(variant.options)


def run(config: OverheadConfig, progress: bool = True) -> dict[str, Any]:
    """Measure every (d, n) of ``config``; returns the JSON record."""
    torch.set_num_threads(1)
    options = config.options()
    started = machine()
    rows, floors = [], []
    for numel in config.sizes:
        layout = model_layout(numel)
        gradient = synthetic_gradient(layout, torch.Generator().manual_seed(config.seed))
        target = max(1, int(config.density * numel))
        calibrate(gradient, config.density, initial_threshold(target))
        floor = {
            "numel": numel,
            "pass_ms": _ms(gradient.sum, max(config.repeats, 21)),
            "topk_ms": _topk_ms(gradient, target),
        }
        floors.append(floor)
        for n in config.partitions:
            row = {"numel": numel, "world_size": n, **_step_costs(layout, gradient, config, n)}
            row["loop_passes"] = row["loop_ms"] / floor["pass_ms"]
            row["hook_passes"] = row["hook_ms"] / floor["pass_ms"]
            row["exchange_passes"] = row["exchange_ms"] / floor["pass_ms"]
            for name in ("quota", "reference"):
                row[f"{name}_select_own_passes"] = row[f"{name}_select_ms"] / (floor["pass_ms"] / n)
            rows.append(row)
            if progress:
                print(
                    f"d={numel:,} n={n:<3} loop {row['loop_passes']:.2f} passes, hook "
                    f"{row['hook_passes']:.2f}; selection quota {row['quota_select_ms']:.3f} ms,"
                    f" reference {row['reference_select_ms']:.3f} ms",
                    flush=True,
                )
    result: dict[str, Any] = {
        "benchmark": "overhead",
        "config": asdict(config),
        "machine": started,
        "floors": floors,
        "rows": rows,
    }
    if config.loopback_ranks:
        numel = max(config.sizes)
        result["loopback"] = loopback.run(
            loopback.LoopbackConfig(
                numel=numel, ranks=config.loopback_ranks, density=config.density,
                repeats=config.loopback_repeats, variants={config.variant: options},
            )
        )  # fmt: skip
        result["loopback"].pop("per_rank")
    result["load_average_at_end"] = machine()["load_average"]
    return result


def _topk_ms(gradient: torch.Tensor, target: int) -> float:
    magnitude = torch.empty_like(gradient)
    return _ms(lambda: torch.topk(torch.abs(gradient, out=magnitude), target), 5)


def _ms(work: Any, repeats: int, setup: Any = None) -> float:
    return 1e3 * median_time(work, repeats, setup=setup, clock="cpu").median


def _step_costs(
    layout: Layout, gradient: torch.Tensor, config: OverheadConfig, n: int
) -> dict[str, Any]:
    """Each measurement in a function of its own, so that its d-sized buffers are freed."""
    peers = SymmetricPeers(0, n)
    return {
        "loop_ms": _loop_ms(layout, gradient, config, peers),
        "hook_ms": _hook_ms(layout, gradient, config, peers),
        "exchange_ms": _exchange_ms(layout, gradient, config, peers),
        **_selection_ms(layout, gradient, config, n),
    }


def _loop_ms(
    layout: Layout, gradient: torch.Tensor, config: OverheadConfig, peers: SymmetricPeers
) -> float:
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in layout.shapes]
    fresh = [g.view(s).clone() for g, s in zip(gradient.split(list(layout.sizes)), layout.shapes)]
    reducer = GradientReducer(params, "micro", config.density, collectives=peers,
                              **config.options())  # fmt: skip

    def setup() -> None:
        reducer.residual.zero_()
        for p, g in zip(params, fresh):
            p.grad = g

    return _ms(reducer.synchronize, config.repeats, setup)


def _hook_ms(
    layout: Layout, gradient: torch.Tensor, config: OverheadConfig, peers: SymmetricPeers
) -> float:
    sparsifier = create_sparsifier("micro", config.density, **config.options())
    sparsifier.bind(layout, 0, peers.world_size)
    feedback = ErrorFeedback(layout, torch.float32, gradient.device)
    engine = SparseStep(sparsifier, feedback)
    bucket, output = torch.empty_like(gradient), SparseOutput(torch.zeros_like(gradient))

    def setup() -> None:
        feedback.accumulated.zero_()
        bucket.copy_(gradient)

    return _ms(lambda: run_blocking(engine.run(0, bucket, output), peers), config.repeats, setup)


def _exchange_ms(
    layout: Layout, gradient: torch.Tensor, config: OverheadConfig, peers: SymmetricPeers
) -> float:
    sparsifier = create_sparsifier("micro", config.density, **config.options())
    sparsifier.bind(layout, 0, peers.world_size)
    proposal = Proposal(sparsifier.select(gradient, 0), gradient, 0, sparsifier.counts(0))
    framing = sparsifier.framing()
    return _ms(lambda: run_blocking(framing.exchange(proposal, peers.world_size), peers),
               config.repeats)  # fmt: skip


def _selection_ms(
    layout: Layout, gradient: torch.Tensor, config: OverheadConfig, n: int
) -> dict[str, Any]:
    quota = create_sparsifier("micro", config.density)
    quota.bind(layout, 0, n)
    reference = create_sparsifier("micro", config.density, **REFERENCE)
    reference.bind(layout, 0, n)
    count = quota.quota(0)
    start, end = reference.partition(0)  # the contiguous partition the reference owns
    owned = gradient[start:end].abs()
    reference.settle(torch.topk(owned, min(count, owned.numel())).values[-1].item())
    return {
        "quota_select_ms": _ms(lambda: quota.select(gradient, 0), config.repeats),
        "reference_select_ms": _ms(lambda: reference.select(gradient, 0), config.repeats),
        "quota_count": quota.select(gradient, 0).numel(),
        "reference_count": reference.select(gradient, 0).numel(),
    }


def markdown(result: dict[str, Any]) -> str:
    """The per-step cost table per d, then the loopback comparison."""
    end = ", ".join(f"{x:g}" for x in result["load_average_at_end"])
    parts = [
        f"Machine: {describe_machine(result['machine'])}; load average {end} at the end. "
        "One torch thread, process CPU time, medians. Loop, hook and loopback: "
        f"{result['config'].get('variant', 'micro')}.",
        "",
    ]
    for floor in result["floors"]:
        rows = [r for r in result["rows"] if r["numel"] == floor["numel"]]
        parts += [
            f"**d = {floor['numel']:,}**: one read pass {significant(floor['pass_ms'])} ms, "
            f"torch.topk {significant(floor['topk_ms'])} ms. Whole step in passes over d; "
            "selection in passes over the rank's own d/n (same count for both).",
            "",
            markdown_table(
                COLUMNS,
                [
                    [
                        r["world_size"],
                        f"{r['loop_passes']:.2f}",
                        f"{r['hook_passes']:.2f}",
                        f"{r['exchange_passes']:.3f}" if "exchange_passes" in r else "",
                        f"{r['quota_select_own_passes']:.2f} ({significant(r['quota_select_ms'])}"
                        " ms)",
                        f"{r['reference_select_own_passes']:.2f} "
                        f"({significant(r['reference_select_ms'])} ms)",
                        r["quota_count"],
                    ]
                    for r in rows
                ],
            ),  # fmt: skip
            "",
        ]
    if "loopback" in result:
        loop = result["loopback"]
        dense = loop["dense"]
        parts.append(
            f"{loop['config']['ranks']} gloo ranks on loopback, d = {loop['config']['numel']:,}:"
            f" dense all-reduce {significant(dense['all_reduce_cpu_ms'])} ms CPU "
            f"({significant(dense['all_reduce_wall_ms'])} ms wall)."
        )
        parts += ["", markdown_table(
            ["sparsifier", "synchronize() CPU ms", "× all-reduce CPU", "wall ms",
             "× all-reduce wall"],
            [[r["sparsifier"], significant(r["synchronize_cpu_ms"]), f"{r['cpu_ratio']:.2f}",
              significant(r["synchronize_wall_ms"]), f"{r['wall_ratio']:.2f}"]
             for r in loop["rows"]],
        ), ""]  # fmt: skip
        if "rounds" in loop:  # an overhead.json older than the round timing has none
            rounds, first = loop["rounds"], loop["rows"][0]["sparsifier"]
            parts += [
                f"{first}'s two rounds alone, at its step's sizes, wall: the index all-gather "
                f"{significant(rounds['index_round_wall_ms'])} ms, the value all-reduce "
                f"{significant(rounds['value_round_wall_ms'])} ms, against one dense all-reduce's "
                f"{significant(dense['all_reduce_wall_ms'])} ms (with more ranks than cores a "
                "round costs its latency, whatever its size).",
                "",
            ]
    return "\n".join(parts)


def write(result: dict[str, Any], out: str | Path, plots: bool = True) -> list[Path]:
    """Write ``overhead.json`` and ``overhead.md`` into ``out``."""
    return _write_results("overhead", result, out, markdown, None)
