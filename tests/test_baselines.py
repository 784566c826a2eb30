"""The paper's baselines (docs/METHOD.md) on real gloo ranks, each against a brute-force reference.

The references below are written independently of the package, in the style of the authors'
reference code: numpy float64, plain loops over ranks, no shared helpers. Only SAGE's random
sample positions come from torch, because the package documents how it draws them.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

import microsparse
from distributed import run_ranks
from microsparse import GradientReducer, NonFiniteGradientError

# d = 1031. The first parameter (800) exceeds d/n for n = 2 and 4, so DEFT cuts it into n
# chunks; the last (a single entry) is always sent whole by DEFT.
SHAPES = [(40, 20), (20,), (10, 20), (10,), (1,)]
SCALES = [0.05, 1.0, 0.2, 0.5, 0.3]
NUMEL = sum(math.prod(shape) for shape in SHAPES)
DENSITY = 0.01
TARGET = max(1, math.floor(DENSITY * NUMEL))  # k = 10
STEPS = 4  # with n = 4 every rank leads once
SAGE_SEED = 3
BASELINES = ["dense", "topk", "cltk", "hard_threshold", "sage", "deft", "oracle"]
EXCHANGE = {
    "dense": "dense",
    "topk": "union",
    "cltk": "shared",
    "hard_threshold": "union",
    "sage": "union",
    "deft": "padded",
    "oracle": "shared",
}
CASES = [{"name": name, "seed": index} for index, name in enumerate(BASELINES)] + [
    {"name": "topk", "seed": 10, "identical": True},  # all ranks hold the same gradient
    {"name": "hard_threshold", "seed": 11, "scale": 1e-6},  # nothing passes λ on any rank
    {"name": "sage", "seed": 12, "scale": 1e-3},  # far below target: γ = 0.95 branch
    # The union as a fixed message: the same average and residuals as the union's.
    {"name": "topk", "seed": 13, "options": {"wire": "fixed"}},
    {"name": "topk", "seed": 14, "identical": True, "options": {"wire": "fixed"}},  # all repeats
]


def make_gradients(
    n: int, seed: int, identical: bool = False, scale: float = 1.0
) -> list[list[np.ndarray]]:
    """``gradients[t][r]``: rank r's flat gradient at step t."""
    rng = np.random.default_rng(seed)
    scales = np.concatenate([np.full(math.prod(s), c) for s, c in zip(SHAPES, SCALES)]) * scale
    steps = []
    for _ in range(STEPS):
        if identical:
            steps.append([rng.standard_normal(NUMEL) * scales] * n)
        else:
            steps.append([rng.standard_normal(NUMEL) * scales for _ in range(n)])
    return steps


def options(name: str) -> dict:
    return {"seed": SAGE_SEED} if name == "sage" else {}


# ---------------------------------------------------------------------------------------------
# What every rank runs.


def every_case(rank: int, n: int) -> dict:
    results: dict = {"cases": [run_case(rank, n, case) for case in CASES]}
    results["dense_bitwise"] = dense_matches_all_reduce(rank, n)
    if n > 1:
        results["nonfinite"] = {
            name: nonfinite_on_leader(rank, name) for name in ("cltk", "deft", "topk", "oracle")
        }
    return results


def run_case(rank: int, n: int, case: dict) -> list[dict]:
    params = [torch.zeros(shape, dtype=torch.float64, requires_grad=True) for shape in SHAPES]
    reducer = GradientReducer(
        params, case["name"], DENSITY, **options(case["name"]), **case.get("options", {})
    )
    gradients = make_gradients(
        n, case["seed"], case.get("identical", False), case.get("scale", 1.0)
    )
    steps = []
    for t in range(STEPS):
        set_gradients(params, gradients[t][rank])
        stats = reducer.synchronize()
        aggregated = torch.cat([p.grad.flatten() for p in params]).numpy().copy()
        steps.append(
            {"aggregated": aggregated, "residual": reducer.residual.numpy().copy(), "stats": stats}
        )
    return steps


def set_gradients(params: list[torch.Tensor], flat: np.ndarray) -> None:
    for p, chunk in zip(params, torch.from_numpy(flat).split([p.numel() for p in params])):
        p.grad = chunk.view(p.shape).clone()


