"""State of the sparse DDP communication hook: options, residuals, threshold, step statistics."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from microsparse.comm import all_reduce_bytes
from microsparse.ddp.memory import ParameterResiduals
from microsparse.ddp.ordering import OrderedLauncher
from microsparse.sparsifiers.base import validate_density
from microsparse.sparsifiers.threshold import STEP_RULES, ThresholdController, ThresholdRule
from microsparse.stats import StepStats

HOOK_SPARSIFIERS = ("micro", "topk", "dense")


@dataclass
class _PassTotals:
    """Sums over the buckets of one backward pass, filled in by completion callbacks."""

    step: int = 0
    numel: int = 0
    selected: int = 0
    candidates: int = 0
    local_selected: int = 0
    message_slots: int = 0
    bytes_sent: int = 0
    dense_bytes: int = 0
    select_seconds: float = 0.0
    exchange_seconds: float = 0.0
    buckets_done: int = 0
    buckets: int | None = None  # known once the last bucket's hook has run
    extra: dict[str, Any] = field(default_factory=dict)


class SparseState:
    """Options and state of :func:`microsparse.ddp.sparse_hook` for one DDP model.

    Args:
        sparsifier: ``"micro"``, ``"topk"`` or ``"dense"`` (plain averaging, as DDP does).
        density: fraction of the model's gradient entries to send per step, in (0, 1]; 1 sends
            everything, whatever the sparsifier.
        process_group: the group DDP averages over (``None``: the default group).
        threshold_rule: MiCRO's threshold controller, ``"symmetric"`` or ``"as_coded"``.
        capacity_factor: MiCRO's index message per rank and bucket holds
            ``ceil(capacity_factor · density · bucket size / n)`` positions, so a step needs two
            collective rounds per bucket (indices with their count, then values) instead of
            three. Positions beyond it (only while the threshold is far too low, e.g. in the
            first steps) are not sent this step: the largest ones are kept, the rest stay in
            the residual. Larger values waste index bytes, smaller ones defer more entries.

    Construction is collective (it creates two process groups for the hook's own collectives,
    so they never interleave with DDP's), so every rank must build the state.
    """

    def __init__(
        self,
        sparsifier: str = "micro",
        density: float = 0.001,
        process_group: dist.ProcessGroup | None = None,
        *,
        threshold_rule: ThresholdRule = "symmetric",
        capacity_factor: float = 2.0,
    ) -> None:
        if sparsifier not in HOOK_SPARSIFIERS:
            raise ValueError(
                f"sparsifier must be one of {', '.join(HOOK_SPARSIFIERS)} for the DDP hook; "
                f"got {sparsifier!r}"
            )
        if threshold_rule not in STEP_RULES:
            raise ValueError(
                f"threshold_rule must be one of {', '.join(STEP_RULES)} for the DDP hook; "
                f"got {threshold_rule!r}"
            )
        if (
            not isinstance(capacity_factor, (int, float))
            or not math.isfinite(capacity_factor)
            or capacity_factor < 1
        ):
            raise ValueError(
                f"capacity_factor must be a finite number >= 1, got {capacity_factor!r}"
            )
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "SparseState needs torch.distributed: call init_process_group before building it"
            )
        self.sparsifier = sparsifier
        self.density = validate_density(density)
        self.threshold_rule: ThresholdRule = threshold_rule
        self.capacity_factor = float(capacity_factor)
        ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
        self.rank = dist.get_rank(process_group)
        self.world_size = len(ranks)
        # Index all-gathers are issued from the hook (autograd thread), value all-reduces from
        # completion callbacks: separate groups keep each group's order identical on all ranks.
        self.index_group = dist.new_group(ranks)
        self.value_group = dist.new_group(ranks)
        self.residuals = ParameterResiduals(self.world_size)
        self.launcher = OrderedLauncher()
        self.step = 0
        """Backward passes completed (the rotation counter t)."""
        self.numel: int | None = None
        """Model size d, learned during the first backward pass."""
        self.controller: ThresholdController | None = None
        self.last_step: StepStats | None = None
        """Statistics of the last completed backward pass."""
        self._sequence = 0
        self._lock = threading.Lock()
        self._totals = _PassTotals()
        self._previous_candidates: int | None = None

    @property
    def sends_everything(self) -> bool:
        """True while this pass is a dense all-reduce (first pass, density 1, or ``dense``)."""
        return self.numel is None or self.density >= 1.0 or self.sparsifier == "dense"

    @property
    def threshold(self) -> float:
        return self.controller.threshold if self.controller else math.nan

    def micro_capacity(self, bucket_numel: int) -> int:
        return max(
            1, math.ceil(self.capacity_factor * self.density * bucket_numel / self.world_size)
        )

    def topk_count(self, bucket_numel: int) -> int:
        return max(1, math.floor(self.density * bucket_numel))

    # ---- the life cycle of one backward pass, driven by the hook -------------------------

    def begin_bucket(self) -> int:
        """Position of this bucket in the current pass; the first one starts a new pass."""
        if self._sequence == 0:
            if self.controller is not None and self._previous_candidates is not None:
                self.controller.update(self._previous_candidates)
            self._previous_candidates = None
            self._totals = _PassTotals(step=self.step)
            self.launcher.reset()
        return self._sequence

    def end_bucket(self, is_last: bool) -> None:
        if not is_last:
            self._sequence += 1
            return
        with self._lock:
            self._totals.buckets = self._sequence + 1
            self._finish_pass_if_done()
        self._sequence = 0
        self.step += 1

    def record(self, **amounts: Any) -> None:
        """Add one bucket's numbers to the current pass (thread-safe, from callbacks)."""
        with self._lock:
            totals = self._totals
            for name, amount in amounts.items():
                setattr(totals, name, getattr(totals, name) + amount)
            totals.buckets_done += 1
            self._finish_pass_if_done()

    def _finish_pass_if_done(self) -> None:
        totals = self._totals
        if totals.buckets is None or totals.buckets_done < totals.buckets:
            return
        if self.numel is None:  # the first pass taught us the model size
            self.numel = totals.numel
            self.controller = ThresholdController(self._target(), self.threshold_rule)
        elif self.controller is not None:
            self._previous_candidates = totals.candidates
        self.last_step = StepStats(
            step=totals.step,
            numel=totals.numel,
            world_size=self.world_size,
            selected=totals.selected,
            target=self._target(),
            threshold=self.threshold,
            local_selected=totals.local_selected,
            max_local_selected=totals.message_slots,
            partition=None,
            bytes_sent=totals.bytes_sent,
            dense_bytes=totals.dense_bytes,
            select_seconds=totals.select_seconds,
            exchange_seconds=totals.exchange_seconds,
            extra={"candidates": totals.candidates, "dense_pass": totals.selected == totals.numel},
        )

    def _target(self) -> int:
        assert self.numel is not None
        return max(1, math.floor(self.density * self.numel))

    def dense_bytes(self, bucket_numel: int, element_size: int) -> int:
        return all_reduce_bytes(bucket_numel * element_size, self.world_size)

    # ---- checkpointing -------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        return {
            "sparsifier": self.sparsifier,
            "density": self.density,
            "threshold_rule": self.threshold_rule,
            "capacity_factor": self.capacity_factor,
            "world_size": self.world_size,
        }

    def state_dict(self) -> dict[str, Any]:
        """Step, model size, threshold and every parameter's residual (this rank's).

        Process groups are not part of it. Save one per rank, between steps.

        Example:
            >>> torch.save(state.state_dict(), f"hook-rank{rank}.pt")  # doctest: +SKIP
        """
        return {
            "config": self._config(),
            "step": self.step,
            "numel": self.numel,
            "threshold": self.controller.threshold if self.controller else None,
            "previous_candidates": self._previous_candidates,
            "residuals": self.residuals.state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore into a state registered on a fresh DDP model, before its first backward.

        The residuals are matched to parameters in the order the hook meets them, which a given
        model definition fixes, so the resumed run continues exactly.
        """
        if state["config"] != self._config():
            raise ValueError(
                f"load_state_dict: saved with options {state['config']}, "
                f"this state has {self._config()}"
            )
        self.residuals.restore(state["residuals"])
        self.step = int(state["step"])
        self.numel = state["numel"]
        self._previous_candidates = state["previous_candidates"]
        if self.numel is not None:
            self.controller = ThresholdController(self._target(), self.threshold_rule)
            self.controller.threshold = float(state["threshold"])


class MicroState(SparseState):
    """State of :func:`microsparse.ddp.micro_hook`: MiCRO with one model-wide threshold.

    Example:
        >>> state = microsparse.ddp.MicroState(density=0.001)               # doctest: +SKIP
        >>> ddp_model.register_comm_hook(state, microsparse.ddp.micro_hook)  # doctest: +SKIP
    """

    def __init__(
        self,
        density: float = 0.001,
        process_group: dist.ProcessGroup | None = None,
        *,
        threshold_rule: ThresholdRule = "symmetric",
        capacity_factor: float = 2.0,
    ) -> None:
        super().__init__(
            "micro",
            density,
            process_group,
            threshold_rule=threshold_rule,
            capacity_factor=capacity_factor,
        )


def accumulator_dtype(gradient: torch.Tensor) -> torch.dtype:
    # Half-precision residuals would round small unsent values away.
    return torch.promote_types(gradient.dtype, torch.float32)
