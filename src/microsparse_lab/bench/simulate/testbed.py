"""The simulated shapes held against the test bed: ``microsparse bench cluster``'s
``results.json`` through :func:`~microsparse_lab.bench.validation.validate_against_cluster`."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from microsparse_lab.bench.simulate.prediction import shapes_from
from microsparse_lab.bench.validation import validate_against_cluster


def validate(
    result: dict[str, Any],
    cluster_results: str | Path,
    latency_us: float,
    select_results: str | Path | None = None,
) -> dict[str, Any]:
    """:func:`~microsparse_lab.bench.validation.validate_against_cluster` on a
    ``results.json``, with this run's shapes; a note instead of rows when the file is not
    there.

    With ``select_results`` (``bench select``'s JSON), the exchange's own CPU work is added
    to the network model: whole per-step overhead − selection − the error-feedback add
    (which the cluster counts as selection), at the nearest d and n.
    """

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
    rows, peer_rows = validate_against_cluster(measured, latency_us, shapes_from(result), local)
    return {
        "source": str(path),
        "latency_us": latency_us,
        "rows": rows,
        "peer_rows": peer_rows,
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
