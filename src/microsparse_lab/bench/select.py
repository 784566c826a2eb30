"""``microsparse bench select``: per-step cost of every sparsifier, against top-k and one pass.

Two things are timed for each sparsifier, vector length d and worker count n, on rank 0 at
step 0 (the step rank 0 leads, so planned sparsifiers include the leader's plan):

- **selection**: the sparsifier's selection protocol as the reducer runs it, through the
  sparsifier's own code bound with ``bind(layout, 0, n)``: ``agreement`` → ``adopt_agreement``
  (the other ranks' contributions taken equal to this rank's) → ``select``; for planned
  sparsifiers ``make_plan`` → ``adopt_plan`` → ``select``;
- **overhead**: one ``GradientReducer.synchronize()``, everything it does on the rank except
  waiting on the network: the error-feedback add, selection, packing the index message,
  unpacking it (and the union), gathering the values, the finiteness check of their sum,
  writing the average into every ``p.grad`` and forgetting the sent positions. For n = 1 the
  reducer has no process group; for n > 1 it runs over
  :class:`~microsparse.comm.SymmetricPeers` (the other ranks send what rank 0 sends).

Both are compared with ``torch.topk(|a|, k)`` over the whole vector and with one memory pass
over d floats (``a.sum()``, the physical floor of anything that reads the whole gradient).
The gradient is Gaussian with per-layer scales on ResNet-18's layer sizes scaled to d,
calibrated so that λ_0 = 1/(2·sqrt(k)) selects about k entries (threshold sparsifiers are
timed at their working point). Sparsifiers that do not partition (union, shared and dense
exchanges) select over the whole vector whatever n is, so their selection is timed once per d.

Example:
    >>> result = run(SelectConfig(sizes=(20_000,), partitions=(1, 4), repeats=2))  # doctest: +SKIP
"""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from microsparse import GradientReducer
from microsparse.comm import SymmetricPeers
from microsparse.feedback import ErrorFeedback
from microsparse.layout import FlatVector, Layout
from microsparse.sparsifiers import Sparsifier, initial_threshold
from microsparse_lab.bench.output import (
    describe_machine,
    machine,
    markdown_table,
    significant,
    write_results,
)
from microsparse_lab.bench.timing import Timing, choose_clock, median_time
from microsparse_lab.bench.workload import (
    PARTITIONED,
    RESNET18_NUMEL,
    calibrate,
    model_layout,
    synthetic_gradient,
)
from microsparse_lab.methods.names import Variant, find_variants
from microsparse_lab.reports.plots import pyplot

DEFAULT_SIZES = (1_000_000, RESNET18_NUMEL, 100_000_000)
DEFAULT_PARTITIONS = (1, 4, 16, 64, 256, 1024)


@dataclass(frozen=True)
class SelectConfig:
    sizes: tuple[int, ...] = DEFAULT_SIZES
    partitions: tuple[int, ...] = DEFAULT_PARTITIONS
    density: float = 0.001
    repeats: int | None = None  # None: by size (15 up to 2 M entries, 7 up to 20 M, then 3)
    budget: float = 10.0  # seconds per measurement: slow ones repeat less, at least 3 times
    devices: tuple[str, ...] = ("cpu",)
    only: tuple[str, ...] | None = None  # labels of the variants to run; None: all
    seed: int = 0


def repeats_for(numel: int, given: int | None) -> int:
    if given is not None:
        return given
    return 15 if numel <= 2_000_000 else 7 if numel <= 20_000_000 else 3


def select_once(sparsifier: Sparsifier, accumulated: torch.Tensor, step: int) -> torch.Tensor:
    """One step of ``sparsifier``'s selection protocol, on the rank that leads ``step``.

    Mirrors ``GradientReducer.synchronize``: a planned sparsifier makes and adopts the plan;
    another may ask for an all-ranks sum first (``agreement``), which n identical ranks give
    as n times this rank's vector.
    """
    if sparsifier.planned:
        sparsifier.adopt_plan(sparsifier.make_plan(accumulated, step), step)
    elif sparsifier.agrees:
        proposal = sparsifier.agreement(accumulated, step)
        sparsifier.adopt_agreement(proposal.mul_(sparsifier.world_size))
    return sparsifier.select(accumulated, step)


