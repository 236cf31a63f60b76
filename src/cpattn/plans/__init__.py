"""Plans: everything a layer's attention needs that does not change between layers, bound once
per forward (FlashInfer's plan/run split). One module per plan kind: ``dense`` (causal
attention of local queries), ``sparse`` (DSA: sparse attention over selected keys and the index
top-k), ``shard`` (attention over one rank's key shard of a sharded KV cache: decode context
parallelism), ``sharded_extend`` (an extend over a sharded prefix: pass-KV or pass-Q),
``static`` (fixed-address placement plans for CUDA graphs).
"""

from .dense import AttentionPlan, check_group_rank, make_spec, plan_attention, window_left
from .shard import ShardAttentionPlan, plan_shard_attention, shard_attention
from .sparse import IndexTopkPlan, SparseAttentionPlan, plan_index_topk, plan_sparse_attention
from .static import StaticPlanner
from ..kernels import AttentionSpec

__all__ = ["AttentionPlan", "AttentionSpec", "IndexTopkPlan", "ShardAttentionPlan", "SparseAttentionPlan",
           "StaticPlanner", "check_group_rank", "make_spec", "plan_attention", "plan_index_topk",
           "plan_shard_attention", "plan_sparse_attention", "shard_attention", "window_left"]
