"""The run's time budget: parts that would not finish in time are skipped, not started.

Example:
    >>> budget = Budget(60.0)
    >>> budget.allows(10.0), budget.allows(100.0)
    (True, False)
"""

from __future__ import annotations

import time


class Budget:
    """Seconds left of ``seconds`` from now; ``reserve`` keeps time for later sections."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        self.reserve = 0.0

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def allows(self, seconds: float) -> bool:
        """Whether work of about ``seconds`` ends before the reserve is touched."""
        return self.left() - self.reserve >= seconds
