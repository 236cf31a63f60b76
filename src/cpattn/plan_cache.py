"""The plan cache of the convenience calls (``strategy.attention``, ``strategy.sparse_attention``, ``dsa.index_topk``).

Plans are cached per placement plan, outside it (a placement plan is frozen data), keyed on an
explicit tuple of the layer-kind facts; an entry lives as long as its placement plan.
"""

from __future__ import annotations

import weakref
from typing import Callable, Hashable, TypeVar

__all__ = ["cached_plan"]

P = TypeVar("P")

_PLANS: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def cached_plan(meta: object, key: tuple[Hashable, ...], build: Callable[[], P]) -> P:
    """The plan cached for ``(meta, key)``, or ``build()`` cached there (host, plan time)."""
    plans = _PLANS.get(meta)
    if plans is None:
        plans = _PLANS[meta] = {}
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = build()
    return plan
