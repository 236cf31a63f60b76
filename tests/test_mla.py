"""MLA under CP: latent all-gather, cache writes, the reference MLA layer (up-projected and absorbed).

Distributed checks run on gloo with 2 and 3 spawned ranks; each spawn does every check in one
worker (a spawn costs seconds). Single-process checks (bytes, validation, absorbed == up-projected)
run in the test process.

Tolerances (CP output vs the same layer on one process, max |diff| / max(1, max |ref|)):
fp32 1e-5, bf16 2e-2 (two bf16 ulps near 1). CP and one process run the same code; differences
come only from GEMMs/attention over different row counts. Gathered latents and caches written from
them are compared bit for bit.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import cpattn
from reference_layers.mla import MLAAttention, MLAConfig

from dist_utils import CountCollectives, run_distributed

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
CFG = MLAConfig(
    hidden=48, num_heads=4, q_lora_rank=40, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10
)
STRATEGIES = ("zigzag", "interleave", "contiguous")
FP8 = torch.float8_e4m3fn


def _batch(cp: int) -> tuple[list[int], list[int]]:
    """Ragged, with prefixes; extend lengths 0, 1 and < 2C included."""
    return [0, 1, 2 * cp - 1, 2 * cp + 1, 11, 4], [3, 0, 2, 0, 5, 1]


def _positions(ext: list[int], pre: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p, p + e) for e, p in zip(ext, pre)])


def _random_rows(gen: torch.Generator, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Random bit patterns (any dtype, fp8 included) so a byte-level mistake cannot hide."""
    nbytes = cols * dtype.itemsize
    raw = torch.randint(0, 256, (rows, nbytes), generator=gen, dtype=torch.uint8)
    return raw.view(dtype) if dtype != torch.uint8 else raw


def _shard_bytes(s, x: torch.Tensor, meta) -> torch.Tensor:
    """Shard [T, n] of any dtype through its bytes; fill pad rows with garbage (must be stripped)."""
    local = s.shard(x.view(torch.uint8), meta)
    local[meta.num_local_tokens :] = 0xAB
    return local.view(x.dtype)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


# ------------------------------------------------------------------------------- distributed worker
def _check_latent_gathers(rank: int, cp: int) -> int:
    ext, pre = _batch(cp)
    r, d_rope = 20, 6  # odd byte widths: alignment padding inside the packed row is exercised
    dtypes = [(torch.bfloat16,) * 2, (torch.float16,) * 2, (torch.float32,) * 2, (FP8, FP8), (FP8, torch.bfloat16)]
    checks = 0
    for name, pad in [(n, 1) for n in STRATEGIES] + [("zigzag", 4)]:
        s = cpattn.get_strategy(name, cp, pad_multiple=pad)
        meta = s.build_metadata(ext, pre, rank=rank)
        t = meta.num_tokens
        for dt_c, dt_pe in dtypes:
            gen = torch.Generator().manual_seed(7)
            kv_c, k_pe = _random_rows(gen, t, r, dt_c), _random_rows(gen, t, d_rope, dt_pe)
            kv_c_local, k_pe_local = _shard_bytes(s, kv_c, meta), _shard_bytes(s, k_pe, meta)
            with CountCollectives() as counter:
                got_c, got_pe = s.gather_mla_latent(kv_c_local, k_pe_local, meta)
            assert len(counter.calls) == 1, f"{name} {dt_c}: {len(counter.calls)} collectives, expected 1"
            row_bytes = gathered_row = counter.calls[0][1]
            assert counter.calls[0] == (meta.num_physical_tokens, row_bytes)
            assert gathered_row == cpattn.gathered_bytes_per_token([kv_c_local, k_pe_local])
            if dt_c == dt_pe:
                assert gathered_row == cpattn.mla_bytes_per_token(r, d_rope, dt_c, aligned=True)
            assert got_c.dtype == dt_c and got_pe.dtype == dt_pe
            assert torch.equal(_bits(got_c), _bits(kv_c)), f"{name} pad={pad} {dt_c}: kv_c differs"
            assert torch.equal(_bits(got_pe), _bits(k_pe)), f"{name} pad={pad} {dt_pe}: k_pe differs"

            # Cache written from the CP gather == cache written from the logical latent, bit for bit.
            if dt_c == dt_pe:
                num_slots = 2 * t + 8
                slots = torch.randperm(num_slots, generator=gen)[: t + 5]  # 5 pad entries past T
                sentinel = torch.full((num_slots, (r + d_rope) * dt_c.itemsize), 0x5A, dtype=torch.uint8)
                cache_cp, cache_ref = sentinel.clone().view(dt_c), sentinel.clone().view(dt_c)
                plan = cpattn.plan_cache_writes(meta, slots, num_slots=num_slots)  # keeps slots[:T]
                cpattn.write_mla_cache(got_c, got_pe, cache_cp, plan)
                cpattn.write_mla_cache(kv_c, k_pe, cache_ref, slots[:t])  # raw: exactly T slots
                assert torch.equal(_bits(cache_cp), _bits(cache_ref))
                untouched = torch.ones(num_slots, dtype=torch.bool)
                untouched[slots[:t]] = False
                assert torch.equal(_bits(cache_cp)[untouched], sentinel[untouched]), "a pad/unused slot was written"
            checks += 1
    return checks


