"""Absorbed-MLA prefill on Hopper (sm_90), written in Gluon: one KV head whose key is the
576-wide latent ``[kv_c (512) | k_pe (64)]`` and whose value is ``kv_c`` itself (``v`` a view of
``k[..., :512]``), many query heads (DeepSeek-V3: 128), many query rows.

Same contract and tile map as the other Triton families (a program = one query tile of one
segment x ``G_PACK`` query heads: 64 rows of (position, head), heads fastest). Dv = 512 fp32
accumulators do not fit one warpgroup, so the two consumer warpgroups share the tile's 64 rows
and split the output columns (warpgroup ``w`` owns columns ``[256 w, 256 w + 256)``), as FlashMLA
does on Hopper:

* a 1-warp **loader** streams 64-key blocks of the latent (72 KiB each: columns 0-255, 256-511
  and 512-575 in three tiles) into two shared-memory stages with TMA; the value block is the
  first two tiles of the same stage, so V is never loaded separately;
* block ``j`` is *owned* by warpgroup ``j % 2``: the owner computes ``S = Q K_j^T`` (three
  wgmmas over the three tiles, 64 x 64 x 576), the online softmax (running max carried from
  block ``j - 1``), writes ``P_j`` (bf16), the rescale factor and the new max to shared memory,
  signals the other warpgroup, and adds ``P_j V_j`` to its 256 columns with P from registers;
  the other warpgroup rescales its columns and adds ``P_j V_j`` with P from shared memory. The
  running max is one chain through the blocks, alternating between the warpgroups; each
  warpgroup issues its next ``Q K^T`` before waiting for the other's ``P``, so one warpgroup's
  softmax runs under the other's tensor-core work. Each warpgroup keeps a partial row sum of the
  probabilities it produced (both rescaled by every block's factor); the two are added at the end.

Shared memory: Q 72 KiB + 2 stages x 72 KiB + P 8 KiB (+ row vectors, barriers) = 225 KiB.
Paged caches are read with the dense kernel's scheme (TMA copies of ``gcd(page_size, 64)`` >= 8
rows per 64-column chunk, rows past the tile's last key clamped to its page and zeroed in each
warpgroup's value half of the last block). Causal masking, windows, sinks and LSE follow the
portable kernel exactly.

Two more modes run the same partitions: split-KV decode (:func:`_mla_decode_sm90`) and sparse
(DSA) attention (:func:`_mla_sparse_sm90`: a program = one query row x 64 heads, key block ``j``
= the latent rows its ``idx`` entries ``[64 j, 64 j + 64)`` select, gathered by a 4-warp
cp.async loader since TMA cannot gather rows on sm_90; per-key validity mask).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._launch import LaunchState, PlannedLaunch
from ._sm90_common import (HAVE_GLUON, TMA_CHUNK, hopper_reason, packed_layout_ok, paged_copy_rows,
                           paged_layout_ok, smem_layout)
from ._tiles import LOG2E

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    # calls spelled per triton release (see _sm90_common.RENAMED_CALLS)
    from ._sm90_common import (cp_async_load, cta_barrier, num_warps, smem_reinterpret, tma_load,
                               warp_specialize)
    from ._sm90_common import (key_range, kv_rows, local_key_count, page_of, page_row, softmax_block, tile_item,
                               zero_rows_from)

#: Latent width (values) and rotary width; D = 576, Dv = 512.
D_LATENT = 512
D_ROPE = 64
#: Output columns per consumer warpgroup (two warpgroups split Dv).
HALF_V = 256
#: Query rows x heads per program, keys per block, K stages.
BLOCK_M = 64
BLOCK_N = 64
STAGES = 2
#: setmaxnreg budget of each consumer warpgroup (the loader gets the rest of the 64512 registers
#: of a 384-thread launch at 168: 24 at 240, 40 at 232): paged caches with pages of fewer than 64
#: keys issue a page-table read per copy group and spill at 24; the sparse gather (4 rows' offsets
#: per thread, two blocks in flight) needs 40.
CONSUMER_REGS = {"packed": 240, "paged": 240, "paged_small": 232, "sparse": 232}


def unsupported_reason(d: int, dv: int, num_kv_heads: int, dtype: torch.dtype, page_size: Optional[int],
                       device: torch.device) -> Optional[str]:
    """Why the absorbed-MLA kernel cannot take this plan (None if it can; that ``v`` is a view of
    ``k[..., :512]`` and the layout are checked per layer by :func:`kv_layout_ok`)."""
    if (d, dv) != (D_LATENT + D_ROPE, D_LATENT):
        return f"head dims D={d}, Dv={dv} (the MLA kernel takes D={D_LATENT + D_ROPE}, Dv={D_LATENT})"
    if num_kv_heads != 1:
        return f"num_kv_heads={num_kv_heads} (absorbed MLA has one latent KV head)"
    if page_size is not None and not paged_copy_rows(page_size, BLOCK_N):
        return f"paged K/V with page_size={page_size} (TMA copies need gcd(page_size, {BLOCK_N}) >= 8)"
    return hopper_reason(dtype, device, "mla")


def sparse_unsupported_reason(d: int, dv: int, num_kv_heads: int, dtype: torch.dtype,
                              device: torch.device) -> Optional[str]:
    """Why the sparse (DSA) mode of the absorbed-MLA kernel cannot take this plan (None if it can):
    the dense conditions without the page-size one (the loader gathers row by row, any page
    size). That ``v`` is a view of ``k[..., :512]`` with 16-byte rows is checked per layer by
    :func:`sparse_layout_ok`."""
    return unsupported_reason(d, dv, num_kv_heads, dtype, None, device)


def sparse_layout_ok(k: Tensor, v: Tensor) -> bool:
    """``v`` is ``k[..., :512]`` (same storage and strides) and the latent rows are 16-byte
    aligned for the cp.async gather: packed ``[rows, 1, 576]`` or paged ``[pages, page_size, 1,
    576]``, last dim contiguous, base and row / page strides multiples of 16 bytes."""
    if v.data_ptr() != k.data_ptr() or v.stride() != k.stride() or v.shape[:-1] != k.shape[:-1]:
        return False
    if k.stride(-1) != 1 or k.data_ptr() % 16:
        return False
    outer = k.stride()[: k.dim() - 2]  # row (packed) or page and slot (paged) strides
    return all((st * k.element_size()) % 16 == 0 for st in outer)


def sparse_head_pack(num_q_heads: int) -> int:
    """Heads per program of the sparse mode: the largest divisor of ``num_q_heads`` <= 64 (128
    heads: 2 groups of 64; 16 heads: one group, M rows 16-63 masked)."""
    return max(g for g in range(1, min(BLOCK_M, num_q_heads) + 1) if num_q_heads % g == 0)


def kv_layout_ok(k: Tensor, v: Tensor) -> bool:
    """``v`` is ``k[..., :512]`` (same storage and strides) and ``k`` is TMA-compatible (packed
    ``[rows, 1, 576]`` or paged ``[pages, page_size, 1, 576]``, 16-byte rows)."""
    if v.data_ptr() != k.data_ptr() or v.stride() != k.stride() or v.shape[:-1] != k.shape[:-1]:
        return False
    return (paged_layout_ok if k.dim() == 4 else packed_layout_ok)(k)


if HAVE_GLUON:

    @gluon.jit
    def _mla_loader(smem, kv, rows, dec, W: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SINKS: gl.constexpr,
                    RETURN_LSE: gl.constexpr, G_PACK: gl.constexpr, PAGE_SIZE: gl.constexpr,
                    COPY_ROWS: gl.constexpr, SPARSE: gl.constexpr):
        """The default partition: TMA latent blocks ``n_lo + j * BLOCK_N`` (j < num_blocks) into the
        two stages (SPARSE: the cp.async gather of :func:`_mla_sparse_loader`)."""
        if SPARSE:
            _mla_sparse_loader(smem, kv, rows, dec, PAGE_SIZE)
        else:
            _mla_tma_loader(smem, kv, PAGE_SIZE, COPY_ROWS)

    @gluon.jit
    def _mla_sparse_rows(idx_row, j, topk, pos, kv_base, pt_row, stride_kp, stride_kn, layout: gl.constexpr,
                         BN: gl.constexpr, PAGE_SIZE: gl.constexpr):
        """Element offsets (int64) of the latent rows that entries ``[j * BN, j * BN + BN)`` of the
        query row's selection pick, and their validity (an entry ``>= 0``, ``<= pos`` and inside the
        selection), in the row slice of ``layout``. Packed: row ``kv_base + e``; paged: slot
        ``e % PAGE_SIZE`` of page ``page_table[seq, e // PAGE_SIZE]`` (read for valid entries only)."""
        n = j * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, layout))
        e = gl.load(idx_row + n, mask=n < topk, other=-1)
        ok = (e >= 0) & (e <= pos)
        p = gl.where(ok, e, 0).to(gl.int64)
        if PAGE_SIZE > 0:
            page = gl.load(pt_row + p // PAGE_SIZE, mask=ok, other=0).to(gl.int64)
            off = page * stride_kp + (p % PAGE_SIZE) * stride_kn
        else:
            off = (kv_base + p) * stride_kn
        return off, ok

    @gluon.jit
    def _mla_sparse_loader(smem, kv, rows, dec, PAGE_SIZE: gl.constexpr):
        """4 warps: cp.async the 64 latent rows that block ``j`` of the row's selection picks into
        stage ``j % 2`` (columns 0-255, 256-511, 512-575 as nine 64-column chunks; 8 threads x 16
        bytes per row and chunk, each thread 4 rows). Invalid entries are never read: their rows
        are zero-filled (so 0 * NaN cannot reach the output). Every loader thread arrives on the
        stage's ``k_ready`` (count 128) when its copies land (cp.async.mbarrier.arrive.noinc), so
        the loader never blocks on a copy: the next block's rows are looked up while the consumers
        work."""
        qa, qb, qr, ka, kb, kr, s_p, s_alpha, s_m, s_l, k_ready, kv_empty, q_bar, p_bar, l_bar = smem
        K, K2, kv_base, n_lo, num_blocks, key_end, pt_row = kv
        idx_row, topk, stride_kp, stride_kn = dec
        pos = rows[13]
        NSTAGE: gl.constexpr = ka.type.shape[0]
        BN: gl.constexpr = ka.type.shape[1]
        HALF: gl.constexpr = ka.type.shape[2]
        CHUNK: gl.constexpr = kr.type.shape[2]
        CH: gl.constexpr = HALF // CHUNK
        NW: gl.constexpr = num_warps()
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
        cols = gl.expand_dims(gl.arange(0, CHUNK, layout=gl.SliceLayout(0, layout)), 0)
        off_n, ok_n = _mla_sparse_rows(idx_row, 0, topk, pos, kv_base, pt_row, stride_kp, stride_kn, layout, BN,
                                       PAGE_SIZE)
        for j in range(num_blocks):
            off = off_n
            ok = ok_n
            slot = j % NSTAGE
            mbarrier.wait(kv_empty.index(slot), ((j // NSTAGE) & 1) ^ 1)
            ptrs = K + gl.expand_dims(off, 1) + cols
            mask = gl.expand_dims(ok, 1)
            a_chunks = smem_reinterpret(ka.index(slot), ka.dtype, [CH, BN, CHUNK], kr.type.layout)
            b_chunks = smem_reinterpret(kb.index(slot), kb.dtype, [CH, BN, CHUNK], kr.type.layout)
            for c in gl.static_range(CH):  # a / b alternate: one shared-memory barrier per chunk pair
                cp_async_load(a_chunks.index(c), ptrs + c * CHUNK, mask=mask)
                cp_async_load(b_chunks.index(c), ptrs + (HALF + c * CHUNK), mask=mask)
            cp_async_load(kr.index(slot), ptrs + 2 * HALF, mask=mask)
            async_copy.mbarrier_arrive(k_ready.index(slot), increment_count=False)
            # the next block's rows (index and page-table reads) while this one is in flight
            off_n, ok_n = _mla_sparse_rows(idx_row, j + 1, topk, pos, kv_base, pt_row, stride_kp, stride_kn, layout,
                                           BN, PAGE_SIZE)

    @gluon.jit
    def _mla_tma_loader(smem, kv, PAGE_SIZE: gl.constexpr, COPY_ROWS: gl.constexpr):
        """TMA latent blocks ``n_lo + j * BLOCK_N`` (j < num_blocks) into the two stages."""
        qa, qb, qr, ka, kb, kr, s_p, s_alpha, s_m, s_l, k_ready, kv_empty, q_bar, p_bar, l_bar = smem
        k_desc, kr_desc, kv_row_base, n_lo, num_blocks, key_end, pt_row = kv
        NSTAGE: gl.constexpr = ka.type.shape[0]
        BN: gl.constexpr = ka.type.shape[1]
        HALF: gl.constexpr = ka.type.shape[2]
        for j in range(num_blocks):
            slot = j % NSTAGE
            mbarrier.wait(kv_empty.index(slot), ((j // NSTAGE) & 1) ^ 1)
            if PAGE_SIZE > 0:
                NG: gl.constexpr = BN // COPY_ROWS
                CH: gl.constexpr = HALF // 64
                mbarrier.expect(k_ready.index(3 * slot), k_desc.block_type.nbytes * NG * CH)
                mbarrier.expect(k_ready.index(3 * slot + 1), k_desc.block_type.nbytes * NG * CH)
                mbarrier.expect(k_ready.index(3 * slot + 2), k_desc.block_type.nbytes * NG)
                a_pieces = smem_reinterpret(ka.index(slot), k_desc.dtype, [CH * NG, COPY_ROWS, 64], k_desc.layout)
                b_pieces = smem_reinterpret(kb.index(slot), k_desc.dtype, [CH * NG, COPY_ROWS, 64], k_desc.layout)
                r_pieces = smem_reinterpret(kr.index(slot), k_desc.dtype, [NG, COPY_ROWS, 64], k_desc.layout)
                start = n_lo + j * BN
                page_a, slot_a = page_of(pt_row, start, key_end - 1, PAGE_SIZE, COPY_ROWS)
                page_b, slot_b = page_of(pt_row, start + COPY_ROWS, key_end - 1, PAGE_SIZE, COPY_ROWS)
                for g in gl.static_range(NG):
                    row = page_row(page_a, slot_a, PAGE_SIZE)
                    page_a, slot_a = page_b, slot_b
                    if g + 2 < NG:
                        page_b, slot_b = page_of(pt_row, start + (g + 2) * COPY_ROWS, key_end - 1, PAGE_SIZE,
                                                 COPY_ROWS)
                    for c in gl.static_range(CH):
                        tma_load(k_desc, [row, c * 64], k_ready.index(3 * slot), a_pieces.index(c * NG + g))
                    for c in gl.static_range(CH):
                        tma_load(k_desc, [row, HALF + c * 64], k_ready.index(3 * slot + 1), b_pieces.index(c * NG + g))
                    tma_load(k_desc, [row, 2 * HALF], k_ready.index(3 * slot + 2), r_pieces.index(g))
            else:
                row = (kv_row_base + n_lo + j * BN).to(gl.int32)
                mbarrier.expect(k_ready.index(3 * slot), k_desc.block_type.nbytes)
                tma_load(k_desc, [row, 0], k_ready.index(3 * slot), ka.index(slot))
                mbarrier.expect(k_ready.index(3 * slot + 1), k_desc.block_type.nbytes)
                tma_load(k_desc, [row, HALF], k_ready.index(3 * slot + 1), kb.index(slot))
                mbarrier.expect(k_ready.index(3 * slot + 2), kr_desc.block_type.nbytes)
                tma_load(kr_desc, [row, 2 * HALF], k_ready.index(3 * slot + 2), kr.index(slot))

    @gluon.jit
    def _mla_fix_last_v(va_slot, vb_slot, jb, num_blocks, n_lo, key_end, PAGE_SIZE: gl.constexpr):
        """Zero both value halves of the last block past the tile's last key: unused slots of a
        paged cache, rows past a shard's keys or another sequence's keys of a packed one may hold
        NaN; P is 0 there, but 0 * NaN is not."""
        BN: gl.constexpr = va_slot.type.shape[0]
        valid = key_end - (n_lo + jb * BN)
        if (jb == num_blocks - 1) & (valid < BN):
            zero_rows_from(va_slot, valid, 4)
            zero_rows_from(vb_slot, valid, 4)

    @gluon.jit
    def _mla_pv_other(acc, l_i, m_i, s_p, s_alpha, s_m, v_buf, p_ready, phase, v_empty, o_rows: gl.constexpr,
                      s_rows: gl.constexpr, FENCE: gl.constexpr):
        """The other warpgroup's block: wait for its P (``p_ready``), rescale the accumulator and
        partial row sum by its factor, take its running max, add ``P V`` from shared memory and
        release this warpgroup's hold on the stage (``v_empty``). FENCE: a proxy fence after the
        wait (values gathered with cp.async)."""
        mbarrier.wait(p_ready, phase)
        if FENCE:
            fence_async_shared()
        alpha = s_alpha.load(o_rows)
        l_i = l_i * s_alpha.load(s_rows)
        m_i = s_m.load(s_rows)
        acc = acc * gl.expand_dims(alpha, 1)
        acc_f = warpgroup_mma(s_p, v_buf, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc_f, ))
        mbarrier.arrive(v_empty, count=1)
        return acc, l_i, m_i

    @gluon.jit
    def _mla_consumer(smem, kv, rows, dec, W: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SINKS: gl.constexpr,
                      RETURN_LSE: gl.constexpr, G_PACK: gl.constexpr, PAGE_SIZE: gl.constexpr,
                      COPY_ROWS: gl.constexpr, DECODE: gl.constexpr, CP_SIZE: gl.constexpr,
                      INTERLEAVE: gl.constexpr, SPARSE: gl.constexpr):
        """4 warps: output columns [W * 256, W * 256 + 256) of the tile's 64 rows; owns blocks j % 2 == W.

        DECODE: the tile is a split-KV work item (see :func:`_mla_decode_sm90`): row positions are
        global and map to local key counts of ``rank`` (CP_SIZE > 1), sinks count only when the
        item is its tile's only split (``ws < 0``), and the result goes to ``Out`` / ``Lse`` then,
        else as an fp32 partial into the workspace slot ``ws`` (DECODE == 2, pair mode: then merged
        with the other split's by whichever finishes second, :func:`_mla_pair_merge`). Its key loop
        adds the other warpgroup's block before waiting for its own (as SPARSE): the latent comes
        from DRAM, and that frees a stage for the loader one ``Q K^T`` earlier.

        SPARSE: the tile is one query row's heads (see :func:`_mla_sparse_sm90`); block ``j`` holds
        the latent rows of entries ``[64 j, 64 j + 64)`` of its selection, gathered with cp.async
        (made visible to wgmma by a proxy fence after each wait), and the mask is per key: an
        entry ``>= 0`` and ``<=`` the row's position (read from ``idx`` here, L1/L2-resident)."""
        qa, qb, qr, ka, kb, kr, s_p, s_alpha, s_m, s_l, k_ready, kv_empty, q_bar, p_bar, l_bar = smem
        k_desc, kr_desc, kv_row_base, n_lo, num_blocks, key_end, pt_row = kv
        (Q, Out, Lse, Sinks, stride_qm, stride_qh, stride_om, stride_oh, stride_lm, stride_lh,
         roff, slen, row0, pos0, pstride, hg, f_lo, f_hi, qk_scale, window, stride_sink) = rows
        NSTAGE: gl.constexpr = ka.type.shape[0]
        BN: gl.constexpr = ka.type.shape[1]
        HALF: gl.constexpr = ka.type.shape[2]
        ROPE: gl.constexpr = kr.type.shape[2]
        BM: gl.constexpr = qa.type.shape[1]
        dtype: gl.constexpr = ka.type.element_ty

        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BN, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HALF, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        if W == 0:
            v_bufs = ka
        else:
            v_bufs = kb

        # Q -> shared memory: warpgroup 0 columns 0-255 and 512-575, warpgroup 1 columns 256-511
        m_q = gl.arange(0, BM, layout=gl.SliceLayout(1, q_layout))
        r_q = roff + m_q // G_PACK
        head_q = hg * G_PACK + m_q % G_PACK
        q_rows = Q + gl.expand_dims((row0 + r_q).to(gl.int64) * stride_qm + head_q * stride_qh, 1)
        q_mask = gl.expand_dims(r_q < slen, 1)
        d_half = gl.arange(0, HALF, layout=gl.SliceLayout(0, q_layout))
        if W == 0:
            qa.index(0).store(gl.load(q_rows + gl.expand_dims(d_half, 0), mask=q_mask, other=0.0))
            d_rope = 2 * HALF + gl.arange(0, ROPE, layout=gl.SliceLayout(0, q_layout))
            qr.index(0).store(gl.load(q_rows + gl.expand_dims(d_rope, 0), mask=q_mask, other=0.0))
        else:
            qb.index(0).store(gl.load(q_rows + HALF + gl.expand_dims(d_half, 0), mask=q_mask, other=0.0))
        fence_async_shared()
        mbarrier.arrive(q_bar, count=1)
        mbarrier.wait(q_bar, 0)

        if DECODE:
            (WsO, WsLse, ws, rank, stride_wi, stride_wr, stride_wh, stride_li, stride_lr, PairSem, PairLse,
             num_head_groups) = dec
        if SPARSE:
            idx_row, topk, stride_kp, stride_kn = dec
        m_s = gl.arange(0, BM, layout=s_rows)
        pos = pos0 + (roff + m_s // G_PACK) * pstride
        if CP_SIZE > 1:  # global position -> the last local key it sees (keys are local indices)
            pos = local_key_count(pos + 1, rank, CP_SIZE, INTERLEAVE) - 1
        offs_n = gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
        if HAS_SINKS:
            m_i = gl.load(Sinks + (hg * G_PACK + m_s % G_PACK) * stride_sink).to(gl.float32) * 1.4426950408889634
            l_i = gl.full([BM], 1.0 - W, gl.float32, layout=s_rows)  # the sink's 1 is counted once
            if DECODE:  # a multi-split tile's sink joins in the combine
                m_i = gl.where(ws < 0, m_i, float("-inf"))
                l_i = gl.where(ws < 0, l_i, 0.0)
        else:
            m_i = gl.full([BM], float("-inf"), gl.float32, layout=s_rows)
            l_i = gl.full([BM], 0.0, gl.float32, layout=s_rows)
        acc = gl.zeros([BM, HALF], gl.float32, layout=o_layout)
        s_zero = gl.zeros([BM, BN], gl.float32, layout=s_layout)
        # no wgmma is in flight here, but ptxas cannot see that on the path from the other
        # partitions' code (Triton runs the worker partitions from one dispatch loop): without this
        # wait it injects one into the loop below, after this warpgroup's Q K^T_j and before the
        # rescale of O for P_{j-1} V_{j-1} (C7517 in warpgroup 0), serializing the two GEMMs
        acc = warpgroup_mma_wait(0, deps=(acc, ))

        # two stages, blocks alternate: this warpgroup's blocks always sit in stage W, the other's in
        # stage 1 - W (constant shared-memory addresses: the wgmma descriptors fold to immediates)
        gl.static_assert(NSTAGE == 2)
        slot: gl.constexpr = W
        # the other warpgroup's block first where keys come from far away (gathered, from DRAM in
        # decode, behind page-table reads); packed prefill (K in L2) issues its own Q K^T first
        PV_FIRST: gl.constexpr = SPARSE | (DECODE != 0) | (PAGE_SIZE > 0)
        other: gl.constexpr = 1 - W
        for j in range(W, num_blocks, 2):
            if PV_FIRST:
                # the other warpgroup's block j - 1 first: its stage is released before this
                # warpgroup waits for block j, so the load of block j + 1 into it never waits for
                # block j's (with two stages and keys gathered, read from DRAM as in decode, or
                # behind page-table reads, load latency would otherwise sit on every block's
                # critical path)
                if j > 0:
                    acc, l_i, m_i = _mla_pv_other(acc, l_i, m_i, s_p, s_alpha, s_m, v_bufs.index(other),
                                                  p_bar.index(W), ((j - 1) // 2) & 1, kv_empty.index(other),
                                                  o_rows, s_rows, SPARSE)
                if SPARSE:
                    mbarrier.wait(k_ready.index(slot), (j // NSTAGE) & 1)
                    fence_async_shared()  # cp.async (generic proxy) writes -> wgmma (async proxy) reads
                else:
                    mbarrier.wait(k_ready.index(3 * slot), (j // NSTAGE) & 1)
            else:
                mbarrier.wait(k_ready.index(3 * slot), (j // NSTAGE) & 1)
            # ``j >> 30`` is 0, but not provably so: the 36 Q / K tile descriptors of this block's
            # Q K^T are then built in the loop instead of hoisted into (spilled) registers
            z = j >> 30
            # TMA modes: columns 0-255, 256-511 and the rope part land on their own barriers, so
            # Q K^T starts on the first third of the block while the rest is still in flight
            s_f = warpgroup_mma(qa.index(z), ka.index(slot + z).permute((1, 0)), s_zero, use_acc=False,
                                is_async=True)
            if not SPARSE:
                mbarrier.wait(k_ready.index(3 * slot + 1), (j // NSTAGE) & 1)
            s_f = warpgroup_mma(qb.index(z), kb.index(slot + z).permute((1, 0)), s_f, is_async=True)
            if not SPARSE:
                mbarrier.wait(k_ready.index(3 * slot + 2), (j // NSTAGE) & 1)
            s_f = warpgroup_mma(qr.index(z), kr.index(slot + z).permute((1, 0)), s_f, is_async=True)
            if SPARSE:  # this block's entries (per-key mask), read while Q K^T runs
                kcol = j * BN + offs_n
                e = gl.load(idx_row + kcol, mask=kcol < topk, other=-1)
                keep = gl.expand_dims((e >= 0) & (e <= pos0), 0)
                s = warpgroup_mma_wait(0, deps=(s_f, ))
                s = gl.where(keep, s, float("-inf"))
            elif PV_FIRST:  # (not SPARSE) block j - 1 was added above
                s = warpgroup_mma_wait(0, deps=(s_f, ))
            elif j > 0:
                # block j - 1 (the other warpgroup's): rescale, add P_{j-1} V_{j-1} from shared memory,
                # while this block's scores are computed
                jr = j - 1
                mbarrier.wait(p_bar.index(W), (jr // 2) & 1)
                alpha = s_alpha.load(o_rows)
                l_i = l_i * s_alpha.load(s_rows)
                m_i = s_m.load(s_rows)
                acc = acc * gl.expand_dims(alpha, 1)
                acc_f = warpgroup_mma(s_p, v_bufs.index(other), acc, is_async=True)
                acc, s = warpgroup_mma_wait(0, deps=(acc_f, s_f))
                mbarrier.arrive(kv_empty.index(other), count=1)
            else:
                s = warpgroup_mma_wait(0, deps=(s_f, ))
            p, alpha, m_i, l_i = softmax_block(s, m_i, l_i, n_lo + j * BN, pos, f_lo, f_hi, window, qk_scale, offs_n,
                                               HAS_WINDOW)
            # hand P_j, its rescale factor and the running max to the other warpgroup, which writes
            # P_{j+1} over it once its own P_j V_j is done (so this warpgroup reads P_j from registers)
            p_lo = p.to(dtype)
            s_p.store(p_lo)
            s_alpha.store(alpha)
            s_m.store(m_i)
            # paged, last block: zero both value halves past the tile's last key before the other
            # warpgroup may read its half (after this warpgroup's Q K^T, with S no longer live)
            if not SPARSE:  # (the gather zero-fills the rows of invalid entries)
                _mla_fix_last_v(ka.index(slot), kb.index(slot), j, num_blocks, n_lo, key_end, PAGE_SIZE)
            fence_async_shared()
            mbarrier.arrive(p_bar.index(1 - W), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
            acc_f = warpgroup_mma(gl.convert_layout(p_lo, p_layout), v_bufs.index(slot), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc_f, ))
            mbarrier.arrive(kv_empty.index(slot), count=1)

        # the last block, when it is the other warpgroup's
        jl = num_blocks - 1
        if (num_blocks > 0) & (jl % 2 != W):
            acc, l_i, m_i = _mla_pv_other(acc, l_i, m_i, s_p, s_alpha, s_m, v_bufs.index(other), p_bar.index(W),
                                          (jl // 2) & 1, kv_empty.index(other), o_rows, s_rows, SPARSE)

        # epilogue: l = both partial sums; O / l (0 / -inf for rows that saw no key), LSE natural log
        s_l.slice(W * BM, BM).store(l_i)
        mbarrier.arrive(l_bar, count=1)
        mbarrier.wait(l_bar, 0)
        l_o = s_l.slice(0, BM).load(o_rows) + s_l.slice(BM, BM).load(o_rows)
        has_mass_o = l_o != 0.0
        out = acc * gl.expand_dims(gl.where(has_mass_o, 1.0 / gl.where(has_mass_o, l_o, 1.0), 0.0), 1)
        m_o = gl.arange(0, BM, layout=o_rows)
        r_o = roff + m_o // G_PACK
        head_o = hg * G_PACK + m_o % G_PACK
        d_o = W * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
        o_mask = gl.expand_dims(r_o < slen, 1)
        o_ptrs = Out + gl.expand_dims((row0 + r_o).to(gl.int64) * stride_om + head_o * stride_oh, 1) \
            + gl.expand_dims(d_o, 0)
        if DECODE:
            if ws >= 0:  # a split of a multi-split tile: its fp32 partial into the workspace
                w_ptrs = WsO + ws.to(gl.int64) * stride_wi \
                    + gl.expand_dims(r_o * stride_wr + head_o * stride_wh, 1) + gl.expand_dims(d_o, 0)
                gl.store(w_ptrs, out, mask=o_mask)
            else:
                gl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=o_mask)
        else:
            gl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=o_mask)
        if RETURN_LSE:
            # pair mode (DECODE == 2): each warpgroup publishes its own copy of a split's LSE
            # (warpgroup 1's in PairLse), so the two column halves merge independently
            if (W == 0) | (DECODE == 2):
                l_s = s_l.slice(0, BM).load(s_rows) + s_l.slice(BM, BM).load(s_rows)
                has_mass = l_s != 0.0
                lse = gl.where(has_mass, (m_i + gl.log2(gl.where(has_mass, l_s, 1.0))) * 0.6931471805599453,
                               float("-inf"))
                lse = gl.where(pos < 0, float("-inf"), lse)  # pad rows (pad segment, position -1)
                r_s = roff + m_s // G_PACK
                head_s = hg * G_PACK + m_s % G_PACK
                l_ptrs = Lse + (row0 + r_s).to(gl.int64) * stride_lm + head_s * stride_lh
                if DECODE:
                    if W == 0:
                        l_ws = WsLse
                    else:
                        l_ws = PairLse
                    if ws >= 0:
                        gl.store(l_ws + ws.to(gl.int64) * stride_li + r_s * stride_lr + head_s, lse, mask=r_s < slen)
                    elif W == 0:
                        gl.store(l_ptrs, lse, mask=r_s < slen)
                else:
                    gl.store(l_ptrs, lse, mask=r_s < slen)
        if DECODE == 2:
            if ws >= 0:
                _mla_pair_merge(Out, Lse, Sinks, WsO, WsLse, PairLse, PairSem, ws, hg, num_head_groups, roff, slen,
                                row0, stride_om, stride_oh, stride_lm, stride_lh, stride_sink, stride_wi, stride_wr,
                                stride_wh, stride_li, stride_lr, W, BM, HALF, G_PACK, HAS_SINKS)

    @gluon.jit
    def _mla_pair_merge(Out, Lse, Sinks, WsO, WsLse, PairLse, PairSem, ws, hg, num_head_groups, roff, slen, row0,
                        stride_om, stride_oh, stride_lm, stride_lh, stride_sink, stride_wi, stride_wr, stride_wh,
                        stride_li, stride_lr, W: gl.constexpr, BM: gl.constexpr, HALF: gl.constexpr,
                        G_PACK: gl.constexpr, HAS_SINKS: gl.constexpr):
        """Pair mode (every multi-split tile has two splits, workspace slots ``2 p`` and ``2 p + 1``):
        after this warpgroup has published its split's partial (columns ``[W * HALF, W * HALF +
        HALF)``, fp32) and LSE, it takes a ticket on its (pair, head group, warpgroup) counter; the
        second of the two splits' warpgroups merges both published halves exactly (split 0 then
        split 1, whoever comes second: the same result either way; the sink, if any, joins the
        denominator; weight-0 parts are not read, a NaN LSE makes the row NaN) into ``Out`` (and,
        warpgroup 0, ``Lse``) and resets the counter for the next launch. No combine kernel runs."""
        cta_barrier()  # this warpgroup's partial and LSE stores precede the ticket (release, gpu scope)
        sem = PairSem + ((ws // 2) * num_head_groups + hg) * 2 + W
        ticket = gl.atomic_add(sem, 1, sem="acq_rel", scope="gpu")
        if ticket == 1:
            gl.store(sem, 0)
            CW: gl.constexpr = 128  # columns per pass: both parts of a pass in flight together
            layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
            rows_l: gl.constexpr = gl.SliceLayout(1, layout)
            m = gl.arange(0, BM, layout=rows_l)
            r = roff + m // G_PACK
            head = hg * G_PACK + m % G_PACK
            live = r < slen
            if W == 0:
                l_ws = WsLse
            else:
                l_ws = PairLse
            s0 = (ws - ws % 2).to(gl.int64)
            l_off = r * stride_lr + head
            l0 = gl.load(l_ws + s0 * stride_li + l_off, mask=live, other=float("-inf"), cache_modifier=".cg")
            l1 = gl.load(l_ws + (s0 + 1) * stride_li + l_off, mask=live, other=float("-inf"), cache_modifier=".cg")
            if HAS_SINKS:
                sink = gl.load(Sinks + head * stride_sink).to(gl.float32)
            else:
                sink = gl.full([BM], float("-inf"), gl.float32, layout=rows_l)
            top = gl.maximum(sink, gl.maximum(l0, l1))
            shift = gl.where(top == float("-inf"), 0.0, top)
            w0 = gl.exp(gl.where(l0 == shift, 0.0, l0 - shift))
            w1 = gl.exp(gl.where(l1 == shift, 0.0, l1 - shift))
            total = w0 + w1
            if HAS_SINKS:
                total += gl.where(sink == shift, 1.0, gl.exp(sink - shift))
            has_mass = total != 0.0
            inv = gl.expand_dims(gl.where(has_mass, 1.0 / gl.where(has_mass, total, 1.0), 0.0), 1)
            use0 = gl.expand_dims(live & (w0 != 0.0), 1)  # NaN != 0: a NaN weight reads its part
            use1 = gl.expand_dims(live & (w1 != 0.0), 1)
            w0 = gl.expand_dims(w0, 1)
            w1 = gl.expand_dims(w1, 1)
            p_off = gl.expand_dims(r * stride_wr + head * stride_wh, 1)
            o_ptr = Out + gl.expand_dims((row0 + r).to(gl.int64) * stride_om + head * stride_oh, 1)
            o_mask = gl.expand_dims(live, 1)
            for c in gl.static_range(HALF // CW):
                cols = gl.expand_dims(W * HALF + c * CW + gl.arange(0, CW, layout=gl.SliceLayout(0, layout)), 0)
                o0 = gl.load(WsO + s0 * stride_wi + p_off + cols, mask=use0, other=0.0, cache_modifier=".cg")
                o1 = gl.load(WsO + (s0 + 1) * stride_wi + p_off + cols, mask=use1, other=0.0, cache_modifier=".cg")
                acc = gl.where(use0, w0 * o0, 0.0) + gl.where(use1, w1 * o1, 0.0)
                gl.store(o_ptr + cols, (acc * inv).to(Out.dtype.element_ty), mask=o_mask)
            if W == 0:
                lse = gl.where(has_mass, shift + gl.log(gl.where(has_mass, total, 1.0)), float("-inf"))
                gl.store(Lse + (row0 + r).to(gl.int64) * stride_lm + head * stride_lh, lse, mask=live)

    @gluon.jit
    def _mla_consumer0(smem, kv, rows, dec, HAS_WINDOW: gl.constexpr, HAS_SINKS: gl.constexpr,
                       RETURN_LSE: gl.constexpr, G_PACK: gl.constexpr, PAGE_SIZE: gl.constexpr,
                       COPY_ROWS: gl.constexpr, DECODE: gl.constexpr, CP_SIZE: gl.constexpr,
                       INTERLEAVE: gl.constexpr, SPARSE: gl.constexpr):
        _mla_consumer(smem, kv, rows, dec, 0, HAS_WINDOW, HAS_SINKS, RETURN_LSE, G_PACK, PAGE_SIZE, COPY_ROWS,
                      DECODE, CP_SIZE, INTERLEAVE, SPARSE)

    @gluon.jit
    def _mla_consumer1(smem, kv, rows, dec, HAS_WINDOW: gl.constexpr, HAS_SINKS: gl.constexpr,
                       RETURN_LSE: gl.constexpr, G_PACK: gl.constexpr, PAGE_SIZE: gl.constexpr,
                       COPY_ROWS: gl.constexpr, DECODE: gl.constexpr, CP_SIZE: gl.constexpr,
                       INTERLEAVE: gl.constexpr, SPARSE: gl.constexpr):
        _mla_consumer(smem, kv, rows, dec, 1, HAS_WINDOW, HAS_SINKS, RETURN_LSE, G_PACK, PAGE_SIZE, COPY_ROWS,
                      DECODE, CP_SIZE, INTERLEAVE, SPARSE)

    @gluon.jit
    def _mla_run(Q, k_desc, kr_desc, Out, Lse, Sinks, kv_row_base, pt_row, n_lo, num_blocks, key_end,
                 stride_qm, stride_qh, stride_om, stride_oh, stride_lm, stride_lh, stride_sink,
                 roff, slen, row0, pos0, pstride, hg, f_lo, f_hi, qk_scale, window, dec,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HALF: gl.constexpr, ROPE: gl.constexpr,
                 STAGES: gl.constexpr, G_PACK: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SINKS: gl.constexpr,
                 RETURN_LSE: gl.constexpr, PAGE_SIZE: gl.constexpr, COPY_ROWS: gl.constexpr,
                 Q_SMEM: gl.constexpr, QR_SMEM: gl.constexpr, K_SMEM: gl.constexpr, KR_SMEM: gl.constexpr,
                 P_SMEM: gl.constexpr, CONSUMER_REGS: gl.constexpr, DECODE: gl.constexpr, CP_SIZE: gl.constexpr,
                 INTERLEAVE: gl.constexpr, SPARSE: gl.constexpr):
        """Shared memory, barriers and the three partitions of one program (prefill, decode and
        sparse). ``k_desc`` / ``kr_desc``: the latent's TMA descriptors, or (SPARSE) its pointer."""
        dt = Q.dtype.element_ty
        qa = gl.allocate_shared_memory(dt, [1, BLOCK_M, HALF], Q_SMEM)
        qb = gl.allocate_shared_memory(dt, [1, BLOCK_M, HALF], Q_SMEM)
        qr = gl.allocate_shared_memory(dt, [1, BLOCK_M, ROPE], QR_SMEM)
        ka = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, HALF], K_SMEM)
        kb = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, HALF], K_SMEM)
        kr = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, ROPE], KR_SMEM)
        s_p = gl.allocate_shared_memory(dt, [BLOCK_M, BLOCK_N], P_SMEM)
        vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        s_alpha = gl.allocate_shared_memory(gl.float32, [BLOCK_M], vec)
        s_m = gl.allocate_shared_memory(gl.float32, [BLOCK_M], vec)
        s_l = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_M], vec)
        # TMA modes: three per stage (barrier 3 s + 0 / 1 / 2: columns 0-255 / 256-511 / the rope
        # part); SPARSE uses the first STAGES (one cp.async arrival per loader thread)
        k_ready = gl.allocate_shared_memory(gl.int64, [3 * STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        p_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        l_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            if SPARSE:  # one cp.async arrival per loader thread (the default partition's warps)
                mbarrier.init(k_ready.index(i), count=32 * num_warps())
            else:  # the loader's expect-tx arrival, one per part
                for p in gl.static_range(3):
                    mbarrier.init(k_ready.index(3 * i + p), count=1)
            mbarrier.init(kv_empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(p_bar.index(i), count=1)
        mbarrier.init(q_bar, count=2)
        mbarrier.init(l_bar, count=2)

        smem = (qa, qb, qr, ka, kb, kr, s_p, s_alpha, s_m, s_l, k_ready, kv_empty, q_bar, p_bar, l_bar)
        kv = (k_desc, kr_desc, kv_row_base, n_lo, num_blocks, key_end, pt_row)
        rows = (Q, Out, Lse, Sinks, stride_qm, stride_qh, stride_om, stride_oh, stride_lm, stride_lh,
                roff, slen, row0, pos0, pstride, hg, f_lo, f_hi, qk_scale, window, stride_sink)
        # flags in tuple literals (a tuple assigned to a name turns its constexprs into runtime values);
        # the two consumers take the same arguments (triton 3.5 passes one tuple to every worker)
        warp_specialize([
            (_mla_loader, (smem, kv, rows, dec, 0, HAS_WINDOW, HAS_SINKS, RETURN_LSE, G_PACK, PAGE_SIZE, COPY_ROWS,
                           SPARSE)),
            (_mla_consumer0, (smem, kv, rows, dec, HAS_WINDOW, HAS_SINKS, RETURN_LSE, G_PACK, PAGE_SIZE,
                              COPY_ROWS, DECODE, CP_SIZE, INTERLEAVE, SPARSE)),
            (_mla_consumer1, (smem, kv, rows, dec, HAS_WINDOW, HAS_SINKS, RETURN_LSE, G_PACK, PAGE_SIZE,
                              COPY_ROWS, DECODE, CP_SIZE, INTERLEAVE, SPARSE)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])

    @gluon.jit
    def _mla_fwd_sm90(
        Q, k_desc, kr_desc, Out, Lse, Sinks, PageTable,
        tile_segment, tile_row_offset, NumTiles,
        seg_seq, seg_row0, seg_len, seg_pos0, seg_stride, cu_kv_lens,
        qk_scale, window, num_head_groups, heads_per_section, group_size,
        stride_qm, stride_qh, stride_om, stride_oh, stride_lm, stride_lh, stride_sink, stride_pt,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HALF: gl.constexpr, ROPE: gl.constexpr, STAGES: gl.constexpr,
        G_PACK: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SINKS: gl.constexpr, RETURN_LSE: gl.constexpr,
        PAGE_SIZE: gl.constexpr, COPY_ROWS: gl.constexpr,
        Q_SMEM: gl.constexpr, QR_SMEM: gl.constexpr, K_SMEM: gl.constexpr, KR_SMEM: gl.constexpr,
        P_SMEM: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    ):
        ROWS: gl.constexpr = BLOCK_M // G_PACK
        # program -> (tile, head group) by L2 sections; programs past the device tile count run no
        # key block and store nothing (slen 0)
        live, hg, seq, roff, slen, row0, pos0, pstride, pos_min, pos_max = tile_item(
            gl.program_id(0), NumTiles, num_head_groups, heads_per_section, tile_segment, tile_row_offset, seg_seq,
            seg_row0, seg_len, seg_pos0, seg_stride, ROWS)
        kv_row_base, pt_row = kv_rows(seq, cu_kv_lens, PageTable, stride_pt, PAGE_SIZE)
        key_end, n_lo, f_lo, f_hi, num_blocks = key_range(live, pos_min, pos_max, window, BLOCK_N, HAS_WINDOW)

        dec = ()  # prefill: no workspace
        _mla_run(Q, k_desc, kr_desc, Out, Lse, Sinks, kv_row_base, pt_row, n_lo, num_blocks, key_end,
                 stride_qm, stride_qh, stride_om, stride_oh, stride_lm, stride_lh, stride_sink,
                 roff, slen, row0, pos0, pstride, hg, f_lo, f_hi, qk_scale, window, dec,
                 BLOCK_M, BLOCK_N, HALF, ROPE, STAGES, G_PACK, HAS_WINDOW, HAS_SINKS, RETURN_LSE, PAGE_SIZE, COPY_ROWS,
                 Q_SMEM, QR_SMEM, K_SMEM, KR_SMEM, P_SMEM, CONSUMER_REGS, False, 1, 1, False)

    @gluon.jit
    def _mla_decode_sm90(
        Q, k_desc, kr_desc, Out, Lse, Sinks, PageTable, WsO, WsLse, PairSem, PairLse,
        item_seq, item_r0, item_k0, item_k1, item_ws, NumItems, q_lens, seq_lens, cu_q_lens, cu_local_kv,
        qk_scale, rank, num_head_groups,
        stride_qm, stride_qh, stride_om, stride_oh, stride_lm, stride_lh, stride_sink, stride_pt,
        stride_wi, stride_wr, stride_wh, stride_li, stride_lr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HALF: gl.constexpr, ROPE: gl.constexpr, STAGES: gl.constexpr,
        G_PACK: gl.constexpr, HAS_SINKS: gl.constexpr, PAGE_SIZE: gl.constexpr, COPY_ROWS: gl.constexpr,
        CP_SIZE: gl.constexpr, INTERLEAVE: gl.constexpr,
        Q_SMEM: gl.constexpr, QR_SMEM: gl.constexpr, K_SMEM: gl.constexpr, KR_SMEM: gl.constexpr,
        P_SMEM: gl.constexpr, CONSUMER_REGS: gl.constexpr, PAIR: gl.constexpr, PDL: gl.constexpr = False,
    ):
        """Split-KV decode over one rank's key shard: a program = one work item (a query tile of
        ``BLOCK_M / G_PACK`` rows of one sequence and a range ``[k0, k1)`` of its local keys, see
        :mod:`.decode_backend`) x one head group. Items past the device count exit. PAIR: every
        multi-split tile has two splits, merged by the second to finish (:func:`_mla_pair_merge`;
        ``PairSem`` int32 [pairs x head groups x 2] zeros, ``PairLse`` fp32 like ``WsLse``) instead
        of the combine kernel. PDL: let the next kernel of the stream (the combine, launched with
        programmatic dependent launch) start now: its programs take SMs as this kernel's leave
        and wait (``griddepcontrol.wait``) for its completion before reading the partials."""
        ROWS: gl.constexpr = BLOCK_M // G_PACK
        if PDL:  # Gluon has no gdc builtin: the PTX of triton's gdc_launch_dependents
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
        pid = gl.program_id(0)
        item = pid // num_head_groups
        hg = pid - item * num_head_groups
        live = item < gl.load(NumItems)
        item = gl.where(live, item, 0)
        seq = gl.load(item_seq + item)
        r0 = gl.load(item_r0 + item)
        k0 = gl.load(item_k0 + item)
        k1 = gl.load(item_k1 + item)
        ws = gl.load(item_ws + item)
        q_len = gl.load(q_lens + seq)
        pos0 = gl.load(seq_lens + seq) - q_len + r0  # global position of the tile's first row
        slen = gl.where(live, gl.minimum(q_len - r0, ROWS), 0)
        row0 = gl.load(cu_q_lens + seq) + r0
        if CP_SIZE > 1:
            first_local = local_key_count(pos0 + 1, rank, CP_SIZE, INTERLEAVE) - 1
        else:
            first_local = pos0
        # key blocks every row sees whole: below the first row's last visible local key
        f_lo = pos0 * 0
        f_hi = gl.maximum(((first_local + 1) // BLOCK_N) * BLOCK_N, 0)
        num_blocks = gl.where(live, gl.maximum(gl.cdiv(k1 - k0, BLOCK_N), 0), 0)
        kv_row_base, pt_row = kv_rows(seq, cu_local_kv, PageTable, stride_pt, PAGE_SIZE)
        dec = (WsO, WsLse, ws, rank, stride_wi, stride_wr, stride_wh, stride_li, stride_lr, PairSem, PairLse,
               num_head_groups)
        MODE: gl.constexpr = 2 if PAIR else 1
        _mla_run(Q, k_desc, kr_desc, Out, Lse, Sinks, kv_row_base, pt_row, k0, num_blocks, k1,
                 stride_qm, stride_qh, stride_om, stride_oh, stride_lm, stride_lh, stride_sink,
                 seq * 0, slen, row0, pos0, 1, hg, f_lo, f_hi, qk_scale, -1, dec,
                 BLOCK_M, BLOCK_N, HALF, ROPE, STAGES, G_PACK, False, HAS_SINKS, True, PAGE_SIZE, COPY_ROWS,
                 Q_SMEM, QR_SMEM, K_SMEM, KR_SMEM, P_SMEM, CONSUMER_REGS, MODE, CP_SIZE, INTERLEAVE, False)

    @gluon.jit
    def _mla_sparse_sm90(
        Q, K, Idx, Out, Lse, Sinks, PageTable, row_seq, row_pos, row_kv_start,
        qk_scale, topk, num_head_groups,
        stride_qm, stride_qh, stride_im, stride_om, stride_oh, stride_lm, stride_lh, stride_sink, stride_pt,
        stride_kp, stride_kn,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HALF: gl.constexpr, ROPE: gl.constexpr, STAGES: gl.constexpr,
        G_PACK: gl.constexpr, HAS_SINKS: gl.constexpr, RETURN_LSE: gl.constexpr, PAGE_SIZE: gl.constexpr,
        Q_SMEM: gl.constexpr, QR_SMEM: gl.constexpr, K_SMEM: gl.constexpr, KR_SMEM: gl.constexpr,
        P_SMEM: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    ):
        """Sparse (DSA) attention: a program = one physical query row x one group of ``G_PACK``
        heads (the 64 M rows; with fewer heads the rows past them are masked), the row's head
        groups adjacent in the grid (the second reads the gathered rows from L2). Its
        ``ceil(topk / 64)`` key blocks are the latent rows its ``idx`` entries select (see
        :func:`_mla_sparse_loader`); pad rows (position -1) run no block and write 0 / -inf."""
        pid = gl.program_id(0)
        row = pid // num_head_groups
        hg = pid - row * num_head_groups
        pos = gl.load(row_pos + row)
        seq = gl.load(row_seq + row)
        kv_base = gl.load(row_kv_start + row).to(gl.int64)
        num_blocks = gl.where(pos >= 0, gl.cdiv(topk, BLOCK_N), 0)
        idx_row = Idx + row.to(gl.int64) * stride_im
        if PAGE_SIZE > 0:
            pt_row = PageTable + seq.to(gl.int64) * stride_pt
        else:
            pt_row = PageTable
        zero = pid * 0
        big = zero + (1 << 30)  # no positional mask: f_lo = 0 <= block starts < f_hi
        dec = (idx_row, topk, stride_kp, stride_kn)
        _mla_run(Q, K, K, Out, Lse, Sinks, kv_base, pt_row, zero, num_blocks, big,
                 stride_qm, stride_qh, stride_om, stride_oh, stride_lm, stride_lh, stride_sink,
                 zero, zero + 1, row, pos, zero, hg, zero, big, qk_scale, zero - 1, dec,
                 BLOCK_M, BLOCK_N, HALF, ROPE, STAGES, G_PACK, False, HAS_SINKS, RETURN_LSE, PAGE_SIZE, 0,
                 Q_SMEM, QR_SMEM, K_SMEM, KR_SMEM, P_SMEM, CONSUMER_REGS, False, 1, 1, True)


def k_descriptors(k: Tensor):
    """Host TMA descriptors over the latent seen as ``[rows, 576]``: packed ``[rows, 1, 576]``:
    ``[64, 256]`` blocks (value halves, columns 0 and 256) and ``[64, 64]`` (rotary part, column
    512); paged ``[pages, page_size, 1, 576]`` (rows = pages x page_size): copies of
    ``[gcd(page_size, 64), 64]`` for every part (the second descriptor is the first)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    width = D_LATENT + D_ROPE
    if k.dim() == 4:
        pages, page = k.shape[0], k.shape[1]
        g = paged_copy_rows(page, BLOCK_N)
        desc = TensorDescriptor(k, [pages * page, width], [k.stride(1), 1], [g, TMA_CHUNK],
                                smem_layout(g, TMA_CHUNK, k.dtype))
        return desc, desc
    n = k.shape[0]
    k_desc = TensorDescriptor(k, [n, width], [k.stride(0), 1], [BLOCK_N, HALF_V], smem_layout(BLOCK_N, HALF_V, k.dtype))
    kr_desc = TensorDescriptor(k, [n, width], [k.stride(0), 1], [BLOCK_N, D_ROPE], smem_layout(BLOCK_N, D_ROPE, k.dtype))
    return k_desc, kr_desc


def _consumer_regs(page_size: Optional[int]) -> int:
    if not page_size:
        return CONSUMER_REGS["packed"]
    return CONSUMER_REGS["paged" if paged_copy_rows(page_size, BLOCK_N) == BLOCK_N else "paged_small"]


def kernel_constexprs(dtype: torch.dtype, page_size: Optional[int]) -> dict:
    """The kernel's geometry constexprs (tiles, paging, shared-memory layouts, registers)."""
    return dict(
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HALF=HALF_V, ROPE=D_ROPE, STAGES=STAGES, PAGE_SIZE=page_size or 0,
        COPY_ROWS=paged_copy_rows(page_size, BLOCK_N) if page_size else 0,
        Q_SMEM=smem_layout(BLOCK_M, HALF_V, dtype), QR_SMEM=smem_layout(BLOCK_M, D_ROPE, dtype),
        K_SMEM=smem_layout(BLOCK_N, HALF_V, dtype), KR_SMEM=smem_layout(BLOCK_N, D_ROPE, dtype),
        P_SMEM=smem_layout(BLOCK_M, BLOCK_N, dtype), CONSUMER_REGS=_consumer_regs(page_size),
    )


def sparse_constexprs(dtype: torch.dtype, page_size: Optional[int]) -> dict:
    """The sparse kernel's geometry constexprs: the dense ones without TMA copy groups (its loader
    gathers rows with cp.async) and the sparse register split."""
    consts = kernel_constexprs(dtype, page_size)
    del consts["COPY_ROWS"]
    consts["CONSUMER_REGS"] = CONSUMER_REGS["sparse"]
    return consts


#: Per-call arguments of the MLA kernel, in the order of a launch's ``values``.
_PER_CALL = ("Q", "Out", "Lse", "Sinks", "PageTable", "qk_scale", "stride_qm", "stride_qh", "stride_om", "stride_oh",
             "stride_lm", "stride_lh", "stride_sink", "stride_pt", "HAS_SINKS", "RETURN_LSE")
_DESCRIPTORS = ("k_desc", "kr_desc")


def kv_key(k: Tensor, v: Tensor) -> tuple:
    """Everything of the latent (and its value view) a launch depends on: addresses, shapes,
    strides, dtype (the key of the plan's per-K/V facts and of its prepared TMA descriptors)."""
    return (k.data_ptr(), v.data_ptr(), k.shape, v.shape, k.stride(), v.stride(), k.dtype)


def _latent_page_size(state, k: Tensor, v: Tensor) -> tuple[tuple, int]:
    """``(kv_key(k, v), page size)`` of the latent for the TMA kernels: 0 packed, -1 not
    TMA-compatible (:func:`kv_layout_ok`); cached per K/V layout in ``state.kv``."""
    key_kv = kv_key(k, v)
    page_size = state.kv.get(key_kv)
    if page_size is None:
        page_size = state.kv.put(key_kv, -1 if not kv_layout_ok(k, v) else k.shape[1] if k.dim() == 4 else 0)
    return key_kv, page_size


def _latent_launcher(state, variant, kernel: str, per_call: tuple, plan_args: dict, dtype: torch.dtype,
                     page_size: int):
    """The plan's :class:`~cpattn.kernels._launch.PlannedLaunch` ``variant`` of the latent-TMA
    kernel named ``kernel`` (``page_size`` 0: packed), created on first use with the plan's fixed
    arguments (the kernel is looked up only then: it exists only where Gluon does)."""

    launcher = state.launchers.get(variant)
    if launcher is None:
        fixed = dict(plan_args, **kernel_constexprs(dtype, page_size or None), num_warps=4, maxnreg=168)
        launcher = state.launchers[variant] = PlannedLaunch(globals()[kernel], fixed, per_call,
                                                            descriptors=_DESCRIPTORS, enabled=state.enabled,
                                                            cache_size=state.cache_size)
    return launcher


def launch(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Optional[Tensor], sinks: Optional[Tensor],
    page_table: Optional[Tensor], *, grid: tuple[int], plan_args: dict, softmax_scale: float, state=None,
) -> bool:
    """Launch the absorbed-MLA kernel into ``out`` [P, Hq, 512] / ``lse``: q [P, Hq, 576], k the
    latent (packed ``[rows, 1, 576]`` or paged ``[pages, page_size, 1, 576]`` with
    ``page_table``), ``v`` = ``k[..., :512]`` (never read). Returns False (and launches nothing)
    when :func:`kv_layout_ok` does not hold (the caller runs the portable kernel). ``plan_args``:
    the planned tile map, segments, G_PACK, L2 section (``triton_backend``), for tiles of
    :data:`BLOCK_M` rows x heads. ``state``: the plan's :class:`~cpattn.kernels._launch.LaunchState`
    (per-K/V facts, a :class:`PlannedLaunch` per variant with its prepared descriptors; None:
    every call through the JIT)."""

    if state is None:
        state = LaunchState(enabled=False)
    key_kv, page_size = _latent_page_size(state, k, v)
    if page_size < 0:
        return False
    launcher = _latent_launcher(state, page_size, "_mla_fwd_sm90", _PER_CALL, plan_args, q.dtype, page_size)
    has_sinks, has_lse = sinks is not None, lse is not None
    qs, os_ = q.stride(), out.stride()
    slm, slh = lse.stride() if has_lse else (0, 0)
    ssink = sinks.stride(0) if has_sinks else 0
    pt = page_table if page_table is not None else q
    spt = page_table.stride(0) if page_table is not None else 0
    values = (q, out, lse if has_lse else out, sinks if has_sinks else out, pt, float(softmax_scale) * LOG2E,
              qs[0], qs[1], os_[0], os_[1], slm, slh, ssink, spt, has_sinks, has_lse)
    key = (q.dtype, q.data_ptr() & 15, out.data_ptr() & 15, lse.data_ptr() & 15 if has_lse else -1,
           (sinks.dtype, sinks.data_ptr() & 15) if has_sinks else None, (pt.dtype, pt.data_ptr() & 15),
           qs[0], qs[1], os_[0], os_[1], slm, slh, ssink, spt)
    launcher(grid, values, key, key_kv, lambda: k_descriptors(k))
    return True


#: Per-call arguments of the split-KV decode kernel, in the order of a launch's ``values``.
_DECODE_PER_CALL = ("Q", "Out", "Lse", "Sinks", "PageTable", "WsO", "WsLse", "qk_scale", "stride_qm", "stride_qh",
                    "stride_om", "stride_oh", "stride_lm", "stride_lh", "stride_sink", "stride_pt", "stride_wi",
                    "stride_wr", "stride_wh", "stride_li", "stride_lr", "HAS_SINKS")


def launch_decode(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, sinks: Optional[Tensor],
    page_table: Optional[Tensor], ws, *, grid: tuple[int], plan_args: dict, softmax_scale: float, state=None,
) -> bool:
    """Launch the split-KV decode kernel over one rank's latent shard: q [N, Hq, 576], k packed
    ``[rows, 1, 576]`` (local key j of sequence b at row ``cu_local_kv[b] + j``) or paged
    ``[pages, page_size, 1, 576]`` with ``page_table`` [B, pages per sequence] (local key j at
    page ``page_table[b, j // page_size]``), ``v`` = ``k[..., :512]`` (never read); out [N, Hq, 512],
    lse float32 [N, Hq]; ``ws``: the plan's :class:`~cpattn.kernels.triton_decode.Workspace`
    (fp32 partials [slots, BLOCK_M / G_PACK, Hq, 512] and LSEs of multi-split tiles, merged by the
    decode family's combine kernel). ``plan_args``: the work items and geometry planned by
    :mod:`.decode_backend`. Returns False (launching nothing) when :func:`kv_layout_ok` does not
    hold. ``state``: the plan's :class:`~cpattn.kernels._launch.LaunchState` (None: every call
    through the JIT)."""

    if state is None:
        state = LaunchState(enabled=False)
    key_kv, page_size = _latent_page_size(state, k, v)
    if page_size < 0:
        return False
    launcher = _latent_launcher(state, ("decode", page_size), "_mla_decode_sm90", _DECODE_PER_CALL, plan_args,
                                q.dtype, page_size)
    has_sinks = sinks is not None
    qs, os_, ls = q.stride(), out.stride(), lse.stride()
    ssink = sinks.stride(0) if has_sinks else 0
    pt = page_table if page_table is not None else q
    spt = page_table.stride(0) if page_table is not None else 0
    values = (q, out, lse, sinks if has_sinks else out, pt, ws.o, ws.lse, float(softmax_scale) * LOG2E,
              qs[0], qs[1], os_[0], os_[1], ls[0], ls[1], ssink, spt) + ws.strides + (has_sinks,)
    key = (q.dtype, q.data_ptr() & 15, out.data_ptr() & 15, lse.data_ptr() & 15,
           (sinks.dtype, sinks.data_ptr() & 15) if has_sinks else None, (pt.dtype, pt.data_ptr() & 15)) \
        + ws.key + values[8:16] + ws.strides
    launcher(grid, values, key, key_kv, lambda: k_descriptors(k))
    return True


#: Per-call arguments of the sparse (DSA) kernel, in the order of a launch's ``values``.
_SPARSE_PER_CALL = ("Q", "K", "Idx", "Out", "Lse", "Sinks", "PageTable", "qk_scale", "topk", "stride_qm", "stride_qh",
                    "stride_im", "stride_om", "stride_oh", "stride_lm", "stride_lh", "stride_sink", "stride_pt",
                    "stride_kp", "stride_kn", "HAS_SINKS", "RETURN_LSE")


def launch_sparse(
    q: Tensor, k: Tensor, idx: Tensor, out: Tensor, lse: Optional[Tensor], sinks: Optional[Tensor],
    page_table: Optional[Tensor], *, grid: tuple[int], plan_args: dict, softmax_scale: float, state=None,
) -> None:
    """Launch the sparse (DSA) mode into ``out`` [P, Hq, 512] / ``lse`` [P, Hq] float32: q [P, Hq,
    576]; k the latent, packed ``[rows, 1, 576]`` (key e of a row's sequence at row
    ``row_kv_start + e``) or paged ``[pages, page_size, 1, 576]`` with ``page_table`` [B, pages]
    (int32/int64); ``v = k[..., :512]`` is implied (checked by :func:`sparse_layout_ok`); idx
    [P, topk] int32/int64. ``plan_args``: the row table (``row_seq``, ``row_pos``,
    ``row_kv_start``), ``num_head_groups`` and ``G_PACK`` (see ``dsa_backend``); ``grid`` = P x
    head groups. ``state``: the plan's :class:`~cpattn.kernels._launch.LaunchState` (None: every
    call through the JIT)."""

    if state is None:
        state = LaunchState(enabled=False)
    paged = page_table is not None
    page_size = k.shape[1] if paged else None
    variant = ("sparse", page_size)
    launcher = state.launchers.get(variant)
    if launcher is None:
        fixed = dict(plan_args, **sparse_constexprs(q.dtype, page_size), num_warps=4, maxnreg=168)
        launcher = state.launchers[variant] = PlannedLaunch(_mla_sparse_sm90, fixed, _SPARSE_PER_CALL,
                                                            enabled=state.enabled, cache_size=state.cache_size)
    skp, skn = (k.stride(0), k.stride(1)) if paged else (0, k.stride(0))
    has_sinks, has_lse = sinks is not None, lse is not None
    sq, sh, so, soh, si = q.stride(0), q.stride(1), out.stride(0), out.stride(1), idx.stride(0)
    slm, slh = (lse.stride(0), lse.stride(1)) if has_lse else (0, 0)
    ssink = sinks.stride(0) if has_sinks else 0
    spt = page_table.stride(0) if paged else 0
    pt = page_table if paged else plan_args["row_seq"]
    topk = idx.shape[1]
    values = (q, k, idx, out, lse if has_lse else out, sinks if has_sinks else out, pt, float(softmax_scale) * LOG2E,
              topk, sq, sh, si, so, soh, slm, slh, ssink, spt, skp, skn, has_sinks, has_lse)
    key = (q.dtype, q.data_ptr() & 15, k.data_ptr() & 15, (idx.dtype, idx.data_ptr() & 15), out.data_ptr() & 15,
           lse.data_ptr() & 15 if has_lse else -1, (sinks.dtype, sinks.data_ptr() & 15) if has_sinks else None,
           (pt.dtype, pt.data_ptr() & 15), topk, sq, sh, si, so, soh, slm, slh, ssink, spt, skp, skn)
    launcher(grid, values, key)
