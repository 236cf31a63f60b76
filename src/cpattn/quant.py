"""FP8 (e4m3) K/V quantization: the one definition every cache write and every reader follows.

A K/V cache of ``kv_dtype=torch.float8_e4m3fn`` holds ``q = fp8(clamp(x / scale, -448, 448))``:
``x / scale`` computed in float32, rounded to the nearest e4m3 value (ties to even), finite values
past the e4m3 range saturated to +-448 (never NaN from overflow). Readers compute ``q * scale``
(exact in float32: an e4m3 value times a float32 scale). The scales are float32 device tensors,
per tensor (shape ``[]``) or per KV head (``[Hkv]``), one for K and one for V; an engine may
change their values between steps (kernels read them at run time: graph-safe).

Non-finite inputs are propagated, not hidden: NaN stays NaN and +-inf becomes NaN (e4m3fn has no
infinity), so a non-finite key or value reaches exactly the rows that read it, as with a bf16
cache. Scales must be positive and finite; their values are not checked (that would read device
memory, a host sync per layer).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._validation import check_int, check_tensor

__all__ = [
    "FP8_E4M3_MAX",
    "FP8_TILE",
    "MLA_FP8_TILE_SIZE",
    "check_kv_scale",
    "dequantize_fp8",
    "dequantize_mla_fp8_tiles",
    "mla_fp8_tile_bytes",
    "quantize_fp8",
    "quantize_fp8_rows",
    "FP8_P_SCALE",
    "quantize_mla_fp8_tiles",
]

#: Largest finite float8_e4m3fn magnitude.
FP8_E4M3_MAX = 448.0

#: The tile-scaled MLA latent layout's name (``AttentionSpec(kv_layout=FP8_TILE)``,
#: ``write_mla_cache(..., layout=FP8_TILE)``, ``gather_mla_latent(..., layout=FP8_TILE)``).
FP8_TILE = "fp8_tile"


def _amax_scale(amax: Tensor) -> Tensor:
    """``amax / 448`` rounded once (IEEE division on every device: CUDA divides by a host scalar
    through its reciprocal, which moves some scales by one ulp and every value of their tile)."""
    return amax / torch.full((), FP8_E4M3_MAX, dtype=amax.dtype, device=amax.device)

#: Latent values per scale of the tile-scaled MLA layout.
MLA_FP8_TILE_SIZE = 128


def check_kv_scale(scale, name: str, num_kv_heads: Optional[int], device: Optional[torch.device]) -> Tensor:
    """``scale`` checked as a K/V scale: a float32 tensor of shape ``[]`` (per tensor) or
    ``[num_kv_heads]`` (per KV head; any length when ``num_kv_heads`` is None), on ``device``
    (when given). TypeError / ValueError naming ``name``."""
    check_tensor(scale, name)
    if scale.dtype != torch.float32:
        raise TypeError(f"{name} must be a float32 tensor, got {scale.dtype}")
    if scale.dim() > 1 or (scale.dim() == 1 and num_kv_heads is not None and scale.shape[0] != num_kv_heads):
        heads = "Hkv" if num_kv_heads is None else f"Hkv={num_kv_heads}"
        raise ValueError(f"{name} must be per tensor [] or per KV head [{heads}], got shape {list(scale.shape)}")
    if device is not None and scale.device != device:
        raise ValueError(f"{name} is on {scale.device} but the K/V are on {device}")
    return scale


def _per_head(scale: Tensor, x: Tensor) -> Tensor:
    """``scale`` ([] or [Hkv]) shaped to broadcast over ``x`` [..., Hkv, D]."""
    return scale.view(-1, 1) if scale.dim() == 1 else scale


def quantize_fp8(x: Tensor, scale: Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> Tensor:
    """``x`` [..., Hkv, D] (any float dtype) -> e4m3 ``fp8(clamp(x / scale, -448, 448))``.

    Args:
        x: keys or values, the KV head in dim -2 (a per-head scale applies along it).
        scale: float32 ``[]`` or ``[Hkv]`` on x's device.
        dtype: the FP8 dtype (torch.float8_e4m3fn).

    Returns:
        a new tensor of x's shape in ``dtype``. Finite values saturate at +-448; NaN and +-inf
        become NaN. Device-only (no sync).
    """
    check_tensor(x, "x")
    if dtype != torch.float8_e4m3fn:
        raise ValueError(f"dtype must be torch.float8_e4m3fn, got {dtype}")
    check_kv_scale(scale, "scale", x.shape[-2] if x.dim() >= 2 else None, x.device)
    y = (x.float() / _per_head(scale, x)).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    y = y.masked_fill_(x.isinf(), float("nan"))  # clamp would saturate inf: e4m3fn has none, propagate
    return y.to(dtype)


def dequantize_fp8(x: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """e4m3 ``x`` [..., Hkv, D] -> ``x * scale`` in ``dtype`` (computed in float32; float64 when
    ``dtype`` is float64). ``scale``: float32 ``[]`` or ``[Hkv]``."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    return (x.to(work) * _per_head(scale, x).to(work)).to(dtype)


