"""Extend (prefill, chunked prefill, prefix-cache hit) with a sharded KV cache: pass-KV or pass-Q.

The extend tokens are placed by the CP strategy (zigzag, ...); the cache is sharded by position
(:class:`cpattn.KVSharding`): rank ``(p // I) % C`` stores key ``p``, including the cached
prefix. Local queries must see every prefix key and every earlier extend key. Two exact
algorithms, planned by :func:`cpattn.plan_attention` (host, once per forward; it needs this rank's
page table, read once) and run by one call per layer (:meth:`ShardedExtendPlan.run`: collectives,
the sharded cache write, attention):

* **pass-KV**: ONE all-gather of [this rank's extend K/V rows, its prefix shard rows]; the
  gathered rows are put in the packed prefix+extend layout and the dense kernel runs the local
  queries over them. Moves ``(C - 1) (P + Np) kv_row`` bytes per rank (Np: most prefix keys any
  rank holds): proportional to the prefix.
* **pass-Q**: ONE all-gather of [q, K, V] extend rows; every rank writes its share of the new
  K/V, then runs ALL new queries over its own keys (prefix + new, the shard kernel with global
  positions) and ONE all-to-all returns each query's partial (out, lse) to its owner, where an
  exact merge finishes it. Moves ``(C - 1) P (q_row + kv_row + part_row)`` bytes: proportional
  to the new tokens, not to the prefix.

``algorithm="auto"`` picks the one :class:`cpattn.CostModel` estimates faster (the same
on every rank: only batch-wide numbers enter); "pass_kv" / "pass_q" force one. Both write this
rank's share of the extend K/V into its cache (validated at plan time; nothing is written when
planning fails) and return the local rows' output [P, Hq, Dv], pad rows 0.

Static plans (:class:`cpattn.StaticPlanner`): every table a layer reads (the page table, the
write plan, pass-KV's prefix slots and row map, pass-Q's return map and the replicated view of
the batch the shard kernel runs) sits at a fixed address of the planner's arena, sized for the
capacity, and every per-layer shape is the capacity's: a CUDA graph captured over ``run``
replays for any batch within it. The price is the collectives' size: pass-KV gathers ``C (P +
Np_cap)`` rows (``Np_cap`` bounds any rank's prefix keys: ``ceil(max_kv_tokens / C) + 2
max_seqs I``, at most ``max_kv_tokens``) and pass-Q ``C P`` rows, whatever the batch. One
algorithm replays, so a static plan names it (``algorithm="pass_kv"`` or ``"pass_q"``) and its
cache writes a reserved ``pad_slot``; the plans of one planner share one page table per
forward (their fixed tables have one home per planner).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from .. import _buffers
from .. import collectives as _collectives
from ..cache import write_kv_cache, write_mla_cache
from ..collectives import all_gather_kv_rows, all_gather_rows, check_group, pack_rows, row_layout, unpack_rows
from ..merge import merge_states
from ..metadata import Capacity, CPMetadata, build_metadata
from ..quant import FP8_TILE, quantize_fp8
from .base import KERNEL_CALL, AttentionPlan, KernelCall, check_sinks, tile_row_bytes
from .static import place_static

if TYPE_CHECKING:  # annotations only (typing.Unpack: Python >= 3.11)
    from typing_extensions import Unpack

__all__ = ["ShardedExtendPlan", "build_sharded_extend", "replicated_view"]

_RUN = KERNEL_CALL - {"out", "lse"}


class ShardedExtendPlan(AttentionPlan):
    """One forward's extend over a sharded cache for one layer kind (see the module docstring).

    Attributes (beyond :class:`AttentionPlan`'s): ``estimate`` (the cost model's dict),
    ``writes`` (the :class:`cpattn.CacheWritePlan` of the extend rows this rank stores, planned
    from the page table given at plan time); ``attention``: the dense plan (pass-KV) or the
    shard plan (pass-Q) whose ``attend`` it runs.
    """

    def __init__(self, meta: CPMetadata, spec, algorithm: str, estimate: dict, writes, page_table: Tensor,
                 attention, extra: dict) -> None:
        super().__init__(meta, spec, attention.backend, attention._impl, rows=meta.num_physical_tokens,
                         q_name="q_local")
        self.algorithm, self.estimate = algorithm, estimate
        self.writes, self.page_table, self.attention = writes, page_table, attention
        self._extra = extra

    def attend(self, *args, **kwargs):
        """The kernel alone: ``attention.attend`` (pass-KV: the dense kernel over packed prefix +
        extend K/V; pass-Q: this rank's partial over its shard)."""
        return self.attention.attend(*args, **kwargs)

    @property
    def tables(self) -> dict[str, Tensor]:
        """The device tables a layer reads beyond the placement plans (``meta``,
        ``attention.meta``): the page table, the write plan and the algorithm's gather / return
        maps (fixed addresses for a static plan; read-only introspection)."""
        out = {"page_table": self.page_table, "write_slots": self.writes.slots}
        if self.writes.rows is not None:
            out["write_rows"] = self.writes.rows
        out.update((k, v) for k, v in self._extra.items() if isinstance(v, Tensor))
        if "packed_writes" in self._extra:
            out["packed_write_rows"] = self._extra["packed_writes"].rows
        return out

    def run(self, q_local: Tensor, k_local: Tensor, v_local: Tensor, cache, *, writes=None, group=None,
            **call: Unpack[KernelCall]) -> Tensor | tuple[Tensor, Tensor]:
        """One layer: collectives, this rank's cache write, attention (device-only).

        Args:
            q_local: [P, Hq, D], k_local: [P, Hkv, D], v_local: [P, Hkv, Dv]: this rank's rows
                (``strategy.shard`` order; pad rows ignored).
            cache: this rank's paged caches ``(k_cache, v_cache)`` [num_pages, page_size, Hkv,
                D] / [.., Dv] (the layer's), holding its prefix shard; its share of the extend
                K/V is written into them.
            writes: None (the plan's own, planned from the page table at plan time) or that
                same plan.
            group: the CP group (None: default group; no collective at C = 1).
            **call: :class:`KernelCall` but ``out`` / ``lse``: ``page_table`` (None or the plan's,
                read at plan time), ``sinks`` ([Hq] float when the spec has sinks),
                ``softmax_scale`` (default D ** -0.5), ``return_lse`` (also return lse [P, Hq]
                float32), ``k_scale`` / ``v_scale`` (an FP8 spec only, required there: float32
                ``[]`` or ``[Hkv]`` device tensors; the new K/V are quantized on this rank before
                the collective, which moves FP8 bytes; pass-KV: the prefix rows too, as cached).

        A tile-scaled latent spec (``kv_layout="fp8_tile"``): ``k_local`` is the new latent rows
        [P, 1, D] in the plan's dtype, ``v_local`` the view ``k_local[..., :Dv]``, ``cache``
        ``(rows, rows)`` (ONE uint8 [num_pages, page_size, 1, row_bytes] tensor twice); the rows
        are quantized on this rank before the collective, which moves one tile row per token (V
        is its latent); no ``k_scale`` / ``v_scale``.

        Returns:
            out [P, Hq, Dv] in q's dtype (pad rows 0), with return_lse (out, lse).
        """
        _, sinks, softmax_scale, _, _, return_lse, scales = self._kernel_call(call, "run", _RUN)
        meta, spec = self.meta, self.spec
        self._check_new_rows(q_local, k_local, v_local, meta.num_physical_tokens)
        if writes is not None and writes is not self.writes:
            raise ValueError("writes= of a pass-KV / pass-Q plan are planned from its page table at plan time; "
                             "pass None")
        if spec.kv_tiled:  # one uint8 tensor of tile rows: K, and V = its latent
            self._check_latent_view(k_local, v_local)
            k_cache = v_cache = self._tile_cache(cache, "this rank's paged tile cache")
            tails = (("cache", k_cache, tile_row_bytes(spec), torch.uint8),)
        else:
            k_cache, v_cache = self._cache_pair(cache, "this rank's paged caches")
            tails = (("k_cache", k_cache, spec.head_dim, spec.kv_dtype),
                     ("v_cache", v_cache, spec.head_dim_v, spec.kv_dtype))
        for name, t, d, dtype in tails:
            if t.dim() != 4 or tuple(t.shape[1:]) != (spec.page_size, spec.num_kv_heads, d) or \
                    t.shape[0] * spec.page_size != self.writes.num_slots:
                raise ValueError(f"{name} must be [num_pages, {spec.page_size}, {spec.num_kv_heads}, {d}] with "
                                 f"num_pages * page_size = {self.writes.num_slots}, got {list(t.shape)}")
            if t.dtype != dtype or t.device != meta.device:
                raise ValueError(f"{name} must be {dtype} on {meta.device}, got {t.dtype} on {t.device}")
        if sinks is not None or spec.has_sinks:
            check_sinks(sinks, spec, meta.device)
        check_group(meta, group)  # local checks, before any collective
        kv_scales = {}
        if spec.kv_tiled:  # quantized where computed: the collective moves tile rows
            k_local = v_local = self._quantize_tiles(k_local)
        elif scales is not None:  # quantized where computed: the collective moves FP8 bytes
            k_local = quantize_fp8(k_local, scales[0], spec.kv_dtype)
            v_local = quantize_fp8(v_local, scales[1], spec.kv_dtype)
            kv_scales = {"k_scale": scales[0], "v_scale": scales[1]}
        if self.algorithm == "pass_kv":
            out, lse = self._pass_kv(q_local, k_local, v_local, k_cache, v_cache, group, sinks, softmax_scale,
                                     return_lse, kv_scales)
        else:
            out, lse = self._pass_q(q_local, k_local, v_local, k_cache, v_cache, group, sinks, softmax_scale,
                                    kv_scales)
        return (out, lse) if return_lse else out

    # ------------------------------------------------------------------ pass-KV
    def _pass_kv(self, q_local, k_local, v_local, k_cache, v_cache, group, sinks, softmax_scale, return_lse,
                 kv_scales):
        meta, spec, x = self.meta, self.spec, self._extra
        p, c = meta.num_physical_tokens, meta.cp_size
        slots, tiled = x["prefix_slots"], spec.kv_tiled
        # the parts of a gathered row: K and V, or a tile spec's one uint8 row (V is its latent)
        tails = [tuple(k_local.shape[1:])] + ([] if tiled else [tuple(v_local.shape[1:])])
        locals_ = (k_local, v_local)[: len(tails)]
        pres = [c.view(-1, *tail).index_select(0, slots) for c, tail in zip((k_cache, v_cache), tails)]  # pre-write
        rows = p + x["np_rows"]
        layout, row_bytes = x["layout"], x["row_bytes"]
        send = torch.empty((rows, row_bytes), dtype=torch.uint8, device=k_local.device)
        n_pre = pres[0].shape[0]
        for (off, width), local, pre in zip(layout, locals_, pres):
            cols = width // local.element_size()
            send[:p, off : off + width] = local.reshape(p, cols).contiguous().view(torch.uint8)
            send[p : p + n_pre, off : off + width] = pre.reshape(n_pre, cols).view(torch.uint8)
        if c == 1:
            gathered = send
        else:
            gathered = torch.empty((c * rows, send.shape[1]), dtype=torch.uint8, device=send.device)
            _collectives.all_gather_into(gathered, send, group, False)  # ONE all-gather
        packed = gathered.index_select(0, x["src_index"])
        parts = unpack_rows(packed, layout, [(t.dtype, tail) for t, tail in zip(locals_, tails)])
        if tiled:
            k_all = v_all = parts[0]
            write_mla_cache(k_all[:, 0], None, k_cache[..., 0, :], x["packed_writes"], layout=FP8_TILE)
        else:
            k_all, v_all = parts
            write_kv_cache(k_all, v_all, k_cache, v_cache, x["packed_writes"])
        res = self.attention.attend(q_local, k_all, v_all, sinks=sinks, softmax_scale=softmax_scale,
                                    return_lse=return_lse, **kv_scales)
        return res if return_lse else (res, None)

    # ------------------------------------------------------------------ pass-Q
    def _pass_q(self, q_local, k_local, v_local, k_cache, v_cache, group, sinks, softmax_scale, kv_scales):
        meta, x = self.meta, self._extra
        p, c = meta.num_physical_tokens, meta.cp_size
        if p == 0:  # an empty batch: nothing to gather, write or attend
            hq, dv = self.spec.num_q_heads, self.spec.head_dim_v
            return (q_local.new_zeros((0, hq, dv)), torch.zeros((0, hq), dtype=torch.float32, device=q_local.device))
        if self.spec.kv_tiled:  # one uint8 tile row per token: K, and V = its latent
            q_all, k_ext = all_gather_rows([q_local, k_local], meta, group)  # ONE all-gather
            write_mla_cache(k_ext[:, 0], None, k_cache[..., 0, :], self.writes, layout=FP8_TILE)
        else:
            q_all, k_ext, v_ext = all_gather_kv_rows(k_local, v_local, meta, group, lead=(q_local,))  # ONE all-gather
            write_kv_cache(k_ext, v_ext, k_cache, v_cache, self.writes)
        out_p, lse_p = self.attention.attend(q_all, k_cache, v_cache, page_table=self.page_table, sinks=sinks,
                                             softmax_scale=softmax_scale, **kv_scales)
        idx = x["send_index"]
        send, layout = pack_rows([out_p.index_select(0, idx), lse_p.index_select(0, idx)], c * p)
        if c == 1:
            received = send
        else:
            received = torch.empty_like(send)
            _collectives.all_to_all_into(received, send, group)  # ONE all-to-all: partials back to the query owners
        hq, dv = self.spec.num_q_heads, self.spec.head_dim_v
        outs, lses = unpack_rows(received.view(c, p, -1), layout, [(out_p.dtype, (hq, dv)), (torch.float32, (hq,))])
        out, lse = merge_states(outs, lses)
        valid = meta.row_valid
        out = torch.where(valid[:, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
        lse = torch.where(valid[:, None], lse.float(), torch.full((), float("-inf"), device=lse.device))
        return out, lse


def _fixed(meta: CPMetadata, name: str, values: Tensor, rows: Optional[int] = None) -> Tensor:
    """``values`` on ``meta``'s device; for a static plan copied (device-only, plan time) into the
    arena's fixed tensor of ``rows`` rows (default: as many as ``values``), rows past it 0."""
    values = values.to(meta.device)
    if not meta.is_static:
        return values
    n = values.shape[0]
    buf = _buffers.scratch(meta, ("sharded-extend", name), (n if rows is None else rows, *values.shape[1:]),
                           values.dtype)
    buf[:n].copy_(values)
    buf[n:].zero_()
    return buf


def _prefix_rows(meta: CPMetadata) -> int:
    """Rows each rank puts its prefix shard in for pass-KV's all-gather: the most any rank holds,
    or for a static plan a bound for every batch within the capacity (a rank holds at most
    ``n / C + 2 I`` of a sequence's ``n`` keys)."""
    most = max(meta.num_local_prefix_tokens_per_rank)
    if not meta.is_static:
        return most
    cap = meta.capacity
    bound = min(cap.max_kv_tokens, -(-cap.max_kv_tokens // meta.cp_size) + 2 * cap.max_seqs * meta.kv.interleave)
    if most > bound:  # pragma: no cover - the bound holds for every batch within the capacity
        raise ValueError(f"a rank holds {most} prefix keys, more than the static bound {bound}")
    return bound


def _device_index_plans(meta: CPMetadata, page_table: Tensor, page_size: int) -> dict:
    """pass-KV gather tables, built on the device at plan time (O(keys of the batch) device
    work, nothing on the host beyond O(B C)): the cache slots of this rank's prefix shard (rows
    past it: slot 0, never read back) and, for every packed prefix+extend row, its row in the
    gathered buffer (rows past the batch's keys: 0, never read)."""
    sh, dev = meta.kv, meta.device
    host = meta.host if meta.host is not None else meta
    c, p, rank = meta.cp_size, meta.num_physical_tokens, meta.rank
    np_mine = meta.num_local_prefix_tokens_per_rank[rank]
    np_rows = _prefix_rows(meta)
    rows = p + np_rows
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
    src = torch.zeros(meta.num_kv_rows, dtype=torch.int64, device=dev)
    if meta.num_tokens:
        t = meta.num_tokens
        g = meta.gather_index[:t]
        src[meta.kv_extend_index[:t]] = (g // p) * rows + g % p
    num_prefix = meta.num_kv_tokens - meta.num_tokens
    if num_prefix:
        per_rank = torch.stack([sh.local_lengths(host.prefix_lens, r) for r in range(c)])  # [C, B]
        cu_all = torch.zeros(c, meta.num_seqs + 1, dtype=torch.int64)
        torch.cumsum(per_rank, 1, out=cu_all[:, 1:])
        cu_pre = torch.zeros(meta.num_seqs + 1, dtype=torch.int64)
        torch.cumsum(host.prefix_lens, 0, out=cu_pre[1:])
        cu_pre = cu_pre.to(dev)
        t = torch.arange(num_prefix, device=dev)
        b = torch.searchsorted(cu_pre, t, right=True) - 1
        pos = t - cu_pre[b]
        owner = sh.owner(pos)
        src[meta.cu_kv_lens[b] + pos] = owner * rows + p + cu_all.to(dev)[owner, b] + sh.local_index(pos)
    return {"prefix_slots": _fixed(meta, "prefix_slots", prefix_slots, np_rows),
            "src_index": _fixed(meta, "src_index", src), "np_rows": np_rows}


def _kv_row_layout(spec) -> tuple[list[tuple[int, int]], int]:
    """(offset, bytes) of K and V inside one gathered row (16-byte aligned parts), row bytes: in
    the cache dtype (``spec.kv_dtype``: an FP8 cache moves half the bytes of a bf16 one)."""
    item = spec.kv_dtype.itemsize
    widths = [spec.num_kv_heads * spec.head_dim * item, spec.num_kv_heads * spec.head_dim_v * item]
    if spec.kv_tiled:  # one tile row (latent, its scales, rope): V is its latent
        widths = [tile_row_bytes(spec)]
    offsets, row_bytes = row_layout(widths)
    return list(zip(offsets, widths)), row_bytes


def build_sharded_extend(meta: CPMetadata, spec, algorithm: str, estimate: dict, page_table: Tensor,
                         num_pages: int, attention, pad_slot: Optional[int] = None) -> ShardedExtendPlan:
    """The pass-KV / pass-Q plan around its inner plan (``attention``: a dense plan over packed K/V
    for pass-KV, a shard plan over the replicated view of the batch for pass-Q): this rank's
    cache writes (validated: nothing is written when the table does not fit; ``pad_slot``: where
    a static plan's padding rows write) and the gather / return tables, built at plan time (at
    the planner's fixed addresses for a static plan)."""
    from ..cache import plan_cache_writes

    writes = plan_cache_writes(meta, page_table, page_size=spec.page_size, num_pages=num_pages, pad_slot=pad_slot)
    pt_dev = _fixed(meta, "page_table", page_table)
    if algorithm == "pass_kv":
        extra = _device_index_plans(meta, page_table, spec.page_size)
        extra["layout"], extra["row_bytes"] = _kv_row_layout(spec)
        packed_rows = _fixed(meta, "packed_write_rows", meta.kv_extend_index.index_select(0, writes.rows))
        extra["packed_writes"] = dataclasses.replace(writes, rows=packed_rows, num_source_rows=meta.num_kv_rows)
    else:
        send_index = torch.zeros(meta.cp_size * meta.num_physical_tokens, dtype=torch.int64, device=meta.device)
        if meta.num_tokens:
            send_index[meta.gather_index[: meta.num_tokens]] = torch.arange(meta.num_tokens, device=meta.device)
        extra = {"send_index": _fixed(meta, "send_index", send_index)}
    return ShardedExtendPlan(meta, spec, algorithm, estimate, writes, pt_dev, attention, extra)


def replicated_view(meta: CPMetadata) -> CPMetadata:
    """The batch of ``meta`` with every query on every rank (what pass-Q's shard kernel runs); for
    a static plan sized for its capacity (every one of ``max_tokens`` gathered rows a query row)
    at fixed addresses of its planner's arena."""
    host = meta.host if meta.host is not None else meta
    cap = meta.capacity
    view = build_metadata("replicated", None, 1, meta.cp_size, meta.rank, 1, host.extend_lens, host.prefix_lens,
                          physical_rows=None if cap is None else cap.max_tokens, kv=meta.kv, replicated=True)
    if cap is None:
        view = view.to(meta.device)
    else:
        view_cap = Capacity(cap.max_tokens, cap.max_seqs, cap.max_kv_tokens, cap.max_tokens, cap.max_seqs,
                            cap.max_q_len, cap.max_seq_len)
        view = place_static(meta.arena, "replicated-view", view, view_cap)
    return dataclasses.replace(view, group=meta.group)
