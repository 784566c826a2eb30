"""The models held against the test bed: ``microsparse bench cluster``'s ``results.json``.

One walk over the test bed's rows (:func:`validate_against_cluster`) sets each row next to
what its model predicts: a loop sparsifier next to the α–β model of the reducer's collectives
(:mod:`~microsparse_lab.bench.costmodel`), a peer next to the peers' model
(:mod:`~microsparse_lab.bench.peermodel`).

Format assumed (``microsparse_lab.bench.cluster``): ``configurations``, each with ``hosts``,
``rate``, ``probe`` (``nominal_gbit_per_s``; achieved ``wire_gbit_per_s`` or
``modelled_gbit_per_s``) and ``rows``, one per method, with ``sparsifier``, ``step_ms``,
``compute_ms`` and, for a loop sparsifier, ``parameters`` (d), ``density`` (K/d),
``select_ms``, ``exchange_ms``, ``other_ms`` and (if present) ``wait_ms`` (medians over steps
of the mean over workers).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import Size

from microsparse.comm import Fixed
from microsparse.layout import Layout
from microsparse.sparsifiers import available_sparsifiers, create_sparsifier
from microsparse_lab.bench.cluster_worker import MODELS
from microsparse_lab.bench.costmodel import (
    Network,
    StepShape,
    collective_seconds,
    communication_seconds,
    plan_is_positions,
)
from microsparse_lab.bench.peermodel import local_seconds
from microsparse_lab.methods.names import DDP_FLOOR, NO_EXCHANGE, parse_method
from microsparse_lab.methods.traffic import peer_bytes, peer_collectives

LocalExchange = Callable[[str, int, int], float | None]
"""``local_exchange_ms(name, d, n)``: the CPU work of a sparsifier's exchange phase, ms."""


