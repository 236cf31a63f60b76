"""Contiguous placement: C blocks per sequence, rank r owns block r (a causally unbalanced baseline)."""

from __future__ import annotations

from torch import Tensor

from .base import CPStrategy, block_of


class ContiguousStrategy(CPStrategy):
    """Each sequence of extend length L is cut into C contiguous blocks of sizes
    ``L // C + (j < L % C)``; rank r owns block r. Later ranks do more causal work."""

    name = "contiguous"

    def _token_owner(self, seq_ids: Tensor, offsets: Tensor, extend_lens: Tensor) -> Tensor:
        return block_of(offsets, extend_lens[seq_ids], self.cp_size)
