"""Host work of plan.run on the GPU machine: planned launch vs JIT call, and a cProfile of the
planned path (the lines that cost the most host time per call)."""
import cProfile
import pstats
import statistics
import time

import torch

import cpattn


def host_us(fn, calls=300):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn()
        t.append((time.perf_counter() - t0) * 1e6)
        if i % 50 == 49:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(t)


dev = "cuda"
hq, hkv, d, seq = 32, 8, 128, 16384
k = torch.randn(seq, hkv, d, device=dev, dtype=torch.bfloat16)
v = torch.randn(seq, hkv, d, device=dev, dtype=torch.bfloat16)
pages = seq // 64
kc, vc = k.view(pages, 64, hkv, d).clone(), v.view(pages, 64, hkv, d).clone()
table = torch.arange(pages, device=dev, dtype=torch.int32)[None]
s = cpattn.ZigzagStrategy(8, pad_multiple=64)
meta = s.build_metadata([seq], rank=0).to(dev)
q = torch.randn(meta.num_physical_tokens, hq, d, device=dev, dtype=torch.bfloat16)
for paged in (False, True):
    for planned in (True, False):
        plan = s.plan_attention(meta, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16,
                                page_size=64 if paged else None, backend="triton",
                                backend_options={"planned_launch": planned})
        args = (q, kc, vc) if paged else (q, k, v)
        fn = (lambda: plan.run(*args, page_table=table)) if paged else (lambda: plan.run(*args))
        ref = fn().clone()
        us = host_us(fn)
        same = torch.equal(fn(), ref)
        print(f"paged={paged} family={plan.family} planned_launch={planned}: host {us:.1f} us per plan.run; "
              f"repeat bit-identical: {same}", flush=True)
        if planned:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
out_buf = torch.empty(meta.num_physical_tokens, hq, d, device=dev, dtype=torch.bfloat16)
plan = s.plan_attention(meta, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16, backend="triton")
print(f"plan.run with out=: {host_us(lambda: plan.run(q, k, v, out=out_buf)):.1f} us")
print(f"plan_attention (planning, host): {host_us(lambda: s.plan_attention(meta, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16, backend='triton'), 50):.1f} us")
