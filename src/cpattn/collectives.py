"""The one collective cpattn uses: an all-gather of packed physical rows, reordered to logical order.

Any number of tensors with the same number of rows (possibly of different dtypes, fp8 included)
are packed byte-wise into one ``[P, row_bytes]`` uint8 buffer, gathered with ONE
``all_gather_into_tensor`` over the group, put in logical order with one ``index_select`` through
``meta.gather_index`` (pad rows dropped), and split back into views of that buffer. The process
group is always an argument; ``None`` means torch.distributed's default group. ``cp_size == 1``
needs no group and runs no collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ._validation import check_process_group
from .metadata import CPMetadata

__all__ = [
    "PendingGather",
    "PlanDisagreement",
    "agree_on_plan",
    "all_gather_into",
    "all_gather_kv_rows",
    "all_gather_rows",
    "all_to_all_into",
    "check_group",
    "gathered_bytes_per_token",
    "group_device",
    "is_leading_view",
    "pack_rows",
    "row_layout",
    "unpack_rows",
]

PART_ALIGN_BYTES = 16  # byte alignment of each part inside a packed row (any dtype views back cleanly)


def all_gather_into(output: Tensor, input: Tensor, group, async_op: bool = False):
    """The all-gather every cpattn all-gather goes through (``output`` [C * rows, ...] from each
    rank's ``input`` [rows, ...]); tests count collectives by patching it."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def all_to_all_into(output: Tensor, input: Tensor, group) -> None:
    """The all-to-all every cpattn all-to-all goes through (equal splits along dim 0); tests
    count collectives by patching it."""
    dist.all_to_all_single(output, input, group=group)


# ---------------------------------------------------------------------------- row packing
def row_layout(widths: Sequence[int]) -> tuple[list[int], int]:
    """Byte offset of each part of a packed row (parts 16-byte aligned) and the row's bytes."""
    offsets, off = [], 0
    for w in widths:
        offsets.append(off)
        off += -(-w // PART_ALIGN_BYTES) * PART_ALIGN_BYTES
    return offsets, max(off, PART_ALIGN_BYTES)


def pack_rows(parts: Sequence[Tensor], rows: int) -> tuple[Tensor, list[tuple[int, int]]]:
    """``[rows, ...]`` tensors of any dtypes -> one ``[rows, row_bytes]`` uint8 buffer (16-byte
    aligned parts) and the (offset, bytes) of each part."""
    widths = [p.element_size() * _row_numel(p) for p in parts]
    offsets, row_bytes = row_layout(widths)
    buf = torch.empty((rows, row_bytes), dtype=torch.uint8, device=parts[0].device)
    for p, off, w in zip(parts, offsets, widths):
        buf[:, off : off + w] = p.reshape(rows, w // p.element_size()).contiguous().view(torch.uint8)
    return buf, list(zip(offsets, widths))


def unpack_rows(buf: Tensor, layout, like: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> list[Tensor]:
    """Views of a packed ``[..., row_bytes]`` buffer as tensors ``[..., *trailing]`` of each
    (dtype, trailing shape) in ``like`` (rows strided, last dim contiguous: no copy)."""
    lead = buf.shape[:-1]
    out = []
    for (off, w), (dtype, trailing) in zip(layout, like):
        view = buf[..., off : off + w]
        if dtype != torch.uint8:
            view = view.view(dtype)
        out.append(view.view(*lead, *trailing))
    return out


class PlanDisagreement(ValueError):
    """The ranks of a CP group planned different batches (or one of them failed to plan)."""


def group_device(group) -> torch.device:
    """Where a collective over ``group`` takes its tensors: CUDA for NCCL, else the CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


#: Fingerprint entries: names used in the error message (the last one is the claimed rank).
_FINGERPRINT_FIELDS = (
    "strategy", "cp_size", "pad_multiple", "num_seqs", "num_tokens", "num_kv_tokens", "lengths",
    "lengths", "capacity", "capacity", "capacity", "capacity", "capacity", "capacity", "capacity", "index_topk",
    "rank",
)


def agree_on_plan(fingerprint: Optional[tuple[int, ...]], group, cp_size: int) -> None:
    """Exchange plan fingerprints over ``group`` (ONE tiny all-gather, plan time) and raise the
    same :class:`PlanDisagreement` on every rank unless all ranks planned the same batch with
    distinct ranks ``0..C-1`` in group order.

    ``fingerprint`` is None on a rank whose own planning failed: it still joins the exchange
    (so no rank hangs), then every other rank raises too and that rank re-raises its own error.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"group= needs an initialized torch.distributed process group (cp_size={cp_size})"
        )
    width = len(_FINGERPRINT_FIELDS) + 2  # + ok flag + this process's rank in the group
    mine = torch.zeros(width, dtype=torch.int64)
    own_error = None
    if fingerprint is not None and len(fingerprint) != len(_FINGERPRINT_FIELDS):
        # raised after the exchange (joined as "failed"), so the other ranks do not hang
        own_error = ValueError(f"fingerprint must have {len(_FINGERPRINT_FIELDS)} entries, got {len(fingerprint)}")
        fingerprint = None
    if fingerprint is not None:
        mine[0] = 1
        mine[1 : 1 + len(fingerprint)] = torch.tensor(fingerprint, dtype=torch.int64)
    mine[-1] = dist.get_rank(group)
    size = dist.get_world_size(group)
    device = group_device(group)
    table = torch.empty(size * width, dtype=torch.int64, device=device)
    all_gather_into(table, mine.to(device), group, False)
    rows = table.view(size, width).cpu().tolist()
    if own_error is not None:
        raise own_error
    failed = [r[-1] for r in rows if r[0] == 0]
    if failed:
        raise PlanDisagreement(f"CP plan: group rank(s) {failed} could not build a plan for this batch "
                               "(their own error says why); no rank ran a collective with it")
    fields = [r[1:-1] for r in rows]
    claimed = [f[-1] for f in fields]
    if any(f[1] != size for f in fields):
        raise PlanDisagreement(f"CP plan: group has {size} ranks but the ranks planned with cp_size "
                               f"{[f[1] for f in fields]}")
    for name_i, name in enumerate(_FINGERPRINT_FIELDS[:-1]):
        values = [f[name_i] for f in fields]
        if len(set(values)) > 1:
            what = {"lengths": "extend_lens / prefix_lens", "capacity": "static planner capacity",
                    "strategy": "strategy or KV sharding",
                    "index_topk": "the DSA index top-k (build_metadata(index_topk=))"}.get(name, name)
            raise PlanDisagreement(f"CP plan: the ranks planned different batches: {what} differ "
                                   f"(per group rank: {values})")
    if sorted(claimed) != list(range(size)):
        raise PlanDisagreement(f"CP plan: ranks {claimed} (per group rank) must be 0..{size - 1} once each; "
                               "two processes claim one rank or a rank is missing")
    if claimed != [r[-1] for r in rows]:
        raise PlanDisagreement(f"CP plan: claimed ranks {claimed} differ from the group ranks "
                               f"{[r[-1] for r in rows]} (rank= must be the process's rank in group)")


def check_group(meta: CPMetadata, group) -> None:
    """Raise ValueError unless ``group`` matches ``meta`` (size cp_size, this process = meta.rank).

    Local checks only: safe to call before a collective, so a misconfigured rank raises instead of
    hanging the others.
    """
    check_process_group(group)
    if (meta.cp_size == 1 or meta.replicated) and group is None:
        return
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"cp_size={meta.cp_size} needs an initialized torch.distributed process group "
            "(call torch.distributed.init_process_group or pass group=)"
        )
    size = dist.get_world_size(group)
    if size != meta.cp_size:
        raise ValueError(f"group size {size} != cp_size {meta.cp_size}: group must have the plan's cp_size ranks")
    rank = dist.get_rank(group)
    if rank != meta.rank:
        raise ValueError(f"metadata was built for rank {meta.rank} but this process is rank {rank} of the group")


def _part_layout(parts: Sequence[Tensor]) -> tuple[list[int], list[int], int]:
    widths = [_row_numel(p) * p.element_size() for p in parts]
    offsets, off = [], 0
    for w in widths:
        offsets.append(off)
        off += -(-w // PART_ALIGN_BYTES) * PART_ALIGN_BYTES
    return offsets, widths, off


def _row_numel(t: Tensor) -> int:
    n = 1
    for s in t.shape[1:]:
        n *= s
    return n


def gathered_bytes_per_token(parts: Sequence[Tensor]) -> int:
    """Bytes each token contributes to one packed all-gather of ``parts`` (alignment included)."""
    return _part_layout(parts)[2]


@dataclass
class PendingGather:
    """An all-gather in flight. :meth:`wait` returns the logical-order tensors (views of one buffer)."""

    _work: Optional[object]
    _gathered: Tensor
    _meta: CPMetadata
    _parts: tuple[tuple[torch.dtype, tuple[int, ...], int, int], ...]
    _result: Optional[list[Tensor]] = None

    def wait(self) -> list[Tensor]:
        if self._result is None:
            if self._work is not None:
                self._work.wait()
            rows = self._gathered.index_select(0, self._meta.gather_index)
            out = []
            for dtype, trailing, off, width in self._parts:
                view = rows[:, off : off + width]
                if dtype != torch.uint8:
                    view = view.view(dtype)
                out.append(view.view(rows.shape[0], *trailing))
            self._result = out
        return self._result


def is_leading_view(v: Tensor, k: Tensor) -> bool:
    """True when ``v`` is ``k[..., :Dv]`` (absorbed MLA: the values are the latent columns of the
    keys), so gathering ``k`` gathers ``v`` too."""
    return (v.data_ptr() == k.data_ptr() and v.dtype == k.dtype and v.dim() == k.dim()
            and v.shape[:-1] == k.shape[:-1] and v.shape[-1] <= k.shape[-1] and v.stride() == k.stride())


def all_gather_kv_rows(k: Tensor, v: Tensor, meta: CPMetadata, group=None, *, lead: Sequence[Tensor] = ()
                       ) -> list[Tensor]:
    """:func:`all_gather_rows` of ``[*lead, k, v]`` in ONE collective, returning the logical
    ``[*lead, k, v]``; a ``v`` that is ``k[..., :Dv]`` (:func:`is_leading_view`) is not moved a second
    time: the result's ``v`` is the same view of the gathered ``k`` (absorbed MLA: 1152 instead of
    2176 bytes per DeepSeek-V3 token in bf16)."""
    if is_leading_view(v, k):
        *rest, k_all = all_gather_rows([*lead, k], meta, group)
        return [*rest, k_all, k_all[..., : v.shape[-1]]]
    return all_gather_rows([*lead, k, v], meta, group)


def all_gather_rows(
    parts: Sequence[Tensor], meta: CPMetadata, group=None, *, async_op: bool = False
) -> list[Tensor] | PendingGather:
    """All-gather rank-local ``[P, ...]`` tensors into logical ``[T, ...]`` ones in ONE collective.

    Args:
        parts: tensors with ``meta.num_physical_tokens`` rows each, on one device; dtypes may
            differ (moved as raw bytes).
        meta: this rank's plan. group: the CP process group (None: default group).
        async_op: return a :class:`PendingGather` instead of waiting.

    Returns:
        ``[T, ...]`` tensors in logical order, pad rows dropped, identical on every rank. They are
        views into one buffer (last dim contiguous, rows strided); at C = 1 or under the
        replicated placement, ``parts`` themselves when a dynamic plan has no pad row (no copy).
    """
    parts = list(parts)
    phys = meta.num_physical_tokens
    if meta.cp_size == 1 or meta.replicated:  # every rank has every row: no collective, no byte packing
        if phys == meta.num_tokens and not meta.is_static:  # no pad row: physical order is logical order
            rows = parts
        else:
            rows = [p.index_select(0, meta.gather_index) for p in parts]
        return PendingGather(None, parts[0], meta, (), rows) if async_op else rows
    offsets, widths, row_bytes = _part_layout(parts)
    device = parts[0].device
    packed = torch.empty((phys, row_bytes), dtype=torch.uint8, device=device)
    for part, off, width in zip(parts, offsets, widths):
        packed[:, off : off + width] = part.reshape(phys, _row_numel(part)).contiguous().view(torch.uint8)
    work = None
    if phys == 0:
        gathered = packed.new_empty((0, row_bytes))
    else:
        gathered = torch.empty((meta.cp_size * phys, row_bytes), dtype=torch.uint8, device=device)
        work = all_gather_into(gathered, packed, group, async_op)
        if not async_op:
            work = None
    layout = tuple((p.dtype, tuple(p.shape[1:]), o, w) for p, o, w in zip(parts, offsets, widths))
    pending = PendingGather(work, gathered, meta, layout)
    return pending if async_op else pending.wait()
