"""``python benchmarks/run.py plan``: host work per attention call: plan.run, plan.attend, strategy.attention.

For each workload (one sequence of S tokens, rank 0's zigzag work at C, GQA 32/8 D128 bf16,
packed or paged 64) and backend: the host time of one call (perf_counter around the call, GPU
queue not drained, median of many calls; µs), the device time of calls issued back to back
(``ms``: host work hidden behind the queue) and of one call followed by a sync (``ms_sync``:
host work exposed, as in a synced single call), and their ratio. ``strategy.attention`` plans
once and caches the plan on the metadata; ``plan.attend`` is the planned per-layer kernel call.

Also runs against an older cpattn without plans (no ``plan_attention``): then only
``strategy.attention`` is measured, e.g. ``PYTHONPATH=old/src python benchmarks/run.py plan --label old``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from .common import default_out, header, progress, time_cuda, time_cuda_back_to_back, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seqs", default="16384,65536", help="total sequence lengths S")
    p.add_argument("--cps", default="1,8", help="zigzag CP sizes (rank 0's work)")
    p.add_argument("--backends", default="triton,fa4", help="comma list: triton, fa4, torch")
    p.add_argument("--no-paged", action="store_true", help="skip the paged (page 64) workloads")
    p.add_argument("--calls", type=int, default=200, help="calls timed on the host")
    p.add_argument("--label", default="new", help="label of this code version in the JSON")
    p.add_argument("--out", default=default_out("plan-host"), help="output path without extension")


def _host_us(fn, calls: int) -> float:
    """Median host microseconds per call; the GPU queue is drained every 50 calls so the host
    never blocks on a full launch queue."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
        if i % 50 == 49:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(times)


def _paged(k, v, page):
    seq, hkv, d = k.shape
    pages = -(-seq // page)
    kc = torch.zeros(pages, page, hkv, d, device=k.device, dtype=k.dtype)
    vc = torch.zeros(pages, page, hkv, v.shape[-1], device=v.device, dtype=v.dtype)
    kc.view(-1, hkv, d)[:seq].copy_(k)
    vc.view(-1, hkv, v.shape[-1])[:seq].copy_(v)
    table = torch.arange(pages, device=k.device, dtype=torch.int32)[None]
    return kc, vc, table


def main(args: argparse.Namespace) -> int:
    import cpattn

    if not torch.cuda.is_available():
        raise SystemExit("the plan benchmark needs a CUDA device")
    has_plans = hasattr(cpattn, "plan_attention")
    info = header(f"benchmarks/run.py plan --seqs {args.seqs} --cps {args.cps} --backends {args.backends}")
    info["label"] = args.label
    progress(f"{info['machine']}; cpattn {getattr(cpattn, '__version__', '?')} ({args.label}); plans: {has_plans}")
    hq, hkv, d = 32, 8, 128
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for seq in (int(x) for x in args.seqs.split(",")):
        k = torch.randn(seq, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
        v = torch.randn(seq, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
        for cp in (int(x) for x in args.cps.split(",")):
            for page in (None,) if args.no_paged else (None, 64):
                s = cpattn.ZigzagStrategy(cp, pad_multiple=64)
                meta = s.build_metadata([seq], rank=0).to(dev)
                q = torch.randn(meta.num_physical_tokens, hq, d, device=dev, dtype=torch.bfloat16, generator=gen)
                kk, vv, table = (k, v, None) if page is None else _paged(k, v, page)
                workload = f"d128 S={seq // 1024}k zigzag C={cp}" + (f" paged{page}" if page else "")
                for backend in args.backends.split(","):
                    calls = {"strategy.attention": lambda: s.attention(q, kk, vv, meta, page_table=table,
                                                                       backend=backend)}
                    if has_plans:
                        try:
                            spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                                        dtype=torch.bfloat16, page_size=page)
                            plan = cpattn.plan_attention(meta, spec, backend=backend)
                        except NotImplementedError as exc:
                            progress(f"{workload} {backend}: {exc}")
                            continue
                        calls["plan.attend"] = lambda: plan.attend(q, kk, vv, page_table=table)
                        if cp == 1 and page is None:  # plan.run in one process: the "local" algorithm
                            k_loc, v_loc = s.shard(k, meta), s.shard(v, meta)
                            calls["plan.run"] = lambda: plan.run(q, k_loc, v_loc)
                    for api, fn in calls.items():
                        try:
                            host = _host_us(fn, args.calls)
                            ms = time_cuda_back_to_back(fn, warmup=2, iters=20)
                            ms_sync = time_cuda(fn, warmup=2, iters=20)
                        except Exception as exc:  # a backend that cannot run here
                            progress(f"{workload} {backend} {api}: {type(exc).__name__}: {exc}"[:300])
                            break
                        rows.append(dict(workload=workload, backend=backend, api=api, label=args.label,
                                         host_us=round(host, 1), ms=round(ms, 4), ms_sync=round(ms_sync, 4),
                                         sync_over_b2b=round(ms / ms_sync, 3)))
                        progress(f"{workload:30s} {backend:7s} {api:19s} host {host:7.1f} us  "
                                 f"b2b {ms:.3f} ms  one+sync {ms_sync:.3f} ms  ({ms / ms_sync:.2f}x)")
                del q
        del k, v
    write_json(args.out + ".json", dict(info, rows=rows))
    print("| workload | backend | api | host µs | ms back-to-back | ms one call + sync | b2b / sync |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['workload']} | {r['backend']} | {r['api']} | {r['host_us']} | {r['ms']} | {r['ms_sync']} | "
              f"{r['sync_over_b2b']} |")
    return 0
