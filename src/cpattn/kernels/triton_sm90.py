"""Warp-specialized Hopper (sm_90) variant of the CP attention kernel, written in Gluon.

Same contract and tile map as :mod:`cpattn.kernels.triton_attn` (a program = one query tile of
one segment x ``G_PACK`` heads of one KV group), organised the way FA3 runs on Hopper:

* a 1-warp **loader** partition streams K/V blocks into a ring of shared-memory stages with TMA,
  signalling ``ready`` mbarriers;
* two 4-warp **consumer** partitions each own half of the tile's rows (``BLOCK_M`` each). Per key
  block: ``S = Q K^T`` (wgmma, Q and K in shared memory), online softmax in registers,
  ``O += P V`` (wgmma, P from registers), then release the stage. The two consumers run
  independently, so the warp scheduler overlaps one's softmax with the other's tensor-core work.
  Options (off by default: not faster on H200, see docs/kernels.md): ``OVERLAP`` 1 issues
  ``P_{j-1} V_{j-1}`` and the next block's ``Q K^T`` back to back, 2 also runs the softmax while
  ``P V`` is in flight (FA3's intra-warpgroup overlap); ``PINGPONG`` (with ``OVERLAP``) makes
  the consumers take turns issuing their GEMMs.

Programs walk the tile map by L2 head sections (see ``triton_attn.heads_per_l2_section``).

Used for packed K/V with ``(D, Dv)`` in (64, 64), (128, 128), (192, 128) (``Q K^T`` of D192 is
two wgmmas over 128 + 64 columns, with 2 K/V stages), bf16/fp16, on sm_90 with Gluon available;
everything else (paged K/V, other head dims, other GPUs, the CPU interpreter) runs the portable
kernel. Masking, windows, sinks and LSE follow the portable kernel exactly.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

try:  # Gluon ships with triton >= 3.5; older versions use the portable kernel only
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    HAVE_GLUON = True
except (ImportError, AssertionError):  # triton < 3.5, or triton loaded for the CPU interpreter
    HAVE_GLUON = False

from ._tiles import LOG2E, SM90_SMEM_PER_BLOCK

#: (consumer warpgroups) x (rows per consumer): the tile a program covers.
NUM_CONSUMERS = 2
CONSUMER_ROWS = 64
#: (D, Dv) pairs the kernel takes; D = 192 (MLA prefill) splits ``Q K^T`` into 128 + 64 columns.
SUPPORTED_HEAD_DIMS = {(64, 64), (128, 128), (192, 128)}


def split_qk_dim(d: int) -> tuple[int, int]:
    """``(D1, D2)``: the ``Q K^T`` columns in the first and second wgmma (D2 = 0: one wgmma)."""
    return (128, d - 128) if d > 128 else (d, 0)


def max_stages(d: int, dv: int, block_n: int, elem_bytes: int = 2) -> int:
    """K/V ring depth that fits in shared memory next to the 128-row Q tile (at most 3)."""
    q_bytes = NUM_CONSUMERS * CONSUMER_ROWS * d * elem_bytes
    stage_bytes = block_n * (d + dv) * elem_bytes
    return max(1, min(3, (SM90_SMEM_PER_BLOCK - q_bytes - 1024) // stage_bytes))


def unsupported_reason(d: int, dv: int, dtype: torch.dtype, paged: bool, device: torch.device) -> Optional[str]:
    """Why the sm_90 kernel cannot take this plan (None if it can; the K/V layout is checked
    per layer by :func:`kv_layout_ok`)."""
    if paged:
        return "paged K/V"
    if (d, dv) not in SUPPORTED_HEAD_DIMS:
        return f"head dims D={d}, Dv={dv} (needs (D, Dv) in {sorted(SUPPORTED_HEAD_DIMS)})"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype} (needs bf16 or fp16)"
    if not HAVE_GLUON:
        return "Gluon unavailable (needs triton >= 3.5, not in interpreter mode)"
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return "not an sm_90 GPU"
    return None


def kv_layout_ok(k: Tensor, v: Tensor) -> bool:
    """K/V seen as 2-D TMA matrices ``[rows, Hkv * D]``: heads adjacent, 16-byte rows and base."""
    for x in (k, v):
        if (x.stride(-1) != 1 or x.stride(-2) != x.shape[-1] or (x.stride(0) * x.element_size()) % 16
                or x.data_ptr() % 16):
            return False
    return True


if HAVE_GLUON:

    @gluon.jit
    def _ws_loader(smem, kv, rows, HAS_WINDOW: gl.constexpr, HAS_SINKS: gl.constexpr, RETURN_LSE: gl.constexpr,
                   G_PACK: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, HEAD_DIM2: gl.constexpr):
        """1 warp: TMA K/V blocks ``n_lo + j * BLOCK_N`` (j < num_blocks) into the stage ring."""
        q_smem, q2_smem, k_bufs, k2_bufs, v_bufs, k_ready, v_ready, kv_empty, turn = smem
        k_desc, k2_desc, v_desc, k_col, v_col, kv_row_base, n_lo, num_blocks = kv
        STAGES: gl.constexpr = k_bufs.type.shape[0]
        BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
        HEAD_DIM1: gl.constexpr = k_bufs.type.shape[2]
        for j in range(num_blocks):
            slot = j % STAGES
            phase = (j // STAGES) & 1
            mbarrier.wait(kv_empty.index(slot), phase ^ 1)
            row = (kv_row_base + n_lo + j * BLOCK_N).to(gl.int32)
            if HEAD_DIM2 > 0:
                mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes + k2_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [row, k_col], k_ready.index(slot), k_bufs.index(slot))
                tma.async_copy_global_to_shared(k2_desc, [row, k_col + HEAD_DIM1], k_ready.index(slot),
                                                k2_bufs.index(slot))
            else:
                mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [row, k_col], k_ready.index(slot), k_bufs.index(slot))
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [row, v_col], v_ready.index(slot), v_bufs.index(slot))

    @gluon.jit
    def _ws_softmax(s, m_i, l_i, start, pos, f_lo, f_hi, window, qk_scale, offs_n, HAS_WINDOW: gl.constexpr):
        """Online softmax of one score block (base 2): returns (p fp32, alpha, m_i, l_i). Blocks
        outside [f_lo, f_hi) get the causal / window mask by position."""
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
    def _ws_qk(q_lo, q_hi, k_lo, k_hi, s_zero, HEAD_DIM2: gl.constexpr):
        """Async ``S = Q K^T`` of one block: one wgmma, or two over column splits (D = 128 + 64)."""
        s = warpgroup_mma(q_lo, k_lo.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if HEAD_DIM2 > 0:
            s = warpgroup_mma(q_hi, k_hi.permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _ws_consumer(smem, kv, rows, HALF: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SINKS: gl.constexpr,
                     RETURN_LSE: gl.constexpr, G_PACK: gl.constexpr, OVERLAP: gl.constexpr,
                     PINGPONG: gl.constexpr, HEAD_DIM2: gl.constexpr):
        """4 warps: rows [HALF * BLOCK_M, (HALF + 1) * BLOCK_M) of the tile."""
        q_smem, q2_smem, k_bufs, k2_bufs, v_bufs, k_ready, v_ready, kv_empty, turn = smem
        k_desc, k2_desc, v_desc, k_col, v_col, kv_row_base, n_lo, num_blocks = kv
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
        q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

        # this half's Q rows -> shared memory (row m = position-major, heads fastest)
        m_q = HALF * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_layout))
        r_q = roff + m_q // G_PACK
        head_q = hg * G_PACK + m_q % G_PACK
        d_q = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
        q_ptrs = Q + gl.expand_dims((row0 + r_q).to(gl.int64) * stride_qm + head_q * stride_qh, 1) \
            + gl.expand_dims(d_q, 0)
        q = gl.load(q_ptrs, mask=gl.expand_dims(r_q < slen, 1), other=0.0)
        q_half = q_smem.index(HALF)
        q_half.store(q)
        q2_half = q_half
        if HEAD_DIM2 > 0:  # columns [HEAD_DIM, HEAD_DIM + HEAD_DIM2) of Q: the second Q K^T wgmma
            d2_q = HEAD_DIM + gl.arange(0, HEAD_DIM2, layout=gl.SliceLayout(0, q_layout))
            q2_ptrs = Q + gl.expand_dims((row0 + r_q).to(gl.int64) * stride_qm + head_q * stride_qh, 1) \
                + gl.expand_dims(d2_q, 0)
            q2_half = q2_smem.index(HALF)
            q2_half.store(gl.load(q2_ptrs, mask=gl.expand_dims(r_q < slen, 1), other=0.0))
        fence_async_shared()
        gl.thread_barrier()

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
            # prologue: block 0's scores and probabilities
            mbarrier.wait(k_ready.index(0), 0)
            if PINGPONG:
                mbarrier.wait(turn.index(HALF), HALF ^ 1)
            s = _ws_qk(q_half, q2_half, k_bufs.index(0), k2_bufs.index(0), s_zero, HEAD_DIM2)
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - HALF), count=1)
            s = warpgroup_mma_wait(0, deps=(s, ))
            p, alpha, m_i, l_i = _ws_softmax(s, m_i, l_i, n_lo, pos, f_lo, f_hi, window, qk_scale, offs_n,
                                             HAS_WINDOW)
            p_op = gl.convert_layout(p.to(dtype), p_layout)  # bf16 operand now: 32 registers, not 64
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
            for j in range(1, num_blocks):
                slot = j % STAGES
                prev = (j - 1) % STAGES
                # issue S_j = Q K_j^T, then O += P_{j-1} V_{j-1}; softmax_j overlaps the second
                mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
                mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
                if PINGPONG:  # the two consumers take turns issuing their GEMMs
                    mbarrier.wait(turn.index(HALF), (j & 1) ^ HALF ^ 1)
                s = _ws_qk(q_half, q2_half, k_bufs.index(slot), k2_bufs.index(slot), s_zero, HEAD_DIM2)
                acc = warpgroup_mma(p_op, v_bufs.index(prev), acc, is_async=True)
                if PINGPONG:
                    mbarrier.arrive(turn.index(1 - HALF), count=1)
                # OVERLAP 2: softmax_j runs while P_{j-1} V_{j-1} is in flight; 1: after both GEMMs
                if OVERLAP == 2:
                    s, p_op = warpgroup_mma_wait(1, deps=(s, p_op))
                else:
                    s, p_op = warpgroup_mma_wait(0, deps=(s, p_op))
                p, alpha, m_i, l_i = _ws_softmax(s, m_i, l_i, n_lo + j * BLOCK_N, pos, f_lo, f_hi, window,
                                                 qk_scale, offs_n, HAS_WINDOW)
                acc = warpgroup_mma_wait(0, deps=(acc, ))
                p_op = gl.convert_layout(p.to(dtype), p_layout)
                mbarrier.arrive(kv_empty.index(prev), count=1)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
            last = (num_blocks - 1) % STAGES
            mbarrier.wait(v_ready.index(last), ((num_blocks - 1) // STAGES) & 1)
            if PINGPONG:
                mbarrier.wait(turn.index(HALF), (num_blocks & 1) ^ HALF ^ 1)
            acc = warpgroup_mma(p_op, v_bufs.index(last), acc, is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - HALF), count=1)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(kv_empty.index(last), count=1)
        else:
            for j in range(num_blocks):
                slot = j % STAGES
                phase = (j // STAGES) & 1
                mbarrier.wait(k_ready.index(slot), phase)
                s = _ws_qk(q_half, q2_half, k_bufs.index(slot), k2_bufs.index(slot), s_zero, HEAD_DIM2)
                s = warpgroup_mma_wait(0, deps=(s, ))
                p, alpha, m_i, l_i = _ws_softmax(s, m_i, l_i, n_lo + j * BLOCK_N, pos, f_lo, f_hi, window,
                                                 qk_scale, offs_n, HAS_WINDOW)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
                p_op = gl.convert_layout(p.to(dtype), p_layout)
                mbarrier.wait(v_ready.index(slot), phase)
                acc = warpgroup_mma(p_op, v_bufs.index(slot), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=(acc, ))
                mbarrier.arrive(kv_empty.index(slot), count=1)

        # epilogue: O / l (0 / -inf for rows that saw no key; NaN stays NaN), LSE in natural log
        has_mass = l_i != 0.0
        inv_l = gl.where(has_mass, 1.0 / gl.where(has_mass, l_i, 1.0), 0.0)
        out = acc * gl.expand_dims(gl.convert_layout(inv_l, o_rows), 1)
        m_o = HALF * BLOCK_M + gl.arange(0, BLOCK_M, layout=o_rows)
        r_o = roff + m_o // G_PACK
        head_o = hg * G_PACK + m_o % G_PACK
        d_o = gl.arange(0, HEAD_DIM_V, layout=gl.SliceLayout(0, o_layout))
        o_ptrs = Out + gl.expand_dims((row0 + r_o).to(gl.int64) * stride_om + head_o * stride_oh, 1) \
            + gl.expand_dims(d_o, 0)
        gl.store(o_ptrs, out.to(dtype), mask=gl.expand_dims(r_o < slen, 1))
        if RETURN_LSE:
            lse = gl.where(has_mass, (m_i + gl.log2(gl.where(has_mass, l_i, 1.0))) * 0.6931471805599453,
                           float("-inf"))
            lse = gl.where(pos < 0, float("-inf"), lse)  # pad rows (pad segment, position -1)
            r_s = roff + m_s // G_PACK
            head_s = hg * G_PACK + m_s % G_PACK
            gl.store(Lse + (row0 + r_s).to(gl.int64) * stride_lm + head_s * stride_lh, lse, mask=r_s < slen)

    @gluon.jit
    def _ws_consumer0(smem, kv, rows, HAS_WINDOW: gl.constexpr, HAS_SINKS: gl.constexpr,
                      RETURN_LSE: gl.constexpr, G_PACK: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr,
                      HEAD_DIM2: gl.constexpr):
        _ws_consumer(smem, kv, rows, 0, HAS_WINDOW, HAS_SINKS, RETURN_LSE, G_PACK, OVERLAP, PINGPONG, HEAD_DIM2)

    @gluon.jit
    def _ws_consumer1(smem, kv, rows, HAS_WINDOW: gl.constexpr, HAS_SINKS: gl.constexpr,
                      RETURN_LSE: gl.constexpr, G_PACK: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr,
                      HEAD_DIM2: gl.constexpr):
        _ws_consumer(smem, kv, rows, 1, HAS_WINDOW, HAS_SINKS, RETURN_LSE, G_PACK, OVERLAP, PINGPONG, HEAD_DIM2)

    @gluon.jit
    def _cp_attn_fwd_sm90(
        Q, k_desc, k2_desc, v_desc, Out, Lse, Sinks,
        tile_segment, tile_row_offset, NumTiles,
        seg_seq, seg_row0, seg_len, seg_pos0, seg_stride, cu_kv_lens,
        qk_scale, window, num_head_groups, heads_per_section, group_size,
        stride_qm, stride_qh, stride_om, stride_oh, stride_lm, stride_lh, stride_sink,
        BLOCK_M: gl.constexpr, STAGES: gl.constexpr, G_PACK: gl.constexpr,
        HAS_WINDOW: gl.constexpr, HAS_SINKS: gl.constexpr, RETURN_LSE: gl.constexpr, OVERLAP: gl.constexpr,
        PINGPONG: gl.constexpr, Q_SMEM: gl.constexpr, HEAD_DIM2: gl.constexpr, Q2_SMEM: gl.constexpr,
    ):
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
        HEAD_DIM_V: gl.constexpr = v_desc.block_type.shape[1]
        ROWS: gl.constexpr = 2 * BLOCK_M // G_PACK
        # program -> (tile, head group) by L2 sections, as triton_attn._tile_and_head_group (not
        # imported from there: that import would fix triton_attn's interpreter/GPU mode early)
        pid = gl.program_id(0)
        # tile count from device memory (static plans: a capacity-sized grid); programs past it
        # run no key block and store nothing (slen 0), so every partition agrees without a branch
        num_tiles = gl.load(NumTiles)
        live = pid < num_tiles * num_head_groups
        pid = gl.where(live, pid, 0)
        per_section = num_tiles * heads_per_section
        section = pid // per_section
        r = pid - section * per_section
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
        kvh = (hg * G_PACK) // group_size
        kv_row_base = gl.load(cu_kv_lens + seq).to(gl.int32)  # TMA coordinates are 32-bit

        key_end = pos_max + 1
        if HAS_WINDOW:
            n_lo = (gl.maximum(pos_min - window, 0) // BLOCK_N) * BLOCK_N
            f_lo = gl.cdiv(gl.maximum(pos_max - window, 0), BLOCK_N) * BLOCK_N
        else:
            n_lo = pos_min * 0
            f_lo = pos_min * 0
        f_hi = gl.maximum(((pos_min + 1) // BLOCK_N) * BLOCK_N, f_lo)
        num_blocks = gl.where(live, gl.cdiv(key_end - n_lo, BLOCK_N), 0)

        q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [2, BLOCK_M, HEAD_DIM], Q_SMEM)
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        if HEAD_DIM2 > 0:
            q2_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [2, BLOCK_M, HEAD_DIM2], Q2_SMEM)
            k2_bufs = gl.allocate_shared_memory(k2_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM2], k2_desc.layout)
        else:  # placeholders, never read
            q2_smem = q_smem
            k2_bufs = k_bufs
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM_V], v_desc.layout)
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)

        # partition arguments (scalars and shared-memory handles only): buffers, K/V stream, rows
        smem = (q_smem, q2_smem, k_bufs, k2_bufs, v_bufs, k_ready, v_ready, kv_empty, turn)
        kv = (k_desc, k2_desc, v_desc, kvh * (HEAD_DIM + HEAD_DIM2), kvh * HEAD_DIM_V, kv_row_base, n_lo, num_blocks)
        rows = (Q, Out, Lse, Sinks, stride_qm, stride_qh, stride_om, stride_oh, stride_lm, stride_lh,
                roff, slen, row0, pos0, pstride, hg, f_lo, f_hi, qk_scale, window, stride_sink)
        # the flags go in tuple literals: assigning a tuple to a name would turn its constexprs into
        # runtime values
        gl.warp_specialize([
            (_ws_consumer0, (smem, kv, rows, HAS_WINDOW, HAS_SINKS, RETURN_LSE, G_PACK, OVERLAP, PINGPONG,
                              HEAD_DIM2)),
            (_ws_consumer1, (smem, kv, rows, HAS_WINDOW, HAS_SINKS, RETURN_LSE, G_PACK, OVERLAP, PINGPONG,
                              HEAD_DIM2)),
            (_ws_loader, (smem, kv, rows, HAS_WINDOW, HAS_SINKS, RETURN_LSE, G_PACK, OVERLAP, PINGPONG,
                              HEAD_DIM2)),
        ], [4, 1], [240, 24])


def _smem_layout(block: int, cols: int, dtype: torch.dtype):
    """NVMMA (wgmma / TMA) shared-memory layout of a ``[block, cols]`` bf16/fp16 tile."""
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for([block, cols], gdt)


def kv_descriptors(k: Tensor, v: Tensor, block_n: int, k_layout=None, k2_layout=None, v_layout=None):
    """Host TMA descriptors over packed K/V seen as ``[rows, Hkv * D]`` matrices: K in column
    splits ``D1`` and ``D2`` (:func:`split_qk_dim`; KV head ``h`` starts at column ``h * D``, the
    second split at ``h * D + D1``), V in blocks ``[block_n, Dv]``. With ``D2 = 0`` the second K
    descriptor is the first (never read). The shared-memory layouts may be given (planned once)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    n, hkv, d = k.shape
    dv = v.shape[-1]
    d1, d2 = split_qk_dim(d)
    k_layout = k_layout or _smem_layout(block_n, d1, k.dtype)
    k_desc = TensorDescriptor(k, [n, hkv * d], [k.stride(0), 1], [block_n, d1], k_layout)
    k2_desc = k_desc
    if d2:
        k2_desc = TensorDescriptor(k, [n, hkv * d], [k.stride(0), 1], [block_n, d2],
                                   k2_layout or _smem_layout(block_n, d2, k.dtype))
    v_desc = TensorDescriptor(v, [n, hkv * dv], [v.stride(0), 1], [block_n, dv], v_layout or _smem_layout(block_n, dv, v.dtype))
    return k_desc, k2_desc, v_desc


