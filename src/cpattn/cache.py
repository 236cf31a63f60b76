"""Write gathered extend tokens into paged KV caches, and the bytes a token costs to move.

After ``gather_mla_latent`` / ``gather_kv`` every rank holds the logical ``[T, ...]`` rows of the
batch's extend tokens, pad rows already dropped. These helpers put row ``t`` at cache slot
``slots[t]`` (``slot = page * page_size + offset``), as a paged-attention engine does before
attention reads the cache through its page table. Engines often pass slot arrays longer than ``T``
(padded to a CUDA-graph size): :func:`plan_slots` keeps ``slots[:T]``, nothing is written for pad
entries.

Cache layouts (either form; the paged one is a view of the flat one):

* MLA latent cache: ``[num_slots, r + d_rope]`` or ``[num_pages, page_size, r + d_rope]``, one row
  per token: ``kv_c`` (RMS-normed latent, ``r = kv_lora_rank``) then ``k_pe`` (rotary key after
  RoPE, shared by all heads). This is the DeepSeek-V3 cache row (576 values) of SGLang / vLLM.
  A ``uint8`` cache stores raw bytes, ``row_bytes = r * kv_c.itemsize + d_rope * k_pe.itemsize``
  (e.g. an fp8 latent next to a bf16 rope key).
* K/V caches: ``[num_slots, Hkv, D]`` / ``[num_slots, Hkv, Dv]`` or
  ``[num_pages, page_size, Hkv, D]`` / ``[.., Dv]`` (what ``strategy.attention`` reads with a
  ``page_table``).

Every write is all-or-nothing: all arguments (row count, slot range, duplicates, dtypes,
devices, every pool) are validated before the first byte is written, and a rejected call raises
ValueError / TypeError leaving every cache bit-identical. Slots are validated once per forward:

* :func:`plan_slots` (host, once per forward; may sync once) checks ``slots[:T]`` (in range, no
  duplicates) and returns a :class:`SlotPlan`. Passing the plan to the writers is the per-layer
  path: device-only, no ``.item()``, no host sync (only host-int checks: rows == ``plan.num_tokens``,
  cache slots == ``plan.num_slots``). A separate SWA pool gets its own plan.
* A raw slot tensor is the convenience path: it must have exactly one entry per row and is
  validated on the spot, which syncs (once per call).

Everything is copied as raw bytes (fp8 included, bit for bit) with one ``index_copy_`` per cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

from ._validation import check_int, check_tensor
from .collectives import PART_ALIGN_BYTES
from . import _buffers
from .metadata import CPMetadata

__all__ = [
    "SlotPlan",
    "kv_bytes_per_token",
    "mla_bytes_per_token",
    "plan_slots",
    "read_mla_cache",
    "write_kv_cache",
    "write_mla_cache",
]


# ---------------------------------------------------------------------------------------- helpers
def _check_dtype(dtype, name: str) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {type(dtype).__name__}")
    return dtype


@dataclass(frozen=True)
class SlotPlan:
    """Validated cache slots of ``num_tokens`` rows (build it with :func:`plan_slots`).

    Attributes:
        index: int64 [num_tokens] slot of each row, on the cache's device; every value in
            ``[0, num_slots)`` and, when ``unique``, no value twice.
        num_tokens: rows it covers (host int). num_slots: slots of the cache it was planned for.
        name: the argument name used in error messages ("slots", "swa_slots", ...).
        unique: no duplicate slots (required for writes; reads of shared prefix pages may repeat).
    """

    index: Tensor
    num_tokens: int
    num_slots: int
    name: str = "slots"
    unique: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.index, Tensor) or self.index.dtype != torch.int64 or self.index.dim() != 1:
            index = self.index
            got = f"{index.dtype} {tuple(index.shape)}" if isinstance(index, Tensor) else type(index).__name__
            raise TypeError(f"SlotPlan.index must be an int64 1-D tensor, got {got} (build it with plan_slots)")
        check_int(self.num_tokens, "num_tokens", 0)
        check_int(self.num_slots, "num_slots", 0)
        if self.index.shape[0] != self.num_tokens:
            raise ValueError(f"SlotPlan.index has {self.index.shape[0]} entries but num_tokens={self.num_tokens}")

    @property
    def device(self) -> torch.device:
        return self.index.device


SlotsLike = Union[SlotPlan, Tensor]


def _check_slot_tensor(slots, name: str) -> Tensor:
    if not isinstance(slots, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or a SlotPlan, got {type(slots).__name__}")
    if slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {slots.dtype}")
    if slots.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(slots.shape)}")
    return slots


def _validate_index(index: Tensor, num_slots: int, name: str, unique: bool) -> None:
    """Range (and duplicate) check of an int64 slot index; ONE host sync (error paths sync more)."""
    n = index.numel()
    if n == 0:
        return
    if unique:
        ordered, order = torch.sort(index, stable=True)
        dup = ordered[1:] == ordered[:-1]
        lo, hi, has_dup = torch.stack([ordered[0], ordered[-1], dup.any().long()]).tolist()
    else:
        lo, hi = torch.stack([index.min(), index.max()]).tolist()
        has_dup = 0
    if lo < 0 or hi >= num_slots:
        row = int(torch.nonzero((index < 0) | (index >= num_slots))[0])
        raise ValueError(
            f"{name}[{row}] = {int(index[row])} is out of range [0, num_slots={num_slots}); nothing was written"
        )
    if has_dup:
        j = int(torch.nonzero(dup)[0])
        a, b = sorted((int(order[j]), int(order[j + 1])))
        raise ValueError(
            f"{name} has duplicate entries: slot {int(index[a])} at rows {a} and {b} "
            "(every token needs its own slot); nothing was written"
        )


def plan_slots(
    meta: Union[CPMetadata, int],
    slots: Tensor,
    num_slots: int,
    *,
    name: str = "slots",
    allow_duplicates: bool = False,
) -> SlotPlan:
    """Validate a forward's cache slots once (host) for every layer's cache write.

    Args:
        meta: the forward's plan; its ``num_tokens`` T rows are covered (``slots[:T]``). Or an int
            row count (e.g. ``sum(prefix_lens)`` for prefix slots read back).
        slots: [>= T] int32/int64 slot of each row in logical order (``page * page_size +
            offset``), on the cache's device; entries past T (an engine's CUDA-graph padding) are
            ignored.
        num_slots: slots of the cache it will be used with (``num_pages * page_size``).
        name: argument name for error messages (e.g. "swa_slots" for a sliding-window pool).
        allow_duplicates: for READ plans only (shared prefix pages); writes reject such a plan.

    Returns:
        a frozen :class:`SlotPlan` (int64 index [T] on ``slots.device``; for a static plan of a
        :class:`cpattn.StaticPlanner`: [capacity T] at a fixed address, rows past T repeating the
        last real slot, so a captured graph's writes replay). Host work, once per
        forward: syncs once. Raises ValueError / TypeError naming ``name`` for an out-of-range or
        duplicate slot, too few entries, or a wrong dtype.

    Example::

        plan = cpattn.plan_slots(meta, out_cache_loc, k_cache.shape[0] * k_cache.shape[1])
        for layer in layers:                       # device-only from here on
            cpattn.write_kv_cache(k_ext, v_ext, k_cache[layer], v_cache[layer], plan)
    """
    if isinstance(meta, CPMetadata):
        rows = meta.num_tokens
    elif isinstance(meta, int) and not isinstance(meta, bool):
        if meta < 0:
            raise ValueError(f"meta (row count) must be >= 0, got {meta}")
        rows = meta
    else:
        raise TypeError(f"meta must be a CPMetadata or an int row count, got {type(meta).__name__}")
    num_slots = check_int(num_slots, "num_slots", 0)
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if not isinstance(allow_duplicates, bool):
        raise TypeError(f"allow_duplicates must be a bool, got {type(allow_duplicates).__name__}")
    slots = _check_slot_tensor(slots, name)
    if slots.shape[0] < rows:
        raise ValueError(f"{name} has {slots.shape[0]} entries, fewer than the {rows} rows to cover")
    if slots.device.type == "meta":
        raise ValueError(f"{name} is on meta: plan_slots needs the slot values (a real device)")
    index = slots[:rows].to(torch.int64).contiguous()
    _validate_index(index, num_slots, name, unique=not allow_duplicates)
    if isinstance(meta, CPMetadata) and meta.is_static:
        index = _static_index(meta, index, name)
        rows = meta.num_token_rows
    return SlotPlan(index=index, num_tokens=rows, num_slots=num_slots, name=name, unique=not allow_duplicates)


def _static_index(meta: CPMetadata, index: Tensor, name: str) -> Tensor:
    """A static plan's slot index: capacity rows at a fixed address (so a captured graph's cache
    writes replay). Rows past T repeat the last real slot: the gathered rows there repeat the
    last real token's row (``gather_index``), so those writes store the same bytes again."""
    if index.numel() == 0:
        raise ValueError(f"{name}: a static plan's cache writes need at least one token in the batch")
    padded = torch.empty(meta.num_token_rows, dtype=torch.int64)
    padded[: index.numel()] = index.cpu()
    padded[index.numel() :] = index[-1].item()
    return _buffers.upload(meta, ("slots", name), {"index": padded})["index"]


