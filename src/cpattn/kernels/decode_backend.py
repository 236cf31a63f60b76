"""``backend="triton"`` for shard plans: split-KV work items, split sizes and launch configs.

Planned once per step (host, O(B + query rows), one upload): the query tiles of every sequence
(``ROWS`` rows each), each tile's local key range (window and causal bound by global position),
a split size that spreads the batch's keys over about ``programs_per_sm x SMs`` programs (so one
128k-key sequence runs on hundreds of programs, not on 8), the work items (tile, split), the
workspace slot of every multi-split item, and per query row where the combine finds its splits.
The per-layer call launches the split kernel (and the combine kernel when some tile has more
than one split): O(1) host work. For static decode plans every table is capacity-sized in fixed
buffers and the split size is chosen so the item count stays within the grid:
``items <= target + tiles`` because ``split >= total keys / target``.

``backend_options``: ``family`` (:data:`FAMILIES`: "auto" runs absorbed MLA (D 576 / Dv 512, one
latent head, no window) on the Hopper MLA kernel's split-KV mode on sm_90, everything else on the
Triton split kernel; "portable" forces the Triton kernel; "mla" raises ValueError where it cannot
run), ``pair`` (default True: the MLA kernel merges tiles of two splits itself, see
:class:`_MlaSplit`; False: the combine kernel always), ``pdl`` (default True: on CUDA devices
of compute capability >= 9.0 the combine is a programmatic dependent launch, started while the
split kernel runs and waiting inside for its end; False: ordinary launches), ``config``
((BLOCK_N, num_warps, num_stages)), ``block_m`` (most query rows x heads per program: 16, 32,
64 or 128; default 64, 32 for head dims > 256), ``min_split`` (fewest keys per split, a
multiple of the key alignment), ``programs_per_sm`` (split target; default 12, 1 for the
MLA kernel), ``num_sms`` (override the device's SM count; e.g. to force splits in tests). Where
``config``, ``block_m``, ``min_split`` or ``programs_per_sm`` is not given, the portable kernel
takes it from the :class:`SplitDefaults` of the plan's cache kind (:func:`split_defaults`:
:data:`BF16_DEFAULTS` for bf16 / fp16 / fp32 caches, :data:`FP8_DEFAULTS` for FP8 ones). The
split, combine (and MLA) kernels are planned launches: after the first call the compiled kernel
is called directly (:mod:`._launch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np
import torch

from . import AttentionSpec, triton_available, triton_unsupported_reason
from .. import _buffers
from ..kv_sharding import local_key_counts
from ._launch import LaunchState

_KERNEL_MODULE = "cpattn.kernels.triton_decode"
_OPTION_NAMES = {"config", "block_m", "min_split", "programs_per_sm", "num_sms", "family", "pair", "pdl"}
#: Kernel families of shard plans ("auto": the absorbed-MLA Hopper kernel where it applies,
#: else the portable split-KV kernel).
FAMILIES = ("auto", "portable", "mla")
#: Split target of the absorbed-MLA kernel, per SM: one 225 KiB program fits an SM, so 1 gives
#: one wave of long programs (measured on H200 against 2 and 4: B = 64
#: L = 4k q1 434 vs 354 TF/s, B = 8 L = 32k q1 395 vs 373, graph replay; fewer partials to combine).
MLA_PROGRAMS_PER_SM = 1

#: Split starts are multiples of this many keys (every BLOCK_N up to it divides it; a wider
#: BLOCK_N, a multiple of it, takes its place); on the GPU also the granularity of split sizes.
KEY_ALIGN = 128
KEY_ALIGN_INTERPRETED = 16
#: Programs the split target aims for, per SM: 12 splits the batch into equal programs whose
#: count fills whole waves for 1, 2, 3, 4 or 6 resident programs per SM (the tail wave of a
#: 1.3-wave grid would idle two thirds of the GPU); the partials stay a few MB.
PROGRAMS_PER_SM = 12
#: Fewest keys per split (smaller splits cost more combine traffic than they save).
MIN_SPLIT = 256


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@dataclass(frozen=True)
class SplitDefaults:
    """Launch defaults of the portable split kernel for one kind of KV cache, used where
    ``backend_options`` give none. ``config_*``: (BLOCK_N, num_warps, num_stages) by the widest
    head dim (D or Dv: <= 128, <= 256, wider); ``block_m_wide``: the most query rows x heads per
    program for head dims > 256 (narrower head dims: 64); ``programs_per_sm`` and ``min_split``:
    the split policy (the split target in programs per SM and the fewest keys per split, a
    multiple of :data:`KEY_ALIGN`). The CPU interpreter runs (16, 4, 1) and its own split sizes."""

    config_d128: tuple[int, int, int]
    config_d256: tuple[int, int, int]
    config_wide: tuple[int, int, int]
    block_m_wide: int = 32
    programs_per_sm: int = PROGRAMS_PER_SM
    min_split: int = MIN_SPLIT

    def config(self, head_dim: int, head_dim_v: int) -> tuple[int, int, int]:
        """(BLOCK_N, num_warps, num_stages) for head dims ``head_dim`` / ``head_dim_v``."""
        width = max(head_dim, head_dim_v)
        if width <= 128:
            return self.config_d128
        if width <= 256:
            return self.config_d256
        return self.config_wide


#: bf16 / fp16 / fp32 caches (2- and 4-byte rows).
BF16_DEFAULTS = SplitDefaults(config_d128=(64, 4, 3), config_d256=(64, 8, 2), config_wide=(32, 8, 2))
#: FP8 caches (e4m3 K/V with per-tensor or per-KV-head scales, and the tile-scaled MLA latent):
#: 1-byte rows, so a block of BLOCK_N keys moves half the bytes of a bf16 block. Measured on an
#: H100 (GQA 32/8 D128, 32k keys, graph replay; fraction of the device copy rate): of 16 configs
#: (BLOCK_N 32-256, 4 / 8 warps, 2-4 stages) x 12 / 24 programs per SM, (64, 4, 3) is the fastest
#: config at both B = 8 and 64 (0.70 / 0.77 at 12 per SM; the next config 0.67 / 0.71, BLOCK_N
#: 128: 0.57 / 0.67), and 24 programs per SM add 2-3% (0.72 / 0.79).
FP8_DEFAULTS = SplitDefaults(config_d128=(64, 4, 3), config_d256=(64, 8, 2), config_wide=(32, 8, 2),
                             programs_per_sm=24)


def split_defaults(kv_quantized: bool) -> SplitDefaults:
    """The :class:`SplitDefaults` of a cache kind: FP8 (``AttentionSpec.kv_quantized``) or not."""
    return FP8_DEFAULTS if kv_quantized else BF16_DEFAULTS


def tile_geometry(num_q_heads: int, num_kv_heads: int, head_dim: int, q_len: int, interpreted: bool,
                  block_m: Optional[int] = None, kv_quantized: bool = False):
    """(ROWS, G_PACK, BLOCK_M): query rows per tile, query heads packed per program, M size.
    ``block_m``: the most M rows per program (default 64; for head dims > 256, where a
    [64, Dv] accumulator would not fit the registers next to the Q tile, the cache kind's
    :attr:`SplitDefaults.block_m_wide`: 32 for bf16)."""
    group = num_q_heads // num_kv_heads
    m_max = block_m or (split_defaults(kv_quantized).block_m_wide if head_dim > 256 else 64)
    g_pack = 1
    while group % (g_pack * 2) == 0 and g_pack * 2 <= m_max:
        g_pack *= 2
    rows = min(_next_pow2(max(1, q_len)), max(1, m_max // g_pack))
    return rows, g_pack, max(16, rows * g_pack)


def default_config(head_dim: int, head_dim_v: int, interpreted: bool,
                   kv_quantized: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) without an explicit config, for a bf16 / fp16 / fp32
    cache or (``kv_quantized``) an FP8 one."""
    if interpreted:
        return 16, 4, 1
    return split_defaults(kv_quantized).config(head_dim, head_dim_v)


