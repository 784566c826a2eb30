"""Issuing collectives from completion callbacks in the same order on every rank."""

from __future__ import annotations

import threading
from collections.abc import Callable


class OrderedLauncher:
    """Runs ``launch`` callables strictly in sequence order, whenever each becomes ready.

    Every rank must issue the collectives of one process group in the same order. The value
    all-reduce of bucket i can only start once bucket i's index all-gather has completed, and
    those completions arrive on gloo/NCCL worker threads in any order; this launcher holds a
    ready launch back until all earlier ones have been issued, without ever waiting.

    Example:
        >>> order = []
        >>> launcher = OrderedLauncher()
        >>> launcher.ready(1, lambda: order.append("bucket 1"))   # arrives early: held back
        >>> launcher.ready(0, lambda: order.append("bucket 0"))
        >>> order
        ['bucket 0', 'bucket 1']
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._waiting: dict[int, Callable[[], None]] = {}

    def reset(self) -> None:
        """Start a new sequence (a new backward pass) at 0."""
        with self._lock:
            self._next = 0
            self._waiting.clear()

    def ready(self, sequence: int, launch: Callable[[], None]) -> None:
        with self._lock:
            self._waiting[sequence] = launch
            while self._next in self._waiting:
                self._waiting.pop(self._next)()
                self._next += 1