def _check_kv_cache_writes(rank: int, cp: int) -> int:
    ext, pre = _batch(cp)
    s = cpattn.ZigzagStrategy(cp)
    meta = s.build_metadata(ext, pre, rank=rank)
    t, hkv = meta.num_tokens, 2
    checks = 0
    for dtype in (torch.bfloat16, FP8):
        gen = torch.Generator().manual_seed(11)
        k = _random_rows(gen, t, hkv * 6, dtype).view(t, hkv, 6)
        v = _random_rows(gen, t, hkv * 4, dtype).view(t, hkv, 4)
        k_loc = _shard_bytes(s, k.reshape(t, -1), meta).view(-1, hkv, 6)
        v_loc = _shard_bytes(s, v.reshape(t, -1), meta).view(-1, hkv, 4)
        with CountCollectives() as counter:
            k_ext, v_ext = s.gather_kv(k_loc, v_loc, meta)
        assert len(counter.calls) == 1
        page_size, pages, swa_slots_n = 4, (t + 12) // 4 + 1, t + 3
        slots = torch.randperm(pages * page_size, generator=gen)[: t + 4].to(torch.int32)
        swa_slots = torch.randperm(swa_slots_n, generator=gen)[: t + 2]

        def caches():
            def cache(shape, fill):
                return torch.full((*shape[:-1], shape[-1] * dtype.itemsize), fill, dtype=torch.uint8).view(dtype)

            return (
                cache((pages, page_size, hkv, 6), 0x33),
                cache((pages, page_size, hkv, 4), 0x33),
                cache((swa_slots_n, hkv, 6), 0x44),
                cache((swa_slots_n, hkv, 4), 0x44),
            )

        cp_caches, ref_caches = caches(), caches()
        plan = cpattn.plan_cache_writes(meta, slots, num_slots=pages * page_size)  # once per forward; keeps slots[:T]
        swa_plan = cpattn.plan_cache_writes(meta, swa_slots, num_slots=swa_slots_n, name="swa_slots")  # the SWA pool's
        cpattn.write_kv_cache(k_ext, v_ext, *cp_caches[:2], plan, swa_writes=swa_plan,
                              swa_k_cache=cp_caches[2], swa_v_cache=cp_caches[3])
        cpattn.write_kv_cache(k, v, *ref_caches[:2], slots[:t], swa_writes=swa_slots[:t],
                              swa_k_cache=ref_caches[2], swa_v_cache=ref_caches[3])
        for a, b in zip(cp_caches, ref_caches):
            assert torch.equal(_bits(a), _bits(b))
        kc = _bits(cp_caches[0]).view(pages * page_size, -1)
        untouched = torch.ones(pages * page_size, dtype=torch.bool)
        untouched[slots[:t].long()] = False
        assert bool((kc[untouched] == 0x33).all())
        assert torch.equal(_bits(cp_caches[2]).view(swa_slots_n, -1)[swa_slots[:t]], _bits(k).view(t, -1))
        swa_untouched = torch.ones(swa_slots_n, dtype=torch.bool)
        swa_untouched[swa_slots[:t]] = False
        assert bool((_bits(cp_caches[3]).view(swa_slots_n, -1)[swa_untouched] == 0x44).all())
        checks += 1
    return checks


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) / max(1.0, float(b.float().abs().max()))


