"""Sharded KV cache: the placement rule, sharded cache writes, pass-KV / pass-Q choice.

With a sharded cache, the key at position ``p`` of every sequence lives on CP rank
``(p // I) % C`` only (``I`` = interleave), at local index
``(p // (C * I)) * I + p % I`` of that rank's cache for the sequence: each rank holds about
``L / C`` keys of a length-``L`` sequence, densely indexed from 0, so its pages hold nothing but
its own keys (at most one partial page per sequence). Local key ``j`` of rank ``r`` has global
position ``(j // I) * C * I + r * I + j % I`` (for ``C = 1``: ``p = j``).

What lives here (all host planning: vectorized, O(T + B), nothing proportional to cached keys):

* :class:`KVSharding`: the rule (``owner``, ``local_index``, ``global_position``,
  ``local_lengths``): pass it as ``kv=`` to ``strategy.build_metadata`` (a decode step is the
  "replicated" strategy over the step's new tokens with a sharded ``kv``).
  Which new rows a rank stores is in the placement plan (``meta.store_rows``); where they go is
  planned by :func:`cpattn.plan_cache_writes`, the same for a replicated and a sharded cache.

Which algorithm runs over a sharded cache (pass-KV or pass-Q for an extend) is priced by
:class:`cpattn.CostModel` (:mod:`cpattn.cost`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np
import torch
from torch import Tensor

from ._validation import check_int
from .metadata import LengthsLike, as_lengths

__all__ = ["EXTEND_ALGORITHMS", "KVSharding", "local_key_counts", "local_key_index"]

IntOrTensor = Union[int, Tensor]

EXTEND_ALGORITHMS = ("pass_kv", "pass_q")


# ----------------------------------------------------------------------------- the rule
@dataclass(frozen=True)
class KVSharding:
    """Key at position ``p`` lives on rank ``(p // interleave) % cp_size`` only.

    Args:
        cp_size: C >= 1 ranks sharing the cache.
        interleave: I >= 1 consecutive positions per rank before moving to the next one (vLLM's
            ``cp_kv_cache_interleave_size``); with a paged cache the page size must be a
            multiple of I (:meth:`check_page_size`), so a rank's run of I positions never
            straddles a page.

    Example::

        sh = cpattn.KVSharding(4, interleave=1)
        sh.owner(torch.arange(8))        # tensor([0, 1, 2, 3, 0, 1, 2, 3])
        sh.local_index(torch.arange(8))  # tensor([0, 0, 0, 0, 1, 1, 1, 1])
    """

    cp_size: int
    interleave: int = 1

    def __post_init__(self) -> None:
        check_int(self.cp_size, "cp_size", 1)
        check_int(self.interleave, "interleave", 1)

    @property
    def period(self) -> int:
        """``C * I``: positions after which the placement repeats."""
        return self.cp_size * self.interleave

    # -- pure, vectorized (ints or integer tensors of any shape; tensors stay on their device)
    def owner(self, positions: IntOrTensor) -> IntOrTensor:
        """Rank holding the key at each position: ``(p // I) % C``."""
        p = _check_positions(positions, "positions")
        return (p // self.interleave) % self.cp_size

    def local_index(self, positions: IntOrTensor) -> IntOrTensor:
        """Index of each position's key in its owner's cache: ``(p // (C I)) * I + p % I``."""
        p = _check_positions(positions, "positions")
        return local_key_index(p, self.cp_size, self.interleave)

    def global_position(self, local_index: IntOrTensor, rank: int) -> IntOrTensor:
        """Position of local key ``j`` of ``rank``: ``(j // I) * C * I + rank * I + j % I``."""
        self._check_rank(rank)
        j = _check_positions(local_index, "local_index")
        return (j // self.interleave) * self.period + rank * self.interleave + j % self.interleave

    def local_lengths(self, lengths: LengthsLike, rank: int) -> Tensor:
        """Keys ``rank`` holds of sequences of ``lengths`` keys: ``#{p < L : owner(p) = rank}``
        = ``(L // (C I)) * I + clamp(L % (C I) - rank * I, 0, I)``. int64 CPU [B]."""
        self._check_rank(rank)
        lens = as_lengths(lengths, "lengths")
        return local_key_counts(lens, rank, self.cp_size, self.interleave)

    def check_page_size(self, page_size: int) -> int:
        """ValueError unless a paged cache's ``page_size`` is a multiple of ``interleave``."""
        ps = check_int(page_size, "page_size", 1)
        if ps % self.interleave:
            raise ValueError(
                f"page_size={ps} must be a multiple of the KV sharding's interleave={self.interleave} "
                "(a rank's run of interleave positions must not straddle a page)"
            )
        return ps

    def _check_rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"rank must be an int, got {type(rank).__name__}")
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank must be in [0, cp_size={self.cp_size}), got {rank}")
        return rank


def _check_positions(x: IntOrTensor, name: str) -> IntOrTensor:
    if isinstance(x, Tensor):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got dtype {x.dtype}")
        if x.device.type == "cpu" and x.numel() and int(x.min()) < 0:
            raise ValueError(f"{name} must be >= 0, got min {int(x.min())}")
        return x
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name} must be an int or an integer tensor, got {type(x).__name__}")
    if x < 0:
        raise ValueError(f"{name} must be >= 0, got {x}")
    return x


def local_key_counts(lens, rank: int, cp_size: int, interleave: int):
    """Keys ``rank`` holds of sequences of ``lens`` keys (a torch tensor or a numpy array)."""
    period = cp_size * interleave
    if isinstance(lens, np.ndarray):  # one divmod, few ufuncs: each numpy op costs ~0.5 us on the host
        full, rest = np.divmod(lens, period)
        if interleave == 1:
            return full + (rest > rank)
        rest = rest - rank * interleave  # rank may be an array (broadcast)
        np.maximum(rest, 0, out=rest)
        np.minimum(rest, interleave, out=rest)
        return full * interleave + rest
    rest = lens % period - rank * interleave
    return (lens // period) * interleave + rest.clip(0, interleave)


def local_key_index(positions, cp_size: int, interleave: int):
    """Index of each position's key in its owner's cache (a torch tensor, numpy array or int)."""
    return (positions // (cp_size * interleave)) * interleave + positions % interleave
