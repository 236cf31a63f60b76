"""FP8 (e4m3) K/V caches: the spec option, quantization, quantizing cache writes, plans over FP8
caches (replicated and sharded), the gather of FP8 bytes.

Accuracy: attention over an FP8 cache is compared with the fp64 oracle of tests/oracle.py run on
the DEQUANTIZED cache values (the FP8 values the cache holds times their scales, computed here in
fp64), at the tolerance of the query dtype (``oracle.TOLERANCE``): quantization error is the
cache's, not the kernel's. The written FP8 rows are compared bit for bit with an independent
quantization written here (float32 divide, clamp to +-448, round to nearest by the cast).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpattn
from cpattn.quant import FP8_E4M3_MAX, dequantize_fp8, quantize_fp8
from dist_utils import CountCollectives, run_distributed
from oracle import TOLERANCE, attention_oracle

FP8 = torch.float8_e4m3fn


# ---------------------------------------------------------------------------------------- helpers
def _quantize_here(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The test's own e4m3 quantization of x [..., Hkv, D] (finite inputs)."""
    s = scale.view(-1, 1) if scale.dim() == 1 else scale
    return (x.float() / s).clamp(-448.0, 448.0).to(FP8)


def _dequantize_here(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = scale.double().view(-1, 1) if scale.dim() == 1 else scale.double()
    return x.double() * s


def _scales(x: torch.Tensor, per_head: bool, g: torch.Generator) -> torch.Tensor:
    """Scales putting x's amax (per head or overall) at 448 times a random factor in [0.3, 1.3]
    (values past the range saturate for factors < 1)."""
    if x.numel() == 0:  # no rows: any scale
        x = torch.ones(1, *x.shape[1:])
    amax = x.abs().amax(dim=(0, 2)) if per_head else x.abs().amax()
    factor = 0.3 + torch.rand(amax.shape, generator=g)
    return (amax.float() / FP8_E4M3_MAX * factor).clamp_min(1e-3)


def _paged_layout(kv_lens, ps, g):
    """A page table [B, max_pages] with distinct random pages per sequence, and the page count."""
    need = [-(-n // ps) for n in kv_lens]
    num_pages = sum(need) + 2
    perm = torch.randperm(num_pages, generator=g).tolist()
    width = max([1, *need])
    table = torch.zeros(len(kv_lens), width, dtype=torch.int32)
    i = 0
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(perm[i : i + n], dtype=torch.int32)
        i += n
    return table, num_pages


def _slot(table, b, j, ps):
    return int(table[b, j // ps]) * ps + j % ps


# ---------------------------------------------------------------------------------------- spec
def test_spec_kv_dtype():
    base = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    plain = cpattn.AttentionSpec(**base)
    assert plain.kv_dtype == torch.bfloat16 and not plain.kv_quantized
    assert cpattn.AttentionSpec(**base, kv_dtype=torch.bfloat16) == plain
    fp8 = cpattn.AttentionSpec(**base, kv_dtype=FP8)
    assert fp8.kv_quantized and fp8.kv_dtype == FP8
    assert fp8 != plain and hash(fp8) != hash(plain)  # plan-cache keys differ
    assert fp8.replace(page_size=16).kv_dtype == FP8
    with pytest.raises(TypeError, match="kv_dtype"):
        cpattn.AttentionSpec(**base, kv_dtype="fp8")
    with pytest.raises(ValueError, match="kv_dtype"):
        cpattn.AttentionSpec(**base, kv_dtype=torch.float16)
    with pytest.raises(ValueError, match="kv_dtype"):
        cpattn.AttentionSpec(**base, kv_dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match="FP8 kv_dtype needs dtype"):
        cpattn.AttentionSpec(**dict(base, dtype=torch.float64), kv_dtype=FP8)


# ---------------------------------------------------------------------------------------- quantization
_finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=200, deadline=None)
@given(st.lists(_finite, min_size=1, max_size=64), st.floats(1e-3, 1e3))
def test_round_trip_within_half_an_e4m3_step(values, scale):
    x = torch.tensor(values, dtype=torch.float32).view(-1, 1, 1)
    s = torch.tensor(scale, dtype=torch.float32)
    scale = s.item()
    q = quantize_fp8(x, s)
    assert q.dtype == FP8 and q.shape == x.shape
    assert not q.float().isnan().any()  # never NaN from overflow
    back = dequantize_fp8(q, s).double()
    y = x.double() / scale
    inside = y.abs() <= FP8_E4M3_MAX
    # e4m3: 3 mantissa bits -> relative half-step 2^-4 for normals, absolute 2^-10 below 2^-6
    bound = torch.maximum(y.abs() * 2.0**-4, torch.full_like(y, 2.0**-10)) * scale
    err = (back - x.double()).abs()
    assert bool((err[inside] <= bound[inside] * (1 + 1e-6)).all()), (err[inside] - bound[inside]).max()
    # saturation: past the range, +-448 with the input's sign
    out = q.float().double()
    assert bool((out[~inside] == FP8_E4M3_MAX * torch.sign(y[~inside])).all())
    # idempotent on representable values, monotone
    assert torch.equal(quantize_fp8(dequantize_fp8(q, s), s).view(torch.uint8), q.view(torch.uint8))
    order = torch.argsort(x.view(-1))
    assert bool((q.float().view(-1)[order].diff() >= 0).all())


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 4), st.integers(1, 8), st.integers(0, 2**31 - 1))
def test_per_head_scales_apply_along_the_head_dim(hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, hkv, d, generator=g) * 100
    s = torch.rand(hkv, generator=g) + 0.05
    q = quantize_fp8(x, s)
    for h in range(hkv):
        assert torch.equal(q[:, h].view(torch.uint8), quantize_fp8(x[:, h : h + 1], s[h]).view(torch.uint8)[:, 0])
        assert torch.equal(dequantize_fp8(q, s)[:, h], q[:, h].float() * s[h])
    assert torch.equal(q.view(torch.uint8), _quantize_here(x, s).view(torch.uint8))


def test_nonfinite_inputs_become_nan_and_overflow_saturates():
    s = torch.tensor(0.5)
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 3e38, 0.0, -0.0]).view(-1, 1, 1)
    q = quantize_fp8(x, s).float().view(-1)
    assert q[:3].isnan().all()  # propagated (e4m3fn has no infinity)
    assert q[3:].tolist() == [448.0, -448.0, 448.0, 0.0, -0.0]
    # a finite x over a tiny scale overflows float32 in the divide: still saturates, not NaN
    tiny = torch.tensor(1e-39)
    assert quantize_fp8(torch.tensor([[[1e3]]]), tiny).float().item() == 448.0
    assert math.copysign(1, quantize_fp8(torch.tensor([[[-1e-30]]]), s).float().item()) == -1.0


def test_quantize_rejects_bad_scales():
    x = torch.randn(3, 2, 4)
    with pytest.raises(TypeError, match="scale must be a float32"):
        quantize_fp8(x, torch.tensor(1.0, dtype=torch.float64))
    with pytest.raises(ValueError, match="per KV head"):
        quantize_fp8(x, torch.ones(3))
    with pytest.raises(TypeError, match="scale must be a torch.Tensor"):
        quantize_fp8(x, 1.0)


# ---------------------------------------------------------------------------------------- cache writes
def _write_setup(per_head, g):
    meta = cpattn.get_strategy("replicated", 1).build_metadata([3, 0, 2], [4, 1, 0], rank=0)
    table, num_pages = _paged_layout([7, 1, 2], 4, g)
    writes = cpattn.plan_cache_writes(meta, table, page_size=4, num_pages=num_pages)
    k = torch.randn(5, 2, 8, generator=g, dtype=torch.bfloat16) * 30
    v = torch.randn(5, 2, 8, generator=g, dtype=torch.bfloat16)
    kc = torch.randint(0, 255, (num_pages, 4, 2, 8), generator=g, dtype=torch.uint8).view(FP8)
    vc = torch.randint(0, 255, (num_pages, 4, 2, 8), generator=g, dtype=torch.uint8).view(FP8)
    ks, vs = _scales(k, per_head, g), _scales(v, per_head, g)
    return meta, table, writes, k, v, kc, vc, ks, vs


