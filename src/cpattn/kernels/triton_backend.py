"""``backend="triton"``: plans the launch and picks the kernel family.

Families: on sm_90 the warp-specialized Hopper kernels (Gluon) where they apply: the
absorbed-MLA kernel (:mod:`.triton_mla`: one latent KV head, D = 576, Dv = 512, ``v`` a view of
``k[..., :512]``) and the dense kernel (:mod:`.triton_sm90`: (D, Dv) in (64, 64), (128, 128),
(192, 128)), packed or paged; else the portable kernel (:mod:`.triton_attn`, any CUDA GPU, and
CPU tensors under the Triton interpreter: ``TRITON_INTERPRET=1`` set before triton is first
imported). All read the same plan: a tile map of the placement plan's segments (pad segment
included, so the kernels write the pad rows; ordered by L2 sequence groups, heaviest first in a
group), GQA head packing and L2 head sections, uploaded once per forward. The family is chosen
at plan time; the per-layer call only checks the K/V layout (TMA-compatible rows, ``v``
aliasing ``k`` for MLA: O(1)), falling back to the portable kernel for that call when it does
not hold, gathers strides and launches: O(1) host work.
Triton is imported lazily: ``import cpattn`` works without it.

``backend_options``: ``family`` (:data:`FAMILIES`; "sm90" / "mla" raise ValueError where they
cannot run), ``block_m`` (query rows x packed heads per program), ``config`` ((BLOCK_N,
num_warps, num_stages) of the portable kernel, bypassing the autotuner), ``sm90`` (a dict of
:data:`SM90_OPTIONS` overrides for the dense Hopper kernel), ``planned_launch`` (default True:
after a plan's first call, launch the compiled kernel directly, see :mod:`._launch`; False:
every call through the JIT), ``decode`` (a dict of :data:`DECODE_OPTIONS` for decode-shaped
plans run by the split-KV family: ``programs_per_sm``, ``min_split``, ``num_sms``, ``family``,
``pair``, ``pdl`` as in :mod:`.decode_backend`). ``CPATTN_TRITON_SM90=0`` in the environment
(read at plan time) makes "auto" use the portable kernel.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

import torch
from torch import Tensor

from . import AttentionSpec, triton_available, triton_unsupported_reason
from .. import _buffers
from ..metadata import CPMetadata
from ._tiles import gqa_packing, heads_per_l2_section, l2_group_keys, max_tiles, section_schedule_loss, tile_map

_KERNEL_MODULE = "cpattn.kernels.triton_attn"

#: Tuning of the sm_90 kernel: key block, K/V stages, FA3-style overlap (0 off, 1 paired GEMMs,
#: 2 softmax under P V, "auto" = :func:`use_overlap`) and ping-pong between the two consumer
#: warpgroups (with overlap, not with persistent programs; "auto" = :func:`use_pingpong`),
#: persistent programs (one per SM walking every work item: True, False, or "auto" =
#: :func:`use_persistent`), L2 head sections (True: as ``heads_per_l2_section`` plans them,
#: False: one section, "auto": :func:`use_sections`).
SM90_OPTIONS = {"block_n": 128, "stages": 3, "overlap": "auto", "pingpong": "auto", "persistent": "auto",
                "sections": "auto"}

#: ``overlap="auto"`` runs ``overlap=2`` at these (head_dim, head_dim_v) and 0 elsewhere. H200,
#: 2026-12-02, sustained timing, two interleaved repeats: D128 zigzag +2-7% at 16k, -0.5 to +4% at 64k / 128k, paged16 +5-6%,
#: interleave 16k -1 / +10%, persistent short batches +1-3%; D64 -2 to +1% but for 16k C = 4
#: (+6-10%). D192 / 128 was -9 to -20% with one release per stage; with K and V released
#: separately (0.3.8) +1 to +7% at 16k / 64k C = 1..8. The cp.async
#: gather on a 2-stage ring runs 0 regardless (``triton_sm90.ring_overlap``). Not with a
#: sliding window: none was measured, and with ``HAS_WINDOW`` the one-program-per-item
#: ``overlap=2`` builds spill (offline ptxas, ``tools/sm90_overlap_spills.py``: 8 bytes packed
#: with sinks, 40-80 bytes at page 16, 288-304 at page 1), where ``overlap=0`` spills nothing
#: packed or at page 16 and 48 bytes at page 1.
OVERLAP_HEAD_DIMS = ((128, 128), (192, 128))

#: ``pingpong="auto"`` makes the two consumer warpgroups take turns issuing their GEMMs at these
#: (head_dim, head_dim_v), with ``overlap`` on and one program per work item (FA3 / FA4 do so at
#: D <= 128). H200, 2026-12-02, sustained timing, two interleaved repeats (named-barrier
#: turns): D128 zigzag 16k / 64k C = 1..8 geomean +1.3% (0.99-1.03 per point),
#: paged 64k C = 2 +0.4%; D192 / 128 +0.7% (0.99-1.04), below the +1% the rule asked for: off.
PINGPONG_HEAD_DIMS = ((128, 128),)

#: ``sections="auto"`` drops the L2 head sections when their grid order makes the simulated
#: makespan this much longer than heaviest-first with head groups fastest. H200, d192 zigzag,
#: 2026-12-01 (dropping at simulated losses > 1.02): 16k C = 2 / 8 +14% /
#: +8%, but 64k C = 4 and 128k C = 8 (losses 1.020-1.023, one KV head per section: their L2
#: reuse counts) -4 to -5%; 1.05 keeps those two. With 1.05 only d192 16k
#: C = 8 (loss 1.092) of the benchmark's 24 dense points drops them: +13%.
SECTION_MAX_LOSS = 1.05

#: ``persistent="auto"`` takes the persistent schedule when a query tile spans at most this many
#: keys on average (H200, D128, 2026-12-01: persistent +11% at 1024 x 128, +19-24% at 256 x 512,
#: +14-15% at 128 x 1024, +5-7% at 64 x 2048, +2-6% at 32 x 4096 (mean ~2k keys per tile), -1 to
#: -6% at 16 x 8192 (mean ~4k); much slower on long causal ranges: 16k C = 8 319 vs 554 TF/s, the
#: snake's static assignment of a few rounds of heavy items: docs/kernels.md).
PERSISTENT_MAX_MEAN_KEYS = 3072


def use_persistent(option, mean_keys: float, static: bool, pingpong: bool) -> bool:
    """Whether the dense sm90 kernel runs the persistent schedule. ``option``: the ``persistent``
    sm90 option (True / False / "auto"); "auto" takes it for short key ranges (``mean_keys``, the
    tile map's mean keys per tile, <= :data:`PERSISTENT_MAX_MEAN_KEYS`), never for static plans
    (whose batches differ between replays) or with ``pingpong`` (whose turn-taking restarts per
    work item)."""
    if option == "auto":
        return not static and pingpong is not True and 0 < mean_keys <= PERSISTENT_MAX_MEAN_KEYS
    return bool(option)


def use_pingpong(option, head_dim: int, head_dim_v: int, overlap: int, persistent: bool) -> bool:
    """Whether the dense sm90 kernel's consumers take turns issuing their GEMMs. ``option``: the
    ``pingpong`` sm90 option; "auto" is on at :data:`PINGPONG_HEAD_DIMS` when ``overlap`` is on
    and the programs are not ``persistent``; True / False are taken as given."""
    if option == "auto":
        return (head_dim, head_dim_v) in PINGPONG_HEAD_DIMS and overlap > 0 and not persistent
    return bool(option)


def use_overlap(option, head_dim: int, head_dim_v: int, window: bool) -> int:
    """The dense sm90 kernel's ``OVERLAP`` (0, 1, 2), persistent or not. ``option``: the
    ``overlap`` sm90 option; "auto" is 2 at :data:`OVERLAP_HEAD_DIMS` without a sliding
    ``window``, else 0; 0 / 1 / 2 are taken as given."""
    if option == "auto":
        return 2 if (head_dim, head_dim_v) in OVERLAP_HEAD_DIMS and not window else 0
    return int(option)


def use_sections(option, loss: float) -> bool:
    """Whether the dense sm90 grid keeps its L2 head sections. ``option``: the ``sections`` sm90
    option (True / False / "auto"); "auto" keeps them unless ``loss`` (the tile map's
    :func:`~._tiles.section_schedule_loss`; 1.0 for static plans, whose batches change between
    replays) exceeds :data:`SECTION_MAX_LOSS`."""
    if option == "auto":
        return loss <= SECTION_MAX_LOSS
    return bool(option)


_OPTION_NAMES = {"family", "block_m", "config", "sm90", "planned_launch", "decode"}
#: ``backend_options["decode"]`` keys passed to the split-KV decode family (see
#: :mod:`.decode_backend`).
DECODE_OPTIONS = {"programs_per_sm", "min_split", "num_sms", "family", "pair", "pdl"}
#: Kernel families ("auto": decode, then mla, then sm90, then portable, the first that can run
#: the plan).
FAMILIES = ("auto", "portable", "sm90", "mla", "decode")

#: Decode-shaped plans (every segment at most this many rows, some sequence at least
#: DECODE_MIN_KEYS keys) run the split-KV decode family: a query tile there is mostly empty, and
#: one program per tile would stream a long sequence's keys on a handful of SMs.
DECODE_MAX_ROWS = 16
DECODE_MIN_KEYS = 256


def decode_unsupported_reason(spec: AttentionSpec, meta: CPMetadata) -> Optional[str]:
    """Why the split-KV decode family cannot take this dense plan (None if it can): it needs the
    rank's rows to be its sequences' last tokens in sequence order (C = 1), short segments and
    long enough key ranges, a plan sized for its batch, and no FP8 tensor-core mode (it
    dequantizes FP8 K/V: a dense plan of ``mma_dtype`` FP8 runs the portable kernel's FP8 dots)."""
    if spec.fp8_mma:
        return f"mma_dtype={spec.mma_dtype} (the split-KV decode kernel dequantizes FP8 K/V)"
    if meta.cp_size != 1:
        return f"cp_size={meta.cp_size} (local rows are a subset of each sequence's queries)"
    if meta.is_static:
        return "a static plan (the decode family has its own static decode plans)"
    if meta.max_seg_len > DECODE_MAX_ROWS or meta.max_seg_keys < DECODE_MIN_KEYS:
        return f"not decode-shaped (segments up to {meta.max_seg_len} rows, {meta.max_seg_keys} keys)"
    return None


class _DecodeRun:
    """A decode-shaped dense plan run by the split-KV decode family: the placement plan's
    sequences become a decode plan (KV sharded over one rank: every key local), whose rows are
    exactly the dense plan's local rows; pad rows are written here, in one launch of the pad-row
    kernel (was a zero and a fill). (Letting the combine kernel write the pad rows instead saved
    host time but was slower under graph replay on H200: its grid then spans the pad rows, e.g.
    178 -> 161 TF/s at B = 8 L = 4k q1.) Without ``lse`` the split kernels write their LSEs into
    a buffer of the plan, allocated at plan time."""

    family = "decode"

    def __init__(self, spec: AttentionSpec, meta: CPMetadata, options: Mapping) -> None:
        from ..kv_sharding import KVSharding
        from ..metadata import build_metadata
        from .decode_backend import TritonShardBackend

        host = meta.host if meta.host is not None else meta
        dmeta = build_metadata("replicated", None, 1, 1, 0, 1, host.extend_lens, host.prefix_lens, kv=KVSharding(1),
                               replicated=True).to(meta.device)
        unknown = set(options) - _OPTION_NAMES
        if unknown:
            raise ValueError(f"unknown triton backend_options {sorted(unknown)} (known: {sorted(_OPTION_NAMES)})")
        decode = dict(options.get("decode") or {})
        bad = set(decode) - DECODE_OPTIONS
        if bad:
            raise ValueError(f"unknown backend_options decode keys {sorted(bad)} (known: {sorted(DECODE_OPTIONS)})")
        if "config" in options:
            decode["config"] = options["config"]
        from . import triton_decode
        from ._launch import LaunchState

        self._impl = TritonShardBackend().plan(spec, dmeta, decode)
        #: the split-KV family that runs ("mla-split-kv" or "split-kv")
        self.kernel_family = self._impl.family

        self.num_local = n = meta.num_local_tokens
        self.pad_grid, self.pad_args = triton_decode.pad_geometry(meta.num_physical_tokens - n, spec.num_q_heads,
                                                                  spec.head_dim_v)
        self._pad, self._pad_state = triton_decode.launch_pad_rows, LaunchState()
        self._lse_rows = torch.empty(n, spec.num_q_heads, dtype=torch.float32, device=meta.device) if n else None
        #: the plan's GPU (None on the CPU): the pad-row launch runs under a device guard off it
        self._device_index = meta.device.index if meta.device.type == "cuda" else None

    def __call__(self, q, k, v, page_table, sinks, softmax_scale, out, lse, k_scale=None, v_scale=None) -> None:
        index = self._device_index
        if index is not None and index != torch.cuda.current_device():
            with torch.cuda.device(index):  # tensors on a non-current GPU: again, with it current
                self(q, k, v, page_table, sinks, softmax_scale, out, lse, k_scale, v_scale)
            return
        n = self.num_local
        if self.pad_grid[0]:
            self._pad(out, lse, n, grid=self.pad_grid, pad_args=self.pad_args, state=self._pad_state)
        if n:
            self._impl(q[:n], k, v, page_table, sinks, softmax_scale, out[:n], lse[:n] if lse is not None else
                       self._lse_rows, k_scale, v_scale)


class _TritonRun:
    """A planned Triton launch (see the module docstring); called once per layer."""

    def __init__(self, spec: AttentionSpec, meta: CPMetadata, options: Mapping) -> None:
        from . import triton_attn, triton_mla, triton_sm90

        unknown = set(options) - _OPTION_NAMES
        if unknown:
            raise ValueError(f"unknown triton backend_options {sorted(unknown)} (known: {sorted(_OPTION_NAMES)})")
        d, dv, hq, hkv = spec.head_dim, spec.head_dim_v, spec.num_q_heads, spec.num_kv_heads
        family = options.get("family", "auto")
        if family not in FAMILIES:
            raise ValueError(f"backend_options family must be one of {FAMILIES}, got {family!r}")
        block_m = options.get("block_m") or triton_attn.default_block_m(d, dv)
        self.config = options.get("config")
        bad = set(options.get("sm90", {})) - set(SM90_OPTIONS)
        if bad:
            raise ValueError(f"unknown backend_options sm90 keys {sorted(bad)} (known: {sorted(SM90_OPTIONS)})")
        self.sm90_options = {**SM90_OPTIONS, **dict(options.get("sm90", {}))}
        for name in ("persistent", "sections", "pingpong"):
            value = self.sm90_options[name]
            if not (value == "auto" or isinstance(value, bool)):
                raise ValueError(f"backend_options sm90 {name} must be True, False or 'auto', got {value!r}")
        overlap = self.sm90_options["overlap"]
        if not (overlap == "auto" or (isinstance(overlap, int) and not isinstance(overlap, bool)
                                      and overlap in (0, 1, 2))):
            raise ValueError(f"backend_options sm90 overlap must be 0, 1, 2 or 'auto', got {overlap!r}")
        persistent = self.sm90_options["persistent"]
        if persistent is True and self.sm90_options["pingpong"] is True:
            raise ValueError("backend_options sm90: persistent runs without pingpong")
        self.reasons = {"portable": None}
        for name, fam_reason, fam_block in (
            ("sm90", triton_sm90.unsupported_reason(d, dv, spec.dtype, spec.page_size, meta.device),
             triton_sm90.NUM_CONSUMERS * triton_sm90.CONSUMER_ROWS),
            ("mla", triton_mla.unsupported_reason(d, dv, hkv, spec.dtype, spec.page_size, meta.device),
             triton_mla.BLOCK_M),
        ):
            reason = "the CPU interpreter" if triton_attn.INTERPRETED else fam_reason
            if reason is None and spec.fp8_mma:
                reason = f"mma_dtype={spec.mma_dtype}: the portable kernel's FP8 dots run it"
            if reason is None and spec.kv_quantized:
                reason = f"an FP8 cache (kv_dtype={spec.kv_dtype}): the portable kernel dequantizes it"
            if reason is None and block_m != fam_block:
                reason = f"block_m={block_m} (the {name} kernel covers {fam_block})"
            if reason is None and self.config is not None:
                reason = "a portable-kernel config was given"
            self.reasons[name] = reason
        if family not in ("auto", "portable") and self.reasons[family] is not None:
            raise ValueError(f"the {family} kernel cannot run this plan: {self.reasons[family]}")
        if family == "auto":
            env_off = os.environ.get("CPATTN_TRITON_SM90", "1") == "0"
            family = next((f for f in ("mla", "sm90") if self.reasons[f] is None and not env_off), "portable")
        #: the kernel family that runs (a Hopper family falls back to the portable kernel per call
        #: when the K/V layout is not TMA-compatible, see ``__call__``)
        self.family = family

        g_pack, rows = gqa_packing(hq, hkv, block_m)
        elem = torch.empty((), dtype=spec.dtype).element_size()
        #: keys per L2 sequence group of the tile order (None: one group; see ``_tiles.l2_group_keys``)
        self.group_keys = l2_group_keys(meta.num_kv_rows, (d + dv) * elem, meta.device)
        tiles = tile_map(meta, rows, capacity=max_tiles(meta, rows) if meta.is_static else None,
                         window_left=spec.window_left, group_keys=self.group_keys)
        self.num_tiles = tiles.num_tiles
        dev = _buffers.upload(meta, ("triton-tiles", rows), {
            "segment": tiles.segment, "row_offset": tiles.row_offset,
            "num_tiles": torch.tensor([tiles.num_tiles], dtype=torch.int32),
        })
        num_head_groups = hq // g_pack
        self.grid = (tiles.segment.numel() * num_head_groups,)
        section = heads_per_l2_section(meta.num_kv_rows, (d + dv) * elem, hq // hkv // g_pack, num_head_groups,
                                       meta.device)
        common = dict(
            tile_segment=dev["segment"], tile_row_offset=dev["row_offset"], NumTiles=dev["num_tiles"],
            seg_seq=meta.seg_seq, seg_row0=meta.seg_row0, seg_len=meta.seg_len, seg_pos0=meta.seg_pos0,
            seg_stride=meta.seg_stride, cu_kv_lens=meta.cu_kv_lens, window=spec.window_left,
            num_head_groups=num_head_groups, heads_per_section=section, group_size=hq // hkv, G_PACK=g_pack,
            HAS_WINDOW=spec.window_left >= 0,
        )
        self.sm90_args = common
        d1, d2 = triton_attn.split_head_dim(d)
        self.portable_args = dict(
            common, HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_D1=d1, BLOCK_D2=d2, BLOCK_M=block_m,
            PAGED=spec.paged, PAGE_SIZE=spec.page_size or 1, **triton_attn.dot_settings(spec.dtype, spec.fp8_mma),
        )
        # always given (a planned launch records only kernels whose every argument it knows);
        # False compiles the FP8 branches away: the kernel of a bf16 plan is unchanged
        self.portable_args["KV_FP8"] = spec.kv_quantized and not spec.kv_tiled
        self.portable_args["KV_TILE"] = spec.kv_tiled  # tile-scaled latent rows: k is v, scales in the rows
        # FP8 tensor-core attention (spec.mma_dtype); 0 compiles its branches away
        self.portable_args["FP8_MMA"] = triton_attn.fp8_mma_mode(spec.fp8_mma)
        #: what the kernel multiplies in when FP8 (``plan.mma_dtype``; the Hopper families refuse it)
        self.mma_dtype = spec.mma_dtype if spec.fp8_mma else None
        planned = bool(options.get("planned_launch", True))
        from ._launch import LaunchState

        self._portable = triton_attn.launch
        self._portable_launch = triton_attn.make_launch(self.portable_args, self.config, enabled=planned)
        #: the portable kernel's per-K/V facts; the fast family's launch state (per-K/V facts, a
        #: planned launcher per kernel variant with its prepared TMA descriptors)
        self._portable_state = LaunchState(enabled=planned)
        self._fast_state = LaunchState(enabled=planned)
        self.cu_kv_lens = meta.cu_kv_lens
        #: the plan's GPU (None on the CPU): launches on another GPU run under a device guard
        self._device_index = meta.device.index if meta.device.type == "cuda" else None
        self._contiguous = triton_attn.last_dim_contiguous
        self.fast_grid = self.grid
        #: whether the dense sm90 kernel runs its persistent schedule (:func:`use_persistent`), its
        #: overlap mode (:func:`use_overlap`), whether it keeps its L2 head sections
        #: (:func:`use_sections`), the head groups per section it planned and the sections'
        #: simulated loss (1.0 where it was not simulated)
        self.persistent = False
        self.overlap = 0
        self.pingpong = False
        self.sections = True
        self.heads_per_section = section
        self.section_loss = 1.0
        if family == "sm90":
            self._fast = triton_sm90.launch
            opts = self.sm90_options
            self.persistent = use_persistent(opts["persistent"], tiles.mean_keys, meta.is_static, opts["pingpong"])
            self.overlap = use_overlap(opts["overlap"], d, dv, spec.window_left >= 0)
            self.pingpong = use_pingpong(opts["pingpong"], d, dv, self.overlap, self.persistent)
            self._fast_options = {k_: v_ for k_, v_ in opts.items() if k_ != "sections"}
            self._fast_options.update(persistent=self.persistent, overlap=self.overlap, pingpong=self.pingpong)
            sms = torch.cuda.get_device_properties(meta.device).multi_processor_count
            if self.persistent:  # one resident program per SM (one fits per SM)
                self.fast_grid = (max(1, min(self.grid[0], sms)),)
            else:  # heaviest first over all head groups where L2 sections would leave a long tail
                simulate = opts["sections"] == "auto" and not meta.is_static  # ~1 ms host at most, plan time
                if simulate:
                    self.section_loss = section_schedule_loss(tiles.tile_keys, num_head_groups, section, sms)
                self.sections = use_sections(opts["sections"], self.section_loss)
                if not self.sections:
                    self.sm90_args = dict(common, heads_per_section=num_head_groups)
        elif family == "mla":
            self._fast = triton_mla.launch
            self._fast_options = {}
        else:
            self._fast = None

    def __call__(self, q, k, v, page_table, sinks, softmax_scale, out, lse, k_scale=None, v_scale=None) -> None:
        if not softmax_scale > 0:
            raise ValueError(f"softmax_scale must be > 0 for the triton kernels, got {softmax_scale}")
        if k.stride(-1) != 1:
            k = self._contiguous(k, "k")
        if v.stride(-1) != 1:
            v = self._contiguous(v, "v")
        if q.stride(-1) != 1:
            q = self._contiguous(q, "q")
        if page_table is not None and page_table.stride(-1) != 1:
            page_table = page_table.contiguous()
        index = self._device_index  # plan.run checked that the tensors are on the plan's device
        if index is not None and index != torch.cuda.current_device():
            with torch.cuda.device(index):  # tensors on a non-current GPU: again, with it current
                self(q, k, v, page_table, sinks, softmax_scale, out, lse, k_scale, v_scale)
            return
        fast = self._fast
        if fast is not None and fast(q, k, v, out, lse, sinks, page_table, grid=self.fast_grid,
                                     plan_args=self.sm90_args, softmax_scale=softmax_scale, state=self._fast_state,
                                     **self._fast_options):
            return
        self._portable(self._portable_launch, q, k, v, out, lse, sinks, page_table, self.cu_kv_lens, grid=self.grid,
                       softmax_scale=softmax_scale, kv_cache=self._portable_state.kv, k_scale=k_scale, v_scale=v_scale)


class TritonBackend:
    name = "triton"

    def available(self) -> Optional[str]:
        return triton_available()

    def unsupported_reason(self, spec: AttentionSpec, meta: CPMetadata) -> Optional[str]:
        return triton_unsupported_reason(spec, meta.device, _KERNEL_MODULE, fp8=True, tiled=True)

    def plan(self, spec: AttentionSpec, meta: CPMetadata, options: Mapping):
        family = options.get("family", "auto")
        if family in ("auto", "decode"):
            reason = decode_unsupported_reason(spec, meta)
            if reason is None and family == "auto" and os.environ.get("CPATTN_TRITON_SM90", "1") == "0":
                reason = "CPATTN_TRITON_SM90=0"
            if family == "decode" and reason is not None:
                raise ValueError(f"the decode kernel cannot run this plan: {reason}")
            if reason is None:
                return _DecodeRun(spec, meta, options)
        return _TritonRun(spec, meta, options)
