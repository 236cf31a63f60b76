"""``python benchmarks/run.py decode --tiny``: the decode / crossover benchmark runs on the CPU
(CI smoke test: tiny shapes, torch reference); its JSON has every config and the measured
crossover, and no target verdicts."""

from __future__ import annotations

import json
import os

from benchmarks.run import main


def test_decode_bench_tiny(tmp_path, capsys):
    out = os.path.join(tmp_path, "decode")
    assert main(["decode", "--tiny", "--shapes", "gqa,mla", "--q-lens", "1,4", "--out", out]) == 0
    payload = json.load(open(out + ".json"))
    assert payload["smoke"]  # a CPU smoke run: no GPU target checked, none printed
    assert not any(word in line for line in payload["summary"] for word in ("PASS", "FAIL", "target"))
    printed = capsys.readouterr().out
    assert "PASS" not in printed and "FAIL" not in printed
    rows = payload["rows"]
    assert len(rows) == 2 * 2 * 2 * 2 * 2  # shapes x L x B x C x q_len
    assert all(r["kv_bytes_ok"] for r in rows) and all(r["attn_ms"] > 0 for r in rows)
    assert {r["cp"] for r in rows} == {1, 2} and {r["shape"] for r in rows} == {"gqa", "mla"}
    assert {r["merge_path"] for r in rows if r["cp"] > 1} == {"torch"}  # CPU without the interpreter
    cross = payload["crossover"]
    assert len(cross["rows"]) == 3 and all(r["bytes_pass_kv"] >= 0 for r in cross["rows"])
    assert any("crossover" in line for line in payload["summary"])


def test_decode_bench_shard_options_from_the_command_line():
    """``--config`` / ``--block-m`` / ``--programs-per-sm`` / ``--no-pdl`` become the shard plans'
    ``backend_options``; none of them: the defaults (None)."""
    import argparse

    from benchmarks.decode import add_arguments, shard_options

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert shard_options(p.parse_args([])) is None
    args = p.parse_args(["--config", "64,4,2", "--block-m", "32", "--programs-per-sm", "2", "--no-pdl"])
    assert shard_options(args) == dict(config=(64, 4, 2), block_m=32, programs_per_sm=2, pdl=False)
