"""Shared machinery of every CP strategy: planning, shard, gather, K/V gather, attention dispatch.

A concrete strategy only says which rank owns each token (``_token_owner``) and the position step
inside one of its query segments (``segment_stride``). Everything else lives here, once.

Plan-then-run: :meth:`CPStrategy.build_metadata` runs on the host once per forward pass (it may
allocate and sync); ``shard``/``gather``/``gather_kv``/``attention`` are the per-layer path and do
no host sync of their own once the metadata is on the device.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from .._validation import check_bool, check_int, check_process_group, check_tensor
from ..collectives import PendingGather, agree_on_plan, all_gather_rows, check_group
from ..metadata import CPMetadata, LengthsLike, as_lengths, build_metadata, token_owners
from ..plan_cache import cached_plan
from ..plans import AttentionPlan, plan_attention
from ..plans.base import KernelCall, check_qkv
from ..plans.sparse import check_index
from ..quant import FP8_TILE, quantize_mla_fp8_tiles
from ..spec import FP8_KV_DTYPES, AttentionSpec

if TYPE_CHECKING:  # annotations only (typing.Unpack: Python >= 3.11)
    from typing_extensions import Unpack

__all__ = ["CPStrategy", "RotatingStrategy", "block_of", "rotation_offsets"]


def block_of(offsets: Tensor, lengths: Tensor, num_blocks: int) -> Tensor:
    """Block index of each offset when a length-L run is cut into ``num_blocks`` contiguous blocks
    of sizes ``L // num_blocks + (j < L % num_blocks)`` (earlier blocks take the remainder)."""
    base = lengths // num_blocks
    rem = lengths % num_blocks
    big_rows = rem * (base + 1)
    in_big = offsets < big_rows
    return torch.where(
        in_big,
        offsets // (base + 1),
        rem + (offsets - big_rows) // base.clamp(min=1),
    )


def rotation_offsets(extend_lens: Tensor, num_blocks: int, cp_size: int) -> Tensor:
    """Per sequence, the rank shift ``(sum of L % num_blocks over earlier sequences) % C`` [B]:
    the next sequence's remainder rows start on the rank after the previous one's."""
    rem = (extend_lens % num_blocks).long()
    return ((torch.cumsum(rem, 0) - rem) % cp_size).to(extend_lens.dtype)


def _keys_seen(n: np.ndarray, cap: Optional[int]) -> np.ndarray:
    """``sum_{x=1..n} min(x, cap)`` per entry (float64): the (query, key) pairs of queries at
    positions ``0 .. n - 1``."""
    n = n.astype(np.float64)
    if cap is None:
        return n * (n + 1) / 2
    return np.where(n <= cap, n * (n + 1) / 2, cap * (cap + 1) / 2 + (n - cap) * cap)


def _check_same(tensors: dict[str, Tensor], what: str) -> None:
    names = list(tensors)
    first = tensors[names[0]]
    for name in names[1:]:
        other = getattr(tensors[name], what)
        if other != getattr(first, what):
            raise ValueError(f"{name} {what} {other} != {names[0]} {what} {getattr(first, what)}")