def _check_layers(rank: int, cp: int) -> dict:
    ext, pre = _batch(cp)
    t, num_prefix = sum(ext), sum(pre)
    r, d_rope = CFG.kv_lora_rank, CFG.qk_rope_head_dim
    page_size = 4
    num_slots = 4 * (t + num_prefix)
    errs: dict = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = MLAAttention(CFG, seed=3, dtype=dtype)
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(t, CFG.hidden, generator=gen).to(dtype)
        pos = _positions(ext, pre)
        prefix = (torch.randn(num_prefix, r, generator=gen).to(dtype), torch.randn(num_prefix, d_rope, generator=gen).to(dtype))
        perm = torch.randperm(num_slots, generator=gen)
        prefix_slots, ext_slots = perm[:num_prefix], perm[num_prefix : num_prefix + t + 3]  # 3 pad entries
        sentinel = torch.full((num_slots // page_size, page_size, r + d_rope), -7.0, dtype=dtype)
        for absorb in (False, True):
            for name in STRATEGIES:
                s1 = cpattn.get_strategy(name, 1)
                meta1 = s1.build_metadata(ext, pre, rank=0)
                cache_ref = sentinel.clone()
                ref, lat_ref = model(x, pos, s1, meta1, prefix_latent=prefix, cache=cache_ref, slots=ext_slots, absorb=absorb)

                s = cpattn.get_strategy(name, cp)
                meta = s.build_metadata(ext, pre, rank=rank)
                cache_cp = sentinel.clone()
                with CountCollectives() as counter:
                    out, lat = model(
                        s.shard(x, meta), s.shard(pos, meta), s, meta,
                        prefix_latent=prefix, cache=cache_cp, slots=ext_slots, absorb=absorb,
                    )
                assert len(counter.calls) == 1, f"the layer ran {len(counter.calls)} collectives, expected 1"
                assert counter.calls[0][1] == cpattn.mla_bytes_per_token(r, d_rope, dtype, aligned=True)
                full = s.gather(out, meta)
                key = (str(dtype).split(".")[-1], "absorbed" if absorb else "up", name)
                err = _rel_err(full, ref)
                lat_err = max(_rel_err(lat[0], lat_ref[0]), _rel_err(lat[1], lat_ref[1]))
                cache_err = _rel_err(cache_cp, cache_ref)
                errs[key] = (err, lat_err, cache_err)
                assert err <= TOL[dtype], f"{key}: CP vs single process {err:.3g} > {TOL[dtype]}"
                assert lat_err <= TOL[dtype] and cache_err <= TOL[dtype], f"{key}: latent/cache {lat_err}, {cache_err}"
                assert bool((out[meta.num_local_tokens :] == 0).all()), "pad rows of the output must be zero"
                flat = cache_cp.view(num_slots, -1)
                untouched = torch.ones(num_slots, dtype=torch.bool)
                untouched[ext_slots[:t]] = False
                assert bool((flat[untouched] == -7.0).all()), "a pad/unused slot of the cache was written"

                # Prefix read from the cache instead of given: same result, bit for bit.
                if name == "zigzag":
                    cpattn.write_mla_cache(*prefix, cache_cp, prefix_slots)
                    out2, _ = model(
                        s.shard(x, meta), s.shard(pos, meta), s, meta,
                        cache=cache_cp, slots=ext_slots, prefix_slots=prefix_slots, absorb=absorb,
                    )
                    assert torch.equal(out2, out), f"{key}: prefix from cache != prefix given"
    return errs


def _cp_worker(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    return {
        "latent_checks": _check_latent_gathers(rank, world_size),
        "kv_checks": _check_kv_cache_writes(rank, world_size),
        "layer_errors": _check_layers(rank, world_size),
    }


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 3])
def test_mla_under_cp_gloo(cp):
    results = run_distributed(_cp_worker, cp)
    assert all(res["latent_checks"] == 4 * 5 for res in results)
    assert all(res["kv_checks"] == 2 for res in results)
    # every rank gathers the same output: the errors are identical across ranks
    assert all(res["layer_errors"] == results[0]["layer_errors"] for res in results)
    assert len(results[0]["layer_errors"]) == 2 * 2 * len(STRATEGIES)


TRITON_CFG = MLAConfig(  # head dims the triton kernel takes: D = 16 + 16 (up) or 32 + 16 (absorbed)
    hidden=32, num_heads=2, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16
)


def _triton_worker(rank: int, world_size: int) -> dict:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is first imported (lazily)
    ext, pre = _batch(world_size)
    model = MLAAttention(TRITON_CFG, seed=4)
    gen = torch.Generator().manual_seed(9)
    x, pos = torch.randn(sum(ext), TRITON_CFG.hidden, generator=gen), _positions(ext, pre)
    prefix = (
        torch.randn(sum(pre), TRITON_CFG.kv_lora_rank, generator=gen),
        torch.randn(sum(pre), TRITON_CFG.qk_rope_head_dim, generator=gen),
    )
    errs = {}
    for name in ("zigzag", "interleave"):
        s1, s = cpattn.get_strategy(name, 1), cpattn.get_strategy(name, world_size)
        meta1, meta = s1.build_metadata(ext, pre, rank=0), s.build_metadata(ext, pre, rank=rank)
        for absorb in (False, True):
            ref, _ = model(x, pos, s1, meta1, prefix_latent=prefix, absorb=absorb, backend="torch")
            out, _ = model(s.shard(x, meta), s.shard(pos, meta), s, meta, prefix_latent=prefix, absorb=absorb, backend="triton")
            errs[(name, absorb)] = err = _rel_err(s.gather(out, meta), ref)
            assert err <= TOL[torch.float32], f"triton {name} absorb={absorb}: {err}"
    return errs


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (interpreter)")
def test_mla_triton_backend_under_cp():
    """Both forms through backend="triton" (Triton interpreter on CPU) under CP == torch on one process."""
    results = run_distributed(_triton_worker, 2)
    assert len(results[0]) == 4


# ------------------------------------------------------------------------------- single process
def test_bytes_per_token_deepseek_v3():
    bf16 = torch.bfloat16
    assert cpattn.mla_bytes_per_token(512, 64, bf16) == 1152 == (512 + 64) * 2
    assert cpattn.mla_bytes_per_token(512, 64, bf16, aligned=True) == 1152
    assert cpattn.mla_bytes_per_token(512, 64, FP8) == 576
    kv = cpattn.kv_bytes_per_token(128, 192, 128, bf16)
    assert kv == 81920 and round(kv / 1152, 1) == 71.1
    parts = [torch.empty(3, 512, dtype=bf16), torch.empty(3, 64, dtype=bf16)]
    assert cpattn.gathered_bytes_per_token(parts) == 1152


@pytest.mark.parametrize("r,d_rope,dtype", [(7, 3, torch.float32), (20, 6, torch.bfloat16), (13, 2, FP8), (512, 64, FP8)])
def test_bytes_per_token_alignment(r, d_rope, dtype):
    raw = cpattn.mla_bytes_per_token(r, d_rope, dtype)
    aligned = cpattn.mla_bytes_per_token(r, d_rope, dtype, aligned=True)
    assert raw == (r + d_rope) * dtype.itemsize
    parts = [torch.empty(2, r, dtype=dtype), torch.empty(2, d_rope, dtype=dtype)]
    assert aligned == cpattn.gathered_bytes_per_token(parts)
    assert raw <= aligned < raw + 32 and aligned % 16 == 0


def test_absorbed_equals_up_projected_fp32():
    ext, pre = [5, 0, 9, 1], [3, 2, 0, 4]
    model = MLAAttention(CFG, seed=1)
    s = cpattn.ZigzagStrategy(1)
    meta = s.build_metadata(ext, pre, rank=0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(ext), CFG.hidden, generator=gen)
    prefix = (torch.randn(sum(pre), CFG.kv_lora_rank, generator=gen), torch.randn(sum(pre), CFG.qk_rope_head_dim, generator=gen))
    up, _ = model(x, _positions(ext, pre), s, meta, prefix_latent=prefix)
    ab, _ = model(x, _positions(ext, pre), s, meta, prefix_latent=prefix, absorb=True)
    assert _rel_err(ab, up) < 1e-5
    q_nope, q_pe, kv_c, k_pe = model.project_local(x, _positions(ext, pre))
    q, k, v = model.attention_inputs(q_nope, q_pe, kv_c, k_pe, absorb=True)
    latent = CFG.kv_lora_rank + CFG.qk_rope_head_dim
    assert q.shape == (x.shape[0], CFG.num_heads, latent) and k.shape == (x.shape[0], 1, latent)
    assert v.shape == (x.shape[0], 1, CFG.kv_lora_rank)  # MQA on the latent: D = r + d_rope, Dv = r


def test_write_mla_cache_trims_and_pages():
    gen = torch.Generator().manual_seed(2)
    kv_c, k_pe = torch.randn(5, 6, generator=gen), torch.randn(5, 2, generator=gen)
    cache = torch.full((3, 4, 8), -1.0)  # [num_pages, page_size, r + d_rope]
    slots = torch.tensor([9, 0, 4, 5, 11, 1, 2], dtype=torch.int32)  # 2 pad entries
    five = cpattn.ZigzagStrategy(1).build_metadata([5], rank=0)  # a forward of 5 new tokens
    plan = cpattn.plan_cache_writes(five, slots, num_slots=12)  # keeps slots[:5]
    assert cpattn.write_mla_cache(kv_c, k_pe, cache, plan) is cache
    flat = cache.view(12, 8)
    assert torch.equal(flat[slots[:5].long()], torch.cat([kv_c, k_pe], 1))
    assert bool((flat[[1, 2, 3, 6, 7, 8, 10]] == -1).all())
    got_c, got_pe = cpattn.read_mla_cache(cache, slots[:5], 6)
    assert torch.equal(got_c, kv_c) and torch.equal(got_pe, k_pe)
    # raw-byte cache with mixed dtypes: fp8 latent + bf16 rope key
    raw = torch.zeros(12, 6 + 2 * 2, dtype=torch.uint8)
    c8, pe16 = kv_c.to(FP8), k_pe.to(torch.bfloat16)
    cpattn.write_mla_cache(c8, pe16, raw, slots[:5])
    assert torch.equal(raw[slots[:5].long(), :6], c8.view(torch.uint8))
    assert torch.equal(raw[slots[:5].long(), 6:], pe16.view(torch.uint8))
    # T = 0 writes nothing
    cpattn.write_mla_cache(kv_c[:0], k_pe[:0], cache, slots[:0])


def _raises(exc, match, fn, *args, **kwargs):
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)


