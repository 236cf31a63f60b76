"""Triton device helpers shared by the portable, split-KV and portable sparse attention kernels
and the DSA index scorers (device functions, no launch of their own): the query tile's load, the
KV head's base pointers, key row offsets, the base-2 online-softmax step and the final
normalization.

Every helper is inlined where it is called, so a kernel compiles to the code it had with the
helper's body written in place.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._fp8_tiles import tile_values


@triton.jit
def _entries(row_ok, col_ok, COL_MASK: tl.constexpr):
    """The [M, N] mask of rows ``row_ok`` [M] (and with COL_MASK, columns ``col_ok`` [N])."""
    if COL_MASK:
        mask = row_ok[:, None] & col_ok[None, :]
    else:
        mask = row_ok[:, None]
    return mask


@triton.jit
def load_query(q_ptrs, row_ok, d1_ok, d2_ok, offs_d1, offs_d2, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
               DOT_UPCAST: tl.constexpr, COL_MASK: tl.constexpr):
    """(q1 [M, BLOCK_D1], q2 [M, BLOCK_D2]) of the query rows at ``q_ptrs`` [M, 1]: the head dim
    split in two (q2 is q1 when ``BLOCK_D2 == 0``); rows not ``row_ok`` [M] (with COL_MASK also
    columns not ``d1_ok`` / ``d2_ok``) read 0; fp32 with DOT_UPCAST."""
    q1 = tl.load(q_ptrs + offs_d1[None, :], mask=_entries(row_ok, d1_ok, COL_MASK), other=0.0)
    if BLOCK_D2 > 0:
        q2 = tl.load(q_ptrs + BLOCK_D1 + offs_d2[None, :], mask=_entries(row_ok, d2_ok, COL_MASK), other=0.0)
    else:
        q2 = q1
    if DOT_UPCAST:
        q1 = q1.to(tl.float32)
        q2 = q2.to(tl.float32)
    return q1, q2


@triton.jit
def kv_head(K, V, KScale, kvh, stride_kh, stride_vh, stride_ks, qk_scale, KV_FP8: tl.constexpr):
    """(K base, V base, softmax scale) of KV head ``kvh``; KV_FP8 folds the head's K scale into
    the softmax scale (scores are linear in K)."""
    k_base = K + kvh.to(tl.int64) * stride_kh
    v_base = V + kvh.to(tl.int64) * stride_vh
    if KV_FP8:
        qk_scale = qk_scale * tl.load(KScale + kvh * stride_ks)
    return k_base, v_base, qk_scale


@triton.jit
def row_offsets(page, slot, stride_ap, stride_an, stride_bp, stride_bn, PAGED: tl.constexpr):
    """Element offsets of the same rows in two tensors A and B (K and V, or keys and their
    scales): paged, ``page * stride_p + slot * stride_n``; packed, ``slot`` is the row
    (``page`` unused). ``page`` / ``slot`` int64."""
    if PAGED:
        a_off = page * stride_ap + slot * stride_an
        b_off = page * stride_bp + slot * stride_bn
    else:
        a_off = slot * stride_an
        b_off = slot * stride_bn
    return a_off, b_off


@triton.jit
def key_offsets(pt_row, j, valid, row_base, stride_kp, stride_kn, stride_sp, stride_sn,
                PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Element offsets (key, per-key scale) of keys ``j`` [N] of one sequence: paged, page
    ``pt_row[j // PAGE_SIZE]`` (table reads masked by ``valid``), slot ``j % PAGE_SIZE``; packed,
    row ``row_base + j``."""
    if PAGED:
        page = tl.load(pt_row + j // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        slot = (j % PAGE_SIZE).to(tl.int64)
    else:
        page = 0
        slot = (row_base + j).to(tl.int64)
    return row_offsets(page, slot, stride_kp, stride_kn, stride_sp, stride_sn, PAGED)


@triton.jit
def kv_rows(PageTable, cu_kv, seq, stride_pt, PAGED: tl.constexpr):
    """(page-table row, first packed K/V row) of sequence ``seq``: paged K/V read the table row
    (first row 0), packed K/V start at ``cu_kv[seq]``."""
    if PAGED:
        pt_row = PageTable + seq.to(tl.int64) * stride_pt
        kv_row_base = 0
    else:
        pt_row = PageTable
        kv_row_base = tl.load(cu_kv + seq)
    return pt_row, kv_row_base


@triton.jit
def head_group_tile(
    Q, K, V, KScale, PageTable, cu_kv, seq, qrow, head, valid, kvh, qk_scale,
    stride_qm, stride_qh, stride_kh, stride_vh, stride_ks, stride_pt,
    BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    PAGED: tl.constexpr, DOT_UPCAST: tl.constexpr, KV_FP8: tl.constexpr,
):
    """What a tile of query rows ``qrow`` [M] x heads ``head`` [M] (``valid`` [M]) of KV head
    ``kvh`` over sequence ``seq`` reads its keys with: (offs_n, offs_d1, offs_d2, offs_dv, q1, q2,
    k_base, v_base, qk_scale, pt_row, kv_row_base) (see :func:`load_query`, :func:`kv_head`,
    :func:`kv_rows`)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_d2 = tl.arange(0, BLOCK_D2 if BLOCK_D2 > 0 else 16)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    q_ptrs = Q + qrow[:, None] * stride_qm + head[:, None] * stride_qh
    q1, q2 = load_query(q_ptrs, valid, None, None, offs_d1, offs_d2, BLOCK_D1, BLOCK_D2, DOT_UPCAST, False)
    k_base, v_base, qk_scale = kv_head(K, V, KScale, kvh, stride_kh, stride_vh, stride_ks, qk_scale, KV_FP8)
    pt_row, kv_row_base = kv_rows(PageTable, cu_kv, seq, stride_pt, PAGED)
    return offs_n, offs_d1, offs_d2, offs_dv, q1, q2, k_base, v_base, qk_scale, pt_row, kv_row_base


@triton.jit
def softmax_rescale(acc, l_i, m_i, s, visible, qk_scale, MASKED: tl.constexpr, ROW_SCALED: tl.constexpr = False):
    """The first half of a base-2 online-softmax step over unscaled scores ``s`` [M, N] (fp32;
    ``qk_scale`` > 0 folds into the exponent's FMA): (acc and l_i rescaled with p's mass added to
    l_i, the new running max, probabilities p [M, N] fp32). MASKED: keys not ``visible`` drop out
    and a row with no visible key so far keeps max -inf. ROW_SCALED (FP8 tensor-core attention):
    ``qk_scale`` is per row [M] and p comes back as ``P_SCALE p`` (2^8: exact, folded into the
    exponent), l_i still adds p."""
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_use = m_new
    if ROW_SCALED:
        p = tl.math.exp2(s * qk_scale[:, None] - (m_use - 8.0)[:, None])  # 256 p: log2(P_SCALE) = 8
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1) * (1.0 / 256.0)
    else:
        p = tl.math.exp2(s * qk_scale - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    return acc, l_i, m_new, p


#: FP8_MMA values: 0 off (the dots take q's dtype), 1 e4m3 tensor-core dots (q, P and K/V
#: e4m3), 2 the same quantization emulated in fp32 for the CPU interpreter (its fp8 conversion and
#: fp8 dot are wrong): values rounded to the e4m3 grid by :func:`e4m3_round`, dots in fp32 (exact
#: for e4m3 products), so it checks the scheme's arithmetic but not the fp8 instructions.
FP8_MMA_OFF = 0
FP8_MMA_HW = 1
FP8_MMA_EMULATED = 2

#: P is rounded as fp8(P_SCALE p) for the P V dot (cpattn.quant.FP8_P_SCALE).
P_SCALE = tl.constexpr(256.0)


@triton.jit
def e4m3_round(x):
    """fp32 ``x`` rounded to the nearest e4m3 value (ties to even, subnormals down to 2^-9),
    finite values saturated to +-448, NaN kept: what ``x.to(float8e4nv).to(float32)`` is on the
    GPU, in fp32 arithmetic (the interpreter's conversion is wrong). Adding and subtracting
    ``1.5 * 2^23 * u`` rounds to a multiple of the e4m3 step ``u`` of x's binade."""
    e = (x.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.minimum(tl.maximum(e, 127 - 6), 127 + 9)  # below 2^-6: the subnormal step; past 2^9 saturates
    u = ((e - 3) << 23).to(tl.float32, bitcast=True)
    c = u * 12582912.0
    r = (x + c) - c
    r = tl.where(r > 448.0, 448.0, r)
    return tl.where(r < -448.0, -448.0, r)


@triton.jit
def to_e4m3(x, FP8_MMA: tl.constexpr):
    """fp32 ``x`` as the P V / q K dots take it: e4m3 (FP8_MMA 1) or its fp32 emulation (2)."""
    return e4m3_round(x) if FP8_MMA == 2 else x.to(tl.float8e4nv)  # 2: FP8_MMA_EMULATED


@triton.jit
def quantize_query_rows(q1, q2, qk_scale, BLOCK_D2: tl.constexpr, FP8_MMA: tl.constexpr):
    """Per-row FP8 query quantization (cpattn.quant.quantize_fp8_rows): the row scale
    ``amax / 448`` over the whole head dim (both parts of a split one; 1 for a row of zeros, NaN
    for a row holding NaN or inf) -> (q1 e4m3, q2 e4m3, qk_scale [M] = qk_scale * row scale)."""
    x1 = q1.to(tl.float32)
    x2 = q2.to(tl.float32)
    amax = tl.max(tl.abs(x1), 1)
    bad = tl.sum(x1 * 0.0, 1)  # 0, or NaN when the row holds NaN or +-inf (max would drop a NaN)
    if BLOCK_D2 > 0:
        amax = tl.maximum(amax, tl.max(tl.abs(x2), 1))
        bad += tl.sum(x2 * 0.0, 1)
    scale = tl.where(amax == 0.0, 1.0, amax / 448.0) + bad
    q1 = to_e4m3(x1 / scale[:, None], FP8_MMA)
    if BLOCK_D2 > 0:
        q2 = to_e4m3(x2 / scale[:, None], FP8_MMA)
    else:
        q2 = q1
    return q1, q2, qk_scale * scale


@triton.jit
def add_values(acc, p, v, tile_scale, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
               KV_TILE: tl.constexpr, FP8_MMA: tl.constexpr = 0):
    """``acc + p @ v`` (fp32) for probabilities ``p`` [M, N] fp32 (rounded to v's dtype as the
    dot takes them). KV_TILE: ``v`` holds e4m3 latent values whose ``tile_scale``
    [N, Dv / 128] applies in fp32. FP8_MMA: ``p`` is ``P_SCALE`` times the probabilities
    (:func:`softmax_rescale` ROW_SCALED), ``acc + fp8(p) @ v8`` (v e4m3, or its fp32 values when
    emulated): the caller divides by P_SCALE at the end."""
    if KV_TILE:
        acc += tile_values(p, v, tile_scale, acc.shape[0], v.shape[0], v.shape[1], DOT_PRECISION)
    elif FP8_MMA != 0:  # p is P_SCALE p (softmax_rescale's ROW_SCALED)
        acc = tl.dot(to_e4m3(p, FP8_MMA), v, acc, input_precision=DOT_PRECISION)
    else:
        p = p.to(v.dtype)
        if DOT_UPCAST:
            p = p.to(tl.float32)
        acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def normalized(acc, l_i, VScale, kvh, stride_vs, KV_FP8: tl.constexpr):
    """(output rows acc / l_i (fp32; 0 where l_i == 0: no visible key), mask l_i != 0); NaN in
    l_i stays NaN. KV_FP8 applies the head's V scale (the output is linear in V)."""
    has_mass = l_i != 0.0
    out = acc * tl.where(has_mass, 1.0 / tl.where(has_mass, l_i, 1.0), 0.0)[:, None]
    if KV_FP8:
        out = out * tl.load(VScale + kvh * stride_vs)
    return out, has_mass


@triton.jit
def row_lse(m_i, l_i, has_mass):
    """Natural-log LSE of the rows from the base-2 running max and sum (-inf without mass)."""
    return tl.where(has_mass, (m_i + tl.math.log2(tl.where(has_mass, l_i, 1.0))) * 0.6931471805599453,
                    float("-inf"))
