"""CP strategies: each module decides token placement only; shared machinery is in ``base``."""

from __future__ import annotations

from .base import CPStrategy
from .contiguous import ContiguousStrategy
from .interleave import InterleaveStrategy
from .replicated import ReplicatedStrategy
from .zigzag import ZigzagStrategy

__all__ = ["CPStrategy", "ContiguousStrategy", "InterleaveStrategy", "ReplicatedStrategy", "ZigzagStrategy", "STRATEGIES", "get_strategy"]

STRATEGIES: dict[str, type[CPStrategy]] = {
    cls.name: cls for cls in (ZigzagStrategy, InterleaveStrategy, ContiguousStrategy, ReplicatedStrategy)
}


def get_strategy(name: str, cp_size: int, pad_multiple: int = 1, **options) -> CPStrategy:
    """Build a strategy by name: "zigzag", "interleave", "contiguous" (shard the new tokens
    over the ranks) or "replicated" (every rank computes every query) (``options``: e.g.
    ``rotate=False`` for zigzag / contiguous)."""
    if name not in STRATEGIES:
        raise ValueError(f"strategy name must be one of {sorted(STRATEGIES)}, got {name!r}")
    return STRATEGIES[name](cp_size, pad_multiple=pad_multiple, **options)
