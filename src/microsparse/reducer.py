"""The plain-training-loop API: sparse gradient averaging between ``backward`` and ``step``."""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from microsparse.comm import Communicator, all_gather_bytes, all_reduce_bytes
from microsparse.comm.collectives import index_dtype
from microsparse.errors import ConfigMismatchError, NonFiniteGradientError
from microsparse.feedback import ErrorFeedback
from microsparse.layout import FlatVector, Layout
from microsparse.sparsifiers import create_sparsifier
from microsparse.stats import StepStats

ParameterSource = nn.Module | Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]]

_HEADER = ("selected", "nonfinite", "step")  # the fixed-size message every rank sends first


class GradientReducer:
    """Replaces every ``p.grad`` by the sparsified average of all workers' gradients.

    Call :meth:`synchronize` after ``loss.backward()`` and before ``optimizer.step()`` on every
    rank. Each call: adds the fresh gradients to this worker's residual (error feedback), lets
    the sparsifier select positions, exchanges them so every rank knows all selected positions,
    all-reduces every rank's accumulated values there, divides by n, writes that sparse
    average into ``p.grad`` (identical on all ranks), and keeps what was not sent as the new
    residual. Momentum and weight decay stay with your optimiser and act on the average.

    Args:
        params: a module, ``module.parameters()`` or ``module.named_parameters()``; the flat
            gradient vector follows this order. Parameters that do not require grad are skipped.
        sparsifier: a name from :func:`microsparse.available_sparsifiers`.
        density: fraction δ of the d gradient entries to send per step, in (0, 1].
        process_group: the group to average over; ``None`` is the default group, or a group
            of one when ``torch.distributed`` is not initialised.
        value_dtype: send the selected values as ``torch.float16`` or ``torch.bfloat16``
            (half the value bytes); each rank's rounding error stays in its residual, so only
            the rounding of the sum itself is lost. float16 overflows above 65504: prefer
            bfloat16 unless gradients are known to be small.
        **options: options of the chosen sparsifier, e.g. ``threshold_rule="as_coded"``.

    Non-finite gradients: if any rank's accumulated gradient holds NaN or Inf, every rank
    raises :class:`microsparse.NonFiniteGradientError` in the same step, naming the step, the
    ranks and (on those ranks) the parameters. Nothing is averaged; the residual is not
    usable afterwards (restore a checkpoint).

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
        density: float = 0.001,
        *,
        process_group: dist.ProcessGroup | None = None,
        value_dtype: torch.dtype | None = None,
        **options: Any,
    ) -> None:
        if value_dtype not in (None, torch.float16, torch.bfloat16):
            raise ValueError(
                f"value_dtype must be None, torch.float16 or torch.bfloat16; got {value_dtype!r}"
            )
        self.value_dtype = value_dtype
        self._names, self._params = _trainable_parameters(params)
        first = self._params[0]
        self.layout = Layout.of(list(zip(self._names, self._params)))
        self._comm = Communicator(process_group)
        self.sparsifier = create_sparsifier(sparsifier, density, **options)
        self.sparsifier.bind(self.layout, self._comm.rank, self._comm.world_size)
        if self.sparsifier.exchange not in self._EXCHANGES:
            raise ValueError(
                f"sparsifier {sparsifier!r} declares exchange {self.sparsifier.exchange!r}; "
                f"the reducer knows {', '.join(sorted(self._EXCHANGES))}"
            )
        dtype = _accumulator_dtype(self._params)
        self._feedback = ErrorFeedback(self.layout, dtype, first.device)
        self._averaged = FlatVector(self.layout, dtype, first.device)  # reused every step
        self._written = torch.empty(0, dtype=torch.long, device=first.device)
        self._message_buffer: torch.Tensor | None = None
        self.step = 0
        self.last_step: StepStats | None = None
        """Statistics of the most recent :meth:`synchronize`, or ``None`` before the first."""
        self._comm.check_agreement(
            "the reducer configuration (parameter count, layout, sparsifier, density, options)",
            [self.layout.numel, zlib.crc32(self._fingerprint().encode())],
            first.device,
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
        return self._feedback.accumulated

    def synchronize(self) -> StepStats:
        """Average the current gradients sparsely across all ranks; see the class docstring."""
        step, n, numel = self.step, self._comm.world_size, self.layout.numel
        began = started = time.perf_counter()
        self._feedback.compensate([p.grad for p in self._params])
        accumulated = self._feedback.accumulated
        if self.sparsifier.planned:  # waiting for the leader's plan is part of selection
            local, counts, agreed_bytes = self._select_planned(accumulated, step)
            selected_at = time.perf_counter()
        else:
            proposal = self.sparsifier.agreement(accumulated, step)
            proposal_bytes = 0
            if proposal is not None:  # e.g. MiCRO's threshold histogram, summed over ranks
                # Waiting for the other ranks is exchange time, not selection cost.
                waiting = time.perf_counter()
                proposal_bytes = self._comm.sum_(proposal)
                started += time.perf_counter() - waiting
                self.sparsifier.adopt_agreement(proposal)
            local = self.sparsifier.select(accumulated, step)
            selected_at = time.perf_counter()
            counts, agreed_bytes = [], proposal_bytes
            if self.sparsifier.exchange != "fixed":  # "fixed" carries the header itself
                counts, header_bytes = self._agree(local.numel(), step, accumulated)
                agreed_bytes += header_bytes
        threshold, extra = self.sparsifier.threshold, self.sparsifier.report()

        exchange = self._EXCHANGES[self.sparsifier.exchange]
        result = exchange(self, accumulated, local, counts)
        self.sparsifier.update(result.selected)
        finished = time.perf_counter()

        self.step += 1
        self.last_step = StepStats(
            step=step,
            numel=numel,
            world_size=n,
            selected=result.selected,
            target=self.sparsifier.target,
            threshold=threshold,
            local_selected=result.local_selected,
            max_local_selected=result.max_local_selected,
            partition=self.sparsifier.partition(step),
            bytes_sent=agreed_bytes + result.bytes_sent,
            dense_bytes=all_reduce_bytes(numel * accumulated.element_size(), n),
            select_seconds=selected_at - started,
            exchange_seconds=finished - selected_at + (started - began),
            extra=extra,
            proposed=result.proposed,
            exchange=self.sparsifier.exchange,
        )
        return self.last_step

    def _select_planned(
        self, accumulated: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, list[int], int]:
        """Check the header first (a leader must not plan on NaN or at another step), then
        broadcast the leader's plan, which fixes every rank's count, and select by it."""
        _, sent = self._agree(0, step, accumulated)
        leader = self.sparsifier.leader(step)
        if self._comm.rank == leader:
            plan = self.sparsifier.make_plan(accumulated, step)
        else:
            plan = self.sparsifier.empty_plan(accumulated.device)
        sent += self._comm.broadcast_(plan, leader)
        counts = self.sparsifier.adopt_plan(plan, step)
        local = self.sparsifier.select(accumulated, step)
        if local.numel() != counts[self._comm.rank]:
            raise RuntimeError(
                f"{self.sparsifier.name}: rank {self._comm.rank} selected {local.numel()} "
                f"positions but its plan says {counts[self._comm.rank]} (a sparsifier bug)"
            )
        return local, counts, sent

    def _agree(self, count: int, step: int, accumulated: torch.Tensor) -> tuple[list[int], int]:
        """All-gather the fixed-size header; raise on every rank if any rank is unusable."""
        header = torch.tensor([count, 0, step], dtype=torch.long, device=accumulated.device)
        header[1] = self._feedback.nonfinite()
        rows = self._comm.all_gather_rows(header).tolist()
        self._check_header(rows)
        sent = all_gather_bytes(header.numel() * header.element_size(), self._comm.world_size)
        return [row[0] for row in rows], sent

    def _exchange_indices(
        self, accumulated: torch.Tensor, local: torch.Tensor, counts: list[int]
    ) -> _Exchanged:
        """``exclusive`` and ``union``: all-gather the padded index lists, average there."""
        positions, sent = self._comm.gather_indices(
            local, counts, self.layout.numel, unique=self.sparsifier.exchange == "union"
        )
        sent += self._average_at(accumulated, positions)
        return _Exchanged(positions.numel(), local.numel(), max(counts), sum(counts), sent)

    def _exchange_shared(
        self, accumulated: torch.Tensor, local: torch.Tensor, counts: list[int]
    ) -> _Exchanged:
        """``shared``: every rank already holds the same positions; only values travel."""
        if len(set(counts)) > 1:
            raise ConfigMismatchError(
                f"{self.sparsifier.name} must select the same positions on every rank, but the "
                f"counts per rank are {counts}"
            )
        sent = self._average_at(accumulated, local)
        selected = local.numel()
        return _Exchanged(selected, selected, selected, selected, sent)

    def _exchange_dense(
        self, accumulated: torch.Tensor, local: torch.Tensor, counts: list[int]
    ) -> _Exchanged:
        """``dense``: all-reduce the whole vector in place; nothing is left behind."""
        sent = self._comm.sum_(accumulated)
        accumulated.div_(self._comm.world_size)
        self._copy_to_grads(self._feedback.views)
        accumulated.zero_()
        numel = self.layout.numel
        return _Exchanged(numel, numel, numel, numel, sent)

    def _exchange_fixed(
        self, accumulated: torch.Tensor, local: torch.Tensor, counts: list[int]
    ) -> _Exchanged:
        """``fixed``: one all-gather of ``capacity`` slots per rank, header included.

        Positions beyond the slots (the smallest of them) are not sent this step: they stay
        in the residual.
        """
        slots, proposed = self.sparsifier.capacity, local.numel()
        if proposed > slots:
            keep = torch.topk(accumulated.index_select(0, local).abs_(), slots).indices
            local = local.index_select(0, keep)
        message = self._message(_FIXED_HEADER + slots, local.device)
        message[0] = local.numel()
        message[1] = self._feedback.nonfinite()
        message[2] = self.step
        message[3] = proposed
        message[_FIXED_HEADER : _FIXED_HEADER + local.numel()] = local
        message[_FIXED_HEADER + local.numel() :] = 0  # what is not a position must not leak
        rows = self._comm.all_gather_rows(message)
        header = rows[:, :_FIXED_HEADER].tolist()
        self._check_header(header)
        counts = [row[0] for row in header]
        pieces = [
            rows[rank, _FIXED_HEADER : _FIXED_HEADER + count] for rank, count in enumerate(counts)
        ]
        positions = torch.cat(pieces).long()
        sent = all_gather_bytes(message.numel() * message.element_size(), self._comm.world_size)
        sent += self._average_at(accumulated, positions)
        proposals = sum(row[3] for row in header)
        return _Exchanged(positions.numel(), local.numel(), slots, proposals, sent)

    def _message(self, length: int, device: torch.device) -> torch.Tensor:
        """The first ``length`` slots of the index message buffer, allocated once at capacity."""
        if self._message_buffer is None:
            dtype = index_dtype(self.layout.numel)
            capacity = _FIXED_HEADER + self.sparsifier.capacity
            self._message_buffer = torch.empty(capacity, dtype=dtype, device=device)
        return self._message_buffer[:length]

    _EXCHANGES = {
        "exclusive": _exchange_indices,
        "fixed": _exchange_fixed,
        "union": _exchange_indices,
        "shared": _exchange_shared,
        "dense": _exchange_dense,
    }

    def _average_at(self, accumulated: torch.Tensor, positions: torch.Tensor) -> int:
        """Average every rank's values at ``positions``, write them, forget them locally."""
        values = accumulated.index_select(0, positions)
        if self.value_dtype is None:
            sent = self._comm.sum_(values)
            self._feedback.forget(positions)
        else:
            wire = values.to(self.value_dtype)
            # What rounding took from this rank's values stays behind in its residual.
            accumulated.index_copy_(0, positions, values.sub_(wire))
            sent = self._comm.sum_(wire)
            values = wire.to(accumulated.dtype)
        values.div_(self._comm.world_size)
        self._write_gradients(positions, values)
        return sent

    def _check_header(self, rows: list[list[int]]) -> None:
        steps = [row[2] for row in rows]
        if len(set(steps)) > 1:
            raise ConfigMismatchError(
                f"ranks called synchronize() a different number of times (steps per rank: "
                f"{steps}); every rank must call it exactly once per training step"
            )
        bad_ranks = [rank for rank, row in enumerate(rows) if row[1]]
        if bad_ranks:
            where = ""
            if self._comm.rank in bad_ranks:
                names = [
                    name
                    for name, p in zip(self._names, self._params)
                    if p.grad is not None and not torch.isfinite(p.grad).all()
                ] or ["(the residual carried from an earlier step)"]
                where = f"; on rank {self._comm.rank} in parameter(s) {', '.join(names)}"
            raise NonFiniteGradientError(
                f"step {steps[0]}: NaN or Inf gradient on rank(s) {bad_ranks}{where}. Lower the "
                "learning rate, clip gradients, or unscale AMP gradients before synchronize()"
            )

    def _write_gradients(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        averaged = self._averaged.data
        # Only last step's positions are nonzero: clearing them is O(K), not a pass over d.
        averaged.index_fill_(0, self._written, 0)
        averaged.index_copy_(0, positions, values)
        self._written = positions
        self._copy_to_grads(self._averaged.views)

    def _copy_to_grads(self, views: list[torch.Tensor]) -> None:
        for p, view in zip(self._params, views):
            if p.grad is None:
                p.grad = view.to(p.dtype, copy=True)
            else:
                p.grad.copy_(view)

    def _fingerprint(self) -> str:
        shapes = ",".join("x".join(map(str, shape)) for shape in self.layout.shapes)
        return (
            f"{shapes}|{self.sparsifier.name}|{self.sparsifier.density!r}|"
            f"{sorted(self.sparsifier.options().items())}|{self._feedback.accumulated.dtype}|"
            f"{self.value_dtype}"
        )

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: step, residual, sparsifier state.

        Example:
            >>> torch.save(reducer.state_dict(), f"reducer-rank{rank}.pt")  # doctest: +SKIP
        """
        return {
            "step": self.step,
            "residual": self._feedback.accumulated.clone(),
            "sparsifier": self.sparsifier.state_dict(),
            "fingerprint": self._fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict` on the same rank of the same setup."""
        if state.get("fingerprint") != self._fingerprint():
            raise ValueError(
                "state was saved by a reducer with a different layout, sparsifier, density or "
                f"options ({state.get('fingerprint')!r} vs {self._fingerprint()!r})"
            )
        self._feedback.accumulated.copy_(state["residual"])
        self.sparsifier.load_state_dict(state["sparsifier"])
        self.step = int(state["step"])


_FIXED_HEADER = 4  # count, non-finite flag, step, proposals: the header of a "fixed" message


class _Exchanged(NamedTuple):
    """What one exchange kind reports back to :meth:`GradientReducer.synchronize`."""

    selected: int
    local_selected: int
    max_local_selected: int
    proposed: int
    bytes_sent: int


def _trainable_parameters(params: ParameterSource) -> tuple[list[str], list[torch.Tensor]]:
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
        if not tensor.is_floating_point():
            raise TypeError(
                f"params: {name} has dtype {tensor.dtype}; only real floating-point parameters "
                "have gradients to reduce (exclude integer or complex tensors from params)"
            )
        if not tensor.requires_grad or id(tensor) in seen:  # frozen, or tied and listed twice
            continue
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


def _accumulator_dtype(params: list[torch.Tensor]) -> torch.dtype:
    # Residuals of half-precision parameters are kept in float32: tiny unsent values would
    # otherwise round away, which is exactly what error feedback must not lose.
    dtype = torch.float32
    for p in params:
        dtype = torch.promote_types(dtype, p.dtype)
    return dtype