def dense_matches_all_reduce(rank: int, n: int) -> bool:
    """``dense`` in float32 against ``all_reduce(flat gradient) / n``, compared bit for bit.

    The reference all-reduces the gradients packed into one flat buffer, as DDP's buckets and
    the authors' exact reducer do: gloo's summation order depends on the tensor's length, so
    per-parameter all-reduces may differ in the last bit for n > 2.
    """
    params = [torch.zeros(shape, requires_grad=True) for shape in SHAPES]
    reducer = GradientReducer(params, "dense")
    generator = torch.Generator().manual_seed(100 + rank)
    equal = True
    for _ in range(3):
        gradients = [torch.randn(p.shape, generator=generator) for p in params]
        expected = torch.cat([g.flatten() for g in gradients])
        dist.all_reduce(expected)
        expected.div_(n)
        for p, g in zip(params, gradients):
            p.grad = g
        reducer.synchronize()
        equal &= torch.equal(torch.cat([p.grad.flatten() for p in params]), expected)
        equal &= bool((reducer.residual == 0).all())
    return equal


def nonfinite_on_leader(rank: int, name: str) -> str:
    """Rank 1 leads step 1 and has a NaN: with nonfinite="raise" every rank must raise in
    that step (the guard sees it before anything is selected), none may hang."""
    params = [torch.zeros(shape, requires_grad=True) for shape in SHAPES]
    reducer = GradientReducer(params, name, DENSITY, nonfinite="raise")
    generator = torch.Generator().manual_seed(rank)
    try:
        for step in range(2 + 2 * dist.get_world_size()):
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator)
            if step == 1 and rank == 1:
                params[0].grad[3, 4] = math.nan
            reducer.synchronize()
    except NonFiniteGradientError as error:
        return f"raised at step {reducer.step}: {error}"
    return "did not raise"


# ---------------------------------------------------------------------------------------------
# Brute-force references: the rule of each baseline, for all ranks at once.


def top_k(values: np.ndarray, k: int) -> set[int]:
    return set(np.argsort(-np.abs(values), kind="stable")[:k].tolist())


def at_least(values: np.ndarray, threshold: float) -> set[int]:
    return {i for i in range(len(values)) if abs(values[i]) >= threshold}


def dense_rule(accumulated, t, state):
    return [set(range(NUMEL)) for _ in accumulated], {}


def topk_rule(accumulated, t, state):
    return [top_k(a, TARGET) for a in accumulated], {}


def cltk_rule(accumulated, t, state):
    leader = t % len(accumulated)
    chosen = top_k(accumulated[leader], TARGET)
    return [chosen for _ in accumulated], {"leader": leader}


def oracle_rule(accumulated, t, state):
    chosen = top_k(sum(accumulated), TARGET)  # the sum of every rank's a
    return [chosen for _ in accumulated], {}


def hard_threshold_rule(accumulated, t, state):
    threshold = 1.0 / (2.0 * math.sqrt(TARGET))
    return [at_least(a, threshold) for a in accumulated], {
        "thresholds": [threshold] * len(accumulated)
    }


def sage_rule(accumulated, t, state):
    n = len(accumulated)
    if not state:
        state["generators"] = [torch.Generator().manual_seed(SAGE_SEED * n + r) for r in range(n)]
        state["thresholds"] = [1.0 / (2.0 * math.sqrt(TARGET))] * n
        state["previous"] = [None] * n
    samples = int(NUMEL / (1 + NUMEL * 0.05 * 0.05))  # Slovin's formula
    picks, factors = [], []
    for r, a in enumerate(accumulated):
        positions = torch.randint(NUMEL, (samples,), generator=state["generators"][r]).numpy()
        mean = float(np.mean(np.abs(a[positions])))
        if state["previous"][r] is not None:
            alpha = mean / state["previous"][r]
            examined = np.count_nonzero(np.abs(a) >= state["thresholds"][r] * alpha) / NUMEL
            beta = 2.0 / (1.0 + math.exp(DENSITY - examined))
            gamma = 0.95 if examined / DENSITY < 0.1 else 1.05 if examined / DENSITY > 10.0 else 1.0
            state["thresholds"][r] *= alpha * beta * gamma
            factors.append(
                {"alpha": alpha, "beta": beta, "gamma": gamma, "examined_density": examined}
            )
        else:
            factors.append({})
        state["previous"][r] = mean
        picks.append(at_least(a, state["thresholds"][r]))
    return picks, {"thresholds": list(state["thresholds"]), "factors": factors}


