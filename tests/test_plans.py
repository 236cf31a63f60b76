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


def _spec_plan(meta, *, backend="auto", backend_options=None, **spec):
    """``cpattn.plan_attention`` for the layer kind of ``spec`` (:class:`AttentionSpec`'s keywords)."""
    return cpattn.plan_attention(meta, AttentionSpec(**spec), backend=backend, backend_options=backend_options)


def _plan(s, meta, q, k, v, *, window=-1, sinks=False, backend="torch", page_size=None):
    return _spec_plan(meta, num_q_heads=q.shape[1], num_kv_heads=k.shape[-2], head_dim=q.shape[-1],
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
        out, lse = plan.attend(ql, k, v, sinks=sk, return_lse=True)
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
    got = plan.attend(ql, k, v, out=out, lse=lse)
    assert got is out and not out.isnan().any() and not lse.isnan().any()
    ref, ref_lse = plan.attend(ql, k, v, return_lse=True)
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
            plan.attend(args.pop("q_local"), args.pop("k"), args.pop("v"), **args)
    paged = _spec_plan(meta, num_q_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, page_size=4)
    with pytest.raises(ValueError, match="pass page_table"):
        paged.attend(ql, torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8))
    for kwargs, exc, match in [
        (dict(num_q_heads=4, num_kv_heads=3), ValueError, "multiple of num_kv_heads"),
        (dict(num_q_heads=4.0, num_kv_heads=2), TypeError, "num_q_heads"),
        (dict(num_q_heads=4, num_kv_heads=2, window_size=3), TypeError, "window_size"),
        (dict(num_q_heads=4, num_kv_heads=2, page_size=512), ValueError, "page_size"),
        (dict(num_q_heads=4, num_kv_heads=2, backend="cudnn"), ValueError, "backend must be one of"),
        (dict(num_q_heads=4, num_kv_heads=2, backend="torch", backend_options={"x": 1}), ValueError, "backend_options"),
    ]:
        with pytest.raises(exc, match=match):
            _spec_plan(meta, head_dim=8, dtype=torch.float32, **kwargs)


def test_plan_is_cached_per_meta_and_layer_kind(monkeypatch):
    """strategy.attention plans once per (meta, layer kind, backend): repeated calls reuse the
    plan, another window is another layer kind, another placement plan plans again."""
    import cpattn.strategies.base as strategy_base

    built = []
    real = strategy_base.plan_attention

    def counting(meta, spec, **kw):
        built.append(spec.window_size)
        return real(meta, spec, **kw)

    monkeypatch.setattr(strategy_base, "plan_attention", counting)
    s = cpattn.InterleaveStrategy(2)
    meta = s.build_metadata([9], rank=1)
    q, k, v, _ = _inputs([9], [0], 2, 1, 8, 8, torch.float32)
    ql = s.shard(q, meta)
    first = s.attention(ql, k, v, meta, backend="torch")
    assert torch.equal(s.attention(ql, k, v, meta, backend="torch"), first)
    s.attention(ql, k, v, meta, backend="torch", window_size=(3, 0))
    s.attention(ql, k, v, meta, backend="torch", window_size=[3, 0])  # the same layer kind
    assert built == [(-1, 0), (3, 0)]
    s.attention(ql, k, v, s.build_metadata([9], rank=1), backend="torch")
    assert len(built) == 3


def test_fa4_descriptors_follow_segments():
    """The FA4 plan's varlen arrays (cu_seqlens_q over segment rows, cu_seqlens_k at the
    sequence starts, seqused_k = last position + 1)."""
    from cpattn.kernels.fa4 import _FA4Run

    s = cpattn.ZigzagStrategy(2)
    meta = s.build_metadata([10, 7, 0, 3], [4, 0, 2, 1], rank=0)
    run = _FA4Run(None, AttentionSpec(num_q_heads=4, num_kv_heads=2, head_dim=8, head_dim_v=8, dtype=torch.bfloat16),
                  meta)
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
            out, lse = plan.attend(ql, k, v, sinks=sinks, return_lse=True)
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
    out, lse = plan.attend(ql, k, v, sinks=sk, return_lse=True)
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
    out, lse = plan.attend(ql, k, v, return_lse=True)
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
            plan = _spec_plan(meta, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                              backend=backend)
            if backend == "triton":
                tiles = plan._impl.portable_args["tile_segment"].data_ptr()
                plan_ptrs = plan_ptrs or tiles
                assert tiles == plan_ptrs
            out, lse = plan.attend(ql, k_buf, v_buf, return_lse=True)
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
            plan = _spec_plan(meta, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                              backend="triton")
            assert plan._impl.group_keys == 24
            tiles_ptr = tiles_ptr or plan._impl.portable_args["tile_segment"].data_ptr()
            assert plan._impl.portable_args["tile_segment"].data_ptr() == tiles_ptr
            out, lse = plan.attend(s.shard(x, meta), k_buf, v_buf, return_lse=True)
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
    """Capture shard + plan.attend once (static plans), then for three different ragged batches:
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
        plan = _spec_plan(meta, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16,
                          page_size=page, backend="triton")
        return meta, plan

    ext0, pre0 = GPU_BATCHES[0]
    _fill_batch(ext0, pre0, hq, hkv, d, k_buf, v_buf, x_buf, page, caches, table, gen)
    meta, plan = plan_for(ext0, pre0)
    for _ in range(2):  # warm up (compile) outside the capture
        plan.attend(s.shard(x_buf, meta), *kv, page_table=table, out=out_buf, lse=lse_buf)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.attend(s.shard(x_buf, meta), *kv, page_table=table, out=out_buf, lse=lse_buf)
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
    """C = 1 (no group needed): shard / gather_kv / plan.attend / gather captured once, replayed
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
        o = plan.attend(q.contiguous(), k_all, v_all)
        y.copy_(s.gather(o, meta))

    batches = [([1000, 3, 2000], None), ([4096], None), ([7, 7, 7, 7, 900], None)]
    meta = planner.plan(*batches[0], rank=0)
    plan = _spec_plan(meta, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16, backend="triton")
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
        _spec_plan(m, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16, backend="triton")
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
    plan = _spec_plan(meta, num_q_heads=16, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16,
                      page_size=page, has_sinks=True, backend="triton")
    ref = s.attention(q.float(), k.float(), v.float(), meta, sinks=sinks[::2], backend="torch")
    n = meta.num_local_tokens
    first = plan.attend(q, k_in, v_in, page_table=table, sinks=sinks[::2])
    second = plan.attend(q, k_in, v_in, page_table=table, sinks=sinks[::2])
    assert torch.equal(first, second)
    assert (first[:n].float() - ref[:n]).abs().max().item() < 2e-2
    buf = torch.empty(q.numel() + 1, device=dev, dtype=q.dtype)
    q_odd = buf[1:].view_as(q)  # base not 16-byte aligned
    q_odd.copy_(q)
    third = plan.attend(q_odd, k_in, v_in, page_table=table, sinks=sinks[::2].clone())  # sinks stride 1 now
    assert (third[:n].float() - ref[:n]).abs().max().item() < 2e-2


