"""Attention plans: everything a layer's attention needs that does not change between layers,
bound once per forward (FlashInfer's plan/run split). :func:`plan_attention` picks the
algorithm from the placement plan's (queries, KV layout) pair; one module per algorithm:
``dense`` ("local", "gather_kv"), ``sparse`` (DSA; and the index top-k plan), ``shard``
("shard_merge"), ``sharded_extend`` ("pass_kv", "pass_q"); ``base`` holds what they share;
``static`` writes placement plans into fixed buffers for CUDA graphs.
"""

from .base import ALGORITHMS, AttentionPlan
from .planner import algorithms_for, plan_attention
from .sparse import IndexTopkPlan, plan_index_topk
from .static import StaticPlanner

__all__ = ["ALGORITHMS", "AttentionPlan", "IndexTopkPlan", "StaticPlanner", "algorithms_for", "plan_attention",
           "plan_index_topk"]
