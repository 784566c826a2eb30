"""Count, on the CPU, the operations that would make the host wait for the GPU, on every thread.

On a GPU, a few operations need a result on the host before Python can go on, so the host
waits until the device has run everything queued before them (a *host sync*): ``.item()``
and ``float()``/``int()``/``bool()`` of a tensor, ``nonzero`` (also behind boolean-mask
indexing and ``torch.where(mask)``), ``masked_select``, ``unique``, ``torch.equal``,
``bincount``, ``repeat_interleave`` without ``output_size``, and copies to the host
(``.tolist()``, ``.numpy()``, ``.cpu()``). A machine without a GPU cannot time these waits,
but it can count the operations: they run the same ATen operators on CPU tensors.

:func:`count_host_syncs` profiles a piece of work with ``torch.profiler`` in its
``profile_all_threads`` mode, because the work that matters is not all on the calling thread:
a DDP communication hook's ``.then()`` stages run on gloo's worker threads, which a
thread-local ``TorchDispatchMode`` (or the profiler's default mode) never sees. Copies to the
host that record no ATen operator on a CPU tensor (``Tensor.tolist``, ``Tensor.numpy``,
``Tensor.cpu``) are counted by wrapping those methods of ``torch.Tensor`` for the duration of
the measurement, for every thread at once.

What is counted, and how (see :data:`SYNC_OPS`):

- each operator of :data:`SYNC_OPS` counts once, unless it runs inside another one (one
  ``masked_select`` counts once, not also for the ``.item()`` it makes on the CPU) or inside
  :data:`DEVICE_CHECKS` (checks that call ``.item()`` on the CPU but run on the device on CUDA);
- an ``.item()`` made inside another operator counts, named after that operator:
  ``repeat_interleave`` without ``output_size`` (two, as on CUDA), ``histc`` with its default
  range, ``allclose``;
- only events that start while the work runs count, on any thread: neither the profiler's own
  start and stop nor a callback still running from before;
- the library runs what it runs on a GPU, not its shortcuts for tensors in host memory (the
  compact wire's NumPy sort, :data:`microsparse.comm.eliasfano.HOST_SORT`).

Checked against the same calls on CUDA tensors (torch 2.11, an H200): every call above that
waits there counts here, and nothing that does not, except where the CPU cannot tell, which
over-counts on purpose: ``.item()`` of a tensor that would stay on the host in GPU training (a
step counter); boolean-mask assignment of one value (``t[mask] = 0.0`` runs ``masked_fill``
there with no wait, ``t[mask] = device_tensor`` runs ``nonzero``; here both take one
``.item()``); ``.cpu()`` of any tensor (a copy from the device only where the tensor is on the
GPU). Waits that only CUDA tensors make are not seen: ``.to("cpu")`` / ``copy_`` to the host
(``.to(device)`` cannot be told apart from a move to the model's own device, so it is not
counted), ``torch.tensor(list, device="cuda")`` (a copy from pageable memory), gloo's
collectives on CUDA tensors, ``torch.cuda.synchronize`` and events.

Example:
    >>> t = torch.tensor([0.5, -1.0, 2.0])
    >>> count_host_syncs(lambda: (t > 0).sum().item()).counts
    {'aten::item -> aten::_local_scalar_dense': 1.0}
    >>> syncs = count_host_syncs(lambda: (t[t > 0], t.tolist()), repeats=2)
    >>> syncs.counts, syncs.total
    ({'Tensor.tolist': 1.0, 'aten::index -> aten::nonzero': 1.0}, 2.0)
    >>> count_host_syncs(lambda: torch.nonzero_static(t > 0, size=3)).total
    0.0
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from microsparse.comm import eliasfano

SYNC_OPS: frozenset[str] = frozenset(
    {
        # .item(), float(t), int(t), bool(t), `if t:`, f"{t}", t[i_tensor], torch.zeros(n_tensor)
        "aten::_local_scalar_dense",
        # torch.nonzero, argwhere, torch.where(mask), x[mask], x[mask] = tensor (not
        # nonzero_static: its output size is fixed, so it need not wait)
        "aten::nonzero",
        "aten::masked_select",
        # torch.unique (sorted or not, with or without inverse and counts), unique(dim=...),
        # unique_consecutive, torch._unique
        "aten::_unique",
        "aten::_unique2",
        "aten::unique_dim",
        "aten::unique_consecutive",
        "aten::unique_dim_consecutive",
        # torch.equal of two distinct tensors: on CUDA, eq(...).all().item()
        "aten::equal",
        # bincount: on CUDA, the input's maximum sizes the output
        "aten::bincount",
    }
)
"""The ATen operators that make the host wait for a CUDA device, as the profiler names them.

