"""Zigzag placement: 2C blocks per sequence, rank r owns blocks r and 2C-1-r (causally balanced)."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import CPStrategy, block_of


class ZigzagStrategy(CPStrategy):
    """Each sequence of extend length L is cut into 2C contiguous blocks of sizes
    ``L // 2C + (j < L % 2C)``; rank r owns block r (early) and block 2C-1-r (late), so every rank
    gets about the same causal work. Sequences shorter than 2C leave some ranks with none of them.

    Example::

        s = cpattn.ZigzagStrategy(cp_size=2)
        meta = s.build_metadata([10, 3], prefix_lens=[4, 0], rank=0)
    """

    name = "zigzag"

    def _token_owner(self, seq_ids: Tensor, offsets: Tensor, extend_lens: Tensor) -> Tensor:
        blocks = 2 * self.cp_size
        block = block_of(offsets, extend_lens[seq_ids], blocks)
        return torch.where(block < self.cp_size, block, blocks - 1 - block)