def deft_fragments(n: int) -> tuple[list[int], list[int]]:
    starts, ends, position = [], [], 0
    for size in (math.prod(shape) for shape in SHAPES):
        if size > NUMEL / n:
            quotient, remainder = divmod(size, n)
            for i in range(n):
                chunk = quotient + (1 if i < remainder else 0)
                if chunk:
                    starts.append(position)
                    ends.append(position + chunk)
                position += chunk
        else:
            starts.append(position)
            ends.append(position + size)
            position += size
    return starts, ends


def deft_rule(accumulated, t, state):
    n = len(accumulated)
    starts, ends = deft_fragments(n)
    layers = len(starts)
    leader = accumulated[t % n]
    norms = [float(np.linalg.norm(leader[starts[i] : ends[i]])) for i in range(layers)]
    k_layer = [0] * layers
    remain_k, remain_norm = TARGET, sum(norms)
    for layer in sorted(range(layers), key=lambda i: -norms[i]):
        size = ends[layer] - starts[layer]
        temp_k = int(remain_k * (norms[layer] / remain_norm)) if remain_norm > 0 else 0
        k_layer[layer] = size if size < temp_k else max(1, temp_k)
        remain_k -= k_layer[layer]
        remain_norm -= norms[layer]
    # The reference's bin packing: repeatedly the heaviest layer into the lightest bin.
    weight = [
        (ends[i] - starts[i]) * math.log2(k_layer[i]) if k_layer[i] > 1 else ends[i] - starts[i]
        for i in range(layers)
    ]
    load, bins = [0.0] * n, [[] for _ in range(n)]
    for _ in range(layers):
        heaviest = weight.index(max(weight))
        lightest = load.index(min(load))
        whole = k_layer[heaviest] == ends[heaviest] - starts[heaviest]
        bins[lightest].append(heaviest)
        load[lightest] += 0 if whole else weight[heaviest]
        weight[heaviest] = -1
    picks, counts = [], []
    for r, a in enumerate(accumulated):
        chosen: set[int] = set()
        for layer in bins[(t + r) % n]:
            start = starts[layer]
            chosen |= {start + i for i in top_k(a[start : ends[layer]], k_layer[layer])}
        picks.append(chosen)
        counts.append(sum(k_layer[layer] for layer in bins[(t + r) % n]))
    return picks, {"counts": counts, "fragments": layers}


RULES = {
    "dense": dense_rule,
    "topk": topk_rule,
    "cltk": cltk_rule,
    "hard_threshold": hard_threshold_rule,
    "sage": sage_rule,
    "deft": deft_rule,
    "oracle": oracle_rule,
}


def reference(name: str, gradients: list[list[np.ndarray]]) -> list[dict]:
    """Error feedback plus the all-reduce at the union of picks, shared by every baseline."""
    n = len(gradients[0])
    residuals = [np.zeros(NUMEL) for _ in range(n)]
    state: dict = {}
    steps = []
    for t, step_gradients in enumerate(gradients):
        accumulated = [residuals[r] + step_gradients[r] for r in range(n)]
        picks, info = RULES[name](accumulated, t, state)
        union = sorted(set().union(*picks))
        aggregated = np.zeros(NUMEL)
        for i in union:
            aggregated[i] = sum(accumulated[r][i] for r in range(n)) / n
        residuals = [a.copy() for a in accumulated]
        for residual in residuals:
            residual[union] = 0.0
        steps.append(
            {
                "picks": picks,
                "union": union,
                "aggregated": aggregated,
                "residuals": residuals,
                **info,
            }
        )
    return steps


