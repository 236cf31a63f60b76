"""``backend="triton"`` for the DSA plan kinds: sparse attention (:mod:`.triton_sparse`, and the
sparse mode of the Hopper absorbed-MLA kernel :mod:`.triton_mla`) and the index top-k
(:mod:`.triton_index` packed score keys + ``torch.topk``).

Sparse attention plans a grid of P rows x head blocks over the per-row table
(:mod:`._dsa_rows`); the per-layer call checks strides, detects ``v = k[..., :Dv]`` and launches
once (O(1) host work; graph-replayable, static plans included). Two kernel families, chosen at
plan time (``plan.family``): ``"mla"`` (sm_90, Gluon: the absorbed form, Hkv = 1, D 576 / Dv 512,
bf16/fp16, packed or paged with any page size; a call whose ``v`` is not a view of
``k[..., :512]`` with 16-byte rows runs the portable kernel instead) and ``"portable"`` (every
shape, any CUDA GPU and the interpreter). ``auto`` takes ``mla`` where it applies, unless
``CPATTN_TRITON_SM90=0`` (read at plan time) or a portable-kernel option is given.

The index top-k plans, once per forward, query tiles of one segment each (``BLOCK_M`` rows, in row
order) and groups consecutive tiles into **chunks** whose score block ``[rows, width]`` (width =
the chunk's largest key count) stays under ``max_score_elems`` scores and within
:data:`CHUNK_SLACK` of its rows' own key counts; a chunk wider than the budget is cut into key
windows merged by a running top-k. Chunks (their windows: **pieces**) are packed into launch
groups of at most ``max_score_elems`` scores. Per layer and group: one score launch (entries =
(tile, piece) x key splits) writing every piece's block of the group buffer as packed
(score, position) int64 keys (:mod:`cpattn.selection`: 8 bytes per score); per chunk one
``torch.topk(sorted=False)`` per window over those keys (ties go to the lower position, as in
the torch reference and over a sharded cache) and one launch writing the positions (int32, -1
where no key). The host loop runs over groups and chunks (8-16 at 32k or 128k tokens), never over
sequences, and never syncs; the chunk geometry comes from the batch, so a graph captured over
``index_topk`` replays only that batch.

``backend_options``: sparse: ``family`` (:data:`SPARSE_FAMILIES`; "mla" raises ValueError where
it cannot run), ``block_h`` (heads per program) and ``config`` ((BLOCK_N, num_warps, num_stages),
bypassing the autotuner) of the portable kernel, ``planned_launch`` (default True: the mla
family launches its compiled kernel directly after the first call, see :mod:`._launch`); index:
``block_m`` (rows per tile), ``keys_per_program``, ``max_score_elems``, ``config``. Triton is
imported lazily.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

import torch
from torch import Tensor

from . import IndexTopkSpec, AttentionSpec, triton_available, triton_device_reason
from .. import _buffers
from ..metadata import CPMetadata
from ..selection import top_keys
from ._dsa_rows import device_rows
from ._tiles import max_tiles, segment_tiles

#: Sparse-attention kernel families ("auto": mla where it applies, else portable).
SPARSE_FAMILIES = ("auto", "mla", "portable")

#: Index top-k chunks end where their score rectangle would exceed this many times their rows'
#: own key counts: widths follow the causal triangle (one chunk over a sequence's rows would
#: make torch.topk read twice what is visible), several chunks per score launch.
CHUNK_SLACK = 1.25

_SPARSE_MODULE = "cpattn.kernels.triton_sparse"
_INDEX_MODULE = "cpattn.kernels.triton_index"
_FP8 = torch.float8_e4m3fn
_HALF = (torch.bfloat16, torch.float16)


def _device_reason(meta: CPMetadata, module: str) -> Optional[str]:
    """Why a Triton DSA kernel cannot run on ``meta``'s device in this process (None if it can)."""
    return triton_device_reason(meta.device, module)


_available = triton_available


def _check_options(options: Mapping, known: set[str]) -> None:
    unknown = set(options) - known
    if unknown:
        raise ValueError(f"unknown triton backend_options {sorted(unknown)} (known: {sorted(known)})")


