"""Cache writes: ONE write-plan type for every placement and KV layout, validated once.

A forward's new K/V rows go into this rank's cache at slots (``slot = page * page_size +
offset``). :func:`plan_cache_writes` decides and validates them on the host once per forward
(in range, no two rows on one slot, the page table covering every key), for a replicated cache
(every extend token, in logical order: the rows ``strategy.gather_kv`` returns) or a sharded one
(only the rows this rank stores, ``meta.store_rows``), and returns a :class:`CacheWritePlan`.
The per-layer writers (:func:`write_kv_cache`, :func:`write_mla_cache`) are device-only: host-int
checks, then one indexed copy per cache; graph-safe with a static plan.

Cache layouts: flat ``[num_slots, *row]`` or paged ``[num_pages, page_size, *row]``, any strides
(e.g. FlashInfer's ``[pages, 2, page, H, D]`` split into ``buf[:, 0]`` / ``buf[:, 1]``):

* K/V caches: rows ``[Hkv, D]`` / ``[Hkv, Dv]``, the dtype of K / V (fp8 included).
* MLA latent cache: rows ``[r + d_rope]``: ``kv_c`` (the RMS-normed latent, ``r =
  kv_lora_rank``) then ``k_pe`` (the rotary key after RoPE) of DeepSeek-V3's cache (576 values);
  or ``uint8`` rows of ``r * kv_c.itemsize + d_rope * k_pe.itemsize`` raw bytes (e.g. an fp8
  latent beside a bf16 rope key).

Every write is all-or-nothing: every argument (rows, dtypes, devices, layouts, every pool) is
checked before the first byte is written; a rejected call raises ValueError / TypeError naming
the argument and leaves every cache bit-identical.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

from . import _buffers
from ._validation import check_int, check_tensor
from .collectives import PART_ALIGN_BYTES
from .metadata import CPMetadata

__all__ = [
    "CacheWritePlan",
    "check_kv_writes",
    "check_mla_tile_writes",
    "kv_bytes_per_token",
    "mla_bytes_per_token",
    "plan_cache_writes",
    "read_mla_cache",
    "write_kv_cache",
    "write_mla_cache",
]

_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_dtype(dtype, name: str) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {type(dtype).__name__}")
    return dtype


# ---------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True, eq=False)
class CacheWritePlan:
    """Where this forward's new rows go in this rank's cache (build it with
    :func:`plan_cache_writes`; validated there).

    Attributes:
        slots: [N] int64 cache slots on the cache's device (static plans: fixed address).
        rows: [N] int64 rows of the per-layer source tensor written to ``slots``, or None: row
            i goes to ``slots[i]``.
        num_writes: real writes (N minus a static plan's padding entries).
        num_source_rows: rows the per-layer source (K / V / latent) must have: T logical rows
            (``gather_kv``'s output) for sharded queries, the P local rows for replicated ones.
        num_slots: slots of the cache it was validated for.
        pad_slot: where a static plan's padding entries write, or None.
        name: the argument name used in messages.
    """

    slots: Tensor
    rows: Optional[Tensor]
    num_writes: int
    num_source_rows: int
    num_slots: int
    pad_slot: Optional[int] = None
    name: str = "slots"

    def __repr__(self) -> str:
        return (f"CacheWritePlan(num_writes={self.num_writes}, num_source_rows={self.num_source_rows}, "
                f"num_slots={self.num_slots})")

    @property
    def device(self) -> torch.device:
        return self.slots.device


def _check_slot_tensor(slots, name: str) -> Tensor:
    if not isinstance(slots, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or a CacheWritePlan, got {type(slots).__name__}")
    if slots.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {slots.dtype}")
    if slots.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(slots.shape)}")
    if slots.device.type == "meta":
        raise ValueError(f"{name} is on meta: cache slots need their values (a real device)")
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


def _new_rows(meta: CPMetadata) -> tuple[Optional[Tensor], Tensor, Tensor, int, Tensor]:
    """(source rows or None, sequence, cache key index, source row count, keys per sequence) of
    the rows this rank writes (host): every extend token for a replicated cache (index =
    position), the stored rows for a sharded one (index = local key index)."""
    h = meta.host if meta.host is not None else meta
    if meta.kv is None:
        seq = torch.repeat_interleave(torch.arange(h.num_seqs), h.extend_lens, output_size=h.num_tokens)
        pos = h.prefix_lens[seq] + torch.arange(h.num_tokens) - h.cu_extend_lens[seq]
        return None, seq, pos, meta.num_token_rows, h.kv_lens
    source_rows = meta.num_physical_tokens if meta.replicated else meta.num_token_rows
    return h.store_rows, meta.store_seq, h.store_index, source_rows, h.local_kv_lens


def plan_cache_writes(
    meta: CPMetadata,
    slots_or_page_table: Tensor,
    *,
    num_slots: Optional[int] = None,
    page_size: Optional[int] = None,
    num_pages: Optional[int] = None,
    pad_slot: Optional[int] = None,
    name: str = "slots",
) -> CacheWritePlan:
    """Plan and validate this rank's cache writes for one forward (host, once; may sync once).

    Args:
        meta: the forward's placement plan (any strategy; ``meta.kv`` says whether the cache is
            replicated or sharded), on the cache's device.
        slots_or_page_table: either
            * ``slots`` 1-D int32/int64: the cache slot of each row this rank writes, in order:
              every extend token in logical order for a replicated cache ([>= T]; entries past
              T, an engine's CUDA-graph padding, are ignored), the rows it stores for a sharded
              one ([>= meta.num_stored_tokens], in ``meta.store_rows`` order); pass
              ``num_slots``; or
            * a page table [B, max_pages] int32/int64 of THIS rank's cache (CPU or device; read
              once here): key j of sequence b (j = position for a replicated cache, the local
              key index for a sharded one) lives at ``page_table[b, j // page_size] *
              page_size + j % page_size``; pass ``page_size`` and ``num_pages``.
        num_slots: slots of the cache (``num_pages * page_size``), with 1-D slots.
        page_size, num_pages: of the paged cache, with a page table (page_size a multiple of a
            sharding's interleave).
        pad_slot: a slot reserved for padded writes (SGLang's slot 0, vLLM's pad slot): a static
            plan's padding entries write there, so the per-layer write has a fixed size
            (required for static plans of a sharded cache; a replicated cache's static plan
            repeats its last real write instead when it is None).
        name: the argument name in messages (e.g. "swa_slots" for a sliding-window pool).

    Returns:
        a :class:`CacheWritePlan` (device tensors; fixed addresses for a static plan). Raises
        ValueError / TypeError naming the argument for a slot out of range, two rows on one slot,
        a table that does not cover a written key, or too few entries; nothing is written.

    Example::

        writes = cpattn.plan_cache_writes(meta, out_cache_loc, num_slots=num_pages * page_size)
        for layer in layers:                              # device-only from here on
            cpattn.write_kv_cache(k_ext, v_ext, k_cache[layer], v_cache[layer], writes)
    """
    if not isinstance(meta, CPMetadata):
        raise TypeError(f"meta must be a CPMetadata, got {type(meta).__name__}")
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    rows, seq, index, source_rows, keys = _new_rows(meta)
    n = index.numel()
    table = slots_or_page_table
    if not isinstance(table, Tensor):
        raise TypeError(f"slots_or_page_table must be a 1-D slot tensor or a 2-D page table, got "
                        f"{type(table).__name__}")
    if table.dim() == 2:
        if page_size is None or num_pages is None:
            raise ValueError("a page table needs page_size= and num_pages=")
        if num_slots is not None:
            raise ValueError("num_slots= is for 1-D slots; a page table gives num_pages * page_size")
        ps = meta.kv.check_page_size(page_size) if meta.kv is not None else check_int(page_size, "page_size", 1)
        pages = check_int(num_pages, "num_pages", 1)
        slots, total = _slots_of_table(meta, table, seq, index, keys, ps, pages), pages * ps
    else:
        if page_size is not None or num_pages is not None:
            raise ValueError("page_size= / num_pages= are for a page table; 1-D slots take num_slots=")
        if num_slots is None:
            raise ValueError("1-D slots need num_slots= (the cache's num_pages * page_size)")
        total = check_int(num_slots, "num_slots", 0)
        flat = _check_slot_tensor(table, name)
        if flat.shape[0] < n:
            what = "extend tokens" if meta.kv is None else "rows this rank stores"
            raise ValueError(f"{name} has {flat.shape[0]} entries, fewer than the {n} {what}")
        slots = flat[:n].to(torch.int64)
        _validate_index(slots, total, name, unique=True)
        slots = slots.cpu()
    if pad_slot is not None:
        check_int(pad_slot, "pad_slot", 0)
        if pad_slot >= total:
            raise ValueError(f"pad_slot must be in [0, num_slots={total}), got {pad_slot}")
        if n and bool((slots == pad_slot).any()):
            raise ValueError(f"pad_slot={pad_slot} is also the slot of a written row")
    if meta.is_static:
        size = source_rows
        if pad_slot is None:
            if meta.kv is not None:
                raise ValueError("static plans write a fixed number of rows: pass pad_slot (a reserved cache slot)")
            if n == 0:
                raise ValueError(f"{name}: a static plan's cache writes need at least one token in the batch "
                                 "(or pad_slot=)")
        fill = pad_slot if pad_slot is not None else int(slots[-1])
        host = {"slots": _buffers.pad_to(slots, size, fill)}
        if rows is not None:
            host["rows"] = _buffers.pad_to(rows, size, 0)
        dev = _buffers.upload(meta, ("writes", name, size), host)
    else:
        host = {"slots": slots.contiguous()}
        if rows is not None:
            host["rows"] = rows.clone()
        dev = _buffers.upload(meta, None, host)
    return CacheWritePlan(dev["slots"], dev.get("rows"), n, source_rows, total, pad_slot, name)


def _slots_of_table(meta: CPMetadata, page_table: Tensor, seq: Tensor, index: Tensor, keys: Tensor, ps: int,
                    pages: int) -> Tensor:
    """Host slots of the written rows through a page table, with its checks."""
    check_tensor(page_table, "page_table")
    if page_table.dtype not in _INDEX_DTYPES:
        raise TypeError(f"page_table must be int32 or int64, got {page_table.dtype}")
    b = meta.num_seq_rows
    if page_table.shape[0] != b:
        raise ValueError(f"page_table must be [B={b}, max_pages], got {list(page_table.shape)}")
    table = page_table.detach().to("cpu", torch.int64)
    need = (keys + ps - 1) // ps  # pages each sequence needs after this forward
    if need.numel() and int(need.max()) > table.shape[1]:
        s = int(torch.argmax(need))
        raise ValueError(f"page_table does not cover sequence {s}: it holds {int(keys[s])} keys on this rank "
                         f"({int(need[s])} pages of {ps}), the table has {table.shape[1]} pages per sequence")
    page = table[seq, index // ps] if index.numel() else torch.zeros(0, dtype=torch.int64)
    if page.numel() and (int(page.min()) < 0 or int(page.max()) >= pages):
        bad = int(torch.nonzero((page < 0) | (page >= pages))[0])
        raise ValueError(f"page_table[{int(seq[bad])}, {int(index[bad]) // ps}] = {int(page[bad])} is outside "
                         f"[0, num_pages={pages}) (key {int(index[bad])} of sequence {int(seq[bad])})")
    slots = page * ps + index % ps
    if slots.numel() > 1 and torch.unique(slots).numel() != slots.numel():
        raise ValueError("page_table maps two written rows to the same cache slot (pages shared between "
                         "sequences must hold only positions both already cached)")
    return slots


# ---------------------------------------------------------------------------------------- writes
def _cache_layout(cache: Tensor, name: str, row_shape: tuple, dtype: torch.dtype, device: torch.device) -> tuple:
    """(page_size or None, num_slots) of a flat ``[num_slots, *row]`` or paged ``[num_pages,
    page_size, *row]`` cache of any strides, after its checks."""
    check_tensor(cache, name)
    k = len(row_shape)
    if cache.dim() == k + 1:
        ps, num_slots = None, cache.shape[0]
    elif cache.dim() == k + 2:
        ps, num_slots = cache.shape[1], cache.shape[0] * cache.shape[1]
    else:
        raise ValueError(f"{name} must be [num_slots, {', '.join(map(str, row_shape))}] or [num_pages, page_size, "
                         f"...], got {list(cache.shape)}")
    if tuple(cache.shape[-k:] if k else ()) != tuple(row_shape):
        raise ValueError(f"{name} rows are {list(cache.shape[-k:])}, expected {list(row_shape)}")
    if cache.dtype != dtype:
        raise TypeError(f"{name} dtype {cache.dtype} != the rows' dtype {dtype}")
    if cache.device != device:
        raise ValueError(f"{name} is on {cache.device} but the rows are on {device}")
    if _may_overlap(cache):  # e.g. an expanded view: distinct slots share memory, no write can be exact
        raise ValueError(f"{name} has overlapping memory (shape {list(cache.shape)}, strides {list(cache.stride())}): "
                         "its slots alias each other, so it cannot hold distinct rows; nothing was written")
    return ps, num_slots


def _may_overlap(t: Tensor) -> bool:
    """Might two elements of ``t`` share memory? False for every non-overlapping layout whose dims,
    ordered by stride, each step over the previous ones (contiguous tensors, slices, views of
    interleaved buffers); True for expanded (stride 0) and other self-overlapping views."""
    span = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s > 1):
        if stride < span:
            return True
        span = stride * size
    return False


def _resolve(writes, name: str, rows: int, rows_of: str, num_slots: int, cache_name: str,
             device: torch.device) -> CacheWritePlan:
    """A plan checked against a write of ``rows`` source rows into ``num_slots`` slots (host ints
    only); a raw slot tensor becomes a plan here (validated: one host sync)."""
    if isinstance(writes, CacheWritePlan):
        if writes.num_source_rows != rows:
            raise ValueError(f"{writes.name} plans {writes.num_source_rows} source rows but {rows_of} has {rows} rows")
        if writes.num_slots != num_slots:
            raise ValueError(f"{writes.name} was planned for num_slots={writes.num_slots} but {cache_name} has "
                             f"{num_slots} slots")
        if writes.device != device:
            raise ValueError(f"{writes.name} is on {writes.device} but the cache is on {device}")
        return writes
    slots = _check_slot_tensor(writes, name)
    if slots.shape[0] != rows:
        raise ValueError(f"{name} has {slots.shape[0]} entries but {rows_of} has {rows} rows: a raw slot tensor needs "
                         "exactly one slot per row (plan a padded slot array with plan_cache_writes)")
    if slots.device != device:
        raise ValueError(f"{name} is on {slots.device} but the cache is on {device}")
    index = slots.to(torch.int64)
    _validate_index(index, num_slots, name, unique=True)
    return CacheWritePlan(index, None, rows, rows, num_slots, None, name)


def _scatter(cache: Tensor, page_size: Optional[int], plan: CacheWritePlan, src: Tensor,
             scale: Optional[Tensor] = None) -> None:
    """Rows ``plan.rows`` of ``src`` into ``cache`` at ``plan.slots`` (device-only, any strides);
    with ``scale``, quantized to the FP8 cache's dtype first (only the rows written)."""
    if plan.rows is not None:
        src = src.index_select(0, plan.rows)
    if scale is not None:
        from .quant import quantize_fp8

        src = quantize_fp8(src, scale, cache.dtype)
    if cache.element_size() == 1 and cache.dtype != torch.uint8:  # fp8: copied as bytes, bit for bit
        cache, src = cache.view(torch.uint8), src.view(torch.uint8)
    if page_size is None:
        cache.index_copy_(0, plan.slots, src)
    elif cache.stride(0) == page_size * cache.stride(1):  # adjacent pages: one flat [num_slots, ...] view
        cache.flatten(0, 1).index_copy_(0, plan.slots, src)
    else:
        cache.index_put_((plan.slots // page_size, plan.slots % page_size), src)


def _store_dtype(k: Tensor, v: Tensor, pools, k_scale, v_scale) -> Optional[torch.dtype]:
    """The FP8 dtype the rows are quantized to (None: written as they are), after the scale
    checks: scales go with an FP8 cache (of every pool) and rows in a wider float dtype."""
    if k_scale is None and v_scale is None:
        return None
    from .quant import check_kv_scale

    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc is None:
            raise ValueError("k_scale and v_scale must be given together (an FP8 cache has both)")
        check_kv_scale(sc, name, k.shape[1], k.device)
    check_tensor(pools[0][1], "k_cache")
    dtype = pools[0][1].dtype
    if dtype != torch.float8_e4m3fn:
        raise TypeError(f"k_cache dtype {dtype}: k_scale / v_scale quantize rows into a float8_e4m3fn cache")
    for name, t in (("k", k), ("v", v)):
        if not t.dtype.is_floating_point or t.element_size() == 1:
            raise TypeError(f"{name} must be the unquantized rows (a 16/32-bit float dtype) when scales are given, "
                            f"got {t.dtype}")
    return dtype


def _kv_pools(k, v, pools, k_scale=None, v_scale=None) -> list:
    """Check every (k_cache, v_cache, writes) pool of a K/V write -> the writes to run: (cache,
    page size, plan, source rows, scale or None: quantized into an FP8 cache)."""
    for name, t in (("k", k), ("v", v)):
        check_tensor(t, name)
        if t.dim() != 3:
            raise ValueError(f"{name} must be [rows, Hkv, dim], got shape {tuple(t.shape)}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k shape {tuple(k.shape)} and v shape {tuple(v.shape)} differ before the last dim")
    store = _store_dtype(k, v, pools, k_scale, v_scale)
    k_dtype, v_dtype = (k.dtype, v.dtype) if store is None else (store, store)
    todo = []
    for prefix, kc, vc, plan in pools:
        ps_k, n_k = _cache_layout(kc, f"{prefix}k_cache", tuple(k.shape[1:]), k_dtype, k.device)
        ps_v, n_v = _cache_layout(vc, f"{prefix}v_cache", tuple(v.shape[1:]), v_dtype, v.device)
        if n_k != n_v:
            raise ValueError(f"{prefix}v_cache {list(vc.shape)} and {prefix}k_cache {list(kc.shape)} differ in "
                             f"pages / slots ({n_v} vs {n_k} slots)")
        plan = _resolve(plan, f"{prefix}slots", k.shape[0], "k", n_k, f"{prefix}k_cache", kc.device)
        todo += [(kc, ps_k, plan, k, k_scale), (vc, ps_v, plan, v, v_scale)]
    return todo


def check_kv_writes(writes, k_cache: Tensor, v_cache: Tensor, rows: int, k: Tensor, v: Tensor, *,
                    k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None) -> None:
    """The checks of :func:`write_kv_cache` for ``rows`` source rows shaped like ``k`` / ``v``
    (plans call it before their collective, so a bad cache raises on every rank first)."""
    like_k = k.new_empty((rows, *k.shape[1:])) if k.shape[0] != rows else k
    like_v = v.new_empty((rows, *v.shape[1:])) if v.shape[0] != rows else v
    _kv_pools(like_k, like_v, [("", k_cache, v_cache, writes)], k_scale, v_scale)


def write_kv_cache(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    writes: Union[CacheWritePlan, Tensor],
    *,
    swa_writes: Optional[Union[CacheWritePlan, Tensor]] = None,
    swa_k_cache: Optional[Tensor] = None,
    swa_v_cache: Optional[Tensor] = None,
    k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None,
) -> None:
    """Write this forward's new K/V into this rank's K/V caches (in place, all or nothing).

    Args:
        k, v: the source rows [writes.num_source_rows, Hkv, D] / [.., Dv]: the logical [T, ...]
            rows of ``strategy.gather_kv`` (sharded queries), or the local [P, ...] rows
            (replicated queries). A sharded cache's plan picks the rows this rank stores.
        k_cache, v_cache: [num_slots, Hkv, D] / [.., Dv] or paged [num_pages, page_size, Hkv, D]
            / [.., Dv], any strides, the dtypes of k / v.
        writes: the :class:`CacheWritePlan` of this forward (:func:`plan_cache_writes`), or a
            raw int32/int64 slot tensor with exactly one slot per row (validated here: one sync).
        swa_writes, swa_k_cache, swa_v_cache: a separate sliding-window pool (all three or none),
            with its own plan; the same rows are written there too.
        k_scale, v_scale: FP8 caches (float8_e4m3fn, every pool) from rows in a 16/32-bit float
            dtype: float32 ``[]`` (per tensor) or ``[Hkv]`` (per KV head) device tensors; the
            written rows are quantized here, on the rank that writes (:func:`cpattn.quant.quantize_fp8`:
            round to nearest, saturate to +-448, NaN / inf -> NaN). Without them, rows are copied
            in their own dtype (FP8 rows already quantized included, bit for bit).

    Device-only with a plan (graph-safe with a static one). On a ValueError / TypeError no cache
    changes.
    """
    swa = (swa_writes, swa_k_cache, swa_v_cache)
    if any(x is not None for x in swa) and not all(x is not None for x in swa):
        raise ValueError("swa_writes, swa_k_cache and swa_v_cache must be given together")
    pools = [("", k_cache, v_cache, writes)]
    if swa_writes is not None:
        pools.append(("swa_", swa_k_cache, swa_v_cache, swa_writes))
    todo = _kv_pools(k, v, pools, k_scale, v_scale)  # every pool checked before any is written
    for cache, ps, plan, src, scale in todo:
        if plan.slots.numel():
            _scatter(cache, ps, plan, src, scale)


def _as_bytes(x: Tensor) -> Tensor:
    """``[N, ...]`` -> ``[N, row_bytes]`` uint8 (a contiguous copy where needed)."""
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


# ---------------------------------------------------------------------------------------- MLA
def _mla_row(cache: Tensor, r: int, d_rope: int, kv_c_dtype: torch.dtype, k_pe_dtype: torch.dtype) -> tuple:
    """(row width, raw bytes?) of an MLA cache for a latent of ``r`` and a rope key of ``d_rope``."""
    if cache.dtype == torch.uint8 and not (kv_c_dtype == k_pe_dtype == torch.uint8):
        return r * kv_c_dtype.itemsize + d_rope * k_pe_dtype.itemsize, True
    if kv_c_dtype == k_pe_dtype == cache.dtype:
        return r + d_rope, False
    raise TypeError(f"cache dtype {cache.dtype} must equal kv_c dtype {kv_c_dtype} and k_pe dtype {k_pe_dtype} "
                    "(or be uint8 for a raw-byte cache)")


def write_mla_cache(kv_c: Tensor, k_pe: Optional[Tensor], cache: Tensor, writes: Union[CacheWritePlan, Tensor], *,
                    scale: Optional[Tensor] = None, layout: Optional[str] = None) -> Tensor:
    """Write this forward's new MLA latent rows into an MLA cache (in place, all or nothing).

    Args:
        kv_c: [rows, r] latent (``strategy.gather_mla_latent``'s logical rows, or the local rows
            of replicated queries). k_pe: [rows, d_rope] rotary key after RoPE, same rows.
        cache: [num_slots, r + d_rope] or [num_pages, page_size, r + d_rope] (any strides) in
            kv_c's dtype (which must equal k_pe's), or uint8 rows of ``r * kv_c.itemsize +
            d_rope * k_pe.itemsize`` raw bytes (mixed dtypes).
        writes: a :class:`CacheWritePlan` (:func:`plan_cache_writes`) or a raw int32/int64 slot
            tensor, exactly one slot per row (validated here: one host sync).
        scale: an FP8 latent cache (float8_e4m3fn rows of ``r + d_rope`` values): the float32
            per-tensor scale ``[]`` of the whole row (absorbed MLA reads it as ``k_scale`` and
            ``v_scale``); kv_c and k_pe (one 16/32-bit float dtype) are quantized as they are
            written (:func:`cpattn.quant.quantize_fp8`).
        layout: ``"fp8_tile"`` (:data:`cpattn.quant.FP8_TILE`): ``cache`` is a uint8 tile-scaled
            FP8 latent cache, rows of :func:`cpattn.quant.mla_fp8_tile_bytes` (656 for 512 +
            64). Either kv_c / k_pe are the unquantized rows (16/32-bit floats), quantized here
            (only the rows this rank writes, :func:`cpattn.quant.quantize_mla_fp8_tiles`), or
            kv_c is the already-quantized uint8 [rows, row_bytes] of ``gather_mla_latent(...,
            layout="fp8_tile")`` and k_pe None (written bit for bit). No ``scale`` (each tile
            carries its own).

    Returns:
        ``cache``. Device-only with a plan; on a ValueError / TypeError nothing is written.
    """
    if layout is not None:
        return _write_mla_tiles(kv_c, k_pe, cache, writes, scale, layout)
    _check_latent_rows(kv_c, k_pe)
    check_tensor(cache, "cache")
    if scale is not None:
        _check_mla_scale(scale, kv_c, k_pe, cache)
        width, raw = kv_c.shape[1] + k_pe.shape[1], False
    else:
        width, raw = _mla_row(cache, kv_c.shape[1], k_pe.shape[1], kv_c.dtype, k_pe.dtype)
    ps, num_slots = _cache_layout(cache, "cache", (width,), cache.dtype, kv_c.device)
    plan = _resolve(writes, "slots", kv_c.shape[0], "kv_c", num_slots, "cache", kv_c.device)
    if plan.slots.numel():
        rows = torch.cat([_as_bytes(kv_c), _as_bytes(k_pe)], dim=1) if raw else torch.cat([kv_c, k_pe], dim=1)
        _scatter(cache, ps, plan, rows, scale)
    return cache


def _check_latent_rows(kv_c, k_pe, pe_optional: bool = False) -> None:
    """kv_c and k_pe are 2-D tensors of one row count and device (``pe_optional``: k_pe may be
    None, tile rows alone)."""
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe)):
        if t is None and name == "k_pe" and pe_optional:
            return
        check_tensor(t, name)
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D [rows, dim], got shape {tuple(t.shape)}")
    if kv_c.shape[0] != k_pe.shape[0]:
        raise ValueError(f"kv_c has {kv_c.shape[0]} rows but k_pe has {k_pe.shape[0]}")
    if kv_c.device != k_pe.device:
        raise ValueError(f"kv_c is on {kv_c.device} but k_pe on {k_pe.device}")


def _write_mla_tiles(kv_c, k_pe, cache: Tensor, writes, scale, layout) -> Tensor:
    """``write_mla_cache(..., layout=)``: checks everything, then quantizes (when the rows are
    not quantized yet) only the rows written and scatters them."""
    from .quant import FP8_TILE, mla_fp8_tile_bytes, quantize_mla_fp8_tiles

    if layout != FP8_TILE:
        raise ValueError(f"layout must be None or {FP8_TILE!r}, got {layout!r}")
    if scale is not None:
        raise ValueError(f"scale= is the per-tensor scale of a float8 latent cache; layout={FP8_TILE!r} rows carry "
                         "one scale per 128-value tile")
    _check_latent_rows(kv_c, k_pe, pe_optional=True)
    if k_pe is None:
        if kv_c.dtype != torch.uint8:
            raise TypeError(f"with k_pe=None, kv_c must be the quantized uint8 tile rows, got {kv_c.dtype}")
        width = kv_c.shape[1]
    else:
        for name, t in (("kv_c", kv_c), ("k_pe", k_pe)):
            if not t.dtype.is_floating_point or t.element_size() == 1:
                raise TypeError(f"{name} must be a 16/32-bit float tensor (quantized here), got {t.dtype}")
        width = mla_fp8_tile_bytes(kv_c.shape[1], k_pe.shape[1])
    ps, plan = check_mla_tile_writes(writes, cache, kv_c.shape[0], width, kv_c.device)
    if plan.slots.numel():
        take = (lambda t: t) if plan.rows is None else (lambda t: t.index_select(0, plan.rows))
        rows = take(kv_c) if k_pe is None else quantize_mla_fp8_tiles(take(kv_c), take(k_pe))
        _scatter(cache, ps, dataclasses.replace(plan, rows=None), rows)
    return cache


def check_mla_tile_writes(writes, cache: Tensor, rows: int, row_bytes: int,
                          device: torch.device) -> tuple[Optional[int], CacheWritePlan]:
    """The cache and write-plan checks of ``write_mla_cache(..., layout="fp8_tile")`` for ``rows``
    source rows of ``row_bytes`` bytes (plans call it before their collective) -> (page size or
    None, the resolved :class:`CacheWritePlan`)."""
    from .quant import FP8_TILE

    check_tensor(cache, "cache")
    if cache.dtype != torch.uint8:
        raise TypeError(f"cache dtype {cache.dtype}: a layout={FP8_TILE!r} cache holds uint8 rows")
    ps, num_slots = _cache_layout(cache, "cache", (row_bytes,), torch.uint8, device)
    return ps, _resolve(writes, "slots", rows, "kv_c", num_slots, "cache", device)


def _check_mla_scale(scale, kv_c: Tensor, k_pe: Tensor, cache: Tensor) -> None:
    """The checks of an FP8 latent write: a per-tensor float32 scale on kv_c's device, an FP8
    cache, kv_c and k_pe in one 16/32-bit float dtype."""
    from .quant import check_kv_scale

    check_kv_scale(scale, "scale", None, kv_c.device)
    if scale.dim() != 0:
        raise ValueError(f"scale of an MLA latent cache must be per tensor [], got shape {list(scale.shape)}")
    if cache.dtype != torch.float8_e4m3fn:
        raise TypeError(f"cache dtype {cache.dtype}: scale= quantizes the latent into a float8_e4m3fn cache")
    if kv_c.dtype != k_pe.dtype or not kv_c.dtype.is_floating_point or kv_c.element_size() == 1:
        raise TypeError(f"kv_c and k_pe must share one 16/32-bit float dtype when scale= is given, got {kv_c.dtype} "
                        f"and {k_pe.dtype}")


def read_mla_cache(cache: Tensor, slots: Tensor, kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """Rows of an MLA cache at ``slots`` -> (kv_c [N, r], k_pe [N, d_rope]) in the cache dtype.

    ``cache``: a typed (not uint8) layout of :func:`write_mla_cache`; ``slots``: int32/int64
    [N], range-checked here (one host sync; repeats allowed: shared prefix pages). The two
    results are views of one gathered [N, r + d_rope] tensor.
    """
    check_tensor(cache, "cache")
    r = check_int(kv_lora_rank, "kv_lora_rank", 1)
    if cache.dtype == torch.uint8:
        raise TypeError("read_mla_cache needs a typed cache; a uint8 (raw-byte) cache has no element type")
    if cache.dim() not in (2, 3):
        raise ValueError(f"cache must be [num_slots, row] or [num_pages, page_size, row], got {list(cache.shape)}")
    if r > cache.shape[-1]:
        raise ValueError(f"kv_lora_rank={r} exceeds the cache row width {cache.shape[-1]}")
    if isinstance(slots, CacheWritePlan):
        raise TypeError("slots must be a torch.Tensor (int32/int64 [N]): read_mla_cache takes raw slots, not a CacheWritePlan")
    index = _check_slot_tensor(slots, "slots").to(torch.int64)
    num_slots = cache.shape[0] if cache.dim() == 2 else cache.shape[0] * cache.shape[1]
    if slots.device != cache.device:
        raise ValueError(f"slots is on {slots.device} but the cache is on {cache.device}")
    _validate_index(index, num_slots, "slots", unique=False)
    if cache.dim() == 2:
        out = cache.index_select(0, index)
    else:
        out = cache[index // cache.shape[1], index % cache.shape[1]]
    return out[:, :r], out[:, r:]
