"""A small GQA attention stack (random weights) that runs the same code with or without CP.

Each layer: ``x + o_proj(attention(RoPE(q), RoPE(k), v))`` followed by ``x + mlp(x)``, with K/V of
the extend tokens all-gathered by the strategy and merged with the layer's cached prefix K/V.
With ``cp_size == 1`` the strategy runs no collective, so the single-process forward is the same
code path.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from cpattn.kv import pack_kv
from cpattn.metadata import CPMetadata
from cpattn.strategies import CPStrategy

from .rope import apply_rope


class GQAAttentionLayer(nn.Module):
    """One pre-norm GQA attention block plus a small MLP. Shapes: x [N, hidden]."""

    def __init__(self, hidden: int, num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.hq, self.hkv, self.d = num_q_heads, num_kv_heads, head_dim
        self.norm = nn.LayerNorm(hidden)
        self.q_proj = nn.Linear(hidden, num_q_heads * head_dim, bias=False)
        self.kv_proj = nn.Linear(hidden, 2 * num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_q_heads * head_dim, hidden, bias=False)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        strategy: CPStrategy,
        meta: CPMetadata,
        group=None,
        prefix_kv: Optional[tuple[Tensor, Tensor]] = None,
        backend: str = "auto",
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x [P, hidden], positions [P] -> (x [P, hidden], logical extend (k, v) [T, Hkv, D])."""
        h = self.norm(x)
        n = x.shape[0]
        k_local, v_local = self.kv_proj(h).view(n, 2, self.hkv, self.d).unbind(1)
        k_local = apply_rope(k_local, positions)
        pending = strategy.gather_kv(k_local, v_local.contiguous(), meta, group, async_op=True)
        q = apply_rope(self.q_proj(h).view(n, self.hq, self.d), positions)  # overlaps the gather
        k_ext, v_ext = pending.wait()
        k, v = pack_kv(k_ext, v_ext, meta, *(prefix_kv or (None, None)))
        o = strategy.attention(q, k, v, meta, backend=backend)
        x = x + self.o_proj(o.reshape(n, -1))
        return x + self.mlp(x), (k_ext, v_ext)


class AttentionStack(nn.Module):
    """``num_layers`` :class:`GQAAttentionLayer` blocks with seeded random weights."""

    def __init__(
        self,
        num_layers: int = 2,
        hidden: int = 64,
        num_q_heads: int = 4,
        num_kv_heads: int = 2,
        head_dim: int = 16,
        seed: int = 0,
    ) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.layers = nn.ModuleList(
            GQAAttentionLayer(hidden, num_q_heads, num_kv_heads, head_dim) for _ in range(num_layers)
        )
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1))

    @torch.no_grad()
    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        strategy: CPStrategy,
        meta: CPMetadata,
        group=None,
        prefix_kv: Optional[Sequence[tuple[Tensor, Tensor]]] = None,
        backend: str = "auto",
    ) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """x [P, hidden] (rank-local rows), positions [P] -> x [P, hidden] and per-layer extend K/V."""
        new_kv = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, positions, strategy, meta, group, prefix_kv[i] if prefix_kv else None, backend)
            new_kv.append(kv)
        return x, new_kv
