"""Real collectives: 2, 3 and 4 gloo processes (spawned). Many checks per spawn to keep CI fast."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import cpattn
from cpattn.layers import AttentionStack
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
            m = s.build_metadata(EXTEND, PREFIX, rank=cp_rank)
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
        m = s.build_metadata([1, 0, 1], rank=cp_rank)
        xs = torch.randn(2, 4, generator=g)
        results["empty_rank_rows"] = m.num_local_tokens
        results["empty_rank_gather"] = torch.equal(s.gather(s.shard(xs, m), m, group), xs)
        q_local = s.shard(torch.randn(2, 2, 8, generator=g), m)
        out = s.attention(q_local, torch.randn(2, 2, 8, generator=g), torch.randn(2, 2, 8, generator=g), m)
        results["empty_rank_attention_finite"] = bool(torch.isfinite(out).all())
        m0 = s.build_metadata([], rank=cp_rank)
        results["empty_batch_gather"] = tuple(s.gather(s.shard(torch.zeros(0, 3), m0), m0, group).shape)

    # Misconfigurations raise before any collective (all ranks raise the same way: no hang).
    wrong_size = cpattn.ZigzagStrategy(cp_size + 1)
    m_bad = wrong_size.build_metadata([8], rank=0)
    try:
        wrong_size.gather(torch.zeros(m_bad.num_physical_tokens, 2), m_bad, group)
        results["group_size_error"] = None
    except ValueError as exc:
        results["group_size_error"] = str(exc)
    s = cpattn.ZigzagStrategy(cp_size)
    m_other = s.build_metadata([8], rank=(cp_rank + 1) % cp_size)
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
        else:
            assert name == "PlanDisagreement" and "CP plan" in message, outcome
    messages = {r[0][1] for rank, r in enumerate(results) if not (case == "fail" and rank == world - 1)}
    assert len(messages) == 1  # every rank raises the same error
    expected = {"lengths": "extend_lens / prefix_lens differ", "swapped": "two processes claim one rank",
                "fail": "could not build a plan", "cp_size": "cp_size", "static": "capacity differ"}[case]
    assert expected in messages.pop()


def _worker_agree(rank: int, world: int):
    s = cpattn.InterleaveStrategy(world)
    m = s.build_metadata([7, 4], [3, 0], rank=rank, group=dist.group.WORLD)
    x = torch.arange(11.0).view(11, 1)
    full = s.gather(s.shard(x, m), m)  # the plan remembers the group it was checked on
    q = torch.zeros(m.num_physical_tokens, 2, 4)
    errors = []
    other = s.build_metadata([7, 4], [3, 0], rank=(rank + 1) % world)  # another rank's plan...
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
