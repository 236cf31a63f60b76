"""The attention-plan base: what every algorithm's plan shares (written once).

An :class:`AttentionPlan` binds one placement plan (``meta``) and one layer kind
(:class:`cpattn.AttentionSpec`) to a backend and an algorithm, at plan time (host, once per
forward per layer kind). Per layer it offers two device-only, graph-safe calls:

* ``run(q, k, v, cache, *, writes=, group=, ...)``: this rank's new rows in, this rank's output
  out: the algorithm's collective(s), the cache write, the kernel and the merge.
* ``attend(q, k, v, ...)``: the kernel only (no collective, no write), for engines that gather
  and write themselves.

The base holds the per-call checks (one tuple compare on the common path, the full checks with
their messages otherwise), the page-table and sinks checks, the out / lse buffers and the softmax
scale. Subclasses (one module per algorithm) add only what differs.
"""

from __future__ import annotations

from typing import Optional, TypedDict

import torch
import torch.distributed as dist
from torch import Tensor

from .._validation import check_softmax_scale, check_tensor
from ..metadata import CPMetadata
from ..spec import AttentionSpec

__all__ = ["ALGORITHMS", "AttentionPlan", "KernelCall", "check_group_rank", "check_qkv", "check_sinks",
           "result_buffers"]

#: Every algorithm a plan can run: "local" (no collective: replicated queries and KV cache, or
#: C = 1), "gather_kv" (all-gather the new K/V, attend locally), "pass_kv" / "pass_q" (an extend
#: over a sharded cache), "shard_merge" (replicated queries over a sharded cache: attend the
#: local shard, merge the partials exactly).
ALGORITHMS = ("local", "gather_kv", "pass_kv", "pass_q", "shard_merge")

_PAGE_TABLE_DTYPES = (torch.int32, torch.int64)


class KernelCall(TypedDict, total=False):
    """The per-call keywords of the kernel that plans' ``attend`` and ``run`` share (each method
    says which it takes; an unknown one is a TypeError before any collective or write):

    page_table: [num_seq_rows, max_pages] int32/int64 of a paged spec. sinks: [Hq] float when
    the spec has sinks. softmax_scale: float > 0 (default D ** -0.5). out: [rows, Hq, Dv] buffer
    in the plan's dtype; lse: [rows, Hq] float32 buffer. return_lse: also return lse.
    k_scale, v_scale: an FP8 spec (``kv_dtype``) only, required there: float32 ``[]`` (per
    tensor) or ``[Hkv]`` (per KV head) device tensors; the caches hold ``x / scale``
    (:mod:`cpattn.quant`). Any other spec refuses them.
    """

    page_table: Optional[Tensor]
    sinks: Optional[Tensor]
    softmax_scale: Optional[float]
    out: Optional[Tensor]
    lse: Optional[Tensor]
    return_lse: bool
    k_scale: Optional[Tensor]
    v_scale: Optional[Tensor]


#: the keywords of a kernel call (:class:`KernelCall`)
KERNEL_CALL = frozenset(KernelCall.__annotations__)


def check_group_rank(meta: CPMetadata) -> None:
    """ValueError when ``meta`` was agreed on a group in which this process has another rank."""
    if meta.group is not None and dist.is_initialized():
        rank = dist.get_rank(meta.group)
        if rank != meta.rank:
            raise ValueError(f"metadata was built for rank {meta.rank} but this process is rank {rank} of its group")


def check_sinks(sinks: Optional[Tensor], spec: AttentionSpec, device: torch.device) -> None:
    """Per-layer check of ``sinks`` against a plan's spec."""
    if (sinks is not None) != spec.has_sinks:
        raise ValueError(f"the plan was built with has_sinks={spec.has_sinks}; "
                         f"got sinks={'a tensor' if sinks is not None else None}")
    if sinks is not None:
        check_tensor(sinks, "sinks")
        if tuple(sinks.shape) != (spec.num_q_heads,) or not sinks.dtype.is_floating_point or sinks.device != device:
            raise ValueError(f"sinks must be a float [Hq={spec.num_q_heads}] tensor on {device}, got "
                             f"{sinks.dtype} {list(sinks.shape)} on {sinks.device}")


