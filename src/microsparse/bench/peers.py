"""The methods a user would pick instead of microsparse, as rows of ``bench cluster``.

A method name is one of:

- a microsparse sparsifier (``micro``, ``topk``, ``micro(selection=threshold)``, ...): the
  loop API, ``GradientReducer.synchronize()`` after backward; with ``@ddp`` (``micro@ddp``)
  the DDP comm hook instead, overlapped with the backward pass;
- ``ddp``: stock DDP, its bucketed all-reduce overlapped with the backward pass;
- ``fp16``, ``bf16``: DDP with gradients all-reduced in half precision. ``fp16`` is torch's
  ``fp16_compress_hook``; DDP refuses torch's ``bf16_compress_hook`` without CUDA, so ``bf16``
  is the same body (divide, cast, all-reduce, cast back) under another name, written here;
- ``powersgd`` or ``powersgd(rank=R)``: torch's ``powerSGD_hook`` (PowerSGDState with error
  feedback and warm start, compressing from the first recorded step). ``start=S`` runs a
  plain all-reduce for the first S steps (torch's ``start_powerSGD_iter``, which its
  authors advise for accuracy; at least 2). With DDP's default
  buckets it crashed on gloo under load ("Received data size doesn't match expected size"),
  so it runs with one bucket holding the whole model (``bucket_cap_mb`` large), marked so in
  its name's description; ``powersgd(rank=R,buckets=default)`` asks for DDP's buckets;
- ``none``: the same training with no exchange at all (the no-communication bound);
- ``none@ddp``: DDP with a hook that hands every bucket back as it is: what DDP itself costs
  (copying gradients into its buckets and back, its autograd hooks, the ranks meeting once a
  step) without sending a byte, the floor under any DDP hook;
- ``NAME@ddp(buckets=one)``: microsparse's hook on DDP with one bucket holding the whole
  model, so that the exchange runs once, after backward, as in the loop API, instead of once
  per DDP bucket;
- ``NAME@ddp(exchange=one)``: microsparse's hook with ``one_exchange=True`` on DDP's own
  buckets: the same single exchange after backward, without touching ``bucket_cap_mb``;
- ``NAME@ddp(min_speedup=X)``: microsparse's hook with ``min_speedup=X``: it times a few
  steps sparse and dense and stays sparse only where its step is X times faster.

A sparsifier may carry its own density, ``micro(density=0.03)@ddp``, over the run's
``--density``: so one run (one dense target, the same links) compares densities side by side.

Example:
    >>> method = parse("micro(selection=threshold)@ddp")
    >>> method.kind, method.sparsifier, method.options
    ('hook', 'micro', {'selection': 'threshold'})
    >>> parse("micro(density=0.03)@ddp").density_or(0.001), parse("micro").density_or(0.001)
    (0.03, 0.001)
    >>> parse("powersgd(rank=4)").rank, parse("powersgd").one_bucket
    (4, True)
    >>> parse("powersgd(rank=4,start=100)").start
    100
    >>> parse("micro@ddp(buckets=one)").one_bucket, parse("none@ddp").kind
    (True, 'floor')
    >>> parse("micro@ddp(exchange=one)").one_exchange
    True
    >>> parse("micro@ddp(min_speedup=1.1,exchange=one)").min_speedup
    1.1
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from microsparse.bench.workload import find_variants
from microsparse.sparsifiers import available_sparsifiers

NO_EXCHANGE = "none"
DDP_FLOOR = "none@ddp"
PEERS = ("ddp", "fp16", "bf16", "powersgd")
HOOK_SUFFIX = "@ddp"
DDP_KINDS = ("hook", "peer", "floor")
"""The kinds of method that train through DistributedDataParallel."""


@dataclass(frozen=True)
class Method:
    """One row of the cluster benchmark: what averages the gradients, and how it is attached."""

    name: str
    kind: str  # "loop", "hook", "peer", "floor" (DDP, no exchange) or "none"
    sparsifier: str = ""  # the microsparse sparsifier, or the peer's name
    options: dict[str, Any] = field(default_factory=dict)
    rank: int = 0  # PowerSGD's matrix approximation rank
    one_bucket: bool = False  # DDP with one bucket holding the whole model
    start: int | None = None  # PowerSGD's plain all-reduce steps, if the name sets them
    one_exchange: bool = False  # the hook's one_exchange: one slab whatever DDP's buckets
    density: float | None = None  # the name's own density (``micro(density=0.03)``), if any
    min_speedup: float | None = None  # the hook's min_speedup: sparse only where X times faster

    def density_or(self, default: float) -> float:
        """The density this method selects at: the name's own, else ``default`` (the run's)."""
        return default if self.density is None else self.density

    def compresses_from(self, default: int) -> int:
        """The first step PowerSGD compresses: the name's ``start``, else ``default`` (>= 2)."""
        return self.start if self.start is not None else max(2, default)

    @property
    def uses_ddp(self) -> bool:
        return self.kind in DDP_KINDS


