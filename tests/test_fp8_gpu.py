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
