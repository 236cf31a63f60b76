"""DSA index scores over one rank's key shard and its top-k candidates (plan kind
``"shard_index"``; backends ``triton``, then ``gemm``): the first half of the exact global top-k
of a decode step over a sharded cache (:class:`cpattn.plans.IndexTopkPlan`, algorithm
"shard_merge").

Every rank holds the same query rows (replicated queries, global positions) and the index keys of
its shard (:class:`cpattn.KVSharding`: local key ``j`` of a sequence at global position
``(j // I) C I + r I + j % I``). A row at global position ``p`` sees the local keys
``j < local_key_counts(p + 1)`` (causal by global position: a prefix of the local keys). Per
layer the plan loops over fixed key chunks of ``width`` local keys (the count is fixed at plan
time: from the longest local sequence, or from the capacity of a static plan, so a CUDA graph of
the step replays for any batch within it) and scores each chunk:

* ``triton`` (:mod:`.triton_shard_index`): one kernel writes the chunk's ``[N, width]`` scores
  (4 bytes each, in the order of :mod:`cpattn.selection`), the indexer heads as the dot's M
  dimension (decode rows are few), each key read once per row; a second kernel selects the
  top-k of each part (at most :data:`SELECT_PART` columns) of each row by radix selection and
  writes them as packed (score, global position) keys; the same selection over 64-bit keys
  merges the parts (and the running best of earlier chunks);
* ``gemm``: gathers each row's chunk of keys (packed rows ``cu_local_kv_lens[seq] + j`` or
  through the page table) and scores them with two matmuls (bf16 / fp16 queries on CUDA: a
  tensor-core ``bmm`` with float32 output; else float32, float64 for float64 inputs), packs
  (score, global position) into int64 keys (:mod:`cpattn.selection`) and keeps a running
  ``torch.topk`` of ``topk`` packed keys per row.

Both select the same set (the tie rule of :mod:`cpattn.selection`). Device-only: no host sync, no
host-to-device copy.

``backend_options``: ``max_score_elems`` (score values per chunk, default 2**24 = 64 MiB of
float32); triton: ``keys_per_program`` (default 1024, fewer for few rows), ``block_n`` (64),
``num_warps`` (4), ``num_stages`` (2) of the score kernel, ``select_block`` (entries per step of
the top-k kernels, default 4096) and ``select_part`` (columns per top-k program, default
:data:`SELECT_PART`).
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch
from torch import Tensor

from .. import _buffers
from . import IndexTopkSpec, triton_available, triton_device_reason
from ._dsa_rows import device_rows
from ._launch import LaunchState
from ..kv_sharding import local_key_counts
from ..metadata import CPMetadata
from ..selection import NO_KEY, pack_keys, top_candidate_positions, top_keys

__all__ = ["GemmShardIndexBackend", "TritonShardIndexBackend", "max_local_keys"]

#: Score values per key chunk (default 2^24: 64 MiB of float32 scores; the gemm family's
#: [N, H_i, width] block and gathered keys stay in that order).
_DEFAULT_SCORE_ELEMS = 1 << 24
_KERNEL_MODULE = "cpattn.kernels.triton_shard_index"
#: Columns per program of the top-k selection (one program per (row, part)): on an H100 one
#: program selects 2048 of 16384 int32 scores in 0.043-0.056 ms (graph replay, k = 2048, N = 1-128
#: rows; torch.topk over the packed int64 keys: 0.066-0.112 ms), but 131072 columns in one
#: program take 0.46-0.56 ms (torch.topk: 0.09-0.60 ms), so wider chunks are split into parts
#: whose candidates one more selection merges.
SELECT_PART = 16384


def max_local_keys(meta: CPMetadata) -> int:
    """The most keys one sequence can have on one rank for ``meta``: the longest local sequence,
    or for a static plan the bound over its capacity's longest sequence (rank 0 holds the most)."""
    sh = meta.kv
    if meta.capacity is None:
        return int(meta.max_local_kv_len)
    total = torch.tensor([meta.capacity.seq_len_bound])
    return int(local_key_counts(total, 0, sh.cp_size, sh.interleave)[0])


_BMM_OUT_DTYPE: dict = {}