def parse(name: str) -> Method:
    """The :class:`Method` a name means; ValueError naming the choices if it means none."""
    if name == NO_EXCHANGE:
        return Method(name, "none")
    if name == DDP_FLOOR:
        return Method(name, "floor")
    base, hooked, suffix = name.partition(HOOK_SUFFIX)
    one_bucket = one_exchange = False
    min_speedup = None
    if suffix:
        options = _arguments(name, suffix[1:]) if suffix.startswith("(") else {}
        if (
            not options
            or not set(options) <= {"buckets", "exchange", "min_speedup"}
            or options.get("buckets", "default") not in ("one", "default")
            or options.get("exchange", "buckets") not in ("one", "buckets")
        ):
            raise ValueError(f"method {name!r}: {HOOK_SUFFIX} ends the name, or takes "
                             "(buckets=one|default), (exchange=one|buckets) and/or "
                             "(min_speedup=X)")  # fmt: skip
        one_bucket = options.get("buckets") == "one"
        one_exchange = options.get("exchange") == "one"
        if "min_speedup" in options:
            min_speedup = _positive(name, "min_speedup", options["min_speedup"])
    label, _, arguments = base.partition("(")
    if label in PEERS:
        options = _arguments(name, arguments)
        if hooked:
            raise ValueError(f"method {name!r}: {label} always runs through DDP; drop "
                             f"{HOOK_SUFFIX}")  # fmt: skip
        unknown = set(options) - ({"rank", "buckets", "start"} if label == "powersgd" else set())
        if unknown:
            raise ValueError(f"method {name!r}: {label} takes no option {sorted(unknown)}")
        if options.get("buckets", "one") not in ("one", "default"):
            raise ValueError(f"method {name!r}: buckets must be 'one' or 'default'")
        rank = _whole(name, "rank", options.get("rank", "1"), 1) if label == "powersgd" else 0
        start = options.get("start")
        if start is not None:  # torch needs 2 steps to set up error feedback and warm start
            start = _whole(name, "start", start, 2)
        one_bucket = label == "powersgd" and options.get("buckets", "one") == "one"
        return Method(name, "peer", label, {}, rank, one_bucket, start)
    base, density = _own_density(name, base)
    try:
        (variant,) = find_variants((base,), density or 0.001)
    except ValueError:
        choices = (*available_sparsifiers(), "micro-reference", *PEERS, NO_EXCHANGE, DDP_FLOOR)
        raise ValueError(
            f"method {name!r}: unknown; choose from {', '.join(choices)} (a sparsifier may "
            f"end in {HOOK_SUFFIX} for the DDP hook)"
        ) from None
    kind = "hook" if hooked else "loop"
    return Method(name, kind, variant.name, dict(variant.options), one_bucket=one_bucket,
                  one_exchange=one_exchange, density=density,
                  min_speedup=min_speedup)  # fmt: skip


def _own_density(name: str, base: str) -> tuple[str, float | None]:
    """``base`` without its ``density=`` option, and that density (None if it has none)."""
    label, _, arguments = base.partition("(")
    options = _arguments(name, arguments)
    if "density" not in options:
        return base, None
    text = options.pop("density")
    try:
        density = float(text)
    except ValueError:
        density = math.nan
    if not 0 < density <= 1:
        raise ValueError(f"method {name!r}: density must be a number in (0, 1], got {text!r}")
    rest = ",".join(f"{key}={value}" for key, value in options.items())
    return (f"{label}({rest})" if rest else label), density


