"""Replicated queries over a sharded KV cache: algorithm "shard_merge" (decode context parallelism).

The placement plan comes from the "replicated" strategy with a sharded ``kv``
(``get_strategy("replicated", C).build_metadata(q_lens, prefix_lens, rank=, kv=KVSharding(C))``):
every rank holds the same query rows (the last ``q_len`` positions of each sequence; q_len >= 1
for speculative verification) and 1/C of every sequence's keys. The backend (kind ``"shard"``:
``triton`` split-KV, ``torch`` reference) decides the launch geometry (query tiles, split sizes
from the key lengths and the SM count) at plan time and uploads it in one copy.

``attend`` returns this rank's partial ``(out, lse)``: exact attention over its keys with the
causal rule and window by GLOBAL position (a rank holding no visible key of a row gives 0 /
-inf; sinks count on rank 0 only, so they count once over the group). ``run`` writes the rows
this rank stores, attends, and merges the partials exactly in ONE collective
(:func:`cpattn.merge_partials`). With a static plan every table sits at a fixed address, grids
are sized for the capacity and kernels read counts from device memory: a CUDA graph of a step
replays for every step (``triton``; ``torch`` loops on the host).

With a spec's ``topk`` (DSA) the plan is a :class:`SparseShardMergePlan`: the sparse kernel over
the selected keys this rank owns (kind ``"sparse"``), the same exact merge.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from .._validation import check_bool
from ..cache import CacheWritePlan, check_kv_writes, check_mla_tile_writes, write_kv_cache, write_mla_cache
from ..collectives import check_group
from ..kernels import row_positions
from ..merge import merge_partials, partials_header
from ..metadata import CPMetadata
from ..quant import FP8_TILE
from .base import KERNEL_CALL, AttentionPlan, KernelCall, tile_row_bytes
from .sparse import check_plan_index

if TYPE_CHECKING:  # annotations only (typing.Unpack: Python >= 3.11)
    from typing_extensions import Unpack

__all__ = ["ShardMergePlan", "SparseShardMergePlan", "local_key_view"]


_ATTEND = KERNEL_CALL - {"return_lse"}  # the partials come back with their lse
_RUN = KERNEL_CALL - {"out", "lse"}  # merge_partials allocates the merged result


class ShardMergePlan(AttentionPlan):
    """Replicated queries over this rank's key shard, merged over the ranks.

    ``run``'s merge checks that every rank passes partials of one shape, dtype and
    ``scatter_heads`` (a tiny header all-gather, :func:`cpattn.merge_partials`) the first time
    this plan merges them over a group; the plan remembers the headers it checked
    (:attr:`agreed_partials`), so its later layers run the ONE data collective alone.
    """

    algorithm = "shard_merge"
    _keys_what = "this rank's longest shard"

    def __init__(self, meta, spec, backend: str, run_impl) -> None:
        super().__init__(meta, spec, backend, run_impl, rows=meta.num_physical_tokens,
                         kv_rows_min=meta.num_local_kv_tokens, max_keys=meta.max_local_kv_len, rows_name="Nq")
        self._agreed: set[tuple[int, ...]] = set()

    @property
    def agreed_partials(self) -> frozenset[tuple[int, ...]]:
        """The partials headers (:func:`cpattn.merge.partials_header`: N, Hq, Dv, dtype code,
        scatter_heads) every rank of the group was checked to merge with this plan (a plan
        merges over one group: the one its placement plan was agreed over)."""
        return frozenset(self._agreed)

    def merge(self, out_part: Tensor, lse_part: Tensor, group=None, *, scatter_heads: bool = False,
              return_lse: bool = False, agree: bool = True) -> Tensor | tuple[Tensor, Tensor]:
        """:func:`cpattn.merge_partials` of this plan's partials (``meta=`` this plan's), ONE
        collective; with ``agree`` the partials header is checked over the group only the first
        time this plan merges it (:attr:`agreed_partials`), ``agree=False``: never (the caller
        guarantees it). ``attend`` + ``merge`` is ``run`` without the write."""
        check_bool(agree, "agree")
        header = partials_header(out_part, scatter_heads) if isinstance(scatter_heads, bool) else None
        check = agree and header not in self._agreed
        out = merge_partials(out_part, lse_part, group, scatter_heads=scatter_heads, meta=self.meta,
                             return_lse=return_lse, agree=check)
        if check and self.meta.cp_size > 1 and not (torch.cuda.is_available()
                                                    and torch.cuda.is_current_stream_capturing()):
            self._agreed.add(header)  # checked over the group (merge_partials raised otherwise)
        return out

    def attend(self, q: Tensor, k_cache: Tensor, v_cache: Tensor,
               **call: Unpack[KernelCall]) -> tuple[Tensor, Tensor]:
        """The kernel alone: this rank's partial attention over its key shard (device-only).

        Args:
            q: [Nq, Hq, D] query rows, sequence after sequence (Nq = ``meta.num_physical_tokens``),
                the same on every rank.
            k_cache, v_cache: this rank's keys. Paged: [num_pages, page_size, Hkv, D] / [.., Dv]
                with ``page_table`` [B, max_pages] (local key j of sequence b at page
                ``page_table[b, j // page_size]``, slot ``j % page_size``). Packed: [>= rows,
                Hkv, D] / [.., Dv], local key j of sequence b at row ``cu_local_kv_lens[b] + j``.
                Any row strides; ``v_cache`` may be a view of ``k_cache[..., :Dv]`` (MLA's
                absorbed form: K is then read once). Slots past a sequence's keys are never read.
            **call: :class:`KernelCall` but ``return_lse`` (both are returned): ``page_table``,
                ``sinks`` ([Hq] float when the spec has sinks; joins rank 0's partial only),
                ``softmax_scale`` (default D ** -0.5), ``out`` / ``lse`` ([Nq, Hq, Dv] in q's
                dtype / [Nq, Hq] float32 buffers), ``k_scale`` / ``v_scale`` (an FP8 spec only,
                required there: float32 ``[]`` or ``[Hkv]`` device tensors, :mod:`cpattn.quant`).

        Returns:
            (out_part [Nq, Hq, Dv] in q's dtype, lse_part [Nq, Hq] float32, natural log; rows
            with no visible key on this rank 0 / -inf; pad rows 0 / -inf).
        """
        page_table, sinks, softmax_scale, out, lse, _, scales = self._kernel_call(call, "attend", _ATTEND)
        self._check_call(q, k_cache, v_cache, page_table, sinks)
        out, lse = self._result(out, lse, True)
        self._launch(q, k_cache, v_cache, page_table, sinks, self._softmax_scale(softmax_scale), out, lse,
                     scales=scales)
        return out, lse

    def run(self, q: Tensor, k: Tensor, v: Tensor, cache, *, writes: Optional[CacheWritePlan] = None, group=None,
            scatter_heads: bool = False, agree: bool = True,
            **call: Unpack[KernelCall]) -> Tensor | tuple[Tensor, Tensor]:
        """One layer: write this rank's share of the new K/V, attend the shard, merge (ONE collective).

        Args:
            q, k, v: the step's new rows [Nq, Hq, D] / [Nq, Hkv, D] / [Nq, Hkv, Dv], the same on
                every rank.
            cache: this rank's caches ``(k_cache, v_cache)`` (as :meth:`attend`).
            writes: :func:`cpattn.plan_cache_writes` of this step (the rows this rank stores), or
                None when the caches already hold the step's keys.
            group: the CP group (None: the default group).
            scatter_heads: as :func:`cpattn.merge_partials`.
            agree: True: the merge checks the partials header over the group the first time
                this plan merges it (one tiny all-gather; later layers skip it). False: the
                caller guarantees every rank merges partials of this shape, dtype and
                ``scatter_heads`` (e.g. an engine whose plan of an earlier step over the same
                group checked the same spec): no check.
            **call: :class:`KernelCall` but ``out`` / ``lse``: ``page_table``, ``sinks``,
                ``softmax_scale``, ``k_scale`` / ``v_scale`` as :meth:`attend` (an FP8 spec: the
                rows this rank stores are quantized as they are written); ``return_lse`` as
                :func:`cpattn.merge_partials`.

        A tile-scaled latent spec (``kv_layout="fp8_tile"``): ``k`` is the new latent rows [Nq, 1,
        D] in the plan's dtype, ``v`` the view ``k[..., :Dv]``, ``cache`` ``(rows, rows)`` (ONE
        uint8 tensor twice); the rows this rank stores are quantized to tile rows as they are
        written (:func:`cpattn.write_mla_cache` with ``layout=``).

        Returns:
            out [Nq, Hq, Dv] (or this rank's heads with scatter_heads), or (out, lse).
        """
        page_table, sinks, softmax_scale, _, _, return_lse, scales = self._kernel_call(call, "run", _RUN)
        check_bool(agree, "agree")
        k_cache, v_cache = self._write_step(q, k, v, cache, writes, group, page_table, sinks, scales)
        k_scale, v_scale = scales or (None, None)
        out_p, lse_p = self.attend(q, k_cache, v_cache, page_table=page_table, sinks=sinks,
                                   softmax_scale=softmax_scale, k_scale=k_scale, v_scale=v_scale)
        return self.merge(out_p, lse_p, group, scatter_heads=scatter_heads, return_lse=return_lse, agree=agree)

    def _write_step(self, q, k, v, cache, writes, group, page_table, sinks,
                    scales: Optional[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        """``run``'s steps before the kernel: every local check (before any write or collective),
        then the write of this rank's share of the new K/V (quantized with ``scales``, the
        checked pair of an FP8 cache) -> this rank's (k_cache, v_cache)."""
        meta = self.meta
        self._check_new_rows(q, k, v, meta.num_physical_tokens)
        if self.spec.kv_tiled:
            return self._write_tiles(k, v, cache, writes, group, page_table, sinks)
        k_scale, v_scale = scales or (None, None)
        k_cache, v_cache = self._cache_pair(cache, "this rank's caches")
        if writes is not None:
            check_kv_writes(writes, k_cache, v_cache, meta.num_physical_tokens, k, v, k_scale=k_scale,
                            v_scale=v_scale)
        self._check_before_write(page_table, sinks, (k_cache, v_cache))
        check_group(meta, group)  # local checks, before any write or collective
        if writes is not None:
            write_kv_cache(k, v, k_cache, v_cache, writes, k_scale=k_scale, v_scale=v_scale)
        return k_cache, v_cache

    def _write_tiles(self, k, v, cache, writes, group, page_table, sinks) -> tuple[Tensor, Tensor]:
        """:meth:`_write_step` of a tile spec (q / k / v checked): every check, then the rows this
        rank stores quantized to tile rows as they are written -> (rows, rows)."""
        self._check_latent_view(k, v)
        tiles = self._tile_cache(cache, "this rank's tile cache")
        self._check_before_write(page_table, sinks, (tiles, tiles))
        if writes is not None:
            check_mla_tile_writes(writes, tiles[..., 0, :], self.meta.num_physical_tokens, tile_row_bytes(self.spec),
                                  self._device)
        check_group(self.meta, group)  # local checks, before any write or collective
        if writes is not None:
            dv = self.spec.head_dim_v
            write_mla_cache(k[:, 0, :dv], k[:, 0, dv:], tiles[..., 0, :], writes, layout=FP8_TILE)
        return tiles, tiles


def local_key_view(meta: CPMetadata) -> CPMetadata:
    """``meta`` (replicated queries over a sharded cache) with each sequence's packed K/V rows
    starting at ``cu_local_kv_lens`` (this rank's packed cache): what the sparse kernels read
    (row positions stay global)."""
    host = meta.host if meta.host is not None else meta
    local_host = dataclasses.replace(host, cu_kv_lens=host.cu_local_kv_lens, host=None)
    return dataclasses.replace(meta, cu_kv_lens=meta.cu_local_kv_lens, host=local_host)


class SparseShardMergePlan(ShardMergePlan):
    """DSA sparse attention (``spec.topk``) of replicated queries over this rank's key shard,
    merged over the ranks (decode over a sharded cache).

    The selection ``idx`` holds GLOBAL positions (the same on every rank:
    :meth:`cpattn.plans.IndexTopkPlan.run` over the same plan); a rank attends the selected
    keys it owns (position ``p`` -> local key ``KVSharding.local_index(p)``; positions it does
    not own are masked) with the sparse kernel, and the partials merge exactly in ONE collective.
    """

    def __init__(self, meta, spec, backend: str, run_impl, view: Optional[CPMetadata] = None) -> None:
        """``view``: the :func:`local_key_view` of ``meta`` the kernel was planned over (None:
        made here); the row positions come from its per-row table (the kernel's own upload)."""
        super().__init__(meta, spec, backend, run_impl)
        self._idx_shape = (meta.num_physical_tokens, spec.topk)
        sh = meta.kv
        self._cp, self._interleave = sh.cp_size, sh.interleave
        #: [Nq, 1] int32 global position of each row (pad rows -1): the causal bound of its entries
        self._row_pos = row_positions(local_key_view(meta) if view is None else view)[:, None]

    def local_index(self, idx: Tensor) -> Tensor:
        """Global positions [Nq, topk] -> this rank's local key indices (idx's dtype; -1 where the
        position is negative, past the row's position (future, or past its sequence) or not this
        rank's). Device-only (graph-safe: the row positions sit in the plan's table)."""
        c, il, r = self._cp, self._interleave, self.meta.rank
        visible = (idx >= 0) & (idx <= self._row_pos)
        if il == 1:
            owned = visible & (idx % c == r)
            local = idx // c
        else:
            block = idx // il
            owned = visible & (block % c == r)
            local = (block // c) * il + idx % il
        return local.masked_fill_(~owned, -1)

    def attend(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, idx: Optional[Tensor] = None,
               **call: Unpack[KernelCall]) -> tuple[Tensor, Tensor]:
        """The kernel alone: this rank's partial sparse attention over its selected keys.

        Args:
            q, k_cache, v_cache: as :meth:`ShardMergePlan.attend` (this rank's caches).
            idx: [Nq, topk] int32/int64 GLOBAL key positions per row (the agreed selection;
                -1 padding; future positions ignored).
            **call: as :meth:`ShardMergePlan.attend` (``sinks`` join rank 0's partial only;
                an FP8 spec's ``k_scale`` / ``v_scale`` are required).

        Returns:
            (out_part [Nq, Hq, Dv], lse_part [Nq, Hq] float32): rows selecting none of this
            rank's keys 0 / -inf (rank 0 with sinks: 0 / the sink); pad rows 0 / -inf.
        """
        page_table, sinks, softmax_scale, out, lse, _, scales = self._kernel_call(call, "attend", _ATTEND)
        self._check_call(q, k_cache, v_cache, page_table, sinks)
        self._check_idx(idx)
        out, lse = self._result(out, lse, True)
        local = self.local_index(idx)
        self._launch(q, k_cache, v_cache, local, page_table, sinks if self.meta.rank == 0 else None,
                     self._softmax_scale(softmax_scale), out, lse, scales=scales)
        return out, lse

    def run(self, q: Tensor, k: Tensor, v: Tensor, cache, *, idx: Optional[Tensor] = None,
            writes: Optional[CacheWritePlan] = None, group=None, scatter_heads: bool = False, agree: bool = True,
            **call: Unpack[KernelCall]) -> Tensor | tuple[Tensor, Tensor]:
        """One layer: write this rank's share of the new K/V, attend its selected keys, merge
        (ONE collective). Arguments as :meth:`ShardMergePlan.run`, plus ``idx`` (as
        :meth:`attend`) and ``agree`` (as :meth:`ShardMergePlan.run`). Every check runs before the
        write and the collective."""
        page_table, sinks, softmax_scale, _, _, return_lse, scales = self._kernel_call(call, "run", _RUN)
        check_bool(agree, "agree")
        self._check_idx(idx)
        k_cache, v_cache = self._write_step(q, k, v, cache, writes, group, page_table, sinks, scales)
        k_scale, v_scale = scales or (None, None)
        out_p, lse_p = self.attend(q, k_cache, v_cache, idx, page_table=page_table, sinks=sinks,
                                   softmax_scale=softmax_scale, k_scale=k_scale, v_scale=v_scale)
        return self.merge(out_p, lse_p, group, scatter_heads=scatter_heads, return_lse=return_lse, agree=agree)

    def _check_idx(self, idx) -> None:
        if idx is None:
            raise ValueError("idx is required: the plan is sparse (AttentionSpec(topk=)); pass the agreed selection")
        check_plan_index(idx, self._idx_shape, self._device, "Nq")
