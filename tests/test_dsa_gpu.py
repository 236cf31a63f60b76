"""DSA on the GPU at real sizes (``-m gpu``; skipped without CUDA): the Triton sparse-attention
(the Hopper MLA family and the portable kernel) and index top-k kernels against the torch
references and fp64 oracles (DeepSeek-V3.2: 128 heads, D 576 / Dv 512, top-k 2048; indexer 64 x
128), packed and paged, fp8 index keys, CUDA-graph replay of a static sparse plan across batches,
and the reference DSA layer (triton == torch)."""

from __future__ import annotations

import pytest
import torch

import cpattn
from cpattn import dsa
from cpattn.kernels.reference import index_scores

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _spec_plan(meta, *, backend="auto", backend_options=None, **spec):
    """``cpattn.plan_attention`` for the layer kind of ``spec`` (:class:`cpattn.AttentionSpec`'s keywords)."""
    return cpattn.plan_attention(meta, cpattn.AttentionSpec(**spec), backend=backend, backend_options=backend_options)


def _meta(strategy: str, cp: int, rank: int, ext, pre, pad: int = 64):
    s = cpattn.get_strategy(strategy, cp, pad_multiple=pad)
    return s, s.build_metadata(ext, pre, rank=rank).to(DEV)


def _random_selection(meta, topk: int, gen) -> torch.Tensor:
    """[P, topk] int32: per row distinct random positions in [0, position + 64) (future entries
    included), -1 padding for rows with fewer keys."""
    p = meta.num_physical_tokens
    pos = torch.full((p,), -1, device=DEV, dtype=torch.long)
    pos[: meta.num_local_tokens] = meta.local_positions
    span = pos + 64
    keys = torch.rand(p, topk * 2, device=DEV, generator=gen)
    cand = (keys * span[:, None].clamp(min=1)).long()  # may repeat: make distinct by a sort + unique mask
    cand, _ = cand.sort(1)
    dup = torch.zeros_like(cand, dtype=torch.bool)
    dup[:, 1:] = cand[:, 1:] == cand[:, :-1]
    cand = cand.masked_fill(dup, -1)
    cand = cand.gather(1, torch.argsort(torch.rand(cand.shape, device=DEV, generator=gen), 1))[:, :topk]
    return cand.masked_fill(pos[:, None] < 0, -1).to(torch.int32)