@pytest.mark.parametrize("per_head", [False, True])
def test_write_kv_cache_quantizes_the_written_rows(per_head):
    g = torch.Generator().manual_seed(1)
    meta, table, writes, k, v, kc, vc, ks, vs = _write_setup(per_head, g)
    before_k, before_v = kc.view(torch.uint8).clone(), vc.view(torch.uint8).clone()
    cpattn.write_kv_cache(k, v, kc, vc, writes, k_scale=ks, v_scale=vs)
    written = torch.zeros(kc.shape[0] * 4, dtype=torch.bool)
    row = 0
    for b, (e, p) in enumerate(zip([3, 0, 2], [4, 1, 0])):
        for j in range(p, p + e):
            slot = _slot(table, b, j, 4)
            assert torch.equal(kc.view(-1, 2, 8)[slot].view(torch.uint8), _quantize_here(k[row : row + 1], ks)[0]
                               .view(torch.uint8))
            assert torch.equal(vc.view(-1, 2, 8)[slot].view(torch.uint8), _quantize_here(v[row : row + 1], vs)[0]
                               .view(torch.uint8))
            written[slot] = True
            row += 1
    assert torch.equal(kc.view(torch.uint8).view(-1, 16)[~written], before_k.view(-1, 16)[~written])
    assert torch.equal(vc.view(torch.uint8).view(-1, 16)[~written], before_v.view(-1, 16)[~written])


def test_write_kv_cache_fp8_checks_everything_before_writing():
    g = torch.Generator().manual_seed(2)
    meta, table, writes, k, v, kc, vc, ks, vs = _write_setup(True, g)
    before = (kc.view(torch.uint8).clone(), vc.view(torch.uint8).clone())
    bad = {
        "k_scale must be a float32": (TypeError, dict(k_scale=ks.double(), v_scale=vs)),
        "v_scale must be per tensor": (ValueError, dict(k_scale=ks, v_scale=torch.ones(3))),
        "given together": (ValueError, dict(k_scale=ks)),
        "v_scale must be a torch.Tensor": (TypeError, dict(k_scale=ks, v_scale=1.0)),
    }
    for match, (exc, kwargs) in bad.items():
        with pytest.raises(exc, match=match):
            cpattn.write_kv_cache(k, v, kc, vc, writes, **kwargs)
    with pytest.raises(TypeError, match="unquantized rows"):
        cpattn.write_kv_cache(k.to(FP8), v.to(FP8), kc, vc, writes, k_scale=ks, v_scale=vs)
    with pytest.raises(TypeError, match="k_cache dtype torch.uint8: k_scale / v_scale quantize rows into a float8"):
        cpattn.write_kv_cache(k, v, kc.view(torch.uint8), vc.view(torch.uint8), writes, k_scale=ks, v_scale=vs)
    with pytest.raises(TypeError, match="k_cache dtype"):  # an FP8 cache without scales: rows must be FP8
        cpattn.write_kv_cache(k, v, kc, vc, writes)
    with pytest.raises(ValueError, match="swa_v_cache rows"):  # a second pool checked before the first is written
        cpattn.write_kv_cache(k, v, kc, vc, writes, k_scale=ks, v_scale=vs, swa_writes=writes, swa_k_cache=kc.clone(),
                              swa_v_cache=vc[..., :4].clone())
    assert torch.equal(kc.view(torch.uint8), before[0]) and torch.equal(vc.view(torch.uint8), before[1])


# ---------------------------------------------------------------------------------------- plans
BATCHES = [
    ([3, 0, 1, 5], [4, 6, 0, 9]),  # a sequence with no new rows, one with no prefix
    ([1, 1, 1], [0, 17, 40]),  # decode
    ([9], [0]),
]


def _plan_inputs(ext, pre, hq, hkv, d, dtype, per_head, g):
    kv_lens = [e + p for e, p in zip(ext, pre)]
    keys = torch.randn(sum(kv_lens), hkv, d, generator=g) * 4
    vals = torch.randn(sum(kv_lens), hkv, d, generator=g)
    q = torch.randn(sum(ext), hq, d, generator=g).to(dtype)
    ks, vs = _scales(keys, per_head, g), _scales(vals, per_head, g)
    starts = [sum(kv_lens[:b]) for b in range(len(kv_lens))]
    pre_rows = torch.cat([torch.arange(o, o + p) for o, p in zip(starts, pre)]).long()
    new_rows = torch.cat([torch.arange(o + p, o + p + e) for o, p, e in zip(starts, pre, ext)]).long()
    return kv_lens, keys.to(dtype), vals.to(dtype), q, ks, vs, pre_rows, new_rows


def _paged_fp8_prefix(keys, vals, kv_lens, pre, ps, ks, vs, g):
    table, num_pages = _paged_layout(kv_lens, ps, g)
    hkv, d = keys.shape[1:]
    kc = torch.full((num_pages, ps, hkv, d), float("nan")).to(FP8)  # unwritten slots: NaN (never read)
    vc = torch.full((num_pages, ps, hkv, d), float("nan")).to(FP8)
    row = 0
    for b, (n, p) in enumerate(zip(kv_lens, pre)):
        for j in range(p):
            slot = _slot(table, b, j, ps)
            kc.view(-1, hkv, d)[slot] = _quantize_here(keys[row + j : row + j + 1], ks)[0]
            vc.view(-1, hkv, d)[slot] = _quantize_here(vals[row + j : row + j + 1], vs)[0]
        row += n
    return kc, vc, table, num_pages


def _read_paged(cache, table, kv_lens, ps):
    flat = cache.view(-1, *cache.shape[2:])
    return torch.cat([flat[[_slot(table, b, j, ps) for j in range(n)]] for b, n in enumerate(kv_lens)])


@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", BATCHES)
def test_local_plan_over_fp8_cache_equals_oracle_on_dequantized_values(batch, dtype, per_head, paged):
    """plan.run writes (quantizes) the new rows, then attends the FP8 cache; the cache equals the
    test's quantization and the output the oracle over the dequantized cache."""
    ext, pre = batch
    g = torch.Generator().manual_seed(len(ext) * 7 + per_head)
    hq, hkv, d, ps = 4, 2, 16, 4
    kv_lens, keys, vals, q, ks, vs, pre_rows, new_rows = _plan_inputs(ext, pre, hq, hkv, d, dtype, per_head, g)
    meta = cpattn.get_strategy("replicated", 1).build_metadata(ext, pre, rank=0)
    spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype, kv_dtype=FP8,
                                page_size=ps if paged else None)
    plan = cpattn.plan_attention(meta, spec, backend="torch")
    assert plan.algorithm == "local"
    q_local = torch.cat([q, q.new_zeros(meta.num_physical_tokens - q.shape[0], hq, d)])
    k_new = torch.cat([keys[new_rows], keys.new_zeros(meta.num_physical_tokens - len(new_rows), hkv, d)])
    v_new = torch.cat([vals[new_rows], vals.new_zeros(meta.num_physical_tokens - len(new_rows), hkv, d)])
    if paged:
        kc, vc, table, num_pages = _paged_fp8_prefix(keys, vals, kv_lens, pre, ps, ks, vs, g)
        writes = cpattn.plan_cache_writes(meta, table, page_size=ps, num_pages=num_pages)
        out, lse = plan.run(q_local, k_new, v_new, (kc, vc), writes=writes, page_table=table, k_scale=ks, v_scale=vs,
                            return_lse=True)
        k_all, v_all = _read_paged(kc, table, kv_lens, ps), _read_paged(vc, table, kv_lens, ps)
    else:
        k_pre, v_pre = _quantize_here(keys[pre_rows], ks), _quantize_here(vals[pre_rows], vs)
        out, lse = plan.run(q_local, k_new, v_new, (k_pre, v_pre), k_scale=ks, v_scale=vs, return_lse=True)
        k_all = torch.empty(sum(kv_lens), hkv, d, dtype=FP8)
        v_all = torch.empty_like(k_all)
        k_all[pre_rows], v_all[pre_rows] = k_pre, v_pre
        k_all[new_rows], v_all[new_rows] = _quantize_here(k_new[: len(new_rows)], ks), \
            _quantize_here(v_new[: len(new_rows)], vs)
    assert torch.equal(k_all.view(torch.uint8), _quantize_here(keys, ks).view(torch.uint8))
    assert torch.equal(v_all.view(torch.uint8), _quantize_here(vals, vs).view(torch.uint8))
    ref, ref_lse = attention_oracle(q, _dequantize_here(k_all, ks), _dequantize_here(v_all, vs), ext, pre)
    t = q.shape[0]
    tol = TOLERANCE[dtype]
    assert (out[:t].double() - ref).abs().max().item() < tol
    assert (lse[:t].double() - ref_lse).abs().max().item() < tol
    assert (out[t:] == 0).all() and torch.isneginf(lse[t:]).all()


