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

from ._validation import check_tensor

__all__ = ["FP8_E4M3_MAX", "check_kv_scale", "dequantize_fp8", "quantize_fp8"]

#: Largest finite float8_e4m3fn magnitude.
FP8_E4M3_MAX = 448.0


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
