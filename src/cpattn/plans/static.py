"""Static placement plans: fixed device addresses sized for a capacity (CUDA-graph replay).

A :class:`StaticPlanner` writes each batch's plan into the same device buffers (one copy from a
pinned staging buffer); attention plans built from such a plan reuse fixed buffers too (their
uploads go through ``meta.arena``), and kernels read counts from device memory with grids sized
for the capacity. A CUDA graph captured over ``shard`` / ``gather_kv`` / ``plan.run`` /
``gather`` for one batch then replays for any batch within the capacity. That holds for every
algorithm: "local", "gather_kv", "shard_merge", and "pass_kv" / "pass_q" (an extend over a
sharded cache: their page table, write plan, gather / return maps and pass-Q's replicated view
of the batch sit in the arena too, and their collectives move capacity-sized buffers).

Replay support: ``triton`` (both kernel families) replays; ``fa4`` takes host sizes and is
refused for static plans (``auto`` picks triton); ``torch`` runs its per-segment loop on the
host and is for eager use only.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from .._buffers import StaticArena, pad_to
from .._validation import check_device, check_int
from ..metadata import (DEVICE_FIELDS, SEGMENT_FIELDS, Capacity, CPMetadata, LengthsLike, as_lengths,
                        plan_fingerprint)

__all__ = ["StaticPlanner", "place_static"]


class StaticPlanner:
    """Placement plans at fixed device addresses, sized for a capacity (CUDA-graph replay).

    Every plan it returns has the same tensors (same data pointers, shapes sized for the
    capacity: ``meta.num_token_rows == max_tokens``, ``num_physical_tokens`` = P capacity,
    ``num_kv_rows == max_kv_tokens``, ``num_seq_rows == max_seqs``); attention plans built from
    them (:func:`plan_attention`) reuse fixed buffers as well, and the kernels read counts from
    device memory. Each :meth:`plan` writes the new batch with ONE host-to-device copy, so a
    graph captured over ``shard`` / ``gather_kv`` / ``plan.run`` / ``gather`` replays for it.
    Rows past a batch's real tokens in gather outputs repeat the last real row (engines ignore them).
    A plan's buffers hold it until the next :meth:`plan` call of the same planner (one planner
    per rank, i.e. per process; the previous forward's kernels, queued on the same stream, have
    read them by then).

    Args:
        strategy: the CP strategy. max_tokens: most extend tokens per batch (T). max_seqs: most
            sequences (B). max_kv_tokens: most prefix + extend tokens (packed K/V rows).
        device: where the plans live. kv: the KV layout, as in ``strategy.build_metadata``
            (None: replicated cache; a :class:`cpattn.KVSharding`: sharded).
        max_q_len: the longest extend of one sequence (kernels size their query tiles for it;
            1 for a decode planner with the "replicated" strategy; default: max_tokens).
        max_local_tokens: physical rows P per rank (default: the strategy's bound for any batch
            within the capacity, rounded to ``pad_multiple``).
        max_seq_len: the longest sequence (prefix + extend tokens) a batch may hold (default:
            max_kv_tokens). Work sized per sequence from the capacity follows it: the DSA index
            top-k over a sharded cache scores ``max_seq_len / C`` local keys per query row
            instead of ``max_kv_tokens / C`` (a decode planner for B sequences of up to L
            tokens: ``max_kv_tokens=B * L, max_seq_len=L``).

    Example::

        planner = cpattn.StaticPlanner(s, max_tokens=8192, max_seqs=64, max_kv_tokens=65536, device="cuda")
        meta = planner.plan(extend_lens, prefix_lens, rank=r, group=g)   # same addresses every time
        # decode steps over a sharded cache (B <= 64 sequences, one new token each):
        dec = cpattn.StaticPlanner(cpattn.get_strategy("replicated", C), max_tokens=64, max_seqs=64,
                                   max_kv_tokens=64 * 131072, max_q_len=1, max_seq_len=131072,
                                   kv=cpattn.KVSharding(C), device="cuda")
        meta = dec.plan(q_lens, seq_lens - q_lens, rank=r, group=g)
    """

    def __init__(self, strategy, *, max_tokens: int, max_seqs: int, max_kv_tokens: int,
                 device: torch.device | str, kv=None, max_q_len: Optional[int] = None,
                 max_local_tokens: Optional[int] = None, max_seq_len: Optional[int] = None) -> None:
        from ..strategies import CPStrategy

        if not isinstance(strategy, CPStrategy):
            raise TypeError(f"strategy must be a cpattn.CPStrategy, got {type(strategy).__name__}")
        t = check_int(max_tokens, "max_tokens", 1)
        b = check_int(max_seqs, "max_seqs", 1)
        kv_rows = check_int(max_kv_tokens, "max_kv_tokens", t)
        strategy.check_kv(kv)
        q = 0 if max_q_len is None else check_int(max_q_len, "max_q_len", 1)
        seq_len = 0 if max_seq_len is None else check_int(max_seq_len, "max_seq_len", 1)
        if seq_len > kv_rows:
            raise ValueError(f"max_seq_len must be <= max_kv_tokens={kv_rows}, got {seq_len}")
        bound = strategy.max_local_tokens(t, b) if max_local_tokens is None else check_int(
            max_local_tokens, "max_local_tokens", 1)
        align = strategy.pad_multiple
        p = -(-bound // align) * align
        self.strategy = strategy
        self.kv = kv
        self.capacity = Capacity(t, b, kv_rows, p, strategy.max_segments(b), min(q, t), seq_len)
        self.device = check_device(device, "device")
        self.arena = StaticArena(self.device)

    def __repr__(self) -> str:
        return f"StaticPlanner({self.strategy!r}, {self.capacity}, kv={self.kv}, device={self.device})"

    def plan(self, extend_lens: LengthsLike, prefix_lens: Optional[LengthsLike] = None, *, rank: int,
             group=None, agree: bool = True, index_topk: Optional[int] = None) -> CPMetadata:
        """Plan a batch into the fixed buffers (host; ValueError before any work when the batch
        exceeds the capacity; with ``group`` the ranks agree on the plan first, as in
        ``strategy.build_metadata``, ``index_topk`` included)."""
        host = self.strategy.agreed(lambda: self._build(extend_lens, prefix_lens, rank, index_topk), group, agree)
        return place_static(self.arena, "meta", host, self.capacity)

    def _build(self, extend_lens, prefix_lens, rank, index_topk=None) -> CPMetadata:
        cap, s = self.capacity, self.strategy
        topk = 0 if index_topk is None else check_int(index_topk, "index_topk", 1)
        ext = as_lengths(extend_lens, "extend_lens")
        pre = torch.zeros_like(ext) if prefix_lens is None else as_lengths(prefix_lens, "prefix_lens")
        if pre.numel() == ext.numel():
            over = [(what, got, limit) for what, got, limit in (
                ("tokens (sum(extend_lens))", int(ext.sum()), cap.max_tokens),
                ("sequences", ext.numel(), cap.max_seqs),
                ("kv tokens (sum(prefix_lens + extend_lens))", int(ext.sum() + pre.sum()), cap.max_kv_tokens),
                ("max extend_len (max_q_len)", int(ext.max()) if ext.numel() and cap.max_q_len else 0,
                 cap.max_q_len),
                ("longest sequence, prefix + extend (max_seq_len)",
                 int((ext + pre).max()) if ext.numel() and cap.max_seq_len else 0, cap.max_seq_len),
            ) if got > limit]
            if over:
                raise ValueError("batch over the StaticPlanner capacity: " +
                                 "; ".join(f"{what} {got} > {limit}" for what, got, limit in over))
        host = s.plan_host(ext, pre, rank, physical_rows=cap.max_local_tokens, kv=self.kv, index_topk=topk)
        if host.num_segments > cap.max_segments:
            raise ValueError(f"batch over the StaticPlanner capacity: {host.num_segments} query segments > "
                             f"{cap.max_segments}")
        fingerprint = plan_fingerprint(s.name, s.cp_size, rank, s.pad_multiple, host.extend_lens, host.prefix_lens,
                                       cap, kv=self.kv, index_topk=topk)
        return dataclasses.replace(host, fingerprint=fingerprint)


def place_static(arena: StaticArena, key, host: CPMetadata, capacity: Capacity) -> CPMetadata:
    """A host plan (its sizes within ``capacity``) at the arena's fixed buffers of ``key``: ONE
    host-to-device copy; the same device tensors for every plan placed under that key."""
    views = arena.upload(key, _expand(host, capacity))
    sized = {name: views[name] for name in DEVICE_FIELDS}
    n, b = host.num_local_tokens, host.num_seqs
    sized.update(  # informational fields: views of the batch's real rows
        local_token_indices=views["local_token_indices"][:n], local_positions=views["local_positions"][:n],
        local_seq_ids=views["local_seq_ids"][:n], extend_lens=views["extend_lens"][:b],
        prefix_lens=views["prefix_lens"][:b], kv_lens=views["kv_lens"][:b],
    )
    return dataclasses.replace(host, **sized, capacity=capacity, host=host, arena=arena)


def _expand(host: CPMetadata, cap: Capacity) -> dict[str, Tensor]:
    """The host plan's device fields padded to the capacity (see StaticPlanner for the rules)."""
    t = host.num_tokens
    last_gather = host.gather_index[t - 1] if t else 0
    last_kv = host.kv_extend_index[t - 1] if t else 0
    s = host.num_segments
    segs = {}
    for name in SEGMENT_FIELDS:
        segs[name] = pad_to(getattr(host, name), cap.max_segments + 1, 0)
    return {
        "extend_lens": pad_to(host.extend_lens, cap.max_seqs, 0),
        "prefix_lens": pad_to(host.prefix_lens, cap.max_seqs, 0),
        "kv_lens": pad_to(host.kv_lens, cap.max_seqs, 0),
        "cu_extend_lens": pad_to(host.cu_extend_lens, cap.max_seqs + 1, host.num_tokens),
        "cu_kv_lens": pad_to(host.cu_kv_lens, cap.max_seqs + 1, host.num_kv_tokens),
        "local_token_indices": pad_to(host.local_token_indices, cap.max_local_tokens, 0),
        "local_positions": pad_to(host.local_positions, cap.max_local_tokens, 0),
        "local_seq_ids": pad_to(host.local_seq_ids, cap.max_local_tokens, 0),
        "shard_index": host.shard_index,
        "row_valid": host.row_valid,
        # rows past T repeat the last real token's row: their duplicate writes are identical
        "gather_index": pad_to(host.gather_index, cap.max_tokens, int(last_gather)),
        "kv_extend_index": pad_to(host.kv_extend_index, cap.max_tokens, int(last_kv)),
        **segs,
        "counts": host.counts,
        # sharded-cache fields: empty without a KV sharding; else sized for the capacity
        # (entries past the batch's are unspecified: writes go through a CacheWritePlan)
        **{name: getattr(host, name) if host.kv is None else pad_to(getattr(host, name), size, fill)
           for name, size, fill in (("store_rows", cap.max_tokens, 0), ("store_index", cap.max_tokens, 0),
                                    ("local_prefix_lens", cap.max_seqs, 0), ("local_kv_lens", cap.max_seqs, 0),
                                    ("cu_local_kv_lens", cap.max_seqs + 1, host.num_local_kv_tokens))},
    }