def expected_bytes(name: str, n: int, stats, want: dict, fixed: bool = False) -> int:
    """The ring model of ``microsparse.comm`` applied by hand to what each exchange sends.

    Every step begins with the guard, two float32 per rank; headers are int64 ``[step,
    count]`` before padded indices; indices are int32. ``fixed``: top-k's fixed union, k
    indices a rank and no header, values at all n·k slots.
    """
    guard = (n - 1) * 8
    values = 2 * (n - 1) * stats.selected * 8 // n
    if fixed:
        return guard + (n - 1) * TARGET * 4 + 2 * (n - 1) * TARGET * 8
    if name == "dense":
        return guard + values
    if name == "cltk":
        return guard + (TARGET * 4 if n > 1 else 0) + values
    if name == "oracle":  # a dense all-reduce of a, then the [step, count] header
        return guard + 2 * (n - 1) * NUMEL * 8 // n + (n - 1) * 2 * 8 + values
    longest = max(len(p) for p in want["picks"])
    if name == "deft":  # the plan fixes the counts: no count header
        plan = 2 * want["fragments"] * 4 if n > 1 else 0
        return guard + plan + (n - 1) * longest * 4 + values
    return guard + (n - 1) * 2 * 8 + (n - 1) * longest * 4 + values


# ---------------------------------------------------------------------------------------------
# The tests.


@pytest.mark.parametrize("n", [1, 2, 4])
def test_baselines_match_brute_force_references(n: int, tmp_path) -> None:
    ranks = run_ranks(every_case, n, tmp_path)
    for index, case in enumerate(CASES):
        name = case["name"]
        gradients = make_gradients(
            n, case["seed"], case.get("identical", False), case.get("scale", 1.0)
        )
        expected = reference(name, gradients)
        previous = [np.zeros(NUMEL) for _ in range(n)]
        for t, want in enumerate(expected):
            got = [ranks[r]["cases"][index][t] for r in range(n)]
            where = f"{case}, n={n}, step {t}"
            for r in range(n):
                stats = got[r]["stats"]
                assert np.array_equal(got[r]["aggregated"], got[0]["aggregated"]), where
                np.testing.assert_allclose(
                    got[r]["aggregated"], want["aggregated"], rtol=1e-12, atol=0, err_msg=where
                )
                # Residuals are exact: the positions sent are exactly the reference's union.
                assert np.array_equal(got[r]["residual"], want["residuals"][r]), where
                assert stats.selected == len(want["union"]), where
                assert stats.local_selected == (
                    NUMEL if name == "dense" else len(want["picks"][r])
                ), where
                fixed = case.get("options", {}).get("wire") == "fixed"
                assert stats.exchange == ("fixed_union" if fixed else EXCHANGE[name]), where
                assert stats.build_up == stats.selected / stats.target, where
                assert stats.bytes_sent == expected_bytes(name, n, stats, want, fixed), where
                check_rule_specifics(name, case, n, t, r, stats, want, where)
            # Conservation: Σ accumulated = n · aggregated + Σ residuals.
            accumulated = [previous[r] + gradients[t][r] for r in range(n)]
            residuals = [got[r]["residual"] for r in range(n)]
            np.testing.assert_allclose(
                sum(accumulated),
                n * got[0]["aggregated"] + sum(residuals),
                rtol=1e-12,
                atol=1e-15,
                err_msg=where,
            )
            previous = residuals
    assert all(rank["dense_bitwise"] for rank in ranks), "dense differs from all_reduce(grad) / n"
    if n > 1:
        for name in ("cltk", "deft", "topk", "oracle"):
            outcomes = [rank["nonfinite"][name] for rank in ranks]
            assert all(o.startswith("raised at step 1:") for o in outcomes), outcomes
            # The rank with the NaN names the parameter; every other rank names that rank.
            assert "NaN or Inf gradient in parameter 0; this rank's" in outcomes[1], outcomes[1]
            assert all("on rank 1; this rank's own gradient was finite" in o
                       for o in outcomes[:1] + outcomes[2:])  # fmt: skip


