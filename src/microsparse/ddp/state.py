"""State of the sparse DDP communication hook: the options, the slabs, the pass statistics."""

from __future__ import annotations

import math
import threading
import zlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from microsparse.comm import ProcessGroupCollectives, all_reduce_bytes
from microsparse.comm.framing import Fixed
from microsparse.ddp.choice import SpeedChoice, check_min_speedup
from microsparse.ddp.ordering import OrderedLauncher, Starter
from microsparse.ddp.slabs import RESTORE_AFTER_BACKWARD, Job, Slabs
from microsparse.engine import StepReport
from microsparse.engine.plan import step_collectives
from microsparse.engine.stats import dense_stats, step_stats
from microsparse.engine.step import NonFinite
from microsparse.layout import Layout
from microsparse.options import SparseOptions
from microsparse.ranks import check_saved_by
from microsparse.sparsifiers import Sparsifier, keywords_of
from microsparse.sparsifiers.warmup import DensityWarmup
from microsparse.stats import StepStats


class SparseState:
    """Options and state of :func:`microsparse.ddp.sparse_hook` for one DDP model.

    Takes the same sparsifiers, densities and options as :class:`microsparse.GradientReducer`,
    with the same defaults, and runs the same step (``microsparse.engine``) on every slab of
    DDP's buckets.

    Args:
        sparsifier: a name from :func:`microsparse.available_sparsifiers`.
        density: fraction of the model's gradient entries to send per step, in (0, 1]. At 1
            every sparsifier averages densely, exactly as DDP does. Where neither it nor
            ``budget`` is given, what ``DEFAULT_BUDGET`` buys (MiCRO: 0.002 on its compact
            wire; the plain wire: 0.001).
        budget: instead of ``density``, the fraction of dense averaging's bytes (4 per
            entry) to send per step, e.g. 0.002; the density follows from the bytes an entry
            costs on the sparsifier's wire (see :class:`microsparse.SparseOptions`).
        process_group: the group DDP averages over (``None``: the default group).
        value_dtype: send the selected values as ``torch.float16`` or ``torch.bfloat16``, or
            as ``torch.int8`` on MiCRO's compact wire; None (default): the wire's choice,
            there int8 up to 16 ranks (see :class:`microsparse.GradientReducer`). Where that
            choice changes what an entry costs, a budget is priced for the ranks of the
            process group at the first backward pass (:attr:`density` then tells).
        nonfinite: what a NaN or Inf in any rank's gradient does, as in
            :class:`microsparse.GradientReducer`. ``"skip"`` (default): the pass changes no
            residual, and the buckets hold NaN where they would hold the average (a
            ``GradScaler`` then skips the step), without the host waiting for the device.
            ``"raise"``: every rank raises ``NonFiniteGradientError`` from ``backward()``
            after DDP has finished the pass, with everything as before it (the host reads one
            small tensor per bucket).
        grad_scaler: the ``torch.amp.GradScaler`` scaling the loss: the residuals hold
            unscaled gradients whatever it does to its scale, and the buckets receive the
            average scaled, as DDP would hand them over.
        timeout: seconds the hook's own collectives may wait for a peer (``None``: torch's
            default for new process groups; it does not inherit the default group's).
        momentum_correction: momentum m of Deep Gradient Compression's momentum correction,
            as in :class:`microsparse.GradientReducer`: every worker's velocity moves into
            the error feedback, so step the optimiser *without* momentum. 0 (default): off.
        momentum_nesterov: with ``momentum_correction``, accumulate g + m·u (Nesterov).
        adam_correction: ``(beta1, beta2, eps)``: every worker's own Adam step goes into the
            error feedback, as in :class:`microsparse.GradientReducer`, so step with plain SGD
            at Adam's learning rate. Not with ``grad_scaler``.
        density_warmup: ``(start, steps)``: a density warm-up, as in
            :class:`microsparse.GradientReducer` (the slabs' ks add up to the model's).
        one_exchange: average the whole model as one slab, in one exchange that starts when
            DDP hands over its last bucket, whatever DDP's buckets are: fewer collective
            rounds per step (2 for MiCRO, instead of 2 per bucket), at the cost of not
            overlapping the exchange with backward; k is then not split by bucket. Pays where
            rounds cost more than they overlap (latency, many buckets, few cores per rank).
            Dense averaging always follows DDP's buckets.
        own_thread: start each slab's step (add the gradient in, select, issue the first
            collective) on a thread of the hook's own instead of autograd's, which then goes
            on computing the next buckets' gradients at once: on a GPU the step's host work
            (its Python and kernel launches) then overlaps backward's instead of delaying it.
            ``None`` (default): where the buckets are on a GPU. On the CPU the step's work is
            the computation itself, which needs a core of its own to overlap (2 ranks on 2
            cores: no gain). The results are the same, bit for bit, either way.
        min_speedup: compress only where it pays (``microsparse.ddp.choice``): after 8
            settling passes the hook times 6 sparse and 6 dense passes, alternating, and every
            rank then keeps sparse averaging only if the median training step is at least
            ``min_speedup`` times faster sparse than dense (summed over ranks), else averages
            densely, as DDP does, from then on (each rank's residual sent along once).
            ``None`` (default): always sparse. Sparse training needs more steps to the same
            accuracy, so ask for a margin, e.g. 1.1. Not with ``nonfinite="raise"``,
            ``grad_scaler``, ``momentum_correction`` or ``adam_correction``.
        **options: options of the sparsifier, e.g. ``threshold_rule="as_coded"``.

    The state can be built before ``init_process_group``, pickled and deep-copied: it binds
    to the process group at the first backward pass (every rank then creates the hook's own
    process groups, one per collective round, so that they never interleave with DDP's).

    Example:
        >>> state = microsparse.ddp.SparseState("micro", density=0.001)     # doctest: +SKIP
        >>> ddp_model.register_comm_hook(state, microsparse.ddp.sparse_hook)  # doctest: +SKIP
    """

    def __init__(
        self,
        sparsifier: str = "micro",
        density: float | None = None,
        process_group: dist.ProcessGroup | None = None,
        *,
        budget: float | None = None,
        value_dtype: torch.dtype | None = None,
        timeout: float | None = None,
        nonfinite: NonFinite = "skip",
        grad_scaler: Any = None,
        momentum_correction: float = 0.0,
        momentum_nesterov: bool = False,
        adam_correction: tuple[float, float, float] | None = None,
        density_warmup: DensityWarmup | tuple[float, int] | None = None,
        one_exchange: bool = False,
        own_thread: bool | None = None,
        min_speedup: float | None = None,
        **options: Any,
    ) -> None:
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"process_group (the third positional argument) must be a torch.distributed "
                f"ProcessGroup or None; got {process_group!r}. Pass the others by keyword, "
                "e.g. SparseState('micro', 0.001, value_dtype=torch.bfloat16)"
            )
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0
        ):
            raise ValueError(f"timeout must be None or a number of seconds > 0; got {timeout!r}")
        self.sparse_options = SparseOptions(
            sparsifier, density, value_dtype, nonfinite, momentum_correction, momentum_nesterov,
            adam_correction, density_warmup, options, budget,
            owner=(type(self).__name__, keywords_of(SparseState)[1]),
        )  # fmt: skip
        """Every option of the sparse step, checked."""
        self.sparse_options.check_scaler(grad_scaler)
        self.timeout = timeout
        self.grad_scaler = grad_scaler
        self.process_group = process_group
        if not isinstance(one_exchange, bool):
            raise ValueError(f"one_exchange must be True or False; got {one_exchange!r}")
        self.one_exchange = one_exchange
        if own_thread is not None and not isinstance(own_thread, bool):
            raise ValueError(f"own_thread must be None, True or False; got {own_thread!r}")
        self.own_thread = own_thread
        self.min_speedup = self._check_min_speedup(min_speedup)
        self.speed = None if self.min_speedup is None else SpeedChoice(self.min_speedup)
        """The timing and choice of ``min_speedup`` (None without it)."""
        self.step = 0
        """Backward passes averaged (the rotation counter t)."""
        self.last_step: StepStats | None = None
        """Statistics of the last completed backward pass."""
        self._binding: _Binding | None = None
        self._pending: dict[str, Any] | None = None

    def _check_min_speedup(self, min_speedup: float | None) -> float | None:
        """``min_speedup``, checked against the options that need every pass sparse."""
        min_speedup = check_min_speedup(min_speedup)
        if min_speedup is None:
            return None
        if self.averages_densely:
            raise ValueError(
                "min_speedup chooses between sparse and dense averaging, but this state always "
                "averages densely (dense, or density 1): leave min_speedup unset (None)"
            )
        clashing = [name for name, on in (
            ("nonfinite='raise'", self.sparse_options.nonfinite == "raise"),
            ("grad_scaler", self.grad_scaler is not None),
            ("momentum_correction", bool(self.sparse_options.momentum_correction)),
            ("adam_correction", self.sparse_options.adam_correction is not None),
        ) if on]  # fmt: skip
        if clashing:  # they need every pass sparse (a dense pass has no residual to keep)
            raise ValueError(
                f"min_speedup may average some passes densely, which {clashing[0]} does not "
                "support: leave min_speedup unset (None), or drop that option"
            )
        return min_speedup

    @property
    def sparsifier(self) -> str:
        return self.sparse_options.sparsifier

    @property
    def density(self) -> float:
        """The density sent: once bound, what the options buy on this many ranks
        (:meth:`SparseOptions.for_ranks`)."""
        binding = self._binding
        return (self.sparse_options if binding is None else binding.slabs.options).density

    @property
    def options(self) -> dict[str, Any]:
        """The sparsifier's own options."""
        return dict(self.sparse_options.options)

    @property
    def averages_densely(self) -> bool:
        """Density 1, or the ``dense`` sparsifier: plain averaging, as DDP's own."""
        return self.sparse_options.averages_densely

    def bind(self) -> _Binding:
        """Bind to the process group (collective: every rank, at the first backward pass)."""
        if self._binding is not None:
            return self._binding
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "the sparse DDP hook needs torch.distributed: call init_process_group before "
                "the first backward pass"
            )
        group = self.process_group
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        rank, world_size = dist.get_rank(group), len(ranks)
        if self._pending is not None:
            _check_saved_by(self._pending, rank, world_size)
        options = self.sparse_options.for_ranks(world_size)
        probe = options.make_sparsifier()
        probe.bind(_probe_layout(), rank, world_size)
        rounds = _rounds(probe, warmup=options.density_warmup is not None)
        wait = None if self.timeout is None else timedelta(seconds=self.timeout)
        groups = [dist.new_group(ranks, timeout=wait) for _ in range(rounds)]
        slabs = Slabs(options, rank, world_size, self.one_exchange and not self.averages_densely)
        if self._pending is not None:
            slabs.restore(self._pending["slabs"])
            self._pending = None
        self._binding = _Binding(
            rank, world_size, [ProcessGroupCollectives(g) for g in groups],
            [OrderedLauncher() for _ in range(rounds)], slabs,
        )  # fmt: skip
        return self._binding

    def residual(self, param: torch.Tensor) -> torch.Tensor:
        """This rank's residual of ``param`` (flat; do not modify), once the hook has met it."""
        residual = None if self._binding is None else self._binding.slabs.residual(param)
        if residual is None:
            raise KeyError("the hook has not met this parameter yet (no backward pass so far)")
        return residual

    def velocity(self, param: torch.Tensor) -> torch.Tensor | None:
        """This rank's velocity of ``param`` with momentum correction (flat; do not modify),
        else None."""
        self.residual(param)  # raises if not met yet
        assert self._binding is not None
        memory = self._binding.slabs.memory(param)
        if memory is None or not self.sparse_options.momentum_correction:
            return None
        return memory[1]

    def moments(self, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This rank's Adam moments (m, v) of ``param`` with Adam correction (flat; do not
        modify), else None."""
        self.residual(param)  # raises if not met yet
        assert self._binding is not None
        memory = self._binding.slabs.memory(param)
        if memory is None or self.sparse_options.adam_correction is None:
            return None
        return memory[1], memory[2]

    @property
    def rank(self) -> int | None:
        return None if self._binding is None else self._binding.rank

    @property
    def world_size(self) -> int | None:
        return None if self._binding is None else self._binding.world_size

    # ---- checkpointing -------------------------------------------------------------------

    def _config(self, loading: dict[str, Any] | None = None) -> dict[str, Any]:
        config = {
            "sparsifier": self.sparsifier,
            "density": self.sparse_options.density,
            "options": sorted(self.options.items()),
            # what is sent, not what was asked: a later default cannot change a resumed run
            "value_dtype": str(self.sparse_options.wire_value_dtype(self._ranks(loading))),
            "transactional": self.sparse_options.nonfinite == "raise",
        }
        config.update(self.sparse_options.corrections())
        if self.one_exchange:  # the slabs, and so the saved thresholds, differ
            config["one_exchange"] = True
        if self.min_speedup is not None:
            config["min_speedup"] = self.min_speedup
        return config

    def _ranks(self, loading: dict[str, Any] | None = None) -> int | None:
        """The ranks that average: the bound group's, else the process group's once it
        exists, else those of the state being loaded (or loaded) before it (None: unknown)."""
        if self._binding is not None:
            return self._binding.world_size
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(self.process_group)
        saved = loading if loading is not None else self._pending
        if saved is not None and saved.get("world_size") is not None:
            return int(saved["world_size"])  # checked against the group when the hook binds
        return None

    def fingerprint(self) -> int:
        """A checksum of the options that decide the hook's collectives (equal on every rank
        that may average with this one)."""
        return zlib.crc32(repr(sorted(self._config().items())).encode())

    def described(self) -> dict[str, Any]:
        """The options of :meth:`fingerprint`, by name, to say which differ between ranks."""
        config = self._config()
        config["nonfinite='raise'"] = config.pop("transactional")  # its name in older states
        return config

    def state_dict(self) -> dict[str, Any]:
        """Step, every parameter's residual, the slabs and their sparsifiers' states (this
        rank's; save one per rank, between steps). Process groups are not part of it.

        Example:
            >>> torch.save(state.state_dict(), f"hook-rank{rank}.pt")  # doctest: +SKIP
        """
        binding = self._binding
        if binding is None:
            slabs = self._pending["slabs"] if self._pending else _empty_slabs()
            rank, world_size = (self._pending or {}).get("rank"), (self._pending or {}).get(
                "world_size"
            )
        else:
            slabs, rank, world_size = binding.slabs.state(), binding.rank, binding.world_size
        state = {
            "config": self._config(),
            "step": self.step,
            "rank": rank,
            "world_size": world_size,
            "slabs": slabs,
        }
        if self.speed is not None:
            state["speed"] = self.speed.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore into a state registered on a fresh DDP model, before its first backward.

        The residuals are matched to parameters in the order the hook meets them, which a given
        model definition fixes, and the saved slabs are kept for the first pass, so the
        resumed run continues exactly. Raises if the state was saved with other options, or by
        another rank or world size.
        """
        if self._binding is not None:
            if self._binding.slabs.order:
                raise RuntimeError(RESTORE_AFTER_BACKWARD)
            _check_saved_by(state, self._binding.rank, self._binding.world_size)
        elif dist.is_available() and dist.is_initialized():  # now, not in rank 1's hook only
            group = self.process_group
            _check_saved_by(state, dist.get_rank(group), dist.get_world_size(group))
        mine = self._config(state)  # another world size was named above: the options differ
        if state["config"] != mine:
            raise ValueError(
                f"load_state_dict: saved with options {state['config']}, this state has {mine}"
            )
        if self._binding is not None:
            self._binding.slabs.restore(state["slabs"])
        else:
            self._pending = state
        self.step = int(state["step"])
        if self.speed is not None:
            self.speed.load_state_dict(state.get("speed", {}))

    def __getstate__(self) -> dict[str, Any]:
        return {
            "kwargs": {
                **self.sparse_options.kwargs(),
                "timeout": self.timeout,
                "one_exchange": self.one_exchange,
                "own_thread": self.own_thread,
                "min_speedup": self.min_speedup,
            },
            "state": self.state_dict(),
        }

    def __setstate__(self, saved: dict[str, Any]) -> None:
        # Process groups do not pickle: the copy binds to the default group on first use.
        SparseState.__init__(self, **saved["kwargs"])
        self._pending = saved["state"] if saved["state"]["rank"] is not None else None
        self.step = int(saved["state"]["step"])
        if self.speed is not None:
            self.speed.load_state_dict(saved["state"].get("speed", {}))


class MicroState(SparseState):
    """State of :func:`microsparse.ddp.micro_hook`: ``SparseState("micro", ...)``.

    Takes every keyword of :class:`SparseState` and MiCRO's options.

    Example:
        >>> state = microsparse.ddp.MicroState(density=0.001)               # doctest: +SKIP
        >>> ddp_model.register_comm_hook(state, microsparse.ddp.micro_hook)  # doctest: +SKIP
    """

    def __init__(
        self,
        density: float | None = None,
        process_group: dist.ProcessGroup | None = None,
        **keywords: Any,
    ) -> None:
        super().__init__("micro", density, process_group, **keywords)

    def __setstate__(self, saved: dict[str, Any]) -> None:
        SparseState.__setstate__(self, saved)


def _check_saved_by(state: dict[str, Any], rank: int, world_size: int) -> None:
    check_saved_by((state.get("rank"), state.get("world_size")), rank, world_size)


@dataclass
class _Binding:
    """What the state holds once bound: the hook's collectives and the slabs."""

    rank: int
    world_size: int
    collectives: list[ProcessGroupCollectives]
    """One per collective round of a step, each on its own process group."""
    launchers: list[OrderedLauncher]
    """Round r of every slab is issued in slab order (round 0 from the hook itself)."""
    slabs: Slabs
    starter: Starter = field(default_factory=Starter)
    """The thread that starts the slabs' steps, where the state's ``own_thread`` asks."""
    current: PassRecord | None = None
    agreed: bool = False
    """Every rank's options were found equal (at the first pass)."""
    clean: bool = False
    """Every residual is zero: a dense pass sent them all, and no sparse pass ran since."""


@dataclass
class PassRecord:
    """One backward pass: its slabs' reports, its first error and its buckets' futures."""

    step: int
    reports: list[tuple[Job, StepReport]] = field(default_factory=list)
    ran: list[Job] = field(default_factory=list)
    """Every slab step started this pass (rolled back together if the pass fails)."""
    error: BaseException | None = None
    buckets: dict[int, tuple[torch.futures.Future, torch.Tensor, set]] = field(
        default_factory=dict
    )
    slabs_started: int = 0
    saw_last_bucket: bool = False
    refused: bool = False
    """An error before any exchange (ranks with other options): nothing is exchanged."""
    dense: bool = False
    """Averaged densely, as DDP does (``min_speedup``'s choice or probe)."""
    dense_numel: int = 0
    dense_bytes: int = 0
    kept_residual: bool = False
    """A dense pass left a residual in place (a parameter this rank did not use)."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, error: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = error

    def dense_stats(self, world_size: int, density: float) -> StepStats:
        numel = self.dense_numel
        dense = all_reduce_bytes(self.dense_bytes, world_size)
        target = max(1, math.floor(density * numel))
        return dense_stats(self.step, numel, world_size, target, dense, dense,
                           extra={"averaging": "dense"},
                           payload_bytes=self.dense_bytes)  # fmt: skip

    def stats(self, world_size: int) -> StepStats:
        slabs = [(job.slab.engine, report) for job, report in self.reports]
        return step_stats(self.step, world_size, slabs, extra={"slabs": len(slabs)})


def _rounds(sparsifier: Sparsifier, warmup: bool = False) -> int:
    """Collective rounds of one step of ``sparsifier`` (:func:`step_collectives`), each taken
    whatever its size: a ``warmup`` adds a fixed message's overflow round."""
    framing = sparsifier.framing()
    overflow = int(warmup and isinstance(framing, Fixed))
    return len(step_collectives(framing, slots=1, values=1, agreement_bytes=int(sparsifier.agrees),
                                planned=sparsifier.planned, overflow_slots=overflow))  # fmt: skip


def _probe_layout() -> Layout:
    return Layout.of([("probe", torch.empty(4096))])


def _empty_slabs() -> dict[str, Any]:
    return {"residuals": [], "slabs": [], "states": []}
