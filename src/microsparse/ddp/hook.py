"""Sparse gradient averaging as a DDP communication hook, overlapped with the backward pass."""

# No ``from __future__ import annotations`` here: DDP checks the hook's annotations as objects.
import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from microsparse.comm import Collective
from microsparse.comm.collectives import check_agreement
from microsparse.ddp.slabs import Job
from microsparse.ddp.state import PassRecord, SparseState, _Binding
from microsparse.engine import StepReport
from microsparse.engine.step import Protocol_, scaler_scale


def sparse_hook(state: SparseState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average DDP's buckets sparsely across ranks, with error feedback: the same step as
    :meth:`microsparse.GradientReducer.synchronize`, on every slab of DDP's buckets.

    For each bucket, as soon as DDP has its gradients:

    1. the slabs that now have all their gradients start their step: add the gradients into
       the residuals of their parameters (error feedback) and select (MiCRO: each rank its
       share of k, inside the partition of the slab it owns this step);
    2. their first collective round is issued at once, from the hook (or, with the state's
       ``own_thread``, from the hook's thread, in the same order); every later round is
       issued when the previous one completes, in slab order on every rank, each round on a
       process group of its own (MiCRO: one all-gather of indices, then one all-reduce of
       the values there);
    3. the sparse average is written (in O(K), into a buffer of the slab's that DDP then
       copies into the gradients); what was not sent stays in the residual.

    Meanwhile autograd goes on computing the next buckets' gradients. Every pass selects k
    entries in all (each slab its share), from the first one on. With the state's
    ``one_exchange=True`` the whole model is one slab, whose step starts at the last bucket.
    With ``min_speedup`` a pass may average densely instead (``microsparse.ddp.choice``):
    each bucket, with its parameters' residuals added in, is all-reduced as DDP does it.

    At the first pass every rank checks that all ranks hold the same options (one small
    all-gather): ranks that disagree would otherwise issue collectives of different sizes.

    A NaN or Inf in any rank's gradient skips the pass on every rank (no residual changes;
    the buckets hold NaN where the average would be) without the host waiting for the device,
    or, with ``nonfinite="raise"``, raises.

    .. warning::
        An error in any slab's step (``nonfinite="raise"`` and a NaN or Inf, ranks at
        different steps) is raised from ``backward()`` on every rank, as itself, after DDP
        has finished the pass; the step counter does not advance.

    Example::
        >>> state = microsparse.ddp.MicroState(density=0.001)               # doctest: +SKIP
        >>> ddp_model.register_comm_hook(state, microsparse.ddp.micro_hook)  # doctest: +SKIP
    """
    binding = state.bind()
    record = binding.current
    buffer = bucket.buffer()
    if record is None or record.saw_last_bucket:  # the first bucket of a pass
        record = _begin_pass(state, binding, buffer.device)
    if record.dense or record.refused:
        record.saw_last_bucket = bucket.is_last()
        if record.refused:  # nothing is exchanged; the error is raised after DDP's pass
            future = _future_on(buffer)
            future.set_result(buffer)
            return future
        return _average_densely(binding, record, bucket)
    future = _future_on(buffer)
    jobs, waiting_for, result = binding.slabs.arrive(bucket.parameters(), buffer, bucket.is_last())
    number = len(record.buckets)
    with record.lock:  # slabs' steps on other threads read it (_slab_done)
        record.buckets[number] = (future, result, waiting_for)
    if not waiting_for:  # in no slab (a checkpoint of another model): reported at the end
        future.set_result(result)
    own_thread = buffer.is_cuda if state.own_thread is None else state.own_thread
    for job in jobs:
        chain = _Chain(state, binding, record, job, record.slabs_started)
        if own_thread:  # the same order of first rounds: one thread, in the order handed over
            binding.starter.submit(chain.start)
        else:
            chain.start()
        record.slabs_started += 1
    if bucket.is_last():
        record.saw_last_bucket = True
        try:
            binding.slabs.check_complete()
        except ValueError as error:  # nothing more will arrive: let DDP finish, then raise
            record.fail(error)
            for key in [key for _, _, keys in record.buckets.values() for key in keys]:
                _slab_done(record, key)
    return future


micro_hook = sparse_hook
"""The hook to register with :class:`microsparse.ddp.MicroState` (same function)."""


def _future_on(buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future for a bucket's result (one that carries CUDA tensors must name the device)."""
    return torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)


