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

A sharded KV cache (each rank stores 1/C of the keys: ``KVSharding``) adds decode context
parallelism (``shard_attention`` + ``merge_partials``, one collective) and extends over a sharded
prefix (``plan_sharded_extend``: pass-KV or pass-Q); see docs/sharded-kv.md.
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
from .kv_sharding import (
    DecodeCapacity,
    DecodeMetadata,
    ExtendCostModel,
    KVSharding,
    ShardWritePlan,
    StaticDecodePlanner,
    choose_extend_algorithm,
    plan_shard_writes,
    write_sharded_cache,
    write_sharded_kv,
)
from .merge import merge_partials, merge_states
from .metadata import Capacity, CPMetadata
from .overlap import GatherHandle, start_gather_kv, start_gather_mla_latent
from .plans import (
    AttentionPlan,
    IndexTopkPlan,
    ShardAttentionPlan,
    SparseAttentionPlan,
    StaticPlanner,
    plan_attention,
    plan_index_topk,
    plan_shard_attention,
    plan_sparse_attention,
    shard_attention,
)
from .plans.sharded_extend import ShardedExtendPlan, plan_sharded_extend
from .strategies import (
    STRATEGIES,
    ContiguousStrategy,
    CPStrategy,
    InterleaveStrategy,
    ZigzagStrategy,
    get_strategy,
)

__version__ = "0.3.15"

__all__ = [
    "AttentionPlan",
    "AttentionSpec",
    "CPMetadata",
    "CPStrategy",
    "Capacity",
    "ContiguousStrategy",
    "DecodeCapacity",
    "DecodeMetadata",
    "ExtendCostModel",
    "GatherHandle",
    "IndexTopkPlan",
    "InterleaveStrategy",
    "KVSharding",
    "PendingGather",
    "PlanDisagreement",
    "STRATEGIES",
    "SlotPlan",
    "ShardAttentionPlan",
    "ShardWritePlan",
    "ShardedExtendPlan",
    "StaticDecodePlanner",
    "StaticPlanner",
    "ZigzagStrategy",
    "available_backends",
    "choose_extend_algorithm",
    "SparseAttentionPlan",
    "StaticPlanner",
    "ZigzagStrategy",
    "available_backends",
    "dsa",
    "gathered_bytes_per_token",
    "get_strategy",
    "kv_bytes_per_token",
    "merge_partials",
    "merge_states",
    "mla_bytes_per_token",
    "pack_kv",
    "padding",
    "plan_attention",
    "plan_index_topk",
    "plan_slots",
    "plan_shard_attention",
    "plan_shard_writes",
    "plan_sharded_extend",
    "plan_sparse_attention",
    "read_mla_cache",
    "resolve_backend",
    "shard_attention",
    "start_gather_kv",
    "start_gather_mla_latent",
    "write_kv_cache",
    "write_mla_cache",
    "write_sharded_cache",
    "write_sharded_kv",
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
