"""Real collectives: 2, 3 and 4 gloo processes (spawned). Many checks per spawn to keep CI fast."""

from __future__ import annotations

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
        s = cpattn.ZigzagStrategy(cp_size)
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
