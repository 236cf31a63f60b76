"""``backend="triton"``: plans the launch and picks the kernel family.

Families: the warp-specialized Hopper kernel (:mod:`.triton_sm90`, Gluon) where it applies, else
the portable kernel (:mod:`.triton_attn`, any CUDA GPU, and CPU tensors under the Triton
interpreter: ``TRITON_INTERPRET=1`` set before triton is first imported). Both read the same
plan: a tile map of the placement plan's segments (pad segment included, so the kernels write
the pad rows), GQA head packing and L2 head sections, uploaded once per forward. The per-layer
call checks the K/V layout (TMA-compatible rows for the sm90 kernel), gathers strides and
launches: O(1) host work. Triton is imported lazily: ``import cpattn`` works without it.

``backend_options``: ``family`` ("auto", "portable", "sm90": "sm90" raises ValueError where it
cannot run), ``block_m`` (query rows x packed heads per program), ``config`` ((BLOCK_N,
num_warps, num_stages) of the portable kernel, bypassing the autotuner), ``sm90`` (a dict of
:data:`SM90_OPTIONS` overrides), ``planned_launch`` (default True: after the first call, launch
the compiled kernel directly, see :mod:`._launch`; False: every call through the JIT). ``CPATTN_TRITON_SM90=0`` in the environment (read at plan time)
makes "auto" use the portable kernel.
"""

from __future__ import annotations

import os
import sys
from typing import Mapping, Optional

import torch
from torch import Tensor

from . import AttentionSpec, module_available
from .. import _buffers
from ..metadata import CPMetadata
from ._tiles import gqa_packing, heads_per_l2_section, max_tiles, tile_map

_KERNEL_MODULE = "cpattn.kernels.triton_attn"

#: Tuning of the sm_90 kernel: key block, K/V stages, FA3-style overlap (0 off, 1 paired GEMMs,
#: 2 softmax under P V) and ping-pong between the two consumer warpgroups (none measured faster
#: on H200; docs/kernels.md has the numbers).
SM90_OPTIONS = {"block_n": 128, "stages": 3, "overlap": 0, "pingpong": False}

