"""Real collectives: 2, 3 and 4 gloo processes (spawned). Many checks per spawn to keep CI fast."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import cpattn
from reference_layers import AttentionStack
from dist_utils import CountCollectives, run_distributed

pytestmark = pytest.mark.slow

NAMES = ["zigzag", "interleave", "contiguous"]
# Ragged, with prefixes, zero and one-token sequences, and sequences shorter than 2C.
EXTEND = [37, 0, 1, 5, 64, 3]
PREFIX = [4, 9, 0, 2, 0, 17]


def _positions(extend, prefix):
    return torch.cat([torch.arange(p, p + e) for e, p in zip(extend, prefix)])


def _worker_checks(rank: int, world: int, subgroups: bool):
    """Run every check on this rank; return {check: value} for the parent to assert on."""
    results = {}
    group, cp_rank, cp_size = None, rank, world
    if subgroups:  # two independent CP groups of 2 ranks: no global state inside cpattn
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        group, cp_rank, cp_size = groups[rank // 2], rank % 2, 2
    g = torch.Generator().manual_seed(0)  # identical logical tensors on every rank
    T = sum(EXTEND)
    x = torch.randn(T, 6, generator=g)
    k = torch.randn(T, 2, 8, generator=g).bfloat16()
    v = torch.randn(T, 2, 4, generator=g).bfloat16()
    with CountCollectives() as counter:
        calls = counter.calls
        for name in NAMES:
            s = cpattn.get_strategy(name, cp_size, pad_multiple=4)
            m = s.build_metadata(EXTEND, PREFIX, rank=cp_rank, group=group)  # agreed over the CP group
            for dtype in (torch.float32, torch.bfloat16, torch.int64):
                xt = (x * 100).to(dtype)
                before = len(calls)
                full = s.gather(s.shard(xt, m), m, group)
                results[f"{name}/gather/{dtype}"] = (torch.equal(full, xt), len(calls) - before)
            pos3 = torch.stack([_positions(EXTEND, PREFIX)] * 3)
            results[f"{name}/gather_dim1"] = torch.equal(s.gather(s.shard(pos3, m, dim=1), m, group, dim=1), pos3)
            before = len(calls)
            k_full, v_full = s.gather_kv(s.shard(k, m), s.shard(v, m), m, group)
            results[f"{name}/gather_kv"] = (torch.equal(k_full, k) and torch.equal(v_full, v), len(calls) - before)
            pending = s.gather_kv(s.shard(k, m), s.shard(v, m), m, group, async_op=True)
            k_a, v_a = pending.wait()
            results[f"{name}/gather_kv_async"] = torch.equal(k_a, k) and torch.equal(v_a, v) and pending.wait()[0] is k_a

            # A small multi-layer attention stack (RoPE with sharded global positions) under CP
            # equals the same stack on one process.
            stack = AttentionStack(num_layers=3, hidden=32, num_q_heads=4, num_kv_heads=2, head_dim=8)
            prefix_kv = [
                (torch.randn(sum(PREFIX), 2, 8, generator=g), torch.randn(sum(PREFIX), 2, 8, generator=g))
                for _ in range(3)
            ]
            pos = _positions(EXTEND, PREFIX)
            y_local, _ = stack(s.shard(x.repeat(1, 6)[:, :32], m), s.shard(pos, m), s, m, group, prefix_kv, "torch")
            y = s.gather(y_local, m, group)
            s1 = cpattn.get_strategy(name, 1)
            m1 = s1.build_metadata(EXTEND, PREFIX, rank=0)
            y_ref, _ = stack(x.repeat(1, 6)[:, :32], pos, s1, m1, None, prefix_kv, "torch")
            results[f"{name}/stack_max_err"] = (y - y_ref).abs().max().item()
            results[f"{name}/stack_finite"] = bool(torch.isfinite(y_local).all())

        # Only short sequences: some ranks own nothing, still join every collective, no NaN.
        s = cpattn.ZigzagStrategy(cp_size, rotate=False)
        m = s.build_metadata([1, 0, 1], rank=cp_rank, group=group)
        xs = torch.randn(2, 4, generator=g)
        results["empty_rank_rows"] = m.num_local_tokens
        results["empty_rank_gather"] = torch.equal(s.gather(s.shard(xs, m), m, group), xs)
        q_local = s.shard(torch.randn(2, 2, 8, generator=g), m)
        out = s.attention(q_local, torch.randn(2, 2, 8, generator=g), torch.randn(2, 2, 8, generator=g), m)
        results["empty_rank_attention_finite"] = bool(torch.isfinite(out).all())
        m0 = s.build_metadata([], rank=cp_rank, group=group)
        results["empty_batch_gather"] = tuple(s.gather(s.shard(torch.zeros(0, 3), m0), m0, group).shape)

    # Misconfigurations raise before any collective (all ranks raise the same way: no hang).
    wrong_size = cpattn.ZigzagStrategy(cp_size + 1)
    m_bad = wrong_size.build_metadata([8], rank=0, agree=False)  # unchecked: gather's own checks must catch it
    try:
        wrong_size.gather(torch.zeros(m_bad.num_physical_tokens, 2), m_bad, group)
        results["group_size_error"] = None
    except ValueError as exc:
        results["group_size_error"] = str(exc)
    s = cpattn.ZigzagStrategy(cp_size)
    m_other = s.build_metadata([8], rank=(cp_rank + 1) % cp_size, agree=False)
    try:
        s.gather(torch.zeros(m_other.num_physical_tokens, 2), m_other, group)
        results["rank_error"] = None
    except ValueError as exc:
        results["rank_error"] = str(exc)
    return results


@pytest.mark.parametrize("world, subgroups", [(2, False), (3, False), (4, False), (4, True)])
def test_collectives_and_stack(world, subgroups):
    results = run_distributed(_worker_checks, world, subgroups)
    assert min(r["empty_rank_rows"] for r in results) == 0  # some rank really had no rows
    for rank, res in enumerate(results):
        for name in NAMES:
            for dtype in (torch.float32, torch.bfloat16, torch.int64):
                assert res[f"{name}/gather/{dtype}"] == (True, 1), (rank, name, dtype)
            assert res[f"{name}/gather_dim1"], (rank, name)
            assert res[f"{name}/gather_kv"] == (True, 1), (rank, name)
            assert res[f"{name}/gather_kv_async"], (rank, name)
            assert res[f"{name}/stack_max_err"] < 1e-4, (rank, name, res[f"{name}/stack_max_err"])
            assert res[f"{name}/stack_finite"]
        assert res["empty_rank_gather"] and res["empty_rank_attention_finite"]
        assert res["empty_batch_gather"] == (0, 3)
        assert "group size" in res["group_size_error"]
        assert "metadata was built for rank" in res["rank_error"]


# ----------------------------------------------------------------------------- plan agreement
def _worker_disagree(rank: int, world: int, case: str):
    """Plan with group= in a way that differs between ranks; report what this rank raised."""
    import time

    s = cpattn.ZigzagStrategy(world)
    ext, pre, claimed = [5, 9, 3], [0, 2, 0], rank
    if case == "lengths" and rank == 0:
        ext = [9, 5, 3]  # same T, a different batch
    if case == "swapped" and rank == 1:
        claimed = 0  # two processes claim rank 0
    if case == "fail" and rank == world - 1:
        ext = [5, -1, 3]  # this rank's own planning fails
    if case == "cp_size" and rank == 0:
        s = cpattn.ZigzagStrategy(world + 1)
    if case == "static":  # two ranks' planners were sized differently
        s = cpattn.StaticPlanner(s, max_tokens=64 + (rank == 0), max_seqs=4, max_kv_tokens=128, device="cpu")
    t0 = time.monotonic()
    try:
        if case == "static":
            s.plan(ext, pre, rank=claimed, group=dist.group.WORLD)
        else:
            s.build_metadata(ext, pre, rank=claimed, group=dist.group.WORLD)
        outcome = None
    except Exception as exc:  # noqa: BLE001
        outcome = (type(exc).__name__, str(exc))
    return outcome, time.monotonic() - t0


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", ["lengths", "swapped", "fail", "cp_size", "static"])
def test_ranks_that_disagree_all_raise(world, case):
    results = run_distributed(_worker_disagree, world, case, timeout=120)
    for rank, (outcome, seconds) in enumerate(results):
        assert outcome is not None, f"rank {rank} accepted a plan the others disagree with ({case})"
        assert seconds < 10, (rank, seconds)
        name, message = outcome
        if case == "fail" and rank == world - 1:
            assert name == "ValueError" and "extend_lens must be >= 0" in message  # its own error
        elif case == "cp_size" and rank == 0:  # its own error, found locally (group size vs cp_size)
            assert name == "ValueError" and f"group has {world} ranks but cp_size={world + 1}" in message, outcome
        else:
            assert name == "PlanDisagreement" and "CP plan" in message, outcome
    failing = {"fail": world - 1, "cp_size": 0}.get(case)
    messages = {r[0][1] for rank, r in enumerate(results) if rank != failing}
    assert len(messages) == 1  # every rank raises the same error
    expected = {"lengths": "extend_lens / prefix_lens differ", "swapped": "two processes claim one rank",
                "fail": f"group rank(s) [{world - 1}] could not build a plan",
                "cp_size": "group rank(s) [0] could not build a plan", "static": "capacity differ"}[case]
    assert expected in messages.pop()


def _worker_agree(rank: int, world: int):
    s = cpattn.InterleaveStrategy(world)
    m = s.build_metadata([7, 4], [3, 0], rank=rank, group=dist.group.WORLD)
    x = torch.arange(11.0).view(11, 1)
    full = s.gather(s.shard(x, m), m)  # the plan remembers the group it was checked on
    q = torch.zeros(m.num_physical_tokens, 2, 4)
    errors = []
    other = s.build_metadata([7, 4], [3, 0], rank=(rank + 1) % world, agree=False)  # another rank's plan...
    other = dataclasses.replace(other, group=dist.group.WORLD)  # ...claiming this group
    try:
        s.attention(q, torch.zeros(14, 1, 4), torch.zeros(14, 1, 4), other)
    except ValueError as exc:
        errors.append(str(exc))
    return torch.equal(full, x), m.group is dist.group.WORLD, errors


def test_agreed_plan_and_rank_check_in_attention():
    for ok, has_group, errors in run_distributed(_worker_agree, 2):
        assert ok and has_group
        assert errors and "metadata was built for rank" in errors[0]


def _worker_timeout(rank: int, world: int):
    """Rank 1 fails mid-layer and skips the collective; rank 0 waits in it. The process group's
    timeout bounds the wait: rank 0 raises instead of hanging."""
    import time

    s = cpattn.ZigzagStrategy(world)
    m = s.build_metadata([8], rank=rank, group=dist.group.WORLD)
    if rank == 1:
        time.sleep(12)  # 'crashed' (alive, but never joins the all-gather)
        return None
    t0 = time.monotonic()
    try:
        s.gather(torch.zeros(m.num_physical_tokens, 2), m)
        outcome = None
    except Exception as exc:  # noqa: BLE001
        outcome = type(exc).__name__
    return outcome, time.monotonic() - t0


def test_process_group_timeout_bounds_a_mid_layer_failure():
    results = run_distributed(_worker_timeout, 2, timeout=120, pg_timeout=3, barrier=False)
    outcome, seconds = results[0]
    assert outcome is not None, "rank 0 returned from a collective its peer never joined"
    assert 2.5 <= seconds < 11, seconds


# ----------------------------------------------------------------------------- safe defaults under faults
def _worker_default_group(rank: int, world: int, case: str):
    """group=None with an initialized default group: the ranks agree over it (or opt out)."""
    import time

    s = cpattn.ZigzagStrategy(world)
    ext = [9, 5, 3] if rank == 0 else [5, 9, 3]  # same T, a different batch on rank 0
    t0 = time.monotonic()
    try:
        if case == "static":
            planner = cpattn.StaticPlanner(s, max_tokens=64, max_seqs=4, max_kv_tokens=128, device="cpu")
            planner.plan(ext, rank=rank)
        elif case == "opt_out":
            m = s.build_metadata(ext, rank=rank, agree=False)
            assert m.group is None
        elif case == "agreed":
            m = s.build_metadata([5, 9, 3], rank=rank)
            assert m.group is dist.group.WORLD  # the plan remembers the group it was agreed on
        else:
            s.build_metadata(ext, rank=rank)
        outcome = None
    except Exception as exc:  # noqa: BLE001
        outcome = (type(exc).__name__, str(exc))
    return outcome, time.monotonic() - t0


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", ["build", "static", "opt_out", "agreed"])
def test_group_none_agrees_over_the_default_group(world, case):
    results = run_distributed(_worker_default_group, world, case, timeout=120, pg_timeout=60)
    for rank, (outcome, seconds) in enumerate(results):
        assert seconds < 10, (rank, seconds)
        if case in ("opt_out", "agreed"):
            assert outcome is None, (rank, outcome)
        else:
            assert outcome is not None, f"rank {rank} accepted a plan the others disagree with"
            assert outcome[0] == "PlanDisagreement" and "extend_lens / prefix_lens differ" in outcome[1], outcome
    assert len({r[0] for r in results}) == 1


def _worker_planner_fault(rank: int, world: int, exc_name: str, use_group: bool):
    """One rank's planner fails with a non-ValueError (allocator, bug, ...): every rank raises fast."""
    import time

    s = cpattn.InterleaveStrategy(world)
    if rank == world - 1:
        def broken(*args, **kwargs):
            raise {"RuntimeError": RuntimeError, "MemoryError": MemoryError,
                   "KeyError": KeyError}[exc_name]("injected planner fault")

        s.plan_host = broken
    t0 = time.monotonic()
    try:
        s.build_metadata([7, 4], [3, 0], rank=rank, group=dist.group.WORLD if use_group else None)
        outcome = None
    except Exception as exc:  # noqa: BLE001
        outcome = (type(exc).__name__, str(exc))
    return outcome, time.monotonic() - t0


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("exc_name, use_group", [("RuntimeError", True), ("MemoryError", False), ("KeyError", True)])
def test_any_planner_failure_reaches_every_rank(world, exc_name, use_group):
    results = run_distributed(_worker_planner_fault, world, exc_name, use_group, timeout=120, pg_timeout=60)
    for rank, (outcome, seconds) in enumerate(results):
        assert outcome is not None, f"rank {rank} returned a plan"
        assert seconds < 10, (rank, seconds)  # not the process group's timeout
        if rank == world - 1:
            assert outcome[0] == exc_name and "injected planner fault" in outcome[1]  # its own error
        else:
            assert outcome[0] == "PlanDisagreement", outcome
            assert f"group rank(s) [{world - 1}] could not build a plan" in outcome[1]


