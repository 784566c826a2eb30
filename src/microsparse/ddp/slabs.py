"""Slabs: the groups of parameters the DDP hook averages as one vector each.

A slab is what ``GradientReducer`` averages for the whole model: a flat vector of parameters
with its residual, its sparsifier and its :class:`~microsparse.engine.SparseStep`. In the hook
the slabs follow DDP's buckets, so each bucket's exchange starts as soon as DDP hands it over
and overlaps the rest of the backward pass.

DDP regroups parameters into new buckets after its first iteration (its second with
``static_graph=True``). State keyed by ``bucket.index()`` would then attach one layer's
residual to another; here every parameter's residual moves with it into its new slab. A state
restored from a checkpoint keeps the saved slabs for its first pass, whatever DDP's first
buckets are (a slab may then span several buckets, or a bucket hold several slabs), so a
resumed run selects exactly what the uninterrupted one did.

Each slab's share of k is cut from the model-wide target by its offset in the pass, so the
slabs of a pass select k entries in all: k_s = ⌊δ(o_s + d_s)⌋ − ⌊δ·o_s⌋ (at least 1).

With ``one_exchange`` the whole model is one slab whatever DDP's buckets: every bucket waits
for it, and its step starts when DDP hands over the last bucket of the pass. That is one
exchange per step (two collective rounds for MiCRO) instead of one per bucket, and k is not
split; it gives up overlapping the exchange with the rest of backward. Its average is still
written in O(K), into a buffer per bucket (:class:`BucketsOutput`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from microsparse.comm.framing import Dense
from microsparse.engine import FlatOutput, SparseOutput, SparseStep
from microsparse.engine.output import as_dtype
from microsparse.feedback import ErrorFeedback
from microsparse.layout import Layout
from microsparse.options import SparseOptions
from microsparse.sparsifiers import Sparsifier
from microsparse.sparsifiers.warmup import DensityWarmup

RESTORE_AFTER_BACKWARD = (
    "load_state_dict must be called before the first backward pass: this state has averaged "
    "gradients already, and its residuals belong to that run. Restore right after building the "
    "DDP model and registering the hook, before training (with Accelerate: call "
    "accelerator.load_state() before the first step). To go back to a checkpoint later in a run, "
    "build a fresh model and state, register the hook on it, and load into those"
)
"""The error of a restore into a state that has trained (Accelerate users meet it when they
call ``save_state()`` and then ``load_state()`` in one run)."""


def slab_target(density: float, offset: int, numel: int) -> int:
    """k_s of a slab of ``numel`` entries after ``offset`` entries of earlier slabs.

    Example:
        >>> [slab_target(0.001, offset, 700) for offset in (0, 700, 1400)]  # δ·d = 2.1 in all
        [1, 1, 1]
        >>> sum(slab_target(0.01, o, 300) for o in range(0, 3000, 300))  # ⌊0.01 · 3000⌋
        30
    """
    return max(1, math.floor(density * (offset + numel)) - math.floor(density * offset))


def _slab_schedule(
    warmup: DensityWarmup | None, density: float, offset: int, target: int, numel: int
) -> Callable[[int], int] | None:
    """k of each step of a slab under a density warm-up: the slabs' ks add up to the model's."""
    if warmup is None:
        return None

    def schedule(step: int) -> int:
        if step >= warmup.steps:
            return target
        return max(target, slab_target(warmup.density(step, density), offset, numel))

    return schedule


class Slab:
    """Parameters averaged as one flat vector, with their residual and engine."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        indices: Sequence[int],
        options: SparseOptions,
        offset: int,
        rank: int,
        world_size: int,
    ) -> None:
        self.params = tuple(params)
        self.indices = tuple(indices)
        """Each parameter's place in the order the state first met them (for checkpoints)."""
        self.layout = Layout.of([(f"parameter {i}", p) for i, p in zip(self.indices, params)])
        sparsifier = options.make_sparsifier()
        target = slab_target(sparsifier.density, offset, self.layout.numel)
        sparsifier.bind(self.layout, rank, world_size, target)
        dtype = torch.promote_types(torch.float32, params[0].dtype)
        for p in params:
            dtype = torch.promote_types(dtype, p.dtype)
        self.feedback = ErrorFeedback(self.layout, dtype, params[0].device, *options.momentum,
                                      options.adam_correction)  # fmt: skip
        schedule = _slab_schedule(options.density_warmup, sparsifier.density, offset, target,
                                  self.layout.numel)  # fmt: skip
        self.engine = SparseStep(sparsifier, self.feedback, options.value_dtype, schedule,
                                 options.nonfinite)  # fmt: skip
        self._output: SparseOutput | None = None

    def output_for(self, buffer: torch.Tensor) -> FlatOutput | SparseOutput:
        """Where the average of a slab that is exactly DDP's bucket ``buffer`` goes
        (:func:`bucket_output`; dense slabs average the bucket itself)."""
        if isinstance(self.engine.framing, Dense):
            return FlatOutput(buffer)
        output = bucket_output(buffer, self.params[0], self._output)
        if isinstance(output, SparseOutput):
            self._output = output
        return output

    @property
    def sparsifier(self) -> Sparsifier:
        return self.engine.sparsifier


