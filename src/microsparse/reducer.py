"""The plain-training-loop API: sparse gradient averaging between ``backward`` and ``step``."""

from __future__ import annotations

import functools
import warnings
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from microsparse.comm.collectives import (
    Collectives,
    ProcessGroupCollectives,
    check_agreement,
)
from microsparse.engine import GradientOutput, SparseStep, run_blocking
from microsparse.engine.stats import step_stats
from microsparse.engine.step import NonFinite, scaler_scale
from microsparse.engine.timing import elapsed, mark
from microsparse.feedback import ErrorFeedback
from microsparse.layout import Layout
from microsparse.options import SparseOptions
from microsparse.ranks import check_saved_by
from microsparse.sparsifiers import create_sparsifier, keywords_of
from microsparse.sparsifiers.warmup import DensityWarmup
from microsparse.stats import Pending, StepStats

ParameterSource = nn.Module | Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def _eager(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method``, never traced by ``torch.compile``: torch.compiler.disable applied at its
    first call (applied at import, it would import dynamo with the library: a second)."""
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(method)
    def run_eagerly(*args: Any, **kwargs: Any) -> Any:
        if not disabled:
            disabled.append(torch.compiler.disable(method))
        return disabled[0](*args, **kwargs)

    return run_eagerly


class GradientReducer:
    """Replaces every ``p.grad`` by the sparsified average of all workers' gradients.

    Call :meth:`synchronize` after ``loss.backward()`` and before ``optimizer.step()`` on every
    rank. Each call: adds the fresh gradients to this worker's residual (error feedback), lets
    the sparsifier select positions, exchanges them so every rank knows all selected positions,
    all-reduces every rank's accumulated values there, divides by n, writes that sparse
    average into ``p.grad`` (identical on all ranks), and keeps what was not sent as the new
    residual. Momentum and weight decay stay with your optimiser and act on the average.

    After the first call every ``p.grad`` is a view of one flat buffer that the reducer
    rewrites in O(K) per step; ``optimizer.zero_grad()`` (which sets them to ``None``) and
    anything that changes them in place (clipping, AMP unscaling) are fine.

    Args:
        params: a module, ``module.parameters()`` or ``module.named_parameters()``; the flat
            gradient vector follows this order. Parameters that do not require grad are skipped.
        sparsifier: a name from :func:`microsparse.available_sparsifiers`.
        density: fraction δ of the d gradient entries to send per step, in (0, 1]
            (where neither it nor ``budget`` is given, what ``DEFAULT_BUDGET`` buys: 0.002
            for MiCRO on its compact wire, 0.001 on the plain wire).
        budget: instead of ``density``, the fraction of dense averaging's bytes (4 per
            entry) to send per step, e.g. 0.002; the density follows from the bytes an entry
            costs on the sparsifier's wire (see :class:`microsparse.SparseOptions`).
        process_group: the group to average over; ``None`` is the default group, or a group
            of one when ``torch.distributed`` is not initialised.
        value_dtype: send the selected values as ``torch.float16`` or ``torch.bfloat16``
            (half the value bytes); each rank's rounding error stays in its residual, so only
            the rounding of the sum itself is lost. float16 overflows above 65504: prefer
            bfloat16 unless gradients are known to be small. ``torch.int8`` (MiCRO's compact
            wire, up to 127 ranks): 8-bit integers on a scale every rank learns in the index
            message, 127 // n levels a rank; a budget then buys a third more entries. None
            (default): the wire's choice, on MiCRO's compact wire int8 up to 16 ranks and
            bfloat16 beyond (``microsparse.sparsifiers.micro.INT8_RANKS``), elsewhere the
            gradient's dtype.
        collectives: run the step's collectives on this object instead of a process group
            (anything with ``rank``, ``world_size`` and ``run(request)``, see
            :class:`microsparse.comm.Collectives`), e.g. an in-process group for benchmarks.
        nonfinite: what a NaN or Inf in any rank's gradient does. ``"skip"`` (default): the
            step changes nothing, on every rank (residuals, sparsifier state), and writes NaN
            where it would have written the average, so that a ``GradScaler`` skips it, or
            an optimiser without one meets the NaN as it would with plain DDP; the host
            never waits for the device to find out. ``"raise"``: every rank raises
            :class:`microsparse.NonFiniteGradientError` from this call, naming the ranks and
            parameters, before anything changed (the host reads one small tensor per step,
            which on a GPU waits for the backward pass to finish).
        momentum_correction: momentum m of Deep Gradient Compression's momentum correction:
            every worker keeps a velocity u ← m·u + g, the residual accumulates u, and u is
            zeroed where values were sent (momentum factor masking). The average then
            carries the momentum: step the optimiser *without* momentum. 0 (default): the
            residual accumulates g and the optimiser's momentum acts on the sparse average,
            which trained better in this project's study
            (docs/results/runs/2026-12-01_quality-d0001.md).
        momentum_nesterov: with ``momentum_correction``, accumulate g + m·u (Nesterov).
        adam_correction: ``(beta1, beta2, eps)``: every worker keeps Adam's moments of its own
            gradients, and the residual accumulates Adam's step m̂ / (√v̂ + ε) instead of the
            gradient, so what is averaged is Adam steps: step with plain SGD at Adam's
            learning rate (no momentum, no weight decay; add an L2 term to the loss instead).
            Adam on the sparse average sees one accumulated value per entry every many steps
            and zeros between (docs/results/runs/2026-12-01_quality-d0001.md, NeuMF). Not
            with ``grad_scaler``.
        density_warmup: ``(start, steps)``: send at density start · (density / start) **
            (t / steps) at step t < steps, then at ``density`` (Deep Gradient Compression's
            warm-up). The extra entries are real traffic; ``DensityWarmup.mean_density`` says
            what a schedule costs over a run.
        grad_scaler: the ``torch.amp.GradScaler`` whose scaled gradients are synchronised
            (fp16 mixed precision): the residual holds unscaled gradients, whatever the
            scaler does to its scale, and an overflow on any rank skips the step on every
            rank (its average is NaN, which the scaler sees).
        **options: options of the chosen sparsifier, e.g. ``threshold_rule="as_coded"``.

    Non-finite gradients. Every step first shares, in one small all-gather, whether each
    rank's fresh gradient holds a NaN or Inf (one fused read pass over it) and each rank's step
    counter. With ``nonfinite="skip"`` a failed step leaves every residual exactly as it was
    and writes NaN (``StepStats.skipped`` says so when read); with ``"raise"`` every rank
    raises in the same call. Ranks at different steps (calls to :meth:`synchronize` that do
    not pair up, or checkpoints of different steps) raise
    :class:`microsparse.ConfigMismatchError` on every rank at the first call after
    construction or :meth:`load_state_dict`, and later skip every step they disagree on.

    The fp16 pattern::

        scaler = torch.amp.GradScaler()
        reducer = GradientReducer(model, "micro", 0.001, grad_scaler=scaler)
        scaler.scale(loss).backward()
        reducer.synchronize()      # on the scaled gradients; an overflow skips the step
        scaler.step(optimizer)     # unscales the average, or skips it
        scaler.update()

    Construction is collective: every rank must build its reducer with the same parameter
    shapes, sparsifier and options, or all ranks raise :class:`microsparse.ConfigMismatchError`.

    Example:
        >>> import torch, microsparse
        >>> model = torch.nn.Linear(100, 10)
        >>> reducer = microsparse.GradientReducer(model.parameters(), "micro", density=0.01)
        >>> model(torch.randn(4, 100)).sum().backward()
        >>> stats = reducer.synchronize()  # every p.grad is now the sparse average over ranks
        >>> stats.target  # k = floor(0.01 * 1010)
        10
    """

    def __init__(
        self,
        params: ParameterSource,
        sparsifier: str = "micro",
        density: float | None = None,
        *,
        budget: float | None = None,
        process_group: dist.ProcessGroup | None = None,
        value_dtype: torch.dtype | None = None,
        collectives: Collectives | None = None,
        nonfinite: NonFinite = "skip",
        grad_scaler: Any = None,
        momentum_correction: float = 0.0,
        momentum_nesterov: bool = False,
        adam_correction: tuple[float, float, float] | None = None,
        density_warmup: DensityWarmup | tuple[float, int] | None = None,
        **options: Any,
    ) -> None:
        if collectives is not None and process_group is not None:
            raise ValueError("pass process_group or collectives, not both")
        self.sparse_options = SparseOptions(
            sparsifier, density, value_dtype, nonfinite, momentum_correction, momentum_nesterov,
            adam_correction, density_warmup, options, budget, owner=keywords_of(type(self)),
        )  # fmt: skip
        """Every option of the sparse step, checked."""
        opts = self.sparse_options
        opts.check_scaler(grad_scaler)
        self._names, self._params = _trainable_parameters(params)
        first = self._params[0]
        self.layout = Layout.of(list(zip(self._names, self._params)))
        self._comm = collectives if collectives is not None else ProcessGroupCollectives(
            process_group
        )
        opts = self.sparse_options = opts.for_ranks(self._comm.world_size)
        self.sparsifier = create_sparsifier(sparsifier, opts.density, **opts.options)
        self.sparsifier.bind(self.layout, self._comm.rank, self._comm.world_size)
        dtype = accumulator_dtype(p.dtype for p in self._params)
        self._feedback = ErrorFeedback(self.layout, dtype, first.device, *opts.momentum,
                                       opts.adam_correction)  # fmt: skip
        schedule = None
        if opts.density_warmup is not None:
            warmup, final, numel = opts.density_warmup, self.sparsifier.target, self.layout.numel

            def schedule(step: int) -> int:
                return warmup.target(step, self.sparsifier.density, final, numel)

        self._engine = SparseStep(self.sparsifier, self._feedback, opts.value_dtype, schedule,
                                  opts.nonfinite)  # fmt: skip
        self._output = GradientOutput(self._params, self.layout)
        self.grad_scaler = grad_scaler
        self.step = 0
        self.last_step: StepStats | None = None
        """Statistics of the most recent :meth:`synchronize`, or ``None`` before the first."""
        check_agreement(
            self._comm,
            "the reducer configuration (parameter count, layout, sparsifier, density, options)",
            [self.layout.numel, zlib.crc32(self._fingerprint().encode())],
            first.device,
            described=self._config(),
        )

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def world_size(self) -> int:
        return self._comm.world_size

    @property
    def residual(self) -> torch.Tensor:
        """This worker's error-feedback residual e as one flat vector (do not modify)."""
        return self._feedback.residual

    @property
    def velocity(self) -> torch.Tensor | None:
        """This worker's velocity u with ``momentum_correction`` (do not modify), else None."""
        return self._feedback.velocity

    @property
    def moments(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This worker's Adam moments (m, v) with ``adam_correction`` (do not modify), else
        None."""
        return self._feedback.moments

    # Inside a torch.compile'd training step this runs as Python, not traced: its
    # collectives, fused kernels and host-side bookkeeping are a graph break of their own.
    @_eager
    def synchronize(self) -> StepStats:
        """Average the current gradients sparsely across all ranks; see the class docstring."""
        device = self._feedback.residual.device
        began = mark(device)
        fresh = [p.grad for p in self._params]
        if all(gradient is None for gradient in fresh):  # would average zeros into every .grad
            raise RuntimeError(
                "synchronize(): no parameter has a gradient (every .grad is None); call "
                "loss.backward() first, once per step on every rank, then synchronize()"
            )
        scale = scaler_scale(self.grad_scaler)
        protocol = self._engine.run(self.step, fresh, self._output, scale=scale)
        try:
            report = run_blocking(protocol, self._comm)
        except BaseException:
            self._engine.rollback()
            raise
        wall, select = elapsed(began, mark(device)), report.select_seconds
        waited = Pending.combine(lambda t: max(0.0, t[0] - t[1]), [wall, select])
        self.last_step = step_stats(
            self.step, self.world_size, [(self._engine, report)],
            exchange_seconds=waited, partition=report.partition,
        )  # fmt: skip
        self.step += 1
        return self.last_step

    def _config(self) -> dict[str, str]:
        """The options every rank must share, as text (joined, the saved fingerprint)."""
        shapes = ",".join("x".join(map(str, shape)) for shape in self.layout.shapes)
        opts = self.sparse_options
        config = {
            "parameter shapes": shapes,
            "sparsifier": self.sparsifier.name,
            "density": repr(self.sparsifier.density),
            "sparsifier options": str(sorted(self.sparsifier.options().items())),
            "gradient dtype": str(self._feedback.residual.dtype),
            # what is sent, not what was asked: a later default cannot change a resumed run
            "value_dtype": str(opts.wire_value_dtype(self.world_size)),
            "nonfinite='raise'": str(opts.nonfinite == "raise"),
        }
        # in the text older states saved; absent when off, so that they still load
        if opts.momentum_correction:
            config["momentum_correction"] = "momentum {} {}".format(*opts.momentum)
        if opts.adam_correction is not None:
            config["adam_correction"] = f"adam {opts.adam_correction!r}"
        if opts.density_warmup is not None:
            warmup = opts.density_warmup
            config["density_warmup"] = f"warm-up {warmup.start!r} {warmup.steps}"
        return config

    def _fingerprint(self) -> str:
        return "|".join(self._config().values())

    def _refusal(self, saved: str) -> str:
        """Why a state saved as ``saved`` does not load here, naming what differs."""
        config, values = self._config(), saved.split("|")
        if len(values) != len(config):
            differs = f"{saved!r} vs {self._fingerprint()!r}"
        else:
            differs = "; ".join(f"{name}: saved {old}, here {new}" for (name, new), old
                                in zip(config.items(), values) if old != new)  # fmt: skip
        fix = ""
        saved_density = dict(zip(config, values)).get("density", config["density"])
        if len(values) == len(config) and saved_density != config["density"]:
            fix = (f"; to continue that run, pass density={saved_density} (what a budget buys "
                   "changes with what an entry costs on the wire)")
        return (f"state was saved by a reducer with a different layout, sparsifier, density or "
                f"options ({differs}){fix}")  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: step, residual, sparsifier state.

        Example:
            >>> torch.save(reducer.state_dict(), f"reducer-rank{rank}.pt")  # doctest: +SKIP
        """
        velocity, moments = self._feedback.velocity, self._feedback.moments
        extra = {} if moments is None else {"moments": [m.clone() for m in moments]}
        return {
            **extra,
            "step": self.step,
            "rank": self.rank,
            "world_size": self.world_size,
            "residual": self._feedback.residual.clone(),
            "velocity": None if velocity is None else velocity.clone(),
            "sparsifier": self.sparsifier.state_dict(),
            "fingerprint": self._fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict` on the same rank of the same setup."""
        saved = (state.get("rank", self.rank), state.get("world_size", self.world_size))
        check_saved_by(saved, self.rank, self.world_size, "reducer")
        if state.get("fingerprint") != self._fingerprint():
            raise ValueError(self._refusal(str(state.get("fingerprint"))))
        self._feedback.residual.copy_(state["residual"])
        if self._feedback.velocity is not None:
            self._feedback.velocity.copy_(state["velocity"])
        for moment, saved_moment in zip(self._feedback.moments or (), state.get("moments", ())):
            moment.copy_(saved_moment)
        self.sparsifier.load_state_dict(state["sparsifier"])
        self.step = int(state["step"])
        self._engine.check_next = True  # the ranks' steps are compared at the next call


def _trainable_parameters(params: ParameterSource) -> tuple[list[str], list[torch.Tensor]]:
    if isinstance(params, nn.parallel.DistributedDataParallel):
        warnings.warn(
            "params: a DistributedDataParallel model averages every gradient densely in "
            "backward(), so the reducer would send sparse traffic on top of dense: pass the "
            "plain model (ddp.module, or the model before wrapping), or keep DDP and register "
            "microsparse.ddp.sparse_hook instead (docs/DDP.md)",
            stacklevel=3,
        )
    items = list(params.named_parameters() if isinstance(params, nn.Module) else params)
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    seen: set[int] = set()
    for index, item in enumerate(items):
        name, tensor = item if isinstance(item, tuple) else (f"parameter {index}", item)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                "params must hold tensors or (name, tensor) pairs; "
                f"item {index} is {type(tensor).__name__}"
            )
        if not tensor.requires_grad or id(tensor) in seen:  # frozen, or tied and listed twice
            continue
        if not tensor.is_floating_point():
            raise TypeError(
                f"params: {name} has dtype {tensor.dtype}; only real floating-point parameters "
                "have gradients to reduce (exclude complex tensors from params)"
            )
        seen.add(id(tensor))
        names.append(name)
        tensors.append(tensor)
    if not tensors:
        raise ValueError(
            "params: no parameter requires grad; pass model.parameters() (or named_parameters()) "
            "of a model with trainable parameters"
        )
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(
            f"params: all parameters must be on one device, found {sorted(map(str, devices))}"
        )
    return names, tensors


def accumulator_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """float32 or wider: residuals of half-precision parameters are kept in float32, because
    tiny unsent values would otherwise round away, which is what error feedback must not lose."""
    dtype = torch.float32
    for each in dtypes:
        dtype = torch.promote_types(dtype, each)
    return dtype
