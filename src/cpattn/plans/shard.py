"""Shard attention plans: queries over ONE rank's key shard of a sharded KV cache (plan once per
step, run per layer).

A :class:`cpattn.DecodeMetadata` says which query rows there are (the last ``q_len`` positions
of each sequence, the same on every rank) and how many keys this rank holds per sequence;
:func:`plan_shard_attention` binds it to heads, dims, dtype, window, page size, sinks and a
backend (kind ``"shard"``: ``triton`` split-KV, ``torch`` reference), deciding the launch
geometry (query tiles, split sizes from the key lengths and the SM count) and uploading it in
one copy. :meth:`ShardAttentionPlan.run` returns this rank's partial ``(out, lse)``: exact
attention over its keys with the causal rule and window by GLOBAL position; a rank holding no
visible key of a row gives (0, -inf). ``cpattn.merge_partials`` combines the ranks' partials in
one collective. Sinks are counted once over the group: rank 0's partial includes them.

With a static plan (:class:`cpattn.StaticDecodePlanner`) every table sits at a fixed address,
grids are sized for the capacity and kernels read counts from device memory: a CUDA graph of
``run`` replays for every step (``triton`` only; ``torch`` loops on the host).
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch
from torch import Tensor

from .._validation import check_tensor
from ..kernels import AttentionSpec, select_backend
from .dense import (_PAGE_TABLE_DTYPES, check_group_rank, check_page_table_fast, check_qkv, check_sinks, make_spec,
                    result_buffers, window_left)

__all__ = ["ShardAttentionPlan", "plan_shard_attention", "shard_attention"]


def _check_dmeta(dmeta):
    from ..kv_sharding import DecodeMetadata

    if not isinstance(dmeta, DecodeMetadata):
        raise TypeError(f"dmeta must be a cpattn.DecodeMetadata (KVSharding.build_decode_metadata), got "
                        f"{type(dmeta).__name__}")
    return dmeta


class ShardAttentionPlan:
    """Attention of a decode plan's query rows over this rank's key shard, one layer kind.

    ``backend``: "triton" or "torch"; ``spec``: the :class:`AttentionSpec`; ``dmeta``: the plan.
    Build with :func:`plan_shard_attention`.
    """

    def __init__(self, dmeta, spec: AttentionSpec, backend: str, run_impl) -> None:
        self.dmeta, self.spec, self.backend = dmeta, spec, backend
        self._impl = run_impl
        rows = dmeta.num_query_token_rows
        self._q_shape = (rows, spec.num_q_heads, spec.head_dim)
        self._out_shape = (rows, spec.num_q_heads, spec.head_dim_v)
        self._lse_shape = (rows, spec.num_q_heads)
        self._scale = spec.head_dim**-0.5
        # what a valid call's q / cache tails / dtypes / devices compare equal to (one tuple compare
        # per layer; the full checks with their messages run only when it differs)
        hkv, d, dv, dev = spec.num_kv_heads, spec.head_dim, spec.head_dim_v, dmeta.device
        tail = (spec.page_size,) if spec.paged else ()
        self._expect = (torch.Size(self._q_shape), torch.Size(tail + (hkv, d)), torch.Size(tail + (hkv, dv)),
                        spec.dtype, spec.dtype, spec.dtype, dev, dev, dev)
        self._pt_expect = (dmeta.num_seq_rows, dev)
        self._min_pages = -(-dmeta.max_local_kv_len // spec.page_size) if spec.paged else 0
        self._min_rows = dmeta.num_local_kv_tokens if not spec.paged else 0

    def __repr__(self) -> str:
        return f"ShardAttentionPlan(backend={self.backend!r}, {self.spec}, rows={self._q_shape[0]})"

    @property
    def family(self) -> str:
        return getattr(self._impl, "family", self.backend)

    def run(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        *,
        page_table: Optional[Tensor] = None,
        sinks: Optional[Tensor] = None,
        softmax_scale: Optional[float] = None,
        out: Optional[Tensor] = None,
        lse: Optional[Tensor] = None,
    ) -> tuple[Tensor, Tensor]:
        """This rank's partial attention (per layer, device-only, graph-safe with static plans).

        Args:
            q: [Nq, Hq, D] query rows, sequence after sequence (Nq = ``dmeta.num_query_token_rows``),
                the same on every rank.
            k_cache, v_cache: this rank's keys. Paged: [num_pages, page_size, Hkv, D] / [.., Dv]
                with ``page_table`` [B, max_pages] (local key j of sequence b at page
                ``page_table[b, j // page_size]``, slot ``j % page_size``). Packed: [>= rows,
                Hkv, D] / [.., Dv], local key j of sequence b at row ``cu_local_kv_lens[b] + j``.
                Any row strides; ``v_cache`` may be a view of ``k_cache[..., :Dv]`` (MLA's
                absorbed form: then K is read once). Slots past a sequence's keys are never read.
            sinks: [Hq] float when the plan has sinks (joins rank 0's partial only).
            softmax_scale: default D ** -0.5.
            out, lse: optional [Nq, Hq, Dv] (q's dtype) / [Nq, Hq] float32 buffers.

        Returns:
            (out_part [Nq, Hq, Dv] in q's dtype, lse_part [Nq, Hq] float32, natural log; rows
            with no visible key on this rank 0 / -inf; a static plan's pad rows 0 / -inf).
        """
        spec = self.spec
        if type(q) is not Tensor or type(k_cache) is not Tensor or type(v_cache) is not Tensor:
            self._check_qkv(q, k_cache, v_cache, page_table)
        else:
            ks, vs = k_cache.shape, v_cache.shape
            if (q.shape, ks[1:], vs[1:], q.dtype, k_cache.dtype, v_cache.dtype, q.device, k_cache.device,
                    v_cache.device) != self._expect or ks[0] != vs[0] or ks[0] < self._min_rows:
                self._check_qkv(q, k_cache, v_cache, page_table)
        check_page_table_fast(page_table, spec.paged, self._pt_expect, self._min_pages, self._check_page_table)
        if sinks is not None or spec.has_sinks:
            check_sinks(sinks, spec, self.dmeta.device)
        out, lse = result_buffers(out, lse, self._out_shape, self._lse_shape, spec.dtype, self.dmeta.device, True,
                                  rows="Nq")
        scale = self._scale if softmax_scale is None else float(softmax_scale)
        self._impl(q, k_cache, v_cache, page_table, sinks, scale, out, lse)
        return out, lse

    def _check_qkv(self, q, k_cache, v_cache, page_table) -> None:
        """The per-layer checks of q / the caches with their messages (raises on the first failure)."""
        spec, dmeta = self.spec, self.dmeta
        device = dmeta.device
        check_tensor(q, "q")
        if tuple(q.shape) != self._q_shape:
            raise ValueError(f"q must be [Nq, Hq, D] = {list(self._q_shape)}, got {list(q.shape)}")
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            check_tensor(t, name)
            if t.dtype != spec.dtype:
                raise TypeError(f"{name} dtype {t.dtype} != the plan's dtype {spec.dtype}")
            if t.device != device:
                raise ValueError(f"{name} is on {t.device} but the plan is on {device} (use dmeta.to(device))")
        hkv, d, dv = spec.num_kv_heads, spec.head_dim, spec.head_dim_v
        if spec.paged:
            if page_table is None:
                raise ValueError(f"the plan is paged (page_size={spec.page_size}): pass page_table")
            k_tail, v_tail = (spec.page_size, hkv, d), (spec.page_size, hkv, dv)
            if k_cache.dim() != 4 or tuple(k_cache.shape[1:]) != k_tail or v_cache.dim() != 4 or \
                    tuple(v_cache.shape[1:]) != v_tail or v_cache.shape[0] != k_cache.shape[0]:
                raise ValueError(f"paged k_cache / v_cache must be [num_pages, {', '.join(map(str, k_tail))}] / "
                                 f"[num_pages, {', '.join(map(str, v_tail))}], got {list(k_cache.shape)} / "
                                 f"{list(v_cache.shape)}")
        else:
            if page_table is not None:
                raise ValueError("page_table given but the plan is for packed K/V (plan with page_size=)")
            need = dmeta.num_local_kv_tokens
            if k_cache.dim() != 3 or tuple(k_cache.shape[1:]) != (hkv, d) or v_cache.dim() != 3 or \
                    tuple(v_cache.shape[1:]) != (hkv, dv) or v_cache.shape[0] != k_cache.shape[0] or \
                    k_cache.shape[0] < need:
                raise ValueError(f"packed k_cache / v_cache must be [>= {need}, {hkv}, {d}] / [.., {hkv}, {dv}] "
                                 f"(this rank's local keys), got {list(k_cache.shape)} / {list(v_cache.shape)}")

    def _check_page_table(self, page_table: Tensor) -> None:
        if page_table is None:
            raise ValueError(f"the plan is paged (page_size={self.spec.page_size}): pass page_table")
        check_tensor(page_table, "page_table")
        dmeta = self.dmeta
        if page_table.dtype not in _PAGE_TABLE_DTYPES:
            raise TypeError(f"page_table must be int32 or int64, got {page_table.dtype}")
        if page_table.dim() != 2 or page_table.shape[0] != dmeta.num_seq_rows:
            raise ValueError(f"page_table must be [B={dmeta.num_seq_rows}, max_pages], got {list(page_table.shape)}")
        if page_table.device != dmeta.device:
            raise ValueError(f"page_table is on {page_table.device} but the plan is on {dmeta.device}")
        if page_table.shape[1] * self.spec.page_size < dmeta.max_local_kv_len:
            raise ValueError(
                f"page_table does not cover the rank's shard: {page_table.shape[1]} pages of {self.spec.page_size} = "
                f"{page_table.shape[1] * self.spec.page_size} keys, fewer than the longest local shard "
                f"({dmeta.max_local_kv_len} keys on rank {dmeta.rank})"
            )


def plan_shard_attention(
    dmeta,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    head_dim_v: Optional[int] = None,
    dtype: torch.dtype,
    window_size: Sequence[int] = (-1, -1),
    page_size: Optional[int] = None,
    has_sinks: bool = False,
    backend: str = "auto",
    backend_options: Optional[Mapping] = None,
) -> ShardAttentionPlan:
    """Plan one layer kind's attention over this rank's key shard (host, once per step).

    Args:
        dmeta: the :class:`cpattn.DecodeMetadata` of the step (on the layers' device).
        num_q_heads, num_kv_heads, head_dim, head_dim_v (default head_dim), dtype: of q / k / v.
            MLA absorbed decode: ``num_kv_heads=1, head_dim=576, head_dim_v=512``.
        window_size: flash-attn's (left, right), right -1 or 0: a row at position p sees keys
            at positions in [p - left, p] (positions global).
        page_size: tokens per page of the rank's paged cache (a multiple of the sharding's
            interleave; ValueError otherwise), None for packed local K/V.
        has_sinks: ``run`` gets [Hq] sink logits (counted on rank 0 only).
        backend: "auto" (triton, then torch), "triton" or "torch".
        backend_options: see ``cpattn.kernels.decode_backend``.

    Example::

        plan = cpattn.plan_shard_attention(dmeta, num_q_heads=32, num_kv_heads=8, head_dim=128,
                                           dtype=torch.bfloat16, page_size=64)
        for layer in layers:
            out_p, lse_p = plan.run(q, k_cache[layer], v_cache[layer], page_table=pt)
            o = cpattn.merge_partials(out_p, lse_p, group, meta=dmeta)
    """
    _check_dmeta(dmeta)
    spec = make_spec(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, head_dim_v=head_dim_v,
                     dtype=dtype, window_size=window_size, page_size=page_size, has_sinks=has_sinks)
    if spec.paged:
        dmeta.sharding.check_page_size(spec.page_size)
    check_group_rank(dmeta)
    chosen = select_backend(spec, dmeta, backend, kind="shard")
    return ShardAttentionPlan(dmeta, spec, chosen.name, chosen.plan(spec, dmeta, dict(backend_options or {})))


def shard_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    dmeta,
    *,
    page_table: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    window_size: Sequence[int] = (-1, -1),
    sinks: Optional[Tensor] = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """This rank's partial attention over its key shard: ``(out_part, lse_part)``.

    The convenience form of ``plan_shard_attention(...).run(...)``: it derives the layer kind
    from the tensors, plans once per (dmeta, layer kind, backend) and caches the plan on
    ``dmeta``. Shapes as in :meth:`ShardAttentionPlan.run`: q [Nq, Hq, D]; caches paged
    [num_pages, page_size, Hkv, D] with ``page_table`` [B, max_pages], or packed [rows, Hkv, D];
    returns out_part [Nq, Hq, Dv] (q's dtype) and lse_part [Nq, Hq] float32.

    Example::

        dmeta = sh.build_decode_metadata(seq_lens, rank=r, group=g).to(dev)
        out_p, lse_p = cpattn.shard_attention(q, k_cache, v_cache, dmeta, page_table=pt)
        out = cpattn.merge_partials(out_p, lse_p, g, meta=dmeta)
    """
    _check_dmeta(dmeta)
    paged = page_table is not None
    hq, hkv = check_qkv(q, k_cache, v_cache, paged, q_name="q", k_name="k_cache", v_name="v_cache", q_rows="Nq",
                        kv_rows="rows")
    left = window_left(window_size)
    key = ("shard", q.dtype, hq, hkv, q.shape[-1], v_cache.shape[-1], left, k_cache.shape[1] if paged else None,
           sinks is not None, backend)
    plan = dmeta.plan_cache.get(key)
    if plan is None:
        plan = plan_shard_attention(dmeta, num_q_heads=hq, num_kv_heads=hkv, head_dim=q.shape[-1],
                                    head_dim_v=v_cache.shape[-1], dtype=q.dtype, window_size=(left, 0),
                                    page_size=k_cache.shape[1] if paged else None, has_sinks=sinks is not None,
                                    backend=backend)
        dmeta.plan_cache[key] = plan
    return plan.run(q, k_cache, v_cache, page_table=page_table, sinks=sinks, softmax_scale=softmax_scale)
