"""One Triton forward kernel for the local queries of every CP strategy.

A program handles one query tile of one segment (``meta.tiles[rows]``, heaviest tiles first) for
``G_PACK`` query heads that share a KV head: the tile's M dimension packs ``rows x G_PACK``
(row-major, heads fastest), so each K/V block is loaded once for the whole head group. Query row
``row0 + i`` of a segment has position ``pos0 + i * stride`` of sequence ``seg_seq``; it attends
keys of that sequence at positions ``<= pos`` (and ``>= pos - window``). Key blocks are visited in
three ranges: masked blocks at the window's edge, unmasked interior blocks (no mask arithmetic)
and masked blocks at the causal diagonal; fully masked blocks are never loaded.

K/V are either packed (key ``p`` of sequence ``b`` at row ``cu_kv_lens[b] + p``) or paged
(page ``page_table[b, p // PAGE_SIZE]``, slot ``p % PAGE_SIZE``); any row strides work (last dim
contiguous). Softmax runs in base 2 with fp32 accumulation; LSE is converted to natural log.
FP8 caches (``KV_FP8``: e4m3 K/V, float32 scales per tensor or per KV head read from device
memory): every K/V block is converted to the query dtype in registers after its load (exact), the
K scale of the program's KV head multiplies the softmax scale and the V scale the output; pointer
loads only (no TMA). With ``KV_FP8`` False the branches compile away. Tile-scaled FP8 MLA latent
rows (``KV_TILE``: uint8 K = V, one float32 scale per 128 latent values, bf16 rope): the e4m3
values convert exactly and the tile scales apply in fp32 outside the dots (:mod:`._fp8_tiles`);
V is the latent block. FP8 tensor-core attention (``FP8_MMA``, an FP8 cache): the query rows are
quantized to e4m3 per (token, head) after their load (:func:`._attn_steps.quantize_query_rows`),
both dots take e4m3 operands (K and V straight from the cache), the per-row scale multiplies the
fp32 scores, P goes to the P V dot as ``fp8(256 p)`` and the output is divided by 256; the row
sum adds the fp32 p. With ``FP8_MMA`` 0 those branches compile away.

The launch geometry (tile map, GQA packing, L2 sections) is planned by the backend
(:mod:`.triton_backend`); this module holds the kernel and :func:`launch`, which only passes
arguments. The tile count is read from device memory and programs past it exit, so a grid sized
for a static plan's capacity replays in a CUDA graph for any batch within it. Pad rows are tiles
of the pad segment (position -1): the kernel writes them as 0 / lse -inf.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._attn_steps import (P_SCALE, add_values, head_group_tile, normalized, quantize_query_rows, row_lse, row_offsets,
                          softmax_rescale)
from ._fp8_tiles import tile_block_scores
from ._launch import PlannedLaunch
from ._tiles import LOG2E, SM90_SMEM_PER_BLOCK, kv_strides

logger = logging.getLogger("cpattn")

#: True when this module's kernels were built for the CPU interpreter (TRITON_INTERPRET=1 at
#: import): Triton decides at decoration time, so one process runs one kind.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")



# ----------------------------------------------------------------------------- helpers (host)
def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def split_head_dim(d: int) -> Optional[tuple[int, int]]:
    """``d = d1 + d2`` with ``d1`` a power of two >= 16 and ``d2`` 0 or a smaller power of two
    >= 16 (e.g. 192 = 128 + 64, 576 = 512 + 64); None when ``d`` has no such split."""
    if d < 16:
        return None
    d1 = 1 << (d.bit_length() - 1)
    d2 = d - d1
    if d2 == 0 or (d2 >= 16 and _is_pow2(d2)):
        return d1, d2
    return None


def shape_unsupported_reason(d: int, dv: int, dtype: torch.dtype) -> Optional[str]:
    """Why the kernel cannot run these head dims / dtype (None if it can)."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {dtype} not supported (bf16, fp16, fp32)"
    if split_head_dim(d) is None or d > 576:
        return f"head dim D={d} not supported (a power of two >= 16, or a sum of two such, <= 576)"
    if not _is_pow2(dv) or not 16 <= dv <= 512:
        return f"value head dim Dv={dv} not supported (a power of two in [16, 512])"
    return None