def plan_work(host, spec: AttentionSpec, *, rows: int, num_head_groups: int, align: int, num_sms: int,
              programs_per_sm: int, min_split: int, capacity=None, fit_target: bool = False) -> dict:
    """Work items, workspace slots and combine tables of a decode plan (host tensors + ints).

    ``capacity``: a static plan's :class:`Capacity`: tables sized for it (static plans). ``fit_target``: grow the
    split (in ``align`` steps) until the items fit the split target (per-sequence rounding can
    exceed it by up to one item per tile: 136 items for a 132-item target at B = 8 would start a
    third, nearly empty wave of one-program-per-SM kernels). Returns a dict with the
    int32 tensors ``item_seq, item_r0, item_k0, item_k1, item_ws, num_items, row_ws0,
    row_nsplit, row_ti`` and host ints ``num_items_host``, ``num_ws``, ``grid_items``,
    ``split``, ``max_splits`` (most splits of one tile).
    """
    sh, rank = host.kv, host.rank
    c, inter = sh.cp_size, sh.interleave
    # numpy on the host: ~1 us per op on [B]-sized arrays where a torch op costs several
    ql, sl = host.extend_lens.numpy(), host.kv_lens.numpy()
    b = ql.size

    n_tiles = (ql + rows - 1) // rows
    num_tiles = int(n_tiles.sum())
    tile_seq = np.repeat(np.arange(b), n_tiles)
    first_tile = np.cumsum(n_tiles) - n_tiles
    tile_r0 = (np.arange(num_tiles) - first_tile[tile_seq]) * rows
    pos0 = (sl - ql)[tile_seq] + tile_r0
    pos_last = pos0 + np.minimum(ql[tile_seq] - tile_r0, rows) - 1
    key_hi = local_key_counts(pos_last + 1, rank, c, inter)
    if spec.window_left >= 0:
        key_lo = local_key_counts(np.maximum(pos0 - spec.window_left, 0), rank, c, inter)
    else:
        key_lo = np.zeros_like(key_hi)
    lo_al = (key_lo // align) * align
    span = np.maximum(key_hi - lo_al, 0)

    target = max(1, num_sms * programs_per_sm // max(1, num_head_groups))
    total = int(span.sum())
    split = max(min_split, -(-total // target))
    split = -(-split // align) * align
    n_split = np.maximum((span + split - 1) // split, 1)
    num_items = int(n_split.sum())
    limit = max(target, num_tiles)
    for _ in range(256 if fit_target else 0):  # O(B) each; a few steps in practice
        if num_items <= limit:
            break
        split += align
        n_split = np.maximum((span + split - 1) // split, 1)
        num_items = int(n_split.sum())
    item_tile = np.repeat(np.arange(num_tiles), n_split)
    first_item = np.cumsum(n_split) - n_split
    s = np.arange(num_items) - first_item[item_tile]
    k0 = lo_al[item_tile] + s * split
    k1 = np.minimum(k0 + split, key_hi[item_tile])
    multi_tile = n_split > 1
    multi_item = multi_tile[item_tile]
    item_ws = np.where(multi_item, np.cumsum(multi_item) - 1, -1)
    num_ws = int(multi_item.sum())

    # per query row: its tile, row in the tile, and where its splits are
    nq = host.num_local_tokens
    row_seq = host.row_seq.numpy().astype(np.int64)
    row_in_seq = np.arange(nq) - host.cu_extend_lens.numpy()[row_seq]
    row_tile = first_tile[row_seq] + row_in_seq // rows
    row_ti = row_in_seq % rows
    tile_ws0 = np.where(multi_tile, item_ws[first_item], 0) if num_tiles else first_item
    row_ws0 = tile_ws0[row_tile]
    row_nsplit = n_split[row_tile]

    if capacity is not None:
        cap_tiles = capacity.max_seqs * -(-capacity.query_tile // rows)
        grid_items = target + cap_tiles
        if num_items > grid_items:  # cannot happen: split >= total / target
            raise AssertionError(f"{num_items} work items > the planned grid of {grid_items}")
        ws_cap = grid_items
        rows_cap = capacity.max_local_tokens
    else:
        # pad rows (pad_multiple > 1) get table entries with no split: the combine writes 0 / -inf
        grid_items, ws_cap, rows_cap = num_items, num_ws, host.num_physical_tokens

    def pad(x, size, fill):
        out = np.full(size, fill, dtype=np.int32)
        out[: x.size] = x
        return torch.from_numpy(out)

    return dict(
        item_seq=pad(tile_seq[item_tile], grid_items, 0), item_r0=pad(tile_r0[item_tile], grid_items, 0),
        item_k0=pad(k0, grid_items, 0), item_k1=pad(k1, grid_items, 0), item_ws=pad(item_ws, grid_items, -1),
        num_items=torch.tensor([num_items], dtype=torch.int32),
        row_ws0=pad(row_ws0, rows_cap, 0), row_nsplit=pad(row_nsplit, rows_cap, 0), row_ti=pad(row_ti, rows_cap, 0),
        num_items_host=num_items, num_ws=num_ws, max_splits=int(n_split.max()) if num_tiles else 0, ws_cap=ws_cap,
        grid_items=grid_items, split=split,
    )


class _TritonShardRun:
    """A planned split-KV launch over one rank's key shard (see the module docstring)."""

    def __init__(self, spec: AttentionSpec, dmeta, options: Mapping) -> None:
        from . import triton_attn, triton_decode

        unknown = set(options) - _OPTION_NAMES
        if unknown:
            raise ValueError(f"unknown triton shard backend_options {sorted(unknown)} (known: {sorted(_OPTION_NAMES)})")
        interpreted = triton_decode.INTERPRETED
        host = dmeta.host if dmeta.host is not None else dmeta
        hq, hkv, d, dv = spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.head_dim_v
        block_m_opt = options.get("block_m")
        if block_m_opt is not None and block_m_opt not in (16, 32, 64, 128):
            raise ValueError(f"backend_options block_m must be 16, 32, 64 or 128, got {block_m_opt!r}")
        defaults = split_defaults(spec.kv_quantized)
        rows, g_pack, block_m = tile_geometry(hq, hkv, d, dmeta.tile_q_len, interpreted, block_m_opt,
                                              spec.kv_quantized)
        self.config = tuple(options.get("config") or default_config(d, dv, interpreted, spec.kv_quantized))
        if len(self.config) != 3 or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in self.config):
            raise ValueError(f"backend_options config must be (BLOCK_N, num_warps, num_stages) ints, got {self.config}")
        align = KEY_ALIGN_INTERPRETED if interpreted else KEY_ALIGN
        if self.config[0] & (self.config[0] - 1):
            raise ValueError(f"backend_options config BLOCK_N must be a power of two, got {self.config[0]}")
        if self.config[0] > align:
            align = self.config[0]  # blocks wider than the key alignment: split starts on block bounds
        if align % self.config[0]:
            raise ValueError(f"config BLOCK_N={self.config[0]} must divide the key alignment {align}")
        min_split = options.get("min_split", align if interpreted else defaults.min_split)
        if isinstance(min_split, bool) or not isinstance(min_split, int) or min_split < 1 or min_split % align:
            raise ValueError(f"backend_options min_split must be a positive multiple of {align}, got {min_split!r}")
        num_sms = options.get("num_sms")
        if num_sms is None:
            num_sms = (torch.cuda.get_device_properties(dmeta.device).multi_processor_count
                       if dmeta.device.type == "cuda" else 4)
        programs_per_sm = options.get("programs_per_sm", defaults.programs_per_sm)
        for name, value in (("num_sms", num_sms), ("programs_per_sm", programs_per_sm)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"backend_options {name} must be an int >= 1, got {value!r}")
        family = options.get("family", "auto")
        if family not in FAMILIES:
            raise ValueError(f"backend_options family must be one of {FAMILIES}, got {family!r}")
        pair = options.get("pair", True)
        if not isinstance(pair, bool):
            raise ValueError(f"backend_options pair must be a bool, got {pair!r}")
        pdl = options.get("pdl", True)
        if not isinstance(pdl, bool):
            raise ValueError(f"backend_options pdl must be a bool, got {pdl!r}")
        #: programmatic dependent launch between the split kernel and the combine
        self.pdl = pdl and triton_decode.pdl_capable(dmeta.device)
        mla_reason = mla_unsupported_reason(spec, dmeta, interpreted, options)
        if family == "mla" and mla_reason is not None:
            raise ValueError(f"the mla kernel cannot run this shard plan: {mla_reason}")
        #: the absorbed-MLA split-KV launch (None: the portable kernel runs every call)
        self._mla = None
        if family != "portable" and mla_reason is None:
            self._mla = _MlaSplit(spec, dmeta, host, num_sms=num_sms, min_split=min_split,
                                  programs_per_sm=options.get("programs_per_sm", MLA_PROGRAMS_PER_SM), pair=pair,
                                  pdl=self.pdl)
        num_head_groups = hq // g_pack
        work = plan_work(host, spec, rows=rows, num_head_groups=num_head_groups, align=align, num_sms=num_sms,
                         programs_per_sm=programs_per_sm, min_split=min_split, capacity=dmeta.capacity)
        self.split, self.num_items, self.num_ws = work["split"], work["num_items_host"], work["num_ws"]
        key = ("shard-work", rows, g_pack, num_head_groups, spec.window_left, num_sms, programs_per_sm, min_split,
               align)
        dev = _buffers.upload(dmeta, key, {name: work[name] for name in (
            "item_seq", "item_r0", "item_k0", "item_k1", "item_ws", "num_items", "row_ws0", "row_nsplit", "row_ti")})
        self.grid = (work["grid_items"] * num_head_groups,)
        self.static = dmeta.is_static
        pad_rows = dmeta.num_physical_tokens > dmeta.num_local_tokens  # written by the combine
        self.run_combine = self.static or self.num_ws > 0 or pad_rows
        self.ws_shape = (max(1, work["ws_cap"]), rows, hq, dv)  # never a null pointer
        # combine: (row, head block, column block) programs reading splits in chunks; a static
        # plan's geometry depends on its capacity only (the captured grid replays every step)
        max_splits = work["grid_items"] if self.static else work["max_splits"]
        block_s, block_h, block_dv = triton_decode.merge_blocks(max_splits, hq, dv, dmeta.num_physical_tokens,
                                                                num_sms)
        self.combine_grid = (dmeta.num_physical_tokens, -(-hq // block_h), -(-dv // block_dv))
        apply_sinks = spec.has_sinks and dmeta.rank == 0  # counted once: on rank 0 only
        d1, d2 = triton_attn.split_head_dim(d)
        self.d1 = d1
        self.plan_args = dict(
            item_seq=dev["item_seq"], item_r0=dev["item_r0"], item_k0=dev["item_k0"], item_k1=dev["item_k1"],
            item_ws=dev["item_ws"], NumItems=dev["num_items"], q_lens=dmeta.extend_lens, seq_lens=dmeta.kv_lens,
            cu_q_lens=dmeta.cu_extend_lens, cu_local_kv=dmeta.cu_local_kv_lens, window=spec.window_left, rank=dmeta.rank,
            num_head_groups=num_head_groups, group_size=hq // hkv, HEAD_DIM_V=dv, BLOCK_D1=d1, BLOCK_D2=d2,
            ROWS=rows, G_PACK=g_pack, BLOCK_M=block_m, CP_SIZE=dmeta.cp_size, INTERLEAVE=dmeta.kv.interleave,
            PAGE_SIZE=spec.page_size or 1, HAS_WINDOW=spec.window_left >= 0, HAS_SINKS=apply_sinks,
            PDL=self.pdl, **triton_attn.dot_settings(spec.dtype),
        )
        # always given (a planned launch records only kernels whose every argument it knows);
        # False compiles the FP8 branches away: the kernel of a bf16 plan is unchanged
        self.plan_args["KV_FP8"] = spec.kv_quantized and not spec.kv_tiled
        self.plan_args["KV_TILE"] = spec.kv_tiled  # tile-scaled latent rows: k is v, scales in the rows
        self.tiled = spec.kv_tiled
        self.combine_args = dict(row_ws0=dev["row_ws0"], row_nsplit=dev["row_nsplit"], row_ti=dev["row_ti"],
                                 HEAD_DIM_V=dv, BLOCK_H=block_h, BLOCK_S=block_s, BLOCK_DV=block_dv,
                                 HAS_SINKS=apply_sinks, ONE_PASS=max_splits <= block_s,
                                 num_warps=triton_decode.merge_warps((block_s, block_h, block_dv), 4),
                                 **triton_decode.pdl_launch(self.pdl))
        self.sinks_used = apply_sinks
        self._split, self._combine = triton_decode.launch_split, triton_decode.launch_combine
        #: planned launches of the split / combine kernels (direct calls after the first)
        self._state = LaunchState()
        self.family = "mla-split-kv" if self._mla is not None else "split-kv"
        #: the split partials' workspace, allocated now (fixed address for static plans; a CUDA
        #: graph never allocates it); with the MLA kernel, its workspace and the portable
        #: fallback's are views of one buffer (one plan's calls run one after another)
        if self._mla is None:
            (self._ws,) = workspaces(dmeta, ("shard-ws", key), [self.ws_shape])
        else:  # what runs (the portable plan stays as the per-call fallback)
            self._ws, self._mla.ws = workspaces(dmeta, ("shard-ws", key), [self.ws_shape, self._mla.ws_shape])
            self.split, self.num_items, self.num_ws = self._mla.split, self._mla.num_items, self._mla.num_ws

    def __call__(self, q, k, v, page_table, sinks, softmax_scale, out, lse, k_scale=None, v_scale=None) -> None:
        if not softmax_scale > 0:
            raise ValueError(f"softmax_scale must be > 0 for the triton kernels, got {softmax_scale}")
        if self.grid[0] == 0 and not self.run_combine:
            return
        if q.stride(-1) != 1:
            q = q.contiguous()
        if page_table is not None and page_table.stride(-1) != 1:
            page_table = page_table.contiguous()
        v_from_k = self.tiled or (v.data_ptr() == k.data_ptr() and v.stride() == k.stride()
                                  and v.shape[-1] == self.d1 and v.dtype == k.dtype)
        if k.stride(-1) != 1:
            k = k.contiguous()
        if not v_from_k and v.stride(-1) != 1:
            v = v.contiguous()
        sinks = sinks if self.sinks_used else None
        if q.is_cuda and q.device.index != torch.cuda.current_device():
            with torch.cuda.device(q.device):  # tensors on a non-current GPU
                self._launch(q, k, v, page_table, sinks, softmax_scale, out, lse, v_from_k, k_scale, v_scale)
        else:
            self._launch(q, k, v, page_table, sinks, softmax_scale, out, lse, v_from_k, k_scale, v_scale)

    def _launch(self, q, k, v, page_table, sinks, softmax_scale, out, lse, v_from_k, k_scale, v_scale) -> None:
        if self._mla is not None and self._mla(q, k, v, page_table, sinks, softmax_scale, out, lse, self._combine):
            return
        ws = self._ws
        if self.grid[0]:
            self._split(q, k, v, out, lse, sinks, page_table, ws, grid=self.grid, plan_args=self.plan_args,
                        softmax_scale=softmax_scale, v_from_k=v_from_k, config=self.config, state=self._state,
                        k_scale=k_scale, v_scale=v_scale)
        if self.run_combine and self.combine_grid[0]:
            self._combine(out, lse, sinks, ws, grid=self.combine_grid, combine_args=self.combine_args,
                          state=self._state)


def workspaces(dmeta, key, shapes: list[tuple[int, int, int, int]]) -> list:
    """Split-KV :class:`~.triton_decode.Workspace` s of ``shapes`` (slots, rows, Hq, Dv) for one
    plan, allocated at plan time as views of one partials buffer and one LSE buffer (the plan's
    launches use them one after another; static plans: the planner's fixed-address scratch, the
    same tensors every step)."""
    from . import triton_decode

    o_n = max(int(np.prod(s)) for s in shapes)
    l_n = max(int(np.prod(s[:3])) for s in shapes)
    o = _buffers.scratch(dmeta, key + ("o", o_n), (o_n,), torch.float32)
    lse = _buffers.scratch(dmeta, key + ("lse", l_n), (l_n,), torch.float32)
    return [triton_decode.Workspace(o[: int(np.prod(s))].view(s), lse[: int(np.prod(s[:3]))].view(s[:3]))
            for s in shapes]


def mla_unsupported_reason(spec: AttentionSpec, dmeta, interpreted: bool, options: Mapping) -> Optional[str]:
    """Why the absorbed-MLA Hopper kernel cannot take this shard plan (None if it can)."""
    from . import triton_mla

    if interpreted:
        return "the CPU interpreter"
    if spec.kv_quantized:
        return f"an FP8 cache (kv_dtype={spec.kv_dtype}): the split-KV kernel dequantizes it"
    if spec.window_left >= 0:
        return "a sliding window (the local window bound is not a fixed key offset)"
    if options.get("config") is not None or options.get("block_m") is not None:
        return "a portable-kernel config / block_m was given"
    return triton_mla.unsupported_reason(spec.head_dim, spec.head_dim_v, spec.num_kv_heads, spec.dtype,
                                         spec.page_size, dmeta.device)


class _MlaSplit:
    """The shard plan's work on the absorbed-MLA Hopper kernel (:func:`.triton_mla.launch_decode`):
    64-row tiles of (query row, head), ``G_PACK`` heads each (64 for 128 heads: one query row per
    tile, two head groups reading the same latent blocks back to back), split-KV work items of
    :func:`plan_work`, and the decode family's combine kernel for multi-split tiles (``pdl``: a
    programmatic dependent launch; the caller checked the device), or (``pair``: no tile has more
    than two splits, not static) their merge inside the kernel."""

    def __init__(self, spec: AttentionSpec, dmeta, host, *, num_sms: int, min_split: int, programs_per_sm: int,
                 pair: bool = True, pdl: bool = False):
        from . import triton_decode, triton_mla

        hq = spec.num_q_heads
        g_pack = 1  # heads fill M first: 64 of 128 heads x 1 row, 16 heads x 4 rows
        while hq % (g_pack * 2) == 0 and g_pack * 2 <= triton_mla.BLOCK_M:
            g_pack *= 2
        rows = triton_mla.BLOCK_M // g_pack
        self.num_head_groups = hq // g_pack
        work = plan_work(host, spec, rows=rows, num_head_groups=self.num_head_groups, align=KEY_ALIGN,
                         num_sms=num_sms, programs_per_sm=programs_per_sm, min_split=max(min_split, KEY_ALIGN),
                         capacity=dmeta.capacity, fit_target=True)
        self.split, self.num_items, self.num_ws = work["split"], work["num_items_host"], work["num_ws"]
        key = ("mla-shard-work", rows, g_pack, num_sms, programs_per_sm, min_split)
        dev = _buffers.upload(dmeta, key, {name: work[name] for name in (
            "item_seq", "item_r0", "item_k0", "item_k1", "item_ws", "num_items", "row_ws0", "row_nsplit", "row_ti")})
        self.grid = (work["grid_items"] * self.num_head_groups,)
        #: pair mode: every multi-split tile has two splits, merged inside the kernel by the second
        #: to finish (no combine launch); not for static plans, whose split counts vary by step
        pad_rows = dmeta.num_physical_tokens > dmeta.num_local_tokens  # written by the combine
        self.pair = pair and not dmeta.is_static and not pad_rows and work["max_splits"] == 2
        self.run_combine = not self.pair and (dmeta.is_static or self.num_ws > 0 or pad_rows)
        dv = spec.head_dim_v
        self.ws_shape = (max(1, work["ws_cap"]), rows, hq, dv)
        # the pair counters (zero; each merge resets its own) and warpgroup 1's copy of the split LSEs
        # (without pair mode the kernel never reads them: a plan tensor stands in)
        pair_sem = pair_lse = dev["item_ws"]
        if self.pair:
            pair_sem = torch.zeros(self.num_ws * self.num_head_groups, dtype=torch.int32, device=dmeta.device)
            pair_lse = torch.empty(self.ws_shape[:3], dtype=torch.float32, device=dmeta.device)
        max_splits = work["grid_items"] if dmeta.is_static else work["max_splits"]
        block_s, block_h, block_dv = triton_decode.merge_blocks(max_splits, hq, dv, dmeta.num_physical_tokens,
                                                                num_sms)
        self.combine_grid = (dmeta.num_physical_tokens, -(-hq // block_h), -(-dv // block_dv))
        apply_sinks = spec.has_sinks and dmeta.rank == 0
        self.plan_args = dict(
            item_seq=dev["item_seq"], item_r0=dev["item_r0"], item_k0=dev["item_k0"], item_k1=dev["item_k1"],
            item_ws=dev["item_ws"], NumItems=dev["num_items"], q_lens=dmeta.extend_lens, seq_lens=dmeta.kv_lens,
            cu_q_lens=dmeta.cu_extend_lens, cu_local_kv=dmeta.cu_local_kv_lens, rank=dmeta.rank,
            num_head_groups=self.num_head_groups, G_PACK=g_pack, CP_SIZE=dmeta.cp_size,
            INTERLEAVE=dmeta.kv.interleave, PairSem=pair_sem, PairLse=pair_lse, PAIR=self.pair,
            PDL=pdl and self.run_combine,  # the combine starts while the split kernel runs (waits inside)
        )
        self.combine_args = dict(row_ws0=dev["row_ws0"], row_nsplit=dev["row_nsplit"], row_ti=dev["row_ti"],
                                 HEAD_DIM_V=dv, BLOCK_H=block_h, BLOCK_S=block_s, BLOCK_DV=block_dv,
                                 HAS_SINKS=apply_sinks, ONE_PASS=max_splits <= block_s,
                                 num_warps=triton_decode.merge_warps((block_s, block_h, block_dv), 4),
                                 **triton_decode.pdl_launch(pdl))
        #: its workspace (set by the owning plan: shared with the portable fallback's)
        self.ws = None
        self._launch = triton_mla.launch_decode
        self._state = LaunchState()

    def __call__(self, q, k, v, page_table, sinks, softmax_scale, out, lse, combine) -> bool:
        """Run the step; False (nothing launched) when ``k`` / ``v`` is not the kernel's layout."""
        ws = self.ws
        if self.grid[0] and not self._launch(q, k, v, out, lse, sinks, page_table, ws, grid=self.grid,
                                             plan_args=self.plan_args, softmax_scale=softmax_scale,
                                             state=self._state):
            return False
        if self.run_combine and self.combine_grid[0]:
            combine(out, lse, sinks, ws, grid=self.combine_grid, combine_args=self.combine_args, state=self._state)
        return True


class TritonShardBackend:
    name = "triton"

    def available(self) -> Optional[str]:
        return triton_available()

    def unsupported_reason(self, spec: AttentionSpec, dmeta) -> Optional[str]:
        return triton_unsupported_reason(spec, dmeta.device, _KERNEL_MODULE, fp8=True, tiled=True)

    def plan(self, spec: AttentionSpec, dmeta, options: Mapping) -> _TritonShardRun:
        return _TritonShardRun(spec, dmeta, options)