#: The factor FP8 tensor-core attention scales probabilities by before rounding them to e4m3
#: (``fp8(256 p)`` for ``p`` in [0, 1] relative to the running row max; a power of two, so exact):
#: small probabilities stay normal e4m3 numbers down to 2^-14 instead of flushing below 2^-10.
FP8_P_SCALE = 256.0


def quantize_fp8_rows(x: Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[Tensor, Tensor]:
    """Per-row FP8 quantization of queries (FP8 tensor-core attention, ``AttentionSpec(mma_dtype=)``).

    Each row (the last dim, e.g. one (token, head) of q [T, Hq, D]) gets the float32 scale
    ``amax(|row|) / 448`` (1 for a row of zeros) and is stored as ``fp8(x / scale)`` (computed in
    float32, rounded to nearest). A row holding NaN or +-inf gets scale NaN and NaN values: its
    scores, output and lse are NaN (never hidden).

    Args:
        x: [..., D] any float dtype.
        dtype: the FP8 dtype (torch.float8_e4m3fn).

    Returns:
        (values [..., D] in ``dtype``, scales [...] float32). ``values * scales`` approximates x.
    """
    check_tensor(x, "x")
    if dtype != torch.float8_e4m3fn:
        raise ValueError(f"dtype must be torch.float8_e4m3fn, got {dtype}")
    xf = x.float()
    amax = xf.abs().amax(dim=-1)  # NaN stays NaN, inf stays inf
    scale = torch.where(amax == 0, 1.0, _amax_scale(amax))
    scale = torch.where(amax.isfinite(), scale, float("nan"))
    y = (xf / scale[..., None]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return y.to(dtype), scale


# ---------------------------------------------------------------------------------------- MLA tiles
def mla_fp8_tile_bytes(kv_lora_rank: int, qk_rope_head_dim: int) -> int:
    """Bytes of one token's row in the tile-scaled FP8 MLA layout: ``r`` e4m3 latent values,
    ``r / 128`` float32 tile scales, ``d_rope`` bfloat16 rope values (DeepSeek-V3: 512 + 16 + 128
    = 656). ValueError unless ``r`` is a positive multiple of 128 and ``d_rope >= 0``."""
    r = check_int(kv_lora_rank, "kv_lora_rank", 1)
    d_rope = check_int(qk_rope_head_dim, "qk_rope_head_dim", 0)
    if r % MLA_FP8_TILE_SIZE:
        raise ValueError(f"kv_lora_rank must be a multiple of {MLA_FP8_TILE_SIZE} (one scale per tile), got {r}")
    return r + 4 * (r // MLA_FP8_TILE_SIZE) + 2 * d_rope


def quantize_mla_fp8_tiles(kv_c: Tensor, k_pe: Tensor) -> Tensor:
    """MLA latent rows -> the tile-scaled FP8 layout (FlashMLA's FP8 KV cache row), uint8.

    Per token, bytes ``[0, r)``: ``kv_c`` as e4m3, tile ``t`` (values ``[128 t, 128 t + 128)``)
    stored as ``fp8(clamp(x / s_t, -448, 448))`` with ``s_t = amax(|tile|) / 448`` (float32);
    bytes ``[r, r + 4 r / 128)``: the ``s_t`` as float32; then ``k_pe`` as bfloat16 (rounded to
    nearest). A tile of zeros gets ``s_t = 0`` and zero values (no 0 / 0). A tile holding NaN or
    +-inf gets ``s_t = NaN``: the whole tile dequantizes to NaN (never hidden, never past its
    token's row).

    Args:
        kv_c: [N, r] latent (16/32-bit float), r a multiple of 128.
        k_pe: [N, d_rope] rotary key after RoPE (16/32-bit float), same rows and device.

    Returns:
        uint8 [N, row_bytes] (:func:`mla_fp8_tile_bytes`), a new contiguous tensor. Device-only.
    """
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe)):
        check_tensor(t, name)
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D [rows, dim], got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point or t.element_size() == 1:
            raise TypeError(f"{name} must be a 16/32-bit float tensor (unquantized), got {t.dtype}")
    if kv_c.shape[0] != k_pe.shape[0]:
        raise ValueError(f"kv_c has {kv_c.shape[0]} rows but k_pe has {k_pe.shape[0]}")
    if kv_c.device != k_pe.device:
        raise ValueError(f"kv_c is on {kv_c.device} but k_pe on {k_pe.device}")
    n, r = kv_c.shape
    row = mla_fp8_tile_bytes(r, k_pe.shape[1])
    tiles = r // MLA_FP8_TILE_SIZE
    x = kv_c.float().view(n, tiles, MLA_FP8_TILE_SIZE)
    amax = x.abs().amax(dim=-1, keepdim=True)  # NaN in a tile gives NaN
    scale = torch.where(amax.isfinite(), _amax_scale(amax), float("nan"))
    y = (x / torch.where(scale == 0, 1.0, scale)).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    out = torch.empty(n, row, dtype=torch.uint8, device=kv_c.device)
    out[:, :r] = y.to(torch.float8_e4m3fn).view(torch.uint8).view(n, r)
    out[:, r : r + 4 * tiles] = scale.view(n, tiles).view(torch.uint8)
    out[:, r + 4 * tiles :] = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)
    return out