def test_cache_bad_inputs():
    kv_c, k_pe = torch.zeros(4, 6), torch.zeros(4, 2)
    cache, slots = torch.zeros(10, 8), torch.arange(4)
    w = cpattn.write_mla_cache
    _raises(ValueError, "kv_c must be 2-D", w, kv_c[0], k_pe, cache, slots)
    _raises(ValueError, "k_pe has 3", w, kv_c, k_pe[:3], cache, slots)
    _raises(ValueError, "slots has 3 entries", w, kv_c, k_pe, cache, slots[:3])
    _raises(TypeError, "slots must be int32 or int64", w, kv_c, k_pe, cache, slots.float())
    _raises(ValueError, "slots must be 1-D", w, kv_c, k_pe, cache, slots.view(2, 2))
    _raises(ValueError, r"cache rows are \[9\], expected \[8\]", w, kv_c, k_pe, torch.zeros(10, 9), slots)
    _raises(TypeError, "cache dtype", w, kv_c, k_pe, cache.half(), slots)
    _raises(ValueError, "cache must be", w, kv_c, k_pe, torch.zeros(10), slots)
    _raises(TypeError, "cache must be a torch.Tensor", w, kv_c, k_pe, None, slots)
    _raises(TypeError, "uint8", cpattn.read_mla_cache, torch.zeros(4, 8, dtype=torch.uint8), slots, 6)
    _raises(ValueError, "kv_lora_rank=9", cpattn.read_mla_cache, cache, slots, 9)

    k, v = torch.zeros(4, 2, 3), torch.zeros(4, 2, 5)
    kc, vc = torch.zeros(10, 2, 3), torch.zeros(10, 2, 5)
    wk = cpattn.write_kv_cache
    _raises(ValueError, "k must be", wk, k[0], v, kc, vc, slots)
    _raises(ValueError, "differ before the last dim", wk, k, v[:, :1], kc, vc, slots)
    _raises(ValueError, "k_cache rows", wk, k, v, torch.zeros(10, 2, 4), vc, slots)
    _raises(TypeError, "v_cache dtype", wk, k, v, kc, vc.half(), slots)
    _raises(ValueError, "given together", wk, k, v, kc, vc, slots, swa_writes=slots)
    swa_k, swa_v = torch.full((6, 2, 3), 9.0), torch.zeros(6, 2, 5)
    _raises(ValueError, "swa_slots has 2", wk, k + 1, v, kc, vc, slots, swa_writes=slots[:2], swa_k_cache=swa_k, swa_v_cache=swa_v)
    assert bool((kc == 0).all()), "a failed call must not write any cache"

    _raises(ValueError, "kv_lora_rank must be >= 1", cpattn.mla_bytes_per_token, 0, 64, torch.bfloat16)
    _raises(TypeError, "dtype must be a torch.dtype", cpattn.mla_bytes_per_token, 512, 64, "bf16")
    _raises(TypeError, "qk_rope_head_dim must be an int", cpattn.mla_bytes_per_token, 512, 6.5, torch.bfloat16)
    _raises(ValueError, "num_kv_heads must be >= 1", cpattn.kv_bytes_per_token, 0, 192, 128, torch.bfloat16)


