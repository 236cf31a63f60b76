"""Compile the sm_90 Gluon kernel for H100/H200 without a GPU and report what ptxas makes of it.

For kernel work on a machine with no GPU: each variant is compiled for sm_90a with the installed
triton (>= 3.5; Gluon), then ptxas reports registers and spills; ``--sass DIR`` also writes the
SASS of each variant (via the cuobjdump bundled with triton) for reading instruction order.

Set-up (CPU only; the triton wheel carries ptxas and cuobjdump; the kernels build with triton
3.5 through 3.9, 3.6 being the GPU machine's):
    python -m venv /tmp/t36 && /tmp/t36/bin/pip install torch==2.13.0 triton==3.6.0 numpy
Run from the repository root:
    PYTHONPATH=src /tmp/t36/bin/python tools/sm90_offline_check.py [--sass /tmp/sass] [--wait-order]
ptxas's "Used N registers" is the launch count (168); ``setmaxnreg`` then gives the consumer
warpgroups 240 and the loader 24, and the spill figures cover the whole kernel. ptxas is the one
triton itself runs for sm_90 (:func:`ptxas_path`; ``--ptxas PATH`` another, e.g. to assemble
triton 3.6's PTX with triton 3.9's CUDA 13 ptxas and tell the two apart).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

import cpattn.kernels.triton_mla as mla
import cpattn.kernels.triton_sm90 as ws

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def ptxas_path() -> str:
    """The ptxas triton runs for sm_90: the bundled ``ptxas`` up to triton 3.6 (CUDA 12.8); triton
    3.9 emits PTX 9.4 for sm_90, which its bundled ``ptxas`` (CUDA 12.9, PTX <= 8.8) rejects, and
    assembles it with its CUDA 13 ``ptxas-blackwell``."""
    from triton.backends.nvidia import compiler

    try:
        return compiler.get_ptxas(90).path
    except TypeError:  # triton 3.5: get_ptxas() takes no architecture
        return compiler.get_ptxas().path


#: ptxas used by :func:`ptxas_report` (None: :func:`ptxas_path`).
PTXAS = None

#: (D, Dv, G_PACK, stages, overlap, pingpong, window, sinks, lse, page_size): the dense variants
#: compiled by default (page_size None: packed K/V).
VARIANTS = [
    (128, 128, 4, 3, 0, False, False, False, True, None),
    (128, 128, 4, 3, 0, False, True, True, False, None),
    (128, 128, 4, 3, 2, True, False, False, True, None),
    (64, 64, 1, 3, 0, False, False, False, True, None),
    (192, 128, 1, 2, 0, False, False, False, True, None),
    (192, 128, 4, 2, 1, True, True, True, False, None),
    (128, 128, 4, 3, 0, False, False, False, True, 16),
    (128, 128, 4, 3, 0, False, True, True, True, 8),
    (128, 128, 4, 3, 0, False, False, False, True, 64),
    (128, 128, 4, 3, 0, False, False, False, True, 256),
    (128, 128, 4, 3, 2, True, False, False, True, 64),
    (64, 64, 1, 3, 0, False, False, False, True, 16),
    (192, 128, 1, 2, 0, False, False, False, True, 16),
    (192, 128, 4, 2, 0, False, True, True, False, 256),
    (128, 128, 4, 3, 0, False, False, False, True, 1),
    (128, 128, 4, 3, 0, False, True, True, True, 4),
    (64, 64, 1, 3, 0, False, False, False, True, 1),
    (192, 128, 1, 2, 0, False, False, False, True, 2),
    (128, 128, 4, 3, 2, True, False, False, True, 1),
    (128, 128, 4, 3, 2, False, False, False, True, None),
    (192, 128, 1, 2, 2, False, False, False, True, None),
    (128, 128, 4, 3, 2, False, True, True, True, 16),
]
#: Dense variants compiled persistent (one program per SM walking the work items).
PERSISTENT_VARIANTS = [
    (128, 128, 4, 3, 0, False, False, False, True, None),
    (128, 128, 4, 3, 0, False, True, True, False, 16),
    (192, 128, 1, 2, 0, False, False, False, True, None),
    (64, 64, 1, 3, 0, False, False, False, True, 1),
    (128, 128, 4, 3, 2, False, False, False, True, None),
    (128, 128, 4, 3, 2, False, True, True, False, 16),
]
#: (variant, block_n): variants compiled with a key block other than 128.
BLOCK_N_VARIANTS = [
    ((192, 128, 1, 4, 0, False, False, False, True, None), 64),
    ((192, 128, 4, 4, 0, False, True, True, True, 16), 64),
    ((128, 128, 4, 4, 0, False, False, False, True, None), 64),
]


#: Arguments the launcher specializes as 16-divisible in practice (pointers, head-dim strides, the
#: split-KV workspace's pointers and strides: without them the decode kernels' fp32 partials
#: compile to 4-byte stores here where the GPU build has 8-byte ones).
_DIV16 = ("Q", "K", "V", "Out", "Lse", "Sinks", "PageTable", "stride_qm", "stride_qh", "stride_om", "stride_oh",
          "stride_kp", "stride_kn", "stride_kh", "stride_vp", "stride_vn", "stride_vh", "Idx", "stride_im", "topk",
          "row_seq", "row_pos", "row_kv_start", "WsO", "WsLse", "PairLse", "stride_wi", "stride_wr", "stride_wh",
          "stride_li", "stride_lr")


def _attrs(fn) -> dict:
    """``tt.divisibility`` 16 on :data:`_DIV16`, as Triton's launcher marks such arguments."""
    return {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in _DIV16}


