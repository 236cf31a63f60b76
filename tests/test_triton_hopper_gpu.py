"""The Hopper (sm_90) Triton paths at real sizes against the torch reference (``-m gpu``, H100/H200).

* dense warp-specialized kernel over a **paged** cache: page sizes 1..256 (TMA copies of
  ``gcd(page_size, 128)`` rows when that is >= 8, a cp.async gather by a 4-warp loader
  otherwise), D64 / D128 / D192-Dv128, GQA, window, sinks, LSE on and off, int32 and int64
  page tables;
* the **absorbed-MLA** kernel (one latent KV head, D 576 / Dv 512, ``v`` a view of ``k[..., :512]``,
  16 and 128 query heads), packed and paged, every strategy, window, sinks, LSE;
* every paged cache holds NaN in its unused slots (the tail of each sequence's last page) and
  in every page-table entry past a sequence's pages (a NaN page): results must be finite and match.

The reference is the torch backend over the packed K/V in float32 (same bf16 values).
"""

from __future__ import annotations

import pytest
import torch

import cpattn
from graph_utils import capture_graph

pytest.importorskip("triton")

pytestmark = pytest.mark.gpu


def _spec_plan(meta, *, backend="auto", backend_options=None, **spec):
    """``cpattn.plan_attention`` for the layer kind of ``spec`` (:class:`cpattn.AttentionSpec`'s keywords)."""
    return cpattn.plan_attention(meta, cpattn.AttentionSpec(**spec), backend=backend, backend_options=backend_options)


def _is_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _is_sm90(), reason="needs an sm_90 GPU")


