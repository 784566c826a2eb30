"""The collectives of one step, in order, as :meth:`SparseStep.run` issues them.

One definition that the DDP hook reads for its rounds (one process group each) and the cost
model reads for its bytes: the guard's all-gather, an all-reduced agreement (MiCRO's
histogram) or a leader's broadcast plan (CLT-k, DEFT) where the sparsifier has one, the index
exchange as its framing lists it, a warm-up's overflow all-gather of a fixed message, and the
all-reduce of the values. The guard's round is listed even where a step carries it inside a
compact message instead (the hook's and FSDP's MiCRO steps on flat gradients): the bytes are
the same there, the rounds one fewer, and the hook keeps a process group for it, for the
steps that cannot.
"""

from __future__ import annotations

from microsparse.comm.framing import Framing
from microsparse.engine.step import Guard

Collectives = list[tuple[str, float]]


def step_collectives(
    framing: Framing | type[Framing],
    *,
    slots: float,
    values: float,
    index_bytes: int = 4,
    value_bytes: int = 4,
    agreement_bytes: float = 0,
    planned: bool = False,
    plan_bytes: float = 0,
    overflow_slots: float = 0,
) -> Collectives:
    """(kind, bytes of this rank's message) of every collective of one step, in order.

    ``slots``: indices in each rank's index message (the largest count, or the capacity);
    ``values``: entries averaged (K, or d for a dense step); ``agreement_bytes``: an
    all-reduced vector before selection, if any; ``planned``: a leader broadcasts a plan of
    ``plan_bytes`` (which also fixes every rank's count); ``overflow_slots``: a fixed
    message's slots beyond its base during a density warm-up (a second all-gather, even when
    empty: its round is always taken). With 8-bit values (``value_bytes`` 1) a framing that
    carries their scale has room for it in each rank's index message.

    Example:
        >>> from microsparse.comm.framing import Padded
        >>> step_collectives(Padded, slots=300, values=1000)
        [('all_gather', 8), ('all_gather', 16), ('all_gather', 1200), ('all_reduce', 4000)]
    """
    steps: Collectives = [("all_gather", Guard.BYTES)]
    if agreement_bytes:
        steps.append(("all_reduce", agreement_bytes))
    if planned:
        steps.append(("broadcast", plan_bytes))
    if value_bytes == 1 and framing.carries_scale:  # 8-bit values: each rank's scale, a word
        slots += framing.SCALE_SLOTS  # type: ignore[union-attr]
    steps += framing.collectives(slots, index_bytes, planned)
    if overflow_slots:
        steps.append(("all_gather", overflow_slots * index_bytes))
    steps.append(("all_reduce", values * value_bytes))
    return steps
