"""Dense attention plans: causal attention of a rank's local queries (plan once, run per layer).

:func:`plan_attention` (host, once per forward per layer kind) binds a placement plan to heads,
head dims, dtype, window, page size, sinks and a backend, decides every plan-level fact
(backend choice and eligibility, kernel family, tile height, heads per program, L2 sections,
varlen descriptors) and uploads what the kernels read in ONE host-to-device copy.
:meth:`AttentionPlan.run` (per layer) checks only what can differ per layer (shapes, dtypes,
devices of its tensors), then launches: no host sync, no host-to-device copy, O(1) host work.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .._validation import check_int, check_tensor
from ..kernels import AttentionSpec, select_backend
from ..metadata import CPMetadata

_PAGE_TABLE_DTYPES = (torch.int32, torch.int64)

__all__ = ["AttentionPlan", "check_group_rank", "check_sinks", "make_spec", "plan_attention", "result_buffers",
           "window_left"]


# ----------------------------------------------------------------------------- spec
def window_left(window_size) -> int:
    """The left window of flash-attn's (left, right) causal ``window_size`` (TypeError /
    ValueError naming the argument)."""
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__"):
        raise TypeError(f"window_size must be a pair (left, right) of ints, got {window_size!r}")
    window = tuple(window_size)
    if len(window) != 2 or any(isinstance(w, bool) or not isinstance(w, int) for w in window):
        raise TypeError(f"window_size must be a pair (left, right) of ints, got {window_size!r}")
    if window[0] < -1 or window[1] not in (-1, 0):
        raise ValueError(
            f"window_size must be (left >= -1, right in (-1, 0)) for causal attention, got {window}"
        )
    return window[0]


def make_spec(
    *, num_q_heads: int, num_kv_heads: int, head_dim: int, head_dim_v: Optional[int] = None,
    dtype: torch.dtype, window_size: Sequence[int] = (-1, -1), page_size: Optional[int] = None,
    has_sinks: bool = False,
) -> AttentionSpec:
    """Validate layer-kind facts into an :class:`AttentionSpec` (TypeError / ValueError naming
    the argument). ``window_size`` is flash-attn's (left, right) with right -1 or 0."""
    hq = check_int(num_q_heads, "num_q_heads", 1)
    hkv = check_int(num_kv_heads, "num_kv_heads", 1)
    if hq % hkv:
        raise ValueError(f"num_q_heads={hq} must be a multiple of num_kv_heads={hkv}")
    d = check_int(head_dim, "head_dim", 1)
    dv = d if head_dim_v is None else check_int(head_dim_v, "head_dim_v", 1)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if page_size is not None:
        page_size = check_int(page_size, "page_size", 1)
        if page_size > 256:
            raise ValueError(f"page_size must be in [1, 256], got {page_size}")
    if not isinstance(has_sinks, bool):
        raise TypeError(f"has_sinks must be a bool, got {type(has_sinks).__name__}")
    return AttentionSpec(hq, hkv, d, dv, dtype, window_left(window_size), page_size, has_sinks)