def dequantize_mla_fp8_tiles(rows: Tensor, kv_lora_rank: int = 512, dtype: torch.dtype = torch.float32) -> Tensor:
    """Tile-scaled FP8 MLA rows -> the latent row ``[kv_c | k_pe]``, the exact inverse of the
    layout of :func:`quantize_mla_fp8_tiles`.

    Args:
        rows: uint8 [..., row_bytes] (any leading dims, e.g. a paged cache [pages, page_size, 656]).
        kv_lora_rank: r, the latent width (a multiple of 128); d_rope follows from row_bytes.
        dtype: result dtype; latent ``q * s_t`` and rope computed in float32 (float64 when
            ``dtype`` is float64: exact).

    Returns:
        [..., r + d_rope] in ``dtype``.
    """
    check_tensor(rows, "rows")
    if rows.dtype != torch.uint8:
        raise TypeError(f"rows must be uint8 (the tile-scaled layout's bytes), got {rows.dtype}")
    r = check_int(kv_lora_rank, "kv_lora_rank", 1)
    tiles = r // MLA_FP8_TILE_SIZE
    rope_bytes = rows.shape[-1] - mla_fp8_tile_bytes(r, 0)
    if rope_bytes < 0 or rope_bytes % 2:
        raise ValueError(f"rows of {rows.shape[-1]} bytes are not tile-scaled rows of kv_lora_rank={r} "
                         f"({r} + {4 * tiles} bytes, then 2 bytes per rope value)")
    work = torch.float64 if dtype == torch.float64 else torch.float32
    lead = rows.shape[:-1]
    flat = rows.reshape(-1, rows.shape[-1])
    q = flat[:, :r].view(torch.float8_e4m3fn).to(work).view(-1, tiles, MLA_FP8_TILE_SIZE)
    scale = flat[:, r : r + 4 * tiles].contiguous().view(torch.float32).to(work).view(-1, tiles, 1)
    rope = flat[:, r + 4 * tiles :].contiguous().view(torch.bfloat16).to(work)
    out = torch.cat([(q * scale).view(-1, r), rope], dim=1)
    return out.to(dtype).view(*lead, r + rope_bytes // 2)
