"""Torch reference backend: exact masked softmax attention, one segment at a time.

Readable and dependable rather than fast (fp32 math, fp64 for fp64 inputs): the ground truth the
optimized backends are compared with and the fallback on machines without Triton or FA4. It is
the one backend whose per-layer call loops over segments on the host (from the plan's host copy;
no device sync), and so the one that a CUDA graph cannot replay for another batch.

NaN semantics: a NaN in q, in a visible key or value, or in a sink reaches exactly the rows that
see it (their out and lse are NaN); masked keys never contribute, not even as 0 * NaN. Rows that
see no key (pad rows) are 0 / -inf.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch
from torch import Tensor

from . import AttentionSpec
from ..metadata import CPMetadata

_ROW_CHUNK = 512  # query rows per score matrix (bounds memory to chunk * keys * Hq floats)


def _keys_of(k: Tensor, v: Tensor, page_table: Optional[Tensor], kv_start: int, seq: int, lo: int, hi: int):
    """K, V rows of sequence ``seq`` at positions [lo, hi)."""
    if page_table is None:
        return k[kv_start + lo : kv_start + hi], v[kv_start + lo : kv_start + hi]
    page_size = k.shape[1]
    pos = torch.arange(lo, hi, device=k.device)
    pages = page_table[seq].to(torch.int64)[pos // page_size]
    if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= k.shape[0]):
        raise ValueError(
            f"page_table[{seq}] holds pages outside [0, num_pages={k.shape[0]}) for positions [{lo}, {hi}): "
            f"values in [{int(pages.min())}, {int(pages.max())}]"
        )
    flat = pages * page_size + pos % page_size
    return k.flatten(0, 1).index_select(0, flat), v.flatten(0, 1).index_select(0, flat)


def segment_attention(
    q: Tensor, pos: Tensor, keys: Tensor, values: Tensor, key_pos: Tensor, softmax_scale: float, window_left: int,
    sinks: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    """q [n, Hq, D], pos [n]; keys [m, Hkv, D], values [m, Hkv, Dv], key_pos [m] -> out, lse.

    Key ``j`` is visible to row ``i`` when ``key_pos[j] <= pos[i]`` (and ``>= pos[i] - window``).
    """
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    n, hq, _ = q.shape
    hkv = keys.shape[1]
    group = hq // hkv
    qg = q.to(work).view(n, hkv, group, -1)
    scores = torch.einsum("nhgd,mhd->nhgm", qg, keys.to(work)) * softmax_scale
    visible = key_pos[None, :] <= pos[:, None]
    if window_left >= 0:
        visible &= key_pos[None, :] >= pos[:, None] - window_left
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.to(work).view(1, hkv, group, 1).expand(n, hkv, group, 1)
        lse = torch.logsumexp(torch.cat([scores, sink], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(scores, dim=-1)
    empty = torch.isneginf(lse)  # no visible key and no sink: 0 / -inf, not NaN
    probs = torch.exp(scores - torch.where(empty, 0.0, lse)[..., None])
    vals = values.to(work)
    bad_v = vals.isnan()
    out = torch.einsum("nhgm,mhd->nhgd", probs, vals.masked_fill(bad_v, 0.0))
    if bad_v.any():  # a NaN value reaches the rows that see it (and only those)
        seen = torch.einsum("nm,mhd->nhd", visible.to(work), bad_v.to(work)) > 0
        out = out.masked_fill(seen[:, :, None, :], float("nan"))
    return out.reshape(n, hq, -1), lse.reshape(n, hq)


class _TorchRun:
    """The planned reference call: the host segment table of the plan, read once at plan time."""

    def __init__(self, spec: AttentionSpec, meta: CPMetadata) -> None:
        host = meta.host if meta.host is not None else meta
        self.segments = meta.host_segments
        self.cu_kv = host.cu_kv_lens.tolist()
        self.num_local = meta.num_local_tokens
        self.window_left = spec.window_left

    def __call__(self, q, k, v, page_table, sinks, softmax_scale, out, lse) -> None:
        n = self.num_local
        out[n:].zero_()
        if lse is not None:
            lse[n:].fill_(float("-inf"))
        w = self.window_left
        for seq, row0, length, pos0, stride in self.segments:
            for c0 in range(0, length, _ROW_CHUNK):
                c1 = min(length, c0 + _ROW_CHUNK)
                first, last = pos0 + c0 * stride, pos0 + (c1 - 1) * stride
                lo = max(0, first - w) if w >= 0 else 0
                keys, values = _keys_of(k, v, page_table, self.cu_kv[seq], seq, lo, last + 1)
                pos = torch.arange(first, last + 1, stride, device=q.device)
                key_pos = torch.arange(lo, last + 1, device=q.device)
                o, l = segment_attention(q[row0 + c0 : row0 + c1], pos, keys, values, key_pos, softmax_scale, w, sinks)
                out[row0 + c0 : row0 + c1] = o.to(out.dtype)
                if lse is not None:
                    lse[row0 + c0 : row0 + c1] = l.to(torch.float32)


class TorchReferenceBackend:
    name = "torch"

    def available(self) -> Optional[str]:
        return None

    def unsupported_reason(self, spec: AttentionSpec, meta: CPMetadata) -> Optional[str]:
        return None

    def plan(self, spec: AttentionSpec, meta: CPMetadata, options: Mapping) -> _TorchRun:
        if options:
            raise ValueError(f"backend 'torch' takes no backend_options, got {sorted(options)}")
        return _TorchRun(spec, meta)


# =============================================================================================
# Shard attention (plan kind "shard"): queries over ONE rank's key shard of a sharded KV cache.
# Self-contained section: the torch reference of cpattn.plans.shard (decode / pass-Q extend).
# =============================================================================================
class _TorchShardRun:
    """Exact attention of each sequence's query rows over this rank's local keys, whose global
    positions follow the sharding rule; sinks counted on rank 0 only (so a merge over the ranks
    counts them once). One sequence at a time from the plan's host copy (eager use only)."""

    def __init__(self, spec: AttentionSpec, dmeta) -> None:
        host = dmeta.host if dmeta.host is not None else dmeta
        self.seq_lens = host.seq_lens.tolist()
        self.q_lens = host.q_lens.tolist()
        self.cu_q = host.cu_q_lens.tolist()
        self.local = host.local_kv_lens.tolist()
        self.cu_local = host.cu_local_kv_lens.tolist()
        self.num_rows = dmeta.num_query_rows
        self.rank = dmeta.rank
        self.sharding = dmeta.sharding
        self.window_left = spec.window_left
        self.sinks_used = spec.has_sinks and dmeta.rank == 0
        self.family = "torch"

    def __call__(self, q, k, v, page_table, sinks, softmax_scale, out, lse) -> None:
        out[self.num_rows :].zero_()
        lse[self.num_rows :].fill_(float("-inf"))
        sinks = sinks if self.sinks_used else None
        for b, (sl, ql) in enumerate(zip(self.seq_lens, self.q_lens)):
            if ql == 0:
                continue
            n_local = self.local[b]
            keys, values = _keys_of(k, v, page_table, self.cu_local[b], b, 0, n_local)
            key_pos = self.sharding.global_position(torch.arange(n_local, device=q.device), self.rank)
            pos = torch.arange(sl - ql, sl, device=q.device)
            r0 = self.cu_q[b]
            o, l = segment_attention(q[r0 : r0 + ql], pos, keys, values, key_pos, softmax_scale, self.window_left,
                                     sinks)
            out[r0 : r0 + ql] = o.to(out.dtype)
            lse[r0 : r0 + ql] = l.to(torch.float32)


class TorchShardBackend:
    name = "torch"

    def available(self) -> Optional[str]:
        return None

    def unsupported_reason(self, spec: AttentionSpec, dmeta) -> Optional[str]:
        return None

    def plan(self, spec: AttentionSpec, dmeta, options: Mapping) -> _TorchShardRun:
        if options:
            raise ValueError(f"backend 'torch' takes no backend_options, got {sorted(options)}")
        return _TorchShardRun(spec, dmeta)
