"""Shard attention (each rank's keys of a sharded cache) + the exact merge == full attention.

fp64 oracles written here: full attention through tests/oracle.py (decode = extend of q_len
tokens over a prefix of seq_len - q_len keys) and a per-rank oracle with an explicit mask over
the rank's positions ``{p : (p // I) % C == r}``. The torch reference and the real Triton
split-KV kernel (interpreter on CPU; small shapes) run over packed and paged local caches whose
unused slots hold NaN. GPU tests (``-m gpu``) at 128k keys and CUDA-graph replay are at the end.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpattn
from oracle import TOLERANCE, attention_oracle

CUDA = torch.cuda.is_available()
MANY_SPLITS = {"num_sms": 64, "min_split": 16}  # interpreter: force several splits per sequence


def _owned(length, c, i, r):
    return [p for p in range(length) if (p // i) % c == r]


def _decode(sh, seq_lens, q_lens=None, *, rank):
    """A decode step's plan: the "replicated" strategy over the last q_len (default 1) positions
    of sequences of ``seq_lens`` keys (new tokens included), keys sharded by ``sh``."""
    ql = [1] * len(seq_lens) if q_lens is None else list(q_lens)
    pre = [n - q for n, q in zip(seq_lens, ql)]
    return cpattn.get_strategy("replicated", sh.cp_size).build_metadata(ql, pre, rank=rank, kv=sh)


def _static_decode_planner(sh, *, max_seqs, max_q_len, max_kv_tokens, device, max_tokens=None):
    """A StaticPlanner of decode steps (replicated queries, keys sharded by ``sh``): at most
    ``max_seqs`` sequences of q_len <= ``max_q_len``, query rows ``max_tokens`` (default
    max_seqs * max_q_len), ``max_kv_tokens`` >= sum(seq_lens)."""
    rows = max_seqs * max_q_len if max_tokens is None else max_tokens
    return cpattn.StaticPlanner(cpattn.get_strategy("replicated", sh.cp_size), max_tokens=rows, max_seqs=max_seqs,
                                max_kv_tokens=max_kv_tokens, max_q_len=max_q_len, kv=sh, device=device)


def _plan(dmeta, *, backend="auto", backend_options=None, **spec):
    """The "shard_merge" plan of a decode step (replicated queries over a sharded cache):
    ``cpattn.plan_attention(meta, cpattn.AttentionSpec(**spec))``; ``plan.attend`` is the kernel."""
    plan = cpattn.plan_attention(dmeta, cpattn.AttentionSpec(**spec), backend=backend,
                                 backend_options=backend_options)
    assert plan.algorithm == "shard_merge" and isinstance(plan, cpattn.AttentionPlan)
    return plan


def _inputs(seq_lens, q_lens, hq, hkv, d, dv, dtype, seed, mla=False):
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, hkv, d, generator=g).to(dtype) for n in seq_lens]
    vals = [k[..., :dv] if mla else torch.randn(n, hkv, dv, generator=g).to(dtype) for k, n in zip(keys, seq_lens)]
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    sinks = torch.randn(hq, generator=g)
    return q, keys, vals, sinks


def _local_cache(keys, vals, seq_lens, c, i, r, page_size, mla, g, hkv, d, dv, dtype):
    """This rank's keys: packed rows (+ NaN rows after) or shuffled pages (unused slots NaN)."""
    local_k = [k[_owned(n, c, i, r)] for k, n in zip(keys, seq_lens)]
    local_v = [v[_owned(n, c, i, r)] for v, n in zip(vals, seq_lens)]
    if page_size is None:
        kc = torch.cat(local_k + [torch.full((3, hkv, d), float("nan"), dtype=dtype)])
        vc = kc[..., :dv] if mla else torch.cat(local_v + [torch.full((3, hkv, dv), float("nan"), dtype=dtype)])
        return kc, vc, None
    pages = [-(-lk.shape[0] // page_size) for lk in local_k]
    num_pages = sum(pages) + 2
    perm = torch.randperm(num_pages, generator=g)
    table = torch.zeros(len(local_k), max(pages + [1]), dtype=torch.int32)
    kc = torch.full((num_pages, page_size, hkv, d), float("nan"), dtype=dtype)
    vc = None if mla else torch.full((num_pages, page_size, hkv, dv), float("nan"), dtype=dtype)
    off = 0
    for b, (lk, lv) in enumerate(zip(local_k, local_v)):
        table[b, : pages[b]] = perm[off : off + pages[b]].int()
        off += pages[b]
        j = torch.arange(lk.shape[0])
        kc[table[b, j // page_size].long(), j % page_size] = lk
        if not mla:
            vc[table[b, j // page_size].long(), j % page_size] = lv
    return kc, (kc[..., :dv] if mla else vc), table


def _rank_oracle(q, keys, vals, seq_lens, q_lens, c, i, r, window, sinks, scale):
    """fp64 partial (out, lse) of rank r: explicit mask over its own positions."""
    hq, hkv, dv = q.shape[1], keys[0].shape[1] if keys else 1, vals[0].shape[-1] if vals else 1
    out = torch.zeros(q.shape[0], hq, dv, dtype=torch.float64)
    lse = torch.full((q.shape[0], hq), float("-inf"), dtype=torch.float64)
    row = 0
    for b, (n, ql) in enumerate(zip(seq_lens, q_lens)):
        mine = torch.tensor(_owned(n, c, i, r), dtype=torch.int64)
        for t in range(ql):
            p = n - ql + t
            vis = mine <= p
            if window >= 0:
                vis &= mine >= p - window
            kk = keys[b][mine[vis]].double()  # [n_vis, Hkv, D]
            vv = vals[b][mine[vis]].double()
            qq = q[row].double().view(hkv, hq // hkv, -1)
            s = torch.einsum("hgd,nhd->hgn", qq, kk).reshape(hq, -1) * scale  # [Hq, n_vis], head h -> KV h // g
            if sinks is not None and r == 0:
                s = torch.cat([s, sinks[:, None].double()], 1)
            if s.shape[1]:
                l_ = torch.logsumexp(s, 1)
                pr = torch.exp(s - l_[:, None])[:, : int(vis.sum())].view(hkv, hq // hkv, -1)
                out[row] = torch.einsum("hgn,nhd->hgd", pr, vv).reshape(hq, -1)
                lse[row] = l_
            row += 1
    return out, lse


def _check(c, i, seq_lens, q_lens, *, hq=4, hkv=2, d=16, dv=None, dtype=torch.float32, window=-1, sinks=False,
           page_size=None, backend="torch", options=None, seed=0, mla=False, device="cpu"):
    dv = dv or d
    q, keys, vals, sk = _inputs(seq_lens, q_lens, hq, hkv, d, dv, dtype, seed, mla)
    sk = sk if sinks else None
    scale = d**-0.5
    g = torch.Generator().manual_seed(seed + 1)
    sh = cpattn.KVSharding(c, interleave=i)
    outs, lses = [], []
    for r in range(c):
        dmeta = _decode(sh, seq_lens, q_lens, rank=r).to(device)
        kc, vc, table = _local_cache(keys, vals, seq_lens, c, i, r, page_size, mla, g, hkv, d, dv, dtype)
        if mla:
            kc = kc.to(device)
            vc = kc[..., :dv]
        else:
            kc, vc = kc.to(device), vc.to(device)
        plan = _plan(dmeta, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv,
                     dtype=dtype, window_size=(window, 0), page_size=page_size,
                     has_sinks=sinks, backend=backend, backend_options=options)
        out, lse = plan.attend(q.to(device), kc, vc, page_table=None if table is None else table.to(device),
                               sinks=None if sk is None else sk.to(device))
        out, lse = out.cpu(), lse.cpu()
        ref, ref_lse = _rank_oracle(q, keys, vals, seq_lens, q_lens, c, i, r, window, sk, scale)
        tol = TOLERANCE[dtype]
        assert (out.double() - ref).abs().max() <= tol if out.numel() else True
        fin = torch.isfinite(ref_lse)
        assert torch.equal(torch.isneginf(lse), ~fin)  # no visible key (and no sink): exactly -inf ...
        assert (out[~fin] == 0).all()  # ... and out 0
        assert (lse[fin].double() - ref_lse[fin]).abs().max() <= tol if fin.any() else True
        outs.append(out)
        lses.append(lse)
    merged, merged_lse = cpattn.merge_states(torch.stack(outs), torch.stack(lses))
    k_all = torch.cat(keys) if keys else torch.zeros(0, hkv, d)
    v_all = torch.cat(vals) if vals else torch.zeros(0, hkv, dv)
    pre = [n - ql for n, ql in zip(seq_lens, q_lens)]
    full, full_lse = attention_oracle(q, k_all, v_all, q_lens, pre, window_left=window, sinks=sk)
    assert not merged.isnan().any()
    if merged.numel():
        assert (merged.double() - full).abs().max() <= TOLERANCE[dtype]
        fin = torch.isfinite(full_lse)
        assert (merged_lse[fin].double() - full_lse[fin]).abs().max() <= TOLERANCE[dtype] if fin.any() else True


@st.composite
def decode_batches(draw, max_len=300, max_seqs=4):
    c = draw(st.integers(1, 8))
    page = draw(st.sampled_from([None, 4, 16]))
    inter = draw(st.sampled_from([1, 4] + ([page] if page else [])))
    if page is not None and page % inter:
        inter = 1
    n = draw(st.integers(0, max_seqs))
    lens = draw(st.lists(st.one_of(st.integers(0, 2 * c), st.integers(0, max_len)), min_size=n, max_size=n))
    q_lens = [min(n_, draw(st.integers(1, 4))) for n_ in lens]
    return c, inter, page, lens, q_lens


HEADS = [(4, 2), (4, 1), (2, 2)]


@settings(max_examples=50, deadline=None)
@given(decode_batches(), st.sampled_from(HEADS), st.sampled_from([-1, 0, 7]), st.booleans(), st.integers(0, 99))
def test_shard_attention_and_merge_equal_full_attention_torch(batch, heads, window, sinks, seed):
    c, inter, page, lens, q_lens = batch
    _check(c, inter, lens, q_lens, hq=heads[0], hkv=heads[1], window=window, sinks=sinks, page_size=page,
           seed=seed)


@settings(max_examples=10, deadline=None)
@given(decode_batches(max_len=150, max_seqs=3), st.sampled_from(HEADS), st.sampled_from([-1, 7]), st.booleans(),
       st.sampled_from([None, MANY_SPLITS]), st.integers(0, 99))
def test_shard_attention_and_merge_equal_full_attention_triton(interp, batch, heads, window, sinks, options, seed):
    c, inter, page, lens, q_lens = batch
    _check(c, inter, lens, q_lens, hq=heads[0], hkv=heads[1], window=window, sinks=sinks, page_size=page,
           backend="triton", options=options, seed=seed)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("page_size", [None, 8])
def test_mla_absorbed_v_is_a_view_of_k(request, backend, page_size):
    """MLA's absorbed form: one latent KV head, D = Dv + rope, v = k[..., :Dv] (read once)."""
    options = None
    if backend == "triton":
        request.getfixturevalue("interp")
        options = MANY_SPLITS
    _check(3, 1, [90, 7, 33], [1, 2, 4], hq=8, hkv=1, d=48, dv=32, page_size=page_size, backend=backend,
           options=options, seed=4, mla=True, sinks=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_half_precision(interp, dtype):
    _check(2, 1, [120, 17], [3, 1], dtype=dtype, page_size=16, backend="triton", options=MANY_SPLITS, seed=2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_many_query_rows_per_sequence(request, backend):
    """pass-Q extends run shard attention with all new tokens as queries: several query tiles
    per sequence (tile rows > 0), windows and splits."""
    options = None
    if backend == "triton":
        request.getfixturevalue("interp")
        options = MANY_SPLITS
    _check(3, 1, [90, 40, 7, 0], [40, 33, 7, 0], window=11, sinks=True, page_size=4, backend=backend,
           options=options, seed=5)
    _check(2, 4, [70, 21], [70, 9], backend=backend, options=options, seed=6)


def test_triton_plan_splits_long_sequences(interp):
    """One long sequence is cut into many splits (one program per split and head group), a short
    batch keeps one split per sequence (no combine pass)."""
    sh = cpattn.KVSharding(1)
    long = _plan(_decode(sh, [4000], rank=0), num_q_heads=4, num_kv_heads=2,
                 head_dim=16, dtype=torch.float32, backend="triton",
                 backend_options={"num_sms": 32})
    assert long._impl.num_items >= 32 and long._impl.run_combine
    short = _plan(_decode(sh, [20] * 64, rank=0), num_q_heads=4,
                  num_kv_heads=2, head_dim=16, dtype=torch.float32, backend="triton")
    assert short._impl.num_items == 64 and not short._impl.run_combine


def test_rank_with_no_keys_contributes_zero_and_minus_inf():
    """C = 8 and sequences shorter than C: most ranks hold no key of a sequence -> (0, -inf),
    sinks only on rank 0, and the merge is finite."""
    _check(8, 1, [1, 3, 0, 5], [1, 2, 0, 4], sinks=True, page_size=4)
    dmeta = _decode(cpattn.KVSharding(8), [3], rank=5)
    plan = _plan(dmeta, num_q_heads=2, num_kv_heads=1, head_dim=8, dtype=torch.float32, has_sinks=True,
                 backend="torch")
    out, lse = plan.attend(torch.randn(1, 2, 8), torch.zeros(0, 1, 8), torch.zeros(0, 1, 8), sinks=torch.randn(2))
    assert (out == 0).all() and torch.isneginf(lse).all()  # rank 5 holds nothing, and sinks live on rank 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_static_decode_plans_same_addresses_same_results(request, backend):
    if backend == "triton":
        request.getfixturevalue("interp")
    sh = cpattn.KVSharding(2, interleave=2)
    planner = _static_decode_planner(sh, max_seqs=3, max_q_len=2, max_kv_tokens=80, device="cpu")
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, ps = 4, 2, 16, 4
    num_pages = 40
    kc = torch.randn(num_pages, ps, hkv, d, generator=g)
    vc = torch.randn(num_pages, ps, hkv, d, generator=g)
    table = torch.randperm(num_pages, generator=g)[:30].view(3, 10).int()
    q = torch.randn(6, hq, d, generator=g)
    ptrs = grid = None
    for seq, ql in (([30, 9], [1, 2]), ([50, 1, 22], [2, 1, 2]), ([3], [1])):
        dmeta = planner.plan(ql, [n - q for n, q in zip(seq, ql)], rank=1)
        plan = _plan(dmeta, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.float32,
                     page_size=ps, backend=backend, backend_options=MANY_SPLITS if
                     backend == "triton" else None)
        out, lse = plan.attend(q, kc, vc, page_table=table)
        fresh = _decode(sh, seq, ql, rank=1)
        nq = fresh.num_local_tokens
        ref, ref_lse = _plan(fresh, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.float32, page_size=ps,
                             backend="torch").attend(q[:nq], kc, vc, page_table=table[: len(seq)])
        assert torch.allclose(out[:nq], ref, atol=1e-5) and torch.allclose(lse[:nq], ref_lse, atol=1e-5)
        assert (out[nq:] == 0).all() and torch.isneginf(lse[nq:]).all()
        if backend == "triton":
            now = {k: v.data_ptr() for k, v in plan._impl.plan_args.items() if isinstance(v, torch.Tensor)}
            now.update(ws_o=plan._impl._ws.o.data_ptr(), ws_lse=plan._impl._ws.lse.data_ptr())  # the workspace too
            ptrs = ptrs or now
            grid = grid or (plan._impl.grid, plan._impl.combine_grid, plan._impl.ws_shape)
            assert now == ptrs and (plan._impl.grid, plan._impl.combine_grid, plan._impl.ws_shape) == grid


def test_shard_plan_rejects_bad_inputs():
    sh = cpattn.KVSharding(2, interleave=2)
    dmeta = _decode(sh, [9, 4], [2, 1], rank=0)
    q = torch.zeros(3, 4, 8)
    plan = _plan(dmeta, num_q_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                 page_size=4, has_sinks=True, backend="torch")
    kc = torch.zeros(6, 4, 2, 8)
    pt = torch.zeros(2, 2, dtype=torch.int32)
    sinks = torch.zeros(4)
    cases = [
        (dict(q=q[:2]), ValueError, r"q must be \[Nq, Hq, D\]"),
        (dict(page_table=None), ValueError, "pass page_table"),
        (dict(page_table=pt[:, :1]), ValueError, "fewer than this rank's longest shard"),
        (dict(page_table=pt[:1]), ValueError, r"page_table must be \[B=2"),
        (dict(k_cache=kc[:, :2]), ValueError, r"k / v must be \[num_pages, 4, 2, 8\]"),
        (dict(v_cache=kc[:5]), ValueError, r"k / v must be \[num_pages, 4, 2, 8\]"),  # fewer pages than k_cache
        (dict(sinks=None), ValueError, "has_sinks=True"),
        (dict(q=q.double()), TypeError, "q dtype"),
        (dict(out=torch.zeros(3, 4, 4)), ValueError, "out must be"),
    ]
    for change, exc, match in cases:
        args = dict(q=q, k_cache=kc, v_cache=kc, page_table=pt, sinks=sinks)
        args.update(change)
        with pytest.raises(exc, match=match):
            plan.attend(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), **args)
    with pytest.raises(ValueError, match="page_size=3 must be a multiple of the KV sharding's interleave=2"):
        _plan(dmeta, num_q_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, page_size=3)
    spec = cpattn.AttentionSpec(num_q_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    with pytest.raises(TypeError, match="meta must be a CPMetadata"):
        cpattn.plan_attention(object(), spec)
    not_shard = [cpattn.ZigzagStrategy(2).build_metadata([3], rank=0),  # sharded queries
                 cpattn.ZigzagStrategy(2).build_metadata([3], rank=0, kv=sh),
                 cpattn.get_strategy("replicated", 2).build_metadata([2, 1], [7, 3], rank=0)]  # replicated cache
    for meta in not_shard:  # "shard_merge" needs replicated queries and a sharded KV cache
        with pytest.raises(ValueError, match="algorithm 'shard_merge' cannot run"):
            cpattn.plan_attention(meta, spec, algorithm="shard_merge")
    # packed local keys: at least this rank's local key rows (9 and 4 keys at C=2, I=2 -> 5 + 2)
    packed_plan = cpattn.plan_attention(dmeta, spec, backend="torch")
    assert packed_plan.algorithm == "shard_merge"
    with pytest.raises(ValueError, match="packed k / v must have >= 7 rows"):
        packed_plan.attend(q, torch.zeros(2, 2, 8), torch.zeros(2, 2, 8))
    kp, vp = torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    packed = packed_plan.attend(q, kp, vp)
    again = packed_plan.attend(q, kp, vp)
    assert packed[0].shape == (3, 4, 8) and packed[1].shape == (3, 4)
    assert torch.equal(again[0], packed[0]) and torch.equal(again[1], packed[1])


def test_triton_shard_plan_validates_its_options(interp):
    dmeta = _decode(cpattn.KVSharding(2), [9, 4], [2, 1], rank=0)
    kw = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, backend="triton")
    cases = [({"pair": 1}, "backend_options pair must be a bool, got 1"),
             ({"min_split": 3}, "min_split must be a positive multiple of 16"),
             ({"num_sms": 0}, "num_sms must be an int >= 1"),
             ({"config": (96, 4, 1)}, "config BLOCK_N must be a power of two, got 96"),
             ({"config": (32, 4, 1), "min_split": 16}, "min_split must be a positive multiple of 32"),
             ({"split": 2}, r"unknown triton shard backend_options \['split'\]")]
    for options, match in cases:
        with pytest.raises(ValueError, match=match):
            _plan(dmeta, **kw, backend_options=options)
    assert _plan(dmeta, **kw, backend_options={"pair": False}).family == "split-kv"


# ----------------------------------------------------------------------------- GPU (H200)
GPU_CASES = [
    # (C, I, seq_lens, q_lens, heads, page, window, sinks)
    (1, 1, [1000, 1, 77], [1, 1, 4], (32, 8), 64, -1, False),
    (3, 1, [5000, 2, 0, 129], [4, 2, 0, 1], (32, 8), 16, -1, True),
    (4, 4, [3000, 700], [2, 3], (32, 8), None, 100, True),
    (8, 1, [7, 4099, 64], [1, 4, 3], (16, 16), 64, -1, False),
    (2, 64, [9000, 130], [1, 1], (32, 4), 64, 513, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(GPU_CASES)))
@pytest.mark.parametrize("options", [None, {"min_split": 128}])
def test_gpu_shard_attention_ragged_batches(case, options):
    """The triton split-KV kernel on the H200 over ragged batches (bf16; the CPU suite runs it
    under the interpreter only): per-rank partials against the fp64 per-rank oracle, merge
    against full attention."""
    c, i, lens, q_lens, (hq, hkv), page, window, sinks = GPU_CASES[case]
    _check(c, i, lens, q_lens, hq=hq, hkv=hkv, d=128, dtype=torch.bfloat16, window=window, sinks=sinks,
           page_size=page, backend="triton", options=options, seed=case, device="cuda")


@pytest.mark.gpu
def test_gpu_mla_absorbed_ragged():
    _check(2, 1, [3000, 5, 900], [1, 4, 2], hq=128, hkv=1, d=576, dv=512, dtype=torch.bfloat16, page_size=64,
           backend="triton", seed=9, mla=True, sinks=True, device="cuda")
MLA_GPU_CASES = [
    # (C, I, seq_lens, q_lens, Hq, page, sinks): the absorbed-MLA Hopper kernel (D 576 / Dv 512)
    (1, 1, [5000, 1, 300, 64], [1, 1, 4, 2], 128, None, False),
    (1, 1, [9000, 77], [1, 3], 16, 16, True),
    (3, 1, [4099, 2, 0, 129], [4, 2, 0, 1], 128, 64, True),
    (2, 64, [20000, 130], [1, 1], 64, 64, False),
    (4, 1, [33000, 5], [1, 4], 128, 256, False),
    (2, 1, [6001, 3], [2, 3], 32, None, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(MLA_GPU_CASES)))
@pytest.mark.parametrize("options", [{}, {"min_split": 128, "programs_per_sm": 8}])
def test_gpu_mla_kernel_shard_attention(case, options):
    """The absorbed-MLA Hopper kernel's split-KV decode (heads packed into M, global positions
    mapped to each rank's local keys, sinks once): per-rank partials against the fp64 per-rank
    oracle, merge against full attention; packed and paged caches whose unused slots hold NaN."""
    c, i, lens, q_lens, hq, page, sinks = MLA_GPU_CASES[case]
    sh = cpattn.KVSharding(c, interleave=i)
    dmeta = _decode(sh, lens, q_lens, rank=c - 1).to("cuda")
    plan = _plan(dmeta, num_q_heads=hq, num_kv_heads=1, head_dim=576, head_dim_v=512,
                 dtype=torch.bfloat16, page_size=page, has_sinks=sinks, backend="triton",
                 backend_options=options)
    assert plan._impl.family == "mla-split-kv"
    _check(c, i, lens, q_lens, hq=hq, hkv=1, d=576, dv=512, dtype=torch.bfloat16, sinks=sinks, page_size=page,
           backend="triton", options=dict(options, family="mla"), seed=20 + case, mla=True, device="cuda")


MLA_PAIR_CASES = [
    # (C, I, seq_lens, q_lens, Hq, page, sinks): with min_split 2048 no tile has more than two splits
    (1, 1, [4096, 3000, 2049, 100, 1], [4, 1, 2, 3, 1], 128, None, False),
    (1, 1, [4000, 2500, 7], [1, 4, 2], 128, 64, True),
    (2, 1, [8192, 5000, 300], [4, 2, 1], 64, 16, True),
    (3, 16, [9000, 33], [2, 1], 16, 64, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(MLA_PAIR_CASES)))
def test_gpu_mla_pair_mode_merges_two_splits_in_the_kernel(case):
    """Tiles of at most two splits: the second split to finish merges both inside the MLA kernel
    (no combine launch). Per-rank partials against the fp64 oracle (NaN in unused paged slots),
    merge against full attention; repeated eager calls and CUDA-graph replays are bit-identical
    (the pair counters reset themselves)."""
    c, i, lens, q_lens, hq, page, sinks = MLA_PAIR_CASES[case]
    options = {"family": "mla", "min_split": 2048}
    _check(c, i, lens, q_lens, hq=hq, hkv=1, d=576, dv=512, dtype=torch.bfloat16, sinks=sinks, page_size=page,
           backend="triton", options=options, seed=40 + case, mla=True, device="cuda")
    sh = cpattn.KVSharding(c, interleave=i)
    dmeta = _decode(sh, lens, q_lens, rank=c - 1).to("cuda")
    plan = _plan(dmeta, num_q_heads=hq, num_kv_heads=1, head_dim=576, head_dim_v=512,
                 dtype=torch.bfloat16, page_size=page, has_sinks=sinks, backend="triton",
                 backend_options=options)
    mla = plan._impl._mla
    assert mla.pair and not mla.run_combine and mla.num_ws > 0
    torch.manual_seed(case)
    local = dmeta.host.local_kv_lens.tolist()
    nq = sum(q_lens)
    q = torch.randn(nq, hq, 576, device="cuda", dtype=torch.bfloat16)
    sk = torch.randn(hq, device="cuda") if sinks else None
    if page:
        pages = [-(-n // page) for n in local]
        kc = torch.randn(sum(pages) + 1, page, 1, 576, device="cuda", dtype=torch.bfloat16)
        table = torch.zeros(len(lens), max(max(pages), 1), dtype=torch.int32, device="cuda")
        off = 0
        for b, npg in enumerate(pages):
            table[b, :npg] = torch.arange(off, off + npg, device="cuda", dtype=torch.int32)
            off += npg
    else:
        kc, table = torch.randn(sum(local), 1, 576, device="cuda", dtype=torch.bfloat16), None
    first = plan.attend(q, kc, kc[..., :512], page_table=table, sinks=sk)
    for _ in range(3):
        again = plan.attend(q, kc, kc[..., :512], page_table=table, sinks=sk)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    out, lse = torch.zeros_like(first[0]), torch.zeros_like(first[1])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        plan.attend(q, kc, kc[..., :512], page_table=table, sinks=sk, out=out, lse=lse)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.attend(q, kc, kc[..., :512], page_table=table, sinks=sk, out=out, lse=lse)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first[0]) and torch.equal(lse, first[1])


@pytest.mark.gpu
def test_gpu_mla_more_than_two_splits_keep_the_combine():
    """A tile of three or more splits: no pair mode, the combine kernel runs."""
    dmeta = _decode(cpattn.KVSharding(1), [9000, 5], [1, 1], rank=0).to("cuda")
    plan = _plan(dmeta, num_q_heads=128, num_kv_heads=1, head_dim=576, head_dim_v=512,
                 dtype=torch.bfloat16, backend="triton", backend_options={"family": "mla"})
    mla = plan._impl._mla
    assert not mla.pair and mla.run_combine and mla.num_ws >= 3


@pytest.mark.gpu
def test_gpu_mla_kernel_equals_portable_split_kv():
    """Both families of the shard backend on one batch (bf16, paged 64): equal within bf16 rounding."""
    torch.manual_seed(5)
    lens, q_lens = [70000, 3000, 17], [1, 2, 4]
    sh = cpattn.KVSharding(2)
    dmeta = _decode(sh, lens, q_lens, rank=1).to("cuda")
    local = dmeta.host.local_kv_lens.tolist()
    pages = [-(-n // 64) for n in local]
    kc = torch.randn(sum(pages), 64, 1, 576, device="cuda", dtype=torch.bfloat16)
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32, device="cuda")
    off = 0
    for b, npg in enumerate(pages):
        table[b, :npg] = torch.arange(off, off + npg, device="cuda", dtype=torch.int32)
        off += npg
    q = torch.randn(sum(q_lens), 128, 576, device="cuda", dtype=torch.bfloat16)
    res = {}
    for family in ("mla", "portable"):
        plan = _plan(dmeta, num_q_heads=128, num_kv_heads=1, head_dim=576, head_dim_v=512,
                     dtype=torch.bfloat16, page_size=64, backend="triton",
                     backend_options={"family": family})
        res[family] = plan.attend(q, kc, kc[..., :512], page_table=table)
    assert (res["mla"][0].float() - res["portable"][0].float()).abs().max().item() < 2e-2
    assert (res["mla"][1] - res["portable"][1]).abs().max().item() < 1e-2


def _gpu_full_reference(q, k, v, q_lens, seq_lens, window, sinks, scale):
    """fp64 on the GPU, explicit mask: per sequence [q_len, Hq, L] scores."""
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64, device=q.device)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float64, device=q.device)
    row = off = 0
    hkv = k.shape[1]
    group = q.shape[1] // hkv
    for n, ql in zip(seq_lens, q_lens):
        kk, vv = k[off : off + n].double(), v[off : off + n].double()
        qq = q[row : row + ql].double().view(ql, hkv, group, -1)
        s = torch.einsum("qhgd,khd->qhgk", qq, kk).reshape(ql, hkv * group, n) * scale
        pos = torch.arange(n - ql, n, device=q.device)[:, None, None]
        kpos = torch.arange(n, device=q.device)[None, None, :]
        vis = kpos <= pos
        if window >= 0:
            vis &= kpos >= pos - window
        s = s.masked_fill(~vis, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.double()[None, :, None].expand(ql, -1, 1)], -1)
        l_ = torch.logsumexp(s, -1)
        pr = torch.exp(s - l_[..., None])[..., :n].view(ql, hkv, group, n)
        out[row : row + ql] = torch.einsum("qhgk,khd->qhgd", pr, vv).reshape(ql, hkv * group, -1)
        lse[row : row + ql] = l_
        row += ql
        off += n
    return out, lse


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["gqa", "mla"])
@pytest.mark.parametrize("c", [1, 4])
def test_gpu_split_kv_at_128k_keys(shape, c):
    """Split-KV (many programs per sequence) against an fp64 oracle at 128k keys, bf16, paged."""
    torch.manual_seed(0)
    dev = "cuda"
    hq, hkv, d, dv = (32, 8, 128, 128) if shape == "gqa" else (128, 1, 576, 512)
    seq_lens, q_lens = [131072, 70001], [1, 4]
    window, ps = (-1, 64) if shape == "mla" else (4096, 64)
    sinks = torch.randn(hq, device=dev) if shape == "gqa" else None
    k = torch.randn(sum(seq_lens), hkv, d, device=dev, dtype=torch.bfloat16)
    v = k[..., :dv] if shape == "mla" else torch.randn(sum(seq_lens), hkv, dv, device=dev, dtype=torch.bfloat16)
    q = torch.randn(sum(q_lens), hq, d, device=dev, dtype=torch.bfloat16)
    sh = cpattn.KVSharding(c)
    outs, lses = [], []
    for r in range(c):
        dmeta = _decode(sh, seq_lens, q_lens, rank=r).to(dev)
        local = dmeta.host.local_kv_lens.tolist()
        pages = [-(-n // ps) for n in local]
        kc = torch.full((sum(pages) + 1, ps, hkv, d), float("nan"), device=dev, dtype=torch.bfloat16)
        vc = kc[..., :dv] if shape == "mla" else torch.full((sum(pages) + 1, ps, hkv, dv), float("nan"), device=dev,
                                                             dtype=torch.bfloat16)
        table = torch.zeros(2, max(pages), dtype=torch.int32, device=dev)
        off_p = off_k = 0
        for b, (n, npg) in enumerate(zip(seq_lens, pages)):
            table[b, :npg] = torch.arange(off_p, off_p + npg, device=dev, dtype=torch.int32).flip(0)
            pos = torch.tensor(_owned_fast(n, c, 1, r), device=dev)
            j = torch.arange(pos.numel(), device=dev)
            kc[table[b, j // ps].long(), j % ps] = k[off_k + pos]
            if shape != "mla":
                vc[table[b, j // ps].long(), j % ps] = v[off_k + pos]
            off_p += npg
            off_k += n
        plan = _plan(dmeta, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv,
                     dtype=torch.bfloat16, window_size=(window, 0), page_size=ps,
                     has_sinks=sinks is not None, backend="triton")
        assert plan._impl.num_items > len(seq_lens)  # the long sequences are split
        out, lse = plan.attend(q, kc, vc, page_table=table, sinks=sinks)
        outs.append(out)
        lses.append(lse)
    merged, merged_lse = cpattn.merge_states(torch.stack(outs), torch.stack(lses))
    ref, ref_lse = _gpu_full_reference(q, k, v, q_lens, seq_lens, window, sinks, d**-0.5)
    assert not merged.isnan().any()
    assert (merged.double() - ref).abs().max().item() < 2e-2
    assert (merged_lse.double() - ref_lse).abs().max().item() < 2e-2


def _owned_fast(length, c, i, r):
    p = torch.arange(length)
    return p[(p // i) % c == r].tolist()


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_of_decode_steps():
    """Capture one decode step (sharded cache write of the new tokens + shard attention over a
    static plan) once; replay it for steps with other sequence lengths, q_lens and batch sizes:
    equal to eager runs, new keys at their slots, pad rows 0 / -inf."""
    dev = "cuda"
    torch.manual_seed(1)
    hq, hkv, d, ps = 32, 8, 128, 64
    sh = cpattn.KVSharding(2)
    rank = 1
    planner = _static_decode_planner(sh, max_seqs=8, max_q_len=2, max_kv_tokens=65536, device=dev)
    num_pages = 2049  # page 0 holds the pad slot of the static write plan
    kc = torch.randn(num_pages, ps, hkv, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn(num_pages, ps, hkv, d, device=dev, dtype=torch.bfloat16)
    table_host = (torch.randperm(num_pages - 1)[: 8 * 256] + 1).view(8, 256).int()
    table = table_host.to(dev)
    q = torch.randn(16, hq, d, device=dev, dtype=torch.bfloat16)
    k_new = torch.randn(16, hkv, d, device=dev, dtype=torch.bfloat16)
    v_new = torch.randn(16, hkv, d, device=dev, dtype=torch.bfloat16)
    steps = [([9000, 17, 5000, 1, 3], [2, 1, 2, 1, 1]), ([9001, 18, 5001, 2, 30000, 7], [1, 2, 1, 2, 2, 1]),
             ([32000], [2]), ([40, 41, 42, 43, 44, 45, 46, 47], [2] * 8)]

    def plan_step(seq, ql):
        dmeta = planner.plan(ql, [n - q for n, q in zip(seq, ql)], rank=rank)
        writes = cpattn.plan_cache_writes(dmeta, table_host, page_size=ps, num_pages=num_pages, pad_slot=0)
        plan = _plan(dmeta, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                     dtype=torch.bfloat16, page_size=ps, backend="triton")
        return dmeta, writes, plan

    dmeta, writes, plan = plan_step(*steps[0])

    def step():
        cpattn.write_kv_cache(k_new, v_new, kc, vc, writes)
        return plan.attend(q, kc, vc, page_table=table)

    step()  # warm-up (compiles) before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = step()
    for seq, ql in steps:
        dmeta, _, _ = plan_step(seq, ql)  # writes the step's tables into the captured buffers
        graph.replay()
        fresh = _decode(sh, seq, ql, rank=rank).to(dev)
        nq = fresh.num_local_tokens
        ref, ref_lse = _plan(fresh, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16, page_size=ps,
                             backend="triton").attend(q[:nq], kc, vc, page_table=table[: len(seq)])
        torch.cuda.synchronize()
        assert torch.allclose(g_out[:nq].float(), ref.float(), atol=2e-2)
        assert torch.allclose(g_lse[:nq], ref_lse, atol=1e-3)
        assert (g_out[nq:] == 0).all() and torch.isneginf(g_lse[nq:]).all()
        for row, j in zip(fresh.host.store_rows.tolist(), fresh.host.store_index.tolist()):
            b = int(fresh.host.row_seq[row])
            slot = int(table_host[b, j // ps]) * ps + j % ps
            assert torch.equal(kc.view(-1, hkv, d)[slot], k_new[row]), (seq, row)


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 5)), min_size=0, max_size=6), st.integers(1, 4),
       st.sampled_from([1, 4]), st.integers(0, 3), st.sampled_from([1, 2, 4]), st.sampled_from([-1, 0, 37, 500]),
       st.booleans(), st.booleans())
def test_plan_work_tables_cover_every_key_once(seqs, cp, inter, rank_seed, rows, window, fit, static):
    """plan_work's tables over ragged decode batches (q_len 0..5 capped at the length, shard
    sizes 0 and up, window, static capacity): each tile's items cover its local key range
    ``[lo aligned down, hi)`` in order without gaps or overlap, splits aligned; a multi-split
    tile's items own consecutive workspace slots 0.. (single-split: -1); each query row points at
    its tile's first slot, split count and row in the tile; static tables are capacity-sized
    with pad entries past the counts."""
    from types import SimpleNamespace

    from cpattn.kernels.decode_backend import plan_work

    rank = rank_seed % cp
    sl = [n for n, _ in seqs]
    ql = [min(q, n) for n, q in seqs]
    sh = cpattn.KVSharding(cp, inter)
    if static:
        dmeta = _static_decode_planner(sh, max_seqs=8, max_q_len=6, max_tokens=48, max_kv_tokens=6 * 3000,
                                       device="cpu").plan(ql, [n - q for n, q in zip(sl, ql)], rank=rank)
    else:
        dmeta = _decode(sh, sl, ql, rank=rank)
    host = dmeta.host if dmeta.host is not None else dmeta
    spec = SimpleNamespace(window_left=window)
    align = 16
    w = plan_work(host, spec, rows=rows, num_head_groups=2, align=align, num_sms=3, programs_per_sm=2, min_split=16,
                  capacity=dmeta.capacity, fit_target=fit)
    n = w["num_items_host"]
    seq, r0 = w["item_seq"][:n].tolist(), w["item_r0"][:n].tolist()
    k0, k1, ws = w["item_k0"][:n].tolist(), w["item_k1"][:n].tolist(), w["item_ws"][:n].tolist()
    assert int(w["num_items"][0]) == n and w["item_seq"].numel() == w["grid_items"] >= n
    if static:
        assert w["grid_items"] >= 3 * 2 // 2 + 8 * -(-6 // rows) and w["row_ws0"].numel() == 48
        assert (w["item_ws"][n:] == -1).all()

    def local(x):  # local keys of positions < x on this rank (the sharding rule, written out)
        return sum(1 for p in range(x) if (p // inter) % cp == rank)

    tiles = [(b, t0) for b, q in enumerate(ql) for t0 in range(0, q, rows)]
    at = 0
    next_ws = 0
    first_slot = {}
    for b, t0 in tiles:
        pos0 = sl[b] - ql[b] + t0
        last = min(ql[b] - t0, rows) + pos0 - 1
        hi = local(last + 1)
        lo = local(max(pos0 - window, 0)) if window >= 0 else 0
        lo = lo // align * align
        mine = []
        while at < n and (seq[at], r0[at]) == (b, t0):
            mine.append(at)
            at += 1
        assert mine, (b, t0)
        assert k0[mine[0]] == lo and k1[mine[-1]] == max(hi, lo) or (len(mine) == 1 and k1[mine[0]] <= lo)
        for i, j in zip(mine, mine[1:]):
            assert k1[i] == k0[j] and k0[j] % align == 0 and k1[i] > k0[i]
        if len(mine) > 1:
            assert [ws[i] for i in mine] == list(range(next_ws, next_ws + len(mine)))
            first_slot[(b, t0)] = next_ws
            next_ws += len(mine)
        else:
            assert ws[mine[0]] == -1
            first_slot[(b, t0)] = 0
        first_slot[(b, t0, "n")] = len(mine)
    assert at == n and next_ws == w["num_ws"]
    row = 0
    for b, q in enumerate(ql):
        for i in range(q):
            t0 = i // rows * rows
            assert int(w["row_ti"][row]) == i - t0
            assert int(w["row_nsplit"][row]) == first_slot[(b, t0, "n")]
            assert int(w["row_ws0"][row]) == first_slot[(b, t0)]
            row += 1


def test_plan_work_fit_target_keeps_whole_waves():
    """Per-sequence rounding of the split can exceed the split target (8 x 128k keys, target
    132: 136 items); ``fit_target`` grows the split until the items fit, and the items still
    cover every sequence's keys exactly once, in order."""
    from types import SimpleNamespace

    from cpattn.kernels.decode_backend import plan_work

    lens = [131072] * 8
    host = _decode(cpattn.KVSharding(1), lens, [1] * 8, rank=0)
    spec = SimpleNamespace(window_left=-1)
    kw = dict(rows=1, num_head_groups=2, align=128, num_sms=132, programs_per_sm=2, min_split=256)
    loose = plan_work(host, spec, **kw)
    fit = plan_work(host, spec, fit_target=True, **kw)
    assert loose["num_items_host"] > 132 >= fit["num_items_host"]
    n = fit["num_items_host"]
    seq, k0, k1 = fit["item_seq"][:n].long(), fit["item_k0"][:n].long(), fit["item_k1"][:n].long()
    for b, length in enumerate(lens):
        mine = seq == b
        assert k0[mine][0] == 0 and k1[mine][-1] == length
        assert torch.equal(k0[mine][1:], k1[mine][:-1])  # contiguous, no overlap
        assert ((k0[mine] % 128) == 0).all()
