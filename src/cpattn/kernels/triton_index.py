"""Triton DSA index scores: the lightning indexer's logits for a chunk of local rows, written as
packed top-k keys.

For query row ``t`` (position ``p``) and key position ``s`` of its sequence the kernel computes
``sum_h w[t, h] * relu(scale * k_scale[s] * q[t, h] . k[s])`` (relu keeps NaN) and writes it,
packed with ``s`` as :mod:`cpattn.selection` packs them (one int64:
``(ordered(score) << 32) | (2^32 - 1 - s)``), into its piece's int64 block ``[rows, width]`` of a
launch group's buffer, whose column ``j`` is key position ``p_lo + j`` ("no key", int64 min,
where ``s > p``: the causal rule); then the backend (:mod:`.dsa_backend`) takes ``torch.topk`` of
each row: one top-k over packed keys selects the best scores with ties to the LOWER position, the
same set as the torch reference. A launch covers one group's entries (a
query tile in one piece: a chunk's rows over one key window). A program handles one entry
(``BLOCK_M`` consecutive rows of one segment, so they share a sequence and one key block serves
them all) and ``KEYS_PER_PROGRAM`` key positions: per key block it loads
K once, then for each indexer head a ``[BLOCK_M, D] x [D, BLOCK_N]`` dot whose relu, weighted by
the head's per-row weights, accumulates into the block's scores (no cross-warp reduction: heads
are a loop, rows are M). Key blocks past the tile's last position are not computed, only filled
with "no key". Index keys are packed (``cu_kv_lens[seq] + s``) or paged; bf16 / fp16 (fp32 in
the interpreter), and fp8 e4m3 keys (dequantized by ``k_scale``) with fp8 (fp8 dot) or
bf16 / fp16 queries (keys converted in registers).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._attn_steps import key_offsets
from ._launch import COMPILE_OPTIONS, scratch_allocator
from ._tiles import SM90_SMEM_PER_BLOCK, index_key_strides

#: True when the kernels were built for the CPU interpreter (TRITON_INTERPRET=1 at import).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

FP8 = torch.float8_e4m3fn


def dot_settings(q_dtype: torch.dtype, k_dtype: torch.dtype) -> dict:
    """DOT_PRECISION / DOT_UPCAST / K_TO_Q: fp32 is exact ("ieee"); under the interpreter bf16
    and fp8 operands are upcast to fp32 (its narrow dots are wrong; the products are exact);
    fp8 keys with bf16 / fp16 queries are converted to the query dtype (K_TO_Q)."""
    upcast = INTERPRETED and (q_dtype in (torch.bfloat16, FP8) or k_dtype in (torch.bfloat16, FP8))
    exact = upcast or q_dtype == torch.float32
    return dict(DOT_PRECISION="ieee" if exact else "tf32", DOT_UPCAST=upcast,
                K_TO_Q=not upcast and k_dtype != q_dtype)


def _configs() -> list:
    return [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bn in (128, 256) for w in (4, 8) for s in (3, 2)]


def _autotune_enabled() -> bool:
    return os.environ.get("CPATTN_TRITON_AUTOTUNE", "1") != "0"


def _prune_configs(configs, named_args, **kwargs):
    """Keep configs whose K block, q stages and score accumulators fit (shared memory and
    <= 128 fp32 accumulator registers per thread for the two [BLOCK_M, BLOCK_N] tiles; the packed
    int64 keys are stored in two halves of BLOCK_N / 2 columns, so their staging takes what a
    float32 block would: ptxas reports 98832 bytes for the default config either way, no spills,
    tools/dsa_offline_check.py). Without
    autotuning (``CPATTN_TRITON_AUTOTUNE=0``) the first one kept: (128, 4 warps, 3 stages), one
    warpgroup per 64-row tile, no spills on sm_90; measured on H200 (DeepSeek-V3.2 indexer, rank
    0 of interleave C = 8) 1.22x / 1.25x faster than (128, 8 warps, 2 stages) at 32k / 128k."""
    arg = lambda name: named_args.get(name, kwargs.get(name))  # noqa: E731
    bd, bm, kpp = arg("BLOCK_D"), arg("BLOCK_M"), arg("KEYS_PER_PROGRAM")
    kept = []
    for c in configs:
        bn, stages, warps = c.kwargs["BLOCK_N"], c.num_stages, c.num_warps
        if kpp % bn:
            continue
        smem = bn * bd * 2 + stages * bm * bd * 2 + bm * bn * 4  # K block, q stages, half-block int64 staging
        if smem > SM90_SMEM_PER_BLOCK or 2 * bm * bn // (32 * warps) > 128:
            continue
        kept.append(c)
    kept = kept or [min(configs, key=lambda c: (c.kwargs["BLOCK_N"], c.num_stages))]
    return kept if _autotune_enabled() else kept[:1]


@triton.jit
def _index_scores_fwd(
    Q, K, W, KScale, Scores, PageTable,
    tile_row0, tile_len, tile_pos0, tile_stride, tile_seq, tile_kv_start,
    entry_tile, entry_piece, piece_row0, piece_plo, piece_width, piece_base,
    entry_base, softmax_scale, num_rows, num_key_rows,
    stride_qm, stride_qh, stride_wm, stride_wh,
    stride_kp, stride_kn, stride_sp, stride_sn, stride_pt,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    KEYS_PER_PROGRAM: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_KSCALE: tl.constexpr,
    K_DESC_OK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, K_TO_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_STAGES: tl.constexpr = 3,
):
    e = entry_base + tl.program_id(0)
    t = tl.load(entry_tile + e)
    piece = tl.load(entry_piece + e)
    p_lo = tl.load(piece_plo + piece)
    width = tl.load(piece_width + piece)
    split = tl.program_id(1)
    if split * KEYS_PER_PROGRAM >= width:  # the group's widest piece sets the grid
        return
    chunk_row0 = tl.load(piece_row0 + piece)
    Scores += tl.load(piece_base + piece)  # the piece's [rows, width] int64 block of the group buffer
    stride_om = width
    row0 = tl.load(tile_row0 + t)
    n = tl.load(tile_len + t)
    pos0 = tl.load(tile_pos0 + t)
    pstride = tl.load(tile_stride + t)
    seq = tl.load(tile_seq + t)
    kv_start = tl.load(tile_kv_start + t)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < n
    d_ok = offs_d < HEAD_DIM
    rows = (row0 + offs_m).to(tl.int64)
    pos = pos0 + offs_m * pstride
    max_pos = pos0 + (n - 1) * pstride

    k_start = p_lo + split * KEYS_PER_PROGRAM
    k_stop = tl.minimum(p_lo + width, k_start + KEYS_PER_PROGRAM)
    c_stop = tl.minimum(k_stop, max_pos + 1)  # keys past the tile's last position: "no key" only
    # the chunk's score rows of this tile as a [tile end, width] matrix: stores clip at the tile's
    # last row (the next tile's rows follow) and at the chunk's width
    out_row0 = (row0 - chunk_row0).to(tl.int32)
    HALF_N: tl.constexpr = BLOCK_N // 2  # keys are stored in two halves: half the int64 staging in shared memory
    out_desc = tl.make_tensor_descriptor(Scores, shape=[out_row0 + n, width], strides=[stride_om, 1],
                                         block_shape=[BLOCK_M, HALF_N])
    pt_row = PageTable + seq.to(tl.int64) * stride_pt
    # q of one head: a [BLOCK_M, D] box of the [P, H, D] tensor (TMA on sm_90; no pointer tensor
    # kept live across the loops). Rows past P read 0; rows past the tile are computed, not stored.
    q_desc = tl.make_tensor_descriptor(Q, shape=[num_rows, NUM_HEADS, HEAD_DIM], strides=[stride_qm, stride_qh, 1],
                                       block_shape=[BLOCK_M, 1, BLOCK_D])
    w_rows = W + rows * stride_wm
    USE_K_DESC: tl.constexpr = K_DESC_OK and ((not PAGED) or PAGE_SIZE % BLOCK_N == 0)
    if USE_K_DESC:  # packed rows, or the pages as one [num_pages * page_size, D] matrix
        k_desc = tl.make_tensor_descriptor(K, shape=[num_key_rows, HEAD_DIM], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
    else:
        k_desc = q_desc

    for kb in range(k_start, c_stop, BLOCK_N):
        kpos = kb + offs_n
        in_key = kpos < c_stop
        k_off, s_off = key_offsets(pt_row, kpos, in_key, kv_start, stride_kp, stride_kn, stride_sp, stride_sn,
                                   PAGED, PAGE_SIZE)
        if USE_K_DESC:  # one [BLOCK_N, D] box of consecutive key rows (keys past the range are masked below)
            if PAGED:
                first = (tl.load(pt_row + kb // PAGE_SIZE).to(tl.int64) * PAGE_SIZE + kb % PAGE_SIZE).to(tl.int32)
            else:
                first = (kv_start + kb).to(tl.int32)
            k = k_desc.load([first, 0])
        else:
            k = tl.load(K + k_off[:, None] + offs_d[None, :], mask=in_key[:, None] & d_ok[None, :], other=0.0)
        if DOT_UPCAST:
            k = k.to(tl.float32)
        elif K_TO_Q:
            k = k.to(Q.dtype.element_ty)
        kt = tl.trans(k)
        if HAS_KSCALE:
            col_scale = tl.load(KScale + s_off, mask=in_key, other=0.0).to(tl.float32) * softmax_scale
        else:
            col_scale = tl.full([BLOCK_N], 1.0, dtype=tl.float32) * softmax_scale
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for h in tl.range(NUM_HEADS, num_stages=HEAD_STAGES):
            q = tl.reshape(q_desc.load([row0, h, 0]), [BLOCK_M, BLOCK_D])
            if DOT_UPCAST:
                q = q.to(tl.float32)
            w = tl.load(w_rows + h * stride_wh, mask=m_ok, other=0.0).to(tl.float32)
            s = tl.dot(q, kt, input_precision=DOT_PRECISION) * col_scale[None, :]
            acc += tl.maximum(s, 0.0, propagate_nan=tl.PropagateNan.ALL) * w[:, None]  # relu keeps NaN
        # the packed (score, position) key of cpattn.selection: -0.0 as +0.0, one NaN
        acc = tl.where(acc == 0.0, 0.0, acc)
        acc = tl.where(acc != acc, float("nan"), acc)
        bits = acc.to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
        key = (ordered << 32) | (4294967295 - kpos.to(tl.int64))[None, :]
        key = tl.where(kpos[None, :] <= pos[:, None], key, -9223372036854775807 - 1)
        lo, hi = tl.split(tl.permute(tl.reshape(key, [BLOCK_M, 2, HALF_N]), (0, 2, 1)))  # columns [0, N/2), [N/2, N)
        out_desc.store([out_row0, (kb - p_lo).to(tl.int32)], lo)
        out_desc.store([out_row0, (kb - p_lo + HALF_N).to(tl.int32)], hi)

    fill = k_start + tl.cdiv(tl.maximum(c_stop - k_start, 0), BLOCK_N) * BLOCK_N
    no_key = tl.full([BLOCK_M, HALF_N], -9223372036854775807 - 1, dtype=tl.int64)
    for kb in range(fill, k_stop, HALF_N):
        out_desc.store([out_row0, (kb - p_lo).to(tl.int32)], no_key)


_index_scores_fwd_tuned = triton.autotune(
    configs=_configs(),
    key=["NUM_HEADS", "HEAD_DIM", "BLOCK_M", "KEYS_PER_PROGRAM", "PAGED", "PAGE_SIZE", "HAS_KSCALE"],
    prune_configs_by={"early_config_prune": _prune_configs},
)(_index_scores_fwd)


def tuned_configs() -> dict:
    """The autotuner's choice per key so far (for benchmarks and notes)."""
    return {str(key): str(cfg) for key, cfg in getattr(_index_scores_fwd_tuned, "cache", {}).items()}


