"""The CP plan: token placement, padding and the segment descriptors the kernels read.

A :class:`CPMetadata` is pure data. A strategy builds it once per forward pass on the host
(vectorized torch ops, no Python loop over tokens), :meth:`CPMetadata.to` moves it to the device,
and every layer of the forward reuses it. Nothing on the per-layer path reads it back to the host:
the few host-side numbers the per-layer path needs (row counts, grid sizes) are plain Python ints
stored alongside the tensors.

Vocabulary (the same everywhere in cpattn):

* ``T``: extend (new) tokens of the batch, packed sequence after sequence.
* logical row: index ``t`` in ``[0, T)``.
* local rows: the real tokens a rank owns, in increasing logical order (``num_local_tokens``).
* physical rows: ``num_physical_tokens`` rows every rank holds; rows past the local ones are pad.
* position: index of a token in its sequence, prefix counted (``prefix_len + offset``).
* packed K/V row: sequences laid out as ``prefix_0, extend_0, prefix_1, extend_1, ...``; the key at
  position ``p`` of sequence ``b`` is row ``cu_kv_lens[b] + p``.
* segment: a run of local rows of one sequence whose positions are ``pos0 + i * stride``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence, Union

import torch
from torch import Tensor

__all__ = ["CPMetadata", "LengthsLike", "TILE_ROWS", "as_lengths", "build_metadata"]

LengthsLike = Union[Sequence[int], Tensor]

#: Query-tile heights (rows) for which tile maps are planned; kernels pick one of these.
TILE_ROWS: tuple[int, ...] = (16, 32, 64, 128)

#: owner_fn(seq_ids, offsets, extend_lens) -> owning rank of every logical token, int64 [T].
OwnerFn = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class TileMap:
    """Query tiles of ``rows`` rows each, heaviest first (longest causal key range).

    ``segment[i]`` is the segment of tile ``i`` and ``row_offset[i]`` its first row inside that
    segment; int32 [num_tiles]. ``num_tiles`` is a host int (grid size, no device sync).
    """

    rows: int
    num_tiles: int
    segment: Tensor
    row_offset: Tensor

    def to(self, device: torch.device | str, non_blocking: bool = True) -> "TileMap":
        return dataclasses.replace(
            self,
            segment=self.segment.to(device, non_blocking=non_blocking),
            row_offset=self.row_offset.to(device, non_blocking=non_blocking),
        )


@dataclass(frozen=True)
class CPMetadata:
    """Placement of one batch's tokens on one CP rank, plus the kernel plan. Pure data.

    Tensor fields are int64 unless stated; ``[B]`` is per sequence, ``[T]`` per logical token,
    ``[n]`` per local row (``n = num_local_tokens``), ``[S]`` per segment.

    Attributes:
        strategy: name of the strategy that built it ("zigzag", "interleave", "contiguous").
        cp_size: number of CP ranks C. rank: this rank, in [0, C). pad_multiple: row alignment.
        num_seqs: B. num_tokens: T. num_kv_tokens: sum(prefix_lens + extend_lens).
        extend_lens, prefix_lens, kv_lens: [B]. cu_extend_lens, cu_kv_lens: [B + 1] offsets.
        local_token_indices: [n] logical row of each local row (increasing).
        local_positions: [n] position of each local row in its sequence (prefix counted).
        local_seq_ids: [n] sequence of each local row.
        num_local_tokens: n. num_local_tokens_per_rank: n of every rank (tuple of C ints).
        num_physical_tokens: P, rows every rank holds, the smallest multiple of pad_multiple
            >= max(num_local_tokens_per_rank).
        gather_index: [T] row of logical token t in the all-gathered ``[C * P]`` buffer.
        kv_extend_index: [T] packed K/V row of each extend token.
        kv_prefix_index: [sum(prefix_lens)] packed K/V row of each prefix token.
        max_kv_len: the longest prefix + extend (host int).
        causal_work_per_rank: per rank, the number of (query, key) pairs its local rows attend
            to under causal masking without window (host ints; a load-balance measure).
        seg_seq, seg_row0, seg_len, seg_pos0, seg_stride: [S] int32 segment descriptors
            (sequence, first local row, rows, first row's position, position step).
        seg_cu_rows: [S + 1] int32 first local row of each segment, then n (varlen cu_seqlens_q).
        seg_key_start: [S + 1] int32 packed K/V row of each segment's sequence start, then
            num_kv_tokens (varlen cu_seqlens_k used with seg_keys_used).
        seg_keys_used: [S] int32 keys visible to the segment's last row (its position + 1).
        max_seg_keys_used: the largest seg_keys_used (host int).
        tiles: query-tile maps keyed by tile height (see :data:`TILE_ROWS`).
        max_seg_len: the longest segment (host int).
    """

    strategy: str
    cp_size: int
    rank: int
    pad_multiple: int
    num_seqs: int
    num_tokens: int
    num_kv_tokens: int
    extend_lens: Tensor
    prefix_lens: Tensor
    kv_lens: Tensor
    cu_extend_lens: Tensor
    cu_kv_lens: Tensor
    local_token_indices: Tensor
    local_positions: Tensor
    local_seq_ids: Tensor
    num_local_tokens: int
    num_local_tokens_per_rank: tuple[int, ...]
    num_physical_tokens: int
    gather_index: Tensor
    kv_extend_index: Tensor
    kv_prefix_index: Tensor
    max_kv_len: int
    causal_work_per_rank: tuple[int, ...]
    seg_seq: Tensor
    seg_row0: Tensor
    seg_len: Tensor
    seg_pos0: Tensor
    seg_stride: Tensor
    seg_cu_rows: Tensor
    seg_key_start: Tensor
    seg_keys_used: Tensor
    max_seg_keys_used: int
    tiles: dict[int, TileMap]
    max_seg_len: int
    # Host copies of the small per-sequence / per-segment tables, for host-side planning
    # (the torch reference backend, FA4 argument building) without device syncs.
    host_cu_kv_lens: tuple[int, ...]
    host_segments: tuple[tuple[int, int, int, int, int], ...]

    @property
    def num_pad_tokens(self) -> int:
        """Pad rows on this rank: ``num_physical_tokens - num_local_tokens``."""
        return self.num_physical_tokens - self.num_local_tokens

    @property
    def num_segments(self) -> int:
        return len(self.host_segments)

    @property
    def device(self) -> torch.device:
        return self.local_token_indices.device

    @property
    def load_imbalance(self) -> float:
        """max / mean of ``causal_work_per_rank`` (1.0 is perfect balance; 1.0 for no work)."""
        work = self.causal_work_per_rank
        mean = sum(work) / len(work)
        return max(work) / mean if mean > 0 else 1.0

    def to(self, device: torch.device | str, non_blocking: bool = True) -> "CPMetadata":
        """Copy every tensor to ``device`` (host-to-device once per forward, before any layer)."""
        changes = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, Tensor):
                changes[field.name] = value.to(device, non_blocking=non_blocking)
        changes["tiles"] = {k: t.to(device, non_blocking) for k, t in self.tiles.items()}
        return dataclasses.replace(self, **changes)


def as_lengths(value: LengthsLike, name: str) -> Tensor:
    """Validate a list/tuple/1-D integer tensor of non-negative lengths; return int64 CPU [B]."""
    if isinstance(value, Tensor):
        if value.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got dtype {value.dtype}")
        lengths = value.detach().to("cpu", torch.int64)
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, bool) or not isinstance(item, int):
                if not (isinstance(item, Tensor) and item.dim() == 0 and not item.is_floating_point()):
                    raise TypeError(f"{name} must hold integers, got {type(item).__name__} {item!r}")
        lengths = torch.tensor([int(x) for x in value], dtype=torch.int64)
    else:
        raise TypeError(f"{name} must be a list, tuple or 1-D int tensor, got {type(value).__name__}")
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"{name} must be >= 0, got {lengths.tolist()}")
    return lengths


def _exclusive_cumsum(x: Tensor) -> Tensor:
    out = torch.zeros(x.numel() + 1, dtype=torch.int64)
    torch.cumsum(x, 0, out=out[1:])
    return out


def _tile_map(seg_len: Tensor, seg_pos0: Tensor, seg_stride: Tensor, rows: int) -> TileMap:
    counts = (seg_len + rows - 1) // rows
    num_tiles = int(counts.sum())
    segment = torch.repeat_interleave(torch.arange(seg_len.numel()), counts)
    first_tile = _exclusive_cumsum(counts)[:-1]
    row_offset = (torch.arange(num_tiles) - first_tile[segment]) * rows
    last_row = torch.minimum(row_offset + rows, seg_len[segment]) - 1
    last_pos = seg_pos0[segment] + seg_stride[segment] * last_row
    order = torch.argsort(last_pos, descending=True, stable=True)  # heaviest tiles first
    return TileMap(
        rows=rows,
        num_tiles=num_tiles,
        segment=segment[order].to(torch.int32),
        row_offset=row_offset[order].to(torch.int32),
    )


def build_metadata(
    strategy: str,
    owner_fn: OwnerFn,
    segment_stride: int,
    cp_size: int,
    rank: int,
    pad_multiple: int,
    extend_lens: LengthsLike,
    prefix_lens: LengthsLike | None,
) -> CPMetadata:
    """Plan one batch for one rank (host, vectorized over tokens). Strategies call this.

    ``owner_fn`` decides placement; everything else (padding, gather order, segments, tiles) is
    derived here the same way for every strategy.
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
    num_seqs = ext.numel()
    kv_lens = pre + ext
    cu_ext = _exclusive_cumsum(ext)
    cu_kv = _exclusive_cumsum(kv_lens)
    num_tokens = int(cu_ext[-1])

    # Per logical token: sequence, offset in the extend part, position, owner. Token-level math
    # runs in int32 when it fits (about twice as fast on the host as int64).
    tok = torch.int32 if int(cu_kv[-1]) < 2**31 - 1 else torch.int64
    seq_ids = torch.repeat_interleave(torch.arange(num_seqs, dtype=tok), ext)
    offsets = torch.arange(num_tokens, dtype=tok) - cu_ext.to(tok)[seq_ids]
    positions = pre.to(tok)[seq_ids] + offsets
    owner = owner_fn(seq_ids, offsets, ext.to(tok))

    # Local rows of every rank: its tokens in increasing logical order.
    per_rank = torch.bincount(owner, minlength=cp_size)
    rank_start = _exclusive_cumsum(per_rank)
    small_keys = owner.to(torch.int16 if cp_size < 2**15 else torch.int32)  # narrow keys sort ~5x faster
    by_rank = torch.argsort(small_keys, stable=True)
    local_row_sorted = torch.arange(num_tokens, dtype=tok) - rank_start.to(tok)[owner[by_rank]]
    local_row = torch.empty(num_tokens, dtype=tok)
    local_row[by_rank] = local_row_sorted
    max_local = int(per_rank.max()) if cp_size else 0
    physical = -(-max_local // pad_multiple) * pad_multiple
    gather_index = owner.long() * physical + local_row

    work = torch.bincount(owner, weights=(positions + 1).double(), minlength=cp_size)
    mine = by_rank[int(rank_start[rank]) : int(rank_start[rank + 1])]
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
    tiles = {rows: _tile_map(seg_len, seg_pos0, seg_stride, rows) for rows in TILE_ROWS}
    seg_keys_used = seg_pos0 + (seg_len - 1) * seg_stride + 1
    seg_cu_rows = torch.cat([seg_row0, torch.tensor([n])])
    seg_key_start = torch.cat([cu_kv[seg_seq], cu_kv[-1:]])
    kv_extend_index = cu_kv[seq_ids] + positions.long()
    cu_pre = _exclusive_cumsum(pre)
    prefix_seq = torch.repeat_interleave(torch.arange(num_seqs), pre)
    kv_prefix_index = cu_kv[prefix_seq] + torch.arange(prefix_seq.numel()) - cu_pre[prefix_seq]

    i32 = torch.int32
    return CPMetadata(
        strategy=strategy,
        cp_size=cp_size,
        rank=rank,
        pad_multiple=pad_multiple,
        num_seqs=num_seqs,
        num_tokens=num_tokens,
        num_kv_tokens=int(cu_kv[-1]),
        extend_lens=ext,
        prefix_lens=pre,
        kv_lens=kv_lens,
        cu_extend_lens=cu_ext,
        cu_kv_lens=cu_kv,
        local_token_indices=mine,
        local_positions=local_pos,
        local_seq_ids=local_seq,
        num_local_tokens=n,
        num_local_tokens_per_rank=tuple(int(c) for c in per_rank),
        num_physical_tokens=physical,
        gather_index=gather_index,
        kv_extend_index=kv_extend_index,
        kv_prefix_index=kv_prefix_index,
        max_kv_len=int(kv_lens.max()) if num_seqs else 0,
        causal_work_per_rank=tuple(int(w) for w in work),
        seg_seq=seg_seq.to(i32),
        seg_row0=seg_row0.to(i32),
        seg_len=seg_len.to(i32),
        seg_pos0=seg_pos0.to(i32),
        seg_stride=seg_stride.to(i32),
        seg_cu_rows=seg_cu_rows.to(i32),
        seg_key_start=seg_key_start.to(i32),
        seg_keys_used=seg_keys_used.to(i32),
        max_seg_keys_used=int(seg_keys_used.max()) if seg_keys_used.numel() else 0,
        tiles=tiles,
        max_seg_len=int(seg_len.max()) if seg_len.numel() else 0,
        host_cu_kv_lens=tuple(cu_kv.tolist()),
        host_segments=tuple(
            zip(seg_seq.tolist(), seg_row0.tolist(), seg_len.tolist(), seg_pos0.tolist(), seg_stride.tolist())
        ),
    )
