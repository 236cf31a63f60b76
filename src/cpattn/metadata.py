"""The placement plan: which rank owns which token, padding, gather order, query segments.

A :class:`CPMetadata` is pure data about one batch on one CP rank. A strategy builds it once per
forward pass on the host (vectorized torch ops, cost O(T + B): no Python loop over tokens, nothing
proportional to cached-prefix length), :meth:`CPMetadata.to` moves every tensor to the device in
ONE copy from one pinned host buffer, and every layer reuses it. What a particular attention
backend needs (tile maps, varlen descriptors) is not here: it lives in the attention plans
(:mod:`cpattn.plans`), built from this one.

Vocabulary (the same everywhere in cpattn):

* ``T``: extend (new) tokens of the batch, packed sequence after sequence; ``B`` sequences.
* logical row: index ``t`` in ``[0, T)``.
* local rows: the real tokens a rank owns, in increasing logical order (``n = num_local_tokens``).
* physical rows: ``P = num_physical_tokens`` rows every rank holds; rows ``[n, P)`` are pad.
* position: index of a token in its sequence, prefix counted (``prefix_len + offset``).
* packed K/V row: sequences laid out as ``prefix_0, extend_0, prefix_1, extend_1, ...``; the key at
  position ``p`` of sequence ``b`` is row ``cu_kv_lens[b] + p``.
* segment: a run of local rows of one sequence whose positions are ``pos0 + i * stride``. The
  segment arrays hold one more entry after the ``S`` real ones: the *pad segment*, rows
  ``[n, P)`` at position -1 (no key visible), so kernels write the pad rows themselves.

Static plans (:class:`cpattn.StaticPlanner`) have the same fields, sized for a capacity
(``meta.capacity``) at fixed device addresses; the "row" properties below give the sizes of the
tensors a caller passes (``num_token_rows`` etc.), which equal the batch counts otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor

from . import padding
from ._validation import as_lengths
from ._buffers import move_packed

__all__ = ["CPMetadata", "Capacity", "LengthsLike", "SEGMENT_FIELDS", "as_lengths", "build_metadata", "plan_fingerprint",
           "token_owners"]

LengthsLike = Union[Sequence[int], Tensor]

#: owner_fn(seq_ids, offsets, extend_lens) -> owning rank of every logical token [T].
OwnerFn = Callable[[Tensor, Tensor, Tensor], Tensor]

@dataclass(frozen=True)
class Capacity:
    """Sizes a static plan's tensors are allocated for (see :class:`cpattn.StaticPlanner`).

    max_tokens: T rows of logical tensors. max_seqs: B rows of per-sequence tensors (and of a
    page table). max_kv_tokens: rows of packed K/V. max_local_tokens: P, the physical rows of
    every rank. max_segments: S, query segments per rank. max_q_len: the longest
    extend of one sequence the kernels are sized for (0: max_tokens; 1 for plain decode steps).
    max_seq_len: the longest sequence (prefix + extend) a batch may hold (0: max_kv_tokens).
    """

    max_tokens: int
    max_seqs: int
    max_kv_tokens: int
    max_local_tokens: int
    max_segments: int
    max_q_len: int = 0
    max_seq_len: int = 0

    @property
    def seq_len_bound(self) -> int:
        """The most keys one sequence can have: ``max_seq_len``, or ``max_kv_tokens`` when 0."""
        return self.max_seq_len or self.max_kv_tokens

    @property
    def query_tile(self) -> int:
        """The longest q_len kernels are sized for: ``max_q_len``, or ``max_tokens`` when 0."""
        return self.max_q_len or self.max_tokens


#: Tensor fields of CPMetadata, in the order they are packed for the one host-to-device copy.
DEVICE_FIELDS = (
    "extend_lens", "prefix_lens", "kv_lens", "cu_extend_lens", "cu_kv_lens",
    "local_token_indices", "local_positions", "local_seq_ids", "shard_index", "row_valid",
    "gather_index", "kv_extend_index",
    "seg_seq", "seg_row0", "seg_len", "seg_pos0", "seg_stride", "counts",
    # sharded KV cache (``build_metadata(kv=)``; empty without it)
    "store_rows", "store_index", "local_prefix_lens", "local_kv_lens", "cu_local_kv_lens",
)


@dataclass(frozen=True, eq=False)
class CPMetadata:
    """Placement of one batch's tokens on one CP rank. Pure data; compare plans by ``fingerprint``.

    Tensors are int64 unless stated. ``[B]`` per sequence, ``[T]`` per logical token, ``[n]`` per
    local row, ``[P]`` per physical row, ``[S + 1]`` per segment (the last one is the pad segment).
    Host ints describe the batch itself; the ``num_*_rows`` properties give tensor sizes.

    Attributes:
        strategy: name of the strategy that built it ("zigzag", "interleave", "contiguous",
            "replicated").
        cp_size: C ranks. rank: this rank, in [0, C). pad_multiple: physical row alignment.
        num_seqs: B. num_tokens: T. num_kv_tokens: sum(prefix_lens + extend_lens).
        extend_lens, prefix_lens, kv_lens: [B]. cu_extend_lens, cu_kv_lens: [B + 1] offsets.
        local_token_indices, local_positions, local_seq_ids: [n] logical row, position and
            sequence of each local row (increasing logical order).
        num_local_tokens: n. num_local_tokens_per_rank: n of every rank (C host ints).
        num_physical_tokens: P = ``padding.physical_rows(num_local_tokens_per_rank, pad_multiple)``.
        shard_index: [P] logical row of each physical row (pad rows: 0). row_valid: [P] bool.
        gather_index: [T] row of logical token t in the all-gathered ``[C * P]`` buffer.
        kv_extend_index: [T] packed K/V row of each extend token.
        max_kv_len: the longest prefix + extend. max_seg_len: the longest segment (host ints).
        max_seg_keys: the largest ``last position + 1`` over segments (host int).
        has_strided_segments: some segment of > 1 row has stride != 1 (interleave).
        causal_work_per_rank: (query, key) pairs per rank under causal masking (host ints).
        seg_seq, seg_row0, seg_len, seg_pos0, seg_stride: [S + 1] int32 segment descriptors;
            entry S is the pad segment (row0 = n, len = P - n, pos0 = -1, stride 0).
        num_segments: S (host int).
        counts: [4] int32 on the device: T, n, num_kv_tokens, S (what static-plan kernels read).
        fingerprint: host ints identifying the plan (strategy, C, alignment, lengths, rank,
            capacity, index top-k); equal on every rank of a consistent CP group except for the
            rank entry.
        index_topk: the DSA index top-k the ranks agreed on with the plan
            (``build_metadata(index_topk=)``), 0 when none was given.
        group: the process group the plan was checked against (``build_metadata(group=)``).
        capacity: None, or the :class:`Capacity` of a static plan.
        host: the CPU copy this one was moved from (itself when on the CPU); planners read it.

    Queries: ``strategy`` "replicated" gives every rank every extend token (``num_local_tokens``
    = T, local row t = logical row t, no collective in ``gather`` / ``gather_kv``): a decode
    step, or CP switched off for one batch. ``max_q_len``: the longest extend of one sequence.

    KV layout (``strategy.build_metadata(..., kv=)``; the tensors are empty and the host values
    0 / () without it, when every rank stores every extend token):
        kv: the :class:`cpattn.KVSharding` of a sharded cache, or None (replicated cache).
        store_rows: [n_store] logical extend rows whose K/V this rank stores (increasing);
            store_index: [n_store] their local cache index. num_stored_tokens: n_store.
        local_prefix_lens, local_kv_lens: [B] prefix keys / prefix + extend keys this rank
            holds. cu_local_kv_lens: [B + 1] offsets of ``local_kv_lens`` (a packed local
            cache holds local key j of sequence b at row ``cu_local_kv_lens[b] + j``).
            num_local_kv_tokens, max_local_kv_len: sum and max of ``local_kv_lens`` (host ints).
            num_local_prefix_tokens_per_rank: sum(local prefix keys) of every rank
            (C host ints: what a pass-KV gather of the prefix shards moves).
    """

    strategy: str
    cp_size: int
    rank: int
    pad_multiple: int
    num_seqs: int
    num_tokens: int
    num_kv_tokens: int
    num_local_tokens: int
    num_local_tokens_per_rank: tuple[int, ...]
    num_physical_tokens: int
    num_segments: int
    max_kv_len: int
    max_seg_len: int
    max_seg_keys: int
    has_strided_segments: bool
    causal_work_per_rank: tuple[int, ...]
    extend_lens: Tensor
    prefix_lens: Tensor
    kv_lens: Tensor
    cu_extend_lens: Tensor
    cu_kv_lens: Tensor
    local_token_indices: Tensor
    local_positions: Tensor
    local_seq_ids: Tensor
    shard_index: Tensor
    row_valid: Tensor
    gather_index: Tensor
    kv_extend_index: Tensor
    seg_seq: Tensor
    seg_row0: Tensor
    seg_len: Tensor
    seg_pos0: Tensor
    seg_stride: Tensor
    counts: Tensor
    store_rows: Tensor
    store_index: Tensor
    local_prefix_lens: Tensor
    local_kv_lens: Tensor
    cu_local_kv_lens: Tensor
    fingerprint: tuple[int, ...]
    max_q_len: int = 0
    kv: Any = None
    num_stored_tokens: int = 0
    num_local_kv_tokens: int = 0
    max_local_kv_len: int = 0
    num_local_prefix_tokens_per_rank: tuple[int, ...] = ()
    group: Any = None
    index_topk: int = 0
    capacity: Optional[Capacity] = None
    host: Optional["CPMetadata"] = field(default=None, repr=False)
    arena: Any = field(default=None, repr=False)  # StaticPlanner buffers (static plans only)

    @property
    def replicated(self) -> bool:
        """Every rank computes every query (strategy "replicated"): no collective for queries."""
        return self.strategy == "replicated"

    @property
    def tile_q_len(self) -> int:
        """The longest q_len kernels are sized for: ``max_q_len``, or the capacity's."""
        return self.capacity.query_tile if self.capacity else self.max_q_len

    @property
    def row_seq(self) -> Tensor:
        """[n] int32 sequence of each local row (host)."""
        h = self.host if self.host is not None else self
        return h.local_seq_ids.to(torch.int32)

    @property
    def store_seq(self) -> Tensor:
        """[n_store] sequence of each row this rank stores in a sharded cache (host)."""
        h = self.host if self.host is not None else self
        return torch.searchsorted(h.cu_extend_lens, h.store_rows, right=True) - 1

    # ------------------------------------------------------------------ sizes of caller tensors
    @property
    def num_token_rows(self) -> int:
        """Rows of logical ``[T, ...]`` tensors (shard input, gather output): T, or the capacity."""
        return self.capacity.max_tokens if self.capacity else self.num_tokens

    @property
    def num_kv_rows(self) -> int:
        """Rows of packed K/V: num_kv_tokens, or the capacity."""
        return self.capacity.max_kv_tokens if self.capacity else self.num_kv_tokens

    @property
    def num_seq_rows(self) -> int:
        """Rows of per-sequence tensors and page tables: B, or the capacity."""
        return self.capacity.max_seqs if self.capacity else self.num_seqs

    @property
    def num_pad_tokens(self) -> int:
        """Pad rows on this rank: ``num_physical_tokens - num_local_tokens``."""
        return self.num_physical_tokens - self.num_local_tokens

    @property
    def device(self) -> torch.device:
        return self.gather_index.device

    @property
    def is_static(self) -> bool:
        return self.capacity is not None

    @property
    def load_imbalance(self) -> float:
        """max / mean of ``causal_work_per_rank`` (1.0 is perfect balance; 1.0 for no work)."""
        work = self.causal_work_per_rank
        mean = sum(work) / len(work)
        return max(work) / mean if mean > 0 else 1.0

    @property
    def host_segments(self) -> tuple[tuple[int, int, int, int, int], ...]:
        """The S real segments as (seq, row0, len, pos0, stride) host tuples (O(S) Python: for
        tests, benchmarks and the torch reference, never for the per-layer path of a kernel)."""
        h = self.host if self.host is not None else self
        s = self.num_segments
        cols = [getattr(h, f)[:s].tolist() for f in SEGMENT_FIELDS]
        return tuple(zip(*cols))

    def to(self, device: torch.device | str, non_blocking: bool = True) -> "CPMetadata":
        """Every tensor on ``device`` in ONE copy (from one pinned buffer when ``device`` is CUDA).

        The result keeps ``host`` (the CPU copy), which attention planning reads without a sync.
        """
        device = torch.device(device)
        src = self.host if self.host is not None else self
        if device.type == "cpu":
            return src
        if self.device == device or (device.index is None and self.device.type == device.type):
            return self
        tensors = {name: getattr(src, name) for name in DEVICE_FIELDS}
        views = move_packed(tensors, device, non_blocking)
        return dataclasses.replace(src, **views, host=src)


