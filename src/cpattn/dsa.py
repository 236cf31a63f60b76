"""DeepSeek sparse attention (DSA) under CP: key ranges and the lightning indexer's top-k.

A DSA layer (DeepSeek-V3.2, GLM-5) scores every visible key of a query with a small "lightning
indexer" and attends only to the ``topk`` best. Under CP each rank holds strided (interleave) or
blocked (zigzag) query rows of a sequence, and every one of them may select any earlier key of
its sequence, so the index keys of the whole sequence are gathered once per layer together with
the MLA latent (``strategy.gather_packed([kv_c, k_pe, k_idx], meta, group)``, ONE all-gather).
This module selects the keys:

* :func:`key_ranges`: per local row, the packed K/V rows ``[ks, ke)`` it may see (what
  DeepGEMM-style indexer kernels take);
* :func:`index_topk`: per local row, the positions of its ``topk`` best-scoring visible keys.

Sparse attention over the selection is ``strategy.sparse_attention`` (see
:mod:`cpattn.plans.sparse` for the causal rule). docs/dsa.md has the data flow.

Decode over a SHARDED cache (replicated queries, ``kv=KVSharding(C)``): each rank scores its own
index keys and the ranks agree on the exact global top-k in ONE all-gather of per-rank
candidates (:func:`select_candidates`; ties to the lower position, :mod:`cpattn.selection`;
bytes: :func:`topk_agreement_bytes`); ``index_topk(..., group=)`` or the plan form does it.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch
from torch import Tensor

from ._validation import check_int, check_softmax_scale, check_tensor
from .metadata import CPMetadata
from .plan_cache import cached_plan
from .plans.sparse import IndexTopkPlan, plan_index_topk, select_candidates

__all__ = ["index_topk", "key_ranges", "select_candidates", "topk_agreement_bytes"]

#: Bytes of one top-k candidate in the agreement over a sharded cache: a float32 score and a
#: 32-bit position packed in one int64 (:mod:`cpattn.selection`).
CANDIDATE_BYTES = 8


def topk_agreement_bytes(num_rows: int, topk: int, cp_size: int) -> int:
    """Bytes each rank receives in the top-k agreement of one DSA layer over a sharded cache
    (the ONE all-gather of :meth:`IndexTopkPlan.run`, algorithm "shard_merge"):
    ``(C - 1) * N * topk * 8`` for ``N`` query rows (it sends ``N * topk * 8``)."""
    n = check_int(num_rows, "num_rows", 0)
    k = check_int(topk, "topk", 1)
    c = check_int(cp_size, "cp_size", 1)
    return (c - 1) * n * k * CANDIDATE_BYTES


def key_ranges(meta: CPMetadata) -> tuple[Tensor, Tensor]:
    """Packed K/V rows each local row may see: ``ks`` = row of its sequence's first key
    (``cu_kv_lens[seq]``), ``ke = ks + position + 1`` (causal: keys at positions ``<=`` its own).

    Returns:
        (ks, ke): int32 [P] each on ``meta.device``; pad rows ``ks = ke = 0``. Device-only (from
        the plan's capacity-sized fields: graph-safe for static plans).

    Example::

        ks, ke = cpattn.dsa.key_ranges(meta)   # row i scores k_idx_all[ks[i]:ke[i]]
    """
    if not isinstance(meta, CPMetadata):
        raise TypeError(f"meta must be a CPMetadata, got {type(meta).__name__}")
    p, device = meta.num_physical_tokens, meta.device
    if meta.num_seqs == 0 or p == 0:
        zeros = torch.zeros(p, dtype=torch.int32, device=device)
        return zeros, zeros.clone()
    t = meta.shard_index
    seq = torch.searchsorted(meta.cu_extend_lens, t, right=True) - 1
    seq = seq.clamp_(0, meta.num_seqs - 1)
    pos = meta.prefix_lens[seq] + t - meta.cu_extend_lens[seq]
    ks = meta.cu_kv_lens[seq]
    zero = torch.zeros((), dtype=ks.dtype, device=device)
    ke = torch.where(meta.row_valid, ks + pos + 1, zero)
    ks = torch.where(meta.row_valid, ks, zero)
    return ks.to(torch.int32), ke.to(torch.int32)


def index_topk(
    q_idx: Tensor,
    k_idx_all: Tensor,
    weights: Tensor,
    meta: CPMetadata,
    topk: int,
    *,
    softmax_scale: Optional[float] = None,
    page_table: Optional[Tensor] = None,
    k_scale: Optional[Tensor] = None,
    backend: str = "auto",
    backend_options: Optional[Mapping] = None,
    out: Optional[Tensor] = None,
    group=None,
) -> Tensor:
    """The DSA lightning indexer's selection for this rank's local rows.

    Score of key ``s`` for row ``t``: ``sum_h weights[t, h] * relu(scale * q_idx[t, h] . k[s])``
    with ``k[s] = k_idx_all[s] * k_scale[s]`` (``k_scale`` given) or ``k_idx_all[s]``.

    Args:
        q_idx: [P, H_i, D_i] index queries (bf16 / fp16 / fp32; fp8 e4m3 together with fp8 keys).
        k_idx_all: index keys packed like K/V (prefix then extend per sequence)
            [num_kv_tokens, D_i], or paged [num_pages, page_size, D_i] with ``page_table``
            [B, max_pages] int32/int64. Any float dtype (fp8 with ``k_scale``).
        weights: [P, H_i] float per-row head weights (any float dtype).
        meta: the placement plan. topk: keys per row (>= 1).
        softmax_scale: ``scale`` above, default D_i ** -0.5.
        k_scale: float32 scale per index key ([num_kv_tokens], or [num_pages, page_size]).
        backend: "auto" (triton, then torch), "triton" or "torch". backend_options: backend knobs.
        out: an int32 [P, topk] buffer to write.
        group: the CP group of a decode step over a sharded cache (``meta`` from the "replicated"
            strategy with ``kv=KVSharding(C)``): ``k_idx_all`` / ``k_scale`` / ``page_table``
            are then this rank's shard, and ONE all-gather of per-rank candidates gives every
            rank the exact global top-k (:meth:`cpattn.plans.IndexTopkPlan.run`).

    Returns:
        int32 [P, topk]: per real row the positions (index in its sequence, prefix counted) of
        its ``topk`` best scores among keys at positions ``<=`` its own (ties: the lower position,
        every backend and over a sharded cache), in unspecified order,
        ``-1`` where fewer than ``topk`` keys are visible; pad rows all ``-1``. Memory stays
        bounded (scores are computed in chunks over rows and keys, never [P, max_kv_len]).
        Per layer: device work plus a host loop over the plan's chunks, no host sync. The plan
        is built on the first call for a layer kind and cached on ``meta``.

    Example::

        kv_c, k_pe, k_idx = s.gather_packed([kv_c, k_pe, k_idx], meta, group)
        idx = cpattn.dsa.index_topk(q_idx, k_idx_packed, weights, meta, 2048)
    """
    softmax_scale = check_softmax_scale(softmax_scale)  # before planning (ValueError / TypeError naming it)
    plan = _cached_index_plan(q_idx, k_idx_all, weights, meta, topk, page_table, k_scale, backend, backend_options)
    return plan.run(q_idx, k_idx_all, weights, k_scale=k_scale, page_table=page_table, softmax_scale=softmax_scale,
                    out=out, group=group)


def _cached_index_plan(q_idx, k_idx_all, weights, meta, topk, page_table, k_scale, backend,
                       backend_options) -> IndexTopkPlan:
    if not isinstance(meta, CPMetadata):
        raise TypeError(f"meta must be a CPMetadata, got {type(meta).__name__}")
    topk = check_int(topk, "topk", 1)
    check_tensor(q_idx, "q_idx")
    check_tensor(k_idx_all, "k_idx_all")
    check_tensor(weights, "weights")
    if q_idx.dim() != 3 or not q_idx.dtype.is_floating_point:
        raise ValueError(f"q_idx must be a float [P, H_i, D_i] tensor, got {q_idx.dtype} {list(q_idx.shape)}")
    if weights.dim() != 2 or weights.shape != q_idx.shape[:2]:
        raise ValueError(f"weights must be [P, H_i] = {list(q_idx.shape[:2])} (as q_idx), got {list(weights.shape)}")
    paged = page_table is not None
    if k_idx_all.dim() != (3 if paged else 2) or k_idx_all.shape[-1] != q_idx.shape[-1]:
        layout = "[num_pages, page_size, D_i]" if paged else "[num_kv_tokens, D_i]"
        raise ValueError(f"k_idx_all must be {layout} with D_i = {q_idx.shape[-1]} (as q_idx), "
                         f"got {list(k_idx_all.shape)}")
    if not k_idx_all.dtype.is_floating_point:
        raise TypeError(f"k_idx_all must be a float tensor (fp8 with k_scale), got {k_idx_all.dtype}")
    page_size = k_idx_all.shape[1] if paged else None
    key = ("index", q_idx.shape[1], q_idx.shape[2], q_idx.dtype, k_idx_all.dtype, topk, page_size,
           k_scale is not None, backend, repr(sorted((backend_options or {}).items())))
    return cached_plan(meta, key, lambda: plan_index_topk(
        meta, num_heads=q_idx.shape[1], head_dim=q_idx.shape[2], q_dtype=q_idx.dtype, k_dtype=k_idx_all.dtype,
        topk=topk, page_size=page_size, has_k_scale=k_scale is not None, backend=backend,
        backend_options=backend_options))
