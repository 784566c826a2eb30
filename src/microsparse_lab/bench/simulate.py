"""``microsparse simulate``: n virtual workers through every sparsifier's exact selection rule.

Worker r's gradient at step t is a shared component plus its own mini-batch noise:

    g_{r,t} = s_t + ρ · rms_layer(s_t) · z_{r,t},   z ~ N(0, 1) independent per worker and step,

where s_t is the average of the captured ranks' real gradients at step t (``--capture DIR``,
cycled if the run is longer than the capture) or a synthetic Gaussian with per-layer scales,
and rms_layer(s_t) is the root-mean-square of s_t over the parameter holding each entry. ρ is
given (``--noise-ratio``) or estimated from the spread between the captured ranks' gradients
(each captured rank's gradient is one worker's mini-batch gradient). Workers run in one
process (:class:`~microsparse_lab.bench.virtual.VirtualCluster`), each with its own sparsifier
bound with ``bind(layout, r, n)`` and its own residual.

Per (sparsifier, n) it reports, as medians over the measured steps: build-up K/k (and its
mean), the
compression ratio error |K/k − 1|, proposals over K (Σ k_r / K: the overlap of union
selections; for the ``fixed`` exchange, how many proposals its capacity held back), the
padding overhead of the index all-gather (n · m / K − 1, m the indices in each rank's
message: max_r k_r when padded, the capacity when fixed), the imbalance of the ranks' own
picks (n · max_r k_r / Σ_r k_r − 1, before a fixed capacity cuts them), the bytes one worker
sends (the reducer's collectives, priced by ``microsparse.comm``'s ring model) and their
ratio to a dense all-reduce and to the ideal (:func:`ideal_bytes`: K int32 indices and K
float32 values, nothing else), and the selection time per worker (median and slowest).

By default n runs up to 64 (:data:`DEFAULT_WORKERS`): every sparsifier at those n takes a few
minutes on two cores and under 2 GB. n = 256 and 1024 (:data:`EXACT_WORKERS`) are simulated
only when asked for: n × d residuals (0.9 GB at n = 1024 for the MNIST CNN's d) plus each
worker's buffers, about 13 MB per worker where every entry is selected (``hard_threshold`` on
the synthetic gradient). Without them :func:`predict` takes the message shapes of n = 256 and
1024 from the largest simulated n, and says so.

Example:
    >>> result = run(SimulateConfig(workers=(1, 4), numel=20_000, steps=3))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from microsparse.comm.collectives import all_gather_bytes, all_reduce_bytes, broadcast_bytes
from microsparse.layout import Layout
from microsparse_lab.bench import costmodel, peermodel
from microsparse_lab.bench.capture import CapturedGradients, load_capture
from microsparse_lab.bench.output import (
    describe_machine,
    machine,
    markdown_table,
    significant,
    write_results,
)
from microsparse_lab.bench.virtual import StepRecord, VirtualCluster, zero_gradient
from microsparse_lab.bench.workload import (
    RESNET18_NUMEL,
    expand,
    layer_rms,
    layout_from_sizes,
    model_layout,
    synthetic_gradient,
)
from microsparse_lab.methods.names import Variant, find_variants
from microsparse_lab.reports.plots import pyplot

SMALLCNN_NUMEL = 215_370
"""Parameters of ``microsparse train``'s MNIST CNN: the default synthetic d."""
DEFAULT_WORKERS = (1, 4, 16, 64)
"""The n simulated unless told: every sparsifier in a few minutes on two cores, < 2 GB."""
EXACT_WORKERS = (1, 4, 16, 64, 256, 1024)
"""Every n that ``--predict`` predicts, simulated: tens of minutes and up to ~14 GB."""
DEFAULT_NOISE_RATIO = 1.0
VALUE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class SimulateConfig:
    workers: tuple[int, ...] = DEFAULT_WORKERS
    density: float = 0.05  # with d = 215,370: k = 10,768, the paper's k (ResNet-18 at 0.001)
    steps: int = 10
    warmup: int = 2  # first steps left out of the medians
    capture: str | None = None  # directory of captured gradients; None: synthetic
    numel: int = SMALLCNN_NUMEL  # synthetic d (a capture brings its own)
    noise_ratio: float | None = None  # ρ; None: estimated from the capture, else 1.0
    threshold_start: str = "settled"  # or "cold": adaptive thresholds from 1/(2·sqrt(k))
    value_dtype: str = "float32"  # the reducer's value_dtype: "bfloat16", "float16" halve values
    only: tuple[str, ...] | None = None  # variant labels; None: every one
    seed: int = 0


