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


def test_decode_bench_fp8_side_by_side(tmp_path):
    """``--kv-dtype both``: every config over the model-dtype cache and over an FP8 cache in one
    run; FP8 rows hold a quarter of the bytes per key of the CPU run's float32 cache (1 vs 4)
    and carry their token-rate ratio to the twin row."""
    out = os.path.join(tmp_path, "decode")
    assert main(["decode", "--tiny", "--shapes", "gqa", "--q-lens", "1", "--kv-dtype", "both", "--no-crossover",
                 "--out", out]) == 0
    rows = json.load(open(out + ".json"))["rows"]
    fp8 = [r for r in rows if r["kv_dtype"] == "float8_e4m3fn"]
    model = [r for r in rows if r["kv_dtype"] == "float32"]
    assert len(fp8) == len(model) == 2 * 2 * 2
    for r in fp8:
        twin = next(x for x in model if all(x[k] == r[k] for k in ("cp", "batch", "keys", "q_len")))
        assert r["kv_bytes_rank"] * 4 == twin["kv_bytes_rank"]
        assert r["speedup_vs_bf16"] > 0


def test_decode_bench_tile_layout_case():
    """``--kv-dtype fp8_tile``'s case over a small absorbed-MLA shape (D = 144, Dv = 128): a tile
    cache of 164-byte rows, counted as such; a CPU tiny run skips shapes the layout cannot hold
    (Dv not a multiple of 128) and says so."""
    import torch

    from benchmarks.decode import KV_DTYPE_RUNS, TILE, Pool, decode_case, kv_row_bytes, timer

    pool = Pool(torch.device("cpu"), torch.uint8)
    r = decode_case(pool, timer(torch.device("cpu")), name="mla", shape=(4, 1, 144, 128, True), c=2, b=2, keys=40,
                    q_len=1, ps=16, backend="torch", options=None, iters=1, dtype=torch.float32, tiled=True)
    assert r["kv_dtype"] == TILE and r["family"] == "torch"
    assert kv_row_bytes(1, 576, 512, True, 1, tiled=True) == 656
    # C = 2: 20 of each sequence's 40 keys on rank 0, in 2 pages of 16 slots of 164 bytes
    assert r["attn_ms"] > 0 and r["kv_bytes_rank"] == 2 * 2 * 16 * 164
    assert KV_DTYPE_RUNS["tile_both"] == (None, TILE)


def test_decode_bench_tile_layout_skips_other_shapes(tmp_path):
    out = os.path.join(tmp_path, "decode")
    assert main(["decode", "--tiny", "--shapes", "gqa,mla", "--q-lens", "1", "--kv-dtype", "fp8_tile",
                 "--no-crossover", "--out", out]) == 0
    payload = json.load(open(out + ".json"))
    assert payload["rows"] == []
    assert any("fp8_tile" in line for line in json.dumps(payload).split("\n"))