def _worker_group_size(rank: int, world: int):
    """A plan for cp_size world + 1 on a world-rank group: ValueError naming group and both sizes."""
    s = cpattn.ZigzagStrategy(world + 1)
    out = []
    for kwargs in ({"group": dist.group.WORLD}, {}):
        try:
            s.build_metadata([8, 3], rank=rank, **kwargs)
            out.append(None)
        except Exception as exc:  # noqa: BLE001
            out.append((type(exc).__name__, str(exc)))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_plan_for_another_group_size_is_rejected_locally(world):
    for outcomes in run_distributed(_worker_group_size, world, timeout=120, pg_timeout=60):
        for outcome in outcomes:
            assert outcome is not None and outcome[0] == "ValueError", outcome
            assert "group" in outcome[1] and f"{world} ranks" in outcome[1] and f"cp_size={world + 1}" in outcome[1]


def _shard_merge_plan(rank: int, world: int, dv: int):
    """A decode step over a sharded cache (agreed over the default group), a "shard_merge" plan
    of head dim ``dv`` for V (packed caches) and its inputs: (plan, q, k, v, caches)."""
    s = cpattn.get_strategy("replicated", world)
    meta = s.build_metadata([1, 2], [4, 3], rank=rank, kv=cpattn.KVSharding(world))
    spec = cpattn.AttentionSpec(num_q_heads=6, num_kv_heads=2, head_dim=8, head_dim_v=dv, dtype=torch.float32)
    plan = cpattn.plan_attention(meta, spec, backend="torch")
    g = torch.Generator().manual_seed(1)
    n, rows = meta.num_physical_tokens, meta.num_local_kv_tokens
    q, k, v = torch.randn(n, 6, 8, generator=g), torch.randn(n, 2, 8, generator=g), torch.randn(n, 2, dv, generator=g)
    return plan, q, k, v, (torch.randn(rows, 2, 8, generator=g), torch.randn(rows, 2, dv, generator=g))