# ---------------------------------------------------------------------------- inputs
def _exclusive_cumsum(x: Tensor) -> Tensor:
    out = torch.zeros(x.numel() + 1, dtype=torch.int64)
    torch.cumsum(x, 0, out=out[1:])
    return out


# ---------------------------------------------------------------------------- fingerprint
_HASH_P = 2147483647  # 2**31 - 1: products of two residues fit in int64


#: (multiplier, salt) of the two position weightings of :func:`_lengths_hashes`.
_HASH_WEIGHTS = np.array([[1103515245, 12345], [69069, 1013904223]], dtype=np.int64)


def _lengths_hashes(ext: Tensor, pre: Tensor) -> list[int]:
    """Two vectorized polynomial hashes of the (extend, prefix) pairs (int64 CPU tensors), each
    in [0, 2**31 - 1): ``sum_i term_i * w_i mod p`` with ``w_i = (i * mult + salt) mod p`` for the
    two (mult, salt) of :data:`_HASH_WEIGHTS`, computed together (numpy: host arithmetic)."""
    e, p = ext.numpy(), pre.numpy()
    if e.size <= _SMALL_BATCH:  # the same sums in Python ints: a decode step's few sequences
        terms = [((a % _HASH_P) * 40503 + (b % _HASH_P) * 65599 + 1) % _HASH_P for a, b in zip(e.tolist(), p.tolist())]
        return [sum(map(operator.mul, terms, w)) % _HASH_P for w in _hash_weight_lists(e.size)]
    term = ((e % _HASH_P) * 40503 + (p % _HASH_P) * 65599 + 1) % _HASH_P
    return (((term * _hash_weights(e.size)) % _HASH_P).sum(1) % _HASH_P).tolist()