def test_static_slot_plan_writes_only_the_batch():
    """A static plan's write plan covers the capacity rows at a fixed address; writing the
    capacity-sized gathered rows stores exactly the batch's rows (pad rows repeat the last one)."""
    s = cpattn.ContiguousStrategy(1)
    planner = cpattn.StaticPlanner(s, max_tokens=32, max_seqs=4, max_kv_tokens=64, device="cpu")
    ptr = None
    for ext in ([5, 9], [20, 1, 3]):
        t = sum(ext)
        meta = planner.plan(ext, rank=0)
        slots = torch.randperm(100)[:t]
        plan = cpattn.plan_cache_writes(meta, slots, num_slots=100)
        assert plan.num_source_rows == 32 and plan.slots.shape == (32,) and plan.num_writes == t
        ptr = ptr or plan.slots.data_ptr()
        assert plan.slots.data_ptr() == ptr
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
    plan = _spec_plan(meta, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, has_sinks=True,
                      page_size=page, window_size=(200, 0), backend="triton")
    assert plan.family == "decode"
    out, lse = plan.attend(ql, k_in, v_in, page_table=table, sinks=sk, return_lse=True)
    ref, ref_lse = attention_oracle(q, k, v, ext, pre, window_left=200, sinks=sk)
    n = meta.num_local_tokens
    assert (out[:n].double() - ref).abs().max() < 2e-5 and (lse[:n].double() - ref_lse).abs().max() < 2e-5
    assert (out[n:] == 0).all() and torch.isneginf(lse[n:]).all()
    # engine buffers holding garbage: every row is written (the pad rows by one pad-row launch)
    out_buf, lse_buf = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
    plan.attend(ql, k_in, v_in, page_table=table, sinks=sk, out=out_buf, lse=lse_buf)
    assert torch.equal(out_buf, out) and torch.equal(lse_buf, lse)
    out_only = torch.full_like(out, float("nan"))  # no lse: the split kernels' LSEs go to the plan's buffer
    plan.attend(ql, k_in, v_in, page_table=table, sinks=sk, out=out_only)
    assert torch.equal(out_only, out)
    forced = _spec_plan(meta, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                        backend="triton", backend_options={"family": "portable"})
    assert forced.family == "portable"
    with pytest.raises(ValueError, match="decode kernel cannot run"):
        _spec_plan(cpattn.ZigzagStrategy(2).build_metadata([3], [500], rank=0),
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
        plan = _spec_plan(meta, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                          backend="triton", backend_options={"decode": {"programs_per_sm": pps, "num_sms": 2}})
        assert plan.family == "decode"
        splits.add(plan._impl._impl.split)
        out = plan.attend(s.shard(q, meta), k, v)
        ref, _ = attention_oracle(q, k, v, ext, pre)
        assert (out[: meta.num_local_tokens].double() - ref).abs().max() < 2e-5
    assert len(splits) == 2
    plan = _spec_plan(meta, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                      backend="triton", backend_options={"decode": {"pdl": False}})
    assert plan._impl._impl.pdl is False  # the option reaches it (on the CPU it is never on anyway)
    with pytest.raises(ValueError, match="pdl must be a bool"):
        _spec_plan(meta, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, backend="triton",
                   backend_options={"decode": {"pdl": "off"}})
    with pytest.raises(ValueError, match="decode keys.*bogus"):
        _spec_plan(meta, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, backend="triton",
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


# ----------------------------------------------------------------------------- plan_attention: one entry point
PLACEMENTS = ["zigzag", "interleave", "contiguous", "replicated"]


def _table_algorithms(strategy: str, kv_sharded: bool, cp_size: int) -> set:
    """The (queries, KV cache) table of ``cpattn.plan_attention``: the algorithms ``auto`` may
    pick for a placement (``strategy``), a KV layout and C."""
    queries_replicated = strategy == "replicated"
    if not kv_sharded:
        return {"local"} if queries_replicated or cp_size == 1 else {"gather_kv"}
    if queries_replicated:
        return {"shard_merge"}
    return {"pass_kv", "pass_q"}  # by the cost model; planning needs page_table= and num_pages=


def _local_page_table(key_counts, page_size: int, seed: int = 0) -> tuple[torch.Tensor, int]:
    """(page table [B, max_pages] int32, num_pages) for sequences of ``key_counts`` keys (this
    rank's): distinct shuffled pages per sequence, and a spare page, the last (never a key's),
    that every entry past a sequence's pages points at."""
    counts = [int(n) for n in key_counts]
    need = [-(-n // page_size) for n in counts]
    num_pages = sum(need) + 1
    perm = torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    table = torch.full((len(counts), max(need + [1])), num_pages - 1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used : used + n]
        used += n
    return table, num_pages


def _slot(table: torch.Tensor, b: int, j: int, page_size: int) -> int:
    """Cache slot of key ``j`` of sequence ``b`` through a page table (the documented rule)."""
    return int(table[b, j // page_size]) * page_size + j % page_size


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8).clone()


@pytest.mark.parametrize("strategy", PLACEMENTS)
@pytest.mark.parametrize("kv_sharded", [False, True])
@pytest.mark.parametrize("cp_size", [1, 2])
def test_plan_attention_picks_the_tables_algorithm(strategy, kv_sharded, cp_size):
    """``cpattn.plan_attention(meta, spec)`` runs the algorithm of the (queries, KV cache) table
    (single process: planning runs no collective): "local" for replicated queries over a
    replicated cache and for C = 1 over a replicated cache, "gather_kv" for sharded queries over
    a replicated cache at C > 1, "shard_merge" for replicated queries over a sharded cache,
    "pass_kv" / "pass_q" for sharded queries over a sharded cache (planned with this rank's
    page_table= and num_pages=). Each of the pair's algorithms can be forced; forcing any other
    raises ValueError naming it."""
    rank = cp_size - 1
    ext, pre = ([1, 1, 2], [37, 5, 0]) if strategy == "replicated" else ([9, 0, 5], [3, 2, 0])
    kv = cpattn.KVSharding(cp_size) if kv_sharded else None
    meta = cpattn.get_strategy(strategy, cp_size).build_metadata(ext, pre, rank=rank, kv=kv)
    spec = AttentionSpec(num_q_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, page_size=4)
    table = _table_algorithms(strategy, kv_sharded, cp_size)
    extra = {}
    if table == {"pass_kv", "pass_q"}:
        with pytest.raises(ValueError, match="needs page_table= and num_pages="):
            cpattn.plan_attention(meta, spec)
        with pytest.raises(ValueError, match="needs a paged spec"):
            cpattn.plan_attention(meta, spec.replace(page_size=None))
        pt, num_pages = _local_page_table(kv.local_lengths([e + p for e, p in zip(ext, pre)], rank), 4)
        extra = dict(page_table=pt, num_pages=num_pages)
    else:
        with pytest.raises(ValueError, match="page_table= / num_pages= are for an extend over a sharded cache"):
            cpattn.plan_attention(meta, spec, page_table=torch.zeros(3, 16, dtype=torch.int32), num_pages=16)
        # packed K/V: the same algorithm
        assert cpattn.plan_attention(meta, spec.replace(page_size=None)).algorithm in table
    plan = cpattn.plan_attention(meta, spec, **extra)
    assert plan.algorithm in table and isinstance(plan, cpattn.AttentionPlan)
    assert plan.meta is meta and plan.spec == spec and plan.backend in ("torch", "triton")
    for algorithm in cpattn.ALGORITHMS:
        if algorithm in table:
            assert cpattn.plan_attention(meta, spec, algorithm=algorithm, **extra).algorithm == algorithm
        else:
            with pytest.raises(ValueError, match=f"algorithm '{algorithm}' cannot run strategy='{strategy}'"):
                cpattn.plan_attention(meta, spec, algorithm=algorithm, **extra)
    with pytest.raises(ValueError, match="algorithm must be 'auto' or one of"):
        cpattn.plan_attention(meta, spec, algorithm="ring")
    if kv_sharded and strategy != "replicated":  # sparse over a sharded cache: replicated queries (decode) only
        with pytest.raises(NotImplementedError, match="sharded KV cache"):
            cpattn.plan_attention(meta, spec.replace(topk=4), **extra)
    else:
        assert cpattn.plan_attention(meta, spec.replace(topk=4)).algorithm in table


def _explicit_mask_oracle(q, k, v, extend, prefix, *, window_left=-1, sinks=None):
    """fp64 attention of every logical row [T, Hq, D] over K/V packed per sequence (prefix then
    extend) through an explicit [T, num_kv] mask: keys of its own sequence at positions <= its
    own and >= its own - window_left; GQA by repeating the KV heads; sinks join the denominator.
    Returns (out [T, Hq, Dv], lse [T, Hq])."""
    q, k, v = q.double(), k.double(), v.double()
    ext, pre = torch.tensor(extend, dtype=torch.int64), torch.tensor(prefix, dtype=torch.int64)
    b = torch.arange(len(extend))
    q_seq = torch.repeat_interleave(b, ext)
    k_seq = torch.repeat_interleave(b, ext + pre)
    cu_q = torch.cumsum(ext, 0) - ext
    cu_k = torch.cumsum(ext + pre, 0) - ext - pre
    q_pos = pre[q_seq] + torch.arange(q.shape[0]) - cu_q[q_seq]
    k_pos = torch.arange(k.shape[0]) - cu_k[k_seq]
    mask = (q_seq[:, None] == k_seq[None]) & (k_pos[None] <= q_pos[:, None])
    if window_left >= 0:
        mask &= k_pos[None] >= q_pos[:, None] - window_left
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,nhd->htn", q, kk) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.double()[:, None, None].expand(q.shape[1], q.shape[0], 1)
        scores = torch.cat([scores, sink], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, T]
    probs = torch.exp(scores - lse[..., None])[..., : k.shape[0]]
    return torch.einsum("htn,nhd->thd", probs, vv), lse.t()


@st.composite
def one_call_cases(draw):
    n = draw(st.integers(1, 4))
    extend = draw(st.lists(st.one_of(st.sampled_from([0, 1]), st.integers(0, 24)), min_size=n, max_size=n))
    prefix = draw(st.lists(st.one_of(st.just(0), st.integers(0, 20)), min_size=n, max_size=n))
    strategy = draw(st.sampled_from(PLACEMENTS))
    page = draw(st.sampled_from([None, 1, 4, 16]))
    # a sharded cache (C = 1): "shard_merge" for replicated queries, else "pass_kv" / "pass_q"
    kv = page is not None and draw(st.booleans())
    algorithm = "auto" if not kv or strategy == "replicated" else draw(st.sampled_from(["pass_kv", "pass_q"]))
    if algorithm == "pass_q" and not sum(extend):  # an empty batch fails in pass-Q's unpacking: see below
        algorithm = "pass_kv"
    return dict(
        strategy=strategy, extend=extend, prefix=prefix, heads=draw(st.sampled_from([(4, 4), (4, 2), (4, 1)])),
        dv=draw(st.sampled_from([16, 8])), window=draw(st.sampled_from([-1, 0, 3, 40])), sinks=draw(st.booleans()),
        page=page, kv=kv, algorithm=algorithm, pad=draw(st.sampled_from([1, 8])), slots_1d=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def _check_run_equals_attend_and_oracle(case, backend):
    """``plan.run`` (one call: the cache write, or the packing after a packed prefix, and the
    kernel) against ``plan.attend`` after a manual gather + write (bit-identical outputs, LSEs
    and caches), and both against the explicit-mask fp64 oracle; single process (C = 1)."""
    strategy, extend, prefix, page = case["strategy"], case["extend"], case["prefix"], case["page"]
    (hq, hkv), d, dv, window = case["heads"], 16, case["dv"], case["window"]
    kv = cpattn.KVSharding(1) if case["kv"] else None
    s = cpattn.get_strategy(strategy, 1, pad_multiple=case["pad"])
    meta = s.build_metadata(extend, prefix, rank=0, kv=kv)
    spec = AttentionSpec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv, dtype=torch.float32,
                         window_size=(window, 0), page_size=page, has_sinks=case["sinks"])
    g = torch.Generator().manual_seed(case["seed"])
    t, n_pre = sum(extend), sum(prefix)
    lens = [e + p for e, p in zip(extend, prefix)]
    q, k_new, v_new = (torch.randn(t, h, x, generator=g) for h, x in ((hq, d), (hkv, d), (hkv, dv)))
    k_pre, v_pre = torch.randn(n_pre, hkv, d, generator=g), torch.randn(n_pre, hkv, dv, generator=g)
    sk = torch.randn(hq, generator=g) if case["sinks"] else None
    # the oracle's K/V, packed per sequence: prefix then extend
    k_all, v_all, at_q, at_p = [], [], 0, 0
    for e, p in zip(extend, prefix):
        k_all += [k_pre[at_p : at_p + p], k_new[at_q : at_q + e]]
        v_all += [v_pre[at_p : at_p + p], v_new[at_q : at_q + e]]
        at_q, at_p = at_q + e, at_p + p
    k_all, v_all = torch.cat(k_all), torch.cat(v_all)
    ref, ref_lse = _explicit_mask_oracle(q, k_all, v_all, extend, prefix, window_left=window, sinks=sk)
    ql, kl, vl = s.shard(q, meta), s.shard(k_new, meta), s.shard(v_new, meta)
    run_kw = dict(sinks=sk, return_lse=True)
    if page is None:  # packed: run packs the new rows after the cached prefix
        plan = cpattn.plan_attention(meta, spec, backend=backend)
        assert plan.algorithm == "local"
        cache = None if n_pre == 0 and case["seed"] % 2 else (k_pre, v_pre)
        out, lse = plan.run(ql, kl, vl, cache, **run_kw)
        k_ext, v_ext = s.gather_kv(kl, vl, meta)
        out_b, lse_b = plan.attend(ql, *cpattn.pack_kv(k_ext, v_ext, meta, k_pre, v_pre), **run_kw)
    else:  # paged: run writes the new rows through the write plan, then attends through the page table
        pt, num_pages = _local_page_table(lens, page, seed=case["seed"])
        all_slots = torch.tensor([_slot(pt, b, j, page) for b, n in enumerate(lens) for j in range(n)],
                                 dtype=torch.int64)
        new_slots = torch.tensor([_slot(pt, b, p + i, page) for b, (e, p) in enumerate(zip(extend, prefix))
                                  for i in range(e)], dtype=torch.int64)
        caches = [torch.full((num_pages, page, hkv, x), float("nan")) for x in (d, dv)]  # NaN: never read
        is_new = torch.zeros(all_slots.numel(), dtype=torch.bool)
        off = 0
        for e, p in zip(extend, prefix):
            is_new[off + p : off + p + e] = True
            off += e + p
        caches[0].view(-1, hkv, d)[all_slots[~is_new]] = k_pre
        caches[1].view(-1, hkv, dv)[all_slots[~is_new]] = v_pre
        a, b = [c.clone() for c in caches], [c.clone() for c in caches]
        if kv is None:
            writes = (cpattn.plan_cache_writes(meta, new_slots, num_slots=num_pages * page) if case["slots_1d"]
                      else cpattn.plan_cache_writes(meta, pt, page_size=page, num_pages=num_pages))
        else:  # C = 1: this rank stores every new row, local key index = position
            writes = cpattn.plan_cache_writes(meta, pt, page_size=page, num_pages=num_pages)
        if case["algorithm"] in ("pass_kv", "pass_q"):
            plan = cpattn.plan_attention(meta, spec, backend=backend, algorithm=case["algorithm"], page_table=pt,
                                         num_pages=num_pages)
            assert plan.algorithm == case["algorithm"]
            assert torch.equal(plan.writes.slots, writes.slots)
            out, lse = plan.run(ql, kl, vl, tuple(a), **run_kw)
            cpattn.write_kv_cache(*s.gather_kv(kl, vl, meta), b[0], b[1], plan.writes)
            if case["algorithm"] == "pass_kv":  # the dense kernel over the packed prefix + extend
                k_ext, v_ext = s.gather_kv(kl, vl, meta)
                out_b, lse_b = plan.attend(ql, *cpattn.pack_kv(k_ext, v_ext, meta, k_pre, v_pre), **run_kw)
            else:  # pass-Q's kernel is the shard plan over every new query: checked against the oracle
                out_b, lse_b = out, lse
        else:
            plan = cpattn.plan_attention(meta, spec, backend=backend)
            assert plan.algorithm == ("shard_merge" if kv is not None else "local")
            out, lse = plan.run(ql, kl, vl, tuple(a), writes=writes, page_table=pt, **run_kw)
            if kv is None:
                cpattn.write_kv_cache(*s.gather_kv(kl, vl, meta), b[0], b[1], writes)
                out_b, lse_b = plan.attend(ql, b[0], b[1], page_table=pt, **run_kw)
            else:  # replicated queries: the local rows are the source rows; attend gives the partials
                cpattn.write_kv_cache(kl, vl, b[0], b[1], writes)
                out_p, lse_p = plan.attend(ql, b[0], b[1], page_table=pt, sinks=sk)
                out_b, lse_b = cpattn.merge_partials(out_p, lse_p, meta=meta, return_lse=True)
        for x, y in zip(a, b):
            assert torch.equal(_bits(x), _bits(y)), "run wrote another cache than the manual write"
        assert torch.equal(a[0].view(-1, hkv, d)[all_slots], k_all)  # every key at its slot
        assert torch.equal(a[1].view(-1, hkv, dv)[all_slots], v_all)
    assert torch.equal(out, out_b) and torch.equal(lse, lse_b)
    n, idx, tol = meta.num_local_tokens, meta.local_token_indices, TOLERANCE[torch.float32]
    if n:
        assert (out[:n].double() - ref[idx]).abs().max() <= tol
        assert (lse[:n].double() - ref_lse[idx]).abs().max() <= tol
    assert (out[n:] == 0).all() and torch.isneginf(lse[n:]).all()


@settings(max_examples=80, deadline=None)
@given(one_call_cases())
def test_one_call_run_equals_attend_and_oracle_torch(case):
    _check_run_equals_attend_and_oracle(case, "torch")


@settings(max_examples=10, deadline=None)
@given(one_call_cases())
def test_one_call_run_equals_attend_and_oracle_triton(interp, case):
    # no pad rows for "shard_merge": the triton shard plan leaves them unwritten (see below)
    pad = 1 if case["kv"] and case["strategy"] == "replicated" else case["pad"]
    _check_run_equals_attend_and_oracle({**case, "dv": 16, "pad": pad}, "triton")


def test_pass_q_runs_an_empty_batch():
    """An extend with no new token (every extend length 0) over a sharded cache: pass-Q, like
    pass-KV, returns an empty output and writes nothing."""
    s = cpattn.ZigzagStrategy(1)
    meta = s.build_metadata([0, 0], [3, 5], rank=0, kv=cpattn.KVSharding(1))
    spec = AttentionSpec(num_q_heads=2, num_kv_heads=1, head_dim=8, dtype=torch.float32, page_size=4)
    pt, num_pages = _local_page_table([3, 5], 4)
    caches = [torch.randn(num_pages, 4, 1, 8) for _ in range(2)]
    before = [_bits(c) for c in caches]
    rows = torch.zeros(meta.num_physical_tokens, 2, 8), torch.zeros(meta.num_physical_tokens, 1, 8)
    for algorithm in ("pass_kv", "pass_q"):
        plan = cpattn.plan_attention(meta, spec, algorithm=algorithm, page_table=pt, num_pages=num_pages)
        out = plan.run(rows[0], rows[1], rows[1], tuple(caches))
        assert out.shape == (meta.num_physical_tokens, 2, 8)
        assert all(torch.equal(_bits(c), b) for c, b in zip(caches, before))


def test_triton_shard_plan_writes_pad_rows(interp):
    """Replicated queries with pad rows (pad_multiple 8) over a sharded cache: the shard kernel's
    partial output has pad rows 0 and lse -inf, into engine buffers holding garbage, as the torch
    backend's does. (Short sequences: no split, so the combine, which would read its per-row
    tables past their end for pad rows, does not run.)"""
    meta = cpattn.get_strategy("replicated", 1, pad_multiple=8).build_metadata([0, 1], [0, 2], rank=0,
                                                                                kv=cpattn.KVSharding(1))
    spec = AttentionSpec(num_q_heads=4, num_kv_heads=4, head_dim=16, dtype=torch.float32, page_size=4)
    pt = torch.tensor([[1], [0]], dtype=torch.int32)
    kc, vc = torch.randn(2, 4, 4, 16), torch.randn(2, 4, 4, 16)
    q = torch.randn(meta.num_physical_tokens, 4, 16)
    n = meta.num_local_tokens
    assert (n, meta.num_physical_tokens) == (1, 8)
    for backend in ("torch", "triton"):
        plan = cpattn.plan_attention(meta, spec, backend=backend)
        out = torch.full((8, 4, 16), float("nan"))
        lse = torch.full((8, 4), float("nan"))
        plan.attend(q, kc, vc, page_table=pt, out=out, lse=lse)
        assert torch.isfinite(out[:n]).all() and torch.isfinite(lse[:n]).all()
        assert (out[n:] == 0).all() and torch.isneginf(lse[n:]).all(), backend


@settings(max_examples=60, deadline=None)
@given(batches(max_seqs=4, max_len=30), st.sampled_from(PLACEMENTS), st.booleans(), st.sampled_from([1, 2, 4]),
       st.booleans(), st.integers(0, 2**16))
def test_plan_cache_writes_page_table_equals_slots(batch, strategy, sharded, page, static, seed):
    """``plan_cache_writes`` from a page table and from the equivalent 1-D slots (the page-table
    rule applied by hand: slot = table[b, j // page_size] * page_size + j % page_size, j the
    position for a replicated cache, the local key index for a sharded one) give the same plan:
    the same slots, source rows and counts; for a replicated cache every extend token in logical
    order, for a sharded cache the rows this rank stores (by ``KVSharding.owner``). Static plans
    (padded to the capacity) too."""
    cp, extend, prefix, pad = batch
    rank = seed % cp
    interleave = page if seed % 3 == 0 else 1  # the page size must be a multiple of the interleave
    kv = cpattn.KVSharding(cp, interleave) if sharded else None
    s = cpattn.get_strategy(strategy, cp, pad_multiple=pad)
    if static:
        planner = cpattn.StaticPlanner(s, max_tokens=sum(extend) + 3, max_seqs=len(extend) + 1,
                                       max_kv_tokens=sum(extend) + sum(prefix) + 3, device="cpu", kv=kv)
        meta = planner.plan(extend, prefix, rank=rank)
    else:
        meta = s.build_metadata(extend, prefix, rank=rank, kv=kv)
    lens = [e + p for e, p in zip(extend, prefix)]
    keys = kv.local_lengths(lens, rank).tolist() if sharded else lens
    pt, num_pages = _local_page_table(keys, page, seed=seed)
    if static:  # a static plan's table has a row per sequence of the capacity (the rest: the spare page)
        pt = torch.cat([pt, pt.new_full((meta.num_seq_rows - pt.shape[0], pt.shape[1]), num_pages - 1)])
    slot_of, t = {}, 0  # logical row -> slot, of the rows this rank writes
    for b, (e, p) in enumerate(zip(extend, prefix)):
        for pos in range(p, p + e):
            if kv is None or kv.owner(pos) == rank:
                slot_of[t] = _slot(pt, b, pos if kv is None else kv.local_index(pos), page)
            t += 1
    pad_slot = (num_pages - 1) * page if static else None  # a slot of the spare page: never a key's
    from_table = cpattn.plan_cache_writes(meta, pt, page_size=page, num_pages=num_pages, pad_slot=pad_slot)
    rows = list(slot_of) if kv is None else meta.store_rows[: from_table.num_writes].tolist()
    junk = [10**6, -1]  # entries past the rows written are ignored
    slots = torch.tensor([slot_of[r] for r in rows] + junk, dtype=torch.int64 if seed % 2 else torch.int32)
    from_slots = cpattn.plan_cache_writes(meta, slots, num_slots=num_pages * page, pad_slot=pad_slot)
    assert from_table.num_writes == from_slots.num_writes == len(slot_of)
    n = from_table.num_writes
    written = from_table.slots[:n].tolist()
    got_rows = list(range(n)) if from_table.rows is None else from_table.rows[:n].tolist()
    assert dict(zip(got_rows, written)) == slot_of  # each row goes to its slot through the table
    for a, b in ((from_table.slots, from_slots.slots), (from_table.rows, from_slots.rows)):
        assert (a is None and b is None) or torch.equal(a, b)
    assert (from_table.num_source_rows, from_table.num_slots) == (from_slots.num_source_rows, num_pages * page)
    assert from_table.num_source_rows == (meta.num_physical_tokens if strategy == "replicated" and sharded
                                          else meta.num_token_rows)
    if static:
        assert from_table.slots.numel() == from_table.num_source_rows  # padded to the capacity rows


def _bad_call_case(algorithm: str):
    """(plan, good run arguments, caches) of a small single-process paged forward for
    ``algorithm`` ("local": zigzag over a replicated cache; "shard_merge": a decode step over a
    sharded cache; "pass_kv" / "pass_q": an extend over a sharded cache)."""
    queries = "replicated" if algorithm == "shard_merge" else "zigzag"
    ext, pre = ([1, 2], [6, 3]) if queries == "replicated" else ([5, 3], [2, 4])
    kv = None if algorithm == "local" else cpattn.KVSharding(1)
    s = cpattn.get_strategy(queries, 1)
    meta = s.build_metadata(ext, pre, rank=0, kv=kv)
    spec = AttentionSpec(num_q_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, page_size=4)
    pt, num_pages = _local_page_table([e + p for e, p in zip(ext, pre)], 4, seed=3)
    extra = dict(page_table=pt, num_pages=num_pages) if algorithm.startswith("pass") else {}
    plan = cpattn.plan_attention(meta, spec, algorithm=algorithm, **extra)
    g = torch.Generator().manual_seed(0)
    caches = (torch.randn(num_pages, 4, 2, 8, generator=g), torch.randn(num_pages, 4, 2, 8, generator=g))
    p = meta.num_physical_tokens
    q, k, v = torch.randn(p, 4, 8, generator=g), torch.randn(p, 2, 8, generator=g), torch.randn(p, 2, 8, generator=g)
    writes = None if algorithm.startswith("pass") else cpattn.plan_cache_writes(meta, pt, page_size=4,
                                                                                 num_pages=num_pages)
    args = dict(q=q, k=k, v=v, cache=caches, writes=writes, page_table=None if extra else pt)
    return plan, args, caches, meta, pt, num_pages


def _run(plan, a):
    return plan.run(a["q"], a["k"], a["v"], a["cache"], writes=a["writes"], page_table=a["page_table"])


@pytest.mark.parametrize("algorithm", ["local", "shard_merge", "pass_kv", "pass_q"])
def test_run_rejects_a_bad_write_plan_or_cache_before_writing(algorithm):
    """``plan.run`` checks its write plan, caches and new rows before the collective and the
    write: every rejected call raises ValueError / TypeError naming the argument and leaves both
    caches bit-identical; the good call then writes."""
    plan, good, caches, meta, pt, num_pages = _bad_call_case(algorithm)
    kc, vc = caches
    other = cpattn.get_strategy("replicated" if algorithm == "shard_merge" else "zigzag", 1).build_metadata(
        [2, 2], [0, 0], rank=0, kv=meta.kv)  # a forward of another batch
    cases = [  # (change, exception, message)
        (dict(q=good["q"][:-1]), ValueError, "must be this rank's new rows"),
        (dict(k=good["k"].double()), TypeError, "k dtype torch.float64 != the plan's dtype"),
        (dict(cache=(kc,)), TypeError, "cache must be a pair"),
        (dict(cache=[kc, "v"]), TypeError, "cache must be a pair"),
    ]
    if algorithm in ("local", "shard_merge"):
        wrong_pages = cpattn.plan_cache_writes(meta, pt, page_size=4, num_pages=num_pages + 1)
        new_rows = good["writes"].num_source_rows
        bad_slot = torch.arange(new_rows)
        bad_slot[-1] = num_pages * 4
        dup = torch.zeros(new_rows, dtype=torch.int64)
        cases += [
            (dict(writes=wrong_pages), ValueError, f"slots was planned for num_slots={(num_pages + 1) * 4} but "
                                                   f"k_cache has {num_pages * 4} slots"),
            (dict(writes=cpattn.plan_cache_writes(other, torch.arange(4), num_slots=num_pages * 4)), ValueError,
             rf"slots plans \d+ source rows but k has {new_rows} rows"),
            (dict(writes=bad_slot), ValueError, rf"slots\[{new_rows - 1}\] = {num_pages * 4} is out of range"),
            (dict(writes=dup if new_rows > 1 else bad_slot), ValueError, "duplicate entries|out of range"),
            (dict(writes=bad_slot[:-1]), ValueError, f"slots has {new_rows - 1} entries but k has {new_rows} rows"),
            (dict(writes=[0, 1]), TypeError, "slots must be a torch.Tensor or a CacheWritePlan"),
            (dict(cache=(kc, vc.half())), TypeError, "v_cache dtype torch.float16"),
            (dict(cache=(kc, vc[:-1])), ValueError, "differ in pages / slots"),
            (dict(cache=(kc, vc[:1].expand(vc.shape))), ValueError, "v_cache has overlapping memory"),
            (dict(cache=(kc[..., :1, :], vc)), ValueError, r"k_cache rows are \[1, 8\], expected \[2, 8\]"),
            (dict(page_table=pt[:1]), ValueError, r"page_table must be \[B=2, max_pages\]"),
            (dict(page_table=None), ValueError, "pass page_table"),
        ]
        if algorithm == "local":
            cases.append((dict(writes=None), ValueError, "writes= is required with a paged cache"))
    else:  # pass-KV / pass-Q write through the plan's own writes, planned from its page table
        cases += [
            (dict(writes=cpattn.plan_cache_writes(meta, pt, page_size=4, num_pages=num_pages)), ValueError,
             "writes= of a pass-KV / pass-Q plan are planned from its page table"),
            (dict(cache=(kc[:-1], vc[:-1])), ValueError, "k_cache must be"),
            (dict(cache=(kc, vc.half())), ValueError, "v_cache must be torch.float32"),
        ]
    pristine = [_bits(c) for c in caches]
    for change, exc, match in cases:
        with pytest.raises(exc, match=match):
            _run(plan, {**good, **change})
        assert all(torch.equal(_bits(c), b) for c, b in zip(caches, pristine)), f"{change}: a cache was written"
    out = _run(plan, good)
    assert out.shape == (meta.num_physical_tokens, 4, 8) and torch.isfinite(out[: meta.num_local_tokens]).all()
    assert not all(torch.equal(_bits(c), b) for c, b in zip(caches, pristine))  # the good call wrote


def test_packed_run_takes_no_write_plan():
    """A packed plan's run reads the prefix from ``cache=`` and writes nothing: ``writes=`` is
    refused (ValueError), before any work."""
    s = cpattn.ZigzagStrategy(1)
    meta = s.build_metadata([3], [2], rank=0)
    spec = AttentionSpec(num_q_heads=2, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    plan = cpattn.plan_attention(meta, spec)
    rows = torch.zeros(3, 2, 8), torch.zeros(3, 1, 8)
    prefix = torch.zeros(2, 1, 8), torch.zeros(2, 1, 8)
    writes = cpattn.plan_cache_writes(meta, torch.arange(3), num_slots=8)
    with pytest.raises(ValueError, match="writes= is for a paged cache"):
        plan.run(rows[0], rows[1], rows[1], prefix, writes=writes)
    with pytest.raises(ValueError, match="page_table given but the plan is for packed K/V"):
        plan.run(rows[0], rows[1], rows[1], prefix, page_table=torch.zeros(1, 1, dtype=torch.int32))
    assert plan.run(rows[0], rows[1], rows[1], prefix).shape == (3, 2, 8)


@pytest.mark.parametrize("what", ["page_table columns", "page_table dtype", "page_table dims", "sinks", "out",
                                  "lse"])
@pytest.mark.parametrize("algorithm", ["local", "shard_merge"])
def test_run_checks_page_table_sinks_and_buffers_before_writing(algorithm, what):
    """Like a bad write plan, a bad page table (too few pages, float, 3-D), ``sinks``, ``out`` or
    ``lse`` raises before the cache write (the docstring: every check runs before the collective
    and the write; the caches are unchanged when one fails)."""
    plan, good, caches, meta, pt, num_pages = _bad_call_case(algorithm)
    p = meta.num_physical_tokens
    kw = {"page_table columns": dict(page_table=pt[:, :1]), "page_table dtype": dict(page_table=pt.float()),
          "page_table dims": dict(page_table=pt[:, None]), "sinks": dict(page_table=pt, sinks=torch.zeros(4)),
          "out": dict(page_table=pt, out=torch.zeros(p, 4, 3)), "lse": dict(page_table=pt, lse=torch.zeros(p, 3))}[what]
    if algorithm == "shard_merge" and what in ("out", "lse"):
        kw = dict(page_table=pt, sinks=torch.zeros(4))  # its run takes no out / lse
    before = [_bits(c) for c in caches]
    with pytest.raises((ValueError, TypeError)):
        plan.run(good["q"], good["k"], good["v"], good["cache"], writes=good["writes"], **kw)
    assert all(torch.equal(_bits(c), b) for c, b in zip(caches, before)), f"{what}: a cache was written"


class _EmulatedGroup:
    """C ranks in one process for ``plan.run``'s all-gather: a first pass records each rank's
    packed send buffer (and stops before the write), a second pass hands every rank the
    concatenation, as ``all_gather_into_tensor`` would; counts the collectives."""

    class Recorded(Exception):
        pass

    def __init__(self, monkeypatch, cp_size: int):
        import cpattn.collectives as collectives
        import cpattn.strategies.base as strategies

        self.cp_size, self.sent, self.rank, self.calls = cp_size, {}, 0, 0
        monkeypatch.setattr(collectives, "all_gather_into", self._all_gather_into)
        for module in (collectives, strategies):  # no process group: every rank is this process
            monkeypatch.setattr(module, "check_group", lambda meta, group: None)

    def _all_gather_into(self, output, input, group, async_op=False):
        self.calls += 1
        if len(self.sent) < self.cp_size:
            self.sent[self.rank] = input.clone()
            raise self.Recorded
        output.copy_(torch.cat([self.sent[r] for r in range(self.cp_size)]))
        return None


@pytest.mark.parametrize("strategy", ["zigzag", "interleave", "contiguous"])
@pytest.mark.parametrize("page", [None, 4])
def test_gather_kv_run_on_two_emulated_ranks(monkeypatch, strategy, page):
    """"gather_kv" at C = 2 (two ranks emulated in one process): each rank's ``plan.run`` does
    ONE all-gather of the new K/V, writes every new row into its replicated cache (paged) or packs
    them after the prefix (packed), and equals ``plan.attend`` after the manual gather + write;
    the ranks' caches end up identical and every local row equals the fp64 oracle."""
    ext, pre = [11, 0, 1, 6], [3, 4, 0, 9]
    cp, hq, hkv, d = 2, 4, 2, 8
    s = cpattn.get_strategy(strategy, cp, pad_multiple=4)
    metas = [s.build_metadata(ext, pre, rank=r) for r in range(cp)]
    spec = AttentionSpec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.float32, window_size=(5, 0),
                         page_size=page, has_sinks=True)
    g = torch.Generator().manual_seed(7)
    t, n_pre, lens = sum(ext), sum(pre), [e + p for e, p in zip(ext, pre)]
    q, k_new, v_new = torch.randn(t, hq, d, generator=g), torch.randn(t, hkv, d, generator=g), torch.randn(
        t, hkv, d, generator=g)
    k_pre, v_pre, sk = torch.randn(n_pre, hkv, d, generator=g), torch.randn(n_pre, hkv, d, generator=g), torch.randn(
        hq, generator=g)
    k_all, v_all, a, b = [], [], 0, 0
    for e, p in zip(ext, pre):
        k_all += [k_pre[b : b + p], k_new[a : a + e]]
        v_all += [v_pre[b : b + p], v_new[a : a + e]]
        a, b = a + e, b + p
    k_all, v_all = torch.cat(k_all), torch.cat(v_all)
    ref, ref_lse = _explicit_mask_oracle(q, k_all, v_all, ext, pre, window_left=5, sinks=sk)
    group = _EmulatedGroup(monkeypatch, cp)
    if page is not None:
        pt, num_pages = _local_page_table(lens, page, seed=1)
        slots = torch.tensor([_slot(pt, i, j, page) for i, n in enumerate(lens) for j in range(n)])
        is_new = torch.cat([torch.arange(n) >= p for n, p in zip(lens, pre)])
        cache0 = [torch.full((num_pages, page, hkv, d), float("nan")) for _ in range(2)]
        cache0[0].view(-1, hkv, d)[slots[~is_new]] = k_pre
        cache0[1].view(-1, hkv, d)[slots[~is_new]] = v_pre
    rank_caches = []
    for phase in ("record", "run"):
        for r, meta in enumerate(metas):
            group.rank = r
            plan = cpattn.plan_attention(meta, spec)
            assert plan.algorithm == "gather_kv"
            ql, kl, vl = s.shard(q, meta), s.shard(k_new, meta), s.shard(v_new, meta)
            if page is None:
                cache, kw = (k_pre, v_pre), {}
            else:
                cache = tuple(c.clone() for c in cache0)
                kw = dict(writes=cpattn.plan_cache_writes(meta, pt, page_size=page, num_pages=num_pages),
                          page_table=pt)
            if phase == "record":
                with pytest.raises(_EmulatedGroup.Recorded):
                    plan.run(ql, kl, vl, cache, sinks=sk, **kw)
                if page is not None:  # stopped at the collective: nothing written
                    assert all(torch.equal(_bits(c), _bits(c0)) for c, c0 in zip(cache, cache0))
                continue
            calls = group.calls
            out, lse = plan.run(ql, kl, vl, cache, sinks=sk, return_lse=True, **kw)
            assert group.calls == calls + 1  # ONE all-gather
            k_ext, v_ext = s.gather_kv(kl, vl, meta)  # the manual gather (the same emulated collective)
            assert torch.equal(k_ext, k_new) and torch.equal(v_ext, v_new)
            if page is None:
                out_b, lse_b = plan.attend(ql, *cpattn.pack_kv(k_ext, v_ext, meta, k_pre, v_pre), sinks=sk,
                                           return_lse=True)
            else:
                manual = [c.clone() for c in cache0]
                cpattn.write_kv_cache(k_ext, v_ext, manual[0], manual[1], kw["writes"])
                assert all(torch.equal(_bits(x), _bits(y)) for x, y in zip(cache, manual))
                assert torch.equal(cache[0].view(-1, hkv, d)[slots], k_all)
                rank_caches.append(cache)
                out_b, lse_b = plan.attend(ql, *manual, page_table=pt, sinks=sk, return_lse=True)
            assert torch.equal(out, out_b) and torch.equal(lse, lse_b)
            n, idx = meta.num_local_tokens, meta.local_token_indices
            assert (out[:n].double() - ref[idx]).abs().max() <= TOLERANCE[torch.float32]
            assert (lse[:n].double() - ref_lse[idx]).abs().max() <= TOLERANCE[torch.float32]
            assert (out[n:] == 0).all() and torch.isneginf(lse[n:]).all()
    if page is not None:  # every rank's replicated cache holds the same keys
        assert all(torch.equal(_bits(x), _bits(y)) for x, y in zip(*rank_caches))
