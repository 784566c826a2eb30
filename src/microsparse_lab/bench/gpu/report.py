"""``gpu-check.json`` and ``gpu-check.md``: rewritten after every part, so that a run cut
short still leaves what it measured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from microsparse_lab.bench.gpu.measure import ASYNC_COPIES, HOST_SYNCS, LAUNCHES, call_cells

COLUMNS = ("| method | step ms | × stock DDP¹ | host syncs / step | kernel launches / step | "
           "own peak MiB² | own peak − stock DDP's (4 B × d) |")  # fmt: skip


def save(result: dict[str, Any], out: Path) -> None:
    """Write both files into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-check.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / "gpu-check.md").write_text(markdown(result) + "\n")


def markdown(result: dict[str, Any]) -> str:
    """The checks as a list, a table per model, the selection table."""
    env = ", ".join(f"{key} {value}" for key, value in result["environment"].items())
    state = "" if result.get("finished") else ", still running"
    lines = ["# GPU check", "", f"{env}; {result['seconds']} s{state}.", "", "## Checks", ""]
    lines += [line for check in result["checks"] for line in _check(check)]
    if "models" in result:
        lines += _models(result["models"])
    if "selection" in result:
        lines += _selection(result["selection"])
    return "\n".join(lines)


def _check(check: dict[str, Any]) -> list[str]:
    lines = [f"- {check['name']}: {'ok' if check['ok'] else 'FAILED'} ({check['seconds']} s)"]
    rows = [*check.get("rows", []), *check.get("loop", {}).get("rows", [])]
    for row in rows:
        if not row["equal"]:
            why = "" if row.get("must_equal", True) else " (allowed: it draws on the device)"
            mode = f" with {row['mode']}" if "mode" in row else ""
            error = f": {row['error']}" if "error" in row else ""
            lines.append(f"  - differs: {row['sparsifier']} {row['options']}{mode}{why}{error}")
    for part in ("hook", "resume"):
        if part in check and not check[part]["equal"]:
            lines.append(f"  - {part}: differs")
    if check.get("refused_by_gloo_on_cuda"):
        lines.append(f"  - gloo refused on CUDA tensors: {check['refused_by_gloo_on_cuda']}")
    if "error" in check:
        lines.append("  - " + check["error"].strip().splitlines()[-1])
    return lines


def _models(section: dict[str, Any]) -> list[str]:
    lines = ["", "## Training steps, world size 1", "",
             f"Host syncs: {', '.join(HOST_SYNCS)}. Kernel launches: {', '.join(LAUNCHES)}. "
             f"Also counted: {', '.join(ASYNC_COPIES)}. ¹ GradientReducer: × the all-reduce "
             "loop; microsparse.fsdp: × FSDP2's hybrid sharding (each block and the model "
             "fully_shard-ed, mesh replicate × shard = 1 × 1). ² The most allocated during "
             "the timed steps beyond what was allocated before the method began. Every "
             "method is timed before any is profiled; stock DDP is timed again last."]  # fmt: skip
    if "error" in section:
        lines += ["", "Failed: " + section["error"].strip().splitlines()[-1]]
    for model in section.get("results", []):
        lines += ["", f"### {model['model']}"]
        if "rows" not in model:
            lines.append(model.get("skipped") or model.get("error", ""))
            continue
        lines += [f"d = {model['numel']:,}; {model['description']}; {model['backend']}.", "",
                  COLUMNS, "|---|---|---|---|---|---|---|"]  # fmt: skip
        lines += [_model_row(row) for row in model["rows"]]
        if any(isinstance(row.get("calls"), dict) and not row["calls"].get("all_threads", True)
               for row in model["rows"]):  # fmt: skip
            lines.append("- Profiled without profile_all_threads: torch ops on other threads "
                         "may be missing.")  # fmt: skip
        lines += [f"- {row['method']}: {row['error'].strip().splitlines()[-1]}"
                  for row in model["rows"] if "error" in row]  # fmt: skip
    return lines


def _model_row(row: dict[str, Any]) -> str:
    if "step_ms" not in row:
        return f"| {row['method']} | {row.get('skipped', 'failed')} | | | | | |"
    syncs, launches = call_cells(row.get("calls", "not profiled"))
    own = None if row["peak_bytes"] is None else row["peak_bytes"] - row["allocated_before_bytes"]
    peak = "" if own is None else f"{own / 2**20:,.0f}"
    over = row.get("peak_over_stock_d_floats")
    return (
        f"| {row['method']} | {row['step_ms']:.2f} | {_number(row.get('ratio'))} | {syncs} | "
        f"{launches} | {peak} | {_number(over)} |"
    )


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"


def _selection(section: dict[str, Any]) -> list[str]:
    lines = ["", "## Selection at density 0.001 (one rank's view of n)", ""]
    if "error" in section:
        lines += ["Failed: " + section["error"].strip().splitlines()[-1], ""]
    if section.get("skipped_sizes"):
        lines += [f"Out of time for d = {section['skipped_sizes']}.", ""]
    lines += ["| d | n | quota selection ms | × topk | reference compare ms | hook step "
              "(d2d copies) |", "|---|---|---|---|---|---|"]  # fmt: skip
    rows = section.get("rows", [])
    lines += [f"| {row['numel']:,} | {row['world_size']} | {_number(row.get('quota_select_ms'))} | "
              f"{_number(row.get('quota_per_topk'))} | "
              f"{_number(row.get('reference_select_ms'))} | "
              f"{_number(row.get('hook_step_passes'))} |" for row in rows]  # fmt: skip
    lines += [f"- d = {row['numel']:,}, n = {row['world_size']}, {key}: {value}"
              for row in rows for key, value in row.items() if key.endswith("_error")]  # fmt: skip
    return lines
