"""Host-to-device transfer of plans: every tensor of a plan in ONE copy from one host buffer
(pinned for CUDA), as views of one device buffer; and the fixed-address buffers of static plans.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor

__all__ = ["StaticArena", "move_packed", "pack_into", "packed_layout", "pad_to", "scratch", "upload", "views_of"]

#: Byte alignment of every tensor inside one buffer.
FIELD_ALIGN = 16


def packed_layout(tensors: dict[str, Tensor]) -> tuple[dict[str, tuple[int, int]], int]:
    """Byte offset and size of each tensor inside one buffer (16-byte aligned); total bytes."""
    offsets, total = {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        offsets[name] = (total, nbytes)
        total += -(-nbytes // FIELD_ALIGN) * FIELD_ALIGN
    return offsets, max(total, FIELD_ALIGN)


#: dtypes whose CPU tensors pack through numpy (a numpy slice assignment costs ~1 µs where the
#: torch slice + view + copy costs several); others (bfloat16, ...) through torch.
_NUMPY_PACKED = {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.float32,
                 torch.float64, torch.float16}


def pack_into(tensors: dict[str, Tensor], buffer: Tensor, layout: dict[str, tuple[int, int]]) -> None:
    """Copy CPU tensors into the CPU uint8 ``buffer`` at their layout offsets."""
    dst = buffer.numpy()
    for name, t in tensors.items():
        off, nbytes = layout[name]
        if not nbytes:
            continue
        if t.dtype in _NUMPY_PACKED and not t.requires_grad:
            dst[off : off + nbytes] = np.ascontiguousarray(t.numpy()).reshape(-1).view(np.uint8)
        else:
            buffer[off : off + nbytes].copy_(t.contiguous().view(-1).view(torch.uint8))


def views_of(buffer: Tensor, tensors: dict[str, Tensor], layout: dict[str, tuple[int, int]]) -> dict[str, Tensor]:
    """Views of ``buffer`` shaped and typed like ``tensors`` (one split into the fields and their
    alignment gaps, then a dtype / shape view where it differs)."""
    sizes, index, pos = [], [], 0
    for name in tensors:
        off, nbytes = layout[name]
        if off > pos:
            sizes.append(off - pos)
        index.append(len(sizes))
        sizes.append(nbytes)
        pos = off + nbytes
    if buffer.numel() > pos:
        sizes.append(buffer.numel() - pos)
    chunks = buffer.split(sizes)
    out = {}
    for (name, t), i in zip(tensors.items(), index):
        c = chunks[i]
        if t.dtype != torch.uint8:
            c = c.view(t.dtype)
        out[name] = c if c.shape == t.shape else c.view(t.shape)
    return out


def pad_to(x: Tensor, size: int, fill: int) -> Tensor:
    """A [size] CPU tensor of ``x``'s dtype: the values of the 1-D CPU tensor ``x``, then ``fill``
    (how static plans size a batch's tables for their capacity)."""
    values = x.numpy()
    out = np.full(size, fill, dtype=values.dtype)
    out[: values.size] = values
    return torch.from_numpy(out)


def move_packed(tensors: dict[str, Tensor], device: torch.device, non_blocking: bool = True) -> dict[str, Tensor]:
    """CPU tensors -> views of one device buffer, filled by ONE host-to-device copy. The pinned
    staging block comes from torch's caching host allocator, which keeps it until the copy ends."""
    layout, total = packed_layout(tensors)
    staging = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    pack_into(tensors, staging, layout)
    if device.type == "cpu":
        return views_of(staging, tensors, layout)
    return views_of(staging.to(device, non_blocking=non_blocking), tensors, layout)


class StaticArena:
    """Fixed-address device buffers of a :class:`cpattn.StaticPlanner`, one per plan kind (key).

    :meth:`upload` writes a plan's tensors (already sized for the capacity) into the key's buffer
    with ONE copy from the key's pinned staging buffer and returns the same views every time, so
    a CUDA graph captured over them reads each new plan. The staging buffer is reused only after
    the previous copy from it has finished (an event), so the host never races the copy engine.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._slots: dict[object, tuple] = {}
        self._scratch: dict[object, Tensor] = {}

    def upload(self, key, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        shapes = tuple((name, tuple(t.shape), t.dtype) for name, t in tensors.items())
        slot = self._slots.get(key)
        if slot is None:
            layout, total = packed_layout(tensors)
            cuda = self.device.type == "cuda"
            staging = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
            buffer = torch.empty(total, dtype=torch.uint8, device=self.device)
            event = torch.cuda.Event() if cuda else None
            slot = (shapes, layout, staging, buffer, event, views_of(buffer, tensors, layout))
            self._slots[key] = slot
        elif slot[0] != shapes:
            raise ValueError(f"static plan buffers for {key!r} were sized {slot[0]}, got {shapes}")
        _, layout, staging, buffer, event, views = slot
        if event is not None:
            event.synchronize()  # the previous plan's copy out of `staging` has finished
        pack_into(tensors, staging, layout)
        buffer.copy_(staging, non_blocking=event is not None)
        if event is not None:
            event.record()
        return views

    def scratch(self, key, shape: tuple, dtype: torch.dtype) -> Tensor:
        """The key's fixed-address device scratch tensor (allocated on first use, then the same
        tensor for every plan of this planner; never copied to): a kernel workspace that a
        captured CUDA graph keeps using across steps."""
        t = self._scratch.get(key)
        if t is None:
            t = self._scratch[key] = torch.empty(shape, dtype=dtype, device=self.device)
        elif tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise ValueError(f"static scratch {key!r} was sized {tuple(t.shape)} {t.dtype}, got {tuple(shape)} {dtype}")
        return t

    @property
    def num_buffers(self) -> int:
        return len(self._slots)


def scratch(meta, key, shape: tuple, dtype: torch.dtype) -> Tensor:
    """A plan's device workspace, allocated at plan time (never inside a captured region): the
    static arena's fixed-address tensor for a static plan, else a new tensor the plan keeps."""
    arena: Optional[StaticArena] = getattr(meta, "arena", None)
    if arena is not None:
        return arena.scratch(key, shape, dtype)
    return torch.empty(shape, dtype=dtype, device=meta.device)


def upload(meta, key, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """A plan's CPU tensors on ``meta``'s device in one copy: into the static arena's fixed
    buffers for a static plan, else into a fresh buffer."""
    arena: Optional[StaticArena] = getattr(meta, "arena", None)
    if arena is not None:
        return arena.upload(key, tensors)
    return move_packed(tensors, meta.device)
