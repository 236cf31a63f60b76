"""Plans: everything a layer's attention needs that does not change between layers, bound once
per forward (FlashInfer's plan/run split). One module per plan kind: ``dense`` (causal
attention of local queries), ``static`` (fixed-address placement plans for CUDA graphs); the
sparse (DSA) and sharded-KV / decode plans follow the same pattern beside them.
"""

from .dense import AttentionPlan, check_group_rank, make_spec, plan_attention, window_left
from .static import StaticPlanner
from ..kernels import AttentionSpec

__all__ = ["AttentionPlan", "AttentionSpec", "StaticPlanner", "check_group_rank", "make_spec", "plan_attention",
           "window_left"]
