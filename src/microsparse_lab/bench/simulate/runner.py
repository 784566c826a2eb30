"""The simulation itself: every variant at every n through
:class:`~microsparse_lab.bench.virtual.VirtualCluster`, its plan known before it starts."""

from __future__ import annotations

import gc
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch
from tqdm import tqdm

from microsparse_lab.bench.output import machine
from microsparse_lab.bench.simulate.config import VALUE_BYTES, SimulateConfig
from microsparse_lab.bench.simulate.stream import simulated_stream
from microsparse_lab.bench.simulate.summary import summarize
from microsparse_lab.bench.streams import Stream
from microsparse_lab.bench.virtual import VirtualCluster, zero_gradient
from microsparse_lab.methods.names import Variant, find_variants


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
    stream = simulated_stream(config)
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
        "stream": stream.description,
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


def _value_bytes(config: SimulateConfig, cluster: VirtualCluster) -> int:
    """Bytes of one value on the wire: ``config.value_dtype``'s, unless the sparsifier's
    framing sends its own (MiCRO's compact wire: int8 up to 16 ranks, bfloat16 beyond), as
    its engines then do."""
    wire = cluster.engines[0].value_dtype
    return VALUE_BYTES[config.value_dtype] if wire is None else wire.itemsize
