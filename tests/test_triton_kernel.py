"""The Triton CP attention kernel (and the FA4 backend) against the fp64 oracle.

CPU: the real Triton kernel under the interpreter (TRITON_INTERPRET=1, set by a module fixture
before the kernel module is first imported and restored afterwards, so other modules keep their
behaviour), small shapes. GPU (``-m gpu``): real sizes against the torch reference and FA4.
"""

from __future__ import annotations

import pytest
import torch

import cpattn
from cpattn.kernels import _tiles, get_backend
from oracle import TOLERANCE, attention_oracle

pytest.importorskip("triton")

CUDA = torch.cuda.is_available()


def _spec_plan(meta, *, backend="auto", backend_options=None, **spec):
    """``cpattn.plan_attention`` for the layer kind of ``spec`` (:class:`cpattn.AttentionSpec`'s keywords)."""
    return cpattn.plan_attention(meta, cpattn.AttentionSpec(**spec), backend=backend, backend_options=backend_options)


def _backend(s, q, k, v, meta, backend="auto"):
    """The backend ``s.attention(q, k, v, meta, backend=backend)`` runs (its cached plan's)."""
    return s._cached_plan(q, k, v, meta, {}, backend).backend


def _paged(k, v, ext, pre, page, int64=False, gen=None):
    """Scatter packed K/V into shuffled pages; returns caches and the page table."""
    lens = [e + p for e, p in zip(ext, pre)]
    max_pages = max([-(-n // page) for n in lens] + [1])
    num_pages = len(lens) * max_pages + 2
    table = torch.randperm(num_pages, generator=gen)[: len(lens) * max_pages].view(len(lens), max_pages)
    kc = torch.randn(num_pages, page, *k.shape[1:], generator=gen).to(k.dtype)
    vc = torch.randn(num_pages, page, *v.shape[1:], generator=gen).to(v.dtype)
    off = 0
    for b, n in enumerate(lens):
        j = torch.arange(n)
        kc[table[b, j // page], j % page] = k[off : off + n]
        vc[table[b, j // page], j % page] = v[off : off + n]
        off += n
    return kc, vc, table.to(torch.int64 if int64 else torch.int32)


def _check(strategy, cp_size, ext, pre, *, hq=4, hkv=2, d=32, dv=None, dtype=torch.bfloat16, window=-1,
           sinks=False, page=None, pt_int64=False, ranks=None, kv_views=False, kv_pad=8, backend="triton",
           device="cpu", pad_multiple=4, seed=0):
    dv = dv or d
    gen = torch.Generator().manual_seed(seed)
    t = sum(ext)
    n_kv = sum(e + p for e, p in zip(ext, pre))
    q = torch.randn(t, hq, d, generator=gen).to(dtype)
    if kv_views:  # like gather_kv: views of one buffer, rows strided, last dim contiguous
        buf = torch.randn(n_kv, hkv * (d + dv) + kv_pad, generator=gen).to(dtype)
        k = buf[:, : hkv * d].view(n_kv, hkv, d)
        v = buf[:, hkv * d : hkv * (d + dv)].view(n_kv, hkv, dv)
    else:
        k = torch.randn(n_kv, hkv, d, generator=gen).to(dtype)
        v = torch.randn(n_kv, hkv, dv, generator=gen).to(dtype)
    sk = torch.randn(hq, generator=gen) if sinks else None
    ref_out, ref_lse = attention_oracle(q, k, v, ext, pre, window_left=window, sinks=sk)
    s = cpattn.get_strategy(strategy, cp_size, pad_multiple=pad_multiple)
    if page is not None:
        k_in, v_in, table = _paged(k, v, ext, pre, page, pt_int64, gen)
        table = table.to(device)
    else:
        k_in, v_in, table = k, v, None
    tol = TOLERANCE[dtype]
    for rank in ranks if ranks is not None else range(cp_size):
        meta = s.build_metadata(ext, pre, rank=rank).to(device)
        q_local = s.shard(q.to(device), meta)
        out, lse = s.attention(
            q_local, k_in.to(device), v_in.to(device), meta, page_table=table, window_size=(window, 0),
            sinks=None if sk is None else sk.to(device), backend=backend, return_lse=True,
        )
        n = meta.num_local_tokens
        assert out.shape == (meta.num_physical_tokens, hq, dv) and out.dtype == dtype
        assert lse.shape == (meta.num_physical_tokens, hq) and lse.dtype == torch.float32
        assert not out.isnan().any() and not lse.isnan().any()
        idx = meta.local_token_indices.cpu()
        if n:
            err = (out[:n].double().cpu() - ref_out[idx]).abs().max().item()
            lse_err = (lse[:n].double().cpu() - ref_lse[idx]).abs().max().item()
            assert err <= tol, f"rank {rank}: max |out - oracle| = {err} > {tol}"
            assert lse_err <= tol, f"rank {rank}: max |lse - oracle| = {lse_err} > {tol}"
        assert (out[n:] == 0).all(), "pad rows must be exactly 0"
        assert torch.isneginf(lse[n:]).all(), "pad rows must have lse -inf"


# ------------------------------------------------------------------ CPU, interpreter
EXT, PRE = [37, 50, 5], [0, 9, 3]


@pytest.mark.parametrize(
    "strategy,cp_size",
    [("zigzag", 1), ("zigzag", 2), ("zigzag", 3), ("interleave", 2), ("interleave", 3), ("contiguous", 2),
     ("contiguous", 3)],
)
def test_strategies_with_prefix_gqa(interp, strategy, cp_size):
    _check(strategy, cp_size, EXT, PRE)


@pytest.mark.parametrize("strategy,cp_size", [("zigzag", 2), ("interleave", 3)])
def test_window_and_sinks(interp, strategy, cp_size):
    _check(strategy, cp_size, [45, 30], [6, 0], window=7, sinks=True, seed=1)
    _check(strategy, cp_size, [45], [20], window=0, ranks=[0], seed=2)  # each row sees itself only


def test_window_only_and_sinks_only(interp):
    _check("contiguous", 2, [50], [40], window=33, seed=3)
    _check("zigzag", 2, [50], [0], sinks=True, seed=4)


@pytest.mark.parametrize("hq,hkv", [(4, 1), (3, 3), (6, 2)])
def test_mqa_mha_group_sizes(interp, hq, hkv):
    _check("zigzag", 2, [40], [5], hq=hq, hkv=hkv, d=16, ranks=[1], seed=hq)


@pytest.mark.parametrize("kv_heads_per_section", [1, 3])
def test_l2_head_sections(interp, monkeypatch, kv_heads_per_section):
    """Programs launched by L2 sections of head groups (one KV head per section, and sections of
    3 over 4 KV heads, the last one short) still cover every (tile, head) once."""
    ext, pre, d = [40, 9], [5, 0], 16
    row_bytes = (d + d) * 2
    monkeypatch.setattr(_tiles, "L2_KV_BYTES", kv_heads_per_section * sum(ext + pre) * row_bytes)
    assert _tiles.heads_per_l2_section(sum(ext + pre), row_bytes, 1, 4, torch.device("cpu")) == kv_heads_per_section
    _check("zigzag", 2, ext, pre, hq=8, hkv=4, d=d, seed=kv_heads_per_section)


@pytest.mark.parametrize("strategy,cp_size", [("zigzag", 2), ("contiguous", 1)])
def test_l2_sequence_groups(interp, monkeypatch, strategy, cp_size):
    """An L2 budget below one KV head's K/V of the batch: the tiles run by sequence groups of that
    many keys (here one group per two sequences, and one per sequence); outputs and LSE still match
    the oracle on every rank."""
    ext, pre, d = [40, 9, 23, 0, 17], [5, 0, 30, 4, 0], 16
    row_bytes = (d + d) * 2
    for budget_keys in (60, 1):
        monkeypatch.setattr(_tiles, "L2_KV_BYTES", budget_keys * row_bytes)
        assert _tiles.l2_group_keys(sum(ext + pre), row_bytes, torch.device("cpu")) == budget_keys
        s = cpattn.get_strategy(strategy, cp_size, pad_multiple=4)
        plan = _spec_plan(s.build_metadata(ext, pre, rank=0), num_q_heads=4, num_kv_heads=2, head_dim=d,
                          dtype=torch.bfloat16, backend="triton")
        assert plan._impl.group_keys == budget_keys  # the plan ran the grouped tile order
        _check(strategy, cp_size, ext, pre, hq=4, hkv=2, d=d, seed=budget_keys)
    monkeypatch.setattr(_tiles, "L2_KV_BYTES", sum(ext + pre) * row_bytes)  # the batch fits: one group
    assert _tiles.l2_group_keys(sum(ext + pre), row_bytes, torch.device("cpu")) is None


def test_heads_per_l2_section_bounds(monkeypatch):
    monkeypatch.setattr(_tiles, "L2_KV_BYTES", 10 << 20)
    cpu = torch.device("cpu")
    assert _tiles.heads_per_l2_section(1 << 20, 512, 4, 32, cpu) == 4  # K/V of one head > budget: one KV head
    assert _tiles.heads_per_l2_section(1024, 512, 4, 32, cpu) == 32  # all fit: one section
    assert _tiles.heads_per_l2_section(10240, 512, 2, 16, cpu) == 4  # 2 KV heads x 2 groups each


@pytest.mark.parametrize("page", [1, 3, 16])
def test_paged_matches_oracle(interp, page):
    _check("zigzag", 2, [33, 20], [10, 0], page=page, seed=page, ranks=[0])
    _check("interleave", 2, [33, 20], [10, 0], page=page, seed=page, window=9, ranks=[1])


def test_paged_int64_table_and_kv_views(interp):
    _check("zigzag", 2, [30], [12], page=4, pt_int64=True, ranks=[1], seed=7)
    _check("interleave", 3, [30, 11], [12, 0], kv_views=True, ranks=[2], seed=8)


def test_kv_views_unaligned_rows(interp):
    """Row strides that are no multiple of 16 bytes: no TMA descriptors, pointer loads."""
    k = torch.zeros(8, 2, 32, dtype=torch.bfloat16)
    assert interp._tma_ok(k, k) and not interp._tma_ok(torch.zeros(8, 2 * 32 + 1)[:, :64].view(8, 2, 32))
    _check("zigzag", 2, [40, 9], [6, 0], kv_views=True, kv_pad=1, ranks=[0], seed=12)


def test_empty_batch_and_idle_rank(interp):
    _check("zigzag", 2, [], [])
    _check("zigzag", 3, [2], [4])  # ranks 1, 2 own no rows (sequence shorter than 2C)
    _check("contiguous", 2, [0, 9, 0], [3, 0, 5])  # zero-length sequences
    # no-rows rank with pad: every row is pad, out 0 and lse -inf
    _check("interleave", 4, [3], [0], ranks=[3], pad_multiple=8)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_dtypes(interp, dtype):
    _check("zigzag", 2, [40], [7], dtype=dtype, ranks=[0], sinks=True, seed=9)


@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (256, 256), (192, 128), (48, 32)])
def test_head_dims(interp, d, dv):
    _check("zigzag", 2, [24], [5], hq=2, hkv=1, d=d, dv=dv, ranks=[0], seed=d)


def test_mla_absorbed_head_dims(interp):
    _check("zigzag", 1, [12], [4], hq=2, hkv=1, d=576, dv=512, seed=11)


def test_backend_selection(interp, monkeypatch):
    s = cpattn.ZigzagStrategy(2)
    meta = s.build_metadata([8], rank=0)
    q = torch.zeros(meta.num_physical_tokens, 2, 16, dtype=torch.bfloat16)
    k = v = torch.zeros(8, 1, 16, dtype=torch.bfloat16)
    assert _backend(s, q, k, v, meta, backend="triton") == "triton"
    with pytest.raises(NotImplementedError, match="dtype"):
        _backend(s, q.double(), k.double(), v.double(), meta, backend="triton")
    with pytest.raises(NotImplementedError, match="fa4"):
        _backend(s, q, k, v, meta, backend="fa4")
    mi = cpattn.InterleaveStrategy(2).build_metadata([8], rank=0)
    spec = cpattn.AttentionSpec(num_q_heads=2, num_kv_heads=1, head_dim=16, head_dim_v=16, dtype=torch.bfloat16)
    assert "interleave" in get_backend("fa4").unsupported_reason(spec, mi)
    assert get_backend("fa4").unsupported_reason(spec, meta) == "fa4 needs CUDA tensors"
    monkeypatch.delenv("TRITON_INTERPRET")
    fresh = s.build_metadata([8], rank=0)  # plans are cached per metadata
    with pytest.raises(NotImplementedError, match="TRITON_INTERPRET"):
        _backend(s, q, k, v, fresh, backend="triton")
    assert _backend(s, q, k, v, fresh) == "torch"
    assert cpattn.available_backends() == ["torch"]


def test_split_head_dim(interp):
    assert interp.split_head_dim(192) == (128, 64)
    assert interp.split_head_dim(576) == (512, 64)
    assert interp.split_head_dim(128) == (128, 0)
    assert interp.split_head_dim(96 + 8) is None
    assert interp.shape_unsupported_reason(128, 96, torch.bfloat16) is not None


# ------------------------------------------------------------------ GPU, real sizes
def _gpu_case(strategy, cp_size, rank, ext, pre, hq, hkv, d, dv, window=-1, sinks=False, page=None, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    t, n_kv = sum(ext), sum(e + p for e, p in zip(ext, pre))
    q = torch.randn(t, hq, d, device=dev, generator=gen, dtype=torch.bfloat16)
    k = torch.randn(n_kv, hkv, d, device=dev, generator=gen, dtype=torch.bfloat16)
    v = torch.randn(n_kv, hkv, dv, device=dev, generator=gen, dtype=torch.bfloat16)
    sk = torch.randn(hq, device=dev, generator=gen) if sinks else None
    s = cpattn.get_strategy(strategy, cp_size, pad_multiple=64)
    meta = s.build_metadata(ext, pre, rank=rank).to(dev)
    table = None
    if page is not None:
        lens = [e + p for e, p in zip(ext, pre)]
        max_pages = max(-(-n // page) for n in lens)
        table = torch.randperm(len(lens) * max_pages, device=dev).view(len(lens), max_pages).to(torch.int32)
        kc = torch.empty(len(lens) * max_pages, page, hkv, d, device=dev, dtype=k.dtype).normal_()
        vc = torch.empty(len(lens) * max_pages, page, hkv, dv, device=dev, dtype=v.dtype).normal_()
        pos = torch.cat([torch.arange(n, device=dev) for n in lens])
        seq = torch.cat([torch.full((n,), b, device=dev) for b, n in enumerate(lens)])
        kc[table[seq, pos // page].long(), pos % page] = k
        vc[table[seq, pos // page].long(), pos % page] = v
    return s, meta, s.shard(q, meta), k, v, sk, table, (kc, vc) if page else None


def _max_err(a, b, n):
    return (a[:n].float() - b[:n].float()).abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "strategy,cp_size,seq,d,dv,hq,hkv",
    [
        ("zigzag", 2, 8192, 128, 128, 32, 8),
        ("zigzag", 4, 16384, 128, 128, 32, 8),
        ("zigzag", 2, 4096, 64, 64, 16, 16),
        ("zigzag", 2, 4096, 256, 256, 8, 2),
        ("zigzag", 2, 8192, 192, 128, 16, 16),
        ("interleave", 4, 8192, 128, 128, 32, 8),
        ("contiguous", 2, 4096, 128, 128, 32, 4),
    ],
)
def test_gpu_triton_vs_torch(strategy, cp_size, seq, d, dv, hq, hkv):
    ext, pre = [seq // 2, seq // 2 - 100], [0, 100]
    s, meta, q, k, v, _, _, _ = _gpu_case(strategy, cp_size, cp_size - 1, ext, pre, hq, hkv, d, dv)
    out, lse = s.attention(q, k, v, meta, backend="triton", return_lse=True)
    ref, ref_lse = s.attention(q, k, v, meta, backend="torch", return_lse=True)
    n = meta.num_local_tokens
    assert _max_err(out, ref, n) < 2e-2 and _max_err(lse, ref_lse, n) < 1e-2
    assert (out[n:] == 0).all() and torch.isneginf(lse[n:]).all()


@pytest.mark.gpu
def test_gpu_triton_window_sinks_paged():
    s, meta, q, k, v, sk, table, caches = _gpu_case("zigzag", 2, 1, [6000, 3000], [500, 0], 16, 4, 128, 128,
                                                    window=1000, sinks=True, page=64)
    kw = dict(window_size=(1000, 0), sinks=sk, return_lse=True)
    out, lse = s.attention(q, caches[0], caches[1], meta, page_table=table, backend="triton", **kw)
    ref, ref_lse = s.attention(q, k, v, meta, backend="torch", **kw)
    n = meta.num_local_tokens
    assert _max_err(out, ref, n) < 2e-2 and _max_err(lse, ref_lse, n) < 1e-2


@pytest.mark.gpu
def test_gpu_triton_vs_sdpa_full_sequence():
    """C=1 contiguous over one 16k sequence equals plain causal SDPA."""
    s, meta, q, k, v, _, _, _ = _gpu_case("contiguous", 1, 0, [16384], [0], 16, 16, 128, 128)
    out = s.attention(q, k, v, meta, backend="triton")
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True
    )[0].transpose(0, 1)
    assert _max_err(out, ref, meta.num_local_tokens) < 2e-2


def _is_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _is_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize(
    "strategy,cp_size,rank,ext,pre,hq,hkv,d,dv,window,sinks,dtype",
    [
        ("zigzag", 2, 0, [8192], [0], 32, 8, 128, 128, -1, False, torch.bfloat16),
        ("zigzag", 3, 2, [3000, 17, 1, 900], [0, 200, 5, 3000], 32, 8, 128, 128, -1, False, torch.bfloat16),
        ("zigzag", 2, 1, [6000, 3000], [500, 0], 16, 4, 128, 128, 1000, True, torch.bfloat16),
        ("interleave", 4, 3, [5000, 333], [64, 0], 32, 8, 128, 128, -1, True, torch.float16),
        ("contiguous", 2, 1, [4096, 100], [0, 7], 8, 1, 128, 128, 300, False, torch.bfloat16),
        ("zigzag", 2, 0, [4096], [100], 16, 16, 64, 64, -1, False, torch.bfloat16),
        ("zigzag", 2, 1, [5000, 300, 1], [0, 900, 2], 16, 16, 192, 128, -1, False, torch.bfloat16),
        ("interleave", 3, 0, [4000], [10], 8, 2, 192, 128, 700, True, torch.float16),
    ],
)
def test_gpu_sm90_kernel_vs_torch(monkeypatch, strategy, cp_size, rank, ext, pre, hq, hkv, d, dv, window, sinks,
                                  dtype):
    """The warp-specialized Hopper kernel and the portable kernel both match the torch reference
    (GQA/MQA/MHA, D64 / D128 / D192-Dv128, ragged batch with prefixes, window, sinks, LSE on and
    off, fp16, L2 sections of one KV head), K/V as strided views."""
    s, meta, q, k, v, sk, _, _ = _gpu_case(strategy, cp_size, rank, ext, pre, hq, hkv, d, dv, window=window,
                                           sinks=sinks)
    q = q.to(dtype)
    buf = torch.zeros(k.shape[0], hkv * (d + dv) + 8, device="cuda", dtype=dtype)  # like gather_kv's views
    kv_k = buf[:, : hkv * d].view(-1, hkv, d)
    kv_v = buf[:, hkv * d : hkv * (d + dv)].view(-1, hkv, dv)
    kv_k.copy_(k)
    kv_v.copy_(v)
    ref, ref_lse = s.attention(q.float(), k.float(), v.float(), meta, backend="torch", window_size=(window, 0),
                               sinks=sk, return_lse=True)
    n = meta.num_local_tokens
    for family, l2_bytes in (("sm90", None), ("sm90", 1), ("portable", None), ("portable", 1)):  # 1: a section per KV head
        monkeypatch.setattr(_tiles, "L2_KV_BYTES", l2_bytes)
        plan = _spec_plan(meta, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv, dtype=dtype,
                          window_size=(window, 0), has_sinks=sinks, backend="triton",
                          backend_options={"family": family})
        assert plan.family == family
        out, lse = plan.attend(q, kv_k, kv_v, sinks=sk, return_lse=True)
        assert _max_err(out, ref, n) < 2e-2 and _max_err(lse, ref_lse, n) < 1e-2, f"{family} l2={l2_bytes}"
        assert (out[n:] == 0).all() and torch.isneginf(lse[n:]).all()
        out_only = plan.attend(q, kv_k, kv_v, sinks=sk)
        assert torch.equal(out_only, out), "output differs without LSE"


@pytest.mark.gpu
@pytest.mark.skipif(not _is_sm90(), reason="needs an sm_90 GPU")
def test_gpu_sm90_forced_on_unsupported_call_raises():
    """Forcing the sm90 family on a plan it cannot run (D 256; every page size 1..256 runs since
    the paged path gained a gathered loader) raises, naming the reason."""
    s, meta, q, k, v, _, table, caches = _gpu_case("zigzag", 2, 0, [2048], [0], 8, 2, 256, 256, page=4)
    with pytest.raises(ValueError, match="head dims"):
        _spec_plan(meta, num_q_heads=8, num_kv_heads=2, head_dim=256, dtype=torch.bfloat16, page_size=4,
                   backend="triton", backend_options={"family": "sm90"})
    plan = _spec_plan(meta, num_q_heads=8, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16, page_size=4,
                      backend="triton", backend_options={"family": "sm90"})
    assert plan.family == "sm90"


def _fa4_available():
    try:
        import flash_attn.cute  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not _fa4_available(), reason="flash_attn.cute not importable")
@pytest.mark.parametrize(
    "strategy,window,sinks,page,d,dv",
    [
        ("zigzag", -1, False, None, 128, 128),
        ("zigzag", 700, True, None, 128, 128),
        ("contiguous", -1, False, None, 192, 128),
        ("zigzag", -1, False, 128, 128, 128),
        ("zigzag", -1, True, 64, 128, 128),
    ],
)
def test_gpu_fa4_vs_triton(strategy, window, sinks, page, d, dv):
    s, meta, q, k, v, sk, table, caches = _gpu_case(strategy, 2, 0, [4096, 2000], [0, 300], 16, 4, d, dv,
                                                    window=window, sinks=sinks, page=page)
    kw = dict(window_size=(window, 0), sinks=sk, return_lse=True)
    kk, vv = caches if caches else (k, v)
    out, lse = s.attention(q, kk, vv, meta, page_table=table, backend="fa4", **kw)
    ref, ref_lse = s.attention(q, kk, vv, meta, page_table=table, backend="triton", **kw)
    n = meta.num_local_tokens
    assert _max_err(out, ref, n) < 2e-2 and _max_err(lse, ref_lse, n) < 1e-2
    assert (out[n:] == 0).all() and torch.isneginf(lse[n:]).all()
