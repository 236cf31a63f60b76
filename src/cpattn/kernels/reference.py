"""Torch reference backend: exact masked softmax attention, one segment at a time.

Readable and dependable rather than fast (fp32 math, fp64 for fp64 inputs, whose lse is then
float64 too, so fp64 checks reach fp64 precision): the ground truth the
optimized backends are compared with and the fallback on machines without Triton or FA4. It is
the one backend whose per-layer call loops over segments on the host (from the plan's host copy;
no device sync), and so the one that a CUDA graph cannot replay for another batch.

FP8 caches (``spec.kv_dtype``): the rows a segment reads are dequantized (``x * scale``, float32,
:func:`cpattn.quant.dequantize_fp8`) before the same math; tile-scaled MLA latent rows
(``spec.kv_layout="fp8_tile"``, k and v the same uint8 cache) by
:func:`cpattn.quant.dequantize_mla_fp8_tiles` (V: the latent, the row's first ``Dv`` values).

FP8 tensor-core attention (``spec.mma_dtype``, dense plans): :func:`segment_attention_fp8` does
the kernels' quantization exactly (queries per row by :func:`cpattn.quant.quantize_fp8_rows`, the
K/V e4m3 values read as they are, probabilities rounded to ``fp8(256 p)``) but relative to each
row's final max where the kernels use their running max: the two agree to a tolerance, not
bitwise.

NaN semantics: a NaN in q, in a visible key or value, or in a sink reaches exactly the rows that
see it (their out and lse are NaN); masked keys never contribute, not even as 0 * NaN. Rows that
see no key (pad rows) are 0 / -inf.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch
from torch import Tensor

from . import AttentionSpec, IndexTopkSpec
from ._dsa_rows import device_rows
from ..metadata import CPMetadata
from ..quant import FP8_P_SCALE, dequantize_fp8, dequantize_mla_fp8_tiles, quantize_fp8_rows
from ..selection import NO_KEY, key_positions, pack_keys, top_keys

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
    slot = pos % page_size
    # index (page, slot) of the un-flattened caches: only these rows are read, whatever the caches'
    # strides (k.flatten(0, 1) would copy a whole strided pool, e.g. FlashInfer's buf[:, 0])
    return k[pages, slot], v[pages, slot]


def _dequantized(keys: Tensor, values: Tensor, k_scale: Optional[Tensor], v_scale: Optional[Tensor], work,
                 tiled: Optional[int] = None):
    """FP8 rows times their scales in ``work`` (rows in the query dtype: unchanged); ``tiled``
    (the latent width Dv of a tile-scaled cache): keys dequantized from their uint8 rows, values
    their first Dv columns."""
    if tiled is not None:
        keys = dequantize_mla_fp8_tiles(keys, tiled, work)
        return keys, keys[..., :tiled]
    if k_scale is None:
        return keys, values
    return dequantize_fp8(keys, k_scale, work), dequantize_fp8(values, v_scale, work)


def _rows_in(x: Tensor, scale: Optional[Tensor], work, tiled: Optional[int], width: int) -> Tensor:
    """Gathered K or V rows in ``work``: dequantized (FP8 scale, or the tile layout whose first
    ``width`` values are kept), or converted."""
    if tiled is not None:
        return dequantize_mla_fp8_tiles(x, tiled, work)[..., :width]
    return x.to(work) if scale is None else dequantize_fp8(x, scale, work)


def segment_attention(
    q: Tensor, pos: Tensor, keys: Tensor, values: Tensor, key_pos: Tensor, softmax_scale: float, window_left: int,
    sinks: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    """q [n, Hq, D], pos [n]; keys [m, Hkv, D], values [m, Hkv, Dv], key_pos [m] -> out, lse.

    Key ``j`` is visible to row ``i`` when ``key_pos[j] <= pos[i]`` (and ``>= pos[i] - window``).
    Math in float32, or float64 when q is float64: out and lse come back in that dtype (lse
    float64 for float64 inputs; the planned calls store it in an lse buffer of the plan's lse
    dtype, float64 for a float64 plan).
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