class Stream:
    """The shared component s_t and the noise scale of every entry."""

    def __init__(self, config: SimulateConfig) -> None:
        self.capture: CapturedGradients | None = None
        self.estimated_noise_ratio: float | None = None
        if config.capture:
            self.capture = load_capture(config.capture)
            self.layout: Layout = self.capture.layout
            self._cache: dict[int, torch.Tensor] = {}
            if len(self.capture.ranks) > 1:
                self.estimated_noise_ratio = estimate_noise_ratio(self.capture)
        else:
            self.layout = model_layout(config.numel)
        given = config.noise_ratio
        self.noise_ratio = (
            given
            if given is not None
            else self.estimated_noise_ratio
            if self.estimated_noise_ratio is not None
            else DEFAULT_NOISE_RATIO
        )
        self.seed = config.seed

    def describe(self) -> str:
        if self.capture is None:
            source = f"synthetic Gaussian with per-layer scales, d = {self.layout.numel:,}"
        else:
            meta = self.capture.metadata
            source = (
                f"captured gradients of {meta.get('task', '?')}/{meta.get('model', '?')} "
                f"({len(self.capture.ranks)} ranks × {self.capture.steps} steps, mean over "
                f"ranks), d = {self.layout.numel:,}"
            )
        how = (
            "estimated from the captured ranks"
            if self.estimated_noise_ratio is not None
            and (self.noise_ratio == self.estimated_noise_ratio)
            else "given"
        )
        return f"{source}; noise ρ = {self.noise_ratio:.3g} ({how})"

    def shared(self, step: int, generator: torch.Generator) -> torch.Tensor:
        if self.capture is None:
            return synthetic_gradient(self.layout, generator)
        index = step % self.capture.steps
        if index not in self._cache:
            self._cache[index] = self.capture.mean_gradient(index)
        return self._cache[index]

    def source(
        self, step: int, generator: torch.Generator
    ) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """``gradient_for(rank, out)`` of step ``step``: s_t + ρ·rms_layer(s_t)·z."""
        shared = self.shared(step, generator)
        scale = expand(self.noise_ratio * layer_rms(shared, self.layout), self.layout)

        def gradient_for(rank: int, out: torch.Tensor) -> torch.Tensor:
            torch.randn(out.shape, generator=generator, out=out)
            return out.mul_(scale).add_(shared)

        return gradient_for


def estimate_noise_ratio(capture: CapturedGradients, steps: int = 20) -> float:
    """ρ from the captured ranks: median over steps of ‖g_r − ḡ‖·sqrt(m/(m−1)) / ‖ḡ‖.

    Each of the m captured ranks computed its gradient on its own mini-batch, so their
    spread around the mean is the mini-batch noise (the mean itself carries 1/√m of it).
    """
    ratios = []
    m = len(capture.ranks)
    for step in range(min(steps, capture.steps)):
        gradients = torch.stack([capture.gradient(rank, step) for rank in capture.ranks]).double()
        mean = gradients.mean(dim=0)
        spread = (gradients - mean).square().sum(dim=1).mean().sqrt() * math.sqrt(m / (m - 1))
        norm = mean.norm()
        if norm > 0:
            ratios.append((spread / norm).item())
    return statistics.median(ratios) if ratios else DEFAULT_NOISE_RATIO


def step_bytes(record: StepRecord, world_size: int, numel: int, value_bytes: int = 4) -> int:
    """Bytes one worker sends in the reducer's collectives (``microsparse.comm``'s ring model)."""
    total = 0
    shape = shape_of([record], numel, value_bytes)
    for kind, size in costmodel.reducer_collectives(shape, world_size):
        size = int(size)
        if kind == "all_reduce":
            total += all_reduce_bytes(size, world_size)
        elif kind == "all_gather":
            total += all_gather_bytes(size, world_size)
        else:
            total += broadcast_bytes(size, world_size)
    return total


