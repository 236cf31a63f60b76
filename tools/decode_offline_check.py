"""Compile the split-KV decode kernels (kernels/triton_decode.py) for sm_90 without a GPU and
report what ptxas makes of each variant (registers, spills, shared memory).

Run from the repository root with the triton that matches the GPU machine:
    PYTHONPATH=src /tmp/t36/bin/python tools/decode_offline_check.py
"""

from __future__ import annotations

import importlib.util
import os

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import cpattn.kernels.triton_decode as td
from cpattn.kernels.decode_backend import default_config, tile_geometry

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("sm90_offline_check", os.path.join(_here, "sm90_offline_check.py"))

#: (name, Hq, Hkv, D, Dv, q_len, C, I, paged, page, window, sinks, v_from_k, dtype[, FP8 K/V])
VARIANTS = [
    ("gqa-d128-q1-paged64", 32, 8, 128, 128, 1, 1, 1, True, 64, False, False, False, "bf16"),
    ("gqa-d128-q1-packed-c8", 32, 8, 128, 128, 1, 8, 1, False, 1, False, False, False, "bf16"),
    ("gqa-d128-q4-paged64-c4-win-sink", 32, 8, 128, 128, 4, 4, 1, True, 64, True, True, False, "bf16"),
    ("gqa-d128-q2-paged16-c2-i4", 32, 8, 128, 128, 2, 2, 4, True, 16, False, False, False, "fp16"),
    ("mha-d64-q1-paged32", 16, 16, 64, 64, 1, 2, 1, True, 32, False, False, False, "bf16"),
    ("d256-q1-paged64", 16, 4, 256, 256, 1, 1, 1, True, 64, False, False, False, "bf16"),
    ("mla-576-512-q1-paged64", 128, 1, 576, 512, 1, 1, 1, True, 64, False, False, True, "bf16"),
    ("mla-576-512-q4-paged64-c8", 128, 1, 576, 512, 4, 8, 1, True, 64, False, False, True, "bf16"),
    ("extend-gqa-d128-q64-paged64-c4", 32, 8, 128, 128, 64, 4, 1, True, 64, False, True, False, "bf16"),
    # FP8 (e4m3) caches, bf16 queries: K/V loaded as fp8e4nv, converted in registers (KV_FP8)
    ("fp8-gqa-d128-q1-paged64", 32, 8, 128, 128, 1, 1, 1, True, 64, False, False, False, "bf16", True),
    ("fp8-gqa-d128-q4-paged64-c4-win-sink", 32, 8, 128, 128, 4, 4, 1, True, 64, True, True, False, "bf16", True),
    ("fp8-mla-576-512-q1-paged64", 128, 1, 576, 512, 1, 1, 1, True, 64, False, False, True, "bf16", True),
]


def _split_sig(name, hq, hkv, d, dv, q_len, c, i, paged, page, window, sinks, v_from_k, dtype, kv_fp8=False):
    from cpattn.kernels.triton_attn import split_head_dim  # noqa: F401 (host helper only)

    fn = td._shard_attn_split
    rows, g_pack, block_m = tile_geometry(hq, hkv, d, q_len, False, kv_quantized=kv_fp8)
    block_n, warps, stages = default_config(d, dv, False, kv_quantized=kv_fp8)
    d1 = 1 << (d.bit_length() - 1)
    d2 = d - d1
    elem = f"*{dtype}"
    sig = {n: "i32" for n in fn.arg_names}
    sig.update(Q=elem, K=elem, V=elem, Out=elem, Lse="*fp32", Sinks="*fp32", WsO="*fp32", WsLse="*fp32",
               PageTable="*i32" if paged else "*i64", qk_scale="fp32", q_lens="*i64", seq_lens="*i64",
               cu_q_lens="*i64", cu_local_kv="*i64", KScale="*fp32", VScale="*fp32")
    for n in ("item_seq", "item_r0", "item_k0", "item_k1", "item_ws", "NumItems"):
        sig[n] = "*i32"
    consts = dict(HEAD_DIM_V=dv, BLOCK_D1=d1, BLOCK_D2=d2, ROWS=rows, G_PACK=g_pack, BLOCK_M=block_m, CP_SIZE=c,
                  INTERLEAVE=i, PAGED=paged, PAGE_SIZE=page, HAS_WINDOW=window, HAS_SINKS=sinks, V_FROM_K=v_from_k,
                  DOT_PRECISION="tf32", DOT_UPCAST=False, BLOCK_N=block_n, KV_FP8=kv_fp8, KV_TILE=False)
    if kv_fp8:
        sig.update(K="*fp8e4nv", V="*fp8e4nv")
    sig.update({n: "constexpr" for n in consts})
    return fn, sig, consts, dict(num_warps=warps, num_stages=stages), (rows, g_pack, block_m, block_n, warps, stages)


