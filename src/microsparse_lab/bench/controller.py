"""``microsparse bench controller``: how well each threshold rule keeps K at k, step by step.

MiCRO with every rule of ``microsparse.sparsifiers.THRESHOLD_RULES`` (whatever the
registry holds when it runs) is fed three gradient streams with error feedback:

- ``stationary``: g_t = σ·z_t, z_t ~ N(0, 1) per entry with ResNet-18-like per-layer scales,
  σ chosen so that the starting threshold λ_0 = 1/(2·sqrt(k)) selects about
  ``initial_excess``·k entries at step 0, or 90 % of d if that is fewer (the paper's first
  step sent ~114× the target);
- ``scale-drop``: the same but starting on target (λ_0 selects about k), then × ``drop_factor``
  from step ``drop_at`` and back (× 1/0.3) at ``rise_at``: what a learning-rate decay or
  warm-up does to the gradient's scale;
- ``captured``: rank 0's real gradients from ``microsparse train --capture-gradients``,
  replayed once in order (as many steps as were captured, at most ``steps``), at their own
  scale.

With one worker the run is exactly MiCRO with n = 1: a ``GradientReducer`` without a process
group, one ``synchronize()`` per step. MiCRO runs with the padded index message
(:func:`micro_options`), so that K is what the threshold selects. With ``workers`` > 1 the
virtual workers of :class:`~microsparse_lab.bench.virtual.VirtualCluster` each get the stream
plus their own Gaussian noise (ρ = ``noise_ratio`` times the per-layer rms: the one stream model
of :mod:`microsparse_lab.bench.streams`).

Reported per (stream, rule): K_0/k; steps to converge (the first step after which K/k stays
within ±``band`` for ``window`` steps); the mean |K/k − 1| after convergence; for the
scale-drop stream, the steps to recover after the drop and after the rise.

Example:
    >>> result = run(ControllerConfig(numel=20_000, density=0.05, steps=50))  # doctest: +SKIP
"""

from __future__ import annotations

import inspect
import math
import statistics
import textwrap
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Generator

from microsparse import GradientReducer
from microsparse.sparsifiers import THRESHOLD_RULES, create_sparsifier, initial_threshold
from microsparse_lab.bench.capture import load_capture
from microsparse_lab.bench.output import (
    describe_machine,
    machine,
    markdown_table,
    significant,
    write_results,
)
from microsparse_lab.bench.streams import Stream
from microsparse_lab.bench.virtual import VirtualCluster
from microsparse_lab.bench.workload import (
    expand,
    layer_scales,
    model_layout,
    quantile_of_magnitude,
)
from microsparse_lab.reports.plots import pyplot

CAPTURE_TARGET = 10_000
"""Captured stream: the density is chosen so that k is at least this."""


@dataclass(frozen=True)
class ControllerConfig:
    numel: int = 500_000  # synthetic streams
    density: float = 0.02  # k = 10,000
    steps: int = 1000
    drop_at: int = 400
    rise_at: int = 700
    drop_factor: float = 0.3
    initial_excess: float = 100.0
    capture: str | None = None  # directory from microsparse train --capture-gradients
    capture_density: float | None = None  # None: the least density with k >= 10,000
    rules: tuple[str, ...] | None = None  # None: every rule in THRESHOLD_RULES
    workers: int = 1
    noise_ratio: float = 1.0  # workers > 1: per-worker noise, × per-layer rms of the stream
    band: float = 0.1
    window: int = 20
    seed: int = 0


def synthetic_streams(config: ControllerConfig) -> list[Stream]:
    """The stationary and scale-drop streams of ``config``."""
    layout = model_layout(config.numel)
    scales = expand(layer_scales(layout), layout)
    target = max(1, int(config.density * config.numel))
    probe = torch.randn(config.numel, generator=torch.Generator().manual_seed(config.seed + 1))
    probe.mul_(scales)

    def sigma_for(excess: float) -> float:
        """σ at which λ_0 selects ``excess``·k of N(0, σ²·scales²)."""
        fraction = min(excess * config.density, 0.9)  # a quantile, not the smallest entries
        return initial_threshold(target) / quantile_of_magnitude(probe, 1.0 - fraction)

    excess = min(config.initial_excess, 0.9 / config.density)

    def gaussian(sigma: float, drop: bool = False) -> Callable[[int, Generator], torch.Tensor]:
        def shared(step: int, generator: Generator) -> torch.Tensor:
            factor = sigma
            if drop and config.drop_at <= step < config.rise_at:
                factor *= config.drop_factor
            return torch.randn(config.numel, generator=generator).mul_(scales).mul_(factor)

        return shared

    start, settled = sigma_for(excess), sigma_for(1.0)
    shape = f"N(0, σ²) with per-layer scales, d = {config.numel:,}"
    return [
        Stream(
            "stationary",
            layout,
            gaussian(start),
            f"{shape}, σ set so that λ_0 selects {excess:.3g}·k at step 0",
            config.steps,
            config.noise_ratio,
            config.density,
        ),
        Stream(
            "scale-drop",
            layout,
            gaussian(settled, drop=True),
            f"{shape}, σ set so that λ_0 selects k at step 0 (every rule starts on target); "
            f"× {config.drop_factor:g} from step {config.drop_at} to {config.rise_at - 1}",
            config.steps,
            config.noise_ratio,
            config.density,
        ),
    ]


