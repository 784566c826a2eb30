"""MiCRO's compact wire (``wire="compact"``): offsets into the owned partition, Elias–Fano coded.

The codec alone first (full, empty, clustered and extreme messages, its size), then on real gloo
ranks against the plain fixed message: the same positions and, with float32 values, the same
averages and residuals bit for bit; with bfloat16 values every rank keeps its own rounding;
the bytes each step reports are the bytes its collectives carried; bad combinations refused.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import microsparse.comm.collectives as collectives
from distributed import run_ranks
from microsparse import GradientReducer
from microsparse.comm import eliasfano
from microsparse.comm.collectives import all_gather_bytes, all_reduce_bytes
from microsparse.comm.eliasfano import EliasFano, position_bits
from microsparse.comm.framing import Compact, Fixed
from microsparse.comm.local import SymmetricPeers
from microsparse.ddp import SparseState, sparse_hook
from microsparse.engine.plan import step_collectives
from microsparse.layout import Layout
from microsparse.sparsifiers import create_sparsifier

STEPS = 4


def random_offsets(generator: torch.Generator, size: int, count: int) -> torch.Tensor:
    return torch.randperm(size, generator=generator)[:count]


@pytest.mark.parametrize(
    ("size", "capacity"),
    [(1000, 37), (300_000, 4000), (140_000, 70_000), (1, 1), (5, 5), (70_000, 1), (4096, 16),
     (5000, 9), (1 << 20, 1000), (1 << 22, 3)],
)  # fmt: skip
def test_the_codec_gives_back_every_ranks_offsets_in_order(size: int, capacity: int) -> None:
    """Full, nearly full, half full and empty messages; ranges one entry long, taken whole,
    or a power of two times the capacity (l exact); l from 0 to 20: low parts of bits alone,
    of one whole byte and 0, 1 or 2 bits, of two whole bytes and 0 or 4 bits."""
    generator = torch.Generator().manual_seed(size)
    codec = EliasFano(size, capacity)
    counts = [capacity, capacity - 1, 0, capacity // 2]
    sent = [random_offsets(generator, size, count) for count in counts]
    rows = torch.stack([codec.encode(offsets) for offsets in sent])
    assert rows.dtype == torch.int32 and rows.shape == (4, codec.words)
    assert codec.counts(rows) == counts
    expected = torch.cat([offsets.sort().values for offsets in sent])
    assert torch.equal(codec.decode(rows, counts), expected)


@pytest.mark.parametrize(("size", "capacity"), [(1000, 37), (300_000, 1000), (1 << 20, 1 << 8)])
def test_the_code_is_the_elias_fano_size_and_its_price(size: int, capacity: int) -> None:
    """capacity · l low bits and capacity + ⌈size / 2**l⌉ high bits, at most l + 3 bits an
    offset; what a budget prices (``position_bits``) is within a bit of it."""
    codec = EliasFano(size, capacity)
    low = math.floor(math.log2(size / capacity))
    assert codec.low == low
    assert codec.bits == capacity * low + (size - 1 >> low) + capacity
    assert codec.bits / capacity <= low + 3
    assert abs(codec.bits / capacity - position_bits(capacity / size)) < 1
    assert codec.words == math.ceil(codec.bits / 32)


def test_numpys_sort_on_the_host_codes_as_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's shortcut (``HOST_SORT``) writes the message the device's path writes."""
    codec = EliasFano(300_000, 4000)
    offsets = random_offsets(torch.Generator().manual_seed(3), 300_000, 3999)
    host = codec.encode(offsets).clone()
    monkeypatch.setattr(eliasfano, "HOST_SORT", False)
    assert torch.equal(codec.encode(offsets), host)


def test_clustered_and_extreme_offsets() -> None:
    """Every entry of a range (no low bits), its two ends alone, and a run of consecutive
    offsets that sets a run of high bits."""
    whole = EliasFano(1000, 1000)
    assert whole.low == 0
    every = torch.arange(1000).flip(0)
    assert torch.equal(whole.decode(whole.encode(every).unsqueeze(0), [1000]), every.flip(0))
    codec = EliasFano(1 << 20, 300)
    ends = torch.tensor([(1 << 20) - 1, 0])
    assert codec.decode(codec.encode(ends).unsqueeze(0), [2]).tolist() == [0, (1 << 20) - 1]
    run = torch.arange(500_000, 500_300)
    assert torch.equal(codec.decode(codec.encode(run).unsqueeze(0), [300]), run)