def _contiguous_last(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch_on(device: torch.device, fn) -> None:
    """Run ``fn`` with ``device`` current (tensors on a non-current GPU)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            fn()
    else:
        fn()


# ----------------------------------------------------------------------------- sparse attention
class _TritonSparseRun:
    """A planned sparse-attention launch (see the module docstring); called once per layer."""

    def __init__(self, spec: AttentionSpec, meta: CPMetadata, options: Mapping) -> None:
        from . import triton_sparse

        _check_options(options, {"block_h", "config", "family", "planned_launch"})
        family = options.get("family", "auto")
        if family not in SPARSE_FAMILIES:
            raise ValueError(f"backend_options family must be one of {SPARSE_FAMILIES}, got {family!r}")
        g = spec.group_size
        block_h = options.get("block_h") or triton_sparse.block_heads(g)
        if block_h < 16 or block_h & (block_h - 1):
            raise ValueError(f"backend_options block_h must be a power of two >= 16, got {block_h}")
        d1, d2 = triton_sparse.split_dim(spec.head_dim)
        per_kv = -(-g // block_h)
        rows = device_rows(meta)
        self.config = options.get("config")
        self.grid = (meta.num_physical_tokens * spec.num_kv_heads * per_kv,)
        self.plan_args = dict(
            row_seq=rows["row_seq"], row_pos=rows["row_pos"], row_kv_start=rows["row_kv_start"],
            num_head_blocks=spec.num_kv_heads * per_kv, head_blocks_per_kv=per_kv, group_size=g,
            HEAD_DIM=spec.head_dim, HEAD_DIM_V=spec.head_dim_v, BLOCK_D1=d1, BLOCK_D2=d2,
            BLOCK_DV=max(16, triton_sparse._next_pow2(spec.head_dim_v)), BLOCK_H=block_h,
            PAGED=spec.paged, PAGE_SIZE=spec.page_size or 1, **triton_sparse.dot_settings(spec.dtype),
        )
        self.plan_args["KV_FP8"] = spec.kv_quantized and not spec.kv_tiled  # False: the FP8 branches compile away
        self.plan_args["KV_TILE"] = spec.kv_tiled  # tile-scaled latent rows: k is v, scales in the rows
        self._launch = triton_sparse.launch
        #: why the mla family cannot run this plan (None: it can)
        self.mla_reason = self._mla_reason(spec, meta, options)
        if family == "mla" and self.mla_reason is not None:
            raise ValueError(f"the mla sparse kernel cannot run this plan: {self.mla_reason}")
        #: the kernel family that runs ("mla" falls back to the portable kernel per call when ``v``
        #: is not a view of ``k[..., :512]`` with 16-byte rows, see ``__call__``)
        self.family = "mla" if family in ("auto", "mla") and self.mla_reason is None else "portable"
        self._mla = None
        if self.family == "mla":
            from . import triton_mla

            g_pack = triton_mla.sparse_head_pack(spec.num_q_heads)
            groups = spec.num_q_heads // g_pack
            self._mla = triton_mla.launch_sparse
            self._mla_layout_ok = triton_mla.sparse_layout_ok
            self.mla_grid = (meta.num_physical_tokens * groups,)
            self.mla_args = dict(row_seq=rows["row_seq"], row_pos=rows["row_pos"], row_kv_start=rows["row_kv_start"],
                                 num_head_groups=groups, G_PACK=g_pack)
            from ._launch import LaunchState

            #: planned launchers per kernel variant (created on first use); disabled: every call
            #: through the JIT
            self._mla_state = LaunchState(enabled=bool(options.get("planned_launch", True)))

    @staticmethod
    def _mla_reason(spec: AttentionSpec, meta: CPMetadata, options: Mapping) -> Optional[str]:
        from . import triton_mla, triton_sparse

        if triton_sparse.INTERPRETED:
            return "the CPU interpreter"
        if spec.kv_quantized:
            return f"an FP8 cache (kv_dtype={spec.kv_dtype}): the portable sparse kernel dequantizes it"
        if options.get("block_h") or options.get("config"):
            return "a portable-kernel option (block_h / config) was given"
        if os.environ.get("CPATTN_TRITON_SM90", "1") == "0" and options.get("family", "auto") == "auto":
            return "CPATTN_TRITON_SM90=0"
        return triton_mla.sparse_unsupported_reason(spec.head_dim, spec.head_dim_v, spec.num_kv_heads, spec.dtype,
                                                    meta.device)

    def __call__(self, q, k, v, idx, page_table, sinks, softmax_scale, out, lse, k_scale=None, v_scale=None) -> None:
        q, k, v, idx = _contiguous_last(q), _contiguous_last(k), _contiguous_last(v), _contiguous_last(idx)
        if page_table is not None:
            page_table = _contiguous_last(page_table)
        if self.grid[0] == 0:
            return
        if self._mla is not None and self._mla_layout_ok(k, v):
            _launch_on(q.device, lambda: self._mla(q, k, idx, out, lse, sinks, page_table, grid=self.mla_grid,
                                                   plan_args=self.mla_args, softmax_scale=softmax_scale,
                                                   state=self._mla_state))
            return
        _launch_on(q.device, lambda: self._launch(q, k, v, idx, out, lse, sinks, page_table, grid=self.grid,
                                                  plan_args=self.plan_args, softmax_scale=softmax_scale,
                                                  config=self.config, k_scale=k_scale, v_scale=v_scale))


class TritonSparseBackend:
    name = "triton"

    def available(self) -> Optional[str]:
        return _available()

    def unsupported_reason(self, spec: AttentionSpec, meta: CPMetadata) -> Optional[str]:
        reason = _device_reason(meta, _SPARSE_MODULE)
        if reason is not None:
            return reason
        rope = spec.head_dim - spec.head_dim_v  # the kernel's (D1, D2) blocks must be (latent, rope)
        pow2 = lambda n: n & (n - 1) == 0  # noqa: E731
        if spec.kv_tiled and not (pow2(spec.head_dim_v) and 16 <= rope < spec.head_dim_v and pow2(rope)):
            return (f"kv_layout={spec.kv_layout!r} needs head_dim_v a power of two and a smaller power-of-two rope "
                    f"part >= 16, got D={spec.head_dim}, Dv={spec.head_dim_v}")
        if spec.dtype not in (*_HALF, torch.float32):
            return f"dtype {spec.dtype} not supported (bf16, fp16; fp32 under the interpreter)"
        if spec.dtype == torch.float32 and meta.device.type == "cuda":
            return "fp32 runs only under the interpreter (use bf16/fp16 on the GPU)"
        if spec.head_dim > 1024 or spec.head_dim_v > 512:
            return f"head dims D={spec.head_dim}, Dv={spec.head_dim_v} not supported (D <= 1024, Dv <= 512)"
        return None

    def plan(self, spec: AttentionSpec, meta: CPMetadata, options: Mapping) -> _TritonSparseRun:
        return _TritonSparseRun(spec, meta, options)


# ----------------------------------------------------------------------------- index top-k
def _row_order_tiles(meta: CPMetadata, block_m: int) -> dict[str, Tensor]:
    """Tiles of ``block_m`` rows of one segment each, in row order (host int tensors)."""
    host = meta.host if meta.host is not None else meta
    s = meta.num_segments
    seg_len = host.seg_len[:s].long()
    seg, off = segment_tiles(seg_len, block_m)
    length = torch.minimum(seg_len[seg] - off, torch.tensor(block_m))
    stride = host.seg_stride[:s].long()[seg]
    pos0 = host.seg_pos0[:s].long()[seg] + off * stride
    seq = host.seg_seq[:s].long()[seg]
    return {
        "row0": host.seg_row0[:s].long()[seg] + off, "len": length, "pos0": pos0, "stride": stride, "seq": seq,
        "kv_start": host.cu_kv_lens[seq], "keys": pos0 + (length - 1) * stride + 1,
    }


def _chunks(tiles: dict[str, Tensor], budget: int, align: int, window_align: int,
            slack: Optional[float] = None) -> list[tuple]:
    """Greedy chunks of consecutive tiles: (first tile, num tiles, first row, rows, windows) with
    windows [(p_lo, width)] covering [0, the chunk's largest key count rounded up to ``align``)
    under ``budget`` values. A chunk also stops growing when its rectangle ``rows x width``
    would exceed ``slack`` times its tiles' own ``rows x keys`` (so widths follow the causal
    triangle: less for ``torch.topk`` to read). Window starts are multiples of ``window_align``
    (the kernel's keys per program, a multiple of every BLOCK_N), so key blocks stay
    BLOCK_N-aligned (inside one page)."""
    slack = CHUNK_SLACK if slack is None else slack
    row0, length, keys = tiles["row0"].tolist(), tiles["len"].tolist(), tiles["keys"].tolist()
    out = []
    i, n = 0, len(row0)
    while i < n:
        j, width, area = i, 0, 0
        while j < n:
            w = -(-max(width, keys[j]) // align) * align
            rows = row0[j] + length[j] - row0[i]
            grown = area + length[j] * keys[j]
            if j > i and (rows * w > budget or rows * w > slack * grown):
                break
            width, area, j = max(width, keys[j]), grown, j + 1
        rows = row0[j - 1] + length[j - 1] - row0[i]
        width = -(-width // align) * align
        window = max(window_align, (budget // max(rows, 1)) // window_align * window_align)
        windows = [(p, min(window, width - p)) for p in range(0, width, window)]
        out.append((i, j - i, row0[i], rows, windows))
        i = j
    return out


def _launch_groups(chunks: list[tuple], budget: int) -> tuple[list[tuple], dict[str, Tensor]]:
    """Pieces (a chunk's rows over one key window) packed in order into launch groups of at most
    ``budget`` score values (a piece larger than that alone): one score launch per group writes
    every piece's ``[rows, width]`` block of the group buffer. Returns the groups, each ``(first
    entry, entries, widest piece, buffer values, pieces)`` with pieces ``(rows, first row, base,
    p_lo, width, last)`` (``last``: the chunk's last window: its selection is complete), and the
    host tables: per entry its tile and piece, per piece its first row, p_lo, width and base
    (element offset in the group buffer)."""
    entry_tile, entry_piece, p_row0, p_plo, p_width, p_base = [], [], [], [], [], []
    groups, current, used, widest, first_entry = [], [], 0, 0, 0
    for t0, nt, r0, rows, windows in chunks:
        for i, (p_lo, width) in enumerate(windows):
            if current and used + rows * width > budget:
                groups.append((first_entry, len(entry_tile) - first_entry, widest, used, current))
                current, used, widest, first_entry = [], 0, 0, len(entry_tile)
            piece = len(p_row0)
            p_row0.append(r0)
            p_plo.append(p_lo)
            p_width.append(width)
            p_base.append(used)
            current.append((rows, r0, used, p_lo, width, i == len(windows) - 1))
            used += rows * width
            widest = max(widest, width)
            entry_tile += range(t0, t0 + nt)
            entry_piece += [piece] * nt
    if current:
        groups.append((first_entry, len(entry_tile) - first_entry, widest, used, current))

    def i32(x):
        return torch.tensor(x or [0], dtype=torch.int32)

    tables = {"entry_tile": i32(entry_tile), "entry_piece": i32(entry_piece), "piece_row0": i32(p_row0),
              "piece_plo": i32(p_plo), "piece_width": i32(p_width),
              "piece_base": torch.tensor(p_base or [0], dtype=torch.int64)}
    return groups, tables


class _TritonIndexRun:
    """A planned index top-k (see the module docstring); called once per layer."""

    def __init__(self, spec: IndexTopkSpec, meta: CPMetadata, options: Mapping) -> None:
        from . import triton_index

        _check_options(options, {"block_m", "keys_per_program", "max_score_elems", "config"})
        interp = triton_index.INTERPRETED
        block_m = options.get("block_m") or (16 if interp else 64)
        kpp = options.get("keys_per_program") or (64 if interp else 1024)
        budget = options.get("max_score_elems") or (1 << 16 if interp else 1 << 27)
        if block_m < 16 or block_m & (block_m - 1) or kpp < 16 or kpp & (kpp - 1):
            raise ValueError(f"backend_options block_m / keys_per_program must be powers of two >= 16, got "
                             f"{block_m} / {kpp}")
        tiles = _row_order_tiles(meta, block_m)
        self.chunks = _chunks(tiles, int(budget), 16, kpp)
        self.groups, pieces = _launch_groups(self.chunks, int(budget))
        self.topk = spec.topk
        self.config = options.get("config")
        size = tiles["row0"].numel()
        if meta.is_static:  # fixed arena shapes: pad to the capacity's tile and entry bounds
            size = max(size, max_tiles(meta, block_m))
            # only a one-tile chunk is cut into windows, each at least budget // block_m keys
            window = max(kpp, (int(budget) // block_m) // kpp * kpp)
            bound = size * -(-max(meta.capacity.max_kv_tokens, 1) // window)
            pieces = {name: torch.cat([t, t.new_zeros(max(0, bound - t.numel()))]) for name, t in pieces.items()}
        i32 = {}
        for name in ("row0", "len", "pos0", "stride", "seq"):
            padded = torch.zeros(max(size, 1), dtype=torch.int32)
            padded[: tiles[name].numel()] = tiles[name].to(torch.int32)
            i32["tile_" + name] = padded
        start = torch.zeros(max(size, 1), dtype=torch.int64)
        start[: tiles["kv_start"].numel()] = tiles["kv_start"]
        dev = _buffers.upload(meta, ("dsa-index-tiles", block_m, kpp, int(budget)),
                              {**i32, "tile_kv_start": start, **pieces})
        self.plan_args = dict(
            tile_row0=dev["tile_row0"], tile_len=dev["tile_len"], tile_pos0=dev["tile_pos0"],
            tile_stride=dev["tile_stride"], tile_seq=dev["tile_seq"], tile_kv_start=dev["tile_kv_start"],
            entry_tile=dev["entry_tile"], entry_piece=dev["entry_piece"], piece_row0=dev["piece_row0"],
            piece_plo=dev["piece_plo"], piece_width=dev["piece_width"], piece_base=dev["piece_base"],
            NUM_HEADS=spec.num_heads, HEAD_DIM=spec.head_dim,
            BLOCK_D=max(16, 1 << max(0, (spec.head_dim - 1).bit_length())), BLOCK_M=block_m, KEYS_PER_PROGRAM=kpp,
            PAGED=spec.paged, PAGE_SIZE=spec.page_size or 1, **triton_index.dot_settings(spec.q_dtype, spec.k_dtype),
        )
        self.kpp = kpp
        self.buffer_elems = max((g[3] for g in self.groups), default=0)
        self._launch, self._q_layout_ok = triton_index.launch, triton_index.q_layout_ok
        self._write = triton_index.write_selection
        self.family = "triton_index"

    def __call__(self, q_idx, k_idx, weights, k_scale, page_table, softmax_scale, out) -> None:
        out.fill_(-1)
        if not self.chunks:
            return
        q_idx, k_idx = _contiguous_last(q_idx), _contiguous_last(k_idx)
        if not self._q_layout_ok(q_idx):
            q_idx = q_idx.contiguous()
        if page_table is not None:
            page_table = _contiguous_last(page_table)
        buf = torch.empty(self.buffer_elems, dtype=torch.int64, device=q_idx.device)
        _launch_on(q_idx.device, lambda: self._run(q_idx, k_idx, weights, k_scale, page_table, softmax_scale, out, buf))

    def _run(self, q_idx, k_idx, weights, k_scale, page_table, softmax_scale, out, buf) -> None:
        topk = self.topk
        best = None  # the running selection (packed keys) of the chunk whose windows are in flight
        for e0, entries, widest, _, pieces in self.groups:
            self._launch(q_idx, k_idx, weights, k_scale, buf, page_table, grid=(entries, -(-widest // self.kpp)),
                         plan_args=self.plan_args, entry_base=e0, softmax_scale=softmax_scale, config=self.config)
            for rows, r0, base, _, width, last in pieces:
                keys = buf[base : base + rows * width].view(rows, width)
                top = torch.topk(keys, min(topk, width), dim=1, sorted=False).values
                if best is not None:  # a later window of a cut chunk: merge (keys carry their positions)
                    top = top_keys(torch.cat([best, top], 1), topk)
                if last:  # positions written in one launch
                    self._write(top, out[r0 : r0 + rows])
                    best = None
                else:
                    best = top


def index_spec_reason(spec: IndexTopkSpec, gpu: bool) -> Optional[str]:
    """Why the Triton index kernels cannot take ``spec``'s dtypes and head dim (None if they can):
    bf16 / fp16 / fp8 e4m3 (fp32 under the interpreter), fp8 queries only with fp8 keys, keys of
    the queries' dtype or fp8, D_i a multiple of 16 up to 256."""
    ok = (*_HALF, _FP8) + (() if gpu else (torch.float32,))
    if spec.q_dtype not in ok or spec.k_dtype not in ok:
        return (f"dtypes q {spec.q_dtype} / k {spec.k_dtype} not supported (bf16, fp16, fp8 e4m3; "
                "fp32 under the interpreter)")
    if spec.q_dtype == _FP8 and spec.k_dtype != _FP8:
        return "fp8 index queries need fp8 index keys"
    if spec.q_dtype != spec.k_dtype and spec.k_dtype != _FP8:
        return f"q_idx {spec.q_dtype} and k_idx {spec.k_dtype} must match (or k_idx fp8)"
    if spec.head_dim > 256 or spec.head_dim % 16:
        return f"index head dim {spec.head_dim} not supported (a multiple of 16, <= 256)"
    return None


class TritonIndexBackend:
    name = "triton"

    def available(self) -> Optional[str]:
        return _available()

    def unsupported_reason(self, spec: IndexTopkSpec, meta: CPMetadata) -> Optional[str]:
        reason = _device_reason(meta, _INDEX_MODULE)
        if reason is not None:
            return reason
        return index_spec_reason(spec, meta.device.type == "cuda")

    def plan(self, spec: IndexTopkSpec, meta: CPMetadata, options: Mapping) -> _TritonIndexRun:
        return _TritonIndexRun(spec, meta, options)
