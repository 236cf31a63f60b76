"""Host work per ``plan.run`` on the GPU machine (issue 11's target: <= 30 µs for triton).

One command prints, for the sm90 packed, sm90 paged (page 64), MLA packed and portable (packed;
paged 16 too) plans at 16k tokens, zigzag C=8 rank 0 (dense: GQA 32/8 D128; MLA: 128 heads,
D576 / Dv512):

* host µs per call (median of many calls, perf_counter around the call, queue drained every 50
  calls) with (a) the same tensors every call, (b) K/V rotating among 4 buffer sets (layers with
  their own caches), (c) (b) with ``out=`` given (no output allocation), and the plain JIT call
  (``planned_launch=False``) for comparison; whether the direct launch (prepared descriptors) ran;
* a self-check: every planned result bit-identical to the JIT call's on each K/V set;
* cProfile's top lines of every case's rotating calls;
* the kernel benchmark's one-call + sync vs back-to-back ratio (``cpattn.bench.common``
  ``time_cuda`` / ``time_cuda_back_to_back``, as ``python -m cpattn.bench kernel`` measures it) at
  16k C=8 D128 (target: within 5%).

Exit status 1 when a self-check fails. Run: ``PYTHONPATH=src python tools/gpu/profile_host.py``
(about 1-2 minutes, mostly compiles).
"""

from __future__ import annotations

import cProfile
import io
import itertools
import pstats
import statistics
import sys
import time

import torch

import cpattn
from cpattn.bench.common import time_cuda, time_cuda_back_to_back, time_cuda_graph
from cpattn.bench.kernel import _flops

TARGET_US = 30.0