def test_slots_past_a_ranks_count_decode_below_two_to_the_low() -> None:
    """Where the host's counts exceed a message's own (every rank answered one rank's message,
    as in ``SymmetricPeers``' timings), the extra slots have no high bit: they read below
    2**l (l = 3 here), the low bits 0 less (slot + 1) << l, which the caller clamps."""
    codec = EliasFano(48, capacity=6)
    message = codec.encode(torch.tensor([40, 2, 17]))
    rows = message.unsqueeze(0).expand(2, codec.words)
    decoded = codec.decode(rows, [3, 6])
    assert codec.low == 3
    assert decoded.tolist() == [2, 17, 40, 2, 17, 40, -32, -40, -48]


def test_bits_past_the_code_are_zero_and_the_message_is_whole_words() -> None:
    """l = 13: each offset's last 5 low bits and the 5 + 7 high bits packed bit by bit in 5
    bytes, then a byte a slot of its other 8 low bits: 10 bytes in 3 int32 words."""
    codec = EliasFano(1 << 16, 5)
    assert (codec.low, codec.bits, codec.words) == (13, 77, 3)
    offsets = [3, 70_000 - (1 << 16)]  # 3: low 3, high 0; 4,464: low 4,464, high 0
    message = codec.encode(torch.tensor(offsets[::-1])).view(torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8)
    packed = message[:5].unsqueeze(1).bitwise_right_shift(shifts).bitwise_and(1).view(-1)
    assert packed[:10].tolist() == [1, 1, 0, 0, 0, 0, 0, 0, 0, 1]  # 3's last 5 bits, 4,464's
    assert packed[25:37].tolist() == [1, 1] + [0] * 10  # both high parts 0: bits 0 + 0, 0 + 1
    assert int(packed[37:].sum()) == 0
    assert message[5:].tolist() == [0, 139, 0, 0, 0, 0, 0]  # the other 8 low bits: 4,464 >> 5
    assert Compact.collectives(slots=2 * codec.words, index_bytes=4) == [("all_gather", 12)]


# ---------------------------------------------------------------------------------------------
# Real gloo ranks.


def gradient(step: int, rank: int, numel: int, hot: tuple[int, int] | None) -> torch.Tensor:
    """A gradient of this rank and step; ``hot`` = (chunk, span): every partition's entries in
    that chunk of its contiguous range are far larger than the rest (one chunk takes every
    pick, the others none)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    values = torch.randn(numel, generator=generator)
    if hot is not None:
        chunk, span = hot
        for start, end in partition_ranges(numel):
            hot_values = values[start + chunk * span : min(end, start + (chunk + 1) * span)]
            hot_values.add_(hot_values.sign().mul_(1000))
    return values


def partition_ranges(numel: int) -> list[tuple[int, int]]:
    micro = create_sparsifier("micro", 0.01, partitioning="contiguous")
    micro.bind(layout_of(numel), 0, dist.get_world_size())
    return micro._partitions.ranges


def layout_of(numel: int) -> Layout:
    return Layout.of([("w", torch.empty(numel))])


class Recorder:
    """The bytes each rank handed to gloo, by collective, as the ring model counts them."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, torch.dtype]] = []
        gather, reduce = collectives.all_gather_flat, dist.all_reduce

        def all_gather(out, tensor, **kw):
            self.calls.append(("all_gather", tensor.numel() * tensor.element_size(), tensor.dtype))
            return gather(out, tensor, **kw)

        def all_reduce(tensor, **kw):
            self.calls.append(("all_reduce", tensor.numel() * tensor.element_size(), tensor.dtype))
            return reduce(tensor, **kw)

        collectives.all_gather_flat = all_gather
        dist.all_reduce = all_reduce

    def take(self) -> list[tuple[str, int, torch.dtype]]:
        calls, self.calls = self.calls, []
        return calls


def wire_worker(rank: int, n: int, numel: int, density: float, options: dict, hot=None) -> dict:
    recorder = Recorder()
    param = torch.zeros(numel, requires_grad=True)
    reducer = GradientReducer([param], "micro", density, **options)
    steps = []
    for step in range(STEPS):
        before = reducer.residual.clone()
        fresh = gradient(step, rank, numel, hot)
        param.grad = fresh.clone()
        stats = reducer.synchronize()
        steps.append({"fresh": fresh, "before": before, "after": reducer.residual.clone(),
                      "average": param.grad.clone(), "stats": stats,
                      "calls": recorder.take()})  # fmt: skip
    framing = reducer._engine.framing
    return {"steps": steps, "label": framing.label, "slots": getattr(framing, "slots", None),
            "value_dtype": reducer._engine.value_dtype}  # fmt: skip