def captured_stream(config: ControllerConfig) -> Stream:
    """Rank 0's captured gradients, in order, once (at most ``config.steps`` of them).

    Not cycled: the gradient scale of a training run falls as the loss does, and jumping
    back to step 0 would add a scale jump that the run did not have.
    """
    assert config.capture is not None
    capture = load_capture(config.capture)
    numel = capture.layout.numel
    density = config.capture_density or min(1.0, math.ceil(1000 * CAPTURE_TARGET / numel) / 1000)
    steps = min(config.steps, capture.steps)
    cache: dict[int, torch.Tensor] = {}

    def shared(step: int, generator: Generator) -> torch.Tensor:
        if step not in cache:
            cache[step] = capture.gradient(capture.ranks[0], step)
        return cache[step]

    meta = capture.metadata
    return Stream(
        "captured",
        capture.layout,
        shared,
        f"rank {capture.ranks[0]}'s gradients of {meta.get('task', '?')}/"
        f"{meta.get('model', '?')}, its first {steps} steps in order, d = {numel:,}, at their "
        "own scale",
        steps,
        config.noise_ratio,
        density,
    )


def micro_options(rule: str) -> dict[str, Any]:
    """MiCRO with threshold rule ``rule`` and, where offered, the padded index message.

    The default ``fixed`` message caps what is sent at its capacity (1.25·k/n + 8), which would
    hide how far the threshold itself is off; padded, K is exactly what the threshold selects.
    """
    options: dict[str, Any] = {"threshold_rule": rule}
    offered = inspect.signature(type(create_sparsifier("micro", 0.5)).__init__).parameters
    if "index_message" in offered:
        options["index_message"] = "padded"
    return options


def run_rule(stream: Stream, rule: str, config: ControllerConfig) -> list[float]:
    """K_t / k for every step of ``stream`` under MiCRO with threshold rule ``rule``."""
    ratios = []
    options = micro_options(rule)
    assert stream.steps is not None and stream.density is not None
    generator = torch.Generator().manual_seed(config.seed)
    if config.workers == 1:
        parameter = torch.nn.Parameter(torch.zeros(stream.layout.numel))
        parameter.grad = torch.zeros_like(parameter)
        reducer = GradientReducer([parameter], "micro", stream.density, **options)
        for step in range(stream.steps):
            # synchronize() overwrites p.grad with the average
            parameter.grad.copy_(stream.shared(step, generator))
            stats = reducer.synchronize()
            ratios.append(stats.selected / stats.target)
        return ratios
    cluster = VirtualCluster("micro", stream.density, stream.layout, config.workers, **options)
    noise = torch.Generator().manual_seed(config.seed + 2)
    for step in range(stream.steps):
        record = cluster.step(stream.source(step, generator, noise))
        ratios.append(record.selected / record.target)
    return ratios


def converged_at(ratios: list[float], band: float, window: int, start: int = 0) -> int | None:
    """First step s ≥ ``start`` with |K/k − 1| ≤ ``band`` at every step of [s, s + window).

    Example:
        >>> converged_at([3.0, 1.5, 1.05, 0.98, 1.02, 1.0], band=0.1, window=3)
        2
        >>> converged_at([3.0, 1.05, 2.0], band=0.1, window=2) is None
        True
    """
    run = 0
    for step in range(start, len(ratios)):
        run = run + 1 if abs(ratios[step] - 1.0) <= band else 0
        if run == window:
            return step - window + 1
    return None


def summarize(ratios: list[float], stream: str, config: ControllerConfig) -> dict[str, Any]:
    """The numbers of the module docstring for one (stream, rule)."""
    errors = [abs(r - 1.0) for r in ratios]
    converged = converged_at(ratios, config.band, config.window)
    summary: dict[str, Any] = {
        "first_ratio": ratios[0],
        "steps_to_converge": converged,
        "mean_error_after_convergence": statistics.fmean(errors[converged:])
        if converged is not None
        else None,
        "mean_ratio_after_convergence": statistics.fmean(ratios[converged:])
        if converged is not None
        else None,
        "mean_error": statistics.fmean(errors),
    }
    if stream == "scale-drop":
        for event, at in (("drop", config.drop_at), ("rise", config.rise_at)):
            if at < len(ratios):
                back = converged_at(ratios, config.band, config.window, start=at)
                summary[f"steps_to_recover_after_{event}"] = None if back is None else back - at
        low = ratios[config.drop_at : config.rise_at]
        summary["mean_ratio_while_dropped"] = statistics.fmean(low) if low else None
    return summary


