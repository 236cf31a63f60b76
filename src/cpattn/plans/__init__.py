"""Plans: everything a layer's attention needs that does not change between layers, bound once
per forward (FlashInfer's plan/run split). One module per plan kind: ``dense`` (causal
attention of local queries), ``shard`` (attention over one rank's key shard of a sharded KV
cache: decode context parallelism), ``sharded_extend`` (an extend over a sharded prefix:
pass-KV or pass-Q), ``static`` (fixed-address placement plans for CUDA graphs); the sparse
(DSA) plans follow the same pattern beside them.
"""

from .dense import AttentionPlan, check_group_rank, make_spec, plan_attention, window_left
from .shard import ShardAttentionPlan, plan_shard_attention, shard_attention
from .static import StaticPlanner
from ..kernels import AttentionSpec

__all__ = ["AttentionPlan", "AttentionSpec", "ShardAttentionPlan", "StaticPlanner", "check_group_rank", "make_spec",
           "plan_attention", "plan_shard_attention", "shard_attention", "window_left"]