def _bmm_out_dtype_ok(device: torch.device) -> bool:
    """Whether ``torch.bmm(bf16, bf16, out_dtype=torch.float32)`` runs on ``device`` (CUDA; tried
    once per device at plan time)."""
    if device.type != "cuda":
        return False
    key = str(device)
    if key not in _BMM_OUT_DTYPE:
        try:
            a = torch.ones(1, 16, 16, dtype=torch.bfloat16, device=device)
            ok = torch.bmm(a, a, out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError, NotImplementedError):
            ok = False
        _BMM_OUT_DTYPE[key] = ok
    return _BMM_OUT_DTYPE[key]


def _row_tables(spec: IndexTopkSpec, meta: CPMetadata) -> tuple[Tensor, Tensor, Tensor]:
    """(seq, visible, start) [N] each on ``meta.device`` (plan time, from the per-row table the DSA
    kernels share: one upload per plan): each query row's sequence, its count of this rank's keys
    at global positions <= its position, and the packed row of its sequence's first local key (0
    for a paged cache). A static plan's are copied into its arena's fixed tensors."""
    sh = meta.kv
    rows = device_rows(meta)  # the DSA kernels' per-row table (pad rows: sequence 0, position -1)
    seq, pos = rows["row_seq"].long(), rows["row_pos"].long()
    visible = local_key_counts(pos + 1, meta.rank, sh.cp_size, sh.interleave)
    start = torch.zeros_like(seq) if spec.paged else meta.cu_local_kv_lens[seq]
    if not meta.is_static:
        return seq, visible, start
    fixed = []
    for name, t in (("seq", seq), ("visible", visible), ("start", start)):
        buf = _buffers.scratch(meta, ("shard-index-rows", name), tuple(t.shape), t.dtype)
        buf.copy_(t)
        fixed.append(buf)
    return fixed[0], fixed[1], fixed[2]


