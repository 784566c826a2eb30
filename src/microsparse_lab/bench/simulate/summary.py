"""What one (sparsifier, n) selected, sent and cost: medians over its measured steps, and the
bytes of one step on ``microsparse.comm``'s ring model."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict
from typing import Any

from microsparse.comm import all_gather_bytes, all_reduce_bytes, broadcast_bytes
from microsparse_lab.bench import costmodel
from microsparse_lab.bench.virtual import StepRecord


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
    gathered = records[0].exchange in ("padded", "fixed", "union", "fixed_union") and world_size > 1
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
