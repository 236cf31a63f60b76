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

The per-segment arrays (``cu_seqlens_q``, ``cu_seqlens_k``, ``seqused_k``) are built by the
attention plan and uploaded once per forward: the per-layer path is device-only. FA4 takes
``max_seqlen_q/k`` as host ints, so a graph captured for one batch does not replay for another:
static plans (``StaticPlanner``) are reported unsupported and ``auto`` picks triton for them.
"""

from __future__ import annotations

import importlib
from typing import Mapping, Optional

import torch
from torch import Tensor

from . import AttentionSpec, module_available
from .. import _buffers
from ..metadata import CPMetadata


def _import_fa4():
    return importlib.import_module("flash_attn.cute.interface")


class _FA4Run:
    """The planned varlen launch: per-segment descriptors uploaded once per forward."""

    def __init__(self, iface, spec: AttentionSpec, meta: CPMetadata) -> None:
        host = meta.host if meta.host is not None else meta
        s = meta.num_segments
        seg_row0 = host.seg_row0[:s].long()
        seg_len = host.seg_len[:s].long()
        seg_pos0 = host.seg_pos0[:s].long()
        seg_stride = host.seg_stride[:s].long()
        seg_seq = host.seg_seq[:s].long()
        i32 = torch.int32
        dev = _buffers.upload(meta, "fa4", {
            "cu_rows": torch.cat([seg_row0, torch.tensor([meta.num_local_tokens])]).to(i32),
            "key_start": torch.cat([host.cu_kv_lens[seg_seq], host.cu_kv_lens[-1:]]).to(i32),
            "keys_used": (seg_pos0 + (seg_len - 1) * seg_stride + 1).to(i32),
            "seg_seq": seg_seq,
        })
        self.iface, self.dev, self.num_segments = iface, dev, s
        self.num_local = meta.num_local_tokens
        self.max_seg_len, self.max_seg_keys = meta.max_seg_len, meta.max_seg_keys
        self.window_left = spec.window_left

    #: FA4 writes lse as [Hq, P]: plans allocate it that way and hand out the [P, Hq] view.
    lse_head_major = True

    def __call__(self, q, k, v, page_table, sinks, softmax_scale, out, lse) -> None:
        n = self.num_local
        out[n:].zero_()
        lse_t = None
        if lse is not None:
            lse[n:].fill_(float("-inf"))
            lse_t = lse.t() if lse.stride(0) == 1 else None  # FA4 writes [Hq, P]
        if self.num_segments == 0:
            return
        dev = self.dev
        if page_table is not None:
            table = page_table.index_select(0, dev["seg_seq"])
            if table.dtype != torch.int32:
                table = table.to(torch.int32)
            kv = dict(cu_seqlens_k=None, page_table=table)
        else:
            kv = dict(cu_seqlens_k=dev["key_start"], page_table=None)
        if sinks is not None and (sinks.dtype != torch.float32 or sinks.stride(0) != 1):
            sinks = sinks.float().contiguous()
        left = self.window_left if self.window_left >= 0 else None
        scratch = lse_t if lse_t is not None or lse is None else torch.empty(
            (q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
        self.iface._flash_attn_fwd(
            q, k, v, cu_seqlens_q=dev["cu_rows"], seqused_k=dev["keys_used"], max_seqlen_q=self.max_seg_len,
            max_seqlen_k=self.max_seg_keys, softmax_scale=softmax_scale, causal=True, window_size_left=left,
            window_size_right=0 if left is not None else None, learnable_sink=sinks, return_lse=lse is not None,
            out=out, lse=scratch, **kv,
        )
        if lse is not None and lse_t is None:
            lse[:n].copy_(scratch.t()[:n])


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

    def available(self) -> Optional[str]:
        if not module_available("flash_attn"):
            return "flash-attn-4 is not installed (pip install cpattn[fa4])"
        if not torch.cuda.is_available():
            return "fa4 needs a CUDA device"
        major = torch.cuda.get_device_capability()[0]
        if major not in (9, 10, 11):
            return f"fa4 backend is enabled for sm90/sm100 only, got sm{major}x"
        return None if self._interface() is not None else self._import_error

    def unsupported_reason(self, spec: AttentionSpec, meta: CPMetadata) -> Optional[str]:
        if spec.fp8_mma:
            return f"fa4 does not multiply in FP8 (mma_dtype={spec.mma_dtype})"
        if spec.kv_quantized:
            return f"fa4 does not read FP8 K/V caches (kv_dtype={spec.kv_dtype})"
        if meta.has_strided_segments:
            return (
                f"{meta.strategy} segments have stride > 1 (interleave): FA4 has no exact per-row "
                "causal mapping for them; use backend='triton'"
            )
        if meta.is_static:
            return "static plans need device-side sizes, but FA4 takes max_seqlen_q/k as host ints (not replayable)"
        if meta.device.type != "cuda":
            return "fa4 needs CUDA tensors"
        if spec.dtype not in (torch.bfloat16, torch.float16):
            return f"fa4 supports bf16/fp16, got {spec.dtype}"
        d, dv = spec.head_dim, spec.head_dim_v
        if not (8 <= d <= 256 and 8 <= dv <= 256 and d % 8 == 0 and dv % 8 == 0):
            return f"head dims (D={d}, Dv={dv}) outside FA4's sm90 range (8..256, multiples of 8)"
        return None

    def plan(self, spec: AttentionSpec, meta: CPMetadata, options: Mapping) -> _FA4Run:
        if options:
            raise ValueError(f"backend 'fa4' takes no backend_options, got {sorted(options)}")
        return _FA4Run(self._interface(), spec, meta)