def _ptr_sig(fn, elem: str, descs: dict) -> dict:
    """Signature of a kernel: i32 scalars by default, the given pointer / descriptor types."""
    sig = {name: "i32" for name in fn.arg_names}
    types = dict(Q=elem, K=elem, V=elem, Out=elem, Sinks=elem, Lse="*fp32", qk_scale="fp32", cu_kv_lens="*i32",
                 PageTable="*i32", **{k: mangle_type(v) for k, v in descs.items()})
    sig.update({k: v for k, v in types.items() if k in sig})
    for name in ("tile_segment", "tile_row_offset", "NumTiles", "seg_seq", "seg_row0", "seg_len", "seg_pos0",
                 "seg_stride"):
        if name in sig:
            sig[name] = "*i32"
    return sig


def _compile(fn, sig: dict, consts: dict):
    """``fn`` compiled for sm_90a with its constexprs (4 warps per partition, 168 registers)."""
    sig.update({name: "constexpr" for name in consts})
    return triton.compile(GluonASTSource(fn, sig, consts, _attrs(fn)), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=168))


def _elem(dtype) -> str:
    return "*bf16" if dtype == torch.bfloat16 else "*fp16"


def _latent_sig(fn, dtype, page_size) -> dict:
    """Signature of an absorbed-MLA kernel reading the latent through its two TMA descriptors."""
    width = mla.D_LATENT + mla.D_ROPE
    k = torch.empty(4096, 1, width, dtype=dtype) if page_size is None else \
        torch.empty(4096 // page_size, page_size, 1, width, dtype=dtype)
    k_desc, kr_desc = mla.k_descriptors(k)
    return _ptr_sig(fn, _elem(dtype), dict(k_desc=k_desc, kr_desc=kr_desc))


def _kv(d, dv, dtype, page_size, hkv=8, rows=4096):
    if page_size is None:
        return torch.empty(rows, hkv, d, dtype=dtype), torch.empty(rows, hkv, dv, dtype=dtype)
    return (torch.empty(rows // page_size, page_size, hkv, d, dtype=dtype),
            torch.empty(rows // page_size, page_size, hkv, dv, dtype=dtype))


def compile_variant(d, dv, g_pack, stages, overlap, pingpong, window, sinks, lse, page_size=None,
                    dtype=torch.bfloat16, block_n=128, persistent=False):
    """The compiled dense kernel (``.asm["ptx"]``, ``.metadata.shared``) of one variant, for sm_90a."""
    fn = ws._cp_attn_fwd_sm90
    k, v = _kv(d, dv, dtype, page_size)
    elem = _elem(dtype)
    if page_size is not None and not ws.paged_tma_ok(k, v, block_n):  # the cp.async gather loader
        sig = _ptr_sig(fn, elem, {})
        sig.update(k_desc=elem, k2_desc=elem, v_desc=elem)
    else:
        k_desc, k2_desc, v_desc = ws.kv_descriptors(k, v, block_n)
        sig = _ptr_sig(fn, elem, dict(k_desc=k_desc, k2_desc=k2_desc, v_desc=v_desc))
    consts = dict(G_PACK=g_pack, HAS_WINDOW=window, HAS_SINKS=sinks, RETURN_LSE=lse,
                  **ws.kernel_constexprs(d, dv, dtype, page_size, block_n, stages, overlap, pingpong,
                                         persistent=persistent))
    return _compile(fn, sig, consts)


#: (G_PACK, window, sinks, lse, page_size): the absorbed-MLA variants compiled by default.
MLA_VARIANTS = [
    (4, False, False, True, None),
    (4, False, False, False, None),
    (4, True, True, True, None),
    (4, False, False, True, 64),
    (4, False, False, True, 16),
    (2, True, True, False, 8),
]


def compile_mla_variant(g_pack, window, sinks, lse, page_size=None, dtype=torch.bfloat16):
    """The compiled absorbed-MLA kernel of one variant, for sm_90a."""
    fn = mla._mla_fwd_sm90
    sig = _latent_sig(fn, dtype, page_size)
    consts = dict(G_PACK=g_pack, HAS_WINDOW=window, HAS_SINKS=sinks, RETURN_LSE=lse,
                  **mla.kernel_constexprs(dtype, page_size))
    return _compile(fn, sig, consts)


#: (G_PACK, sinks, page_size, cp_size, interleave, pair): the absorbed-MLA split-KV decode
#: variants (pair: two-split tiles merged in the kernel, no combine).
MLA_DECODE_VARIANTS = [
    (64, False, None, 1, 1, False),
    (64, True, None, 8, 1, False),
    (16, False, 64, 2, 16, False),
    (64, False, 16, 4, 1, False),
    (16, False, None, 1, 1, True),
    (16, True, 64, 2, 1, True),
]


def compile_mla_decode_variant(g_pack, sinks, page_size, cp_size, interleave, pair=False, dtype=torch.bfloat16):
    """The compiled absorbed-MLA split-KV decode kernel of one variant, for sm_90a."""
    fn = mla._mla_decode_sm90
    sig = _latent_sig(fn, dtype, page_size)
    sig.update(WsO="*fp32", WsLse="*fp32", PairSem="*i32", PairLse="*fp32")
    for name in ("item_seq", "item_r0", "item_k0", "item_k1", "item_ws", "NumItems", "q_lens", "seq_lens",
                 "cu_q_lens", "cu_local_kv"):
        sig[name] = "*i32"
    consts = dict(G_PACK=g_pack, HAS_SINKS=sinks, CP_SIZE=cp_size, INTERLEAVE=interleave, PAIR=pair,
                  **mla.kernel_constexprs(dtype, page_size))
    return _compile(fn, sig, consts)


#: (G_PACK, sinks, lse, page_size, idx dtype): the absorbed-MLA sparse (DSA) variants.
MLA_SPARSE_VARIANTS = [
    (64, False, False, None, "i32"),
    (64, False, True, None, "i32"),
    (64, True, True, None, "i64"),
    (64, False, True, 64, "i32"),
    (64, True, False, 1, "i32"),
    (16, False, True, 16, "i64"),
]


def compile_mla_sparse_variant(g_pack, sinks, lse, page_size, idx_type, dtype=torch.bfloat16):
    """The compiled absorbed-MLA sparse (DSA) kernel of one variant, for sm_90a."""
    fn = mla._mla_sparse_sm90
    sig = _ptr_sig(fn, _elem(dtype), {})
    sig.update(Idx=f"*{idx_type}", Sinks="*fp32", row_seq="*i32", row_pos="*i32", row_kv_start="*i64")
    consts = dict(G_PACK=g_pack, HAS_SINKS=sinks, RETURN_LSE=lse, **mla.sparse_constexprs(dtype, page_size))
    return _compile(fn, sig, consts)


def ptxas_report(ptx: str, sass_path: str | None = None) -> str:
    """ptxas's register / spill lines for ``ptx`` (sm_90a); optionally writes the SASS."""
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([PTXAS or ptxas_path(), "-arch=sm_90a", "-v", src, "-o", cubin],
                           capture_output=True, text=True, check=True)
        if sass_path:
            sass = subprocess.run([os.path.join(_BIN, "cuobjdump"), "-sass", cubin], capture_output=True,
                                  text=True, check=True).stdout
            with open(sass_path, "w") as f:
                f.write(sass)
    keep = ("spill", "registers", "Performance", "warning")
    return "; ".join(line.split(":", 1)[-1].strip() for line in (r.stdout + r.stderr).splitlines()
                     if any(k in line for k in keep))


def wait_order(sass: str) -> str:
    """The order of the consumers' softmax ``EX2`` runs and wgmma waits in ``sass`` (``W1`` / ``W0``:
    ``WARPGROUP.DEPBAR.LE gsb0`` 1 / 0, ``N``: the sleeping never-taken loop that ends a basic block,
    runs of one kind counted): with ``overlap=2`` the loop reads ``W1 Ex66 Nx2 W0`` when softmax_j's
    EX2s run under ``P_{j-1} V_{j-1}`` and ``W1 W0 Ex66`` when ptxas hoisted the second wait."""
    from sass_loops import runs  # tools/, this script's folder

    kinds = [("E" if "MUFU.EX2" in line else "W0" if "DEPBAR.LE gsb0, 0x0" in line
              else "W1" if "DEPBAR.LE gsb0, 0x1" in line else "N" if "NANOSLEEP" in line else None)
             for line in sass.splitlines()]
    return runs([k for k in kinds if k is not None])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sass", default=None, help="folder to write each variant's SASS into")
    p.add_argument("--only", default=None, help="compile only variants whose name contains this")
    p.add_argument("--wait-order", action="store_true", help="also print each variant's EX2 / wgmma-wait order")
    p.add_argument("--ptxas", default=None, help="assemble with this ptxas instead of triton's own for sm_90")
    args = p.parse_args()
    global PTXAS
    PTXAS = args.ptxas
    print(f"triton {triton.__version__}, ptxas {PTXAS or ptxas_path()}", flush=True)
    if args.sass:
        os.makedirs(args.sass, exist_ok=True)
    jobs = []
    for v in VARIANTS:
        d, dv, g_pack, stages, overlap, pingpong, window, sinks, lse, page = v
        name = f"d{d}-{dv}_g{g_pack}_st{stages}_ov{overlap}{'pp' if pingpong else ''}" \
               f"{'_win' if window else ''}{'_sink' if sinks else ''}{'' if lse else '_nolse'}" \
               f"{f'_page{page}' if page else ''}"
        jobs.append((name, compile_variant, v))
    for v, block_n in BLOCK_N_VARIANTS:
        d, dv, g_pack, stages, overlap, pingpong, window, sinks, lse, page = v
        name = f"d{d}-{dv}_g{g_pack}_bn{block_n}_st{stages}{'_win' if window else ''}{'_sink' if sinks else ''}" \
               f"{f'_page{page}' if page else ''}"
        jobs.append((name, lambda *a, bn=block_n: compile_variant(*a, block_n=bn), v))
    for v in PERSISTENT_VARIANTS:
        d, dv, g_pack, stages, overlap, pingpong, window, sinks, lse, page = v
        name = f"d{d}-{dv}_g{g_pack}_st{stages}_persistent{f'_ov{overlap}' if overlap else ''}" \
               f"{'_win' if window else ''}{'_sink' if sinks else ''}" \
               f"{f'_page{page}' if page else ''}"
        jobs.append((name, lambda *a: compile_variant(*a, persistent=True), v))
    for v in MLA_VARIANTS:
        g_pack, window, sinks, lse, page = v
        name = f"mla576-512_g{g_pack}{'_win' if window else ''}{'_sink' if sinks else ''}" \
               f"{'' if lse else '_nolse'}{f'_page{page}' if page else ''}"
        jobs.append((name, compile_mla_variant, v))
    for v in MLA_DECODE_VARIANTS:
        g_pack, sinks, page, cp, inter, pair = v
        name = f"mla576-512-decode_g{g_pack}{'_sink' if sinks else ''}{f'_page{page}' if page else ''}_cp{cp}i{inter}" \
               f"{'_pair' if pair else ''}"
        jobs.append((name, compile_mla_decode_variant, v))
    for v in MLA_SPARSE_VARIANTS:
        g_pack, sinks, lse, page, idx_type = v
        name = f"mla576-512-sparse_g{g_pack}{'_sink' if sinks else ''}{'' if lse else '_nolse'}" \
               f"{f'_page{page}' if page else ''}_idx{idx_type}"
        jobs.append((name, compile_mla_sparse_variant, v))
    for name, compile_fn, v in jobs:
        if args.only and args.only not in name:
            continue
        k = compile_fn(*v)
        ptx = k.asm["ptx"]
        with tempfile.TemporaryDirectory() as tmp:
            sass = os.path.join(args.sass or tmp, name + ".sass") if args.sass or args.wait_order else None
            print(f"{name}: smem {k.metadata.shared} B, {ptx.count('wgmma.mma_async')} wgmma in PTX; "
                  f"{ptxas_report(ptx, sass)}", flush=True)
            if args.wait_order:
                print(f"  waits: {wait_order(open(sass).read())}", flush=True)

if __name__ == "__main__":
    main()
