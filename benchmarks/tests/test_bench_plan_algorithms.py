"""``python benchmarks/run.py plan_algorithms --tiny``: every algorithm of ``cpattn.ALGORITHMS``
runs through ``plan.run`` on 2 gloo ranks; the JSON has one row per algorithm with positive
timings and the collectives counted per call (the same on every rank)."""

from __future__ import annotations

import json
import os

import torch

import cpattn
from benchmarks.plan_algorithms import ALGORITHM_ORDER, owned_positions, paged_cache
from benchmarks.run import main

#: torch.distributed collectives per steady-state call (the counter counts a nested collective once).
EXPECTED = {
    "local": {},
    "gather_kv": {"all_gather_single": 1},
    "pass_kv": {"all_gather_single": 1},
    "pass_q": {"all_gather_single": 1, "all_to_all_single": 1},
    "shard_merge": {"all_gather_single": 1},
}


def test_every_algorithm_is_benchmarked():
    assert set(ALGORITHM_ORDER) == set(cpattn.ALGORITHMS)


def test_plan_algorithms_tiny(tmp_path, capsys):
    out, dump = os.path.join(tmp_path, "plan-algorithms"), os.path.join(tmp_path, "dump")
    assert main(["plan_algorithms", "--tiny", "--cp", "2", "--calls", "3", "--rounds", "2", "--warmup", "1",
                 "--out", out, "--dump", dump]) == 0
    payload = json.load(open(out + ".json"))
    assert payload["cp"] == 2 and payload["backend"] == "torch" and payload["cpattn"] == cpattn.__version__
    rows = {r["algorithm"]: r for r in payload["rows"]}
    assert list(rows) == list(ALGORITHM_ORDER)
    for name, r in rows.items():
        assert 0 < r["us_p10"] <= r["us_median"] <= r["us_p90"], (name, r)
        assert len(r["round_medians"]) == 2
        assert r["collectives"] == EXPECTED[name], (name, r["collectives"])
        assert r["collectives_per_call"] == sum(EXPECTED[name].values())
        assert r["same_counts_on_every_rank"] is True
    # the first shard_merge call also checks the partials header over the group (one tiny all-gather)
    assert rows["shard_merge"]["first_call_collectives"] == {"all_gather_single": 2}
    # --dump: each rank's output and caches after one call, every algorithm, finite
    for rank in range(2):
        saved = torch.load(os.path.join(dump, f"rank{rank}.pt"))
        assert list(saved) == list(ALGORITHM_ORDER)
        for name, d in saved.items():
            assert d["out"].shape[-2:] == (2, 16) and torch.isfinite(d["out"]).all(), name
            assert d["k_cache"].shape[1:] == (4, 1, 16) == d["v_cache"].shape[1:], name
    printed = capsys.readouterr().out
    assert all(name in printed for name in ALGORITHM_ORDER)


def test_paged_cache_holds_this_ranks_positions():
    """Rank r of c stores positions p with p % c == r, at consecutive local indices through its
    page table; pages for ``room`` positions."""
    keys = torch.arange(2 * 7 * 1 * 2, dtype=torch.float32).view(14, 1, 2)
    stored, room, c, ps = [5, 9], [6, 12], 2, 2
    for r in range(c):
        kc, _, table = paged_cache(keys, keys, stored, room, c, r, ps)
        row = 0
        for b, n in enumerate(stored):
            pos = owned_positions(n, c, r)
            for j, p in enumerate(pos.tolist()):
                assert torch.equal(kc[int(table[b, j // ps]), j % ps], keys[row + p])
            row += n
        assert kc.shape[0] == sum(-(-owned_positions(n, c, r).numel() // ps) for n in room) + 1