def _combine_sig(dv, sinks, dtype, blocks, one_pass):
    fn = td._shard_attn_combine
    sig = {n: "i32" for n in fn.arg_names}
    sig.update(Out=f"*{dtype}", Lse="*fp32", Sinks="*fp32", WsO="*fp32", WsLse="*fp32", row_ws0="*i32",
               row_nsplit="*i32", row_ti="*i32")
    block_s, block_h, block_dv = blocks
    consts = dict(HEAD_DIM_V=dv, BLOCK_H=block_h, BLOCK_S=block_s, BLOCK_DV=block_dv, HAS_SINKS=sinks,
                  ONE_PASS=one_pass)
    sig.update({n: "constexpr" for n in consts})
    return fn, sig, consts


def _merge_sig(dv, dtype, blocks, one_pass):
    fn = td._merge_parts
    sig = {n: "i32" for n in fn.arg_names}
    sig.update(Out=f"*{dtype}", Lse="*fp32", Parts=f"*{dtype}", PartLse="*fp32")
    block_s, block_h, block_dv = blocks
    consts = dict(HEAD_DIM_V=dv, BLOCK_H=block_h, BLOCK_S=block_s, BLOCK_DV=block_dv, ONE_PASS=one_pass)
    sig.update({n: "constexpr" for n in consts})
    return fn, sig, consts


#: (what, Dv, sinks, dtype, (parts, heads, rows)) of the combine / merge variants: the block sizes
#: are merge_blocks' choice for an H200 (132 SMs).
MERGE_VARIANTS = [
    ("combine B=1 L=128k gqa", 128, False, "bf16", (171, 32, 1)),
    ("combine B=64 gqa", 128, True, "bf16", (3, 32, 256)),
    ("combine B=1 mla", 512, True, "bf16", (200, 128, 1)),
    ("combine B=64 q4 mla", 512, False, "bf16", (2, 128, 256)),
    ("merge C=8 N=64 gqa", 128, False, "bf16", (8, 32, 64)),
    ("merge C=8 N=64 mla", 512, False, "bf16", (8, 128, 64)),
    ("merge C=4 N=1 fp32", 128, False, "fp32", (4, 32, 1)),
    ("merge C=8 N=256 fp16", 128, False, "fp16", (8, 32, 256)),
]


def _attrs(fn, sig) -> dict:
    """What the JIT specializes at a real launch: 16-byte aligned pointers and strides that are
    multiples of 16 (without these hints the pipeliner cannot use cp.async and nothing is
    multi-buffered)."""
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
            if t.startswith("*") or (n.startswith("stride_") and n not in ("stride_sink", "stride_lh"))}


def main() -> None:
    check = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(check)
    target = GPUTarget("cuda", 90, 32)
    for v in VARIANTS:
        fn, sig, consts, opts, geo = _split_sig(*v)
        k = triton.compile(ASTSource(fn, sig, consts, _attrs(fn, sig)), target=target, options=opts)
        rows, g_pack, block_m, block_n, warps, stages = geo
        ttgir = k.asm["ttgir"]
        print(f"split {v[0]}: ROWS={rows} G_PACK={g_pack} BLOCK_M={block_m} BLOCK_N={block_n} warps={warps} "
              f"stages={stages}: smem {k.metadata.shared} B, {ttgir.count('async_copy_global_to_local')} async "
              f"copies, {ttgir.count('warp_group_dot ')} wgmma; {check.ptxas_report(k.asm['ptx'])}", flush=True)
    for what, dv, sinks, dtype, (parts, heads, rows) in MERGE_VARIANTS:
        blocks = td.merge_blocks(parts, heads, dv, rows, 132)
        if what.startswith("combine"):
            fn, sig, consts = _combine_sig(dv, sinks, dtype, blocks, parts <= blocks[0])
            attrs = _attrs(fn, sig)
        else:  # strides of received views are not 16-divisible in general: pointers only
            fn, sig, consts = _merge_sig(dv, dtype, blocks, parts <= blocks[0])
            attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*")}
        k = triton.compile(ASTSource(fn, sig, consts, attrs), target=target, options=dict(num_warps=4))
        print(f"{what} Dv={dv} {dtype}: BLOCK_S/H/DV={blocks}{' one pass' if parts <= blocks[0] else ''}: smem {k.metadata.shared} B; "
              f"{check.ptxas_report(k.asm['ptx'])}", flush=True)


if __name__ == "__main__":
    main()
