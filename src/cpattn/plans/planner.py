"""``plan_attention``: one entry point from (placement plan, layer kind) to the attention plan.

The algorithm follows from where the queries are computed (``meta.strategy``) and where the KV
cache lives (``meta.kv``):

| queries \\ KV cache | replicated (``kv=None``) | sharded (``kv=KVSharding(C)``) |
| --- | --- | --- |
| sharded (zigzag, interleave, contiguous) | "gather_kv" ("local" at C = 1) | "pass_kv" or "pass_q" (cost model) |
| replicated | "local" (no collective) | "shard_merge" |

A spec with ``topk`` (DSA sparse attention) runs over a replicated cache ("local" /
"gather_kv") and, with replicated queries, over a sharded cache ("shard_merge": the selected keys
each rank owns, merged; the selection comes from :func:`cpattn.plans.plan_index_topk` over the
same placement plan).
"""

from __future__ import annotations

from typing import Mapping, Optional

from torch import Tensor

from .._validation import check_int
from ..kernels import select_backend
from ..cost import CostModel, choose_extend_algorithm
from ..metadata import CPMetadata
from ..spec import AttentionSpec
from .base import ALGORITHMS, AttentionPlan, check_group_rank
from .dense import ReplicatedKVPlan
from .shard import ShardMergePlan, SparseShardMergePlan, local_key_view
from .sharded_extend import build_sharded_extend, replicated_view

__all__ = ["algorithms_for", "plan_attention"]


def algorithms_for(meta: CPMetadata, spec: AttentionSpec) -> tuple[str, ...]:
    """The algorithms that can run ``spec`` over ``meta`` (the first is ``auto``'s choice
    unless a cost model decides between two)."""
    if meta.kv is None:
        return ("local",) if meta.replicated or meta.cp_size == 1 else ("gather_kv",)
    if spec.sparse:
        return ("shard_merge",) if meta.replicated else ()
    return ("shard_merge",) if meta.replicated else ("pass_kv", "pass_q")


