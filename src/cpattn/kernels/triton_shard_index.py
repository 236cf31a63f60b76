"""Triton DSA index scores of decode rows over one rank's key shard, written as packed top-k keys.

For query row ``t`` (sequence ``b``) and this rank's local key ``j`` of ``b`` the kernel computes
``sum_h w[t, h] * relu(scale * k_scale[j] * q[t, h] . k[j])`` (relu keeps NaN) and writes it,
packed with the key's global position as :mod:`cpattn.selection` packs them (one int64:
``(ordered(score) << 32) | (2^32 - 1 - position)``), into column ``j - j0`` of row ``t`` of an
int64 block ``[N, width]`` (one key chunk); "no key" (int64 min) where ``j >= visible[t]`` (the
causal rule by global position: a row sees a prefix of its sequence's local keys). A decode step
has few rows (1..4 per sequence), so the indexer heads are the M dimension of the dot (``[H_i,
D_i] x [D_i, BLOCK_N]``, H_i = 64 for DeepSeek-V3.2): one program per (row, ``KEYS_PER_PROGRAM``
keys) keeps the row's queries in registers and reads each key of its range once. Keys are
packed (``start[t] + j``) or paged (``page_table[b, j // page_size]``, slot ``j % page_size``);
bf16 / fp16 (fp32 in the interpreter), fp8 e4m3 keys with a float32 scale (converted to the
queries' dtype in registers, or an fp8 dot with fp8 queries; the dot settings are the prefill
index kernel's, ``triton_index.dot_settings``). Every count is read from device memory: a CUDA graph replays.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import triton
import triton.language as tl
from torch import Tensor

from ._attn_steps import key_offsets
from ._launch import LaunchState, align_key, int_key
from ._tiles import index_key_strides

#: True when the kernels were built for the CPU interpreter (TRITON_INTERPRET=1 at import).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

def block_sizes(num_heads: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_H, BLOCK_D): powers of two >= 16 covering the heads and the head dim."""
    return max(16, triton.next_power_of_2(num_heads)), max(16, triton.next_power_of_2(head_dim))


@triton.jit
def _shard_index_scores(
    Q, K, W, KScale, Scores, PageTable, row_seq, row_visible, row_start,
    j0, width, softmax_scale, cp_size, interleave, rank,
    stride_qm, stride_qh, stride_wm, stride_wh, stride_kp, stride_kn, stride_sp, stride_sn, stride_pt, stride_om,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, KEYS_PER_PROGRAM: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_KSCALE: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, K_TO_Q: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c0 = tl.program_id(1) * KEYS_PER_PROGRAM
    seq = tl.load(row_seq + row).to(tl.int64)
    visible = tl.load(row_visible + row)
    start = tl.load(row_start + row).to(tl.int64)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < NUM_HEADS
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + row * stride_qm + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_UPCAST:
        q = q.to(tl.float32)
    w = tl.load(W + row * stride_wm + offs_h * stride_wh, mask=h_ok, other=0.0).to(tl.float32)
    pt_row = PageTable + seq * stride_pt
    for kb in range(0, KEYS_PER_PROGRAM, BLOCK_N):
        cols = c0 + kb + offs_n  # columns of the chunk
        in_chunk = cols < width
        j = j0 + cols  # local key indices
        valid = in_chunk & (j < visible)
        k_off, s_off = key_offsets(pt_row, j, valid, start, stride_kp, stride_kn, stride_sp, stride_sn, PAGED, PAGE_SIZE)
        k = tl.load(K + k_off[:, None] + offs_d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
        if DOT_UPCAST:
            k = k.to(tl.float32)
        elif K_TO_Q:
            k = k.to(Q.dtype.element_ty)
        if HAS_KSCALE:
            col_scale = tl.load(KScale + s_off, mask=valid, other=0.0).to(tl.float32) * softmax_scale
        else:
            col_scale = tl.full([BLOCK_N], 1.0, dtype=tl.float32) * softmax_scale
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * col_scale[None, :]  # [BLOCK_H, BLOCK_N]
        s = tl.maximum(s, 0.0, propagate_nan=tl.PropagateNan.ALL)  # relu keeps NaN
        score = tl.sum(s * w[:, None], axis=0)
        # the packed (score, global position) key of cpattn.selection: -0.0 as +0.0, one NaN
        score = tl.where(score == 0.0, 0.0, score)
        score = tl.where(score != score, float("nan"), score)
        bits = score.to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
        gpos = (j // interleave) * (cp_size * interleave) + rank * interleave + j % interleave
        key = (ordered << 32) | (4294967295 - gpos.to(tl.int64))
        no_key = tl.full([BLOCK_N], -9223372036854775807 - 1, dtype=tl.int64)
        tl.store(Scores + row * stride_om + cols, tl.where(valid, key, no_key), mask=in_chunk)


#: Per-call arguments of the score kernel, in the order of a launch's ``values`` (the constexprs and
#: launch options of the plan are fixed at its first call).
_PER_CALL = ("Q", "K", "W", "KScale", "Scores", "PageTable", "row_seq", "row_visible", "row_start", "j0", "width",
             "softmax_scale", "cp_size", "interleave", "rank", "stride_qm", "stride_qh", "stride_wm", "stride_wh",
             "stride_kp", "stride_kn", "stride_sp", "stride_sn", "stride_pt", "stride_om", "PAGED", "HAS_KSCALE")


def bind(q: Tensor, k: Tensor, w: Tensor, k_scale, scores: Tensor, page_table, row_seq: Tensor,
         row_visible: Tensor, row_start: Tensor, softmax_scale: float, sharding: tuple[int, int, int], *,
         plan_args: dict, state: Optional[LaunchState] = None) -> Callable[[int], None]:
    """One call's score launches: ``bind(...)(j0)`` writes the packed keys of the key chunk
    ``[j0, j0 + width)`` into ``scores`` [N, width] int64 (contiguous rows). Everything but ``j0``
    is bound once per call. ``row_seq`` / ``row_visible`` / ``row_start`` [N]: sequence, visible
    local keys and packed start of every row; ``sharding``: (C, I, rank) (local key -> global
    position). ``plan_args``: the constexprs and ``KEYS_PER_PROGRAM``, ``num_warps``,
    ``num_stages``. ``state``: the plan's :class:`~cpattn.kernels._launch.LaunchState` (after the
    first call of a kind, the compiled kernel is called directly; None: every call through the
    JIT)."""
    n, width = scores.shape
    if n == 0 or width == 0:
        return lambda j0: None
    paged = page_table is not None
    skp, skn, ssp, ssn, pt, stride_pt = index_key_strides(k, k_scale, page_table, row_seq)
    ks = k_scale if k_scale is not None else scores  # never read without HAS_KSCALE
    head = (q, k, w, ks, scores, pt, row_seq, row_visible, row_start)
    tail = (width, float(softmax_scale), *sharding, q.stride(0), q.stride(1), w.stride(0), w.stride(1), skp, skn, ssp,
            ssn, stride_pt, scores.stride(0), paged, k_scale is not None)
    # j0 steps through the chunks: keyed on what the JIT specializes, not its value (softmax_scale,
    # a float, is not specialized)
    key_head, key_tail = align_key(*head), (width,) + tail[2:]
    launcher = (state or LaunchState(enabled=False)).launcher("scores", _shard_index_scores, lambda: plan_args,
                                                              _PER_CALL)
    grid = (n, triton.cdiv(width, plan_args["KEYS_PER_PROGRAM"]))

    def score_chunk(j0: int) -> None:
        launcher(grid, head + (j0,) + tail, key_head + int_key(j0) + key_tail)

    return score_chunk
