"""Rotary position embedding (rotate-half / NeoX layout) on global positions."""

from __future__ import annotations

import torch
from torch import Tensor


def apply_rope(x: Tensor, positions: Tensor, theta: float = 10000.0) -> Tensor:
    """Rotate ``x`` [N, H, D] (D even) by ``positions`` [N] (global token positions, any int dtype).

    Pad rows of a CP shard carry position 0 and stay finite. Computed in fp32, returned in x.dtype.
    """
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