def _average_densely(
    binding: _Binding, record: PassRecord, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A dense pass's bucket, as DDP averages it, with every residual sent along: the bucket
    plus its parameters' residuals (which become zero), divided by n and all-reduced."""
    buffer, slabs = bucket.buffer(), binding.slabs
    offset = 0
    for p in bucket.parameters():
        slabs.meet(p)
        residual = None if binding.clean else slabs.residual(p)
        if residual is not None:
            # DDP drops the average of a parameter no rank used: what it held would be lost.
            if slabs.used(p):
                buffer[offset : offset + p.numel()].add_(residual)
                residual.zero_()
            else:
                record.kept_residual = True
        offset += p.numel()
    record.dense_numel += buffer.numel()
    record.dense_bytes += buffer.numel() * buffer.element_size()
    buffer.div_(binding.world_size)  # divide first, as DDP does
    return binding.collectives[0].start(Collective("all_reduce", buffer, "values"))


class _Chain:
    """One slab's step as a chain of futures: each round issued when the previous completed.

    On a GPU every stage runs on the stream the hook was called on: a ``.then()`` callback
    starts on a stream of torch's pool, and a temporary made on one stream and read on
    another could be handed out again by the caching allocator while still being read.
    """

    def __init__(
        self, state: SparseState, binding: _Binding, record: PassRecord, job: Job, sequence: int
    ) -> None:
        self.binding, self.record, self.job, self.sequence = binding, record, job, sequence
        device = job.slab.feedback.residual.device
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self.protocol: Protocol_ = job.slab.engine.run(
            state.step, job.fresh, job.output, job.exclude, scaler_scale(state.grad_scaler)
        )
        with record.lock:
            record.ran.append(job)

    def start(self) -> None:
        """Run the step up to its first collective and issue it (from the hook, or on the
        hook's own thread); an error fails the pass, raised after DDP's."""
        with _on(self.stream):
            try:
                self._resume(-1, None)
            except BaseException as error:  # noqa: BLE001 - issuing the round failed
                self.record.fail(error)
                self._end(0, None)

    def _resume(self, round_: int, result: torch.Tensor | None) -> None:
        following = round_ + 1
        try:
            request = next(self.protocol) if round_ < 0 else self.protocol.send(result)
            if following >= len(self.binding.collectives):
                raise RuntimeError(f"the step asked for more than {following} collective rounds")
        except StopIteration as done:
            self._end(following, done.value)
            return
        except BaseException as error:  # noqa: BLE001 - every error must reach backward()
            self.record.fail(error)
            self._end(following, None)
            return

        def issue() -> None:
            future = self.binding.collectives[following].start(request)
            future.then(self._completed(following))

        if following == 0:
            issue()  # from the hook itself: slabs start in the same order on every rank
        else:
            self.binding.launchers[following].ready(self.sequence, issue)

    def _completed(self, round_: int) -> Callable[[torch.futures.Future], None]:
        def completed(future: torch.futures.Future) -> None:
            with _on(self.stream):
                try:
                    result = future.wait()  # the hook's stream waits for the collective
                except BaseException as error:  # noqa: BLE001 - a failed collective
                    self.record.fail(error)
                    self._end(round_ + 1, None)
                    return
                self._resume(round_, result)

        return completed

    def _end(self, following: int, report: StepReport | None) -> None:
        # Later slabs must not wait for rounds this one will never issue.
        for launcher in self.binding.launchers[max(following, 1) :]:
            launcher.ready(self.sequence, lambda: None)
        if report is not None:
            with self.record.lock:
                self.record.reports.append((self.job, report))
        _slab_done(self.record, self.job.key)


def _on(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def _slab_done(record: PassRecord, key: object) -> None:
    """Complete every bucket whose slabs are all done (errors are raised after the pass)."""
    finished = []
    with record.lock:
        for future, buffer, waiting in record.buckets.values():
            if key in waiting:
                waiting.discard(key)
                if not waiting and not future.done():
                    finished.append((future, buffer))
    for future, buffer in finished:
        future.set_result(buffer)


def _begin_pass(state: SparseState, binding: _Binding, device: torch.device) -> PassRecord:
    record = PassRecord(state.step)
    binding.current = record
    for launcher in binding.launchers:
        launcher.reset()
    engine = torch.autograd.Variable._execution_engine

    def after_backward() -> None:  # queued now, so it runs before DDP's own finalisation:
        engine.queue_callback(lambda: _end_pass(state, binding, record))  # this one runs after

    engine.queue_callback(after_backward)
    first = binding.collectives[0]
    try:
        if not binding.agreed:  # before any collective whose size the options decide
            check_agreement(first, "the DDP hook's options (SparseState)",
                            [state.fingerprint()], device, state.described())  # fmt: skip
            binding.agreed = True
        if state.speed is not None:
            record.dense = state.speed.begin_pass(
                lambda mine: first.run(Collective("all_gather", mine.to(device), "agreement"))
            )
    except Exception as error:  # noqa: BLE001 - raised from backward(), after DDP's pass
        record.fail(error)
        record.refused = True
    return record


def _end_pass(state: SparseState, binding: _Binding, record: PassRecord) -> None:
    """After DDP has finished the pass: publish the statistics, or roll every slab's
    sparsifier back and raise the pass's error."""
    binding.current = None
    binding.slabs.end_pass()
    if state.speed is not None:
        state.speed.end_pass(record.dense)
    if record.dense:
        binding.clean = not record.kept_residual
        state.last_step = record.dense_stats(binding.world_size, state.density)
        state.step += 1
        return
    if record.ran:
        binding.clean = False
    if record.error is not None:
        for job in record.ran:
            job.slab.engine.rollback()
        raise record.error
    if record.reports:
        state.last_step = record.stats(binding.world_size)
    state.step += 1