Each of these records itself when called on CPU tensors as well (checked for every call named
in the comments). ``repeat_interleave`` needs no entry: without ``output_size`` it calls
``.item()`` twice (on the CPU as on CUDA); with it, not at all.
"""

DEVICE_CHECKS: frozenset[str] = frozenset({"aten::_assert_async"})
"""Operators that call ``.item()`` on CPU tensors but check on the device on CUDA (no wait):
what runs inside them is not counted (``torch.multinomial``'s argument checks, for one)."""

SYNC_METHODS: tuple[str, ...] = ("tolist", "numpy", "cpu")
"""``torch.Tensor`` methods counted by wrapping: on a CPU tensor they record no operator that
would show a copy from the device (``tolist`` reads memory directly, ``cpu`` returns the
tensor itself). ``np.asarray(t)`` goes through ``Tensor.numpy`` and counts too."""

METADATA_OPS: frozenset[str] = frozenset(
    f"aten::{name}"
    for name in (
        "view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "slice", "select",
        "narrow", "expand", "unsqueeze", "squeeze", "t", "transpose", "permute", "alias",
        "detach", "view_as", "split", "split_with_sizes", "unbind", "lift_fresh", "empty",
        "empty_strided", "empty_like", "new_empty", "resize_", "set_", "unfold",
    )
)  # fmt: skip
"""Operators that change only a tensor's metadata or allocate it: no kernel runs on a GPU, so
:attr:`HostSyncs.operators` leaves them out."""

_WINDOW = "microsparse_lab.bench.syncs.count_host_syncs"


@dataclass(frozen=True)
class HostSyncs:
    """What :func:`count_host_syncs` counted, per call of the work (a mean over its repeats).

    ``counts`` maps a name to the number of such operations per call, sorted by name: an
    operator of :data:`SYNC_OPS` called directly (``'aten::nonzero'``), one reached through
    another operator (``'aten::index -> aten::nonzero'``: the outermost operator first, the
    one that Python called), or a wrapped method (``'Tensor.tolist'``).
    """

    counts: dict[str, float]
    repeats: int
    operators: float = 0.0
    """ATen operators called from Python (or from torch's C++ around them) per call, none
    inside another, views and allocations (:data:`METADATA_OPS`) left out: about the kernels
    one call would launch on a GPU."""

    @property
    def total(self) -> float:
        """All the host syncs of one call, of any name."""
        return float(sum(self.counts.values()))


def count_host_syncs(work: Callable[[], Any], repeats: int = 1) -> HostSyncs:
    """Run ``work()`` ``repeats`` times and count the host syncs it makes, on any thread.

    Everything the process runs meanwhile counts, on every thread: run nothing else
    alongside. ``work`` should leave nothing in flight when it returns (a DDP step does not:
    backward waits for every bucket's future); a callback of another thread that starts after
    the last call returned is not counted. Not re-entrant (one profiler at a time).

    The first measurement in a process pays the profiler's start-up (about a second on CPU);
    the counts do not depend on it.

    Args:
        work: what to measure, e.g. one training step, after its warm-up.
        repeats: how many times to call it; the counts are divided by it.

    Returns:
        The counts per call of ``work``.

    Raises:
        RuntimeError: where torch's profiler cannot record every thread (torch too old).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1; got {repeats}")
    with profile(activities=[ProfilerActivity.CPU], experimental_config=_every_thread()) as prof:
        with _device_paths(), _counting_methods() as method_calls, record_function(_WINDOW):
            for _ in range(repeats):
                work()
    events = list(prof.events())
    counts = Counter(_sync_names(events))
    counts.update(method_calls)
    per_call = {name: counts[name] / repeats for name in sorted(counts)}
    return HostSyncs(per_call, repeats, _operators(events) / repeats)


def _every_thread() -> Any:
    """A profiler configuration that records every thread, not just the one that starts it."""
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError as error:
        raise RuntimeError(
            f"counting host syncs needs a torch profiler with profile_all_threads; torch "
            f"{torch.__version__} has none"
        ) from error


def _within(events: list[Any]) -> Iterator[Any]:
    """The events that start within the measurement, on any thread."""
    window = next(event for event in events if event.name == _WINDOW)
    start, end = window.time_range.start, window.time_range.end
    return (event for event in events if start <= event.time_range.start <= end)


def _operators(events: list[Any]) -> int:
    """Outermost ATen operators that run a kernel (see :attr:`HostSyncs.operators`)."""
    count = 0
    for event in _within(events):
        if not event.name.startswith("aten::") or event.name in METADATA_OPS:
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        count += parent is None
    return count


def _sync_names(events: list[Any]) -> Iterator[str]:
    """The name of every counted event that starts within the measurement, on any thread."""
    for event in _within(events):
        if event.name in SYNC_OPS:
            name = _counted_name(event)
            if name is not None:
                yield name


def _counted_name(event: Any) -> str | None:
    """How to name a sync event; ``None`` where an enclosing event accounts for it already."""
    outermost = event
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in SYNC_OPS or parent.name in DEVICE_CHECKS:
            return None
        if parent.name.startswith("aten::"):
            outermost = parent
        parent = parent.cpu_parent
    return event.name if outermost is event else f"{outermost.name} -> {event.name}"


@contextmanager
def _device_paths() -> Iterator[None]:
    """Run the library's paths for device memory, not its shortcuts for host memory (the
    compact wire sorts its offsets with NumPy where they are on the host): what a GPU runs."""
    host_sort, eliasfano.HOST_SORT = eliasfano.HOST_SORT, False
    try:
        yield
    finally:
        eliasfano.HOST_SORT = host_sort


@contextmanager
def _counting_methods() -> Iterator[Counter[str]]:
    """Count calls of :data:`SYNC_METHODS` from any thread until exit, then restore them."""
    calls: Counter[str] = Counter()
    lock = threading.Lock()
    own = {name: torch.Tensor.__dict__.get(name) for name in SYNC_METHODS}
    installed: list[str] = []
    try:
        for name in SYNC_METHODS:
            method = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, _counting(method, f"Tensor.{name}", calls, lock))
            installed.append(name)
        yield calls
    finally:
        for name in installed:
            if own[name] is None:  # inherited from torch._C.TensorBase: uncover it again
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, own[name])


def _counting(
    method: Callable[..., Any], name: str, calls: Counter[str], lock: threading.Lock
) -> Callable[..., Any]:
    """``method``, counting its calls under ``name`` (from any thread)."""

    @functools.wraps(method)
    def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        with lock:
            calls[name] += 1
        return method(self, *args, **kwargs)

    return counted