def run(config: ControllerConfig, progress: bool = True) -> dict[str, Any]:
    """Every (stream, rule); returns the JSON record with per-step K/k."""
    rules = config.rules or THRESHOLD_RULES
    unknown = sorted(set(rules) - set(THRESHOLD_RULES))
    if unknown:
        raise ValueError(
            f"unknown threshold rule(s) {', '.join(unknown)}; choose from "
            f"{', '.join(THRESHOLD_RULES)}"
        )
    streams = synthetic_streams(config)
    if config.capture:
        streams.append(captured_stream(config))
    started = machine()
    rows = []
    for stream in streams:
        for rule in rules:
            ratios = run_rule(stream, rule, config)
            summary = summarize(ratios, stream.name, config)
            rows.append({
                "stream": stream.name,
                "rule": rule,
                "numel": stream.layout.numel,
                "density": stream.density,
                "target": max(1, int(stream.density * stream.layout.numel)),
                **summary,
                "ratios": ratios,
            })  # fmt: skip
            if progress:
                print(
                    f"{stream.name:>11} {rule:>10}: K_0/k {summary['first_ratio']:8.2f}, "
                    f"converged at {summary['steps_to_converge']}, mean |K/k-1| after "
                    f"{significant(summary['mean_error_after_convergence'] or float('nan'))}",
                    flush=True,
                )
    return {
        "benchmark": "controller",
        "config": asdict(config),
        "rules": list(rules),
        "options": {k: v for k, v in micro_options(rules[0]).items() if k != "threshold_rule"},
        "streams": {stream.name: stream.description for stream in streams},
        "machine": started,
        "load_average_at_end": machine()["load_average"],
        "rows": rows,
    }


def markdown(result: dict[str, Any]) -> str:
    config = result["config"]
    parts = [
        f"MiCRO ({', '.join(f'{k}={v}' for k, v in result['options'].items())}) with "
        f"{config['workers']} worker(s); converged = |K/k − 1| ≤ {config['band']:g} "
        f"for {config['window']} steps in a row. Streams:",
        "",
    ]
    parts += [f"- `{name}`: {text}" for name, text in result["streams"].items()]
    table = []
    for row in result["rows"]:
        recover = [row.get(f"steps_to_recover_after_{event}", "–") for event in ("drop", "rise")]
        table.append([
            row["stream"],
            row["rule"],
            f"{row['numel']:,} / {row['target']:,}",
            significant(row["first_ratio"]),
            "never" if row["steps_to_converge"] is None else row["steps_to_converge"],
            significant(row["mean_error_after_convergence"] or float("nan"), 2),
            significant(row["mean_ratio_after_convergence"] or float("nan"), 3),
            *("never" if value is None else value for value in recover),
            significant(row.get("mean_ratio_while_dropped") or float("nan"), 2),
        ])  # fmt: skip
    parts += [
        "",
        markdown_table(
            [
                "stream",
                "rule",
                "d / k",
                "K_0/k",
                "steps to converge",
                "mean \\|K/k−1\\| after",
                "mean K/k after",
                "recover after drop",
                "recover after rise",
                "mean K/k while dropped",
            ],
            table,
        ),  # fmt: skip
        "",
        f"Machine: {describe_machine(result['machine'])}.",
    ]
    return "\n".join(parts)


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    """``density_vs_step.png``: K/k per step, one panel per stream, one line per rule."""
    plt = pyplot()
    from matplotlib import ticker

    config = result["config"]
    streams = list(dict.fromkeys(row["stream"] for row in result["rows"]))
    figure, axes = plt.subplots(
        len(streams), 1, figsize=(8, 2.8 * len(streams)), squeeze=False, sharex=False
    )
    for axis, stream in zip(axes[:, 0], streams):
        for row in (r for r in result["rows"] if r["stream"] == stream):
            axis.plot(row["ratios"], linewidth=1, label=row["rule"])
        axis.axhspan(1 - config["band"], 1 + config["band"], color="green", alpha=0.12)
        axis.axhline(1.0, color="black", linewidth=0.6)
        if stream == "scale-drop":
            for at in (config["drop_at"], config["rise_at"]):
                axis.axvline(at, color="grey", linestyle="--", linewidth=0.8)
        axis.set_yscale("log")
        axis.set_ylabel("actual / target density")
        title = textwrap.fill(f"{stream}: {result['streams'][stream]}", 110)
        axis.set_title(title, fontsize=8)
        axis.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.yaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}"))
        axis.yaxis.set_minor_formatter(ticker.NullFormatter())
        axis.grid(True, alpha=0.3)
    axes[-1][0].set_xlabel("step")
    axes[0][0].legend(fontsize=8, loc="upper right")
    figure.tight_layout()
    path = out / "density_vs_step.png"
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return [path]


def write(result: dict[str, Any], out: str | Path, plots: bool = True) -> list[Path]:
    """Write ``controller.json``, ``controller.md`` and (with ``plots``) the PNG into ``out``."""
    return write_results("controller", result, out, markdown, plot if plots else None)