#: Batches up to this many sequences hash in Python ints (faster than numpy's per-op overhead).
_SMALL_BATCH = 16


@functools.lru_cache(maxsize=16)
def _hash_weights(size: int) -> np.ndarray:
    """The [2, size] position weights of :func:`_lengths_hashes` (read-only; batch sizes repeat)."""
    w = (np.arange(size, dtype=np.int64) * _HASH_WEIGHTS[:, :1] + _HASH_WEIGHTS[:, 1:]) % _HASH_P
    w.flags.writeable = False
    return w


@functools.lru_cache(maxsize=_SMALL_BATCH + 1)
def _hash_weight_lists(size: int) -> tuple[list[int], list[int]]:
    """:func:`_hash_weights` as Python ints (the small-batch path)."""
    return tuple(_hash_weights(size).tolist())


#: the capacity part of a dynamic plan's fingerprint
_NO_CAPACITY = (0,) * len(dataclasses.fields(Capacity))


def plan_fingerprint(
    strategy: str, cp_size: int, rank: int, pad_multiple: int, ext: Tensor, pre: Tensor,
    capacity: Optional[Capacity] = None, kv=None, index_topk: int = 0,
) -> tuple[int, ...]:
    """Host ints that identify a plan: equal on all ranks of one batch except ``rank``.

    (strategy code, cp_size, pad_multiple, B, T, num_kv_tokens, two length hashes,
    capacity..., index_topk, rank). Strategies and :class:`cpattn.StaticPlanner` exchange it
    over the group. A KV sharding joins the strategy code (ranks must shard the cache the same
    way); ``index_topk`` (0: none) is the DSA index top-k the ranks will select (the width of the
    candidates they exchange over a sharded cache).
    """
    cap = dataclasses.astuple(capacity) if capacity is not None else _NO_CAPACITY
    code = strategy if kv is None else f"{strategy}/kv{kv.cp_size}x{kv.interleave}"
    e, p = ext.numpy(), pre.numpy()
    num_tokens = int(e.sum())
    return (
        _code_hash(code), cp_size, pad_multiple, e.size, num_tokens, num_tokens + int(p.sum()),
        *_lengths_hashes(ext, pre), *cap, index_topk, rank,
    )