def time_selection(
    variant: Variant,
    layout: Layout,
    gradient: torch.Tensor,
    density: float,
    world_size: int,
    repeats: int,
    budget: float,
) -> tuple[Timing, int]:
    """Median time of :func:`select_once` on rank 0 of ``world_size``, and its count."""
    sparsifier = variant.create(density)
    sparsifier.bind(layout, 0, world_size)
    select_once(sparsifier, gradient, 0)  # first call: buffers, generator, previous mean
    state = sparsifier.state_dict()
    timing = median_time(
        lambda: select_once(sparsifier, gradient, 0),
        repeats,
        setup=lambda: sparsifier.load_state_dict(state),
        device=gradient.device,
        budget=budget,
        clock=choose_clock(gradient.device),
    )
    sparsifier.load_state_dict(state)
    count = select_once(sparsifier, gradient, 0).numel()
    return timing, count


def time_overhead(
    variant: Variant,
    parameters: list[tuple[str, torch.nn.Parameter]],
    gradient: torch.Tensor,
    density: float,
    world_size: int,
    repeats: int,
    budget: float,
) -> tuple[Timing, dict[str, Any]]:
    """Median time of one ``synchronize()`` on rank 0 of ``world_size`` (network excluded).

    Before every call (untimed) the reducer's state is restored (step 0, zero residual, the
    sparsifier's state after its first step) and every ``p.grad`` is set to a tensor holding
    ``gradient``, as autograd leaves them after ``zero_grad()`` and backward.
    """
    reducer = GradientReducer(
        parameters, variant.name, density, collectives=SymmetricPeers(0, world_size),
        **variant.options,
    )  # fmt: skip
    # Autograd's fresh gradients, as after ``optimizer.zero_grad()`` (set to None) and
    # backward: separate tensors that synchronize() reads and then replaces by its views.
    fresh = [
        view.view_as(p).clone() for (_, p), view in zip(parameters, gradient.split(
            [p.numel() for _, p in parameters]))
    ]  # fmt: skip

    def restore_gradients() -> None:
        for (_, p), g in zip(parameters, fresh):
            p.grad = g

    restore_gradients()
    reducer.synchronize()  # first step: buffers and the sparsifier's first-step state
    initial = reducer.state_dict()
    initial["step"] = 0
    initial["residual"].zero_()

    def setup() -> None:
        reducer.load_state_dict(initial)
        restore_gradients()

    timing = median_time(
        reducer.synchronize,
        repeats,
        setup=setup,
        device=gradient.device,
        budget=budget,
        clock=choose_clock(gradient.device),
    )
    stats = reducer.last_step
    assert stats is not None
    record = {
        "selected": stats.selected,
        "local_selected": stats.local_selected,
        "max_local_selected": stats.max_local_selected,
        "bytes_sent": stats.bytes_sent,
    }
    return timing, record


