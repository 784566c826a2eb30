"""Time to accuracy on the test bed: real training of a real task, per method and network.

For every link rate a cluster of ``hosts`` network namespaces is built
(:class:`~microsparse_lab.bench.netns.Cluster`); for every method, each host runs one rank of an
ordinary ``microsparse train`` (torchrun's variables, over the shaped link; with
``ranks_per_host`` several, which talk among themselves over the host's loopback) into
``OUT/<rate>/<method>``. Each rate then gets the report of ``microsparse report``: the metric
against epochs and against wall time, and per method the epochs, wall seconds, steps and
bytes per worker to a target fixed in advance (``target_fraction`` of the dense run's final
metric; for a metric where lower is better, 2 − that fraction of it). Each method's bytes
between hosts per step are read from the hosts' links (what each host's switch port received,
every header and retransmission included, and its packets) just after its first step is
logged and just after its last, so that the set-up (rank 0's initial weights, sent to every
rank) and the final evaluation are left out; they are reported per host and step beside the
bytes its statistics model.

A method is named as in :mod:`microsparse_lab.methods.names`: a sparsifier (the loop API), a
sparsifier with ``@ddp`` (microsparse's DDP hook), or a peer (``ddp``, ``fp16``, ``bf16``,
``powersgd(rank=R)``: DDP with torch's hooks, ``microsparse train --ddp-hook``). ``none``
(no exchange) is no training method and is refused.

Example:
    >>> config = AccuracyConfig(rates=("100mbit",), methods=("dense", "micro", "powersgd"))
    >>> train_arguments("micro@ddp", config)[:4]   # no amount: train's default
    ['--task', 'mnist', '--sparsifier', 'micro']
    >>> train_arguments("micro(density=0.001)", config)[:4]
    ['--task', 'mnist', '--density', '0.001']
    >>> train_arguments("micro(budget=0.002)", config)[:4]
    ['--task', 'mnist', '--budget', '0.002']
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import microsparse
from microsparse_lab.bench import netns
from microsparse_lab.bench.cluster import machine, wait_for_workers
from microsparse_lab.methods.names import parse_method
from microsparse_lab.reports import load_run, write_report
from microsparse_lab.reports.table import results_table
from microsparse_lab.training.tasks import available_tasks

DEFAULT_METHODS = (
    "dense", "micro", "micro@ddp", "ddp", "powersgd", "powersgd(rank=4)", "fp16",
)  # fmt: skip
"""What the issue of users asks for: dense, MiCRO (loop and hook), and torch's choices."""
TARGET_FRACTION = 0.98
"""Target: 98 % of the dense run's final metric (lower is better: 102 %)."""


@dataclass(frozen=True)
class AccuracyConfig:
    """One ``microsparse bench accuracy`` run."""

    task: str = "mnist"
    hosts: int = 4
    ranks_per_host: int = 1  # ranks of a host share its namespace and talk over loopback
    rates: tuple[str, ...] = ("100mbit", "1gbit")
    methods: tuple[str, ...] = DEFAULT_METHODS
    density: float | None = None  # None (and no budget): train's default, DEFAULT_BUDGET
    budget: float | None = None  # instead of density: a fraction of dense's bytes
    seed: int = 1
    target_fraction: float = TARGET_FRACTION
    train_args: tuple[str, ...] = ()  # given to every ``microsparse train`` (``--epochs 10``)
    timeout: float = 3600.0  # seconds one training may take
    out: str = "runs/bench-accuracy"

    def __post_init__(self) -> None:
        """ValueError ``"FIELD: what is wrong"`` for the first field that cannot work."""
        if self.task not in available_tasks():
            raise ValueError(f"task: must be one of {', '.join(available_tasks())}")
        if self.hosts < 2:
            raise ValueError(f"hosts must be at least 2, got {self.hosts}")
        if self.ranks_per_host < 1:
            raise ValueError(f"ranks_per_host: must be at least 1, got {self.ranks_per_host}")
        for name in self.methods:
            try:
                method = parse_method(name)
            except ValueError as error:
                raise ValueError(f"methods: {error}") from None
            if method.kind in ("none", "floor"):
                raise ValueError(f"methods: {name!r} trains no model together; leave it out")
            if method.kind == "hook" and method.one_bucket:
                raise ValueError(f"methods: {name!r}: microsparse train keeps DDP's buckets; "
                                 "(buckets=one) is a bench cluster option")  # fmt: skip
        if not any(name in ("dense", "dense@fsdp") for name in self.methods):
            raise ValueError("methods: must include dense or dense@fsdp (the target is a "
                             "fraction of its final metric)")  # fmt: skip
        if self.budget is not None and not self.budget > 0:
            raise ValueError(f"budget: must be > 0, got {self.budget}")
        if not 0 < self.target_fraction <= 1:
            raise ValueError(f"target_fraction: must be in (0, 1], got {self.target_fraction}")