def result_buffers(
    out: Optional[Tensor], lse: Optional[Tensor], out_shape: tuple, lse_shape: tuple, dtype: torch.dtype,
    device: torch.device, want_lse: bool, rows: str = "P", lse_head_major: bool = False,
    lse_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Optional[Tensor]]:
    """The out [rows, Hq, Dv] / lse [rows, Hq] buffers of a call: the caller's (checked; an lse
    buffer may be float32 or ``lse_dtype``) or new ones (lse in ``lse_dtype``: float32, or float64
    where the backend computes float64 inputs in float64; only when ``want_lse``;
    ``lse_head_major``: allocated [Hq, rows], handed out transposed)."""
    if out is None:
        out = torch.empty(out_shape, dtype=dtype, device=device)
    else:
        check_tensor(out, "out")
        if tuple(out.shape) != out_shape or out.dtype != dtype or out.device != device or out.stride(-1) != 1:
            raise ValueError(f"out must be [{rows}, Hq, Dv] = {list(out_shape)} {dtype} on {device} with a "
                             f"contiguous last dim, got {list(out.shape)} {out.dtype} on {out.device}")
    if lse is None:
        if want_lse:
            lse = (torch.empty(lse_shape[::-1], dtype=lse_dtype, device=device).t() if lse_head_major
                   else torch.empty(lse_shape, dtype=lse_dtype, device=device))
    else:
        check_tensor(lse, "lse")
        if tuple(lse.shape) != lse_shape or lse.dtype not in (torch.float32, lse_dtype) or lse.device != device:
            what = "float32" if lse_dtype == torch.float32 else f"float32 or {lse_dtype}"
            raise ValueError(f"lse must be [{rows}, Hq] = {list(lse_shape)} {what} on {device}, got "
                             f"{list(lse.shape)} {lse.dtype} on {lse.device}")
    return out, lse


def kv_storage_dtype(spec: AttentionSpec) -> torch.dtype:
    """The dtype of the K/V tensors a plan of ``spec`` reads: uint8 for the tile-scaled FP8
    latent (``kv_layout="fp8_tile"``), else ``spec.kv_dtype``."""
    return torch.uint8 if spec.kv_tiled else spec.kv_dtype


def tile_row_bytes(spec: AttentionSpec) -> int:
    """Bytes per token of a tile-scaled latent cache of ``spec`` (Dv latent, D - Dv rope)."""
    return spec.kv_row_bytes


def check_qkv(q: Tensor, k: Tensor, v: Tensor, paged: bool, *, q_name: str = "q_local", k_name: str = "k",
              v_name: str = "v", q_rows: str = "P", kv_rows: str = "num_kv_tokens") -> tuple[int, int]:
    """(Hq, Hkv) of the q / k / v of a convenience call (``attention``, ``sparse_attention``,
    which plan from the tensors), after the checks every plan kind shares:
    tensors, q ``[rows, Hq, D]`` floating, K/V packed ``[rows, Hkv, D]`` or paged ``[pages,
    page_size, Hkv, D]`` with q's head dim and the same leading dims, Hq a multiple of Hkv
    (ValueError / TypeError naming the argument)."""
    for name, t in ((q_name, q), (k_name, k), (v_name, v)):
        check_tensor(t, name)
    if q.dim() != 3:
        raise ValueError(f"{q_name} must be [{q_rows}, Hq, D], got shape {tuple(q.shape)}")
    if not q.dtype.is_floating_point:
        raise TypeError(f"{q_name} must be a floating tensor, got {q.dtype}")
    if k.dim() != (4 if paged else 3) or v.dim() != k.dim():
        layout = "[num_pages, page_size, Hkv, D]" if paged else f"[{kv_rows}, Hkv, D]"
        raise ValueError(f"{k_name} and {v_name} must be {layout}, got shapes {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"{k_name} head dim {k.shape[-1]} != q head dim {q.shape[-1]}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"{k_name} shape {tuple(k.shape)} and {v_name} shape {tuple(v.shape)} differ before the last "
                         "dim")
    hq, hkv = q.shape[1], k.shape[-2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"Hq={hq} must be a multiple of Hkv={hkv}")
    return hq, hkv