@pytest.mark.parametrize("per_head", [False, True])
def test_shard_merge_plan_over_fp8_cache(per_head):
    """Replicated decode queries over a sharded FP8 cache (C = 1 here, C = 2 over gloo below)."""
    ext, pre = [1, 2, 1], [5, 11, 0]
    g = torch.Generator().manual_seed(5)
    hq, hkv, d, ps = 4, 2, 16, 4
    kv_lens, keys, vals, q, ks, vs, pre_rows, new_rows = _plan_inputs(ext, pre, hq, hkv, d, torch.bfloat16,
                                                                      per_head, g)
    meta = cpattn.get_strategy("replicated", 1).build_metadata(ext, pre, rank=0, kv=cpattn.KVSharding(1))
    spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16, kv_dtype=FP8,
                                page_size=ps)
    plan = cpattn.plan_attention(meta, spec, backend="torch")
    assert plan.algorithm == "shard_merge"
    kc, vc, table, num_pages = _paged_fp8_prefix(keys, vals, kv_lens, pre, ps, ks, vs, g)
    writes = cpattn.plan_cache_writes(meta, table, page_size=ps, num_pages=num_pages)
    out = plan.run(q, keys[new_rows], vals[new_rows], (kc, vc), writes=writes, page_table=table, k_scale=ks,
                   v_scale=vs)
    k_all, v_all = _read_paged(kc, table, kv_lens, ps), _read_paged(vc, table, kv_lens, ps)
    assert torch.equal(k_all.view(torch.uint8), _quantize_here(keys, ks).view(torch.uint8))
    ref, _ = attention_oracle(q, _dequantize_here(k_all, ks), _dequantize_here(v_all, vs), ext, pre)
    assert (out.double() - ref).abs().max().item() < TOLERANCE[torch.bfloat16]


def test_fp8_plans_check_scales_before_writing():
    ext, pre = [2, 1], [3, 0]
    g = torch.Generator().manual_seed(9)
    hq, hkv, d, ps = 4, 2, 8, 4
    kv_lens, keys, vals, q, ks, vs, _, new_rows = _plan_inputs(ext, pre, hq, hkv, d, torch.float32, True, g)
    meta = cpattn.get_strategy("replicated", 1).build_metadata(ext, pre, rank=0)
    spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.float32, kv_dtype=FP8,
                                page_size=ps)
    plan = cpattn.plan_attention(meta, spec, backend="torch")
    kc, vc, table, num_pages = _paged_fp8_prefix(keys, vals, kv_lens, pre, ps, ks, vs, g)
    writes = cpattn.plan_cache_writes(meta, table, page_size=ps, num_pages=num_pages)
    before = (kc.view(torch.uint8).clone(), vc.view(torch.uint8).clone())
    args = (q, keys[new_rows], vals[new_rows], (kc, vc))
    cases = {
        "pass k_scale": (ValueError, dict(v_scale=vs)),
        "pass v_scale": (ValueError, dict(k_scale=ks)),
        "k_scale must be a float32": (TypeError, dict(k_scale=ks.half(), v_scale=vs)),
        r"v_scale must be per tensor \[\] or per KV head \[Hkv=2\]": (ValueError, dict(k_scale=ks, v_scale=vs[:1])),
    }
    for match, (exc, kwargs) in cases.items():
        with pytest.raises(exc, match=match):
            plan.run(*args, writes=writes, page_table=table, **kwargs)
    with pytest.raises(TypeError, match="k dtype torch.float32 != the plan's kv_dtype"):
        plan.attend(q, kc.float(), vc, page_table=table, k_scale=ks, v_scale=vs)
    with pytest.raises(TypeError, match="k_cache dtype torch.float32: k_scale / v_scale quantize rows into a float8"):
        plan.run(q, keys[new_rows], vals[new_rows], (kc.float(), vc), writes=writes, page_table=table, k_scale=ks,
                 v_scale=vs)
    assert torch.equal(kc.view(torch.uint8), before[0]) and torch.equal(vc.view(torch.uint8), before[1])
    plain = cpattn.plan_attention(meta, spec.replace(kv_dtype=None), backend="torch")
    with pytest.raises(ValueError, match="k_scale / v_scale are for an FP8 cache"):
        plain.attend(q, kc.float(), vc.float(), page_table=table, k_scale=ks, v_scale=vs)


def test_backends_without_fp8_support_say_so():
    """FA4 does not read FP8 caches: its backend names the reason (auto never picks it)."""
    from cpattn.kernels import get_backend

    meta = cpattn.get_strategy("replicated", 1).build_metadata([1], [3], rank=0)
    spec = cpattn.AttentionSpec(num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16, kv_dtype=FP8,
                                page_size=4)
    try:
        backend = get_backend("fa4")
    except ImportError:
        pytest.skip("the fa4 backend module cannot load here")
    assert "FP8" in backend.unsupported_reason(spec, meta)


# ---------------------------------------------------------------------------------------- over gloo
def _sharded_fp8_prefix(keys, vals, kv_lens, pre, ps, ks, vs, world, rank):
    """This rank's FP8 paged shard (interleave 1: position p on rank p % C) holding the quantized
    prefix keys it owns (unwritten slots NaN) -> (k_cache, v_cache, page_table, num_pages)."""
    hkv, d = keys.shape[1:]
    local_lens = [len([p for p in range(n) if p % world == rank]) for n in kv_lens]
    table, num_pages = _paged_layout(local_lens, ps, torch.Generator().manual_seed(rank))
    kc = torch.full((num_pages, ps, hkv, d), float("nan")).to(FP8)
    vc = kc.clone()
    row = 0
    for b, (n, p) in enumerate(zip(kv_lens, pre)):
        for j, pos in enumerate(x for x in range(n) if x % world == rank):
            if pos < p:
                kc.view(-1, hkv, d)[_slot(table, b, j, ps)] = _quantize_here(keys[row + pos : row + pos + 1], ks)[0]
                vc.view(-1, hkv, d)[_slot(table, b, j, ps)] = _quantize_here(vals[row + pos : row + pos + 1], vs)[0]
        row += n
    return kc, vc, table, num_pages


