"""Plans: everything a layer's attention needs that does not change between layers, bound once
per forward (FlashInfer's plan/run split). One module per plan kind: ``dense`` (causal
attention of local queries), ``sparse`` (DSA: sparse attention over selected keys and the index
top-k), ``static`` (fixed-address placement plans for CUDA graphs); the sharded-KV / decode plans
follow the same pattern beside them.
"""

from .dense import AttentionPlan, check_group_rank, make_spec, plan_attention, window_left
from .sparse import IndexTopkPlan, SparseAttentionPlan, plan_index_topk, plan_sparse_attention
from .static import StaticPlanner
from ..kernels import AttentionSpec

__all__ = ["AttentionPlan", "AttentionSpec", "IndexTopkPlan", "SparseAttentionPlan", "StaticPlanner",
           "check_group_rank", "make_spec", "plan_attention", "plan_index_topk", "plan_sparse_attention",
           "window_left"]
