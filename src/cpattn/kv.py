"""Host-free helpers that place gathered extend K/V next to cached prefix K/V."""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from .metadata import CPMetadata

__all__ = ["pack_kv"]


def pack_kv(
    k_ext: Tensor,
    v_ext: Tensor,
    meta: CPMetadata,
    k_prefix: Optional[Tensor] = None,
    v_prefix: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """Interleave prefix and extend K/V into the packed layout ``strategy.attention`` reads.

    Args:
        k_ext, v_ext: logical extend K/V [T, Hkv, D] / [T, Hkv, Dv] (e.g. from ``gather_kv``).
        k_prefix, v_prefix: cached prefix K/V packed per sequence [sum(prefix_lens), Hkv, ...];
            required when any prefix length is > 0.

    Returns:
        [num_kv_tokens, Hkv, D] and [num_kv_tokens, Hkv, Dv]: prefix_0, extend_0, prefix_1, ...
    """
    num_prefix = meta.num_kv_tokens - meta.num_tokens
    if k_ext.shape[0] != meta.num_tokens or v_ext.shape[0] != meta.num_tokens:
        raise ValueError(f"k_ext/v_ext must have T={meta.num_tokens} rows, got {k_ext.shape[0]} and {v_ext.shape[0]}")
    if num_prefix and (k_prefix is None or v_prefix is None):
        raise ValueError(f"the batch has {num_prefix} prefix tokens: pass k_prefix and v_prefix")
    k = k_ext.new_empty((meta.num_kv_tokens, *k_ext.shape[1:]))
    v = v_ext.new_empty((meta.num_kv_tokens, *v_ext.shape[1:]))
    k[meta.kv_extend_index] = k_ext
    v[meta.kv_extend_index] = v_ext
    if num_prefix:
        if k_prefix.shape[0] != num_prefix or v_prefix.shape[0] != num_prefix:
            raise ValueError(
                f"k_prefix/v_prefix must have sum(prefix_lens)={num_prefix} rows, "
                f"got {k_prefix.shape[0]} and {v_prefix.shape[0]}"
            )
        k[meta.kv_prefix_index] = k_prefix
        v[meta.kv_prefix_index] = v_prefix
    return k, v
