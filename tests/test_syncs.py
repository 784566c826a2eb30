"""Host syncs per steady-state training step, counted on the CPU on real gloo ranks.

On a GPU each of these operations makes the host wait until the device has drained its queue;
``microsparse_lab.bench.syncs`` counts them on CPU tensors, on every thread, so that a DDP comm
hook's ``.then()`` stages on gloo's threads count too. First the counter is shown able to
fail, then MiCRO's step is held to zero in both drivers.
"""

# No ``from __future__ import annotations``: DDP checks a hook's annotations as objects.
import functools
import threading
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import microsparse
import microsparse.ddp
import microsparse.fsdp
from distributed import run_ranks
from microsparse.comm import eliasfano
from microsparse.comm.eliasfano import EliasFano
from microsparse_lab.bench import syncs_table
from microsparse_lab.bench.syncs import SYNC_METHODS, HostSyncs, count_host_syncs
from microsparse_lab.bench.syncs_table import (  # one model, step and count for both
    BUCKET_CAP_MB,
    COUNTED,
    DENSITY,
    model,
    steady_syncs,
    training_step,
)
from test_selection import FreshBytes


class Calls:
    """A hook's state with its calls counted (a pass calls the hook once per DDP bucket)."""

    def __init__(self, state: object = None) -> None:
        self.state = state
        self.caller = threading.get_ident()
        self.reset()

    def reset(self) -> None:
        self.calls = 0
        self.off_thread = 0  # calls whose .then() stage ran on another thread than backward's


