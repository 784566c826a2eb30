"""The names of the averaging methods the harness trains, benchmarks and simulates.

A method name (``train --ddp-hook``, ``bench cluster``, ``bench accuracy``) is one of:

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
- ``NAME@fsdp`` (``bench accuracy`` only): the model sharded by FSDP2 among the ranks of a
  host, the hosts averaging with ``microsparse.fsdp`` (``train --integration fsdp``);
  ``dense@fsdp`` is FSDP2's own hybrid sharding; ``NAME@fsdp(exchange=one)`` averages the
  whole model in one exchange a step, after backward (``one_exchange=True``).

A sparsifier may carry its own density, ``micro(density=0.03)@ddp``, over the run's
``--density``: so one run (one dense target, the same links) compares densities side by side.
Or its own byte budget, ``micro(budget=0.002)``, a fraction of dense's bytes
(``microsparse.SparseOptions``): so wires compare at equal bytes, e.g.
``micro(budget=0.002)`` and ``micro(budget=0.002,wire=compact)``. And the dtype its values
travel in, ``micro(value_dtype=int8)@ddp`` (``float16``, ``bfloat16`` or ``int8``; a budget
then buys the entries that dtype's bytes allow).

Example:
    >>> method = parse_method("micro(selection=threshold)@ddp")
    >>> method.kind, method.sparsifier, method.options
    ('hook', 'micro', {'selection': 'threshold'})
    >>> parse_method("micro(density=0.03)@ddp").amount(0.001)
    {'density': 0.03}
    >>> parse_method("micro(budget=0.002)").amount(0.001), parse_method("micro").amount(0.001)
    ({'budget': 0.002}, {'density': 0.001})
    >>> parse_method("micro(value_dtype=int8)@ddp").value_options()
    {'value_dtype': torch.int8}
    >>> parse_method("powersgd(rank=4)").rank, parse_method("powersgd").one_bucket
    (4, True)
    >>> parse_method("powersgd(rank=4,start=100)").start
    100
    >>> parse_method("micro@ddp(buckets=one)").one_bucket, parse_method("none@ddp").kind
    (True, 'floor')
    >>> parse_method("micro@ddp(exchange=one)").one_exchange
    True
    >>> parse_method("micro@ddp(min_speedup=1.1,exchange=one)").min_speedup
    1.1
    >>> method = parse_method("micro@fsdp(exchange=one)")
    >>> method.kind, method.one_exchange
    ('sharded', True)

A sparsifier *variant* (``bench select``, ``bench overhead``, ``simulate``) is a sparsifier
name with options, ``name(key=value,...)``, or ``micro-reference``: MiCRO with the options
that make it behave as the authors' reference code.
"""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from microsparse import SparseOptions
from microsparse.sparsifiers import (
    Sparsifier,
    available_sparsifiers,
    create_sparsifier,
    method_sparsifiers,
)

REFERENCE_MICRO = {
    "threshold_rule": "as_coded",
    "partitioning": "contiguous",
    "index_message": "padded",
}
"""Options that make ``micro`` behave like the authors' reference code (those it offers)."""


@dataclass(frozen=True)
class Variant:
    """A sparsifier name with options, and how it is labelled in tables and plots."""

    label: str
    name: str
    options: dict[str, Any] = field(default_factory=dict)

    def create(self, density: float) -> Sparsifier:
        return create_sparsifier(self.name, density, **self.options)


def variants(density: float = 0.001) -> list[Variant]:
    """Every registered sparsifier with its defaults, plus MiCRO as the reference code has it.

    Example:
        >>> [v.label for v in variants()][:2]
        ['cltk', 'deft']
    """
    found = [Variant(name, name) for name in method_sparsifiers()]
    if "micro" in available_sparsifiers():
        offered = inspect.signature(type(create_sparsifier("micro", density)).__init__).parameters
        options = {key: value for key, value in REFERENCE_MICRO.items() if key in offered}
        reference = Variant("micro-reference", "micro", options)
        try:
            if (
                reference.create(density).options()
                != Variant("micro", "micro").create(density).options()
            ):
                found.append(reference)
        except (TypeError, ValueError):  # options not offered by this version of micro
            pass
    return found