def _gloo_worker(rank, world):
    """Zigzag gather_kv into a replicated FP8 cache, pass-KV / pass-Q into a sharded one, and
    shard_merge decode: max errors vs the oracle on dequantized values, and the gathered bytes
    of the FP8 plan vs the same plan with a bf16 cache."""
    g = torch.Generator().manual_seed(11)
    ext, pre = [13, 0, 1, 6], [9, 5, 0, 2 * world - 1]
    hq, hkv, d, ps = 4, 2, 16, 4
    group = torch.distributed.group.WORLD
    kv_lens, keys, vals, q, ks, vs, pre_rows, new_rows = _plan_inputs(ext, pre, hq, hkv, d, torch.bfloat16, True, g)
    deq_k = _dequantize_here(_quantize_here(keys, ks), ks)
    deq_v = _dequantize_here(_quantize_here(vals, vs), vs)
    ref, _ = attention_oracle(q, deq_k, deq_v, ext, pre)
    res = {}
    s = cpattn.ZigzagStrategy(world, pad_multiple=4)
    # replicated cache: gather_kv (ONE all-gather of FP8 rows)
    meta = s.build_metadata(ext, pre, rank=rank, group=group)
    for kv_dtype in (FP8, None):
        spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16,
                                    kv_dtype=kv_dtype, page_size=ps)
        plan = cpattn.plan_attention(meta, spec, backend="torch")
        g2 = torch.Generator().manual_seed(3)
        if kv_dtype is None:
            kc, vc, table, num_pages = _paged_fp8_prefix(keys, vals, kv_lens, pre, ps, ks, vs, g2)
            kc, vc = kc.float().to(torch.bfloat16), vc.float().to(torch.bfloat16)
            scales = {}
        else:
            kc, vc, table, num_pages = _paged_fp8_prefix(keys, vals, kv_lens, pre, ps, ks, vs, g2)
            scales = dict(k_scale=ks, v_scale=vs)
        writes = cpattn.plan_cache_writes(meta, table, page_size=ps, num_pages=num_pages)
        k_ext, v_ext = keys[new_rows], vals[new_rows]
        with CountCollectives() as ag:
            out = plan.run(s.shard(q, meta), s.shard(k_ext, meta), s.shard(v_ext, meta), (kc, vc), writes=writes,
                           group=group, page_table=table, **scales)
        name = "fp8" if kv_dtype else "bf16"
        res[f"gather_kv/{name}/bytes"] = [math.prod(c) for c in ag.calls]
        if kv_dtype is not None:
            full = s.gather(out, meta, group)
            res["gather_kv/fp8/err"] = (full.double() - ref).abs().max().item()
    # sharded cache: pass-KV / pass-Q extend
    sh = cpattn.KVSharding(world)
    meta = s.build_metadata(ext, pre, rank=rank, kv=sh, group=group)
    for algo in ("pass_kv", "pass_q"):
        kc, vc, table, num_pages = _sharded_fp8_prefix(keys, vals, kv_lens, pre, ps, ks, vs, world, rank)
        spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16,
                                    kv_dtype=FP8, page_size=ps)
        plan = cpattn.plan_attention(meta, spec, page_table=table, num_pages=num_pages, algorithm=algo,
                                     backend="torch")
        out = plan.run(s.shard(q, meta), s.shard(keys[meta.kv_extend_index], meta),
                       s.shard(vals[meta.kv_extend_index], meta), (kc, vc), group=group, k_scale=ks, v_scale=vs)
        full = s.gather(out, meta, group)
        res[f"{algo}/err"] = (full.double() - ref).abs().max().item()
        if algo == "pass_kv":
            res["pass_kv/row_bytes"] = plan._extra["row_bytes"]
    # shard_merge decode over the sharded cache
    dec_ext, dec_pre = [1, 1, 2], [6, 0, 9]
    kv_lens2, keys2, vals2, q2, ks2, vs2, _, new2 = _plan_inputs(dec_ext, dec_pre, hq, hkv, d, torch.bfloat16,
                                                                 False, torch.Generator().manual_seed(4))
    dmeta = cpattn.get_strategy("replicated", world).build_metadata(dec_ext, dec_pre, rank=rank, kv=sh, group=group)
    kc, vc, table, num_pages = _sharded_fp8_prefix(keys2, vals2, kv_lens2, dec_pre, ps, ks2, vs2, world, rank)
    spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16, kv_dtype=FP8,
                                page_size=ps)
    plan = cpattn.plan_attention(dmeta, spec, backend="torch")
    writes = cpattn.plan_cache_writes(dmeta, table, page_size=ps, num_pages=num_pages)
    out = plan.run(q2, keys2[new2], vals2[new2], (kc, vc), writes=writes, group=group, page_table=table,
                   k_scale=ks2, v_scale=vs2)
    ref2, _ = attention_oracle(q2, _dequantize_here(_quantize_here(keys2, ks2), ks2),
                               _dequantize_here(_quantize_here(vals2, vs2), vs2), dec_ext, dec_pre)
    res["shard_merge/err"] = (out.double() - ref2).abs().max().item()
    return res


@pytest.mark.slow
def test_fp8_caches_over_gloo():
    world = 2
    for rank, res in enumerate(run_distributed(_gloo_worker, world)):
        for key in ("gather_kv/fp8/err", "pass_kv/err", "pass_q/err", "shard_merge/err"):
            assert res[key] < TOLERANCE[torch.bfloat16], (rank, key, res[key])
        fp8, bf16 = res["gather_kv/fp8/bytes"], res["gather_kv/bf16/bytes"]
        assert len(fp8) == len(bf16) == 1 and 2 * fp8[0] == bf16[0], (fp8, bf16)  # one collective, half the bytes
        hkv, d = 2, 16
        assert res["pass_kv/row_bytes"] == 2 * hkv * d  # K and V, one byte per element


# ---------------------------------------------------------------------------------------- Triton (interpreter)
def _fp8_shard_case(dtype, per_head, paged, backend, options, ext=(1, 3, 1, 2), pre=(40, 70, 0, 33), window=-1,
                    sinks=False, seed=21):
    """A sharded-cache plan (C = 1) over an FP8 cache, attended with ``attend``: (out, lse, ref, ref_lse)."""
    ext, pre = list(ext), list(pre)
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, ps = 8, 2, 32, 16
    kv_lens, keys, vals, q, ks, vs, _, _ = _plan_inputs(ext, pre, hq, hkv, d, dtype, per_head, g)
    sk = torch.randn(hq, generator=g) if sinks else None
    meta = cpattn.get_strategy("replicated", 1).build_metadata(ext, pre, rank=0, kv=cpattn.KVSharding(1))
    spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype, kv_dtype=FP8,
                                page_size=ps if paged else None, window_size=(window, 0), has_sinks=sinks)
    plan = cpattn.plan_attention(meta, spec, backend=backend, backend_options=options)
    kq, vq = _quantize_here(keys, ks), _quantize_here(vals, vs)
    if paged:
        table, num_pages = _paged_layout(kv_lens, ps, g)
        kc = torch.full((num_pages, ps, hkv, d), float("nan")).to(FP8)  # unwritten slots NaN: never read
        vc = kc.clone()
        row = 0
        for b, n in enumerate(kv_lens):
            for j in range(n):
                kc.view(-1, hkv, d)[_slot(table, b, j, ps)] = kq[row + j]
                vc.view(-1, hkv, d)[_slot(table, b, j, ps)] = vq[row + j]
            row += n
        out, lse = plan.attend(q, kc, vc, page_table=table, sinks=sk, k_scale=ks, v_scale=vs)
    else:
        out, lse = plan.attend(q, kq, vq, sinks=sk, k_scale=ks, v_scale=vs)
    ref, ref_lse = attention_oracle(q, _dequantize_here(kq, ks), _dequantize_here(vq, vs), ext, pre,
                                    window_left=window, sinks=sk)
    return out, lse, ref, ref_lse, plan


@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_kv_kernel_reads_fp8_caches(interp, dtype, per_head, paged):
    """The split-KV decode kernel (several splits per sequence and the combine) over FP8 caches
    equals the oracle on the dequantized cache as tightly as over caches of q's dtype."""
    out, lse, ref, ref_lse, plan = _fp8_shard_case(dtype, per_head, paged, "triton",
                                                   {"num_sms": 64, "min_split": 16})
    assert plan.family == "split-kv" and plan.launch.num_ws > 0  # splits and the combine ran
    tol = TOLERANCE[dtype]
    assert (out.double() - ref).abs().max().item() < tol
    assert (lse.double() - ref_lse).abs().max().item() < tol


