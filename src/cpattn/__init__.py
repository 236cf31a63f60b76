"""cpattn: context-parallel attention for LLM inference prefill.

Plan a batch's placement over C ranks once per forward (``build_metadata``), shard at the model's
input boundary, all-gather K/V in each attention layer, run attention for the local queries, and
gather hidden states back before the logits::

    s = cpattn.ZigzagStrategy(cp_size)
    meta = s.build_metadata(extend_lens, prefix_lens, rank=rank, group=group).to(device)
    plan = s.plan_attention(meta, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    h = s.shard(hidden, meta)                                 # [P, hidden]
    k_ext, v_ext = s.gather_kv(k_local, v_local, meta, group)  # per layer, one collective
    o = plan.run(q_local, k, v)                                # [P, Hq, Dv]
    h_full = s.gather(h, meta, group)                          # [T, hidden]
"""

from . import dsa, padding
from .cache import (
    SlotPlan,
    kv_bytes_per_token,
    mla_bytes_per_token,
    plan_slots,
    read_mla_cache,
    write_kv_cache,
    write_mla_cache,
)
from .collectives import PendingGather, PlanDisagreement, gathered_bytes_per_token
from .kernels import AttentionSpec, available_backends
from .kv import pack_kv
from .metadata import Capacity, CPMetadata
from .overlap import GatherHandle, start_gather_kv, start_gather_mla_latent
from .plans import AttentionPlan, IndexTopkPlan, SparseAttentionPlan, StaticPlanner, plan_attention, plan_index_topk, \
    plan_sparse_attention
from .strategies import (
    STRATEGIES,
    ContiguousStrategy,
    CPStrategy,
    InterleaveStrategy,
    ZigzagStrategy,
    get_strategy,
)

__version__ = "0.2.0"

__all__ = [
    "AttentionPlan",
    "AttentionSpec",
    "CPMetadata",
    "CPStrategy",
    "Capacity",
    "ContiguousStrategy",
    "GatherHandle",
    "IndexTopkPlan",
    "InterleaveStrategy",
    "PendingGather",
    "PlanDisagreement",
    "STRATEGIES",
    "SlotPlan",
    "SparseAttentionPlan",
    "StaticPlanner",
    "ZigzagStrategy",
    "available_backends",
    "dsa",
    "gathered_bytes_per_token",
    "get_strategy",
    "kv_bytes_per_token",
    "mla_bytes_per_token",
    "pack_kv",
    "padding",
    "plan_attention",
    "plan_index_topk",
    "plan_slots",
    "plan_sparse_attention",
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
    """Name of the backend ``strategy.attention(q_local, k, v, meta, ...)`` runs for the same
    arguments (the first argument is the strategy). Plans (and caches the plan on ``meta``)
    exactly like ``attention``; NotImplementedError when a named backend cannot run the call.
    ``backend="auto"`` prefers fa4, then triton, then torch. (``softmax_scale`` and
    ``return_lse`` do not change the choice; they are accepted so the call mirrors ``attention``.)"""
    return strategy._cached_plan(q_local, k, v, meta, page_table, window_size, sinks, backend).backend
