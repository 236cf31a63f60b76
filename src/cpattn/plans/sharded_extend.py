"""Extend (prefill, chunked prefill, prefix-cache hit) with a sharded KV cache: pass-KV or pass-Q.

The extend tokens are placed by the CP strategy (zigzag, ...); the cache is sharded by position
(:class:`cpattn.KVSharding`): rank ``(p // I) % C`` stores key ``p``, including the cached
prefix. Local queries must see every prefix key and every earlier extend key. Two exact
algorithms, one plan (:func:`plan_sharded_extend`, host, once per forward), one call per layer
(:meth:`ShardedExtendPlan.run`: collectives, the sharded cache write, attention):

* **pass-KV**: ONE all-gather of [this rank's extend K/V rows, its prefix shard rows]; the
  gathered rows are put in the packed prefix+extend layout and the dense kernel runs the local
  queries over them. Moves ``(C - 1) (P + Np) kv_row`` bytes per rank (Np: most prefix keys any
  rank holds): proportional to the prefix.
* **pass-Q**: ONE all-gather of [q, K, V] extend rows; every rank writes its share of the new
  K/V, then runs ALL new queries over its own keys (prefix + new, the shard kernel with global
  positions) and ONE all-to-all returns each query's partial (out, lse) to its owner, where an
  exact merge finishes it. Moves ``(C - 1) P (q_row + kv_row + part_row)`` bytes: proportional
  to the new tokens, not to the prefix.

``algorithm="auto"`` picks the one :class:`cpattn.ExtendCostModel` estimates faster (the same
on every rank: only batch-wide numbers enter); "pass_kv" / "pass_q" force one. Both write this
rank's share of the extend K/V into its cache (validated at plan time; nothing is written when
planning fails) and return the local rows' output [P, Hq, Dv], pad rows 0.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

import torch
from torch import Tensor

from .._validation import check_int, check_tensor
from .. import collectives as _collectives
from .. import merge as _merge
from ..collectives import all_gather_rows, check_group
from ..kv_sharding import EXTEND_ALGORITHMS, ExtendCostModel, choose_extend_algorithm, plan_shard_writes, write_sharded_kv
from ..merge import _pack, _row_layout, _unpack, merge_states
from ..metadata import CPMetadata
from .dense import AttentionPlan, make_spec, plan_attention
from .shard import ShardAttentionPlan, plan_shard_attention

__all__ = ["ShardedExtendPlan", "plan_sharded_extend"]


class ShardedExtendPlan:
    """One forward's extend over a sharded cache for one layer kind (see the module docstring).

    Attributes: ``algorithm`` ("pass_kv" or "pass_q"), ``estimate`` (the cost model's dict),
    ``writes`` (the :class:`cpattn.ShardWritePlan` of the extend rows this rank stores),
    ``meta``; ``attention``: the dense plan (pass-KV) or shard plan (pass-Q) it runs.
    """

    def __init__(self, meta: CPMetadata, spec, algorithm: str, estimate: dict, writes, page_table: Tensor,
                 attention, extra: dict) -> None:
        self.meta, self.spec, self.algorithm, self.estimate = meta, spec, algorithm, estimate
        self.writes, self.page_table, self.attention = writes, page_table, attention
        self._extra = extra

    def __repr__(self) -> str:
        return f"ShardedExtendPlan(algorithm={self.algorithm!r}, {self.spec}, P={self.meta.num_physical_tokens})"

    def run(
        self,
        q_local: Tensor,
        k_local: Tensor,
        v_local: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        group=None,
        *,
        sinks: Optional[Tensor] = None,
        softmax_scale: Optional[float] = None,
        return_lse: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """One layer: collectives, this rank's cache write, attention (device-only).

        Args:
            q_local: [P, Hq, D], k_local: [P, Hkv, D], v_local: [P, Hkv, Dv]: this rank's rows
                (``strategy.shard`` order; pad rows ignored).
            k_cache, v_cache: this rank's paged caches [num_pages, page_size, Hkv, D] / [.., Dv]
                (the layer's), holding its prefix shard; its share of the extend K/V is
                written into them.
            group: the CP group (None: default group; no collective at C = 1).
            sinks: [Hq] float when planned with has_sinks. softmax_scale: default D ** -0.5.
            return_lse: also return lse [P, Hq] float32.

        Returns:
            out [P, Hq, Dv] in q's dtype (pad rows 0), with return_lse (out, lse).
        """
        meta, spec = self.meta, self.spec
        p = meta.num_physical_tokens
        for name, t, tail in (("q_local", q_local, (spec.num_q_heads, spec.head_dim)),
                              ("k_local", k_local, (spec.num_kv_heads, spec.head_dim)),
                              ("v_local", v_local, (spec.num_kv_heads, spec.head_dim_v))):
            check_tensor(t, name)
            if tuple(t.shape) != (p, *tail):
                raise ValueError(f"{name} must be [P, ...] = {[p, *tail]}, got {list(t.shape)}")
            if t.dtype != spec.dtype or t.device != meta.device:
                raise ValueError(f"{name} must be {spec.dtype} on {meta.device}, got {t.dtype} on {t.device}")
        for name, t, d in (("k_cache", k_cache, spec.head_dim), ("v_cache", v_cache, spec.head_dim_v)):
            check_tensor(t, name)
            if t.dim() != 4 or tuple(t.shape[1:]) != (spec.page_size, spec.num_kv_heads, d) or \
                    t.shape[0] * spec.page_size != self.writes.num_slots:
                raise ValueError(f"{name} must be [num_pages, {spec.page_size}, {spec.num_kv_heads}, {d}] with "
                                 f"num_pages * page_size = {self.writes.num_slots}, got {list(t.shape)}")
            if t.dtype != spec.dtype or t.device != meta.device:
                raise ValueError(f"{name} must be {spec.dtype} on {meta.device}, got {t.dtype} on {t.device}")
        check_group(meta, group)  # local checks, before any collective
        if self.algorithm == "pass_kv":
            out, lse = self._pass_kv(q_local, k_local, v_local, k_cache, v_cache, group, sinks, softmax_scale,
                                     return_lse)
        else:
            out, lse = self._pass_q(q_local, k_local, v_local, k_cache, v_cache, group, sinks, softmax_scale)
        return (out, lse) if return_lse else out

    # ------------------------------------------------------------------ pass-KV
    def _pass_kv(self, q_local, k_local, v_local, k_cache, v_cache, group, sinks, softmax_scale, return_lse):
        meta, spec, x = self.meta, self.spec, self._extra
        p, c = meta.num_physical_tokens, meta.cp_size
        hkv, d, dv = spec.num_kv_heads, spec.head_dim, spec.head_dim_v
        slots = x["prefix_slots"]
        k_pre = k_cache.view(-1, hkv, d).index_select(0, slots)  # read before this layer's writes
        v_pre = v_cache.view(-1, hkv, dv).index_select(0, slots)
        rows = p + x["np_max"]
        layout, row_bytes = x["layout"], x["row_bytes"]
        send = torch.empty((rows, row_bytes), dtype=torch.uint8, device=k_local.device)
        n_pre = k_pre.shape[0]
        for (off, width), local, pre in zip(layout, (k_local, v_local), (k_pre, v_pre)):
            cols = width // local.element_size()
            send[:p, off : off + width] = local.reshape(p, cols).contiguous().view(torch.uint8)
            send[p : p + n_pre, off : off + width] = pre.reshape(n_pre, cols).view(torch.uint8)
        if c == 1:
            gathered = send
        else:
            gathered = torch.empty((c * rows, send.shape[1]), dtype=torch.uint8, device=send.device)
            _collectives._all_gather_into(gathered, send, group, False)  # ONE all-gather
        packed = gathered.index_select(0, x["src_index"])
        k_all, v_all = _unpack(packed, layout, [(k_local.dtype, (hkv, d)), (v_local.dtype, (hkv, dv))])
        write_sharded_kv(k_all, v_all, k_cache, v_cache, x["packed_writes"])
        res = self.attention.run(q_local, k_all, v_all, sinks=sinks, softmax_scale=softmax_scale,
                                 return_lse=return_lse)
        return res if return_lse else (res, None)

    # ------------------------------------------------------------------ pass-Q
    def _pass_q(self, q_local, k_local, v_local, k_cache, v_cache, group, sinks, softmax_scale):
        meta, x = self.meta, self._extra
        p, c = meta.num_physical_tokens, meta.cp_size
        q_all, k_ext, v_ext = all_gather_rows([q_local, k_local, v_local], meta, group)  # ONE all-gather
        write_sharded_kv(k_ext, v_ext, k_cache, v_cache, self.writes)
        out_p, lse_p = self.attention.run(q_all, k_cache, v_cache, page_table=self.page_table, sinks=sinks,
                                          softmax_scale=softmax_scale)
        idx = x["send_index"]
        send, layout = _pack([out_p.index_select(0, idx), lse_p.index_select(0, idx)], c * p)
        if c == 1:
            received = send
        else:
            received = torch.empty_like(send)
            _merge._all_to_all_into(received, send, group)  # ONE all-to-all: partials back to the query owners
        hq, dv = self.spec.num_q_heads, self.spec.head_dim_v
        outs, lses = _unpack(received.view(c, p, -1), layout, [(out_p.dtype, (hq, dv)), (torch.float32, (hq,))])
        out, lse = merge_states(outs, lses)
        valid = meta.row_valid
        out = torch.where(valid[:, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
        lse = torch.where(valid[:, None], lse.float(), torch.full((), float("-inf"), device=lse.device))
        return out, lse


def _device_index_plans(meta: CPMetadata, page_table: Tensor, page_size: int) -> dict:
    """pass-KV gather tables, built on the device at plan time (O(keys of the batch) device
    work, nothing on the host beyond O(B C)): the cache slots of this rank's prefix shard and,
    for every packed prefix+extend row, its row in the gathered buffer."""
    sh, dev = meta.kv_sharding, meta.device
    host = meta.host if meta.host is not None else meta
    c, p, rank = meta.cp_size, meta.num_physical_tokens, meta.rank
    np_all = meta.num_local_prefix_tokens_per_rank
    np_max, np_mine = max(np_all), np_all[rank]
    rows = p + np_max
    # this rank's prefix shard: local key j < local_prefix_len of every sequence
    lp = host.local_prefix_lens
    cu_lp = torch.zeros(meta.num_seqs + 1, dtype=torch.int64)
    torch.cumsum(lp, 0, out=cu_lp[1:])
    cu_lp_dev = cu_lp.to(dev)
    i = torch.arange(np_mine, device=dev)
    seq = torch.searchsorted(cu_lp_dev, i, right=True) - 1
    j = i - cu_lp_dev[seq]
    pt = page_table.to(device=dev, dtype=torch.int64)
    prefix_slots = pt[seq, j // page_size] * page_size + j % page_size
    # packed row -> gathered row
    src = torch.empty(meta.num_kv_tokens, dtype=torch.int64, device=dev)
    if meta.num_tokens:
        g = meta.gather_index
        src[meta.kv_extend_index] = (g // p) * rows + g % p
    num_prefix = meta.num_kv_tokens - meta.num_tokens
    if num_prefix:
        per_rank = torch.stack([sh.local_lengths(host.prefix_lens, r) for r in range(c)])  # [C, B]
        cu_all = torch.zeros(c, meta.num_seqs + 1, dtype=torch.int64)
        torch.cumsum(per_rank, 1, out=cu_all[:, 1:])
        cu_pre = torch.zeros(meta.num_seqs + 1, dtype=torch.int64, device=dev)
        torch.cumsum(meta.prefix_lens, 0, out=cu_pre[1:])
        t = torch.arange(num_prefix, device=dev)
        b = torch.searchsorted(cu_pre, t, right=True) - 1
        pos = t - cu_pre[b]
        owner = sh.owner(pos)
        src[meta.cu_kv_lens[b] + pos] = owner * rows + p + cu_all.to(dev)[owner, b] + sh.local_index(pos)
    return {"prefix_slots": prefix_slots, "src_index": src, "np_max": np_max}


def _kv_row_layout(spec) -> tuple[list[tuple[int, int]], int]:
    """(offset, bytes) of K and V inside one gathered row (16-byte aligned parts), row bytes."""
    item = torch.empty((), dtype=spec.dtype).element_size()
    widths = [spec.num_kv_heads * spec.head_dim * item, spec.num_kv_heads * spec.head_dim_v * item]
    offsets, row_bytes = _row_layout(widths)
    return list(zip(offsets, widths)), row_bytes


def plan_sharded_extend(
    meta: CPMetadata,
    *,
    page_table: Tensor,
    page_size: int,
    num_pages: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    head_dim_v: Optional[int] = None,
    dtype: torch.dtype,
    window_size: Sequence[int] = (-1, -1),
    has_sinks: bool = False,
    algorithm: str = "auto",
    cost_model: Optional[ExtendCostModel] = None,
    backend: str = "auto",
    shard_backend: str = "auto",
    backend_options: Optional[Mapping] = None,
    shard_backend_options: Optional[Mapping] = None,
) -> ShardedExtendPlan:
    """Plan one forward's extend over a sharded cache for one layer kind (host, once per forward).

    Args:
        meta: ``strategy.build_metadata(extend_lens, prefix_lens, rank=, group=, kv_sharding=)``
            on the layers' device (not a static plan).
        page_table: [B, max_pages] int32/int64 of THIS rank's pages (local key j of sequence b
            at ``page_table[b, j // page_size] * page_size + j % page_size``), covering its
            prefix + extend keys; CPU or device (read once here).
        page_size, num_pages: of this rank's paged caches (page_size a multiple of the
            sharding's interleave).
        num_q_heads, num_kv_heads, head_dim, head_dim_v, dtype, window_size, has_sinks: the
            layer kind (as :func:`cpattn.plan_attention`).
        algorithm: "auto" (the cost model's choice), "pass_kv" or "pass_q".
        cost_model: an :class:`cpattn.ExtendCostModel` for "auto" (default H200 constants).
        backend / backend_options: the dense backend of pass-KV; shard_backend /
            shard_backend_options: the shard backend of pass-Q.

    ValueError before any collective or write when the cache plan does not fit (see
    :func:`cpattn.plan_shard_writes`).

    Example::

        meta = s.build_metadata(ext, pre, rank=r, group=g, kv_sharding=sh).to(dev)
        ext_plan = cpattn.plan_sharded_extend(meta, page_table=local_pt, page_size=64, num_pages=n,
                                              num_q_heads=32, num_kv_heads=8, head_dim=128,
                                              dtype=torch.bfloat16)
        for layer in layers:
            o = ext_plan.run(q, k, v, k_cache[layer], v_cache[layer], g)   # [P, Hq, Dv]
    """
    if not isinstance(meta, CPMetadata):
        raise TypeError(f"meta must be a CPMetadata, got {type(meta).__name__}")
    if meta.kv_sharding is None:
        raise ValueError("meta has no kv_sharding: build it with strategy.build_metadata(..., kv_sharding=)")
    if meta.is_static:
        raise ValueError("plan_sharded_extend needs a plan sized for its batch, not a static plan")
    if algorithm not in ("auto", *EXTEND_ALGORITHMS):
        raise ValueError(f"algorithm must be 'auto', 'pass_kv' or 'pass_q', got {algorithm!r}")
    ps = meta.kv_sharding.check_page_size(check_int(page_size, "page_size", 1))
    spec = make_spec(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, head_dim_v=head_dim_v,
                     dtype=dtype, window_size=window_size, page_size=ps, has_sinks=has_sinks)
    model = cost_model or ExtendCostModel()
    estimate = model.estimate(meta, num_q_heads=spec.num_q_heads, num_kv_heads=spec.num_kv_heads,
                              head_dim=spec.head_dim, head_dim_v=spec.head_dim_v, dtype=dtype)
    if algorithm == "auto":
        algorithm = choose_extend_algorithm(meta, num_q_heads=spec.num_q_heads, num_kv_heads=spec.num_kv_heads,
                                            head_dim=spec.head_dim, head_dim_v=spec.head_dim_v, dtype=dtype,
                                            cost_model=model)
    writes = plan_shard_writes(meta, page_table, page_size=ps, num_pages=num_pages)  # validates the table
    pt_dev = page_table.to(meta.device)
    window = (spec.window_left, 0)
    if algorithm == "pass_kv":
        extra = _device_index_plans(meta, page_table, ps)
        extra["layout"], extra["row_bytes"] = _kv_row_layout(spec)
        extra["packed_writes"] = dataclasses.replace(writes, rows=meta.kv_extend_index.index_select(0, writes.rows),
                                                     num_source_rows=meta.num_kv_rows)
        attention: AttentionPlan | ShardAttentionPlan = plan_attention(
            meta, num_q_heads=spec.num_q_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            head_dim_v=spec.head_dim_v, dtype=dtype, window_size=window, has_sinks=has_sinks, backend=backend,
            backend_options=backend_options)
    else:
        host = meta.host if meta.host is not None else meta
        dmeta = meta.kv_sharding.build_decode_metadata(host.kv_lens, host.extend_lens, rank=meta.rank).to(meta.device)
        dmeta = dataclasses.replace(dmeta, group=meta.group)
        attention = plan_shard_attention(
            dmeta, num_q_heads=spec.num_q_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            head_dim_v=spec.head_dim_v, dtype=dtype, window_size=window, page_size=ps, has_sinks=has_sinks,
            backend=shard_backend, backend_options=shard_backend_options)
        send_index = torch.zeros(meta.cp_size * meta.num_physical_tokens, dtype=torch.int64, device=meta.device)
        if meta.num_tokens:
            send_index[meta.gather_index] = torch.arange(meta.num_tokens, device=meta.device)
        extra = {"send_index": send_index}
    return ShardedExtendPlan(meta, spec, algorithm, estimate, writes, pt_dev, attention, extra)