def check_rule_specifics(
    name: str, case: dict, n: int, t: int, r: int, stats, want: dict, where: str
) -> None:
    if name == "dense":
        assert stats.selected == NUMEL and stats.target == NUMEL and stats.build_up == 1.0, where
    elif name == "topk":
        assert stats.proposed == n * TARGET, where
        if case.get("identical") or n == 1:
            assert stats.selected == TARGET, where  # identical gradients: no build-up at all
        else:
            assert TARGET < stats.selected <= n * TARGET, where  # build-up
    elif name == "cltk":
        assert stats.selected == TARGET and stats.local_selected == TARGET, where
        assert stats.extra["leader"] == t % n == want["leader"], where
    elif name == "oracle":
        assert stats.selected == TARGET and stats.local_selected == TARGET, where
    elif name == "deft":
        # Every rank sends exactly what the leader's plan gave its bin; bins are disjoint.
        assert stats.local_selected == want["counts"][r], where
        assert stats.max_local_selected == max(want["counts"]), where
        assert stats.selected == stats.proposed == sum(want["counts"]), where
        assert stats.extra["bin"] == (t + r) % n, where
    elif name == "hard_threshold":
        assert stats.threshold == 1.0 / (2.0 * math.sqrt(TARGET)), where
        if case.get("scale", 1.0) < 1e-3:
            assert stats.selected == 0 and stats.bytes_sent == (n - 1) * 24, where  # guard, header
    elif name == "sage":
        assert stats.threshold == pytest.approx(want["thresholds"][r], rel=1e-12), where
        for factor, value in want["factors"][r].items():
            assert stats.extra[factor] == pytest.approx(value, rel=1e-12), (where, factor)
        if t == 0:
            assert stats.threshold == 1.0 / (2.0 * math.sqrt(TARGET)), where


@pytest.mark.parametrize("name", BASELINES)
def test_state_dict_resumes_exactly(name: str) -> None:
    """Single process: save after two steps, resume in a fresh reducer, same next steps."""

    def run(reducer, params, gradients):
        out = []
        for flat in gradients:
            set_gradients(params, flat)
            stats = reducer.synchronize()
            out.append(
                (
                    torch.cat([p.grad.flatten() for p in params]).clone(),
                    stats.threshold,
                    stats.selected,
                )
            )
        return out

    gradients = [g[0] for g in make_gradients(1, seed=7)]
    params = [torch.zeros(shape, dtype=torch.float64, requires_grad=True) for shape in SHAPES]
    reducer = GradientReducer(params, name, DENSITY, **options(name))
    run(reducer, params, gradients[:2])
    state = copy.deepcopy(reducer.state_dict())
    first = run(reducer, params, gradients[2:])
    fresh_params = [torch.zeros(shape, dtype=torch.float64, requires_grad=True) for shape in SHAPES]
    resumed = GradientReducer(fresh_params, name, DENSITY, **options(name))
    resumed.load_state_dict(state)
    second = run(resumed, fresh_params, gradients[2:])
    for (grad_a, threshold_a, selected_a), (grad_b, threshold_b, selected_b) in zip(first, second):
        assert torch.equal(grad_a, grad_b)
        assert selected_a == selected_b
        assert threshold_a == threshold_b or (math.isnan(threshold_a) and math.isnan(threshold_b))


def test_deft_plan_helpers_follow_the_reference_rule() -> None:
    from microsparse.sparsifiers.deft import allocate_k, pack_bins

    # Largest norm first; every fragment gets at least 1 and at most its size.
    assert allocate_k([1.0, 3.0, 0.0], [100, 2, 5], target=8) == [6, 2, 1]
    # A fragment sent whole (k = size) needs no top-k, so it adds nothing to its bin's load:
    # the next fragment still goes to bin 0.
    assert pack_bins([5, 1, 2], [5, 10, 8], bins=2) == [0, 0, 1]


def test_baselines_are_registered_with_their_options() -> None:
    assert set(BASELINES) <= set(microsparse.available_sparsifiers())
    params = [torch.zeros(5, requires_grad=True)]
    with pytest.raises(ValueError, match="sample_size"):
        GradientReducer(params, "sage", 0.5, sample_size=0)
    with pytest.raises(TypeError, match="sparsifier 'cltk' takes no options"):
        GradientReducer(params, "cltk", 0.5, seed=1)
    with pytest.raises(TypeError, match="sparsifier 'topk' takes: wire"):
        GradientReducer(params, "topk", 0.5, seed=1)
    with pytest.raises(ValueError, match="wire must be one of union, fixed for topk"):
        GradientReducer(params, "topk", 0.5, wire="compact")
