"""The sparse averaging step, written once: compensate, select, exchange, average, write.

``SparseStep.run`` yields collective requests instead of calling ``torch.distributed``, so the
same protocol is driven by ``GradientReducer`` (blocking), the DDP hook (futures) and the
simulator (in-process groups).

``step_collectives`` (what one step sends, for the cost model), ``dense_stats`` (the
statistics of a plain all-reduce step, so that dense baselines report like sparse ones) and
``resolve`` (a number a ``StepReport`` left on the device, read) are exported for measuring
and comparing, not for a training loop's use of the library; so are ``mark`` and
``seconds_between`` (times that make no host wait: CUDA events on a GPU).
"""

from microsparse.engine.output import DiscardOutput, FlatOutput, GradientOutput, SparseOutput
from microsparse.engine.plan import step_collectives
from microsparse.engine.stats import dense_stats
from microsparse.engine.step import SparseStep, StepReport, run_blocking
from microsparse.engine.timing import mark, seconds_between
from microsparse.stats import resolve

__all__ = [
    "DiscardOutput", "FlatOutput", "GradientOutput", "SparseOutput", "SparseStep",
    "StepReport", "dense_stats", "mark", "resolve", "run_blocking", "seconds_between",
    "step_collectives",
]
