"""DSA index scores over one rank's key shard and its top-k candidates (``backend="gemm"``, plan
kind ``"shard_index"``): the first half of the exact global top-k of a decode step over a sharded
cache (:class:`cpattn.plans.IndexTopkPlan`, algorithm "shard_merge").

Every rank holds the same query rows (replicated queries, global positions) and the index keys of
its shard (:class:`cpattn.KVSharding`: local key ``j`` of a sequence at global position
``(j // I) C I + r I + j % I``). A row at global position ``p`` sees the local keys
``j < local_key_counts(p + 1)`` (causal by global position: a prefix of the local keys). Per
layer the plan loops over fixed key chunks of ``width`` local keys (the count is fixed at plan
time: from the longest local sequence, or from the capacity of a static plan, so a CUDA graph of
the step replays for any batch within it): it gathers each row's chunk of keys (packed rows
``cu_local_kv_lens[seq] + j`` or through the page table), scores them with two matmuls
(``einsum`` in float32; float64 for float64 inputs), packs (score, global position) into int64
keys (:mod:`cpattn.selection`) and keeps a running ``torch.topk`` of ``topk`` keys per row.
Device-only: no host sync, no host-to-device copy.

``backend_options``: ``max_score_elems`` (score values per chunk, default 2**24 = 64 MiB of
float32: the gathered keys and the [rows, heads, width] score block stay in that order).
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch
from torch import Tensor

from . import IndexTopkSpec
from ..kv_sharding import local_key_counts
from ..metadata import CPMetadata
from ..selection import NO_KEY, pack_keys, top_keys

__all__ = ["GemmShardIndexBackend", "max_local_keys"]

_DEFAULT_SCORE_ELEMS = 1 << 24


def max_local_keys(meta: CPMetadata) -> int:
    """The most keys one sequence can have on one rank for ``meta``: the longest local sequence,
    or for a static plan the bound over its capacity (rank 0 holds the most)."""
    sh = meta.kv
    if meta.capacity is None:
        return int(meta.max_local_kv_len)
    total = torch.tensor([meta.capacity.max_kv_tokens])
    return int(local_key_counts(total, 0, sh.cp_size, sh.interleave)[0])


def _row_positions(meta: CPMetadata) -> tuple[Tensor, Tensor]:
    """Sequence and global position of every query row (pad rows: sequence 0, position -1),
    from the plan's device fields (fixed addresses in a static plan: graph-safe)."""
    t = meta.shard_index
    b = meta.num_seq_rows
    if b == 0:  # no sequence: every row is a pad row
        return torch.zeros_like(t), torch.full_like(t, -1)
    seq = (torch.searchsorted(meta.cu_extend_lens, t, right=True) - 1).clamp_(0, b - 1)
    cu_kv, cu_ext = meta.cu_kv_lens, meta.cu_extend_lens  # capacity-sized ([B + 1] or [max_seqs + 1])
    pos = cu_kv[seq + 1] - cu_kv[seq] - cu_ext[seq + 1] + t  # prefix + offset in the extend
    pos = torch.where(meta.row_valid, pos, torch.full((), -1, dtype=pos.dtype, device=pos.device))
    return seq, pos


class _ShardIndexRun:
    """A planned index top-k over one key shard (see the module docstring); called per layer."""

    def __init__(self, spec: IndexTopkSpec, meta: CPMetadata, options: Mapping) -> None:
        unknown = set(options) - {"max_score_elems"}
        if unknown:
            raise ValueError(f"unknown gemm backend_options {sorted(unknown)} (known: ['max_score_elems'])")
        budget = int(options.get("max_score_elems") or _DEFAULT_SCORE_ELEMS)
        if budget < 1:
            raise ValueError(f"backend_options max_score_elems must be >= 1, got {budget}")
        sh = meta.kv
        self.spec, self.meta = spec, meta
        self.cp_size, self.interleave, self.rank = sh.cp_size, sh.interleave, meta.rank
        n = meta.num_physical_tokens
        self.num_keys = max_local_keys(meta)
        per_key = max(1, n) * max(spec.num_heads, spec.head_dim)
        self.width = max(16, min(budget // per_key, max(self.num_keys, 1)))
        self.family = "gemm"

    def __call__(self, q_idx: Tensor, k_idx: Tensor, weights: Tensor, k_scale: Optional[Tensor],
                 page_table: Optional[Tensor], softmax_scale: float, out: Tensor) -> None:
        """Write this rank's candidates: ``out`` int64 [N, topk] packed keys (NO_KEY padding)."""
        spec, meta = self.spec, self.meta
        dev = q_idx.device
        work = torch.float64 if torch.float64 in (q_idx.dtype, k_idx.dtype) else torch.float32
        c, il, r = self.cp_size, self.interleave, self.rank
        seq, pos = _row_positions(meta)
        visible = local_key_counts(pos + 1, r, c, il)  # [N] local keys at global positions <= pos
        best = torch.full(out.shape, NO_KEY, dtype=torch.int64, device=dev)
        qw, ww = q_idx.to(work), weights.to(work)
        if spec.paged:
            ps = spec.page_size
            table = page_table.long()[seq]  # [N, max_pages]
        else:
            start = meta.cu_local_kv_lens[seq]
        num_keys = self.num_keys if k_idx.shape[0] else 0  # an empty shard holds no candidate
        for j0 in range(0, num_keys, self.width):
            j = torch.arange(j0, j0 + self.width, device=dev)
            valid = j[None, :] < visible[:, None]  # [N, W]
            gpos = (j // il) * (c * il) + r * il + j % il
            if spec.paged:
                page = table.gather(1, (j // ps).clamp(max=table.shape[1] - 1)[None, :].expand(table.shape[0], -1))
                page = torch.where(valid, page, 0)
                slot = torch.where(valid, j % ps, 0)
                keys = k_idx[page, slot].to(work)  # [N, W, D]
                scale = k_scale[page, slot] if k_scale is not None else None
            else:
                rows = torch.where(valid, start[:, None] + j[None, :], 0)
                keys = k_idx[rows].to(work)
                scale = k_scale[rows] if k_scale is not None else None
            if scale is not None:
                keys = keys * scale.to(work)[..., None]
            s = torch.relu(torch.einsum("nhd,nwd->nhw", qw, keys) * softmax_scale)
            s = torch.einsum("nh,nhw->nw", ww, s)
            best = top_keys(torch.cat([best, pack_keys(s, gpos[None, :], valid)], dim=1), out.shape[1])
        out.copy_(best)


class GemmShardIndexBackend:
    name = "gemm"

    def available(self) -> Optional[str]:
        return None

    def unsupported_reason(self, spec: IndexTopkSpec, meta: CPMetadata) -> Optional[str]:
        return None

    def plan(self, spec: IndexTopkSpec, meta: CPMetadata, options: Mapping) -> _ShardIndexRun:
        return _ShardIndexRun(spec, meta, options)
