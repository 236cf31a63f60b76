"""``examples/mini_engine.py --kv sharded``: prefill, a prefix-reusing prefill (pass-KV and
pass-Q over a sharded prefix) and 16 decode steps ("shard_merge": one ``plan.run`` per layer
writes, attends and merges) with a sharded cache on 1-4 gloo ranks.

Greedy tokens equal the replicated engine; each rank's cache holds exactly its positions (the
C = 1 sharded engine's keys at the positions ``(p // I) % C == rank``) and about 1/C of the pages.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import cpattn

from dist_utils import CountCollectives, run_distributed

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)
import _sharded_engine  # noqa: E402
import mini_engine  # noqa: E402

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
STEPS = 16


@pytest.fixture(scope="module")
def replicated() -> dict:
    return mini_engine.run_engine("zigzag", 1, 0, None, CPU, decode_steps=STEPS)


@pytest.fixture(scope="module")
def sharded_c1() -> dict:
    return _sharded_engine.run_sharded_engine("zigzag", 1, 0, None, CPU, STEPS)


def test_c1_sharded_engine_equals_replicated(replicated, sharded_c1):
    assert sharded_c1["tokens"] == replicated["tokens"]
    assert sharded_c1["prefix_hits"] == replicated["prefix_hits"] == {"A": 0, "B": 0, "C": 12, "D": 0}
    assert all(len(t) == STEPS + 1 for t in sharded_c1["tokens"].values())
    for algo in ("pass_kv", "pass_q"):
        res = _sharded_engine.run_sharded_engine("zigzag", 1, 0, None, CPU, STEPS, extend_algorithm=algo)
        assert res["tokens"] == replicated["tokens"] and res["extend_algorithms"] == [algo, algo]


def _worker(rank, world, cases):
    return {case: _sharded_engine.run_sharded_engine(name, world, rank, None, CPU, STEPS, interleave=inter,
                                                     extend_algorithm=algo)
            for case, (name, inter, algo) in cases.items()}


CASES = {
    "zigzag/pass_kv": ("zigzag", 1, "pass_kv"),
    "zigzag/pass_q": ("zigzag", 1, "pass_q"),
    "interleave/I2/pass_q": ("interleave", 2, "pass_q"),
    "contiguous/I4/pass_kv": ("contiguous", 4, "pass_kv"),
}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_engine_over_gloo_equals_replicated(world, replicated, sharded_c1):
    results = run_distributed(_worker, world, CASES)
    full = sharded_c1["local_cache"]  # C = 1: local index == position
    for case, (name, inter, algo) in CASES.items():
        pages = 0
        for rank, per_rank in enumerate(results):
            res = per_rank[case]
            assert res["tokens"] == replicated["tokens"], (case, world, rank)
            assert res["prefix_hits"] == replicated["prefix_hits"], (case, world, rank)
            assert res["extend_algorithms"] == [algo, algo]
            for rid, (k, v) in res["local_cache"].items():
                n = res["cached"][rid]
                mine = [p for p in range(n) if (p // inter) % world == rank]
                assert k.shape[1] == len(mine)
                torch.testing.assert_close(k, full[rid][0][:, mine], atol=1e-4, rtol=0)
                torch.testing.assert_close(v, full[rid][1][:, mine], atol=1e-4, rtol=0)
            pages += res["used_pages"]
        # the C ranks together use about as many pages as one replicated copy (+ partial pages)
        assert pages <= sharded_c1["used_pages"] + world * 4 * 2, (case, pages)


def _decode_collectives_worker(rank, world):
    """All-gathers of each decode step: (1-D: plan agreement / partials header checks, data)."""
    cfg = _sharded_engine.EngineConfig()
    engine = _sharded_engine.ShardedMiniEngine(cfg, cpattn.get_strategy("zigzag", world, pad_multiple=8), rank,
                                               None, CPU)
    batch1, batch2 = _sharded_engine.make_requests(cfg)
    engine.prefill(batch1)
    engine.prefill(batch2)
    steps = []
    for _ in range(4):
        with CountCollectives() as counter:
            engine.decode(batch1 + batch2)
        steps.append((sum(len(c) == 1 for c in counter.calls), sum(len(c) > 1 for c in counter.calls)))
    return steps, cfg.layers


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_engine_decode_collectives_per_step(world):
    """Steady state: a decode step runs the plan agreement and ONE merge per layer; the partials
    header is checked once, by the first decode step's plan (the engine then passes agree=False)."""
    for steps, layers in run_distributed(_decode_collectives_worker, world):
        assert steps == [(2, layers)] + [(1, layers)] * 3, steps


def test_cli_sharded():
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "mini_engine.py"), "--kv", "sharded", "--spawn", "2", "--cpu",
         "--decode-steps", "6", "--extend", "pass_q"],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "equal to the replicated C = 1 engine" in proc.stdout
