"""Sparse gradient averaging as a DDP communication hook, overlapped with the backward pass."""

# No ``from __future__ import annotations`` here: DDP checks the hook's annotations as objects.
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from microsparse.comm import all_gather_bytes, all_gather_flat, all_reduce_bytes
from microsparse.ddp.memory import BucketMemory
from microsparse.ddp.state import SparseState, accumulator_dtype
from microsparse.errors import NonFiniteGradientError
from microsparse.feedback.residual import any_nonfinite

_FLAG, _COUNT, _CANDIDATES, _HEADER = 0, 1, 2, 3  # layout of the index message


def sparse_hook(state: SparseState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one DDP bucket sparsely across ranks, with error feedback.

    For each bucket, as soon as DDP has its gradients:

    1. add the bucket's gradients into the residuals of its parameters (error feedback);
    2. select: MiCRO takes the positions with \\|a\\| >= λ inside the slice of every parameter
       this rank owns this step (slice (t + r) mod n; no sort, no overlap between ranks);
       ``topk`` takes the bucket's top-k (k = density · bucket size);
    3. round 1, issued now: all-gather a fixed-size index message that carries its own count;
    4. round 2, issued from round 1's completion, in bucket order on every rank: all-reduce
       every rank's accumulated values at all selected positions, divide by n;
    5. write the sparse average into the bucket; what was not sent stays in the residual.

    Meanwhile autograd goes on computing the next buckets' gradients. λ is one model-wide
    threshold, updated before each backward pass from the previous pass's total count.

    .. warning::
        The first backward pass of a fresh state is a plain dense all-reduce: it is how the
        hook learns the model's parameters (d, and a stable order for checkpoints) before DDP
        settles its buckets. A state restored with ``load_state_dict`` skips it.

    Example::
        >>> state = microsparse.ddp.MicroState(density=0.001)               # doctest: +SKIP
        >>> ddp_model.register_comm_hook(state, microsparse.ddp.micro_hook)  # doctest: +SKIP
    """
    started = time.perf_counter()
    sequence = state.begin_bucket()
    buffer = bucket.buffer()
    if state.sends_everything:
        future = _average_dense(state, bucket, buffer, started)
    else:
        future = _average_sparse(state, bucket, buffer, sequence, started)
    state.end_bucket(bucket.is_last())
    return future


micro_hook = sparse_hook
"""The hook to register with :class:`microsparse.ddp.MicroState` (same function)."""


def _average_dense(
    state: SparseState, bucket: dist.GradBucket, buffer: torch.Tensor, started: float
) -> torch.futures.Future[torch.Tensor]:
    if state.numel is None:  # learning pass: meet every parameter, in a stable order
        state.residuals.memory(bucket.parameters(), accumulator_dtype(buffer))
    buffer.div_(state.world_size)  # divide first, as DDP does, for identical results
    work = dist.all_reduce(buffer, group=state.value_group, async_op=True)
    numel, dense = buffer.numel(), state.dense_bytes(buffer.numel(), buffer.element_size())
    select_seconds = time.perf_counter() - started

    def done(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        state.record(
            numel=numel,
            selected=numel,
            bytes_sent=dense,
            dense_bytes=dense,
            select_seconds=select_seconds,
        )
        return future.value()[0]

    return work.get_future().then(done)


def _average_sparse(
    state: SparseState, bucket: dist.GradBucket, buffer: torch.Tensor, sequence: int, started: float
) -> torch.futures.Future[torch.Tensor]:
    n, step = state.world_size, state.step
    memory = state.residuals.memory(bucket.parameters(), accumulator_dtype(buffer))
    residual = memory.residual
    residual.add_(buffer)  # a = e + g
    buffer.zero_()  # becomes the output: only selected positions will be written
    local, candidates, capacity = _select(state, memory, residual)

    index_dtype = torch.int32 if memory.numel <= torch.iinfo(torch.int32).max else torch.long
    message = torch.zeros(_HEADER + capacity, dtype=index_dtype, device=buffer.device)
    message[_FLAG] = any_nonfinite(residual)
    message[_COUNT] = local.numel()
    message[_CANDIDATES] = candidates
    message[_HEADER : _HEADER + local.numel()] = local
    rows = message.new_empty(n * message.numel())
    gathered = all_gather_flat(rows, message, group=state.index_group, async_op=True)
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future(
        devices=[buffer.device] if buffer.is_cuda else None
    )
    sent = all_gather_bytes(message.numel() * message.element_size(), n)
    select_seconds = time.perf_counter() - started

    def on_indices(_: Any) -> None:
        begun = time.perf_counter()
        table = rows.view(n, -1)
        header = table[:, :_HEADER].tolist()
        bad = [rank for rank, row in enumerate(header) if row[_FLAG]]
        if bad:
            raise NonFiniteGradientError(
                f"step {step}: NaN or Inf gradient on rank(s) {bad} in the bucket holding "
                f"{len(memory.views)} parameter(s). Lower the learning rate, clip gradients, or "
                "unscale AMP gradients before backward() returns"
            )
        pieces = [table[rank, _HEADER : _HEADER + row[_COUNT]] for rank, row in enumerate(header)]
        positions = torch.cat(pieces).long()
        if state.sparsifier == "topk":
            positions = torch.unique(positions)
        total_candidates = sum(row[_CANDIDATES] for row in header)
        decode_seconds = time.perf_counter() - begun

        def launch_values() -> None:
            values = residual.index_select(0, positions)
            residual.index_fill_(0, positions, 0)  # e = a with every sent position zeroed
            work = dist.all_reduce(values, group=state.value_group, async_op=True)
            work.get_future().then(_failing_into(result, on_values))

        def on_values(future: torch.futures.Future[list[torch.Tensor]]) -> None:
            begun_values = time.perf_counter()
            values = future.value()[0].div_(n)
            buffer.index_copy_(0, positions, values)
            state.record(
                numel=memory.numel,
                selected=positions.numel(),
                candidates=total_candidates,
                local_selected=local.numel(),
                message_slots=capacity,
                bytes_sent=sent + all_reduce_bytes(values.numel() * values.element_size(), n),
                dense_bytes=state.dense_bytes(memory.numel, buffer.element_size()),
                select_seconds=select_seconds,
                exchange_seconds=decode_seconds + time.perf_counter() - begun_values,
            )
            result.set_result(buffer)

        state.launcher.ready(sequence, _failing_into(result, launch_values))

    def on_indices_or_skip(future: Any) -> None:
        try:
            on_indices(future)
        except BaseException:
            state.launcher.ready(sequence, lambda: None)  # later buckets must not wait for us
            raise

    gathered.get_future().then(_failing_into(result, on_indices_or_skip))
    return result


def _select(
    state: SparseState, memory: BucketMemory, residual: torch.Tensor
) -> tuple[torch.Tensor, int, int]:
    """This rank's positions (ascending), how many passed the rule, and the message capacity."""
    if state.sparsifier == "topk":
        count = min(state.topk_count(memory.numel), memory.numel)
        chosen = torch.topk(residual.abs(), count, sorted=False).indices.sort().values
        return chosen, count, count
    capacity = state.micro_capacity(memory.numel)
    owned = memory.owned((state.step + state.rank) % state.world_size)
    magnitude = residual.index_select(0, owned).abs_()
    passed = magnitude >= state.threshold
    chosen = owned[passed]
    candidates = chosen.numel()
    if candidates > capacity:  # keep the largest; the rest waits in the residual
        keep = torch.topk(magnitude[passed], capacity, sorted=False).indices
        chosen = chosen[keep].sort().values
    return chosen, candidates, capacity


def _failing_into(
    result: torch.futures.Future[torch.Tensor], step: Callable[..., None]
) -> Callable[..., None]:
    """Wrap a callback so that an error fails ``result`` (DDP then raises it) instead of hanging."""

    def guarded(*args: Any) -> None:
        try:
            step(*args)
        except BaseException as error:  # noqa: BLE001 - every error must reach DDP
            if not result.done():
                result.set_exception(error)

    return guarded