def _resolve_slots(
    slots: SlotsLike, name: str, rows: int, rows_of: str, num_slots: int, cache_name: str,
    device: torch.device, write: bool,
) -> Tensor:
    """Check ``slots`` (a SlotPlan: host ints only; a raw tensor: validated here, syncs) against a
    write/read of ``rows`` rows into a cache of ``num_slots`` slots -> int64 index on ``device``."""
    if isinstance(slots, SlotPlan):
        if slots.num_tokens != rows:
            raise ValueError(f"{slots.name} plans {slots.num_tokens} rows but {rows_of} has {rows} rows")
        if slots.num_slots != num_slots:
            raise ValueError(
                f"{slots.name} was planned for num_slots={slots.num_slots} but {cache_name} has {num_slots} slots"
            )
        if slots.device != device:
            raise ValueError(f"{slots.name} is on {slots.device} but the cache is on {device}")
        if write and not slots.unique:
            raise ValueError(
                f"{slots.name} allows duplicate slots: a write needs a plan_slots(..., allow_duplicates=False) plan"
            )
        return slots.index
    slots = _check_slot_tensor(slots, name)
    if slots.shape[0] != rows:
        raise ValueError(
            f"{name} has {slots.shape[0]} entries but {rows_of} has {rows} rows: a raw slot tensor needs exactly "
            "one slot per row (pass the gathered [T, ...] rows; trim a padded slot array with plan_slots)"
        )
    if slots.device != device:
        raise ValueError(f"{name} is on {slots.device} but the cache is on {device}")
    index = slots.to(torch.int64)
    _validate_index(index, num_slots, name, unique=write)
    return index