def shape_of(records: list[StepRecord], numel: int, value_bytes: int = 4) -> costmodel.StepShape:
    """The median message sizes of ``records`` as the cost model's :class:`StepShape`."""
    first = records[0]
    return costmodel.StepShape(
        first.exchange,
        numel,
        statistics.median(r.selected for r in records),
        statistics.median(r.max_local_selected for r in records),
        statistics.median(r.agreement_bytes for r in records),
        statistics.median(r.plan_bytes for r in records),
        first.index_bytes or 4,
        value_bytes,
    )


def ideal_bytes(selected: int, world_size: int) -> float:
    """What one worker sends to average ``selected`` positions with nothing wasted: their
    int32 indices all-gathered (K/n from each rank) and their float32 values all-reduced."""
    return (world_size - 1) / world_size * 4 * selected * 3


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def summarize(
    records: list[StepRecord], world_size: int, numel: int, value_bytes: int = 4
) -> dict[str, Any]:
    """Medians over ``records`` of what one (sparsifier, n) selected, sent and cost."""
    dense = all_reduce_bytes(numel * 4, world_size)
    sent = [step_bytes(r, world_size, numel, value_bytes) for r in records]
    # One worker exchanges no indices at all.
    gathered = records[0].exchange in ("padded", "fixed", "union") and world_size > 1
    shape = shape_of(records, numel, value_bytes)
    return {
        "build_up": statistics.median(r.selected / r.target for r in records),
        "build_up_mean": statistics.fmean(r.selected / r.target for r in records),
        "ratio_error": statistics.median(abs(r.selected / r.target - 1) for r in records),
        "overlap": _median([r.proposed / r.selected for r in records if r.selected]),
        "padding": statistics.median(
            world_size * r.max_local_selected / r.selected - 1 if gathered and r.selected else 0.0
            for r in records
        ),
        "imbalance": statistics.median(
            world_size * max(r.proposals) / r.proposed - 1 if gathered and r.proposed else 0.0
            for r in records
        ),
        "wire_ratio": _median(
            [
                bytes_ / ideal_bytes(r.selected, world_size)
                for r, bytes_ in zip(records, sent)
                if world_size > 1 and r.selected
            ]
        ),
        "bytes_per_worker": statistics.median(sent),
        "dense_bytes": dense,
        "traffic_ratio": statistics.median(sent) / dense if dense else math.nan,
        "select_ms": 1e3 * statistics.median(statistics.median(r.select_seconds) for r in records),
        "select_ms_slowest": 1e3 * statistics.median(max(r.select_seconds) for r in records),
        "shape": asdict(shape),
    }


@dataclass(frozen=True)
class Plan:
    """How much one :func:`run` simulates, known before it starts."""

    sparsifiers: int
    workers: tuple[int, ...]
    steps: int
    numel: int

    @property
    def runs(self) -> int:
        """(sparsifier, n) pairs."""
        return self.sparsifiers * len(self.workers)

    @property
    def worker_steps(self) -> int:
        """Steps of one virtual worker, summed over every run: the unit of the work."""
        return self.sparsifiers * sum(self.workers) * self.steps

    @property
    def residual_bytes(self) -> int:
        """The float32 residuals of the largest n, the least the largest run holds."""
        return max(self.workers) * self.numel * 4

    def describe(self) -> str:
        return (
            f"simulating {self.sparsifiers} sparsifiers × n = "
            f"{','.join(map(str, self.workers))} × {self.steps} steps at d = {self.numel:,}: "
            f"{self.runs} runs, {self.worker_steps:,} worker-steps; the largest n holds "
            f"{self.residual_bytes / 1e6:,.1f} MB of residuals (and each sparsifier's buffers)"
        )


def run(config: SimulateConfig, progress: bool = True) -> dict[str, Any]:
    """Simulate every variant at every n of ``config``; returns the JSON record.

    With ``progress``, the plan (:class:`Plan`) and a bar of worker-steps with the time left
    go to stderr, one line per finished run to stdout.
    """
    stream = Stream(config)
    layout = stream.layout
    chosen = find_variants(config.only, config.density)
    plan = Plan(len(chosen), tuple(config.workers), config.steps, layout.numel)
    started = machine()
    if progress:
        print(plan.describe(), file=sys.stderr, flush=True)
    bar = tqdm(total=plan.worker_steps, unit="worker-step", file=sys.stderr, dynamic_ncols=True,
               mininterval=0.5, disable=not progress)  # fmt: skip
    with bar:
        rows = _simulate(config, stream, chosen, bar)
    return {
        "benchmark": "simulate",
        "config": asdict(config),
        "stream": stream.describe(),
        "noise_ratio": stream.noise_ratio,
        "numel": layout.numel,
        "machine": started,
        "load_average_at_end": machine()["load_average"],
        "rows": rows,
    }