def default_block_m(d: int, dv: int) -> int:
    """Query rows x packed heads per program (the tile map follows from it)."""
    if INTERPRETED:
        return 32
    if max(d, dv) > 256:
        return 64
    return 128


def _autotune_enabled() -> bool:
    return os.environ.get("CPATTN_TRITON_AUTOTUNE", "1") != "0"


# ----------------------------------------------------------------------------- autotune configs
def _configs() -> list:
    out = []
    for bn in (64, 128, 32):
        for warps in (8, 4):
            for stages in (3, 2, 4):
                out.append(triton.Config({"BLOCK_N": bn}, num_warps=warps, num_stages=stages))
    return out


def _heuristic(d: int, dv: int, block_m: int, fp8_mma: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) used without autotuning (measured defaults on H200; the
    FP8-MMA ones are unmeasured: the bf16 choices, except D <= 64 on 8 warps, where 4 spill 304
    bytes offline (tools/fp8_mma_offline_check.py) and 8 spill none)."""
    width = max(d, dv)
    if fp8_mma and width <= 64:
        return 128, 8, 3
    if width <= 64:
        return 128, 4, 3
    if width <= 128:
        return 128, 8, 3 if block_m >= 128 else 2
    if width <= 192 or (d <= 192 and dv <= 128):
        return 64, 8, 3
    if width <= 256:
        return 64, 8, 2
    return 32, 8, 2


def _prune_configs(configs, named_args, **kwargs):
    """Keep configs whose K/V stages fit in shared memory; one heuristic config when autotuning
    is off (``CPATTN_TRITON_AUTOTUNE=0``)."""
    d = named_args.get("HEAD_DIM", kwargs.get("HEAD_DIM"))
    dv = named_args.get("HEAD_DIM_V", kwargs.get("HEAD_DIM_V"))
    block_m = named_args.get("BLOCK_M", kwargs.get("BLOCK_M"))
    elt = 2
    kept = []
    for c in configs:
        bn, stages = c.kwargs["BLOCK_N"], c.num_stages
        smem = stages * bn * (d + dv) * elt + block_m * d * elt
        if smem > SM90_SMEM_PER_BLOCK:
            continue
        if max(d, dv) > 128 and (bn > 64 or c.num_warps < 8):
            continue
        if max(d, dv) <= 128 and bn < 64:
            continue
        kept.append(c)
    want = _heuristic(d, dv, block_m, bool(named_args.get("FP8_MMA", kwargs.get("FP8_MMA", 0))))
    if not _autotune_enabled() or not kept:
        for c in configs:
            if (c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) == want:
                return [c]
    return kept


def _bench_config(fn, quantiles=None):
    """Autotuner timing: short warm-up and repeat (ms), median."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


def tuned_configs() -> dict:
    """The autotuner's choice per key so far (for benchmarks and notes)."""
    return {key: str(cfg) for key, cfg in getattr(_cp_attn_fwd_tuned, "cache", {}).items()}


def _tma_ok(*tensors: Tensor) -> bool:
    """TMA descriptors need 16-byte aligned bases and row strides (per head: base + head stride)."""
    for x in tensors:
        elt = x.element_size()
        if x.data_ptr() % 16 or any((st * elt) % 16 for st in x.stride()[:-1]) or x.shape[-1] * elt < 16:
            return False
    return True