def launch(tmp_path, numel, density, options, world=2, hot=None) -> list[dict]:
    return run_ranks(wire_worker, world, tmp_path, numel, density, options, hot)


@pytest.mark.parametrize(
    ("numel", "partitioning", "world"),
    [(400_003, "interleaved", 2), (400_003, "contiguous", 3), (5_000, "interleaved", 2)],
)
def test_float32_values_average_as_the_plain_message(
    numel: int, partitioning: str, world: int, tmp_path
) -> None:
    """Partitions of about 200,000, 133,000 and 2,500 entries.
    The same positions, hence the same residuals, bit for bit. The values travel sorted by
    position instead of in selection order: with two ranks each sum is one addition and the
    averages are equal bit for bit; with three, gloo's ring adds an entry's three values in an
    order that depends on where it lies in the buffer, so they agree to rounding."""
    options = {"partitioning": partitioning}
    plain = launch(tmp_path / "plain", numel, 0.01, {**options, "wire": "plain"}, world)
    compact = launch(tmp_path / "compact", numel, 0.01, {**options, "wire": "compact_positions"},
                     world)  # fmt: skip
    assert compact[0]["label"] == "compact"
    assert compact[0]["value_dtype"] is None
    for t in range(STEPS):
        for r in range(world):
            a, b = plain[r]["steps"][t], compact[r]["steps"][t]
            assert torch.equal(a["after"], b["after"]), (t, r)
            assert torch.equal(a["average"] != 0, b["average"] != 0), (t, r)
            if world == 2:
                assert torch.equal(a["average"], b["average"]), (t, r)
            torch.testing.assert_close(a["average"], b["average"], rtol=1e-6, atol=0)
            assert torch.equal(b["average"], compact[0]["steps"][t]["average"]), (t, r)
            for field in ("selected", "local_selected", "proposed", "target"):
                assert getattr(a["stats"], field) == getattr(b["stats"], field), (t, r, field)
            assert b["stats"].exchange == "compact"
            assert b["stats"].selected == b["stats"].target > 0
        # the index message: 8.6 bits an offset at density 0.01 and the guard, against 32
        index = [c for c in compact[0]["steps"][t]["calls"] if c[2] == torch.int32]
        plain_index = [c for c in plain[0]["steps"][t]["calls"] if c[2] == torch.int32]
        assert len(index) == len(plain_index) == 1
        assert index[0][1] < 0.3 * plain_index[0][1], (index, plain_index)


def test_bfloat16_values_keep_each_ranks_rounding_and_conserve(tmp_path) -> None:
    numel = 200_000
    ranks = launch(tmp_path, numel, 0.01, {"wire": "compact", "value_dtype": torch.bfloat16})
    assert ranks[0]["value_dtype"] == torch.bfloat16
    for t in range(STEPS):
        got = [rank["steps"][t] for rank in ranks]
        sent = got[0]["average"] != 0
        assert int(sent.sum()) == got[0]["stats"].selected == got[0]["stats"].target
        wire = []
        for seen in got:
            had = seen["before"] + seen["fresh"]
            wire.append(had[sent].to(torch.bfloat16))
            # what rounding took from this rank's values stays in its residual, exactly
            assert torch.equal(seen["after"][sent], had[sent] - wire[-1].float()), t
            assert torch.equal(seen["after"][~sent], had[~sent]), t
            assert torch.equal(seen["average"], got[0]["average"]), t
        # the average is the wire sum (one more bfloat16 rounding, in the all-reduce) over n
        summed = (wire[0] + wire[1]).float()
        assert torch.equal(got[0]["average"][sent], summed / 2), t
        had = sum((s["before"] + s["fresh"]).double() for s in got)
        kept = sum(s["after"].double() for s in got)
        exact = sum(w.double() for w in wire)  # Σ of what was sent, before the sum's rounding
        conserved = 2 * got[0]["average"].double()
        conserved[sent] += exact - summed.double()
        assert torch.equal(conserved + kept, had), t


