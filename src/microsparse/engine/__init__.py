"""The sparse averaging step, written once: compensate, select, exchange, average, write.

``SparseStep.run`` yields collective requests instead of calling ``torch.distributed``, so the
same protocol is driven by ``GradientReducer`` (blocking), the DDP hook (futures) and the
simulator (in-process groups).
"""

from microsparse.engine.output import DiscardOutput, FlatOutput, GradientOutput, SparseOutput
from microsparse.engine.step import SparseStep, StepReport, run_blocking

__all__ = [
    "DiscardOutput",
    "FlatOutput",
    "GradientOutput",
    "SparseOutput",
    "SparseStep",
    "StepReport",
    "run_blocking",
]
