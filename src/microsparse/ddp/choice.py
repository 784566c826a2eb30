"""Compress only where it pays: the hook times its own step sparse and dense, and every rank
takes the same choice.

On a fast link and a small model one dense all-reduce can cost less than a sparse exchange's
dependent rounds, and sparse training needs more steps to the same accuracy: there the user is
better served by plain DDP. Torch's PowerSGD hook answers this with a static rule (compress a
tensor only above ``min_compression_rate``); bytes do not decide it here, latency and cores
do, so the hook measures instead:

1. the first :data:`SETTLING_PASSES` passes are sparse (DDP rebuilds its buckets after the
   first one, after the second with ``static_graph``, and the first steps allocate and warm
   up);
2. the next ``2 ·`` :data:`PROBE_PASSES` passes alternate sparse and dense, so that a change
   in the machine's load weighs on both alike; each pass's time is the wall time between the
   ends of two consecutive backward passes, which is the whole training step (forward,
   backward, exchange, optimiser, data), nothing of it left out;
3. at the next pass every rank all-gathers its two medians and every rank sums the same rows
   in the same order: the hook stays sparse if ``Σ sparse · min_speedup <= Σ dense``, else it
   averages densely from then on. The choice is part of the state's checkpoint.

Example:
    >>> choice = SpeedChoice(min_speedup=1.1)
    >>> modes = []
    >>> for _ in range(SETTLING_PASSES + 4):
    ...     modes.append(choice.begin_pass(lambda mine: mine.unsqueeze(0)))
    ...     choice.end_pass(modes[-1])
    >>> ["dense" if dense else "sparse" for dense in modes[SETTLING_PASSES - 1:]]
    ['sparse', 'sparse', 'dense', 'sparse', 'dense']
    >>> SpeedChoice.decide([[0.030, 0.032], [0.031, 0.034]], min_speedup=1.1)
    'dense'
    >>> SpeedChoice.decide([[0.030, 0.090], [0.031, 0.095]], min_speedup=1.1)
    'sparse'
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

SETTLING_PASSES = 8
"""Passes run sparse before any timing: DDP's bucket rebuild and the first allocations. The
sparse step settles later than the dense one: on the LSTM over 4 hosts it fell from 280–360 ms
at pass 0 to its steady 150–160 ms only by pass 5–7, so timing it from pass 3 on took
its warm-up for its cost (and chose dense where sparse was 1.15× faster)."""
PROBE_PASSES = 6
"""Timed passes of each kind, alternating (sparse first)."""
CHOICE_PASS = SETTLING_PASSES + 2 * PROBE_PASSES
"""The pass (counted from 0) at whose start every rank takes the choice."""
CHOICES = ("sparse", "dense")


def check_min_speedup(value: Any) -> float | None:
    """``min_speedup`` as given: None, or a finite number > 0 (ValueError naming it)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
        math.isfinite(value) and value > 0
    ):
        raise ValueError(
            f"min_speedup must be None (always sparse) or a finite number > 0, e.g. 1.1 to "
            f"stay sparse only where the step is at least 10 % faster; got {value!r}"
        )
    return float(value)


class SpeedChoice:
    """Times a state's passes and takes the choice between sparse and dense averaging; see the
    module docstring. Knows no process group: :meth:`begin_pass` is handed the all-gather."""

    def __init__(self, min_speedup: float) -> None:
        self.min_speedup = min_speedup
        self.choice: str | None = None
        """``"sparse"`` or ``"dense"`` once taken (every rank the same), else None."""
        self.medians: list[list[float]] | None = None
        """Every rank's median seconds a step, sparse then dense, once the choice is taken."""
        self._passes = 0
        self._last_end: float | None = None
        self._seconds: tuple[list[float], list[float]] = ([], [])

    def _probe_index(self) -> int:
        """Where the current pass is in the probe (-1 before, 2·PROBE_PASSES or more after)."""
        return self._passes - SETTLING_PASSES if self._passes >= SETTLING_PASSES else -1

    def begin_pass(self, all_gather: Callable[[torch.Tensor], Any]) -> bool:
        """Whether the pass now starting averages densely. At the first pass after the probe
        it calls ``all_gather`` (collective: every rank at the same pass) with this rank's two
        medians and takes the choice from every rank's rows."""
        if self.choice is None and self._passes >= CHOICE_PASS:
            mine = torch.tensor([statistics.median(s) for s in self._seconds], dtype=torch.float64)
            self.medians = [[float(x) for x in row] for row in all_gather(mine).tolist()]
            self.choice = self.decide(self.medians, self.min_speedup)
        if self.choice is not None:
            return self.choice == "dense"
        probe = self._probe_index()
        return 0 <= probe < 2 * PROBE_PASSES and probe % 2 == 1

    def end_pass(self, dense: bool) -> None:
        """The pass that began last has ended (whatever its outcome): time it if timed."""
        now = time.perf_counter()
        probe = self._probe_index()
        if self._last_end is not None and 0 <= probe < 2 * PROBE_PASSES:
            self._seconds[int(dense)].append(now - self._last_end)
        self._last_end = now
        self._passes += 1

    @staticmethod
    def decide(rows: Sequence[Sequence[float]], min_speedup: float) -> str:
        """``"sparse"`` if every rank's sparse medians, summed, times ``min_speedup`` are at
        most their dense medians summed, else ``"dense"`` (the same rows give the same
        answer on every rank)."""
        sparse = math.fsum(row[0] for row in rows)
        dense = math.fsum(row[1] for row in rows)
        return "sparse" if sparse * min_speedup <= dense else "dense"

    def state_dict(self) -> dict[str, Any]:
        return {"choice": self.choice, "medians": self.medians}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A taken choice holds on resume (no new probe); an untaken one starts the probe
        over, as timings from another run say nothing of this one."""
        choice = state.get("choice")
        if choice not in (None, *CHOICES):
            raise ValueError(f"load_state_dict: min_speedup's choice must be one of {CHOICES}")
        self.choice, self.medians = choice, state.get("medians")