def _simulate(
    config: SimulateConfig, stream: Stream, chosen: list[Variant], bar: tqdm
) -> list[dict[str, Any]]:
    layout = stream.layout
    rows = []
    for variant in chosen:
        for world_size in config.workers:
            bar.set_description(f"{variant.label} n={world_size}", refresh=False)
            generator = torch.Generator().manual_seed(config.seed)  # same stream for every row
            cluster = VirtualCluster(
                variant.name, config.density, layout, world_size, **variant.options
            )
            records = []
            for step in range(config.steps):
                source = stream.source(step, generator)
                if step == 0 and config.threshold_start == "settled" and cluster.settle(source):
                    source = zero_gradient
                records.append(cluster.step(source))
                bar.update(world_size)
            measured = records[config.warmup :] or records
            row = {
                "sparsifier": variant.label,
                "name": variant.name,
                "options": variant.options,
                "exchange": cluster.exchange,
                "world_size": world_size,
                "numel": layout.numel,
                "target": cluster.target,
                **summarize(measured, world_size, layout.numel, _value_bytes(config, cluster)),
                "per_step": [
                    {
                        "step": r.step,
                        "selected": r.selected,
                        "max_local_selected": r.max_local_selected,
                        "proposed": r.proposed,
                    }  # fmt: skip
                    for r in records
                ],
            }
            row["clock"] = cluster.clock
            rows.append(row)
            if not bar.disable:
                bar.write(
                    f"{variant.label:>16} n={world_size:<5} K/k {row['build_up']:7.3f}  "
                    f"padding {row['padding']:6.3f}  {row['bytes_per_worker'] / 1e3:9.1f} kB/worker"
                    f"  select {row['select_ms']:8.3f} ms",
                    file=sys.stdout,
                )
            del cluster
            if world_size * layout.numel >= 50_000_000:  # free n × d residuals now
                gc.collect()
    return rows


@dataclass(frozen=True)
class PredictConfig:
    rates_gbit: tuple[float, ...] = (10.0, 25.0, 100.0)
    workers: tuple[int, ...] = (16, 64, 256, 1024)
    numel: int = RESNET18_NUMEL
    latency_us: float = 20.0
    compute_ms: float = 0.0
    select_results: str | None = None  # ``microsparse bench select``'s select.json
    algorithms: str = "ring"  # or "best": the faster of ring and recursive doubling
    peers: tuple[str, ...] = peermodel.DEFAULT_PEERS  # torch's hooks and stock DDP beside


def shapes_from(result: dict[str, Any]) -> dict[tuple[str, int], costmodel.StepShape]:
    """(sparsifier label, n) → the simulated :class:`~costmodel.StepShape`."""
    return {
        (row["sparsifier"], row["world_size"]): costmodel.StepShape(**row["shape"])
        for row in result["rows"]
    }


