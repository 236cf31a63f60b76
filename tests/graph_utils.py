"""CUDA-graph capture for the GPU tests: warm a step up on a side stream, then capture it."""

from __future__ import annotations

from typing import Callable

import torch


def capture_graph(step: Callable[[], object], warmup: int = 2) -> torch.cuda.CUDAGraph:
    """Run ``step`` ``warmup`` times on a side stream (compiles, first-call set-up), then capture
    one call of it into a CUDA graph and return the graph (not yet replayed)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph
