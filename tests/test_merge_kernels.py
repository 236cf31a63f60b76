"""The fused merge kernel (``merge_states`` on CUDA / under the interpreter) and the split-KV
combine kernel, against fp64 oracles written here (the explicit max-shifted formula, one row
and head at a time): many parts / splits read in several chunks, strided views into a packed
byte buffer, -inf parts (whose outputs hold NaN and are never read), +/-1e30, 3e38, +inf and NaN
LSEs, sinks counted once. GPU tests (``-m gpu``) at real sizes are at the end."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpattn
from cpattn import merge as merge_mod

CUDA = torch.cuda.is_available()
INF = float("inf")
NAN = float("nan")


def oracle_merge(o: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor | None = None):
    """fp64: o [C, N, H, Dv], lse [C, N, H] (+ sink [H], a part with output 0) -> ([N, H, Dv], [N, H]).

    Per (n, h): a NaN LSE -> NaN row; m = max LSE; parts with LSE == m weigh 1, others
    exp(LSE - m) (a -inf part weighs 0 and its output is not read); all weights 0 -> 0 / -inf."""
    c, n, h, dv = o.shape
    o, lse = o.double(), lse.double()
    out = torch.zeros(n, h, dv, dtype=torch.float64)
    res = torch.full((n, h), -INF, dtype=torch.float64)
    for i in range(n):
        for j in range(h):
            ls = [float(lse[k, i, j]) for k in range(c)] + ([float(sink[j])] if sink is not None else [])
            if any(math.isnan(x) for x in ls):
                out[i, j] = NAN
                res[i, j] = NAN
                continue
            m = max(ls) if ls else -INF
            if m == -INF:
                continue
            w = [1.0 if x == m else math.exp(x - m) for x in ls]
            total = sum(w)
            acc = torch.zeros(dv, dtype=torch.float64)
            for k in range(c):
                if w[k] != 0.0:
                    acc += w[k] * o[k, i, j]
            out[i, j] = acc / total
            res[i, j] = m + math.log(total)
    return out, res


def _assert_close(out, lse, ref, ref_lse, tol):
    assert torch.equal(out.isnan(), ref.isnan()), "NaN pattern of out differs"
    assert torch.equal(lse.isnan(), ref_lse.isnan()), "NaN pattern of lse differs"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)) and torch.equal(torch.isposinf(lse),
                                                                                       torch.isposinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    if fin.any():
        rel = ((lse.double() - ref_lse).abs() / ref_lse.abs().clamp(min=1.0))[fin]
        assert rel.max() <= 1e-6, f"lse error {rel.max()}"
    ok = ~ref.isnan()
    if ok.any():  # tol relative to max(1, |ref|): bf16 rounds to 8 significant bits
        err = ((out.double() - ref).abs() / ref.abs().clamp(min=1.0))[ok].max()
        assert err <= tol, f"out error {err}"
    assert (out[torch.isneginf(ref_lse)] == 0).all()


def received_views(o: torch.Tensor, lse: torch.Tensor):
    """[C, N, H, Dv] / [C, N, H] as merge_partials sees them: typed strided views into one uint8
    buffer of 16-byte aligned (out, lse) rows."""
    c, n = o.shape[:2]
    buf, layout = cpattn.collectives.pack_rows([o.reshape(c * n, *o.shape[2:]), lse.reshape(c * n, -1)], c * n)
    outs, lses = cpattn.collectives.unpack_rows(buf.view(c, n, -1), layout, [(o.dtype, tuple(o.shape[2:])),
                                                                (torch.float32, tuple(lse.shape[2:]))])
    assert outs.data_ptr() == buf.data_ptr()  # views into the buffer, not copies
    if c * n > 1:  # rows strided by the packed row (out + lse), not by Hq x Dv (a 1-row view is contiguous)
        assert not outs.is_contiguous()
    return outs, lses


def _edge_parts(c, n, h, dv, g, dtype):
    o = torch.randn(c, n, h, dv, generator=g).to(dtype)
    lse = (torch.randn(c, n, h, generator=g) * 4).float()
    # -inf parts with NaN outputs (never read)
    drop = torch.rand(c, n, h, generator=g) < 0.3
    lse[drop] = -INF
    o[drop] = NAN
    return o, lse


TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


# ----------------------------------------------------------------------------- fused merge (interpreter)
@settings(max_examples=12, deadline=None)
@given(st.integers(1, 8), st.integers(1, 4), st.integers(1, 5), st.sampled_from([1, 3, 8, 40]),
       st.sampled_from([torch.float32, torch.bfloat16]), st.booleans(), st.integers(0, 10**6))
def test_fused_merge_equals_fp64_oracle(interp, c, n, h, dv, dtype, strided, seed):
    g = torch.Generator().manual_seed(seed)
    o, lse = _edge_parts(c, n, h, dv, g, dtype)
    lse += float(torch.randint(-600, 600, (1,), generator=g))  # a common shift: same weights, no overflow
    parts, part_lse = received_views(o, lse) if strided else (o, lse)
    assert merge_mod.merge_path(parts, part_lse) == "triton"
    out, res = cpattn.merge_states(parts, part_lse)
    assert out.dtype == dtype and res.dtype == torch.float32 and out.shape == (n, h, dv)
    ref, ref_lse = oracle_merge(o, lse)
    _assert_close(out, res, ref, ref_lse, TOL[dtype])


def test_fused_merge_same_geometry_other_strides(interp):
    """The merge memoizes each geometry's grid and launch: a second call of the same shape with
    other strides (received views instead of contiguous parts) and other values is still exact."""
    g = torch.Generator().manual_seed(4)
    results = []
    for strided in (False, True, False):
        o, lse = _edge_parts(4, 3, 2, 40, g, torch.float32)
        parts, part_lse = received_views(o, lse) if strided else (o, lse)
        out, res = cpattn.merge_states(parts, part_lse)
        ref, ref_lse = oracle_merge(o, lse)
        _assert_close(out, res, ref, ref_lse, TOL[torch.float32])
        results.append(out)
    assert not torch.equal(results[0], results[1])  # different inputs really reached the kernel


def test_fused_merge_edge_values(interp):
    c, n, h, dv = 5, 9, 3, 8
    g = torch.Generator().manual_seed(1)
    o = torch.randn(c, n, h, dv, generator=g)
    lse = torch.randn(c, n, h, generator=g)
    lse[:, 0] = -INF  # every part empty: 0 / -inf ...
    o[:, 0] = NAN  # ... and their NaN outputs are never read
    lse[:, 1] = torch.tensor([1e30, -1e30, 1e30, -INF, 0.0])[:, None]  # equal huge values share the weight
    lse[:, 2] = torch.tensor([3e38, -3e38, 0.0, -INF, -3e38])[:, None]  # 3e38 - (-3e38) overflows: weight 0
    lse[:, 3] = torch.tensor([INF, 0.0, 1.0, INF, 2.0])[:, None]  # +inf (overflowed upstream): no NaN
    lse[3, 4, 1] = NAN  # a NaN lse reaches its row / head only
    o[1, 5, 2, 3] = NAN  # a NaN in a part with weight > 0 reaches its element only
    lse[:, 6] = torch.tensor([-1e30, -INF, -1e30, -INF, -INF])[:, None]  # tiny finite LSEs
    o[:, 7] = NAN
    lse[:, 7] = torch.tensor([-INF, -INF, 2.0, -INF, -INF])[:, None]
    o[2, 7] = torch.randn(h, dv, generator=g)  # one live part among NaN outputs of -inf parts
    lse[:, 8] = torch.tensor([88.0, -80.0, 0.0, 50.0, -INF])[:, None]  # weights across the fp32 range
    from cpattn.kernels import triton_decode

    def fused(parts, part_lse, blocks):  # the kernel with given chunks: (8, ..) one pass, (2, ..) three
        out, res = torch.empty(parts.shape[1:], dtype=parts.dtype), torch.empty(part_lse.shape[1:])
        triton_decode.merge_parts(parts, part_lse, out, res, num_sms=4, blocks=blocks)
        return out, res

    runs = [cpattn.merge_states(o, lse), cpattn.merge_states(*received_views(o, lse)), fused(o, lse, (8, 2, 8)),
            fused(o, lse, (2, 2, 8))]
    for out, res in runs:
        ref, ref_lse = oracle_merge(o, lse)
        _assert_close(out, res, ref, ref_lse, 2e-6)
        assert (out[0] == 0).all() and torch.isneginf(res[0]).all()
        assert (res[1] == 1e30).all() and torch.isposinf(res[3]).all() and not out[3].isnan().any()
        assert res[4, 1].isnan() and out[4, 1].isnan().all() and not out[4, 0].isnan().any()
        assert out[5, 2, 3].isnan() and out[5].isnan().sum() == 1
        assert torch.equal(out[7], o[2, 7]) and (res[6] != -INF).all()
        # the torch reference agrees (same semantics)
        ref_t, ref_tl = merge_mod._merge_states_torch(o, lse, 0)
        _assert_close(out, res, ref_t.double(), ref_tl.double(), 2e-6)


@pytest.mark.parametrize("c", [1, 2, 8, 11])
def test_fused_merge_many_parts_and_dims(interp, c):
    """C = 1 (the merge of one part is that part), C = 11 > BLOCK_S chunks when forced; dim != 0
    and an lse that is not contiguous are read through their strides."""
    g = torch.Generator().manual_seed(c)
    o, lse = _edge_parts(c, 3, 4, 16, g, torch.float32)
    out, res = cpattn.merge_states(o.transpose(0, 1), lse.transpose(0, 1), dim=1)
    ref, ref_lse = oracle_merge(o, lse)
    _assert_close(out, res, ref, ref_lse, 2e-6)
    if c == 1:
        live = torch.isfinite(lse[0])
        assert torch.allclose(out[live], o[0][live], atol=1e-6)
    # the launcher with a 2-part chunk: the max and sum passes walk ceil(C / 2) chunks
    from cpattn.kernels import triton_decode

    out2 = torch.empty_like(out)
    res2 = torch.empty_like(res)
    triton_decode.merge_parts(o, lse, out2, res2, num_sms=4, blocks=(2, 2, 8))
    _assert_close(out2, res2, ref, ref_lse, 2e-6)


def test_merge_path_dispatch(interp):
    o, lse = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4)
    assert merge_mod.merge_path(o, lse) == "triton"
    assert merge_mod.merge_path(o.double(), lse) == "torch"  # float64: the torch reference
    assert merge_mod.merge_path(o[:, :, 0], lse[:, :, 0]) == "torch"  # not the [C, N, H, Dv] form
    assert merge_mod.merge_path(o[:0], lse[:0]) == "torch"  # no parts
    assert merge_mod.merge_path(o.transpose(2, 3), lse) == "torch"  # last dim not contiguous
    a, la = cpattn.merge_states(o.double(), lse.double())
    assert a.dtype == torch.float64 and la.dtype == torch.float64


def test_merge_partials_single_process_group_uses_fused_views(interp):
    """merge_partials with one rank needs no merge; the C > 1 path (received views) is exercised
    above through received_views, which packs exactly as merge_partials does."""
    o, l = torch.randn(3, 4, 8), torch.randn(3, 4)
    assert cpattn.merge_partials(o, l, None) is o


# ----------------------------------------------------------------------------- combine kernel (interpreter)
def _combine_case(row_splits, h, dv, g, sinks):
    """A hand-made split workspace: row r has row_splits[r] consecutive slots (0: a pad row)."""
    rows_per_tile = 2
    ws0, ti, total = [], [], 0
    for ns in row_splits:
        ws0.append(total)
        ti.append(len(ws0) % rows_per_tile)
        total += ns
    ws_o = torch.randn(max(total, 1), rows_per_tile, h, dv, generator=g)
    ws_lse = torch.randn(max(total, 1), rows_per_tile, h, generator=g) * 3
    drop = torch.rand(ws_lse.shape, generator=g) < 0.25
    ws_lse[drop] = -INF
    ws_o[drop] = NAN
    sink = torch.randn(h, generator=g) if sinks else None
    return ws_o, ws_lse, torch.tensor(ws0, dtype=torch.int32), torch.tensor(row_splits, dtype=torch.int32), \
        torch.tensor(ti, dtype=torch.int32), sink


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("blocks", [(4, 1, 16), (2, 2, 8), (64, 4, 32)])
def test_combine_kernel_against_fp64_oracle(interp, sinks, blocks):
    from cpattn.kernels import triton_decode

    h, dv = 5, 32
    g = torch.Generator().manual_seed(7 + sinks)
    row_splits = [13, 2, 0, 1, 9, 4]  # 13 > 3 chunks of 4; 0: pad row; 1: written by the split kernel
    ws_o, ws_lse, ws0, nsplit, ti, sink = _combine_case(row_splits, h, dv, g, sinks)
    # edge values inside the splits of row 4
    s4 = int(ws0[4])
    t4 = int(ti[4])
    ws_o[s4 : s4 + 9, t4, 1:4] = torch.randn(9, 3, dv, generator=g)  # live outputs where LSEs are set below
    ws_lse[s4 : s4 + 9, t4, 0] = -INF  # all splits empty: sink only (or 0 / -inf)
    ws_lse[s4, t4, 1] = 1e30
    ws_lse[s4 + 1, t4, 1] = -1e30
    ws_lse[s4 + 2, t4, 2] = NAN
    ws_lse[s4 + 3, t4, 3] = 20.0
    ws_o[s4 + 3, t4, 3, 5] = NAN
    n_rows = len(row_splits)
    out = torch.full((n_rows, h, dv), 7.0)
    lse = torch.full((n_rows, h), 7.0)
    block_s, block_h, block_dv = blocks
    grid = (n_rows, -(-h // block_h), -(-dv // block_dv))
    triton_decode.launch_combine(out, lse, sink, triton_decode.Workspace(ws_o, ws_lse), grid=grid, combine_args=dict(
        row_ws0=ws0, row_nsplit=nsplit, row_ti=ti, HEAD_DIM_V=dv, BLOCK_H=block_h, BLOCK_S=block_s,
        BLOCK_DV=block_dv, HAS_SINKS=sinks, ONE_PASS=max(row_splits) <= block_s))
    for r, ns in enumerate(row_splits):
        if ns == 1:  # one-split rows belong to the split kernel: untouched
            assert (out[r] == 7).all() and (lse[r] == 7).all()
            continue
        if ns == 0:  # pad rows: 0 / -inf, no sink
            assert (out[r] == 0).all() and torch.isneginf(lse[r]).all()
            continue
        w0 = int(ws0[r])
        parts = ws_o[w0 : w0 + ns, int(ti[r])][:, None]
        part_lse = ws_lse[w0 : w0 + ns, int(ti[r])][:, None]
        ref, ref_lse = oracle_merge(parts, part_lse, sink)
        _assert_close(out[r : r + 1], lse[r : r + 1], ref, ref_lse, 2e-6)
    assert lse[4, 2].isnan() and out[4, 2].isnan().all() and not out[4, 1].isnan().any()
    assert out[4, 3, 5].isnan() and out[4, 3].isnan().sum() == 1
    if not sinks:
        assert torch.isneginf(lse[4, 0]) and (out[4, 0] == 0).all()


def test_merge_blocks_spread_few_rows_over_the_gpu():
    from cpattn.kernels.triton_decode import merge_blocks, merge_warps

    # B = 1, L = 128k: 171 splits x 32 heads x Dv 128 -> >= 128 programs, chunks of <= 8192 fp32
    s, hb, d = merge_blocks(171, 32, 128, 1, 132)
    assert 1 * -(-32 // hb) * -(-128 // d) >= 128 and s * hb * d <= 8192 and s >= 32
    # many rows: whole rows of Dv and heads up to 256 columns per program
    s, hb, d = merge_blocks(3, 32, 128, 256, 132)
    assert d == 128 and hb == 2 and s == 4
    assert merge_blocks(3, 32, 64, 256, 132)[1:] == (4, 64)
    s, hb, d = merge_blocks(8, 128, 512, 64, 132)
    assert s * hb * d <= 8192 and d == 256
    # an explicit budget / column cap / spread are honoured
    s, hb, d = merge_blocks(64, 128, 512, 1, 132, budget=4096, max_block_dv=128, programs_per_sm=2)
    assert s * hb * d <= 4096 and d <= 128 and -(-128 // hb) * -(-512 // d) >= 264
    # warps along the columns only (512 bytes each), enough for <= 128 chunk elements a lane
    assert merge_warps((8, 4, 128), 2) == 1 and merge_warps((8, 1, 512), 2) == 2
    assert merge_warps((8, 1, 512), 4) == 4 and merge_warps((256, 1, 32), 4) == 2 and merge_warps((4, 1, 16), 4) == 1


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 400), st.integers(1, 160), st.sampled_from([16, 64, 100, 128, 512, 576]), st.integers(1, 300),
       st.sampled_from([16, 132]), st.sampled_from([2, 4]))
def test_merge_geometry_invariants(parts, heads, dv, rows, num_sms, elem_bytes):
    """merge_blocks / merge_warps over ragged shapes: powers of two, the chunk within its budget,
    heads packed only up to 4 and 256 columns, a column block never wider than needed, the grid
    spread over 2 programs per SM unless one head and 32 columns per program are reached, 1-4
    warps with <= 128 chunk elements a lane (or the most warps allowed)."""
    from cpattn.kernels.triton_decode import merge_blocks, merge_warps

    def pow2(x):
        return x & (x - 1) == 0

    s, hb, d = merge_blocks(parts, heads, dv, rows, num_sms)
    assert all(pow2(x) and x >= 1 for x in (s, hb, d))
    assert s * hb * d <= 8192 or s == 1
    assert s <= max(1, 1 << (parts - 1).bit_length())  # never more chunk rows than parts need
    assert hb <= 4 and (hb == 1 or hb * d <= 256) and hb <= max(1, 1 << (heads - 1).bit_length())
    assert d <= 256 and (d <= 32 or d < 2 * dv)
    programs = rows * -(-heads // hb) * -(-dv // d)
    assert programs >= 2 * num_sms or (hb == 1 and d <= 32)
    w = merge_warps((s, hb, d), elem_bytes)
    assert 1 <= w <= 4 and (s * hb * d <= 128 * 32 * w or w == 4)


def test_many_splits_end_to_end(interp):
    """A long sequence cut into ~100 splits per tile through the plan (q_len 1 and 3, sinks,
    window, paged and packed): per-rank partials against the fp64 per-rank oracle and the merge
    against full attention (chunked split walks: test_combine_kernel_against_fp64_oracle)."""
    from test_shard_attention import _check

    opts = {"num_sms": 200, "min_split": 16, "programs_per_sm": 4}
    _check(2, 1, [3300, 40], [1, 3], sinks=True, page_size=16, backend="triton", options=opts, seed=11)
    _check(1, 1, [1700], [3], window=900, sinks=True, backend="triton", options=opts, seed=12)


# ----------------------------------------------------------------------------- GPU (H200)
@pytest.mark.gpu
@pytest.mark.parametrize("dv", [128, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_fused_merge_real_sizes(dv, dtype):
    """C = 8, N = 64, H = 32 over merge_partials' received views: the fused kernel against the
    fp64 formula (vectorized here) with -inf parts holding NaN, huge and NaN LSEs."""
    c, n, h = 8, 64, 32
    g = torch.Generator().manual_seed(dv)
    o, lse = _edge_parts(c, n, h, dv, g, dtype)
    lse[:, 0] = -INF
    lse[0, 1], lse[1, 1] = 1e30, -1e30
    lse[2, 2, 3] = NAN
    o_cuda, lse_cuda = o.cuda(), lse.cuda()
    parts, part_lse = received_views(o_cuda, lse_cuda)
    assert merge_mod.merge_path(parts, part_lse) == "triton"
    out, res = cpattn.merge_states(parts, part_lse)
    ref, ref_lse = _vectorized_oracle(o, lse)
    _assert_close(out.cpu(), res.cpu(), ref, ref_lse, TOL[dtype])


def _vectorized_oracle(o, lse):
    """fp64, the same formula as oracle_merge without Python loops over rows (GPU-test sizes)."""
    o, lse = o.double(), lse.double()
    m = lse.amax(0)
    m = torch.where(lse.isnan().any(0), torch.full_like(m, NAN), m)
    w = torch.where(lse == m, torch.ones_like(lse), torch.exp(lse - m))
    w = torch.where(torch.isneginf(m)[None], torch.zeros_like(w), w)
    total = w.sum(0)
    acc = torch.where(w[..., None] == 0, torch.zeros_like(o), w[..., None] * o).sum(0)
    empty = total == 0
    out = torch.where(empty[..., None], torch.zeros_like(acc), acc / total[..., None])
    res = torch.where(empty, torch.full_like(total, -INF), m + torch.log(total))
    return out, res


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["gqa", "mla"])
def test_gpu_split_kv_one_sequence_128k(shape):
    """B = 1, L = 128k, q_len 1 (the case of 171 splits per row): the split-KV kernel + the new
    combine against a torch fp32 reference computed in key chunks (paged bf16 cache, sinks)."""
    torch.manual_seed(3)
    dev = "cuda"
    hq, hkv, d, dv = (32, 8, 128, 128) if shape == "gqa" else (128, 1, 576, 512)
    n, ps = 131072, 64
    k = torch.randn(n, hkv, d, device=dev, dtype=torch.bfloat16)
    v = k[..., :dv] if shape == "mla" else torch.randn(n, hkv, dv, device=dev, dtype=torch.bfloat16)
    q = torch.randn(1, hq, d, device=dev, dtype=torch.bfloat16)
    sinks = torch.randn(hq, device=dev)
    pages = n // ps
    perm = torch.randperm(pages, device=dev)
    kc = torch.empty(pages, ps, hkv, d, device=dev, dtype=torch.bfloat16)
    kc[perm] = k.view(pages, ps, hkv, d)
    if shape == "mla":
        vc = kc[..., :dv]
    else:
        vc = torch.empty(pages, ps, hkv, dv, device=dev, dtype=torch.bfloat16)
        vc[perm] = v.view(pages, ps, hkv, dv)
    table = perm.int()[None]
    dmeta = cpattn.get_strategy("replicated", 1).build_metadata([1], [n - 1], rank=0, kv=cpattn.KVSharding(1)).to(dev)
    spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv, dtype=torch.bfloat16,
                                page_size=ps, has_sinks=True)
    plan = cpattn.plan_attention(dmeta, spec, backend="triton")
    assert plan.algorithm == "shard_merge" and plan._impl.num_items > 32 and plan._impl.run_combine
    out, lse = plan.attend(q, kc, vc, page_table=table, sinks=sinks)
    # fp32 reference in chunks of keys: per chunk (out, lse), merged by the fp64 formula
    scale = d**-0.5
    qf = q.float().view(hkv, hq // hkv, d)
    chunk_o, chunk_l = [], []
    for s0 in range(0, n, 8192):
        kk, vv = k[s0 : s0 + 8192].float(), v[s0 : s0 + 8192].float()
        s = torch.einsum("hgd,khd->hgk", qf, kk) * scale
        l_ = torch.logsumexp(s, -1)
        chunk_o.append(torch.einsum("hgk,khd->hgd", torch.exp(s - l_[..., None]), vv).reshape(hq, dv))
        chunk_l.append(l_.reshape(hq))
    parts = torch.stack(chunk_o + [torch.zeros(hq, dv, device=dev)])[:, None].cpu()
    part_lse = torch.stack(chunk_l + [sinks])[:, None].cpu()
    ref, ref_lse = _vectorized_oracle(parts, part_lse)
    err = (out.cpu().double() - ref).abs().max().item()
    lse_err = (lse.cpu().double() - ref_lse).abs().max().item()
    assert err < 2e-2 and lse_err < 1e-3, f"{shape}: max |out error| {err}, max |lse error| {lse_err}"
