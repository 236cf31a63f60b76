"""Triton device helpers shared by the kernel families that read the tile-scaled FP8 MLA latent
layout (:func:`cpattn.quant.quantize_mla_fp8_tiles`): uint8 rows of ``BLOCK_D1`` e4m3 latent
values, ``BLOCK_D1 / 128`` float32 tile scales and the bfloat16 rope part. Imported by the
split-KV, portable and portable sparse kernels (device functions, no launch of their own).

The e4m3 values convert exactly to the query dtype; the tile scales are applied in fp32 outside
the dots (one batched dot per 128-value tile: the same FLOPs as one dot over the row), so the
result is as exact as the same kernel over a cache holding the dequantized values in fp32, up to
the probabilities' rounding that every path has.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Latent values per float32 scale (:data:`cpattn.quant.MLA_FP8_TILE_SIZE`).
TILE = tl.constexpr(128)


@triton.jit
def load_tile_rows(base, off, in_range, offs_d1, offs_d2, MASKED: tl.constexpr, BLOCK_D1: tl.constexpr,
                   dtype: tl.constexpr):
    """(latent values [BLOCK_N, BLOCK_D1] e4m3 converted to ``dtype`` (exact), their tile scales
    [BLOCK_N, BLOCK_D1 / 128] fp32, rope [BLOCK_N, BLOCK_D2] in ``dtype``) of the rows at uint8
    ``base + off``; rows not ``in_range`` (MASKED) read as zeros."""
    TILES: tl.constexpr = BLOCK_D1 // TILE
    row = base + off
    offs_t = tl.arange(0, TILES)
    scale_row = (row + BLOCK_D1).to(tl.pointer_type(tl.float32))
    rope_row = (row + BLOCK_D1 + 4 * TILES).to(tl.pointer_type(tl.bfloat16))
    if MASKED:
        x = tl.load(row[:, None] + offs_d1[None, :], mask=in_range[:, None], other=0)
        sc = tl.load(scale_row[:, None] + offs_t[None, :], mask=in_range[:, None], other=0.0)
        rope = tl.load(rope_row[:, None] + offs_d2[None, :], mask=in_range[:, None], other=0.0)
    else:
        x = tl.load(row[:, None] + offs_d1[None, :])
        sc = tl.load(scale_row[:, None] + offs_t[None, :])
        rope = tl.load(rope_row[:, None] + offs_d2[None, :])
    return x.to(tl.float8e4nv, bitcast=True).to(dtype), sc, rope.to(dtype)


@triton.jit
def tile_scores(q1, x, sc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """Scores ``q1 @ (x * scale).T`` [BLOCK_M, BLOCK_N] fp32: one dot per tile, scaled in fp32."""
    TILES: tl.constexpr = BLOCK_D1 // TILE
    q3 = tl.permute(tl.reshape(q1, (BLOCK_M, TILES, TILE)), (1, 0, 2))  # [T, M, 128]
    x3 = tl.permute(tl.reshape(x, (BLOCK_N, TILES, TILE)), (1, 2, 0))  # [T, 128, N]
    s3 = tl.dot(q3, x3, input_precision=DOT_PRECISION)  # [T, M, N]
    return tl.sum(s3 * tl.permute(sc, (1, 0))[:, None, :], axis=0)


@triton.jit
def tile_values(p, x, sc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """``p @ (x * scale)`` [BLOCK_M, BLOCK_D1] fp32 for probabilities ``p`` [BLOCK_M, BLOCK_N]
    fp32: each tile's scale joins the probabilities (rounded to x's dtype as ``p`` always is)."""
    TILES: tl.constexpr = BLOCK_D1 // TILE
    ps = (p[None, :, :] * tl.permute(sc, (1, 0))[:, None, :]).to(x.dtype)  # [T, M, N]
    x3 = tl.permute(tl.reshape(x, (BLOCK_N, TILES, TILE)), (1, 0, 2))  # [T, N, 128]
    o3 = tl.dot(ps, x3, input_precision=DOT_PRECISION)  # [T, M, 128]
    return tl.reshape(tl.permute(o3, (1, 0, 2)), (BLOCK_M, BLOCK_D1))


@triton.jit
def tile_block_scores(q1, q2, base, off, in_range, offs_d1, offs_d2, MASKED: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One block of tile-scaled latent rows (:func:`load_tile_rows`) scored against the query
    parts ``q1`` (latent) and ``q2`` (rope): (scores [BLOCK_M, BLOCK_N] fp32, the latent values
    in q's dtype [BLOCK_N, BLOCK_D1] (V of absorbed MLA), their tile scales [BLOCK_N, tiles])."""
    x, sc, rope = load_tile_rows(base, off, in_range, offs_d1, offs_d2, MASKED, BLOCK_D1, q1.dtype)
    s = tile_scores(q1, x, sc, BLOCK_M, BLOCK_N, BLOCK_D1, DOT_PRECISION)
    s = tl.dot(q2, tl.trans(rope), s, input_precision=DOT_PRECISION)
    return s, x, sc