def make_launch(plan_args: dict, d: int, dv: int, dtype: torch.dtype, *, block_n: int = 128, stages: int = 3,
                overlap: int = 0, pingpong: bool = False):
    """A :class:`PlannedLaunch` of the warp-specialized kernel with the planned keyword arguments
    (tile map with its device tile count, segments, G_PACK, L2 section; see ``triton_backend``),
    whose tiles are ``NUM_CONSUMERS * CONSUMER_ROWS`` rows x heads. ``overlap`` 1 issues
    ``P_{j-1} V_{j-1}`` and ``Q K_j^T`` back to back, 2 also runs softmax_j under the first;
    ``pingpong`` (with ``overlap``) makes the two consumers take turns issuing their GEMMs.
    ``stages`` is capped by shared memory (D192/128 fits 2)."""
    from ._launch import PlannedLaunch

    d1, d2 = split_qk_dim(d)
    block_m = CONSUMER_ROWS
    fixed = dict(
        plan_args, BLOCK_M=block_m, STAGES=min(stages, max_stages(d, dv, block_n, dtype.itemsize)),
        OVERLAP=int(overlap), PINGPONG=bool(pingpong and overlap), Q_SMEM=_smem_layout(block_m, d1, dtype),
        HEAD_DIM2=d2, Q2_SMEM=_smem_layout(block_m, max(d2, 16), dtype), num_warps=4, maxnreg=168,
    )
    launcher = PlannedLaunch(_cp_attn_fwd_sm90, fixed)
    launcher.layouts = (block_n, _smem_layout(block_n, d1, dtype),
                        _smem_layout(block_n, d2, dtype) if d2 else None, _smem_layout(block_n, dv, dtype))
    return launcher