def validate_against_cluster(
    results: dict[str, Any],
    latency_us: float,
    shapes: dict[tuple[str, int], StepShape] | None = None,
    local_exchange_ms: LocalExchange | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the loop sparsifiers' rows, the peers' rows) of the test bed, each with its model.

    A loop sparsifier (:func:`sparsifier_row`) is a row of a registered sparsifier with a
    measured density; ``none`` (no exchange) is none. A peer (:func:`PeerModel.row`) needs the
    probed rate and a base row to stand on: ``none@ddp``, else ``none``.
    """
    known = set(available_sparsifiers())
    density = results.get("config", {}).get("density", 0.001)
    peers = PeerModel(results)
    rows, peer_rows = [], []
    for configuration in results.get("configurations", []):
        n, probe = configuration["hosts"], configuration.get("probe", {})
        rates = {"nominal": probe.get("nominal_gbit_per_s")}
        rates["probed"] = probe.get("wire_gbit_per_s") or probe.get("modelled_gbit_per_s")
        named = {r["sparsifier"]: r for r in configuration["rows"]}
        base = named.get(DDP_FLOOR) or named.get(NO_EXCHANGE)
        for row in configuration["rows"]:
            measured = {"hosts": n, "rate": configuration["rate"], "sparsifier": row["sparsifier"],
                        "measured_step_ms": row["step_ms"]}  # fmt: skip
            if row["sparsifier"] in known and row.get("density") is not None:
                rows.append(sparsifier_row(measured, row, density, rates, latency_us, shapes,
                                           local_exchange_ms))  # fmt: skip
            if rates["probed"] and base is not None and _is_peer(row["sparsifier"]):
                peer_rows.append(peers.row(measured, row, base, rates["probed"], latency_us))
    return rows, peer_rows


def sparsifier_row(
    measured: dict[str, Any],
    row: dict[str, Any],
    density: float,
    rates: dict[str, float | None],
    latency_us: float,
    shapes: dict[tuple[str, int], StepShape] | None,
    local_exchange_ms: LocalExchange | None,
) -> dict[str, Any]:
    """One loop sparsifier's row against the α–β model.

    Its messages come from its measured density (K = density·d) and the run's density; the
    padded index message and the fixed-size messages come from ``shapes[(sparsifier, n)]`` (a
    simulator run) scaled to K when given, else from a balanced split (max_r k_r = K/n) and,
    for CLT-k, a plan of K indices; a ``fixed`` message has the sparsifier's own capacity.
    Predicted exchange = the α–β time of the reducer's collectives at the nominal and at the
    probed link rate, and (with ``local_exchange_ms(name, d, n)``) the probed one plus the CPU
    work the exchange phase does besides waiting on the network; predicted step = the
    measured compute, wait, select and other times + the predicted exchange.
    """
    name, n, numel = row["sparsifier"], measured["hosts"], row["parameters"]
    sparsifier = create_sparsifier(name, density)
    sparsifier.bind(Layout(("flat",), (Size([numel]),), (0,), numel), 0, n)
    framing = sparsifier.framing()
    shape = _measured_shape(name, framing.label, numel, row["density"] * numel, n, shapes)
    if isinstance(framing, Fixed):
        shape = replace(shape, max_local_selected=framing.capacity)
    record = {**measured, "measured_exchange_ms": row["exchange_ms"]}
    local = sum(row.get(f"{part}_ms", 0.0) for part in ("compute", "wait", "select", "other"))
    cpu = local_exchange_ms(name, numel, n) if local_exchange_ms else None
    for label, gbit in rates.items():
        if not gbit:
            continue
        exchange_ms = 1e3 * communication_seconds(shape, n, Network.of(gbit, latency_us))
        predictions = {label: exchange_ms}
        if label == "probed" and cpu is not None:
            record["local_exchange_ms"] = cpu
            predictions["probed_plus_local"] = exchange_ms + cpu
        for key, value in predictions.items():
            record[f"predicted_exchange_ms_{key}"] = value
            record[f"predicted_step_ms_{key}"] = local + value
            record[f"step_ratio_{key}"] = (local + value) / row["step_ms"]
    return record


class PeerModel:
    """The peers' model of the test bed's runs: its model's layers, its cores, and the
    peers' own work timed once per (peer, threads)."""

    def __init__(self, results: dict[str, Any]) -> None:
        config = results.get("config", {})
        model = MODELS[config.get("model", "resnet18")](config.get("seed", 1))
        self.shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
        self.cores = int(results.get("machine", {}).get("cores") or 0)
        self._local_ms: dict[tuple[str, int], float] = {}

    def row(
        self,
        measured: dict[str, Any],
        row: dict[str, Any],
        base: dict[str, Any],
        gbit: float,
        latency_us: float,
    ) -> dict[str, Any]:
        """One peer's row against its model.

        The peers run inside DDP's backward, so the test bed cannot time their exchange apart
        from compute. Model step = the base row's step + the peer's local work
        (:func:`~microsparse_lab.bench.peermodel.local_seconds`) + its collectives at the
        probed rate (nothing hidden), and the overlapped bound = that base − its compute +
        max(its compute + local, collectives), except with one bucket (ready only when
        backward ends). The local work is timed on the threads each test-bed worker had
        (cores // hosts, at least 1). It is CPU-bound and runs on every worker at once, so
        where the test bed has more workers' threads than cores it is stretched by hosts ·
        threads / cores (``shared_cores``; 1 where the file does not say how many cores it
        had). Bytes: the model's against the link counters.
        """
        name, n, shapes = row["sparsifier"], measured["hosts"], self.shapes
        threads = max(1, self.cores // n)  # what each test-bed worker had (1 if not recorded)
        shared = max(1.0, n * threads / self.cores) if self.cores else 1.0
        if (name, threads) not in self._local_ms:
            self._local_ms[name, threads] = 1e3 * local_seconds(name, shapes, n, threads=threads)
        local = self._local_ms[name, threads] * shared
        network = Network.of(gbit, latency_us)
        comm_ms = 1e3 * sum(
            collective_seconds(kind, size, n, network)
            for kind, size in peer_collectives(name, shapes, n)
        )
        serial = base["step_ms"] + local + comm_ms
        hidden = base["step_ms"] - base["compute_ms"] + max(base["compute_ms"] + local, comm_ms)
        if parse_method(name).one_bucket:
            hidden = serial
        return {
            **measured,
            "base": base["sparsifier"],
            "base_step_ms": base["step_ms"],
            "shared_cores": shared,
            "local_ms": local,
            "communication_ms": comm_ms,
            "predicted_step_ms": serial,
            "overlapped_step_ms": hidden,
            "step_ratio": serial / row["step_ms"],
            "modelled_bytes": peer_bytes(name, shapes, n),
            "wire_bytes": row.get("wire_bytes_per_step"),
        }


def _is_peer(name: str) -> bool:
    try:
        return parse_method(name).kind == "peer"
    except ValueError:
        return False


def _measured_shape(
    name: str,
    exchange: str,
    numel: int,
    selected: float,
    world_size: int,
    shapes: dict[tuple[str, int], StepShape] | None,
) -> StepShape:
    simulated = _nearest(shapes or {}, name, world_size)
    if simulated is not None and simulated.selected:
        factor = selected / simulated.selected
        plan = simulated.plan_bytes
        return StepShape(
            exchange,
            numel,
            selected,
            simulated.max_local_selected * factor,
            simulated.agreement_bytes,
            plan * factor if plan and plan_is_positions(simulated) else plan,
            simulated.index_bytes,
            simulated.value_bytes,
        )
    plan = selected * 4 if name == "cltk" else 0
    return StepShape(exchange, numel, selected, selected / world_size, 0, plan)


def _nearest(
    shapes: dict[tuple[str, int], StepShape], name: str, world_size: int
) -> StepShape | None:
    sizes = [n for label, n in shapes if label == name]
    if not sizes:
        return None
    best = min(sizes, key=lambda n: abs(math.log2(n) - math.log2(world_size)))
    return shapes[(name, best)]