def predict(result: dict[str, Any], config: PredictConfig) -> dict[str, Any]:
    """Step time of every simulated sparsifier at ``config``'s networks, n and d.

    Messages: the simulated shape at the nearest simulated n, scaled to ``config.numel``.
    Local overhead: ``bench select``'s whole per-step overhead at the nearest d and n when
    ``select_results`` is given (same sparsifier label), else the simulator's selection time
    scaled by d/d_simulated (selection only).

    The peers (``config.peers``: stock DDP, torch's fp16/bf16 and PowerSGD hooks) follow
    :func:`peermodel.predict_rows`: their collectives from ResNet-18's layer shapes widened to
    d, DDP's buckets, and their own arithmetic timed on this machine.
    """
    shapes = shapes_from(result)
    overheads, overhead_source = _overheads(config, result)
    density = result["config"]["density"]
    rows = []
    for label in dict.fromkeys(label for label, _ in shapes):
        for world_size in config.workers:
            at = nearest_simulated([n for name, n in shapes if name == label], world_size)
            shape = costmodel.scaled(shapes[(label, at)], config.numel)
            if shape.exchange == "fixed":  # the capacity follows k/n, not the counts
                variant = find_variants((label,), density)[0]
                capacity = capacity_at(variant, density, config.numel, world_size)
                shape = dataclasses.replace(shape, max_local_selected=capacity)
            overhead = overheads(label, world_size)
            for gbit in config.rates_gbit:
                network = costmodel.Network.of(gbit, config.latency_us)
                comm = costmodel.communication_seconds(
                    shape, world_size, network, config.algorithms
                )
                rows.append({
                    "sparsifier": label,
                    "world_size": world_size,
                    "simulated_at": at,
                    "gbit_per_s": gbit,
                    "communication_ms": 1e3 * comm,
                    "overhead_ms": overhead,
                    "compute_ms": config.compute_ms,
                    "step_ms": config.compute_ms + overhead + 1e3 * comm,
                })  # fmt: skip
    rows += peermodel.predict_rows(
        config.peers, config.numel, config.workers, config.rates_gbit, config.latency_us,
        config.compute_ms, config.algorithms,
    )  # fmt: skip
    dense = {
        (r["world_size"], r["gbit_per_s"]): r["step_ms"] for r in rows if r["sparsifier"] == "dense"
    }
    for row in rows:
        reference = dense.get((row["world_size"], row["gbit_per_s"]))
        row["speedup_vs_dense"] = reference / row["step_ms"] if reference else None
    largest = max(n for _, n in shapes)
    return {
        "config": asdict(config),
        "model": costmodel.describe(),
        "overhead_source": overhead_source,
        "simulated_workers": sorted({n for _, n in shapes}),
        "beyond_simulated": [n for n in config.workers if n > largest],
        "rows": rows,
    }


def nearest_simulated(sizes: list[int], world_size: int) -> int:
    """The simulated n (of ``sizes``) nearest ``world_size`` on a log scale.

    Example:
        >>> nearest_simulated([1, 4, 16, 64], 1024), nearest_simulated([1, 4, 16, 64], 20)
        (64, 16)
    """
    return min(sizes, key=lambda n: abs(math.log2(n) - math.log2(world_size)))


def beyond_note(prediction: dict[str, Any]) -> str:
    """What the prediction took from a smaller n than it predicts; '' if nothing."""
    beyond = prediction.get("beyond_simulated")
    if not beyond:
        return ""
    largest = max(prediction["simulated_workers"])
    return (
        f"n = {', '.join(map(str, beyond))} not simulated: their message shapes are those "
        f"simulated at n = {largest}, scaled to d. Union sparsifiers' K grows with n, so their "
        f"bytes and times there are likely underestimated; simulate those n with --workers "
        f"{','.join(map(str, EXACT_WORKERS))} (tens of minutes, up to ~14 GB)."
    )


def _value_bytes(config: SimulateConfig, cluster: VirtualCluster) -> int:
    """Bytes of one value on the wire: ``config.value_dtype``'s, unless the sparsifier's
    framing sends its own (MiCRO's compact wire: bfloat16), as its engines then do."""
    wire = cluster.engines[0].value_dtype
    return VALUE_BYTES[config.value_dtype] if wire is None else wire.itemsize


def capacity_at(variant: Variant, density: float, numel: int, world_size: int) -> int:
    """Index slots per rank of a ``fixed`` exchange: the sparsifier's own ``capacity``."""
    sparsifier = variant.create(density)
    sparsifier.bind(layout_from_sizes([numel]), 0, world_size)
    return sparsifier.framing().capacity  # type: ignore[attr-defined]


def _overheads(
    config: PredictConfig, result: dict[str, Any]
) -> tuple[Callable[[str, int], float], str]:
    simulated = {(r["sparsifier"], r["world_size"]): r["select_ms"] for r in result["rows"]}
    scale = config.numel / result["numel"]

    def from_simulation(label: str, world_size: int) -> float:
        sizes = [n for name, n in simulated if name == label]
        best = min(sizes, key=lambda n: abs(math.log2(n) - math.log2(world_size)))
        return simulated[(label, best)] * scale

    if not config.select_results or not Path(config.select_results).is_file():
        return from_simulation, (
            f"selection time of the simulator at d = {result['numel']:,}, × {scale:.3g} "
            "(selection only)"
        )
    import json

    measured = json.loads(Path(config.select_results).read_text())
    rows = [r for r in measured["rows"] if r["device"] == "cpu"]
    sizes = sorted({r["numel"] for r in rows})
    numel = min(sizes, key=lambda d: abs(math.log(d) - math.log(config.numel)))

    def from_select(label: str, world_size: int) -> float:
        mine = [r for r in rows if r["sparsifier"] == label and r["numel"] == numel]
        if not mine:
            return from_simulation(label, world_size)
        best = min(mine, key=lambda r: abs(math.log2(r["world_size"]) - math.log2(world_size)))
        return best["overhead_ms"] * config.numel / numel

    return from_select, (
        f"whole per-step overhead from {config.select_results} at d = {numel:,} "
        f"(cpu, nearest n), × {config.numel / numel:.3g}"
    )


