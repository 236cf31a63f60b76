"""Compile the DSA Triton kernels (sparse attention, index scores) for sm_90 without a GPU and
report what ptxas makes of them (registers, spills, shared memory).

For kernel work on a machine with no GPU, with the triton that matches the GPU machine:
    PYTHONPATH=src /tmp/t36/bin/python tools/dsa_offline_check.py [--all]
(``--all`` first compiles every constexpr combination the backends launch; see tools/sm90_offline_check.py for the set-up). Each variant is one autotuner config of the
real-size shapes: absorbed MLA (128 heads, D 576 / Dv 512, v = k[..., :512]), the per-head
D 192 / 128 form, and the DeepSeek-V3.2 indexer (64 heads x 128, bf16 and fp8 keys).
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import cpattn.kernels.triton_index as ti
import cpattn.kernels.triton_sparse as ts


def ptxas_path() -> str:
    """The ptxas triton runs for sm_90 (as tools/sm90_offline_check.py: triton 3.9 assembles its
    PTX 9.4 with the CUDA 13 ``ptxas-blackwell``, up to 3.6 the bundled ``ptxas``)."""
    from triton.backends.nvidia import compiler

    try:
        return compiler.get_ptxas(90).path
    except TypeError:  # triton 3.5: get_ptxas() takes no architecture
        return compiler.get_ptxas().path


def _signature(fn, pointers: dict, floats=(), consts: dict = ()) -> dict:
    sig = {name: "i32" for name in fn.arg_names}
    sig.update(pointers)
    sig.update({name: "fp32" for name in floats})
    sig.update({name: "constexpr" for name in consts})
    return sig


def compile_sparse(d, dv, block_h, v_is_k, block_n, warps, stages, paged=False, lse=True, off32=True, sinks=False,
                   dtype="bf16"):
    fn = ts._sparse_attn_fwd
    d1, d2 = ts.split_dim(d)
    consts = dict(HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_D1=d1, BLOCK_D2=d2, BLOCK_DV=max(16, ts._next_pow2(dv)),
                  BLOCK_H=block_h, PAGED=paged,
                  PAGE_SIZE=64 if paged else 1, V_IS_K=v_is_k, HAS_SINKS=sinks, RETURN_LSE=lse,
                  DOT_PRECISION="tf32", DOT_UPCAST=False, OFFSET_32=off32, BLOCK_N=block_n, KV_FP8=False, KV_TILE=False)
    e = "*" + dtype
    ptrs = dict(Q=e, K=e, V=e, Idx="*i32", Out=e, Lse="*fp32", Sinks="*fp32",
                PageTable="*i32", row_seq="*i32", row_pos="*i32", row_kv_start="*i64", KScale="*fp32",
                VScale="*fp32")
    sig = _signature(fn, ptrs, ("qk_scale",), consts)
    return triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def compile_index(h, d, block_m, block_n, warps, stages, k_fp8=False, q_fp8=False, head_stages=3, paged=None,
                  k_desc=True):
    fn = ti._index_scores_fwd
    q_t = "*fp8e4nv" if q_fp8 else "*bf16"
    k_t = "*fp8e4nv" if k_fp8 else "*bf16"
    consts = dict(NUM_HEADS=h, HEAD_DIM=d, BLOCK_D=d, BLOCK_M=block_m, KEYS_PER_PROGRAM=1024, PAGED=paged is not None,
                  PAGE_SIZE=paged or 1, HAS_KSCALE=k_fp8, K_DESC_OK=k_desc, DOT_PRECISION="tf32", DOT_UPCAST=False,
                  K_TO_Q=k_fp8 and not q_fp8, BLOCK_N=block_n, HEAD_STAGES=head_stages)
    ptrs = dict(Q=q_t, K=k_t, W="*fp32", KScale="*fp32", Scores="*i64", PageTable="*i32", tile_row0="*i32",
                tile_len="*i32", tile_pos0="*i32", tile_stride="*i32", tile_seq="*i32", tile_kv_start="*i64",
                entry_tile="*i32", entry_piece="*i32", piece_row0="*i32", piece_plo="*i32", piece_width="*i32",
                piece_base="*i64")
    sig = _signature(fn, ptrs, ("softmax_scale",), consts)
    return triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def compile_write_selection(block=512):
    fn = ti._write_selection
    sig = _signature(fn, dict(Keys="*i64", Out="*i32"), (), dict(BLOCK=block))
    return triton.compile(ASTSource(fn, sig, dict(BLOCK=block)), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, num_stages=1))


def ptxas_report(ptx: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([ptxas_path(), "-arch=sm_90a", "-v", src, "-o", cubin],
                           capture_output=True, text=True, check=True)
    keep = ("spill", "registers")
    return "; ".join(line.split(":", 1)[-1].strip() for line in (r.stdout + r.stderr).splitlines()
                     if any(k in line for k in keep))


SPARSE = [  # (D, Dv, BLOCK_H, V_IS_K, BLOCK_N, warps, stages)
    (576, 512, 64, True, 64, 8, 2),
    (576, 512, 64, True, 32, 8, 3),
    (576, 512, 64, True, 32, 8, 2),
    (576, 512, 64, True, 16, 8, 3),
    (192, 128, 16, False, 64, 4, 2),
    (192, 128, 16, False, 64, 8, 3),
]
INDEX = [  # (H, D, BLOCK_M, BLOCK_N, warps, stages, k_fp8, q_fp8); the first: the no-autotune default
    (64, 128, 64, 128, 4, 3, False, False),
    (64, 128, 64, 256, 8, 3, False, False),
    (64, 128, 64, 128, 8, 2, False, False),
    (64, 128, 128, 128, 8, 3, False, False),
    (64, 128, 64, 128, 4, 3, True, False),
    (64, 128, 64, 256, 8, 3, True, True),
]


def compile_matrix() -> int:
    """Every constexpr combination the backend can launch on sm_90 compiles (no report)."""
    count = 0
    for d, dv, bh, vk in ((576, 512, 64, True), (576, 512, 64, False), (192, 128, 16, False), (128, 128, 16, False),
                          (24, 16, 16, False)):
        for paged in (False, True):
            for sinks, lse in ((False, True), (True, False)):
                for dtype in ("bf16", "fp16"):
                    compile_sparse(d, dv, bh, vk, 32, 8, 2, paged=paged, lse=lse, sinks=sinks, dtype=dtype)
                    count += 1
    for k8, q8 in ((False, False), (True, False), (True, True)):
        for paged, k_desc in ((None, True), (None, False), (64, True), (16, False)):
            compile_index(64, 128, 64, 128, 8, 2, k_fp8=k8, q_fp8=q8, paged=paged, k_desc=k_desc)
            count += 1
    compile_write_selection()
    return count + 1


def main() -> None:
    import sys

    if "--all" in sys.argv:
        print(f"compiled {compile_matrix()} variants for sm_90", flush=True)
    for v in SPARSE:
        d, dv, bh, vk, bn, w, st = v
        k = compile_sparse(*v)
        ptx = k.asm["ptx"]
        print(f"sparse d{d}-{dv} h{bh} {'v=k ' if vk else ''}bn{bn} w{w} st{st}: smem {k.metadata.shared} B, "
              f"{ptx.count('wgmma.mma_async')} wgmma; {ptxas_report(ptx)}", flush=True)
    for v in INDEX:
        h, d, bm, bn, w, st, k8, q8 = v
        k = compile_index(*v)
        ptx = k.asm["ptx"]
        print(f"index h{h} d{d} bm{bm} bn{bn} w{w} st{st} {'q8' if q8 else 'q16'}{'k8' if k8 else 'k16'}: "
              f"smem {k.metadata.shared} B, {ptx.count('wgmma.mma_async')} wgmma; {ptxas_report(ptx)}", flush=True)


if __name__ == "__main__":
    main()