@functools.lru_cache(maxsize=64)
def _code_hash(code: str) -> int:
    """A stable 31-bit hash of a strategy / KV-layout code (CRC-32)."""
    return zlib.crc32(code.encode()) & 0x7FFFFFFF


# ---------------------------------------------------------------------------- build
def build_metadata(
    strategy: str,
    owner_fn: OwnerFn,
    segment_stride: int,
    cp_size: int,
    rank: int,
    pad_multiple: int,
    extend_lens: LengthsLike,
    prefix_lens: LengthsLike | None,
    physical_rows: Optional[int] = None,
    kv=None,
    replicated: bool = False,
    index_topk: int = 0,
) -> CPMetadata:
    """Plan one batch for one rank on the host (O(T + B), vectorized). Strategies call this.

    ``owner_fn`` decides placement; everything else (padding, gather order, segments) is derived
    here the same way for every strategy. ``physical_rows``: a fixed P (static plans; ValueError
    when a rank owns more rows), else ``padding.physical_rows`` of the per-rank counts.
    ``kv``: a :class:`cpattn.KVSharding` with ``cp_size`` ranks: also plan which extend
    rows this rank stores in its sharded cache (O(T)) and its local key counts (O(B C)).
    ``replicated``: every rank owns every token (``owner_fn`` is not called): local row t is
    logical row t on every rank (:func:`_build_replicated`). ``index_topk``: the DSA index top-k
    the ranks agree on with the plan (0: none; see ``CPStrategy.build_metadata``).
    """
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"rank must be an int, got {type(rank).__name__}")
    if not 0 <= rank < cp_size:
        raise ValueError(f"rank must be in [0, cp_size={cp_size}), got {rank}")
    ext = as_lengths(extend_lens, "extend_lens")
    pre = torch.zeros_like(ext) if prefix_lens is None else as_lengths(prefix_lens, "prefix_lens")
    if pre.numel() != ext.numel():
        raise ValueError(
            f"extend_lens and prefix_lens must have the same size, got {ext.numel()} and {pre.numel()}"
        )
    if replicated:
        return _build_replicated(strategy, cp_size, rank, pad_multiple, ext, pre, physical_rows, kv, index_topk)
    kv_lens = pre + ext
    cu_ext = _exclusive_cumsum(ext)
    cu_kv = _exclusive_cumsum(kv_lens)
    num_tokens = int(cu_ext[-1])
    seq_ids, positions, owner = token_owners(owner_fn, ext, pre, cu_ext, int(cu_kv[-1]))
    tok = seq_ids.dtype
    # Local rows of every rank: its tokens in increasing logical order.
    per_rank = torch.bincount(owner, minlength=cp_size)
    rank_start = _exclusive_cumsum(per_rank)
    small_keys = owner.to(torch.int16 if cp_size < 2**15 else torch.int32)  # narrow keys sort ~5x faster
    by_rank = torch.argsort(small_keys, stable=True)
    local_row_sorted = torch.arange(num_tokens, dtype=tok) - rank_start.to(tok)[owner[by_rank]]
    local_row = torch.empty(num_tokens, dtype=tok)
    local_row[by_rank] = local_row_sorted
    counts_per_rank = tuple(int(c) for c in per_rank)
    physical = padding.physical_rows(counts_per_rank, pad_multiple)
    if physical_rows is not None:
        if physical > physical_rows:
            raise ValueError(
                f"batch over capacity: a rank owns {max(counts_per_rank)} rows, more than the "
                f"{physical_rows} physical rows planned"
            )
        physical = physical_rows
    gather_index = owner.long() * physical + local_row
    work = torch.bincount(owner, weights=(positions + 1).double(), minlength=cp_size)
    mine = by_rank[int(rank_start[rank]) : int(rank_start[rank + 1])].long()
    local_seq = seq_ids[mine].long()
    local_pos = positions[mine].long()
    n = mine.numel()

    # Segments: break where the sequence changes or the position step is not the stride.
    starts = torch.ones(n, dtype=torch.bool)
    if n > 1:
        starts[1:] = (local_seq[1:] != local_seq[:-1]) | (local_pos[1:] - local_pos[:-1] != segment_stride)
    seg_row0 = torch.nonzero(starts).flatten()
    seg_len = torch.diff(seg_row0, append=torch.tensor([n]))
    seg_seq = local_seq[seg_row0]
    seg_pos0 = local_pos[seg_row0]
    seg_stride = torch.full_like(seg_row0, segment_stride)
    num_segments = seg_row0.numel()
    seg_keys = seg_pos0 + (seg_len - 1) * seg_stride + 1

    sharded = _sharded_cache_fields(kv, cp_size, rank, positions, pre, kv_lens)

    shard_index = torch.zeros(physical, dtype=torch.int64)
    shard_index[:n] = mine
    row_valid = torch.zeros(physical, dtype=torch.bool)
    row_valid[:n] = True
    return CPMetadata(
        **_batch_fields(strategy, cp_size, rank, pad_multiple, kv, ext, pre, kv_lens, cu_ext, cu_kv, n, num_segments,
                        index_topk),
        **_segment_fields((seg_seq, seg_row0, seg_len, seg_pos0, seg_stride), n, physical), **sharded,
        num_local_tokens_per_rank=counts_per_rank, num_physical_tokens=physical,
        max_seg_len=int(seg_len.max()) if num_segments else 0, max_seg_keys=int(seg_keys.max()) if num_segments else 0,
        has_strided_segments=bool(segment_stride != 1 and bool((seg_len > 1).any())),
        causal_work_per_rank=tuple(int(w) for w in work), local_token_indices=mine, local_positions=local_pos,
        local_seq_ids=local_seq, shard_index=shard_index, row_valid=row_valid, gather_index=gather_index,
        kv_extend_index=cu_kv[seq_ids.long()] + positions.long(),
    )