def _positive(name: str, key: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"method {name!r}: {key} must be a number > 0, got {text!r}")
    return value


def _whole(name: str, key: str, text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise ValueError(f"method {name!r}: {key} must be a whole number >= {least}, got {text!r}")
    return value


def _arguments(name: str, text: str) -> dict[str, str]:
    if not text:
        return {}
    if not text.endswith(")"):
        raise ValueError(f"method {name!r}: unbalanced parentheses")
    pairs = [part.split("=", 1) for part in text[:-1].split(",") if part]
    if any(len(pair) != 2 for pair in pairs):
        raise ValueError(f"method {name!r}: options are key=value")
    return dict(pairs)  # type: ignore[arg-type]


def attach(
    method: Method, model: nn.Module, density: float, start: int, checkpointable: bool = False
) -> tuple[nn.Module, Any]:
    """Wrap ``model`` for a DDP method and register its hook; returns (module to train, the
    hook's state or None). ``start`` is the step from which PowerSGD compresses, unless the
    name sets its own. ``checkpointable`` runs torch's PowerSGD hook through
    :class:`microsparse.bench.powersgd.PowerSGD`, whose state a checkpoint can save and
    restore; the benchmarks leave it off to time torch's hook as users get it."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel

    import microsparse.ddp as mddp

    # DDP's own bucket defaults (1 MiB first, 25 MiB after), as a user gets them.
    from microsparse.bench.peermodel import ONE_BUCKET_BYTES

    one_bucket_mb = ONE_BUCKET_BYTES >> 20
    ddp = DistributedDataParallel(model, bucket_cap_mb=one_bucket_mb if method.one_bucket else None)
    state: Any = None
    if method.kind == "floor":
        ddp.register_comm_hook(None, unchanged_hook)
    elif method.kind == "hook":
        state = mddp.SparseState(method.sparsifier, method.density_or(density),
                                 one_exchange=method.one_exchange,
                                 min_speedup=method.min_speedup, **method.options)  # fmt: skip
        ddp.register_comm_hook(state, mddp.sparse_hook)
    elif method.sparsifier == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif method.sparsifier == "bf16":
        ddp.register_comm_hook(None, bfloat16_hook)
    elif method.sparsifier == "powersgd" and checkpointable:
        from microsparse.bench.powersgd import PowerSGD

        state = PowerSGD(model.parameters(), method.rank, method.compresses_from(start))
        state.attach(ddp)
    elif method.sparsifier == "powersgd":
        state = powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=method.rank,
            start_powerSGD_iter=method.compresses_from(start), use_error_feedback=True,
            warm_start=True,
        )  # fmt: skip
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    return ddp, state


def unchanged_hook(process_group, bucket):  # type: ignore[no-untyped-def]
    """Hand the bucket back as it is: DDP's own cost, no exchange (``none@ddp``)."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def bfloat16_hook(process_group, bucket):  # type: ignore[no-untyped-def]
    """torch's ``bf16_compress_hook`` body: divide, cast to bfloat16, all-reduce, cast back
    into the bucket. DDP refuses a hook of torch's name without CUDA (it checks the name); the
    same body under another name runs on CPU. (Unannotated: DDP checks a hook's annotations as
    objects, and this module's are strings.)"""
    buffer = bucket.buffer()
    world_size = dist.get_world_size(process_group)
    compressed = buffer.div(world_size).to(torch.bfloat16)
    work = dist.all_reduce(compressed, group=process_group, async_op=True)

    def decompress(future):  # type: ignore[no-untyped-def]
        buffer.copy_(future.value()[0])
        return buffer

    return work.get_future().then(decompress)


def modelled_bytes(method: Method, model: nn.Module, world_size: int) -> int | None:
    """Bytes one rank sends per step in a ring model, for the peers (None for the others):
    :func:`microsparse.bench.peermodel.peer_bytes` on the model's layer shapes."""
    from microsparse.bench import peermodel

    if method.kind != "peer":
        return None
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    return peermodel.peer_bytes(method.name, shapes, world_size)
