"""Warp-specialized Hopper (sm_90) variant of the CP attention kernel, written in Gluon.

Same contract and tile map as :mod:`cpattn.kernels.triton_attn` (a program = one query tile of
one segment x ``G_PACK`` heads of one KV group), organised the way FA3 runs on Hopper:

* a 1-warp **loader** partition streams K/V blocks into a ring of shared-memory stages with TMA,
  signalling ``ready`` mbarriers;
* two 4-warp **consumer** partitions each own half of the tile's rows (``BLOCK_M`` each). Per key
  block: ``S = Q K^T`` (wgmma, Q and K in shared memory), then release the stage's K half,
  online softmax in registers, ``O += P V`` (wgmma, P from registers), then release its V half
  (the loader refills each half as soon as it is free). O is stored through the consumer's Q
  tile (16-byte rows). The two consumers run independently, so the warp scheduler overlaps
  one's softmax with the other's tensor-core work. Options (see docs/kernels.md for what each
  measured on H200): ``OVERLAP`` 1 issues ``P_{j-1} V_{j-1}`` and the next block's ``Q K^T``
  back to back, 2 also runs the softmax while ``P V`` is in flight (FA3's intra-warpgroup
  overlap; the plan's default at D128 and D192); ``PINGPONG`` (with ``OVERLAP``, not with
  ``PERSISTENT``; the plan's default at D128) makes the consumers take turns issuing their GEMMs
  through two named hardware barriers (``bar.sync`` / ``bar.arrive``, as FA3 does).

Programs walk the tile map by L2 head sections and sequence groups (see
``_tiles.heads_per_l2_section`` and ``_tiles.l2_group_keys``).

Used for ``(D, Dv)`` in (64, 64), (128, 128), (192, 128) (``Q K^T`` of D192 is two wgmmas over
128 + 64 columns, with 2 K/V stages), bf16/fp16, on sm_90 with Gluon available, K/V packed or
paged. Paged caches are read with TMA copies of ``gcd(page_size, BLOCK_N)`` rows (>= 8: one page
table read per copy; page sizes with a smaller gcd are gathered with cp.async), one copy per
64-column chunk into its sub-tile of the stage; rows past the tile's last key in the last block
are clamped to that key's page (no table entry past the sequence is read) and zeroed in V before
``P V`` (unused cache slots may hold NaN). Everything else (other head dims, other GPUs, the CPU
interpreter) runs the portable kernel. Masking, windows, sinks and LSE follow the portable
kernel exactly.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._launch import LaunchState, PlannedLaunch
from ._sm90_common import (HAVE_GLUON, TMA_CHUNK, hopper_reason, packed_layout_ok, paged_copy_rows,
                           paged_layout_ok, smem_layout as _smem_layout)
from ._tiles import LOG2E, SM90_SMEM_PER_BLOCK, kv_strides

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    # calls spelled per triton release (see _sm90_common.RENAMED_CALLS)
    from ._sm90_common import (cp_async_load, cta_barrier, num_warps, smem_reinterpret, tma_load,
                               warp_specialize)
    from ._sm90_common import (key_range, kv_rows, page_of, page_row, softmax_block as _ws_softmax, tile_item,
                               zero_rows_from)

#: (consumer warpgroups) x (rows per consumer): the tile a program covers.
NUM_CONSUMERS = 2
CONSUMER_ROWS = 64
#: (D, Dv) pairs the kernel takes; D = 192 (MLA prefill) splits ``Q K^T`` into 128 + 64 columns.
SUPPORTED_HEAD_DIMS = {(64, 64), (128, 128), (192, 128)}


#: setmaxnreg budgets (consumer warpgroups, loader warp; 2 x 128 x consumers + 128 x loader <= the
#: 64512 registers of a 384-thread launch at 168): the paged loader computes a page-table row per
#: TMA copy and spills at 24.
PACKED_REGS = dict(CONSUMER_REGS=240, LOADER_REGS=24, LOADER_WARPS=1)
PAGED_REGS = dict(CONSUMER_REGS=232, LOADER_REGS=40, LOADER_WARPS=1)
#: page sizes without 8-row copy groups: a 4-warp cp.async loader (same register split)
GATHER_REGS = dict(CONSUMER_REGS=232, LOADER_REGS=40, LOADER_WARPS=4)


def split_qk_dim(d: int) -> tuple[int, int]:
    """``(D1, D2)``: the ``Q K^T`` columns in the first and second wgmma (D2 = 0: one wgmma)."""
    return (128, d - 128) if d > 128 else (d, 0)


def max_stages(d: int, dv: int, block_n: int, elem_bytes: int = 2) -> int:
    """K/V ring depth that fits in shared memory next to the 128-row Q tile (at most 4: e.g.
    D192/128 with 64-key blocks)."""
    q_bytes = NUM_CONSUMERS * CONSUMER_ROWS * d * elem_bytes
    stage_bytes = block_n * (d + dv) * elem_bytes
    return max(1, min(4, (SM90_SMEM_PER_BLOCK - q_bytes - 1024) // stage_bytes))


def unsupported_reason(d: int, dv: int, dtype: torch.dtype, page_size: Optional[int],
                       device: torch.device) -> Optional[str]:
    """Why the sm_90 kernel cannot take this plan (None if it can; the K/V layout is checked
    per layer by :func:`kv_layout_ok`). Every page size 1..256 runs (``page_size`` None: packed)."""
    if (d, dv) not in SUPPORTED_HEAD_DIMS:
        return f"head dims D={d}, Dv={dv} (needs (D, Dv) in {sorted(SUPPORTED_HEAD_DIMS)})"
    return hopper_reason(dtype, device, "sm90")


def kv_layout_ok(k: Tensor, v: Tensor) -> bool:
    """Packed K/V seen as 2-D TMA matrices ``[rows, Hkv * D]``: heads adjacent (or one KV head),
    16-byte rows and base. Paged caches ``[pages, page_size, Hkv, D]``: read through TMA copy
    groups (:func:`paged_tma_ok`) or gathered with cp.async (16-byte vectors: every stride a
    multiple of 16 elements, 16-byte base)."""
    if k.dim() == 4:
        return paged_tma_ok(k, v, 128) or (_gather_ok(k) and _gather_ok(v))
    return packed_layout_ok(k) and packed_layout_ok(v)


def _gather_ok(x: Tensor) -> bool:
    return x.stride(-1) == 1 and all(st % 16 == 0 for st in x.stride()[:-1]) and x.data_ptr() % 16 == 0


def paged_tma_ok(k: Tensor, v: Tensor, block_n: int) -> bool:
    """A paged cache read through TMA copy groups: ``gcd(page_size, block_n) >= 8`` and both
    caches seen as ``[pages * page_size, Hkv * D]`` (pages evenly spaced, heads adjacent, 16-byte
    rows); else the loader gathers rows with cp.async."""
    return bool(paged_copy_rows(k.shape[1], block_n)) and paged_layout_ok(k) and paged_layout_ok(v)


if HAVE_GLUON:

    @gluon.jit
    def _ws_load_paged(k_desc, v_desc, k_slot, k2_slot, v_slot, k_ready, v_ready, pt_row, start, last_key, k_col,
                       v_col, HEAD_DIM2: gl.constexpr, PAGE_SIZE: gl.constexpr, COPY_ROWS: gl.constexpr,
                       PART: gl.constexpr):
        """TMA one key block of a paged cache, PART 0: K (and K's second split), 1: V: per group of
        COPY_ROWS keys (inside one page: one page-table read) one copy per 64-column chunk into its
        sub-tile, the stage seen as [chunks * groups, COPY_ROWS, 64] (the chunk-major order of a
        128-byte-swizzled tile). The loader issues K's copies before V's (``Q K^T`` waits for K
        only; V's slot may still be in use); the V pass reads the same page-table entries again
        (L1 hits)."""
        BLOCK_N: gl.constexpr = k_slot.type.shape[0]
        CK: gl.constexpr = k_slot.type.shape[1] // 64
        CK2: gl.constexpr = HEAD_DIM2 // 64
        CV: gl.constexpr = v_slot.type.shape[1] // 64
        NG: gl.constexpr = BLOCK_N // COPY_ROWS
        k_pieces = smem_reinterpret(k_slot, k_desc.dtype, [CK * NG, COPY_ROWS, 64], k_desc.layout)
        CK2_VIEW: gl.constexpr = CK2 if CK2 > 0 else 1  # not max(): a tensor in triton 3.5's Gluon
        k2_pieces = smem_reinterpret(k2_slot, k_desc.dtype, [CK2_VIEW * NG, COPY_ROWS, 64], k_desc.layout)
        v_pieces = smem_reinterpret(v_slot, v_desc.dtype, [CV * NG, COPY_ROWS, 64], v_desc.layout)
        for part in gl.static_range(PART, PART + 1):
            # page-table reads run two groups ahead of the copies (one warp issues everything)
            page_a, slot_a = page_of(pt_row, start, last_key, PAGE_SIZE, COPY_ROWS)
            page_b, slot_b = page_of(pt_row, start + COPY_ROWS, last_key, PAGE_SIZE, COPY_ROWS)
            for g in gl.static_range(NG):
                row = page_row(page_a, slot_a, PAGE_SIZE)
                page_a, slot_a = page_b, slot_b
                if g + 2 < NG:
                    page_b, slot_b = page_of(pt_row, start + (g + 2) * COPY_ROWS, last_key, PAGE_SIZE, COPY_ROWS)
                if part == 0:
                    for c in gl.static_range(CK):
                        tma_load(k_desc, [row, k_col + c * 64], k_ready, k_pieces.index(c * NG + g))
                    for c in gl.static_range(CK2):
                        tma_load(k_desc, [row, k_col + (CK + c) * 64], k_ready, k2_pieces.index(c * NG + g))
                else:
                    for c in gl.static_range(CV):
                        tma_load(v_desc, [row, v_col + c * 64], v_ready, v_pieces.index(c * NG + g))

    @gluon.jit
    def _ws_gather_pages(pt_row, start, p, r_in, key_end, R: gl.constexpr, PAGE_SIZE: gl.constexpr):
        """Key positions of pass ``p`` (rows ``start + p * R + r_in``) and their page ids (clamped to
        the tile's last key: no page-table entry past the sequence is read)."""
        kpos = start + p * R + r_in
        return kpos, gl.load(pt_row + gl.minimum(kpos, key_end - 1) // PAGE_SIZE).to(gl.int64)

    @gluon.jit
    def _ws_gather_rows(bases, bufs, gather, cols_off, pt_row, start, key_end, PAGE_SIZE: gl.constexpr,
                        NUM_WARPS: gl.constexpr, TWO: gl.constexpr):
        """cp.async one key block ``[BLOCK_N, cols]`` of a paged cache into ``bufs[0]`` (and, TWO,
        the same rows of the second cache into ``bufs[1]``: K and V share the page lookups), 16
        bytes per thread and pass; page ids are read two passes ahead. Rows past the tile's last
        key are zero-filled."""
        K, V, stride_kp, stride_kn, stride_vp, stride_vn = gather
        buf = bufs[0]
        BLOCK_N: gl.constexpr = buf.type.shape[0]
        COLS: gl.constexpr = buf.type.shape[1]
        TPR: gl.constexpr = COLS // 8
        R: gl.constexpr = 32 * NUM_WARPS // TPR
        NP: gl.constexpr = BLOCK_N // R
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPR, TPR], [NUM_WARPS, 1], [1, 0])
        cols = gl.expand_dims(gl.arange(0, COLS, layout=gl.SliceLayout(0, layout)), 0)
        r_in = gl.arange(0, R, layout=gl.SliceLayout(1, layout))
        kpos_a, page_a = _ws_gather_pages(pt_row, start, 0, r_in, key_end, R, PAGE_SIZE)
        kpos_b, page_b = _ws_gather_pages(pt_row, start, 1, r_in, key_end, R, PAGE_SIZE)
        for p in gl.static_range(NP):
            kpos = kpos_a
            page = page_a
            kpos_a, page_a = kpos_b, page_b
            if p + 2 < NP:
                kpos_b, page_b = _ws_gather_pages(pt_row, start, p + 2, r_in, key_end, R, PAGE_SIZE)
            slot = (kpos % PAGE_SIZE).to(gl.int64)
            mask = gl.expand_dims(kpos < key_end, 1)
            k_off = page * stride_kp + slot * stride_kn + cols_off[0]
            cp_async_load(buf.slice(p * R, R), bases[0] + gl.expand_dims(k_off, 1) + cols, mask=mask)
            if TWO:
                v_off = page * stride_vp + slot * stride_vn + cols_off[1]
                cp_async_load(bufs[1].slice(p * R, R), bases[1] + gl.expand_dims(v_off, 1) + cols, mask=mask)

    @gluon.jit
    def _ws_gather_loader(smem, kv, it0, HEAD_DIM2: gl.constexpr, PAGE_SIZE: gl.constexpr):
        """4 warps: cp.async K/V blocks of a paged cache into the stage ring; block j is signalled
        ready once block j + 1's copies are issued (cp.async groups complete in order)."""
        q_smem, q2_smem, k_bufs, k2_bufs, v_bufs, k_ready, v_ready, kv_empty, turn = smem
        k_desc, k2_desc, v_desc, k_col, v_col, kv_row_base, n_lo, num_blocks, key_end, pt_row, gather = kv
        K, V, stride_kp, stride_kn, stride_vp, stride_vn = gather
        gather_v = (V, V, stride_vp, stride_vn, stride_vp, stride_vn)  # V through the "K" slots
        STAGES: gl.constexpr = k_bufs.type.shape[0]
        BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
        HEAD_DIM1: gl.constexpr = k_bufs.type.shape[2]
        HEAD_DIM_V: gl.constexpr = v_bufs.type.shape[2]
        NW: gl.constexpr = num_warps()
        for j in range(num_blocks):
            slot = (it0 + j) % STAGES
            mbarrier.wait(kv_empty.index(slot), (((it0 + j) // STAGES) & 1) ^ 1)  # K slot free
            mbarrier.wait(kv_empty.index(STAGES + slot), (((it0 + j) // STAGES) & 1) ^ 1)  # V slot free
            start = n_lo + j * BLOCK_N
            if HEAD_DIM1 == HEAD_DIM_V:  # K and V rows in the same passes
                _ws_gather_rows((K, V), (k_bufs.index(slot), v_bufs.index(slot)), gather, (k_col, v_col), pt_row,
                                start, key_end, PAGE_SIZE, NW, True)
            else:
                _ws_gather_rows((K, K), (k_bufs.index(slot), k_bufs.index(slot)), gather, (k_col, k_col), pt_row,
                                start, key_end, PAGE_SIZE, NW, False)
                _ws_gather_rows((V, V), (v_bufs.index(slot), v_bufs.index(slot)), gather_v, (v_col, v_col), pt_row,
                                start, key_end, PAGE_SIZE, NW, False)
            if HEAD_DIM2 > 0:
                _ws_gather_rows((K, K), (k2_bufs.index(slot), k2_bufs.index(slot)), gather, (k_col + HEAD_DIM1, 0),
                                pt_row, start, key_end, PAGE_SIZE, NW, False)
            async_copy.commit_group()
            if j > 0:
                async_copy.wait_group(1)
                fence_async_shared()
                prev = (it0 + j - 1) % STAGES
                mbarrier.arrive(k_ready.index(prev), count=1)
                mbarrier.arrive(v_ready.index(prev), count=1)
        if num_blocks > 0:
            async_copy.wait_group(0)
            fence_async_shared()
            last = (it0 + num_blocks - 1) % STAGES
            mbarrier.arrive(k_ready.index(last), count=1)
            mbarrier.arrive(v_ready.index(last), count=1)

    @gluon.jit
    def _ws_bar(id, count, SYNC: gl.constexpr):
        """Named hardware barrier ``id`` of ``count`` threads, for every thread of the calling
        partition: SYNC, ``bar.sync`` (wait until ``count`` threads arrived, this partition's
        included), else ``bar.arrive`` (count this partition in, do not wait). Per-thread inline
        PTX: Triton's mbarrier arrive / wait come with a warpgroup ``bar.sync`` each."""
        NW: gl.constexpr = num_warps()
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        ids = gl.full([32 * NW], 0, gl.int32, layout) + id
        counts = gl.full([32 * NW], 0, gl.int32, layout) + count
        if SYNC:
            gl.inline_asm_elementwise("bar.sync $1, $2;\n\tmov.b32 $0, 0;", "=r,r,r", [ids, counts], dtype=gl.int32,
                                      is_pure=False, pack=1)
        else:
            gl.inline_asm_elementwise("bar.arrive $1, $2;\n\tmov.b32 $0, 0;", "=r,r,r", [ids, counts],
                                      dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _ws_turn_wait(turn, HALF: gl.constexpr):
        """PINGPONG: consumer HALF waits for its turn to issue GEMMs (named barrier ``turn + HALF``,
        2 x 128 threads; consumer 0 goes first: see :func:`_ws_turn_start`)."""
        _ws_bar(turn + HALF, 256, True)

    @gluon.jit
    def _ws_turn_pass(turn, HALF: gl.constexpr):
        """PINGPONG: consumer HALF hands the turn to the other consumer."""
        _ws_bar(turn + 1 - HALF, 256, False)

    @gluon.jit
    def _ws_turn_start(turn, HALF: gl.constexpr):
        """Consumer 0 counts itself in on its own turn barrier once, so its first wait passes."""
        if HALF == 0:
            _ws_bar(turn, 256, False)

    @gluon.jit
    def _ws_rounds(sched):
        """Rounds of a persistent program: ceil(work items / programs); items = tiles x head groups
        (the tile count read from device memory: static plans)."""
        total = gl.load(sched[2]) * sched[9]
        return gl.cdiv(total, gl.num_programs(0))

    @gluon.jit
    def _ws_work(r, sched):
        """Work item of round ``r`` for this program: programs walk the (heaviest-first) item list
        in a snake, left to right on even rounds and right to left on odd ones, which balances
        the causal tiles' decreasing costs over the programs."""
        npr = gl.num_programs(0)
        pid = gl.program_id(0)
        return r * npr + gl.where(r % 2 == 0, pid, npr - 1 - pid)

    @gluon.jit
    def _ws_item(w, kv, rows, sched, smem, HAS_WINDOW: gl.constexpr, G_PACK: gl.constexpr, PAGE_SIZE: gl.constexpr,
                 COPY_ROWS: gl.constexpr, HEAD_DIM2: gl.constexpr):
        """(kv, rows) of work item ``w`` (:func:`tile_item`, :func:`key_range`)."""
        (tile_segment, tile_row_offset, NumTiles, seg_seq, seg_row0, seg_len, seg_pos0, seg_stride, cu_kv_lens,
         num_head_groups, heads_per_section, group_size, PageTable, stride_pt, stride_kh, stride_vh) = sched
        k_bufs = smem[2]
        v_bufs = smem[4]
        BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
        HEAD_DIM: gl.constexpr = k_bufs.type.shape[2]
        HEAD_DIM_V: gl.constexpr = v_bufs.type.shape[2]
        BLOCK_M: gl.constexpr = smem[0].type.shape[1]
        ROWS: gl.constexpr = 2 * BLOCK_M // G_PACK
        window = rows[19]
        live, hg, seq, roff, slen, row0, pos0, pstride, pos_min, pos_max = tile_item(
            w, NumTiles, num_head_groups, heads_per_section, tile_segment, tile_row_offset, seg_seq, seg_row0,
            seg_len, seg_pos0, seg_stride, ROWS)
        kvh = (hg * G_PACK) // group_size
        kv_row_base, pt_row = kv_rows(seq, cu_kv_lens, PageTable, stride_pt, PAGE_SIZE)
        if (PAGE_SIZE > 0) & (COPY_ROWS == 0):  # cp.async gather: element offsets of this KV head
            k_col = kvh * stride_kh
            v_col = kvh * stride_vh
        else:  # TMA: columns of the [rows, Hkv * D] matrices
            k_col = kvh * (HEAD_DIM + HEAD_DIM2)
            v_col = kvh * HEAD_DIM_V
        key_end, n_lo, f_lo, f_hi, num_blocks = key_range(live, pos_min, pos_max, window, BLOCK_N, HAS_WINDOW)
        kv = (kv[0], kv[1], kv[2], k_col, v_col, kv_row_base, n_lo, num_blocks, key_end, pt_row, kv[10])
        rows = (rows[0], rows[1], rows[2], rows[3], rows[4], rows[5], rows[6], rows[7], rows[8], rows[9],
                roff, slen, row0, pos0, pstride, hg, f_lo, f_hi, rows[18], rows[19], rows[20])
        return kv, rows

    @gluon.jit
    def _ws_load_item(smem, kv, it0, HEAD_DIM2: gl.constexpr, PAGE_SIZE: gl.constexpr, COPY_ROWS: gl.constexpr):
        """The K/V blocks of one work item, ring positions it0, it0 + 1, ... (PAGE_SIZE > 0: from a
        paged cache, COPY_ROWS keys per TMA copy; COPY_ROWS 0: the cp.async gather)."""
        if (PAGE_SIZE > 0) & (COPY_ROWS == 0):
            _ws_gather_loader(smem, kv, it0, HEAD_DIM2, PAGE_SIZE)
        else:
            _ws_tma_loader(smem, kv, it0, HEAD_DIM2, PAGE_SIZE, COPY_ROWS)

    @gluon.jit
    def _ws_loader(smem, kv, rows, sched, HAS_WINDOW: gl.constexpr, HAS_SINKS: gl.constexpr,
                   RETURN_LSE: gl.constexpr, G_PACK: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr,
                   HEAD_DIM2: gl.constexpr, PAGE_SIZE: gl.constexpr, COPY_ROWS: gl.constexpr,
                   PERSISTENT: gl.constexpr):
        """Loader partition: 1 warp streams K/V with TMA (4 warps for the cp.async gather)."""
        if PERSISTENT:
            it = 0
            for r in range(_ws_rounds(sched)):
                kv, rows = _ws_item(_ws_work(r, sched), kv, rows, sched, smem, HAS_WINDOW, G_PACK, PAGE_SIZE,
                                    COPY_ROWS, HEAD_DIM2)
                _ws_load_item(smem, kv, it, HEAD_DIM2, PAGE_SIZE, COPY_ROWS)
                it += kv[7]
        else:
            _ws_load_item(smem, kv, 0, HEAD_DIM2, PAGE_SIZE, COPY_ROWS)

    @gluon.jit
    def _ws_tma_loader(smem, kv, it0, HEAD_DIM2: gl.constexpr, PAGE_SIZE: gl.constexpr, COPY_ROWS: gl.constexpr):
        """1 warp: TMA K/V blocks (packed rows, or per-page copy groups) into the stage ring."""
        q_smem, q2_smem, k_bufs, k2_bufs, v_bufs, k_ready, v_ready, kv_empty, turn = smem
        k_desc, k2_desc, v_desc, k_col, v_col, kv_row_base, n_lo, num_blocks, key_end, pt_row, gather = kv
        STAGES: gl.constexpr = k_bufs.type.shape[0]
        BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
        HEAD_DIM1: gl.constexpr = k_bufs.type.shape[2]
        HEAD_DIM_V: gl.constexpr = v_bufs.type.shape[2]
        for j in range(num_blocks):
            slot = (it0 + j) % STAGES
            phase = ((it0 + j) // STAGES) & 1
            # K's and V's halves of a stage are released separately (K after Q K^T, V after P V), so
            # the next K streams in while the consumers still read this stage's V (overlap=2 holds
            # V_{j-1} and K_j at once); a ready barrier is armed only once its slot is free
            mbarrier.wait(kv_empty.index(slot), phase ^ 1)
            if PAGE_SIZE > 0:
                copy_bytes: gl.constexpr = k_desc.block_type.nbytes * (BLOCK_N // COPY_ROWS)
                mbarrier.expect(k_ready.index(slot), copy_bytes * ((HEAD_DIM1 + HEAD_DIM2) // 64))
                _ws_load_paged(k_desc, v_desc, k_bufs.index(slot), k2_bufs.index(slot), v_bufs.index(slot),
                               k_ready.index(slot), v_ready.index(slot), pt_row, n_lo + j * BLOCK_N, key_end - 1,
                               k_col, v_col, HEAD_DIM2, PAGE_SIZE, COPY_ROWS, 0)
                mbarrier.wait(kv_empty.index(STAGES + slot), phase ^ 1)
                mbarrier.expect(v_ready.index(slot), copy_bytes * (HEAD_DIM_V // 64))
                _ws_load_paged(k_desc, v_desc, k_bufs.index(slot), k2_bufs.index(slot), v_bufs.index(slot),
                               k_ready.index(slot), v_ready.index(slot), pt_row, n_lo + j * BLOCK_N, key_end - 1,
                               k_col, v_col, HEAD_DIM2, PAGE_SIZE, COPY_ROWS, 1)
            else:
                row = (kv_row_base + n_lo + j * BLOCK_N).to(gl.int32)
                if HEAD_DIM2 > 0:
                    mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes + k2_desc.block_type.nbytes)
                    tma_load(k_desc, [row, k_col], k_ready.index(slot), k_bufs.index(slot))
                    tma_load(k2_desc, [row, k_col + HEAD_DIM1], k_ready.index(slot), k2_bufs.index(slot))
                else:
                    mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
                    tma_load(k_desc, [row, k_col], k_ready.index(slot), k_bufs.index(slot))
                mbarrier.wait(kv_empty.index(STAGES + slot), phase ^ 1)
                mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
                tma_load(v_desc, [row, v_col], v_ready.index(slot), v_bufs.index(slot))

    @gluon.jit
    def _ws_qk(q_lo, q_hi, k_lo, k_hi, s_zero, HEAD_DIM2: gl.constexpr):
        """Async ``S = Q K^T`` of one block: one wgmma, or two over column splits (D = 128 + 64)."""
        s = warpgroup_mma(q_lo, k_lo.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if HEAD_DIM2 > 0:
            s = warpgroup_mma(q_hi, k_hi.permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _ws_fix_last_v(v_buf, j, num_blocks, n_lo, key_end):
        """Zero the V rows of the last key block past the tile's last key: unused slots of a paged
        cache, rows clamped to the last page, or (packed) the next sequence's keys may hold NaN;
        P is 0 there but 0 * NaN is not. (The cp.async gather already zero-fills those rows; the
        pass is cheap and keeps one rule for every loader.)"""
        BLOCK_N: gl.constexpr = v_buf.type.shape[0]
        valid = key_end - (n_lo + j * BLOCK_N)
        if (j == num_blocks - 1) & (valid < BLOCK_N):
            zero_rows_from(v_buf, valid, 4)

    @gluon.jit
    def _ws_block(blk, j, acc, m_i, l_i, HAS_WINDOW: gl.constexpr, HEAD_DIM2: gl.constexpr, LAST: gl.constexpr,
                  P_LAYOUT: gl.constexpr, O_ROWS: gl.constexpr):
        """One key block of the non-overlapped consumer loop: S = Q K^T, online softmax, O += P V;
        LAST: the tile's last block (its V rows past the last key zeroed first)."""
        (q_half, q2_half, k_bufs, k2_bufs, v_bufs, k_ready, v_ready, kv_empty, s_zero, it0, num_blocks,
         n_lo, key_end, pos, f_lo, f_hi, window, qk_scale, offs_n) = blk
        STAGES: gl.constexpr = k_bufs.type.shape[0]
        BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
        slot = (it0 + j) % STAGES
        phase = ((it0 + j) // STAGES) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        s = _ws_qk(q_half, q2_half, k_bufs.index(slot), k2_bufs.index(slot), s_zero, HEAD_DIM2)
        s = warpgroup_mma_wait(0, deps=(s, ))
        mbarrier.arrive(kv_empty.index(slot), count=1)  # K_j read
        p, alpha, m_i, l_i = _ws_softmax(s, m_i, l_i, n_lo + j * BLOCK_N, pos, f_lo, f_hi, window, qk_scale, offs_n,
                                         HAS_WINDOW)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, O_ROWS), 1)
        p_op = gl.convert_layout(p.to(k_bufs.type.element_ty), P_LAYOUT)
        mbarrier.wait(v_ready.index(slot), phase)
        if LAST:
            _ws_fix_last_v(v_bufs.index(slot), j, num_blocks, n_lo, key_end)
        acc = warpgroup_mma(p_op, v_bufs.index(slot), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(kv_empty.index(STAGES + slot), count=1)  # V_j read
        return acc, m_i, l_i

    @gluon.jit
    def _ws_q_load(rows, HALF: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                   HEAD_DIM2: gl.constexpr, G_PACK: gl.constexpr):
        """Consumer HALF's Q rows of one work item into registers, [BLOCK_M, HEAD_DIM] bf16 (row m
        = position-major, heads fastest; rows past the segment 0): (q, q2), q2 = columns
        [HEAD_DIM, HEAD_DIM + HEAD_DIM2) (q again when HEAD_DIM2 == 0)."""
        Q, stride_qm, stride_qh = rows[0], rows[4], rows[5]
        roff, slen, row0, hg = rows[10], rows[11], rows[12], rows[15]
        q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        m_q = HALF * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_layout))
        r_q = roff + m_q // G_PACK
        head_q = hg * G_PACK + m_q % G_PACK
        q_rows = gl.expand_dims((row0 + r_q).to(gl.int64) * stride_qm + head_q * stride_qh, 1)
        d_q = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
        q = gl.load(Q + q_rows + gl.expand_dims(d_q, 0), mask=gl.expand_dims(r_q < slen, 1), other=0.0)
        q2 = q
        if HEAD_DIM2 > 0:  # the second Q K^T wgmma's columns
            d2_q = HEAD_DIM + gl.arange(0, HEAD_DIM2, layout=gl.SliceLayout(0, q_layout))
            q2 = gl.load(Q + q_rows + gl.expand_dims(d2_q, 0), mask=gl.expand_dims(r_q < slen, 1), other=0.0)
        return q, q2

    @gluon.jit
    def _ws_consumer_item(smem, kv, rows, it0, q, q2, next_w, sched, HALF: gl.constexpr, HAS_WINDOW: gl.constexpr,
                          HAS_SINKS: gl.constexpr, RETURN_LSE: gl.constexpr, G_PACK: gl.constexpr,
                          OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, HEAD_DIM2: gl.constexpr,
                          PAGE_SIZE: gl.constexpr, COPY_ROWS: gl.constexpr, PREFETCH: gl.constexpr):
        """4 warps: rows [HALF * BLOCK_M, (HALF + 1) * BLOCK_M) of one work item's tile, its key
        blocks at ring positions it0, it0 + 1, ... PREFETCH (persistent programs at D <= 128): this
        item's Q rows ``q, q2`` were loaded by the caller (:func:`_ws_q_load`), and work item
        ``next_w`` is located and its Q loads issued before this item's epilogue, so the loads'
        latency hides behind it (locating it before the key blocks instead was slower on H200);
        returns (kv, rows, q, q2) of the next item. Otherwise ``q, q2, next_w``
        are unused (Q is loaded here) and the return value is this item's."""
        q_smem, q2_smem, k_bufs, k2_bufs, v_bufs, k_ready, v_ready, kv_empty, turn = smem
        k_desc, k2_desc, v_desc, k_col, v_col, kv_row_base, n_lo, num_blocks, key_end, pt_row, gather = kv
        (Q, Out, Lse, Sinks, stride_qm, stride_qh, stride_om, stride_oh, stride_lm, stride_lh,
         roff, slen, row0, pos0, pstride, hg, f_lo, f_hi, qk_scale, window, stride_sink) = rows
        STAGES: gl.constexpr = k_bufs.type.shape[0]
        BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
        HEAD_DIM: gl.constexpr = k_bufs.type.shape[2]
        HEAD_DIM_V: gl.constexpr = v_bufs.type.shape[2]
        BLOCK_M: gl.constexpr = q_smem.type.shape[1]
        dtype: gl.constexpr = k_bufs.type.element_ty

        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM_V, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

        # this half's Q rows -> shared memory
        if not PREFETCH:  # (prefetched: loaded during the previous item's epilogue)
            q, q2 = _ws_q_load(rows, HALF, BLOCK_M, HEAD_DIM, HEAD_DIM2, G_PACK)
        q_half = q_smem.index(HALF)
        q_half.store(q)
        q2_half = q_half
        if HEAD_DIM2 > 0:
            q2_half = q2_smem.index(HALF)
            q2_half.store(q2)
        fence_async_shared()
        cta_barrier()

        m_s = HALF * BLOCK_M + gl.arange(0, BLOCK_M, layout=s_rows)
        pos = pos0 + (roff + m_s // G_PACK) * pstride
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        if HAS_SINKS:
            m_i = gl.load(Sinks + (hg * G_PACK + m_s % G_PACK) * stride_sink).to(gl.float32) * 1.4426950408889634
            l_i = gl.full([BLOCK_M], 1.0, gl.float32, layout=s_rows)
        else:
            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=s_rows)
            l_i = gl.full([BLOCK_M], 0.0, gl.float32, layout=s_rows)
        acc = gl.zeros([BLOCK_M, HEAD_DIM_V], gl.float32, layout=o_layout)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

        if OVERLAP > 0:
            if num_blocks > 0:  # pad tiles have no key block
                # prologue: block 0's scores and probabilities
                first = it0 % STAGES
                mbarrier.wait(k_ready.index(first), (it0 // STAGES) & 1)
                if PINGPONG:
                    _ws_turn_start(turn, HALF)
                    _ws_turn_wait(turn, HALF)
                s = _ws_qk(q_half, q2_half, k_bufs.index(first), k2_bufs.index(first), s_zero, HEAD_DIM2)
                if PINGPONG:
                    _ws_turn_pass(turn, HALF)
                s = warpgroup_mma_wait(0, deps=(s, ))
                mbarrier.arrive(kv_empty.index(first), count=1)  # K_0 read
                p, alpha, m_i, l_i = _ws_softmax(s, m_i, l_i, n_lo, pos, f_lo, f_hi, window, qk_scale, offs_n,
                                                 HAS_WINDOW)
                p_op = gl.convert_layout(p.to(dtype), p_layout)  # bf16 operand now: 32 registers, not 64
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
                for j in range(1, num_blocks):
                    slot = (it0 + j) % STAGES
                    prev = (it0 + j - 1) % STAGES
                    # issue S_j = Q K_j^T, then O += P_{j-1} V_{j-1}; softmax_j overlaps the second
                    mbarrier.wait(k_ready.index(slot), ((it0 + j) // STAGES) & 1)
                    mbarrier.wait(v_ready.index(prev), ((it0 + j - 1) // STAGES) & 1)
                    if PINGPONG:  # the two consumers take turns issuing their GEMMs
                        _ws_turn_wait(turn, HALF)
                    s = _ws_qk(q_half, q2_half, k_bufs.index(slot), k2_bufs.index(slot), s_zero, HEAD_DIM2)
                    acc = warpgroup_mma(p_op, v_bufs.index(prev), acc, is_async=True)
                    if PINGPONG:
                        _ws_turn_pass(turn, HALF)
                    # OVERLAP 2: softmax_j runs while P_{j-1} V_{j-1} is in flight; 1: after both GEMMs
                    if OVERLAP == 2:
                        s, p_op = warpgroup_mma_wait(1, deps=(s, p_op))
                    else:
                        s, p_op = warpgroup_mma_wait(0, deps=(s, p_op))
                    mbarrier.arrive(kv_empty.index(slot), count=1)  # K_j read
                    p, alpha, m_i, l_i = _ws_softmax(s, m_i, l_i, n_lo + j * BLOCK_N, pos, f_lo, f_hi, window,
                                                     qk_scale, offs_n, HAS_WINDOW)
                    acc = warpgroup_mma_wait(0, deps=(acc, ))
                    p_op = gl.convert_layout(p.to(dtype), p_layout)
                    mbarrier.arrive(kv_empty.index(STAGES + prev), count=1)  # V_{j-1} read
                    acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
                last = (it0 + num_blocks - 1) % STAGES
                mbarrier.wait(v_ready.index(last), ((it0 + num_blocks - 1) // STAGES) & 1)
                _ws_fix_last_v(v_bufs.index(last), num_blocks - 1, num_blocks, n_lo, key_end)
                if PINGPONG:
                    _ws_turn_wait(turn, HALF)
                acc = warpgroup_mma(p_op, v_bufs.index(last), acc, is_async=True)
                if PINGPONG:
                    _ws_turn_pass(turn, HALF)
                acc = warpgroup_mma_wait(0, deps=(acc, ))
                mbarrier.arrive(kv_empty.index(STAGES + last), count=1)
        else:
            # the last block (whose V rows past the tile's last key are zeroed) is peeled off the
            # loop: a zeroing branch inside the loop body costs the packed kernel ~8% (H200)
            blk = (q_half, q2_half, k_bufs, k2_bufs, v_bufs, k_ready, v_ready, kv_empty, s_zero, it0, num_blocks,
                   n_lo, key_end, pos, f_lo, f_hi, window, qk_scale, offs_n)
            for j in range(num_blocks - 1):
                acc, m_i, l_i = _ws_block(blk, j, acc, m_i, l_i, HAS_WINDOW, HEAD_DIM2, False, p_layout, o_rows)
            if num_blocks > 0:
                acc, m_i, l_i = _ws_block(blk, num_blocks - 1, acc, m_i, l_i, HAS_WINDOW, HEAD_DIM2, True, p_layout,
                                          o_rows)

        if PREFETCH:  # the next item's Q loads are in flight during this epilogue
            kv_next, rows_next = _ws_item(next_w, kv, rows, sched, smem, HAS_WINDOW, G_PACK, PAGE_SIZE, COPY_ROWS,
                                          HEAD_DIM2)
            q, q2 = _ws_q_load(rows_next, HALF, BLOCK_M, HEAD_DIM, HEAD_DIM2, G_PACK)
        else:
            kv_next, rows_next = kv, rows

        # epilogue: O / l (0 / -inf for rows that saw no key; NaN stays NaN), LSE in natural log
        has_mass = l_i != 0.0
        inv_l = gl.where(has_mass, 1.0 / gl.where(has_mass, l_i, 1.0), 0.0)
        out = (acc * gl.expand_dims(gl.convert_layout(inv_l, o_rows), 1)).to(dtype)
        # O goes through this half's Q tile (free: its last Q K^T has retired) so that each thread
        # stores 16 contiguous bytes and a warp whole rows, not 4-byte pieces of the accumulator
        # layout (Dv == the Q tile's width at D64, D128 and D192 / 128)
        gl.static_assert(HEAD_DIM_V == HEAD_DIM)
        q_half.store(out)
        cta_barrier()
        st_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_DIM_V // 8), HEAD_DIM_V // 8], [4, 1], [1, 0])
        out = q_half.load(st_layout)
        m_o = HALF * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, st_layout))
        r_o = roff + m_o // G_PACK
        head_o = hg * G_PACK + m_o % G_PACK
        d_o = gl.arange(0, HEAD_DIM_V, layout=gl.SliceLayout(0, st_layout))
        o_ptrs = Out + gl.expand_dims((row0 + r_o).to(gl.int64) * stride_om + head_o * stride_oh, 1) \
            + gl.expand_dims(d_o, 0)
        gl.store(o_ptrs, out, mask=gl.expand_dims(r_o < slen, 1))
        cta_barrier()  # every row read back before the next item's Q rows overwrite the tile
        if RETURN_LSE:
            lse = gl.where(has_mass, (m_i + gl.log2(gl.where(has_mass, l_i, 1.0))) * 0.6931471805599453,
                           float("-inf"))
            lse = gl.where(pos < 0, float("-inf"), lse)  # pad rows (pad segment, position -1)
            r_s = roff + m_s // G_PACK
            head_s = hg * G_PACK + m_s % G_PACK
            gl.store(Lse + (row0 + r_s).to(gl.int64) * stride_lm + head_s * stride_lh, lse, mask=r_s < slen)
        return kv_next, rows_next, q, q2


    @gluon.jit
    def _ws_consumer(smem, kv, rows, sched, HALF: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SINKS: gl.constexpr,
                     RETURN_LSE: gl.constexpr, G_PACK: gl.constexpr, OVERLAP: gl.constexpr,
                     PINGPONG: gl.constexpr, HEAD_DIM2: gl.constexpr, PAGE_SIZE: gl.constexpr,
                     COPY_ROWS: gl.constexpr, PERSISTENT: gl.constexpr):
        """Consumer warpgroup HALF: one work item, or (PERSISTENT) every item of this program; at
        D128 / D64 each item's Q loads are issued before the previous item's epilogue (at D192 the
        48 extra registers of Q would spill there: loaded after it)."""
        BLOCK_M: gl.constexpr = smem[0].type.shape[1]
        HEAD_DIM: gl.constexpr = smem[2].type.shape[2]
        if PERSISTENT and HEAD_DIM2 == 0:
            it = 0
            kv, rows = _ws_item(_ws_work(0, sched), kv, rows, sched, smem, HAS_WINDOW, G_PACK, PAGE_SIZE, COPY_ROWS,
                                HEAD_DIM2)
            q, q2 = _ws_q_load(rows, HALF, BLOCK_M, HEAD_DIM, HEAD_DIM2, G_PACK)
            for r in range(_ws_rounds(sched)):
                blocks = kv[7]
                kv, rows, q, q2 = _ws_consumer_item(smem, kv, rows, it, q, q2, _ws_work(r + 1, sched), sched, HALF,
                                                    HAS_WINDOW, HAS_SINKS, RETURN_LSE, G_PACK, OVERLAP, PINGPONG,
                                                    HEAD_DIM2, PAGE_SIZE, COPY_ROWS, True)
                it += blocks
        elif PERSISTENT:
            it = 0
            for r in range(_ws_rounds(sched)):
                kv, rows = _ws_item(_ws_work(r, sched), kv, rows, sched, smem, HAS_WINDOW, G_PACK, PAGE_SIZE,
                                    COPY_ROWS, HEAD_DIM2)
                _ws_consumer_item(smem, kv, rows, it, 0, 0, 0, sched, HALF, HAS_WINDOW, HAS_SINKS, RETURN_LSE, G_PACK,
                                  OVERLAP, PINGPONG, HEAD_DIM2, PAGE_SIZE, COPY_ROWS, False)
                it += kv[7]
        else:
            _ws_consumer_item(smem, kv, rows, 0, 0, 0, 0, sched, HALF, HAS_WINDOW, HAS_SINKS, RETURN_LSE, G_PACK,
                              OVERLAP, PINGPONG, HEAD_DIM2, PAGE_SIZE, COPY_ROWS, False)

    @gluon.jit
    def _ws_consumer0(smem, kv, rows, sched, HAS_WINDOW: gl.constexpr, HAS_SINKS: gl.constexpr,
                      RETURN_LSE: gl.constexpr, G_PACK: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr,
                      HEAD_DIM2: gl.constexpr, PAGE_SIZE: gl.constexpr, COPY_ROWS: gl.constexpr,
                      PERSISTENT: gl.constexpr):
        _ws_consumer(smem, kv, rows, sched, 0, HAS_WINDOW, HAS_SINKS, RETURN_LSE, G_PACK, OVERLAP, PINGPONG, HEAD_DIM2,
                     PAGE_SIZE, COPY_ROWS, PERSISTENT)

    @gluon.jit
    def _ws_consumer1(smem, kv, rows, sched, HAS_WINDOW: gl.constexpr, HAS_SINKS: gl.constexpr,
                      RETURN_LSE: gl.constexpr, G_PACK: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr,
                      HEAD_DIM2: gl.constexpr, PAGE_SIZE: gl.constexpr, COPY_ROWS: gl.constexpr,
                      PERSISTENT: gl.constexpr):
        _ws_consumer(smem, kv, rows, sched, 1, HAS_WINDOW, HAS_SINKS, RETURN_LSE, G_PACK, OVERLAP, PINGPONG, HEAD_DIM2,
                     PAGE_SIZE, COPY_ROWS, PERSISTENT)

    @gluon.jit
    def _cp_attn_fwd_sm90(
        Q, k_desc, k2_desc, v_desc, K, V, Out, Lse, Sinks, PageTable,
        tile_segment, tile_row_offset, NumTiles,
        seg_seq, seg_row0, seg_len, seg_pos0, seg_stride, cu_kv_lens,
        qk_scale, window, num_head_groups, heads_per_section, group_size,
        stride_qm, stride_qh, stride_om, stride_oh, stride_lm, stride_lh, stride_sink, stride_pt,
        stride_kp, stride_kn, stride_kh, stride_vp, stride_vn, stride_vh,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM2: gl.constexpr,
        HEAD_DIM_V: gl.constexpr, STAGES: gl.constexpr, G_PACK: gl.constexpr,
        HAS_WINDOW: gl.constexpr, HAS_SINKS: gl.constexpr, RETURN_LSE: gl.constexpr, OVERLAP: gl.constexpr,
        PINGPONG: gl.constexpr, PAGE_SIZE: gl.constexpr, COPY_ROWS: gl.constexpr,
        Q_SMEM: gl.constexpr, Q2_SMEM: gl.constexpr, K_SMEM: gl.constexpr, K2_SMEM: gl.constexpr,
        V_SMEM: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, LOADER_WARPS: gl.constexpr,
        PERSISTENT: gl.constexpr,
    ):
        q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [2, BLOCK_M, HEAD_DIM], Q_SMEM)
        k_bufs = gl.allocate_shared_memory(Q.dtype.element_ty, [STAGES, BLOCK_N, HEAD_DIM], K_SMEM)
        if HEAD_DIM2 > 0:
            q2_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [2, BLOCK_M, HEAD_DIM2], Q2_SMEM)
            k2_bufs = gl.allocate_shared_memory(Q.dtype.element_ty, [STAGES, BLOCK_N, HEAD_DIM2], K2_SMEM)
        else:  # placeholders, never read
            q2_smem = q_smem
            k2_bufs = k_bufs
        v_bufs = gl.allocate_shared_memory(Q.dtype.element_ty, [STAGES, BLOCK_N, HEAD_DIM_V], V_SMEM)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # stage i's K half is free at kv_empty[i], its V half at kv_empty[STAGES + i] (both consumers)
        kv_empty = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)
            mbarrier.init(kv_empty.index(STAGES + i), count=2)

        # partition arguments (scalars and shared-memory handles only): buffers, K/V stream, rows,
        # and what locates a work item (tile x head group)
        # PINGPONG's turn barriers: named barriers 14 - 2 * STAGES and 15 - 2 * STAGES, above the
        # ids Triton's partitions use
        turn = 14 - 2 * STAGES
        smem = (q_smem, q2_smem, k_bufs, k2_bufs, v_bufs, k_ready, v_ready, kv_empty, turn)
        zero = gl.program_id(0) * 0
        gather = (K, V, stride_kp, stride_kn, stride_vp, stride_vn)
        kv = (k_desc, k2_desc, v_desc, zero, zero, zero, zero, zero, zero, PageTable, gather)
        rows = (Q, Out, Lse, Sinks, stride_qm, stride_qh, stride_om, stride_oh, stride_lm, stride_lh,
                zero, zero, zero, zero, zero, zero, zero, zero, qk_scale, window, stride_sink)
        sched = (tile_segment, tile_row_offset, NumTiles, seg_seq, seg_row0, seg_len, seg_pos0, seg_stride, cu_kv_lens,
                 num_head_groups, heads_per_section, group_size, PageTable, stride_pt, stride_kh, stride_vh)
        if not PERSISTENT:  # one work item per program: located once here
            kv, rows = _ws_item(gl.program_id(0), kv, rows, sched, smem, HAS_WINDOW, G_PACK, PAGE_SIZE, COPY_ROWS,
                                HEAD_DIM2)
        # the flags go in tuple literals: assigning a tuple to a name would turn its constexprs into
        # runtime values
        warp_specialize([
            (_ws_consumer0, (smem, kv, rows, sched, HAS_WINDOW, HAS_SINKS, RETURN_LSE, G_PACK, OVERLAP, PINGPONG,
                              HEAD_DIM2, PAGE_SIZE, COPY_ROWS, PERSISTENT)),
            (_ws_consumer1, (smem, kv, rows, sched, HAS_WINDOW, HAS_SINKS, RETURN_LSE, G_PACK, OVERLAP, PINGPONG,
                              HEAD_DIM2, PAGE_SIZE, COPY_ROWS, PERSISTENT)),
            (_ws_loader, (smem, kv, rows, sched, HAS_WINDOW, HAS_SINKS, RETURN_LSE, G_PACK, OVERLAP, PINGPONG,
                          HEAD_DIM2, PAGE_SIZE, COPY_ROWS, PERSISTENT)),
        ], [4, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])


def kv_descriptors(k: Tensor, v: Tensor, block_n: int):
    """Host TMA descriptors over K/V seen as ``[rows, Hkv * D]`` matrices (KV head ``h`` starts at
    column ``h * D``). Packed ``[rows, Hkv, D]``: K in column splits ``D1`` and ``D2``
    (:func:`split_qk_dim`; the second at ``h * D + D1``), V in blocks ``[block_n, Dv]`` (with
    ``D2 = 0`` the second K descriptor is the first, never read). Paged ``[pages, page_size, Hkv,
    D]`` (rows = pages x page_size): copies of ``[paged_copy_rows(page_size, block_n), 64]`` for
    both K and V, one descriptor each (the second K descriptor is the first)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if k.dim() == 4:
        pages, page, hkv, d = k.shape
        dv = v.shape[-1]
        g = paged_copy_rows(page, block_n)
        layout = _smem_layout(g, TMA_CHUNK, k.dtype)
        k_desc = TensorDescriptor(k, [pages * page, hkv * d], [k.stride(1), 1], [g, TMA_CHUNK], layout)
        v_desc = TensorDescriptor(v, [pages * page, hkv * dv], [v.stride(1), 1], [g, TMA_CHUNK], layout)
        return k_desc, k_desc, v_desc
    n, hkv, d = k.shape
    dv = v.shape[-1]
    d1, d2 = split_qk_dim(d)
    k_desc = TensorDescriptor(k, [n, hkv * d], [k.stride(0), 1], [block_n, d1], _smem_layout(block_n, d1, k.dtype))
    k2_desc = k_desc
    if d2:
        k2_desc = TensorDescriptor(k, [n, hkv * d], [k.stride(0), 1], [block_n, d2], _smem_layout(block_n, d2, k.dtype))
    v_desc = TensorDescriptor(v, [n, hkv * dv], [v.stride(0), 1], [block_n, dv], _smem_layout(block_n, dv, v.dtype))
    return k_desc, k2_desc, v_desc


def ring_overlap(overlap: int, stages: int, gather: bool) -> int:
    """The consumers' ``OVERLAP`` on a ring of ``stages`` K/V stages: 0 where the cp.async gather
    loader runs on fewer than 3. That loader signals block j once block j + 1's copies are issued,
    into the slot of block j - 1 at 2 stages, while an overlapped consumer releases ``V_{j-1}``
    only after ``Q K_j^T``: each would wait for the other (a hang, seen on the H200 at D192 / 128,
    page 2). The TMA loaders signal each block by its own bytes and take any overlap."""
    return 0 if gather and stages < 3 else int(overlap)


def kernel_constexprs(d: int, dv: int, dtype: torch.dtype, page_size: Optional[int], block_n: int = 128,
                      stages: int = 3, overlap: int = 0, pingpong: bool = False, gather: bool = False,
                      persistent: bool = False) -> dict:
    """The kernel's geometry constexprs (tiles, stages, paging, shared-memory layouts, register
    split). ``gather``: a paged cache read by the cp.async loader (COPY_ROWS 0)."""
    d1, d2 = split_qk_dim(d)
    gather = bool(page_size) and (gather or not paged_copy_rows(page_size, block_n))
    elem = torch.empty((), dtype=dtype).element_size()
    stages = min(stages, max_stages(d, dv, block_n, elem))
    overlap = ring_overlap(overlap, stages, gather)
    return dict(
        BLOCK_M=CONSUMER_ROWS, BLOCK_N=block_n, HEAD_DIM=d1, HEAD_DIM2=d2, HEAD_DIM_V=dv,
        STAGES=stages, OVERLAP=overlap, PINGPONG=bool(pingpong and overlap), PAGE_SIZE=page_size or 0,
        COPY_ROWS=paged_copy_rows(page_size, block_n) if page_size and not gather else 0,
        Q_SMEM=_smem_layout(CONSUMER_ROWS, d1, dtype), Q2_SMEM=_smem_layout(CONSUMER_ROWS, max(d2, 16), dtype),
        K_SMEM=_smem_layout(block_n, d1, dtype), K2_SMEM=_smem_layout(block_n, max(d2, 16), dtype),
        V_SMEM=_smem_layout(block_n, dv, dtype),
        **(GATHER_REGS if gather else PAGED_REGS if page_size else PACKED_REGS), PERSISTENT=bool(persistent),
    )


#: Per-call arguments of the dense kernel, in the order of a launch's ``values`` (the gather
#: variant also takes ``k_desc`` / ``k2_desc`` / ``v_desc`` per call: the K/V tensors).
_PER_CALL = ("Q", "K", "V", "Out", "Lse", "Sinks", "PageTable", "qk_scale", "stride_qm", "stride_qh", "stride_om",
             "stride_oh", "stride_lm", "stride_lh", "stride_sink", "stride_pt", "stride_kp", "stride_kn", "stride_kh",
             "stride_vp", "stride_vn", "stride_vh", "HAS_SINKS", "RETURN_LSE")
_DESCRIPTORS = ("k_desc", "k2_desc", "v_desc")


def kv_key(k: Tensor, v: Tensor) -> tuple:
    """Everything of K/V a launch depends on: addresses, shapes, strides, dtype (the key of the
    plan's per-K/V facts and of its prepared TMA descriptors)."""
    return (k.data_ptr(), v.data_ptr(), k.shape, v.shape, k.stride(), v.stride(), k.dtype)


def kv_facts(k: Tensor, v: Tensor, block_n: int = 128):
    """``((page_size, gather), K/V stride ints, their key part)`` of a launch over these K/V, or
    False when the layout is not TMA-compatible (:func:`kv_layout_ok`: the portable kernel runs).
    Ints only: the plan caches these per :func:`kv_key`."""
    if not kv_layout_ok(k, v):
        return False
    paged = k.dim() == 4
    ints = kv_strides(k, v, paged)
    variant = (k.shape[1], not paged_tma_ok(k, v, block_n)) if paged else (None, False)
    return variant, ints, (k.data_ptr() & 15, v.data_ptr() & 15) + ints


def launch(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Optional[Tensor], sinks: Optional[Tensor],
    page_table: Optional[Tensor], *, grid: tuple[int], plan_args: dict, softmax_scale: float, block_n: int = 128,
    stages: int = 3, overlap: int = 0, pingpong: bool = False, persistent: bool = False, state=None,
) -> bool:
    """Launch the warp-specialized kernel into ``out`` / ``lse``: packed K/V ``[rows, Hkv, D]``,
    or paged caches ``[pages, page_size, Hkv, D]`` with ``page_table`` [B, max_pages] (int32 or
    int64). Returns False (and launches nothing) when the K/V layout is not TMA-compatible
    (:func:`kv_layout_ok`; the caller runs the portable kernel). ``plan_args``: the planned
    keyword arguments (tile map with its device tile count, segments, G_PACK, L2 section; see
    ``triton_backend``), whose tiles are ``NUM_CONSUMERS * CONSUMER_ROWS`` rows x heads.
    ``overlap`` 1 issues ``P_{j-1} V_{j-1}`` and ``Q K_j^T`` back to back, 2 also runs softmax_j
    under the first; ``pingpong`` (with ``overlap``) makes the two consumers take turns issuing
    their GEMMs. ``stages`` is capped by shared memory (D192/128 fits 2 at 128-key blocks).
    ``persistent``: ``grid`` is a number of resident programs that walk all work items (round by
    round, snake order; no pingpong), else one item per program. ``state``: the plan's
    :class:`~cpattn.kernels._launch.LaunchState` (per-K/V facts, a :class:`PlannedLaunch` per
    kernel variant with its prepared descriptors; None: every call through the JIT)."""

    if state is None:
        state = LaunchState(enabled=False)
    key_kv = kv_key(k, v)
    facts = state.kv.get(key_kv)
    if facts is None:
        facts = state.kv.put(key_kv, kv_facts(k, v, block_n))
    if facts is False:
        return False
    variant, kv_ints, kv_part = facts
    launcher = state.launchers.get(variant)
    page_size, gather = variant
    if launcher is None:
        fixed = dict(plan_args, **kernel_constexprs(q.shape[2], v.shape[-1], q.dtype, page_size, block_n, stages,
                                                    overlap, pingpong, gather, persistent), num_warps=4, maxnreg=168)
        if gather:  # no descriptors: the loader reads K / V through pointers
            launcher = PlannedLaunch(_cp_attn_fwd_sm90, fixed, _PER_CALL + _DESCRIPTORS, enabled=state.enabled,
                                     cache_size=state.cache_size)
        else:
            launcher = PlannedLaunch(_cp_attn_fwd_sm90, fixed, _PER_CALL, descriptors=_DESCRIPTORS,
                                     enabled=state.enabled, cache_size=state.cache_size)
        state.launchers[variant] = launcher
    has_sinks, has_lse = sinks is not None, lse is not None
    qs, os_ = q.stride(), out.stride()
    slm, slh = lse.stride() if has_lse else (0, 0)
    ssink = sinks.stride(0) if has_sinks else 0
    pt = page_table if page_table is not None else q
    spt = page_table.stride(0) if page_table is not None else 0
    values = (q, k, v, out, lse if has_lse else out, sinks if has_sinks else out, pt,
              float(softmax_scale) * LOG2E, qs[0], qs[1], os_[0], os_[1], slm, slh, ssink, spt) + kv_ints \
        + (has_sinks, has_lse)
    key = (q.dtype, q.data_ptr() & 15, out.data_ptr() & 15, lse.data_ptr() & 15 if has_lse else -1,
           (sinks.dtype, sinks.data_ptr() & 15) if has_sinks else None, (pt.dtype, pt.data_ptr() & 15),
           qs[0], qs[1], os_[0], os_[1], slm, slh, ssink, spt) + kv_part
    if gather:
        launcher(grid, values + (k, k, k), key)
    else:
        launcher(grid, values, key, key_kv, lambda: kv_descriptors(k, v, block_n))
    return True