def test_split_kv_kernel_fp8_block_wider_than_the_key_alignment(interp):
    """A BLOCK_N wider than the key alignment (the interpreter's: 16) moves split starts to block
    bounds: several splits of 32 keys per sequence, the combine, and the oracle's result."""
    out, lse, ref, ref_lse, plan = _fp8_shard_case(torch.float32, False, True, "triton",
                                                   {"num_sms": 64, "min_split": 32, "config": (32, 4, 1)})
    assert plan.launch.config == (32, 4, 1) and plan.launch.num_ws > 0 and plan.launch.split % 32 == 0
    assert (out.double() - ref).abs().max().item() < TOLERANCE[torch.float32]
    assert (lse.double() - ref_lse).abs().max().item() < TOLERANCE[torch.float32]


def test_fp8_plans_take_the_fp8_split_defaults(interp, monkeypatch):
    """Without backend_options, an FP8 plan takes its split policy from ``FP8_DEFAULTS`` and a
    bf16 plan from ``BF16_DEFAULTS``; on the GPU the FP8 config comes from the FP8 defaults."""
    from cpattn.kernels import decode_backend as db

    assert db.split_defaults(True) is db.FP8_DEFAULTS and db.split_defaults(False) is db.BF16_DEFAULTS
    fp8 = db.SplitDefaults(config_d128=(128, 8, 3), config_d256=(64, 4, 2), config_wide=(16, 4, 2),
                           block_m_wide=16, programs_per_sm=1)
    monkeypatch.setattr(db, "FP8_DEFAULTS", fp8)
    assert db.default_config(128, 128, False, kv_quantized=True) == (128, 8, 3)
    assert db.default_config(576, 512, False, kv_quantized=True) == (16, 4, 2)
    assert db.default_config(128, 128, False) == db.BF16_DEFAULTS.config_d128
    assert db.tile_geometry(128, 1, 576, 1, False, kv_quantized=True)[2] == 16
    assert db.tile_geometry(128, 1, 576, 1, False)[2] == 32
    # one program per SM for FP8 (4 SMs: at most 4 + tiles items), twelve for bf16
    out, _, ref, _, plan = _fp8_shard_case(torch.float32, False, True, "triton", {"num_sms": 4})
    assert plan.launch.num_items <= 4 + 4
    assert (out.double() - ref).abs().max().item() < TOLERANCE[torch.float32]
    meta = cpattn.get_strategy("replicated", 1).build_metadata([1, 3, 1, 2], [40, 70, 0, 33], rank=0,
                                                               kv=cpattn.KVSharding(1))
    spec = cpattn.AttentionSpec(num_q_heads=8, num_kv_heads=2, head_dim=32, dtype=torch.float32, page_size=16)
    bf16_plan = cpattn.plan_attention(meta, spec, backend="triton", backend_options={"num_sms": 4})
    assert bf16_plan.launch.num_items > plan.launch.num_items


def test_split_kv_kernel_fp8_window_and_sinks(interp):
    out, lse, ref, ref_lse, _ = _fp8_shard_case(torch.float32, True, True, "triton", {"num_sms": 64, "min_split": 16},
                                                window=20, sinks=True)
    assert (out.double() - ref).abs().max().item() < TOLERANCE[torch.float32]
    assert (lse.double() - ref_lse).abs().max().item() < TOLERANCE[torch.float32]


def _fp8_dense_case(dtype, per_head, paged, ext, pre, options=None, window=-1, sinks=False, hq=8, hkv=2, d=32,
                    seed=17, backend="triton", cp=1, rank=0, ps=16):
    """A replicated-cache plan (replicated queries: algorithm "local") over an FP8 cache through
    ``plan.run`` (quantizing write), and the oracle over the dequantized cache."""
    g = torch.Generator().manual_seed(seed)
    kv_lens, keys, vals, q, ks, vs, pre_rows, new_rows = _plan_inputs(ext, pre, hq, hkv, d, dtype, per_head, g)
    sk = torch.randn(hq, generator=g) if sinks else None
    meta = cpattn.get_strategy("replicated", cp).build_metadata(ext, pre, rank=rank)
    spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype, kv_dtype=FP8,
                                page_size=ps if paged else None, window_size=(window, 0), has_sinks=sinks)
    plan = cpattn.plan_attention(meta, spec, backend=backend, backend_options=options)
    n_pad = meta.num_physical_tokens - q.shape[0]
    q_local = torch.cat([q, q.new_zeros(n_pad, hq, d)])
    k_new = torch.cat([keys[new_rows], keys.new_zeros(n_pad, hkv, d)])
    v_new = torch.cat([vals[new_rows], vals.new_zeros(n_pad, hkv, d)])
    if paged:
        kc, vc, table, num_pages = _paged_fp8_prefix(keys, vals, kv_lens, pre, ps, ks, vs, g)
        writes = cpattn.plan_cache_writes(meta, table, page_size=ps, num_pages=num_pages)
        out, lse = plan.run(q_local, k_new, v_new, (kc, vc), writes=writes, page_table=table, sinks=sk, k_scale=ks,
                            v_scale=vs, return_lse=True)
    else:
        k_pre, v_pre = _quantize_here(keys[pre_rows], ks), _quantize_here(vals[pre_rows], vs)
        out, lse = plan.run(q_local, k_new, v_new, (k_pre, v_pre), sinks=sk, k_scale=ks, v_scale=vs, return_lse=True)
    kq, vq = _quantize_here(keys, ks), _quantize_here(vals, vs)
    ref, ref_lse = attention_oracle(q, _dequantize_here(kq, ks), _dequantize_here(vq, vs), ext, pre,
                                    window_left=window, sinks=sk)
    t = q.shape[0]
    assert (out[t:] == 0).all() and torch.isneginf(lse[t:]).all()
    return out[:t], lse[:t], ref, ref_lse, plan


@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_portable_kernel_reads_fp8_caches(interp, dtype, per_head, paged):
    """Prefill-shaped batches (the portable kernel) over FP8 caches: the oracle on the
    dequantized cache at the query dtype's tolerance."""
    out, lse, ref, ref_lse, plan = _fp8_dense_case(dtype, per_head, paged, [20, 0, 1, 37], [5, 9, 0, 30])
    assert plan.family == "portable"
    tol = TOLERANCE[dtype]
    assert (out.double() - ref).abs().max().item() < tol
    assert (lse.double() - ref_lse).abs().max().item() < tol


def test_portable_kernel_fp8_window_and_sinks(interp):
    """A window, sinks, GQA 3:1, D = 64."""
    out, lse, ref, ref_lse, _ = _fp8_dense_case(torch.float32, True, True, [19, 4], [7, 33], window=11, sinks=True,
                                                hq=6, hkv=2, d=64)
    assert (out.double() - ref).abs().max().item() < TOLERANCE[torch.float32]
    assert (lse.double() - ref_lse).abs().max().item() < TOLERANCE[torch.float32]


@pytest.mark.parametrize("per_head", [False, True])
def test_dense_decode_plan_runs_split_kv_over_fp8(interp, per_head):
    """A decode-shaped dense plan runs the split-KV family over the FP8 cache."""
    out, lse, ref, ref_lse, plan = _fp8_dense_case(torch.bfloat16, per_head, True, [1, 1, 2], [300, 77, 150],
                                                   options={"decode": {"num_sms": 64, "min_split": 16}})
    assert plan.family == "decode"
    assert (out.double() - ref).abs().max().item() < TOLERANCE[torch.bfloat16]
    assert (lse.double() - ref_lse).abs().max().item() < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("kind", ["shard", "dense"])