class CPStrategy(ABC):
    """Base of the CP strategies. ``cp_size``: ranks C >= 1; ``pad_multiple``: physical row count
    alignment (e.g. 8 or 64 for engines whose kernels or CUDA graphs want aligned batches)."""

    name: ClassVar[str]

    def __init__(self, cp_size: int, pad_multiple: int = 1) -> None:
        self.cp_size = check_int(cp_size, "cp_size", 1)
        self.pad_multiple = check_int(pad_multiple, "pad_multiple", 1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cp_size={self.cp_size}, pad_multiple={self.pad_multiple})"

    @property
    def replicated(self) -> bool:
        """Does every rank compute every query (no collective for queries)?"""
        return False

    @property
    def segment_stride(self) -> int:
        """Position step between consecutive local rows inside one kernel segment."""
        return 1

    @abstractmethod
    def _token_owner(self, seq_ids: Tensor, offsets: Tensor, extend_lens: Tensor) -> Tensor:
        """Owning rank of every logical token (same int dtype as the inputs). seq_ids, offsets: [T];
        extend_lens: [B]; int32, or int64 for batches past 2**31 keys."""

    @abstractmethod
    def max_local_tokens(self, max_tokens: int, max_seqs: int) -> int:
        """Most real rows one rank can own for any batch of <= max_tokens tokens in <= max_seqs
        sequences (what a static plan's physical rows must hold, before alignment)."""

    def max_segments(self, max_seqs: int) -> int:
        """Most query segments one rank can have for <= max_seqs sequences."""
        return max_seqs

    # ------------------------------------------------------------------ plan (host, per forward)
    def rank_loads(self, extend_lens: LengthsLike, prefix_lens: Optional[LengthsLike] = None, *,
                   keys_cap: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
        """What each rank would compute for a batch, without planning it (host; O(B) for the
        replicated placement, O(T) otherwise).

        Returns ``(rows, pairs)``: int64 [C] new tokens each rank computes (before padding) and
        float64 [C] (query, key) pairs they attend: a query at position ``p`` sees
        ``min(p + 1, keys_cap)`` keys (``keys_cap``: None, or the window / top-k bound).
        :func:`cpattn.choose_placement` prices placements with it.
        """
        ext = as_lengths(extend_lens, "extend_lens")
        pre = torch.zeros_like(ext) if prefix_lens is None else as_lengths(prefix_lens, "prefix_lens")
        if pre.numel() != ext.numel():
            raise ValueError(f"extend_lens and prefix_lens must have the same size, got {ext.numel()} and "
                             f"{pre.numel()}")
        cap = None if keys_cap is None else check_int(keys_cap, "keys_cap", 1)
        c = self.cp_size
        if self.replicated:
            e, p = ext.numpy(), pre.numpy()
            pairs = float((_keys_seen(p + e, cap) - _keys_seen(p, cap)).sum())
            return np.full(c, int(e.sum()), dtype=np.int64), np.full(c, pairs)
        _, positions, owner = token_owners(self._token_owner, ext, pre)
        seen = (positions.long() + 1).double()
        if cap is not None:
            seen = seen.clamp(max=cap)
        rows = torch.bincount(owner, minlength=c).numpy().astype(np.int64)
        return rows, torch.bincount(owner, weights=seen, minlength=c).numpy()

    def build_metadata(
        self,
        extend_lens: LengthsLike,
        prefix_lens: Optional[LengthsLike] = None,
        *,
        rank: int,
        group=None,
        agree: bool = True,
        kv=None,
        index_topk: Optional[int] = None,
    ) -> CPMetadata:
        """Plan a batch for ``rank`` (host, O(T + B); call once per forward, then ``.to(device)``).

        Args:
            extend_lens: [B] new tokens per sequence (list, tuple, numpy array or 1-D int tensor;
                0 allowed).
            prefix_lens: [B] tokens per sequence already in the KV cache (default 0).
            rank: this process's rank in the CP group, in [0, cp_size).
            group: the CP process group; None: torch.distributed's default group. The ranks
                exchange a small plan fingerprint in ONE tiny all-gather over it (a host sync)
                and every rank raises the same ValueError
                (:class:`cpattn.collectives.PlanDisagreement`) when any rank planned a different
                batch, strategy or alignment, claims another rank's rank, or failed to plan
                (a rank whose planning raised re-raises its own error; the others name it).
                A group whose size is not ``cp_size`` is a ValueError found locally first.
                The plan remembers the group; later calls check this process's rank against it.
                With group=None the exchange runs only when it can matter: ``cp_size > 1`` and
                an initialized default process group (single-process use needs none).
            agree: False skips the exchange (and the group-size check): the caller guarantees
                that every rank plans the same batch (e.g. plans for several ranks in one
                process, or an engine that agrees by other means). Explicit opt-out only: with
                the default True, ranks that planned different batches raise instead of
                silently mixing data.
            kv: where the KV cache lives: None for a cache replicated on every rank, or a
                :class:`cpattn.KVSharding` (same cp_size) for a sharded cache: the plan then also
                says which extend rows this rank stores and their local cache indices
                (``meta.store_rows`` / ``meta.store_index``, for :func:`cpattn.plan_cache_writes`)
                and how many keys each rank holds per sequence. Part of the agreed fingerprint.
            index_topk: the DSA index top-k of the step's layers (int >= 1), or None. Part of the
                agreed fingerprint (ranks that give different values raise PlanDisagreement
                here) and kept as ``meta.index_topk``: an index top-k over a sharded cache
                (:meth:`cpattn.IndexTopkPlan.run`) then exchanges its candidates without a
                shape check of its own (see docs/dsa.md).

        Example::

            meta = cpattn.ZigzagStrategy(2).build_metadata([5, 9], [0, 3], rank=1).to("cuda")
        """
        def build() -> CPMetadata:  # a failure here (kv, index_topk included) still joins the exchange
            self.check_kv(kv)
            topk = 0 if index_topk is None else check_int(index_topk, "index_topk", 1)
            return self.plan_host(extend_lens, prefix_lens, rank, kv=kv, index_topk=topk)

        return self.agreed(build, group, agree)

    def check_kv(self, kv) -> None:
        """TypeError / ValueError unless ``kv`` is None or a KVSharding over this strategy's C."""
        if kv is not None:
            from ..kv_sharding import KVSharding

            if not isinstance(kv, KVSharding):
                raise TypeError(f"kv must be None or a cpattn.KVSharding, got {type(kv).__name__}")
            if kv.cp_size != self.cp_size:
                raise ValueError(f"kv has cp_size={kv.cp_size} but the strategy has cp_size={self.cp_size}")

    def plan_host(self, extend_lens, prefix_lens, rank, physical_rows: Optional[int] = None,
                  kv=None, index_topk: int = 0) -> CPMetadata:
        """``build_metadata`` without the plan exchange (host only; ``physical_rows``: a static
        plan's fixed P; ``index_topk``: 0 for none). Planners call it inside :meth:`agreed`."""
        return build_metadata(
            self.name,
            self._token_owner,
            self.segment_stride,
            self.cp_size,
            rank,
            self.pad_multiple,
            extend_lens,
            prefix_lens,
            physical_rows,
            kv,
            self.replicated,
            index_topk,
        )

    def agreed(self, build, group, agree: bool = True) -> CPMetadata:
        """Run ``build()`` and exchange its fingerprint over the CP group (``group``; None: the
        default group, when there is one and cp_size > 1), also when it failed: any exception of
        ``build`` (or a group whose size is not cp_size, found locally first) joins the exchange as
        "failed", so every rank raises promptly. ``agree=False``: ``build()`` alone."""
        check_bool(agree, "agree")
        check_process_group(group)
        if not agree:
            meta = build()
            return meta if group is None else dataclasses.replace(meta, group=group)
        if group is None:
            if self.cp_size == 1 or not (dist.is_available() and dist.is_initialized()):
                return build()
            group = dist.group.WORLD
            named = "group=None (the default process group)"
        else:
            named = "group"
        size = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else None
        try:
            if size is not None and size != self.cp_size:
                raise ValueError(f"{named} has {size} ranks but cp_size={self.cp_size}: a plan for {self.cp_size} "
                                 f"ranks cannot run on it (pass the CP process group as group=)")
            meta = build()
        except Exception:
            if size is not None:
                try:  # join the exchange so the other ranks raise too, then raise this rank's own error
                    agree_on_plan(None, group, self.cp_size)
                except Exception:  # noqa: BLE001 - this rank's own error is the one to report
                    pass
            raise
        agree_on_plan(meta.fingerprint, group, self.cp_size)
        return dataclasses.replace(meta, group=group)

    def check_metadata(self, meta: CPMetadata) -> None:
        """ValueError unless ``meta`` was built by this kind of strategy with the same geometry."""
        if not isinstance(meta, CPMetadata):
            raise TypeError(f"meta must be a CPMetadata, got {type(meta).__name__}")
        if (meta.strategy, meta.cp_size, meta.pad_multiple) != (self.name, self.cp_size, self.pad_multiple):
            raise ValueError(
                f"meta was built by strategy={meta.strategy!r} cp_size={meta.cp_size} "
                f"pad_multiple={meta.pad_multiple}, not by {self!r}"
            )

    def _check_rows(self, x: Tensor, name: str, dim: int, expected: int, what: str, meta: CPMetadata) -> int:
        check_tensor(x, name)
        if not -x.dim() <= dim < x.dim():
            raise ValueError(f"dim {dim} out of range for {name} of shape {tuple(x.shape)}")
        dim %= x.dim()
        if x.shape[dim] != expected:
            raise ValueError(f"{name} has {x.shape[dim]} rows along dim {dim}, expected {what} = {expected}")
        if x.device != meta.device:
            raise ValueError(f"{name} is on {x.device} but meta is on {meta.device} (use meta.to(device))")
        return dim

    # ------------------------------------------------------------------ boundary (per forward)
    def shard(self, x: Tensor, meta: CPMetadata, dim: int = 0) -> Tensor:
        """Logical ``[.., T, ..]`` -> this rank's physical ``[.., P, ..]`` along ``dim``.

        Rows ``[0, num_local_tokens)`` are ``x`` at ``meta.local_token_indices``; pad rows are zero.
        Use it for hidden states, input ids, 1-D positions and M-RoPE positions ``[3, T]`` (dim=1).
        Device-only (graph-safe with a static plan: ``T`` is then the capacity).
        """
        self.check_metadata(meta)
        dim = self._check_rows(x, "x", dim, meta.num_token_rows, "num_tokens T", meta)
        if x.shape[dim] == 0 or meta.num_physical_tokens == 0:
            shape = list(x.shape)
            shape[dim] = meta.num_physical_tokens
            return x.new_zeros(shape)
        rows = x.index_select(dim, meta.shard_index)
        keep = meta.row_valid.view([-1] + [1] * (x.dim() - dim - 1))
        return torch.where(keep, rows, torch.zeros((), dtype=x.dtype, device=x.device))

    def gather(self, x_local: Tensor, meta: CPMetadata, group=None, dim: int = 0) -> Tensor:
        """Every rank's physical ``[.., P, ..]`` -> logical ``[.., T, ..]`` (pad dropped), identical
        on all ranks, in ONE all-gather over ``group`` (None: default group)."""
        self.check_metadata(meta)
        dim = self._check_rows(x_local, "x_local", dim, meta.num_physical_tokens, "num_physical_tokens", meta)
        check_group(meta, group)
        (full,) = all_gather_rows([x_local.movedim(dim, 0)], meta, group)
        return full.movedim(0, dim).contiguous()

    # ------------------------------------------------------------------ per layer
    def gather_packed(
        self, parts: Sequence[Tensor], meta: CPMetadata, group=None, *, async_op: bool = False
    ) -> list[Tensor] | PendingGather:
        """Any number of per-token tensors ``[P, ...]`` of this rank -> logical ``[T, ...]`` each,
        in ONE all-gather (any dtypes, fp8 and fp32 scales included, any trailing shapes; moved
        as raw bytes). The results are views of one gathered buffer (rows strided, last dim
        contiguous). ``async_op=True`` returns a handle whose ``wait()`` gives the list.

        Example (DSA: latent, rope key and index key of a layer)::

            kv_c, k_pe, k_idx = s.gather_packed([kv_c, k_pe, k_idx], meta, group)
        """
        self.check_metadata(meta)
        if isinstance(parts, Tensor) or not isinstance(parts, (list, tuple)) or not parts:
            raise TypeError("parts must be a non-empty list or tuple of tensors")
        for i, t in enumerate(parts):
            self._check_rows(t, f"parts[{i}]", 0, meta.num_physical_tokens, "num_physical_tokens", meta)
            if t.dim() == 0:
                raise ValueError(f"parts[{i}] must have a row dim")
        check_group(meta, group)
        result = all_gather_rows(list(parts), meta, group, async_op=async_op)
        return result if async_op else list(result)

    def gather_kv(
        self, k_local: Tensor, v_local: Tensor, meta: CPMetadata, group=None, *, async_op: bool = False
    ) -> tuple[Tensor, Tensor] | PendingGather:
        """K ``[P, Hkv, D]`` and V ``[P, Hkv, Dv]`` of this rank -> logical ``[T, Hkv, D]``,
        ``[T, Hkv, Dv]`` of all extend tokens, packed into ONE all-gather (``gather_packed``).

        The results are views of one gathered buffer (rows strided, last dim contiguous); write
        them to a cache, or merge with cached prefix K/V via :func:`cpattn.pack_kv`.
        ``async_op=True`` returns a handle whose ``wait()`` gives ``[k, v]``.
        """
        self.check_metadata(meta)
        self._check_rows(k_local, "k_local", 0, meta.num_physical_tokens, "num_physical_tokens", meta)
        self._check_rows(v_local, "v_local", 0, meta.num_physical_tokens, "num_physical_tokens", meta)
        _check_same({"k_local": k_local, "v_local": v_local}, "dtype")
        result = self.gather_packed([k_local, v_local], meta, group, async_op=async_op)
        return result if async_op else (result[0], result[1])

    def gather_mla_latent(
        self, kv_c_local: Tensor, k_pe_local: Tensor, meta: CPMetadata, group=None, *, async_op: bool = False,
        layout: Optional[str] = None,
    ) -> tuple[Tensor, Tensor] | Tensor | PendingGather:
        """MLA latent ``kv_c`` [P, r] and rotary key ``k_pe`` [P, d_rope] of this rank -> logical
        [T, r] and [T, d_rope] of all extend tokens, packed into ONE all-gather (``gather_packed``).

        This is what a paged MLA cache stores: (r + d_rope) * itemsize bytes per token instead of
        Hkv * (D + Dv) for up-projected K/V. Any dtype, fp8 included (moved as raw bytes; the two
        may differ, e.g. fp8 latent with bf16 rope key). ``async_op=True`` returns a handle.

        ``layout="fp8_tile"`` (:data:`cpattn.quant.FP8_TILE`): this rank quantizes its rows to
        the tile-scaled FP8 layout (:func:`cpattn.quant.quantize_mla_fp8_tiles`, 656 bytes per
        DeepSeek-V3 token instead of 1,152 in bf16) and the one all-gather moves those bytes; the
        result is ONE uint8 tensor [T, row_bytes] (the cache rows: ``write_mla_cache(rows, None,
        cache, writes, layout="fp8_tile")``; with ``async_op``, ``wait()`` gives ``[rows]``).
        """
        self.check_metadata(meta)
        for name, t in (("kv_c_local", kv_c_local), ("k_pe_local", k_pe_local)):
            self._check_rows(t, name, 0, meta.num_physical_tokens, "num_physical_tokens", meta)
            if t.dim() != 2:
                raise ValueError(f"{name} must be 2-D [P, dim], got shape {tuple(t.shape)}")
        if layout is not None:
            if layout != FP8_TILE:
                raise ValueError(f"layout must be None or {FP8_TILE!r}, got {layout!r}")
            check_group(meta, group)
            rows = quantize_mla_fp8_tiles(kv_c_local, k_pe_local)
            result = self.gather_packed([rows], meta, group, async_op=async_op)
            return result if async_op else result[0]
        result = self.gather_packed([kv_c_local, k_pe_local], meta, group, async_op=async_op)
        return result if async_op else (result[0], result[1])

    def attention(self, q_local: Tensor, k: Tensor, v: Tensor, meta: CPMetadata, *,
                  window_size: Sequence[int] = (-1, -1), backend: str = "auto",
                  **call: Unpack[KernelCall]) -> Tensor | tuple[Tensor, Tensor]:
        """Causal attention of this rank's local queries over their whole sequences.

        The kernel-only convenience form of ``cpattn.plan_attention(meta, spec).attend(...)``: it
        derives the :class:`cpattn.AttentionSpec` from the tensors and plans once per (meta, spec,
        backend) (cached beside ``meta``, for as long as ``meta`` lives). K/V hold every key.

        Args:
            q_local: [P, Hq, D] (P = meta.num_physical_tokens; pad rows are ignored).
            k, v: packed per sequence in logical order (prefix then extend of sequence 0, then
                sequence 1, ...): [num_kv_tokens, Hkv, D] and [num_kv_tokens, Hkv, Dv]. With
                ``page_table``: caches [num_pages, page_size, Hkv, D] / [.., Dv] where key j of
                sequence b is at page ``page_table[b, j // page_size]``, slot ``j % page_size``.
            window_size: (left, right) like flash-attn; a row at position p sees keys at positions
                in [p - left, p] (left = -1: no limit; positions are global). Causal, so right
                must be -1 or 0.
            backend: "auto", "torch", "triton" or "fa4" (``plan.backend`` of the plan says which ran).
            **call: the plan's :class:`cpattn.plans.base.KernelCall` keywords: ``page_table``
                ([B, max_pages] int32/int64, or None for packed K/V), ``softmax_scale`` (default
                D ** -0.5), ``sinks`` ([Hq] float logits, any float dtype and stride, that join
                each row's softmax denominator only), ``out`` / ``lse`` buffers, ``return_lse``
                (also return lse [P, Hq] float32, float64 for float64 inputs on the torch
                backend, natural log; it counts the sinks (``lse = log(sum_j exp(s_j) +
                exp(sink))``) and is -inf on pad rows), ``k_scale`` / ``v_scale`` (FP8 K/V only,
                required there: float32 ``[]`` or ``[Hkv]`` scales, :mod:`cpattn.quant`).

        Returns:
            out [P, Hq, Dv] in q's dtype, pad rows exactly zero; with return_lse, (out, lse).
        """
        plan = self._cached_plan(q_local, k, v, meta, call, backend, window_size=window_size)
        return plan.attend(q_local, k, v, **call)

    def _check_replicated_cache(self, meta: CPMetadata) -> None:
        if meta.kv is not None:
            raise ValueError("strategy.attention / sparse_attention attend keys every rank holds; with a sharded KV "
                             "cache (meta.kv) use cpattn.plan_attention(meta, spec) and its run / attend")

    def _cached_plan(self, q, k, v, meta, call: dict, backend: str, *, window_size=(-1, -1),
                     idx: Optional[Tensor] = None) -> AttentionPlan:
        """The plan of a convenience call (its spec read from the tensors; ``idx``: sparse),
        cached beside ``meta`` under the raw facts it is built from, so a repeated call does
        one dict lookup here (the plan's own per-call checks still run); the first call of a
        key validates everything and builds the spec."""
        self.check_metadata(meta)
        self._check_replicated_cache(meta)
        paged = call.get("page_table") is not None
        try:
            key = ("convenience", backend, tuple(window_size), paged, call.get("sinks") is not None,
                   None if idx is None else tuple(idx.shape), tuple(q.shape), tuple(k.shape[1:]), tuple(v.shape[1:]),
                   q.dtype, k.dtype, v.dtype)
            hash(key)
        except (AttributeError, TypeError):  # not tensors / an odd window: the full checks raise
            key = None

        def build() -> AttentionPlan:
            hq, hkv = check_qkv(q, k, v, paged)
            topk = None if idx is None else check_index(idx, meta.num_physical_tokens)
            spec = AttentionSpec(num_q_heads=hq, num_kv_heads=hkv, head_dim=q.shape[-1], head_dim_v=v.shape[-1],
                                 dtype=q.dtype, window_size=window_size, page_size=k.shape[1] if paged else None,
                                 has_sinks=call.get("sinks") is not None, topk=topk,
                                 kv_dtype=k.dtype if k.dtype in FP8_KV_DTYPES else None)
            return cached_plan(meta, (spec, backend), lambda: plan_attention(meta, spec, backend=backend))

        return build() if key is None else cached_plan(meta, key, build)

    # ------------------------------------------------------------------ DSA
    def sparse_attention(self, q_local: Tensor, k: Tensor, v: Tensor, meta: CPMetadata, idx: Tensor, *,
                         backend: str = "auto", **call: Unpack[KernelCall]) -> Tensor | tuple[Tensor, Tensor]:
        """Sparse (DSA) attention: each local row attends the keys of its own sequence whose
        positions appear in its row of ``idx`` and are ``<=`` its position (-1, future and
        out-of-sequence entries are ignored, so a selection without a causal mask stays causal).

        The kernel-only convenience form of ``cpattn.plan_attention(meta, spec).attend(...)`` for a
        spec with ``topk``: plans once per (meta, spec, backend), cached beside ``meta``.

        Args:
            q_local: [P, Hq, D]. Absorbed MLA: D = 576 (latent 512 + rope 64).
            k, v: packed per sequence (prefix then extend) [num_kv_tokens, Hkv, D] /
                [.., Dv], or paged [num_pages, page_size, Hkv, D] / [.., Dv] with ``page_table``
                [B, max_pages]. Absorbed MLA: Hkv = 1 and ``v = k[..., :512]`` (a view); per-head
                form: Hkv = Hq or GQA (e.g. transformers' expanded K/V).
            idx: [P, topk] int32/int64 key positions per row (index in the sequence, prefix
                counted), e.g. :func:`cpattn.dsa.index_topk`.
            backend: "auto" (triton, then torch), "triton" or "torch".
            **call: as :meth:`attention`: ``page_table``, ``softmax_scale`` (default D ** -0.5),
                ``sinks`` ([Hq] float logits, denominator only), ``out`` / ``lse``,
                ``return_lse`` (lse [P, Hq] float32, float64 for float64 inputs on the torch
                backend, natural log, sinks counted; -inf on pad rows and on real rows with no
                valid key without sinks).

        Returns:
            out [P, Hq, Dv] in q's dtype (pad rows and rows with no valid key exactly 0); with
            return_lse, (out, lse).
        """
        plan = self._cached_plan(q_local, k, v, meta, call, backend, idx=idx)
        return plan.attend(q_local, k, v, idx, **call)


class RotatingStrategy(CPStrategy):
    """A block strategy whose sequences' remainder rows start on successive ranks
    (``rotate=True``, the default; see :class:`ZigzagStrategy`)."""

    def __init__(self, cp_size: int, pad_multiple: int = 1, *, rotate: bool = True) -> None:
        super().__init__(cp_size, pad_multiple)
        if not isinstance(rotate, bool):
            raise TypeError(f"rotate must be a bool, got {type(rotate).__name__}")
        self.rotate = rotate

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cp_size={self.cp_size}, pad_multiple={self.pad_multiple}, rotate={self.rotate})"