def run(config: SelectConfig, progress: bool = True) -> dict[str, Any]:
    """Time every variant at every (device, d, n) of ``config``; returns the JSON record."""
    rows: list[dict[str, Any]] = []
    floors: list[dict[str, Any]] = []
    chosen = find_variants(config.only, config.density)
    started = machine()
    for device in config.devices:
        for numel in config.sizes:
            repeats = repeats_for(numel, config.repeats)
            layout = model_layout(numel)
            target = max(1, int(config.density * numel))
            generator = torch.Generator(device=device).manual_seed(config.seed)
            gradient = synthetic_gradient(layout, generator, device)
            calibrate(gradient, config.density, initial_threshold(target))
            floor = _floors(gradient, layout, target, repeats, config.budget)
            floors.append({"device": device, "numel": numel, "target": target, **floor})
            _say(progress, f"{device} d={numel:,}: topk {floor['topk_ms']:.2f} ms, "
                 f"one pass {floor['pass_ms']:.3f} ms")  # fmt: skip
            parameters = [
                (name, _parameter(shape, device))
                for name, shape in zip(layout.names, layout.shapes)
            ]
            for variant in chosen:
                whole_vector: tuple[Timing, int] | None = None
                for world_size in config.partitions:
                    probe = variant.create(config.density)
                    probe.bind(layout, 0, world_size)
                    exchange = probe.framing().label
                    if exchange not in PARTITIONED and whole_vector is not None:
                        selection, count = whole_vector
                    else:
                        selection, count = time_selection(
                            variant, layout, gradient, config.density, world_size, repeats,
                            config.budget,
                        )  # fmt: skip
                        whole_vector = (selection, count)
                    overhead, record = time_overhead(
                        variant, parameters, gradient, config.density, world_size, repeats,
                        config.budget,
                    )  # fmt: skip
                    row = {
                        "device": device,
                        "sparsifier": variant.label,
                        "name": variant.name,
                        "options": variant.options,
                        "exchange": exchange,
                        "numel": numel,
                        "target": target,
                        "world_size": world_size,
                        "select_ms": 1e3 * selection.median,
                        "select_samples": len(selection.samples),
                        "select_spread": selection.spread,
                        "select_count": count,
                        "overhead_ms": 1e3 * overhead.median,
                        "overhead_samples": len(overhead.samples),
                        "overhead_spread": overhead.spread,
                        **record,
                    }
                    for part in ("select", "overhead"):
                        row[f"{part}_per_topk"] = row[f"{part}_ms"] / floor["topk_ms"]
                        row[f"{part}_per_pass"] = row[f"{part}_ms"] / floor["pass_ms"]
                    rows.append(row)
                    _say(
                        progress,
                        f"  {variant.label:>16} n={world_size:<5} select "
                        f"{row['select_ms']:9.3f} ms, overhead {row['overhead_ms']:9.3f} ms",
                    )
                    if numel >= 10_000_000:  # free the reducer's d-sized buffers now
                        gc.collect()
            del parameters, gradient
    return {
        "benchmark": "select",
        "config": asdict(config),
        "machine": started,
        "load_average_at_end": machine()["load_average"],
        "clocks": {device: choose_clock(device) for device in config.devices},
        "floors": floors,
        "rows": rows,
    }


def _parameter(shape: torch.Size, device: str) -> torch.nn.Parameter:
    parameter = torch.nn.Parameter(torch.empty(shape, device=device))
    parameter.grad = torch.zeros(shape, device=device)
    return parameter


def _floors(
    gradient: torch.Tensor, layout: Layout, target: int, repeats: int, budget: float
) -> dict[str, Any]:
    """The references (top-k, one pass) and the dense passes every reducer step makes."""
    device = gradient.device

    def timed(work: Any, setup: Any = None, times: int = repeats) -> float:
        timing = median_time(
            work, times, setup=setup, device=device, budget=budget, clock=choose_clock(device)
        )
        return 1e3 * timing.median

    magnitude = torch.empty_like(gradient)
    floors = {
        "topk_ms": timed(
            lambda: torch.topk(torch.abs(gradient, out=magnitude), target, sorted=False)
        ),
        "pass_ms": timed(gradient.sum, times=max(repeats, 15)),
    }
    magnitude.resize_(0)  # free it before the next buffers
    feedback = ErrorFeedback(layout, gradient.dtype, device)
    grads = [g.view(shape) for g, shape in zip(gradient.split(list(layout.sizes)), layout.shapes)]
    positions = torch.randperm(layout.numel, device=device)[:target]
    output = FlatVector(layout, gradient.dtype, device).data
    floors["compensate_ms"] = timed(lambda: feedback.compensate(grads))
    floors["zero_ms"] = timed(output.zero_)
    floors["forget_ms"] = timed(lambda: feedback.forget(positions))
    return floors


def _say(progress: bool, line: str) -> None:
    if progress:
        print(line, flush=True)


