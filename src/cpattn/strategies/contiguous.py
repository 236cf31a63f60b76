"""Contiguous placement: C blocks per sequence, rank r owns block r (a causally unbalanced baseline)."""

from __future__ import annotations

from torch import Tensor

from .base import RotatingStrategy, block_of, rotation_offsets


class ContiguousStrategy(RotatingStrategy):
    """Each sequence of extend length L is cut into C contiguous blocks of sizes
    ``L // C + (j < L % C)``; rank r owns block r. Later ranks do more causal work.

    ``rotate=True`` (default): block j of sequence b goes to rank ``(j + o_b) % C`` with
    ``o_b = (sum of L % C over earlier sequences) % C``, so sequences shorter than C spread over
    the ranks; ``rotate=False``: rank r owns block r of every sequence.
    """

    name = "contiguous"

    def _token_owner(self, seq_ids: Tensor, offsets: Tensor, extend_lens: Tensor) -> Tensor:
        block = block_of(offsets, extend_lens[seq_ids], self.cp_size)
        if not self.rotate or self.cp_size == 1:
            return block
        return (block + rotation_offsets(extend_lens, self.cp_size, self.cp_size)[seq_ids]) % self.cp_size

    def max_local_tokens(self, max_tokens: int, max_seqs: int) -> int:
        return min(max_tokens, -(-max_tokens // self.cp_size) + max_seqs)
