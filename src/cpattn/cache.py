"""Write gathered extend tokens into paged KV caches, and the bytes a token costs to move.

After ``gather_mla_latent`` / ``gather_kv`` every rank holds the logical ``[T, ...]`` rows of the
batch's extend tokens, pad rows already dropped. These helpers put row ``t`` at cache slot
``slots[t]`` (``slot = page * page_size + offset``), as a paged-attention engine does before
attention reads the cache through its page table. Engines often pass slot arrays longer than ``T``
(padded to a CUDA-graph size): only ``slots[:T]`` is used, nothing is written for pad entries.

Cache layouts (either form; the paged one is a view of the flat one):

* MLA latent cache: ``[num_slots, r + d_rope]`` or ``[num_pages, page_size, r + d_rope]``, one row
  per token: ``kv_c`` (RMS-normed latent, ``r = kv_lora_rank``) then ``k_pe`` (rotary key after
  RoPE, shared by all heads). This is the DeepSeek-V3 cache row (576 values) of SGLang / vLLM.
  A ``uint8`` cache stores raw bytes, ``row_bytes = r * kv_c.itemsize + d_rope * k_pe.itemsize``
  (e.g. an fp8 latent next to a bf16 rope key).
* K/V caches: ``[num_slots, Hkv, D]`` / ``[num_slots, Hkv, Dv]`` or
  ``[num_pages, page_size, Hkv, D]`` / ``[.., Dv]`` (what ``strategy.attention`` reads with a
  ``page_table``).

Everything is copied as raw bytes (fp8 included, bit for bit) with one ``index_copy_`` per cache.
Per-layer path: device-only, no ``.item()``, no host sync; slot values are not range-checked on the
host (an out-of-range slot fails inside the index kernel). Duplicate slots in ``slots[:T]`` leave
an unspecified winner.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._validation import check_int, check_tensor
from .collectives import PART_ALIGN_BYTES

__all__ = [
    "kv_bytes_per_token",
    "mla_bytes_per_token",
    "read_mla_cache",
    "write_kv_cache",
    "write_mla_cache",
]



# ---------------------------------------------------------------------------------------- helpers
def _check_dtype(dtype, name: str) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {type(dtype).__name__}")
    return dtype


def _slot_index(slots: Tensor, num_tokens: int, device: torch.device, name: str) -> Tensor:
    """``slots[:num_tokens]`` as int64 on ``device`` (validated by shape and dtype only)."""
    check_tensor(slots, name)
    if slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {slots.dtype}")
    if slots.dim() != 1:
        raise ValueError(f"{name} must be 1-D [>= T], got shape {tuple(slots.shape)}")
    if slots.shape[0] < num_tokens:
        raise ValueError(f"{name} has {slots.shape[0]} entries, fewer than the T={num_tokens} tokens to write")
    if slots.device != device:
        raise ValueError(f"{name} is on {slots.device} but the cache is on {device}")
    return slots[:num_tokens].to(torch.int64)


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
    slots: Tensor,
    num_tokens: int,
    r: int,
    d_rope: int,
    kv_c_dtype: torch.dtype,
    k_pe_dtype: torch.dtype,
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    """Validate an MLA cache write of ``num_tokens`` rows -> (flat cache view, int64 slot index).

    Shape/dtype/device checks only (no sync); callers run it before a collective so a bad cache
    raises on every rank instead of after the gather.
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
    return flat, _slot_index(slots, num_tokens, device, "slots")


# ---------------------------------------------------------------------------------------- MLA
def write_mla_cache(kv_c: Tensor, k_pe: Tensor, cache: Tensor, slots: Tensor) -> Tensor:
    """Write the gathered latent of ``T`` extend tokens into a paged MLA cache (in place).

    Args:
        kv_c: [T, r] latent in logical order (e.g. from ``strategy.gather_mla_latent``).
        k_pe: [T, d_rope] rotary key after RoPE, same rows.
        cache: [num_slots, r + d_rope] or [num_pages, page_size, r + d_rope] in kv_c's dtype
            (which must equal k_pe's), or uint8 with rows of ``r * kv_c.itemsize + d_rope *
            k_pe.itemsize`` bytes (raw, for mixed dtypes).
        slots: [>= T] int32/int64 slot of each token in logical order; only ``slots[:T]`` is used.

    Returns:
        ``cache`` (written in place). Device-only: no host sync.

    Example::

        kv_c, k_pe = s.gather_mla_latent(kv_c_local, k_pe_local, meta, group)
        cpattn.write_mla_cache(kv_c, k_pe, mla_cache, out_cache_loc)
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


def read_mla_cache(cache: Tensor, slots: Tensor, kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """Rows of an MLA cache at ``slots`` -> (kv_c [N, r], k_pe [N, d_rope]), in the cache dtype.

    ``cache``: a layout of :func:`write_mla_cache` (typed, not uint8); ``slots``: [N] int32/int64.
    The two results are views of one gathered [N, r + d_rope] tensor. Device-only.
    """
    check_tensor(cache, "cache")
    r = check_int(kv_lora_rank, "kv_lora_rank", 1)
    flat = _flat_slots(cache, "cache", 1)
    if cache.dtype == torch.uint8:
        raise TypeError("read_mla_cache needs a typed cache; a uint8 (raw-byte) cache has no element type")
    if r > flat.shape[1]:
        raise ValueError(f"kv_lora_rank={r} exceeds the cache row width {flat.shape[1]}")
    _slot_index(slots, 0, cache.device, "slots")  # dtype / 1-D / device checks
    rows = flat.index_select(0, slots.to(torch.int64))
    return rows[:, :r], rows[:, r:]


# ---------------------------------------------------------------------------------------- K/V
def write_kv_cache(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    *,
    swa_slots: Optional[Tensor] = None,
    swa_k_cache: Optional[Tensor] = None,
    swa_v_cache: Optional[Tensor] = None,
) -> None:
    """Write the gathered K/V of ``T`` extend tokens into paged K/V caches (in place).

    Args:
        k, v: [T, Hkv, D] / [T, Hkv, Dv] in logical order (e.g. from ``strategy.gather_kv``).
        k_cache, v_cache: [num_slots, Hkv, D] / [num_slots, Hkv, Dv], or paged
            [num_pages, page_size, Hkv, D] / [.., Dv]; same dtypes as k / v (fp8 fine).
        slots: [>= T] int32/int64 slot of each token; only ``slots[:T]`` is used.
        swa_slots, swa_k_cache, swa_v_cache: a separate sliding-window pool (all three or none);
            its own slot array, trimmed the same way; the same rows are written there too.
            (A layer that lives only in an SWA pool passes that pool as k_cache / v_cache.)

    Device-only: no host sync.
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
            writes.append((flat, src, _slot_index(sl, k.shape[0], cache.device, f"{prefix}slots")))
    if k.shape[0] == 0:
        return
    for flat, src, index in writes:
        _as_bytes_view(flat).index_copy_(0, index, _as_bytes(src))


def _as_bytes_view(flat: Tensor) -> Tensor:
    """A ``[num_slots, ...]`` cache as a writable ``[num_slots, row_bytes]`` uint8 view."""
    view = flat.view(flat.shape[0], -1)
    return view.view(torch.uint8) if view.dtype != torch.uint8 else view
