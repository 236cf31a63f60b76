"""Host-free helpers that place gathered extend K/V next to cached prefix K/V."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .metadata import CPMetadata

__all__ = ["pack_kv"]


def _prefix_rows(meta: CPMetadata, num_prefix: int, device: torch.device) -> Tensor:
    """Packed K/V row of every prefix token [num_prefix] int64, derived on the device from the
    per-sequence lengths (the plan holds nothing proportional to the prefix)."""
    cu_pre = torch.zeros(meta.num_seqs + 1, dtype=torch.int64, device=device)
    torch.cumsum(meta.prefix_lens, 0, out=cu_pre[1:])
    i = torch.arange(num_prefix, device=device)
    seq = torch.searchsorted(cu_pre, i, right=True) - 1
    return meta.cu_kv_lens[seq] + (i - cu_pre[seq])


def pack_kv(
    k_ext: Tensor,
    v_ext: Tensor,
    meta: CPMetadata,
    k_prefix: Optional[Tensor] = None,
    v_prefix: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """Interleave prefix and extend K/V into the packed layout ``attention`` reads (device-only).

    Args:
        k_ext, v_ext: logical extend K/V [T, Hkv, D] / [T, Hkv, Dv] (e.g. from ``gather_kv``), or
            any [T, ...] per-token tensors (the MLA latent [T, r] and rope key [T, d_rope]).
        meta: the placement plan (not a static plan: those read prefixes through a page table).
        k_prefix, v_prefix: cached prefix rows packed per sequence, [sum(prefix_lens), ...] with
            the same trailing shapes and dtypes as k_ext / v_ext; required when any prefix
            length is > 0.

    Returns:
        [num_kv_tokens, ...] each: prefix_0, extend_0, prefix_1, extend_1, ...
    """
    if meta.is_static:
        raise ValueError("pack_kv needs a plan sized for its batch; static plans read prefixes through a page table")
    num_prefix = meta.num_kv_tokens - meta.num_tokens
    if k_ext.shape[0] != meta.num_tokens or v_ext.shape[0] != meta.num_tokens:
        raise ValueError(f"k_ext/v_ext must have T={meta.num_tokens} rows, got {k_ext.shape[0]} and {v_ext.shape[0]}")
    if num_prefix and (k_prefix is None or v_prefix is None):
        raise ValueError(f"the batch has {num_prefix} prefix tokens: pass k_prefix and v_prefix")
    if num_prefix:
        for name, pre, ext in (("k_prefix", k_prefix, k_ext), ("v_prefix", v_prefix, v_ext)):
            if pre.shape[0] != num_prefix or pre.shape[1:] != ext.shape[1:] or pre.dtype != ext.dtype:
                raise ValueError(
                    f"{name} must be [sum(prefix_lens)={num_prefix}, {', '.join(map(str, ext.shape[1:]))}] "
                    f"{ext.dtype}, got {list(pre.shape)} {pre.dtype}"
                )
    k = k_ext.new_empty((meta.num_kv_tokens, *k_ext.shape[1:]))
    v = v_ext.new_empty((meta.num_kv_tokens, *v_ext.shape[1:]))
    k[meta.kv_extend_index] = k_ext
    v[meta.kv_extend_index] = v_ext
    if num_prefix:
        rows = _prefix_rows(meta, num_prefix, k_ext.device)
        k[rows] = k_prefix
        v[rows] = v_prefix
    return k, v