def markdown(result: dict[str, Any]) -> str:
    """The simulation table; the prediction and validation tables when present."""
    parts = [
        f"Stream: {result['stream']}. Density {result['config']['density']:g}, "
        f"k = {result['rows'][0]['target']:,}; {result['config']['steps']} steps, medians over "
        f"steps {result['config']['warmup']}–{result['config']['steps'] - 1}; thresholds "
        f"{result['config']['threshold_start']}; selection timed in {result['rows'][0]['clock']} "
        "time.",
        f"Machine: {describe_machine(result['machine'])}.",
        "",
    ]
    table = [
        [
            r["sparsifier"],
            r["world_size"],
            significant(r["build_up"]),
            significant(r["build_up_mean"]),
            significant(r["overlap"]),
            significant(r["padding"], 2) if r["world_size"] > 1 else "–",
            significant(r["imbalance"], 2) if r["world_size"] > 1 else "–",
            significant(r["bytes_per_worker"] / 1e3),
            significant(r["wire_ratio"], 3) if r["world_size"] > 1 else "–",
            significant(100 * r["traffic_ratio"], 2) if r["traffic_ratio"] is not None else "–",
            significant(r["select_ms"]),
            significant(r["select_ms_slowest"]),
        ]
        for r in result["rows"]
    ]
    parts.append(
        markdown_table(
            [
                "sparsifier",
                "n",
                "K/k",
                "mean K/k",
                "Σk_r/K",
                "padding",
                "imbalance",
                "kB sent/worker",
                "wire / ideal",
                "% of dense",
                "select ms (median worker)",
                "select ms (slowest)",
            ],  # fmt: skip
            table,
        )
    )
    if "prediction" in result:
        parts += ["", markdown_prediction(result["prediction"])]
    if "validation" in result:
        parts += ["", markdown_validation(result["validation"])]
    return "\n".join(parts)


def markdown_prediction(prediction: dict[str, Any]) -> str:
    config = prediction["config"]
    workers = list(config["workers"])
    parts = [
        f"Predicted step time, ms, d = {config['numel']:,}, α = {config['latency_us']:g} µs, "
        f"{config.get('algorithms', 'ring')} collectives, "
        f"compute {config['compute_ms']:g} ms; local overhead: {prediction['overhead_source']}. "
        "Cells: step ms (of which communication; speed-up over dense). The peers run through "
        "DDP: their local overhead is their own work (the casts; torch's PowerSGD hook end to "
        "end) timed here, and 'if hidden' is the bound where DDP overlaps all communication "
        "with the backward pass.",
    ]
    note = beyond_note(prediction)
    if note:
        parts += ["", f"**{note}**"]
    for gbit in config["rates_gbit"]:
        rows = [r for r in prediction["rows"] if r["gbit_per_s"] == gbit]
        table = []
        for label in dict.fromkeys(r["sparsifier"] for r in rows):
            cells = {r["world_size"]: r for r in rows if r["sparsifier"] == label}
            table.append(
                [label]
                + [
                    f"{significant(cells[n]['step_ms'])} "
                    f"({significant(cells[n]['communication_ms'], 2)} comm; "
                    f"{significant(cells[n]['speedup_vs_dense'] or math.nan, 2)}×"
                    + (
                        f"; {significant(cells[n]['overlapped_step_ms'])} if hidden)"
                        if "overlapped_step_ms" in cells[n]
                        else ")"
                    )
                    for n in workers
                ]
            )
        parts += ["", f"**{gbit:g} Gbit/s**", "", markdown_table(
            ["sparsifier"] + [f"n={n}" for n in workers], table)]  # fmt: skip
    return "\n".join(parts)