def counted_micro_hook(calls: Calls, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    calls.calls += 1
    return microsparse.ddp.micro_hook(calls.state, bucket)


def item_hook(calls: Calls, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's average, with one ``.item()`` in the ``.then()`` stage."""
    calls.calls += 1
    if dist.get_rank() == 1:  # rank 0's all-reduce waits for it: its .then() runs on gloo's thread
        time.sleep(0.02)
    future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return future.then(functools.partial(_average_with_item, calls))


def _average_with_item(calls: Calls, future: torch.futures.Future) -> torch.Tensor:
    calls.off_thread += threading.get_ident() != calls.caller
    buffer = future.value()[0].div_(dist.get_world_size())
    buffer.abs().max().item()  # the host sync under test
    return buffer


def ddp_worker(rank: int, n: int, hook: Callable, state: object) -> tuple[HostSyncs, float, float]:
    """Syncs per steady step of a DDP model with ``hook``, its calls per step, those off-thread."""
    calls = Calls(state)
    ddp = DDP(model(), bucket_cap_mb=BUCKET_CAP_MB)
    ddp.register_comm_hook(calls, hook)
    syncs = steady_syncs(training_step(ddp, rank), calls.reset)
    return syncs, calls.calls / COUNTED, calls.off_thread / COUNTED


def stock_ddp_worker(rank: int, n: int) -> HostSyncs:
    return steady_syncs(training_step(DDP(model(), bucket_cap_mb=BUCKET_CAP_MB), rank))


def reducer_worker(rank: int, n: int, **options: object) -> HostSyncs:
    net = model()
    reducer = microsparse.GradientReducer(net.named_parameters(), "micro", DENSITY, **options)
    return steady_syncs(training_step(net, rank, reducer.synchronize))


def compact_reducer_worker(rank: int, n: int) -> HostSyncs:
    return reducer_worker(rank, n, wire="compact")


def test_counts_syncs_on_the_calling_thread() -> None:
    t = torch.tensor([0.5, -1.0, 2.0])
    syncs = count_host_syncs(lambda: (t.sum().item(), t.tolist(), t[t > 0]), repeats=2)
    assert syncs.counts == {
        "Tensor.tolist": 1.0,
        "aten::index -> aten::nonzero": 1.0,
        "aten::item -> aten::_local_scalar_dense": 1.0,
    }
    assert syncs.total == 3.0
    assert count_host_syncs(lambda: torch.nonzero_static(t > 0, size=3)).total == 0.0


def test_restores_the_tensor_methods_after_an_error() -> None:
    with pytest.raises(ZeroDivisionError):
        count_host_syncs(lambda: 1 / 0)
    assert not set(SYNC_METHODS) & set(torch.Tensor.__dict__)
    assert torch.tensor([1, 2]).tolist() == [1, 2]


def test_counts_the_path_a_gpu_runs_not_the_hosts_shortcut() -> None:
    """The compact wire sorts with NumPy on the host (``.numpy()`` counts as a copy from the
    device); while counting, it sorts as on a GPU, and afterwards as before."""
    codec, offsets = EliasFano(10_000, 50), torch.randperm(10_000)[:50]
    assert count_host_syncs(lambda: codec.encode(offsets)).total == 0.0
    assert eliasfano.HOST_SORT
    with pytest.raises(ZeroDivisionError):
        count_host_syncs(lambda: 1 / 0)
    assert eliasfano.HOST_SORT


def test_counts_an_item_in_a_hooks_then_stage_on_a_gloo_thread(tmp_path) -> None:
    syncs, calls, off_thread = run_ranks(ddp_worker, 2, tmp_path, item_hook, None)[0]
    assert calls >= 3, calls  # DDP split the model as the MiCRO hook test needs it
    assert off_thread > 0, (calls, off_thread)  # rank 1's delay holds rank 0's stages back
    assert syncs.counts == {"aten::item -> aten::_local_scalar_dense": calls}, syncs


def test_stock_ddp_makes_no_sync(tmp_path) -> None:
    for syncs in run_ranks(stock_ddp_worker, 2, tmp_path):
        assert syncs.total == 0, syncs


def int8_reducer_worker(rank: int, n: int) -> HostSyncs:
    return reducer_worker(rank, n, value_dtype=torch.int8)


@pytest.mark.parametrize("worker", [reducer_worker, int8_reducer_worker], ids=["default", "int8"])
def test_micro_reducer_step_makes_no_sync(worker, tmp_path) -> None:
    for syncs in run_ranks(worker, 2, tmp_path):
        assert syncs.total == 0, syncs


@pytest.mark.parametrize(
    "options",
    [{}, {"wire": "compact"}, {"value_dtype": torch.int8}, {"own_thread": True}],
    ids=["fixed", "compact", "int8", "own-thread"],
)
def test_micro_hook_step_makes_no_sync(options, tmp_path) -> None:
    state = microsparse.ddp.MicroState(density=DENSITY, **(options or {}))
    for syncs, buckets, _ in run_ranks(ddp_worker, 2, tmp_path, counted_micro_hook, state):
        assert buckets >= 3, buckets
        assert syncs.total == 0, syncs


def test_micro_compact_wire_step_makes_no_sync(tmp_path) -> None:
    """Elias-Fano offsets decoded at the quotas' known total: nothing read back either."""
    for syncs in run_ranks(compact_reducer_worker, 2, tmp_path):
        assert syncs.total == 0, syncs


def table_worker(rank: int, n: int) -> list[dict]:
    return syncs_table.measure(rank, [("micro", {}), ("topk", {}), ("topk", {"wire": "fixed"})])


def test_the_table_tells_a_fixed_size_from_one_the_data_decides(tmp_path) -> None:
    """``bench.syncs_table``: MiCRO's default reads nothing back in either driver, and adds a
    bounded number of kernels a bucket to stock DDP's step; top-k's union of positions has a
    size only the data decides, found once per slab and step; as a fixed message of n·k slots
    it reads nothing back either."""
    stock, micro, topk, fixed = run_ranks(table_worker, 2, tmp_path)[0]
    assert stock["loop"] is None and stock["hook"].total == 0
    # What the hook adds to stock DDP's step, in operators that would each launch a kernel
    # on a GPU: 58 a bucket with 8-bit values (MiCRO's default, torch 2.13; 50 with bfloat16
    # values); a bound, not a timing.
    assert 0 < (micro["hook"].operators - stock["hook"].operators) / 5 <= 59
    assert micro["loop"].total == micro["hook"].total == 0
    assert topk["loop"].counts["aten::_unique2"] == 1
    assert topk["hook"].counts["aten::_unique2"] == 5  # one per DDP bucket
    assert fixed["loop"].total == fixed["hook"].total == 0, fixed


def fsdp_worker(
    rank: int, n: int, sparse: bool, options: dict | None = None
) -> tuple[HostSyncs, int, int]:
    """Syncs per steady step of the table's model under FSDP2 (each layer, then the model,
    over a shard dimension of 1), hybrid sharding's or ``microsparse.fsdp``'s average across
    the n replicas; the FSDP modules, and the passes the sparse state averaged."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from microsparse_lab.bench.gpu.methods import fully_shard_blocks  # as make gpu-check does

    mesh = init_device_mesh("cpu", (n, 1), mesh_dim_names=("replicate", "shard"))
    net = model()
    fully_shard_blocks(net, mesh["shard"] if sparse else mesh)
    units = [m for m in net.modules() if isinstance(m, FSDPModule)]
    state = None
    if sparse:
        options = options or {}
        state = microsparse.fsdp.sparsify(net, mesh["replicate"], density=DENSITY, **options)
    syncs = steady_syncs(training_step(net, rank))
    return syncs, len(units), 0 if state is None else state.step


@pytest.mark.parametrize(("sparse", "options"), [(False, None), (True, None),
                                                 (True, {"one_exchange": True})],
                         ids=["hybrid sharding", "microsparse.fsdp", "one exchange"])  # fmt: skip
def test_fsdp_step_makes_no_sync(sparse, options, tmp_path) -> None:
    """Inside FSDP2's all-reduce hook a sync would stall its prefetching on a GPU: MiCRO's
    default reads nothing back there either, in any of the model's 7 FSDP modules, nor in
    its one exchange after backward."""
    for syncs, units, passes in run_ranks(fsdp_worker, 2, tmp_path, sparse, options):
        assert units == 7
        assert passes == (syncs_table.WARMUP + COUNTED if sparse else 0)
        assert syncs.total == 0, syncs


def test_the_count_sees_a_sync_inside_fsdps_hook(tmp_path) -> None:
    """``nonfinite="raise"`` reads the guard on the host inside the hook, once a module that
    holds parameters of its own: the 6 layers (the root holds none)."""
    for syncs, units, _ in run_ranks(fsdp_worker, 2, tmp_path, True, {"nonfinite": "raise"}):
        assert syncs.total == units - 1, syncs


FRESH_K = 400


def fresh_bytes_worker(rank: int, n: int, options: dict) -> dict[int, int]:
    """Bytes of new tensors a steady ``synchronize()`` makes, by gradient size, at one k, on
    the path a GPU runs (NumPy's arrays on the host are not tensors the count could see)."""
    torch.set_num_threads(1)
    eliasfano.HOST_SORT = False
    made = {}
    for numel in (200_000, 1_600_000):
        params = [torch.nn.Parameter(torch.zeros(numel // 2)) for _ in range(2)]
        reducer = microsparse.GradientReducer(params, "micro", FRESH_K / numel, **options)
        generator = torch.Generator().manual_seed(rank)
        for _ in range(6):  # the last counts: buffers kept from earlier steps are not new
            for param in params:
                param.grad = torch.randn(param.shape, generator=generator)
            counter = FreshBytes()
            with counter:
                reducer.synchronize()
        made[numel] = counter.bytes
    return made


@pytest.mark.parametrize("options", [{}, {"selection": "threshold"}], ids=["quota", "threshold"])
def test_micro_reducer_step_makes_nothing_of_the_gradients_size(options, tmp_path) -> None:
    """A steady step makes new tensors of O(k) bytes (positions, values, their messages),
    reused by the caching allocator on a GPU, and nothing that grows with d: 8 times the
    gradient at the same k makes at most the compact offsets' few more bits each (their
    low bits grow with log2(d/k), from 8 to 11 here, and the decoder takes the 3 that are
    not a whole byte apart into int64), far from 8 times (with a shared threshold, a
    histogram's and a message's slack more)."""
    for made in run_ranks(fresh_bytes_worker, 2, tmp_path, options):
        small, large = made[200_000], made[1_600_000]
        assert 0 < large <= small * 1.5 and small <= 400 * FRESH_K, made