def check_qkv(q: Tensor, k: Tensor, v: Tensor, paged: bool, *, q_name: str = "q_local", k_name: str = "k",
              v_name: str = "v", q_rows: str = "P", kv_rows: str = "num_kv_tokens") -> tuple[int, int]:
    """(Hq, Hkv) of the q / k / v of a convenience call (``attention``, ``sparse_attention``,
    ``shard_attention``, which plan from the tensors), after the checks every plan kind shares:
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


def check_page_table_fast(page_table, paged: bool, expect: tuple, min_pages: int,
                          full_check: Callable[[object], None]) -> None:
    """The per-layer page-table check of a plan (shared by every plan kind): one compare for a
    valid table (int32 / int64 [B, >= ``min_pages``] with (B, device) == ``expect``), else
    ``full_check(page_table)`` (the checks with their messages); a table for a packed plan is
    refused."""
    if paged:
        if type(page_table) is not Tensor or page_table.dim() != 2 or page_table.dtype not in _PAGE_TABLE_DTYPES \
                or (page_table.shape[0], page_table.device) != expect or page_table.shape[1] < min_pages:
            full_check(page_table)
    elif page_table is not None:
        raise ValueError("page_table given but the plan is for packed K/V (plan with page_size=)")


def check_sinks(sinks: Optional[Tensor], spec: AttentionSpec, device: torch.device) -> None:
    """Per-layer check of ``sinks`` against a plan's spec (shared by every plan kind)."""
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
) -> tuple[Tensor, Optional[Tensor]]:
    """The out [rows, Hq, Dv] / lse [rows, Hq] float32 buffers of a plan's run: the caller's
    (checked) or new ones (lse only when ``want_lse``; ``lse_head_major``: allocated [Hq, rows]
    and handed out transposed). Shared by every plan kind."""
    if out is None:
        out = torch.empty(out_shape, dtype=dtype, device=device)
    else:
        check_tensor(out, "out")
        if tuple(out.shape) != out_shape or out.dtype != dtype or out.device != device or out.stride(-1) != 1:
            raise ValueError(f"out must be [{rows}, Hq, Dv] = {list(out_shape)} {dtype} on {device} with a "
                             f"contiguous last dim, got {list(out.shape)} {out.dtype} on {out.device}")
    if lse is None:
        if want_lse:
            lse = (torch.empty(lse_shape[::-1], dtype=torch.float32, device=device).t() if lse_head_major
                   else torch.empty(lse_shape, dtype=torch.float32, device=device))
    else:
        check_tensor(lse, "lse")
        if tuple(lse.shape) != lse_shape or lse.dtype != torch.float32 or lse.device != device:
            raise ValueError(f"lse must be [{rows}, Hq] = {list(lse_shape)} float32 on {device}, got "
                             f"{list(lse.shape)} {lse.dtype} on {lse.device}")
    return out, lse


def check_group_rank(meta: CPMetadata) -> None:
    """ValueError when ``meta`` was agreed on a group in which this process has another rank."""
    if meta.group is not None and dist.is_initialized():
        rank = dist.get_rank(meta.group)
        if rank != meta.rank:
            raise ValueError(f"metadata was built for rank {meta.rank} but this process is rank {rank} of its group")


