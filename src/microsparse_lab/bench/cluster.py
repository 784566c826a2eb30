"""``microsparse bench cluster``: step time on a real, bandwidth-limited cluster on one machine.

For every host count and link rate, :class:`~microsparse_lab.bench.netns.Cluster` makes one
network namespace per host on a bridge, every link shaped with ``tc tbf``, and one worker
process per host (:mod:`microsparse_lab.bench.cluster_worker`) runs inside its namespace, talking
gloo over that link. The workers first probe the link (a timed dense all-reduce of a known
size, with the bytes the link really sent), then time training steps with each sparsifier
and with ``none``, the same training without any exchange (the no-communication bound).

Aggregation: each component of a step (compute, select, exchange, other) is averaged over
the workers, and the median over the recorded steps is reported; step time is the median of
the per-step worker mean of whole steps. Output in ``--out``: ``results.json`` (everything,
rewritten after every configuration, so an interrupted run keeps what it finished),
``results.md`` (the table, likewise) and ``cluster.png`` (stacked bars of the split).

Example:
    >>> config = BenchConfig(hosts=(2,), rates=("1gbit",), sparsifiers=("micro", "none"),
    ...                      model="tiny", steps=2, warmup=1, out="runs/bench")
    >>> results = run_benchmark(config)                                   # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import microsparse
from microsparse.ddp import CHOICE_PASS
from microsparse.sparsifiers import method_sparsifiers
from microsparse_lab.bench import netns
from microsparse_lab.bench.cluster_worker import MODELS, NO_EXCHANGE
from microsparse_lab.bench.output import cpu_model
from microsparse_lab.methods.names import DDP_FLOOR, DDP_KINDS, parse_method
from microsparse_lab.reports.plots import pyplot

PARTS = ("compute", "wait", "select", "exchange", "other")
"""The split of a step: forward + backward, waiting for the slowest worker, selection (with
error-feedback accumulation), collectives and writing back, the rest (optimiser step)."""
_LOG_TAIL = 3000  # characters of a failed worker's log shown in the error


def default_sparsifiers() -> tuple[str, ...]:
    """``dense``, every other registered sparsifier (the loop API), MiCRO through the DDP
    hook, the peers a user would pick instead (:mod:`~microsparse_lab.methods.names`),
    ``none@ddp`` (DDP's own cost, no exchange) and ``none`` (the no-exchange bound).

    Example:
        >>> names = default_sparsifiers()
        >>> names[0], names[-1], "micro@ddp" in names, "powersgd(rank=4)" in names
        ('dense', 'none', True, True)
    """
    others = [name for name in method_sparsifiers() if name != "dense"]
    peer_rows = ("ddp", "powersgd", "powersgd(rank=4)", "fp16", "bf16")
    return ("dense", *others, "micro@ddp", *peer_rows, DDP_FLOOR, NO_EXCHANGE)


@dataclass(frozen=True)
class BenchConfig:
    """One ``microsparse bench cluster`` run: the matrix and how each cell is measured."""

    hosts: tuple[int, ...] = (2, 4)  # host namespaces, one worker each
    rates: tuple[str, ...] = ("1gbit", "100mbit")  # tc rate of every link, each direction
    sparsifiers: tuple[str, ...] = field(default_factory=default_sparsifiers)
    density: float = 0.001
    steps: int = 8  # recorded steps per sparsifier, shared between the rounds
    warmup: int = 2  # unrecorded steps before every round
    rounds: int = 2  # passes over the sparsifiers, so that a burst of load hits them all
    model: str = "resnet18"
    batch_size: int = 8  # random CIFAR-shaped images per worker and step
    threshold_start: str = "settled"  # "cold": adaptive thresholds start at 1/(2·sqrt(k))
    probe_numel: int = 2_000_000  # float32 values of the link probe's all-reduce (8 MB)
    timeout: float = 1200.0  # seconds per configuration before the run is abandoned
    out: str = "runs/bench-cluster"

    def __post_init__(self) -> None:
        # Fail here, with the option's name, rather than in every worker inside the cluster.
        for name in self.sparsifiers:
            try:
                method = parse_method(name)
            except ValueError as error:
                raise ValueError(f"sparsifiers: {error}") from None
            if method.kind == "sharded":
                raise ValueError(f"sparsifiers: {name!r}: sharded training is measured by "
                                 "bench accuracy (--ranks-per-host 2), not here")  # fmt: skip
            # Each round attaches a new state, which chooses at its pass CHOICE_PASS.
            if method.min_speedup is not None and self.warmup < CHOICE_PASS:
                raise ValueError(
                    f"sparsifiers: {name!r} takes its choice after {CHOICE_PASS} passes, so "
                    f"that recorded steps come after it: give --warmup {CHOICE_PASS} or more "
                    f"(got {self.warmup})"
                )
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if not self.hosts or min(self.hosts) < 2 or max(self.hosts) > netns.MAX_HOSTS:
            raise ValueError(f"hosts must be between 2 and {netns.MAX_HOSTS}, got {self.hosts}")
        for rate in self.rates:
            netns.rate_bits(rate)
        if not 1 <= self.rounds <= self.steps:
            raise ValueError(
                f"rounds must be between 1 and steps ({self.steps}), got {self.rounds}"
            )
        if self.threshold_start not in ("settled", "cold"):
            raise ValueError(
                f"threshold_start must be 'settled' or 'cold', got {self.threshold_start!r}"
            )


QUICK = {
    "hosts": (2,),
    "rates": ("1gbit", "100mbit"),
    "sparsifiers": ("dense", "micro", "topk", NO_EXCHANGE),
    "steps": 5,
    "warmup": 2,
    "rounds": 1,
}
"""What ``--quick`` changes: a small matrix (about 2 minutes here)."""


class BenchError(RuntimeError):
    """A configuration could not be measured (a worker failed or timed out)."""


def refusal(euid: int | None = None, command: str = "cluster") -> str | None:
    """Why this machine cannot run the benchmark (one line naming the fix), or None.

    Example:
        >>> print(refusal(euid=1000))
        needs root to create network namespaces and shape links with tc; run it as root, e.g. sudo .venv/bin/microsparse bench cluster
    """  # noqa: E501
    if (os.geteuid() if euid is None else euid) != 0:
        return (
            "needs root to create network namespaces and shape links with tc; run it as root, "
            f"e.g. sudo .venv/bin/microsparse bench {command}"
        )
    missing = netns.missing_tools()
    if missing:
        return (
            f"needs {' and '.join(missing)} from iproute2, which is not installed; install it "
            "(Debian/Ubuntu: apt-get install iproute2)"
        )
    return None


def run_benchmark(
    config: BenchConfig, log: Callable[[str], None] = print, command: str = ""
) -> dict[str, Any]:
    """Measure every (hosts, rate) configuration; write and return the results.

    Raises :class:`BenchError` if a configuration fails, :class:`netns.NetnsError` if the
    cluster cannot be built, and :class:`netns.Interrupted` (a ``KeyboardInterrupt``) on
    SIGINT, SIGTERM or SIGHUP; the namespaces are gone in every case.
    """
    out = Path(config.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "command": command,
        "config": asdict(config),
        "machine": machine(),
        "configurations": [],
    }
    for hosts in config.hosts:
        for rate in config.rates:
            log(f"[{hosts} hosts, {rate}] building the cluster, starting {hosts} workers")
            load_before = os.getloadavg()
            with netns.Cluster(hosts, rate) as cluster:
                raw = _measure(cluster, config, out)
            measured = summarize_configuration(raw, hosts, rate)
            measured["load_average"] = {"before": load_before, "after": os.getloadavg()}
            results["configurations"].append(measured)
            results["machine"]["load_average_end"] = os.getloadavg()
            _write_results(results, out, log, final=False)
            log(_describe(measured))
    _write_results(results, out, log, final=True)
    return results


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "microsparse": microsparse.__version__,
        "load_average_start": os.getloadavg(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def _measure(cluster: netns.Cluster, config: BenchConfig, out: Path) -> dict[str, Any]:
    """Run one worker per host inside the cluster; return rank 0's JSON."""
    name = f"hosts{cluster.hosts}-{cluster.rate}"
    result_file = out / "raw" / f"{name}.json"
    result_file.parent.mkdir(parents=True, exist_ok=True)
    result_file.unlink(missing_ok=True)
    package_root = str(Path(microsparse.__file__).resolve().parent.parent)
    threads = max(1, (os.cpu_count() or 1) // cluster.hosts)
    workers: list[tuple[int, subprocess.Popen[Any], Path]] = []
    for rank in reversed(range(cluster.hosts)):  # rank 0 last: the others are listening
        env = dict(os.environ)
        env.update(
            GLOO_SOCKET_IFNAME=cluster.interface(rank),
            OMP_NUM_THREADS=str(threads),
            PYTHONPATH=os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")])),
        )
        argv = [
            sys.executable, "-m", "microsparse_lab.bench.cluster_worker",
            "--rank", str(rank), "--world-size", str(cluster.hosts),
            "--master-addr", cluster.address(0), "--interface", cluster.interface(rank),
            "--sparsifiers", ",".join(config.sparsifiers), "--density", repr(config.density),
            "--steps", str(config.steps), "--warmup", str(config.warmup),
            "--rounds", str(config.rounds),
            "--model", config.model, "--batch-size", str(config.batch_size),
            "--threshold-start", config.threshold_start,
            "--probe-numel", str(config.probe_numel), "--threads", str(threads),
            "--timeout", str(config.timeout), "--out", str(result_file),
        ]  # fmt: skip
        log_file = out / "logs" / f"{name}-rank{rank}.log"
        with open(log_file, "w", encoding="utf-8") as stream:
            process = cluster.popen(rank, argv, env=env, stdout=stream, stderr=subprocess.STDOUT)
        workers.append((rank, process, log_file))
    wait_for_workers(workers, config.timeout, cluster)
    return json.loads(result_file.read_text(encoding="utf-8"))


def wait_for_workers(
    workers: list[tuple[int, subprocess.Popen[Any], Path]],
    timeout: float,
    cluster: netns.Cluster,
) -> None:
    """Wait for every worker; on the first failure, a signal or the timeout raise (the
    cluster's clean-up then stops the rest)."""
    deadline = time.monotonic() + timeout
    while True:
        cluster.raise_if_interrupted()
        codes = [(rank, process.poll(), log) for rank, process, log in workers]
        failed = [(rank, code, log) for rank, code, log in codes if code not in (None, 0)]
        if failed:
            rank, code, log = min(failed, key=lambda item: item[0])
            tail = log.read_text(encoding="utf-8", errors="replace")[-_LOG_TAIL:]
            raise BenchError(f"worker {rank} exited with code {code}; end of {log}:\n{tail}")
        if all(code == 0 for _, code, _ in codes):
            return
        if time.monotonic() > deadline:
            raise BenchError(
                f"workers still running after {timeout:.0f} s; logs in {workers[0][2].parent}"
            )
        time.sleep(0.2)


def summarize_configuration(raw: dict[str, Any], hosts: int, rate: str) -> dict[str, Any]:
    """Medians per sparsifier from the workers' step records, and the link probe.

    Example:
        >>> summary = summarize_configuration(json.load(open("raw/hosts2-1gbit.json")),
        ...                                   2, "1gbit")                   # doctest: +SKIP
        >>> summary["rows"][0]["step_ms"], summary["probe"]["wire_gbit_per_s"]  # doctest: +SKIP
    """
    ranks = sorted(raw["ranks"], key=lambda report: report["rank"])
    probe = dict(ranks[0]["probe"])
    probe["nominal_gbit_per_s"] = netns.rate_bits(rate) / 1e9
    rows = [
        _summarize_run([report["runs"][index] for report in ranks])
        for index in range(len(ranks[0]["runs"]))
    ]
    by_name = {row["sparsifier"]: row for row in rows}
    dense, bound = by_name.get("dense"), by_name.get(NO_EXCHANGE)
    floor = by_name.get(DDP_FLOOR)
    for row in rows:
        row["speedup_vs_dense"] = dense["step_ms"] / row["step_ms"] if dense else None
        row["over_bound"] = row["step_ms"] / bound["step_ms"] if bound else None
        through_ddp = floor is not None and row["kind"] in DDP_KINDS
        row["over_ddp_floor"] = row["step_ms"] / floor["step_ms"] if through_ddp else None
    return {"hosts": hosts, "rate": rate, "probe": probe, "rows": rows}


def _summarize_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One sparsifier's record on every rank -> medians over steps of the mean over ranks."""
    steps = min(len(run["steps"]) for run in runs)

    def median_ms(part: str) -> float:
        per_step = [statistics.fmean(run["steps"][i][part] for run in runs) for i in range(steps)]
        return 1000 * statistics.median(per_step)

    first = runs[0]
    name = first["sparsifier"]
    records = first["steps"][:steps]
    wire = [run["wire_bytes_per_step"] for run in runs]
    kind = first.get("kind") or parse_method(name).kind  # records of older runs lack it
    density = None
    if kind in ("loop", "hook"):
        density = statistics.median(r["selected"] / first["parameters"] for r in records)
    return {
        "sparsifier": name,
        "parameters": first["parameters"],
        "steps": steps,
        "step_ms": median_ms("total"),
        **{f"{part}_ms": median_ms(part) for part in PARTS},
        "density": density,
        "kind": kind,
        "selected_over_target": None
        if kind not in ("loop", "hook") or name == "dense"
        else statistics.median(r["selected"] / r["target"] for r in records),
        "modelled_bytes_per_step": statistics.median(r["bytes_sent"] for r in records),
        "wire_bytes_per_step": None if None in wire else statistics.fmean(wire),
    }


def _describe(measured: dict[str, Any]) -> str:
    probe = measured["probe"]
    lines = [f"[{measured['hosts']} hosts, {measured['rate']}] {_probe_text(probe)}"]
    for row in measured["rows"]:
        lines.append(
            f"  {row['sparsifier']:>15}: {row['step_ms']:8.1f} ms/step ("
            + ", ".join(f"{part} {row[f'{part}_ms']:.1f}" for part in PARTS)
            + ")"
        )
    return "\n".join(lines)


def _probe_text(probe: dict[str, Any]) -> str:
    achieved = probe["wire_gbit_per_s"] or probe["modelled_gbit_per_s"]
    source = "sent on the wire" if probe["wire_gbit_per_s"] else "modelled"
    return (
        f"link probe: all-reduce of {probe['payload_bytes'] / 1e6:.0f} MB in "
        f"{1000 * probe['seconds']:.0f} ms, {achieved:.3f} Gbit/s {source} by host 0 "
        f"(nominal {probe['nominal_gbit_per_s']:g} Gbit/s)"
    )


def _write_results(
    results: dict[str, Any], out: Path, log: Callable[[str], None], final: bool
) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    (out / "results.md").write_text(to_markdown(results), encoding="utf-8")
    if not final:
        return
    written = ["results.json", "results.md"]
    try:
        plot(results, out / "cluster.png")
        written.append("cluster.png")
    except ModuleNotFoundError:
        log("matplotlib is not installed: no plot (pip install matplotlib, the `plots` extra)")
    log(f"wrote {', '.join(str(out / name) for name in written)}")


def to_markdown(results: dict[str, Any]) -> str:
    """The results as a Markdown table, one row per (hosts, rate, sparsifier), with the link
    probes and the machine above it."""
    config, host = results["config"], results["machine"]
    lines = [
        f"Model {config['model']}, batch {config['batch_size']} per worker, density "
        f"{config['density']:g}, {config['steps']} recorded steps in {config.get('rounds', 1)} "
        f"round(s), each after {config['warmup']} warm-up steps, thresholds "
        f"{config['threshold_start']}. Rows: microsparse through the loop API, or the DDP "
        "hook (`@ddp`); the peers through DDP (`microsparse_lab.methods.names`).",
        f"Machine: {host['cpu']}, {host['cores']} cores, torch {host['torch']}; load average "
        f"{_load(host['load_average_start'])} at the start, "
        f"{_load(host.get('load_average_end', host['load_average_start']))} at the end.",
        "",
    ]
    for measured in results["configurations"]:
        lines.append(f"- {measured['hosts']} hosts, {measured['rate']}: "
                     f"{_probe_text(measured['probe'])}")  # fmt: skip
    lines += [
        "",
        "| hosts | link | sparsifier | step ms | compute | wait | select | exchange | other "
        "| speed-up vs dense | × no-comm bound | × DDP floor | density | MB sent/step (model) "
        "| MB on wire/step |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for measured in results["configurations"]:
        for row in measured["rows"]:
            cells = [
                str(measured["hosts"]),
                measured["rate"],
                row["sparsifier"],
                f"{row['step_ms']:.0f}",
                *(f"{row[f'{part}_ms']:.1f}" for part in PARTS),
                _maybe(row["speedup_vs_dense"], "{:.2f}×"),
                _maybe(row["over_bound"], "{:.2f}"),
                _maybe(row.get("over_ddp_floor"), "{:.2f}"),
                _maybe(row["density"], "{:.3%}"),
                f"{row['modelled_bytes_per_step'] / 1e6:.3f}",
                _maybe(row["wire_bytes_per_step"], "{:.3f}", scale=1e-6),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    """Stacked horizontal bars of the step split, one panel per (hosts, rate), with the
    no-communication bound as a dashed line and DDP's own cost (``none@ddp``) dotted."""
    plt = pyplot()
    configurations = results["configurations"]
    hosts = sorted({c["hosts"] for c in configurations})
    rates = list(dict.fromkeys(c["rate"] for c in configurations))
    figure, axes = plt.subplots(
        len(hosts),
        len(rates),
        figsize=(6 * len(rates), 0.45 * len(configurations[0]["rows"]) * len(hosts) + 1.5),
        squeeze=False,
    )
    colors = {
        "compute": "#4c72b0",
        "wait": "#ccb974",
        "select": "#dd8452",
        "exchange": "#c44e52",
        "other": "#8c8c8c",
    }
    for measured in configurations:
        axis = axes[hosts.index(measured["hosts"])][rates.index(measured["rate"])]
        rows = measured["rows"]
        names = [row["sparsifier"] for row in rows]
        left = [0.0] * len(rows)
        for part in PARTS:
            widths = [max(0.0, row[f"{part}_ms"]) for row in rows]
            axis.barh(names, widths, left=left, color=colors[part], label=part)
            left = [a + b for a, b in zip(left, widths)]
        for name, style in ((NO_EXCHANGE, "--"), (DDP_FLOOR, ":")):
            line = next((row for row in rows if row["sparsifier"] == name), None)
            if line:
                axis.axvline(line["step_ms"], color="black", linestyle=style, linewidth=1)
        axis.invert_yaxis()
        axis.set_title(f"{measured['hosts']} hosts, {measured['rate']} links")
        axis.set_xlabel("median step time, ms")
    axes[0][0].legend(loc="lower right", fontsize="small")
    figure.suptitle(
        f"{results['config']['model']}, density {results['config']['density']:g}: "
        "step time and its split (dashed: no-exchange bound; dotted: DDP with no exchange)"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _maybe(value: float | None, template: str, scale: float = 1.0) -> str:
    return "–" if value is None else template.format(value * scale)


def _load(values: Sequence[float]) -> str:
    return " / ".join(f"{value:.2f}" for value in values)


__all__ = [
    "BenchConfig",
    "BenchError",
    "MODELS",
    "QUICK",
    "default_sparsifiers",
    "refusal",
    "run_benchmark",
    "summarize_configuration",
    "to_markdown",
    "wait_for_workers",
]
