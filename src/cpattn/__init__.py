"""cpattn: context-parallel attention for LLM inference prefill.

Plan a batch's placement over C ranks once per forward (``build_metadata``), shard at the model's
input boundary, all-gather K/V in each attention layer, run attention for the local queries, and
gather hidden states back before the logits::

    s = cpattn.ZigzagStrategy(cp_size)
    meta = s.build_metadata(extend_lens, prefix_lens, rank=rank).to(device)
    h = s.shard(hidden, meta)                                 # [P, hidden]
    k_ext, v_ext = s.gather_kv(k_local, v_local, meta, group)  # per layer, one collective
    o = s.attention(q_local, k, v, meta)                       # [P, Hq, Dv]
    h_full = s.gather(h, meta, group)                          # [T, hidden]
"""

from .cache import kv_bytes_per_token, mla_bytes_per_token, read_mla_cache, write_kv_cache, write_mla_cache
from .collectives import PendingGather, gathered_bytes_per_token
from .kernels import AttentionCall, available_backends, resolve_backend as _resolve_call
from .kv import pack_kv
from .metadata import CPMetadata
from .overlap import GatherHandle, start_gather_kv, start_gather_mla_latent
from .strategies import (
    STRATEGIES,
    ContiguousStrategy,
    CPStrategy,
    InterleaveStrategy,
    ZigzagStrategy,
    get_strategy,
)

__version__ = "0.1.0"

__all__ = [
    "AttentionCall",
    "CPMetadata",
    "CPStrategy",
    "ContiguousStrategy",
    "GatherHandle",
    "InterleaveStrategy",
    "PendingGather",
    "STRATEGIES",
    "ZigzagStrategy",
    "available_backends",
    "gathered_bytes_per_token",
    "get_strategy",
    "kv_bytes_per_token",
    "mla_bytes_per_token",
    "pack_kv",
    "read_mla_cache",
    "resolve_backend",
    "start_gather_kv",
    "start_gather_mla_latent",
    "write_kv_cache",
    "write_mla_cache",
]


def resolve_backend(
    strategy: CPStrategy,
    q_local,
    k,
    v,
    meta: CPMetadata,
    *,
    page_table=None,
    softmax_scale=None,
    window_size=(-1, -1),
    sinks=None,
    backend: str = "auto",
    return_lse: bool = False,
) -> str:
    """Name of the backend ``strategy.attention`` would run for the same arguments.

    Validates exactly like ``attention`` and raises NotImplementedError when a named backend
    cannot run the call. ``backend="auto"`` prefers fa4, then triton, then torch.
    """
    call = strategy._attention_call(
        q_local, k, v, meta, page_table, softmax_scale, window_size, sinks, return_lse
    )
    return _resolve_call(call, backend).name
