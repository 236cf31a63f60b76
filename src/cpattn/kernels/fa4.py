"""``backend="fa4"``: flash-attn-4 (``flash_attn.cute``) in ONE varlen launch per layer.

Each metadata segment becomes one FA4 "batch": ``cu_seqlens_q`` over the segments' local rows
(segments are contiguous in row order), and for packed K/V ``cu_seqlens_k[b]`` = the key row where
the segment's sequence starts with ``seqused_k[b]`` = the segment's last position + 1. FA4's
bottom-right causal alignment then puts row ``i`` at position ``seqused_k - len + i``, exactly the
row's position, so causality, the sliding window and sinks are exact. Paged K/V: the segment's
page-table row (``page_table[seg_seq]``) with the same ``seqused_k``.

Only stride-1 segments map this way (zigzag, contiguous). Interleave (stride C) has no exact
mapping: a mask_mod would turn off FA4's causal block skipping; the backend reports it
unsupported, so ``backend="fa4"`` raises NotImplementedError before any work.

The per-segment arrays are planned with the metadata (``seg_cu_rows``, ``seg_key_start``,
``seg_keys_used``) and moved to the device with it: the per-layer path is device-only.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch
from torch import Tensor

from . import AttentionCall

def _import_fa4():
    return importlib.import_module("flash_attn.cute.interface")


class FA4Backend:
    name = "fa4"

    def __init__(self) -> None:
        self._import_error: Optional[str] = None
        self._iface = None

    def _interface(self):
        if self._iface is None and self._import_error is None:
            try:
                self._iface = _import_fa4()
            except Exception as exc:  # not installed, or no CUDA toolchain
                self._import_error = f"flash_attn.cute not importable ({type(exc).__name__}: {exc})"
        return self._iface

    def unsupported_reason(self, call: AttentionCall) -> Optional[str]:
        meta = call.meta
        if any(stride != 1 and length > 1 for _, _, length, _, stride in meta.host_segments):
            return (
                f"{meta.strategy} segments have stride > 1 (interleave): FA4 has no exact per-row "
                "causal mapping for them; use backend='triton'"
            )
        if not call.q.is_cuda:
            return "fa4 needs CUDA tensors"
        if call.q.dtype not in (torch.bfloat16, torch.float16):
            return f"fa4 supports bf16/fp16, got {call.q.dtype}"
        d, dv = call.q.shape[-1], call.v.shape[-1]
        if not (8 <= d <= 256 and 8 <= dv <= 256 and d % 8 == 0 and dv % 8 == 0):
            return f"head dims (D={d}, Dv={dv}) outside FA4's sm90 range (8..256, multiples of 8)"
        major = torch.cuda.get_device_capability(call.q.device)[0]
        if major not in (9, 10, 11):
            return f"fa4 backend is enabled for sm90/sm100 only, got sm{major}x"
        if self._interface() is None:
            return self._import_error
        return None

    def run(self, call: AttentionCall) -> tuple[Tensor, Optional[Tensor]]:
        iface = self._interface()
        q, meta = call.q, call.meta
        p_rows, hq, _ = q.shape
        dv = call.v.shape[-1]
        n = meta.num_local_tokens
        out = torch.empty((p_rows, hq, dv), dtype=q.dtype, device=q.device)
        lse_t = torch.empty((hq, p_rows), dtype=torch.float32, device=q.device) if call.return_lse else None
        if n < p_rows:
            out[n:].zero_()
            if lse_t is not None:
                lse_t[:, n:].fill_(float("-inf"))
        if n == 0 or meta.num_segments == 0:
            return out, (lse_t.t() if lse_t is not None else None)
        if call.paged:
            table = call.page_table.index_select(0, meta.seg_seq)
            if table.dtype != torch.int32:
                table = table.to(torch.int32)
            kv = dict(cu_seqlens_k=None, page_table=table)
        else:
            kv = dict(cu_seqlens_k=meta.seg_key_start, page_table=None)
        sinks = call.sinks
        if sinks is not None and sinks.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            sinks = sinks.float()
        left = call.window_left if call.window_left >= 0 else None
        iface._flash_attn_fwd(
            q,
            call.k,
            call.v,
            cu_seqlens_q=meta.seg_cu_rows,
            seqused_k=meta.seg_keys_used,
            max_seqlen_q=meta.max_seg_len,
            max_seqlen_k=meta.max_seg_keys_used,
            softmax_scale=call.softmax_scale,
            causal=True,
            window_size_left=left,
            window_size_right=0 if left is not None else None,
            learnable_sink=sinks,
            return_lse=call.return_lse,
            out=out,
            lse=lse_t,
            **kv,
        )
        return out, (lse_t.t() if lse_t is not None else None)
