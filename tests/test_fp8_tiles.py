"""The tile-scaled FP8 MLA latent layout (FlashMLA's FP8 KV cache row): the spec option, the
quantization and its exact inverse, quantizing cache writes and the CP gather of the quantized
rows.

The layout is checked byte for byte against an independent construction written here (e4m3 of
``x / (amax / 448)`` per 128-value tile, the four float32 scales little-endian, the rope key as
bfloat16); round trips are bounded by half an e4m3 step of each tile's own scale.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpattn
from cpattn.quant import (
    FP8_E4M3_MAX,
    FP8_TILE,
    dequantize_mla_fp8_tiles,
    mla_fp8_tile_bytes,
    quantize_mla_fp8_tiles,
)
from dist_utils import CountCollectives, run_distributed
from oracle import TOLERANCE, attention_oracle
from test_dsa import _selection, sparse_oracle  # module level: importing defines @given tests

FP8 = torch.float8_e4m3fn


# ---------------------------------------------------------------------------------------- helpers
def _tiles_here(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """The test's own tile-scaled row of finite inputs, built value by value with struct."""
    n, r = kv_c.shape
    out = []
    for i in range(n):
        scales, vals = [], []
        for t in range(r // 128):
            x = kv_c[i, 128 * t : 128 * t + 128].float()
            s = (x.abs().max() / 448.0).float()  # float32, as FlashMLA computes it
            scales.append(s.item())
            y = x / s if s.item() > 0 else torch.zeros_like(x)
            vals.append(y.clamp(-448, 448).to(FP8).view(torch.uint8))
        row = torch.cat(vals).tolist() + list(struct.pack("<" + "f" * len(scales), *scales))
        row += k_pe[i].to(torch.bfloat16).view(torch.uint8).tolist()
        out.append(row)
    return torch.tensor(out, dtype=torch.uint8).view(n, -1)


# ---------------------------------------------------------------------------------------- spec
def test_spec_kv_layout():
    mla = dict(num_q_heads=16, num_kv_heads=1, head_dim=576, head_dim_v=512, dtype=torch.bfloat16)
    tiled = cpattn.AttentionSpec(**mla, kv_dtype=FP8, kv_layout=FP8_TILE, page_size=64)
    assert tiled.kv_tiled and tiled.kv_quantized and tiled.kv_layout == "fp8_tile"
    plain = cpattn.AttentionSpec(**mla, kv_dtype=FP8, page_size=64)
    assert not plain.kv_tiled and plain.kv_layout is None
    assert tiled != plain and hash(tiled) != hash(plain)  # plan-cache keys differ
    assert tiled.replace(page_size=16).kv_tiled
    cases = {
        "kv_layout must be None or a str": (TypeError, dict(mla, kv_dtype=FP8, kv_layout=1)),
        "kv_layout must be None or one of": (ValueError, dict(mla, kv_dtype=FP8, kv_layout="tiles")),
        "needs kv_dtype=torch.float8_e4m3fn": (ValueError, dict(mla, kv_layout=FP8_TILE)),
        "num_kv_heads=1, head_dim_v a multiple of 128": (ValueError, dict(mla, num_kv_heads=2, kv_dtype=FP8,
                                                                          kv_layout=FP8_TILE)),
    }
    for match, (exc, kwargs) in cases.items():
        with pytest.raises(exc, match=match):
            cpattn.AttentionSpec(**kwargs)
    for d, dv in ((576, 500), (512, 512)):
        with pytest.raises(ValueError, match="head_dim > head_dim_v"):
            cpattn.AttentionSpec(**dict(mla, head_dim=d, head_dim_v=dv), kv_dtype=FP8, kv_layout=FP8_TILE)


# ---------------------------------------------------------------------------------------- quantization
def test_deepseek_row_is_656_bytes_laid_out_as_flashmla():
    g = torch.Generator().manual_seed(0)
    kv_c = torch.randn(3, 512, generator=g, dtype=torch.bfloat16) * torch.tensor([0.01, 1.0, 300.0]).view(3, 1)
    k_pe = torch.randn(3, 64, generator=g, dtype=torch.bfloat16)
    assert mla_fp8_tile_bytes(512, 64) == 656
    rows = quantize_mla_fp8_tiles(kv_c, k_pe)
    assert rows.dtype == torch.uint8 and rows.shape == (3, 656) and rows.is_contiguous()
    assert torch.equal(rows, _tiles_here(kv_c, k_pe))
    # the parts, read back through plain views: e4m3 [0, 512), 4 float32 scales [512, 528), bf16 rope [528, 656)
    scales = rows[:, 512:528].contiguous().view(torch.float32)
    amax = kv_c.float().view(3, 4, 128).abs().amax(-1)
    assert torch.equal(scales, amax / 448.0)
    assert torch.equal(rows[:, 528:].contiguous().view(torch.bfloat16), k_pe)


_BF16_MAX = float(torch.finfo(torch.bfloat16).max)
_finite = st.floats(-_BF16_MAX, _BF16_MAX, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 3), st.integers(0, 3), st.lists(_finite, min_size=1, max_size=40), st.integers(0, 2**31 - 1),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_round_trip_within_half_an_e4m3_step_of_each_tile_scale(tiles, rope, values, seed, dtype):
    """Random tiles (magnitudes from 1e-30 to 3e38, hypothesis' extremes planted in them): every
    value comes back within half an e4m3 step of its tile's scale, never NaN; each tile's largest
    magnitude maps to +-448 (the top of the range, saturated not NaN); the rope key round-trips
    as bfloat16."""
    g = torch.Generator().manual_seed(seed)
    n, r = 3, 128 * tiles
    mag = torch.exp(torch.empty(n, tiles, 1).uniform_(math.log(1e-30), math.log(1e30), generator=g))
    kv_c = (torch.randn(n, tiles, 128, generator=g) * mag).view(n, r)
    planted = torch.tensor(values, dtype=torch.float32)[: n * r]
    kv_c.view(-1)[torch.randperm(n * r, generator=g)[: planted.numel()]] = planted
    kv_c = kv_c.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
    k_pe = torch.randn(n, 16 * rope, generator=g).to(dtype)
    rows = quantize_mla_fp8_tiles(kv_c, k_pe)
    assert rows.shape == (n, mla_fp8_tile_bytes(r, 16 * rope))
    back = dequantize_mla_fp8_tiles(rows, r, torch.float64)
    assert not back.isnan().any()
    scale = rows[:, r : r + 4 * tiles].contiguous().view(torch.float32).double().repeat_interleave(128, dim=1)
    x = kv_c.double()
    y = (x / scale.clamp_min(1e-300)).abs()
    # e4m3: 3 mantissa bits -> relative half step 2^-4 for normals, absolute 2^-10 below 2^-6
    bound = torch.maximum(y * 2.0**-4, torch.full_like(y, 2.0**-10)) * scale
    err = (back[:, :r] - x).abs()
    assert bool((err <= bound * (1 + 1e-6) + 1e-300).all()), (err - bound).max()
    q = rows[:, :r].view(FP8).float().view(n, tiles, 128)
    top = kv_c.float().view(n, tiles, 128).abs().argmax(-1, keepdim=True)
    nonzero = scale.view(n, tiles, 128)[..., 0] > 0
    assert bool((q.gather(-1, top).abs()[..., 0][nonzero] == FP8_E4M3_MAX).all())
    assert torch.equal(back[:, r:], k_pe.to(torch.bfloat16).double())


def test_zero_tiles_nan_and_inf():
    """A zero tile: scale 0, values 0, dequantized 0 (no 0 / 0). A NaN or +-inf makes its tile
    (only) NaN: the scale is NaN; the other tiles and rows are untouched."""
    g = torch.Generator().manual_seed(3)
    kv_c = torch.randn(4, 512, generator=g)
    k_pe = torch.randn(4, 64, generator=g)
    kv_c[0, 128:256] = 0.0
    kv_c[1, 5] = float("nan")
    kv_c[2, 300] = float("inf")
    kv_c[3, 511] = -float("inf")
    k_pe[3, 7] = float("nan")
    rows = quantize_mla_fp8_tiles(kv_c, k_pe)
    back = dequantize_mla_fp8_tiles(rows)
    scales = rows[:, 512:528].contiguous().view(torch.float32)
    assert scales[0, 1].item() == 0.0 and torch.equal(back[0, 128:256], torch.zeros(128))
    nan_tiles = {(1, 0), (2, 2), (3, 3)}
    for i in range(4):
        for t in range(4):
            part = back[i, 128 * t : 128 * t + 128]
            if (i, t) in nan_tiles:
                assert scales[i, t].isnan() and part.isnan().all()
            else:
                assert not part.isnan().any()
    assert back[3, 512 + 7].isnan() and back[3, 512:].isnan().sum() == 1
    clean = quantize_mla_fp8_tiles(kv_c[[0]], k_pe[[0]])
    assert torch.equal(rows[0], clean[0])  # a row's bytes do not depend on the other rows


def test_quantize_and_dequantize_reject_bad_inputs():
    kv_c, k_pe = torch.randn(2, 256), torch.randn(2, 64)
    cases = [
        (ValueError, "kv_lora_rank must be a multiple of 128", (torch.randn(2, 200), k_pe)),
        (TypeError, "kv_c must be a 16/32-bit float", (kv_c.to(FP8), k_pe)),
        (ValueError, "k_pe must be 2-D", (kv_c, k_pe[0])),
        (ValueError, "kv_c has 2 rows but k_pe has 1", (kv_c, k_pe[:1])),
        (TypeError, "k_pe must be a torch.Tensor", (kv_c, None)),
    ]
    for exc, match, args in cases:
        with pytest.raises(exc, match=match):
            quantize_mla_fp8_tiles(*args)
    rows = quantize_mla_fp8_tiles(kv_c, k_pe)
    with pytest.raises(TypeError, match="rows must be uint8"):
        dequantize_mla_fp8_tiles(rows.float(), 256)
    with pytest.raises(ValueError, match="not tile-scaled rows of kv_lora_rank=512"):
        dequantize_mla_fp8_tiles(rows, 512)
    with pytest.raises(ValueError, match="not tile-scaled rows"):
        dequantize_mla_fp8_tiles(rows[:, :-1], 256)
    assert dequantize_mla_fp8_tiles(rows.view(2, 1, -1), 256).shape == (2, 1, 320)


# ---------------------------------------------------------------------------------------- cache writes
def _sharded_writes(ps, g):
    """A sharded cache (C = 2, interleave 1) seen from rank 1: the write plan of the rows it owns,
    the page table and the page count (T = 13 logical rows, ragged, with prefixes)."""
    ext, pre = [3, 0, 1, 9], [4, 2, 0, 1]
    meta = cpattn.ZigzagStrategy(2).build_metadata(ext, pre, rank=1, kv=cpattn.KVSharding(2))
    local = [-(-(e + p) // 2) for e, p in zip(ext, pre)]
    need = [-(-n // ps) for n in local]
    num_pages = sum(need) + 1
    perm = torch.randperm(num_pages, generator=g)
    table = torch.zeros(len(ext), max(need), dtype=torch.int32)
    i = 0
    for b, k in enumerate(need):
        table[b, :k] = perm[i : i + k].int()
        i += k
    writes = cpattn.plan_cache_writes(meta, table, page_size=ps, num_pages=num_pages)
    return meta, writes, num_pages


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("prequantized", [False, True])
def test_write_mla_cache_tile_layout(paged, prequantized):
    """Quantizing writes of the rows this rank owns (a sharded write plan), or the bytes of
    already-quantized rows: written slots hold the quantized rows bit for bit, every other byte
    of the cache is unchanged."""
    g = torch.Generator().manual_seed(7)
    ps = 4
    meta, writes, num_pages = _sharded_writes(ps, g)
    t = writes.num_source_rows
    kv_c = torch.randn(t, 256, generator=g, dtype=torch.bfloat16) * 5
    k_pe = torch.randn(t, 32, generator=g, dtype=torch.bfloat16)
    row = mla_fp8_tile_bytes(256, 32)
    cache = torch.randint(0, 255, (num_pages, ps, row), generator=g, dtype=torch.uint8)
    if not paged:
        cache = cache.view(num_pages * ps, row)
    before = cache.clone()
    want = quantize_mla_fp8_tiles(kv_c, k_pe)
    if prequantized:
        cpattn.write_mla_cache(want, None, cache, writes, layout=FP8_TILE)
    else:
        cpattn.write_mla_cache(kv_c, k_pe, cache, writes, layout=FP8_TILE)
    flat, old = cache.view(-1, row), before.view(-1, row)
    src = torch.arange(t) if writes.rows is None else writes.rows
    assert writes.num_writes > 0 and writes.num_writes < t  # a sharded plan: some rows are another rank's
    assert torch.equal(flat[writes.slots], want[src])
    kept = torch.ones(flat.shape[0], dtype=torch.bool)
    kept[writes.slots] = False
    assert torch.equal(flat[kept], old[kept])


def test_write_mla_cache_tile_layout_checks_everything_before_writing():
    g = torch.Generator().manual_seed(8)
    kv_c = torch.randn(5, 128, generator=g)
    k_pe = torch.randn(5, 16, generator=g)
    cache = torch.zeros(3, 4, mla_fp8_tile_bytes(128, 16), dtype=torch.uint8)
    slots = torch.tensor([0, 5, 2, 11, 7])
    cases = [
        (ValueError, "layout must be None or 'fp8_tile'", (kv_c, k_pe, cache), dict(layout="tile")),
        (ValueError, "scale= is the per-tensor scale", (kv_c, k_pe, cache), dict(scale=torch.tensor(1.0))),
        (TypeError, "cache dtype torch.float8_e4m3fn", (kv_c, k_pe, cache.view(FP8)), {}),
        (ValueError, r"cache rows are \[164\], expected \[148\]", (kv_c, k_pe[:, :8], cache), {}),
        (ValueError, "kv_lora_rank must be a multiple of 128", (kv_c[:, :100], k_pe, cache), {}),
        (TypeError, "k_pe must be a 16/32-bit float", (kv_c, k_pe.to(FP8), cache), {}),
        (TypeError, "must be the quantized uint8 tile rows", (kv_c, None, cache), {}),
        (ValueError, "kv_c has 5 rows but k_pe has 4", (kv_c, k_pe[:4], cache), {}),
        (ValueError, "slots has 5 entries but kv_c has 4", (kv_c[:4], k_pe[:4], cache), {}),
        (ValueError, r"cache rows are \[164\], expected \[163\]",
         (quantize_mla_fp8_tiles(kv_c, k_pe)[:, :-1], None, cache), {}),
    ]
    for exc, match, args, kwargs in cases:
        with pytest.raises(exc, match=match):
            cpattn.write_mla_cache(*args, slots, **dict(dict(layout=FP8_TILE), **kwargs))
    with pytest.raises(ValueError, match="slots"):  # a duplicate slot: validated before the write
        cpattn.write_mla_cache(kv_c, k_pe, cache, torch.tensor([0, 5, 2, 5, 7]), layout=FP8_TILE)
    assert not cache.any()
    cpattn.write_mla_cache(kv_c, k_pe, cache, slots, layout=FP8_TILE)
    assert torch.equal(cache.view(12, -1)[slots], quantize_mla_fp8_tiles(kv_c, k_pe))


# ---------------------------------------------------------------------------------------- the CP gather
def _gather_worker(rank, world):
    """Zigzag with pad rows: the tile-layout gather moves 656-byte rows in ONE collective (bf16:
    1,152), its rows equal the quantization of the logical latent bit for bit, and the cache
    written from them equals the cache written from the logical latent."""
    ext, pre = [5, 0, 1, 2 * world + 1, 11], [3, 2, 0, 7, 1]
    g = torch.Generator().manual_seed(1)
    t = sum(ext)
    kv_c = torch.randn(t, 512, generator=g, dtype=torch.bfloat16) * 3
    k_pe = torch.randn(t, 64, generator=g, dtype=torch.bfloat16)
    s = cpattn.ZigzagStrategy(world, pad_multiple=4)
    meta = s.build_metadata(ext, pre, rank=rank, group=torch.distributed.group.WORLD)
    kv_c_local, k_pe_local = s.shard(kv_c, meta), s.shard(k_pe, meta)
    pad = meta.num_physical_tokens - meta.num_local_tokens
    if pad:  # garbage in the pad rows: dropped by the gather
        kv_c_local[-pad:] = float("nan")
    res = {"P": meta.num_physical_tokens}
    with CountCollectives() as tile_calls:
        rows = s.gather_mla_latent(kv_c_local, k_pe_local, meta, layout=FP8_TILE)
    with CountCollectives() as bf16_calls:
        s.gather_mla_latent(kv_c_local, k_pe_local, meta)
    res["tile"], res["bf16"] = tile_calls.calls, bf16_calls.calls
    want = quantize_mla_fp8_tiles(kv_c, k_pe)
    res["rows_equal"] = rows.dtype == torch.uint8 and torch.equal(rows, want)
    slots = torch.randperm(64, generator=g)[:t]
    cache = torch.zeros(16, 4, 656, dtype=torch.uint8)
    cpattn.write_mla_cache(rows, None, cache, cpattn.plan_cache_writes(meta, slots, num_slots=64), layout=FP8_TILE)
    direct = torch.zeros_like(cache)
    cpattn.write_mla_cache(kv_c, k_pe, direct, slots, layout=FP8_TILE)
    res["cache_equal"] = torch.equal(cache, direct)
    handle = s.gather_mla_latent(kv_c_local, k_pe_local, meta, layout=FP8_TILE, async_op=True)
    res["async_equal"] = torch.equal(handle.wait()[0], want)
    return res


@pytest.mark.slow
def test_tile_layout_gather_moves_656_byte_rows():
    for res in run_distributed(_gather_worker, 2):
        assert res["rows_equal"] and res["cache_equal"] and res["async_equal"]
        assert len(res["tile"]) == len(res["bf16"]) == 1  # one collective each
        tile_bytes, bf16_bytes = math.prod(res["tile"][0]), math.prod(res["bf16"][0])
        assert tile_bytes == 656 * res["P"] and bf16_bytes == 1152 * res["P"], (res["tile"], res["bf16"], res["P"])


# ---------------------------------------------------------------------------------------- reads (torch reference)
def _latent(n, r, rope, g, spread=True):
    """Tile rows [n, row] of a random latent (tile standard deviations spread over 0.05..1 when
    ``spread``) and their fp64 dequantization [n, 1, r + rope] (the oracle's keys)."""
    kv_c = torch.randn(n, r, generator=g)
    if spread:
        kv_c = kv_c * torch.exp(torch.empty(n, r // 128, 1).uniform_(-3.0, 0.0, generator=g)).repeat_interleave(
            128, dim=1).view(n, r)
    rows = quantize_mla_fp8_tiles(kv_c, torch.randn(n, rope, generator=g))
    return rows, dequantize_mla_fp8_tiles(rows, r, torch.float64)[:, None, :]


def _tile_pages(rows_per_seq, ps, g):
    """Packed per-sequence tile rows -> (uint8 cache [num_pages, ps, 1, row] with unwritten slots
    all 0xFF (NaN values and scales: never read), page table [B, max_pages] int32)."""
    counts = [-(-x.shape[0] // ps) for x in rows_per_seq]
    num_pages = sum(counts) + 2
    order = torch.randperm(num_pages, generator=g).tolist()
    row = rows_per_seq[0].shape[-1]
    cache = torch.full((num_pages, ps, 1, row), 0xFF, dtype=torch.uint8)
    table = torch.zeros(len(rows_per_seq), max([1, *counts]), dtype=torch.int32)
    used = 0
    for b, x in enumerate(rows_per_seq):
        for j in range(x.shape[0]):
            if j % ps == 0:
                table[b, j // ps] = order[used]
                used += 1
            cache[table[b, j // ps], j % ps, 0] = x[j]
    return cache, table


def _tile_spec(hq, r, rope, dtype, ps=None, **kw):
    return cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=1, head_dim=r + rope, head_dim_v=r, dtype=dtype,
                                kv_dtype=FP8, kv_layout=FP8_TILE, page_size=ps, **kw)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dims", [(128, 16), (512, 64)])
def test_dense_attend_over_tile_cache_equals_oracle_on_dequantized_latent(request, dims, dtype, paged, backend):
    """Absorbed MLA (k = v = the uint8 tile cache) through a local dense plan (torch reference or
    the portable Triton kernel), ragged batch with prefixes, an empty sequence and pad rows: the
    fp64 oracle on the dequantized latent."""
    if backend == "triton":
        request.getfixturevalue("interp")
    r, rope = dims
    ext, pre = [5, 0, 1, 9], [3, 6, 0, 1]
    kv_lens = [e + p for e, p in zip(ext, pre)]
    g = torch.Generator().manual_seed(r + paged)
    rows, deq = _latent(sum(kv_lens), r, rope, g)
    q = torch.randn(sum(ext), 8, r + rope, generator=g).to(dtype)
    meta = cpattn.ZigzagStrategy(1, pad_multiple=4).build_metadata(ext, pre, rank=0)
    plan = cpattn.plan_attention(meta, _tile_spec(8, r, rope, dtype, 4 if paged else None), backend=backend)
    assert plan.family == ("portable" if backend == "triton" else "torch")
    q_local = cpattn.ZigzagStrategy(1, pad_multiple=4).shard(q, meta)
    if paged:
        cache, table = _tile_pages(list(rows.split(kv_lens)), 4, g)
        out, lse = plan.attend(q_local, cache, cache, page_table=table, return_lse=True)
    else:
        lat = rows[:, None, :]
        out, lse = plan.attend(q_local, lat, lat, return_lse=True)
    ref, ref_lse = attention_oracle(q, deq, deq[..., :r], ext, pre)
    t = q.shape[0]
    assert out.shape == (meta.num_physical_tokens, 8, r)
    assert (out[:t].double() - ref).abs().max().item() < TOLERANCE[dtype]
    assert (lse[:t].double() - ref_lse).abs().max().item() < TOLERANCE[dtype]
    assert (out[t:] == 0).all() and torch.isneginf(lse[t:]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("c", [1, 2])
def test_split_kv_decode_over_sharded_tile_cache(request, c, paged, backend, dtype):
    """Replicated decode queries over a tile cache sharded C ways (interleave 2), each rank's
    share attended by its shard_merge plan (torch reference, or the split-KV kernel with several
    splits per sequence and the combine) and merged: the fp64 oracle on the dequantized latent;
    over a replicated cache (C = 1) a decode-shaped local plan too."""
    from test_dsa_sharded import _meta, _shard_packed, _shard_paged

    from cpattn.merge import merge_states

    options = None
    if backend == "triton":
        request.getfixturevalue("interp")
        options = {"num_sms": 64, "min_split": 16}
    r, rope, hq, il = 128, 16, 4, 2
    lens, qs = [70, 1, 13, 40], [1, 1, 2, 1]
    pre = [n - q for n, q in zip(lens, qs)]
    g = torch.Generator().manual_seed(c * 10 + paged)
    rows, deq = _latent(sum(lens), r, rope, g)
    per_seq = list(rows[:, None, :].split(lens))
    q = torch.randn(sum(qs), hq, r + rope, generator=g, dtype=dtype)
    ref, _ = attention_oracle(q, deq, deq[..., :r], qs, pre)
    spec = _tile_spec(hq, r, rope, dtype, 4 if paged else None)
    outs, lses = [], []
    for rank in range(c):
        plan = cpattn.plan_attention(_meta(c, il, lens, qs, rank), spec, backend=backend, backend_options=options)
        assert plan.algorithm == "shard_merge"
        if backend == "triton":
            assert plan.family == "split-kv" and plan.launch.num_ws > 0  # splits and the combine ran
        kw = {}
        if paged:
            k_loc, kw["page_table"] = _shard_paged(per_seq, c, il, rank, 4, g)
        else:
            k_loc = _shard_packed(per_seq, c, il, rank)
        o, l = plan.attend(q, k_loc, k_loc, **kw)
        outs.append(o)
        lses.append(l)
    out, _ = merge_states(torch.stack(outs), torch.stack(lses))
    assert (out.double() - ref).abs().max().item() < TOLERANCE[dtype]
    if c == 1 and backend == "torch":
        meta = cpattn.get_strategy("replicated", 1).build_metadata(qs, pre, rank=0)
        plan = cpattn.plan_attention(meta, spec, backend="torch")
        kw = {}
        if paged:
            cache, kw["page_table"] = _tile_pages([x[:, 0] for x in per_seq], 4, g)
        else:
            cache = rows[:, None, :]
        out = plan.attend(q, cache, cache, **kw)
        assert (out.double() - ref).abs().max().item() < TOLERANCE[dtype]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("paged", [False, True])
def test_sparse_attention_over_tile_cache(request, paged, backend):
    """DSA sparse attention (topk) over a tile cache (torch reference or the portable sparse
    Triton kernel), a local plan (replicated cache) and the sharded-cache plan (C = 3,
    interleave 2, merged): the fp64 sparse oracles on the dequantized latent."""
    if backend == "triton":
        request.getfixturevalue("dsa_interp")
    from test_dsa import _paged as dsa_paged
    from test_dsa import _selection, sparse_oracle
    from test_dsa_sharded import _meta, _shard_packed, _shard_paged
    from test_dsa_sharded import sparse_oracle as sharded_oracle

    from cpattn.merge import merge_states

    r, rope, hq = 128, 16, 4
    g = torch.Generator().manual_seed(30 + paged)
    ext, pre = [5, 1, 9], [3, 20, 0]
    rows, deq = _latent(sum(e + p for e, p in zip(ext, pre)), r, rope, g)
    q = torch.randn(sum(ext), hq, r + rope, generator=g)
    idx = _selection(ext, pre, 12, g)
    ref, ref_lse = sparse_oracle(q, deq, deq[..., :r], idx, ext, pre, 0.2)
    meta = cpattn.get_strategy("replicated", 1).build_metadata(ext, pre, rank=0)
    plan = cpattn.plan_attention(meta, _tile_spec(hq, r, rope, torch.float32, 4 if paged else None, topk=12),
                                 backend=backend)
    assert plan.family == ("portable" if backend == "triton" else "torch")
    lat, kw = rows[:, None, :], {}
    if paged:
        (lat,), kw["page_table"] = dsa_paged([lat], ext, pre, 4, g)
    out, lse = plan.attend(q, lat, lat, idx, softmax_scale=0.2, return_lse=True, **kw)
    assert (out.double() - ref).abs().max().item() < TOLERANCE[torch.float32]
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() < TOLERANCE[torch.float32]
    # sharded cache, decode rows
    c, il, topk = 3, 2, 8
    lens, qs = [70, 13, 1, 33], [2, 1, 1, 4]
    rows, deq = _latent(sum(lens), r, rope, g)
    per_seq = list(rows[:, None, :].split(lens))
    q = torch.randn(sum(qs), hq, r + rope, generator=g)
    sel = torch.tensor([(torch.randperm(p + 1, generator=g)[:topk].tolist() + [-1] * topk)[:topk]
                        for n, ql in zip(lens, qs) for p in range(n - ql, n)])
    deq_seq = list(deq.split(lens))
    want = sharded_oracle(q, deq_seq, [x[..., :r] for x in deq_seq], sel.tolist(), lens, qs, 0.2)
    outs, lses = [], []
    for rank in range(c):
        plan = cpattn.plan_attention(_meta(c, il, lens, qs, rank), _tile_spec(hq, r, rope, torch.float32,
                                                                              4 if paged else None, topk=topk),
                                     backend=backend)
        kw = {}
        if paged:
            k_loc, kw["page_table"] = _shard_paged(per_seq, c, il, rank, 4, g)
        else:
            k_loc = _shard_packed(per_seq, c, il, rank)
        o, l = plan.attend(q, k_loc, k_loc, sel, softmax_scale=0.2, **kw)
        outs.append(o)
        lses.append(l)
    out, _ = merge_states(torch.stack(outs), torch.stack(lses))
    assert (out.double() - want).abs().max().item() < TOLERANCE[torch.float32]


def test_tile_plans_check_their_calls():
    """The cache must be the uint8 rows (k and v alike) and no scales are taken."""
    r, rope = 128, 16
    ext, pre = [1, 2], [3, 0]
    g = torch.Generator().manual_seed(2)
    rows, _ = _latent(6, r, rope, g)
    lat = rows[:, None, :]
    q = torch.randn(3, 4, r + rope, generator=g)
    meta = cpattn.get_strategy("replicated", 1).build_metadata(ext, pre, rank=0)
    spec = _tile_spec(4, r, rope, torch.float32)
    plan = cpattn.plan_attention(meta, spec, backend="torch")
    with pytest.raises(ValueError, match="carry their own tile scales"):
        plan.attend(q, lat, lat, k_scale=torch.tensor(1.0), v_scale=torch.tensor(1.0))
    with pytest.raises(TypeError, match="reads the uint8 cache rows"):
        plan.attend(q, lat.view(FP8), lat.view(FP8))
    with pytest.raises(ValueError, match=r"k / v must be \[rows, 1, 164\]"):
        plan.attend(q, lat, lat[..., :144])


def test_triton_backends_name_what_they_cannot_read(interp, dsa_interp):
    """The Triton kernels read the layout with a power-of-two latent and rope part only:
    NotImplementedError naming the reason (backend "auto": the torch reference)."""
    ext, pre = [1, 2], [3, 0]
    dense = cpattn.get_strategy("replicated", 1).build_metadata(ext, pre, rank=0)
    sharded = cpattn.get_strategy("replicated", 1).build_metadata(ext, pre, rank=0, kv=cpattn.KVSharding(1))
    odd = _tile_spec(4, 384, 64, torch.float32, 4)
    for meta, spec in ((dense, odd), (sharded, odd), (dense, odd.replace(topk=4))):
        match = "needs head_dim_v a power of two"
        with pytest.raises(NotImplementedError, match=match):
            cpattn.plan_attention(meta, spec, backend="triton")
        assert cpattn.plan_attention(meta, spec).backend == "torch"


def test_dense_decode_plan_runs_split_kv_over_tile_cache(interp):
    """A decode-shaped dense plan of a tile spec runs the split-KV family (several splits):
    the fp64 oracle on the dequantized latent."""
    ext, pre = [1, 1, 2], [300, 77, 150]
    kv_lens = [e + p for e, p in zip(ext, pre)]
    g = torch.Generator().manual_seed(0)
    rows, deq = _latent(sum(kv_lens), 128, 16, g)
    cache, table = _tile_pages(list(rows.split(kv_lens)), 16, g)
    meta = cpattn.get_strategy("replicated", 1).build_metadata(ext, pre, rank=0)
    plan = cpattn.plan_attention(meta, _tile_spec(4, 128, 16, torch.float32, 16), backend="triton",
                                 backend_options={"decode": {"num_sms": 64, "min_split": 16}})
    assert plan.family == "decode"
    q = torch.randn(4, 4, 144, generator=g)
    out, lse = plan.attend(q, cache, cache, page_table=table, return_lse=True)
    ref, ref_lse = attention_oracle(q, deq, deq[..., :128], ext, pre)
    assert (out.double() - ref).abs().max().item() < TOLERANCE[torch.float32]
    assert (lse.double() - ref_lse).abs().max().item() < TOLERANCE[torch.float32]


# ---------------------------------------------------------------------------------------- plan.run
def _run_inputs(ext, pre, r, rope, hq, dtype, g):
    """Latent rows of a batch: (lat [N, 1, r + rope] in ``dtype``, prefix-then-extend per sequence;
    its fp64 dequantized tile rows [N, 1, r + rope] (the oracle's keys); q [T, Hq, r + rope];
    the row index of each sequence's prefix rows and of its extend rows)."""
    kv_lens = [e + p for e, p in zip(ext, pre)]
    lat = torch.randn(sum(kv_lens), 1, r + rope, generator=g).to(dtype)
    deq = dequantize_mla_fp8_tiles(quantize_mla_fp8_tiles(lat[:, 0, :r], lat[:, 0, r:]), r, torch.float64)
    q = torch.randn(sum(ext), hq, r + rope, generator=g).to(dtype)
    starts = [sum(kv_lens[:b]) for b in range(len(ext))]
    pre_rows = torch.tensor([s + j for s, p in zip(starts, pre) for j in range(p)], dtype=torch.int64)
    new_rows = torch.tensor([s + p + j for s, p, e in zip(starts, pre, ext) for j in range(e)], dtype=torch.int64)
    return lat, deq[:, None, :], q, pre_rows, new_rows


def _paged_prefix_cache(lat, r, kv_lens, pre, ps, g):
    """A paged tile cache [num_pages, ps, 1, row] holding each sequence's prefix rows (quantized)
    at random pages, every other byte 0xFF, its page table [B, max_pages] int32, the page count."""
    rows = quantize_mla_fp8_tiles(lat[:, 0, :r], lat[:, 0, r:])
    counts = [-(-n // ps) for n in kv_lens]
    num_pages = sum(counts) + 2
    order = torch.randperm(num_pages, generator=g).tolist()
    cache = torch.full((num_pages, ps, 1, rows.shape[1]), 0xFF, dtype=torch.uint8)
    table = torch.zeros(len(kv_lens), max([1, *counts]), dtype=torch.int32)
    used, start = 0, 0
    for b, n in enumerate(kv_lens):
        for j in range(counts[b]):
            table[b, j] = order[used]
            used += 1
        for j in range(pre[b]):
            cache[table[b, j // ps], j % ps, 0] = rows[start + j]
        start += n
    return cache, table, num_pages


def _check_local_run(ext, pre, paged, backend, dtype, seed, topk=None):
    """plan.run of a local plan (sparse with ``topk``) vs the fp64 oracle on the dequantized
    latent, and its cache vs write_mla_cache(layout=) of the same rows."""
    r, rope, hq, ps = 128, 16, 4, 4
    g = torch.Generator().manual_seed(seed)
    kv_lens = [e + p for e, p in zip(ext, pre)]
    lat, deq, q, pre_rows, new_rows = _run_inputs(ext, pre, r, rope, hq, dtype, g)
    s = cpattn.ZigzagStrategy(1, pad_multiple=4)
    meta = s.build_metadata(ext, pre, rank=0)
    spec = _tile_spec(hq, r, rope, dtype, ps if paged else None, **({} if topk is None else {"topk": topk}))
    plan = cpattn.plan_attention(meta, spec, backend=backend)
    assert plan.algorithm == "local"
    k_local = s.shard(lat[new_rows], meta)
    kw = {}
    if topk is not None:
        idx = _selection(ext, pre, topk, g)
        kw["idx"] = s.shard(idx, meta)
    if paged:
        cache, table, num_pages = _paged_prefix_cache(lat, r, kv_lens, pre, ps, g)
        writes = cpattn.plan_cache_writes(meta, table, page_size=ps, num_pages=num_pages)
        want = cache.clone()
        cpattn.write_mla_cache(lat[new_rows, 0, :r], lat[new_rows, 0, r:], want[..., 0, :], writes, layout=FP8_TILE)
        kw.update(writes=writes, page_table=table)
    else:
        pre_tiles = quantize_mla_fp8_tiles(lat[pre_rows, 0, :r], lat[pre_rows, 0, r:])[:, None, :]
        cache = (pre_tiles, pre_tiles) if pre_rows.numel() else None
    arg = (cache, cache) if paged else cache
    out, lse = plan.run(s.shard(q, meta), k_local, k_local[..., :r], arg, return_lse=True, **kw)
    if paged:
        assert torch.equal(cache, want)  # bit for bit the write_mla_cache(layout=) of the same rows
    if topk is None:
        ref, ref_lse = attention_oracle(q, deq, deq[..., :r], ext, pre)
    else:
        ref, ref_lse = sparse_oracle(q, deq, deq[..., :r], idx, ext, pre, (r + rope) ** -0.5)
    t = q.shape[0]
    assert (out[:t].double() - ref).abs().max().item() < TOLERANCE[dtype]
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse[:t]), ~fin)
    if fin.any():
        assert (lse[:t].double()[fin] - ref_lse[fin]).abs().max().item() < TOLERANCE[dtype]
    assert (out[t:] == 0).all() and torch.isneginf(lse[t:]).all()


_BATCHES = st.lists(st.tuples(st.integers(0, 9), st.integers(0, 6)), min_size=1, max_size=4).filter(
    lambda b: sum(e for e, _ in b) > 0)


@settings(max_examples=20, deadline=None)
@given(batch=_BATCHES, paged=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       topk=st.sampled_from([None, 1, 6]), seed=st.integers(0, 2**16))
def test_local_run_over_tile_cache_equals_oracle(batch, paged, dtype, topk, seed):
    """plan.run of a local plan (torch reference, dense or sparse): this rank's new latent rows
    quantized to tile rows, written through the write plan (paged) or packed after the cached
    prefix tile rows: the fp64 oracle on the dequantized latent; the cache equals
    write_mla_cache(layout=) bit for bit (ragged batches: empty sequences, single rows, prefixes)."""
    ext, pre = [e for e, _ in batch], [p for _, p in batch]
    _check_local_run(ext, pre, paged, "torch", dtype, seed, topk)


@pytest.mark.parametrize("paged", [False, True])
def test_local_run_over_tile_cache_triton(interp, paged):
    """The same through the portable Triton kernel (interpreter)."""
    _check_local_run([5, 0, 1, 7], [3, 2, 0, 1], paged, "triton", torch.float32, 5)


@pytest.mark.parametrize("paged", [False, True])
def test_sparse_local_run_over_tile_cache_triton(dsa_interp, paged):
    """Sparse through the portable sparse Triton kernel (interpreter)."""
    _check_local_run([5, 0, 1, 7], [3, 2, 0, 1], paged, "triton", torch.float32, 6, topk=5)


def _run_worker(rank, world):
    """gather_kv (zigzag, pad rows) and shard_merge (dense and sparse) runs over tile caches:
    outputs vs the fp64 oracle on the dequantized latent, caches vs write_mla_cache(layout=) of
    the same rows, the collectives (count, bytes), and bad inputs refused before any collective
    or write with the caches unchanged."""
    from test_dsa_sharded import _shard_paged
    from test_dsa_sharded import sparse_oracle as sharded_oracle

    r, rope, hq, ps = 512, 64, 4, 4  # DeepSeek's latent: 656-byte tile rows, 1,152 bytes in bf16
    group = torch.distributed.group.WORLD
    g = torch.Generator().manual_seed(21)
    ext, pre = [7, 0, 1, 2 * world - 1, 2], [3, 4, 0, 2, 0]
    kv_lens = [e + p for e, p in zip(ext, pre)]
    lat, deq, q, _, new_rows = _run_inputs(ext, pre, r, rope, hq, torch.bfloat16, g)
    res = {}
    s = cpattn.ZigzagStrategy(world, pad_multiple=4)
    meta = s.build_metadata(ext, pre, rank=rank, group=group)
    cache, table, num_pages = _paged_prefix_cache(lat, r, kv_lens, pre, ps, torch.Generator().manual_seed(3))
    writes = cpattn.plan_cache_writes(meta, table, page_size=ps, num_pages=num_pages)
    plan = cpattn.plan_attention(meta, _tile_spec(hq, r, rope, torch.bfloat16, ps), backend="torch")
    res["algorithm"] = plan.algorithm
    q_local, k_local = s.shard(q, meta), s.shard(lat[new_rows], meta)
    before = cache.clone()
    bad = {
        "v_view": ((q_local, k_local, k_local[..., :r].clone(), (cache, cache)), {}),
        "cache_pair": ((q_local, k_local, k_local[..., :r], (cache, cache.clone())), {}),
        "cache_dtype": ((q_local, k_local, k_local[..., :r], (cache.view(FP8), cache.view(FP8))), {}),
        "scales": ((q_local, k_local, k_local[..., :r], (cache, cache)),
                   dict(k_scale=torch.tensor(1.0), v_scale=torch.tensor(1.0))),
        "k_shape": ((q_local, k_local[..., :-1], k_local[..., :r], (cache, cache)), {}),
        "writes": ((q_local, k_local, k_local[..., :r], (cache, cache)), dict(writes=None)),
        "page_table": ((q_local, k_local, k_local[..., :r], (cache, cache)), dict(page_table=table[:1])),
    }
    with CountCollectives() as none:
        for name, (args, kw) in bad.items():
            kw = dict(dict(writes=writes, group=group, page_table=table), **kw)
            try:
                plan.run(*args, **kw)
                res[f"bad/{name}"] = "no error"
            except (ValueError, TypeError) as e:
                res[f"bad/{name}"] = type(e).__name__ + ": " + str(e)
    res["bad/collectives"] = len(none.calls)
    res["bad/unchanged"] = torch.equal(cache, before)
    want = cache.clone()
    cpattn.write_mla_cache(lat[new_rows, 0, :r], lat[new_rows, 0, r:], want[..., 0, :], writes, layout=FP8_TILE)
    with CountCollectives() as ag:
        out = plan.run(q_local, k_local, k_local[..., :r], (cache, cache), writes=writes, group=group,
                       page_table=table)
    res["gather/bytes"] = [math.prod(c) for c in ag.calls]
    res["P"] = meta.num_physical_tokens
    res["gather/cache_equal"] = torch.equal(cache, want)
    ref, _ = attention_oracle(q, deq, deq[..., :r], ext, pre)
    res["gather/err"] = (s.gather(out, meta, group).double() - ref).abs().max().item()
    bf16 = cpattn.plan_attention(meta, cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=1, head_dim=r + rope,
                                                            head_dim_v=r, dtype=torch.bfloat16, page_size=ps),
                                 backend="torch")
    full = torch.zeros(num_pages, ps, 1, r + rope, dtype=torch.bfloat16)
    with CountCollectives() as ag:
        bf16.run(q_local, k_local, k_local[..., :r], (full, full[..., :r]), writes=writes, group=group,
                 page_table=table)
    res["bf16/bytes"] = [math.prod(c) for c in ag.calls]
    # shard_merge decode over a sharded tile cache: dense and sparse
    r, rope, il, lens, qs = 128, 16, 2, [9, 1, 14, 5], [1, 1, 2, 1]
    dpre = [n - x for n, x in zip(lens, qs)]
    lat2, deq2, q2, pre2, new2 = _run_inputs(qs, dpre, r, rope, hq, torch.float32, g)
    dmeta = cpattn.get_strategy("replicated", world).build_metadata(qs, dpre, rank=rank,
                                                                    kv=cpattn.KVSharding(world, il), group=group)
    tiles = quantize_mla_fp8_tiles(lat2[:, 0, :r], lat2[:, 0, r:])[:, None, :]
    per_seq = list(tiles.clone().index_fill_(0, new2, 0xFF).split(lens))  # the new rows: not cached yet
    cache2, table2 = _shard_paged(per_seq, world, il, rank, ps, torch.Generator().manual_seed(5))
    writes2 = cpattn.plan_cache_writes(dmeta, table2, page_size=ps, num_pages=cache2.shape[0])
    sel = torch.tensor([(torch.randperm(p + 1, generator=torch.Generator().manual_seed(p))[:6].tolist() + [-1] * 6)[:6]
                        for n, x in zip(lens, qs) for p in range(n - x, n)])
    deq_seq = list(deq2.split(lens))
    refs = {"dense": attention_oracle(q2, deq2, deq2[..., :r], qs, dpre)[0],
            "sparse": sharded_oracle(q2, deq_seq, [x[..., :r] for x in deq_seq], sel.tolist(), lens, qs, 0.2)}
    for kind in ("dense", "sparse"):
        c2 = cache2.clone()
        spec = _tile_spec(hq, r, rope, torch.float32, ps, **({"topk": 6} if kind == "sparse" else {}))
        plan = cpattn.plan_attention(dmeta, spec, backend="torch")
        res[f"{kind}/algorithm"] = plan.algorithm
        kw = dict(idx=sel, softmax_scale=0.2) if kind == "sparse" else {}
        k2 = lat2[new2]
        with CountCollectives() as none:
            try:
                plan.run(q2, k2, k2[..., :r], (c2, c2), writes=writes2, group=group, page_table=table2[:, :0], **kw)
                res[f"{kind}/bad"] = "no error"
            except ValueError as e:
                res[f"{kind}/bad"] = str(e)
        res[f"{kind}/bad_collectives"], res[f"{kind}/bad_unchanged"] = len(none.calls), torch.equal(c2, cache2)
        want = c2.clone()
        cpattn.write_mla_cache(k2[:, 0, :r], k2[:, 0, r:], want[..., 0, :], writes2, layout=FP8_TILE)
        c3 = c2.clone()  # a second layer: its steady-state collectives (the first merge checks headers once)
        out = plan.run(q2, k2, k2[..., :r], (c2, c2), writes=writes2, group=group, page_table=table2, **kw)
        with CountCollectives() as ag:
            out3 = plan.run(q2, k2, k2[..., :r], (c3, c3), writes=writes2, group=group, page_table=table2, **kw)
        res[f"{kind}/collectives"] = len(ag.calls)
        res[f"{kind}/cache_equal"] = torch.equal(c2, want) and torch.equal(c3, want) and torch.equal(out, out3)
        res[f"{kind}/err"] = (out.double() - refs[kind]).abs().max().item()
    return res


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_tile_runs_over_gloo(world):
    bad_match = {
        "v_view": "ValueError: v must be the view k", "cache_pair": "ValueError: cache of a kv_layout='fp8_tile'",
        "cache_dtype": "TypeError: k dtype torch.float8_e4m3fn", "scales": "ValueError: .*carry their own tile",
        "k_shape": r"ValueError: k must be this rank's new rows", "writes": "ValueError: writes= is required",
        "page_table": "ValueError: page_table must be",
    }
    import re

    for rank, res in enumerate(run_distributed(_run_worker, world)):
        assert res["algorithm"] == "gather_kv"
        for name, pattern in bad_match.items():
            assert re.match(pattern, res[f"bad/{name}"]), (rank, name, res[f"bad/{name}"])
        assert res["bad/collectives"] == 0 and res["bad/unchanged"]
        assert res["gather/cache_equal"], rank
        assert res["gather/err"] < TOLERANCE[torch.bfloat16], (rank, res["gather/err"])
        # ONE all-gather of 656-byte rows; the bf16 plan's run moves K once (1,152 bytes: its V is a
        # view of K, not moved again), as gather_mla_latent does
        assert res["gather/bytes"] == [656 * res["P"]] and res["bf16/bytes"] == [1152 * res["P"]], res
        for kind in ("dense", "sparse"):
            assert res[f"{kind}/algorithm"] == "shard_merge"
            assert res[f"{kind}/bad"].startswith("page_table holds 0 pages"), res[f"{kind}/bad"]
            assert res[f"{kind}/bad_collectives"] == 0 and res[f"{kind}/bad_unchanged"]
            assert res[f"{kind}/collectives"] == 1 and res[f"{kind}/cache_equal"], (rank, kind)
            assert res[f"{kind}/err"] < TOLERANCE[torch.float32], (rank, kind, res[f"{kind}/err"])


def _extend_worker(rank, world):
    """pass-KV and pass-Q runs over a sharded tile cache (zigzag, pad rows, prefixes): outputs vs
    the fp64 oracle on the dequantized latent, the cache vs write_mla_cache(layout=) of the same
    rows through the plan's writes, ONE all-gather of tile rows per layer, and bad inputs refused
    before any collective or write."""
    from test_dsa_sharded import _shard_paged

    r, rope, hq, ps = 512, 64, 4, 4
    group = torch.distributed.group.WORLD
    g = torch.Generator().manual_seed(31)
    ext, pre = [7, 0, 1, 2 * world - 1, 3], [5, 4, 0, 2, 9]
    kv_lens = [e + p for e, p in zip(ext, pre)]
    lat, deq, q, _, new_rows = _run_inputs(ext, pre, r, rope, hq, torch.bfloat16, g)
    tiles = quantize_mla_fp8_tiles(lat[:, 0, :r], lat[:, 0, r:])[:, None, :]
    per_seq = list(tiles.clone().index_fill_(0, new_rows, 0xFF).split(kv_lens))  # the new rows: not cached yet
    s = cpattn.ZigzagStrategy(world, pad_multiple=4)
    meta = s.build_metadata(ext, pre, rank=rank, kv=cpattn.KVSharding(world), group=group)
    ref, _ = attention_oracle(q, deq, deq[..., :r], ext, pre)
    q_local, k_local = s.shard(q, meta), s.shard(lat[meta.kv_extend_index], meta)
    res = {"P": meta.num_physical_tokens, "Np": max(meta.num_local_prefix_tokens_per_rank)}
    for algo in ("pass_kv", "pass_q"):
        cache, table = _shard_paged(per_seq, world, 1, rank, ps, torch.Generator().manual_seed(rank))
        plan = cpattn.plan_attention(meta, _tile_spec(hq, r, rope, torch.bfloat16, ps), page_table=table,
                                     num_pages=cache.shape[0], algorithm=algo, backend="torch")
        before = cache.clone()
        bad = {"v_view": (k_local, k_local[..., :r].clone(), (cache, cache)),
               "cache_pair": (k_local, k_local[..., :r], (cache, cache.clone())),
               "cache_shape": (k_local, k_local[..., :r], (cache[:, :, :, :-1], cache[:, :, :, :-1]))}
        with CountCollectives() as none:
            for name, (k, v, c) in bad.items():
                try:
                    plan.run(q_local, k, v, c, group=group)
                    res[f"{algo}/bad/{name}"] = "no error"
                except ValueError as e:
                    res[f"{algo}/bad/{name}"] = str(e)
        res[f"{algo}/bad/collectives"], res[f"{algo}/bad/unchanged"] = len(none.calls), torch.equal(cache, before)
        want = cache.clone()
        cpattn.write_mla_cache(lat[meta.kv_extend_index, 0, :r], lat[meta.kv_extend_index, 0, r:], want[..., 0, :],
                               plan.writes, layout=FP8_TILE)
        with CountCollectives() as ag:
            out = plan.run(q_local, k_local, k_local[..., :r], (cache, cache), group=group)
        res[f"{algo}/bytes"] = [math.prod(c) for c in ag.calls]
        res[f"{algo}/cache_equal"] = torch.equal(cache, want)
        res[f"{algo}/err"] = (s.gather(out, meta, group).double() - ref).abs().max().item()
        res[f"{algo}/pad_zero"] = bool((out[meta.num_local_tokens :] == 0).all())
    return res


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_tile_extend_runs_over_gloo(world):
    for rank, res in enumerate(run_distributed(_extend_worker, world)):
        for algo in ("pass_kv", "pass_q"):
            assert res[f"{algo}/bad/v_view"].startswith("v must be the view k[..., :512]"), res
            assert res[f"{algo}/bad/cache_pair"].startswith("cache of a kv_layout='fp8_tile' plan is (rows, rows)")
            assert res[f"{algo}/bad/cache_shape"].startswith("cache must be [num_pages, 4, 1, 656]"), res
            assert res[f"{algo}/bad/collectives"] == 0 and res[f"{algo}/bad/unchanged"]
            assert res[f"{algo}/cache_equal"] and res[f"{algo}/pad_zero"], (rank, algo)
            assert res[f"{algo}/err"] < TOLERANCE[torch.bfloat16], (rank, algo, res[f"{algo}/err"])
            (nbytes,) = res[f"{algo}/bytes"]  # ONE all-gather per layer
            if algo == "pass_kv":  # rows of 656 bytes: this rank's new rows, then its prefix shard's
                assert nbytes == 656 * (res["P"] + res["Np"]) and res["Np"] > 0, (nbytes, res["P"], res["Np"])
            else:  # q rows (4 heads x 576 bf16) and 656-byte tile rows
                assert nbytes == res["P"] * (4 * 576 * 2 + 656), nbytes


def test_packed_tile_run_checks_its_prefix():
    """A packed tile plan's run: the prefix tile rows must be uint8 [sum(prefix_lens), 1, row],
    given as (rows, rows) when the batch has a prefix; writes= is refused (checked before use)."""
    ext, pre = [2, 1], [3, 0]
    meta = cpattn.get_strategy("replicated", 1).build_metadata(ext, pre, rank=0)
    plan = cpattn.plan_attention(meta, _tile_spec(4, 128, 16, torch.float32), backend="torch")
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(3, 4, 144, generator=g), torch.randn(3, 1, 144, generator=g)
    rows, _ = _latent(3, 128, 16, g)
    pre_rows = rows[:, None, :]
    cases = [
        ("the batch has 3 prefix tokens: pass cache=", None, {}),
        (r"must be uint8 \[sum\(prefix_lens\)=3, 1, 164\]", (pre_rows[:2], pre_rows[:2]), {}),
        (r"must be uint8 \[sum\(prefix_lens\)=3, 1, 164\]", (pre_rows.view(FP8), pre_rows.view(FP8)), {}),
        ("writes= is for a paged cache", (pre_rows, pre_rows), dict(writes=torch.arange(3))),
    ]
    for match, cache, kw in cases:
        with pytest.raises(ValueError, match=match):
            plan.run(q, k, k[..., :128], cache, **kw)
    out = plan.run(q, k, k[..., :128], (pre_rows, pre_rows))
    # packed: sequence 0's 3 prefix rows, its 2 new rows, sequence 1's new row
    lat = torch.cat([pre_rows, quantize_mla_fp8_tiles(k[:, 0, :128], k[:, 0, 128:])[:, None, :]])
    assert torch.equal(out, plan.attend(q, lat, lat))


def test_cost_model_prices_tile_rows_at_656_bytes():
    """An extend over a sharded tile-scaled latent cache is priced at the 656 bytes per token
    the gather moves (spec.kv_row_bytes), not Hkv (D + Dv) = 1088 values of the cache dtype."""
    spec = cpattn.AttentionSpec(num_q_heads=16, num_kv_heads=1, head_dim=576, head_dim_v=512, dtype=torch.bfloat16,
                                page_size=64, kv_dtype=torch.float8_e4m3fn, kv_layout="fp8_tile")
    assert spec.kv_row_bytes == 656
    assert spec.replace(kv_layout=None).kv_row_bytes == 1088
    assert spec.replace(kv_layout=None, kv_dtype=None).kv_row_bytes == 2176
    meta = cpattn.ZigzagStrategy(4).build_metadata([64, 30], [4000, 900], rank=0, kv=cpattn.KVSharding(4))
    dims = dict(num_q_heads=16, num_kv_heads=1, head_dim=576, head_dim_v=512, dtype=torch.bfloat16,
                kv_dtype=torch.float8_e4m3fn)
    values = cpattn.CostModel().estimate(meta, **dims)
    tiles = cpattn.CostModel().estimate(meta, **dims, kv_row_bytes=656)
    assert tiles["bytes_pass_kv"] * 1088 == values["bytes_pass_kv"] * 656
    table = torch.arange(2 * 20, dtype=torch.int32).view(2, 20)
    plan = cpattn.plan_attention(meta, spec, page_table=table, num_pages=40, backend="torch")
    assert plan.estimate == tiles
    with pytest.raises(ValueError, match="kv_row_bytes"):
        cpattn.CostModel().estimate(meta, **dims, kv_row_bytes=0)