def test_layer_bad_inputs():
    _raises(ValueError, "qk_rope_head_dim must be even", MLAConfig, qk_rope_head_dim=7)
    _raises(ValueError, "q_lora_rank", MLAConfig, q_lora_rank=0)
    _raises(TypeError, "config must be an MLAConfig", MLAAttention, {"hidden": 8})
    model = MLAAttention(CFG)
    s = cpattn.ZigzagStrategy(1)
    meta = s.build_metadata([3, 2], [2, 0], rank=0)
    x, pos = torch.zeros(5, CFG.hidden), torch.tensor([2, 3, 4, 0, 1])
    _raises(ValueError, "prefix_latent or prefix_slots", model, x, pos, s, meta)
    _raises(ValueError, "x must be", model, x[:, :3], pos, s, meta)
    _raises(ValueError, "positions must be", model, x, pos[:3], s, meta)
    bad_prefix = (torch.zeros(2, CFG.kv_lora_rank), torch.zeros(3, CFG.qk_rope_head_dim))
    _raises(ValueError, "prefix_latent k_pe", model, x, pos, s, meta, prefix_latent=bad_prefix)
    _raises(ValueError, "cache and slots", model, x, pos, s, meta, cache=torch.zeros(8, CFG.latent_dim))
    _raises(TypeError, "absorb must be a bool", model, x, pos, s, meta, absorb="yes")
    prefix = (torch.zeros(2, CFG.kv_lora_rank), torch.zeros(2, CFG.qk_rope_head_dim))
    slots = torch.arange(5)
    _raises(ValueError, "cache rows hold 30", model, x, pos, s, meta, prefix_latent=prefix, cache=torch.zeros(8, 30), slots=slots)
    _raises(TypeError, "cache dtype", model, x, pos, s, meta, prefix_latent=prefix, cache=torch.zeros(8, CFG.latent_dim).half(), slots=slots)
    _raises(ValueError, "slots has 4 entries", model, x, pos, s, meta, prefix_latent=prefix, cache=torch.zeros(8, CFG.latent_dim), slots=slots[:4])
    cache = torch.zeros(8, CFG.latent_dim)
    _raises(ValueError, "prefix_slots must have sum", model, x, pos, s, meta, cache=cache, slots=slots, prefix_slots=torch.arange(3))
    _raises(TypeError, "prefix_slots must be int32", model, x, pos, s, meta, cache=cache, slots=slots, prefix_slots=torch.zeros(2))
    _raises(ValueError, "not both", model, x, pos, s, meta, prefix_latent=prefix, cache=cache, slots=slots, prefix_slots=torch.arange(2))
    # write plans and prefix slots: checked against the cache before the collective; a rejected call writes nothing
    cache = torch.randn(8, CFG.latent_dim)
    before = cache.clone()
    _raises(ValueError, r"slots\[4\] = 8 is out of range", model, x, pos, s, meta, prefix_latent=prefix, cache=cache,
            slots=torch.tensor([0, 1, 2, 3, 8]))
    _raises(ValueError, "slots was planned for num_slots=9 but cache has 8", model, x, pos, s, meta,
            prefix_latent=prefix, cache=cache, slots=cpattn.plan_cache_writes(meta, slots, num_slots=9))
    _raises(ValueError, r"prefix_slots\[1\] = 8 is out of range \[0, num_slots=8\)", model, x, pos, s, meta,
            cache=cache, slots=slots, prefix_slots=torch.tensor([0, 8]))
    _raises(ValueError, r"prefix_slots\[0\] = -1 is out of range", model, x, pos, s, meta, cache=cache, slots=slots,
            prefix_slots=torch.tensor([-1, 0]))
    assert torch.equal(cache, before)
    # a plan gives the same result as raw slots
    out_raw, _ = model(x, pos, s, meta, prefix_latent=prefix, cache=cache.clone(), slots=slots)
    out_plan, _ = model(x, pos, s, meta, prefix_latent=prefix, cache=cache,
                        slots=cpattn.plan_cache_writes(meta, slots, num_slots=8))
    assert torch.equal(out_raw, out_plan)
    s2 = cpattn.ZigzagStrategy(2)
    meta2 = s2.build_metadata([3, 2], rank=0)
    _raises(ValueError, "kv_c_local", s2.gather_mla_latent, torch.zeros(7, 4), torch.zeros(meta2.num_physical_tokens, 2), meta2)


def test_bench_runs_single_process_cpu(tmp_path, monkeypatch):
    """``python benchmarks/run.py mla --small --device cpu`` without torchrun: bytes + the CP=1 layer."""
    import argparse
    import json

    from benchmarks import mla as bench_mla

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    parser = argparse.ArgumentParser()
    bench_mla.add_arguments(parser)
    out = tmp_path / "mla.json"
    args = parser.parse_args(["--small", "--device", "cpu", "--tokens", "64", "--iters", "1", "--warmup", "0",
                              "--forms", "up,absorbed", "--out", str(out)])
    assert bench_mla.main(args) == 0
    payload = json.loads(out.read_text())
    assert payload["bytes"]["latent_bytes_per_token"] == cpattn.mla_bytes_per_token(32, 8, torch.float32)
    assert [r["status"] for r in payload["layer"]] == ["ok", "ok"]
    assert (tmp_path / "mla.png").exists()
