"""``python benchmarks/run.py kernel``: workload names, ``--workloads`` selection, the paged cache
it builds and the targets summary (host code, CPU)."""

from __future__ import annotations

import argparse

import pytest
import torch

from benchmarks import kernel as bench


def _args(*argv):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(list(argv))


def test_default_workloads_name_what_they_are():
    names = {w.name: w for w in bench.all_workloads(_args())}
    for name in ("d128 S=64k zigzag C=2", "d128 S=64k zigzag C=2 paged16", "d192 S=128k zigzag C=2 paged256",
                 "d128 S=16k interleave C=4", "mla576 S=16k zigzag C=1", "mla576 S=64k zigzag C=4",
                 "mla576 S=16k zigzag C=1 paged64", "mla576 decode B=64 L=32k q1", "mla576 decode B=1 L=128k q4",
                 "d128 1024x128", "d128 64x2048"):
        assert name in names, name
    dec = names["mla576 decode B=8 L=4k q4"]
    assert dec.ext == (4,) * 8 and dec.prefix == (4092,) * 8 and dec.cp == 1
    short = names["d128 1024x128"]
    assert short.ext == (128,) * 1024 and short.group == "short"
    assert names["d128 S=64k zigzag C=2 paged64"].page == 64
    assert [w.page for w in names.values() if w.group == "mla" and w.page] == [64]


def test_mla_page_sizes_on_request():
    """``--mla-pages`` adds a paged absorbed-MLA prefill per page size (the first S, C = 1)."""
    ws = bench.all_workloads(_args("--mla-seqs", "65536,16384", "--mla-cps", "4", "--mla-pages", "16,256"))
    mla = [(w.name, w.cp, w.page) for w in ws if w.group == "mla"]
    assert mla == [("mla576 S=64k zigzag C=4", 4, None), ("mla576 S=16k zigzag C=4", 4, None),
                   ("mla576 S=64k zigzag C=1 paged16", 1, 16), ("mla576 S=64k zigzag C=1 paged256", 1, 256)]


def test_head_shapes_d64_on_request_unknown_refused():
    """d64 (32 / 8 heads, D 64) is measured only when asked for; an unknown shape stops the run."""
    assert not any(w.shape == "d64" for w in bench.all_workloads(_args()))
    names = [w.name for w in bench.all_workloads(_args("--shapes", "d64", "--seqs", "16384", "--cps", "2",
                                                       "--no-interleave", "--pages", "16"))]
    assert names[:2] == ["d64 S=16k zigzag C=2", "d64 S=16k zigzag C=2 paged16"]
    assert bench.SHAPES["d64"] == (32, 8, 64, 64)
    with pytest.raises(SystemExit, match="--shapes takes d64,d128,d192, got 'd96'"):
        bench.all_workloads(_args("--shapes", "d96"))


def test_workload_selection_by_group_and_substring():
    ws = bench.all_workloads(_args())
    assert {w.group for w in bench.select(ws, "mla,decode")} == {"mla", "decode"}
    assert bench.select(ws, "all") == ws
    picked = [w.name for w in bench.select(ws, "S=64k zigzag C=2 paged64")]
    # a paged workload brings its packed baseline
    assert picked == ["d128 S=64k zigzag C=2", "d128 S=64k zigzag C=2 paged64", "d192 S=64k zigzag C=2",
                      "d192 S=64k zigzag C=2 paged64"]
    assert [w.name for w in bench.select(ws, "d128 64x2048")] == ["d128 64x2048"]
    assert bench.select(ws, "no such workload") == []


