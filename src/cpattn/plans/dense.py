"""Attention over a replicated KV cache: algorithms "local" and "gather_kv", dense or sparse.

The queries are the rank's local rows (sharded by zigzag / interleave / contiguous, or every row
with the "replicated" strategy); every rank's cache holds every key. ``run`` all-gathers the new
K/V in ONE collective ("gather_kv"; none for replicated queries or C = 1: "local"), writes them to
the paged cache through a validated write plan (or packs them after the cached prefix for packed
K/V), and runs causal attention of the local queries; with a spec's ``topk`` (DSA sparse
attention) each row attends only the keys its row of ``idx`` selects. ``attend`` is the kernel
alone. Plan-level facts (backend, kernel family, tile height, heads per program, L2 sections,
varlen descriptors) are decided at plan time and uploaded in ONE host-to-device copy; the
per-layer calls check only what can differ per layer and launch: no host sync, no host-to-device
copy.

The causal rule of sparse attention: a row at position ``p`` of sequence ``b`` attends the keys
of ``b`` whose positions appear in its row of ``idx`` and are ``<= p``; negative entries (-1
padding), future entries and positions past the sequence are ignored. So a selection computed
without a causal mask (e.g. every key of a sequence shorter than top-k) stays causal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from torch import Tensor

from ..cache import CacheWritePlan
from .base import AttentionPlan, KernelCall
from .sparse import check_plan_index

if TYPE_CHECKING:  # annotations only (typing.Unpack: Python >= 3.11)
    from typing_extensions import Unpack

__all__ = ["ReplicatedKVPlan"]



class ReplicatedKVPlan(AttentionPlan):
    """Causal attention of a rank's local queries over a replicated cache (dense, or sparse with
    ``spec.topk``)."""

    def __init__(self, meta, spec, backend: str, run_impl, algorithm: str) -> None:
        super().__init__(meta, spec, backend, run_impl, rows=meta.num_physical_tokens, kv_rows_exact=meta.num_kv_rows,
                         max_keys=meta.max_kv_len, q_name="q_local")
        self.algorithm = algorithm
        self._idx_shape = (meta.num_physical_tokens, spec.topk) if spec.sparse else None

    def attend(self, q_local: Tensor, k: Tensor, v: Tensor, idx: Optional[Tensor] = None,
               **call: Unpack[KernelCall]) -> Tensor | tuple[Tensor, Tensor]:
        """The kernel alone: local queries over K/V every key of which is given (device-only).

        Args:
            q_local: [P, Hq, D] in the plan's dtype (pad rows ignored).
            k, v: packed [num_kv_rows, Hkv, D] / [.., Dv] (prefix then extend of each sequence,
                :func:`cpattn.pack_kv`), or paged caches [num_pages, page_size, Hkv, D] / [.., Dv]
                with ``page_table`` [num_seq_rows, max_pages] int32/int64 (key j of sequence b
                at page ``page_table[b, j // page_size]``, slot ``j % page_size``). Any row
                strides; for absorbed MLA ``v`` may be a view of ``k[..., :Dv]`` (each latent row
                is then read once).
            idx: sparse specs only: [P, topk] int32/int64 key positions per row (index in the
                row's sequence, prefix counted); negative, future and out-of-sequence entries
                are ignored; a position counts once per occurrence.
            **call: :class:`KernelCall`: ``page_table`` (paged specs), ``sinks`` ([Hq] float,
                any float dtype and stride, when the spec has sinks), ``softmax_scale`` (default
                D ** -0.5), ``out`` ([P, Hq, Dv] buffer, q's dtype, contiguous last dim), ``lse``
                ([P, Hq] float32), ``return_lse`` (also return lse: natural log, float32, sinks
                counted; a sparse row with no valid key has lse = its sink, or -inf without sinks),
                ``k_scale`` / ``v_scale`` (an FP8 spec only, required there: float32 ``[]`` or
                ``[Hkv]`` device tensors; K/V hold ``x / scale``, :mod:`cpattn.quant`).

        Returns:
            out [P, Hq, Dv] (pad rows, and sparse rows with no valid key, exactly 0), or
            (out, lse) with return_lse (pad rows -inf).
        """
        page_table, sinks, softmax_scale, out, lse, return_lse, scales = self._kernel_call(call, "attend")
        self._check_call(q_local, k, v, page_table, sinks)
        self._check_idx(idx)
        out, lse = self._result(out, lse, return_lse)
        return self._attend(q_local, k, v, idx, page_table, sinks, softmax_scale, out, lse, return_lse, scales)

    def _attend(self, q_local, k, v, idx, page_table, sinks, softmax_scale, out, lse, return_lse, scales):
        """The launch, after the checks (``out`` / ``lse``: the call's buffers)."""
        scale = self._softmax_scale(softmax_scale)
        if self._idx_shape is None:
            self._launch(q_local, k, v, page_table, sinks, scale, out, lse, scales=scales)
        else:
            self._launch(q_local, k, v, idx, page_table, sinks, scale, out, lse, scales=scales)
        return (out, lse) if return_lse else out

    def run(self, q_local: Tensor, k_local: Tensor, v_local: Tensor, cache=None, *, idx: Optional[Tensor] = None,
            writes: Optional[CacheWritePlan] = None, group=None,
            **call: Unpack[KernelCall]) -> Tensor | tuple[Tensor, Tensor]:
        """One layer: gather the new K/V (one collective; none for "local"), write them, attend.

        Args:
            q_local, k_local, v_local: this rank's rows [P, Hq, D] / [P, Hkv, D] / [P, Hkv, Dv]
                (``strategy.shard`` order; pad rows ignored).
            cache: paged spec: the layer's caches ``(k_cache, v_cache)`` [num_pages, page_size,
                Hkv, D] / [.., Dv], written through ``writes`` and read through ``page_table``.
                Packed spec: None (no cached prefix) or the cached prefix ``(k_prefix,
                v_prefix)`` packed per sequence [sum(prefix_lens), Hkv, D] / [.., Dv].
            idx: sparse specs: [P, topk] (as :meth:`attend`). A DSA layer whose index keys travel
                with the latent in one collective uses the parts instead
                (``strategy.gather_packed``, :func:`cpattn.write_mla_cache`,
                :func:`cpattn.dsa.index_topk`, :meth:`attend`).
            writes: paged spec: :func:`cpattn.plan_cache_writes` of this forward (required).
            group: the CP group (None: the default group; unused by "local").
            **call: :class:`KernelCall` (``page_table``, ``sinks``, ``softmax_scale``, ``out``,
                ``lse``, ``return_lse``, ``k_scale`` / ``v_scale``), as :meth:`attend`. An FP8
                spec: the new K/V (in the plan's dtype) are quantized on this rank before the
                all-gather, which then moves FP8 bytes; a packed plan's cached prefix is FP8 too.

        A tile-scaled latent spec (``kv_layout="fp8_tile"``): ``k_local`` is the new latent rows
        [P, 1, D] (``kv_c | k_pe``) in the plan's dtype and ``v_local`` the view
        ``k_local[..., :Dv]``; ``cache`` is ``(rows, rows)``, ONE uint8 tensor twice ([num_pages,
        page_size, 1, row_bytes], or a packed plan's prefix [sum(prefix_lens), 1, row_bytes]);
        this rank quantizes its rows (:func:`cpattn.quant.quantize_mla_fp8_tiles`) before the
        all-gather, which moves the tile rows; no ``k_scale`` / ``v_scale``.

        Every check runs before the collective and the write (ValueError / TypeError naming the
        argument; the caches are unchanged when one fails).
        """
        page_table, sinks, softmax_scale, out, lse, return_lse, scales = self._kernel_call(call, "run")
        self._check_idx(idx)
        out, lse = self._result(out, lse, return_lse)  # checked (and allocated) before the collective and write
        k_all, v_all = self._gather_and_write(q_local, k_local, v_local, cache, writes, group, page_table, sinks,
                                              scales)
        self._check_call(q_local, k_all, v_all, page_table, sinks)
        return self._attend(q_local, k_all, v_all, idx, page_table, sinks, softmax_scale, out, lse, return_lse,
                            scales)

    def _check_idx(self, idx) -> None:
        if self._idx_shape is None:
            if idx is not None:
                raise ValueError("idx is for a sparse spec (AttentionSpec(topk=)); this plan is dense")
            return
        check_plan_index(idx, self._idx_shape, self._device)
