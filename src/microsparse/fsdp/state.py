"""The sparse exchange across replicas inside FSDP2's all-reduce hook; see ``microsparse.fsdp``."""

from __future__ import annotations

import functools
import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from microsparse.comm import ProcessGroupCollectives
from microsparse.comm.collectives import check_agreement
from microsparse.ddp.slabs import Job, Slab
from microsparse.ddp.state import PassRecord
from microsparse.engine import FlatOutput
from microsparse.engine.step import NonFinite, run_blocking, scaler_scale
from microsparse.layout import FlatVector
from microsparse.options import SparseOptions
from microsparse.ranks import check_saved_by
from microsparse.sparsifiers import keywords_of
from microsparse.sparsifiers.warmup import DensityWarmup
from microsparse.stats import StepStats


def sparsify(
    model: nn.Module,
    replicate: Any,
    density: float | None = None,
    sparsifier: str = "micro",
    *,
    budget: float | None = None,
    value_dtype: torch.dtype | None = None,
    nonfinite: NonFinite = "skip",
    momentum_correction: float = 0.0,
    momentum_nesterov: bool = False,
    adam_correction: tuple[float, float, float] | None = None,
    density_warmup: DensityWarmup | tuple[float, int] | None = None,
    grad_scaler: Any = None,
    one_exchange: bool = False,
    **options: Any,
) -> ShardedState:
    """Average ``model``'s gradient shards across ``replicate`` sparsely, with error feedback.

    Call it once, after ``fully_shard`` has sharded the model over the shard dimension of the
    mesh (``mesh["shard"]``, not the 2-D mesh: this replaces hybrid sharding's all-reduce).

    Args:
        model: a model whose modules ``fully_shard`` has wrapped (FSDP2).
        replicate: the replicate dimension, a 1-D ``DeviceMesh`` (``mesh["replicate"]``) or
            its ``ProcessGroup``: the ranks that hold the same shard in each replica.
        density: fraction of the gradient entries to send per step, in (0, 1], kept over the
            whole model (each FSDP module's shard gets its share, by size). At 1 every
            sparsifier averages densely: hybrid sharding's own average. Given neither it nor
            ``budget``, what ``DEFAULT_BUDGET`` buys.
        budget: instead of ``density``, the fraction of dense averaging's bytes (4 per
            entry) to send per step; the density follows from the bytes an entry costs on
            the sparsifier's wire (see :class:`microsparse.SparseOptions`).
        sparsifier: a name from :func:`microsparse.available_sparsifiers` (default MiCRO).
        value_dtype: send the selected values as ``torch.float16``, ``torch.bfloat16`` or
            (MiCRO's compact wire) ``torch.int8``; the rounding stays in the residual. None
            (default): the wire's choice, on MiCRO's compact wire int8 up to 16 replicas.
        nonfinite: ``"skip"`` (default): a NaN or Inf in any replica's shard changes none of
            that module's residuals and writes NaN into its gradient shard; ``"raise"``: every
            rank raises ``NonFiniteGradientError`` from ``backward()``.
        momentum_correction, momentum_nesterov, adam_correction, density_warmup: the
            corrections of :class:`microsparse.GradientReducer`, kept per shard: with
            momentum correction step the optimiser *without* momentum, with Adam correction
            with plain SGD at Adam's learning rate (not both); the modules' ks of a warm-up
            add up to the model's at every step.
        grad_scaler: the ``torch.amp.GradScaler`` scaling the loss, as in
            :class:`microsparse.ddp.SparseState`: the residuals hold unscaled gradients.
        one_exchange: one exchange a step for the whole model, after backward, instead of
            one per FSDP module inside FSDP's hook: two collective rounds a step (MiCRO's
            compact wire) instead of two a module, so a few bytes of framing a step instead
            of a few a module, and k not split among modules; it gives up overlapping the
            exchange with the rest of backward and keeps one more buffer the size of the
            rank's shard (the shards, copied into one flat gradient). It averages FSDP's
            gradient shards as the optimiser will see them: after FSDP's division and its
            cast to the parameters' dtype (a bf16 ``reduce_dtype`` is then averaged in
            float32).
        **options: the sparsifier's options (e.g. MiCRO's ``selection``).

    The corrections need error feedback: at density 1, or with ``dense``, they are refused.
    The velocity or the moments have the shard's size, like the residual, and are saved with
    it by ``state_dict()``.

    Returns the :class:`ShardedState`: ``step``, ``last_step`` (:class:`~microsparse.StepStats`
    of the last backward pass), ``state_dict()`` and ``load_state_dict()``.

    Example (2 replicas of 2 shards; see ``tests/test_fsdp.py``)::

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh["shard"])
        state = microsparse.fsdp.sparsify(model, mesh["replicate"], density=0.001)
    """
    owner = ("microsparse.fsdp.sparsify", keywords_of(sparsify)[1])
    chosen = SparseOptions(sparsifier, density, value_dtype, nonfinite, momentum_correction,
                           momentum_nesterov, adam_correction, density_warmup, options,
                           budget, owner=owner)  # fmt: skip
    chosen.check_scaler(grad_scaler)
    state = ShardedState(replicate, chosen, grad_scaler, one_exchange)
    state.attach(model)
    return state