class _ShardIndexRun:
    """A planned index top-k over one key shard (see the module docstring); called per layer.
    ``family``: "triton" (:mod:`.triton_shard_index` scores) or "gemm" (torch matmuls)."""

    def __init__(self, spec: IndexTopkSpec, meta: CPMetadata, options: Mapping, family: str) -> None:
        known = {"max_score_elems"} | ({"keys_per_program", "block_n", "num_warps", "num_stages", "select_block",
                                        "select_part"}
                                       if family == "triton" else set())
        unknown = set(options) - known
        if unknown:
            raise ValueError(f"unknown {family} backend_options {sorted(unknown)} (known: {sorted(known)})")
        budget = int(options.get("max_score_elems") or _DEFAULT_SCORE_ELEMS)
        if budget < 1:
            raise ValueError(f"backend_options max_score_elems must be >= 1, got {budget}")
        sh = meta.kv
        self.spec, self.meta = spec, meta
        self.cp_size, self.interleave, self.rank = sh.cp_size, sh.interleave, meta.rank
        n = meta.num_physical_tokens
        self.num_keys = max_local_keys(meta)
        # the block per chunk: [N, width] int32 ordered scores (triton) or [N, H_i, width] float32 (gemm)
        per_key = max(1, n) * (1 if family == "triton" else max(spec.num_heads, spec.head_dim))
        self.width = max(16, min(budget // per_key, max(self.num_keys, 1)))
        self.half_gemm = False
        #: per-row tables (sequence, local keys visible, first packed local key row), built once
        #: at plan time; a static plan's sit in its arena at fixed addresses (graph replays read
        #: the current plan's)
        self.rows = _row_tables(spec, meta)
        if family == "triton":
            from . import triton_index, triton_shard_index as kern

            interp = kern.INTERPRETED
            block_n = int(options.get("block_n") or (16 if interp else 64))
            # keys per program: up to 1024, fewer when the rows are few, so that a chunk still
            # spreads over >= 1024 programs (a B = 1 step would otherwise occupy ~1 program per SM)
            spread = max(block_n, 1 << max(0, (max(1, n) * self.width // 1024).bit_length() - 1))
            kpp = int(options.get("keys_per_program") or (64 if interp else min(1024, spread)))
            warps = int(options.get("num_warps") or 4)
            stages = int(options.get("num_stages") or 2)
            select_block = int(options.get("select_block") or (64 if interp else 4096))
            select_part = int(options.get("select_part") or (256 if interp else SELECT_PART))
            for name, value in (("keys_per_program", kpp), ("block_n", block_n), ("select_block", select_block),
                                ("select_part", select_part)):
                if value < 16 or value & (value - 1):
                    raise ValueError(f"backend_options {name} must be a power of two >= 16, got {value}")
            if kpp % block_n:
                raise ValueError(f"backend_options keys_per_program={kpp} must be a multiple of block_n={block_n}")
            block_h, block_d = kern.block_sizes(spec.num_heads, spec.head_dim)
            self.plan_args = dict(NUM_HEADS=spec.num_heads, HEAD_DIM=spec.head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
                                  BLOCK_N=block_n, KEYS_PER_PROGRAM=kpp, num_warps=warps, num_stages=stages,
                                  PAGE_SIZE=spec.page_size or 1,
                                  **triton_index.dot_settings(spec.q_dtype, spec.k_dtype))
            #: the top-k kernels: one program per (row, part of <= ``select_part`` columns),
            #: ``select_block`` entries per step
            self.select_args = dict(BLOCK=select_block, num_warps=8 if select_block >= 1024 else 4, num_stages=2)
            #: the selection's geometry, fixed per plan: parts per key chunk, key chunks per call
            self.parts = -(-self.width // select_part)
            self.chunks = -(-self.num_keys // self.width)
            self._bind, self._top_columns, self._top_candidates = kern.bind, kern.top_columns, kern.top_candidates
            self._state = LaunchState()  # the kernels' pre-bound launches (one set per plan)
            self.family = "triton"
        else:
            #: bf16 / fp16 index queries on CUDA: scores by a tensor-core bmm with float32 output
            #: (fp8 keys are converted to the queries' dtype exactly, their scales applied after the
            #: dot); else float32 matmuls (float64 for float64 inputs)
            self.half_gemm = spec.q_dtype in (torch.bfloat16, torch.float16) and _bmm_out_dtype_ok(meta.device)
            self.family = "gemm-half" if self.half_gemm else "gemm-fp32"

    def __call__(self, q_idx: Tensor, k_idx: Tensor, weights: Tensor, k_scale: Optional[Tensor],
                 page_table: Optional[Tensor], softmax_scale: float, out: Tensor) -> None:
        """Write this rank's candidates: ``out`` int64 [N, topk] packed keys (NO_KEY padding)."""
        spec, meta = self.spec, self.meta
        dev = q_idx.device
        work = torch.float64 if torch.float64 in (q_idx.dtype, k_idx.dtype) else torch.float32
        c, il, r = self.cp_size, self.interleave, self.rank
        seq, visible, start = self.rows
        num_keys = self.num_keys if k_idx.shape[0] else 0  # an empty shard holds no candidate
        if self.family == "triton":
            self._triton(q_idx, k_idx, weights, k_scale, page_table, softmax_scale, seq, visible, start, num_keys,
                         out)
            return
        best = torch.full(out.shape, NO_KEY, dtype=torch.int64, device=dev)
        ww = weights.to(work)
        q_half = q_idx if self.half_gemm else None
        qw = None if self.half_gemm else q_idx.to(work)
        if spec.paged:
            ps = spec.page_size
            table = page_table.long()[seq]  # [N, max_pages]
        for j0 in range(0, num_keys, self.width):
            j = torch.arange(j0, j0 + self.width, device=dev)
            valid = j[None, :] < visible[:, None]  # [N, W]
            gpos = (j // il) * (c * il) + r * il + j % il
            if spec.paged:
                page = table.gather(1, (j // ps).clamp(max=table.shape[1] - 1)[None, :].expand(table.shape[0], -1))
                page = torch.where(valid, page, 0)
                slot = torch.where(valid, j % ps, 0)
                keys = k_idx[page, slot]  # [N, W, D]
                scale = k_scale[page, slot] if k_scale is not None else None
            else:
                rows = torch.where(valid, start[:, None] + j[None, :], 0)
                keys = k_idx[rows]
                scale = k_scale[rows] if k_scale is not None else None
            if self.half_gemm:  # tensor-core GEMM, float32 out: keys stay in their 2-byte dtype
                dots = torch.bmm(q_half, keys.to(q_half.dtype).transpose(1, 2), out_dtype=torch.float32)
                if scale is not None:
                    dots = dots * scale.float()[:, None, :]
            else:
                keys = keys.to(work)
                if scale is not None:
                    keys = keys * scale.to(work)[..., None]
                dots = torch.einsum("nhd,nwd->nhw", qw, keys)
            s = torch.einsum("nh,nhw->nw", ww, torch.relu(dots * softmax_scale))
            best = top_keys(torch.cat([best, pack_keys(s, gpos[None, :], valid)], dim=1), out.shape[1])
        out.copy_(best)

    def select(self, candidates: Tensor, out: Tensor) -> None:
        """The exact global top-k of every rank's candidates: ``candidates`` int64 [C, N, topk]
        packed keys -> ``out`` int32 [N, topk] global positions (-1 padding). triton: one
        program per row (:func:`~.triton_shard_index.top_candidates`); gemm: one ``torch.topk``."""
        if self.family == "triton":
            dst = out if out.stride(-1) == 1 else torch.empty(out.shape, dtype=out.dtype, device=out.device)
            self._top_candidates(candidates, dst, select_args=self.select_args, state=self._state)
            if dst is not out:
                out.copy_(dst)
            return
        out.copy_(top_candidate_positions(candidates, out.shape[1]))

    def _triton(self, q_idx, k_idx, weights, k_scale, page_table, softmax_scale, seq, visible, start, num_keys,
                out) -> None:
        """Scores of each key chunk (int32 [N, width]), each row's top-k of every part of the
        chunk (:func:`~.triton_shard_index.top_columns`, one program per (row, part) of at most
        :data:`SELECT_PART` columns), then the top-k of those candidates (and of the running best
        of earlier chunks) by :func:`~.triton_shard_index.top_candidates`; one part, one chunk
        (a short context) is selected straight into ``out``."""
        dev = q_idx.device
        q = q_idx if q_idx.stride(-1) == 1 else q_idx.contiguous()
        k = k_idx if k_idx.stride(-1) == 1 else k_idx.contiguous()
        n, topk = out.shape
        if num_keys == 0:
            out.fill_(NO_KEY)
            return
        scores = torch.empty(n, self.width, dtype=torch.int32, device=dev)
        score_chunk = self._bind(q, k, weights, k_scale, scores, page_table, seq, visible, start, softmax_scale,
                                 plan_args=self.plan_args, state=self._state)
        sharding = (self.cp_size, self.interleave, self.rank)
        select = dict(select_args=self.select_args, state=self._state)
        parts, chunks = self.parts, self.chunks
        dst = out if out.stride(-1) == 1 else torch.empty(n, topk, dtype=torch.int64, device=dev)
        if parts == 1 and chunks == 1:
            score_chunk(0)
            self._top_columns(scores, dst.unsqueeze(1), sharding, **select)(0)
        else:
            # [N, lead + parts, topk]: with several chunks the running best first (NO_KEY before
            # the first chunk), then each part's candidates of the current chunk
            lead = 1 if chunks > 1 else 0
            cand = torch.empty(n, lead + parts, topk, dtype=torch.int64, device=dev)
            cand[:, :lead].fill_(NO_KEY)
            best = torch.empty(n, topk, dtype=torch.int64, device=dev)
            select_parts = self._top_columns(scores, cand[:, lead:], sharding, **select)
            for j0 in range(0, self.num_keys, self.width):
                score_chunk(j0)
                select_parts(j0)
                last = j0 + self.width >= self.num_keys
                self._top_candidates(cand.transpose(0, 1), dst if last else best, **select)
                if not last:
                    cand[:, 0].copy_(best)
        if dst is not out:
            out.copy_(dst)


class GemmShardIndexBackend:
    name = "gemm"

    def available(self) -> Optional[str]:
        return None

    def unsupported_reason(self, spec: IndexTopkSpec, meta: CPMetadata) -> Optional[str]:
        return None

    def plan(self, spec: IndexTopkSpec, meta: CPMetadata, options: Mapping) -> _ShardIndexRun:
        return _ShardIndexRun(spec, meta, options, "gemm")


class TritonShardIndexBackend:
    name = "triton"

    def available(self) -> Optional[str]:
        return triton_available()

    def unsupported_reason(self, spec: IndexTopkSpec, meta: CPMetadata) -> Optional[str]:
        reason = triton_device_reason(meta.device, _KERNEL_MODULE)
        if reason is not None:
            return reason
        from .dsa_backend import index_spec_reason  # the prefill index kernel's dtype / head-dim rule

        reason = index_spec_reason(spec, meta.device.type == "cuda")
        if reason is not None:
            return reason
        if spec.num_heads > 128:
            return f"{spec.num_heads} index heads not supported (<= 128)"
        return None

    def plan(self, spec: IndexTopkSpec, meta: CPMetadata, options: Mapping) -> _ShardIndexRun:
        return _ShardIndexRun(spec, meta, options, "triton")