def markdown(result: dict[str, Any]) -> str:
    """Per device and d: selection and overhead tables, sparsifiers × n."""
    end = ", ".join(f"{x:g}" for x in result["load_average_at_end"])
    clocks = ", ".join(f"{device}: {clock} time" for device, clock in result["clocks"].items())
    parts = [
        f"Machine: {describe_machine(result['machine'])}; load average {end} at the end. "
        f"Clock: {clocks}.",
        "",
    ]
    for floor in result["floors"]:
        rows = [
            r
            for r in result["rows"]
            if r["device"] == floor["device"] and r["numel"] == floor["numel"]
        ]
        sizes = sorted({r["world_size"] for r in rows})
        labels = list(dict.fromkeys(r["sparsifier"] for r in rows))
        parts.append(
            f"**{floor['device']}, d = {floor['numel']:,}, k = {floor['target']:,}**: "
            f"torch.topk {significant(floor['topk_ms'])} ms, one memory pass "
            f"{significant(floor['pass_ms'])} ms. Cells: median ms (× one pass)."
        )
        if "zero_ms" in floor:
            parts.append(
                "The dense pass of every step (ms): the error-feedback add "
                f"{significant(floor['compensate_ms'])}; a zeroing pass (the hook's bucket, "
                f"or p.grad changed in place) {significant(floor['zero_ms'])}; forgetting k "
                f"positions {significant(floor['forget_ms'])}."
            )
        for part, title in (("select", "Selection"), ("overhead", "Whole per-step overhead")):
            table = []
            for label in labels:
                cells = {r["world_size"]: r for r in rows if r["sparsifier"] == label}
                table.append(
                    [label]
                    + [
                        f"{significant(cells[n][f'{part}_ms'])} "
                        f"({significant(cells[n][f'{part}_per_pass'], 2)})"
                        if n in cells
                        else "–"
                        for n in sizes
                    ]
                )
            parts += [
                "",
                f"{title}:",
                "",
                markdown_table(["sparsifier"] + [f"n={n}" for n in sizes], table),
                "",
            ]
    return "\n".join(parts)


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    """``select_vs_n.png`` and ``overhead_vs_n.png``: one panel per (device, d)."""
    plt = pyplot()
    paths = []
    for part, title in (("select", "selection"), ("overhead", "whole per-step overhead")):
        floors = result["floors"]
        figure, axes = plt.subplots(
            1, len(floors), figsize=(4.2 * len(floors), 3.8), squeeze=False, sharey=True
        )
        for axis, floor in zip(axes[0], floors):
            rows = [
                r
                for r in result["rows"]
                if r["device"] == floor["device"] and r["numel"] == floor["numel"]
            ]
            labels = list(dict.fromkeys(r["sparsifier"] for r in result["rows"]))
            for index, label in enumerate(labels):
                mine = [r for r in rows if r["sparsifier"] == label]
                if label == "dense" and part == "select":
                    continue  # selects nothing
                axis.plot(
                    [r["world_size"] for r in mine],
                    [r[f"{part}_ms"] for r in mine],
                    marker="o",
                    markersize=3,
                    label=label,
                    color=f"C{index}",  # the same colour in both plots
                )
            axis.axhline(floor["topk_ms"], color="black", linestyle="--", linewidth=1)
            axis.axhline(floor["pass_ms"], color="grey", linestyle=":", linewidth=1)
            axis.text(1, floor["topk_ms"], " topk", va="bottom", fontsize=7)
            axis.text(1, floor["pass_ms"], " one pass", va="bottom", fontsize=7)
            workers = sorted({r["world_size"] for r in rows})
            axis.set_xscale("log", base=2)
            axis.set_xticks(workers, [str(n) for n in workers])
            axis.minorticks_off()
            axis.set_yscale("log")
            axis.set_xlabel("workers n (partitions)")
            axis.set_title(f"{floor['device']}, d = {floor['numel']:,}", fontsize=9)
            axis.grid(True, which="major", alpha=0.3)
        axes[0][0].set_ylabel(f"{title}, ms (median)")
        handles, labels = axes[0][0].get_legend_handles_labels()
        figure.legend(handles, labels, fontsize=7, loc="center right")
        figure.tight_layout(rect=(0, 0, 0.86, 1))
        path = out / f"{part}_vs_n.png"
        figure.savefig(path, dpi=90)
        plt.close(figure)
        paths.append(path)
    return paths


def write(result: dict[str, Any], out: str | Path, plots: bool = True) -> list[Path]:
    """Write ``select.json``, ``select.md`` and (with ``plots``) the PNGs into ``out``."""
    return write_results("select", result, out, markdown, plot if plots else None)