class AttentionPlan:
    """One layer kind's attention over one placement plan (build with :func:`cpattn.plan_attention`).

    Attributes:
        meta: the placement plan. spec: the :class:`cpattn.AttentionSpec` (an index top-k
            plan, :class:`cpattn.plans.IndexTopkPlan`: its ``IndexTopkSpec``).
        algorithm: one of :data:`ALGORITHMS`. backend: the backend that runs the kernel
            ("triton", "fa4", "torch"; "gemm" for the index scores over a key shard). family: the kernel family (e.g. "sm90", "portable",
            "split-kv"; the backend's name when it has one family).

    ``attend``'s K/V (``kv_rows`` rule): a plan whose keys are packed expects
    ``[num_kv_rows, Hkv, D]`` exactly (``kv_rows_exact``) or at least ``kv_rows_min`` rows (a
    rank's packed shard); a paged plan expects ``[num_pages, page_size, Hkv, D]`` with a
    ``page_table`` covering ``max_keys`` keys per sequence.
    """

    algorithm: str = "local"
    #: the key count a page table must cover per sequence, and what it is called in messages
    _keys_what = "the longest sequence"

    def __init__(self, meta: CPMetadata, spec: AttentionSpec, backend: str, run_impl, *, rows: int,
                 kv_rows_exact: Optional[int] = None, kv_rows_min: int = 0, max_keys: int = 0,
                 q_name: str = "q", rows_name: str = "P") -> None:
        self._bind(meta, spec, backend, run_impl)
        device = self._device
        self._rows_name, self._q_name = rows_name, q_name
        self._q_shape = (rows, spec.num_q_heads, spec.head_dim)
        self._out_shape = (rows, spec.num_q_heads, spec.head_dim_v)
        self._lse_shape = (rows, spec.num_q_heads)
        self._scale = spec.head_dim**-0.5
        self._lse_head_major = getattr(run_impl, "lse_head_major", False)
        hkv, d, dv = spec.num_kv_heads, spec.head_dim, spec.head_dim_v
        self._k_tail = ((spec.page_size,) if spec.paged else ()) + (hkv, d)
        self._v_tail = ((spec.page_size,) if spec.paged else ()) + (hkv, dv)
        if spec.kv_tiled:  # k and v: the same uint8 rows of the tile-scaled latent
            self._k_tail = self._v_tail = self._k_tail[:-1] + (tile_row_bytes(spec),)
        self._kv_rows_exact = None if spec.paged else kv_rows_exact
        self._kv_rows_min = 0 if spec.paged else kv_rows_min
        size, dtype, kv_dtype = torch.Size, spec.dtype, kv_storage_dtype(spec)
        # what a valid call's q shape, k / v shapes past dim 0, dtypes and devices compare equal to
        self._expect = (size(self._q_shape), size(self._k_tail), size(self._v_tail), dtype, kv_dtype, kv_dtype, device,
                        device, device)
        self._pt_expect = (meta.num_seq_rows, device)
        self._max_keys = max_keys
        self._min_pages = -(-max_keys // spec.page_size) if spec.paged else 0

    def _bind(self, meta: CPMetadata, spec, backend: str, run_impl) -> None:
        """What every plan binds (attention and index top-k plans): placement plan, spec,
        backend name, the planned launch and the device."""
        self.meta, self.spec, self.backend = meta, spec, backend
        self._impl = run_impl
        self._device = meta.device

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(algorithm={self.algorithm!r}, backend={self.backend!r}, {self.spec}, "
                f"{self._rows_name}={self._q_shape[0]})")

    @property
    def launch(self):
        """The backend's planned launch (read-only introspection for benchmarks and tools, e.g.
        a split-KV plan's ``num_items`` / ``split``)."""
        return self._impl

    @property
    def family(self) -> str:
        """The kernel family that runs (e.g. "sm90" or "portable" for triton; else the backend)."""
        return getattr(self._impl, "family", self.backend)

    @property
    def mma_dtype(self) -> Optional[torch.dtype]:
        """The dtype this plan's kernel multiplies in when it is FP8 tensor-core attention
        (``spec.mma_dtype`` where the running kernel implements it: dense plans, the portable
        Triton kernel or the torch reference), else None: the kernel multiplies in the query
        dtype (FP8 K/V dequantized in registers; e.g. shard / split-KV decode plans, which
        ignore ``spec.mma_dtype``)."""
        return getattr(self._impl, "mma_dtype", None)

    # ------------------------------------------------------------------ per-call checks
    def _check_call(self, q: Tensor, k: Tensor, v: Tensor, page_table: Optional[Tensor],
                    sinks: Optional[Tensor]) -> None:
        """The per-layer checks of a kernel call: one tuple compare when everything holds."""
        if type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor:
            self._check_qkv(q, k, v)
        else:
            ks, vs = k.shape, v.shape
            if (q.shape, ks[1:], vs[1:], q.dtype, k.dtype, v.dtype, q.device, k.device, v.device) != self._expect \
                    or ks[0] != vs[0] or (self._kv_rows_exact is not None and ks[0] != self._kv_rows_exact) \
                    or ks[0] < self._kv_rows_min:
                self._check_qkv(q, k, v)
        self._check_table_and_sinks(page_table, sinks)

    def _check_table_and_sinks(self, page_table, sinks) -> None:
        """The page table (one compare when it holds) and sinks of a call."""
        if self.spec.paged:
            if type(page_table) is not Tensor or page_table.dim() != 2 or page_table.dtype not in _PAGE_TABLE_DTYPES \
                    or (page_table.shape[0], page_table.device) != self._pt_expect \
                    or page_table.shape[1] < self._min_pages:
                self._check_page_table(page_table)
        elif page_table is not None:
            raise ValueError("page_table given but the plan is for packed K/V (plan with page_size=)")
        if sinks is not None or self.spec.has_sinks:
            check_sinks(sinks, self.spec, self._device)

    def _check_qkv(self, q, k, v) -> None:
        """The per-layer checks of q / k / v with their messages (raises on the first failure)."""
        spec, device, qn = self.spec, self._device, self._q_name
        check_tensor(q, qn)
        if q.dtype != spec.dtype:
            raise TypeError(f"{qn} dtype {q.dtype} != the plan's dtype {spec.dtype}")
        if q.device != device:
            raise ValueError(f"{qn} is on {q.device} but the plan is on {device} (use meta.to(device))")
        if tuple(q.shape) != self._q_shape:
            raise ValueError(f"{qn} must be [{self._rows_name}, Hq, D] = {list(self._q_shape)}, got {list(q.shape)}")
        self._check_kv(k, v)

    def _check_kv(self, k, v) -> None:
        """The per-layer checks of the K / V ``attend`` reads, with their messages."""
        spec, device = self.spec, self._device
        for name, t in (("k", k), ("v", v)):
            check_tensor(t, name)
            if spec.kv_tiled and t.dtype != torch.uint8:
                raise TypeError(f"{name} dtype {t.dtype}: a kv_layout={spec.kv_layout!r} plan reads the uint8 cache "
                                "rows")
            if t.dtype != kv_storage_dtype(spec):
                what = "kv_dtype" if spec.kv_quantized else "dtype"
                raise TypeError(f"{name} dtype {t.dtype} != the plan's {what} {spec.kv_dtype}")
            if t.device != device:
                raise ValueError(f"{name} is on {t.device} but the plan is on {device} (use meta.to(device))")
        k_tail, v_tail = self._k_tail, self._v_tail
        n = len(k_tail) + 1
        if k.dim() != n or tuple(k.shape[1:]) != k_tail or v.dim() != n or tuple(v.shape[1:]) != v_tail \
                or v.shape[0] != k.shape[0]:
            lead = "num_pages" if self.spec.paged else "rows"
            raise ValueError(f"k / v must be [{lead}, {', '.join(map(str, k_tail))}] / "
                             f"[{lead}, {', '.join(map(str, v_tail))}], got {list(k.shape)} / {list(v.shape)}")
        if self._kv_rows_exact is not None and k.shape[0] != self._kv_rows_exact:
            rows = self._kv_rows_exact
            raise ValueError(f"packed k/v must be {[rows, *k_tail]} / {[rows, *v_tail]} (rows = sum(prefix_lens + "
                             f"extend_lens)), got {list(k.shape)} / {list(v.shape)}")
        if k.shape[0] < self._kv_rows_min:
            raise ValueError(f"packed k / v must have >= {self._kv_rows_min} rows (this rank's local keys), "
                             f"got {k.shape[0]}")

    def _check_page_table(self, page_table) -> None:
        if page_table is None:
            raise ValueError(f"the plan is paged (page_size={self.spec.page_size}): pass page_table")
        check_tensor(page_table, "page_table")
        meta = self.meta
        if page_table.dtype not in _PAGE_TABLE_DTYPES:
            raise TypeError(f"page_table must be int32 or int64, got {page_table.dtype}")
        if page_table.dim() != 2 or page_table.shape[0] != meta.num_seq_rows:
            raise ValueError(f"page_table must be [B={meta.num_seq_rows}, max_pages], got {list(page_table.shape)}")
        if page_table.device != self._device:
            raise ValueError(f"page_table is on {page_table.device} but the plan is on {self._device}")
        ps = self.spec.page_size
        if page_table.shape[1] * ps < self._max_keys:
            raise ValueError(f"page_table holds {page_table.shape[1]} pages of {ps} = {page_table.shape[1] * ps} "
                             f"keys, fewer than {self._keys_what} ({self._max_keys})")

    def _kernel_call(self, call: dict, method: str, allowed: frozenset = KERNEL_CALL) -> tuple:
        """(page_table, sinks, softmax_scale, out, lse, return_lse, scales) of a call's keywords
        (absent: None / False; ``scales``: :meth:`_check_scales` of ``k_scale`` / ``v_scale``);
        TypeError naming any keyword ``method`` does not take, ValueError for scales the spec
        does not match (both before any collective or write)."""
        if not call.keys() <= allowed:
            raise TypeError(f"{type(self).__name__}.{method}() got unexpected keyword argument(s) "
                            f"{sorted(call.keys() - allowed)}")
        get = call.get
        scales = self._check_scales(get("k_scale"), get("v_scale"))
        return (get("page_table"), get("sinks"), get("softmax_scale"), get("out"), get("lse"), get("return_lse", False),
                scales)

    def _check_scales(self, k_scale, v_scale) -> Optional[tuple[Tensor, Tensor]]:
        """The K/V scales of a call: None for a cache in the query dtype (both must be None), the
        checked (k_scale, v_scale) pair for an FP8 cache (float32 ``[]`` or ``[Hkv]`` on the
        plan's device; device tensors, read by the kernels: graph-safe)."""
        if self.spec.kv_tiled:
            if k_scale is not None or v_scale is not None:
                raise ValueError(f"kv_layout={self.spec.kv_layout!r} rows carry their own tile scales: pass no "
                                 "k_scale / v_scale")
            return None
        if not self.spec.kv_quantized:
            if k_scale is not None or v_scale is not None:
                raise ValueError(f"k_scale / v_scale are for an FP8 cache (AttentionSpec(kv_dtype=)); this plan's "
                                 f"kv_dtype is {self.spec.kv_dtype}")
            return None
        if type(k_scale) is not Tensor or type(v_scale) is not Tensor or k_scale.dtype != torch.float32 \
                or v_scale.dtype != torch.float32 or k_scale.device != self._device or v_scale.device != self._device \
                or k_scale.shape not in self._scale_shapes or v_scale.shape not in self._scale_shapes:
            from ..quant import check_kv_scale

            for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
                if sc is None:
                    raise ValueError(f"the plan's kv_dtype is {self.spec.kv_dtype}: pass {name}= (float32 [] or "
                                     f"[Hkv={self.spec.num_kv_heads}])")
                check_kv_scale(sc, name, self.spec.num_kv_heads, self._device)
        return k_scale, v_scale

    @property
    def _scale_shapes(self) -> tuple:
        return (torch.Size(()), torch.Size((self.spec.num_kv_heads,)))

    def _launch(self, *args, scales: Optional[tuple[Tensor, Tensor]]) -> None:
        """The backend's call, with ``k_scale`` / ``v_scale`` for an FP8 cache."""
        if scales is None:
            self._impl(*args)
        else:
            self._impl(*args, k_scale=scales[0], v_scale=scales[1])

    def _softmax_scale(self, softmax_scale) -> float:
        if softmax_scale is None:
            return self._scale
        return check_softmax_scale(softmax_scale)

    def _result(self, out, lse, want_lse: bool) -> tuple[Tensor, Optional[Tensor]]:
        if out is None and lse is None and not want_lse:
            return torch.empty(self._out_shape, dtype=self.spec.dtype, device=self._device), None
        return result_buffers(out, lse, self._out_shape, self._lse_shape, self.spec.dtype, self._device, want_lse,
                              rows=self._rows_name, lse_head_major=self._lse_head_major,
                              lse_dtype=getattr(self._impl, "lse_dtype", torch.float32))

    # ------------------------------------------------------------------ one-call helpers
    def _check_new_rows(self, q: Tensor, k: Tensor, v: Tensor, rows: int) -> None:
        """Checks of ``run``'s q / k / v: this rank's [rows, ...] new rows (before any collective)."""
        spec = self.spec
        for name, t, tail in ((self._q_name, q, (spec.num_q_heads, spec.head_dim)),
                              ("k", k, (spec.num_kv_heads, spec.head_dim)),
                              ("v", v, (spec.num_kv_heads, spec.head_dim_v))):
            check_tensor(t, name)
            if tuple(t.shape) != (rows, *tail):
                raise ValueError(f"{name} must be this rank's new rows [{rows}, {', '.join(map(str, tail))}], "
                                 f"got {list(t.shape)}")
            if t.dtype != spec.dtype:
                raise TypeError(f"{name} dtype {t.dtype} != the plan's dtype {spec.dtype}")
            if t.device != self._device:
                raise ValueError(f"{name} is on {t.device} but the plan is on {self._device}")

    def _check_before_write(self, page_table, sinks, cache=None) -> None:
        """The cache-layout, page-table and sinks checks of ``attend``, for ``run`` to make
        before its collective and cache write (``cache``: the (k, v) pair ``attend`` will read)."""
        if cache is not None and not self._cache_matches(*cache):
            self._check_kv(*cache)
        self._check_table_and_sinks(page_table, sinks)

    def _cache_matches(self, k: Tensor, v: Tensor) -> bool:
        """Do K/V caches have the dims, dtype and device ``attend`` reads (the cheap test; the
        full check with its messages is ``_check_kv``)?"""
        n = len(self._k_tail) + 1
        return not (k.dim() != n or tuple(k.shape[1:]) != self._k_tail or v.dim() != n
                    or tuple(v.shape[1:]) != self._v_tail or v.shape[0] != k.shape[0] or k.dtype != self._expect[4]
                    or v.dtype != self._expect[4] or k.device != self._device or v.device != self._device)

    def _gather_and_write(self, q: Tensor, k_local: Tensor, v_local: Tensor, cache, writes, group,
                          page_table, sinks, scales=None) -> tuple[Tensor, Tensor]:
        """``run``'s steps before the kernel over a replicated cache: checks (before any
        collective or write), ONE all-gather of the new K/V (none for "local"), the cache write
        (paged) or the packing after the cached prefix (packed) -> the K/V ``attend`` reads.
        ``scales`` (an FP8 cache, checked): the new rows are quantized on this rank first, so the
        all-gather moves FP8 bytes."""
        from ..cache import check_kv_writes, write_kv_cache
        from ..collectives import all_gather_kv_rows, check_group
        from ..kv import pack_kv

        meta = self.meta
        self._check_new_rows(q, k_local, v_local, meta.num_physical_tokens)
        if self.spec.kv_tiled:
            return self._gather_and_write_tiles(k_local, v_local, cache, writes, group, page_table, sinks)
        if self.spec.paged:
            k_cache, v_cache = self._cache_pair(cache, "the layer's paged caches")
            if writes is None:
                raise ValueError("writes= is required with a paged cache (cpattn.plan_cache_writes); engines that "
                                 "write the cache themselves call plan.attend")
            if self.algorithm != "local" or scales is not None or not self._cache_matches(k_cache, v_cache):
                # before the collective / the quantization. "local" without scales over caches that
                # match the plan moves and changes nothing before write_kv_cache, whose own checks
                # (the same) still come before any write; checking twice was part of a CPU decode
                # step's 1.06x host time against 0.3.15 (0.99x without it and the flat page write)
                k_scale, v_scale = scales if scales is not None else (None, None)  # FP8: the cache must be FP8
                check_kv_writes(writes, k_cache, v_cache, meta.num_token_rows, k_local, v_local, k_scale=k_scale,
                                v_scale=v_scale)
            self._check_before_write(page_table, sinks, (k_cache, v_cache))
        else:
            if writes is not None:
                raise ValueError("writes= is for a paged cache; a packed plan reads the prefix from cache=")
            k_pre, v_pre = (None, None) if cache is None else self._cache_pair(cache, "the packed prefix K/V")
            if k_pre is not None and (k_pre.dtype != self.spec.kv_dtype or v_pre.dtype != self.spec.kv_dtype):
                raise TypeError(f"the packed prefix K/V must be {self.spec.kv_dtype} (the plan's kv_dtype), got "
                                f"{k_pre.dtype} / {v_pre.dtype}")
            self._check_before_write(page_table, sinks)
        if self.algorithm != "local":
            check_group(meta, group)
        if scales is not None:  # quantized where computed: the gather moves FP8 bytes
            from ..quant import quantize_fp8

            k_local = quantize_fp8(k_local, scales[0], self.spec.kv_dtype)
            v_local = quantize_fp8(v_local, scales[1], self.spec.kv_dtype)
        k_ext, v_ext = all_gather_kv_rows(k_local, v_local, meta, group)  # ONE all-gather ("local": none)
        if self.spec.paged:
            write_kv_cache(k_ext, v_ext, k_cache, v_cache, writes)
            return k_cache, v_cache
        if meta.num_kv_tokens == meta.num_tokens:  # no cached prefix: the logical rows are the packed layout
            return k_ext, v_ext
        return pack_kv(k_ext, v_ext, meta, k_pre, v_pre)

    # ------------------------------------------------------------------ tile-scaled latent (kv_layout="fp8_tile")
    def _check_latent_view(self, k: Tensor, v: Tensor) -> None:
        """``run``'s new rows of a tile spec: ``v`` must be the view ``k[..., :Dv]`` (absorbed
        MLA: the tile row stores the latent once; a separate V would be dropped)."""
        if v.data_ptr() != k.data_ptr() or v.stride() != k.stride():
            raise ValueError(f"v must be the view k[..., :{self.spec.head_dim_v}] of a kv_layout="
                             f"{self.spec.kv_layout!r} plan (the tile row holds the latent once), got a separate tensor")

    def _tile_cache(self, cache, what: str) -> Tensor:
        """The uint8 tile rows of ``run``'s ``cache``: a pair ``(rows, rows)`` of ONE tensor (as
        :meth:`attend` reads k = v = the rows)."""
        k, v = self._cache_pair(cache, what)
        if v is not k and (v.data_ptr(), v.shape, v.stride(), v.dtype) != (k.data_ptr(), k.shape, k.stride(), k.dtype):
            raise ValueError(f"cache of a kv_layout={self.spec.kv_layout!r} plan is (rows, rows), one uint8 tensor "
                             f"twice ({what}: K and V are the same latent rows), got two different tensors")
        return k

    def _quantize_tiles(self, k: Tensor) -> Tensor:
        """New latent rows ``k`` [N, 1, D] (latent | rope) -> uint8 tile rows [N, 1, row_bytes]."""
        from ..quant import quantize_mla_fp8_tiles

        dv = self.spec.head_dim_v
        return quantize_mla_fp8_tiles(k[:, 0, :dv], k[:, 0, dv:]).unsqueeze(1)

    def _gather_and_write_tiles(self, k_local, v_local, cache, writes, group, page_table,
                                sinks) -> tuple[Tensor, Tensor]:
        """:meth:`_gather_and_write` of a tile spec (q / k / v checked): every check, then this
        rank's rows quantized to tile rows, ONE all-gather of them (none for "local"), the write
        through ``writes`` (paged) or the packing after the cached prefix -> (rows, rows)."""
        from ..cache import check_mla_tile_writes, write_mla_cache
        from ..collectives import all_gather_rows, check_group
        from ..kv import pack_kv
        from ..quant import FP8_TILE

        meta, spec = self.meta, self.spec
        self._check_latent_view(k_local, v_local)
        row_bytes = tile_row_bytes(spec)
        pre = None
        if spec.paged:
            tiles = self._tile_cache(cache, "the layer's paged tile cache")
            if writes is None:
                raise ValueError("writes= is required with a paged cache (cpattn.plan_cache_writes); engines that "
                                 "write the cache themselves call plan.attend")
            self._check_before_write(page_table, sinks, (tiles, tiles))
            check_mla_tile_writes(writes, tiles[..., 0, :], meta.num_token_rows, row_bytes, self._device)
        else:
            if writes is not None:
                raise ValueError("writes= is for a paged cache; a packed plan reads the prefix from cache=")
            num_prefix = meta.num_kv_tokens - meta.num_tokens
            if cache is not None:
                pre = self._tile_cache(cache, "the packed prefix tile rows")
                if tuple(pre.shape) != (num_prefix, 1, row_bytes) or pre.dtype != torch.uint8 \
                        or pre.device != self._device:
                    raise ValueError(f"the packed prefix tile rows must be uint8 [sum(prefix_lens)={num_prefix}, 1, "
                                     f"{row_bytes}] on {self._device}, got {pre.dtype} {list(pre.shape)} on "
                                     f"{pre.device}")
            elif num_prefix:
                raise ValueError(f"the batch has {num_prefix} prefix tokens: pass cache=(prefix_rows, prefix_rows)")
            self._check_before_write(page_table, sinks)
        if self.algorithm != "local":
            check_group(meta, group)
        (ext,) = all_gather_rows([self._quantize_tiles(k_local)], meta, group)  # ONE all-gather of tile rows
        if spec.paged:
            write_mla_cache(ext[:, 0], None, tiles[..., 0, :], writes, layout=FP8_TILE)
            return tiles, tiles
        if pre is None:
            return ext, ext
        rows, _ = pack_kv(ext, ext[..., :0], meta, pre, pre[..., :0])  # V is K's latent: one packed tensor
        return rows, rows

    @staticmethod
    def _cache_pair(cache, what: str) -> tuple[Tensor, Tensor]:
        if not isinstance(cache, (tuple, list)) or len(cache) != 2 or not all(isinstance(c, Tensor) for c in cache):
            raise TypeError(f"cache must be a pair (k, v) of tensors ({what}), got {type(cache).__name__}")
        return cache[0], cache[1]

    def attend(self, *args, **kwargs):  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def run(self, *args, **kwargs):  # pragma: no cover - every subclass defines it
        raise NotImplementedError