def _flat_slots(cache: Tensor, name: str, trailing: int) -> Tensor:
    """View a flat ``[num_slots, *row]`` or paged ``[num_pages, page_size, *row]`` cache as
    ``[num_slots, *row]`` (``trailing`` = dims of one row). Must be a view: writes land in ``cache``."""
    if cache.dim() == trailing + 1:
        return cache
    if cache.dim() == trailing + 2:
        try:
            return cache.view(-1, *cache.shape[2:])
        except RuntimeError:
            raise ValueError(f"{name} paged layout must be viewable as [num_slots, ...] (contiguous pages)") from None
    raise ValueError(
        f"{name} must be [num_slots, ...] or [num_pages, page_size, ...] with {trailing} row dim(s), "
        f"got shape {tuple(cache.shape)}"
    )


def _as_bytes(x: Tensor) -> Tensor:
    """``[N, ...]`` -> ``[N, row_bytes]`` uint8 (the last dim must be contiguous)."""
    x = x.reshape(x.shape[0], -1)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.view(torch.uint8) if x.dtype != torch.uint8 else x


# ---------------------------------------------------------------------------------------- bytes
def mla_bytes_per_token(kv_lora_rank: int, qk_rope_head_dim: int, dtype: torch.dtype, *, aligned: bool = False) -> int:
    """Bytes of one token's MLA latent: ``(kv_lora_rank + qk_rope_head_dim) * itemsize``.

    That is the MLA cache row and what ``gather_mla_latent`` moves per token per layer (times
    ``C - 1`` received by each rank). ``aligned=True`` gives the exact row of the packed all-gather,
    where each part is rounded up to 16 bytes (equal to ``cpattn.gathered_bytes_per_token([kv_c,
    k_pe])``; the same as the unaligned value whenever both parts are multiples of 16 bytes, e.g.
    DeepSeek-V3 bf16: 1024 + 128 = 1152).

    Example::

        cpattn.mla_bytes_per_token(512, 64, torch.bfloat16)  # 1152
    """
    r = check_int(kv_lora_rank, "kv_lora_rank", 1)
    d_rope = check_int(qk_rope_head_dim, "qk_rope_head_dim", 0)
    size = _check_dtype(dtype, "dtype").itemsize
    if not aligned:
        return (r + d_rope) * size
    return sum(-(-n * size // PART_ALIGN_BYTES) * PART_ALIGN_BYTES for n in (r, d_rope))


def kv_bytes_per_token(num_kv_heads: int, head_dim: int, v_head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token's up-projected K and V: ``num_kv_heads * (head_dim + v_head_dim) * itemsize``.

    The MLA comparison: DeepSeek-V3 K/V per token is 128 heads x (192 + 128) bf16 = 81,920 bytes,
    71x the 1,152-byte latent.
    """
    hkv = check_int(num_kv_heads, "num_kv_heads", 1)
    d = check_int(head_dim, "head_dim", 1)
    dv = check_int(v_head_dim, "v_head_dim", 1)
    return hkv * (d + dv) * _check_dtype(dtype, "dtype").itemsize


def _check_mla_write(
    cache: Tensor,
    slots: SlotsLike,
    num_tokens: int,
    r: int,
    d_rope: int,
    kv_c_dtype: torch.dtype,
    k_pe_dtype: torch.dtype,
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    """Validate an MLA cache write of ``num_tokens`` rows -> (flat cache view, int64 slot index).

    With a :class:`SlotPlan` only host ints are checked (no sync); callers run it before a
    collective so a bad cache raises on every rank instead of after the gather.
    """
    check_tensor(cache, "cache")
    if cache.device != device:
        raise ValueError(f"cache is on {cache.device} but the latent rows are on {device}")
    if cache.dtype == torch.uint8 and not (kv_c_dtype == k_pe_dtype == torch.uint8):
        row = r * kv_c_dtype.itemsize + d_rope * k_pe_dtype.itemsize
        what = "bytes (raw uint8 cache)"
    elif kv_c_dtype == k_pe_dtype == cache.dtype:
        row = r + d_rope
        what = "values"
    else:
        raise TypeError(
            f"cache dtype {cache.dtype} must equal kv_c dtype {kv_c_dtype} and k_pe dtype {k_pe_dtype} "
            "(or be uint8 for a raw-byte cache)"
        )
    flat = _flat_slots(cache, "cache", 1)
    if flat.shape[1] != row:
        raise ValueError(f"cache rows hold {flat.shape[1]} {what}, expected r + d_rope = {r} + {d_rope} -> {row}")
    index = _resolve_slots(slots, "slots", num_tokens, "kv_c", flat.shape[0], "cache", device, write=True)
    return flat, index


# ---------------------------------------------------------------------------------------- MLA
def write_mla_cache(kv_c: Tensor, k_pe: Tensor, cache: Tensor, slots: SlotsLike) -> Tensor:
    """Write the gathered latent of ``T`` extend tokens into a paged MLA cache (in place, all or nothing).

    Args:
        kv_c: [T, r] latent in logical order (e.g. from ``strategy.gather_mla_latent``).
        k_pe: [T, d_rope] rotary key after RoPE, same rows.
        cache: [num_slots, r + d_rope] or [num_pages, page_size, r + d_rope] in kv_c's dtype
            (which must equal k_pe's), or uint8 with rows of ``r * kv_c.itemsize + d_rope *
            k_pe.itemsize`` bytes (raw, for mixed dtypes).
        slots: a :class:`SlotPlan` of T rows for this cache (:func:`plan_slots`, once per
            forward), or a raw int32/int64 [T] tensor, exactly one slot per row (validated here:
            one host sync).

    Returns:
        ``cache`` (written in place). With a SlotPlan: device-only, no host sync. On a ValueError
        / TypeError nothing is written.

    Example::

        plan = cpattn.plan_slots(meta, out_cache_loc, num_slots)               # once per forward
        kv_c, k_pe = s.gather_mla_latent(kv_c_local, k_pe_local, meta, group)  # per layer
        cpattn.write_mla_cache(kv_c, k_pe, mla_cache, plan)
    """
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe)):
        check_tensor(t, name)
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D [T, dim], got shape {tuple(t.shape)}")
    if kv_c.shape[0] != k_pe.shape[0]:
        raise ValueError(f"kv_c has {kv_c.shape[0]} rows but k_pe has {k_pe.shape[0]}")
    if kv_c.device != k_pe.device:
        raise ValueError(f"kv_c is on {kv_c.device} but k_pe on {k_pe.device}")
    flat, index = _check_mla_write(
        cache, slots, kv_c.shape[0], kv_c.shape[1], k_pe.shape[1], kv_c.dtype, k_pe.dtype, kv_c.device
    )
    if kv_c.shape[0] == 0:
        return cache
    rows = torch.cat([_as_bytes(kv_c), _as_bytes(k_pe)], dim=1)
    _as_bytes_view(flat).index_copy_(0, index, rows)
    return cache


def read_mla_cache(cache: Tensor, slots: SlotsLike, kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """Rows of an MLA cache at ``slots`` -> (kv_c [N, r], k_pe [N, d_rope]), in the cache dtype.

    ``cache``: a layout of :func:`write_mla_cache` (typed, not uint8); ``slots``: a
    :class:`SlotPlan` of N rows (device-only; ``allow_duplicates=True`` plans are fine for reads),
    or a raw int32/int64 [N] tensor (range-checked here: one host sync; repeats allowed). The two
    results are views of one gathered [N, r + d_rope] tensor.
    """
    check_tensor(cache, "cache")
    r = check_int(kv_lora_rank, "kv_lora_rank", 1)
    flat = _flat_slots(cache, "cache", 1)
    if cache.dtype == torch.uint8:
        raise TypeError("read_mla_cache needs a typed cache; a uint8 (raw-byte) cache has no element type")
    if r > flat.shape[1]:
        raise ValueError(f"kv_lora_rank={r} exceeds the cache row width {flat.shape[1]}")
    rows = slots.num_tokens if isinstance(slots, SlotPlan) else _check_slot_tensor(slots, "slots").shape[0]
    index = _resolve_slots(slots, "slots", rows, "the read", flat.shape[0], "cache", cache.device, write=False)
    out = flat.index_select(0, index)
    return out[:, :r], out[:, r:]


# ---------------------------------------------------------------------------------------- K/V
def write_kv_cache(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: SlotsLike,
    *,
    swa_slots: Optional[SlotsLike] = None,
    swa_k_cache: Optional[Tensor] = None,
    swa_v_cache: Optional[Tensor] = None,
) -> None:
    """Write the gathered K/V of ``T`` extend tokens into paged K/V caches (in place, all or nothing).

    Args:
        k, v: [T, Hkv, D] / [T, Hkv, Dv] in logical order (e.g. from ``strategy.gather_kv``; NOT
            the rank-local [P, ...] rows).
        k_cache, v_cache: [num_slots, Hkv, D] / [num_slots, Hkv, Dv], or paged
            [num_pages, page_size, Hkv, D] / [.., Dv]; same dtypes as k / v (fp8 fine).
        slots: a :class:`SlotPlan` of T rows for these caches (:func:`plan_slots`, once per
            forward), or a raw int32/int64 [T] tensor, exactly one slot per row (validated here:
            one host sync).
        swa_slots, swa_k_cache, swa_v_cache: a separate sliding-window pool (all three or none);
            its own slot plan (planned against the SWA pool's size) or raw tensor; the same rows are
            written there too. (A layer that lives only in an SWA pool passes that pool as
            k_cache / v_cache.)

    Every pool is validated before any is written; on a ValueError / TypeError no cache changes.
    With SlotPlans: device-only, no host sync.
    """
    for name, t in (("k", k), ("v", v)):
        check_tensor(t, name)
        if t.dim() != 3:
            raise ValueError(f"{name} must be [T, Hkv, dim], got shape {tuple(t.shape)}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k shape {tuple(k.shape)} and v shape {tuple(v.shape)} differ before the last dim")
    swa = (swa_slots, swa_k_cache, swa_v_cache)
    if any(x is not None for x in swa) and not all(x is not None for x in swa):
        raise ValueError("swa_slots, swa_k_cache and swa_v_cache must be given together")
    pools = [("", k_cache, v_cache, slots)]
    if swa_slots is not None:
        pools.append(("swa_", swa_k_cache, swa_v_cache, swa_slots))
    writes = []
    for prefix, kc, vc, sl in pools:  # validate every pool before writing any
        flats = []
        for name, cache, src in ((f"{prefix}k_cache", kc, k), (f"{prefix}v_cache", vc, v)):
            check_tensor(cache, name)
            flat = _flat_slots(cache, name, 2)
            if tuple(flat.shape[1:]) != tuple(src.shape[1:]):
                raise ValueError(
                    f"{name} rows are {tuple(flat.shape[1:])}, expected [Hkv, dim] = {tuple(src.shape[1:])}"
                )
            if cache.dtype != src.dtype:
                raise TypeError(f"{name} dtype {cache.dtype} != {'k' if src is k else 'v'} dtype {src.dtype}")
            if cache.device != src.device:
                raise ValueError(f"{name} is on {cache.device} but the rows are on {src.device}")
            flats.append(flat)
        if flats[1].shape[0] != flats[0].shape[0]:
            raise ValueError(
                f"{prefix}v_cache has {flats[1].shape[0]} slots but {prefix}k_cache has {flats[0].shape[0]}"
            )
        index = _resolve_slots(
            sl, f"{prefix}slots", k.shape[0], "k", flats[0].shape[0], f"{prefix}k_cache", kc.device, write=True
        )
        writes += [(flats[0], k, index), (flats[1], v, index)]
    if k.shape[0] == 0:
        return
    for flat, src, index in writes:
        _as_bytes_view(flat).index_copy_(0, index, _as_bytes(src))


def _as_bytes_view(flat: Tensor) -> Tensor:
    """A ``[num_slots, ...]`` cache as a writable ``[num_slots, row_bytes]`` uint8 view."""
    view = flat.view(flat.shape[0], -1)
    return view.view(torch.uint8) if view.dtype != torch.uint8 else view