def find_variants(labels: tuple[str, ...] | None, density: float = 0.001) -> list[Variant]:
    """The :func:`variants` with these labels (all if None), in that order.

    A label may also give options, ``name(key=value,...)``, e.g.
    ``micro(selection=threshold,partitioning=contiguous)``. Raises ValueError naming unknown
    labels or bad options.

    Example:
        >>> find_variants(("topk", "micro(selection=threshold)"))[1].options
        {'selection': 'threshold'}
    """
    found = {v.label: v for v in variants(density)}
    if labels is None:
        return list(found.values())
    chosen = []
    for label in labels:
        variant = found.get(label) or (parse_variant(label) if "(" in label else None)
        if variant is None:
            raise ValueError(
                f"unknown sparsifier {label!r}; choose from {', '.join(found)}, or give options "
                "as name(key=value,...)"
            )
        try:
            variant.create(density)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{label}: {error}") from None
        chosen.append(variant)
    return chosen


def split_labels(text: str, once: bool = True) -> tuple[str, ...]:
    """Comma-separated labels, once each (all of them if not ``once``); commas inside
    ``name(key=value,...)`` stay.

    Example:
        >>> split_labels("topk,micro(selection=threshold,partitioning=contiguous),topk")
        ('topk', 'micro(selection=threshold,partitioning=contiguous)')
        >>> split_labels("topk,topk", once=False)
        ('topk', 'topk')
    """
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    parts = [part for part in (*parts, current.strip()) if part]
    if not parts or depth:
        raise ValueError(f"expected comma-separated labels, got {text!r}")
    return tuple(dict.fromkeys(parts)) if once else tuple(parts)


