"""Interleave (round-robin) placement: packed token t goes to rank t % C."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import CPStrategy


class InterleaveStrategy(CPStrategy):
    """Token ``t`` of the packed batch goes to rank ``t % C``. A rank's rows of one sequence have
    positions ``pos0 + i * C`` (one kernel segment of stride C per sequence); each row keeps its own
    causal bound and window, so nothing past a row's position is ever visible."""

    name = "interleave"

    @property
    def segment_stride(self) -> int:
        return self.cp_size

    def _token_owner(self, seq_ids: Tensor, offsets: Tensor, extend_lens: Tensor) -> Tensor:
        return torch.arange(seq_ids.numel(), dtype=seq_ids.dtype) % self.cp_size

    def max_local_tokens(self, max_tokens: int, max_seqs: int) -> int:
        return -(-max_tokens // self.cp_size)
