"""Triton DSA index scores of decode rows over one rank's key shard, and their exact top-k.

Two kernels per key chunk ``[j0, j0 + width)`` of this rank's local keys:

* **scores** (:func:`bind`): for query row ``t`` (sequence ``b``) and local key ``j`` of ``b``
  the kernel computes ``sum_h w[t, h] * relu(scale * k_scale[j] * q[t, h] . k[j])`` (relu keeps
  NaN) and writes its float32 bits in a monotone int32 order (:mod:`cpattn.selection`'s
  ``ordered``: -0.0 as +0.0, one NaN above +inf) into column ``j - j0`` of an int32 block ``[N,
  width]``; int32 min ("no key") where ``j >= visible[t]`` (the causal rule by global position: a
  row sees a prefix of its sequence's local keys). A decode step has few rows (1..4 per
  sequence), so the indexer heads are the M dimension of the dot (``[H_i, D_i] x [D_i,
  BLOCK_N]``, H_i = 64 for DeepSeek-V3.2): one program per (row, ``KEYS_PER_PROGRAM`` keys)
  keeps the row's queries in registers and reads each key of its range once. Keys are packed
  (``start[t] + j``) or paged (``page_table[b, j // page_size]``, slot ``j % page_size``); bf16 /
  fp16 (fp32 in the interpreter), fp8 e4m3 keys with a float32 scale (converted to the queries'
  dtype in registers, or an fp8 dot with fp8 queries; the dot settings are the prefill index
  kernel's, ``triton_index.dot_settings``).
* **top columns** (:func:`top_columns`): one program per row finds the row's ``k`` largest
  (score, lower column first) entries by radix selection over the 32-bit order (8-bit digits
  from the top: one histogram pass per digit, ending early once the threshold digit's count is
  exactly what is still needed), then writes them in one pass as packed keys
  ``(ordered << 32) | (2^32 - 1 - position)`` with the column's global position (a shard's
  positions rise with its columns, so "lower column" is the tie rule "lower position"), and
  :data:`~cpattn.selection.NO_KEY` for "no key" entries and for the columns ``[width, k)`` of a
  narrower chunk. The set is exactly what ``torch.topk`` over the packed keys selects; each
  score is read 2-5 times as 4 bytes where a ``torch.topk`` over packed keys reads 8-byte keys
  once per 8-bit radix pass.

Every count is read from device memory: a CUDA graph replays.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch
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
    j0, width, softmax_scale,
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
        # cpattn.selection's score order: -0.0 as +0.0, one NaN
        score = tl.where(score == 0.0, 0.0, score)
        score = tl.where(score != score, float("nan"), score)
        bits = score.to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        no_key = tl.full([BLOCK_N], -2147483648, dtype=tl.int32)
        tl.store(Scores + row * stride_om + cols, tl.where(valid, ordered, no_key), mask=in_chunk)


@triton.jit
def _row_top_k(
    Src, Out, j0, seg, total, part_len, k, cp_size, interleave, rank, stride_row, stride_seg, stride_om, stride_op,
    KEY_BITS: tl.constexpr, OUT_KEYS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Part ``program_id(1)`` of row ``program_id(0)``: the ``k`` largest of the row's entries
    ``[part * part_len, (part + 1) * part_len)`` (of ``total``; ties: the lower entry index),
    radix-selected 8 bits at a time from the top, written to ``Out + row * stride_om + part *
    stride_op``. Entry ``e`` of a row sits at ``Src + row * stride_row + (e // seg) * stride_seg
    + e % seg``.

    ``KEY_BITS`` 32: int32 ordered scores (int32 min = no key) of local keys ``j0 + e``; writes
    packed int64 keys ``(score << 32) | (2^32 - 1 - global position)`` (NO_KEY for "no key" and
    past the part's entries). ``KEY_BITS`` 64: int64 packed keys (unique but for NO_KEY); writes
    them (``OUT_KEYS``) or their int32 global positions (-1 for NO_KEY and past the entries)."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    e0 = part * part_len  # the part's first entry
    count = tl.minimum(part_len, total - e0)
    src = Src + row * stride_row
    dst = Out + row * stride_om + part.to(tl.int64) * stride_op
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    need = tl.minimum(k, count)  # entries still to choose at the threshold prefix
    prefix = tl.zeros([], dtype=tl.int64)  # (key >> shift) of the k-th largest, for the digits fixed so far
    final = tl.full([], KEY_BITS, dtype=tl.int32)  # the shift of the last digit fixed
    stop = count + 0  # 0 once the threshold digit holds exactly ``need`` entries: later passes are empty
    for rnd in tl.static_range(KEY_BITS // 8):
        shift = KEY_BITS - 8 - 8 * rnd  # a constexpr (static_range)
        hist = tl.zeros([256], dtype=tl.int32)
        for b in range(0, stop, BLOCK):
            ok = b + offs < count
            e = e0 + b + offs
            x = tl.load(src + (e // seg) * stride_seg + e % seg, mask=ok, other=0).to(tl.int64)
            if rnd == 0:  # the top digit: signed, offset to [0, 256)
                match = ok
                digit = ((x >> shift) + 128).to(tl.int32)
            else:
                match = ok & ((x >> (shift + 8)) == prefix)
                digit = ((x >> shift) & 255).to(tl.int32)
            # entries outside the prefix count in bin 0, then are taken out of it
            outside = tl.sum((~match).to(tl.int32), axis=0)
            hist += tl.histogram(tl.where(match, digit, 0), 256) - tl.where(bins == 0, outside, 0)
        if stop > 0:
            # the largest digit t with (entries of digit >= t) >= need: entries above t are all in
            at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
            t = tl.max(tl.where(at_least >= need, bins, -1), axis=0)
            need -= tl.sum(tl.where(bins > t, hist, 0), axis=0)
            if rnd == 0:
                prefix = (t - 128).to(tl.int64)
            else:
                prefix = prefix * 256 + t
            final = final * 0 + shift
            if tl.sum(tl.where(bins == t, hist, 0), axis=0) == need:
                stop = stop * 0
    # one pass: every entry above the prefix, and the first ``need`` (lowest index) at it
    ties = tl.zeros([], dtype=tl.int32)
    written = tl.zeros([], dtype=tl.int32)
    for b in range(0, count, BLOCK):
        ok = b + offs < count
        e = e0 + b + offs
        x = tl.load(src + (e // seg) * stride_seg + e % seg, mask=ok, other=0).to(tl.int64)
        top = x >> final
        tie = ok & (top == prefix)
        tie_rank = ties + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        take = (ok & (top > prefix)) | (tie & (tie_rank < need))
        at = written + tl.cumsum(take.to(tl.int32), axis=0) - 1
        if KEY_BITS == 32:
            j = j0 + e.to(tl.int64)
            gpos = (j // interleave) * (cp_size * interleave) + rank * interleave + j % interleave
            value = tl.where(x == -2147483648, -9223372036854775807 - 1, (x << 32) | (4294967295 - gpos))
        elif OUT_KEYS:
            value = x
        else:
            value = tl.where(x == -9223372036854775807 - 1, -1, 4294967295 - (x & 4294967295)).to(tl.int32)
        tl.store(dst + at, value, mask=take & (at < k))  # at < k holds; the mask keeps it in bounds regardless
        ties += tl.sum(tie.to(tl.int32), axis=0)
        written += tl.sum(take.to(tl.int32), axis=0)
    for b in range(0, k, BLOCK):  # fewer entries than k: the rest is "no key"
        i = b + offs
        pad = (i >= written) & (i < k)
        if KEY_BITS == 32 or OUT_KEYS:
            tl.store(dst + i, tl.full([BLOCK], -9223372036854775807 - 1, dtype=tl.int64), mask=pad)
        else:
            tl.store(dst + i, tl.full([BLOCK], -1, dtype=tl.int32), mask=pad)


#: Per-call arguments of the score kernel, in the order of a launch's ``values`` (the constexprs and
#: launch options of the plan are fixed at its first call).
_PER_CALL = ("Q", "K", "W", "KScale", "Scores", "PageTable", "row_seq", "row_visible", "row_start", "j0", "width",
             "softmax_scale", "stride_qm", "stride_qh", "stride_wm", "stride_wh",
             "stride_kp", "stride_kn", "stride_sp", "stride_sn", "stride_pt", "stride_om", "PAGED", "HAS_KSCALE")


def bind(q: Tensor, k: Tensor, w: Tensor, k_scale, scores: Tensor, page_table, row_seq: Tensor,
         row_visible: Tensor, row_start: Tensor, softmax_scale: float, *,
         plan_args: dict, state: Optional[LaunchState] = None) -> Callable[[int], None]:
    """One call's score launches: ``bind(...)(j0)`` writes the ordered int32 scores of the key
    chunk ``[j0, j0 + width)`` into ``scores`` [N, width] int32 (contiguous rows). Everything but
    ``j0`` is bound once per call. ``row_seq`` / ``row_visible`` / ``row_start`` [N]: sequence,
    visible local keys and packed start of every row. ``plan_args``: the constexprs and ``KEYS_PER_PROGRAM``, ``num_warps``,
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
    tail = (width, float(softmax_scale), q.stride(0), q.stride(1), w.stride(0), w.stride(1), skp, skn, ssp,
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


#: Per-call arguments of the row top-k kernel (its ``KEY_BITS``, ``OUT_KEYS``, ``BLOCK`` and launch
#: options are fixed per launcher).
_SELECT_PER_CALL = ("Src", "Out", "j0", "seg", "total", "part_len", "k", "cp_size", "interleave", "rank",
                    "stride_row", "stride_seg", "stride_om", "stride_op")


def top_columns(scores: Tensor, out: Tensor, sharding: tuple[int, int, int], *, select_args: dict,
                state: Optional[LaunchState] = None) -> Callable[[int], None]:
    """One call's selections: ``top_columns(...)(j0)`` writes, for every row of ``scores`` [N,
    width] int32 (the chunk ``[j0, j0 + width)`` the score launch of :func:`bind` wrote) and each
    of its ``P`` parts of ``ceil(width / P)`` columns, the part's ``k`` best entries as packed keys
    into ``out`` [N, P, k] int64 (unordered; :data:`~cpattn.selection.NO_KEY` padding): one
    program per (row, part). ``sharding``: (C, I, rank) (local key -> global position).
    ``select_args``: ``BLOCK``, ``num_warps``, ``num_stages``. ``state``: as :func:`bind`'s."""
    n, width = scores.shape
    _, parts, k = out.shape
    if n == 0 or k == 0:
        return lambda j0: None
    part_len = -(-width // parts)
    head = (scores, out)
    tail = (max(width, 1), width, part_len, k, *sharding, scores.stride(0), 0, out.stride(0), out.stride(1))
    key_head = align_key(*head)
    launcher = (state or LaunchState(enabled=False)).launcher(
        "top_columns", _row_top_k, lambda: dict(select_args, KEY_BITS=32, OUT_KEYS=True), _SELECT_PER_CALL)

    def select_chunk(j0: int) -> None:
        launcher((n, parts), head + (j0,) + tail, key_head + int_key(j0) + tail)

    return select_chunk


def top_candidates(candidates: Tensor, out: Tensor, *, select_args: dict,
                   state: Optional[LaunchState] = None) -> None:
    """The exact top-k of packed keys gathered in ``C`` blocks: ``candidates`` int64 [C, N, m]
    (any strides but a unit column stride: every rank's candidates as the all-gather delivers
    them, or a row's parts) -> ``out`` [N, k]: int32 global positions (-1 where fewer than ``k``
    keys exist) or, for an int64 ``out``, the packed keys (NO_KEY padding); unordered. One
    program per row. ``select_args``, ``state``: as :func:`top_columns`'s."""
    c, n, m = candidates.shape
    k = out.shape[1]
    if n == 0 or k == 0:
        return
    keys = out.dtype == torch.int64
    head = (candidates, out)
    tail = (max(m, 1), c * m, c * m, k, 1, 1, 0, candidates.stride(1), candidates.stride(0), out.stride(0), 0)
    launcher = (state or LaunchState(enabled=False)).launcher(
        "top_keys" if keys else "top_positions", _row_top_k, lambda: dict(select_args, KEY_BITS=64, OUT_KEYS=keys),
        _SELECT_PER_CALL)
    launcher((n, 1), head + (0,) + tail, align_key(*head) + int_key(0) + tail)