def test_paged_cache_holds_every_key_at_its_table_slot():
    gen = torch.Generator().manual_seed(0)
    lens = [37, 1, 64, 100]
    k = torch.randn(sum(lens), 2, 8)
    v = torch.randn(sum(lens), 2, 4)
    kc, vc, table = bench.paged_cache(k, v, lens, 16, gen)
    assert table.dtype == torch.int32 and table.shape == (4, 7)
    row = 0
    for b, n in enumerate(lens):
        j = torch.arange(n)
        pages = table[b, j // 16].long()
        assert torch.equal(kc[pages, j % 16], k[row : row + n]) and torch.equal(vc[pages, j % 16], v[row : row + n])
        row += n
    used = torch.cat([table[b, : -(-n // 16)] for b, n in enumerate(lens)])
    assert used.unique().numel() == used.numel() == kc.shape[0]  # every page used once
    kc_only, none, _ = bench.paged_cache(k, None, lens, 16, gen)
    assert none is None and kc_only.shape == kc.shape


def test_targets_summary(capsys):
    rows = []

    def add(w, b, tf, group="dense", **kw):
        rows.append(dict(workload=w, group=group, backend=b, family="x", tflops=tf, ms=1.0, **kw))

    for c, (t, f) in enumerate([(600, 600), (620, 590), (500, 560)], start=1):
        add(f"d128 S=64k zigzag C={c}", "triton", t)
        add(f"d128 S=64k zigzag C={c}", "fa4", f)
    add("d128 S=64k zigzag C=2 paged16", "triton", 589, "paged")
    add("d128 S=64k zigzag C=2 paged16", "fa4", 500, "paged")
    add("mla576 S=16k zigzag C=1", "triton", 510, "mla")
    add("mla576 decode B=8 L=32k q1", "triton", 20, "decode", gbps=2600.0)
    add("mla576 decode B=8 L=4k q1", "triton", 88, "decode", gbps=364.0, tflops_graph=350.0, gbps_graph=1450.0)
    add("d128 1024x128", "triton", 300, "short")
    add("d128 1024x128", "fa4", 400, "short")
    add("d128 S=128k zigzag C=4", "triton", 600)
    add("d128 S=128k zigzag C=4", "triton-fp8", 930, rel_rmse_vs_bf16=0.0312)
    bench._print_targets(rows)
    out = capsys.readouterr().out
    assert "dense d128 zigzag triton/fa4: median 1.000" in out and "min 0.893" in out
    assert "d128 S=64k zigzag C=2 paged16: triton 589 TF/s = 0.95x its packed" in out and "1.18x fa4 paged" in out
    assert "mla576 S=16k zigzag C=1: triton 510 TF/s" in out
    assert "mla576 decode B=8 L=32k q1: triton back to back 2600 GB/s, 20 TF/s (target" in out
    assert "mla576 decode B=8 L=4k q1: triton back to back 364 GB/s, 88 TF/s; graph replay 1450 GB/s, 350 TF/s" in out
    assert "d128 1024x128: triton 300 TF/s = 0.75x fa4 varlen" in out
    assert "d128 S=128k zigzag C=4: triton-fp8 930 TF/s = 1.55x triton bf16 (target >= 1.50), rel RMSE vs bf16 " \
        "0.0312" in out


def test_fp8_kv_quantizes_per_kv_head():
    """The triton-fp8 backend's K/V: e4m3 with per-KV-head scales amax / 448 (packed and paged)."""
    g = torch.Generator().manual_seed(0)
    for shape in ((50, 3, 16), (4, 8, 3, 16)):
        k = torch.randn(*shape, generator=g) * torch.tensor([1.0, 10.0, 0.1]).view(3, 1)
        v = torch.randn(*shape, generator=g)
        k8, v8, ks, vs = bench.fp8_kv(k.bfloat16(), v.bfloat16())
        assert k8.dtype == torch.float8_e4m3fn and ks.shape == (3,) and vs.shape == (3,)
        amax = k.bfloat16().float().abs().flatten(0, -3).amax(dim=(0, 2))
        assert torch.equal(ks, amax / 448)
        assert (k8.float().abs().flatten(0, -3).amax(dim=(0, 2)) == 448).all()
        back = k8.float() * ks.view(3, 1)
        assert bench.rel_rmse(back, k.bfloat16().float()) < 0.05


def test_sm90_options_parse():
    assert bench.parse_options("block_n=64,stages=4,pingpong=1,overlap=2") == dict(
        block_n=64, stages=4, pingpong=True, overlap=2)
    assert bench.parse_options("persistent=0") == dict(persistent=False)
    assert bench.parse_options("persistent=auto") == dict(persistent="auto")
    assert bench.parse_options("overlap=auto,sections=auto") == dict(overlap="auto", sections="auto")
    assert bench.parse_options("programs_per_sm=1,family=mla", "--decode-options") == dict(
        programs_per_sm=1, family="mla")
    assert bench.parse_options("pdl=0,pair=1", "--decode-options") == dict(pdl=False, pair=True)
    with pytest.raises(SystemExit, match="--decode-options items are key=value"):
        bench.parse_options("programs_per_sm", "--decode-options")


def test_timed_iters_caps_long_calls_and_stretches_short_ones():
    assert bench.timed_iters(10.0, 5, 0.0) == 5  # 50 ms a repeat: --iters as given
    assert bench.timed_iters(400.0, 5, 50.0) == 3  # > 1 s a repeat: fewer, never below 3
    assert bench.timed_iters(0.25, 5, 50.0) == 200  # a 0.25 ms call: 200 calls fill 50 ms
    assert bench.timed_iters(1e-6, 5, 50.0) == 2000  # bounded
    assert bench.timed_iters(0.25, 5, 0.0) == 5  # --min-ms 0: the old count


def test_default_timing_warms_up_and_lasts():
    args = _args()
    assert args.warmup_ms == bench.WARMUP_MS > 0 and args.min_ms == bench.MIN_MS > 0
    assert _args("--warmup-ms", "0", "--min-ms", "0").warmup_ms == 0.0
    assert "--warmup-ms 200" in " ".join(bench._argv_summary(args))
