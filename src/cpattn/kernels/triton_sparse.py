"""Triton sparse (DSA) attention: each query row attends only the keys its row of ``idx`` selects.

A program handles one query row and ``BLOCK_H`` query heads that share one KV head, packed into
the M dimension of the dots: in the absorbed MLA form (one KV head, D = 576, Dv = 512, 128 heads)
``BLOCK_H = 64``, so every gathered latent row serves 64 heads per load (two programs per row,
adjacent in the grid so the second one reads the rows from L2). It walks the row's ``topk``
entries in blocks of ``BLOCK_N``: loads the positions, keeps those ``>= 0`` and ``<=`` the row's
position (the causal rule; -1 padding, future and out-of-sequence entries drop out), gathers the
selected K rows (packed: ``row_kv_start + position``; paged: through the page table), computes
``q @ K^T`` as two dots when D = D1 + D2 (576 = 512 + 64), runs an online softmax in base 2 with
fp32 accumulation and adds ``P @ V``. When ``v`` is a view of ``k[..., :Dv]`` with Dv = D1 (the
absorbed latent) the V operand is the K tile already loaded (``V_IS_K``): each selected latent row
is read once per head group. Per-head and GQA forms (transformers' expanded K/V) use the same
kernel with ``BLOCK_H`` covering a KV head's group (at least 16 rows, unused heads masked).

Rows are physical rows: a pad row (position -1) sees no key and writes 0 / lse -inf; the grid is
P x head blocks, so a static plan's capacity-sized grid replays in a CUDA graph. Masked entries
are never loaded (no 0 * NaN). FP8 caches (``KV_FP8``: e4m3 K/V with float32 scales per tensor
or per KV head): each gathered K/V tile is converted to the query dtype in registers (exact), the
K scale of the program's KV head multiplies the softmax scale and the V scale the output; with
``KV_FP8`` False the branches compile away. Tile-scaled FP8 MLA latent rows (``KV_TILE``: uint8
K = V, one float32 scale per 128 latent values, bf16 rope): the e4m3 values convert exactly and
the tile scales apply in fp32 outside the dots (:mod:`._fp8_tiles`). This module holds the kernel
and :func:`launch`; the backend (:mod:`.dsa_backend`) plans it.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._attn_steps import add_values, kv_head, load_query, normalized, row_lse, softmax_rescale
from ._fp8_tiles import tile_block_scores
from ._launch import COMPILE_OPTIONS
from ._tiles import LOG2E, SM90_SMEM_PER_BLOCK, kv_strides

#: True when the kernels were built for the CPU interpreter (TRITON_INTERPRET=1 at import).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# ----------------------------------------------------------------------------- helpers (host)
def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def split_dim(d: int) -> tuple[int, int]:
    """Blocks (D1, D2) covering head dim ``d``: D1 the largest power of two <= d (>= 16), D2 0 or
    the next power of two (>= 16) of the rest (576 -> 512 + 64, 192 -> 128 + 64, 24 -> 16 + 16)."""
    if d <= 16:
        return 16, 0
    d1 = 1 << (d.bit_length() - 1)
    rest = d - d1
    return d1, (0 if rest == 0 else max(16, _next_pow2(rest)))


def block_heads(group_size: int) -> int:
    """Query heads of one KV head per program (the M dimension): 64 for large groups (absorbed
    MLA), the group rounded up to a power of two >= 16 otherwise."""
    return min(64, max(16, _next_pow2(group_size)))


def dot_settings(dtype: torch.dtype) -> dict:
    """DOT_PRECISION / DOT_UPCAST: fp32 is exact ("ieee"); the interpreter's bf16 dot is wrong,
    so there bf16 operands are upcast (bf16 x bf16 products are exact in fp32)."""
    upcast = INTERPRETED and dtype == torch.bfloat16
    return dict(DOT_PRECISION="ieee" if dtype == torch.float32 or upcast else "tf32", DOT_UPCAST=upcast)


def _configs() -> list:
    return [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bn in (64, 32) for w in (8, 4) for s in (2, 3)]


def _autotune_enabled() -> bool:
    return os.environ.get("CPATTN_TRITON_AUTOTUNE", "1") != "0"


def _prune_configs(configs, named_args, **kwargs):
    """Keep configs whose K/V stages and q fit in shared memory and whose accumulator fits in
    registers (BLOCK_H x Dv fp32 over the warps' threads <= 128 per thread). Without autotuning
    (``CPATTN_TRITON_AUTOTUNE=0``) the first one kept: (32, 8 warps, 2 stages) for the absorbed
    576 / 512 form (fewest spills on sm_90, tools/dsa_offline_check.py)."""
    arg = lambda name: named_args.get(name, kwargs.get(name))  # noqa: E731
    d1, d2, dv, bh = arg("BLOCK_D1"), arg("BLOCK_D2"), arg("BLOCK_DV"), arg("BLOCK_H")
    v_is_k = arg("V_IS_K")
    if bh * dv > 8192:  # large accumulators: smaller key blocks first (fewer spills)
        configs = sorted(configs, key=lambda c: (c.kwargs["BLOCK_N"], -c.num_warps, c.num_stages))
    kept = []
    for c in configs:
        bn, stages, warps = c.kwargs["BLOCK_N"], c.num_stages, c.num_warps
        tile = bn * (d1 + d2 + (0 if v_is_k else dv)) * 2
        if stages * tile + bh * (d1 + d2) * 2 > SM90_SMEM_PER_BLOCK:
            continue
        if bh * dv // (32 * warps) > 128:
            continue
        kept.append(c)
    kept = kept or [min(configs, key=lambda c: (c.kwargs["BLOCK_N"], c.num_stages, -c.num_warps))]
    return kept if _autotune_enabled() else kept[:1]


# ----------------------------------------------------------------------------- kernel
@triton.jit
def _sparse_attn_fwd(
    Q, K, V, Idx, Out, Lse, Sinks, PageTable, KScale, VScale,
    row_seq, row_pos, row_kv_start,
    qk_scale, topk, num_head_blocks, head_blocks_per_kv, group_size,
    stride_qm, stride_qh, stride_im, stride_sink,
    stride_kp, stride_kn, stride_kh,
    stride_vp, stride_vn, stride_vh,
    stride_om, stride_oh, stride_lm, stride_lh, stride_pt, stride_ks, stride_vs,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_H: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, V_IS_K: tl.constexpr,
    HAS_SINKS: tl.constexpr, RETURN_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, OFFSET_32: tl.constexpr,
    BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr, KV_TILE: tl.constexpr = False,
):
    pid = tl.program_id(0)
    row = pid // num_head_blocks  # head blocks of a row are adjacent: the second reads from L2
    hb = pid - row * num_head_blocks
    kvh = hb // head_blocks_per_kv
    h_local = (hb - kvh * head_blocks_per_kv) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_valid = h_local < group_size
    head = kvh * group_size + h_local
    row64 = row.to(tl.int64)

    pos = tl.load(row_pos + row)
    seq = tl.load(row_seq + row)
    kv_start = tl.load(row_kv_start + row)

    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_d2 = tl.arange(0, BLOCK_D2 if BLOCK_D2 > 0 else 16)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    d1_ok = offs_d1 < HEAD_DIM
    d2_ok = (BLOCK_D1 + offs_d2) < HEAD_DIM
    dv_ok = offs_dv < HEAD_DIM_V

    q_row = Q + row64 * stride_qm + head[:, None].to(tl.int64) * stride_qh
    q1, q2 = load_query(q_row, h_valid, d1_ok, d2_ok, offs_d1, offs_d2, BLOCK_D1, BLOCK_D2, DOT_UPCAST, True)

    k_base, v_base, qk_scale = kv_head(K, V, KScale, kvh, stride_kh, stride_vh, stride_ks, qk_scale, KV_FP8)
    pt_row = PageTable + seq.to(tl.int64) * stride_pt
    idx_row = Idx + row64 * stride_im

    if HAS_SINKS:
        m_i = tl.load(Sinks + head * stride_sink, mask=h_valid, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)

    n_hi = tl.where(pos >= 0, topk, 0)  # pad rows see nothing
    for start in range(0, n_hi, BLOCK_N):
        offs = start + offs_n
        e = tl.load(idx_row + offs, mask=offs < topk, other=-1)
        if not OFFSET_32:
            e = e.to(tl.int64)
        else:
            e = e.to(tl.int32)
        valid = (e >= 0) & (e <= pos)  # the causal rule: -1, future and out-of-sequence entries drop out
        p_sel = tl.where(valid, e, 0)
        if PAGED:
            page = tl.load(pt_row + p_sel // PAGE_SIZE, mask=valid, other=0).to(e.dtype)
            slot = p_sel % PAGE_SIZE
            k_off = page * stride_kp + slot * stride_kn
            v_off = page * stride_vp + slot * stride_vn
        else:
            k_off = (kv_start.to(e.dtype) + p_sel) * stride_kn
            v_off = (kv_start.to(e.dtype) + p_sel) * stride_vn
        if KV_TILE:  # tile-scaled latent rows: tile scales applied in fp32 outside the dots; V is the latent
            s, k1, tsc = tile_block_scores(q1, q2, k_base, k_off, valid, offs_d1, offs_d2, True, BLOCK_H, BLOCK_N,
                                           BLOCK_D1, DOT_PRECISION)
        else:
            tsc = None
            k1 = tl.load(k_base + k_off[:, None] + offs_d1[None, :], mask=valid[:, None] & d1_ok[None, :],
                         other=0.0)
            if DOT_UPCAST:
                k1 = k1.to(tl.float32)
            if KV_FP8:  # e4m3 -> q's dtype in registers (exact)
                k1 = k1.to(q1.dtype)
            s = tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)
            if BLOCK_D2 > 0:
                k2 = tl.load(k_base + BLOCK_D1 + k_off[:, None] + offs_d2[None, :],
                             mask=valid[:, None] & d2_ok[None, :], other=0.0)
                if DOT_UPCAST:
                    k2 = k2.to(tl.float32)
                if KV_FP8:
                    k2 = k2.to(q2.dtype)
                s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PRECISION)
        acc, l_i, m_i, p = softmax_rescale(acc, l_i, m_i, s, valid[None, :], qk_scale, True)
        if KV_TILE or V_IS_K:
            v = k1
        else:
            v = tl.load(v_base + v_off[:, None] + offs_dv[None, :], mask=valid[:, None] & dv_ok[None, :],
                        other=0.0)
            if DOT_UPCAST:
                v = v.to(tl.float32)
            if KV_FP8:
                v = v.to(q1.dtype)
        acc = add_values(acc, p, v, tsc, DOT_PRECISION, DOT_UPCAST, KV_TILE)

    # l_i == 0: no valid key and no sink (0 / -inf); NaN from q, a selected k / v or a sink stays NaN
    out, has_mass = normalized(acc, l_i, VScale, kvh, stride_vs, KV_FP8)
    o_ptrs = Out + row64 * stride_om + head[:, None].to(tl.int64) * stride_oh + offs_dv[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=h_valid[:, None] & dv_ok[None, :])
    if RETURN_LSE:
        lse = row_lse(m_i, l_i, has_mass)
        lse = tl.where(pos < 0, float("-inf"), lse)  # pad rows
        tl.store(Lse + row64 * stride_lm + head * stride_lh, lse, mask=h_valid)


_sparse_attn_fwd_tuned = triton.autotune(
    configs=_configs(),
    key=["topk", "HEAD_DIM", "HEAD_DIM_V", "BLOCK_H", "PAGED", "PAGE_SIZE", "V_IS_K", "KV_FP8", "KV_TILE"],
    prune_configs_by={"early_config_prune": _prune_configs},
)(_sparse_attn_fwd)


def tuned_configs() -> dict:
    """The autotuner's choice per key so far (for benchmarks and notes)."""
    return {str(key): str(cfg) for key, cfg in getattr(_sparse_attn_fwd_tuned, "cache", {}).items()}


# ----------------------------------------------------------------------------- host launcher
def v_is_k(k: Tensor, v: Tensor, dv: int, block_d1: int) -> bool:
    """``v`` is the view ``k[..., :Dv]`` (same storage, base and strides) with Dv = D1, so the
    kernel can use the K tile it loaded as the V operand."""
    return (dv == block_d1 and v.data_ptr() == k.data_ptr() and v.stride() == k.stride()
            and v.shape[:-1] == k.shape[:-1])


def _max_offset(x: Tensor) -> int:
    """Largest element offset of ``x`` from its base (int32 offsets when it fits)."""
    return sum((n - 1) * st for n, st in zip(x.shape, x.stride()) if n > 0) + 1


def launch(
    q: Tensor, k: Tensor, v: Tensor, idx: Tensor, out: Tensor, lse: Optional[Tensor], sinks: Optional[Tensor],
    page_table: Optional[Tensor], *, grid: tuple[int], plan_args: dict, softmax_scale: float,
    config: Optional[tuple[int, int, int]] = None, k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None,
) -> None:
    """Launch the sparse kernel. ``plan_args``: the planned keyword arguments (row table, head
    blocking, geometry constexprs, ``KV_FP8``; see ``dsa_backend``). ``config`` = (BLOCK_N,
    num_warps, num_stages) bypasses the autotuner. ``k_scale`` / ``v_scale``: float32 ``[]`` or
    ``[Hkv]`` scales of FP8 K/V."""
    paged = page_table is not None
    skp, skn, skh, svp, svn, svh = kv_strides(k, v, paged)
    pt, stride_pt = (page_table, page_table.stride(0)) if paged else (plan_args["row_seq"], 0)
    args = dict(
        Q=q, K=k, V=v, Idx=idx, Out=out, Lse=lse if lse is not None else out,
        Sinks=sinks if sinks is not None else out, PageTable=pt, qk_scale=float(softmax_scale) * LOG2E,
        KScale=k_scale if k_scale is not None else pt, VScale=v_scale if v_scale is not None else pt,
        stride_ks=k_scale.stride(0) if k_scale is not None and k_scale.dim() == 1 else 0,
        stride_vs=v_scale.stride(0) if v_scale is not None and v_scale.dim() == 1 else 0,
        topk=idx.shape[1], stride_qm=q.stride(0), stride_qh=q.stride(1), stride_im=idx.stride(0),
        stride_sink=sinks.stride(0) if sinks is not None else 0,
        stride_kp=skp, stride_kn=skn, stride_kh=skh, stride_vp=svp, stride_vn=svn, stride_vh=svh,
        stride_om=out.stride(0), stride_oh=out.stride(1),
        stride_lm=lse.stride(0) if lse is not None else 0, stride_lh=lse.stride(1) if lse is not None else 0,
        stride_pt=stride_pt, HAS_SINKS=sinks is not None, RETURN_LSE=lse is not None,
        V_IS_K=v_is_k(k, v, plan_args["HEAD_DIM_V"], plan_args["BLOCK_D1"]),
        OFFSET_32=_max_offset(k) < 2**31 and _max_offset(v) < 2**31, **plan_args,
    )
    if INTERPRETED or config is not None:
        bn, warps, stages = config if config is not None else (16, 4, 1)
        _sparse_attn_fwd[grid](**args, BLOCK_N=bn, num_warps=warps, num_stages=stages, **COMPILE_OPTIONS)
    else:
        _sparse_attn_fwd_tuned[grid](**args, **COMPILE_OPTIONS)
