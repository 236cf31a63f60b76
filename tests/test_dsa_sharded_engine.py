"""``examples/mini_engine.py --model dsa``: a DSA model (MLA latent + rope key + index keys) whose
cache is sharded over 2 and 3 gloo ranks: prefill under interleave / zigzag keeps each rank's
positions, decode steps agree on the exact global top-k and merge the partials. Greedy tokens
equal the C = 1 engine; each rank holds exactly its positions."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from dist_utils import run_distributed

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)
import _dsa_engine  # noqa: E402

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
STEPS = 6
CASES = {"interleave/I1": ("interleave", 1, False), "zigzag/I2": ("zigzag", 2, False),
         "interleave/I1/fp8": ("interleave", 1, True)}


def _worker(rank, world):
    return {case: _dsa_engine.run_dsa_engine(name, world, rank, None, CPU, STEPS, inter, fp8)
            for case, (name, inter, fp8) in CASES.items()}


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_dsa_engine_equals_c1(world):
    results = run_distributed(_worker, world)
    for case, (name, inter, fp8) in CASES.items():
        want = _dsa_engine.run_dsa_engine(name, 1, 0, None, CPU, STEPS, inter, fp8)
        assert all(len(t) == STEPS + 1 for t in want["tokens"])
        for rank, per_rank in enumerate(results):
            res = per_rank[case]
            assert res["tokens"] == want["tokens"], (case, world, rank)
            for rid, n in enumerate(res["lengths"]):
                # the cache holds the positions before the last step's token, owned by this rank
                assert res["local_rows"][rid] == sum((p // inter) % world == rank for p in range(n)), (case, rank)


def test_cli_dsa():
    import subprocess

    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "mini_engine.py"), "--model", "dsa", "--spawn", "2", "--cpu",
         "--strategy", "zigzag", "--decode-steps", "3"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "equal to the C = 1 engine" in proc.stdout