def test_absorbed_mla_over_fp8_latent_cache(interp, kind):
    """Absorbed MLA (one latent KV head, v a view of k's first Dv columns) over an FP8 latent cache
    with one scale for the latent row (k_scale is v_scale): the split-KV kernel (decode, V read
    from the K block) and the portable kernel (prefill-shaped) equal the oracle on the
    dequantized latent."""
    g = torch.Generator().manual_seed(4)
    hq, d, dv, ps = 8, 48, 32, 16  # D = 32 + 16 (two dots), Dv = the latent's first 32 columns
    if kind == "shard":
        ext, pre = [1, 2, 1], [70, 33, 0]
    else:
        ext, pre = [17, 1, 30], [5, 40, 0]
    kv_lens = [e + p for e, p in zip(ext, pre)]
    lat = torch.randn(sum(kv_lens), 1, d, generator=g) * 2
    scale = (lat.abs().amax() / 448 * 0.8).float()
    lq = _quantize_here(lat, scale)
    q = torch.randn(sum(ext), hq, d, generator=g)
    table, num_pages = _paged_layout(kv_lens, ps, g)
    cache = torch.full((num_pages, ps, 1, d), float("nan")).to(FP8)
    row = 0
    for b, n in enumerate(kv_lens):
        for j in range(n):
            cache.view(-1, 1, d)[_slot(table, b, j, ps)] = lq[row + j]
        row += n
    spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=1, head_dim=d, head_dim_v=dv, dtype=torch.float32,
                                kv_dtype=FP8, page_size=ps)
    if kind == "shard":
        meta = cpattn.get_strategy("replicated", 1).build_metadata(ext, pre, rank=0, kv=cpattn.KVSharding(1))
        plan = cpattn.plan_attention(meta, spec, backend="triton", backend_options={"num_sms": 64, "min_split": 16})
        out, lse = plan.attend(q, cache, cache[..., :dv], page_table=table, k_scale=scale, v_scale=scale)
    else:
        meta = cpattn.get_strategy("replicated", 1).build_metadata(ext, pre, rank=0)
        plan = cpattn.plan_attention(meta, spec, backend="triton")
        assert plan.family == "portable"
        out, lse = plan.attend(q, cache, cache[..., :dv], page_table=table, k_scale=scale, v_scale=scale,
                               return_lse=True)
    deq = _dequantize_here(lq, scale)
    ref, ref_lse = attention_oracle(q, deq, deq[..., :dv], ext, pre)
    n = q.shape[0]
    assert (out[:n].double() - ref).abs().max().item() < TOLERANCE[torch.float32]
    assert (lse[:n].double() - ref_lse).abs().max().item() < TOLERANCE[torch.float32]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("form", ["gqa", "absorbed"])
@pytest.mark.parametrize("paged", [False, True])
def test_sparse_attention_over_fp8_cache(request, backend, form, paged):
    """DSA sparse attention over an FP8 cache (per-head scales; absorbed: one latent scale, v a
    view of k): the fp64 sparse oracle on the dequantized cache."""
    if backend == "triton":
        request.getfixturevalue("dsa_interp")
    from test_dsa import _paged as dsa_paged
    from test_dsa import _selection, sparse_oracle

    ext, pre = [5, 1, 9], [3, 20, 0]
    g = torch.Generator().manual_seed(8)
    hq = 4
    if form == "absorbed":
        hkv, d, dv = 1, 48, 32
    else:
        hkv, d, dv = 2, 32, 16
    n_kv = sum(e + p for e, p in zip(ext, pre))
    k = torch.randn(n_kv, hkv, d, generator=g) * 3
    ks = _scales(k, True, g)
    kq = _quantize_here(k, ks)
    if form == "absorbed":
        vs, vq = ks, kq[..., :dv]
    else:
        v = torch.randn(n_kv, hkv, dv, generator=g)
        vs = _scales(v, True, g)
        vq = _quantize_here(v, vs)
    q = torch.randn(sum(ext), hq, d, generator=g)
    idx = _selection(ext, pre, 12, g)
    ref, ref_lse = sparse_oracle(q, _dequantize_here(kq, ks), _dequantize_here(vq.contiguous(), vs), idx, ext, pre,
                                 0.2)
    meta = cpattn.get_strategy("replicated", 1).build_metadata(ext, pre, rank=0)
    spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv, dtype=torch.float32,
                                kv_dtype=FP8, topk=12, page_size=4 if paged else None)
    plan = cpattn.plan_attention(meta, spec, backend=backend)
    kw = {}
    k_in, v_in = kq, vq
    if paged:
        (k_in, v_full), kw["page_table"] = dsa_paged([kq.view(torch.uint8), vq.contiguous().view(torch.uint8)], ext,
                                                     pre, 4, g)
        k_in, v_full = k_in.view(FP8), v_full.view(FP8)
        v_in = k_in[..., :dv] if form == "absorbed" else v_full
    out, lse = plan.attend(q, k_in, v_in, idx, softmax_scale=0.2, k_scale=ks, v_scale=vs, return_lse=True, **kw)
    assert (out.double() - ref).abs().max().item() < TOLERANCE[torch.float32]
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() < TOLERANCE[torch.float32]


# ---------------------------------------------------------------------------------------- ragged batches
@st.composite
def _ragged(draw):
    """(C, q_lens, prefix_lens): q_len 0..4 with 0, 1 and < 2C lengths, prefixes 0, < 2C or long."""
    c = draw(st.integers(1, 4))
    n = draw(st.integers(1, 4))
    ext = draw(st.lists(st.one_of(st.integers(1, 4), st.sampled_from([0, 1]), st.integers(0, 2 * c - 1)),
                        min_size=n, max_size=n))
    pre = draw(st.lists(st.one_of(st.just(0), st.integers(0, 2 * c - 1), st.integers(0, 60)), min_size=n, max_size=n))
    return c, ext, pre