@pytest.mark.parametrize(("density", "chunk"), [(0.01, 0), (0.01, 2), (0.5, 1)])
def test_picks_all_in_one_block(density: float, chunk: int, tmp_path) -> None:
    """Contiguous partitions of 150,000 entries; every pick in one block of the range, none
    in the others (a run of set high bits, long gaps around it). At density 0.5 the quota
    (75,000) fills a block of 32,768 entries, and the rest lie elsewhere."""
    numel, options = 300_000, {"partitioning": "contiguous"}
    span = 1 << 16 if density < 0.4 else 1 << 15
    plain = launch(tmp_path / "plain", numel, density, {**options, "wire": "plain"}, world=2,
                   hot=(chunk, span))  # fmt: skip
    compact = launch(tmp_path / "compact", numel, density,
                     {**options, "wire": "compact_positions"}, world=2,
                     hot=(chunk, span))  # fmt: skip
    for t in range(STEPS):
        for r in range(2):
            a, b = plain[r]["steps"][t], compact[r]["steps"][t]
            assert torch.equal(a["average"], b["average"]), (t, r)
            assert torch.equal(a["after"], b["after"]), (t, r)
        if t == 0:  # residuals start at 0: the hot chunk holds every pick
            for start, end in [(0, 150_000), (150_000, 300_000)]:
                after = compact[0]["steps"][t]["after"][start:end]  # 0 where sent
                sent = (after == 0).nonzero().squeeze(1)
                if density == 0.5:  # the hot chunk whole, the rest elsewhere
                    hot = sent[(sent // span) == chunk]
                    assert sent.numel() == 75_000
                    assert torch.equal(hot, torch.arange(chunk * span, (chunk + 1) * span))
                else:  # every pick in the hot chunk, none in the others
                    assert bool(((sent // span) == chunk).all()) and sent.numel() == 1_500


@pytest.mark.parametrize("values", [torch.int8, torch.bfloat16], ids=["default", "bfloat16"])
def test_reported_bytes_are_the_bytes_gathered(values: torch.dtype, tmp_path) -> None:
    numel, n = 400_003, 3
    options = {"wire": "compact"} if values == torch.int8 else {"value_dtype": values}
    ranks = launch(tmp_path, numel, 0.001, options, world=n)
    for rank in ranks:
        for seen in rank["steps"]:
            # Not a step's: the reducer's one check, at its first step, that all ranks have the
            # same options (an int64 all-gather).
            calls = [call for call in seen["calls"] if call[2] != torch.int64]
            stats = seen["stats"]
            ring = {"all_gather": all_gather_bytes, "all_reduce": all_reduce_bytes}
            assert stats.bytes_sent == sum(ring[kind](size, n) for kind, size, _ in calls)
            modelled = step_collectives(Compact, slots=rank["slots"], values=stats.selected,
                                        value_bytes=values.itemsize)  # fmt: skip
            assert [(kind, size) for kind, size, _ in calls] == modelled
            assert calls[-1][2] == values


def test_combinations_that_cannot_work_are_refused() -> None:
    with pytest.raises(ValueError, match="wire='compact' needs selection='quota'"):
        create_sparsifier("micro", 0.01, wire="compact", selection="threshold")
    with pytest.raises(ValueError, match="leave index_message='fixed'"):
        create_sparsifier("micro", 0.01, wire="compact", index_message="padded")
    with pytest.raises(ValueError, match="wire must be one of plain, compact"):
        create_sparsifier("micro", 0.01, wire="int16")
    with pytest.raises(TypeError, match="'cltk' has no option 'wire'.*use 'micro'"):
        GradientReducer([torch.zeros(10, requires_grad=True)], "cltk", 0.1, wire="compact")
    with pytest.raises(ValueError, match="one of union, fixed for topk.*use 'micro'"):
        GradientReducer([torch.zeros(10, requires_grad=True)], "topk", 0.1, wire="compact")


def test_a_plain_micro_keeps_its_fixed_message() -> None:
    micro = create_sparsifier("micro", 0.01, wire="plain")
    micro.bind(layout_of(10_000), 0, 2)
    assert isinstance(micro.framing(), Fixed) and micro.framing().value_dtype is None


def test_the_compact_wire_is_the_default_where_the_options_can_carry_it() -> None:
    micro = create_sparsifier("micro", 0.01)
    micro.bind(layout_of(10_000), 0, 2)
    assert micro.wire == "compact" and isinstance(micro.framing(), Compact)
    assert micro.framing().value_dtype == torch.int8
    assert micro.entry_bytes() == 1 + position_bits(0.01) / 8 < 2.1
    # a shared threshold, or the reference's padded message: the plain wire, without asking
    assert create_sparsifier("micro", 0.01, selection="threshold").wire == "plain"
    assert create_sparsifier("micro", 0.01, index_message="padded").wire == "plain"


def test_more_ranks_than_entries_leave_the_last_partitions_empty(tmp_path) -> None:
    """2 entries over 4 ranks (d <= n): partitions 2 and 3 own nothing, and their owners'
    compact messages (no offset) still decode on every rank."""
    ranks = launch(tmp_path / "compact", 2, 0.5, {}, world=4)
    plain = launch(tmp_path / "plain", 2, 0.5, {"wire": "plain"}, world=4)
    for t in range(STEPS):
        averages = [ranks[r]["steps"][t]["average"] for r in range(4)]
        assert all(torch.equal(a, averages[0]) for a in averages), t
        # the plain wire's picks: k = 1 where the share lands on an entry, none where on nothing
        assert torch.equal(averages[0] != 0, plain[0]["steps"][t]["average"] != 0), t
        assert ranks[0]["steps"][t]["stats"].selected == plain[0]["steps"][t]["stats"].selected


@pytest.mark.parametrize("partitioning", ["interleaved", "contiguous"])
def test_offsets_invert_positions_in_every_partition(partitioning: str) -> None:
    """Including the short tail block, and one rank's offsets mapped for every rank at once."""
    numel, n = 1_000_003, 4
    micro = create_sparsifier("micro", 0.01, partitioning=partitioning, wire="compact")
    micro.bind(layout_of(numel), 0, n)
    partitions, generator = micro._partitions, torch.Generator().manual_seed(0)
    for part in range(n):
        size = partitions.size(part)
        offsets = torch.cat([random_offsets(generator, size, 500), torch.tensor([0, size - 1])])
        positions = partitions.positions(part, offsets)
        assert torch.equal(partitions.offsets(part, positions), offsets)
    step, counts = 1, [3, 0, 2, 1]
    picks = [torch.tensor([0, 9, partitions.size(1) - 1]), torch.tensor([], dtype=torch.long),
             torch.tensor([5, 6]), torch.tensor([partitions.size(0) - 1])]  # fmt: skip
    owned = micro.framing()._ranges
    expected = torch.cat([partitions.positions((step + r) % n, p) for r, p in enumerate(picks)])
    assert torch.equal(owned.positions(step, torch.cat(picks), counts), expected)


def test_symmetric_peers_time_the_compact_step_with_unequal_quotas() -> None:
    """The benchmarks answer every rank with this rank's message, though the quotas differ
    by one and the partitions by a tail block: the step still runs, at a third of the bytes."""
    sent = {}
    for wire in ("plain", "compact"):
        param = torch.nn.Parameter(torch.zeros(1_000_003))
        reducer = GradientReducer([param], "micro", 0.001, collectives=SymmetricPeers(0, 4),
                                  wire=wire)  # fmt: skip
        for _ in range(5):
            param.grad = torch.randn(1_000_003)
            stats = reducer.synchronize()
        assert stats.selected == stats.target == 1000
        sent[wire] = stats.bytes_sent
    assert sent["compact"] < 0.35 * sent["plain"], sent


class SometimesUsed(torch.nn.Module):
    """``branch`` is used in the first steps only, then unused on every rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Linear(64, 64)
        self.branch = torch.nn.Linear(64, 64)
        self.use_branch = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.trunk(x)
        return self.branch(y) if self.use_branch else y


def unused_worker(rank: int, n: int, options: dict) -> list[torch.Tensor]:
    """DDP leaving out the parameters no rank used: the counts are then not known before the
    exchange, and the compact messages' set bits are counted on the host."""
    read = []
    counts = EliasFano.counts
    EliasFano.counts = lambda codec, rows: read.append(1) or counts(codec, rows)
    model = SometimesUsed()
    ddp = DDP(model, find_unused_parameters=True)
    ddp.register_comm_hook(SparseState("micro", 0.05, **options), sparse_hook)
    generator = torch.Generator().manual_seed(rank)
    for step in range(6):
        model.use_branch = step < 2
        model.zero_grad()
        ddp(torch.randn(8, 64, generator=generator)).pow(2).sum().backward()
    assert options.get("wire") == "plain" or read, "the compact messages' counts were never read"
    return [p.detach().clone() for p in model.parameters()]


def warmup_worker(rank: int, n: int, options: dict) -> list[torch.Tensor]:
    """A density warm-up moves k, hence the message's capacity, every step."""
    param = torch.zeros(300_000, requires_grad=True)
    reducer = GradientReducer([param], "micro", 0.001, density_warmup=(0.01, 3), **options)
    averages = []
    for step in range(5):
        param.grad = gradient(step, rank, 300_000, None)
        stats = reducer.synchronize()
        assert stats.selected == stats.target
        averages.append(param.grad.clone())
    return averages


@pytest.mark.parametrize("worker", [unused_worker, warmup_worker])
def test_unused_parameters_and_a_warm_up_average_as_the_plain_message(worker, tmp_path) -> None:
    plain = run_ranks(worker, 2, tmp_path / "plain", {"wire": "plain"})
    compact = run_ranks(worker, 2, tmp_path / "compact", {"wire": "compact_positions"})
    for a, b in zip(plain, compact):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


class Recording(collectives.ProcessGroupCollectives):
    """The process group's collectives, with what each request was for."""

    def __init__(self) -> None:
        super().__init__()
        self.whats: list[str] = []

    def run(self, request: collectives.Collective) -> torch.Tensor:
        self.whats.append(request.what)
        return super().run(request)


def guard_worker(rank: int, n: int, scale: float | None = None) -> dict[str, list]:
    """Five steps of one slab, its gradient handed over flat (as DDP's bucket) or as a list
    of one tensor (as the loop API's per-parameter gradients), an Inf on rank 0 at step 3;
    with ``scale``, multiplied by it as a ``GradScaler`` scales it."""
    from microsparse.engine import FlatOutput, SparseStep, run_blocking
    from microsparse.feedback import ErrorFeedback

    layout = Layout.of([("w", torch.zeros(40_000))])
    got: dict[str, list] = {}
    for how in ("flat", "list"):
        sparsifier = create_sparsifier("micro", 0.01)
        sparsifier.bind(layout, rank, n)
        feedback = ErrorFeedback(layout, torch.float32, torch.device("cpu"))
        engine, comm = SparseStep(sparsifier, feedback), Recording()
        got[how] = []
        for step in range(5):
            generator = torch.Generator().manual_seed(10 * step + rank)
            gradient = torch.randn(40_000, generator=generator)
            if step == 3 and rank == 0:
                gradient[7] = torch.inf
            output = FlatOutput(torch.empty(40_000))
            comm.whats.clear()
            factor = None if scale is None else torch.tensor([scale])
            if factor is not None:
                gradient *= factor
            fresh = gradient if how == "flat" else [gradient]
            report = run_blocking(engine.run(step, fresh, output, scale=factor), comm)
            skipped = report.skipped  # a Pending where the verdict stayed on the device
            skipped = skipped if isinstance(skipped, bool) else bool(skipped.get())
            got[how].append((list(comm.whats), skipped, feedback.residual.clone(),
                             output.data.clone(), report.bytes_sent))  # fmt: skip
    return got


@pytest.mark.parametrize("scale", [None, 3.0 * 2**12], ids=["unscaled", "grad-scaler"])
def test_a_flat_gradient_takes_two_rounds_the_guard_inside_the_index_message(
    scale, tmp_path
) -> None:
    """Where the gradient is one flat tensor (DDP's bucket, FSDP's shard) MiCRO selects from
    e + g before writing the residual (e + g / scale under a ``GradScaler``), and the guard's
    flag and step ride in the compact message: two rounds instead of three, with bit for bit
    the same residuals and averages, and a step with an Inf on one rank skipped on every rank
    with nothing changed."""
    for got in run_ranks(guard_worker, 2, tmp_path, scale):
        # the first step reads the guard on the host (after a start), the others do not
        assert [whats for whats, *_ in got["flat"]] == [["indices", "values"]] * 5
        assert [whats for whats, *_ in got["list"]] == [["guard", "indices", "values"]] * 5
        for flat, listed in zip(got["flat"], got["list"]):
            assert flat[1] == listed[1]  # skipped
            assert flat[4] == listed[4]  # the same bytes: the guard's 8 a rank moved inside
            assert torch.equal(flat[2], listed[2])
            if not flat[1]:
                assert torch.equal(flat[3], listed[3])
        assert [skipped for _, skipped, *_ in got["flat"]] == [False] * 3 + [True, False]
        assert torch.equal(got["flat"][3][2], got["flat"][2][2])  # the residual as it was
        # NaN where it would have averaged (k = 400 positions, chosen from e + g there and
        # from e where the guard had its own round), as a GradScaler skips it
        for how in ("flat", "list"):
            skipped = got[how][3][3]
            assert int(skipped.isnan().sum()) == 400 and int((skipped == 0).sum()) == 39_600
