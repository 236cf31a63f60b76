"""Exact merge of partial attention results (out, lse) over disjoint key sets, locally and over a
CP group in ONE collective.

Attention over a key set split into disjoint parts is recovered exactly from each part's
normalized output ``o_c`` and natural-log LSE ``l_c``: with ``m = max_c l_c``,
``w_c = exp(l_c - m)``, ``o = sum_c w_c o_c / sum_c w_c`` and ``l = m + log(sum_c w_c)``. A part
with no visible key contributes ``(0, -inf)`` (weight 0; its ``o`` is never read, so even a
NaN there cannot leak); all parts empty give ``(0, -inf)``; finite LSEs of any size (1e30 or
-1e30) merge without overflow; a NaN LSE or a NaN in a part with weight > 0 makes the row NaN.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.distributed as dist
from torch import Tensor

from ._validation import check_process_group, check_tensor
from . import collectives as _collectives
from .metadata import CPMetadata

__all__ = ["check_same_partials", "merge_partials", "merge_states", "merge_path", "partials_header"]


def merge_states(out_parts: Tensor, lse_parts: Tensor, *, dim: int = 0) -> tuple[Tensor, Tensor]:
    """Merge partial attention results over disjoint key sets (pure, local, exact).

    Args:
        out_parts: [..., C, ...] normalized partial outputs (any float dtype), the C parts
            along ``dim``; e.g. [C, N, H, Dv].
        lse_parts: the matching natural-log LSEs, ``out_parts`` without its last dim
            (e.g. [C, N, H]), any float dtype.
        dim: the parts dimension (of lse_parts; the same index in out_parts).

    Returns:
        (out, lse): out in out_parts' dtype without the parts dim ([N, H, Dv]); lse float32
        (float64 if an input is float64) [N, H]. Math in float32 (float64 for float64 inputs).

    [C, N, H, Dv] parts on a CUDA device (or on the CPU under the Triton interpreter) in
    fp16/bf16/fp32 run as ONE fused Triton launch that reads the parts through their strides
    (no copy; e.g. the typed views of ``merge_partials``' received buffer), with no host sync
    (CUDA-graph capturable); every other case runs the torch reference (see :func:`merge_path`).
    Both have the same semantics.

    Example::

        out, lse = cpattn.merge_states(torch.stack([o0, o1]), torch.stack([l0, l1]))
    """
    check_tensor(out_parts, "out_parts")
    check_tensor(lse_parts, "lse_parts")
    if not out_parts.dtype.is_floating_point or not lse_parts.dtype.is_floating_point:
        raise TypeError(f"out_parts and lse_parts must be floating, got {out_parts.dtype} and {lse_parts.dtype}")
    if out_parts.dim() < 2 or tuple(out_parts.shape[:-1]) != tuple(lse_parts.shape):
        raise ValueError(f"lse_parts must be out_parts without its last dim: out_parts {list(out_parts.shape)}, "
                         f"lse_parts {list(lse_parts.shape)}")
    if out_parts.device != lse_parts.device:
        raise ValueError(f"out_parts is on {out_parts.device} but lse_parts on {lse_parts.device}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__} {dim!r}")
    if not -lse_parts.dim() <= dim < lse_parts.dim():
        raise ValueError(f"dim {dim} out of range for lse_parts of shape {list(lse_parts.shape)}")
    dim %= lse_parts.dim()
    if merge_path(out_parts, lse_parts, dim=dim) == "triton":
        if dim:
            out_parts, lse_parts = out_parts.movedim(dim, 0), lse_parts.movedim(dim, 0)
        return _merge_fused(out_parts, lse_parts)
    return _merge_states_torch(out_parts, lse_parts, dim)


_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MERGE_KERNELS = "cpattn.kernels.triton_decode"


def merge_path(out_parts: Tensor, lse_parts: Tensor, *, dim: int = 0) -> str:
    """Which implementation :func:`merge_states` runs for these (valid) inputs: ``"triton"`` (the
    fused one-launch kernel: [C, N, H, Dv] / [C, N, H] parts, any strides with the last dim of
    ``out_parts`` contiguous, fp16/bf16/fp32, C >= 1, nothing empty, on a CUDA device, or on the
    CPU under the Triton interpreter) or ``"torch"`` (the reference: every other case, float64
    included). O(1) host work, no sync."""
    if (out_parts.dim() != 4 or out_parts.dtype not in _FUSED_DTYPES or lse_parts.dtype not in _FUSED_DTYPES
            or out_parts.numel() == 0 or out_parts.stride(-1) != 1):
        return "torch"
    loaded = sys.modules.get(_MERGE_KERNELS)
    if out_parts.is_cuda and loaded is not None:  # the per-layer case: the kernels are loaded, decide in O(1)
        return "torch" if loaded.INTERPRETED else "triton"
    from .kernels import triton_available, triton_device_reason

    if triton_available() is not None or triton_device_reason(out_parts.device, _MERGE_KERNELS) is not None:
        return "torch"
    return "triton"


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    """The SM count of CUDA device ``index`` (the merge's block sizes depend on it; a pure
    function of the hardware, memoized: the merge runs once per layer)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def _merge_fused(parts: Tensor, part_lse: Tensor) -> tuple[Tensor, Tensor]:
    """The fused kernel over [C, N, H, Dv] / [C, N, H] (one launch)."""
    from .kernels import triton_decode

    c, n, h, dv = parts.shape
    device = parts.device
    out = torch.empty((n, h, dv), dtype=parts.dtype, device=device)
    lse = torch.empty((n, h), dtype=torch.float32, device=device)
    if device.type == "cuda":
        index = device.index
        num_sms = _num_sms(torch.cuda.current_device() if index is None else index)
        if index != torch.cuda.current_device():
            with torch.cuda.device(device):  # parts on a non-current GPU
                triton_decode.merge_parts(parts, part_lse, out, lse, num_sms=num_sms)
        else:
            triton_decode.merge_parts(parts, part_lse, out, lse, num_sms=num_sms)
    else:
        triton_decode.merge_parts(parts, part_lse, out, lse, num_sms=4)
    return out, lse


def _merge_states_torch(out_parts: Tensor, lse_parts: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """The torch reference of :func:`merge_states` (validated inputs, ``dim`` normalized)."""
    work = torch.float64 if torch.float64 in (out_parts.dtype, lse_parts.dtype) else torch.float32
    lse = lse_parts.to(work)
    if lse.shape[dim] == 0:
        shape = list(out_parts.shape)
        del shape[dim]
        return out_parts.new_zeros(shape), torch.full(shape[:-1], float("-inf"), dtype=work, device=lse.device)
    m = lse.amax(dim, keepdim=True)  # NaN propagates
    shift = torch.where(m == float("-inf"), torch.zeros((), dtype=work, device=m.device), m)
    # lse == shift: weight 1 exactly (also +inf == +inf, which inf - inf would turn into NaN)
    w = torch.exp(torch.where(lse == shift, torch.zeros((), dtype=work, device=m.device), lse - shift))
    total = w.sum(dim)
    wo = w.unsqueeze(-1)
    contrib = torch.where(wo == 0, torch.zeros((), dtype=work, device=m.device), wo * out_parts.to(work))
    empty = total == 0
    out = contrib.sum(dim) / torch.where(empty, torch.ones((), dtype=work, device=m.device), total).unsqueeze(-1)
    lse_out = torch.where(empty, torch.full((), float("-inf"), dtype=work, device=m.device),
                          shift.squeeze(dim) + torch.log(total))
    return out.to(out_parts.dtype), lse_out


def _group_size_and_rank(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("merge_partials over a group needs an initialized torch.distributed process group")
    return dist.get_world_size(group), dist.get_rank(group)


#: dtype codes of the partials' header (another dtype: 100 * itemsize + 99)
_HEADER_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn,
                  torch.float8_e5m2)


def _dtype_code(dtype: torch.dtype) -> int:
    return _HEADER_DTYPES.index(dtype) + 1 if dtype in _HEADER_DTYPES else 100 * dtype.itemsize + 99


def _describe(header: list[int]) -> str:
    n, hq, dv, code, scatter = header
    dtype = str(_HEADER_DTYPES[code - 1]).split(".")[-1] if 1 <= code <= len(_HEADER_DTYPES) else f"code {code}"
    return f"out_part [N={n}, Hq={hq}, Dv={dv}] {dtype} scatter_heads={bool(scatter)}"


def partials_header(out_part: Tensor, scatter_heads: bool = False) -> tuple[int, int, int, int, int]:
    """What the ranks of a merge must agree on: (N, Hq, Dv, dtype code, scatter_heads) of
    ``out_part`` [N, Hq, Dv] (host ints; the data collective's size and layout depend on them)."""
    n, hq, dv = out_part.shape
    return n, hq, dv, _dtype_code(out_part.dtype), int(scatter_heads)


def check_same_partials(header: tuple[int, ...], group, size: int) -> bool:
    """Every rank of the group passes partials of one header (:func:`partials_header`: shape,
    dtype, ``scatter_heads``): else the same ValueError on every rank. The data collective's
    size depends on these, and collectives of different sizes abort (gloo) or hang (NCCL)
    before anything can be checked, so a tiny fixed-size all-gather of ``header`` (5 int64 per
    rank, a host sync) runs first. Skipped while a CUDA graph is being captured (the check reads
    its result on the host). Returns whether it checked; keeps no state (callers that merge one
    header many times, e.g. a plan, remember it)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    device = _collectives.group_device(group)
    table = torch.empty(size * len(header), dtype=torch.int64, device=device)
    _collectives.all_gather_into(table, torch.tensor(header, dtype=torch.int64).to(device), group, False)
    rows = table.view(size, len(header)).tolist()
    if any(row != rows[0] for row in rows):
        per_rank = "; ".join(f"rank {r}: {_describe(row)}" for r, row in enumerate(rows))
        raise ValueError("merge_partials: the ranks passed different partials (out_part shape, dtype or "
                         f"scatter_heads differ; nothing was merged): {per_rank}")
    return True


def merge_partials(
    out_part: Tensor, lse_part: Tensor, group=None, *, scatter_heads: bool = False, meta=None,
    return_lse: bool = False, agree: bool = True,
) -> Tensor | tuple[Tensor, Tensor]:
    """Merge every CP rank's partial attention (over its key shard) exactly, in ONE collective.

    Args:
        out_part: [N, Hq, Dv] this rank's normalized partial output (e.g. from
            :meth:`AttentionPlan.attend` of a "shard_merge" plan), any float dtype; the same shape on every rank.
        lse_part: [N, Hq] its natural-log LSE (float32; -inf where the rank holds no visible key).
        group: the CP process group (None: the default group). One rank and no group: no
            collective.
        scatter_heads: False: ONE all-gather of the packed (out, lse) bytes, every rank returns
            all heads [N, Hq, Dv]. True: ONE all-to-all, rank r returns heads
            ``[r Hq / C, (r + 1) Hq / C)`` only, [N, Hq / C, Dv] (for an o_proj sharded by heads);
            Hq must be a multiple of C.
        meta: the plan the partials came from (replicated queries over a sharded ``kv``): given, the
            group must have ``meta.cp_size`` ranks with this process at ``meta.rank``, and N must
            be ``meta.num_physical_tokens`` (so every rank of an agreed plan passes one shape).
        return_lse: also return the merged lse (float32) [N, Hq] (or [N, Hq / C]).
        agree: True: every rank's partials header is checked first (see below). False skips
            that check: the caller guarantees that every rank passes partials of one shape,
            dtype and ``scatter_heads`` (e.g. a plan that checked them on its first merge).

    All checks run before the collective (ValueError / TypeError naming the argument). Ranks
    whose partials differ in shape, dtype or ``scatter_heads`` all raise the same ValueError
    (instead of a collective of mismatched sizes, which aborts or hangs): with ``agree`` (the
    default) a tiny header all-gather (5 int64 per rank, a host sync) checks it before the data
    collective on EVERY call over more than one rank (never inside a CUDA-graph capture). This
    function keeps no state between calls: a "shard_merge" plan's ``run`` checks a header once
    per plan and then passes ``agree=False`` (its later layers run the ONE data collective alone).
    Bytes moved per rank: (C - 1) N Hq (Dv itemsize + 4) received, or 1/C of that with
    scatter_heads.

    Example::

        out_p, lse_p = plan.attend(q, k_cache, v_cache, page_table=pt)   # plan.algorithm == "shard_merge"
        out = cpattn.merge_partials(out_p, lse_p, group, meta=meta)   # [N, Hq, Dv]
    """
    check_tensor(out_part, "out_part")
    check_tensor(lse_part, "lse_part")
    if out_part.dim() != 3 or not out_part.dtype.is_floating_point:
        raise ValueError(f"out_part must be a float [N, Hq, Dv] tensor, got {out_part.dtype} {list(out_part.shape)}")
    if lse_part.dim() != 2 or tuple(lse_part.shape) != tuple(out_part.shape[:2]) or lse_part.dtype != torch.float32:
        raise ValueError(f"lse_part must be float32 [N, Hq] = {list(out_part.shape[:2])} matching out_part, got "
                         f"{lse_part.dtype} {list(lse_part.shape)}")
    if lse_part.device != out_part.device:
        raise ValueError(f"out_part is on {out_part.device} but lse_part on {lse_part.device}")
    if not isinstance(scatter_heads, bool):
        raise TypeError(f"scatter_heads must be a bool, got {type(scatter_heads).__name__}")
    if not isinstance(agree, bool):
        raise TypeError(f"agree must be a bool, got {type(agree).__name__}")
    if meta is not None and not isinstance(meta, CPMetadata):
        raise TypeError(f"meta must be None or a CPMetadata (the plan the partials came from), got "
                        f"{type(meta).__name__} {meta!r}")
    check_process_group(group)
    n, hq, dv = out_part.shape
    if meta is not None and meta.cp_size == 1 and group is None:
        size, rank = 1, 0
    elif group is None and not (dist.is_available() and dist.is_initialized()):
        size, rank = 1, 0
    else:
        size, rank = _group_size_and_rank(group)
    if meta is not None:
        if size != meta.cp_size:
            raise ValueError(f"merge group size {size} != cp_size {meta.cp_size} of the plan")
        if rank != meta.rank:
            raise ValueError(f"the plan was built for rank {meta.rank} but this process is rank {rank} of the group")
    if size > 1 and agree:  # the checks below depend on this rank's shapes: first make sure every rank has the same
        check_same_partials(partials_header(out_part, scatter_heads), group, size)
    if meta is not None and n != meta.num_physical_tokens:
        raise ValueError(f"out_part has {n} rows but the plan has {meta.num_physical_tokens} query rows")
    if scatter_heads and hq % size:
        raise ValueError(f"scatter_heads needs Hq={hq} to be a multiple of the group size {size}")
    if size == 1:
        out, lse = out_part, lse_part
        return (out, lse) if return_lse else out
    hc = hq // size if scatter_heads else hq
    like = [(out_part.dtype, (hc, dv)), (torch.float32, (hc,))]
    if scatter_heads:
        o = out_part.reshape(n, size, hc, dv).transpose(0, 1).reshape(size * n, hc, dv)
        l = lse_part.reshape(n, size, hc).transpose(0, 1).reshape(size * n, hc)
        packed, layout = _collectives.pack_rows([o, l], size * n)
        received = torch.empty_like(packed)
        _collectives.all_to_all_into(received, packed, group)
    else:
        packed, layout = _collectives.pack_rows([out_part, lse_part], n)
        received = torch.empty((size * n, packed.shape[1]), dtype=torch.uint8, device=packed.device)
        _collectives.all_gather_into(received, packed, group, False)  # the one collective (counted in tests)
    outs, lses = _collectives.unpack_rows(received.view(size, n, -1), layout, like)
    out, lse = merge_states(outs, lses)
    return (out, lse.float()) if return_lse else out
