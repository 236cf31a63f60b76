"""KVSharding (placement rule), decode plans (the "replicated" strategy over a sharded ``kv``),
CP plans with ``kv=``, sharded cache writes and the pass-KV / pass-Q cost model: CPU only, explicit
loops as the reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpattn
from cpattn.kv_sharding import KVSharding

NAMES = ["zigzag", "interleave", "contiguous"]


def _owned(length: int, c: int, i: int, r: int) -> list[int]:
    """Positions < length that rank r holds, in increasing order (the rule written out)."""
    return [p for p in range(length) if (p // i) % c == r]


def _decode(sh: KVSharding, seq_lens, q_lens=None, *, rank: int):
    """A decode step's plan: the "replicated" strategy over the last q_len (default 1) positions
    of sequences of ``seq_lens`` keys (new tokens included), keys sharded by ``sh``."""
    ql = [1] * len(seq_lens) if q_lens is None else list(q_lens)
    pre = [n - q for n, q in zip(seq_lens, ql)]
    return cpattn.get_strategy("replicated", sh.cp_size).build_metadata(ql, pre, rank=rank, kv=sh)


# ----------------------------------------------------------------------------- the rule
@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.sampled_from([1, 2, 4, 16]), st.integers(0, 300))
def test_every_position_owned_once_and_local_indices_dense(c, i, length):
    sh = KVSharding(c, interleave=i)
    pos = torch.arange(length)
    owner = sh.owner(pos)
    local = sh.local_index(pos)
    seen = torch.zeros(length, dtype=torch.int64)
    for r in range(c):
        mine = _owned(length, c, i, r)
        assert torch.equal(torch.nonzero(owner == r).flatten(), torch.tensor(mine, dtype=torch.int64))
        # local indices of a rank's positions are 0, 1, 2, ... in position order
        assert local[mine].tolist() == list(range(len(mine)))
        assert sh.global_position(torch.arange(len(mine)), r).tolist() == mine
        assert sh.local_lengths([length, 0, length // 2], r).tolist() == [
            len(mine), 0, len(_owned(length // 2, c, i, r))]
        seen[mine] += 1
    assert bool((seen == 1).all())
    # ints and tensors agree
    if length:
        p = length - 1
        assert sh.owner(p) == int(owner[p]) and sh.local_index(p) == int(local[p])


def test_unsharded_cache_is_identity():
    sh = KVSharding(1, interleave=3)
    p = torch.arange(50)
    assert torch.equal(sh.owner(p), torch.zeros(50, dtype=torch.int64))
    assert torch.equal(sh.local_index(p), p) and torch.equal(sh.global_position(p, 0), p)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(cp_size=0), ValueError, "cp_size"),
    (dict(cp_size=2, interleave=0), ValueError, "interleave"),
    (dict(cp_size=2.0), TypeError, "cp_size"),
    (dict(cp_size=2, interleave=True), TypeError, "interleave"),
])
def test_bad_sharding(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        KVSharding(**kwargs)


def test_bad_positions_and_page_size():
    sh = KVSharding(2, interleave=4)
    with pytest.raises(ValueError, match="positions must be >= 0"):
        sh.owner(torch.tensor([3, -1]))
    with pytest.raises(TypeError, match="positions must hold integers"):
        sh.local_index(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="rank must be in"):
        sh.global_position(0, 2)
    with pytest.raises(ValueError, match="page_size=6 must be a multiple of the KV sharding's interleave=4"):
        sh.check_page_size(6)
    assert sh.check_page_size(8) == 8


# ----------------------------------------------------------------------------- decode plans
def test_decode_metadata_fields():
    sh = KVSharding(3, interleave=2)
    seq, ql = [10, 3, 1, 0], [2, 1, 1, 0]
    for r in range(3):
        d = _decode(sh, seq, ql, rank=r)
        assert d.replicated and d.kv is sh
        assert d.num_local_tokens == 4 and d.cu_extend_lens.tolist() == [0, 2, 3, 4, 4]
        assert d.kv_lens.tolist() == seq and d.extend_lens.tolist() == ql
        assert d.local_kv_lens.tolist() == [len(_owned(n, 3, 2, r)) for n in seq]
        assert d.row_seq.tolist() == [0, 0, 1, 2] and d.row_seq.dtype == torch.int32
        positions = [8, 9, 2, 0]
        mine = [t for t, p in enumerate(positions) if (p // 2) % 3 == r]
        assert d.store_rows.tolist() == mine
        assert d.store_index.tolist() == [_owned(positions[t] + 1, 3, 2, r).index(positions[t]) for t in mine]
        # T, n, num_kv_tokens, S (three segments: one per sequence with query rows)
        assert d.counts.tolist() == [4, 4, 14, 3] and d.num_stored_tokens == len(mine)
    fps = [_decode(sh, seq, ql, rank=r).fingerprint for r in range(3)]
    assert fps[0][:-1] == fps[1][:-1] == fps[2][:-1] and [f[-1] for f in fps] == [0, 1, 2]
    other = _decode(KVSharding(3, interleave=1), seq, ql, rank=0).fingerprint
    assert other[:-1] != fps[0][:-1]


@pytest.mark.parametrize("ext, pre, match", [
    ([1], [3, 1], "same size"),
    ([1, 3], [3, -1], "prefix_lens must be >= 0"),  # a q_len past the sequence's keys
    ([1], [-1], "prefix_lens must be >= 0"),
    ([1, 1], [3, -2], "prefix_lens must be >= 0"),
    ([-1], [5], "extend_lens must be >= 0"),
])
def test_decode_metadata_bad_lengths(ext, pre, match):
    with pytest.raises(ValueError, match=match):
        cpattn.get_strategy("replicated", 2).build_metadata(ext, pre, rank=0, kv=KVSharding(2))


def test_static_decode_planner_fixed_addresses():
    sh = KVSharding(2)
    s = cpattn.get_strategy("replicated", 2)
    planner = cpattn.StaticPlanner(s, max_tokens=8, max_seqs=4, max_kv_tokens=16, max_q_len=2, kv=sh, device="cpu")
    ptrs = None
    for seq, ql in (([5, 9], [1, 2]), ([1, 2, 3, 4], [1, 1, 1, 1]), ([7], [2])):
        d = planner.plan(ql, [n - q for n, q in zip(seq, ql)], rank=1)
        assert d.is_static and d.num_physical_tokens == 8 and d.num_seq_rows == 4
        assert d.capacity.max_local_tokens == 8 and d.capacity.max_q_len == 2 and d.tile_q_len == 2
        fresh = _decode(sh, seq, ql, rank=1)
        n_store = fresh.num_stored_tokens
        assert torch.equal(d.kv_lens, fresh.kv_lens) and d.num_stored_tokens == n_store
        assert torch.equal(d.store_rows[:n_store], fresh.store_rows)
        now = {n: getattr(d, n).data_ptr() for n in ("kv_lens", "extend_lens", "cu_extend_lens", "shard_index",
                                                      "row_valid", "store_rows", "counts")}
        ptrs = ptrs or now
        assert now == ptrs
        n = fresh.num_local_tokens
        assert d.row_valid.tolist() == [True] * n + [False] * (8 - n)  # rows past the step's are pad rows
    with pytest.raises(ValueError, match="sequences 5 > 4"):
        planner.plan([1] * 5, [0] * 5, rank=0)
    with pytest.raises(ValueError, match=r"max_q_len\) 3 > 2"):
        planner.plan([3], [1], rank=0)


# ----------------------------------------------------------------------------- CP plans
@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.sampled_from([1, 2, 4]), st.sampled_from(NAMES),
       st.lists(st.tuples(st.integers(0, 40), st.integers(0, 30)), min_size=0, max_size=4))
def test_cp_plan_stores_each_extend_token_once(c, i, name, seqs):
    sh = KVSharding(c, interleave=i)
    ext, pre = [e for e, _ in seqs], [p for _, p in seqs]
    s = cpattn.get_strategy(name, c)
    positions = [p + j for e, p in seqs for j in range(e)]
    stored = torch.zeros(len(positions), dtype=torch.int64)
    for r in range(c):
        m = s.build_metadata(ext, pre, rank=r, kv=sh)
        mine = [t for t, p in enumerate(positions) if (p // i) % c == r]
        assert m.store_rows.tolist() == mine and m.num_stored_tokens == len(mine)
        assert m.store_index.tolist() == [_owned(positions[t] + 1, c, i, r).index(positions[t]) for t in mine]
        assert m.local_prefix_lens.tolist() == [len(_owned(p, c, i, r)) for p in pre]
        assert m.local_kv_lens.tolist() == [len(_owned(e + p, c, i, r)) for e, p in seqs]
        assert m.num_local_prefix_tokens_per_rank == tuple(sum(len(_owned(p, c, i, q)) for p in pre) for q in range(c))
        stored[mine] += 1
    assert bool((stored == 1).all())
    plain = s.build_metadata(ext, pre, rank=0)
    assert plain.store_rows.numel() == 0 and plain.kv is None
    assert plain.fingerprint[1:] == s.build_metadata(ext, pre, rank=0, kv=sh).fingerprint[1:]
    assert plain.fingerprint[0] != s.build_metadata(ext, pre, rank=0, kv=sh).fingerprint[0]


def test_cp_plan_with_sharding_moves_in_one_copy_and_is_prefix_independent():
    sh = KVSharding(4)
    s = cpattn.ZigzagStrategy(4)
    a = s.build_metadata([1000, 24], [0, 0], rank=1, kv=sh)
    b = s.build_metadata([1000, 24], [1 << 20, 3 << 20], rank=1, kv=sh)
    for name in ("store_rows", "store_index", "local_prefix_lens", "local_kv_lens"):
        assert abs(getattr(a, name).numel() - getattr(b, name).numel()) <= 4, name
    with pytest.raises(ValueError, match="kv has cp_size=2"):
        s.build_metadata([5], rank=0, kv=KVSharding(2))
    with pytest.raises(TypeError, match="kv must be None or a cpattn.KVSharding"):
        s.build_metadata([5], rank=0, kv=4)


# ----------------------------------------------------------------------------- writes
def _table(lens, ps, extra_pages=1, seed=0):
    pages = [-(-n // ps) for n in lens]
    total = sum(pages) + extra_pages
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    table = torch.full((len(lens), max(pages + [1])), -1, dtype=torch.int32)
    off = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[off : off + n].int()
        off += n
    return table, total


def test_shard_writes_put_each_owned_row_at_its_local_slot():
    sh = KVSharding(3, interleave=2)
    s = cpattn.ZigzagStrategy(3, pad_multiple=4)
    ext, pre = [11, 4, 0, 7], [3, 0, 5, 12]
    positions = [p + j for e, p in zip(ext, pre) for j in range(e)]
    seq_of = [b for b, e in enumerate(ext) for _ in range(e)]
    t = len(positions)
    k = torch.randn(t, 2, 4)
    v = torch.randn(t, 2, 6)
    ps = 4
    for r in range(3):
        m = s.build_metadata(ext, pre, rank=r, kv=sh)
        table, pages = _table(m.local_kv_lens.tolist(), ps, seed=r)
        plan = cpattn.plan_cache_writes(m, table, page_size=ps, num_pages=pages)
        kc = torch.full((pages, ps, 2, 4), float("nan"))
        vc = torch.full((pages, ps, 2, 6), float("nan"))
        cpattn.write_kv_cache(k, v, kc, vc, plan)
        written = torch.zeros(pages * ps, dtype=torch.bool)
        for t_, (p, b) in enumerate(zip(positions, seq_of)):
            if (p // 2) % 3 != r:
                continue
            j = _owned(p + 1, 3, 2, r).index(p)
            slot = int(table[b, j // ps]) * ps + j % ps
            assert torch.equal(kc.view(-1, 2, 4)[slot], k[t_]) and torch.equal(vc.view(-1, 2, 6)[slot], v[t_])
            written[slot] = True
        assert kc.view(-1, 8)[~written].isnan().all() and plan.num_writes == int(written.sum())


def test_shard_writes_validate_before_writing():
    sh = KVSharding(2)
    d = _decode(sh, [9, 4], rank=0)  # rank 0 holds 5 and 2 keys; new rows at 8 (mine), 3
    ps = 2
    good = torch.tensor([[0, 1, 2], [3, 4, 0]], dtype=torch.int32)
    cases = [
        (torch.tensor([[0, 1], [3, 4]], dtype=torch.int32), "page_table does not cover sequence 0"),
        (torch.tensor([[0, 1, 9], [3, 4, 0]], dtype=torch.int32), r"page_table\[0, 2\] = 9 is outside"),
        (torch.tensor([[0, 1, 2], [3, 4, 0]], dtype=torch.float32), "page_table must be int32 or int64"),
        (torch.tensor([[0, 1, 2]], dtype=torch.int32), r"page_table must be \[B=2"),
    ]
    for table, match in cases:
        with pytest.raises((ValueError, TypeError), match=match):
            cpattn.plan_cache_writes(d, table, page_size=ps, num_pages=6)
    with pytest.raises(ValueError, match="page_size=3 must be a multiple"):
        cpattn.plan_cache_writes(_decode(KVSharding(2, 2), [9], rank=0), good[:1], page_size=3, num_pages=6)
    d2 = _decode(sh, [9, 9], [2, 2], rank=0)  # both sequences store rows into page 0 of the table
    with pytest.raises(ValueError, match="same cache slot"):
        cpattn.plan_cache_writes(d2, torch.tensor([[0, 1, 2], [0, 1, 2]]), page_size=ps, num_pages=6)
    plan = cpattn.plan_cache_writes(d, good, page_size=ps, num_pages=6)
    assert isinstance(plan, cpattn.CacheWritePlan) and plan.num_source_rows == 2 and plan.num_writes == 1
    k = torch.randn(2, 1, 4)
    kc = torch.zeros(6, ps, 1, 4)
    bad_v = torch.zeros(6, ps, 1, 3)
    with pytest.raises(ValueError, match="v_cache rows"):
        cpattn.write_kv_cache(k, k, kc, bad_v, plan)
    assert not kc.any()  # nothing written when the second cache is wrong
    with pytest.raises(ValueError, match="slots plans 2 source rows but k has 1 rows"):
        cpattn.write_kv_cache(k[:1], k[:1], kc, kc.clone(), plan)
    with pytest.raises(ValueError, match="slots was planned for num_slots=12 but k_cache has 14 slots"):
        cpattn.write_kv_cache(k, k, torch.zeros(7, ps, 1, 4), torch.zeros(7, ps, 1, 4), plan)
    assert not kc.any()
    # a replicated cache (no kv) through a page table: every extend token, at its position's slot
    rep = cpattn.plan_cache_writes(cpattn.ZigzagStrategy(2).build_metadata([3], rank=0), good[:1], page_size=ps,
                                   num_pages=6)
    assert rep.num_source_rows == 3 and rep.slots.tolist() == [0, 1, 2]


def test_static_shard_writes_need_pad_slot_and_keep_addresses():
    sh = KVSharding(2)
    planner = cpattn.StaticPlanner(cpattn.get_strategy("replicated", 2), max_tokens=3, max_seqs=3, max_kv_tokens=16,
                                   max_q_len=1, kv=sh, device="cpu")
    table = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=torch.int32)
    d = planner.plan([1, 1], [4, 1], rank=0)
    with pytest.raises(ValueError, match="pass pad_slot"):
        cpattn.plan_cache_writes(d, table, page_size=2, num_pages=10)
    ptrs = None
    kc = torch.zeros(10, 2, 1, 2)
    for seq in ([5, 2], [6, 3, 1], [1]):
        d = planner.plan([1] * len(seq), [n - 1 for n in seq], rank=0)
        plan = cpattn.plan_cache_writes(d, table, page_size=2, num_pages=10, pad_slot=0)
        assert plan.rows.numel() == 3 and (plan.rows.data_ptr(), plan.slots.data_ptr()) == (ptrs or (
            plan.rows.data_ptr(), plan.slots.data_ptr()))
        ptrs = (plan.rows.data_ptr(), plan.slots.data_ptr())
        k = torch.arange(3 * 2, dtype=torch.float32).view(3, 1, 2) + 10 * len(seq)
        cpattn.write_kv_cache(k, k, kc, kc.clone(), plan)
        assert plan.num_writes == d.num_stored_tokens
        for row in d.host.store_rows.tolist():
            b = int(d.host.row_seq[row])
            j = int(d.host.store_index[d.host.store_rows.tolist().index(row)])
            assert torch.equal(kc.view(-1, 1, 2)[int(table[b, j // 2]) * 2 + j % 2], k[row])


# ----------------------------------------------------------------------------- cost model
def test_cost_model_prefers_pass_q_for_few_new_tokens_over_long_prefixes():
    """pass-KV moves the prefix, pass-Q the new tokens: a short chunk over a 256k prefix goes
    pass-Q, a long chunk over a short prefix pass-KV; every rank decides the same."""
    sh = KVSharding(4)
    s = cpattn.ZigzagStrategy(4)
    kw = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    short = [s.build_metadata([4096], [512], rank=r, kv=sh) for r in range(4)]
    long = [s.build_metadata([256], [262144], rank=r, kv=sh) for r in range(4)]
    assert {cpattn.choose_extend_algorithm(m, **kw) for m in short} == {"pass_kv"}
    assert {cpattn.choose_extend_algorithm(m, **kw) for m in long} == {"pass_q"}
    est = cpattn.CostModel().estimate(long[0], **kw)
    assert est["bytes_pass_kv"] > 10 * est["bytes_pass_q"]
    none = s.build_metadata([4096], rank=0, kv=sh)
    assert cpattn.choose_extend_algorithm(none, **kw) == "pass_kv"
    with pytest.raises(ValueError, match="link_bytes_per_s"):
        cpattn.CostModel(link_bytes_per_s=0)
    with pytest.raises(ValueError, match="no sharded KV cache"):
        cpattn.choose_extend_algorithm(s.build_metadata([5], rank=0), **kw)