def _batch_fields(strategy: str, cp_size: int, rank: int, pad_multiple: int, kv, ext: Tensor, pre: Tensor,
                  kv_lens: Tensor, cu_ext: Tensor, cu_kv: Tensor, n: int, num_segments: int,
                  index_topk: int = 0) -> dict:
    """The fields every placement derives alike from the batch's int64 CPU lengths ([B] ``ext``,
    ``pre``, ``kv_lens``; [B + 1] offsets), its ``n`` local rows and ``num_segments`` segments."""
    # numpy views of the CPU tensors: a host scalar costs ~1 us there against 2-3 us per torch op
    e_np, kv_np = ext.numpy(), kv_lens.numpy()
    num_seqs, num_tokens, num_kv_tokens = e_np.size, int(cu_ext.numpy()[-1]), int(cu_kv.numpy()[-1])
    return dict(
        strategy=strategy, cp_size=cp_size, rank=rank, pad_multiple=pad_multiple, num_seqs=num_seqs,
        num_tokens=num_tokens, num_kv_tokens=num_kv_tokens, num_local_tokens=n, num_segments=num_segments,
        max_kv_len=int(kv_np.max()) if num_seqs else 0, max_q_len=int(e_np.max()) if num_seqs else 0,
        extend_lens=ext, prefix_lens=pre, kv_lens=kv_lens, cu_extend_lens=cu_ext, cu_kv_lens=cu_kv,
        counts=torch.from_numpy(np.array([num_tokens, n, num_kv_tokens, num_segments], dtype=np.int32)),
        fingerprint=plan_fingerprint(strategy, cp_size, rank, pad_multiple, ext, pre, kv=kv, index_topk=index_topk),
        index_topk=index_topk,
    )


