"""CP padding rules, in one place: logical rows (real tokens) vs physical rows (what collectives move).

Pure host-side functions (no state, no device work except :func:`pad_rows` / :func:`unpad_rows`,
which are shape-checked views or one copy). Everything CP pads is derived from LOGICAL counts:

* :func:`physical_rows`: rows every rank holds, ``ceil(max(counts) / align) * align``.
* :func:`combined_alignment`: one alignment for CP and an engine's own padding (TP/DP sizes,
  CUDA-graph buckets), so the rows are padded once, not twice.
* :func:`pad_rows` / :func:`unpad_rows`: zero pad / strip rows along a dim.
* :func:`prefix_lens`: cached prefix per sequence from logical lengths (never from padded counts).
* :func:`max_key_len`: the longest key range, from logical lengths only (pad rows are never keys).

The bugs these rule out (seen in a reference system, see docs/design.md "Padding"): padding
applied twice; a prefix computed from padded counts (``3671 - 3672 = -1``); a pad delta widening
the key length; a pad row added while CP was off surfacing as a dummy token.

Example::

    from cpattn import padding
    padding.physical_rows([1148, 1147, 1148], 8)          # 1152
    padding.combined_alignment(8, 6)                      # 24: pad once to 24
    padding.prefix_lens([3671, 12], [3000, 12]).tolist()  # [671, 0]
"""

from __future__ import annotations

import math
from typing import Sequence, Union

import torch
from torch import Tensor

from ._validation import as_lengths, check_int, check_tensor

__all__ = [
    "combined_alignment",
    "max_key_len",
    "pad_rows",
    "physical_rows",
    "prefix_lens",
    "unpad_rows",
]

CountsLike = Union[Sequence[int], Tensor]


def physical_rows(logical_counts_per_rank: CountsLike, align: int) -> int:
    """Physical rows P every rank holds: the smallest multiple of ``align`` >= max(counts).

    Args:
        logical_counts_per_rank: [C] real tokens per rank (list/tuple of ints or 1-D int tensor,
            C >= 1). Logical counts only: an engine's own padding never enters here.
        align: row alignment (int >= 1), e.g. ``strategy.pad_multiple`` or
            :func:`combined_alignment`.

    Returns:
        P as a Python int: ``ceil(max / align) * align``; 0 when every count is 0 (no dummy row).
        With ``align = 1`` P is exactly the largest count (C = 1: P = T, no pad at all).

    Example::

        physical_rows([5, 4], 8)    # 8
        physical_rows([0, 0], 8)    # 0
    """
    counts = as_lengths(logical_counts_per_rank, "logical_counts_per_rank")
    align = check_int(align, "align", 1)
    if counts.numel() == 0:
        raise ValueError("logical_counts_per_rank must have one entry per CP rank (at least one), got []")
    largest = int(counts.max())
    return -(-largest // align) * align


def combined_alignment(cp_align: int, engine_align: int) -> int:
    """One row alignment that satisfies CP and the engine: ``lcm(cp_align, engine_align)``.

    When an engine also pads (attention-TP/DP sizes, CUDA-graph batch buckets), pad the physical
    rows ONCE to this alignment (e.g. ``ZigzagStrategy(C, pad_multiple=combined_alignment(...))``)
    instead of padding the logical tokens for the engine and then again for CP.

    Example::

        combined_alignment(8, 6)   # 24
    """
    a = check_int(cp_align, "cp_align", 1)
    b = check_int(engine_align, "engine_align", 1)
    return a * b // math.gcd(a, b)


def _dim(x: Tensor, dim: int, name: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if x.dim() == 0 or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} out of range for {name} of shape {tuple(x.shape)}")
    return dim % x.dim()


def pad_rows(x: Tensor, rows: int, dim: int = 0) -> Tensor:
    """Zero-pad ``x`` along ``dim`` to ``rows`` (any dtype; returns ``x`` itself when already there).

    Args:
        x: [.., n, ..] with ``n <= rows`` along ``dim``.
        rows: target row count (int >= 0), e.g. :func:`physical_rows`.

    Returns:
        [.., rows, ..]: ``x`` in rows ``[0, n)``, zeros after (pad rows are never real tokens).
    """
    check_tensor(x, "x")
    rows = check_int(rows, "rows", 0)
    dim = _dim(x, dim, "x")
    n = x.shape[dim]
    if n > rows:
        raise ValueError(f"x has {n} rows along dim {dim}, more than rows={rows}: cannot pad down")
    if n == rows:
        return x
    shape = list(x.shape)
    shape[dim] = rows
    out = x.new_zeros(shape)
    out.narrow(dim, 0, n).copy_(x)
    return out


def unpad_rows(x: Tensor, rows: int, dim: int = 0) -> Tensor:
    """The first ``rows`` rows of ``x`` along ``dim`` (a view): strip the pad rows.

    Args:
        x: [.., P, ..] with ``P >= rows`` along ``dim``.
        rows: real (logical) row count (int >= 0).
    """
    check_tensor(x, "x")
    rows = check_int(rows, "rows", 0)
    dim = _dim(x, dim, "x")
    if rows > x.shape[dim]:
        raise ValueError(f"rows={rows} exceeds the {x.shape[dim]} rows of x along dim {dim}")
    return x.narrow(dim, 0, rows)


def prefix_lens(kv_lens: CountsLike, extend_lens: CountsLike) -> Tensor:
    """Cached prefix tokens per sequence, ``kv_lens - extend_lens``, int64 CPU [B].

    Args:
        kv_lens: [B] total tokens per sequence after this forward (cached + new; an engine's
            ``seq_lens``), logical.
        extend_lens: [B] new tokens per sequence, LOGICAL (never padded counts).

    Raises ValueError when a sequence has more new tokens than tokens in total: that is the sign
    of padded counts (``3671 - 3672 = -1``), never a valid batch.
    """
    kv = as_lengths(kv_lens, "kv_lens")
    ext = as_lengths(extend_lens, "extend_lens")
    if kv.numel() != ext.numel():
        raise ValueError(f"kv_lens and extend_lens must have the same size, got {kv.numel()} and {ext.numel()}")
    pre = kv - ext
    bad = torch.nonzero(pre < 0).flatten()
    if bad.numel():
        b = int(bad[0])
        raise ValueError(
            f"extend_lens[{b}]={int(ext[b])} > kv_lens[{b}]={int(kv[b])} (prefix {int(pre[b])}): "
            "extend_lens must be logical token counts, not padded ones"
        )
    return pre


def max_key_len(extend_lens: CountsLike, prefix_lens: CountsLike | None = None) -> int:
    """The longest key range of the batch, ``max(prefix_lens + extend_lens)`` (0 for no sequence).

    From logical lengths only: pad rows are never keys, so no pad delta ever widens it (a
    bottom-right-aligned causal mask with a widened key length shifts every query's window).
    """
    ext = as_lengths(extend_lens, "extend_lens")
    pre = torch.zeros_like(ext) if prefix_lens is None else as_lengths(prefix_lens, "prefix_lens")
    if pre.numel() != ext.numel():
        raise ValueError(f"extend_lens and prefix_lens must have the same size, got {ext.numel()} and {pre.numel()}")
    return int((pre + ext).max()) if ext.numel() else 0