def parse_variant(label: str) -> Variant:
    """``name(key=value,...)`` as a :class:`Variant`; values are JSON where they parse.

    Example:
        >>> parse_variant("micro(capacity_factor=1.5,partitioning=contiguous)").options
        {'capacity_factor': 1.5, 'partitioning': 'contiguous'}
    """
    name, _, rest = label.partition("(")
    options: dict[str, Any] = {}
    for key, value in _arguments(label, rest).items():
        try:
            options[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[key.strip()] = value.strip()
    if "density" in options:  # these benchmarks calibrate their inputs to one density
        raise ValueError(f"{label!r}: density is one per run here: give it with --density")
    return Variant(label, name.strip(), options)


NO_EXCHANGE = "none"
DDP_FLOOR = "none@ddp"
PEERS = ("ddp", "fp16", "bf16", "powersgd")
HOOK_SUFFIX = "@ddp"
SHARDED_SUFFIX = "@fsdp"
ONE_EXCHANGE = "(exchange=one)"
"""What follows ``@fsdp`` for ``one_exchange=True``."""
DDP_KINDS = ("hook", "peer", "floor")
"""The kinds of method that train through DistributedDataParallel."""


@dataclass(frozen=True)
class Method:
    """One row of the cluster benchmark: what averages the gradients, and how it is attached."""

    name: str
    kind: str  # "loop", "hook", "sharded" (FSDP2), "peer", "floor" (DDP, no exchange), "none"
    sparsifier: str = ""  # the microsparse sparsifier, or the peer's name
    options: dict[str, Any] = field(default_factory=dict)
    rank: int = 0  # PowerSGD's matrix approximation rank
    one_bucket: bool = False  # DDP with one bucket holding the whole model
    start: int | None = None  # PowerSGD's plain all-reduce steps, if the name sets them
    one_exchange: bool = False  # the hook's one_exchange: one slab whatever DDP's buckets
    density: float | None = None  # the name's own density (``micro(density=0.03)``), if any
    budget: float | None = None  # the name's own byte budget (``micro(budget=0.002)``), if any
    min_speedup: float | None = None  # the hook's min_speedup: sparse only where X times faster
    value_dtype: str | None = None  # the name's own value dtype (``micro(value_dtype=int8)``)

    def amount(self, density: float | None, budget: float | None = None) -> dict[str, float]:
        """How much this method sends, as the one keyword of ``SparseOptions`` that says it:
        the name's own density or budget, else the run's ``budget`` if given, else its
        ``density``; nothing where the run gives neither (``SparseOptions``' default)."""
        if self.density is not None:
            return {"density": self.density}
        if self.budget is not None:
            return {"budget": self.budget}
        if budget is not None:
            return {"budget": budget}
        return {} if density is None else {"density": density}

    def value_options(self) -> dict[str, torch.dtype]:
        """The ``value_dtype`` keyword of ``SparseOptions`` where the name sets one."""
        if self.value_dtype is None:
            return {}
        return {"value_dtype": SparseOptions.value_dtype_named(self.value_dtype)}

    def compresses_from(self, default: int) -> int:
        """The first step PowerSGD compresses: the name's ``start``, else ``default`` (>= 2)."""
        return self.start if self.start is not None else max(2, default)

    @property
    def uses_ddp(self) -> bool:
        return self.kind in DDP_KINDS


def parse_method(name: str) -> Method:
    """The :class:`Method` a name means; ValueError naming the choices if it means none."""
    if name == NO_EXCHANGE:
        return Method(name, "none")
    if name == DDP_FLOOR:
        return Method(name, "floor")
    base, sharded, suffix = name.rpartition(SHARDED_SUFFIX)
    if sharded:
        method = parse_method(base)
        one_exchange = suffix == ONE_EXCHANGE
        if method.kind != "loop" or suffix not in ("", ONE_EXCHANGE) or (
            one_exchange and method.sparsifier == "dense"
        ):
            raise ValueError(f"method {name!r}: {SHARDED_SUFFIX} follows a sparsifier: "
                             f"micro{SHARDED_SUFFIX} (microsparse.fsdp across replicas, one "
                             f"exchange a module), micro{SHARDED_SUFFIX}(exchange=one) (one "
                             f"exchange a step, after backward), dense{SHARDED_SUFFIX} "
                             "(FSDP2's own hybrid sharding)")  # fmt: skip
        return replace(method, name=name, kind="sharded", one_exchange=one_exchange)
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
    base, density = _own_amount(name, base, "density")
    base, budget = _own_amount(name, base, "budget")
    base, value_dtype = _own_option(name, base, "value_dtype")
    if density is not None and budget is not None:
        raise ValueError(f"method {name!r}: give density or budget, not both")
    try:
        (variant,) = find_variants((base,), density or 0.001)
    except ValueError:
        choices = (*available_sparsifiers(), "micro-reference", *PEERS, NO_EXCHANGE, DDP_FLOOR)
        raise ValueError(
            f"method {name!r}: unknown; choose from {', '.join(choices)} (a sparsifier may "
            f"end in {HOOK_SUFFIX} for the DDP hook)"
        ) from None
    if value_dtype is not None:  # here, not in every worker after dense has trained
        try:
            SparseOptions(variant.name, density or 0.001, options=variant.options,
                          value_dtype=SparseOptions.value_dtype_named(value_dtype))  # fmt: skip
        except ValueError as error:
            raise ValueError(f"method {name!r}: {error}") from None
    kind = "hook" if hooked else "loop"
    return Method(name, kind, variant.name, dict(variant.options), one_bucket=one_bucket,
                  one_exchange=one_exchange, density=density, budget=budget,
                  min_speedup=min_speedup, value_dtype=value_dtype)  # fmt: skip


def _own_amount(name: str, base: str, key: str) -> tuple[str, float | None]:
    """``base`` without its ``density=`` (or ``budget=``) option, and that value (None if it
    has none)."""
    base, text = _own_option(name, base, key)
    if text is None:
        return base, None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if key == "density" and not 0 < value <= 1:
        raise ValueError(f"method {name!r}: density must be a number in (0, 1], got {text!r}")
    if key == "budget" and not (math.isfinite(value) and value > 0):
        raise ValueError(f"method {name!r}: budget must be a number > 0 (a fraction of "
                         f"dense's bytes), got {text!r}")  # fmt: skip
    return base, value


def _own_option(name: str, base: str, key: str) -> tuple[str, str | None]:
    """``base`` without its option ``key``, and that option's text (None if it has none)."""
    label, _, arguments = base.partition("(")
    options = _arguments(name, arguments)
    if key not in options:
        return base, None
    text = options.pop(key)
    rest = ",".join(f"{option}={setting}" for option, setting in options.items())
    return (f"{label}({rest})" if rest else label), text


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
