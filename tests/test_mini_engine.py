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


# ------------------------------------------------------------------ FP8 (e4m3) KV cache
FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def fp8_reference() -> dict:
    return mini_engine.run_engine("zigzag", 1, 0, None, CPU, kv_dtype=FP8)


def test_fp8_cache_logits_within_bound_of_unquantized_engine(reference, fp8_reference):
    """--kv-dtype fp8 at C = 1: an FP8 cache, and logits within the documented bound of the
    unquantized engine's (and not equal: the cache really is quantized)."""
    # the FP8 caches' bytes (uint8 views): they hold e4m3 values, not the model's
    assert fp8_reference["k_cache"].dtype == torch.uint8 and fp8_reference["v_cache"].dtype == torch.uint8
    assert not torch.equal(fp8_reference["k_cache"].view(FP8).float(), reference["k_cache"])
    err = mini_engine.logit_error(fp8_reference["logits"], reference["logits"])
    assert 0 < err < mini_engine.FP8_LOGIT_BOUND, err
    assert len(fp8_reference["logits"]) == len(reference["logits"]) == 6


def _sharded_fp8_rank(rank, world, device):
    import _sharded_engine

    return _sharded_engine.run_sharded_engine("zigzag", world, rank, None, device, kv_dtype=FP8)


def test_fp8_cache_under_cp_replicated_and_sharded(reference, fp8_reference):
    """C = 2 with an FP8 cache, replicated (gather of FP8 rows) and sharded (pass-KV / pass-Q
    extends, shard_merge decode): the greedy tokens of the FP8 engine at C = 1, logits within the
    bound of the unquantized engine."""
    rep = [r["zigzag"] for r in run_distributed(mini_engine.run_rank, 2, CPU, ("zigzag",), 4, 8, FP8)]
    sharded = run_distributed(_sharded_fp8_rank, 2, CPU)
    for res in rep + sharded:
        assert res["tokens"] == fp8_reference["tokens"]
        assert mini_engine.logit_error(res["logits"], reference["logits"]) < mini_engine.FP8_LOGIT_BOUND
    assert torch.equal(rep[0]["k_cache"], rep[1]["k_cache"]) and torch.equal(rep[0]["v_cache"], rep[1]["v_cache"])


def test_fp8_spawn_cli():
    for kv in ("replicated", "sharded"):
        proc = subprocess.run(
            [sys.executable, os.path.join(EXAMPLES, "mini_engine.py"), "--spawn", "2", "--kv", kv, "--kv-dtype", "fp8",
             "--cpu"], capture_output=True, text=True, timeout=180,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "equal to the" in proc.stdout


def test_fp8_is_refused_for_the_dsa_model(capsys):
    """--kv-dtype selects the GQA engine's cache dtype; with --model dsa it is a usage error
    (exit status 2, naming the option) before any rank starts."""
    with pytest.raises(SystemExit) as exc:
        mini_engine.main(["--model", "dsa", "--kv-dtype", "fp8", "--cpu"])
    assert exc.value.code == 2 and "--kv-dtype" in capsys.readouterr().err