def _nan_paged(k, v, lens, page, int64=False, seed=0):
    """Scatter packed K/V (sequences of ``lens`` keys, in order) into shuffled pages of a cache
    whose unused slots are NaN; table entries past a sequence's pages point at an all-NaN page.
    ``v`` None: K only (the MLA latent), the V cache returned is None."""
    dev = k.device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    pages_per = [-(-n // page) for n in lens]
    max_pages = max(pages_per + [1])
    used = sum(pages_per)
    num_pages = used + 2  # + the NaN page + one spare
    perm = torch.randperm(num_pages, generator=gen)
    nan_page = int(perm[-1])
    kc = torch.full((num_pages, page, *k.shape[1:]), float("nan"), dtype=k.dtype, device=dev)
    vc = None if v is None else torch.full((num_pages, page, *v.shape[1:]), float("nan"), dtype=v.dtype, device=dev)
    table = torch.full((len(lens), max_pages), nan_page, dtype=torch.int64)
    off, nxt = 0, 0
    for b, n in enumerate(lens):
        table[b, : pages_per[b]] = perm[nxt : nxt + pages_per[b]]
        nxt += pages_per[b]
        j = torch.arange(n)
        slots = table[b, j // page].to(dev) * page + (j % page).to(dev)
        kc.view(-1, *k.shape[1:])[slots] = k[off : off + n]
        if vc is not None:
            vc.view(-1, *v.shape[1:])[slots] = v[off : off + n]
        off += n
    return kc, vc, table.to(dev, torch.int64 if int64 else torch.int32)


def _case(strategy, cp_size, rank, ext, pre, hq, hkv, d, dv, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    t, n_kv = sum(ext), sum(e + p for e, p in zip(ext, pre))
    q = torch.randn(t, hq, d, device="cuda", generator=gen).to(dtype)
    k = torch.randn(n_kv, hkv, d, device="cuda", generator=gen).to(dtype)
    v = torch.randn(n_kv, hkv, dv, device="cuda", generator=gen).to(dtype)
    s = cpattn.get_strategy(strategy, cp_size, pad_multiple=64)
    meta = s.build_metadata(ext, pre, rank=rank).to("cuda")
    return s, meta, s.shard(q, meta), k, v


def _check(out, lse, ref, ref_lse, meta, what):
    n = meta.num_local_tokens
    assert torch.isfinite(out[:n]).all() and torch.isfinite(lse[:n]).all(), f"{what}: NaN/inf in the output"
    err = (out[:n].float() - ref[:n].float()).abs().max().item()
    lse_err = (lse[:n] - ref_lse[:n]).abs().max().item()
    assert err < 2e-2 and lse_err < 1e-2, f"{what}: max |out - ref| = {err}, |lse - ref| = {lse_err}"
    assert (out[n:] == 0).all() and torch.isneginf(lse[n:]).all(), f"{what}: pad rows"


# ------------------------------------------------------------------------------ dense, paged
@needs_sm90
@pytest.mark.parametrize(
    "page,d,dv,hq,hkv,window,sinks,int64",
    [
        (16, 128, 128, 32, 8, -1, False, False),
        (64, 128, 128, 32, 8, -1, False, True),
        (256, 128, 128, 32, 8, -1, False, False),
        (128, 128, 128, 32, 8, 700, True, False),
        (8, 128, 128, 16, 4, -1, True, False),
        (24, 128, 128, 16, 4, -1, False, False),
        (192, 128, 128, 16, 4, 1000, False, True),
        (1, 128, 128, 16, 4, -1, False, False),
        (4, 128, 128, 16, 4, 500, True, False),
        (12, 128, 128, 32, 8, -1, False, True),
        (1, 64, 64, 16, 16, -1, False, False),
        (2, 192, 128, 16, 16, -1, True, False),
        (16, 64, 64, 16, 16, -1, False, False),
        (256, 64, 64, 16, 16, 300, True, False),
        (16, 192, 128, 16, 16, -1, False, False),
        (64, 192, 128, 16, 4, -1, True, False),
        (256, 192, 128, 16, 16, 500, False, True),
    ],
)
def test_gpu_sm90_paged_vs_torch(page, d, dv, hq, hkv, window, sinks, int64):
    """Ragged batch (prefixes, a 1-token sequence, lengths that end mid-page), zigzag C=3 rank 1."""
    ext, pre = [3000, 17, 1, 900], [0, 200, 5, 2999]
    lens = [e + p for e, p in zip(ext, pre)]
    s, meta, q, k, v = _case("zigzag", 3, 1, ext, pre, hq, hkv, d, dv)
    sk = torch.randn(hq, device="cuda") if sinks else None
    kc, vc, table = _nan_paged(k, v, lens, page, int64)
    kw = dict(window_size=(window, 0), sinks=sk, return_lse=True)
    ref, ref_lse = s.attention(q.float(), k.float(), v.float(), meta, backend="torch", **kw)
    plan = _spec_plan(meta, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv, dtype=q.dtype,
                      window_size=(window, 0), page_size=page, has_sinks=sinks, backend="triton")
    assert plan.family == "sm90"  # TMA copy groups for page % 8 == 0, the cp.async gather otherwise
    out, lse = plan.attend(q, kc, vc, page_table=table, sinks=sk, return_lse=True)
    _check(out, lse, ref, ref_lse, meta, f"{plan.family} page {page}")
    assert torch.equal(plan.attend(q, kc, vc, page_table=table, sinks=sk), out), "output differs without LSE"


@needs_sm90
@pytest.mark.parametrize("overlap,pingpong", [(0, False), (1, False), (2, False), (2, True), ("auto", False)])
@pytest.mark.parametrize("d,dv,hq,hkv,page,window,sinks", [
    (128, 128, 32, 8, None, -1, False),
    (192, 128, 16, 16, None, -1, False),
    (128, 128, 16, 4, 16, 700, True),
])
def test_gpu_sm90_overlap_modes_vs_torch(overlap, pingpong, d, dv, hq, hkv, page, window, sinks):
    """The FA3-style overlap options (``overlap=1``: both GEMMs issued back to back, ``overlap=2``:
    softmax_j issued under ``P_{j-1} V_{j-1}``; "auto", the default: 2 at D128 and D192 / 128
    without a window)
    against torch on a ragged zigzag batch, packed and paged with NaN in unused slots."""
    ext, pre = [3000, 17, 1, 900], [0, 200, 5, 2999]
    lens = [e + p for e, p in zip(ext, pre)]
    s, meta, q, k, v = _case("zigzag", 3, 1, ext, pre, hq, hkv, d, dv)
    sk = torch.randn(hq, device="cuda") if sinks else None
    kc, vc, table = _nan_paged(k, v, lens, page, False) if page else (k, v, None)
    kw = dict(window_size=(window, 0), sinks=sk, return_lse=True)
    ref, ref_lse = s.attention(q.float(), k.float(), v.float(), meta, backend="torch", **kw)
    plan = _spec_plan(meta, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv, dtype=q.dtype,
                      window_size=(window, 0), page_size=page, has_sinks=sinks, backend="triton",
                      backend_options={"sm90": {"overlap": overlap, "pingpong": pingpong}})
    assert plan.family == "sm90"
    want = overlap if overlap != "auto" else (2 if (d, dv) in ((128, 128), (192, 128)) and window < 0 else 0)
    assert plan._impl.overlap == want
    out, lse = plan.attend(q, kc, vc, page_table=table, sinks=sk, return_lse=True)
    _check(out, lse, ref, ref_lse, meta, f"overlap {overlap} pingpong {pingpong} page {page}")


@needs_sm90
@pytest.mark.parametrize("page", [1, 16, 64, 256])
def test_gpu_sm90_paged_matches_packed(page):
    """One long sequence at a bench-like size: paged and packed sm90 runs agree closely."""
    ext, pre = [16384], [0]
    s, meta, q, k, v = _case("zigzag", 2, 0, ext, pre, 32, 8, 128, 128, seed=1)
    kc, vc, table = _nan_paged(k, v, [16384], page)
    packed = s.attention(q, k, v, meta, backend="triton")
    plan = _spec_plan(meta, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=q.dtype, page_size=page,
                      backend="triton")
    assert plan.family == "sm90"
    paged = plan.attend(q, kc, vc, page_table=table)
    n = meta.num_local_tokens
    assert torch.isfinite(paged[:n]).all()
    assert (paged[:n].float() - packed[:n].float()).abs().max().item() < 1e-2


@needs_sm90
@pytest.mark.parametrize(
    "d,dv,hq,hkv,page,window,sinks",
    [
        (128, 128, 32, 8, None, -1, False),
        (128, 128, 16, 4, None, 700, True),
        (192, 128, 16, 16, None, -1, False),
        (64, 64, 16, 16, None, -1, True),
        (128, 128, 32, 8, 16, -1, False),
        (128, 128, 16, 4, 1, 300, False),
        (192, 128, 16, 4, 256, -1, True),
    ],
)
@pytest.mark.parametrize("overlap", [0, 2])
def test_gpu_sm90_persistent_is_bit_identical(d, dv, hq, hkv, page, window, sinks, overlap):
    """Persistent programs (one per SM, snake over the work items) compute every item exactly as
    one program per item does, in either loop (``overlap`` 0 / 2): outputs and LSE are
    bit-identical (ragged batch, pad tiles)."""
    ext, pre = [5000, 300, 1, 700], [0, 900, 2, 64]
    lens = [e + p for e, p in zip(ext, pre)]
    s, meta, q, k, v = _case("zigzag", 2, 1, ext, pre, hq, hkv, d, dv, seed=5)
    sk = torch.randn(hq, device="cuda") if sinks else None
    kk, vv, table = (k, v, None) if page is None else _nan_paged(k, v, lens, page)
    outs = []
    for persistent in (False, True):
        plan = _spec_plan(meta, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv, dtype=q.dtype,
                          window_size=(window, 0), page_size=page, has_sinks=sinks, backend="triton",
                          backend_options={"sm90": {"persistent": persistent, "overlap": overlap}})
        assert plan.family == "sm90" and plan._impl.persistent == persistent and plan._impl.overlap == overlap
        outs.append(plan.attend(q, kk, vv, page_table=table, sinks=sk, return_lse=True))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    ref, ref_lse = s.attention(q.float(), k.float(), v.float(), meta, backend="torch", window_size=(window, 0),
                               sinks=sk, return_lse=True)
    _check(outs[1][0], outs[1][1], ref, ref_lse, meta, f"persistent overlap {overlap}")


@needs_sm90
@pytest.mark.parametrize("cp_size,rank", [(8, 0), (4, 3)])
def test_gpu_sm90_grid_without_l2_sections_is_bit_identical(cp_size, rank):
    """d192/128 MHA at 16k under zigzag C = 8 / 4, where the L2 head sections (3 or 4 of 16 heads,
    by the GPU's L2) leave a long tail: one section (``sections=False``, what "auto" picks when
    the simulated loss is large) runs heaviest first over all heads; every program still
    computes its own tile, so the results are bit-identical to the sectioned grid's, and both
    match the reference."""
    s, meta, q, k, v = _case("zigzag", cp_size, rank, [16384], [0], 16, 16, 192, 128, seed=11)
    outs, sections = [], []
    for option in (False, True):
        plan = _spec_plan(meta, num_q_heads=16, num_kv_heads=16, head_dim=192, head_dim_v=128, dtype=q.dtype,
                          backend="triton", backend_options={"sm90": {"sections": option}})
        assert plan.family == "sm90"
        sections.append(plan._impl.sm90_args["heads_per_section"])
        outs.append(plan.attend(q, k, v, return_lse=True))
    assert sections[0] == 16 and sections[1] < 16
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    ref, ref_lse = s.attention(q.float(), k.float(), v.float(), meta, backend="torch", return_lse=True)
    _check(outs[0][0], outs[0][1], ref, ref_lse, meta, "one section")


# ------------------------------------------------------------------------------ absorbed MLA
def _mla_case(strategy, cp_size, rank, ext, pre, hq, seed=0):
    s, meta, q, k, _ = _case(strategy, cp_size, rank, ext, pre, hq, 1, 576, 512, seed=seed)
    return s, meta, q, k, k[..., :512]


def _mla_plan(s, meta, hq, page=None, window=-1, sinks=False, **options):
    return _spec_plan(meta, num_q_heads=hq, num_kv_heads=1, head_dim=576, head_dim_v=512, dtype=torch.bfloat16,
                      window_size=(window, 0), page_size=page, has_sinks=sinks, backend="triton",
                      backend_options=options)


@needs_sm90
@pytest.mark.parametrize(
    "strategy,cp_size,rank,ext,pre,hq,window,sinks,page",
    [
        ("zigzag", 1, 0, [4096], [0], 16, -1, False, None),
        ("zigzag", 2, 1, [3000, 300, 1], [0, 900, 2], 16, -1, False, None),
        ("zigzag", 4, 2, [2048], [512], 128, -1, False, None),
        ("contiguous", 2, 1, [2500, 100], [0, 7], 32, 300, True, None),
        ("interleave", 3, 0, [2000], [10], 16, -1, True, None),
        ("zigzag", 2, 0, [3000, 300, 1], [0, 900, 2], 16, -1, False, 64),
        ("zigzag", 2, 1, [3000, 300, 1], [0, 900, 2], 16, -1, False, 16),
        ("zigzag", 2, 1, [2048], [100], 128, -1, False, 256),
        ("contiguous", 1, 0, [1500, 33], [17, 0], 16, 200, True, 8),
        ("zigzag", 2, 0, [2000, 5], [0, 60], 16, -1, False, 1),
    ],
)
def test_gpu_mla_prefill_vs_torch(strategy, cp_size, rank, ext, pre, hq, window, sinks, page):
    """Absorbed MLA (latent MQA, v = k[..., :512]) on the MLA kernel, packed and paged (page 1:
    the portable kernel), against the torch reference over the packed latent."""
    from cpattn.kernels._sm90_common import paged_copy_rows

    s, meta, q, k, v = _mla_case(strategy, cp_size, rank, ext, pre, hq)
    sk = torch.randn(hq, device="cuda") if sinks else None
    kw = dict(window_size=(window, 0), sinks=sk, return_lse=True)
    ref, ref_lse = s.attention(q.float(), k.float(), v.float(), meta, backend="torch", **kw)
    plan = _mla_plan(s, meta, hq, page, window, sinks)
    assert plan.family == ("mla" if page is None or paged_copy_rows(page, 64) else "portable")
    if page is None:
        kk, vv, table = k, v, None
    else:
        lens = [e + p for e, p in zip(ext, pre)]
        kk, _, table = _nan_paged(k, None, lens, page)
        vv = kk[..., :512]
    out, lse = plan.attend(q, kk, vv, page_table=table, sinks=sk, return_lse=True)
    _check(out, lse, ref, ref_lse, meta, f"{plan.family} page {page}")
    assert torch.equal(plan.attend(q, kk, vv, page_table=table, sinks=sk), out), "output differs without LSE"


@needs_sm90
@pytest.mark.parametrize("family,hq,hkv,d,dv", [("mla", 16, 1, 576, 512), ("sm90", 32, 8, 128, 128),
                                               ("sm90", 16, 16, 192, 128)])
def test_gpu_packed_nan_in_another_sequence_stays_there(family, hq, hkv, d, dv):
    """Packed K/V: NaN keys and values in sequence 1 reach only sequence 1's rows; sequence 0's
    last key block, which overlaps sequence 1's first keys, stays finite and correct."""
    s, meta, q, k, v = _case("contiguous", 1, 0, [100, 200], [0, 0], hq, hkv, d, dv)
    k = k.clone()
    k[100 + 20] = float("nan")  # a key of sequence 1 inside sequence 0's last key block
    v = k[..., :512] if family == "mla" else v.clone()
    if family != "mla":
        v[100 + 21] = float("nan")
    plan = _spec_plan(meta, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv,
                      dtype=torch.bfloat16, backend="triton")
    assert plan.family == family
    out, lse = plan.attend(q, k, v, return_lse=True)
    one = cpattn.ContiguousStrategy(1)
    k0, v0 = k[:100].float(), v[:100].float()
    ref0, ref_lse0 = one.attention(q[:100].float(), k0, v0, one.build_metadata([100], rank=0).to("cuda"),
                                   backend="torch", return_lse=True)
    assert torch.isfinite(out[:100]).all() and torch.isfinite(lse[:100]).all()
    assert (out[:100].float() - ref0).abs().max().item() < 2e-2
    assert (lse[:100] - ref_lse0).abs().max().item() < 1e-2
    assert torch.isnan(out[122:300]).all()  # rows at or after the NaN key and value see them


@needs_sm90
def test_gpu_mla_separate_v_falls_back_per_call():
    """A value tensor that is not a view of the latent runs the portable kernel for that call."""
    s, meta, q, k, v = _mla_case("zigzag", 2, 0, [2048], [0], 16)
    plan = _mla_plan(s, meta, 16)
    assert plan.family == "mla"
    out_view = plan.attend(q, k, v)
    out_copy = plan.attend(q, k, v.clone())
    ref = s.attention(q.float(), k.float(), v.float(), meta, backend="torch")
    n = meta.num_local_tokens
    for out in (out_view, out_copy):
        assert (out[:n].float() - ref[:n]).abs().max().item() < 2e-2


@needs_sm90
def test_gpu_mla_large_matches_portable():
    """128 heads over 16k keys (the benchmark's shape, zigzag C=2 rank 0): the MLA kernel and the
    portable kernel agree."""
    s, meta, q, k, v = _mla_case("zigzag", 2, 0, [16384], [0], 128, seed=3)
    fast = _mla_plan(s, meta, 128).attend(q, k, v)
    slow = _mla_plan(s, meta, 128, family="portable").attend(q, k, v)
    n = meta.num_local_tokens
    assert torch.isfinite(fast[:n]).all()
    assert (fast[:n].float() - slow[:n].float()).abs().max().item() < 1e-2


# ------------------------------------------------------------------------------ static plans, graphs
@needs_sm90
@pytest.mark.parametrize(
    "family,d,dv,hq,hkv,page,options",
    [
        ("sm90", 128, 128, 32, 8, None, {}),
        ("sm90", 128, 128, 32, 8, None, {"sm90": {"persistent": True}}),
        ("sm90", 128, 128, 16, 4, 16, {}),
        ("sm90", 192, 128, 16, 16, 1, {"sm90": {"persistent": True}}),
        ("mla", 576, 512, 16, 1, None, {}),
        ("mla", 576, 512, 16, 1, 64, {}),
    ],
)
def test_gpu_static_plan_graph_replay(family, d, dv, hq, hkv, page, options):
    """A CUDA graph captured over shard + plan.attend for one batch of a StaticPlanner replays for
    other batches planned into the same buffers (capacity-sized grids, device tile counts)."""
    s = cpattn.get_strategy("zigzag", 2, pad_multiple=64)
    planner = cpattn.StaticPlanner(s, max_tokens=6000, max_seqs=4, max_kv_tokens=9000, device="cuda")
    cap = planner.capacity
    batches = [([3000, 17, 1], [0, 200, 5]), ([5000], [100]), ([100, 200, 300, 400], [0, 50, 0, 2000])]
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.zeros(cap.max_tokens, hq, d, device="cuda", dtype=torch.bfloat16)
    k_buf = torch.zeros(cap.max_kv_tokens, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_buf = k_buf[..., :dv] if family == "mla" else torch.zeros(cap.max_kv_tokens, hkv, dv, device="cuda",
                                                                  dtype=torch.bfloat16)
    if page is not None:
        max_pages = -(-cap.max_kv_tokens // page)
        kc = torch.full((cap.max_seqs * max_pages + 1, page, hkv, d), float("nan"), device="cuda", dtype=torch.bfloat16)
        vc = kc[..., :dv] if family == "mla" else torch.full((kc.shape[0], page, hkv, dv), float("nan"), device="cuda",
                                                            dtype=torch.bfloat16)
        table = torch.zeros(cap.max_seqs, max_pages, dtype=torch.int32, device="cuda")
    out = torch.empty(cap.max_local_tokens, hq, dv, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(cap.max_local_tokens, hq, device="cuda", dtype=torch.float32)
    graph = None
    for ext, pre in batches:
        lens = [e + p for e, p in zip(ext, pre)]
        t, n_kv = sum(ext), sum(lens)
        q = torch.randn(t, hq, d, device="cuda", generator=gen).to(torch.bfloat16)
        k = torch.randn(n_kv, hkv, d, device="cuda", generator=gen).to(torch.bfloat16)
        v = k[..., :dv] if family == "mla" else torch.randn(n_kv, hkv, dv, device="cuda", generator=gen).to(
            torch.bfloat16)
        x.zero_()
        x[:t] = q
        k_buf[:n_kv] = k
        if family != "mla":
            v_buf[:n_kv] = v
        if page is not None:
            kk, vv, tt = _nan_paged(k, None if family == "mla" else v, lens, page)
            kc[: kk.shape[0]] = kk
            if family != "mla":
                vc[: vv.shape[0]] = vv
            table.fill_(kc.shape[0] - 1)  # entries past a sequence's pages: the last (NaN) page
            table[: tt.shape[0], : tt.shape[1]] = tt
        meta = planner.plan(ext, pre, rank=1)
        plan = _spec_plan(meta, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv,
                          dtype=torch.bfloat16, page_size=page, backend="triton", backend_options=options)
        assert plan.family == family
        kv = (k_buf, v_buf) if page is None else (kc, vc)

        def step():
            plan.attend(s.shard(x, meta), *kv, page_table=None if page is None else table, out=out, lse=lse)

        if graph is None:
            graph = capture_graph(step)
        graph.replay()
        torch.cuda.synchronize()
        fresh = s.build_metadata(ext, pre, rank=1).to("cuda")
        ref, ref_lse = s.attention(s.shard(q, fresh).float(), k.float(), v.float(), fresh, backend="torch",
                                   return_lse=True)
        n = fresh.num_local_tokens
        assert torch.isfinite(out[:n]).all()
        err = (out[:n].float() - ref[:n]).abs().max().item()
        lse_err = (lse[:n] - ref_lse[:n]).abs().max().item()
        assert err < 2e-2 and lse_err < 1e-2, f"batch {ext}: {err}, {lse_err}"
        assert (out[n:] == 0).all() and torch.isneginf(lse[n:]).all()