def _paged(x: torch.Tensor, meta, page: int, gen):
    """Packed [N, ...] rows -> cache [num_pages, page, ...] in random page order, page_table."""
    lens = (meta.host.kv_lens if meta.host is not None else meta.kv_lens).tolist()
    max_pages = max(-(-n // page) for n in lens)
    table = torch.randperm(len(lens) * max_pages, device=DEV, generator=gen).view(len(lens), max_pages).to(torch.int32)
    cache = torch.full((len(lens) * max_pages, page, *x.shape[1:]), float("nan"), device=DEV, dtype=x.dtype)
    pos = torch.cat([torch.arange(n, device=DEV) for n in lens])
    seq = torch.cat([torch.full((n,), b, device=DEV) for b, n in enumerate(lens)])
    cache[table[seq, pos // page].long(), pos % page] = x
    return cache, table  # unused slots hold NaN: a kernel that reads one gives NaN


def _err(a, b, n):
    return (a[:n].float() - b[:n].float()).abs().max().item()


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("sinks", [False, True])
def test_sparse_absorbed_real_size(paged, sinks):
    """Absorbed MLA: 128 heads, D 576 / Dv 512, top-k 2048, rank 0 of interleave C = 8 at 16k."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    s, meta = _meta("interleave", 8, 0, [12288, 4000], [0, 96])
    n_kv = meta.num_kv_tokens
    q = torch.randn(meta.num_physical_tokens, 128, 576, device=DEV, generator=gen).to(torch.bfloat16)
    latent = torch.randn(n_kv, 1, 576, device=DEV, generator=gen).to(torch.bfloat16)
    idx = _random_selection(meta, 2048, gen)
    sk = torch.randn(128, device=DEV, generator=gen) if sinks else None
    kw = dict(softmax_scale=192**-0.5, sinks=sk, return_lse=True)
    ref, ref_lse = s.sparse_attention(q, latent, latent[..., :512], meta, idx, backend="torch", **kw)
    k_in, table = (latent, None) if not paged else _paged(latent, meta, 64, gen)
    out, lse = s.sparse_attention(q, k_in, k_in[..., :512], meta, idx, page_table=table, backend="triton", **kw)
    n = meta.num_local_tokens
    assert _err(out, ref, n) < 2e-2 and _err(lse, ref_lse, n) < 1e-2
    assert not out[:n].isnan().any() and (out[n:] == 0).all() and torch.isneginf(lse[n:]).all()


def _nan_unselected(latent, meta, idx):
    """NaN in every packed latent row that no valid entry of ``idx`` selects (rows that only
    future entries point at included): a kernel that reads one gives NaN."""
    n = meta.num_local_tokens
    seq, pos = meta.local_seq_ids[:n].long(), meta.local_positions[:n].long()
    start = meta.cu_kv_lens.long()[seq]
    e = idx[:n].long()
    valid = (e >= 0) & (e <= pos[:, None])
    used = torch.zeros(latent.shape[0], dtype=torch.bool, device=DEV)
    used[(start[:, None] + e)[valid]] = True
    latent[~used] = float("nan")
    return int(valid.sum())


def _oracle_rows(q, latent, meta, idx, rows, scale, sinks):
    """fp64 absorbed sparse attention of the given local rows, explicit index-and-causal mask:
    row r sees latent row ``cu_kv_lens[seq] + e`` for each entry 0 <= e <= its position."""
    outs, lses = [], []
    for r in rows:
        b, p = int(meta.local_seq_ids[r]), int(meta.local_positions[r])
        e = idx[r].long()
        e = e[(e >= 0) & (e <= p)]
        keys = latent[int(meta.cu_kv_lens[b]) + e, 0].double()  # [n, 576]
        s = (q[r].double() @ keys.T) * scale  # [H, n]
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None]], 1)
        if s.shape[1] == 0:
            outs.append(torch.zeros(q.shape[1], 512, dtype=torch.float64, device=DEV))
            lses.append(torch.full((q.shape[1],), float("-inf"), dtype=torch.float64, device=DEV))
            continue
        m = s.max(1, keepdim=True).values
        w = torch.exp(s - m)
        outs.append((w[:, : keys.shape[0]] @ keys[:, :512]) / w.sum(1, keepdim=True))
        lses.append((m[:, 0] + torch.log(w.sum(1))))
    return torch.stack(outs), torch.stack(lses)


#: (heads, page_size, sinks, topk, idx dtype, lengths): rank 0 of interleave C = 8; "long"
#: sequences (most rows see more keys than top-k 2048), "short" ones (every row fewer: the
#: selection holds every visible key, -1 and future entries).
_MLA_CASES = [
    (128, None, False, 2048, torch.int32, "long"),
    (128, 64, True, 2048, torch.int64, "long"),
    (16, None, True, 2048, torch.int32, "short"),
    (16, 1, False, 512, torch.int32, "long"),
]


@pytest.mark.parametrize("heads,page,sinks,topk,idx_dtype,lengths", _MLA_CASES)
def test_sparse_mla_family_real_size(heads, page, sinks, topk, idx_dtype, lengths):
    """The Hopper MLA sparse family (plan.family == "mla"): against an fp64 oracle on sampled rows
    (explicit mask), the torch reference on every row and the portable family; NaN in every latent
    row no valid entry selects and in unused page slots; a row whose entries are all future or -1
    gives 0 / -inf (its sink's lse with sinks); pad rows 0 / -inf."""
    gen = torch.Generator(device=DEV).manual_seed(5)
    ext, pre = ([9000, 3000], [0, 500]) if lengths == "long" else ([1500, 700], [0, 200])
    s, meta = _meta("interleave", 8, 0, ext, pre)
    p, n, n_kv = meta.num_physical_tokens, meta.num_local_tokens, meta.num_kv_tokens
    q = torch.randn(p, heads, 576, device=DEV, generator=gen).to(torch.bfloat16)
    latent = torch.randn(n_kv, 1, 576, device=DEV, generator=gen).to(torch.bfloat16)
    idx = _random_selection(meta, topk, gen)
    pos = meta.local_positions[:n].long()
    idx[1] = (pos[1] + 1 + torch.arange(topk, device=DEV)).to(torch.int32)  # only future entries
    idx[2] = -1
    idx = idx.to(idx_dtype)
    assert _nan_unselected(latent, meta, idx) > 0
    sk = torch.randn(heads, device=DEV, generator=gen) if sinks else None
    k_in, table = (latent, None) if page is None else _paged(latent, meta, page, gen)
    kw = dict(num_q_heads=heads, num_kv_heads=1, head_dim=576, head_dim_v=512, dtype=torch.bfloat16, topk=topk,
              page_size=page, has_sinks=sinks, backend="triton")
    run = dict(page_table=table, sinks=sk, softmax_scale=192**-0.5, return_lse=True)
    plan = _spec_plan(meta, **kw)
    assert plan.family == "mla"
    out, lse = plan.attend(q, k_in, k_in[..., :512], idx, **run)
    portable = _spec_plan(meta, **kw, backend_options={"family": "portable", "config": (32, 8, 2)})
    assert portable.family == "portable"
    out_p, lse_p = portable.attend(q, k_in, k_in[..., :512], idx, **run)
    ref, ref_lse = s.sparse_attention(q, latent, latent[..., :512], meta, idx, backend="torch",
                                      **{k: v for k, v in run.items() if k != "page_table"})
    assert not out[:n].isnan().any() and not lse[:n].isnan().any()
    assert _err(out, ref, n) < 2e-2 and _err(out, out_p, n) < 2e-2
    fin = torch.isfinite(ref_lse[:n])
    assert torch.equal(torch.isneginf(lse[:n]), torch.isneginf(ref_lse[:n]))
    assert (lse[:n][fin] - ref_lse[:n][fin]).abs().max().item() < 1e-2
    assert (lse[:n][fin] - lse_p[:n][fin]).abs().max().item() < 1e-2
    rows = sorted({1, 2, 3, n // 2, n - 1})
    o64, l64 = _oracle_rows(q, latent, meta, idx, rows, 192**-0.5, sk)
    assert (out[rows].double() - o64).abs().max().item() < 2e-2
    fin = torch.isfinite(l64)
    assert torch.equal(torch.isneginf(lse[rows]), torch.isneginf(l64))
    assert (lse[rows].double()[fin] - l64[fin]).abs().max().item() < 1e-2
    assert (out[1:3] == 0).all()  # no valid key: 0 (lse -inf, or the sink's lse)
    if sinks:
        assert torch.allclose(lse[1:3], sk.expand(2, heads), atol=1e-5)
    else:
        assert torch.isneginf(lse[1:3]).all()
    assert (out[n:] == 0).all() and torch.isneginf(lse[n:]).all()


def test_sparse_mla_family_fallback_per_call(monkeypatch):
    """The mla family falls back to the portable kernel for a call whose ``v`` is not a view of
    ``k[..., :512]`` (a copy), with the same result."""
    monkeypatch.setenv("CPATTN_TRITON_AUTOTUNE", "0")  # the portable kernel's first config: no tuning
    gen = torch.Generator(device=DEV).manual_seed(6)
    s, meta = _meta("interleave", 8, 0, [4000], [0])
    p, n = meta.num_physical_tokens, meta.num_local_tokens
    q = torch.randn(p, 128, 576, device=DEV, generator=gen).to(torch.bfloat16)
    latent = torch.randn(meta.num_kv_tokens, 1, 576, device=DEV, generator=gen).to(torch.bfloat16)
    idx = _random_selection(meta, 256, gen)
    plan = _spec_plan(meta, num_q_heads=128, num_kv_heads=1, head_dim=576, head_dim_v=512,
                      dtype=torch.bfloat16, topk=256, backend="triton",
                      backend_options={"family": "mla"})
    assert plan.family == "mla"
    a = plan.attend(q, latent, latent[..., :512], idx)
    b = plan.attend(q, latent, latent[..., :512].clone(), idx)
    assert _err(a, b, n) < 2e-2 and (a[n:] == 0).all() and (b[n:] == 0).all()


def test_sparse_per_head_real_size():
    """Per-head (transformers' expanded K/V): 16 heads, D 192 / Dv 128, top-k 512; and GQA 16 / 4."""
    gen = torch.Generator(device=DEV).manual_seed(1)
    for hkv in (16, 4):
        s, meta = _meta("zigzag", 2, 1, [6000, 3000], [500, 0])
        n_kv = meta.num_kv_tokens
        q = torch.randn(meta.num_physical_tokens, 16, 192, device=DEV, generator=gen).to(torch.bfloat16)
        k = torch.randn(n_kv, hkv, 192, device=DEV, generator=gen).to(torch.bfloat16)
        v = torch.randn(n_kv, hkv, 128, device=DEV, generator=gen).to(torch.bfloat16)
        idx = _random_selection(meta, 512, gen)
        ref, ref_lse = s.sparse_attention(q, k, v, meta, idx, backend="torch", return_lse=True)
        out, lse = s.sparse_attention(q, k, v, meta, idx, backend="triton", return_lse=True)
        n = meta.num_local_tokens
        assert _err(out, ref, n) < 2e-2 and _err(lse, ref_lse, n) < 1e-2


@pytest.mark.parametrize("keys", ["bf16", "fp8", "bf16-paged64"])
def test_index_topk_real_size(keys):
    """Indexer 64 x 128, top-k 2048, rank 0 of interleave C = 8 at 16k tokens (two sequences, one
    with a prefix): every row selects min(topk, visible) distinct visible keys whose fp32 scores
    are the top ones (sorted selected scores == sorted top scores, within fp32-sum tolerance)."""
    gen = torch.Generator(device=DEV).manual_seed(2)
    ext, pre = [12288, 3000], [0, 1000]
    s, meta = _meta("interleave", 8, 0, ext, pre)
    p, n, n_kv = meta.num_physical_tokens, meta.num_local_tokens, meta.num_kv_tokens
    q = torch.randn(p, 64, 128, device=DEV, generator=gen).to(torch.bfloat16)
    k = torch.randn(n_kv, 128, device=DEV, generator=gen).to(torch.bfloat16)
    w = torch.randn(p, 64, device=DEV, generator=gen) * 64**-0.5
    k_scale, k_in, table = None, k, None
    if keys == "fp8":
        k_scale = k.float().abs().amax(-1) / 448.0
        k_in = (k.float() / k_scale[:, None]).to(torch.float8_e4m3fn)
    elif keys == "bf16-paged64":
        k_in, table = _paged(k, meta, 64, gen)
    idx = dsa.index_topk(q, k_in, w, meta, 2048, k_scale=k_scale, page_table=table, backend="triton")
    ks, ke = dsa.key_ranges(meta)
    k_ref = k_in.float() * k_scale[:, None] if k_scale is not None else k.float()
    rows = torch.linspace(0, n - 1, 96, device=DEV).long().unique().tolist()
    for r in rows:
        keys_r = k_ref[int(ks[r]) : int(ke[r])]
        scores = index_scores(q[r : r + 1].float(), keys_r, w[r : r + 1].float(), 128**-0.5)[0]
        kk = min(2048, scores.numel())
        sel = idx[r].long()
        chosen = sel[sel >= 0]
        assert chosen.numel() == kk and int((sel == -1).sum()) == 2048 - kk
        assert chosen.unique().numel() == kk and int(chosen.max()) < scores.numel()
        got = scores[chosen].sort(descending=True).values
        want = torch.topk(scores, kk).values
        assert torch.allclose(got, want, atol=1e-3, rtol=1e-3), r
    assert (idx[n:] == -1).all()
    ref = dsa.index_topk(q, k_in, w, meta, 2048, k_scale=k_scale, page_table=table, backend="torch")
    same = (idx.sort(1).values == ref.sort(1).values).all(1).float().mean().item()
    assert same > 0.9, f"only {same:.1%} of rows select exactly what the torch reference selects"


@pytest.mark.parametrize("keys", ["bf16", "fp8", "bf16-paged64"])
def test_index_topk_ties_real_size(keys):
    """Indexer 64 x 128, top-k 2048, rank 0 of interleave C = 8 at 16k tokens, with scores that
    tie everywhere and are exact in float32 whatever the summation order (integer queries and
    weights in [-2, 2], keys in {-1, 0, 1}, scale 1/4): the Triton path selects exactly the torch
    reference's set in every row (ties to the lower position, the same -1 padding), and sampled
    rows equal an fp64 (score, position) oracle."""
    gen = torch.Generator(device=DEV).manual_seed(4)
    ext, pre = [12288, 3000], [0, 1000]
    s, meta = _meta("interleave", 8, 0, ext, pre)
    p, n, n_kv = meta.num_physical_tokens, meta.num_local_tokens, meta.num_kv_tokens
    q = torch.randint(-2, 3, (p, 64, 128), device=DEV, generator=gen).to(torch.bfloat16)
    k = torch.randint(-1, 2, (n_kv, 128), device=DEV, generator=gen).to(torch.bfloat16)
    w = torch.randint(-2, 3, (p, 64), device=DEV, generator=gen).float()
    k_scale, k_in, table = None, k, None
    if keys == "fp8":
        k_scale = torch.full((n_kv,), 0.5, device=DEV)
        k_in = (k.float() * 2).to(torch.float8_e4m3fn)
    elif keys == "bf16-paged64":
        k_in, table = _paged(k, meta, 64, gen)
    kw = dict(softmax_scale=0.25, k_scale=k_scale, page_table=table)
    idx = dsa.index_topk(q, k_in, w, meta, 2048, backend="triton", **kw)
    ref = dsa.index_topk(q, k_in, w, meta, 2048, backend="torch", **kw)
    assert torch.equal(idx.sort(1).values, ref.sort(1).values)
    assert (idx[n:] == -1).all()
    ks, ke = dsa.key_ranges(meta)
    for r in torch.linspace(0, n - 1, 24, device=DEV).long().unique().tolist():
        scores = index_scores(q[r : r + 1].double(), k[int(ks[r]) : int(ke[r])].double(), w[r : r + 1].double(),
                              0.25)[0]
        vals = scores.tolist()
        order = sorted(range(len(vals)), key=lambda j: (-vals[j], j))[:2048]
        want = [-1] * (2048 - len(order)) + sorted(order)
        assert idx[r].sort().values.tolist() == want, r


def test_sparse_static_plan_graph_replay():
    """A CUDA graph captured over a static plan's sparse attention replays for other batches."""
    s = cpattn.InterleaveStrategy(2, pad_multiple=64)
    planner = cpattn.StaticPlanner(s, max_tokens=8192, max_seqs=8, max_kv_tokens=12288, device=DEV)
    cap = planner.capacity
    gen = torch.Generator(device=DEV).manual_seed(3)
    q = torch.zeros(cap.max_local_tokens, 64, 576, device=DEV, dtype=torch.bfloat16)
    latent = torch.zeros(cap.max_kv_tokens, 1, 576, device=DEV, dtype=torch.bfloat16)
    idx = torch.full((cap.max_local_tokens, 256), -1, device=DEV, dtype=torch.int32)
    out = torch.zeros(cap.max_local_tokens, 64, 512, device=DEV, dtype=torch.bfloat16)
    batches = [([5000, 1000], [2000, 0]), ([8000], [100]), ([100, 3000, 7, 2000], [0, 50, 1000, 0])]
    graph = None
    for ext, pre in batches:
        meta = planner.plan(ext, pre, rank=1)
        fresh = s.build_metadata(ext, pre, rank=1).to(DEV)
        n, n_kv = fresh.num_local_tokens, fresh.num_kv_tokens
        q[:n].normal_(generator=gen)
        latent[:n_kv].normal_(generator=gen)
        idx.copy_(torch.nn.functional.pad(_random_selection(fresh, 256, gen),
                                          (0, 0, 0, cap.max_local_tokens - fresh.num_physical_tokens), value=-1))
        plan = _spec_plan(meta, num_q_heads=64, num_kv_heads=1, head_dim=576, head_dim_v=512,
                          dtype=torch.bfloat16, topk=256, backend="triton")
        if graph is None:
            plan.attend(q, latent, latent[..., :512], idx, out=out)  # autotune outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                plan.attend(q, latent, latent[..., :512], idx, out=out)
        graph.replay()
        ref = s.sparse_attention(q[: fresh.num_physical_tokens], latent[:n_kv], latent[:n_kv, :, :512], fresh,
                                 idx[: fresh.num_physical_tokens], backend="torch")
        assert _err(out, ref, n) < 2e-2 and (out[n:] == 0).all()


def test_dsa_layer_triton_equals_torch():
    """The reference DSA layer at DeepSeek-V3.2 attention sizes (bf16, one GPU, CP = 1, 4k
    tokens, top-k 2048): triton backends == torch backends."""
    from reference_layers.dsa import DSAAttention, DSAConfig

    cfg = DSAConfig.deepseek_v32()
    model = DSAAttention(cfg, seed=0, device=DEV, dtype=torch.bfloat16)
    s = cpattn.InterleaveStrategy(1)
    ext = [4096]
    meta = s.build_metadata(ext, rank=0).to(DEV)
    x = torch.randn(4096, cfg.hidden, device=DEV, generator=torch.Generator(device=DEV).manual_seed(4))
    x = x.to(torch.bfloat16)
    pos = torch.arange(4096, device=DEV)
    ref, _, ref_idx = model(x, pos, s, meta, backend="torch", index_backend="torch")
    out, _, idx = model(x, pos, s, meta, backend="triton", index_backend="triton")
    same = (idx.sort(1).values == ref_idx.sort(1).values).all(1).float().mean().item()
    assert same > 0.9
    rows = (idx.sort(1).values == ref_idx.sort(1).values).all(1)
    scale = max(1.0, ref.float().abs().max().item())
    assert (out[rows].float() - ref[rows].float()).abs().max().item() / scale < 3e-2
