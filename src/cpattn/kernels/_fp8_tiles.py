"""Triton device helper shared by the kernel families that read the tile-scaled FP8 MLA latent
layout (:func:`cpattn.quant.quantize_mla_fp8_tiles`): uint8 rows of ``BLOCK_D1`` e4m3 latent
values, ``BLOCK_D1 / 128`` float32 tile scales and the bfloat16 rope part. Imported by the
split-KV, portable and portable sparse kernels (a device function, no launch of its own)."""

from __future__ import annotations

import triton
import triton.language as tl

#: Latent values per float32 scale (:data:`cpattn.quant.MLA_FP8_TILE_SIZE`).
TILE = tl.constexpr(128)


@triton.jit
def load_tile_rows(base, off, in_range, offs_d1, offs_d2, MASKED: tl.constexpr, BLOCK_D1: tl.constexpr,
                   dtype: tl.constexpr):
    """(latent [BLOCK_N, BLOCK_D1], rope [BLOCK_N, BLOCK_D2]) in ``dtype`` of tile-scaled FP8 rows
    (uint8 ``base + off``: BLOCK_D1 e4m3 values, BLOCK_D1 / 128 float32 scales, bf16 rope):
    each latent value times its tile's scale in fp32, then converted (rounded for bf16 / fp16)."""
    row = base + off
    if MASKED:
        x = tl.load(row[:, None] + offs_d1[None, :], mask=in_range[:, None], other=0)
    else:
        x = tl.load(row[:, None] + offs_d1[None, :])
    scale_row = (row + BLOCK_D1).to(tl.pointer_type(tl.float32))
    rope_row = (row + BLOCK_D1 + 4 * (BLOCK_D1 // TILE)).to(tl.pointer_type(tl.bfloat16))
    if MASKED:
        sc = tl.load(scale_row[:, None] + (offs_d1 // TILE)[None, :], mask=in_range[:, None], other=0.0)
        rope = tl.load(rope_row[:, None] + offs_d2[None, :], mask=in_range[:, None], other=0.0)
    else:
        sc = tl.load(scale_row[:, None] + (offs_d1 // TILE)[None, :])
        rope = tl.load(rope_row[:, None] + offs_d2[None, :])
    lat = x.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc
    return lat.to(dtype), rope.to(dtype)