@settings(max_examples=25, deadline=None)
@given(_ragged(), st.booleans(), st.integers(0, 2**31 - 1))
def test_each_rank_quantizes_exactly_the_rows_it_stores(batch, per_head, seed):
    """Replicated decode queries over a cache sharded C ways: every rank's write (with scales)
    puts the quantized row of each new position it owns into its cache and changes nothing else;
    over the ranks every new position is stored once."""
    c, ext, pre = batch
    g = torch.Generator().manual_seed(seed)
    hkv, d, ps = 2, 8, 4
    n_new = sum(ext)
    k = torch.randn(n_new, hkv, d, generator=g) * 50
    v = torch.randn(n_new, hkv, d, generator=g)
    ks, vs = _scales(k, per_head, g), _scales(v, per_head, g)
    sh = cpattn.KVSharding(c)
    owners = torch.zeros(n_new, dtype=torch.long)
    for rank in range(c):
        meta = cpattn.get_strategy("replicated", c).build_metadata(ext, pre, rank=rank, kv=sh)
        local = [len([p for p in range(e + p0) if p % c == rank]) for e, p0 in zip(ext, pre)]
        table, num_pages = _paged_layout(local, ps, g)
        writes = cpattn.plan_cache_writes(meta, table, page_size=ps, num_pages=num_pages)
        kc = torch.randint(0, 255, (num_pages, ps, hkv, d), generator=g, dtype=torch.uint8).view(FP8)
        vc = torch.randint(0, 255, (num_pages, ps, hkv, d), generator=g, dtype=torch.uint8).view(FP8)
        before = kc.view(torch.uint8).clone()
        k_rows = torch.cat([k, k.new_zeros(meta.num_physical_tokens - n_new, hkv, d)])
        v_rows = torch.cat([v, v.new_zeros(meta.num_physical_tokens - n_new, hkv, d)])
        cpattn.write_kv_cache(k_rows, v_rows, kc, vc, writes, k_scale=ks, v_scale=vs)
        written = torch.zeros(num_pages * ps, dtype=torch.bool)
        row = 0
        for b, (e, p0) in enumerate(zip(ext, pre)):
            for pos in range(p0, p0 + e):
                if pos % c == rank:
                    slot = _slot(table, b, pos // c, ps)
                    assert torch.equal(kc.view(-1, hkv, d)[slot].view(torch.uint8),
                                       _quantize_here(k[row : row + 1], ks)[0].view(torch.uint8))
                    assert torch.equal(vc.view(-1, hkv, d)[slot].view(torch.uint8),
                                       _quantize_here(v[row : row + 1], vs)[0].view(torch.uint8))
                    written[slot] = True
                    owners[row] += 1
                row += 1
        assert torch.equal(kc.view(torch.uint8).view(-1, hkv * d)[~written], before.view(-1, hkv * d)[~written])
    assert bool((owners == 1).all())


@settings(max_examples=20, deadline=None)
@given(_ragged(), st.booleans(), st.booleans(), st.integers(0, 2**31 - 1))
def test_local_fp8_plans_over_ragged_batches(batch, per_head, paged, seed):
    """Replicated queries over a replicated FP8 cache (algorithm "local", any C): the oracle on
    the dequantized cache; pad rows 0 / -inf."""
    c, ext, pre = batch
    out, lse, ref, ref_lse, _ = _fp8_dense_case(torch.float32, per_head, paged, ext, pre, hq=4, hkv=2, d=8, seed=seed,
                                                backend="torch", cp=c, rank=seed % c, ps=4)
    if out.shape[0]:
        assert (out.double() - ref).abs().max().item() < TOLERANCE[torch.float32]
        assert (lse.double() - ref_lse).abs().max().item() < TOLERANCE[torch.float32]


def test_cost_model_prices_fp8_rows():
    """The cost model counts an FP8 cache's gathered K/V rows at one byte per value: pass-KV's
    bytes (prefix + extend K/V rows) halve against bf16; pass-Q keeps its q and partial rows."""
    meta = cpattn.ZigzagStrategy(4).build_metadata([64, 30], [4000, 900], rank=0, kv=cpattn.KVSharding(4))
    dims = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    bf16 = cpattn.CostModel().estimate(meta, **dims)
    fp8 = cpattn.CostModel().estimate(meta, **dims, kv_dtype=FP8)
    assert 2 * fp8["bytes_pass_kv"] == bf16["bytes_pass_kv"]
    assert bf16["bytes_pass_q"] > fp8["bytes_pass_q"] > bf16["bytes_pass_q"] / 2
    assert fp8["pass_kv"] < bf16["pass_kv"]
    spec = cpattn.AttentionSpec(**dims, page_size=16, kv_dtype=FP8)
    table = torch.arange(2 * 80, dtype=torch.int32).view(2, 80)
    plan = cpattn.plan_attention(meta, spec, page_table=table, num_pages=160, backend="torch")
    assert plan.estimate == fp8


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_static_decode_plans_over_fp8_cache(request, backend):
    """Static decode plans (fixed addresses, capacity-sized grids: what a CUDA graph replays)
    over a sharded FP8 cache: every step equals a fresh eager plan's torch reference, with the
    scales changed in place between steps (read from device memory by the kernels)."""
    if backend == "triton":
        request.getfixturevalue("interp")
    sh = cpattn.KVSharding(2, interleave=2)
    planner = cpattn.StaticPlanner(cpattn.get_strategy("replicated", 2), max_tokens=6, max_seqs=3, max_kv_tokens=80,
                                   max_q_len=2, kv=sh, device="cpu")
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, ps, num_pages = 4, 2, 16, 4, 40
    kc = (torch.randn(num_pages, ps, hkv, d, generator=g) * 40).to(FP8)
    vc = (torch.randn(num_pages, ps, hkv, d, generator=g) * 40).to(FP8)
    table = torch.randperm(num_pages, generator=g)[:30].view(3, 10).int()
    q = torch.randn(6, hq, d, generator=g)
    ks, vs = torch.full((hkv,), 0.05), torch.full((hkv,), 0.02)
    spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.float32, kv_dtype=FP8,
                                page_size=ps)
    options = {"num_sms": 64, "min_split": 16} if backend == "triton" else None
    for step, (seq, ql) in enumerate((([30, 9], [1, 2]), ([50, 1, 22], [2, 1, 2]), ([3], [1]))):
        ks.mul_(1.5)  # recalibrated in place: the same tensors, new values
        vs.mul_(0.5 + step)
        dmeta = planner.plan(ql, [n - q for n, q in zip(seq, ql)], rank=1)
        plan = cpattn.plan_attention(dmeta, spec, backend=backend, backend_options=options)
        out, lse = plan.attend(q, kc, vc, page_table=table, k_scale=ks, v_scale=vs)
        fresh = cpattn.get_strategy("replicated", 2).build_metadata(ql, [n - q for n, q in zip(seq, ql)], rank=1,
                                                                    kv=sh)
        nq = fresh.num_local_tokens
        ref, ref_lse = cpattn.plan_attention(fresh, spec, backend="torch").attend(
            q[:nq], kc, vc, page_table=table[: len(seq)], k_scale=ks.clone(), v_scale=vs.clone())
        torch.testing.assert_close(out[:nq], ref, atol=2e-5, rtol=0)
        torch.testing.assert_close(lse[:nq], ref_lse, atol=2e-5, rtol=0)  # -inf: a row with no key on this rank
        assert (out[nq:] == 0).all() and torch.isneginf(lse[nq:]).all()


def test_write_mla_cache_quantizes_an_fp8_latent_cache_that_absorbed_mla_reads():
    """write_mla_cache(..., scale=) quantizes [kv_c, k_pe] rows with one per-tensor scale into an
    FP8 latent cache (all or nothing); absorbed MLA over it (k_scale = v_scale = scale) equals the
    oracle on the dequantized latent."""
    g = torch.Generator().manual_seed(12)
    r, d_rope, hq, ps = 32, 16, 8, 4
    ext, pre = [3, 1], [0, 6]
    kv_lens = [e + p for e, p in zip(ext, pre)]
    n = sum(kv_lens)
    kv_c = torch.randn(n, r, generator=g, dtype=torch.bfloat16) * 3
    k_pe = torch.randn(n, d_rope, generator=g, dtype=torch.bfloat16)
    scale = torch.tensor(0.02)
    table, num_pages = _paged_layout(kv_lens, ps, g)
    cache = torch.zeros(num_pages, ps, r + d_rope, dtype=FP8)
    slots = torch.tensor([_slot(table, b, j, ps) for b, kl in enumerate(kv_lens) for j in range(kl)])
    before = cache.view(torch.uint8).clone()
    for bad, kwargs, exc in ((torch.ones(1), {}, "per tensor"), (scale.double(), {}, "float32"),
                             (scale, {"cache": cache.view(torch.uint8)}, "float8_e4m3fn cache")):
        with pytest.raises((TypeError, ValueError), match=exc):
            cpattn.write_mla_cache(kv_c, k_pe, kwargs.get("cache", cache), slots, scale=bad)
    with pytest.raises(TypeError, match="share one 16/32-bit float dtype"):
        cpattn.write_mla_cache(kv_c, k_pe.float(), cache, slots, scale=scale)
    assert torch.equal(cache.view(torch.uint8), before)
    cpattn.write_mla_cache(kv_c, k_pe, cache, slots, scale=scale)
    lat = torch.cat([kv_c, k_pe], 1)[:, None, :]  # [N, 1, r + d_rope]
    want = _quantize_here(lat, scale)
    assert torch.equal(cache.view(-1, r + d_rope)[slots].view(torch.uint8), want[:, 0].view(torch.uint8))
    meta = cpattn.get_strategy("replicated", 1).build_metadata(ext, pre, rank=0)
    spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=1, head_dim=r + d_rope, head_dim_v=r,
                                dtype=torch.bfloat16, kv_dtype=FP8, page_size=ps)
    plan = cpattn.plan_attention(meta, spec, backend="torch")
    q = torch.randn(sum(ext), hq, r + d_rope, generator=g, dtype=torch.bfloat16)
    k4 = cache.unsqueeze(2)  # [pages, ps, 1, r + d_rope]
    out = plan.attend(q, k4, k4[..., :r], page_table=table, k_scale=scale, v_scale=scale)
    deq = _dequantize_here(want, scale)
    ref, _ = attention_oracle(q, deq, deq[..., :r], ext, pre)
    assert (out.double() - ref).abs().max().item() < TOLERANCE[torch.bfloat16]


