"""Host µs per ``plan.run`` measured in interleaved rounds (issue 11: <= 30 µs for triton).

A single median per plan (``profile_host.py``) moves by 1.5-2x between runs and machine
instances, and with it the plan that looks slowest. This takes the five plans of
``profile_host.py`` (16k tokens, zigzag C=8 rank 0: sm90 packed / paged64, MLA packed, portable
packed / paged16), warms each (compile, direct launch recorded), then runs ``--rounds`` rounds;
in each round every plan (in a rotated order) is timed for ``--calls`` calls with the queue busy
(drained before the round and every 50 calls, as ``profile_host.host_us``): with ``out=`` given
and the same K/V, with ``out=`` and K/V rotating among 4 buffer sets (layers with their own
caches), and allocating its output (no ``out=``). After the rounds it splits each plan's call into cpattn's Python (the C launch a
no-op) and the C launch alone (a recorded call's arguments), three rounds each.

Prints per plan: median [min, max] over the rounds of the per-round medians, and the split.
Run: ``PYTHONPATH=src:tools/gpu python tools/gpu/host_rounds.py [--rounds 12] [--calls 60]
[--pin CPU] [--no-gc]`` (about 1 minute on the H200; ``--pin``: one CPU only, ``--no-gc``: the
garbage collector off while timing).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import statistics

import torch

import cpattn
from profile_host import host_us, paged


def _direct(plan):
    """The plan's one direct launch record (None when its calls do not go direct)."""
    impl = plan._impl
    launchers = [impl._portable_launch] if plan.family == "portable" else list(impl._fast_state.launchers.values())
    recs = [r for launcher in launchers for r in launcher.records.values() if r.direct is not None]
    return recs[-1].direct if recs else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--pin", type=int, default=None, help="run on this CPU only (sched_setaffinity)")
    ap.add_argument("--no-gc", action="store_true", help="garbage collector off while timing")
    args = ap.parse_args()
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})
    if args.no_gc:
        gc.disable()
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    seq, c, hq, hkv, d = 16384, 8, 32, 8, 128
    s = cpattn.ZigzagStrategy(c, pad_multiple=64)
    meta = s.build_metadata([seq], rank=0).to(dev)
    p = meta.num_physical_tokens
    q = torch.randn(p, hq, d, device=dev, generator=gen).to(torch.bfloat16)
    k = torch.randn(seq, hkv, d, device=dev, generator=gen).to(torch.bfloat16)
    v = torch.randn(seq, hkv, d, device=dev, generator=gen).to(torch.bfloat16)
    qm = torch.randn(p, 128, 576, device=dev, generator=gen).to(torch.bfloat16)
    lat = torch.randn(seq, 1, 576, device=dev, generator=gen).to(torch.bfloat16)
    dense = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    cases = []
    for name, family, qq, kk, vv, page, kw in (
        ("sm90 packed", "sm90", q, k, v, None, dense),
        ("sm90 paged64", "sm90", q, k, v, 64, dense),
        ("mla packed", "mla", qm, lat, None, None, dict(num_q_heads=128, num_kv_heads=1, head_dim=576,
                                                         head_dim_v=512)),
        ("portable packed", "portable", q, k, v, None, dense),
        ("portable paged16", "portable", q, k, v, 16, dense),
    ):
        extra = {}
        sets = [(kk, vv)] + [(torch.randn_like(kk), None if vv is None else torch.randn_like(vv)) for _ in range(3)]
        if page is not None:
            sets = [paged(a, b, page) for a, b in sets]
            extra["page_table"] = torch.arange(-(-seq // page), device=dev, dtype=torch.int32)[None]
        sets = [(a, a[..., :512] if b is None else b) for a, b in sets]
        kk, vv = sets[0]
        plan = s.plan_attention(meta, dtype=torch.bfloat16, backend="triton", backend_options={"family": family},
                                page_size=page, **kw)
        out = plan.run(qq, kk, vv, **extra)
        plan.run(qq, kk, vv, out=out, **extra)
        for a, b in sets:
            plan.run(qq, a, b, out=out, **extra)
        cases.append((name, plan, qq, kk, vv, extra, out, itertools.cycle(sets)))
    torch.cuda.synchronize()
    print(f"{len(cases)} plans warmed; {args.rounds} rounds of {args.calls} calls each; pinned to "
          f"{args.pin if args.pin is not None else 'no CPU'}; gc {'off' if args.no_gc else 'on'}", flush=True)

    times = {name: {"out=": [], "rotating": [], "alloc": []} for name, *_ in cases}
    for r in range(args.rounds):
        order = cases[r % len(cases):] + cases[: r % len(cases)]
        for name, plan, qq, kk, vv, extra, out, cyc in order:
            times[name]["out="].append(host_us(lambda: plan.run(qq, kk, vv, out=out, **extra), calls=args.calls))
            times[name]["rotating"].append(host_us(lambda: plan.run(qq, *next(cyc), out=out, **extra),
                                                   calls=args.calls))
            times[name]["alloc"].append(host_us(lambda: plan.run(qq, kk, vv, **extra), calls=args.calls))
        if r % 4 == 3:
            print(f"round {r + 1}/{args.rounds} done", flush=True)

    split = {}
    for name, plan, qq, kk, vv, extra, out, _ in cases:
        direct = _direct(plan)
        if direct is None:
            split[name] = None
            continue
        real = direct.launch
        recorded = []
        direct.launch = lambda *a: recorded.append(a) or real(*a)
        plan.run(qq, kk, vv, out=out, **extra)
        direct.launch = lambda *a: None
        py = [host_us(lambda: plan.run(qq, kk, vv, out=out, **extra), calls=args.calls) for _ in range(3)]
        direct.launch = real
        launch = [host_us(lambda: real(*recorded[-1]), calls=args.calls) for _ in range(3)]
        split[name] = (statistics.median(py), statistics.median(launch))
        torch.cuda.synchronize()

    def fmt(xs):
        return f"{statistics.median(xs):5.1f} [{min(xs):5.1f}, {max(xs):5.1f}]"

    print("\nhost us per plan.run, median [min, max] over rounds of per-round medians (target <= 30):")
    for name, *_ in cases:
        t = times[name]
        parts = split[name]
        how = f"Python {parts[0]:5.1f} + C launch {parts[1]:4.1f}" if parts else "not direct"
        print(f"  {name:17s} out= {fmt(t['out='])} | rotating {fmt(t['rotating'])} | allocating {fmt(t['alloc'])}"
              f" | {how}", flush=True)


if __name__ == "__main__":
    main()
