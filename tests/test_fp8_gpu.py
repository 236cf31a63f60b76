"""FP8 (e4m3) K/V caches on the GPU: the Triton kernels that dequantize in registers (split-KV
decode over a sharded or replicated cache, the portable kernel for prefill-shaped batches) against
the fp64 oracle on the dequantized cache (small cases) and the torch reference on the same FP8
cache (large ones); quantization on the GPU equals the CPU's bit for bit; a CUDA graph of
``plan.attend`` replays with recalibrated scales (the scales are read from device memory)."""

from __future__ import annotations

import pytest
import torch

import cpattn
from cpattn.quant import dequantize_fp8, quantize_fp8
from graph_utils import capture_graph
from oracle import TOLERANCE, attention_oracle

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn
DEV = torch.device("cuda")
HQ, HKV, D, PAGE = 32, 8, 128, 64


def _cache(kv_lens, gen, per_head=True):
    """An FP8 paged cache holding every key of each sequence (shuffled pages, unused slots NaN),
    its scales and the dequantized keys/values packed per sequence (fp64, CPU)."""
    total = sum(kv_lens)
    keys = torch.randn(total, HKV, D, generator=gen) * 3
    vals = torch.randn(total, HKV, D, generator=gen)
    shape = (HKV,) if per_head else ()
    ks = (keys.abs().amax() / 448 * (0.5 + torch.rand(shape, generator=gen))).float()
    vs = (vals.abs().amax() / 448 * (0.5 + torch.rand(shape, generator=gen))).float()
    kq, vq = quantize_fp8(keys, ks), quantize_fp8(vals, vs)
    pages = [-(-n // PAGE) for n in kv_lens]
    num_pages = sum(pages) + 1
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(len(kv_lens), max(pages + [1]), dtype=torch.int32)
    kc = torch.full((num_pages, PAGE, HKV, D), float("nan")).to(FP8)
    vc = kc.clone()
    row = used = 0
    for b, n in enumerate(kv_lens):
        table[b, : pages[b]] = perm[used : used + pages[b]].int()
        used += pages[b]
        j = torch.arange(n)
        kc[table[b].long()[j // PAGE], j % PAGE] = kq[row : row + n]
        vc[table[b].long()[j // PAGE], j % PAGE] = vq[row : row + n]
        row += n
    deq = (dequantize_fp8(kq, ks, torch.float64), dequantize_fp8(vq, vs, torch.float64))
    return kc.to(DEV), vc.to(DEV), table.to(DEV), ks.to(DEV), vs.to(DEV), deq


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("q_len", [1, 4])
def test_gpu_split_kv_decode_over_fp8_equals_oracle(q_len, per_head):
    gen = torch.Generator().manual_seed(q_len * 10 + per_head)
    kv_lens = [1, 129, 4000, 700, 33, 2048 + 5, q_len, 999]
    kc, vc, table, ks, vs, (k64, v64) = _cache(kv_lens, gen, per_head)
    q_lens = [min(q_len, n) for n in kv_lens]
    meta = cpattn.get_strategy("replicated", 1).build_metadata(q_lens, [n - q for n, q in zip(kv_lens, q_lens)],
                                                               rank=0, kv=cpattn.KVSharding(1)).to(DEV)
    spec = cpattn.AttentionSpec(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=torch.bfloat16, kv_dtype=FP8,
                                page_size=PAGE)
    plan = cpattn.plan_attention(meta, spec, backend="triton")
    assert plan.family == "split-kv"
    q = torch.randn(sum(q_lens), HQ, D, generator=gen).bfloat16()
    out, lse = plan.attend(q.to(DEV), kc, vc, page_table=table, k_scale=ks, v_scale=vs)
    ref, ref_lse = attention_oracle(q, k64, v64, q_lens, [n - q for n, q in zip(kv_lens, q_lens)])
    tol = TOLERANCE[torch.bfloat16]
    assert (out.cpu().double() - ref).abs().max().item() < tol
    assert (lse.cpu().double() - ref_lse).abs().max().item() < tol


@pytest.mark.parametrize("shape", ["prefill", "decode"])
def test_gpu_dense_plans_over_fp8_equal_torch_reference(shape):
    """The portable kernel (prefill-shaped) and the decode family (decode-shaped) over a
    replicated FP8 cache equal the torch reference reading the same cache and scales."""
    gen = torch.Generator().manual_seed(3)
    if shape == "prefill":
        ext, pre = [300, 1, 77, 1024], [0, 5000, 64, 3000]
    else:
        ext, pre = [1, 1, 2, 1], [40000, 7, 9000, 130]
    kv_lens = [e + p for e, p in zip(ext, pre)]
    kc, vc, table, ks, vs, _ = _cache(kv_lens, gen)
    meta = cpattn.get_strategy("replicated", 1).build_metadata(ext, pre, rank=0).to(DEV)
    spec = cpattn.AttentionSpec(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=torch.bfloat16, kv_dtype=FP8,
                                page_size=PAGE)
    q = torch.randn(meta.num_physical_tokens, HQ, D, generator=gen).bfloat16().to(DEV)
    tri = cpattn.plan_attention(meta, spec, backend="triton")
    assert tri.family == ("portable" if shape == "prefill" else "decode")
    ref = cpattn.plan_attention(meta, spec, backend="torch")
    o1, l1 = tri.attend(q, kc, vc, page_table=table, k_scale=ks, v_scale=vs, return_lse=True)
    o2, l2 = ref.attend(q, kc, vc, page_table=table, k_scale=ks, v_scale=vs, return_lse=True)
    assert (o1.float() - o2.float()).abs().max().item() < TOLERANCE[torch.bfloat16]
    assert (l1 - l2).abs().max().item() < 1e-3


def test_gpu_quantization_equals_cpu_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, HKV, D, generator=gen) * 500  # many values past +-448 * scale
    x[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
    s = torch.rand(HKV, generator=gen) + 0.1
    cpu = quantize_fp8(x, s)
    gpu = quantize_fp8(x.to(DEV), s.to(DEV)).cpu()
    nan = cpu.float().isnan()
    assert torch.equal(nan, gpu.float().isnan()) and int(nan.sum()) == 3  # NaN bit patterns may differ
    assert torch.equal(cpu.view(torch.uint8)[~nan], gpu.view(torch.uint8)[~nan])


def test_gpu_fp8_graph_replays_with_recalibrated_scales():
    """plan.attend over an FP8 cache in a CUDA graph: changing the scale tensors' values between
    replays changes the result exactly as an eager call with those scales."""
    gen = torch.Generator().manual_seed(7)
    kv_lens = [5000, 70, 1200]
    kc, vc, table, ks, vs, _ = _cache(kv_lens, gen)
    meta = cpattn.get_strategy("replicated", 1).build_metadata([1] * 3, [n - 1 for n in kv_lens], rank=0,
                                                               kv=cpattn.KVSharding(1)).to(DEV)
    spec = cpattn.AttentionSpec(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=torch.bfloat16, kv_dtype=FP8,
                                page_size=PAGE)
    plan = cpattn.plan_attention(meta, spec, backend="triton")
    q = torch.randn(3, HQ, D, generator=gen).bfloat16().to(DEV)
    out = torch.empty(3, HQ, D, dtype=torch.bfloat16, device=DEV)
    lse = torch.empty(3, HQ, device=DEV)
    graph = capture_graph(lambda: plan.attend(q, kc, vc, page_table=table, k_scale=ks, v_scale=vs, out=out, lse=lse))
    for factor in (1.0, 0.5, 3.0):
        ks.mul_(factor)
        vs.mul_(factor)
        graph.replay()
        torch.cuda.synchronize()
        eager_o, eager_l = plan.attend(q, kc, vc, page_table=table, k_scale=ks.clone(), v_scale=vs.clone())
        assert torch.equal(out, eager_o) and torch.equal(lse, eager_l)


# ---------------------------------------------------------------------------------------- tile-scaled MLA latent
from cpattn.quant import FP8_TILE, dequantize_mla_fp8_tiles, quantize_mla_fp8_tiles  # noqa: E402

R, ROPE, MLA_HQ = 512, 64, 128  # DeepSeek-V3 absorbed MLA: 656-byte rows


def _tile_cache(kv_lens, gen):
    """A paged tile-scaled latent cache [pages, PAGE, 1, 656] on the GPU (shuffled pages, unused
    slots 0xFF: NaN values and scales), its page table and the fp64 dequantized latent [N, 1, 576]
    (CPU), from RMS-normed-like latent rows (tile magnitudes spread over 0.05..1)."""
    total = sum(kv_lens)
    kv_c = torch.randn(total, R, generator=gen)
    kv_c *= torch.exp(torch.empty(total, R // 128, 1).uniform_(-3.0, 0.0, generator=gen)).repeat_interleave(
        128, dim=1).view(total, R)
    rows = quantize_mla_fp8_tiles(kv_c.bfloat16(), torch.randn(total, ROPE, generator=gen).bfloat16())
    pages = [-(-n // PAGE) for n in kv_lens]
    num_pages = sum(pages) + 1
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(len(kv_lens), max(pages + [1]), dtype=torch.int32)
    cache = torch.full((num_pages, PAGE, 1, rows.shape[1]), 0xFF, dtype=torch.uint8)
    row = used = 0
    for b, n in enumerate(kv_lens):
        table[b, : pages[b]] = perm[used : used + pages[b]].int()
        used += pages[b]
        j = torch.arange(n)
        cache[table[b].long()[j // PAGE], j % PAGE, 0] = rows[row : row + n]
        row += n
    return cache.to(DEV), table.to(DEV), dequantize_mla_fp8_tiles(rows, R, torch.float64)[:, None, :]


def _tile_spec(**kw):
    return cpattn.AttentionSpec(num_q_heads=MLA_HQ, num_kv_heads=1, head_dim=R + ROPE, head_dim_v=R,
                                dtype=torch.bfloat16, kv_dtype=FP8, kv_layout=FP8_TILE, page_size=PAGE, **kw)


def test_gpu_tile_quantization_equals_cpu_bit_for_bit():
    gen = torch.Generator().manual_seed(1)
    kv_c = torch.randn(4096, R, generator=gen) * torch.rand(4096, 1, generator=gen) * 50
    k_pe = torch.randn(4096, ROPE, generator=gen)
    kv_c[1, :128] = 0.0
    kv_c[2, 200] = float("nan")
    for dtype in (torch.float32, torch.bfloat16):
        cpu = quantize_mla_fp8_tiles(kv_c.to(dtype), k_pe.to(dtype))
        gpu = quantize_mla_fp8_tiles(kv_c.to(dtype).to(DEV), k_pe.to(dtype).to(DEV)).cpu()
        ok = torch.ones(4096, dtype=torch.bool)
        ok[2] = False  # NaN bit patterns may differ
        assert torch.equal(cpu[ok], gpu[ok])
        assert dequantize_mla_fp8_tiles(gpu[2:3])[0, 128:256].isnan().all()
        assert torch.equal(dequantize_mla_fp8_tiles(gpu.to(DEV)).cpu()[ok], dequantize_mla_fp8_tiles(cpu)[ok])


@pytest.mark.parametrize("q_len", [1, 2])
def test_gpu_split_kv_mla_decode_over_tile_cache_equals_oracle(q_len):
    """Absorbed MLA decode (128 heads, 576 / 512) over the 656-byte tile cache at B = 8, L = 4096
    (plus ragged lengths): the split-KV kernel vs the fp64 oracle on the dequantized latent."""
    gen = torch.Generator().manual_seed(q_len)
    for kv_lens in ([4096] * 8, [1, 129, 4096, 700, 33, 2053, q_len, 999]):
        cache, table, deq = _tile_cache(kv_lens, gen)
        q_lens = [min(q_len, n) for n in kv_lens]
        pre = [n - q for n, q in zip(kv_lens, q_lens)]
        meta = cpattn.get_strategy("replicated", 1).build_metadata(q_lens, pre, rank=0,
                                                                   kv=cpattn.KVSharding(1)).to(DEV)
        plan = cpattn.plan_attention(meta, _tile_spec(), backend="triton")
        assert plan.family == "split-kv"
        q = (torch.randn(sum(q_lens), MLA_HQ, R + ROPE, generator=gen) * 0.5).bfloat16()
        out, lse = plan.attend(q.to(DEV), cache, cache, page_table=table, softmax_scale=192**-0.5)
        ref, ref_lse = attention_oracle(q, deq, deq[..., :R], q_lens, pre, scale=192**-0.5)
        tol = TOLERANCE[torch.bfloat16]
        assert (out.cpu().double() - ref).abs().max().item() < tol
        assert (lse.cpu().double() - ref_lse).abs().max().item() < tol


def _tile_batch(kind, gen):
    """(ext, pre, cache, page table) of a prefill-shaped or decode-shaped batch over a tile cache."""
    if kind == "prefill":
        ext, pre = [300, 1, 77], [0, 3000, 64]
    else:
        ext, pre = [1, 1, 2, 1], [9000, 7, 4000, 130]
    cache, table, _ = _tile_cache([e + p for e, p in zip(ext, pre)], gen)
    return ext, pre, cache, table


def _selection_256(ext, pre, gen):
    """idx [T, 256] int32 on the GPU: up to 256 distinct visible positions per row, -1 padded."""
    rows = [(torch.randperm(p + i + 1, generator=gen)[:256].tolist() + [-1] * 256)[:256]
            for e, p in zip(ext, pre) for i in range(e)]
    return torch.tensor(rows, dtype=torch.int32).to(DEV)


@pytest.mark.parametrize("kind", ["prefill", "decode", "sparse"])
def test_gpu_tile_cache_kernels_equal_torch_reference(kind):
    """The portable kernel (prefill-shaped), the decode family (decode-shaped dense plan) and the
    portable sparse kernel (DSA) over a tile cache equal the torch reference on the same cache."""
    gen = torch.Generator().manual_seed(5)
    ext, pre, cache, table = _tile_batch(kind, gen)
    meta = cpattn.get_strategy("replicated", 1).build_metadata(ext, pre, rank=0).to(DEV)
    spec = _tile_spec(topk=256) if kind == "sparse" else _tile_spec()
    q = (torch.randn(meta.num_physical_tokens, MLA_HQ, R + ROPE, generator=gen) * 0.5).bfloat16().to(DEV)
    args = (q, cache, cache)
    if kind == "sparse":
        args += (_selection_256(ext, pre, gen),)
    tri = cpattn.plan_attention(meta, spec, backend="triton")
    assert tri.family == {"prefill": "portable", "decode": "decode", "sparse": "portable"}[kind]
    ref = cpattn.plan_attention(meta, spec, backend="torch")
    o1, l1 = tri.attend(*args, page_table=table, return_lse=True)
    o2, l2 = ref.attend(*args, page_table=table, return_lse=True)
    assert (o1.float() - o2.float()).abs().max().item() < TOLERANCE[torch.bfloat16]
    assert (l1 - l2).abs().max().item() < 1e-3


def test_gpu_write_mla_cache_tile_layout_equals_cpu():
    gen = torch.Generator().manual_seed(9)
    kv_c = torch.randn(300, R, generator=gen).bfloat16()
    k_pe = torch.randn(300, ROPE, generator=gen).bfloat16()
    slots = torch.randperm(64 * 8, generator=gen)[:300]
    cpu = torch.zeros(8, 64, 656, dtype=torch.uint8)
    cpattn.write_mla_cache(kv_c, k_pe, cpu, slots, layout=FP8_TILE)
    gpu = torch.zeros(8, 64, 656, dtype=torch.uint8, device=DEV)
    cpattn.write_mla_cache(kv_c.to(DEV), k_pe.to(DEV), gpu, slots.to(DEV), layout=FP8_TILE)
    assert torch.equal(gpu.cpu(), cpu)


def test_gpu_tile_decode_graph_replays_new_cache_rows():
    """plan.attend over a tile cache in a CUDA graph: rows rewritten between replays (new values
    and new tile scales, written by write_mla_cache) give exactly the eager result."""
    gen = torch.Generator().manual_seed(11)
    kv_lens = [4096, 70, 1200]
    cache, table, _ = _tile_cache(kv_lens, gen)
    meta = cpattn.get_strategy("replicated", 1).build_metadata([1] * 3, [n - 1 for n in kv_lens], rank=0,
                                                               kv=cpattn.KVSharding(1)).to(DEV)
    plan = cpattn.plan_attention(meta, _tile_spec(), backend="triton")
    q = (torch.randn(3, MLA_HQ, R + ROPE, generator=gen) * 0.5).bfloat16().to(DEV)
    out = torch.empty(3, MLA_HQ, R, dtype=torch.bfloat16, device=DEV)
    lse = torch.empty(3, MLA_HQ, device=DEV)
    graph = capture_graph(lambda: plan.attend(q, cache, cache, page_table=table, out=out, lse=lse))
    flat = cache.view(-1, cache.shape[-1])
    for step in range(3):
        slots = (table[0, :4].long()[:, None] * PAGE + torch.arange(PAGE, device=DEV)).view(-1)
        cpattn.write_mla_cache(torch.randn(slots.numel(), R, device=DEV) * (step + 1),
                               torch.randn(slots.numel(), ROPE, device=DEV), flat, slots, layout=FP8_TILE)
        graph.replay()
        torch.cuda.synchronize()
        eager_o, eager_l = plan.attend(q, cache, cache, page_table=table)
        assert torch.equal(out, eager_o) and torch.equal(lse, eager_l)


@pytest.mark.parametrize("kind", ["prefill", "decode", "sparse", "shard_merge"])
def test_gpu_tile_plan_run_equals_torch_reference(kind):
    """plan.run over a tile cache on the GPU (Triton kernels, 128 heads, 576 / 512): the cache
    equals write_mla_cache(layout=) of the same rows on the CPU bit for bit, the output equals the
    torch reference plan's run from the same cache."""
    gen = torch.Generator().manual_seed(13)
    ext, pre, cache, table = _tile_batch(kind, gen)
    kv = cpattn.KVSharding(1) if kind == "shard_merge" else None
    meta_cpu = cpattn.get_strategy("replicated", 1).build_metadata(ext, pre, rank=0, kv=kv)
    meta = meta_cpu.to(DEV)
    spec = _tile_spec(topk=256) if kind == "sparse" else _tile_spec()
    n = meta.num_physical_tokens
    q = (torch.randn(n, MLA_HQ, R + ROPE, generator=gen) * 0.5).bfloat16().to(DEV)
    k = torch.randn(n, 1, R + ROPE, generator=gen).bfloat16().to(DEV)
    writes = cpattn.plan_cache_writes(meta, table, page_size=PAGE, num_pages=cache.shape[0])
    kw = dict(writes=writes, page_table=table, softmax_scale=192**-0.5)
    if kind == "sparse":
        kw["idx"] = _selection_256(ext, pre, gen)
    want = cache.cpu()
    writes_cpu = cpattn.plan_cache_writes(meta_cpu, table.cpu(), page_size=PAGE, num_pages=cache.shape[0])
    cpattn.write_mla_cache(k[:, 0, :R].cpu(), k[:, 0, R:].cpu(), want[..., 0, :], writes_cpu, layout=FP8_TILE)
    outs = []
    for backend in ("triton", "torch"):
        c = cache.clone()
        plan = cpattn.plan_attention(meta, spec, backend=backend)
        outs.append(plan.run(q, k, k[..., :R], (c, c), **kw))
        assert torch.equal(c.cpu(), want), backend
    assert (outs[0].float() - outs[1].float()).abs().max().item() < TOLERANCE[torch.bfloat16]
