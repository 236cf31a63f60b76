"""Gluon device helpers shared by the Hopper kernel families (:mod:`.triton_sm90` dense,
:mod:`.triton_mla` absorbed MLA): the online-softmax step, paged-cache row lookup for TMA, and
zeroing of key rows past a tile's last key. Not a kernel family: holds no kernel and no launch.

Also the Gluon compatibility layer: the kernels call :data:`cta_barrier`, :data:`tma_load`,
:data:`cp_async_load`, :data:`smem_reinterpret`, :data:`num_warps` and :data:`warp_specialize`,
bound at import time to this triton's spelling (:func:`resolve_gluon_api`), so one kernel source
builds with triton 3.5 through 3.9. ``HAVE_GLUON`` is False where Gluon is missing (triton < 3.5) or lacks a
call the kernels make (:data:`GLUON_API_REASON` says which); the families then report themselves
unsupported (and warn once, see :func:`hopper_reason`) and the portable kernel runs.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
from types import SimpleNamespace
from typing import Mapping, Optional

import torch

#: Gluon calls whose spelling changed between the triton releases the kernels build with, as
#: (name the kernels use, owner, spellings newest first). After triton 3.6, ``gl.thread_barrier``
#: became ``gl.barrier``, the TMA copy ``tma.async_copy_global_to_shared`` became
#: ``tma.async_load``, the cp.async copy ``async_copy.async_copy_global_to_shared`` became
#: ``async_copy.async_load`` (triton 3.9 keeps the old copy names as stubs that raise) and
#: ``shared_memory_descriptor._reinterpret`` became ``reinterpret``; the arguments the kernels pass
#: and what each call emits are the same. ``gl.num_warps`` (new in 3.6) and ``gl.warp_specialize``
#: (signature changed in 3.6) are handled apart, for triton 3.5.
RENAMED_CALLS = (
    ("cta_barrier", "gl", ("barrier", "thread_barrier")),
    ("tma_load", "tma", ("async_load", "async_copy_global_to_shared")),
    ("cp_async_load", "async_copy", ("async_load", "async_copy_global_to_shared")),
    ("smem_reinterpret", "smem", ("reinterpret", "_reinterpret")),
)
#: Calls spelled alike in triton 3.5-3.9, checked too: a later triton without one is reported here
#: instead of failing at the first launch.
UNCHANGED_CALLS = {
    "gl": ("allocate_shared_memory", "inline_asm_elementwise", "convert_layout", "NVMMASharedLayout",
           "NVMMADistributedLayout", "DotOperandLayout", "SwizzledSharedLayout", "BlockedLayout", "SliceLayout"),
    "hopper": ("fence_async_shared", "warpgroup_mma", "warpgroup_mma_wait"),
    "mbarrier": ("MBarrierLayout", "init", "wait", "arrive", "expect"),
    "async_copy": ("commit_group", "wait_group", "mbarrier_arrive"),
}


def _params(fn) -> list:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return []


def _is_stub(fn) -> bool:
    """A removed call left as ``f(*args, **kwargs)`` that raises (triton 3.9's old TMA / cp.async
    copy names)."""
    return any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in _params(fn))


def _builtin(fn):
    """Mark ``fn`` as a Gluon builtin (as gluon's ``@builtin`` does: the attribute triton's code
    generator looks for), so kernels call it at compile time with ``_semantic`` / ``_generator``."""
    fn.__triton_builtin__ = True
    return fn


def _warp_specialize_35(ws):
    """triton 3.5's ``warp_specialize(default_args, default_partition, worker_args,
    worker_partitions, warps, regs)`` called as 3.6+'s ``warp_specialize([(fn, args), ...], warps,
    regs)``: 3.5 passes one argument tuple to every worker, so the workers' tuples must agree
    (values the same objects, constexprs equal)."""
    from triton.language.core import constexpr

    def same(a, b) -> bool:
        if isinstance(a, constexpr) and isinstance(b, constexpr):
            return a.value == b.value
        if hasattr(a, "values") and hasattr(b, "values"):  # gluon tuples
            a, b = a.values, b.values
        if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a is b

    @_builtin
    def warp_specialize(functions_and_args, worker_num_warps, worker_num_regs, _semantic=None, _generator=None):
        (default_fn, default_args), workers = functions_and_args[0], functions_and_args[1:]
        worker_args = workers[0][1]
        if not all(same(args, worker_args) for _, args in workers):
            raise ValueError("triton 3.5's warp_specialize gives every worker partition the same arguments")
        return ws(default_args, default_fn, worker_args, [fn for fn, _ in workers], worker_num_warps,
                  worker_num_regs, _semantic=_semantic, _generator=_generator)

    return warp_specialize


def _num_warps_35():
    """``gl.num_warps()`` (triton >= 3.6) for triton 3.5, which has the partition's warp count but
    no call returning it: the calling partition's warps, else the launch's."""
    from triton.language.core import constexpr

    @_builtin
    def num_warps(_semantic=None, _generator=None):
        context = _generator.caller_context
        return constexpr(context.num_warps if context is not None else _semantic.builder.options.num_warps)

    return num_warps


def resolve_gluon_api(modules: Mapping[str, object], version: str):
    """``(api, reason)``: the Gluon calls the Hopper kernels make, bound to this triton's spelling
    (a namespace of :data:`RENAMED_CALLS`' names, ``num_warps`` and ``warp_specialize``), or
    ``(None, why not)`` naming every call missing. ``modules``: "gl" (gluon.language), "smem" (its
    shared_memory_descriptor), "tma", "mbarrier", "async_copy", "hopper" (the nvidia.hopper
    language module)."""
    api, missing = {}, []
    for name, owner, spellings in RENAMED_CALLS:
        found = [getattr(modules[owner], s) for s in spellings
                 if getattr(modules[owner], s, None) is not None and not _is_stub(getattr(modules[owner], s))]
        if found:
            api[name] = found[0]
        else:
            missing.append(" / ".join(f"{owner}.{s}" for s in spellings))
    for owner, names in UNCHANGED_CALLS.items():
        missing += [f"{owner}.{n}" for n in names if not hasattr(modules[owner], n)]
    api["num_warps"] = getattr(modules["gl"], "num_warps", None) or _num_warps_35()
    ws = getattr(modules["gl"], "warp_specialize", None)
    first = [p.name for p in _params(ws)[:1]]
    if first == ["functions_and_args"]:  # triton >= 3.6: [(fn, args), ...], warps, regs
        api["warp_specialize"] = ws
    elif first == ["default_args"]:  # triton 3.5
        api["warp_specialize"] = _warp_specialize_35(ws)
    else:
        missing.append("gl.warp_specialize([(fn, args), ...], warps, regs)")
    if missing:
        return None, f"Gluon API of triton {version} (the Hopper kernels need {', '.join(missing)})"
    return SimpleNamespace(**api), None


#: Why the installed triton cannot build the Hopper kernels (None if it can): no Gluon (triton <
#: 3.5), or a Gluon without a call they make. ``_MODE_REASON``: Gluon did not load because triton
#: was loaded for the CPU interpreter first (not the installed triton's fault).
GLUON_API_REASON: Optional[str] = None
_MODE_REASON: Optional[str] = None
try:  # Gluon ships with triton >= 3.5
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper as _hopper
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as _async_copy
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier as _mbarrier, tma as _tma
except AssertionError:  # triton.language was decorated for the CPU interpreter before Gluon loaded
    _MODE_REASON = "Gluon unavailable (triton was loaded for the CPU interpreter)"
except ImportError as exc:
    try:
        import triton

        GLUON_API_REASON = f"triton {triton.__version__} has no Gluon ({exc}; the Hopper kernels need triton >= 3.5)"
    except ImportError:
        GLUON_API_REASON = "triton is not installed"
else:
    _API, GLUON_API_REASON = resolve_gluon_api(
        dict(gl=gl, smem=getattr(gl, "shared_memory_descriptor", None), tma=_tma, mbarrier=_mbarrier,
             async_copy=_async_copy, hopper=_hopper), triton.__version__)
HAVE_GLUON = GLUON_API_REASON is None and _MODE_REASON is None
if HAVE_GLUON:
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

    #: Bound per triton (:data:`RENAMED_CALLS`): a CTA-wide barrier (``bar.sync 0``), the TMA copy
    #: ``(desc, coord, mbarrier, dst)``, the cp.async copy ``(dst, pointers, mask=)``, the
    #: shared-memory view ``(buf, dtype, shape, layout)``, the calling partition's warp count
    #: ``num_warps()`` (a constexpr) and ``warp_specialize([(fn, args), ...], warps, regs)``.
    cta_barrier = _API.cta_barrier
    tma_load = _API.tma_load
    cp_async_load = _API.cp_async_load
    smem_reinterpret = _API.smem_reinterpret
    num_warps = _API.num_warps
    warp_specialize = _API.warp_specialize

#: Columns of one TMA copy into a 128-byte-swizzled tile (64 bf16/fp16 = 128 bytes): a wider
#: box is split by Triton into several copies laid out chunk by chunk, so paged copies of a few
#: rows are issued per 64-column chunk into their own sub-tile.
TMA_CHUNK = 64
#: Rows of the smallest TMA copy that keeps the 128-byte swizzle phase (8 rows x 128 bytes).
TMA_MIN_ROWS = 8


def hopper_reason(dtype: torch.dtype, device: torch.device, family: Optional[str] = None) -> Optional[str]:
    """Why no warp-specialized Hopper kernel can run here (None if one can): bf16 / fp16, an sm_90
    GPU, this triton's Gluon able to build the kernels. ``family`` ("sm90", "mla"): the kernel
    family asking, whose plans would use it but for the installed triton: warns once
    (:func:`cpattn.kernels.warn_family_fallback`) unless ``CPATTN_TRITON_SM90=0`` turned the Hopper
    families off."""
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype} (needs bf16 or fp16)"
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return "not an sm_90 GPU"
    if GLUON_API_REASON is not None:
        if family is not None and os.environ.get("CPATTN_TRITON_SM90", "1") != "0":
            from . import warn_family_fallback

            warn_family_fallback(family, GLUON_API_REASON)
        return GLUON_API_REASON
    if not HAVE_GLUON:
        return _MODE_REASON
    return None


def paged_copy_rows(page_size: int, block_n: int) -> int:
    """Rows per TMA copy of a key block from a paged cache: ``gcd(page_size, block_n)``, so each
    copy lies in one page (0 when below :data:`TMA_MIN_ROWS`: no TMA path for that page size)."""
    g = math.gcd(page_size, block_n)
    return g if g >= TMA_MIN_ROWS else 0


def paged_layout_ok(x: torch.Tensor) -> bool:
    """A paged cache ``[num_pages, page_size, Hkv, D]`` seen as the 2-D TMA matrix
    ``[num_pages * page_size, Hkv * D]``: pages evenly spaced by ``page_size`` rows, heads adjacent
    (or one head), last dim contiguous, 16-byte rows and base."""
    if x.dim() != 4:
        return False
    return (x.stride(-1) == 1 and (x.stride(-2) == x.shape[-1] or x.shape[-2] == 1)
            and x.stride(0) == x.shape[1] * x.stride(1) and (x.stride(1) * x.element_size()) % 16 == 0
            and x.data_ptr() % 16 == 0)


def packed_layout_ok(x: torch.Tensor) -> bool:
    """Packed K or V ``[rows, Hkv, D]`` seen as the 2-D TMA matrix ``[rows, Hkv * D]``: heads
    adjacent (or one head), last dim contiguous, 16-byte rows and base."""
    if x.dim() != 3:
        return False
    return (x.stride(-1) == 1 and (x.stride(-2) == x.shape[-1] or x.shape[-2] == 1)
            and (x.stride(0) * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0)


@functools.lru_cache(maxsize=None)
def smem_layout(block: int, cols: int, dtype: torch.dtype):
    """NVMMA (wgmma / TMA) shared-memory layout of a ``[block, cols]`` bf16/fp16 tile (cached:
    host descriptors are built per call)."""
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for([block, cols], gdt)


if HAVE_GLUON:

    @gluon.jit
    def softmax_block(s, m_i, l_i, start, pos, f_lo, f_hi, window, qk_scale, offs_n, HAS_WINDOW: gl.constexpr):
        """Online softmax of one score block (base 2): returns (p fp32, alpha, m_i, l_i). Blocks
        outside [f_lo, f_hi) get the causal / window mask by position (keys past the tile's last
        position are masked there, whatever their scores: NaN from unused cache slots included)."""
        if (start < f_lo) | (start >= f_hi):
            kpos = start + offs_n
            visible = gl.expand_dims(kpos, 0) <= gl.expand_dims(pos, 1)
            if HAS_WINDOW:
                visible = visible & (gl.expand_dims(kpos, 0) >= gl.expand_dims(pos - window, 1))
            s = gl.where(visible, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, alpha, m_new, l_i

    @gluon.jit
    def local_key_count(x, rank, CP_SIZE: gl.constexpr, INTERLEAVE: gl.constexpr):
        """Keys of ``rank`` at global positions < x (x >= 0) when position p lives on rank
        ``(p // INTERLEAVE) % CP_SIZE`` (:class:`cpattn.KVSharding`): local key j < this count
        is exactly a key at position < x."""
        PERIOD: gl.constexpr = CP_SIZE * INTERLEAVE
        part = gl.minimum(gl.maximum(x % PERIOD - rank * INTERLEAVE, 0), INTERLEAVE)
        return (x // PERIOD) * INTERLEAVE + part

    @gluon.jit
    def tile_item(w, NumTiles, num_head_groups, heads_per_section, tile_segment, tile_row_offset, seg_seq, seg_row0,
                  seg_len, seg_pos0, seg_stride, ROWS: gl.constexpr):
        """Work item ``w`` of a prefill launch -> its tile and head group by L2 sections (as
        triton_attn._tile_and_head_group: sections of ``heads_per_section`` head groups, all tiles of
        a section before the next, head groups fastest; not imported from there, which would fix
        triton_attn's interpreter/GPU mode early) and the tile's segment facts. Returns (live, hg,
        seq, roff, slen, row0, pos0, pstride, pos_min, pos_max): items past the device tile count
        (static plans) have ``live`` False and ``slen`` 0 (no key block, nothing stored), so every
        partition agrees without a branch; ``ROWS`` query rows per tile; positions of its first and
        last row."""
        num_tiles = gl.load(NumTiles)
        live = w < num_tiles * num_head_groups
        w = gl.where(live, w, 0)
        per_section = num_tiles * heads_per_section
        section = w // per_section
        r = w - section * per_section
        section_heads = gl.minimum(heads_per_section, num_head_groups - section * heads_per_section)
        tile = r // section_heads
        hg = section * heads_per_section + r % section_heads
        seg = gl.load(tile_segment + tile)
        roff = gl.load(tile_row_offset + tile)
        seq = gl.load(seg_seq + seg)
        row0 = gl.load(seg_row0 + seg)
        slen = gl.where(live, gl.load(seg_len + seg), 0)
        pos0 = gl.load(seg_pos0 + seg)
        pstride = gl.load(seg_stride + seg)
        last_r = gl.minimum(roff + ROWS, slen) - 1
        pos_min = pos0 + roff * pstride
        pos_max = pos0 + last_r * pstride
        return live, hg, seq, roff, slen, row0, pos0, pstride, pos_min, pos_max

    @gluon.jit
    def key_range(live, pos_min, pos_max, window, BLOCK_N: gl.constexpr, HAS_WINDOW: gl.constexpr):
        """A prefill tile's key blocks from its rows' positions ``[pos_min, pos_max]``: (key_end, n_lo,
        f_lo, f_hi, num_blocks): keys ``[n_lo, key_end)`` in ``num_blocks`` blocks of BLOCK_N (0 when
        not ``live``); blocks inside ``[f_lo, f_hi)`` are seen whole by every row (no mask)."""
        key_end = pos_max + 1
        if HAS_WINDOW:
            n_lo = (gl.maximum(pos_min - window, 0) // BLOCK_N) * BLOCK_N
            f_lo = gl.cdiv(gl.maximum(pos_max - window, 0), BLOCK_N) * BLOCK_N
        else:
            n_lo = pos_min * 0
            f_lo = pos_min * 0
        f_hi = gl.maximum(((pos_min + 1) // BLOCK_N) * BLOCK_N, f_lo)
        num_blocks = gl.where(live, gl.cdiv(key_end - n_lo, BLOCK_N), 0)
        return key_end, n_lo, f_lo, f_hi, num_blocks

    @gluon.jit
    def kv_rows(seq, kv_starts, PageTable, stride_pt, PAGE_SIZE: gl.constexpr):
        """(first TMA row of sequence ``seq``'s keys, its page-table row): paged (PAGE_SIZE > 0):
        (0, ``PageTable + seq * stride_pt``); packed: (``kv_starts[seq]`` as int32, TMA coordinates
        being 32-bit, ``PageTable`` unused)."""
        if PAGE_SIZE > 0:
            kv_row_base = seq * 0
            pt_row = PageTable + seq.to(gl.int64) * stride_pt
        else:
            kv_row_base = gl.load(kv_starts + seq).to(gl.int32)
            pt_row = PageTable
        return kv_row_base, pt_row

    @gluon.jit
    def page_of(pt_row, p, last_key, PAGE_SIZE: gl.constexpr, COPY_ROWS: gl.constexpr):
        """(page, slot) of the copy group starting at key ``p`` (a multiple of COPY_ROWS). Keys past
        ``last_key`` are clamped to the group holding it, so no page-table entry past the
        sequence's last page is ever read (those rows are masked / zeroed by the consumers)."""
        p = gl.minimum(p, last_key)
        p = p - p % COPY_ROWS
        return gl.load(pt_row + p // PAGE_SIZE), p % PAGE_SIZE

    @gluon.jit
    def page_row(page, slot, PAGE_SIZE: gl.constexpr):
        """TMA row of (page, slot) in the cache seen as ``[pages * PAGE_SIZE, ...]`` (int32)."""
        return page.to(gl.int32) * PAGE_SIZE + slot

    @gluon.jit
    def zero_rows_from(buf, valid, NUM_WARPS: gl.constexpr):
        """Zero rows ``[valid, rows)`` of the shared ``[rows, cols]`` tile ``buf`` (16-row chunks,
        read-modify-write: rows below ``valid`` are written back unchanged), then make the stores
        visible to wgmma. Used on a paged cache's last key block, whose tail rows may hold NaN:
        P is 0 there, but 0 * NaN is NaN."""
        ROWS: gl.constexpr = buf.type.shape[0]
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
        for c in gl.static_range(ROWS // 16):
            if (c + 1) * 16 > valid:
                part = buf.slice(c * 16, 16)
                x = part.load(layout)
                r = c * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, layout))
                x = gl.where(gl.expand_dims(r < valid, 1), x, gl.zeros_like(x))
                part.store(x)
        fence_async_shared()
        cta_barrier()