_OPTION_NAMES = {"family", "block_m", "config", "sm90", "planned_launch"}


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class _TritonRun:
    """A planned Triton launch (see the module docstring); called once per layer."""

    def __init__(self, spec: AttentionSpec, meta: CPMetadata, options: Mapping) -> None:
        from . import triton_attn, triton_sm90

        unknown = set(options) - _OPTION_NAMES
        if unknown:
            raise ValueError(f"unknown triton backend_options {sorted(unknown)} (known: {sorted(_OPTION_NAMES)})")
        d, dv, hq, hkv = spec.head_dim, spec.head_dim_v, spec.num_q_heads, spec.num_kv_heads
        family = options.get("family", "auto")
        if family not in ("auto", "portable", "sm90"):
            raise ValueError(f"backend_options family must be 'auto', 'portable' or 'sm90', got {family!r}")
        block_m = options.get("block_m") or triton_attn.default_block_m(d, dv)
        self.config = options.get("config")
        sm90_block = triton_sm90.NUM_CONSUMERS * triton_sm90.CONSUMER_ROWS
        reason = None if not triton_attn.INTERPRETED else "the CPU interpreter"
        reason = reason or triton_sm90.unsupported_reason(d, dv, spec.dtype, spec.paged, meta.device)
        if reason is None and block_m != sm90_block:
            reason = f"block_m={block_m} (the sm_90 kernel covers {sm90_block})"
        if reason is None and self.config is not None:
            reason = "a portable-kernel config was given"
        if family == "sm90" and reason is not None:
            raise ValueError(f"the sm_90 kernel cannot run this plan: {reason}")
        env_off = family == "auto" and os.environ.get("CPATTN_TRITON_SM90", "1") == "0"
        self.use_sm90 = family != "portable" and reason is None and not env_off
        self.sm90_options = {**SM90_OPTIONS, **dict(options.get("sm90", {}))}
        self.sm90_reason = reason

        g_pack, rows = gqa_packing(hq, hkv, block_m)
        tiles = tile_map(meta, rows, capacity=max_tiles(meta, rows) if meta.is_static else None)
        self.num_tiles = tiles.num_tiles
        dev = _buffers.upload(meta, ("triton-tiles", rows), {
            "segment": tiles.segment, "row_offset": tiles.row_offset,
            "num_tiles": torch.tensor([tiles.num_tiles], dtype=torch.int32),
        })
        num_head_groups = hq // g_pack
        self.grid = (tiles.segment.numel() * num_head_groups,)
        elem = torch.empty((), dtype=spec.dtype).element_size()
        section = heads_per_l2_section(meta.num_kv_rows, (d + dv) * elem, hq // hkv // g_pack, num_head_groups,
                                       meta.device)
        common = dict(
            tile_segment=dev["segment"], tile_row_offset=dev["row_offset"], NumTiles=dev["num_tiles"],
            seg_seq=meta.seg_seq, seg_row0=meta.seg_row0, seg_len=meta.seg_len, seg_pos0=meta.seg_pos0,
            seg_stride=meta.seg_stride, cu_kv_lens=meta.cu_kv_lens, window=spec.window_left,
            num_head_groups=num_head_groups, heads_per_section=section, group_size=hq // hkv, G_PACK=g_pack,
            HAS_WINDOW=spec.window_left >= 0,
        )
        d1, d2 = triton_attn.split_head_dim(d)
        self.portable_args = dict(
            common, HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_D1=d1, BLOCK_D2=d2, BLOCK_M=block_m,
            PAGED=spec.paged, PAGE_SIZE=spec.page_size or 1, **triton_attn.dot_settings(spec.dtype),
        )
        self.cu_kv_lens = meta.cu_kv_lens
        self._portable_launch = triton_attn.make_launch(self.portable_args, self.config)
        self._sm90_launch = triton_sm90.make_launch(common, d, dv, spec.dtype, **self.sm90_options) \
            if self.use_sm90 else None
        if not options.get("planned_launch", True):  # every call through the JIT (for comparison)
            for launcher in (self._portable_launch, self._sm90_launch):
                if launcher is not None:
                    launcher._enabled = False
        self._portable, self._sm90 = triton_attn.launch, triton_sm90.launch
        self._contiguous, self._layout_ok = triton_attn.last_dim_contiguous, triton_sm90.kv_layout_ok
        self.family = "sm90" if self.use_sm90 else "portable"

    def __call__(self, q, k, v, page_table, sinks, softmax_scale, out, lse) -> None:
        if not softmax_scale > 0:
            raise ValueError(f"softmax_scale must be > 0 for the triton kernels, got {softmax_scale}")
        k, v = self._contiguous(k, "k"), self._contiguous(v, "v")
        q = self._contiguous(q, "q")
        if page_table is not None and page_table.stride(-1) != 1:
            page_table = page_table.contiguous()
        if q.is_cuda and q.device.index != torch.cuda.current_device():
            with torch.cuda.device(q.device):  # tensors on a non-current GPU
                self._launch(q, k, v, page_table, sinks, softmax_scale, out, lse)
        else:
            self._launch(q, k, v, page_table, sinks, softmax_scale, out, lse)

    def _launch(self, q, k, v, page_table, sinks, softmax_scale, out, lse) -> None:
        if self.use_sm90 and self._layout_ok(k, v):
            self._sm90(self._sm90_launch, q, k, v, out, lse, sinks, grid=self.grid, softmax_scale=softmax_scale)
        else:
            self._portable(self._portable_launch, q, k, v, out, lse, sinks, page_table, self.cu_kv_lens,
                           grid=self.grid, softmax_scale=softmax_scale)


class TritonBackend:
    name = "triton"

    def available(self) -> Optional[str]:
        if not module_available("triton"):
            return "triton is not installed (pip install cpattn[triton])"
        if not torch.cuda.is_available() and not _interpret_env():
            return "no CUDA device (CPU tensors need TRITON_INTERPRET=1, the Triton interpreter)"
        return None

    def unsupported_reason(self, spec: AttentionSpec, meta: CPMetadata) -> Optional[str]:
        loaded = sys.modules.get(_KERNEL_MODULE)
        device = meta.device
        if device.type == "cuda":
            if loaded is not None and loaded.INTERPRETED:
                return "the triton kernel was built for the CPU interpreter in this process"
        elif device.type == "cpu":
            if not _interpret_env():
                return "CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter)"
            if loaded is not None and not loaded.INTERPRETED:
                return "the triton kernel was built for the GPU in this process (TRITON_INTERPRET set too late)"
        else:
            return f"device {device} not supported"
        from .triton_attn import shape_unsupported_reason

        reason = shape_unsupported_reason(spec.head_dim, spec.head_dim_v, spec.dtype)
        if reason is None and spec.dtype == torch.float32 and device.type == "cuda":
            reason = "fp32 runs only under the interpreter (use bf16/fp16 on the GPU)"
        return reason

    def plan(self, spec: AttentionSpec, meta: CPMetadata, options: Mapping) -> _TritonRun:
        return _TritonRun(spec, meta, options)