@dataclass
class Job:
    """One slab's step of one pass: where its gradient is and where the average goes."""

    slab: Slab
    key: object
    """Names the slab in this pass (the buckets holding its parameters wait for it)."""
    fresh: torch.Tensor | list[torch.Tensor]
    output: FlatOutput | SparseOutput | PiecesOutput | BucketsOutput
    buckets: list[int]
    """Indices (in this pass) of the buckets holding its parameters."""
    exclude: list[tuple[int, int]] = field(default_factory=list)
    """Slab ranges of parameters this rank did not use this pass: not proposed."""


class PiecesOutput:
    """The average of a slab whose parameters lie in several DDP buckets (or share one)."""

    def __init__(self, views: Sequence[torch.Tensor], layout: Layout) -> None:
        self._views = list(views)
        self._layout = layout

    def write(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        for view, offset, size in zip(self._views, self._layout.offsets, self._layout.sizes):
            flat = view.view(-1)
            flat.zero_()
            local, inside = _within(positions, offset, size)
            flat.index_add_(0, local, as_dtype(values.where(inside, 0), flat.dtype))

    def poison(self) -> None:
        for view in self._views:
            view.fill_(float("nan"))

    def dense(self, fresh: object) -> torch.Tensor:
        raise NotImplementedError("dense slabs always follow DDP's buckets one to one")


class BucketsOutput:
    """The average of one slab spread over several DDP buckets, each rewritten in O(K).

    ``places`` gives, for each parameter of the slab in order, its bucket's number and its
    offset in that bucket; ``outputs`` holds each bucket's output (what its future returns).

    Example:
        >>> layout = Layout.of([("a", torch.zeros(2)), ("b", torch.zeros(3))])
        >>> buckets = [SparseOutput(torch.zeros(3)), SparseOutput(torch.zeros(2))]
        >>> out = BucketsOutput(layout, [(1, 0), (0, 0)], buckets)   # b came first, alone
        >>> out.write(torch.tensor([1, 4]), torch.tensor([5.0, 7.0]))
        >>> buckets[0].data.tolist(), buckets[1].data.tolist()
        ([0.0, 0.0, 7.0], [0.0, 5.0])
    """

    def __init__(
        self,
        layout: Layout,
        places: Sequence[tuple[int, int]],
        outputs: Sequence[FlatOutput | SparseOutput],
    ) -> None:
        device = outputs[0].data.device
        self._outputs = list(outputs)
        self._ends = torch.tensor([o + n for o, n in zip(layout.offsets, layout.sizes)],
                                  dtype=torch.long, device=device)  # fmt: skip
        self._bucket = torch.tensor([number for number, _ in places], device=device)
        self._shift = torch.tensor([at - offset for (_, at), offset in zip(places, layout.offsets)],
                                   dtype=torch.long, device=device)  # fmt: skip

    def write(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        parameter = torch.searchsorted(self._ends, positions, right=True)
        local = positions + self._shift[parameter]
        bucket = self._bucket[parameter]
        for number, output in enumerate(self._outputs):
            # Every bucket gets every slot; slots of other buckets add 0 at position 0.
            inside = bucket == number
            output.write(local.where(inside, 0), values.where(inside, 0))

    def poison(self) -> None:
        for output in self._outputs:
            output.poison()

    def dense(self, fresh: object) -> torch.Tensor:
        raise NotImplementedError("dense slabs always follow DDP's buckets one to one")


def _within(positions: torch.Tensor, offset: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions − offset`` where they fall in [offset, offset + size), else 0; and where."""
    local = positions - offset
    inside = (local >= 0) & (local < size)
    return local.where(inside, 0), inside


def bucket_output(
    buffer: torch.Tensor, first: torch.Tensor, kept: SparseOutput | None
) -> FlatOutput | SparseOutput:
    """Where the sparse average of DDP's bucket ``buffer`` goes, ``first`` its first parameter.

    DDP copies the hook's result into every ``p.grad``. On a CPU a buffer of our own
    (``kept``, if it still fits), rewritten in O(K), saves zeroing the bucket every step; on a
    GPU, where zeroing costs next to nothing and memory is what is short, the bucket itself
    is used, as it is for gradients that are views of the bucket
    (``gradient_as_bucket_view=True``).
    """
    grad, storage = first.grad, buffer.untyped_storage().data_ptr()
    if buffer.is_cuda or (grad is not None and grad.untyped_storage().data_ptr() == storage):
        return FlatOutput(buffer)
    if kept is None or kept.data.dtype != buffer.dtype or kept.data.shape != buffer.shape:
        return SparseOutput(torch.zeros_like(buffer))
    return kept


class _Arrived:
    """Where each parameter's gradient is in this pass: (bucket number, flat view), and its
    offset in its bucket."""

    def __init__(self) -> None:
        self.where: dict[int, tuple[int, torch.Tensor]] = {}
        self.offset: dict[int, int] = {}

    def add(self, bucket_number: int, params: Sequence[torch.Tensor], buffer: torch.Tensor) -> None:
        offset = 0
        for p in params:
            self.where[id(p)] = (bucket_number, buffer[offset : offset + p.numel()].view(p.shape))
            self.offset[id(p)] = offset
            offset += p.numel()


class Slabs:
    """Which slab each parameter is in, following DDP's buckets; see the module docstring.

    ``options`` builds each new slab's sparsifier and feedback; ``one_exchange`` makes the
    whole model one slab (see the module docstring).
    """

    def __init__(
        self,
        options: SparseOptions,
        rank: int,
        world_size: int,
        one_exchange: bool = False,
    ) -> None:
        self.options = options
        self.one_exchange = one_exchange
        self._bucket_outputs: dict[int, SparseOutput] = {}  # one_exchange: kept per bucket
        self._spread: tuple[object, BucketsOutput] | None = None
        self.rank = rank
        self.world_size = world_size
        self.order: list[torch.Tensor] = []
        """Parameters in the order first met: on a fresh DDP model fixed by its definition."""
        self._index: dict[int, int] = {}
        self._slab_of: dict[int, Slab] = {}
        self._place: dict[int, tuple[Slab, int]] = {}  # parameter -> (its slab, its index)
        self._loaded: dict[int, list[torch.Tensor]] = {}  # restored, not yet in a slab
        """Every parameter's memory (by ``id``): residual, and velocity with momentum."""
        self._used_in: dict[int, int] = {}
        self._met_in: dict[int, int] = {}
        self._pass = 0
        self._restored: _Saved | None = None
        self._saved_memory: list[list[torch.Tensor]] | None = None
        self._begin_pass()

    # ---- one pass ---------------------------------------------------------------------

    def _begin_pass(self) -> None:
        self._arrived = _Arrived()
        self._pass_outputs: dict[int, FlatOutput | SparseOutput] = {}
        self._started: set[int] = set()
        self._offset = 0  # entries of the slabs started so far in this pass
        self._buckets = 0

    def end_pass(self) -> None:
        self._pass += 1
        self._restored = None  # the saved slabs held for the first pass only
        self._begin_pass()

    def arrive(
        self, params: Sequence[torch.Tensor], buffer: torch.Tensor, last: bool = False
    ) -> tuple[list[Job], set[object], torch.Tensor]:
        """DDP handed over a bucket (``last``: the last of the pass): the jobs of the slabs
        that now have all their gradients (in an order that is the same on every rank), the
        keys of the slabs the bucket must wait for, and the tensor its future completes
        with."""
        number = self._buckets
        self._buckets += 1
        for p in params:
            self.meet(p)
        self._arrived.add(number, params, buffer)
        if self._restored is None and self.one_exchange:
            return self._arrive_for_one_slab(number, params, buffer, last)
        if self._restored is None:
            key = tuple(id(p) for p in params)
            slab = self._slab_of.get(key[0])
            if slab is None or tuple(id(p) for p in slab.params) != key:
                slab = self._new_slab(params)
            job = self._job(slab, id(slab), whole=buffer)
            return [job], {id(slab)}, job.output.data
        saved = self._restored
        waiting: set[object] = {
            ("saved", saved.slab_of[self._index[id(p)]])
            for p in params
            if self._index[id(p)] in saved.slab_of
        }
        jobs = [self._job(slab, ("saved", n)) for n, slab in self._ready_restored_slabs()]
        return jobs, waiting, buffer

    def _arrive_for_one_slab(
        self, number: int, params: Sequence[torch.Tensor], buffer: torch.Tensor, last: bool
    ) -> tuple[list[Job], set[object], torch.Tensor]:
        output = bucket_output(buffer, params[0], self._bucket_outputs.get(number))
        if isinstance(output, SparseOutput):
            self._bucket_outputs[number] = output
        self._pass_outputs[number] = output
        if not last:
            return [], {_MODEL}, output.data
        arrived = [p for p in self.order if id(p) in self._arrived.where]
        slab = self._slab_of.get(id(arrived[0]))
        if slab is None or tuple(id(p) for p in slab.params) != tuple(id(p) for p in arrived):
            slab = self._new_slab(arrived)
        places = [(self._arrived.where[id(p)][0], self._arrived.offset[id(p)]) for p in arrived]
        outputs = [self._pass_outputs[n] for n in range(self._buckets)]
        # By memory, not object: DDP hands out a new tensor of the same bucket every pass.
        key = (id(slab), tuple(places), tuple(o.data.data_ptr() for o in outputs))
        if self._spread is None or self._spread[0] != key:  # once after DDP's rebuild
            self._spread = (key, BucketsOutput(slab.layout, places, outputs))
        job = self._job(slab, _MODEL, spread=self._spread[1])
        return [job], {_MODEL}, output.data

    def _job(
        self,
        slab: Slab,
        key: object,
        whole: torch.Tensor | None = None,
        spread: BucketsOutput | None = None,
    ) -> Job:
        """``whole``: the slab is exactly this bucket; ``spread``: the output of a slab over
        several buckets (else written into the buckets' views, zeroing each)."""
        self._started.add(id(slab))
        self._offset += slab.layout.numel
        where = [self._arrived.where[id(p)] for p in slab.params]
        buckets = sorted({number for number, _ in where})
        exclude = [
            (offset, offset + size)
            for p, offset, size in zip(slab.params, slab.layout.offsets, slab.layout.sizes)
            if not self.used(p)
        ]
        if whole is not None:
            return Job(slab, key, whole, slab.output_for(whole), buckets, exclude)
        views = [view for _, view in where]
        output = spread if spread is not None else PiecesOutput(views, slab.layout)
        return Job(slab, key, views, output, buckets, exclude)

    # ---- parameters and slabs ---------------------------------------------------------

    def meet(self, param: torch.Tensor) -> None:
        """Learn ``param`` (its place in the order, its restored memory, its use marks)."""
        if id(param) in self._index:
            return
        index = len(self.order)
        self._index[id(param)] = index
        self._met_in[id(param)] = self._pass
        self.order.append(param)
        saved = self._saved_memory
        if saved is not None:
            if index >= len(saved) or saved[index][0].numel() != param.numel():
                raise ValueError(
                    "load_state_dict: the checkpoint's residuals do not match this model's "
                    f"parameters (parameter {index} has {param.numel()} elements); restore into "
                    "the same model definition, before its first backward pass"
                )
            # Copies: a dense pass zeroes a residual in place; the caller's checkpoint stays.
            self._loaded[id(param)] = [buffer.reshape(-1).clone() for buffer in saved[index]]
        # Marks the pass in which autograd gave the parameter a gradient on this rank; it runs
        # before DDP's own hook for it. Unused parameters (find_unused_parameters=True) are then
        # not proposed: DDP drops their average, which would lose what their residual sent.
        param.register_post_accumulate_grad_hook(self._mark_used)

    def _mark_used(self, param: torch.Tensor) -> None:
        self._used_in[id(param)] = self._pass

    def used(self, param: torch.Tensor) -> bool:
        """Whether autograd gave ``param`` a gradient on this rank in this pass."""
        if self._met_in[id(param)] < self._pass:
            return self._used_in.get(id(param)) == self._pass
        return param.grad is not None  # met in this pass, before its hook could mark it

    def _new_slab(self, params: Sequence[torch.Tensor]) -> Slab:
        indices = [self._index[id(p)] for p in params]
        slab = Slab(params, indices, self.options, self._offset, self.rank, self.world_size)
        for index, p in enumerate(params):
            previous = self.memory(p)
            if previous is not None:  # DDP rebuilt its buckets (or a restore): it moves along
                for buffer, old in zip(slab.feedback.buffers, previous):
                    buffer.views[index].view(-1).copy_(old)
            self._loaded.pop(id(p), None)
            self._place[id(p)] = (slab, index)
            self._slab_of[id(p)] = slab
        return slab

    def _ready_restored_slabs(self) -> list[tuple[int, Slab]]:
        saved = self._restored
        assert saved is not None
        ready = []
        for number, definition in enumerate(saved.slabs):
            if number in saved.built or not all(
                i < len(self.order) and id(self.order[i]) in self._arrived.where
                for i in definition
            ):
                continue
            slab = self._new_slab([self.order[i] for i in definition])
            if saved.states[number]:  # {}: a sparsifier that carries nothing (or a fresh one)
                slab.sparsifier.load_state_dict(saved.states[number])
            saved.built.add(number)
            ready.append((number, slab))
        return ready

    def residual(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param``'s residual (flat; a view into its slab's), None before it is met."""
        memory = self.memory(param)
        return None if memory is None else memory[0]

    def memory(self, param: torch.Tensor) -> list[torch.Tensor] | None:
        """``param``'s residual, then its velocity with momentum correction or its two Adam
        moments with Adam correction (flat views into its slab's), None before it is met."""
        place = self._place.get(id(param))
        if place is None:
            return self._loaded.get(id(param))
        slab, index = place
        return [buffer.views[index].view(-1) for buffer in slab.feedback.buffers]

    @property
    def slabs(self) -> list[Slab]:
        """The current slabs, in the order of their first parameter."""
        unique = {id(slab): slab for slab in self._slab_of.values()}
        return sorted(unique.values(), key=lambda slab: slab.indices[0])

    # ---- checkpoints ------------------------------------------------------------------

    def state(self) -> dict[str, object]:
        slabs = self.slabs
        memory = [[buffer.detach().clone() for buffer in self.memory(p)] for p in self.order]
        state: dict[str, object] = {
            "residuals": [buffers[0] for buffers in memory],
            "slabs": [list(slab.indices) for slab in slabs],
            "states": [slab.sparsifier.state_dict() for slab in slabs],
        }
        if self.options.momentum_correction:
            state["velocities"] = [buffers[1] for buffers in memory]
        if self.options.adam_correction is not None:
            state["moments"] = [buffers[1:] for buffers in memory]
        return state

    def restore(self, state: dict[str, object]) -> None:
        """Take a :meth:`state`; the parameters are matched in the order they are met."""
        if self.order:
            raise RuntimeError(RESTORE_AFTER_BACKWARD)
        definitions = [list(slab) for slab in state["slabs"]]  # type: ignore[attr-defined]
        slab_of = {index: number for number, slab in enumerate(definitions) for index in slab}
        saved = _Saved(list(state["residuals"]), definitions,  # type: ignore[call-overload]
                       list(state["states"]), slab_of, set())  # type: ignore[call-overload]  # fmt: skip
        velocities = state.get("velocities") if self.options.momentum_correction else None
        moments = state.get("moments") if self.options.adam_correction is not None else None
        self._saved_memory = [
            [residual]
            + ([] if velocities is None else [velocities[i]])  # type: ignore[index]
            + ([] if moments is None else list(moments[i]))  # type: ignore[index]
            for i, residual in enumerate(saved.residuals)
        ]
        # A dense average selects nothing, so the saved grouping changes nothing: dense slabs
        # follow DDP's buckets from the first pass, their residuals moving in by parameter.
        keeps_slabs = saved.slabs and not self.options.averages_densely
        self._restored = saved if keeps_slabs else None

    def check_complete(self) -> None:
        """At the end of a restored pass: every parameter must have been in a saved slab."""
        if self._restored is None:
            return
        missing = [self._index[key] for key in self._arrived.where if key not in self._slab_of]
        if missing or len(self._restored.built) < len(self._restored.slabs):
            raise ValueError(
                "load_state_dict: the checkpoint's slabs do not match this model's parameters "
                f"(parameters {missing[:10]} are in none of them); restore into the same model "
                "definition"
            )


_MODEL = "model"
"""The key every bucket waits for with ``one_exchange``: the one slab of the whole model."""


@dataclass
class _Saved:
    """A restored state's slabs, kept for the first pass."""

    residuals: list[torch.Tensor]
    slabs: list[list[int]]
    """Each slab as the meeting indices of its parameters."""
    states: list[dict]
    slab_of: dict[int, int]
    built: set[int]
