"""Where a plan's host time goes (issue 11). For the sm90 packed / paged64 and the portable packed
(device-side descriptors: global scratch) / paged16 plans at 16k C=8 D128 this prints host µs per
call of (a) plan.run, (b) plan.run with the C launch replaced by a no-op (cpattn's Python work
only) and (c) the C launch alone with the arguments of a recorded call (the driver's work), each
with the queue busy (drained every 50 calls) and idle (drained before every call). A plan whose
calls do not go direct is reported as such (only (a) is timed).

Run: ``PYTHONPATH=src:tools/gpu python tools/gpu/paged_host_probe.py`` (about 1 minute).
"""

from __future__ import annotations

import torch

import cpattn
from profile_host import host_us, paged


def main() -> None:
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    seq, c, hq, hkv, d, page = 16384, 8, 32, 8, 128, 64
    s = cpattn.ZigzagStrategy(c, pad_multiple=64)
    meta = s.build_metadata([seq], rank=0).to(dev)
    q = torch.randn(meta.num_physical_tokens, hq, d, device=dev, generator=gen).to(torch.bfloat16)
    k = torch.randn(seq, hkv, d, device=dev, generator=gen).to(torch.bfloat16)
    v = torch.randn(seq, hkv, d, device=dev, generator=gen).to(torch.bfloat16)
    kp, vp = paged(k, v, page)
    table = torch.arange(-(-seq // page), device=dev, dtype=torch.int32)[None]
    kp16, vp16 = paged(k, v, 16)
    table16 = torch.arange(-(-seq // 16), device=dev, dtype=torch.int32)[None]
    cases = (("sm90 packed", k, v, {}, {}, "sm90"),
             ("sm90 paged64", kp, vp, {"page_table": table}, {"page_size": page}, "sm90"),
             ("portable packed", k, v, {}, {}, "portable"),
             ("portable paged16", kp16, vp16, {"page_table": table16}, {"page_size": 16}, "portable"))
    for name, kk, vv, extra, kw, family in cases:
        plan = s.plan_attention(meta, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16,
                                backend="triton", backend_options={"family": family}, **kw)
        out = plan.run(q, kk, vv, **extra)
        plan.run(q, kk, vv, out=out, **extra)
        impl = plan._impl
        (launcher,) = impl._fast_state.launchers.values() if family == "sm90" else (impl._portable_launch,)
        (rec,) = launcher.records.values()
        direct = rec.direct
        if direct is None:
            full = host_us(lambda: plan.run(q, kk, vv, out=out, **extra), calls=200)
            print(f"{name:16s} not direct: plan.run {full:5.1f} us", flush=True)
            continue
        real = direct.launch
        recorded = []
        direct.launch = lambda *a: recorded.append(a) or real(*a)
        plan.run(q, kk, vv, out=out, **extra)
        args = recorded[-1]
        results = {}
        for idle in (False, True):
            direct.launch = real
            full = host_us(lambda: plan.run(q, kk, vv, out=out, **extra), calls=200, idle=idle)
            direct.launch = lambda *a: None
            python = host_us(lambda: plan.run(q, kk, vv, out=out, **extra), calls=200, idle=idle)
            direct.launch = real
            launch = host_us(lambda: real(*args), calls=200, idle=idle)
            results["idle" if idle else "busy"] = (full, python, launch)
        scratch = f" (global scratch {direct.scratch_bytes} B / program)" if direct.scratch_bytes else ""
        print(f"{name:16s} " + " | ".join(f"{mode}: plan.run {f:5.1f} us = Python {p:5.1f} + C launch alone {c_:5.1f}"
                                          for mode, (f, p, c_) in results.items()) + scratch, flush=True)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
