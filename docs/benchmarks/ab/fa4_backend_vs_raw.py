"""Interleaved A/B: fa4 backend vs raw flash_attn_varlen_func (and raw with out= preallocated)."""
import statistics

import torch
from flash_attn.cute import interface as iface

from ab_common import interleaved_tflops, rank0_workload
from cpattn.bench.kernel import _fa4_raw_fn


def _nothing():
    pass


for shape, seq, cp in [("d128", 65536, 4), ("d192", 65536, 8), ("d128", 16384, 1), ("d128", 16384, 2)]:
    s, meta, q, k, v, fl = rank0_workload(shape, seq, cp)
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], device="cuda", dtype=torch.bfloat16)

    def raw_out():
        iface._flash_attn_fwd(q, k, v, cu_seqlens_q=meta.seg_cu_rows, seqused_k=meta.seg_keys_used,
                              max_seqlen_q=meta.max_seg_len, max_seqlen_k=meta.max_seg_keys_used,
                              cu_seqlens_k=meta.seg_key_start, causal=True, softmax_scale=q.shape[-1] ** -0.5,
                              out=out)

    variants = [("backend", _nothing, lambda: s.attention(q, k, v, meta, backend="fa4")),
                ("raw", _nothing, _fa4_raw_fn(q, k, v, meta, None)), ("raw_out", _nothing, raw_out),
                ("triton", _nothing, lambda: s.attention(q, k, v, meta, backend="triton"))]
    res = interleaved_tflops(variants, fl, 0.15, repeats=4)
    print(f"{shape} S={seq} C={cp}: " + "  ".join(
        f"{n}={statistics.median(x):.0f} [{min(x):.0f}-{max(x):.0f}]" for n, x in res.items()), flush=True)