def host_us(fn, calls: int = 400, idle: bool = False) -> float:
    """Median host µs of ``fn``; ``idle``: the queue drained before every call (the GPU idle, no
    pending launches while the call runs), else every 50 calls."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn()
        t.append((time.perf_counter() - t0) * 1e6)
        if idle or i % 50 == 49:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(t)


def paged(k, v, page):
    rows, hkv, d = k.shape
    pages = -(-rows // page)
    kc = torch.zeros(pages, page, hkv, d, device=k.device, dtype=k.dtype)
    kc.view(-1, hkv, d)[:rows] = k
    if v is None:
        return kc, None
    vc = torch.zeros(pages, page, hkv, v.shape[-1], device=k.device, dtype=v.dtype)
    vc.view(-1, hkv, v.shape[-1])[:rows] = v
    return kc, vc


def direct_taken(plan) -> str:
    impl = plan._impl
    if plan.family == "portable":
        launchers = [impl._portable_launch]
    else:
        launchers = list(impl._fast_state.launchers.values())
    recs = [r for launcher in launchers for r in launcher.records.values()]
    if not recs:
        return "no record"
    n = sum(r.direct is not None for r in recs)
    ent = max((len(r.entries) for r in recs), default=0)
    return f"direct {n}/{len(recs)}, prepared descriptor sets {ent}"


def main() -> int:
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    seq, c = 16384, 8
    s = cpattn.ZigzagStrategy(c, pad_multiple=64)
    meta = s.build_metadata([seq], rank=0).to(dev)
    page = 64
    table = torch.arange(-(-seq // page), device=dev, dtype=torch.int32)[None]
    table16 = torch.arange(-(-seq // 16), device=dev, dtype=torch.int32)[None]
    hq, hkv, d = 32, 8, 128
    q = torch.randn(meta.num_physical_tokens, hq, d, device=dev, generator=gen).to(torch.bfloat16)
    dense = [(torch.randn(seq, hkv, d, device=dev, generator=gen).to(torch.bfloat16),
              torch.randn(seq, hkv, d, device=dev, generator=gen).to(torch.bfloat16)) for _ in range(4)]
    dense_paged = [paged(k, v, page) for k, v in dense]
    dense_paged16 = [paged(k, v, 16) for k, v in dense]
    mhq, dl = 128, 576
    qm = torch.randn(meta.num_physical_tokens, mhq, dl, device=dev, generator=gen).to(torch.bfloat16)
    lat = [torch.randn(seq, 1, dl, device=dev, generator=gen).to(torch.bfloat16) for _ in range(4)]
    mla = [(k, k[..., :512]) for k in lat]
    cases = [
        # name, q, kv sets, page table, plan kwargs, family
        ("sm90 packed", q, dense, None, dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d), "sm90"),
        ("sm90 paged64", q, dense_paged, table, dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page),
         "sm90"),
        ("mla packed", qm, mla, None, dict(num_q_heads=mhq, num_kv_heads=1, head_dim=dl, head_dim_v=512), "mla"),
        ("portable packed", q, dense, None, dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d), "portable"),
        ("portable paged16", q, dense_paged16, table16,
         dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=16), "portable"),
    ]
    ok = True
    rows = []
    profiles = {}
    for name, qq, sets, pt, kw, family in cases:
        t0 = time.perf_counter()
        fast = s.plan_attention(meta, dtype=torch.bfloat16, backend="triton", backend_options={"family": family},
                                **kw)
        jit = s.plan_attention(meta, dtype=torch.bfloat16, backend="triton",
                               backend_options={"family": family, "planned_launch": False}, **kw)
        assert fast.family == family, (name, fast.family)
        extra = {} if pt is None else {"page_table": pt}
        same = True
        for k, v in sets:  # self-check first (also compiles): planned == JIT on every K/V set
            a = fast.run(qq, k, v, **extra)
            a2 = fast.run(qq, k, v, **extra)
            b = jit.run(qq, k, v, **extra)
            same &= bool(torch.equal(a, b) and torch.equal(a2, b))
        ok &= same
        k0, v0 = sets[0]
        us_same = host_us(lambda: fast.run(qq, k0, v0, **extra))
        cyc = itertools.cycle(sets)
        us_rot = host_us(lambda: fast.run(qq, *next(cyc), **extra))
        out_buf = torch.empty(meta.num_physical_tokens, qq.shape[1], sets[0][1].shape[-1], device=dev,
                              dtype=torch.bfloat16)
        us_out = host_us(lambda: fast.run(qq, *next(cyc), out=out_buf, **extra))
        us_jit = host_us(lambda: jit.run(qq, k0, v0, **extra), calls=100)
        us_idle = host_us(lambda: fast.run(qq, k0, v0, **extra), calls=100, idle=True)
        rows.append((name, us_same, us_rot, us_out, us_jit, same, direct_taken(fast)))
        print(f"{name:17s} same K/V {us_same:6.1f} us | rotating 4 {us_rot:6.1f} us | rotating, out= {us_out:6.1f} us"
              f" | JIT {us_jit:6.1f} us | GPU idle {us_idle:6.1f} us | bit-identical to JIT: {same} | {direct_taken(fast)} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            fast.run(qq, *next(cyc), **extra)
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(16)
        profiles[name] = text.getvalue()
    for name, text in profiles.items():
        print(f"\n---- cProfile, {name}, rotating K/V, 300 calls (tottime) ----")
        print("\n".join(line for line in text.splitlines() if line.strip())[:4000])

    # one call + sync vs back to back, as the kernel benchmark measures it
    plan = s.plan_attention(meta, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16,
                            backend="triton")
    k0, v0 = dense[0]
    fn = lambda: plan.run(q, k0, v0)  # noqa: E731
    ms = time_cuda_back_to_back(fn, warmup=2, iters=20)
    ms_sync = time_cuda(fn, warmup=2, iters=10)
    flops = _flops(meta, hq, d, d)
    tf, tf_sync = flops / (ms * 1e-3) / 1e12, flops / (ms_sync * 1e-3) / 1e12
    ratio = ms / ms_sync
    print(f"\nkernel bench 16k C=8 D128 (zigzag rank 0, family {plan.family}): back to back {ms:.3f} ms "
          f"({tf:.0f} TF/s), one call + sync {ms_sync:.3f} ms ({tf_sync:.0f} TF/s): sync / back-to-back = "
          f"{ratio:.3f} (target >= 0.95)")
    from torch.profiler import ProfilerActivity, profile

    for sync in (False, True):  # the kernel's own duration, back to back vs isolated by a sync
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
                if sync:
                    torch.cuda.synchronize()
            torch.cuda.synchronize()
        durs = [e.device_time_total for e in prof.events() if e.device_type.name == "CUDA"]
        print(f"kernel duration ({'one call + sync' if sync else 'back to back'}): median "
              f"{statistics.median(durs):.1f} us over {len(durs)} GPU ops")
    graph_ms = time_cuda_graph(fn, warmup=2, iters=20)
    print(f"graph replay {graph_ms:.3f} ms")
    print("\nsummary (host us per plan.run; target <= 30 for triton):")
    for name, us_same, us_rot, us_out, us_jit, same, how in rows:
        verdict = "PASS" if max(us_same, us_rot) <= TARGET_US else "over"
        print(f"  {name:17s} same {us_same:6.1f}  rotating {us_rot:6.1f}  out= {us_out:6.1f}  JIT {us_jit:6.1f}  "
              f"{verdict}{'' if same else '  NOT BIT-IDENTICAL'}")
    if not ok:
        print("SELF-CHECK FAILED: a planned launch differs from the JIT call")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