def markdown_validation(validation: dict[str, Any]) -> str:
    rows = validation["rows"]
    peer_rows = validation.get("peer_rows")
    if not rows:
        if peer_rows:  # a run of the peers and the hook alone: no loop sparsifier to model
            return markdown_peer_validation(peer_rows)
        return f"Validation: {validation['note'] or 'no rows to compare'}"
    local = any("local_exchange_ms" in r for r in rows)
    headers = ["hosts", "link", "sparsifier", "exchange ms (measured)", "network model, nominal",
               "network model, probed"]  # fmt: skip
    if local:
        headers.append("probed + local CPU")
    headers += ["step ms (measured)", "step ms (model)", "model / measured"]
    best = "probed_plus_local" if local else "probed"
    table = []
    for r in rows:
        cells = [
            r["hosts"],
            r["rate"],
            r["sparsifier"],
            significant(r["measured_exchange_ms"]),
            significant(r.get("predicted_exchange_ms_nominal", math.nan)),
            significant(r.get("predicted_exchange_ms_probed", math.nan)),
        ]
        if local:
            cells.append(significant(r.get("predicted_exchange_ms_probed_plus_local", math.nan)))
        cells += [
            significant(r["measured_step_ms"]),
            significant(r.get(f"predicted_step_ms_{best}", math.nan)),
            significant(r.get(f"step_ratio_{best}", math.nan), 2),
        ]
        table.append(cells)
    source = f" Local CPU of the exchange: {validation['local_source']}." if local else ""
    text = (
        f"Validation against {validation['source']} (α = {validation['latency_us']:g} µs; "
        f"model step = measured compute + wait + select + other + modelled exchange).{source}"
        "\n\n" + markdown_table(headers, table)
    )
    if peer_rows:
        text += "\n\n" + markdown_peer_validation(peer_rows)
    return text


def markdown_peer_validation(rows: list[dict[str, Any]]) -> str:
    """The peers' rows of the validation (:func:`peermodel.validate_peers`)."""
    headers = ["hosts", "link", "peer", "step ms (measured)", "base", "base step", "local ms",
               "collectives ms (probed)", "model: nothing hidden", "model: all hidden",
               "model / measured", "MB (model)", "MB (wire)"]  # fmt: skip
    table = [
        [r["hosts"], r["rate"], r["sparsifier"], significant(r["measured_step_ms"]), r["base"],
         significant(r["base_step_ms"]), significant(r["local_ms"]),
         significant(r["communication_ms"]), significant(r["predicted_step_ms"]),
         significant(r["overlapped_step_ms"]), significant(r["step_ratio"], 2),
         significant(r["modelled_bytes"] / 1e6),
         significant(r["wire_bytes"] / 1e6) if r["wire_bytes"] is not None else "–"]
        for r in rows
    ]  # fmt: skip
    return (
        "The peers through DDP (model step = the base row's step (DDP without an exchange, "
        "`none@ddp`, or `none` where the run has no such row) + the peer's own work, timed "
        "here on the threads each worker had and stretched by hosts · threads / cores where "
        "the test bed shares its cores + its collectives at the probed rate; 'all hidden' "
        "overlaps the collectives with compute, except for one "
        "bucket):\n\n" + markdown_table(headers, table)
    )


def validate(
    result: dict[str, Any],
    cluster_results: str | Path,
    latency_us: float,
    select_results: str | Path | None = None,
) -> dict[str, Any]:
    """:func:`costmodel.validate_against_cluster` on a ``results.json``, with this run's
    shapes; a note instead of rows when the file is not there.

    With ``select_results`` (``bench select``'s JSON), the exchange's own CPU work is added
    to the network model: whole per-step overhead − selection − the error-feedback add
    (which the cluster counts as selection), at the nearest d and n.
    """
    import json

    path = Path(cluster_results)
    if not path.is_file():
        return {
            "source": str(path),
            "latency_us": latency_us,
            "rows": [],
            "note": f"{path} not found; run `microsparse bench cluster` (root), then rerun "
            f"`microsparse simulate --from SIMULATE.json --cluster-results {path}`",
        }
    local, local_source = None, ""
    if select_results and Path(select_results).is_file():
        local = _local_exchange(json.loads(Path(select_results).read_text()))
        local_source = (
            f"{select_results}: overhead − selection − error-feedback add, CPU time, "
            "nearest d and n"
        )
    measured = json.loads(path.read_text())
    rows = costmodel.validate_against_cluster(measured, latency_us, shapes_from(result), local)
    return {
        "source": str(path),
        "latency_us": latency_us,
        "rows": rows,
        "peer_rows": peermodel.validate_peers(measured, latency_us),
        "note": "",
        "local_source": local_source,
    }


