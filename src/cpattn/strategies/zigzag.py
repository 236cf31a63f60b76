"""Zigzag placement: 2C blocks per sequence, rank r owns blocks r and 2C-1-r (causally balanced)."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import RotatingStrategy, block_of, rotation_offsets


class ZigzagStrategy(RotatingStrategy):
    """Each sequence of extend length L is cut into 2C contiguous blocks of sizes
    ``L // 2C + (j < L % 2C)``; blocks j and 2C-1-j go to one rank, so every rank gets about the
    same causal work.

    ``rotate=True`` (default): sequence b's block pair j goes to rank ``(j + o_b) % C`` with
    ``o_b = (sum of L % 2C over earlier sequences) % C``, so the remainder rows of successive
    sequences (all of a sequence shorter than 2C) land on successive ranks instead of always on
    the low ranks; a long sequence's balance is unchanged (its ranks still own one early and one
    late block each). ``rotate=False``: rank r owns blocks r and 2C-1-r of every sequence.

    Example::

        s = cpattn.ZigzagStrategy(cp_size=2)
        meta = s.build_metadata([10, 3], prefix_lens=[4, 0], rank=0)
    """

    name = "zigzag"

    def _token_owner(self, seq_ids: Tensor, offsets: Tensor, extend_lens: Tensor) -> Tensor:
        blocks = 2 * self.cp_size
        block = block_of(offsets, extend_lens[seq_ids], blocks)
        pair = torch.where(block < self.cp_size, block, blocks - 1 - block)
        if not self.rotate or self.cp_size == 1:
            return pair
        return (pair + rotation_offsets(extend_lens, blocks, self.cp_size)[seq_ids]) % self.cp_size

    def max_local_tokens(self, max_tokens: int, max_seqs: int) -> int:
        # per sequence at most two blocks of ceil(L / 2C) rows: <= L / C + 2 rows
        return min(max_tokens, -(-max_tokens // self.cp_size) + 2 * max_seqs)

    def max_segments(self, max_seqs: int) -> int:
        return 2 * max_seqs
