"""``simulate.md``: the simulation's table, and the prediction's and validation's when
present; :func:`write` writes it with the JSON and the plots."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from microsparse_lab.bench.output import (
    describe_machine,
    markdown_table,
    significant,
    write_results,
)
from microsparse_lab.bench.simulate.plots import plot
from microsparse_lab.bench.simulate.prediction import beyond_note


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
    """The peers' rows of the validation (:meth:`validation.PeerModel.row`)."""
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


def write(result: dict[str, Any], out: str | Path, plots: bool = True) -> list[Path]:
    """Write ``simulate.json``, ``simulate.md`` and (with ``plots``) the PNGs into ``out``."""
    return write_results("simulate", result, out, markdown, plot if plots else None)
