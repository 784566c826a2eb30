"""The public :class:`~microsparse.stats.StepStats` of a step, built in one place.

A step averages one slab (the loop API, the hook with ``one_exchange``) or several (one per
DDP bucket or FSDP module); each slab's engine reports what it did (:class:`StepReport`), and
the step's statistics are their sums over the model. A step that averaged densely (the DDP
hook's dense passes, a peer hook the harness trains through) has no report to read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from microsparse.comm.collectives import all_reduce_bytes
from microsparse.engine.step import SparseStep, StepReport
from microsparse.stats import Pending, StepStats


def step_stats(
    step: int,
    world_size: int,
    slabs: Sequence[tuple[SparseStep, StepReport]],
    *,
    exchange_seconds: float | Pending | None = None,
    extra: dict[str, Any] | None = None,
    partition: tuple[int, int] | None = None,
) -> StepStats:
    """The statistics of one step over its slabs' engines and reports.

    ``exchange_seconds``: the step's exchange time where the driver measured it (the loop
    API: its wall time less selection); else the slabs' local work after selection.
    ``extra`` defaults to the one slab's own (its sparsifier's values), ``partition`` is the
    range this rank selected from, where one slab has one.
    """
    reports = [report for _, report in slabs]
    numel = sum(engine.sparsifier.layout.numel for engine, _ in slabs)
    largest, report = max(slabs, key=lambda slab: slab[0].sparsifier.layout.numel)
    element = largest.feedback.residual.element_size()

    def total(name: str) -> Any:
        return Pending.combine(sum, [getattr(r, name) for r in reports])

    return StepStats(
        step=step,
        numel=numel,
        world_size=world_size,
        selected=total("selected"),
        target=sum(engine.sparsifier.target for engine, _ in slabs),
        threshold=report.threshold,
        local_selected=total("local_selected"),
        max_local_selected=sum(r.message_slots for r in reports),
        partition=partition,
        bytes_sent=sum(r.bytes_sent for r in reports),
        dense_bytes=all_reduce_bytes(numel * element, world_size),
        select_seconds=total("select_seconds"),
        exchange_seconds=total("finish_seconds") if exchange_seconds is None else exchange_seconds,
        extra=dict(report.extra) if extra is None else extra,
        proposed=total("proposed"),
        exchange=largest.framing.label,
        skipped=Pending.combine(any, [r.skipped for r in reports]),
        payload_bytes=sum(r.payload_bytes for r in reports),
    )


def dense_stats(
    step: int,
    numel: int,
    world_size: int,
    target: int,
    bytes_sent: int,
    dense_bytes: int,
    extra: dict[str, Any] | None = None,
    payload_bytes: int = 0,
) -> StepStats:
    """The statistics of a step that averaged all ``numel`` entries, with no index message;
    ``payload_bytes``: the vector's bytes where known.

    Example:
        >>> stats = dense_stats(3, numel=100, world_size=2, target=1, bytes_sent=400,
        ...                     dense_bytes=400)
        >>> stats.selected, stats.max_local_selected, stats.exchange, stats.padding_overhead
        (100, 0, 'dense', 0.0)
    """
    return StepStats(
        step=step,
        numel=numel,
        world_size=world_size,
        selected=numel,
        target=target,
        threshold=math.nan,
        local_selected=numel,
        max_local_selected=0,
        partition=None,
        bytes_sent=bytes_sent,
        dense_bytes=dense_bytes,
        select_seconds=0.0,
        exchange_seconds=0.0,
        extra={} if extra is None else extra,
        proposed=numel,
        exchange="dense",
        payload_bytes=payload_bytes,
    )
