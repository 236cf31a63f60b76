"""Split-KV attention over a key shard (flash-decoding with an LSE combine), few query rows.

A *work item* is one query tile of one sequence (``ROWS`` consecutive query rows, e.g. the 1..4
tokens of a decode or speculative-verification step) and one key *split* (a range of the
rank's local keys of that sequence). A program handles one work item for ``G_PACK`` query heads
that share a KV head: the M dimension packs ``ROWS x G_PACK`` (row-major, heads fastest), so
each K/V block is loaded once for the whole head group (GQA 32/8: 4 heads; MLA absorbed: 32 of
the 128 heads of the single latent "KV head").

Positions are GLOBAL: query row ``i`` of a tile sits at ``seq_len - q_len + r0 + i``; local key
``j`` of rank ``r`` sits at ``(j // I) * C * I + r * I + j % I`` (C = CP_SIZE, I = INTERLEAVE;
C = 1 is an unsharded cache, ``p = j``). A key is visible when its position is ``<=`` the row's
(and ``>= pos - window``). Key blocks are walked in three ranges: masked blocks before the
interior, interior blocks every row sees entirely (no mask arithmetic, no load masks) and masked
blocks at the end; masked loads stop at the split's end, so cache slots past a sequence's keys
(which may hold anything, NaN included) are never read.

K/V: packed (local key ``j`` of sequence ``b`` at row ``cu_local_kv[b] + j``) or paged (page
``page_table[b, j // PAGE_SIZE]``, slot ``j % PAGE_SIZE``), any row strides, last dim
contiguous. ``V_FROM_K``: V is a view of K's first ``HEAD_DIM_V`` columns (MLA's absorbed form,
``v = k[..., :512]``); the kernel reuses the K block instead of loading V. Softmax in base 2,
fp32 accumulation, natural-log LSE.

FP8 caches (``KV_FP8``, e4m3 K/V with float32 scales per tensor or per KV head, read from device
memory): each K/V block is converted to the query dtype in registers after its load (exact: every
e4m3 value is a bf16 / fp16 / fp32 value) and the scales are applied outside the dots: the K scale
of the program's KV head multiplies the softmax scale, the V scale the normalized output (the
combine is linear in the partials). With ``KV_FP8`` False the branches compile away.
Tile-scaled FP8 MLA latent rows (``KV_TILE``, uint8 K = V: ``BLOCK_D1`` e4m3 values, one float32
scale per 128, ``BLOCK_D2`` bf16 rope values per row): the e4m3 values convert exactly to the
query dtype and the tile scales apply in fp32 outside the dots (one batched dot per 128-value
tile, :mod:`._fp8_tiles`); V is the latent block. With ``KV_TILE`` False that branch compiles away.

A work item whose tile has one split writes the final ``out`` / ``lse`` (sinks included);
otherwise it writes its normalized partial and LSE (fp32) into a workspace, and the combine
kernel merges a tile's splits (sinks included once) into ``out`` / ``lse``. Counts come from
device memory (programs past them exit), so grids sized for a static plan's capacity replay in a
CUDA graph. The host side (work items, split sizes, configs) is planned by
:mod:`.decode_backend`; this module holds the kernels and their launchers.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._attn_steps import add_values, head_group_tile, normalized, row_lse, row_offsets, softmax_rescale
from ._fp8_tiles import tile_block_scores
from ._launch import LRU, LaunchState, align_key
from ._tiles import LOG2E, kv_strides

#: True when this module's kernels were built for the CPU interpreter (TRITON_INTERPRET=1 at
#: import): Triton decides at decoration time, so one process runs one kind.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

#: The constants for use inside kernels (Triton reads only constexpr globals).
_LOG2E = tl.constexpr(LOG2E)


# ----------------------------------------------------------------------------- helpers (device)
@triton.jit
def _local_len(x, rank, CP_SIZE: tl.constexpr, INTERLEAVE: tl.constexpr):
    """Local keys of ``rank`` at positions < x (x >= 0)."""
    PERIOD: tl.constexpr = CP_SIZE * INTERLEAVE
    part = tl.minimum(tl.maximum(x % PERIOD - rank * INTERLEAVE, 0), INTERLEAVE)
    return (x // PERIOD) * INTERLEAVE + part


@triton.jit
def _global_pos(j, rank, CP_SIZE: tl.constexpr, INTERLEAVE: tl.constexpr):
    """Global position of local key j of ``rank``."""
    if CP_SIZE == 1:
        return j
    return (j // INTERLEAVE) * (CP_SIZE * INTERLEAVE) + rank * INTERLEAVE + j % INTERLEAVE


@triton.jit
def _page_of(pt_row, start, hi, offs_n, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Page(s) of local keys [start, start + BLOCK_N) (0 where the key is >= hi): one table entry
    when a page holds whole blocks (blocks are BLOCK_N-aligned), else one per key."""
    if PAGE_SIZE % BLOCK_N == 0:
        page = tl.load(pt_row + start // PAGE_SIZE, mask=start < hi, other=0).to(tl.int64)
    else:
        j = start + offs_n
        page = tl.load(pt_row + j // PAGE_SIZE, mask=j < hi, other=0).to(tl.int64)
    return page


@triton.jit
def _kv_offsets(start, kv_row_base, page, key_end, stride_kp, stride_kn, stride_vp, stride_vn, offs_n,
                PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Element offsets of local keys [start, start + BLOCK_N) in K and V, and the in-range mask."""
    j = start + offs_n
    in_range = j < key_end
    if PAGED:
        if PAGE_SIZE % BLOCK_N == 0:
            slot = (start % PAGE_SIZE + offs_n).to(tl.int64)
        else:
            slot = (j % PAGE_SIZE).to(tl.int64)
    else:
        slot = (kv_row_base + j).to(tl.int64)
    k_off, v_off = row_offsets(page, slot, stride_kp, stride_kn, stride_vp, stride_vn, PAGED)
    return k_off, v_off, in_range


@triton.jit
def _load_block(base, off, in_range, offs_d, MASKED: tl.constexpr, DOT_UPCAST: tl.constexpr):
    if MASKED:
        x = tl.load(base + off[:, None] + offs_d[None, :], mask=in_range[:, None], other=0.0)
    else:
        x = tl.load(base + off[:, None] + offs_d[None, :])
    if DOT_UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _key_range(
    acc, l_i, m_i, q1, q2, pos, rank,
    k_base, v_base, kv_row_base, pt_row, lo, hi, key_end, window, qk_scale,
    stride_kp, stride_kn, stride_vp, stride_vn, offs_n, offs_d1, offs_d2, offs_dv,
    MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    CP_SIZE: tl.constexpr, INTERLEAVE: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
    V_FROM_K: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_FP8: tl.constexpr = False, KV_TILE: tl.constexpr = False,
):
    """Online softmax (base 2) over local key blocks [lo, hi); MASKED masks by global position
    and bounds loads at key_end. Paged: the next block's page is loaded one iteration ahead (a
    loop-carried value, not a load the block's K/V addresses wait for in the same iteration), so
    the pipeliner keeps num_stages - 1 K/V blocks in flight as it does for packed K/V."""
    if PAGED:
        page_next = _page_of(pt_row, lo, hi, offs_n, PAGE_SIZE, BLOCK_N)
    else:
        page_next = 0
    for start in range(lo, hi, BLOCK_N):
        page = page_next
        if PAGED:
            page_next = _page_of(pt_row, start + BLOCK_N, hi, offs_n, PAGE_SIZE, BLOCK_N)
        k_off, v_off, in_range = _kv_offsets(start, kv_row_base, page, key_end, stride_kp, stride_kn,
                                             stride_vp, stride_vn, offs_n, PAGED, PAGE_SIZE, BLOCK_N)
        if KV_TILE:  # tile-scaled latent rows: tile scales applied in fp32 outside the dots; V is the latent
            s, k1, tsc = tile_block_scores(q1, q2, k_base, k_off, in_range, offs_d1, offs_d2, MASKED, q1.shape[0],
                                           BLOCK_N, BLOCK_D1, DOT_PRECISION)
        else:
            tsc = None
            k1 = _load_block(k_base, k_off, in_range, offs_d1, MASKED, DOT_UPCAST)
            if KV_FP8:  # dequantized in registers: e4m3 -> q's dtype (exact), scales outside the dots
                k1 = k1.to(q1.dtype)
            s = tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)
            if BLOCK_D2 > 0:
                k2 = _load_block(k_base + BLOCK_D1, k_off, in_range, offs_d2, MASKED, DOT_UPCAST)
                if KV_FP8:
                    k2 = k2.to(q2.dtype)
                s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PRECISION)
        if KV_TILE or V_FROM_K:
            v = k1
        else:
            v = _load_block(v_base, v_off, in_range, offs_dv, MASKED, DOT_UPCAST)
            if KV_FP8:
                v = v.to(q1.dtype)
        if MASKED:
            kpos = _global_pos(start + offs_n, rank, CP_SIZE, INTERLEAVE)
            visible = in_range[None, :] & (kpos[None, :] <= pos[:, None])
            if HAS_WINDOW:
                visible = visible & (kpos[None, :] >= pos[:, None] - window)
        else:
            visible = None
        acc, l_i, m_i, p = softmax_rescale(acc, l_i, m_i, s, visible, qk_scale, MASKED)
        acc = add_values(acc, p, v, tsc, DOT_PRECISION, DOT_UPCAST, KV_TILE)
    return acc, l_i, m_i


# ----------------------------------------------------------------------------- split kernel
@triton.jit
def _shard_attn_split(
    Q, K, V, Out, Lse, Sinks, PageTable, WsO, WsLse, KScale, VScale,
    item_seq, item_r0, item_k0, item_k1, item_ws, NumItems,
    q_lens, seq_lens, cu_q_lens, cu_local_kv,
    qk_scale, window, rank, num_head_groups, group_size,
    stride_qm, stride_qh, stride_sink,
    stride_kp, stride_kn, stride_kh, stride_vp, stride_vn, stride_vh,
    stride_om, stride_oh, stride_lm, stride_lh, stride_pt,
    stride_wi, stride_wr, stride_wh, stride_li, stride_lr, stride_ks, stride_vs,
    HEAD_DIM_V: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
    ROWS: tl.constexpr, G_PACK: tl.constexpr, BLOCK_M: tl.constexpr,
    CP_SIZE: tl.constexpr, INTERLEAVE: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, V_FROM_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr,
    PDL: tl.constexpr = False, KV_TILE: tl.constexpr = False,
):
    if PDL:  # the combine (programmatic dependent launch) may start; it waits for this grid's end
        gdc_launch_dependents()
    pid = tl.program_id(0)
    item = pid // num_head_groups
    hg = pid - item * num_head_groups
    if item >= tl.load(NumItems):  # from device memory: a capacity-sized grid replays for any step
        return
    seq = tl.load(item_seq + item)
    r0 = tl.load(item_r0 + item)
    k0 = tl.load(item_k0 + item)
    k1_end = tl.load(item_k1 + item)
    ws = tl.load(item_ws + item)
    q_len = tl.load(q_lens + seq)
    pos0 = tl.load(seq_lens + seq) - q_len + r0
    n_rows = tl.minimum(q_len - r0, ROWS)

    offs_m = tl.arange(0, BLOCK_M)
    i = offs_m // G_PACK
    head = hg * G_PACK + offs_m % G_PACK
    valid = (offs_m < ROWS * G_PACK) & (i < n_rows)
    pos = pos0 + i
    qrow = (tl.load(cu_q_lens + seq) + r0 + i).to(tl.int64)
    kvh = (hg * G_PACK) // group_size

    offs_n, offs_d1, offs_d2, offs_dv, q1, q2, k_base, v_base, qk_scale, pt_row, kv_row_base = head_group_tile(
        Q, K, V, KScale, PageTable, cu_local_kv, seq, qrow, head, valid, kvh, qk_scale,
        stride_qm, stride_qh, stride_kh, stride_vh, stride_ks, stride_pt,
        BLOCK_N, BLOCK_D1, BLOCK_D2, HEAD_DIM_V, PAGED, DOT_UPCAST, KV_FP8)

    single = ws < 0
    if HAS_SINKS:  # sinks join the denominator once: here when the tile has one split, else in the combine
        sink = tl.load(Sinks + head * stride_sink).to(tl.float32) * _LOG2E
        m_i = tl.where(single, sink, float("-inf"))
        l_i = tl.where(single, 1.0, 0.0) + tl.zeros([BLOCK_M], dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], dtype=tl.float32)

    # interior: local keys every row of the tile sees (position <= the first row's, and inside
    # the last row's window), in whole blocks of this split
    pos_last = pos0 + n_rows - 1
    vis_hi = _local_len(pos0 + 1, rank, CP_SIZE, INTERLEAVE)
    if HAS_WINDOW:
        vis_lo = _local_len(tl.maximum(pos_last - window, 0), rank, CP_SIZE, INTERLEAVE)
    else:
        vis_lo = 0
    a_lo = tl.maximum(k0, tl.cdiv(vis_lo, BLOCK_N) * BLOCK_N)
    a_hi = (tl.minimum(k1_end, vis_hi) // BLOCK_N) * BLOCK_N
    empty = a_hi <= a_lo
    a_lo = tl.where(empty, k0, a_lo)
    a_hi = tl.where(empty, k0, a_hi)

    acc, l_i, m_i = _key_range(
        acc, l_i, m_i, q1, q2, pos, rank, k_base, v_base, kv_row_base, pt_row, k0, a_lo, k1_end, window,
        qk_scale, stride_kp, stride_kn, stride_vp, stride_vn, offs_n, offs_d1, offs_d2, offs_dv,
        True, HAS_WINDOW, PAGED, PAGE_SIZE, CP_SIZE, INTERLEAVE, BLOCK_D1, BLOCK_D2, V_FROM_K, DOT_PRECISION,
        DOT_UPCAST, BLOCK_N, KV_FP8, KV_TILE)
    acc, l_i, m_i = _key_range(
        acc, l_i, m_i, q1, q2, pos, rank, k_base, v_base, kv_row_base, pt_row, a_lo, a_hi, k1_end, window,
        qk_scale, stride_kp, stride_kn, stride_vp, stride_vn, offs_n, offs_d1, offs_d2, offs_dv,
        False, HAS_WINDOW, PAGED, PAGE_SIZE, CP_SIZE, INTERLEAVE, BLOCK_D1, BLOCK_D2, V_FROM_K, DOT_PRECISION,
        DOT_UPCAST, BLOCK_N, KV_FP8, KV_TILE)
    acc, l_i, m_i = _key_range(
        acc, l_i, m_i, q1, q2, pos, rank, k_base, v_base, kv_row_base, pt_row, a_hi, k1_end, k1_end, window,
        qk_scale, stride_kp, stride_kn, stride_vp, stride_vn, offs_n, offs_d1, offs_d2, offs_dv,
        True, HAS_WINDOW, PAGED, PAGE_SIZE, CP_SIZE, INTERLEAVE, BLOCK_D1, BLOCK_D2, V_FROM_K, DOT_PRECISION,
        DOT_UPCAST, BLOCK_N, KV_FP8, KV_TILE)

    # l_i == 0: no visible key (0 / -inf); NaN (from q, a visible k / v, or a sink) stays NaN
    # KV_FP8: the V scale applies here (each partial, which the combine mixes linearly, is linear in V)
    out, has_mass = normalized(acc, l_i, VScale, kvh, stride_vs, KV_FP8)
    lse = row_lse(m_i, l_i, has_mass)
    if single:
        o_ptrs = Out + qrow[:, None] * stride_om + head[:, None] * stride_oh + offs_dv[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=valid[:, None])
        tl.store(Lse + qrow * stride_lm + head * stride_lh, lse, mask=valid)
    else:
        w_ptrs = WsO + ws.to(tl.int64) * stride_wi + i[:, None] * stride_wr + head[:, None] * stride_wh
        tl.store(w_ptrs + offs_dv[None, :], out, mask=valid[:, None])
        tl.store(WsLse + ws.to(tl.int64) * stride_li + i * stride_lr + head, lse, mask=valid)


# ----------------------------------------------------------------------------- exact merge (shared)
@triton.jit
def _merge_block(o_base, l_base, n_parts, stride_po, stride_pl, stride_oh, stride_lh, heads, hmask, offs_dv, dmask,
                 sink, HAS_SINK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_DV: tl.constexpr, ONE_PASS: tl.constexpr):
    """Exact merge of ``n_parts`` partial results for BLOCK_H heads x BLOCK_DV columns.

    Part ``s``, head ``h``, column ``d`` at ``o_base + s * stride_po + h * stride_oh + d``, its
    natural-log LSE at ``l_base + s * stride_pl + h * stride_lh``; ``sink`` [BLOCK_H] (natural
    log, -inf: none) joins the denominator as a part with output 0. Two passes over the parts in
    chunks of BLOCK_S: the max LSE, then the weighted sum ``w = exp(lse - shift)`` (1 where
    ``lse == shift``, so +inf == +inf is no NaN); outputs of parts with weight 0 are not loaded
    (masked), so NaN there cannot leak; a NaN LSE gives weight NaN and a NaN row. ``sink`` is
    -inf where there is none (HAS_SINK False: no sink anywhere). ``ONE_PASS`` (``n_parts <=
    BLOCK_S``): one chunk, its LSEs and outputs loaded together (no load waits for the weights;
    parts of weight 0 are read but do not count: ``where``, not ``0 * x``). Returns
    (out [BLOCK_H, BLOCK_DV] fp32, lse [BLOCK_H] fp32): (0, -inf) when every weight is 0.
    """
    offs_s = tl.arange(0, BLOCK_S)
    if ONE_PASS:
        s64 = offs_s.to(tl.int64)
        live = offs_s < n_parts
        lmask = live[:, None] & hmask[None, :]
        lse_s = tl.load(l_base + s64[:, None] * stride_pl + heads[None, :] * stride_lh, mask=lmask,
                        other=float("-inf")).to(tl.float32)
        o_ptrs = o_base + s64[:, None, None] * stride_po + heads[None, :, None] * stride_oh + offs_dv[None, None, :]
        o_s = tl.load(o_ptrs, mask=lmask[:, :, None] & dmask[None, None, :], other=0.0).to(tl.float32)
        m = tl.maximum(sink, tl.max(lse_s, 0))
        shift = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp(tl.where(lse_s == shift[None, :], 0.0, lse_s - shift[None, :]))  # [BLOCK_S, BLOCK_H]
        use = (w != 0.0) & lmask  # NaN != 0: a NaN weight counts (and stays NaN)
        acc = tl.sum(tl.where(use[:, :, None], w[:, :, None] * o_s, 0.0), 0)
        total = tl.sum(w, 0)
        if HAS_SINK:
            total += tl.where(sink == shift, 1.0, tl.exp(sink - shift))
    else:
        m = sink
        for s0 in range(0, n_parts, BLOCK_S):
            s = s0 + offs_s
            lmask = (s < n_parts)[:, None] & hmask[None, :]
            lse_s = tl.load(l_base + s.to(tl.int64)[:, None] * stride_pl + heads[None, :] * stride_lh, mask=lmask,
                            other=float("-inf")).to(tl.float32)
            m = tl.maximum(m, tl.max(lse_s, 0))
        shift = tl.where(m == float("-inf"), 0.0, m)
        total = tl.zeros_like(shift)
        if HAS_SINK:
            total += tl.where(sink == shift, 1.0, tl.exp(sink - shift))
        acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
        for s0 in range(0, n_parts, BLOCK_S):
            s = s0 + offs_s
            lmask = (s < n_parts)[:, None] & hmask[None, :]
            s64 = s.to(tl.int64)
            lse_s = tl.load(l_base + s64[:, None] * stride_pl + heads[None, :] * stride_lh, mask=lmask,
                            other=float("-inf")).to(tl.float32)
            w = tl.exp(tl.where(lse_s == shift[None, :], 0.0, lse_s - shift[None, :]))  # [BLOCK_S, BLOCK_H]
            use = (w != 0.0) & lmask  # NaN != 0: a NaN weight reads its part (and stays NaN)
            o_ptrs = o_base + s64[:, None, None] * stride_po + heads[None, :, None] * stride_oh \
                + offs_dv[None, None, :]
            o_s = tl.load(o_ptrs, mask=use[:, :, None] & dmask[None, None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w[:, :, None] * o_s, 0)  # unread parts: w = 0 and o_s = 0
            total += tl.sum(w, 0)
    has_mass = total != 0.0
    out = acc * tl.where(has_mass, 1.0 / tl.where(has_mass, total, 1.0), 0.0)[:, None]
    lse = tl.where(has_mass, shift + tl.log(tl.where(has_mass, total, 1.0)), float("-inf"))
    return out, lse


# ----------------------------------------------------------------------------- combine kernel
@triton.jit
def _shard_attn_combine(
    Out, Lse, Sinks, WsO, WsLse, row_ws0, row_nsplit, row_ti,
    num_heads, stride_om, stride_oh, stride_lm, stride_lh, stride_sink,
    stride_wi, stride_wr, stride_wh, stride_li, stride_lr,
    HEAD_DIM_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_SINKS: tl.constexpr, ONE_PASS: tl.constexpr, PDL: tl.constexpr = False,
):
    """Merge the splits of one query row exactly, for BLOCK_H heads x BLOCK_DV columns (grid:
    rows x head blocks x column blocks); rows of one-split tiles were written by the split
    kernel; pad rows (no split) get 0 / -inf. Splits are read in chunks of BLOCK_S. PDL: launched
    with programmatic dependent launch: the plan tables and sinks (written before the split
    kernel started) are read before ``griddepcontrol.wait``, the partials after it; every program
    waits, so that the kernel after the combine (an ordinary launch) starts only once the split
    kernel's stores are complete too."""
    row = tl.program_id(0)
    hb = tl.program_id(1)
    db = tl.program_id(2)
    ns = tl.load(row_nsplit + row)
    ws0 = tl.load(row_ws0 + row).to(tl.int64)
    ti = tl.load(row_ti + row).to(tl.int64)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    offs_dv = db * BLOCK_DV + tl.arange(0, BLOCK_DV)
    dmask = offs_dv < HEAD_DIM_V
    if HAS_SINKS:  # counted once, here (a multi-split tile's splits carry none); not on pad rows
        sink = tl.load(Sinks + heads * stride_sink, mask=hmask, other=float("-inf")).to(tl.float32)
        sink = tl.where(ns > 1, sink, float("-inf"))
    else:
        sink = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    if PDL:  # every program waits, also those that return: the combine's end implies the split kernel's
        gdc_wait()
    if ns == 1:
        return
    out, lse = _merge_block(WsO + ws0 * stride_wi + ti * stride_wr, WsLse + ws0 * stride_li + ti * stride_lr, ns,
                            stride_wi, stride_li, stride_wh, 1, heads, hmask, offs_dv, dmask, sink, HAS_SINKS,
                            BLOCK_S, BLOCK_H, BLOCK_DV, ONE_PASS)
    o_ptrs = Out + row.to(tl.int64) * stride_om + heads[:, None] * stride_oh + offs_dv[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=hmask[:, None] & dmask[None, :])
    lse_mask = heads < tl.where(db == 0, num_heads, 0)  # the first column block writes the lse
    tl.store(Lse + row.to(tl.int64) * stride_lm + heads * stride_lh, lse, mask=lse_mask)


# ----------------------------------------------------------------------------- merge kernel
@triton.jit
def _merge_parts(
    Out, Lse, Parts, PartLse, num_parts, num_heads,
    stride_pc, stride_pn, stride_ph, stride_lc, stride_ln, stride_lh,
    stride_on, stride_oh, stride_mn, stride_mh,
    HEAD_DIM_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    """``merge_states`` of C parts [C, N, H, Dv] / [C, N, H] (any strides, last dim contiguous)
    into out [N, H, Dv] (out dtype) and lse [N, H] fp32; grid: N x head blocks x column blocks."""
    n = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    db = tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    offs_dv = db * BLOCK_DV + tl.arange(0, BLOCK_DV)
    dmask = offs_dv < HEAD_DIM_V
    none = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    out, lse = _merge_block(Parts + n * stride_pn, PartLse + n * stride_ln, num_parts, stride_pc, stride_lc,
                            stride_ph, stride_lh, heads, hmask, offs_dv, dmask, none, False, BLOCK_S, BLOCK_H, BLOCK_DV,
                            ONE_PASS)
    o_ptrs = Out + n * stride_on + heads[:, None] * stride_oh + offs_dv[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=hmask[:, None] & dmask[None, :])
    lse_mask = heads < tl.where(db == 0, num_heads, 0)  # the first column block writes the lse
    tl.store(Lse + n * stride_mn + heads * stride_mh, lse, mask=lse_mask)


# ----------------------------------------------------------------------------- host launchers
#: Per-call arguments of the split kernel, in the order of a planned launch's ``values``.
_SPLIT_PER_CALL = ("Q", "K", "V", "Out", "Lse", "Sinks", "PageTable", "WsO", "WsLse", "KScale", "VScale", "qk_scale",
                   "stride_qm", "stride_qh", "stride_sink", "stride_kp", "stride_kn", "stride_kh", "stride_vp",
                   "stride_vn", "stride_vh", "stride_om", "stride_oh", "stride_lm", "stride_lh", "stride_pt",
                   "stride_wi", "stride_wr", "stride_wh", "stride_li", "stride_lr", "stride_ks", "stride_vs", "PAGED",
                   "V_FROM_K")
#: Per-call arguments of the combine kernel.
_COMBINE_PER_CALL = ("Out", "Lse", "Sinks", "WsO", "WsLse", "num_heads", "stride_om", "stride_oh", "stride_lm",
                     "stride_lh", "stride_sink", "stride_wi", "stride_wr", "stride_wh", "stride_li", "stride_lr")


def pdl_capable(device: torch.device) -> bool:
    """Whether kernels on ``device`` can use programmatic dependent launch (``griddepcontrol``: a
    CUDA device of compute capability >= 9.0; never the CPU interpreter)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch(enabled: bool) -> dict:
    """The combine's launch options: with ``enabled`` (:func:`pdl_capable` and the plan's ``pdl``
    option) it starts while the split kernel before it runs (``launch_pdl``) and waits inside for
    its end (``PDL``); else none."""
    return dict(PDL=True, launch_pdl=True) if enabled else {}


class Workspace:
    """A split-KV workspace: the fp32 partials ``o`` [slots, rows, Hq, Dv] of multi-split tiles and
    their LSEs ``lse`` [slots, rows, Hq], with the stride ints and alignment key part every launch
    passes (computed once: a plan allocates its workspace at plan time and reuses it)."""

    __slots__ = ("o", "lse", "strides", "key")

    def __init__(self, o: Tensor, lse: Tensor) -> None:
        self.o, self.lse = o, lse
        self.strides = (o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1))
        self.key = align_key(o, lse)


def launch_split(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, sinks: Optional[Tensor],
                 page_table: Optional[Tensor], ws: Workspace, *, grid: tuple[int], plan_args: dict,
                 softmax_scale: float, v_from_k: bool, config: tuple[int, int, int], state=None,
                 k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None) -> None:
    """Launch the split kernel; ``plan_args`` holds the planned keyword arguments (work items,
    counts, per-sequence arrays, geometry constexprs, ``PDL``, ``KV_FP8``), ``ws`` the plan's
    :class:`Workspace`, the rest is per layer (``k_scale`` / ``v_scale``: float32 ``[]`` or
    ``[Hkv]`` scales of FP8 K/V). ``state``: the plan's :class:`~cpattn.kernels._launch.LaunchState`
    (planned launches: after the first call the compiled kernel is called directly; None: every
    call through the JIT)."""

    paged = page_table is not None
    skp, skn, skh, svp, svn, svh = kv_strides(k, v, paged)
    pt, stride_pt = (page_table, page_table.stride(0)) if paged else (plan_args["cu_local_kv"], 0)
    sk = sinks if sinks is not None else out
    ks = k_scale if k_scale is not None else ws.lse  # never read without KV_FP8
    vs = v_scale if v_scale is not None else ws.lse
    qs, os_, ls = q.stride(), out.stride(), lse.stride()
    values = (q, k, v, out, lse, sk, pt, ws.o, ws.lse, ks, vs, float(softmax_scale) * LOG2E, qs[0], qs[1],
              sinks.stride(0) if sinks is not None else 0, skp, skn, skh, svp, svn, svh, os_[0], os_[1], ls[0], ls[1],
              stride_pt) + ws.strides + (_scale_stride(k_scale), _scale_stride(v_scale), paged, v_from_k)
    key = align_key(q, k, v, out, lse, sk, pt, ks, vs) + ws.key + values[12:]
    block_n, warps, stages = config
    launcher = (state or LaunchState(enabled=False)).launcher(
        "split", _shard_attn_split, lambda: dict(plan_args, BLOCK_N=block_n, num_warps=warps, num_stages=stages),
        _SPLIT_PER_CALL)
    launcher(grid, values, key)


def _scale_stride(scale: Optional[Tensor]) -> int:
    """Stride of a K/V scale over the KV heads: 1 per head ([Hkv]), 0 per tensor ([]) or none."""
    return scale.stride(0) if scale is not None and scale.dim() == 1 else 0


def merge_blocks(parts: int, heads: int, dv: int, rows: int, num_sms: int, budget: int = 8192,
                 max_block_dv: int = 256, programs_per_sm: int = 2) -> tuple[int, int, int]:
    """(BLOCK_S, BLOCK_H, BLOCK_DV) of a merge of ``parts`` partials (at most) for ``rows`` rows of
    ``heads`` x ``dv``: columns in blocks of up to ``max_block_dv``, a chunk of BLOCK_S x BLOCK_H x
    BLOCK_DV <= ``budget`` elements per load (:func:`merge_warps` gives a lane at most 128 of
    them), heads packed up to 4 and 256 columns per program, and narrower column blocks while
    the grid would have fewer than ``programs_per_sm``
    programs per SM (one long sequence: 171 splits x 32 heads are then 128 programs of [256 x 32]
    chunks, not one program walking 171 splits). The defaults were measured on H200 against the
    earlier (4096, 128, 2): the absorbed-MLA combine of a decode step 1.3-2.0x faster, GQA ones
    equal or faster."""
    p2 = _next_pow2
    block_dv = min(p2(dv), max_block_dv)
    block_s = min(p2(parts), max(1, budget // block_dv))
    block_h = 1
    while (block_h < 4 and block_h < p2(heads) and block_h * block_dv < 256
           and block_s * block_h * 2 * block_dv <= budget):
        block_h *= 2

    def programs():
        return rows * -(-heads // block_h) * -(-dv // block_dv)

    while programs() < programs_per_sm * num_sms and block_h > 1:
        block_h //= 2
    while programs() < programs_per_sm * num_sms and block_dv > 32:
        block_dv //= 2
        block_s = min(p2(parts), max(1, budget // block_dv))
    return block_s, block_h, block_dv


def merge_warps(blocks: tuple[int, int, int], elem_bytes: int) -> int:
    """Warps of a merge / combine program with ``blocks`` reading ``elem_bytes``-wide parts: one per
    512 bytes of a column block (32 lanes x 16 bytes; more warps would be laid along the parts
    axis, whose sum then goes through shared memory: 4 warps on a [8, 4, 128] bf16 chunk read
    at 420 GB/s, 1 warp at 3.3 TB/s on H200), at least one per 4096 chunk elements (<= 128 a
    lane), at most 4."""
    block_s, block_h, block_dv = blocks
    return max(1, min(4, max(block_dv * elem_bytes // 512, -(-block_s * block_h * block_dv // 4096))))


def _next_pow2(x: int) -> int:
    return 1 << max(0, (max(1, x) - 1).bit_length())


def launch_combine(out: Tensor, lse: Tensor, sinks: Optional[Tensor], ws: Workspace, *,
                   grid: tuple[int, int, int], combine_args: dict, state=None) -> None:
    """Launch the combine kernel over ``grid`` = (query rows, head blocks, column blocks), reading
    the partials of ``ws``; ``combine_args``: the planned keyword arguments (tables, constexprs,
    :func:`pdl_launch`'s options; ``num_warps``, default 4); ``state`` as in :func:`launch_split`."""

    sk = sinks if sinks is not None else out
    os_, ls = out.stride(), lse.stride()
    values = (out, lse, sk, ws.o, ws.lse, out.shape[1], os_[0], os_[1], ls[0], ls[1],
              sinks.stride(0) if sinks is not None else 0) + ws.strides
    key = align_key(out, lse, sk) + ws.key + values[5:]
    launcher = (state or LaunchState(enabled=False)).launcher(
        "combine", _shard_attn_combine, lambda: {"num_warps": 4, **combine_args}, _COMBINE_PER_CALL)
    launcher(grid, values, key)


@triton.jit
def _pad_rows(Out, Lse, row0, num_heads, stride_om, stride_oh, stride_lm, stride_lh,
              HEAD_DIM_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_LSE: tl.constexpr):
    """Pad rows of a plan's output in one launch: program (r, head block, column block) writes 0
    into ``Out[row0 + r, heads, cols]`` and, in the first column block, -inf into
    ``Lse[row0 + r, heads]``."""
    r = (row0 + tl.program_id(0)).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    hmask = heads < num_heads
    mask = hmask[:, None] & (cols < HEAD_DIM_V)[None, :]
    tl.store(Out + r * stride_om + heads[:, None] * stride_oh + cols[None, :],
             tl.zeros([BLOCK_H, BLOCK_DV], dtype=Out.dtype.element_ty), mask=mask)
    if HAS_LSE:
        if tl.program_id(2) == 0:
            tl.store(Lse + r * stride_lm + heads * stride_lh, tl.full([BLOCK_H], float("-inf"), tl.float32),
                     mask=hmask)


#: Per-call arguments of the pad-row kernel.
_PAD_PER_CALL = ("Out", "Lse", "num_heads", "stride_om", "stride_oh", "stride_lm", "stride_lh", "HAS_LSE")
#: Elements one pad-row program writes (at most; fewer when a row holds fewer).
PAD_BLOCK = 4096


def pad_geometry(num_pad_rows: int, num_heads: int, head_dim_v: int) -> tuple[tuple[int, int, int], dict]:
    """(grid, constexprs) of :func:`launch_pad_rows` over ``num_pad_rows`` rows of ``num_heads`` x
    ``head_dim_v``: columns in blocks of up to 512, heads filling the rest of :data:`PAD_BLOCK`."""
    block_dv = min(_next_pow2(head_dim_v), 512)
    block_h = max(1, min(_next_pow2(num_heads), PAD_BLOCK // block_dv))
    grid = (num_pad_rows, -(-num_heads // block_h), -(-head_dim_v // block_dv))
    return grid, dict(HEAD_DIM_V=head_dim_v, BLOCK_H=block_h, BLOCK_DV=block_dv)


def launch_pad_rows(out: Tensor, lse: Optional[Tensor], row0: int, *, grid: tuple[int, int, int], pad_args: dict,
                    state=None) -> None:
    """Write a plan's pad rows ``[row0, row0 + grid[0])``: 0 in ``out`` [P, Hq, Dv] (last dim
    contiguous), -inf in ``lse`` [P, Hq] float32 when given; one launch (:func:`pad_geometry`
    gives ``grid`` and ``pad_args``). ``state`` as in :func:`launch_split`."""
    has_lse = lse is not None
    lt = lse if has_lse else out
    os_ = out.stride()
    ls = lse.stride() if has_lse else (0, 0)
    values = (out, lt, out.shape[1], os_[0], os_[1], ls[0], ls[1], has_lse)
    key = align_key(out, lt) + values[2:]
    launcher = (state or LaunchState(enabled=False)).launcher(
        "pad", _pad_rows, lambda: {"row0": row0, "num_warps": 4, **pad_args}, _PAD_PER_CALL)
    launcher(grid, values, key)


#: Per-call arguments of the fused merge kernel.
_MERGE_PER_CALL = ("Out", "Lse", "Parts", "PartLse", "num_parts", "num_heads", "stride_pc", "stride_pn", "stride_ph",
                   "stride_lc", "stride_ln", "stride_lh", "stride_on", "stride_oh", "stride_mn", "stride_mh")
#: Compiled merge kernels called directly (a memo of what the JIT compiled, one per geometry;
#: created on first use, holds no tensors), and each merge geometry's (grid, launch).
_MERGE_LAUNCHES = None
_MERGE_GEOMETRIES = None


def merge_parts(parts: Tensor, part_lse: Tensor, out: Tensor, lse: Tensor, *, num_sms: int,
                blocks: Optional[tuple[int, int, int]] = None) -> None:
    """Fused exact merge: ``parts`` [C, N, H, Dv] and ``part_lse`` [C, N, H] (any strides, last dim
    of ``parts`` contiguous, e.g. typed views into a received byte buffer) into ``out`` [N, H, Dv]
    and ``lse`` [N, H] float32 (both last dims contiguous). One launch, no sync; C >= 1, N > 0.
    ``blocks``: (BLOCK_S, BLOCK_H, BLOCK_DV) instead of :func:`merge_blocks`' choice (tests).
    After a geometry's first call the compiled kernel is called directly (planned launch; the
    geometry's grid and launcher are memoized, so a repeated call does no block-size work)."""
    global _MERGE_LAUNCHES, _MERGE_GEOMETRIES

    if _MERGE_LAUNCHES is None:
        _MERGE_LAUNCHES, _MERGE_GEOMETRIES = LaunchState(), LRU(64)
    c, n, h, dv = parts.shape
    # per device: a recorded direct launch holds the compiled function of the device it ran on
    geometry = (parts.device.index, c, n, h, dv, parts.element_size(), num_sms, blocks)
    found = _MERGE_GEOMETRIES.get(geometry)
    if found is None:
        block_s, block_h, block_dv = blocks or merge_blocks(c, h, dv, n, num_sms)
        grid = (n, -(-h // block_h), -(-dv // block_dv))
        one_pass = c <= block_s
        warps = merge_warps((block_s, block_h, block_dv), parts.element_size())
        launcher = _MERGE_LAUNCHES.launcher(
            ("merge", parts.device.index, dv, block_s, block_h, block_dv, one_pass, parts.element_size()), _merge_parts,
            lambda: dict(HEAD_DIM_V=dv, BLOCK_H=block_h, BLOCK_S=block_s, BLOCK_DV=block_dv, ONE_PASS=one_pass,
                         num_warps=warps),
            _MERGE_PER_CALL)
        found = _MERGE_GEOMETRIES.put(geometry, (grid, launcher))
    grid, launcher = found
    ps, ls, os_, ms = parts.stride(), part_lse.stride(), out.stride(), lse.stride()
    values = (out, lse, parts, part_lse, c, h, ps[0], ps[1], ps[2], ls[0], ls[1], ls[2], os_[0], os_[1], ms[0], ms[1])
    launcher(grid, values, align_key(out, lse, parts, part_lse) + values[4:])
