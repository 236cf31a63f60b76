"""CP padding rules (placeholder; the full public module lands with issue 10's padding work)."""

from __future__ import annotations

from typing import Sequence

__all__ = ["physical_rows"]


def physical_rows(logical_counts: Sequence[int], align: int) -> int:
    """Physical rows every rank holds: ``ceil(max(logical_counts) / align) * align`` (0 for none)."""
    most = max((int(c) for c in logical_counts), default=0)
    return -(-most // align) * align
