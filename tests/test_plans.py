"""Attention plans (plan once, run per layer) and static plans, on CPU: the torch backend and the
real Triton kernel under the interpreter. GPU graph capture / replay tests are marked ``gpu``."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpattn
from cpattn.kernels import AttentionSpec
from oracle import TOLERANCE, attention_oracle

NAMES = ["zigzag", "interleave", "contiguous"]


@st.composite
def batches(draw, max_seqs: int = 4, max_len: int = 70):
    cp_size = draw(st.integers(1, 8))
    n = draw(st.integers(0, max_seqs))
    small = st.integers(0, 2 * cp_size)
    extend = draw(st.lists(st.one_of(small, st.integers(0, max_len)), min_size=n, max_size=n))
    prefix = draw(st.lists(st.integers(0, 30), min_size=n, max_size=n))
    return cp_size, extend, prefix, draw(st.sampled_from([1, 4, 16]))


def _inputs(extend, prefix, hq, hkv, d, dv, dtype, seed=0, sinks=False):
    g = torch.Generator().manual_seed(seed)
    t, n_kv = sum(extend), sum(e + p for e, p in zip(extend, prefix))
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = torch.randn(n_kv, hkv, d, generator=g).to(dtype)
    v = torch.randn(n_kv, hkv, dv, generator=g).to(dtype)
    sk = torch.randn(hq, generator=g) if sinks else None
    return q, k, v, sk


def _plan(s, meta, q, k, v, *, window=-1, sinks=False, backend="torch", page_size=None):
    return s.plan_attention(meta, num_q_heads=q.shape[1], num_kv_heads=k.shape[-2], head_dim=q.shape[-1],
                            head_dim_v=v.shape[-1], dtype=q.dtype, window_size=(window, 0), page_size=page_size,
                            has_sinks=sinks, backend=backend)


def _check_plan_equals_attention_and_oracle(batch, name, backend, dtype, window, sinks, seed):
    cp_size, extend, prefix, pad = batch
    s = cpattn.get_strategy(name, cp_size, pad_multiple=pad)
    q, k, v, sk = _inputs(extend, prefix, 4, 2, 16, 16, dtype, seed, sinks)
    ref, ref_lse = attention_oracle(q, k, v, extend, prefix, window_left=window, sinks=sk)
    tol = TOLERANCE[dtype]
    for rank in range(cp_size):
        meta = s.build_metadata(extend, prefix, rank=rank)
        ql = s.shard(q, meta)
        plan = _plan(s, meta, ql, k, v, window=window, sinks=sinks, backend=backend)
        assert plan.backend == backend
        out, lse = plan.run(ql, k, v, sinks=sk, return_lse=True)
        out2, lse2 = s.attention(ql, k, v, meta, window_size=(window, 0), sinks=sk, backend=backend, return_lse=True)
        assert torch.equal(out, out2) and torch.equal(lse, lse2)
        n = meta.num_local_tokens
        idx = meta.local_token_indices
        if n:
            assert (out[:n].double() - ref[idx]).abs().max() <= tol
            assert (lse[:n].double() - ref_lse[idx]).abs().max() <= tol
        assert (out[n:] == 0).all() and torch.isneginf(lse[n:]).all()


@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from(NAMES), st.sampled_from([-1, 5]), st.booleans(), st.integers(0, 99))
def test_plan_run_equals_attention_torch(batch, name, window, sinks, seed):
    _check_plan_equals_attention_and_oracle(batch, name, "torch", torch.float32, window, sinks, seed)


@settings(max_examples=12, deadline=None)
@given(batches(max_seqs=3, max_len=40), st.sampled_from(NAMES), st.sampled_from([-1, 5]), st.booleans(),
       st.integers(0, 99))
def test_plan_run_equals_attention_triton(interp, batch, name, window, sinks, seed):
    _check_plan_equals_attention_and_oracle(batch, name, "triton", torch.float32, window, sinks, seed)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_out_and_lse_written_in_place(request, backend):
    if backend == "triton":
        request.getfixturevalue("interp")
    s = cpattn.ZigzagStrategy(2, pad_multiple=8)
    ext, pre = [20, 3], [5, 0]
    q, k, v, _ = _inputs(ext, pre, 4, 2, 16, 16, torch.float32)
    meta = s.build_metadata(ext, pre, rank=1)
    ql = s.shard(q, meta)
    plan = _plan(s, meta, ql, k, v, backend=backend)
    out = torch.full((meta.num_physical_tokens, 4, 16), float("nan"))
    lse_buf = torch.full((4, meta.num_physical_tokens), float("nan"))
    lse = lse_buf.t()  # a strided [P, Hq] view, as engines lay it out
    got = plan.run(ql, k, v, out=out, lse=lse)
    assert got is out and not out.isnan().any() and not lse.isnan().any()
    ref, ref_lse = plan.run(ql, k, v, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    n = meta.num_local_tokens
    assert (out[n:] == 0).all() and torch.isneginf(lse[n:]).all()


def test_run_rejects_wrong_inputs():
    s = cpattn.ZigzagStrategy(2)
    meta = s.build_metadata([6, 4], [2, 0], rank=0)
    q, k, v, sk = _inputs([6, 4], [2, 0], 4, 2, 8, 8, torch.float32, sinks=True)
    ql = s.shard(q, meta)
    plan = _plan(s, meta, ql, k, v, sinks=True)
    cases = [
        (dict(q_local=ql[:-1]), ValueError, r"q_local must be \[P, Hq, D\]"),
        (dict(k=k[:-1], v=v[:-1]), ValueError, "packed k/v must be"),
        (dict(q_local=ql.half()), TypeError, "q_local dtype"),
        (dict(sinks=None), ValueError, "has_sinks=True"),
        (dict(sinks=sk[:3]), ValueError, "sinks must be a float"),
        (dict(sinks=sk.long()), ValueError, "sinks must be a float"),
        (dict(out=torch.zeros(meta.num_physical_tokens, 4, 8).double()), ValueError, "out must be"),
        (dict(lse=torch.zeros(meta.num_physical_tokens, 3)), ValueError, "lse must be"),
        (dict(page_table=torch.zeros(2, 4, dtype=torch.int32)), ValueError, "packed K/V"),
    ]
    for change, exc, match in cases:
        args = dict(q_local=ql, k=k, v=v, sinks=sk)
        args.update(change)
        with pytest.raises(exc, match=match):
            plan.run(args.pop("q_local"), args.pop("k"), args.pop("v"), **args)
    paged = s.plan_attention(meta, num_q_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, page_size=4)
    with pytest.raises(ValueError, match="pass page_table"):
        paged.run(ql, torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8))
    for kwargs, exc, match in [
        (dict(num_q_heads=4, num_kv_heads=3), ValueError, "multiple of num_kv_heads"),
        (dict(num_q_heads=4.0, num_kv_heads=2), TypeError, "num_q_heads"),
        (dict(num_q_heads=4, num_kv_heads=2, window_size=3), TypeError, "window_size"),
        (dict(num_q_heads=4, num_kv_heads=2, page_size=512), ValueError, "page_size"),
        (dict(num_q_heads=4, num_kv_heads=2, backend="cudnn"), ValueError, "backend must be one of"),
        (dict(num_q_heads=4, num_kv_heads=2, backend="torch", backend_options={"x": 1}), ValueError, "backend_options"),
    ]:
        with pytest.raises(exc, match=match):
            s.plan_attention(meta, head_dim=8, dtype=torch.float32, **kwargs)


def test_plan_is_cached_per_meta_and_layer_kind():
    s = cpattn.InterleaveStrategy(2)
    meta = s.build_metadata([9], rank=1)
    q, k, v, _ = _inputs([9], [0], 2, 1, 8, 8, torch.float32)
    ql = s.shard(q, meta)
    s.attention(ql, k, v, meta, backend="torch")
    s.attention(ql, k, v, meta, backend="torch")
    s.attention(ql, k, v, meta, backend="torch", window_size=(3, 0))
    assert len(meta.plan_cache) == 2


def test_fa4_descriptors_follow_segments():
    """The FA4 plan's varlen arrays (cu_seqlens_q over segment rows, cu_seqlens_k at the
    sequence starts, seqused_k = last position + 1)."""
    from cpattn.kernels.fa4 import _FA4Run

    s = cpattn.ZigzagStrategy(2)
    meta = s.build_metadata([10, 7, 0, 3], [4, 0, 2, 1], rank=0)
    run = _FA4Run(None, AttentionSpec(4, 2, 8, 8, torch.bfloat16), meta)
    segs = meta.host_segments
    cu_kv = [0, 14, 21, 23, 27]
    assert run.dev["cu_rows"].tolist() == [r0 for _, r0, *_ in segs] + [meta.num_local_tokens]
    assert run.dev["key_start"].tolist() == [cu_kv[b] for b, *_ in segs] + [cu_kv[-1]]
    assert run.dev["keys_used"].tolist() == [p0 + (n - 1) * st_ + 1 for _, _, n, p0, st_ in segs]


# ----------------------------------------------------------------------------- sinks and NaN
def _sinks_variants(hq: int):
    base = torch.randn(2 * hq, generator=torch.Generator().manual_seed(5))
    return {
        "strided": base[::2],
        "expanded": base[:1].expand(hq),
        "fp32": base[:hq].clone(),
        "bf16": base[:hq].bfloat16(),
        "fp64": base[:hq].double(),
    }


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_strided_and_expanded_sinks(request, backend):
    """Any strided / expanded float [Hq] sinks give the result of its contiguous fp32 copy (the
    Triton kernels once read ``Sinks + head`` and ignored strides: max diff 1.9)."""
    if backend == "triton":
        request.getfixturevalue("interp")
    s = cpattn.ZigzagStrategy(2)
    ext, pre = [30, 9], [4, 0]
    q, k, v, _ = _inputs(ext, pre, 4, 2, 16, 16, torch.float32, seed=3)
    for rank in range(2):
        meta = s.build_metadata(ext, pre, rank=rank)
        ql = s.shard(q, meta)
        plan = _plan(s, meta, ql, k, v, sinks=True, backend=backend)
        for name, sinks in _sinks_variants(4).items():
            out, lse = plan.run(ql, k, v, sinks=sinks, return_lse=True)
            dense = sinks.float().contiguous()
            ref, ref_lse = attention_oracle(q, k, v, ext, pre, sinks=dense)
            n, idx = meta.num_local_tokens, meta.local_token_indices
            assert (out[:n].double() - ref[idx]).abs().max() < 2e-5, name
            assert (lse[:n].double() - ref_lse[idx]).abs().max() < 2e-5, name


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("where", ["q", "k", "v", "sinks"])
def test_nan_reaches_the_rows_that_see_it(request, backend, where):
    """A NaN in q / a key / a value / a sink makes exactly the rows that see it NaN in out and
    lse (not 0, not the pad marker -inf); rows of other sequences stay finite; pad rows 0/-inf."""
    if backend == "triton":
        request.getfixturevalue("interp")
    s = cpattn.ContiguousStrategy(1, pad_multiple=8)
    ext, pre = [40, 12], [0, 3]
    q, k, v, sk = _inputs(ext, pre, 2, 1, 16, 16, torch.float32, seed=7, sinks=True)
    meta = s.build_metadata(ext, pre, rank=0)
    nan_pos = 10  # key / query position 10 of sequence 0 (a key in the interior of later tiles)
    head = 1
    if where == "q":
        q[nan_pos, head, 3] = float("nan")
    elif where == "k":
        k[nan_pos, 0, 5] = float("nan")
    elif where == "v":
        v[nan_pos, 0, 2] = float("nan")
    else:
        sk[head] = float("nan")
    ql = s.shard(q, meta)
    plan = _plan(s, meta, ql, k, v, sinks=True, backend=backend)
    out, lse = plan.run(ql, k, v, sinks=sk, return_lse=True)
    n = meta.num_local_tokens
    seq0 = torch.arange(40)
    if where == "q":
        affected = [(nan_pos, head)]
    elif where == "sinks":
        affected = [(t, head) for t in range(n)]
    else:  # rows of sequence 0 at positions >= nan_pos see it, every head (one KV head)
        affected = [(t, h) for t in seq0[nan_pos:].tolist() for h in range(2)]
    for t, h in affected:
        assert out[t, h].isnan().any(), (t, h)
        assert lse[t, h].isnan() or where == "v", (t, h)
    if where == "v":
        assert torch.isfinite(lse[:n]).all()  # V never enters the lse
    # sequence 1 never sees sequence 0's keys
    if where != "sinks":
        assert torch.isfinite(out[40:n]).all() and torch.isfinite(lse[40:n]).all()
    if backend == "torch" and where in ("k", "v"):  # the reference is exact: earlier rows stay clean
        assert torch.isfinite(out[:nan_pos]).all() and torch.isfinite(lse[:nan_pos]).all()
    assert (out[n:] == 0).all() and torch.isneginf(lse[n:]).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("where", ["k", "v"])
def test_nan_in_a_later_sequence_stays_there(request, backend, where):
    """Packed K/V: a NaN key / value of sequence 1 (its rows follow sequence 0's in the packed
    tensor, inside sequence 0's last key block) never reaches sequence 0's rows, which equal the
    oracle; sequence 1's rows after it are NaN."""
    if backend == "triton":
        request.getfixturevalue("interp")
    s = cpattn.ContiguousStrategy(1, pad_multiple=8)
    ext, pre = [37, 12], [0, 3]
    q, k, v, _ = _inputs(ext, pre, 2, 1, 16, 16, torch.float32, seed=9)
    ref, ref_lse = attention_oracle(q, k, v, ext, pre)
    bad = 37 + 1  # packed row of sequence 1's key at position 1
    (k if where == "k" else v)[bad, 0, 4] = float("nan")
    meta = s.build_metadata(ext, pre, rank=0)
    ql = s.shard(q, meta)
    plan = _plan(s, meta, ql, k, v, backend=backend)
    out, lse = plan.run(ql, k, v, return_lse=True)
    assert torch.isfinite(out[:37]).all() and torch.isfinite(lse[:37]).all()
    assert (out[:37].double() - ref[:37]).abs().max() < 2e-5
    assert (lse[:37].double() - ref_lse[:37]).abs().max() < 2e-5
    # sequence 1: its query rows sit at positions 3..14, all after the NaN key at position 1
    assert out[37:49].isnan().any(-1).all()


# ----------------------------------------------------------------------------- static plans
def _data_ptrs(meta) -> dict:
    from cpattn.metadata import DEVICE_FIELDS

    return {name: getattr(meta, name).data_ptr() for name in DEVICE_FIELDS}


STATIC_BATCHES = [([37, 0, 5, 1], [4, 9, 0, 2]), ([64], [0]), ([3, 17, 2, 9, 11], [1, 0, 6, 0, 2])]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_static_planner_same_addresses_same_results(request, name, backend):
    if backend == "triton":
        request.getfixturevalue("interp")
    cp = 3
    s = cpattn.get_strategy(name, cp, pad_multiple=4)
    planner = cpattn.StaticPlanner(s, max_tokens=96, max_seqs=6, max_kv_tokens=160, device="cpu")
    cap = planner.capacity
    g = torch.Generator().manual_seed(1)
    k_buf = torch.zeros(cap.max_kv_tokens, 2, 16)
    v_buf = torch.zeros(cap.max_kv_tokens, 2, 16)
    ptrs, plan_ptrs = None, None
    for ext, pre in STATIC_BATCHES:
        t, n_kv = sum(ext), sum(e + p for e, p in zip(ext, pre))
        q = torch.randn(t, 4, 16, generator=g)
        k_buf[:n_kv].normal_(generator=g)
        v_buf[:n_kv].normal_(generator=g)
        x = torch.zeros(cap.max_tokens, 4, 16)
        x[:t] = q
        for rank in range(cp):
            meta = planner.plan(ext, pre, rank=rank)
            assert meta.is_static and meta.num_physical_tokens == cap.max_local_tokens
            if ptrs is None:
                ptrs = _data_ptrs(meta)
            assert _data_ptrs(meta) == ptrs  # every tensor at the same address
            fresh = s.build_metadata(ext, pre, rank=rank)
            ql = s.shard(x, meta)
            assert ql.shape[0] == cap.max_local_tokens
            n = fresh.num_local_tokens
            assert torch.equal(ql[:n], s.shard(q, fresh)[:n]) and not ql[n:].any()
            plan = s.plan_attention(meta, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                                    backend=backend)
            if backend == "triton":
                tiles = plan._impl.portable_args["tile_segment"].data_ptr()
                plan_ptrs = plan_ptrs or tiles
                assert tiles == plan_ptrs
            out, lse = plan.run(ql, k_buf, v_buf, return_lse=True)
            ref, ref_lse = s.attention(s.shard(q, fresh), k_buf[:n_kv], v_buf[:n_kv], fresh, backend=backend,
                                       return_lse=True)
            assert torch.allclose(out[:n], ref[:n], atol=1e-6) and torch.allclose(lse[:n], ref_lse[:n], atol=1e-6)
            assert (out[n:] == 0).all() and torch.isneginf(lse[n:]).all()
            # gather back: the first T rows are the logical rows (emulated all-gather)
            if cp == 1:
                continue
    assert planner.arena.num_buffers >= 1


@pytest.mark.parametrize("name", NAMES)
def test_static_planner_with_l2_sequence_groups(interp, monkeypatch, name):
    """A static plan whose batches exceed the L2 budget (forced to 24 keys of one KV head): the tile
    order goes by sequence groups, the tables stay at their addresses, and every rank's output and
    LSE match the fp64 oracle on the same batch."""
    from cpattn.kernels import _tiles

    monkeypatch.setattr(_tiles, "L2_KV_BYTES", 24 * (16 + 16) * 4)
    cp = 2
    s = cpattn.get_strategy(name, cp, pad_multiple=4)
    planner = cpattn.StaticPlanner(s, max_tokens=96, max_seqs=6, max_kv_tokens=160, device="cpu")
    g = torch.Generator().manual_seed(2)
    k_buf = torch.randn(planner.capacity.max_kv_tokens, 2, 16, generator=g)
    v_buf = torch.randn(planner.capacity.max_kv_tokens, 2, 16, generator=g)
    tiles_ptr = None
    for ext, pre in STATIC_BATCHES:
        n_kv = sum(e + p for e, p in zip(ext, pre))
        q = torch.randn(sum(ext), 4, 16, generator=g)
        x = torch.zeros(planner.capacity.max_tokens, 4, 16)
        x[: q.shape[0]] = q
        for rank in range(cp):
            meta = planner.plan(ext, pre, rank=rank)
            plan = s.plan_attention(meta, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                                    backend="triton")
            assert plan._impl.group_keys == 24
            tiles_ptr = tiles_ptr or plan._impl.portable_args["tile_segment"].data_ptr()
            assert plan._impl.portable_args["tile_segment"].data_ptr() == tiles_ptr
            out, lse = plan.run(s.shard(x, meta), k_buf, v_buf, return_lse=True)
            fresh = s.build_metadata(ext, pre, rank=rank)
            ref, ref_lse = attention_oracle(q, k_buf[:n_kv], v_buf[:n_kv], ext, pre)
            ref, ref_lse = s.shard(ref, fresh), s.shard(ref_lse, fresh)
            n, tol = fresh.num_local_tokens, TOLERANCE[torch.float32]
            assert torch.allclose(out[:n].double(), ref[:n], atol=tol)
            assert torch.allclose(lse[:n].double(), ref_lse[:n], atol=tol)
            assert (out[n:] == 0).all() and torch.isneginf(lse[n:]).all()


def test_static_planner_gather_emulated():
    """gather_index of a static plan over [C * P_cap] rows puts logical rows first."""
    s = cpattn.ZigzagStrategy(2)
    # one planner per rank (as one per process): a plan's buffers hold it until the next plan()
    planners = [cpattn.StaticPlanner(s, max_tokens=40, max_seqs=4, max_kv_tokens=60, device="cpu") for _ in range(2)]
    x = torch.arange(40 * 3).view(40, 3)
    for ext, pre in (([7, 13], [2, 0]), ([1, 1, 30], [0, 0, 5])):
        t = sum(ext)
        metas = [planners[r].plan(ext, pre, rank=r) for r in range(2)]
        shards = [s.shard(x, m).clone() for m in metas]
        gathered = torch.cat(shards).index_select(0, metas[0].gather_index)
        assert gathered.shape[0] == 40 and torch.equal(gathered[:t], x[:t])


def test_static_planner_over_capacity_and_bad_args():
    s = cpattn.InterleaveStrategy(2)
    planner = cpattn.StaticPlanner(s, max_tokens=16, max_seqs=2, max_kv_tokens=24, device="cpu")
    with pytest.raises(ValueError, match="tokens .* > 16"):
        planner.plan([10, 7], rank=0)
    with pytest.raises(ValueError, match="sequences 3 > 2"):
        planner.plan([1, 1, 1], rank=0)
    with pytest.raises(ValueError, match="kv tokens .* > 24"):
        planner.plan([4], [30], rank=0)
    with pytest.raises(ValueError, match="max_kv_tokens"):
        cpattn.StaticPlanner(s, max_tokens=16, max_seqs=2, max_kv_tokens=8, device="cpu")
    with pytest.raises(TypeError, match="strategy"):
        cpattn.StaticPlanner("zigzag", max_tokens=16, max_seqs=2, max_kv_tokens=24, device="cpu")
    meta = planner.plan([5, 3], rank=1)
    with pytest.raises(ValueError, match="num_tokens T = 16"):
        s.shard(torch.zeros(8, 4), meta)  # static plans take capacity-sized logical tensors
    with pytest.raises(ValueError, match="static plans"):
        cpattn.pack_kv(torch.zeros(16, 1, 2), torch.zeros(16, 1, 2), meta)


def test_strategy_bounds_hold():
    """max_local_tokens / max_segments bound every rank of random batches."""
    g = torch.Generator().manual_seed(0)
    for name in NAMES:
        for cp in (1, 2, 3, 8):
            s = cpattn.get_strategy(name, cp)
            for _ in range(20):
                b = int(torch.randint(1, 7, (1,), generator=g))
                ext = torch.randint(0, 40, (b,), generator=g).tolist()
                metas = [s.build_metadata(ext, rank=r) for r in range(cp)]
                assert max(metas[0].num_local_tokens_per_rank) <= s.max_local_tokens(max(sum(ext), 1), b)
                assert max(m.num_segments for m in metas) <= s.max_segments(b)


# ----------------------------------------------------------------------------- GPU: graph replay
GPU_BATCHES = [([3000, 17, 1, 900], [0, 200, 5, 3000]), ([6000], [100]), ([5, 2500, 700, 64, 1], [0, 0, 40, 900, 7])]


def _fill_batch(ext, pre, hq, hkv, d, k_buf, v_buf, x_buf, page, caches, table, gen):
    """Random logical q and packed K/V of a batch written into the fixed buffers (and into the
    paged caches through a shuffled page table)."""
    t, n_kv = sum(ext), sum(e + p for e, p in zip(ext, pre))
    x_buf.zero_()
    x_buf[:t].normal_(generator=gen)
    k_buf.normal_(generator=gen)
    v_buf.normal_(generator=gen)
    if page is None:
        return t, n_kv
    kc, vc = caches
    lens = [e + p for e, p in zip(ext, pre)]
    perm = torch.randperm(kc.shape[0], device=kc.device, generator=gen)
    table.fill_(0)
    used, off = 0, 0
    for b, n in enumerate(lens):
        pages = -(-n // page)
        table[b, :pages] = perm[used : used + pages].to(table.dtype)
        j = torch.arange(n, device=kc.device)
        kc[table[b, j // page].long(), j % page] = k_buf[off : off + n]
        vc[table[b, j // page].long(), j % page] = v_buf[off : off + n]
        used, off = used + pages, off + n
    return t, n_kv


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["zigzag", "interleave"])
@pytest.mark.parametrize("page", [None, 64])
def test_gpu_graph_capture_replays_for_other_batches(name, page):
    """Capture shard + plan.run once (static plans), then for three different ragged batches:
    plan into the same buffers, replay, compare with an eager plan of the batch."""
    dev = torch.device("cuda")
    cp, rank, hq, hkv, d = 2, 1, 16, 4, 128
    s = cpattn.get_strategy(name, cp, pad_multiple=64)
    planner = cpattn.StaticPlanner(s, max_tokens=8192, max_seqs=8, max_kv_tokens=16384, device=dev)
    cap = planner.capacity
    gen = torch.Generator(device=dev).manual_seed(0)
    x_buf = torch.zeros(cap.max_tokens, hq, d, device=dev, dtype=torch.bfloat16)
    k_buf = torch.zeros(cap.max_kv_tokens, hkv, d, device=dev, dtype=torch.bfloat16)
    v_buf = torch.zeros_like(k_buf)
    caches = table = None
    if page is not None:
        num_pages = cap.max_kv_tokens // page + cap.max_seqs
        caches = (torch.full((num_pages, page, hkv, d), float("nan"), device=dev, dtype=torch.bfloat16),
                  torch.full((num_pages, page, hkv, d), float("nan"), device=dev, dtype=torch.bfloat16))
        table = torch.zeros(cap.max_seqs, cap.max_kv_tokens // page + 1, device=dev, dtype=torch.int32)
    out_buf = torch.empty(cap.max_local_tokens, hq, d, device=dev, dtype=torch.bfloat16)
    lse_buf = torch.empty(cap.max_local_tokens, hq, device=dev, dtype=torch.float32)
    kv = caches if caches is not None else (k_buf, v_buf)

    def plan_for(ext, pre):
        meta = planner.plan(ext, pre, rank=rank)
        plan = s.plan_attention(meta, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16,
                                page_size=page, backend="triton")
        return meta, plan

    ext0, pre0 = GPU_BATCHES[0]
    _fill_batch(ext0, pre0, hq, hkv, d, k_buf, v_buf, x_buf, page, caches, table, gen)
    meta, plan = plan_for(ext0, pre0)
    for _ in range(2):  # warm up (compile) outside the capture
        plan.run(s.shard(x_buf, meta), *kv, page_table=table, out=out_buf, lse=lse_buf)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(s.shard(x_buf, meta), *kv, page_table=table, out=out_buf, lse=lse_buf)
    for ext, pre in GPU_BATCHES:
        t, n_kv = _fill_batch(ext, pre, hq, hkv, d, k_buf, v_buf, x_buf, page, caches, table, gen)
        meta_b, _ = plan_for(ext, pre)  # rewrites the fixed buffers the graph reads
        graph.replay()
        fresh = s.build_metadata(ext, pre, rank=rank).to(dev)
        q = s.shard(x_buf[:t], fresh)
        ref, ref_lse = s.attention(q, k_buf[:n_kv], v_buf[:n_kv], fresh, backend="triton", return_lse=True)
        n = fresh.num_local_tokens
        assert (out_buf[:n].float() - ref[:n].float()).abs().max().item() < 1e-2
        assert (lse_buf[:n] - ref_lse[:n]).abs().max().item() < 1e-3
        assert (out_buf[n:] == 0).all() and torch.isneginf(lse_buf[n:]).all()


@pytest.mark.gpu
def test_gpu_graph_capture_full_layer_path_cp1():
    """C = 1 (no group needed): shard / gather_kv / plan.run / gather captured once, replayed
    for three batches, equal to eager."""
    dev = torch.device("cuda")
    s = cpattn.ZigzagStrategy(1, pad_multiple=64)
    planner = cpattn.StaticPlanner(s, max_tokens=8192, max_seqs=8, max_kv_tokens=8192, device=dev)
    cap = planner.capacity
    hq, hkv, d = 8, 2, 128
    gen = torch.Generator(device=dev).manual_seed(1)
    x = torch.zeros(cap.max_tokens, hq + 2 * hkv, d, device=dev, dtype=torch.bfloat16)
    y = torch.zeros(cap.max_tokens, hq, d, device=dev, dtype=torch.bfloat16)

    def layer(meta, plan):
        h = s.shard(x, meta)
        q, k, v = h[:, :hq], h[:, hq : hq + hkv], h[:, hq + hkv :]
        k_all, v_all = s.gather_kv(k.contiguous(), v.contiguous(), meta)
        o = plan.run(q.contiguous(), k_all, v_all)
        y.copy_(s.gather(o, meta))

    batches = [([1000, 3, 2000], None), ([4096], None), ([7, 7, 7, 7, 900], None)]
    meta = planner.plan(*batches[0], rank=0)
    plan = s.plan_attention(meta, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16, backend="triton")
    for _ in range(2):
        layer(meta, plan)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer(meta, plan)
    for ext, _ in batches:
        t = sum(ext)
        x.zero_()
        x[:t].normal_(generator=gen)
        m = planner.plan(ext, rank=0)
        s.plan_attention(m, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16, backend="triton")
        graph.replay()
        fresh = s.build_metadata(ext, rank=0).to(dev)
        xs = x[:t]
        q_ref = s.shard(xs[:, :hq].contiguous(), fresh)
        ref = s.attention(q_ref, xs[:, hq : hq + hkv].contiguous(), xs[:, hq + hkv :].contiguous(), fresh,
                          backend="triton")
        assert (y[:t].float() - ref[:t].float()).abs().max().item() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("page", [None, 64])
def test_gpu_planned_launch_repeats_and_respecializes(page):
    """The planned launch (compiled kernel called directly after the first call) gives the JIT
    call's result, and a call whose arguments specialize differently (an unaligned q view, other
    sinks strides) goes through the JIT again and is still right."""
    dev = torch.device("cuda")
    s = cpattn.ZigzagStrategy(2, pad_multiple=64)
    ext, pre = [3000, 900], [100, 0]
    meta = s.build_metadata(ext, pre, rank=1).to(dev)
    gen = torch.Generator(device=dev).manual_seed(3)
    n_kv = sum(ext) + sum(pre)
    q = torch.randn(meta.num_physical_tokens, 16, 128, device=dev, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(n_kv, 4, 128, device=dev, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(n_kv, 4, 128, device=dev, dtype=torch.bfloat16, generator=gen)
    sinks = torch.randn(32, device=dev, generator=gen)
    table = None
    if page is not None:
        pages = -(-3100 // page) + -(-900 // page)
        kc = torch.zeros(pages, page, 4, 128, device=dev, dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        table = torch.zeros(2, -(-3100 // page), device=dev, dtype=torch.int32)
        used = 0
        for b, (n, off) in enumerate(((3100, 0), (900, 3100))):
            p = -(-n // page)
            table[b, :p] = torch.arange(used, used + p, device=dev)
            kc.view(-1, 4, 128)[used * page : used * page + n] = k[off : off + n]
            vc.view(-1, 4, 128)[used * page : used * page + n] = v[off : off + n]
            used += p
        k_in, v_in = kc, vc
    else:
        k_in, v_in = k, v
    plan = s.plan_attention(meta, num_q_heads=16, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16,
                            page_size=page, has_sinks=True, backend="triton")
    ref = s.attention(q.float(), k.float(), v.float(), meta, sinks=sinks[::2], backend="torch")
    n = meta.num_local_tokens
    first = plan.run(q, k_in, v_in, page_table=table, sinks=sinks[::2])
    second = plan.run(q, k_in, v_in, page_table=table, sinks=sinks[::2])
    assert torch.equal(first, second)
    assert (first[:n].float() - ref[:n]).abs().max().item() < 2e-2
    buf = torch.empty(q.numel() + 1, device=dev, dtype=q.dtype)
    q_odd = buf[1:].view_as(q)  # base not 16-byte aligned
    q_odd.copy_(q)
    third = plan.run(q_odd, k_in, v_in, page_table=table, sinks=sinks[::2].clone())  # sinks stride 1 now
    assert (third[:n].float() - ref[:n]).abs().max().item() < 2e-2


def test_static_slot_plan_writes_only_the_batch():
    """A static plan's slot plan covers the capacity rows at a fixed address; writing the
    capacity-sized gathered rows stores exactly the batch's rows (pad rows repeat the last one)."""
    s = cpattn.ContiguousStrategy(1)
    planner = cpattn.StaticPlanner(s, max_tokens=32, max_seqs=4, max_kv_tokens=64, device="cpu")
    ptr = None
    for ext in ([5, 9], [20, 1, 3]):
        t = sum(ext)
        meta = planner.plan(ext, rank=0)
        slots = torch.randperm(100)[:t]
        plan = cpattn.plan_slots(meta, slots, 100)
        assert plan.num_tokens == 32 and plan.index.shape == (32,)
        ptr = ptr or plan.index.data_ptr()
        assert plan.index.data_ptr() == ptr
        k = torch.randn(t, 2, 4)
        k_rows = torch.zeros(32, 2, 4)
        k_rows[:t] = k
        k_rows[t:] = k[-1]  # what gather_kv returns past T under a static plan
        kc, vc = torch.zeros(100, 2, 4), torch.zeros(100, 2, 4)
        cpattn.write_kv_cache(k_rows, k_rows, kc, vc, plan)
        ref = torch.zeros(100, 2, 4)
        ref[slots] = k
        assert torch.equal(kc, ref) and torch.equal(vc, ref)


@pytest.mark.parametrize("page", [None, 16])
def test_decode_shaped_dense_plan_runs_the_decode_family(interp, page):
    """q_len 1..4 per sequence over long key ranges at C = 1 (decode with a replicated cache):
    the triton backend plans the split-KV decode family, results equal the oracle, pad rows 0."""
    s = cpattn.ContiguousStrategy(1, pad_multiple=8)
    ext, pre = [1, 4, 2, 0, 3], [300, 260, 511, 40, 280]
    q, k, v, sk = _inputs(ext, pre, 4, 2, 16, 16, torch.float32, seed=11, sinks=True)
    meta = s.build_metadata(ext, pre, rank=0)
    ql = s.shard(q, meta)
    if page is None:
        k_in, v_in, table = k, v, None
    else:
        from test_triton_kernel import _paged

        k_in, v_in, table = _paged(k, v, ext, pre, page, gen=torch.Generator().manual_seed(2))
    plan = s.plan_attention(meta, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, has_sinks=True,
                            page_size=page, window_size=(200, 0), backend="triton")
    assert plan.family == "decode"
    out, lse = plan.run(ql, k_in, v_in, page_table=table, sinks=sk, return_lse=True)
    ref, ref_lse = attention_oracle(q, k, v, ext, pre, window_left=200, sinks=sk)
    n = meta.num_local_tokens
    assert (out[:n].double() - ref).abs().max() < 2e-5 and (lse[:n].double() - ref_lse).abs().max() < 2e-5
    assert (out[n:] == 0).all() and torch.isneginf(lse[n:]).all()
    # engine buffers holding garbage: every row is written (the pad rows by one pad-row launch)
    out_buf, lse_buf = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
    plan.run(ql, k_in, v_in, page_table=table, sinks=sk, out=out_buf, lse=lse_buf)
    assert torch.equal(out_buf, out) and torch.equal(lse_buf, lse)
    out_only = torch.full_like(out, float("nan"))  # no lse: the split kernels' LSEs go to the plan's buffer
    plan.run(ql, k_in, v_in, page_table=table, sinks=sk, out=out_only)
    assert torch.equal(out_only, out)
    forced = s.plan_attention(meta, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                              backend="triton", backend_options={"family": "portable"})
    assert forced.family == "portable"
    with pytest.raises(ValueError, match="decode kernel cannot run"):
        cpattn.ZigzagStrategy(2).plan_attention(cpattn.ZigzagStrategy(2).build_metadata([3], [500], rank=0),
                                                num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                                                backend="triton", backend_options={"family": "decode"})


def test_pad_row_kernel_writes_only_the_pad_rows(interp):
    """The decode plans' pad-row kernel: 0 / -inf into rows [row0, P) of out [P, H, Dv] (a head
    stride wider than Dv, H and Dv not powers of two) and lse [P, H] (strided), nothing else; with
    no lse only out."""
    from cpattn.kernels import triton_decode

    p, h, dv, row0 = 9, 3, 40, 5
    base = torch.full((p, h, 48), float("nan"))
    out = base[..., :dv]
    lse_base = torch.full((h, p), float("nan"))
    lse = lse_base.t()
    grid, args = triton_decode.pad_geometry(p - row0, h, dv)
    triton_decode.launch_pad_rows(out, lse, row0, grid=grid, pad_args=args)
    assert (out[row0:] == 0).all() and torch.isneginf(lse[row0:]).all()
    assert out[:row0].isnan().all() and lse[:row0].isnan().all() and base[..., dv:].isnan().all()
    out2 = torch.full((p, h, dv), float("nan"))
    triton_decode.launch_pad_rows(out2, None, row0, grid=grid, pad_args=args)
    assert (out2[row0:] == 0).all() and out2[:row0].isnan().all()


def test_decode_shaped_dense_plan_takes_split_options(interp):
    """backend_options["decode"] reaches the split-KV family: a forced split target changes the
    split size (results still equal the oracle); ``pdl`` is taken and checked; unknown keys raise
    ValueError naming them."""
    s = cpattn.ContiguousStrategy(1, pad_multiple=8)
    ext, pre = [1, 2], [700, 900]
    q, k, v, _ = _inputs(ext, pre, 4, 2, 16, 16, torch.float32, seed=5)
    meta = s.build_metadata(ext, pre, rank=0)
    splits = set()
    for pps in (1, 8):
        plan = s.plan_attention(meta, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                                backend="triton", backend_options={"decode": {"programs_per_sm": pps, "num_sms": 2}})
        assert plan.family == "decode"
        splits.add(plan._impl._impl.split)
        out = plan.run(s.shard(q, meta), k, v)
        ref, _ = attention_oracle(q, k, v, ext, pre)
        assert (out[: meta.num_local_tokens].double() - ref).abs().max() < 2e-5
    assert len(splits) == 2
    plan = s.plan_attention(meta, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                            backend="triton", backend_options={"decode": {"pdl": False}})
    assert plan._impl._impl.pdl is False  # the option reaches it (on the CPU it is never on anyway)
    with pytest.raises(ValueError, match="pdl must be a bool"):
        s.plan_attention(meta, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, backend="triton",
                         backend_options={"decode": {"pdl": "off"}})
    with pytest.raises(ValueError, match="decode keys.*bogus"):
        s.plan_attention(meta, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, backend="triton",
                         backend_options={"decode": {"bogus": 1}})


_PACK_DTYPES = [torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool, torch.float32, torch.float16,
                torch.bfloat16, torch.float64]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_PACK_DTYPES), st.lists(st.integers(0, 5), min_size=0, max_size=3),
                          st.booleans()), min_size=1, max_size=7), st.integers(0, 2**31 - 1))
def test_plan_tensors_round_trip_through_one_buffer(fields, seed):
    """The one-copy packing of a plan's tensors (``_buffers.move_packed`` / ``StaticArena``):
    any dtypes (numpy-packed and not), shapes (0-d, empty, multi-dim), non-contiguous sources;
    every view comes back equal, typed and shaped as its source, inside one buffer, 16-byte
    aligned; a static arena returns the same views (addresses) for a second, different plan."""
    from cpattn import _buffers

    g = torch.Generator().manual_seed(seed)

    def make(fields):
        out = {}
        for i, (dtype, shape, transpose) in enumerate(fields):
            x = (torch.randn(shape or [], generator=g) * 100)
            x = x.to(dtype) if dtype != torch.bool else x > 0
            if transpose and x.dim() >= 2:
                x = x.transpose(0, 1)  # non-contiguous source
            out[f"t{i}"] = x
        return out

    ts = make(fields)
    views = _buffers.move_packed(ts, torch.device("cpu"))
    base = None
    for name, t in ts.items():
        v = views[name]
        assert v.dtype == t.dtype and v.shape == t.shape and torch.equal(v, t), name
        if v.numel():
            assert v.data_ptr() % _buffers.FIELD_ALIGN == 0
            storage = v.untyped_storage().data_ptr()
            assert base is None or storage == base  # one buffer
            base = storage
    arena = _buffers.StaticArena(torch.device("cpu"))
    first = arena.upload("k", ts)
    second_src = make(fields)
    second = arena.upload("k", second_src)
    for name in ts:
        assert second[name].data_ptr() == first[name].data_ptr() and torch.equal(second[name], second_src[name])


def test_static_arena_scratch_is_one_fixed_tensor_per_key():
    """A static planner's kernel workspace: the same tensor for a key on every request, another
    for another key, and a request of another shape or dtype for a key is refused."""
    from cpattn import _buffers

    arena = _buffers.StaticArena(torch.device("cpu"))
    a = arena.scratch("ws", (4, 2, 3), torch.float32)
    assert arena.scratch("ws", (4, 2, 3), torch.float32) is a
    b = arena.scratch("ws2", (4, 2, 3), torch.float32)
    assert b.data_ptr() != a.data_ptr()
    with pytest.raises(ValueError, match="static scratch 'ws' was sized"):
        arena.scratch("ws", (5, 2, 3), torch.float32)
    with pytest.raises(ValueError, match="static scratch 'ws' was sized"):
        arena.scratch("ws", (4, 2, 3), torch.bfloat16)