def train_arguments(name: str, config: AccuracyConfig) -> list[str]:
    """``microsparse train`` options of method ``name`` (task, density or budget, seed and
    how the gradients are averaged), before ``config.train_args``."""
    method = parse_method(name)
    argv = ["--task", config.task]
    for key, amount in method.amount(config.density, config.budget).items():
        argv += [f"--{key}", repr(amount)]
    if method.value_dtype is not None:
        argv += ["--value-dtype", method.value_dtype]
    if method.kind == "peer":
        argv += ["--integration", "ddp", "--ddp-hook", name, "--sparsifier", "dense"]
    else:
        argv += ["--sparsifier", method.sparsifier]
        integration = {"hook": "ddp", "sharded": "fsdp"}.get(method.kind, "loop")
        argv += ["--integration", integration]
        if method.one_exchange:
            argv.append("--one-exchange")
        if method.min_speedup is not None:
            argv += ["--min-speedup", repr(method.min_speedup)]
        for key, value in method.options.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
    # On CPU, gloo over the shaped links: on a GPU machine NCCL would bypass them.
    return [*argv, "--seed", str(config.seed), "--device", "cpu", "--no-progress"]


def run_accuracy(
    config: AccuracyConfig,
    log: Callable[[str], None] = print,
    command: str = "",
    plots: bool = True,
) -> dict[str, Any]:
    """Train every method at every rate on the test bed; write and return the results
    (``results.json`` in ``out``, and each rate's report in ``out/<rate>``; plots need
    matplotlib)."""
    import importlib.util

    plots = plots and importlib.util.find_spec("matplotlib") is not None

    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "command": command, "config": asdict(config), "machine": machine(), "rates": [],
    }  # fmt: skip
    for rate in config.rates:
        runs_dir = out / rate
        with netns.Cluster(config.hosts, rate) as cluster:
            for index, name in enumerate(config.methods):
                log(f"[{config.hosts} hosts, {rate}] training {name}")
                started = time.perf_counter()
                run_dir = runs_dir / _directory(name)
                with _LinkWatch(cluster, run_dir / "metrics.jsonl") as link:
                    _train(cluster, name, config, run_dir, 29600 + index)
                (run_dir / "link.json").write_text(json.dumps(link.result()) + "\n")
                log(f"[{config.hosts} hosts, {rate}] {name}: {time.perf_counter() - started:.0f} s")
        runs = [load_run(runs_dir / _directory(name), label=name) for name in config.methods]
        table = results_table(runs, None, config.target_fraction)
        links = [
            _link_row(run, runs_dir / _directory(name)) for name, run in zip(config.methods, runs)
        ]
        results["rates"].append({
            "rate": rate,
            "target": table.target.value,
            "target_source": table.target.source,
            "rows": table.rows,
            "links": links,
            "load_average_after": os.getloadavg(),
        })  # fmt: skip
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
        write_report(runs, runs_dir, None, plots=plots, fraction=config.target_fraction)
        log((runs_dir / "results.md").read_text(encoding="utf-8"))
        log(_links_table(links))
    return results


