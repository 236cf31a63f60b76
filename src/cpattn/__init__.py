"""cpattn: context-parallel attention for LLM inference (prefill, extend and decode).

Every forward is two choices: where the queries are computed (the strategy: "zigzag",
"interleave", "contiguous" shard the new tokens over the C ranks; "replicated" gives every rank
all of them) and where the KV cache lives (replicated, or sharded by ``KVSharding``)::

    s = cpattn.get_strategy("zigzag", C)
    meta = s.build_metadata(extend_lens, prefix_lens, rank=rank, group=group).to(device)
    spec = cpattn.AttentionSpec(num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                                page_size=64)
    plan = cpattn.plan_attention(meta, spec)                   # plan.algorithm == "gather_kv"
    writes = cpattn.plan_cache_writes(meta, out_cache_loc, num_slots=num_pages * 64)
    h = s.shard(hidden, meta)                                  # [P, hidden]
    o = plan.run(q, k, v, (k_cache, v_cache), writes=writes, group=group, page_table=pt)  # per layer
    h_full = s.gather(h, meta, group)                          # [T, hidden]

A decode step over a sharded cache is the same code with
``get_strategy("replicated", C).build_metadata(q_lens, seq_lens - q_lens, rank=, kv=KVSharding(C))``
(``plan.algorithm == "shard_merge"``); see docs/design.md.
"""

from . import dsa, padding, quant
from .cache import (
    CacheWritePlan,
    kv_bytes_per_token,
    mla_bytes_per_token,
    plan_cache_writes,
    read_mla_cache,
    write_kv_cache,
    write_mla_cache,
)
from .collectives import PendingGather, PlanDisagreement, gathered_bytes_per_token
from .kernels import KernelFamilyWarning, available_backends
from .kv import pack_kv
from .cost import CostModel, PlacementChoice, choose_extend_algorithm, choose_placement
from .kv_sharding import KVSharding
from .merge import merge_partials, merge_states
from .metadata import Capacity, CPMetadata
from .overlap import GatherHandle, start_gather_kv, start_gather_mla_latent
from .plans import ALGORITHMS, AttentionPlan, IndexTopkPlan, StaticPlanner, plan_attention, plan_index_topk
from .spec import AttentionSpec
from .strategies import (
    STRATEGIES,
    ContiguousStrategy,
    CPStrategy,
    InterleaveStrategy,
    ReplicatedStrategy,
    ZigzagStrategy,
    get_strategy,
)

__version__ = "0.4.0"

__all__ = [
    "ALGORITHMS",
    "AttentionPlan",
    "AttentionSpec",
    "CPMetadata",
    "CPStrategy",
    "CacheWritePlan",
    "Capacity",
    "ContiguousStrategy",
    "CostModel",
    "GatherHandle",
    "IndexTopkPlan",
    "InterleaveStrategy",
    "KVSharding",
    "KernelFamilyWarning",
    "PendingGather",
    "PlacementChoice",
    "PlanDisagreement",
    "ReplicatedStrategy",
    "STRATEGIES",
    "StaticPlanner",
    "ZigzagStrategy",
    "available_backends",
    "choose_extend_algorithm",
    "choose_placement",
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
    "plan_cache_writes",
    "plan_index_topk",
    "quant",
    "read_mla_cache",
    "start_gather_kv",
    "start_gather_mla_latent",
    "write_kv_cache",
    "write_mla_cache",
]
