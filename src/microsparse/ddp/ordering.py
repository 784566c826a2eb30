"""Issuing collectives from completion callbacks in the same order on every rank."""

from __future__ import annotations

import queue
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


class Starter:
    """One thread that runs the callables handed to it, one after another, in the order given.

    The hook hands each slab's first stage (adding the gradient in, selecting, encoding,
    issuing its first collective) to it and returns at once, so that autograd's thread goes
    on to the next buckets' gradients instead of waiting for that work; on a GPU, whose step
    is often bound by the host's launches, that thread is the critical path. One thread keeps
    the slabs' first rounds in the same order on every rank. The thread starts with the first
    callable and lives as long as the process (it only waits when idle).

    Example:
        >>> import threading
        >>> done, order = threading.Event(), []
        >>> starter = Starter()
        >>> for name in ("slab 0", "slab 1"):
        ...     starter.submit(lambda name=name: order.append(name))
        >>> starter.submit(done.set)
        >>> done.wait(10), order
        (True, ['slab 0', 'slab 1'])
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, work: Callable[[], None]) -> None:
        """Run ``work()`` on the thread after everything handed over before it; ``work``
        must not raise (what it raises is lost)."""
        if self._thread is None or not self._thread.is_alive():  # first use, or after a fork
            self._thread = threading.Thread(target=self._run, name="microsparse-starter",
                                            daemon=True)  # fmt: skip
            self._thread.start()
        self._queue.put(work)

    def _run(self) -> None:
        while True:
            self._queue.get()()