#: the segment descriptor fields, in the order :func:`_segment_fields` takes them
SEGMENT_FIELDS = ("seg_seq", "seg_row0", "seg_len", "seg_pos0", "seg_stride")


def _segment_fields(segments, n: int, physical: int) -> dict[str, Tensor]:
    """The [S + 1] int32 segment descriptors: the S real segments (seq, row0, len, pos0, stride:
    five [S] int CPU tensors or arrays) and the pad segment, rows [n, physical) at position -1
    (no key visible), stride 0."""
    s = len(segments[1])
    segs = np.empty((5, s + 1), dtype=np.int32)
    for i, column in enumerate(segments):
        segs[i, :s] = column
    segs[:, s] = 0, n, physical - n, -1, 0
    return dict(zip(SEGMENT_FIELDS, torch.from_numpy(segs).unbind(0)))


def token_owners(owner_fn: OwnerFn, ext: Tensor, pre: Tensor, cu_ext: Optional[Tensor] = None,
                 num_kv_tokens: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(sequence, position, owning rank) of every logical new token [T] (O(T), vectorized):
    ``ext`` / ``pre`` int64 [B]; ``cu_ext`` their exclusive cumsum and ``num_kv_tokens`` the
    batch's keys when the caller has them. Token-level math runs in int32 when the batch's keys
    fit (about twice as fast on the host as int64)."""
    if cu_ext is None:
        cu_ext = _exclusive_cumsum(ext)
    if num_kv_tokens is None:
        num_kv_tokens = int(ext.sum() + pre.sum())
    num_tokens = int(cu_ext[-1])
    tok = torch.int32 if num_kv_tokens < 2**31 - 1 else torch.int64
    seq_ids = torch.repeat_interleave(torch.arange(ext.numel(), dtype=tok), ext, output_size=num_tokens)
    offsets = torch.arange(num_tokens, dtype=tok) - cu_ext.to(tok)[seq_ids]
    positions = pre.to(tok)[seq_ids] + offsets
    return seq_ids, positions, owner_fn(seq_ids, offsets, ext.to(tok))


def _build_replicated(strategy: str, cp_size: int, rank: int, pad_multiple: int, ext: Tensor, pre: Tensor,
                      physical_rows: Optional[int], kv, index_topk: int = 0) -> CPMetadata:
    """The plan of the "replicated" placement (every rank owns every token, one stride-1 segment
    per non-empty sequence), in numpy: a decode step of B sequences costs O(B) host ints."""
    e, p = ext.numpy(), pre.numpy()
    num_seqs = e.size
    kv_np = e + p
    cu_ext = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(e, out=cu_ext[1:])
    cu_kv = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(kv_np, out=cu_kv[1:])
    t = int(cu_ext[-1])
    seq = np.repeat(np.arange(num_seqs, dtype=np.int64), e)
    positions = p[seq] + np.arange(t, dtype=np.int64) - cu_ext[seq]
    physical = -(-t // pad_multiple) * pad_multiple  # padding.physical_rows of (t,) * cp_size
    if physical_rows is not None:
        if physical > physical_rows:
            raise ValueError(f"batch over capacity: a rank owns {t} rows, more than the {physical_rows} physical "
                             "rows planned")
        physical = physical_rows
    live = np.flatnonzero(e > 0)
    s = live.size
    rows = torch.from_numpy(np.arange(t, dtype=np.int64))  # local row t is logical row t (read-only, shared)
    if physical == t:
        shard_index, row_valid = rows, torch.ones(t, dtype=torch.bool)
    else:
        shard_index = torch.zeros(physical, dtype=torch.int64)
        shard_index[:t] = rows
        row_valid = torch.zeros(physical, dtype=torch.bool)
        row_valid[:t] = True
    work = int((positions + 1).sum())
    as_t = torch.from_numpy
    return CPMetadata(
        **_batch_fields(strategy, cp_size, rank, pad_multiple, kv, ext, pre, as_t(kv_np), as_t(cu_ext), as_t(cu_kv),
                        t, s, index_topk),
        **_segment_fields((live, cu_ext[live], e[live], p[live], 1), t, physical),
        **_sharded_cache_fields(kv, cp_size, rank, positions, p, kv_np, replicated=True),
        num_local_tokens_per_rank=(t,) * cp_size, num_physical_tokens=physical,
        max_seg_len=int(e.max()) if num_seqs else 0, max_seg_keys=int(kv_np[live].max()) if s else 0,
        has_strided_segments=False, causal_work_per_rank=(work,) * cp_size, local_token_indices=rows,
        local_positions=as_t(positions), local_seq_ids=as_t(seq), shard_index=shard_index, row_valid=row_valid,
        gather_index=rows, kv_extend_index=as_t(cu_kv[seq] + positions),
    )


def _sharded_cache_fields(kv, cp_size: int, rank: int, positions, pre, kv_lens, replicated: bool = False) -> dict:
    """The sharded-cache write plan of a batch (store rows and local indices, O(T)) and the
    rank's local key counts (O(B C)); empty fields without a sharding. ``positions`` [T],
    ``pre`` [B], ``kv_lens`` [B]: int CPU tensors or numpy arrays."""
    empty = torch.zeros(0, dtype=torch.int64)
    if kv is None:
        return dict(store_rows=empty, store_index=empty, local_prefix_lens=empty, local_kv_lens=empty,
                    cu_local_kv_lens=empty)
    if kv.cp_size != cp_size:
        raise ValueError(f"kv has cp_size={kv.cp_size} but the strategy has cp_size={cp_size}")
    # numpy on the host: [T] and [C, B] arithmetic costs ~1 us per op where a torch op costs several
    from .kv_sharding import local_key_counts, local_key_index

    c, inter = kv.cp_size, kv.interleave
    as_np = lambda x: x if isinstance(x, np.ndarray) else x.numpy()  # noqa: E731
    pos = as_np(positions).astype(np.int64, copy=False)
    store_rows = np.flatnonzero((pos // inter) % c == rank)
    pre_np, kv_np = as_np(pre), as_np(kv_lens)
    if replicated:  # only this rank's prefix keys (the per-rank totals serve pass-KV's cost model)
        prefix_per_rank = None
        local_pre = local_key_counts(pre_np, rank, c, inter)
    else:
        prefix_per_rank = local_key_counts(pre_np[None, :], np.arange(c)[:, None], c, inter)  # [C, B]
        local_pre = np.ascontiguousarray(prefix_per_rank[rank])
    local_kv = local_key_counts(kv_np, rank, c, inter)
    cu_local = np.zeros(local_kv.size + 1, dtype=np.int64)
    np.cumsum(local_kv, out=cu_local[1:])
    return dict(
        store_rows=torch.from_numpy(store_rows),
        store_index=torch.from_numpy(local_key_index(pos[store_rows], c, inter)),
        local_prefix_lens=torch.from_numpy(local_pre),
        local_kv_lens=torch.from_numpy(local_kv),
        cu_local_kv_lens=torch.from_numpy(cu_local),
        kv=kv,
        num_stored_tokens=int(store_rows.size),
        num_local_kv_tokens=int(cu_local[-1]),
        max_local_kv_len=int(local_kv.max()) if local_kv.size else 0,
        num_local_prefix_tokens_per_rank=() if prefix_per_rank is None else tuple(int(x) for x in
                                                                                  prefix_per_rank.sum(1)),
    )