def plan_attention(
    meta: CPMetadata,
    spec: AttentionSpec,
    *,
    backend: str = "auto",
    algorithm: str = "auto",
    backend_options: Optional[Mapping] = None,
    page_table: Optional[Tensor] = None,
    num_pages: Optional[int] = None,
    pad_slot: Optional[int] = None,
    cost_model: Optional[CostModel] = None,
) -> AttentionPlan:
    """Plan one layer kind's attention over ``meta`` (host, once per forward; may copy once).

    Args:
        meta: the placement plan, on the device the layers run on.
        spec: the :class:`cpattn.AttentionSpec` of the layer kind.
        backend: "auto" (the first of the algorithm's backends that can run it: fa4, triton,
            torch for dense attention; triton, torch otherwise), or a name (NotImplementedError
            naming the reason when it cannot run it).
        algorithm: "auto" or one of "local", "gather_kv", "pass_kv", "pass_q", "shard_merge"
            (ValueError when the (placement, KV layout) pair cannot run it: see the module table).
        backend_options: backend knobs (``cpattn.kernels.triton_backend``, ``decode_backend``).
        page_table, num_pages: this rank's page table [B, max_pages] and page count, for an
            extend over a sharded cache ("pass_kv" / "pass_q": they plan its cache writes and
            prefix reads; read once here).
        pad_slot: a reserved slot of this rank's cache where a static plan's padding rows write
            ("pass_kv" / "pass_q" over a :class:`cpattn.StaticPlanner` plan, which also names its
            algorithm: a captured graph replays one).
        cost_model: a :class:`cpattn.CostModel` choosing pass-KV or pass-Q ("auto").

    Returns:
        an :class:`cpattn.AttentionPlan`; ``plan.algorithm``, ``plan.backend``, ``plan.family``
        say what runs. Per layer: ``plan.run(q, k, v, cache, writes=, group=, ...)`` or the
        kernel alone, ``plan.attend(...)``.

    Example::

        spec = cpattn.AttentionSpec(num_q_heads=32, num_kv_heads=8, head_dim=128,
                                    dtype=torch.bfloat16, page_size=64)
        plan = cpattn.plan_attention(meta, spec)
        writes = cpattn.plan_cache_writes(meta, out_cache_loc, num_slots=num_pages * 64)
        for layer in layers:
            o = plan.run(q, k, v, (k_cache[layer], v_cache[layer]), writes=writes, group=g,
                         page_table=pt)
    """
    if not isinstance(meta, CPMetadata):
        raise TypeError(f"meta must be a CPMetadata, got {type(meta).__name__}")
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"spec must be a cpattn.AttentionSpec, got {type(spec).__name__}")
    if not isinstance(algorithm, str) or algorithm not in ("auto", *ALGORITHMS):
        raise ValueError(f"algorithm must be 'auto' or one of {list(ALGORITHMS)}, got {algorithm!r}")
    options = dict(backend_options or {})
    allowed = algorithms_for(meta, spec)
    if not allowed:
        raise NotImplementedError("sparse (topk) attention over a sharded KV cache runs replicated queries (a decode "
                                  "step); an extend over a sharded cache is not supported")
    if algorithm != "auto" and algorithm not in allowed:
        raise ValueError(f"algorithm {algorithm!r} cannot run strategy={meta.strategy!r} with "
                         f"kv={'sharded' if meta.kv is not None else 'replicated'} (C={meta.cp_size}): "
                         f"it runs {list(allowed)}")
    check_group_rank(meta)
    if meta.kv is not None and spec.paged:
        meta.kv.check_page_size(spec.page_size)
    if allowed == ("pass_kv", "pass_q"):
        return _plan_sharded_extend(meta, spec, backend, algorithm, options, page_table, num_pages, pad_slot,
                                    cost_model)
    if page_table is not None or num_pages is not None or pad_slot is not None:
        raise ValueError(f"page_table= / num_pages= are for an extend over a sharded cache (pad_slot= too); "
                         f"algorithm {allowed[0]!r} reads the page table per layer")
    if allowed == ("shard_merge",) and spec.sparse:
        view = local_key_view(meta)
        chosen = select_backend(spec, view, backend, kind="sparse")
        return SparseShardMergePlan(meta, spec, chosen.name, chosen.plan(spec, view, options), view)
    if allowed == ("shard_merge",):
        chosen = select_backend(spec, meta, backend, kind="shard")
        return ShardMergePlan(meta, spec, chosen.name, chosen.plan(spec, meta, options))
    chosen = select_backend(spec, meta, backend, kind="sparse" if spec.sparse else "dense")
    return ReplicatedKVPlan(meta, spec, chosen.name, chosen.plan(spec, meta, options), allowed[0])


def _plan_sharded_extend(meta, spec, backend, algorithm, options, page_table, num_pages, pad_slot, cost_model):
    if meta.is_static and algorithm == "auto":
        raise ValueError("a static plan of an extend over a sharded cache replays one algorithm: pass "
                         "algorithm='pass_kv' or 'pass_q' (the cost model's choice may differ between batches)")
    if not spec.paged:
        raise ValueError("an extend over a sharded cache needs a paged spec (page_size=)")
    if page_table is None or num_pages is None:
        raise ValueError("an extend over a sharded cache (pass_kv / pass_q) needs page_table= and num_pages= "
                         "(this rank's pages)")
    check_int(num_pages, "num_pages", 1)
    model = cost_model or CostModel()
    if not isinstance(model, CostModel):
        raise TypeError(f"cost_model must be a cpattn.CostModel, got {type(model).__name__}")
    dims = dict(num_q_heads=spec.num_q_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                head_dim_v=spec.head_dim_v, dtype=spec.dtype, kv_dtype=spec.kv_dtype, kv_row_bytes=spec.kv_row_bytes)
    estimate = model.estimate(meta, **dims)
    if algorithm == "auto":
        algorithm = choose_extend_algorithm(meta, cost_model=model, **dims)
    if algorithm == "pass_kv":  # the dense kernel over the gathered prefix + extend, packed
        inner_spec = spec.replace(page_size=None)
        chosen = select_backend(inner_spec, meta, backend)
        inner = ReplicatedKVPlan(meta, inner_spec, chosen.name, chosen.plan(inner_spec, meta, options), "gather_kv")
    else:  # the shard kernel for every new query over this rank's keys
        view = replicated_view(meta)
        chosen = select_backend(spec, view, backend, kind="shard")
        inner = ShardMergePlan(view, spec, chosen.name, chosen.plan(spec, view, options))
    return build_sharded_extend(meta, spec, algorithm, estimate, page_table, num_pages, inner, pad_slot)