# ---------------------------------------------------------------------------------------- DSA decode, sharded
def _decode_selection(lens, qs, topk, g):
    """[N, topk] int64 GLOBAL positions per decode row: visible positions (<= the row's), -1
    padding where a row sees fewer than topk keys."""
    rows = []
    for n, q in zip(lens, qs):
        for p in range(n - q, n):
            pick = torch.randperm(p + 1, generator=g)[:topk].tolist()
            rows.append(pick + [-1] * (topk - len(pick)))
    return torch.tensor(rows, dtype=torch.int64)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("paged", [False, True])
def test_sparse_shard_merge_over_fp8_cache(request, backend, paged):
    """DSA decode over a sharded FP8 latent cache (absorbed form: Hkv = 1, v = k[..., :Dv], one
    scale): C = 3 ranks (interleave 2) simulated in-process, each attending the selected keys it
    owns with k_scale / v_scale, merged: the fp64 sparse oracle on the dequantized cache."""
    if backend == "triton":
        request.getfixturevalue("dsa_interp")
    from test_dsa_sharded import _meta, _shard_packed, _shard_paged, sparse_oracle

    from cpattn.merge import merge_states

    c, il, hq, d, dv, topk = 3, 2, 4, 24, 16, 8
    lens, qs = [70, 13, 1, 33], [2, 1, 1, 4]
    g = torch.Generator().manual_seed(21)
    keys = [torch.randn(n, 1, d, generator=g) * 3 for n in lens]
    ks = _scales(torch.cat(keys), True, g)
    kq = [_quantize_here(k, ks) for k in keys]
    q = torch.randn(sum(qs), hq, d, generator=g)
    sel = _decode_selection(lens, qs, topk, g)
    sinks = torch.randn(hq, generator=g)
    deq = [_dequantize_here(k, ks) for k in kq]
    want = sparse_oracle(q, deq, [k[..., :dv] for k in deq], sel.tolist(), lens, qs, 0.2, sinks)
    outs, lses = [], []
    for r in range(c):
        meta = _meta(c, il, lens, qs, r)
        spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=1, head_dim=d, head_dim_v=dv, dtype=torch.float32,
                                    kv_dtype=FP8, topk=topk, page_size=4 if paged else None, has_sinks=True)
        plan = cpattn.plan_attention(meta, spec, backend=backend)
        assert type(plan).__name__ == "SparseShardMergePlan"
        kw = {}
        if paged:
            k_loc, kw["page_table"] = _shard_paged([k.view(torch.uint8) for k in kq], c, il, r, 4, g)
        else:
            k_loc = _shard_packed([k.view(torch.uint8) for k in kq], c, il, r)
        k_loc = k_loc.view(FP8)
        with pytest.raises(ValueError, match="pass k_scale"):
            plan.attend(q, k_loc, k_loc[..., :dv], sel, sinks=sinks, **kw)
        o, l = plan.attend(q, k_loc, k_loc[..., :dv], sel, softmax_scale=0.2, sinks=sinks, k_scale=ks, v_scale=ks,
                           **kw)
        outs.append(o)
        lses.append(l)
    out, _ = merge_states(torch.stack(outs), torch.stack(lses))
    assert (out.double() - want).abs().max().item() < TOLERANCE[torch.float32]


def test_sparse_shard_merge_run_quantizes_its_writes():
    """SparseShardMergePlan.run over an FP8 paged cache (C = 1): a missing scale raises before
    the write (cache bytes unchanged); with the scales the step's rows are written quantized
    (bit for bit) and the output equals the oracle on the dequantized cache. A plan of a
    query-dtype cache refuses the scales."""
    from test_dsa_sharded import sparse_oracle

    hq, hkv, d, ps, topk = 4, 1, 16, 4, 6  # one KV head: the oracle reads head 0
    lens, qs = [11, 3, 6], [1, 2, 1]
    pre = [n - q for n, q in zip(lens, qs)]
    g = torch.Generator().manual_seed(5)
    kv_lens, keys, vals, q, ks, vs, _, new_rows = _plan_inputs(qs, pre, hq, hkv, d, torch.float32, True, g)
    kc, vc, table, num_pages = _paged_fp8_prefix(keys, vals, kv_lens, pre, ps, ks, vs, g)
    meta = cpattn.get_strategy("replicated", 1).build_metadata(qs, pre, rank=0, kv=cpattn.KVSharding(1))
    spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.float32, kv_dtype=FP8,
                                topk=topk, page_size=ps)
    plan = cpattn.plan_attention(meta, spec, backend="torch")
    writes = cpattn.plan_cache_writes(meta, table, page_size=ps, num_pages=num_pages)
    sel = _decode_selection(lens, qs, topk, g)
    args = (q, keys[new_rows], vals[new_rows], (kc, vc))
    before = (kc.view(torch.uint8).clone(), vc.view(torch.uint8).clone())
    with pytest.raises(ValueError, match="pass v_scale"):
        plan.run(*args, idx=sel, writes=writes, page_table=table, k_scale=ks)
    with pytest.raises(TypeError, match=r"run\(\) got unexpected keyword argument\(s\) \['out'\]"):
        plan.run(*args, idx=sel, writes=writes, page_table=table, k_scale=ks, v_scale=vs, out=torch.empty(0))
    assert torch.equal(kc.view(torch.uint8), before[0]) and torch.equal(vc.view(torch.uint8), before[1])
    out = plan.run(*args, idx=sel, writes=writes, page_table=table, k_scale=ks, v_scale=vs)
    k_all, v_all = _read_paged(kc, table, kv_lens, ps), _read_paged(vc, table, kv_lens, ps)
    assert torch.equal(k_all.view(torch.uint8), _quantize_here(keys, ks).view(torch.uint8))
    assert torch.equal(v_all.view(torch.uint8), _quantize_here(vals, vs).view(torch.uint8))
    per_seq = lambda x: list(x.split(kv_lens))  # noqa: E731
    want = sparse_oracle(q, per_seq(_dequantize_here(k_all, ks)), per_seq(_dequantize_here(v_all, vs)), sel.tolist(),
                         lens, qs, d**-0.5)
    assert (out.double() - want).abs().max().item() < TOLERANCE[torch.float32]
    plain = cpattn.plan_attention(meta, spec.replace(kv_dtype=None), backend="torch")
    with pytest.raises(ValueError, match="k_scale / v_scale are for an FP8 cache"):
        plain.attend(q, kc.float(), vc.float(), sel, page_table=table, k_scale=ks, v_scale=vs)


def test_strategy_attention_over_fp8_kv():
    """The convenience forms plan an FP8 spec from FP8 K/V and take the scales as kernel
    keywords (required there): the oracle on the dequantized values (sparse: a selection of
    every key)."""
    ext, pre = [3, 1], [2, 4]
    g = torch.Generator().manual_seed(13)
    kv_lens, keys, vals, q, ks, vs, _, _ = _plan_inputs(ext, pre, 4, 2, 16, torch.bfloat16, True, g)
    kq, vq = _quantize_here(keys, ks), _quantize_here(vals, vs)
    s = cpattn.get_strategy("zigzag", 1)
    meta = s.build_metadata(ext, pre, rank=0)
    ql = s.shard(q, meta)
    with pytest.raises(ValueError, match="pass k_scale"):
        s.attention(ql, kq, vq, meta, backend="torch")
    out = s.attention(ql, kq, vq, meta, backend="torch", k_scale=ks, v_scale=vs)
    ref, _ = attention_oracle(q, _dequantize_here(kq, ks), _dequantize_here(vq, vs), ext, pre)
    assert (s.gather(out, meta).double() - ref).abs().max().item() < TOLERANCE[torch.bfloat16]
    every = torch.arange(8).expand(ql.shape[0], 8).contiguous()  # every key (later positions are ignored)
    sparse = s.sparse_attention(ql, kq, vq, meta, every, backend="torch", k_scale=ks, v_scale=vs)
    assert (s.gather(sparse, meta).double() - ref).abs().max().item() < TOLERANCE[torch.bfloat16]
