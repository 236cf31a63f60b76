"""Interleaved A/B: fa4 backend vs raw flash_attn_varlen_func (and raw with out= preallocated)."""
import torch, statistics
import cpattn
from cpattn.bench.common import time_cuda_back_to_back
from cpattn.bench.kernel import _flops, _fa4_raw_fn, SHAPES
from flash_attn.cute import interface as iface
for shape, seq, cp in [("d128", 65536, 4), ("d192", 65536, 8), ("d128", 16384, 1), ("d128", 16384, 2)]:
    hq, hkv, d, dv = SHAPES[shape]
    s = cpattn.get_strategy("zigzag", cp, pad_multiple=64)
    meta = s.build_metadata([seq], rank=0).to("cuda")
    q = torch.randn(meta.num_physical_tokens, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(seq, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(seq, hkv, dv, device="cuda", dtype=torch.bfloat16)
    fl = _flops(meta, hq, d, dv)
    out = torch.empty(q.shape[0], hq, dv, device="cuda", dtype=torch.bfloat16)
    raw = _fa4_raw_fn(q, k, v, meta, None)
    def raw_out():
        iface._flash_attn_fwd(q, k, v, cu_seqlens_q=meta.seg_cu_rows, seqused_k=meta.seg_keys_used,
                              max_seqlen_q=meta.max_seg_len, max_seqlen_k=meta.max_seg_keys_used,
                              cu_seqlens_k=meta.seg_key_start, causal=True, softmax_scale=d ** -0.5, out=out)
    V = [("backend", lambda: s.attention(q, k, v, meta, backend="fa4")), ("raw", raw), ("raw_out", raw_out),
         ("triton", lambda: s.attention(q, k, v, meta, backend="triton"))]
    iters = max(3, int(0.15 / (fl / 600e12)))
    res = {n: [] for n, _ in V}
    for rep in range(4):
        for n, f in (V if rep % 2 == 0 else V[::-1]):
            res[n].append(fl / time_cuda_back_to_back(f, 2, iters, 2) / 1e9)
    print(f"{shape} S={seq} C={cp}: " + "  ".join(f"{n}={statistics.median(x):.0f} [{min(x):.0f}-{max(x):.0f}]" for n, x in res.items()), flush=True)