def launch(launcher, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Optional[Tensor], sinks: Optional[Tensor], *,
           grid: tuple[int], softmax_scale: float) -> None:
    """Launch the warp-specialized kernel into ``out`` / ``lse`` (packed, TMA-compatible K/V)."""
    k_desc, k2_desc, v_desc = kv_descriptors(k, v, *launcher.layouts)
    has_sinks, has_lse = sinks is not None, lse is not None
    sq, sh, so, soh = q.stride(0), q.stride(1), out.stride(0), out.stride(1)
    slm, slh = (lse.stride(0), lse.stride(1)) if has_lse else (0, 0)
    ssink = sinks.stride(0) if has_sinks else 0
    args = dict(
        Q=q, k_desc=k_desc, k2_desc=k2_desc, v_desc=v_desc, Out=out, Lse=lse if has_lse else out,
        Sinks=sinks if has_sinks else out, qk_scale=float(softmax_scale) * LOG2E, stride_qm=sq, stride_qh=sh,
        stride_om=so, stride_oh=soh, stride_lm=slm, stride_lh=slh, stride_sink=ssink, HAS_SINKS=has_sinks,
        RETURN_LSE=has_lse,
    )
    key = (q.data_ptr() & 15, out.data_ptr() & 15, lse.data_ptr() & 15 if has_lse else -1,
           (sinks.dtype, sinks.data_ptr() & 15) if has_sinks else None, sq, sh, so, soh, slm, slh, ssink)
    launcher(grid, args, key)
