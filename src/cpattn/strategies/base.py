"""Shared machinery of every CP strategy: planning, shard, gather, K/V gather, attention dispatch.

A concrete strategy only says which rank owns each token (``_token_owner``) and the position step
inside one of its query segments (``segment_stride``). Everything else lives here, once.

Plan-then-run: :meth:`CPStrategy.build_metadata` runs on the host once per forward pass (it may
allocate and sync); ``shard``/``gather``/``gather_kv``/``attention`` are the per-layer path and do
no host sync of their own once the metadata is on the device.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Optional, Sequence

import torch
from torch import Tensor

from .._validation import check_int, check_tensor
from ..collectives import PendingGather, all_gather_rows, check_group
from ..kernels import AttentionCall, resolve_backend
from ..metadata import CPMetadata, LengthsLike, build_metadata

__all__ = ["CPStrategy", "block_of"]


def block_of(offsets: Tensor, lengths: Tensor, num_blocks: int) -> Tensor:
    """Block index of each offset when a length-L run is cut into ``num_blocks`` contiguous blocks
    of sizes ``L // num_blocks + (j < L % num_blocks)`` (earlier blocks take the remainder)."""
    base = lengths // num_blocks
    rem = lengths % num_blocks
    big_rows = rem * (base + 1)
    in_big = offsets < big_rows
    return torch.where(
        in_big,
        offsets // (base + 1),
        rem + (offsets - big_rows) // base.clamp(min=1),
    )


def _check_same(tensors: dict[str, Tensor], what: str) -> None:
    names = list(tensors)
    first = tensors[names[0]]
    for name in names[1:]:
        other = getattr(tensors[name], what)
        if other != getattr(first, what):
            raise ValueError(f"{name} {what} {other} != {names[0]} {what} {getattr(first, what)}")


