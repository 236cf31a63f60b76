"""Triton DSA index scores: the lightning indexer's logits for a chunk of local rows.

For query row ``t`` (position ``p``) and key position ``s`` of its sequence the kernel writes
``sum_h w[t, h] * relu(scale * k_scale[s] * q[t, h] . k[s])`` into a float32 score buffer
``[rows, width]`` whose column ``j`` is key position ``p_lo + j`` (``-inf`` where ``s > p``: the
causal rule), then the backend (:mod:`.dsa_backend`) takes ``torch.topk`` of each row. A program
handles one query tile (``BLOCK_M`` consecutive rows of one segment, so they share a sequence
and one key block serves them all) and ``KEYS_PER_PROGRAM`` key positions: per key block it loads
K once, then for each indexer head a ``[BLOCK_M, D] x [D, BLOCK_N]`` dot whose relu, weighted by
the head's per-row weights, accumulates into the block's scores (no cross-warp reduction: heads
are a loop, rows are M). Key blocks past the tile's last position are not computed, only filled
with ``-inf``. Index keys are packed (``cu_kv_lens[seq] + s``) or paged; bf16 / fp16 (fp32 in
the interpreter), and fp8 e4m3 keys (dequantized by ``k_scale``) with fp8 (fp8 dot) or
bf16 / fp16 queries (keys converted in registers).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._tiles import SM90_SMEM_PER_BLOCK

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
            for bn in (128, 64, 256) for w in (4, 8) for s in (3, 2, 4)]


def _prune_configs(configs, named_args, **kwargs):
    """Keep configs whose K block, q stages and score accumulators fit (shared memory and
    <= 128 fp32 accumulator registers per thread for the two [BLOCK_M, BLOCK_N] tiles)."""
    arg = lambda name: named_args.get(name, kwargs.get(name))  # noqa: E731
    bd, bm, kpp = arg("BLOCK_D"), arg("BLOCK_M"), arg("KEYS_PER_PROGRAM")
    kept = []
    for c in configs:
        bn, stages, warps = c.kwargs["BLOCK_N"], c.num_stages, c.num_warps
        if kpp % bn:
            continue
        smem = bn * bd * 2 + stages * bm * bd * 2
        if smem > SM90_SMEM_PER_BLOCK or 2 * bm * bn // (32 * warps) > 128:
            continue
        kept.append(c)
    return kept or [min(configs, key=lambda c: (c.kwargs["BLOCK_N"], c.num_stages))]


@triton.jit
def _index_scores_fwd(
    Q, K, W, KScale, Scores, PageTable,
    tile_row0, tile_len, tile_pos0, tile_stride, tile_seq, tile_kv_start,
    tile_base, chunk_row0, p_lo, width, softmax_scale,
    stride_qm, stride_qh, stride_wm, stride_wh,
    stride_kp, stride_kn, stride_sp, stride_sn, stride_om, stride_pt,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    KEYS_PER_PROGRAM: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_KSCALE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, K_TO_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tile_base + tl.program_id(0)
    split = tl.program_id(1)
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
    c_stop = tl.minimum(k_stop, max_pos + 1)  # keys past the tile's last position: -inf only
    out_rows = Scores + (rows - chunk_row0)[:, None] * stride_om
    pt_row = PageTable + seq.to(tl.int64) * stride_pt
    q_rows = Q + rows[:, None] * stride_qm + offs_d[None, :]
    w_rows = W + rows * stride_wm

    for kb in range(k_start, c_stop, BLOCK_N):
        kpos = kb + offs_n
        in_key = kpos < c_stop
        if PAGED:
            page = tl.load(pt_row + kpos // PAGE_SIZE, mask=in_key, other=0).to(tl.int64)
            slot = (kpos % PAGE_SIZE).to(tl.int64)
            k_off = page * stride_kp + slot * stride_kn
            s_off = page * stride_sp + slot * stride_sn
        else:
            k_off = (kv_start + kpos).to(tl.int64) * stride_kn
            s_off = (kv_start + kpos).to(tl.int64) * stride_sn
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
        for h in range(NUM_HEADS):
            q = tl.load(q_rows + h * stride_qh, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
            if DOT_UPCAST:
                q = q.to(tl.float32)
            w = tl.load(w_rows + h * stride_wh, mask=m_ok, other=0.0).to(tl.float32)
            s = tl.dot(q, kt, input_precision=DOT_PRECISION) * col_scale[None, :]
            acc += tl.maximum(s, 0.0) * w[:, None]
        acc = tl.where(kpos[None, :] <= pos[:, None], acc, float("-inf"))
        tl.store(out_rows + (kpos - p_lo)[None, :], acc, mask=m_ok[:, None] & (kpos < k_stop)[None, :])

    fill = k_start + tl.cdiv(tl.maximum(c_stop - k_start, 0), BLOCK_N) * BLOCK_N
    neg = tl.full([BLOCK_M, BLOCK_N], float("-inf"), dtype=tl.float32)
    for kb in range(fill, k_stop, BLOCK_N):
        kpos = kb + offs_n
        tl.store(out_rows + (kpos - p_lo)[None, :], neg, mask=m_ok[:, None] & (kpos < k_stop)[None, :])


_index_scores_fwd_tuned = triton.autotune(
    configs=_configs(),
    key=["NUM_HEADS", "HEAD_DIM", "BLOCK_M", "KEYS_PER_PROGRAM", "PAGED", "PAGE_SIZE", "HAS_KSCALE"],
    prune_configs_by={"early_config_prune": _prune_configs},
)(_index_scores_fwd)


def launch(
    q: Tensor, k: Tensor, w: Tensor, k_scale, scores: Tensor, page_table, *, grid: tuple[int, int],
    plan_args: dict, tile_base: int, chunk_row0: int, p_lo: int, width: int, softmax_scale: float,
    config=None,
) -> None:
    """Scores of one chunk's tiles ``[tile_base, tile_base + grid[0])`` over key positions
    ``[p_lo, p_lo + width)`` into ``scores`` [rows, width] (row ``r`` = physical row
    ``chunk_row0 + r``). ``config`` = (BLOCK_N, num_warps, num_stages) bypasses the autotuner."""
    paged = page_table is not None
    if paged:
        skp, skn = k.stride(0), k.stride(1)
        ssp, ssn = (k_scale.stride(0), k_scale.stride(1)) if k_scale is not None else (0, 0)
        pt, stride_pt = page_table, page_table.stride(0)
    else:
        skp, skn = 0, k.stride(0)
        ssp, ssn = (0, k_scale.stride(0)) if k_scale is not None else (0, 0)
        pt, stride_pt = plan_args["tile_seq"], 0
    args = dict(
        Q=q, K=k, W=w, KScale=k_scale if k_scale is not None else scores, Scores=scores, PageTable=pt,
        tile_base=tile_base, chunk_row0=chunk_row0, p_lo=p_lo, width=width, softmax_scale=float(softmax_scale),
        stride_qm=q.stride(0), stride_qh=q.stride(1), stride_wm=w.stride(0), stride_wh=w.stride(1),
        stride_kp=skp, stride_kn=skn, stride_sp=ssp, stride_sn=ssn, stride_om=scores.stride(0), stride_pt=stride_pt,
        HAS_KSCALE=k_scale is not None, **plan_args,
    )
    if INTERPRETED or config is not None:
        bn, warps, stages = config if config is not None else (16, 4, 1)
        _index_scores_fwd[grid](**args, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    else:
        _index_scores_fwd_tuned[grid](**args)