def launch(
    q: Tensor, k: Tensor, w: Tensor, k_scale, scores: Tensor, page_table, *, grid: tuple[int, int],
    plan_args: dict, entry_base: int, softmax_scale: float, config=None,
) -> None:
    """Scores of one launch group: entries ``[entry_base, entry_base + grid[0])`` of the plan's
    entry table (a query tile in one piece: a chunk's rows over one key window), each written
    into its piece's ``[rows, width]`` block of ``scores`` (int64 packed keys, flat; block at
    element ``piece_base``, column j = key position ``p_lo + j``). ``grid[1]``: key splits of the widest
    piece. ``config`` = (BLOCK_N, num_warps, num_stages) bypasses the autotuner."""
    paged = page_table is not None
    skp, skn, ssp, ssn, pt, stride_pt = index_key_strides(k, k_scale, page_table, plan_args["tile_seq"])
    args = dict(
        Q=q, K=k, W=w, KScale=k_scale if k_scale is not None else scores, Scores=scores, PageTable=pt,
        entry_base=entry_base, softmax_scale=float(softmax_scale),
        num_rows=q.shape[0], num_key_rows=k.shape[0] * (k.shape[1] if paged else 1), K_DESC_OK=k_layout_ok(k),
        stride_qm=q.stride(0), stride_qh=q.stride(1), stride_wm=w.stride(0), stride_wh=w.stride(1),
        stride_kp=skp, stride_kn=skn, stride_sp=ssp, stride_sn=ssn, stride_pt=stride_pt,
        HAS_KSCALE=k_scale is not None, **plan_args,
    )
    with scratch_allocator("cpu" if INTERPRETED else "cuda"):
        if INTERPRETED or config is not None:
            bn, warps, stages = config if config is not None else (16, 4, 1)
            _index_scores_fwd[grid](**args, BLOCK_N=bn, num_warps=warps, num_stages=stages, **COMPILE_OPTIONS)
        else:
            _index_scores_fwd_tuned[grid](**args, **COMPILE_OPTIONS)