class CPStrategy(ABC):
    """Base of the CP strategies. ``cp_size``: ranks C >= 1; ``pad_multiple``: physical row count
    alignment (e.g. 8 or 64 for engines whose kernels or CUDA graphs want aligned batches)."""

    name: ClassVar[str]

    def __init__(self, cp_size: int, pad_multiple: int = 1) -> None:
        self.cp_size = check_int(cp_size, "cp_size", 1)
        self.pad_multiple = check_int(pad_multiple, "pad_multiple", 1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cp_size={self.cp_size}, pad_multiple={self.pad_multiple})"

    @property
    def segment_stride(self) -> int:
        """Position step between consecutive local rows inside one kernel segment."""
        return 1

    @abstractmethod
    def _token_owner(self, seq_ids: Tensor, offsets: Tensor, extend_lens: Tensor) -> Tensor:
        """Owning rank of every logical token (same int dtype as the inputs). seq_ids, offsets: [T];
        extend_lens: [B]; int32, or int64 for batches past 2**31 keys."""

    # ------------------------------------------------------------------ plan (host, per forward)
    def build_metadata(
        self, extend_lens: LengthsLike, prefix_lens: Optional[LengthsLike] = None, *, rank: int
    ) -> CPMetadata:
        """Plan a batch for ``rank`` (host, vectorized; call once per forward, then ``.to(device)``).

        Args:
            extend_lens: [B] new tokens per sequence (list, tuple or 1-D int tensor; 0 allowed).
            prefix_lens: [B] tokens per sequence already in the KV cache (default 0).
            rank: this process's rank in the CP group, in [0, cp_size).

        Example::

            meta = cpattn.ZigzagStrategy(2).build_metadata([5, 9], [0, 3], rank=1).to("cuda")
        """
        return build_metadata(
            self.name,
            self._token_owner,
            self.segment_stride,
            self.cp_size,
            rank,
            self.pad_multiple,
            extend_lens,
            prefix_lens,
        )

    def check_metadata(self, meta: CPMetadata) -> None:
        """ValueError unless ``meta`` was built by this kind of strategy with the same geometry."""
        if not isinstance(meta, CPMetadata):
            raise TypeError(f"meta must be a CPMetadata, got {type(meta).__name__}")
        if (meta.strategy, meta.cp_size, meta.pad_multiple) != (self.name, self.cp_size, self.pad_multiple):
            raise ValueError(
                f"meta was built by strategy={meta.strategy!r} cp_size={meta.cp_size} "
                f"pad_multiple={meta.pad_multiple}, not by {self!r}"
            )

    def _check_rows(self, x: Tensor, name: str, dim: int, expected: int, what: str, meta: CPMetadata) -> int:
        check_tensor(x, name)
        if not -x.dim() <= dim < x.dim():
            raise ValueError(f"dim {dim} out of range for {name} of shape {tuple(x.shape)}")
        dim %= x.dim()
        if x.shape[dim] != expected:
            raise ValueError(f"{name} has {x.shape[dim]} rows along dim {dim}, expected {what} = {expected}")
        if x.device != meta.device:
            raise ValueError(f"{name} is on {x.device} but meta is on {meta.device} (use meta.to(device))")
        return dim

    # ------------------------------------------------------------------ boundary (per forward)
    def shard(self, x: Tensor, meta: CPMetadata, dim: int = 0) -> Tensor:
        """Logical ``[.., T, ..]`` -> this rank's physical ``[.., P, ..]`` along ``dim``.

        Rows ``[0, num_local_tokens)`` are ``x`` at ``meta.local_token_indices``; pad rows are zero.
        Use it for hidden states, input ids, 1-D positions and M-RoPE positions ``[3, T]`` (dim=1).
        """
        self.check_metadata(meta)
        dim = self._check_rows(x, "x", dim, meta.num_tokens, "num_tokens T", meta)
        shape = list(x.shape)
        shape[dim] = meta.num_physical_tokens
        out = x.new_zeros(shape)
        out.narrow(dim, 0, meta.num_local_tokens).copy_(x.index_select(dim, meta.local_token_indices))
        return out

    def gather(self, x_local: Tensor, meta: CPMetadata, group=None, dim: int = 0) -> Tensor:
        """Every rank's physical ``[.., P, ..]`` -> logical ``[.., T, ..]`` (pad dropped), identical
        on all ranks, in ONE all-gather over ``group`` (None: default group)."""
        self.check_metadata(meta)
        dim = self._check_rows(x_local, "x_local", dim, meta.num_physical_tokens, "num_physical_tokens", meta)
        check_group(meta, group)
        (full,) = all_gather_rows([x_local.movedim(dim, 0)], meta, group)
        return full.movedim(0, dim).contiguous()

    # ------------------------------------------------------------------ per layer
    def gather_kv(
        self, k_local: Tensor, v_local: Tensor, meta: CPMetadata, group=None, *, async_op: bool = False
    ) -> tuple[Tensor, Tensor] | PendingGather:
        """K ``[P, Hkv, D]`` and V ``[P, Hkv, Dv]`` of this rank -> logical ``[T, Hkv, D]``,
        ``[T, Hkv, Dv]`` of all extend tokens, packed into ONE all-gather.

        The results are views of one gathered buffer (rows strided, last dim contiguous); write
        them to a cache, or merge with cached prefix K/V via :func:`cpattn.pack_kv`.
        ``async_op=True`` returns a handle whose ``wait()`` gives ``[k, v]``.
        """
        self.check_metadata(meta)
        self._check_rows(k_local, "k_local", 0, meta.num_physical_tokens, "num_physical_tokens", meta)
        self._check_rows(v_local, "v_local", 0, meta.num_physical_tokens, "num_physical_tokens", meta)
        _check_same({"k_local": k_local, "v_local": v_local}, "dtype")
        check_group(meta, group)
        result = all_gather_rows([k_local, v_local], meta, group, async_op=async_op)
        return result if async_op else (result[0], result[1])

    def gather_mla_latent(
        self, kv_c_local: Tensor, k_pe_local: Tensor, meta: CPMetadata, group=None, *, async_op: bool = False
    ) -> tuple[Tensor, Tensor] | PendingGather:
        """MLA latent ``kv_c`` [P, r] and rotary key ``k_pe`` [P, d_rope] of this rank -> logical
        [T, r] and [T, d_rope] of all extend tokens, packed into ONE all-gather.

        This is what a paged MLA cache stores: (r + d_rope) * itemsize bytes per token instead of
        Hkv * (D + Dv) for up-projected K/V. Any dtype, fp8 included (moved as raw bytes; the two
        may differ, e.g. fp8 latent with bf16 rope key). ``async_op=True`` returns a handle.
        """
        self.check_metadata(meta)
        for name, t in (("kv_c_local", kv_c_local), ("k_pe_local", k_pe_local)):
            self._check_rows(t, name, 0, meta.num_physical_tokens, "num_physical_tokens", meta)
            if t.dim() != 2:
                raise ValueError(f"{name} must be 2-D [P, dim], got shape {tuple(t.shape)}")
        check_group(meta, group)
        result = all_gather_rows([kv_c_local, k_pe_local], meta, group, async_op=async_op)
        return result if async_op else (result[0], result[1])

    def attention(
        self,
        q_local: Tensor,
        k: Tensor,
        v: Tensor,
        meta: CPMetadata,
        *,
        page_table: Optional[Tensor] = None,
        softmax_scale: Optional[float] = None,
        window_size: Sequence[int] = (-1, -1),
        sinks: Optional[Tensor] = None,
        backend: str = "auto",
        return_lse: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Causal attention of this rank's local queries over their whole sequences.

        Args:
            q_local: [P, Hq, D] (P = meta.num_physical_tokens; pad rows are ignored).
            k, v: packed per sequence in logical order (prefix then extend of sequence 0, then
                sequence 1, ...): [num_kv_tokens, Hkv, D] and [num_kv_tokens, Hkv, Dv]. With
                ``page_table``: caches [num_pages, page_size, Hkv, D] / [.., Dv] where key j of
                sequence b is at page ``page_table[b, j // page_size]``, slot ``j % page_size``.
            page_table: [B, max_pages] int32, or None for packed K/V.
            softmax_scale: default D ** -0.5.
            window_size: (left, right) like flash-attn; a row at position p sees keys at positions
                in [p - left, p] (left = -1: no limit). Causal, so right must be -1 or 0.
            sinks: [Hq] float logits that join each row's softmax denominator only.
            backend: "auto", "torch", "triton" or "fa4" (see :func:`cpattn.resolve_backend`).
            return_lse: also return lse [P, Hq] float32, natural log; it counts the sinks
                (``lse = log(sum_j exp(s_j) + exp(sink))``) and is -inf on pad rows.

        Returns:
            out [P, Hq, Dv] in q's dtype, pad rows exactly zero; with return_lse, (out, lse).
        """
        call = self._attention_call(q_local, k, v, meta, page_table, softmax_scale, window_size, sinks, return_lse)
        out, lse = resolve_backend(call, backend).run(call)
        return (out, lse) if return_lse else out

    def _attention_call(
        self, q, k, v, meta, page_table, softmax_scale, window_size, sinks, return_lse
    ) -> AttentionCall:
        self.check_metadata(meta)
        self._check_rows(q, "q_local", 0, meta.num_physical_tokens, "num_physical_tokens", meta)
        for name, t in (("k", k), ("v", v)):
            check_tensor(t, name)
        if q.dim() != 3:
            raise ValueError(f"q_local must be [P, Hq, D], got shape {tuple(q.shape)}")
        if not q.dtype.is_floating_point:
            raise TypeError(f"q_local must be a floating tensor, got {q.dtype}")
        _check_same({"q_local": q, "k": k, "v": v}, "dtype")
        _check_same({"q_local": q, "k": k, "v": v}, "device")
        kv_dims = 4 if page_table is not None else 3
        for name, t in (("k", k), ("v", v)):
            if t.dim() != kv_dims:
                layout = "[num_pages, page_size, Hkv, D]" if kv_dims == 4 else "[num_kv_tokens, Hkv, D]"
                raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
        if k.shape[:-1] != v.shape[:-1]:
            raise ValueError(f"k shape {tuple(k.shape)} and v shape {tuple(v.shape)} differ before the last dim")
        if page_table is None:
            if k.shape[0] != meta.num_kv_tokens:
                raise ValueError(
                    f"k/v have {k.shape[0]} rows, expected sum(prefix_lens + extend_lens) = {meta.num_kv_tokens}"
                )
        else:
            self._check_page_table(page_table, k, meta)
        hq, hkv = q.shape[1], k.shape[-2]
        if hkv == 0 or hq % hkv != 0:
            raise ValueError(f"Hq={hq} must be a multiple of Hkv={hkv}")
        if k.shape[-1] != q.shape[-1]:
            raise ValueError(f"k head dim {k.shape[-1]} != q head dim {q.shape[-1]}")
        window = tuple(window_size)
        if len(window) != 2 or any(isinstance(w, bool) or not isinstance(w, int) for w in window):
            raise TypeError(f"window_size must be a pair of ints, got {window_size!r}")
        if window[0] < -1 or window[1] not in (-1, 0):
            raise ValueError(f"window_size must be (left >= -1, right in (-1, 0)) for causal attention, got {window}")
        if sinks is not None:
            check_tensor(sinks, "sinks")
            if tuple(sinks.shape) != (hq,) or not sinks.dtype.is_floating_point:
                raise ValueError(f"sinks must be a float [Hq={hq}] tensor, got {sinks.dtype} {tuple(sinks.shape)}")
            if sinks.device != q.device:
                raise ValueError(f"sinks is on {sinks.device} but q_local on {q.device}")
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
        return AttentionCall(q, k, v, meta, scale, window[0], sinks, page_table, bool(return_lse))

    @staticmethod
    def _check_page_table(page_table: Tensor, k_cache: Tensor, meta: CPMetadata) -> None:
        check_tensor(page_table, "page_table")
        if page_table.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"page_table must be int32 or int64, got {page_table.dtype}")
        if page_table.dim() != 2 or page_table.shape[0] != meta.num_seqs:
            raise ValueError(f"page_table must be [B={meta.num_seqs}, max_pages], got {tuple(page_table.shape)}")
        if page_table.device != k_cache.device:
            raise ValueError(f"page_table is on {page_table.device} but k on {k_cache.device}")
        page_size = k_cache.shape[1]
        if not 1 <= page_size <= 256:
            raise ValueError(f"page_size must be in [1, 256], got {page_size}")
        if page_table.shape[1] * page_size < meta.max_kv_len:
            raise ValueError(
                f"page_table holds {page_table.shape[1]} pages of {page_size} = "
                f"{page_table.shape[1] * page_size} keys, fewer than the longest sequence ({meta.max_kv_len})"
            )
