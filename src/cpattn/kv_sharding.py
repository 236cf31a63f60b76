"""Sharded KV cache: the placement rule, decode plans, sharded cache writes, pass-KV / pass-Q choice.

With a sharded cache, the key at position ``p`` of every sequence lives on CP rank
``(p // I) % C`` only (``I`` = interleave), at local index
``(p // (C * I)) * I + p % I`` of that rank's cache for the sequence: each rank holds about
``L / C`` keys of a length-``L`` sequence, densely indexed from 0, so its pages hold nothing but
its own keys (at most one partial page per sequence). Local key ``j`` of rank ``r`` has global
position ``(j // I) * C * I + r * I + j % I`` (for ``C = 1``: ``p = j``).

What lives here (all host planning: vectorized, O(T + B), nothing proportional to cached keys):

* :class:`KVSharding`: the rule (``owner``, ``local_index``, ``global_position``,
  ``local_lengths``) and the decode planner ``build_decode_metadata``.
* :class:`DecodeMetadata`: a decode placement plan (queries replicated on every rank, the last
  ``q_len`` positions of each sequence; keys sharded), moved to the device in ONE copy;
  :class:`StaticDecodePlanner` writes it into fixed buffers for CUDA-graph replay.
* :class:`ShardWritePlan` / :func:`plan_shard_writes` / :func:`write_sharded_kv`: which new rows
  this rank stores and at which slot, validated on the host once per forward (nothing is written
  when it fails); the per-layer write is one ``index_copy_`` per cache, device-only.
* :class:`ExtendCostModel` / :func:`choose_extend_algorithm`: pass-KV or pass-Q for an extend
  over a sharded prefix (see docs/sharded-kv.md for the model and its measured crossover).
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np
import torch
from torch import Tensor

from . import _buffers
from ._validation import check_int, check_tensor
from .metadata import LengthsLike, _lengths_hashes, as_lengths

__all__ = [
    "DecodeCapacity",
    "DecodeMetadata",
    "ExtendCostModel",
    "KVSharding",
    "ShardWritePlan",
    "StaticDecodePlanner",
    "choose_extend_algorithm",
    "plan_shard_writes",
    "write_sharded_cache",
    "write_sharded_kv",
]

IntOrTensor = Union[int, Tensor]

EXTEND_ALGORITHMS = ("pass_kv", "pass_q")


# ----------------------------------------------------------------------------- the rule
@dataclass(frozen=True)
class KVSharding:
    """Key at position ``p`` lives on rank ``(p // interleave) % cp_size`` only.

    Args:
        cp_size: C >= 1 ranks sharing the cache.
        interleave: I >= 1 consecutive positions per rank before moving to the next one (vLLM's
            ``cp_kv_cache_interleave_size``); with a paged cache the page size must be a
            multiple of I (:meth:`check_page_size`), so a rank's run of I positions never
            straddles a page.

    Example::

        sh = cpattn.KVSharding(4, interleave=1)
        sh.owner(torch.arange(8))        # tensor([0, 1, 2, 3, 0, 1, 2, 3])
        sh.local_index(torch.arange(8))  # tensor([0, 0, 0, 0, 1, 1, 1, 1])
    """

    cp_size: int
    interleave: int = 1

    def __post_init__(self) -> None:
        check_int(self.cp_size, "cp_size", 1)
        check_int(self.interleave, "interleave", 1)

    @property
    def period(self) -> int:
        """``C * I``: positions after which the placement repeats."""
        return self.cp_size * self.interleave

    # -- pure, vectorized (ints or integer tensors of any shape; tensors stay on their device)
    def owner(self, positions: IntOrTensor) -> IntOrTensor:
        """Rank holding the key at each position: ``(p // I) % C``."""
        p = _check_positions(positions, "positions")
        return (p // self.interleave) % self.cp_size

    def local_index(self, positions: IntOrTensor) -> IntOrTensor:
        """Index of each position's key in its owner's cache: ``(p // (C I)) * I + p % I``."""
        p = _check_positions(positions, "positions")
        return _local_index(p, self.cp_size, self.interleave)

    def global_position(self, local_index: IntOrTensor, rank: int) -> IntOrTensor:
        """Position of local key ``j`` of ``rank``: ``(j // I) * C * I + rank * I + j % I``."""
        self._check_rank(rank)
        j = _check_positions(local_index, "local_index")
        return (j // self.interleave) * self.period + rank * self.interleave + j % self.interleave

    def local_lengths(self, lengths: LengthsLike, rank: int) -> Tensor:
        """Keys ``rank`` holds of sequences of ``lengths`` keys: ``#{p < L : owner(p) = rank}``
        = ``(L // (C I)) * I + clamp(L % (C I) - rank * I, 0, I)``. int64 CPU [B]."""
        self._check_rank(rank)
        lens = as_lengths(lengths, "lengths")
        return _local_lengths(lens, rank, self.cp_size, self.interleave)

    def check_page_size(self, page_size: int) -> int:
        """ValueError unless a paged cache's ``page_size`` is a multiple of ``interleave``."""
        ps = check_int(page_size, "page_size", 1)
        if ps % self.interleave:
            raise ValueError(
                f"page_size={ps} must be a multiple of the KV sharding's interleave={self.interleave} "
                "(a rank's run of interleave positions must not straddle a page)"
            )
        return ps

    def _check_rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"rank must be an int, got {type(rank).__name__}")
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank must be in [0, cp_size={self.cp_size}), got {rank}")
        return rank

    # -- decode plans
    def build_decode_metadata(
        self, seq_lens: LengthsLike, q_lens: Optional[LengthsLike] = None, *, rank: int, group=None
    ) -> "DecodeMetadata":
        """Plan one decode step for ``rank`` (host, O(B + rows); then ``.to(device)``).

        Args:
            seq_lens: [B] keys of each sequence AFTER this step's tokens are appended (so the
                queries sit at positions ``seq_len - q_len .. seq_len - 1``).
            q_lens: [B] query tokens per sequence (default 1; k for speculative verification;
                0 allowed); ``q_lens <= seq_lens``.
            rank: this process's rank in the CP group.
            group: the CP group: given, the ranks exchange a plan fingerprint in ONE tiny
                all-gather and all raise :class:`cpattn.PlanDisagreement` when any rank
                planned another batch or sharding (as ``strategy.build_metadata(group=)``).

        Queries (``[sum(q_lens), Hq, D]``, sequence after sequence) are the same on every rank
        (replicated, the Helix layout); ``shard_attention`` attends them over this rank's keys
        and ``merge_partials`` combines the ranks' partials.

        Example::

            dmeta = sh.build_decode_metadata(seq_lens, rank=r, group=g).to("cuda")
        """
        return _agreed(lambda: _build_decode(self, seq_lens, q_lens, rank, None), group, self.cp_size)


def _check_positions(x: IntOrTensor, name: str) -> IntOrTensor:
    if isinstance(x, Tensor):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got dtype {x.dtype}")
        if x.device.type == "cpu" and x.numel() and int(x.min()) < 0:
            raise ValueError(f"{name} must be >= 0, got min {int(x.min())}")
        return x
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name} must be an int or an integer tensor, got {type(x).__name__}")
    if x < 0:
        raise ValueError(f"{name} must be >= 0, got {x}")
    return x


def _local_lengths(lens, rank: int, cp_size: int, interleave: int):
    """Keys ``rank`` holds of sequences of ``lens`` keys (a torch tensor or a numpy array)."""
    period = cp_size * interleave
    return (lens // period) * interleave + (lens % period - rank * interleave).clip(0, interleave)


def _local_index(positions, cp_size: int, interleave: int):
    """Index of each position's key in its owner's cache (a torch tensor, numpy array or int)."""
    return (positions // (cp_size * interleave)) * interleave + positions % interleave


# ----------------------------------------------------------------------------- decode plans
@dataclass(frozen=True)
class DecodeCapacity:
    """Sizes a static decode plan's tensors are allocated for (:class:`StaticDecodePlanner`).

    max_seqs: B rows of per-sequence tensors and page tables. max_query_rows: rows of q / out
    (sum of q_lens). max_q_len: the longest q_len (the kernels' query tile).
    """

    max_seqs: int
    max_query_rows: int
    max_q_len: int


#: Tensor fields of DecodeMetadata, in the order they are packed for the one host-to-device copy.
DECODE_DEVICE_FIELDS = (
    "seq_lens", "q_lens", "cu_q_lens", "local_kv_lens", "cu_local_kv_lens", "row_seq", "store_rows",
    "store_index", "counts",
)


@dataclass(frozen=True, eq=False)
class DecodeMetadata:
    """One decode step on one rank of a sharded cache. Pure data; compare by ``fingerprint``.

    Tensors int64 unless stated; ``[B]`` per sequence, ``[Nq]`` per query row (query rows are
    the new tokens, sequence after sequence: rows ``cu_q_lens[b] .. cu_q_lens[b + 1]`` sit at
    positions ``seq_lens[b] - q_lens[b] + i``).

    Attributes:
        sharding: the :class:`KVSharding`. rank: this rank. num_seqs: B.
        num_query_rows: Nq = sum(q_lens). max_q_len, max_seq_len: host ints.
        num_local_kv_tokens: sum(local_kv_lens). max_local_kv_len: host int.
        seq_lens, q_lens: [B]. cu_q_lens: [B + 1].
        local_kv_lens: [B] keys of each sequence this rank holds (new tokens included).
        cu_local_kv_lens: [B + 1]: with a packed local cache, local key j of sequence b is row
            ``cu_local_kv_lens[b] + j``.
        row_seq: [Nq] int32 sequence of each query row (-1 on a static plan's pad rows).
        store_rows: [n] query rows whose new K/V this rank stores (increasing);
            store_index: [n] their local index. num_stored_tokens: n (host int).
        counts: [3] int32 on the device: Nq, B, n.
        fingerprint: host ints, equal on every rank of a consistent group except the rank.
        group, capacity (a :class:`DecodeCapacity` for static plans), host (the CPU copy).
    """

    sharding: KVSharding
    rank: int
    num_seqs: int
    num_query_rows: int
    max_q_len: int
    max_seq_len: int
    num_local_kv_tokens: int
    max_local_kv_len: int
    num_stored_tokens: int
    seq_lens: Tensor
    q_lens: Tensor
    cu_q_lens: Tensor
    local_kv_lens: Tensor
    cu_local_kv_lens: Tensor
    row_seq: Tensor
    store_rows: Tensor
    store_index: Tensor
    counts: Tensor
    fingerprint: tuple[int, ...]
    group: Any = None
    capacity: Optional[DecodeCapacity] = None
    host: Optional["DecodeMetadata"] = field(default=None, repr=False)
    arena: Any = field(default=None, repr=False)
    plan_cache: dict = field(default_factory=dict, repr=False)

    @property
    def cp_size(self) -> int:
        return self.sharding.cp_size

    @property
    def num_query_token_rows(self) -> int:
        """Rows of q / out / lse tensors: Nq, or the capacity."""
        return self.capacity.max_query_rows if self.capacity else self.num_query_rows

    @property
    def num_seq_rows(self) -> int:
        """Rows of per-sequence tensors and page tables: B, or the capacity."""
        return self.capacity.max_seqs if self.capacity else self.num_seqs

    @property
    def tile_q_len(self) -> int:
        """The q_len kernels are planned for: max_q_len, or the capacity's."""
        return self.capacity.max_q_len if self.capacity else self.max_q_len

    @property
    def device(self) -> torch.device:
        return self.counts.device

    @property
    def is_static(self) -> bool:
        return self.capacity is not None

    @property
    def store_seq(self) -> Tensor:
        """[n] sequence of each stored row (host)."""
        h = self.host if self.host is not None else self
        return h.row_seq[h.store_rows].long()

    def to(self, device: torch.device | str, non_blocking: bool = True) -> "DecodeMetadata":
        """Every tensor on ``device`` in ONE copy; ``host`` keeps the CPU copy planners read."""
        device = torch.device(device)
        src = self.host if self.host is not None else self
        if device.type == "cpu":
            return src
        if self.device == device or (device.index is None and self.device.type == device.type):
            return self
        views = _buffers.move_packed({n: getattr(src, n) for n in DECODE_DEVICE_FIELDS}, device, non_blocking)
        return dataclasses.replace(src, **views, host=src, plan_cache={})


def _decode_fingerprint(sh: KVSharding, rank: int, seq: Tensor, ql: Tensor,
                        capacity: Optional[DecodeCapacity]) -> tuple[int, ...]:
    """14 host ints in the layout ``collectives.agree_on_plan`` exchanges."""
    cap = (capacity.max_seqs, capacity.max_query_rows, capacity.max_q_len, 0, 0) if capacity else (0,) * 5
    code = zlib.crc32(f"decode/kv{sh.cp_size}x{sh.interleave}".encode()) & 0x7FFFFFFF
    return (
        code, sh.cp_size, sh.interleave, seq.numel(), int(ql.numpy().sum()), int(seq.numpy().sum()),
        *_lengths_hashes(ql, seq), *cap, rank,
    )


def _build_decode(sh: KVSharding, seq_lens, q_lens, rank, capacity: Optional[DecodeCapacity]) -> DecodeMetadata:
    sh._check_rank(rank)
    seq = as_lengths(seq_lens, "seq_lens")
    ql = torch.ones_like(seq) if q_lens is None else as_lengths(q_lens, "q_lens")
    if ql.numel() != seq.numel():
        raise ValueError(f"seq_lens and q_lens must have the same size, got {seq.numel()} and {ql.numel()}")
    bad = np.flatnonzero(ql.numpy() > seq.numpy())
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"q_lens must be <= seq_lens (the queries are the last q_len positions), got "
                         f"q_len {int(ql[b])} > seq_len {int(seq[b])} for sequence {b}")
    num_seqs, num_rows = seq.numel(), int(ql.numpy().sum())
    if capacity is not None:
        over = [(what, got, limit) for what, got, limit in (
            ("sequences", num_seqs, capacity.max_seqs), ("query rows (sum(q_lens))", num_rows, capacity.max_query_rows),
            ("max q_len", int(ql.numpy().max()) if num_seqs else 0, capacity.max_q_len)) if got > limit]
        if over:
            raise ValueError("batch over the StaticDecodePlanner capacity: " +
                             "; ".join(f"{what} {got} > {limit}" for what, got, limit in over))
    # numpy on the host for the [B] / [rows] arithmetic (~1 us per op where a torch op costs several)
    s_np, q_np = seq.numpy(), ql.numpy()
    inter = sh.interleave
    cu_q = _np_exclusive_cumsum(q_np)
    local = _local_lengths(s_np, rank, sh.cp_size, inter)
    row_seq = np.repeat(np.arange(num_seqs), q_np)
    row_pos = (s_np - q_np)[row_seq] + np.arange(num_rows) - cu_q[row_seq]
    mine = np.flatnonzero((row_pos // inter) % sh.cp_size == rank)
    pos_mine = row_pos[mine]
    store_index = _local_index(pos_mine, sh.cp_size, inter)
    return DecodeMetadata(
        sharding=sh, rank=rank, num_seqs=num_seqs, num_query_rows=num_rows,
        max_q_len=int(q_np.max()) if num_seqs else 0, max_seq_len=int(s_np.max()) if num_seqs else 0,
        num_local_kv_tokens=int(local.sum()), max_local_kv_len=int(local.max()) if num_seqs else 0,
        num_stored_tokens=mine.size, seq_lens=seq, q_lens=ql, cu_q_lens=torch.from_numpy(cu_q),
        local_kv_lens=torch.from_numpy(local), cu_local_kv_lens=torch.from_numpy(_np_exclusive_cumsum(local)),
        row_seq=torch.from_numpy(row_seq.astype(np.int32)), store_rows=torch.from_numpy(mine.astype(np.int64)),
        store_index=torch.from_numpy(store_index),
        counts=torch.tensor([num_rows, num_seqs, mine.size], dtype=torch.int32),
        fingerprint=_decode_fingerprint(sh, rank, seq, ql, capacity),
    )


def _np_exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(x.size + 1, dtype=np.int64)
    np.cumsum(x, out=out[1:])
    return out


def _agreed(build, group, cp_size: int):
    """``build()``; with a group, exchange its fingerprint (also when it failed) first."""
    if group is None:
        return build()
    from .collectives import PlanDisagreement, agree_on_plan

    try:
        plan = build()
    except (ValueError, TypeError):
        try:  # join the exchange so the other ranks raise too, then raise this rank's own error
            agree_on_plan(None, group, cp_size)
        except PlanDisagreement:
            pass
        raise
    agree_on_plan(plan.fingerprint, group, cp_size)
    return dataclasses.replace(plan, group=group)


def _pad_to(x: Tensor, size: int, fill: int) -> Tensor:
    """The CPU [n] tensor ``x`` in a [size] one, ``fill`` past it (numpy: host arithmetic)."""
    src = x.numpy()
    out = np.full(size, fill, dtype=src.dtype)
    out[: src.size] = src
    return torch.from_numpy(out)


class StaticDecodePlanner:
    """Decode plans at fixed device addresses, sized for a capacity (CUDA-graph replay).

    Every :meth:`plan` writes the step into the same device buffers with ONE copy, so a graph
    captured over ``shard_attention`` / the plan's ``run`` / ``merge_partials`` /
    ``write_sharded_kv`` of one step replays for the next: sequence lengths change, addresses
    do not. Shard attention plans built from these plans put their launch tables into fixed
    buffers too and size their grids for the capacity (kernels read counts from device memory).
    q / out / lse have ``max_query_rows`` rows; rows past a step's real ones are pad rows (out 0,
    lse -inf). One planner per rank; a plan's buffers hold it until the next :meth:`plan`.

    Args:
        sharding: the :class:`KVSharding`. max_seqs: most sequences. max_q_len: longest q_len
            (1 for plain decode). max_query_rows: most query rows (default max_seqs * max_q_len).
        device: where the plans live.

    Example::

        planner = cpattn.StaticDecodePlanner(sh, max_seqs=64, device="cuda")
        dmeta = planner.plan(seq_lens, rank=r)   # same addresses every step
    """

    def __init__(self, sharding: KVSharding, *, max_seqs: int, max_q_len: int = 1,
                 max_query_rows: Optional[int] = None, device: torch.device | str) -> None:
        if not isinstance(sharding, KVSharding):
            raise TypeError(f"sharding must be a cpattn.KVSharding, got {type(sharding).__name__}")
        b = check_int(max_seqs, "max_seqs", 1)
        q = check_int(max_q_len, "max_q_len", 1)
        rows = b * q if max_query_rows is None else check_int(max_query_rows, "max_query_rows", 1)
        self.sharding = sharding
        self.capacity = DecodeCapacity(b, rows, q)
        self.device = torch.device(device)
        self.arena = _buffers.StaticArena(self.device)

    def __repr__(self) -> str:
        return f"StaticDecodePlanner({self.sharding}, {self.capacity}, device={self.device})"

    def plan(self, seq_lens: LengthsLike, q_lens: Optional[LengthsLike] = None, *, rank: int,
             group=None) -> DecodeMetadata:
        """Plan a step into the fixed buffers (host; ValueError before any work when the step
        exceeds the capacity; with ``group`` the ranks agree first)."""
        cap = self.capacity
        host = _agreed(lambda: _build_decode(self.sharding, seq_lens, q_lens, rank, cap), group,
                       self.sharding.cp_size)
        b, nq = host.num_seqs, host.num_query_rows
        expanded = {
            "seq_lens": _pad_to(host.seq_lens, cap.max_seqs, 0),
            "q_lens": _pad_to(host.q_lens, cap.max_seqs, 0),
            "cu_q_lens": _pad_to(host.cu_q_lens, cap.max_seqs + 1, nq),
            "local_kv_lens": _pad_to(host.local_kv_lens, cap.max_seqs, 0),
            "cu_local_kv_lens": _pad_to(host.cu_local_kv_lens, cap.max_seqs + 1, host.num_local_kv_tokens),
            "row_seq": _pad_to(host.row_seq, cap.max_query_rows, -1),
            "store_rows": _pad_to(host.store_rows, cap.max_query_rows, 0),
            "store_index": _pad_to(host.store_index, cap.max_query_rows, 0),
            "counts": host.counts,
        }
        views = self.arena.upload("decode-meta", expanded)
        n = host.num_stored_tokens
        sized = dict(views, seq_lens=views["seq_lens"][:b], q_lens=views["q_lens"][:b],
                     local_kv_lens=views["local_kv_lens"][:b], store_rows=views["store_rows"][:n],
                     store_index=views["store_index"][:n])
        return dataclasses.replace(host, **sized, capacity=cap, host=host, arena=self.arena, plan_cache={})


# ----------------------------------------------------------------------------- sharded writes
@dataclass(frozen=True, eq=False)
class ShardWritePlan:
    """Where this rank's new K/V rows go in its sharded cache (validated on the host).

    rows: [N] int64 device rows of the per-layer source tensor (``k``/``v`` passed to
    :func:`write_sharded_kv`); slots: [N] int64 device cache slots (``page * page_size + offset``).
    num_writes: real writes (N minus static padding). num_source_rows: rows the source must have.
    num_slots: slots of the cache it was validated for. pad_slot: where a static plan's padding
    entries write (row 0, every layer), or None.
    """

    rows: Tensor
    slots: Tensor
    num_writes: int
    num_source_rows: int
    num_slots: int
    pad_slot: Optional[int] = None

    def __repr__(self) -> str:
        return (f"ShardWritePlan(num_writes={self.num_writes}, num_source_rows={self.num_source_rows}, "
                f"num_slots={self.num_slots})")


def _store_info(meta) -> tuple[Tensor, Tensor, Tensor, int, Tensor]:
    """(rows, local index, sequence, source rows, local kv lens) of a decode or CP plan (host)."""
    from .metadata import CPMetadata

    if isinstance(meta, DecodeMetadata):
        h = meta.host if meta.host is not None else meta
        return h.store_rows, h.store_index, meta.store_seq, meta.num_query_token_rows, h.local_kv_lens
    if isinstance(meta, CPMetadata):
        if meta.kv_sharding is None:
            raise ValueError("meta has no kv_sharding: build it with strategy.build_metadata(..., kv_sharding=)")
        h = meta.host if meta.host is not None else meta
        rows = h.store_rows
        seq = torch.searchsorted(h.cu_extend_lens, rows, right=True) - 1
        return rows, h.store_index, seq, meta.num_token_rows, h.local_kv_lens
    raise TypeError(f"meta must be a DecodeMetadata or a CPMetadata with kv_sharding, got {type(meta).__name__}")


def plan_shard_writes(meta, page_table: Tensor, *, page_size: int, num_pages: int,
                      pad_slot: Optional[int] = None) -> ShardWritePlan:
    """Plan this rank's sharded cache writes for one forward (host; validates everything).

    Args:
        meta: a :class:`DecodeMetadata` (the step's new tokens) or a ``CPMetadata`` built with
            ``kv_sharding=`` (the extend tokens), on the device the cache lives on.
        page_table: [B, max_pages] int32/int64 (CPU or device; read once here) of THIS rank's
            pages: local key j of sequence b lives at slot
            ``page_table[b, j // page_size] * page_size + j % page_size``.
        page_size: tokens per page (a multiple of the sharding's interleave).
        num_pages: pages of the rank's cache (slots = num_pages * page_size).
        pad_slot: a slot reserved for padded writes (SGLang's slot 0, vLLM's pad slot): static
            decode plans write their padding entries there (row 0 of the source) so the
            per-layer write has a fixed size; required for static plans.

    ValueError (before anything is written) when the table does not cover a stored row's local
    index, points outside [0, num_pages), or maps two stored rows to one slot.

    Example::

        writes = cpattn.plan_shard_writes(dmeta, local_pt, page_size=64, num_pages=n)
        cpattn.write_sharded_kv(k_new, v_new, k_cache[layer], v_cache[layer], writes)  # per layer
    """
    rows, index, seq, source_rows, local_kv = _store_info(meta)
    sharding = meta.sharding if isinstance(meta, DecodeMetadata) else meta.kv_sharding
    ps = sharding.check_page_size(page_size)
    pages = check_int(num_pages, "num_pages", 1)
    check_tensor(page_table, "page_table")
    if page_table.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"page_table must be int32 or int64, got {page_table.dtype}")
    num_seq_rows = meta.num_seq_rows
    if page_table.dim() != 2 or page_table.shape[0] != num_seq_rows:
        raise ValueError(f"page_table must be [B={num_seq_rows}, max_pages], got {list(page_table.shape)}")
    table = page_table.detach().to("cpu", torch.int64)
    need = (local_kv + ps - 1) // ps  # pages each sequence's shard needs after this forward
    if need.numel() and int(need.max()) > table.shape[1]:
        b = int(torch.argmax(need))
        raise ValueError(
            f"page_table does not cover the rank's shard: sequence {b} holds {int(local_kv[b])} local keys "
            f"({int(need[b])} pages of {ps}), the table has {table.shape[1]} pages per sequence"
        )
    page = table[seq, index // ps] if rows.numel() else torch.zeros(0, dtype=torch.int64)
    if page.numel() and (int(page.min()) < 0 or int(page.max()) >= pages):
        bad = int(torch.nonzero((page < 0) | (page >= pages))[0])
        raise ValueError(
            f"page_table[{int(seq[bad])}, {int(index[bad]) // ps}] = {int(page[bad])} is outside "
            f"[0, num_pages={pages}) (local key {int(index[bad])} of sequence {int(seq[bad])})"
        )
    slots = page * ps + index % ps
    if slots.numel() > 1 and torch.unique(slots).numel() != slots.numel():
        raise ValueError("page_table maps two stored rows to the same cache slot (pages shared between "
                         "sequences must hold only positions both already cached)")
    num_slots = pages * ps
    n = rows.numel()
    if pad_slot is not None:
        check_int(pad_slot, "pad_slot", 0)
        if pad_slot >= num_slots:
            raise ValueError(f"pad_slot must be in [0, num_slots={num_slots}), got {pad_slot}")
        if n and bool((slots == pad_slot).any()):
            raise ValueError(f"pad_slot={pad_slot} is also the slot of a stored row")
    if meta.is_static:
        if pad_slot is None:
            raise ValueError("static plans write a fixed number of rows: pass pad_slot (a reserved cache slot)")
        size = source_rows
        rows = _pad_to(rows, size, 0)
        slots = _pad_to(slots, size, pad_slot)
        dev = _buffers.upload(meta, ("shard-writes", size), {"rows": rows, "slots": slots})
    else:
        dev = _buffers.upload(meta, None, {"rows": rows.clone(), "slots": slots})
    return ShardWritePlan(dev["rows"], dev["slots"], n, source_rows, num_slots, pad_slot)


def _flat_cache(cache: Tensor, name: str, row_shape: tuple[int, ...]) -> Tensor:
    """``[num_slots, *row]`` view of a flat or paged ``[num_pages, page_size, *row]`` cache."""
    check_tensor(cache, name)
    k = len(row_shape)
    if cache.dim() == k + 2:
        try:
            flat = cache.view(-1, *cache.shape[2:])
        except RuntimeError:
            raise ValueError(f"{name} paged layout must be viewable as [num_slots, ...] (contiguous pages)") from None
    elif cache.dim() == k + 1:
        flat = cache
    else:
        raise ValueError(f"{name} must be [num_slots, {', '.join(map(str, row_shape))}] or "
                         f"[num_pages, page_size, ...], got {list(cache.shape)}")
    if tuple(flat.shape[1:]) != tuple(row_shape):
        raise ValueError(f"{name} rows are {list(flat.shape[1:])}, expected {list(row_shape)}")
    return flat


def write_sharded_cache(xs, caches, plan: ShardWritePlan, names=None) -> None:
    """Write rows ``plan.rows`` of each source ``xs[i]`` into ``caches[i]`` at ``plan.slots``.

    xs: tensors ``[num_source_rows, ...]``; caches: flat ``[num_slots, ...]`` or paged
    ``[num_pages, page_size, ...]`` with the same row shape and dtype (e.g. an MLA latent cache
    ``[num_pages, page_size, 576]``). Every pair is validated before any is written.
    Device-only (one ``index_select`` + ``index_copy_`` per cache; graph-safe with static plans).
    """
    if not isinstance(plan, ShardWritePlan):
        raise TypeError(f"plan must be a ShardWritePlan (cpattn.plan_shard_writes), got {type(plan).__name__}")
    names = names or [(f"xs[{i}]", f"caches[{i}]") for i in range(len(xs))]
    writes = []
    for (xn, cn), x, cache in zip(names, xs, caches):
        check_tensor(x, xn)
        if x.dim() < 1 or x.shape[0] != plan.num_source_rows:
            raise ValueError(f"{xn} must have {plan.num_source_rows} rows (the plan's source rows), got "
                             f"{list(x.shape)}")
        flat = _flat_cache(cache, cn, tuple(x.shape[1:]))
        if flat.shape[0] != plan.num_slots:
            raise ValueError(f"{cn} has {flat.shape[0]} slots, the write plan was validated for {plan.num_slots}")
        if cache.dtype != x.dtype:
            raise TypeError(f"{cn} dtype {cache.dtype} != {xn} dtype {x.dtype}")
        if cache.device != x.device or plan.rows.device != x.device:
            raise ValueError(f"{cn} is on {cache.device}, {xn} on {x.device}, the plan on {plan.rows.device}")
        writes.append((flat, x))
    if plan.rows.numel() == 0:
        return
    for flat, x in writes:
        flat.index_copy_(0, plan.slots, x.index_select(0, plan.rows))


def write_sharded_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, plan: ShardWritePlan) -> None:
    """Write this rank's share of new K/V into its sharded caches (per layer, device-only).

    Args:
        k, v: [num_source_rows, Hkv, D] / [.., Dv]: for a decode plan the step's new tokens
            (query rows, replicated on every rank); for a CP plan the logical extend K/V
            (``strategy.gather_kv``), T rows.
        k_cache, v_cache: [num_pages, page_size, Hkv, D] / [.., Dv] (or flat [num_slots, ...]).
        plan: :func:`plan_shard_writes` of this forward.

    Only the rows this rank owns are written; both caches are validated before either is.
    """
    write_sharded_cache([k, v], [k_cache, v_cache], plan, names=[("k", "k_cache"), ("v", "v_cache")])


# ----------------------------------------------------------------------------- pass-KV / pass-Q
@dataclass(frozen=True)
class ExtendCostModel:
    """Time model of an extend over a sharded prefix, per rank (seconds); the plan picks the
    algorithm with the smaller estimate. Constants default to H200 + NVLink measurements
    (docs/sharded-kv.md); an engine passes its own for other hardware.

    pass-KV: ONE all-gather of [extend K/V rows, prefix shard rows]; every rank then runs the
    dense kernel for its queries over the whole prefix + extend:
        t = latency + launch + (C - 1) (P + Np) kv_row / link + work_max / dense_flops
    pass-Q: ONE all-gather of [q, extend K/V] rows, the shard kernel for ALL new queries over
    this rank's keys, ONE all-to-all of the partials back to the query owners, a local merge:
        t = 2 latency + 3 launch + (C - 1) P (q_row + kv_row + part_row) / link
            + work_mean / shard_flops + C P part_row / hbm
    ``launch``: the fixed cost of one kernel (pass-Q runs three: split-KV, combine, merge), which
    decides short extends over short prefixes.
    P: physical rows per rank; Np: the most prefix keys any rank holds; kv_row / q_row /
    part_row: bytes of one token's K+V, q, and (out, lse) partial; work: attention FLOPs
    (``4 Hq (D + Dv) / 2 x`` causal (query, key) pairs: the slowest rank for pass-KV, the mean
    for pass-Q whose sharded keys balance every position range).
    """

    link_bytes_per_s: float = 300e9
    #: calibrated on one H200, 2026-12-01 (docs/benchmarks.md: decode benchmark, crossover):
    #: the dense kernel on extend-shaped work (few query tiles over a long prefix) and the
    #: split-KV shard kernel at 16k-1M keys, and one kernel's fixed cost
    dense_flops_per_s: float = 400e12
    shard_flops_per_s: float = 300e12
    hbm_bytes_per_s: float = 4.0e12
    collective_latency_s: float = 25e-6
    launch_overhead_s: float = 30e-6

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{f.name} must be a number > 0, got {value!r}")

    def estimate(self, meta, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 head_dim_v: Optional[int] = None, dtype: torch.dtype) -> dict:
        """{"pass_kv": s, "pass_q": s, "bytes_pass_kv": n, "bytes_pass_q": n} for ``meta``
        (a ``CPMetadata`` with ``kv_sharding``). The same on every rank (only batch-wide
        numbers enter)."""
        hq = check_int(num_q_heads, "num_q_heads", 1)
        hkv = check_int(num_kv_heads, "num_kv_heads", 1)
        d = check_int(head_dim, "head_dim", 1)
        dv = d if head_dim_v is None else check_int(head_dim_v, "head_dim_v", 1)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        if getattr(meta, "kv_sharding", None) is None:
            raise ValueError("meta has no kv_sharding: build it with strategy.build_metadata(..., kv_sharding=)")
        item = torch.empty((), dtype=dtype).element_size()
        c, p = meta.cp_size, meta.num_physical_tokens
        np_max = max(meta.num_local_prefix_tokens_per_rank) if meta.num_local_prefix_tokens_per_rank else 0
        kv_row, q_row, part_row = hkv * (d + dv) * item, hq * d * item, hq * (dv * item + 4)
        flop_per_pair = 2.0 * hq * (d + dv)
        work_max = max(meta.causal_work_per_rank) * flop_per_pair if meta.causal_work_per_rank else 0.0
        work_mean = sum(meta.causal_work_per_rank) * flop_per_pair / c
        bytes_kv = (c - 1) * (p + np_max) * kv_row
        bytes_q = (c - 1) * p * (q_row + kv_row + part_row)
        lat = self.collective_latency_s if c > 1 else 0.0
        launch = self.launch_overhead_s
        t_kv = lat + launch + bytes_kv / self.link_bytes_per_s + work_max / self.dense_flops_per_s
        t_q = (2 * lat + 3 * launch + bytes_q / self.link_bytes_per_s + work_mean / self.shard_flops_per_s
               + c * p * part_row / self.hbm_bytes_per_s)
        return {"pass_kv": t_kv, "pass_q": t_q, "bytes_pass_kv": bytes_kv, "bytes_pass_q": bytes_q}


def choose_extend_algorithm(meta, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                            head_dim_v: Optional[int] = None, dtype: torch.dtype,
                            cost_model: Optional[ExtendCostModel] = None) -> str:
    """"pass_kv" or "pass_q" for an extend over a sharded prefix: the smaller estimate of
    ``cost_model`` (default :class:`ExtendCostModel`); "pass_kv" without any cached prefix or
    at C = 1. Deterministic from batch-wide numbers, so every rank picks the same one."""
    model = cost_model or ExtendCostModel()
    if not isinstance(model, ExtendCostModel):
        raise TypeError(f"cost_model must be an ExtendCostModel, got {type(model).__name__}")
    est = model.estimate(meta, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         head_dim_v=head_dim_v, dtype=dtype)
    if meta.cp_size == 1 or meta.num_kv_tokens == meta.num_tokens:
        return "pass_kv"
    return "pass_q" if est["pass_q"] < est["pass_kv"] else "pass_kv"
