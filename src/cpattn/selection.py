"""Exact top-k selection with a fixed tie rule: packed (score, position) keys.

The DSA indexer keeps, per query row, the ``topk`` keys of highest score; where scores tie, the
key at the LOWER position wins. Both facts travel in one int64 per candidate, so one
``torch.topk`` over packed keys selects exactly that set, whatever order the candidates come in
(a running merge over key chunks, or the candidates of every CP rank):

    key = (ordered(float32(score)) << 32) | (2**32 - 1 - position)

``ordered`` maps float32 bits to int32 monotonically (-0.0 counts as +0.0; every NaN ranks
above +inf, as in ``torch.topk``). Keys with no score (masked, padding) are :data:`NO_KEY`
(int64 min), below every real key. Positions must be in ``[0, 2**32 - 1)``.

Scores are compared in float32 (fp64 scores are rounded to float32 first), so every path that
packs the same float32 scores selects the same set.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["NO_KEY", "key_positions", "pack_keys", "top_candidate_positions", "top_keys"]

#: The key of "no candidate" (masked, padding): below every real key.
NO_KEY = -(1 << 63)

_LOW32 = (1 << 32) - 1


def pack_keys(scores: Tensor, positions: Tensor, valid: Tensor) -> Tensor:
    """Packed keys of ``scores`` (any float dtype) at ``positions`` (int, broadcastable to
    ``scores``); :data:`NO_KEY` where ``valid`` (bool, broadcastable) is False. int64, device-only."""
    s = scores.to(torch.float32) + 0.0  # -0.0 -> +0.0
    s = torch.where(torch.isnan(s), torch.full((), float("nan"), dtype=torch.float32, device=s.device), s)
    bits = s.view(torch.int32).to(torch.int64)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # monotone in the float value
    key = (ordered << 32) | (_LOW32 - positions.to(torch.int64))
    return torch.where(valid, key, torch.full((), NO_KEY, dtype=torch.int64, device=key.device))


def top_keys(keys: Tensor, k: int) -> Tensor:
    """The ``k`` largest packed keys of each row of ``keys`` [r, m] (unordered), [r, k] int64;
    rows with fewer than ``k`` columns are padded with :data:`NO_KEY`."""
    r, m = keys.shape
    if m < k:
        pad = torch.full((r, k - m), NO_KEY, dtype=torch.int64, device=keys.device)
        return torch.cat([keys, pad], dim=1)
    return torch.topk(keys, k, dim=1, sorted=False).values


def key_positions(keys: Tensor) -> Tensor:
    """Positions of packed keys (int64, same shape), -1 for :data:`NO_KEY`."""
    pos = _LOW32 - (keys & _LOW32)
    return torch.where(keys == NO_KEY, torch.full((), -1, dtype=torch.int64, device=keys.device), pos)


def top_candidate_positions(candidates: Tensor, k: int) -> Tensor:
    """The positions of the ``k`` largest of every row's candidates gathered in blocks:
    ``candidates`` int64 [C, N, m] packed keys -> int64 [N, k] (unordered, -1 where fewer than
    ``k`` keys exist)."""
    c, n, m = candidates.shape
    return key_positions(top_keys(candidates.permute(1, 0, 2).reshape(n, c * m), k))
