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

from .metadata import CPMetadata

__all__ = ["PendingGather", "all_gather_rows", "check_group", "gathered_bytes_per_token"]

PART_ALIGN_BYTES = 16  # byte alignment of each part inside a packed row (any dtype views back cleanly)


def _all_gather_into(output: Tensor, input: Tensor, group, async_op: bool):
    """The single collective call (tests count calls through this function)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def check_group(meta: CPMetadata, group) -> None:
    """Raise ValueError unless ``group`` matches ``meta`` (size cp_size, this process = meta.rank).

    Local checks only: safe to call before a collective, so a misconfigured rank raises instead of
    hanging the others.
    """
    if meta.cp_size == 1 and group is None:
        return
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"cp_size={meta.cp_size} needs an initialized torch.distributed process group "
            "(call torch.distributed.init_process_group or pass group=)"
        )
    size = dist.get_world_size(group)
    if size != meta.cp_size:
        raise ValueError(f"group size {size} != cp_size {meta.cp_size}")
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
        views into one buffer (last dim contiguous, rows strided).
    """
    parts = list(parts)
    offsets, widths, row_bytes = _part_layout(parts)
    phys = meta.num_physical_tokens
    device = parts[0].device
    packed = torch.empty((phys, row_bytes), dtype=torch.uint8, device=device)
    for part, off, width in zip(parts, offsets, widths):
        packed[:, off : off + width] = part.reshape(phys, _row_numel(part)).contiguous().view(torch.uint8)
    work = None
    if meta.cp_size == 1 or phys == 0:
        gathered = packed if meta.cp_size == 1 else packed.new_empty((0, row_bytes))
    else:
        gathered = torch.empty((meta.cp_size * phys, row_bytes), dtype=torch.uint8, device=device)
        work = _all_gather_into(gathered, packed, group, async_op)
        if not async_op:
            work = None
    layout = tuple((p.dtype, tuple(p.shape[1:]), o, w) for p, o, w in zip(parts, offsets, widths))
    pending = PendingGather(work, gathered, meta, layout)
    return pending if async_op else pending.wait()