class ShardedState:
    """Options, residuals and statistics of the sparse exchange across replicas.

    Built by :func:`sparsify`. One slab per FSDP module, met in the order of the first
    backward pass: the module's gradient shard as FSDP reduce-scattered it (summed or averaged
    over the shard dimension), its residual (the shard's size, in float32 at least), its
    sparsifier and its engine, bound to this rank's place in the replicate dimension. Each
    module's step runs to its end inside the hook, in the stream FSDP runs the hook in.

    With ``one_exchange`` there is one slab, numbered 0: every parameter's local gradient
    shard, in the model's order, averaged after backward (after FSDP's own last callback,
    which makes the current stream wait for its reductions); the hook only marks that this
    pass reduces (a micro-batch under ``set_requires_gradient_sync(False)`` does not).
    """

    def __init__(
        self,
        replicate: Any,
        options: SparseOptions,
        grad_scaler: Any = None,
        one_exchange: bool = False,
    ) -> None:
        self.group = _replicate_group(replicate)
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        """This rank's place and the number of replicas (the exchange's n)."""
        self.sparse_options = options.for_ranks(self.world_size)
        """Every option of the sparse step, checked, as it runs on this many replicas."""
        self.one_exchange = one_exchange
        """One exchange a step for the whole model, after backward (see :func:`sparsify`)."""
        self.grad_scaler = grad_scaler
        """The ``GradScaler`` whose scale the gradient shards carry, or None."""
        self.step = 0
        """Backward passes averaged (the rotation counter t)."""
        self.last_step: StepStats | None = None
        """Statistics of the last backward pass, over every FSDP module's shard."""
        self._collectives = ProcessGroupCollectives(self.group)
        self._slabs: dict[int, Slab] = {}
        self._offset = 0
        self._offsets: dict[int, int] = {}
        """Each module's place in the model-wide vector, which decides its share of k."""
        self._record: PassRecord | None = None
        self._agreed = False
        self._shard: tuple[int, int] = (0, 1)
        self._restored: dict[int, dict[str, Any]] | None = None
        self._params: list[nn.Parameter] = []
        """The trained parameters, in the model's order (``one_exchange``'s slab)."""
        self._flat: FlatVector | None = None
        """``one_exchange``'s gradient, averaged in place: one buffer the size of the shard."""

    @property
    def density(self) -> float:
        return self.sparse_options.density

    @property
    def averages_densely(self) -> bool:
        """Density 1, or the ``dense`` sparsifier: hybrid sharding's plain average."""
        return self.sparse_options.averages_densely

    def attach(self, model: nn.Module) -> None:
        """Register the exchange on every FSDP module of ``model`` (see :func:`sparsify`)."""
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        if not units:
            raise TypeError(
                "model: none of its modules is sharded by FSDP2; call fully_shard(block, "
                "mesh=mesh['shard']) on its blocks and fully_shard(model, mesh=mesh['shard']) "
                "first, then microsparse.fsdp.sparsify(model, mesh['replicate'], ...)"
            )
        meshes = {p.device_mesh for m in units for p in m.parameters() if hasattr(p, "device_mesh")}
        if any(mesh.ndim != 1 for mesh in meshes):
            raise ValueError(
                "model: fully_shard was given a 2-D mesh (hybrid sharding), which all-reduces "
                "across replicas itself; shard over the shard dimension only, "
                "fully_shard(module, mesh=mesh['shard']), and let sparsify average across "
                "mesh['replicate']"
            )
        if len(meshes) != 1:
            raise ValueError(f"model: its FSDP modules use {len(meshes)} meshes; use one")
        shard = meshes.pop()
        self._shard = (shard.get_local_rank(), shard.size())
        trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        loose = [name for name, p in trained if not isinstance(p, DTensor)]
        if loose:
            raise ValueError(
                f"model: {len(loose)} of its parameters ({loose[0]}, ...) are not sharded by "
                "FSDP2, so nothing would average their gradients; call "
                "fully_shard(model, mesh=mesh['shard']) on the model itself too, after its blocks"
            )
        self._params = [p for _, p in trained]
        force_sum = dist.get_backend(shard.get_group()) == "gloo"  # gloo has no ReduceOp.AVG
        for number, unit in enumerate(units):
            if force_sum:
                unit.set_force_sum_reduction_for_comms(True)
            unit.set_all_reduce_hook(functools.partial(self._average, number))

    # ---- one FSDP module's shard, inside FSDP's hook ------------------------------------

    def _average(self, number: int, shard: torch.Tensor) -> None:
        record = self._record or self._begin_pass(shard.device)
        if self.one_exchange:
            return  # the whole model's shards are averaged after backward (_end_pass)
        slab = self._slabs.get(number) or self._new_slab(number, [shard])
        if slab.layout.numel != shard.numel():
            raise RuntimeError(
                f"FSDP module {number}'s gradient shard has {shard.numel()} entries, but "
                f"{slab.layout.numel} when this state first met it; build a new state after "
                "resharding the model"
            )
        output = FlatOutput(shard)
        job = Job(slab, number, shard, output, [])
        record.ran.append(job)
        try:
            scale = scaler_scale(self.grad_scaler)
            steps = slab.engine.run(self.step, shard, output, scale=scale)
            report = run_blocking(steps, self._collectives)
        except BaseException:
            self._abandon(record)
            raise
        record.reports.append((job, report))

    def _begin_pass(self, device: torch.device) -> PassRecord:
        if not self._agreed:  # before any collective whose size the options decide
            check_agreement(
                self._collectives,
                "the sparse FSDP state's options, or the shard this rank holds (replicate "
                "must be the mesh dimension across which the shards are equal: "
                "mesh['replicate'])",
                [self.fingerprint(), *self._shard],
                device,
                self.described(),
            )
            self._agreed = True
        record = self._record = PassRecord(self.step)
        engine = torch.autograd.Variable._execution_engine

        def after_backward() -> None:  # queued again: it runs after FSDP's own last callback
            engine.queue_callback(lambda: self._end_pass(record))

        engine.queue_callback(after_backward)
        return record

    def _end_pass(self, record: PassRecord) -> None:
        if self._record is not record:  # abandoned
            return
        if self.one_exchange:
            try:
                self._average_model(record)
            except BaseException:
                self._abandon(record)
                raise
        self._record = None
        if record.reports:
            self.last_step = record.stats(self.world_size)
        self.step += 1

    def _average_model(self, record: PassRecord) -> None:
        """``one_exchange``: average every parameter's local gradient shard in one step.

        The shards are copied into one flat buffer of our own (one flat gradient: the step
        can then carry its guard in the index message, two rounds in all), averaged there in
        place, as a DDP bucket is, and copied back into the gradient shards FSDP set (new
        tensors every step, each a view of its module's reduce-scatter output). A parameter
        without a gradient in this pass (unused: FSDP leaves its ``grad`` None) counts as
        zeros, this rank proposes nothing there, and its ``grad`` stays None, as with FSDP
        alone; such a step reads its guard on the host. (The replicas must agree on what is
        unused, as hybrid sharding's all-reduce needs too.)
        """
        with torch.no_grad():
            grads = [p.grad for p in self._params]
            slab = self._slabs.get(0) or self._new_slab(0, [p.to_local() for p in self._params])
            if self._flat is None:
                dtype = functools.reduce(torch.promote_types, [p.dtype for p in self._params])
                self._flat = FlatVector(slab.layout, dtype, slab.feedback.residual.device)
            flat, layout = self._flat, slab.layout
            present = [(view, grad.to_local()) for view, grad in zip(flat.views, grads)
                       if grad is not None]  # fmt: skip
            views, shards = [view for view, _ in present], [shard for _, shard in present]
            torch._foreach_copy_(views, shards)
            unused = []
            for view, offset, size, grad in zip(flat.views, layout.offsets, layout.sizes, grads):
                if grad is None:
                    view.zero_()
                    unused.append((offset, offset + size))
            output = FlatOutput(flat.data)
            job = Job(slab, 0, flat.data, output, [], unused)
            record.ran.append(job)
            steps = slab.engine.run(self.step, flat.data, output, unused,
                                    scale=scaler_scale(self.grad_scaler))  # fmt: skip
            record.reports.append((job, run_blocking(steps, self._collectives)))
            torch._foreach_copy_(shards, views)

    def _abandon(self, record: PassRecord) -> None:
        """A module's step failed: the pass's sparsifiers as before it, the step not counted."""
        for job in record.ran:
            job.slab.engine.rollback()
        self._record = None

    def _new_slab(self, number: int, shards: list[torch.Tensor]) -> Slab:
        """The slab of FSDP module ``number``'s shard, or (``one_exchange``) of every
        parameter's."""
        what = "the model's gradient shards" if self.one_exchange else f"FSDP module {number}"
        saved = None if self._restored is None else self._restored.get(number)
        if self._restored is not None and saved is None:
            raise ValueError(
                f"load_state_dict: the checkpoint has no residual for {what}; "
                "restore into the same model, sharded the same way"
            )
        offset = self._offset if saved is None else int(saved["offset"])
        # Stand-ins of the shards' shapes: the slab must not keep FSDP's gradients alive.
        likes = [torch.empty((), dtype=s.dtype, device=s.device).expand(s.shape) for s in shards]
        indices = range(len(shards)) if self.one_exchange else [number]
        slab = Slab(likes, indices, self.sparse_options, offset, self.rank, self.world_size)
        numel = slab.layout.numel
        self._offset = max(self._offset, offset + numel)
        self._offsets[number] = offset
        if saved is not None:
            if int(saved["numel"]) != numel:
                raise ValueError(
                    f"load_state_dict: {what} hold {numel} entries here but {saved['numel']} "
                    "in the checkpoint; restore on the same mesh shape"
                )
            # e, then u (momentum correction) or m and v (Adam correction), as in _saved.
            for buffer, kept in zip(slab.feedback.buffers, _memory(saved)):
                buffer.data.copy_(kept)
            slab.sparsifier.load_state_dict(saved["sparsifier"])
        self._slabs[number] = slab
        return slab

    # ---- agreement and checkpoints --------------------------------------------------------

    def described(self) -> dict[str, Any]:
        """The options every replica must share, by name."""
        options = self.sparse_options
        return {
            "sparsifier": options.sparsifier,
            "density": options.density,
            "options": sorted(options.options.items()),
            "value_dtype": str(options.wire_value_dtype(self.world_size)),  # what is sent
            "nonfinite": options.nonfinite,
            **options.corrections(),
            **({"grad_scaler": True} if self.grad_scaler is not None else {}),
            "shard (this rank's place, shard size)": self._shard,
            **({"one_exchange": True} if self.one_exchange else {}),
        }

    def fingerprint(self) -> int:
        """A checksum of :meth:`described`, equal on every rank that may average with this one."""
        return zlib.crc32(repr(self.described()).encode())

    def state_dict(self) -> dict[str, Any]:
        """Step, every module's residual (and velocity or Adam moments) and sparsifier state
        (this rank's; save one per rank).

        Example:
            >>> torch.save(state.state_dict(), f"sparse-rank{dist.get_rank()}.pt")  # doctest: +SKIP
        """
        return {
            "step": self.step,
            "rank": dist.get_rank(),
            "world_size": dist.get_world_size(),
            "config": self.described(),
            "slabs": {number: self._saved(number, slab) for number, slab in self._slabs.items()},
        }

    def _saved(self, number: int, slab: Slab) -> dict[str, Any]:
        feedback = slab.feedback
        saved = {
            "offset": self._offsets[number],
            "numel": slab.layout.numel,
            "residual": feedback.residual.clone(),
            "sparsifier": slab.sparsifier.state_dict(),
        }
        if feedback.velocity is not None:
            saved["velocity"] = feedback.velocity.clone()
        if feedback.moments is not None:
            saved["moments"] = [moment.clone() for moment in feedback.moments]
        return saved

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved on this rank, before the first backward pass."""
        if self._slabs or self.step:
            raise RuntimeError(
                "load_state_dict must be called before the first backward pass: build the "
                "model, fully_shard it, call sparsify, then load the checkpoint and train"
            )
        check_saved_by((state.get("rank"), state.get("world_size")), dist.get_rank(),
                       dist.get_world_size())  # fmt: skip
        mine, theirs = self.described(), state["config"]
        # Both ways: an option that is on in one and off in the other is absent from it.
        names = [*mine, *(k for k in theirs if k not in mine)]
        differing = [k for k in names if _comparable(theirs.get(k)) != _comparable(mine.get(k))]
        if differing:
            unset = "(not set)"
            raise ValueError(
                "load_state_dict: the checkpoint was saved with other options: "
                + "; ".join(
                    f"{k} {theirs.get(k, unset)!r} there, {mine.get(k, unset)!r} here"
                    for k in differing
                )
            )
        self._restored = {int(k): v for k, v in state["slabs"].items()}
        self.step = int(state["step"])


def _replicate_group(replicate: Any) -> dist.ProcessGroup:
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(replicate, DeviceMesh):
        if replicate.ndim != 1:
            raise ValueError(
                f"replicate must be one dimension of the mesh, e.g. mesh['replicate']; got a "
                f"{replicate.ndim}-D mesh"
            )
        return replicate.get_group()
    if isinstance(replicate, dist.ProcessGroup):
        return replicate
    raise TypeError(
        "replicate must be the replicate dimension of the device mesh (mesh['replicate']) or "
        f"its ProcessGroup; got {type(replicate).__name__}"
    )


def _memory(saved: dict[str, Any]) -> list[torch.Tensor]:
    """A saved module's buffers in :attr:`ErrorFeedback.buffers`' order."""
    return [saved["residual"], *([saved["velocity"]] if "velocity" in saved else []),
            *saved.get("moments", [])]  # fmt: skip


def _comparable(value: Any) -> Any:
    """Lists and tuples alike: a checkpoint may have turned one into the other."""
    return [_comparable(v) for v in value] if isinstance(value, list | tuple) else value