def _local_exchange(measured: dict[str, Any]) -> Callable[[str, int, int], float | None]:
    rows = [r for r in measured["rows"] if r["device"] == "cpu"]
    floors = {f["numel"]: f for f in measured["floors"] if f["device"] == "cpu"}

    def local(name: str, numel: int, world_size: int) -> float | None:
        mine = [r for r in rows if r["sparsifier"] == name]
        if not mine:
            return None
        size = min({r["numel"] for r in mine}, key=lambda d: abs(math.log(d / numel)))
        mine = [r for r in mine if r["numel"] == size]
        row = min(mine, key=lambda r: abs(math.log2(r["world_size"] / world_size)))
        compensate = floors.get(size, {}).get("compensate_ms", 0.0)
        work = row["overhead_ms"] - row["select_ms"] - compensate
        return max(0.0, work) * numel / size

    return local


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    """``simulate.png`` (K/k, padding, bytes, selection vs n) and ``predict.png``."""
    plt = pyplot()
    rows = result["rows"]
    labels = list(dict.fromkeys(r["sparsifier"] for r in rows))
    panels = [
        ("build_up", "build-up K/k", "log"),
        ("padding", "index padding n·m/K − 1", "symlog"),
        ("bytes_per_worker", "bytes sent per worker per step", "log"),
        ("select_ms", "selection ms per worker (median)", "log"),
    ]
    figure, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    for axis, (key, title, scale) in zip(axes.flat, panels):
        for label in labels:
            mine = [r for r in rows if r["sparsifier"] == label]
            if scale == "log":  # zeros (nothing sent, nothing selected) have no place there
                mine = [r for r in mine if r[key] and r[key] > 0]
            if key == "padding":  # one worker exchanges no indices
                mine = [r for r in mine if r["world_size"] > 1]
            axis.plot(
                [r["world_size"] for r in mine],
                [r[key] for r in mine],
                marker="o",
                markersize=3,
                label=label,
            )
        _workers_axis(axis, sorted({r["world_size"] for r in rows}))
        if scale == "symlog":
            axis.set_yscale("symlog", linthresh=0.1)
            axis.set_ylim(bottom=0)
        else:
            axis.set_yscale(scale)
        axis.set_title(title, fontsize=9)
        axis.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="upper left")
    figure.suptitle(
        f"{result['numel']:,} parameters, density {result['config']['density']:g}", fontsize=10
    )
    figure.tight_layout()
    paths = [out / "simulate.png"]
    figure.savefig(paths[0], dpi=90)
    plt.close(figure)
    if "prediction" in result:
        prediction = result["prediction"]
        rates = prediction["config"]["rates_gbit"]
        figure, axes = plt.subplots(
            1, len(rates), figsize=(4.2 * len(rates), 3.8), squeeze=False, sharey=True
        )
        for axis, gbit in zip(axes[0], rates):
            mine = [r for r in prediction["rows"] if r["gbit_per_s"] == gbit]
            for label in dict.fromkeys(r["sparsifier"] for r in mine):
                points = [r for r in mine if r["sparsifier"] == label]
                axis.plot([r["world_size"] for r in points], [r["step_ms"] for r in points],
                          marker="o", markersize=3, label=label)  # fmt: skip
            _workers_axis(axis, sorted({r["world_size"] for r in mine}))
            axis.set_yscale("log")
            axis.set_title(f"{gbit:g} Gbit/s", fontsize=9)
            axis.grid(True, alpha=0.3)
        axes[0][0].set_ylabel("predicted step time, ms")
        axes[0][-1].legend(fontsize=7, loc="upper left")
        figure.tight_layout()
        paths.append(out / "predict.png")
        figure.savefig(paths[-1], dpi=90)
        plt.close(figure)
    return paths


def _workers_axis(axis: Any, workers: list[int]) -> None:
    axis.set_xscale("log", base=2)
    axis.set_xticks(workers, [str(n) for n in workers])
    axis.minorticks_off()
    axis.set_xlabel("workers n")


def write(result: dict[str, Any], out: str | Path, plots: bool = True) -> list[Path]:
    """Write ``simulate.json``, ``simulate.md`` and (with ``plots``) the PNGs into ``out``."""
    return write_results("simulate", result, out, markdown, plot if plots else None)