def _per_head_scale(scale: Tensor, hkv: int, work) -> Tensor:
    """A K/V scale ([] or [Hkv]) as [Hkv] in ``work``."""
    return scale.to(work).reshape(-1).expand(hkv)


def segment_attention_fp8(
    q: Tensor, pos: Tensor, keys: Tensor, values: Tensor, k_scale: Tensor, v_scale: Tensor, key_pos: Tensor,
    softmax_scale: float, window_left: int, sinks: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    """FP8 tensor-core attention of one segment (``AttentionSpec(mma_dtype=torch.float8_e4m3fn)``).

    q [n, Hq, D] (bf16 / fp16 / fp32), pos [n]; keys [m, Hkv, D], values [m, Hkv, Dv] e4m3 as the
    cache holds them, k_scale / v_scale float32 [] or [Hkv]; key_pos [m] -> (out [n, Hq, Dv],
    lse [n, Hq]) float32. Scores ``(q8 . k8) * q_scale_row * k_scale * softmax_scale`` (q8, q_scale
    from :func:`cpattn.quant.quantize_fp8_rows`), ``p = exp(s - row max)`` (the sink's logit joins
    the max), the P V dot takes ``fp8(256 p) / 256``; the row sum ``l`` adds the fp32 ``p`` (and
    ``exp(sink - max)``); out ``= (P8 V8) * v_scale / l``.
    Visibility and NaN as :func:`segment_attention` (a NaN or inf in a query row: that row is NaN
    where it sees a key).
    """
    work = torch.float32
    n, hq, _ = q.shape
    hkv = keys.shape[1]
    group = hq // hkv
    q8, qs = quantize_fp8_rows(q)
    qg = q8.to(work).view(n, hkv, group, -1)
    row_scale = qs.view(n, hkv, group, 1) * _per_head_scale(k_scale, hkv, work).view(1, hkv, 1, 1) * softmax_scale
    scores = torch.einsum("nhgd,mhd->nhgm", qg, keys.to(work)) * row_scale
    visible = key_pos[None, :] <= pos[:, None]
    if window_left >= 0:
        visible &= key_pos[None, :] >= pos[:, None] - window_left
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    m = scores.amax(dim=-1, keepdim=True) if scores.shape[-1] else scores.new_full((n, hkv, group, 1), -torch.inf)
    sink = sinks.to(work).view(1, hkv, group, 1).expand(n, hkv, group, 1) if sinks is not None else None
    if sink is not None:
        m = torch.maximum(m, sink)
        m = torch.where(scores.isnan().any(dim=-1, keepdim=True), float("nan"), m)  # maximum keeps NaN; amax too
    m_use = torch.where(m == -torch.inf, 0.0, m)
    p = torch.exp(scores - m_use)
    p8 = (p * FP8_P_SCALE).to(torch.float8_e4m3fn).to(work) / FP8_P_SCALE
    l = p.sum(dim=-1, keepdim=True)  # fp32 p, as the kernels' online softmax (docs/fp8.md: measured)
    if sink is not None:
        l = l + torch.exp(sink - m_use)
    out = torch.einsum("nhgm,mhd->nhgd", p8, values.to(work)) * _per_head_scale(v_scale, hkv, work).view(1, hkv, 1, 1)
    has_mass = l != 0
    out = out * torch.where(has_mass, 1.0 / torch.where(has_mass, l, 1.0), 0.0)
    lse = torch.where(has_mass, m_use + torch.log(torch.where(has_mass, l, 1.0)), -torch.inf)
    return out.reshape(n, hq, -1), lse.reshape(n, hq)


class _TorchRun:
    """The planned reference call: the host segment table of the plan, read once at plan time."""

    def __init__(self, spec: AttentionSpec, meta: CPMetadata) -> None:
        host = meta.host if meta.host is not None else meta
        self.segments = meta.host_segments
        self.cu_kv = host.cu_kv_lens.tolist()
        self.num_local = meta.num_local_tokens
        self.window_left = spec.window_left
        self.tiled = spec.head_dim_v if spec.kv_tiled else None
        #: FP8 tensor-core attention (``spec.mma_dtype``): :func:`segment_attention_fp8`
        self.fp8_mma = spec.fp8_mma
        self.mma_dtype = spec.mma_dtype if spec.fp8_mma else None  # plan.mma_dtype
        #: the lse dtype the plan hands out: float64 math for float64 inputs keeps a float64 lse
        self.lse_dtype = torch.float64 if spec.dtype == torch.float64 else torch.float32

    def __call__(self, q, k, v, page_table, sinks, softmax_scale, out, lse, k_scale=None, v_scale=None) -> None:
        n = self.num_local
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
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
                if self.fp8_mma:
                    o, l = segment_attention_fp8(q[row0 + c0 : row0 + c1], pos, keys, values, k_scale, v_scale,
                                                 key_pos, softmax_scale, w, sinks)
                else:
                    keys, values = _dequantized(keys, values, k_scale, v_scale, work, self.tiled)
                    o, l = segment_attention(q[row0 + c0 : row0 + c1], pos, keys, values, key_pos, softmax_scale, w,
                                             sinks)
                out[row0 + c0 : row0 + c1] = o.to(out.dtype)
                if lse is not None:
                    lse[row0 + c0 : row0 + c1] = l.to(lse.dtype)  # float64 buffers keep float64 math


class _TorchBackend:
    """A torch reference backend of one kind: always available, any spec, no backend options;
    ``plan`` builds the kind's ``run_class`` (a host loop for eager use and tests)."""

    name = "torch"
    run_class: type

    def available(self) -> Optional[str]:
        return None

    def unsupported_reason(self, spec, meta) -> Optional[str]:
        return None

    def plan(self, spec, meta, options: Mapping):
        if options:
            raise ValueError(f"backend 'torch' takes no backend_options, got {sorted(options)}")
        return self.run_class(spec, meta)


class TorchReferenceBackend(_TorchBackend):
    run_class = _TorchRun


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
        self.seq_lens = host.kv_lens.tolist()
        self.q_lens = host.extend_lens.tolist()
        self.cu_q = host.cu_extend_lens.tolist()
        self.local = host.local_kv_lens.tolist()
        self.cu_local = host.cu_local_kv_lens.tolist()
        self.num_rows = dmeta.num_local_tokens
        self.rank = dmeta.rank
        self.sharding = dmeta.kv
        self.window_left = spec.window_left
        self.sinks_used = spec.has_sinks and dmeta.rank == 0
        self.tiled = spec.head_dim_v if spec.kv_tiled else None
        self.family = "torch"

    def __call__(self, q, k, v, page_table, sinks, softmax_scale, out, lse, k_scale=None, v_scale=None) -> None:
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        out[self.num_rows :].zero_()
        lse[self.num_rows :].fill_(float("-inf"))
        sinks = sinks if self.sinks_used else None
        for b, (sl, ql) in enumerate(zip(self.seq_lens, self.q_lens)):
            if ql == 0:
                continue
            n_local = self.local[b]
            keys, values = _keys_of(k, v, page_table, self.cu_local[b], b, 0, n_local)
            keys, values = _dequantized(keys, values, k_scale, v_scale, work, self.tiled)
            key_pos = self.sharding.global_position(torch.arange(n_local, device=q.device), self.rank)
            pos = torch.arange(sl - ql, sl, device=q.device)
            r0 = self.cu_q[b]
            o, l = segment_attention(q[r0 : r0 + ql], pos, keys, values, key_pos, softmax_scale, self.window_left,
                                     sinks)
            out[r0 : r0 + ql] = o.to(out.dtype)
            lse[r0 : r0 + ql] = l.to(lse.dtype)


class TorchShardBackend(_TorchBackend):
    run_class = _TorchShardRun


# =============================================================================================
# DSA (DeepSeek sparse attention) torch references: sparse attention over selected keys and the
# lightning indexer's top-k. Self-contained section (kinds "sparse" and "index" of the registry).
# =============================================================================================


#: Gathered K/V elements per step of the sparse reference (bounds its memory: 16M floats).
_SPARSE_GATHER_ELEMS = 1 << 24
#: Score elements (rows x heads x keys) per step of the index reference (16M floats).
_INDEX_SCORE_ELEMS = 1 << 24


def _flat_kv_rows(sel: Tensor, valid: Tensor, start: Tensor, seq: Tensor, page_table: Optional[Tensor],
                  page_size: int) -> Tensor:
    """Rows of the flattened K/V ([num_kv_rows] packed, [num_pages * page_size] paged) holding
    positions ``sel`` [r, k] of each row's sequence; entries not ``valid`` point at row 0 (the
    page table is never dereferenced for them: a sequence without keys may have no pages)."""
    if page_table is None:
        return torch.where(valid, start[:, None] + sel, 0)
    pages = page_table.long()[seq.long()[:, None], sel // page_size]
    return torch.where(valid, pages * page_size + sel % page_size, 0)


class _TorchSparseRun:
    """Sparse attention by gathering each row's selected keys (exact masked softmax, fp32; fp64
    for fp64 inputs). Rows are processed in chunks on the host (eager only: not for graphs)."""

    def __init__(self, spec: AttentionSpec, meta: CPMetadata) -> None:
        self.spec = spec
        rows = device_rows(meta)
        self.row_seq, self.row_pos, self.row_start = rows["row_seq"], rows["row_pos"], rows["row_kv_start"]
        self.num_rows = meta.num_physical_tokens
        self.lse_dtype = torch.float64 if spec.dtype == torch.float64 else torch.float32  # as _TorchRun

    def __call__(self, q, k, v, idx, page_table, sinks, softmax_scale, out, lse, k_scale=None, v_scale=None) -> None:
        spec = self.spec
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        hq, hkv, g = spec.num_q_heads, spec.num_kv_heads, spec.group_size
        ps = spec.page_size or 1
        tiled = spec.head_dim_v if spec.kv_tiled else None

        def take(x: Tensor, rows: Tensor) -> Tensor:  # rows of the flattened K/V, without flattening x
            if x.shape[0] == 0:  # an empty key shard: every entry is masked
                return x.new_zeros(*rows.shape, *x.shape[(2 if spec.paged else 1):])
            return x[rows // ps, rows % ps] if spec.paged else x[rows]

        topk = idx.shape[1]
        per_key = hkv * (spec.head_dim + spec.head_dim_v)
        key_chunk = max(1, min(topk, _SPARSE_GATHER_ELEMS // per_key))
        row_chunk = max(1, min(self.num_rows, _SPARSE_GATHER_ELEMS // (per_key * key_chunk)))
        for r0 in range(0, self.num_rows, row_chunk):
            r1 = min(self.num_rows, r0 + row_chunk)
            pos = self.row_pos[r0:r1].long()
            e = idx[r0:r1].long()
            valid = (e >= 0) & (e <= pos[:, None])  # [r, K]: -1, future and out-of-sequence ignored
            sel = torch.where(valid, e, torch.zeros((), dtype=e.dtype, device=e.device))
            flat = _flat_kv_rows(sel, valid, self.row_start[r0:r1], self.row_seq[r0:r1], page_table, ps)
            qr = q[r0:r1].to(work).view(r1 - r0, hkv, g, -1)
            scores = torch.empty(r1 - r0, hkv, g, topk, dtype=work, device=q.device)
            for c0 in range(0, topk, key_chunk):
                c1 = min(topk, c0 + key_chunk)
                keys = take(k, flat[:, c0:c1])  # [r, kc, Hkv, D]
                keys = _rows_in(keys, k_scale, work, tiled, spec.head_dim)
                scores[..., c0:c1] = torch.einsum("rhgd,rkhd->rhgk", qr, keys) * softmax_scale
            scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
            if sinks is not None:
                sink = sinks.to(work).view(1, hkv, g, 1).expand(r1 - r0, hkv, g, 1)
                row_lse = torch.logsumexp(torch.cat([scores, sink], dim=-1), dim=-1)
            else:
                row_lse = torch.logsumexp(scores, dim=-1)
            empty = torch.isneginf(row_lse)
            probs = torch.exp(scores - torch.where(empty, 0.0, row_lse)[..., None])
            acc = torch.zeros(r1 - r0, hkv, g, spec.head_dim_v, dtype=work, device=q.device)
            for c0 in range(0, topk, key_chunk):
                c1 = min(topk, c0 + key_chunk)
                vals = take(v, flat[:, c0:c1])  # [r, kc, Hkv, Dv]
                vals = _rows_in(vals, v_scale, work, tiled, spec.head_dim_v)
                vals = vals.masked_fill(~valid[:, c0:c1, None, None], 0.0)  # masked keys: not even 0 * NaN
                acc += torch.einsum("rhgk,rkhd->rhgd", probs[..., c0:c1], vals)
            pad = (pos < 0)[:, None]
            out[r0:r1] = acc.reshape(r1 - r0, hq, -1).masked_fill(pad[..., None], 0.0).to(out.dtype)
            if lse is not None:
                lse[r0:r1] = row_lse.reshape(r1 - r0, hq).masked_fill(pad, float("-inf")).to(lse.dtype)


class TorchSparseBackend(_TorchBackend):
    run_class = _TorchSparseRun


def index_scores(q_idx: Tensor, keys: Tensor, weights: Tensor, softmax_scale: float) -> Tensor:
    """DSA index scores ``sum_h w[t, h] * relu(scale * q[t, h] . k[s])``: q_idx [r, H, D] and
    weights [r, H] of r rows, keys [m, D] (already dequantized) -> [r, m] in the keys' dtype."""
    s = torch.einsum("rhd,md->rhm", q_idx, keys) * softmax_scale
    return torch.einsum("rh,rhm->rm", weights, torch.relu(s))


class _TorchIndexRun:
    """Index top-k one segment at a time (host loop over the plan's segments), over key chunks
    with a running top-k merge of packed (score, position) keys (:mod:`cpattn.selection`: ties
    go to the lower position): memory stays bounded at any context length."""

    def __init__(self, spec: IndexTopkSpec, meta: CPMetadata) -> None:
        host = meta.host if meta.host is not None else meta
        self.spec = spec
        self.segments = meta.host_segments
        self.cu_kv = host.cu_kv_lens.tolist()

    def __call__(self, q_idx, k_idx, weights, k_scale, page_table, softmax_scale, out) -> None:
        spec = self.spec
        work = torch.float64 if torch.float64 in (q_idx.dtype, k_idx.dtype) else torch.float32
        topk, h = spec.topk, spec.num_heads
        out.fill_(-1)
        row_chunk = 64
        key_chunk = max(256, _INDEX_SCORE_ELEMS // (row_chunk * h))
        dev = q_idx.device
        for seq, row0, length, pos0, stride in self.segments:
            for c0 in range(0, length, row_chunk):
                c1 = min(length, c0 + row_chunk)
                rows = slice(row0 + c0, row0 + c1)
                pos = torch.arange(pos0 + c0 * stride, pos0 + (c1 - 1) * stride + 1, stride, device=dev)
                last = pos0 + (c1 - 1) * stride
                qr, wr = q_idx[rows].to(work), weights[rows].to(work)
                best = torch.full((c1 - c0, topk), NO_KEY, dtype=torch.int64, device=dev)
                for k0 in range(0, last + 1, key_chunk):
                    k1 = min(last + 1, k0 + key_chunk)
                    key_pos = torch.arange(k0, k1, device=dev)
                    keys = self._keys(k_idx, k_scale, page_table, seq, key_pos, work)
                    s = index_scores(qr, keys, wr, softmax_scale)
                    packed = pack_keys(s, key_pos[None, :], key_pos[None, :] <= pos[:, None])
                    best = top_keys(torch.cat([best, packed], dim=1), topk)
                best_p = key_positions(best)
                out[rows] = best_p.to(out.dtype)

    def _keys(self, k_idx, k_scale, page_table, seq, key_pos, work) -> Tensor:
        if page_table is None:
            rows = self.cu_kv[seq] + key_pos
            keys, scale = k_idx[rows].to(work), (k_scale[rows] if k_scale is not None else None)
        else:
            ps = k_idx.shape[1]
            pages, slot = page_table[seq].long()[key_pos // ps], key_pos % ps
            keys = k_idx[pages, slot].to(work)  # only these rows, whatever the cache's strides
            scale = k_scale[pages, slot] if k_scale is not None else None
        return keys if scale is None else keys * scale.to(work)[:, None]


class TorchIndexBackend(_TorchBackend):
    run_class = _TorchIndexRun
