"""Torch reference backend: exact masked softmax attention, one segment at a time.

Readable and dependable rather than fast (fp32 math, fp64 for fp64 inputs); the ground truth the
optimized backends are compared with, and the fallback on machines without Triton or FA4.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import AttentionCall

_ROW_CHUNK = 512  # query rows per score matrix (bounds memory to chunk * keys * Hq floats)


def _keys_of(call: AttentionCall, seq: int, lo: int, hi: int) -> tuple[Tensor, Tensor]:
    """K, V rows of sequence ``seq`` at positions [lo, hi)."""
    k, v = call.k, call.v
    if not call.paged:
        start = call.meta.host_cu_kv_lens[seq]
        return k[start + lo : start + hi], v[start + lo : start + hi]
    page_size = k.shape[1]
    pos = torch.arange(lo, hi, device=k.device)
    pages = call.page_table[seq].to(torch.int64)[pos // page_size]
    flat = pages * page_size + pos % page_size
    return k.flatten(0, 1).index_select(0, flat), v.flatten(0, 1).index_select(0, flat)


def _segment_attention(
    call: AttentionCall, q: Tensor, pos: Tensor, keys: Tensor, values: Tensor, key_pos: Tensor
) -> tuple[Tensor, Tensor]:
    """q [n, Hq, D], pos [n]; keys [m, Hkv, D], values [m, Hkv, Dv], key_pos [m] -> out, lse."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    n, hq, _ = q.shape
    hkv = keys.shape[1]
    group = hq // hkv
    qg = q.to(work).view(n, hkv, group, -1)
    scores = torch.einsum("nhgd,mhd->nhgm", qg, keys.to(work)) * call.softmax_scale
    visible = key_pos[None, :] <= pos[:, None]
    if call.window_left >= 0:
        visible &= key_pos[None, :] >= pos[:, None] - call.window_left
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    if call.sinks is not None:
        sink = call.sinks.to(work).view(1, hkv, group, 1).expand(n, hkv, group, 1)
        lse = torch.logsumexp(torch.cat([scores, sink], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("nhgm,mhd->nhgd", probs, values.to(work))
    return out.reshape(n, hq, -1), lse.reshape(n, hq)


class TorchReferenceBackend:
    name = "torch"

    def unsupported_reason(self, call: AttentionCall) -> Optional[str]:
        return None

    def run(self, call: AttentionCall) -> tuple[Tensor, Optional[Tensor]]:
        q, meta = call.q, call.meta
        rows, hq = q.shape[0], q.shape[1]
        out = q.new_zeros((rows, hq, call.v.shape[-1]))
        lse = torch.full((rows, hq), float("-inf"), dtype=torch.float32, device=q.device)
        for seq, row0, length, pos0, stride in meta.host_segments:
            for c0 in range(0, length, _ROW_CHUNK):
                c1 = min(length, c0 + _ROW_CHUNK)
                first, last = pos0 + c0 * stride, pos0 + (c1 - 1) * stride
                lo = max(0, first - call.window_left) if call.window_left >= 0 else 0
                keys, values = _keys_of(call, seq, lo, last + 1)
                pos = torch.arange(first, last + 1, stride, device=q.device)
                key_pos = torch.arange(lo, last + 1, device=q.device)
                o, l = _segment_attention(call, q[row0 + c0 : row0 + c1], pos, keys, values, key_pos)
                out[row0 + c0 : row0 + c1] = o.to(out.dtype)
                lse[row0 + c0 : row0 + c1] = l.to(torch.float32)
        return out, (lse if call.return_lse else None)
