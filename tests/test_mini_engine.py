"""examples/mini_engine.py: CP prefill into a paged cache, prefix reuse, decode with replicated
queries (the "replicated" strategy over the replicated cache: no collective), one ``plan.run``
per layer.

Greedy tokens at C = 2 and C = 3 (every strategy) must equal the C = 1 engine; every rank must end
with the same (replicated) cache.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dist_utils import run_distributed

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)
import mini_engine  # noqa: E402

pytestmark = pytest.mark.slow

STRATEGIES = ("zigzag", "interleave", "contiguous")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def reference() -> dict:
    return mini_engine.run_engine("zigzag", 1, 0, None, CPU)


def test_single_rank_scenario(reference):
    # The second batch's first request reuses 12 prompt tokens (3 full pages) of the first batch.
    assert reference["prefix_hits"] == {"A": 0, "B": 0, "C": 12, "D": 0}
    assert reference["shared_pages"]
    assert all(len(t) == 5 for t in reference["tokens"].values())  # prefill token + 4 decode steps
    assert len({tuple(t) for t in reference["tokens"].values()}) == 4


@pytest.mark.parametrize("world", [2, 3])
def test_cp_greedy_tokens_equal_single_rank(world, reference):
    results = run_distributed(mini_engine.run_rank, world, CPU, STRATEGIES)
    for name in STRATEGIES:
        per_rank = [res[name] for res in results]
        for rank, res in enumerate(per_rank):
            assert res["tokens"] == reference["tokens"], (name, world, rank)
            assert res["prefix_hits"] == reference["prefix_hits"]
            assert res["shared_pages"]
            # Replicated: bit-identical caches on every rank, and equal to the C = 1 cache.
            assert torch.equal(res["k_cache"], per_rank[0]["k_cache"])
            assert torch.equal(res["v_cache"], per_rank[0]["v_cache"])
            torch.testing.assert_close(res["k_cache"], reference["k_cache"], atol=2e-5, rtol=0)
            torch.testing.assert_close(res["v_cache"], reference["v_cache"], atol=2e-5, rtol=0)


def test_spawn_cli():
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "mini_engine.py"), "--spawn", "2", "--strategy", "zigzag", "--cpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "equal to the C = 1 engine" in proc.stdout