# ----------------------------------------------------------------------------- plan
class AttentionPlan:
    """Causal attention of a rank's local queries, bound to one placement plan and layer kind.

    ``backend``: the backend that runs ("triton", "fa4" or "torch"); ``spec``: the bound
    :class:`AttentionSpec`; ``meta``: the placement plan. Build with :func:`plan_attention`
    (or ``strategy.plan_attention``).
    """

    def __init__(self, meta: CPMetadata, spec: AttentionSpec, backend: str, run_impl) -> None:
        self.meta, self.spec, self.backend = meta, spec, backend
        self._impl = run_impl
        p = meta.num_physical_tokens
        self._q_shape = (p, spec.num_q_heads, spec.head_dim)
        self._out_shape = (p, spec.num_q_heads, spec.head_dim_v)
        self._lse_shape = (p, spec.num_q_heads)
        if spec.paged:
            self._k_tail = (spec.page_size, spec.num_kv_heads, spec.head_dim)
            self._v_tail = (spec.page_size, spec.num_kv_heads, spec.head_dim_v)
        else:
            self._k_shape = (meta.num_kv_rows, spec.num_kv_heads, spec.head_dim)
            self._v_shape = (meta.num_kv_rows, spec.num_kv_heads, spec.head_dim_v)
        self._scale = spec.head_dim**-0.5
        self._lse_head_major = getattr(run_impl, "lse_head_major", False)
        self._device = device = meta.device
        dtype = spec.dtype
        # what run's one-compare check expects: (q shape, k / v shapes past dim 0, dtypes, devices)
        k_shape = self._k_tail if spec.paged else self._k_shape  # paged: past the page count
        v_shape = self._v_tail if spec.paged else self._v_shape
        size = torch.Size  # Size == Size compares faster than Size == tuple
        self._expect = (size(self._q_shape), size(k_shape), size(v_shape), dtype, dtype, dtype, device, device, device)
        self._pt_expect = (meta.num_seq_rows, device)
        self._min_pages = -(-meta.max_kv_len // spec.page_size) if spec.paged else 0

    def __repr__(self) -> str:
        return f"AttentionPlan(backend={self.backend!r}, {self.spec}, P={self.meta.num_physical_tokens})"

    @property
    def family(self) -> str:
        """The kernel family that runs (e.g. "sm90" or "portable" for triton; else the backend)."""
        return getattr(self._impl, "family", self.backend)

    def run(
        self,
        q_local: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        page_table: Optional[Tensor] = None,
        sinks: Optional[Tensor] = None,
        softmax_scale: Optional[float] = None,
        out: Optional[Tensor] = None,
        lse: Optional[Tensor] = None,
        return_lse: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attention of the local queries over their whole sequences (per layer, device-only).

        Args:
            q_local: [P, Hq, D] in the plan's dtype (pad rows ignored).
            k, v: packed [num_kv_rows, Hkv, D] / [.., Dv] (prefix then extend of each sequence),
                or paged caches [num_pages, page_size, Hkv, D] / [.., Dv] with ``page_table``
                [num_seq_rows, max_pages] int32/int64 (key j of sequence b at page
                ``page_table[b, j // page_size]``, slot ``j % page_size``). Any row strides.
            sinks: [Hq] float (any float dtype and stride) when the plan has sinks.
            softmax_scale: default D ** -0.5.
            out: [P, Hq, Dv] buffer to write (q's dtype); lse: [P, Hq] float32 buffer (any
                strides). Written in place; pad rows 0 / -inf.
            return_lse: also return lse (natural log, float32, sinks counted).

        Returns:
            out [P, Hq, Dv] (pad rows exactly 0), or (out, lse) with return_lse.
        """
        spec = self.spec
        # one tuple compare for the common case; the full checks (with their messages) otherwise
        if type(q_local) is not Tensor or type(k) is not Tensor or type(v) is not Tensor:
            self._check_qkv(q_local, k, v)
        elif spec.paged:
            ks, vs = k.shape, v.shape
            if (q_local.shape, ks[1:], vs[1:], q_local.dtype, k.dtype, v.dtype, q_local.device, k.device,
                    v.device) != self._expect or ks[0] != vs[0]:
                self._check_qkv(q_local, k, v)
        elif (q_local.shape, k.shape, v.shape, q_local.dtype, k.dtype, v.dtype, q_local.device, k.device,
              v.device) != self._expect:
            self._check_qkv(q_local, k, v)
        check_page_table_fast(page_table, spec.paged, self._pt_expect, self._min_pages, self._check_page_table)
        if sinks is not None or spec.has_sinks:
            check_sinks(sinks, spec, self._device)
        if out is None and lse is None and not return_lse:
            out = torch.empty(self._out_shape, dtype=spec.dtype, device=self._device)
        else:
            out, lse = result_buffers(out, lse, self._out_shape, self._lse_shape, spec.dtype, self._device,
                                      return_lse, lse_head_major=self._lse_head_major)
        scale = self._scale if softmax_scale is None else float(softmax_scale)
        self._impl(q_local, k, v, page_table, sinks, scale, out, lse)
        return (out, lse) if return_lse else out

    def _check_qkv(self, q_local, k, v) -> None:
        """The per-layer checks of q / k / v with their messages (raises on the first failure)."""
        spec, device = self.spec, self._device
        check_tensor(q_local, "q_local")
        if q_local.shape != self._q_shape:
            raise ValueError(f"q_local must be [P, Hq, D] = {list(self._q_shape)}, got {list(q_local.shape)}")
        dtype = spec.dtype
        for name, t in (("q_local", q_local), ("k", k), ("v", v)):
            check_tensor(t, name)
            if t.dtype != dtype:
                raise TypeError(f"{name} dtype {t.dtype} != the plan's dtype {dtype}")
            if t.device != device:
                raise ValueError(f"{name} is on {t.device} but the plan is on {device} (use meta.to(device))")
        if spec.paged:
            if k.dim() != 4 or k.shape[1:] != self._k_tail or v.dim() != 4 or v.shape[1:] != self._v_tail \
                    or v.shape[0] != k.shape[0]:
                raise ValueError(
                    f"paged k/v must be [num_pages, {', '.join(map(str, self._k_tail))}] / "
                    f"[num_pages, {', '.join(map(str, self._v_tail))}], got {list(k.shape)} / {list(v.shape)}"
                )
        elif k.shape != self._k_shape or v.shape != self._v_shape:
            raise ValueError(
                f"packed k/v must be {list(self._k_shape)} / {list(self._v_shape)} "
                f"(rows = sum(prefix_lens + extend_lens)), got {list(k.shape)} / {list(v.shape)}"
            )

    def _check_page_table(self, page_table: Optional[Tensor]) -> None:
        if page_table is None:
            raise ValueError(f"the plan is paged (page_size={self.spec.page_size}): pass page_table")
        check_tensor(page_table, "page_table")
        meta = self.meta
        if page_table.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"page_table must be int32 or int64, got {page_table.dtype}")
        if page_table.dim() != 2 or page_table.shape[0] != meta.num_seq_rows:
            raise ValueError(f"page_table must be [B={meta.num_seq_rows}, max_pages], got {list(page_table.shape)}")
        if page_table.device != meta.device:
            raise ValueError(f"page_table is on {page_table.device} but the plan is on {meta.device}")
        if page_table.shape[1] * self.spec.page_size < meta.max_kv_len:
            raise ValueError(
                f"page_table holds {page_table.shape[1]} pages of {self.spec.page_size} = "
                f"{page_table.shape[1] * self.spec.page_size} keys, fewer than the longest sequence ({meta.max_kv_len})"
            )


def plan_attention(
    meta: CPMetadata,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    head_dim_v: Optional[int] = None,
    dtype: torch.dtype,
    window_size: Sequence[int] = (-1, -1),
    page_size: Optional[int] = None,
    has_sinks: bool = False,
    backend: str = "auto",
    backend_options: Optional[Mapping] = None,
) -> AttentionPlan:
    """Plan one layer kind's attention over ``meta`` (host, once per forward; may copy once).

    Args:
        meta: the placement plan (on the device the layers run on).
        num_q_heads, num_kv_heads, head_dim, head_dim_v (default head_dim), dtype: of q / k / v.
        window_size: (left, right) like flash-attn; a row at position p sees keys at positions in
            [p - left, p] (left -1: no limit; positions are global, prefix counted). right must
            be -1 or 0 (causal).
        page_size: tokens per page of a paged K/V cache (1..256), None for packed K/V.
        has_sinks: the layer passes attention sinks ([Hq] float logits) to ``run``.
        backend: "auto" (fa4, then triton, then torch: the first that can run it), or a name
            (NotImplementedError naming the reason when it cannot).
        backend_options: backend-specific knobs (see ``cpattn.kernels.triton_backend``).

    Example::

        plan = s.plan_attention(meta, num_q_heads=32, num_kv_heads=8, head_dim=128,
                                dtype=torch.bfloat16, page_size=64)
        for layer in layers:
            o = plan.run(q, k_cache[layer], v_cache[layer], page_table=pt)
    """
    if not isinstance(meta, CPMetadata):
        raise TypeError(f"meta must be a CPMetadata, got {type(meta).__name__}")
    spec = make_spec(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, head_dim_v=head_dim_v,
                     dtype=dtype, window_size=window_size, page_size=page_size, has_sinks=has_sinks)
    options = dict(backend_options or {})
    check_group_rank(meta)
    chosen = select_backend(spec, meta, backend)
    return AttentionPlan(meta, spec, chosen.name, chosen.plan(spec, meta, options))


