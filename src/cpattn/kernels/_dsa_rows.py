"""Per-row facts of a placement plan that the DSA kernels (index top-k, sparse attention) read:
for every physical row its sequence, position (-1 on pad rows) and the packed K/V row of its
sequence's first key. Built on the host from the plan's host copy (O(P)), uploaded once per plan
(into the static arena for static plans, so the addresses stay fixed) and cached on the plan."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _buffers
from ..plan_cache import cached_plan
from ..metadata import CPMetadata

__all__ = ["host_rows", "device_rows"]


def host_rows(meta: CPMetadata) -> dict[str, Tensor]:
    """CPU tensors over the P physical rows: ``row_seq`` int32 (pad rows 0), ``row_pos`` int32
    (pad rows -1), ``row_kv_start`` int64 (``cu_kv_lens[seq]``; pad rows 0)."""
    host = meta.host if meta.host is not None else meta
    p, n = meta.num_physical_tokens, meta.num_local_tokens
    seq = torch.zeros(p, dtype=torch.int32)
    pos = torch.full((p,), -1, dtype=torch.int32)
    start = torch.zeros(p, dtype=torch.int64)
    local_seq = host.local_seq_ids[:n].long()
    seq[:n] = local_seq.to(torch.int32)
    pos[:n] = host.local_positions[:n].to(torch.int32)
    start[:n] = host.cu_kv_lens[local_seq]
    return {"row_seq": seq, "row_pos": pos, "row_kv_start": start}


def device_rows(meta: CPMetadata) -> dict[str, Tensor]:
    """:func:`host_rows` on ``meta.device``, uploaded once per plan (ONE copy) and cached in
    the plan cache of ``meta``; static plans write them into fixed arena buffers."""
    key = ("dsa-rows", meta.num_physical_tokens)
    return cached_plan(meta, key, lambda: _buffers.upload(meta, key, host_rows(meta)))