# ----------------------------------------------------------------------------- kernel
@triton.jit
def _kv_block_offsets(
    start, kv_row_base, pt_row, key_end, stride_kp, stride_kn, stride_vp, stride_vn, offs_n,
    MASKED: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Row offsets (elements) of key block [start, start + BLOCK_N) in K and V, and its
    in-sequence mask: packed rows ``kv_row_base + p`` or paged ``page_table[p // PAGE_SIZE]``."""
    kpos = start + offs_n
    in_seq = kpos < key_end
    if PAGED:
        if PAGE_SIZE % BLOCK_N == 0:  # the whole block sits in one page: one table read
            page = tl.load(pt_row + start // PAGE_SIZE).to(tl.int64)
            slot = (start % PAGE_SIZE + offs_n).to(tl.int64)
        else:
            if MASKED:
                page = tl.load(pt_row + kpos // PAGE_SIZE, mask=in_seq, other=0).to(tl.int64)
            else:
                page = tl.load(pt_row + kpos // PAGE_SIZE).to(tl.int64)
            slot = (kpos % PAGE_SIZE).to(tl.int64)
    else:
        page = 0
        slot = (kv_row_base + kpos).to(tl.int64)
    k_off, v_off = row_offsets(page, slot, stride_kp, stride_kn, stride_vp, stride_vn, PAGED)
    return k_off, v_off, in_seq


@triton.jit
def _load_rows(base, off, in_seq, offs_d, desc, desc_row, MASKED: tl.constexpr, USE_DESC: tl.constexpr,
               DOT_UPCAST: tl.constexpr):
    """A [BLOCK_N, width] block of K or V: through the TMA descriptor (row ``desc_row``) or
    pointers ``base + off[:, None] + offs_d`` (masked rows read 0)."""
    if USE_DESC:
        x = desc.load([desc_row, 0])
    elif MASKED:
        x = tl.load(base + off[:, None] + offs_d[None, :], mask=in_seq[:, None], other=0.0)
    else:
        x = tl.load(base + off[:, None] + offs_d[None, :])
    if DOT_UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _block_scores(
    q1, q2, k_base, k_off, in_seq, k_desc1, k_desc2, desc_row, offs_d1, offs_d2,
    MASKED: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr, USE_DESC: tl.constexpr, KV_FP8: tl.constexpr = False,
):
    """Unscaled scores ``q @ K_block.T`` [BLOCK_M, BLOCK_N] (fp32); a split head dim
    (``BLOCK_D2 > 0``) accumulates two dots. KV_FP8: e4m3 blocks converted to q's dtype."""
    k1 = _load_rows(k_base, k_off, in_seq, offs_d1, k_desc1, desc_row, MASKED, USE_DESC, DOT_UPCAST)
    if KV_FP8:
        k1 = k1.to(q1.dtype)
    s = tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)
    if BLOCK_D2 > 0:
        k2 = _load_rows(k_base + BLOCK_D1, k_off, in_seq, offs_d2, k_desc2, desc_row, MASKED, USE_DESC,
                        DOT_UPCAST)
        if KV_FP8:
            k2 = k2.to(q2.dtype)
        s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PRECISION)
    return s


@triton.jit
def _softmax_update(
    acc, l_i, m_i, s, v, start, pos, window, qk_scale, offs_n,
    MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    tile_scale=None, KV_TILE: tl.constexpr = False, FP8_MMA: tl.constexpr = 0,
):
    """One online-softmax step (base 2): fold scores ``s`` of a key block and its values ``v``
    into (acc, l_i, m_i). MASKED applies the causal / window mask by position. KV_TILE: ``v``
    holds e4m3 latent values whose ``tile_scale`` [BLOCK_N, Dv / 128] applies in fp32. FP8_MMA:
    ``qk_scale`` is per row [BLOCK_M] (the query rows' quantization scales folded in)."""
    if MASKED:
        kpos = start + offs_n
        visible = kpos[None, :] <= pos[:, None]
        if HAS_WINDOW:
            visible = visible & (kpos[None, :] >= pos[:, None] - window)
    else:
        visible = None
    acc, l_i, m_new, p = softmax_rescale(acc, l_i, m_i, s, visible, qk_scale, MASKED, FP8_MMA != 0)
    acc = add_values(acc, p, v, tile_scale, DOT_PRECISION, DOT_UPCAST, KV_TILE, FP8_MMA)
    return acc, l_i, m_new


@triton.jit
def _attn_key_range(
    acc, l_i, m_i, q1, q2, pos,
    k_base, v_base, kv_row_base, pt_row, k_desc1, k_desc2, v_desc,
    n_lo, n_hi, key_end, window, qk_scale,
    stride_kp, stride_kn, stride_vp, stride_vn,
    offs_n, offs_d1, offs_d2, offs_dv,
    MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_DESC: tl.constexpr, KV_FP8: tl.constexpr = False, KV_TILE: tl.constexpr = False,
    FP8_MMA: tl.constexpr = 0,
):
    """Online softmax over key blocks [n_lo, n_hi) (BLOCK_N-aligned); MASKED adds the causal /
    window mask and bounds loads at key_end. USE_DESC loads K/V blocks through the tensor
    descriptors (TMA; packed K/V, unmasked blocks) instead of pointers. DOT_UPCAST feeds fp32 to
    tl.dot (the interpreter's bf16 dot is wrong)."""
    for start in range(n_lo, n_hi, BLOCK_N):
        k_off, v_off, in_seq = _kv_block_offsets(start, kv_row_base, pt_row, key_end, stride_kp, stride_kn,
                                                 stride_vp, stride_vn, offs_n, MASKED, PAGED, PAGE_SIZE, BLOCK_N)
        desc_row = (kv_row_base + start).to(tl.int32)
        if KV_TILE:  # tile-scaled latent rows: tile scales applied in fp32 outside the dots; V is the latent
            s, v, tsc = tile_block_scores(q1, q2, k_base, k_off, in_seq, offs_d1, offs_d2, MASKED, q1.shape[0],
                                          BLOCK_N, BLOCK_D1, DOT_PRECISION)
        else:
            tsc = None
            s = _block_scores(q1, q2, k_base, k_off, in_seq, k_desc1, k_desc2, desc_row, offs_d1, offs_d2,
                              MASKED, BLOCK_D1, BLOCK_D2, DOT_PRECISION, DOT_UPCAST, USE_DESC, KV_FP8)
            v = _load_rows(v_base, v_off, in_seq, offs_dv, v_desc, desc_row, MASKED, USE_DESC, DOT_UPCAST)
            if KV_FP8:
                v = v.to(q1.dtype)
        acc, l_i, m_i = _softmax_update(acc, l_i, m_i, s, v, start, pos, window, qk_scale, offs_n,
                                        MASKED, HAS_WINDOW, DOT_PRECISION, DOT_UPCAST, tsc, KV_TILE, FP8_MMA)
    return acc, l_i, m_i


@triton.jit
def _tile_and_head_group(pid, num_tiles, num_head_groups, heads_per_section):
    """Program ``pid`` -> (tile, head group): sections of ``heads_per_section`` head groups, all
    tiles of a section (heaviest first) before the next, head groups fastest inside a section."""
    per_section = num_tiles * heads_per_section
    section = pid // per_section
    r = pid - section * per_section
    section_heads = tl.minimum(heads_per_section, num_head_groups - section * heads_per_section)
    return r // section_heads, section * heads_per_section + r % section_heads


@triton.jit
def _cp_attn_fwd(
    Q, K, V, Out, Lse, Sinks, PageTable, KScale, VScale,
    tile_segment, tile_row_offset, NumTiles,
    seg_seq, seg_row0, seg_len, seg_pos0, seg_stride, cu_kv_lens,
    qk_scale, window, num_head_groups, heads_per_section, group_size, num_kv_rows,
    stride_qm, stride_qh, stride_sink,
    stride_kp, stride_kn, stride_kh,
    stride_vp, stride_vn, stride_vh,
    stride_om, stride_oh, stride_lm, stride_lh, stride_pt, stride_ks, stride_vs,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
    BLOCK_M: tl.constexpr, G_PACK: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, RETURN_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr, KV_TILE: tl.constexpr = False, FP8_MMA: tl.constexpr = 0,
):
    ROWS: tl.constexpr = BLOCK_M // G_PACK
    num_tiles = tl.load(NumTiles)  # from device memory: a capacity-sized grid replays for any batch
    pid = tl.program_id(0)
    if pid >= num_tiles * num_head_groups:
        return
    tile, hg = _tile_and_head_group(pid, num_tiles, num_head_groups, heads_per_section)

    seg = tl.load(tile_segment + tile)
    roff = tl.load(tile_row_offset + tile)
    seq = tl.load(seg_seq + seg)
    row0 = tl.load(seg_row0 + seg)
    slen = tl.load(seg_len + seg)
    pos0 = tl.load(seg_pos0 + seg)
    pstride = tl.load(seg_stride + seg)

    offs_m = tl.arange(0, BLOCK_M)
    r = roff + offs_m // G_PACK
    head = hg * G_PACK + offs_m % G_PACK
    valid = r < slen
    row = (row0 + r).to(tl.int64)
    pos = pos0 + r * pstride
    last_r = tl.minimum(roff + ROWS, slen) - 1
    pos_min = pos0 + roff * pstride
    pos_max = pos0 + last_r * pstride
    kvh = (hg * G_PACK) // group_size

    offs_n, offs_d1, offs_d2, offs_dv, q1, q2, k_base, v_base, qk_scale, pt_row, kv_row_base = head_group_tile(
        Q, K, V, KScale, PageTable, cu_kv_lens, seq, row, head, valid, kvh, qk_scale,
        stride_qm, stride_qh, stride_kh, stride_vh, stride_ks, stride_pt,
        BLOCK_N, BLOCK_D1, BLOCK_D2, HEAD_DIM_V, PAGED, DOT_UPCAST, KV_FP8)
    if FP8_MMA != 0:  # q rows to e4m3, their scales into the per-row softmax scale
        q1, q2, qk_scale = quantize_query_rows(q1, q2, qk_scale, BLOCK_D2, FP8_MMA)
    if USE_TMA:  # packed K/V of this KV head as [num_kv_rows, D] row-strided matrices
        k_desc1 = tl.make_tensor_descriptor(k_base, shape=[num_kv_rows, BLOCK_D1], strides=[stride_kn, 1],
                                            block_shape=[BLOCK_N, BLOCK_D1])
        if BLOCK_D2 > 0:
            k_desc2 = tl.make_tensor_descriptor(k_base + BLOCK_D1, shape=[num_kv_rows, BLOCK_D2],
                                                strides=[stride_kn, 1], block_shape=[BLOCK_N, BLOCK_D2])
        else:
            k_desc2 = k_desc1
        v_desc = tl.make_tensor_descriptor(v_base, shape=[num_kv_rows, HEAD_DIM_V], strides=[stride_vn, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM_V])
    else:
        k_desc1 = k_base
        k_desc2 = k_base
        v_desc = v_base

    if HAS_SINKS:
        m_i = tl.load(Sinks + head * stride_sink).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], dtype=tl.float32)

    key_end = pos_max + 1
    if HAS_WINDOW:
        n_lo = (tl.maximum(pos_min - window, 0) // BLOCK_N) * BLOCK_N
        f_lo = tl.cdiv(tl.maximum(pos_max - window, 0), BLOCK_N) * BLOCK_N
    else:
        n_lo = 0
        f_lo = 0
    f_hi = ((pos_min + 1) // BLOCK_N) * BLOCK_N
    f_hi = tl.maximum(f_hi, f_lo)

    if HAS_WINDOW:  # masked blocks at the window's left edge
        acc, l_i, m_i = _attn_key_range(
            acc, l_i, m_i, q1, q2, pos, k_base, v_base, kv_row_base, pt_row,
            k_desc1, k_desc2, v_desc, n_lo, f_lo, key_end, window, qk_scale,
            stride_kp, stride_kn, stride_vp, stride_vn, offs_n, offs_d1, offs_d2, offs_dv,
            True, HAS_WINDOW, PAGED, PAGE_SIZE, BLOCK_D1, BLOCK_D2, DOT_PRECISION, DOT_UPCAST, BLOCK_N,
            False, KV_FP8, KV_TILE, FP8_MMA,
        )
    # interior: every key visible to every row of the tile
    acc, l_i, m_i = _attn_key_range(
        acc, l_i, m_i, q1, q2, pos, k_base, v_base, kv_row_base, pt_row,
        k_desc1, k_desc2, v_desc, f_lo, f_hi, key_end, window, qk_scale,
        stride_kp, stride_kn, stride_vp, stride_vn, offs_n, offs_d1, offs_d2, offs_dv,
        False, HAS_WINDOW, PAGED, PAGE_SIZE, BLOCK_D1, BLOCK_D2, DOT_PRECISION, DOT_UPCAST, BLOCK_N,
        USE_TMA, KV_FP8, KV_TILE, FP8_MMA,
    )
    # the causal diagonal
    acc, l_i, m_i = _attn_key_range(
        acc, l_i, m_i, q1, q2, pos, k_base, v_base, kv_row_base, pt_row,
        k_desc1, k_desc2, v_desc, f_hi, key_end, key_end, window, qk_scale,
        stride_kp, stride_kn, stride_vp, stride_vn, offs_n, offs_d1, offs_d2, offs_dv,
        True, HAS_WINDOW, PAGED, PAGE_SIZE, BLOCK_D1, BLOCK_D2, DOT_PRECISION, DOT_UPCAST, BLOCK_N,
        False, KV_FP8, KV_TILE, FP8_MMA,
    )

    # l_i == 0: no visible key (0 / -inf); NaN (from q, k, v or a sink) stays NaN in out and lse
    out, has_mass = normalized(acc, l_i, VScale, kvh, stride_vs, KV_FP8)
    if FP8_MMA != 0:
        out = out * (1.0 / P_SCALE)  # P went to the P V dot as fp8(P_SCALE p)
    o_ptrs = Out + row[:, None] * stride_om + head[:, None] * stride_oh + offs_dv[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=valid[:, None])
    if RETURN_LSE:
        lse = row_lse(m_i, l_i, has_mass)
        lse = tl.where(pos < 0, float("-inf"), lse)  # pad rows (pad segment, position -1)
        tl.store(Lse + row * stride_lm + head * stride_lh, lse, mask=valid)


_cp_attn_fwd_tuned = triton.autotune(
    configs=_configs(),
    key=["HEAD_DIM", "HEAD_DIM_V", "BLOCK_M", "G_PACK", "PAGED", "PAGE_SIZE", "HAS_WINDOW", "USE_TMA", "KV_FP8",
         "KV_TILE", "FP8_MMA"],
    prune_configs_by={"early_config_prune": _prune_configs},
    do_bench=_bench_config,
)(_cp_attn_fwd)


# ----------------------------------------------------------------------------- host launcher
def last_dim_contiguous(x: Tensor, name: str) -> Tensor:
    if x.stride(-1) != 1:
        logger.debug("cpattn triton: %s has last-dim stride %d, copying", name, x.stride(-1))
        return x.contiguous()
    return x


def dot_settings(dtype: torch.dtype, fp8_mma: bool = False) -> dict:
    """DOT_PRECISION / DOT_UPCAST constexprs: fp32 is exact ("ieee"); under the interpreter bf16
    operands are upcast (its bf16 dot is wrong; bf16 x bf16 products are exact in fp32), and the
    emulated FP8 dots (``fp8_mma``, :func:`fp8_mma_mode`) run "ieee"."""
    upcast = INTERPRETED and dtype == torch.bfloat16
    exact = dtype == torch.float32 or upcast or (INTERPRETED and fp8_mma)
    return dict(DOT_PRECISION="ieee" if exact else "tf32", DOT_UPCAST=upcast)


def fp8_mma_mode(fp8_mma: bool) -> int:
    """The FP8_MMA constexpr of FP8 tensor-core attention (``AttentionSpec(mma_dtype=)``): 0 off,
    1 e4m3 dots on the GPU, 2 their fp32 emulation under the interpreter (its fp8 conversion and
    fp8 dot are wrong; :data:`._attn_steps.FP8_MMA_EMULATED`)."""
    return (2 if INTERPRETED else 1) if fp8_mma else 0


#: Per-call arguments of the portable kernel, in the order of a launch's ``values``.
_PER_CALL = ("Q", "K", "V", "Out", "Lse", "Sinks", "PageTable", "KScale", "VScale", "qk_scale", "num_kv_rows",
             "stride_qm", "stride_qh", "stride_sink", "stride_kp", "stride_kn", "stride_kh", "stride_vp", "stride_vn",
             "stride_vh", "stride_om", "stride_oh", "stride_lm", "stride_lh", "stride_pt", "stride_ks", "stride_vs",
             "HAS_SINKS", "RETURN_LSE", "USE_TMA")


def make_launch(plan_args: dict, config: Optional[tuple[int, int, int]] = None, enabled: bool = True):
    """A :class:`PlannedLaunch` of the portable kernel with the planned keyword arguments
    (tile map, tile count, segments, geometry constexprs; see ``triton_backend``). ``config`` =
    (BLOCK_N, num_warps, num_stages) bypasses the autotuner (the interpreter uses a small one).
    ``enabled`` False (and always under the interpreter): every call through the JIT."""

    if INTERPRETED or config is not None:
        bn, warps, stages = config if config is not None else (16, 4, 1)
        fixed = dict(plan_args, BLOCK_N=bn, num_warps=warps, num_stages=stages)
        return PlannedLaunch(_cp_attn_fwd, fixed, _PER_CALL, enabled=enabled and not INTERPRETED,
                             device_scratch=not INTERPRETED)
    return PlannedLaunch(_cp_attn_fwd_tuned, plan_args, _PER_CALL, enabled=enabled, device_scratch=True)


def kv_facts(k: Tensor, v: Tensor, paged: bool) -> tuple:
    """``(use_tma, K/V ints, their key part)`` of a portable launch over these K/V (ints and
    flags only: a plan caches them per K/V address, shape, strides and dtype)."""
    ints = kv_strides(k, v, paged)
    use_tma = not paged and not INTERPRETED and k.element_size() > 1 and _tma_ok(k, v)  # FP8: pointer loads
    return use_tma, ints, (k.data_ptr() & 15, v.data_ptr() & 15, k.shape[0]) + ints + (use_tma,)


def launch(
    launcher, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Optional[Tensor], sinks: Optional[Tensor],
    page_table: Optional[Tensor], cu_kv_lens: Tensor, *, grid: tuple[int], softmax_scale: float, kv_cache=None,
    k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None,
) -> None:
    """Launch the portable kernel through its planned launcher (:func:`make_launch`).
    ``kv_cache``: the plan's :class:`~cpattn.kernels._launch.LRU` of :func:`kv_facts` (None:
    computed per call). ``k_scale`` / ``v_scale``: float32 ``[]`` or ``[Hkv]`` scales of FP8
    K/V (a plan with ``KV_FP8``)."""
    paged = page_table is not None
    key_kv = (k.data_ptr(), v.data_ptr(), k.shape, v.shape, k.stride(), v.stride(), k.dtype, paged)
    facts = kv_cache.get(key_kv) if kv_cache is not None else None
    if facts is None:
        facts = kv_facts(k, v, paged)
        if kv_cache is not None:
            kv_cache.put(key_kv, facts)
    use_tma, kv_ints, kv_part = facts
    pt, stride_pt = (page_table, page_table.stride(0)) if paged else (cu_kv_lens, 0)
    has_sinks, has_lse = sinks is not None, lse is not None
    qs, os_ = q.stride(), out.stride()
    slm, slh = lse.stride() if has_lse else (0, 0)
    ssink = sinks.stride(0) if has_sinks else 0
    ks = k_scale if k_scale is not None else pt  # never read without KV_FP8
    vs = v_scale if v_scale is not None else pt
    sks = k_scale.stride(0) if k_scale is not None and k_scale.dim() == 1 else 0
    svs = v_scale.stride(0) if v_scale is not None and v_scale.dim() == 1 else 0
    values = (q, k, v, out, lse if has_lse else out, sinks if has_sinks else out, pt, ks, vs,
              float(softmax_scale) * LOG2E, k.shape[0], qs[0], qs[1], ssink) + kv_ints + (
                  os_[0], os_[1], slm, slh, stride_pt, sks, svs, has_sinks, has_lse, use_tma)
    key = (q.dtype, q.data_ptr() & 15, out.data_ptr() & 15, lse.data_ptr() & 15 if has_lse else -1,
           (sinks.dtype, sinks.data_ptr() & 15) if has_sinks else None, (pt.dtype, pt.data_ptr() & 15),
           qs[0], qs[1], ssink, os_[0], os_[1], slm, slh, stride_pt) + kv_part
    if k_scale is not None:  # (FP8 plans only: a bf16 plan's key is unchanged)
        key += (ks.data_ptr() & 15, vs.data_ptr() & 15, sks, svs)
    launcher(grid, values, key)  # USE_TMA: device-side descriptors in the launch's global scratch