@triton.jit
def _write_selection(Keys, Out, cols, stride_k, stride_om, stride_on, BLOCK: tl.constexpr):
    """``Out[r, j]`` = the position of packed key ``Keys[r, j]`` (int32), or -1 for "no key"."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < cols
    key = tl.load(Keys + r * stride_k + offs, mask=ok, other=0)
    pos = 4294967295 - (key & 4294967295)
    tl.store(Out + r * stride_om + offs.to(tl.int64) * stride_on,
             tl.where(key == -9223372036854775807 - 1, -1, pos).to(tl.int32), mask=ok)


def write_selection(keys: Tensor, out: Tensor) -> None:
    """One launch turning ``torch.topk``'s packed keys into positions: the first k columns of
    ``out`` [rows, >= k] int32 (any strides) = the positions of ``keys`` int64 [rows, k]
    (contiguous rows), -1 for "no key" (:func:`cpattn.selection.key_positions` in one launch)."""
    rows, cols = keys.shape
    if rows == 0 or cols == 0:
        return
    block = 512 if not INTERPRETED else 64
    _write_selection[(rows, triton.cdiv(cols, block))](keys, out, cols, keys.stride(0), out.stride(0), out.stride(1),
                                                      BLOCK=block, num_warps=4, **COMPILE_OPTIONS)


def k_layout_ok(k: Tensor) -> bool:
    """Index keys readable as one [rows, D] matrix through a tensor descriptor: 16-byte aligned
    base and row stride, pages (paged [num_pages, page_size, D]) adjacent."""
    elt = k.element_size()
    if k.dim() == 3 and k.stride(0) != k.shape[1] * k.stride(1):
        return False
    return k.data_ptr() % 16 == 0 and (k.stride(-2) * elt) % 16 == 0 and k.stride(-1) == 1 and \
        k.shape[-1] * elt >= 16


def q_layout_ok(q: Tensor) -> bool:
    """The q tensor descriptor needs a 16-byte aligned base and row / head strides."""
    elt = q.element_size()
    return q.data_ptr() % 16 == 0 and (q.stride(0) * elt) % 16 == 0 and (q.stride(1) * elt) % 16 == 0 \
        and q.stride(2) == 1