def _worker_merge_shapes(rank: int, world: int):
    """merge_partials with partials of different shapes on different ranks: a ValueError on every
    rank (not a gloo abort), without a plan on every call; a plan checks once per header."""
    out = {}
    dv = 8 if rank == 0 else 16
    o, l = torch.randn(3, 4, dv), torch.randn(3, 4)
    for scatter in (False, True):
        try:
            cpattn.merge_partials(o, l, None, scatter_heads=scatter and world == 2)
            out[f"dv/{scatter}"] = None
        except ValueError as exc:
            out[f"dv/{scatter}"] = str(exc)
    try:
        cpattn.merge_partials(o[:, :, :8].to(torch.float16 if rank == 0 else torch.bfloat16), l, None)
        out["dtype"] = None
    except ValueError as exc:
        out["dtype"] = str(exc)
    # "shard_merge" plans whose specs differ in Dv on one rank: plan.run raises on every rank
    plan, q, k, v, cache = _shard_merge_plan(rank, world, 8 if rank == world - 1 else 16)
    try:
        plan.run(q, k, v, cache)
        out["plan/dv"] = None
    except ValueError as exc:
        out["plan/dv"] = str(exc)
    out["plan/agreed_after_error"] = sorted(plan.agreed_partials)
    # the same plans: collectives per merge (direct calls keep no state; a plan checks once)
    plan, q, k, v, cache = _shard_merge_plan(rank, world, 8)
    meta = plan.meta
    o, l = plan.attend(q, *cache)
    counts = {}
    for name, call in (("direct", lambda: cpattn.merge_partials(o, l, None, meta=meta)),
                       ("direct/agree=False", lambda: cpattn.merge_partials(o, l, None, meta=meta, agree=False)),
                       ("plan.merge", lambda: plan.merge(o, l)),
                       ("plan.run", lambda: plan.run(q, k, v, cache)),
                       ("plan.merge/scatter", lambda: plan.merge(o, l, scatter_heads=True)),
                       ("plan.run/agree=False", lambda: plan.run(q, k, v, cache, agree=False))):
        counts[name] = []
        for _ in range(3):
            with CountCollectives() as counter:
                merged = call()
            counts[name].append(len(counter.calls))
        out[f"finite/{name}"] = bool(torch.isfinite(merged).all())
    out["counts"] = counts
    out["agreed"] = sorted(plan.agreed_partials)
    try:
        plan.run(q, k, v, cache, agree=1)
        out["agree=1"] = None
    except TypeError as exc:
        out["agree=1"] = str(exc)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_merge_partials_with_different_shapes_raises_on_every_rank(world):
    results = run_distributed(_worker_merge_shapes, world, timeout=120, pg_timeout=60)
    n = results[0]["agreed"][0][0]
    for rank, res in enumerate(results):
        for key in ("dv/False", "dv/True", "dtype", "plan/dv"):
            assert res[key] is not None and "merge_partials: the ranks passed different partials" in res[key], (
                rank, key, res[key])
        assert "Dv" in res["dv/False"] and "dtype" in res["dtype"]
        assert f"rank {world - 1}: out_part [N={n}, Hq=6, Dv=8]" in res["plan/dv"], res["plan/dv"]
        assert "rank 0: out_part [N=" in res["plan/dv"] and "Dv=16]" in res["plan/dv"], res["plan/dv"]
        assert res["plan/agreed_after_error"] == [], res  # a failed check is not remembered
        # all-gathers per call: without a plan every call checks (header + data); a plan checks a
        # header once, then ONE collective (scatter_heads: an all-to-all, not counted here)
        assert res["counts"] == {"direct": [2, 2, 2], "direct/agree=False": [1, 1, 1], "plan.merge": [2, 1, 1],
                                 "plan.run": [1, 1, 1], "plan.merge/scatter": [1, 0, 0],
                                 "plan.run/agree=False": [1, 1, 1]}, res["counts"]
        assert res["agreed"] == [(n, 6, 8, 3, 0), (n, 6, 8, 3, 1)], res["agreed"]  # float32: dtype code 3
        assert all(res[f"finite/{k}"] for k in res["counts"])
        assert "agree must be a bool" in res["agree=1"], res["agree=1"]
    for key in ("dv/False", "plan/dv"):
        assert len({r[key] for r in results}) == 1  # the same message on every rank
