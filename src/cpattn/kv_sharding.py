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
* :class:`ExtendCostModel` / :func:`choose_extend_algorithm`: pass-KV or pass-Q for an extend
  over a sharded prefix (see docs/sharded-kv.md for the model and its measured crossover).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch
from torch import Tensor

from ._validation import check_int
from .metadata import LengthsLike, as_lengths

__all__ = [
    "ExtendCostModel",
    "KVSharding",
    "choose_extend_algorithm",
]

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
    rest = lens % period - rank * interleave
    if isinstance(rest, np.ndarray):  # np.clip's wrapper costs more than the two ufuncs
        return (lens // period) * interleave + np.minimum(np.maximum(rest, 0), interleave)
    return (lens // period) * interleave + rest.clip(0, interleave)


def local_key_index(positions, cp_size: int, interleave: int):
    """Index of each position's key in its owner's cache (a torch tensor, numpy array or int)."""
    return (positions // (cp_size * interleave)) * interleave + positions % interleave


# ----------------------------------------------------------------------------- pass-KV / pass-Q
@dataclass(frozen=True)
class ExtendCostModel:
    """Time model of an extend over a sharded prefix, per rank (seconds); the plan picks the
    algorithm with the smaller estimate. Constants default to H200 + NVLink measurements
    (docs/sharded-kv.md); an engine passes its own for other hardware.

    pass-KV: ONE all-gather of [extend K/V rows, prefix shard rows]; every rank then runs the
    dense kernel for its queries over the whole prefix + extend:
        t = latency + launch + (C - 1) (P + Np) kv_row / link + work_max / dense_flops
    pass-Q: ONE all-gather of [q, extend K/V] rows, the shard kernel for ALL new queries over
    this rank's keys, ONE all-to-all of the partials back to the query owners, a local merge:
        t = 2 latency + 3 launch + (C - 1) P (q_row + kv_row + part_row) / link
            + work_mean / shard_flops + C P part_row / hbm
    ``launch``: the fixed cost of one kernel (pass-Q runs three: split-KV, combine, merge), which
    decides short extends over short prefixes.
    P: physical rows per rank; Np: the most prefix keys any rank holds; kv_row / q_row /
    part_row: bytes of one token's K+V, q, and (out, lse) partial; work: attention FLOPs
    (``4 Hq (D + Dv) / 2 x`` causal (query, key) pairs: the slowest rank for pass-KV, the mean
    for pass-Q whose sharded keys balance every position range).
    """

    link_bytes_per_s: float = 300e9
    #: calibrated on one H200, 2026-12-01 (decode benchmark, crossover):
    #: the dense kernel on extend-shaped work (few query tiles over a long prefix) and the
    #: split-KV shard kernel at 16k-1M keys, and one kernel's fixed cost
    dense_flops_per_s: float = 400e12
    shard_flops_per_s: float = 300e12
    hbm_bytes_per_s: float = 4.0e12
    collective_latency_s: float = 25e-6
    launch_overhead_s: float = 30e-6

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{f.name} must be a number > 0, got {value!r}")

    def estimate(self, meta, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 head_dim_v: Optional[int] = None, dtype: torch.dtype) -> dict:
        """{"pass_kv": s, "pass_q": s, "bytes_pass_kv": n, "bytes_pass_q": n} for ``meta``
        (a ``CPMetadata`` with a sharded ``kv``). The same on every rank (only batch-wide
        numbers enter)."""
        hq = check_int(num_q_heads, "num_q_heads", 1)
        hkv = check_int(num_kv_heads, "num_kv_heads", 1)
        d = check_int(head_dim, "head_dim", 1)
        dv = d if head_dim_v is None else check_int(head_dim_v, "head_dim_v", 1)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        if getattr(meta, "kv", None) is None:
            raise ValueError("meta has no sharded KV cache: build it with strategy.build_metadata(..., kv=KVSharding(C))")
        item = torch.empty((), dtype=dtype).element_size()
        c, p = meta.cp_size, meta.num_physical_tokens
        np_max = max(meta.num_local_prefix_tokens_per_rank) if meta.num_local_prefix_tokens_per_rank else 0
        kv_row, q_row, part_row = hkv * (d + dv) * item, hq * d * item, hq * (dv * item + 4)
        flop_per_pair = 2.0 * hq * (d + dv)
        work_max = max(meta.causal_work_per_rank) * flop_per_pair if meta.causal_work_per_rank else 0.0
        work_mean = sum(meta.causal_work_per_rank) * flop_per_pair / c
        bytes_kv = (c - 1) * (p + np_max) * kv_row
        bytes_q = (c - 1) * p * (q_row + kv_row + part_row)
        lat = self.collective_latency_s if c > 1 else 0.0
        launch = self.launch_overhead_s
        t_kv = lat + launch + bytes_kv / self.link_bytes_per_s + work_max / self.dense_flops_per_s
        t_q = (2 * lat + 3 * launch + bytes_q / self.link_bytes_per_s + work_mean / self.shard_flops_per_s
               + c * p * part_row / self.hbm_bytes_per_s)
        return {"pass_kv": t_kv, "pass_q": t_q, "bytes_pass_kv": bytes_kv, "bytes_pass_q": bytes_q}


def choose_extend_algorithm(meta, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                            head_dim_v: Optional[int] = None, dtype: torch.dtype,
                            cost_model: Optional[ExtendCostModel] = None) -> str:
    """"pass_kv" or "pass_q" for an extend over a sharded prefix: the smaller estimate of
    ``cost_model`` (default :class:`ExtendCostModel`); "pass_kv" without any cached prefix or
    at C = 1. Deterministic from batch-wide numbers, so every rank picks the same one."""
    model = cost_model or ExtendCostModel()
    if not isinstance(model, ExtendCostModel):
        raise TypeError(f"cost_model must be an ExtendCostModel, got {type(model).__name__}")
    est = model.estimate(meta, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         head_dim_v=head_dim_v, dtype=dtype)
    if meta.cp_size == 1 or meta.num_kv_tokens == meta.num_tokens:
        return "pass_kv"
    return "pass_q" if est["pass_q"] < est["pass_kv"] else "pass_kv"
