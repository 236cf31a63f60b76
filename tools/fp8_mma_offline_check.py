"""Compile the portable dense kernel (kernels/triton_attn.py) for sm_90 without a GPU: its FP8
tensor-core variants (``FP8_MMA``, ``AttentionSpec(mma_dtype=torch.float8_e4m3fn)``) and, for
comparison, the bf16 and FP8-dequantize variants of the same shapes.

For each variant: the wgmma instruction kinds in the PTX (``wgmma.mma_async...`` with shape and
operand types: the FP8 variants should show ``e4m3.e4m3`` for both dots), and ptxas's registers
and spills. ``--hash`` prints a digest of the PTX with its debug lines (``.loc`` / ``.file`` /
the DWARF sections) removed, so the code of a variant can be compared across two checkouts:

    PYTHONPATH=src /work/venv/bin/python tools/fp8_mma_offline_check.py --hash
    (cd <other checkout> && PYTHONPATH=src python <this file> --hash --only bf16,dequant)

The block sizes are the portable kernel's defaults without autotuning (``_heuristic``), the
same for the FP8 variants: unmeasured for FP8 until a GPU run (``--config BN,WARPS,STAGES``
compiles others).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import cpattn.kernels.triton_attn as ta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sm90_offline_check import ptxas_report  # noqa: E402 (tools/, this script's folder)

#: (name, D, Dv, page size (None: packed), mode): mode "bf16" (bf16 K/V), "dequant" (FP8 K/V
#: dequantized in registers) or "fp8" (FP8 tensor-core dots).
VARIANTS = [
    ("bf16-d128-packed", 128, 128, None, "bf16"),
    ("bf16-d128-paged64", 128, 128, 64, "bf16"),
    ("dequant-d128-packed", 128, 128, None, "dequant"),
    ("dequant-d128-paged64", 128, 128, 64, "dequant"),
    ("fp8-d64-packed", 64, 64, None, "fp8"),
    ("fp8-d64-paged64", 64, 64, 64, "fp8"),
    ("fp8-d128-packed", 128, 128, None, "fp8"),
    ("fp8-d128-paged64", 128, 128, 64, "fp8"),
    ("fp8-d192-dv128-packed", 192, 128, None, "fp8"),
    ("fp8-d192-dv128-paged64", 192, 128, 64, "fp8"),
]

#: Arguments Triton's launcher marks 16-divisible at a real launch (pointers, row strides).
_DIV16 = ("Q", "K", "V", "Out", "Lse", "PageTable", "KScale", "VScale", "tile_segment", "tile_row_offset",
          "NumTiles", "seg_seq", "seg_row0", "seg_len", "seg_pos0", "seg_stride", "cu_kv_lens", "stride_qm",
          "stride_qh", "stride_kp", "stride_kn", "stride_kh", "stride_vp", "stride_vn", "stride_vh", "stride_om",
          "stride_oh", "stride_pt")


def compile_variant(d: int, dv: int, page, mode: str, config=None, hq: int = 32, hkv: int = 8):
    """The portable kernel of one variant compiled for sm_90a: (compiled, (BLOCK_N, warps, stages))."""
    fn = ta._cp_attn_fwd
    block_m = ta.default_block_m(d, dv)
    g_pack = min(hq // hkv, block_m)
    d1, d2 = ta.split_head_dim(d)
    bn, warps, stages = config or (ta._heuristic(d, dv, block_m, True) if mode == "fp8" else ta._heuristic(d, dv, block_m))
    kv = "*fp8e4nv" if mode != "bf16" else "*bf16"
    sig = {name: "i32" for name in fn.arg_names}
    sig.update(Q="*bf16", K=kv, V=kv, Out="*bf16", Lse="*fp32", Sinks="*fp32", PageTable="*i32",
               KScale="*fp32", VScale="*fp32", qk_scale="fp32", cu_kv_lens="*i32")
    for name in ("tile_segment", "tile_row_offset", "NumTiles", "seg_seq", "seg_row0", "seg_len", "seg_pos0",
                 "seg_stride"):
        sig[name] = "*i32"
    consts = dict(HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_D1=d1, BLOCK_D2=d2, BLOCK_M=block_m, G_PACK=g_pack,
                  PAGED=page is not None, PAGE_SIZE=page or 1, HAS_WINDOW=False, HAS_SINKS=False, RETURN_LSE=True,
                  DOT_PRECISION="tf32", DOT_UPCAST=False, USE_TMA=False, BLOCK_N=bn, KV_FP8=mode != "bf16",
                  KV_TILE=False)
    if "FP8_MMA" in fn.arg_names:  # (a checkout from before the option has no such argument)
        consts["FP8_MMA"] = 1 if mode == "fp8" else 0
    sig.update({name: "constexpr" for name in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in _DIV16}
    compiled = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages))
    return compiled, (bn, warps, stages)


def wgmma_kinds(ptx: str) -> dict:
    """``{instruction: count}`` of the wgmma.mma_async instructions in ``ptx``."""
    out: dict = {}
    for m in re.finditer(r"wgmma\.mma_async\.[\w.]+", ptx):
        out[m.group(0)] = out.get(m.group(0), 0) + 1
    return out


def code_digest(ptx: str) -> str:
    """sha256 (16 hex digits) of ``ptx`` without its debug lines and sections."""
    keep = []
    skip = False
    for line in ptx.splitlines():
        s = line.strip()
        if s.startswith(".section") and "debug" in s:
            skip = True
        if skip:
            if s == "}":
                skip = False
            continue
        if s.startswith((".loc", ".file", "$L__", "//")):
            continue
        keep.append(line)
    return hashlib.sha256("\n".join(keep).encode()).hexdigest()[:16]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hash", action="store_true", help="print the PTX code digest of each variant")
    p.add_argument("--only", default="", help="comma-separated name prefixes (bf16, dequant, fp8, fp8-d128 ...)")
    p.add_argument("--config", default="", help="BLOCK_N,num_warps,num_stages for every variant")
    args = p.parse_args()
    config = tuple(int(x) for x in args.config.split(",")) if args.config else None
    prefixes = [x for x in args.only.split(",") if x]
    for name, d, dv, page, mode in VARIANTS:
        if prefixes and not any(name.startswith(x) for x in prefixes):
            continue
        compiled, (bn, warps, stages) = compile_variant(d, dv, page, mode, config)
        ptx = compiled.asm["ptx"]
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(wgmma_kinds(ptx).items())) or "no wgmma"
        digest = f" ptx {code_digest(ptx)};" if args.hash else ""
        print(f"{name}: BLOCK_N={bn} warps={warps} stages={stages} smem {compiled.metadata.shared} B;{digest} "
              f"{kinds}; {ptxas_report(ptx)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