class _LinkWatch:
    """The hosts' link counters read just after rank 0 logs its first step and its last.

    A thread polls the run's ``metrics.jsonl`` (a line a step, flushed as written) while it
    trains and reads the counters whenever the line count has grown, keeping a reading only if
    the count did not move while it was taken. The window runs from the first reading (after
    step 1: the set-up, rank 0's weights sent to every rank, stays before it) to the last one
    taken during training (the evaluation after the last step stays after it). Both ends lag
    the ranks alike, so the window holds whole steps, and no step's bytes are counted against
    another's.
    """

    def __init__(self, cluster: netns.Cluster, metrics: Path) -> None:
        self._cluster, self._metrics = cluster, metrics
        self._readings: list[tuple[int, list[tuple[int, int]]]] = []
        self._started = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> _LinkWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _steps(self) -> int:
        """Lines in this training's metrics file (0 before the training has written it)."""
        try:
            if self._metrics.stat().st_mtime < self._started:
                return 0
            return self._metrics.read_bytes().count(b"\n")
        except OSError:
            return 0

    def _poll(self) -> None:
        seen = 0
        while not self._stop.wait(0.005):
            steps = self._steps()
            if steps <= seen:
                continue
            counters = self._cluster.sent()
            if self._steps() == steps:
                self._readings.append((steps, counters))
                seen = steps

    def result(self) -> dict[str, Any]:
        """``steps`` between the first and last readings, and the bytes and packets each host
        sent in them."""
        if len(self._readings) < 2:
            return {"steps": 0, "tx_bytes_per_host": None, "tx_packets_per_host": None}
        (first, before), (last, after) = self._readings[0], self._readings[-1]
        return {
            "steps": last - first,
            "tx_bytes_per_host": [b[0] - a[0] for a, b in zip(before, after)],
            "tx_packets_per_host": [b[1] - a[1] for a, b in zip(before, after)],
        }


def _link_row(run: Any, run_dir: Path) -> dict[str, Any]:
    """Bytes and packets between hosts of one training per host and step, measured, and the
    bytes modelled."""
    link = json.loads((run_dir / "link.json").read_text())
    sent, packets, steps = link["tx_bytes_per_host"], link.get("tx_packets_per_host"), link["steps"]
    modelled = [record.get("bytes_sent", 0) for record in run.steps]
    return {
        "run": run.label,
        "steps": steps,
        "link_bytes_per_host_step": None if not sent else sum(sent) / len(sent) / steps,
        "link_packets_per_host_step": None if not packets else sum(packets) / len(packets) / steps,
        "modelled_bytes_per_rank_step": sum(modelled) / max(1, len(modelled)),
    }


def _links_table(links: list[dict[str, Any]]) -> str:
    """Markdown table of :func:`_link_row` rows, with each as a share of the first's bytes."""
    first = links[0]["link_bytes_per_host_step"]
    lines = [
        "| run | steps read | KB between hosts / host / step | packets / host / step | "
        "% of the first run's bytes | modelled KB / rank / step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in links:
        sent, packets = row["link_bytes_per_host_step"], row.get("link_packets_per_host_step")
        share = "–" if sent is None or not first else f"{100 * sent / first:.2f}"
        lines.append(
            f"| {row['run']} | {row['steps']} | {'–' if sent is None else f'{sent / 1e3:.1f}'} | "
            f"{'–' if packets is None else f'{packets:.0f}'} | {share} | "
            f"{row['modelled_bytes_per_rank_step'] / 1e3:.1f} |"
        )
    return "\n".join(lines) + "\n"


def _directory(name: str) -> str:
    """A directory name for a method name (``powersgd(rank=4)`` → ``powersgd-rank=4``)."""
    return name.replace("(", "-").replace(")", "").replace(",", "-").replace("@", "-at-")


def _train(
    cluster: netns.Cluster, name: str, config: AccuracyConfig, run_dir: Path, port: int
) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    package_root = str(Path(microsparse.__file__).resolve().parent.parent)
    per_host = config.ranks_per_host
    threads = max(1, (os.cpu_count() or 1) // (cluster.hosts * per_host))
    argv = [
        sys.executable, "-m", "microsparse_lab", "train", *train_arguments(name, config),
        *config.train_args, "--out", str(run_dir.resolve()),
    ]  # fmt: skip
    workers = []
    for rank in reversed(range(cluster.hosts * per_host)):
        host = rank // per_host
        env = dict(os.environ)
        env.update(
            RANK=str(rank), WORLD_SIZE=str(cluster.hosts * per_host),
            LOCAL_RANK=str(rank % per_host), LOCAL_WORLD_SIZE=str(per_host),
            MASTER_ADDR=cluster.address(0), MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME=cluster.interface(host), OMP_NUM_THREADS=str(threads),
            PYTHONPATH=os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")])),
        )  # fmt: skip
        log_file = run_dir / f"rank{rank}.log"
        with open(log_file, "w", encoding="utf-8") as stream:
            process = cluster.popen(host, argv, env=env, stdout=stream, stderr=subprocess.STDOUT)
        workers.append((rank, process, log_file))
    wait_for_workers(workers, config.timeout, cluster)


__all__ = ["DEFAULT_METHODS", "AccuracyConfig", "run_accuracy", "train_arguments"]
