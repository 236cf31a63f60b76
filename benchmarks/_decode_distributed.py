"""``torchrun --nproc_per_node C benchmarks/run.py decode --distributed``: the real multi-GPU run.

Decode: every rank holds its own 1/C shard (paged, random keys) of B sequences of L keys and
runs per layer a "shard_merge" plan's ``attend`` + ``merge_partials`` (ONE NCCL all-gather) for the step's
replicated queries; reported per config: attention ms, merge (collective + exact merge) ms and
step ms of the slowest rank (CUDA events, ranks started together by a barrier), and the
bytes the merge moves. Crossover: an extend of T tokens over a sharded prefix of Np keys with
``plan_attention(..., algorithm="pass_kv")`` and ``"pass_q"``, per-layer ``run`` timed on every
rank (real collectives); the measured crossover prefix is compared with
:class:`cpattn.CostModel` using the link bandwidth measured by an all-gather and the kernel
throughputs measured on rank 0. Rank 0 writes the JSON / PNG.

CPU smoke run (gloo, tiny shapes, torch reference; bench-out/decode-cpu-smoke-dist-c2.*)::

    torchrun --nproc_per_node 2 benchmarks/run.py decode --distributed --tiny
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

import cpattn
from cpattn import collectives as _collectives

from .common import default_out, header, progress, smoke_notice, write_json
from .decode import (SHAPES, TINY_SHAPES, Pool, _ints, _k, crossover_point, kv_row_bytes, plot, print_table,
                     random_page_table)


def _barrier(device):
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_ms(fn, device, iters: int) -> float:
    """Median ms of ``fn`` on this rank, all ranks starting each repetition together."""
    fn()
    times = []
    for _ in range(iters):
        _barrier(device)
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            import time

            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _max_over_ranks(x: float, device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _shard_case(pool, device, dtype, rank, c, name, shape, b, keys, q_len, ps, backend, iters) -> dict:
    hq, hkv, d, dv, v_from_k = shape
    sh = cpattn.KVSharding(c)
    dmeta = cpattn.get_strategy("replicated", c).build_metadata([q_len] * b, [keys - q_len] * b, rank=rank,
                                                               group=dist.group.WORLD, kv=sh).to(device)
    local = (dmeta.host or dmeta).local_kv_lens.tolist()
    num_pages, table = random_page_table(local, ps, rank, device)
    kc, vc = pool.paged(num_pages, ps, hkv, d, dv, v_from_k)
    q = torch.randn(b * q_len, hq, d, device=device, dtype=dtype, generator=torch.Generator(device=device).manual_seed(7))
    spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv, dtype=dtype,
                                page_size=ps)
    plan = cpattn.plan_attention(dmeta, spec, backend=backend)
    out, lse = plan.attend(q, kc, vc, page_table=table)

    def step():
        o, l_ = plan.attend(q, kc, vc, page_table=table, out=out, lse=lse)
        return cpattn.merge_partials(o, l_, None, meta=dmeta)

    attn = _max_over_ranks(_time_ms(lambda: plan.attend(q, kc, vc, page_table=table, out=out, lse=lse), device, iters),
                           device)
    merge = _max_over_ranks(_time_ms(lambda: cpattn.merge_partials(out, lse, None, meta=dmeta), device, iters), device)
    total = _max_over_ranks(_time_ms(step, device, iters), device)
    item = torch.empty((), dtype=dtype).element_size()
    return dict(shape=name, cp=c, batch=b, keys=keys, q_len=q_len, attn_ms=round(attn, 5), merge_ms=round(merge, 5),
                rank_ms=round(total, 5), hbm_gbps=round(sum(local) * kv_row_bytes(hkv, d, dv, v_from_k, item)
                                                        / (attn * 1e-3) / 1e9, 1),
                merge_bytes_received=(c - 1) * b * q_len * hq * (dv * item + 4), tflops=0.0,
                kv_bytes_rank=num_pages * ps * kv_row_bytes(hkv, d, dv, v_from_k, item),
                kv_bytes_ok=True, splits=getattr(plan.launch, "num_items", None),
                split_keys=getattr(plan.launch, "split", None))


def _link_bandwidth(device, c: int) -> float:
    """Bytes per second each rank receives in a large all-gather (the pass-KV / pass-Q link)."""
    n = (64 << 20) if device.type == "cuda" else (1 << 20)
    x = torch.empty(n, dtype=torch.uint8, device=device)
    y = torch.empty(n * c, dtype=torch.uint8, device=device)
    ms = _time_ms(lambda: _collectives.all_gather_into(y, x, None, False), device, 5)
    return (c - 1) * n / (_max_over_ranks(ms, device) * 1e-3)


def _extend_case(device, dtype, rank, c, shape, tokens, prefix, ps, backend, iters, model) -> dict:
    hq, hkv, d, dv, _ = shape
    s = cpattn.ZigzagStrategy(c)
    sh = cpattn.KVSharding(c)
    meta = s.build_metadata([tokens], [prefix], rank=rank, kv=sh, group=dist.group.WORLD).to(device)
    local = int((meta.host or meta).local_kv_lens[0])
    pages = -(-local // ps) + 1
    kc = torch.randn(pages, ps, hkv, d, device=device, dtype=dtype)
    vc = torch.randn(pages, ps, hkv, dv, device=device, dtype=dtype)
    table = torch.arange(pages, dtype=torch.int32)[None]
    p = meta.num_physical_tokens
    q = torch.randn(p, hq, d, device=device, dtype=dtype)
    k = torch.randn(p, hkv, d, device=device, dtype=dtype)
    v = torch.randn(p, hkv, dv, device=device, dtype=dtype)
    out = {}
    for algo in ("pass_kv", "pass_q"):
        spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv, dtype=dtype,
                                    page_size=ps)
        plan = cpattn.plan_attention(meta, spec, algorithm=algo, page_table=table, num_pages=pages,
                                     cost_model=model, backend=backend)
        out[algo] = _max_over_ranks(_time_ms(lambda: plan.run(q, k, v, (kc, vc)), device, iters), device)
        out["estimate"] = plan.estimate
    return dict(cp=c, tokens=tokens, prefix=prefix, pass_kv_ms=round(out["pass_kv"], 4),
                pass_q_ms=round(out["pass_q"], 4), model=out["estimate"])


def main(args: argparse.Namespace) -> int:
    if "RANK" not in os.environ:
        raise SystemExit("--distributed runs under torchrun: torchrun --nproc_per_node C benchmarks/run.py decode "
                         "--distributed")
    cuda = torch.cuda.is_available() and not args.tiny
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, c = dist.get_rank(), dist.get_world_size()
    shapes = TINY_SHAPES if args.tiny else SHAPES
    dtype = torch.bfloat16 if cuda else torch.float32
    backend = args.backend if cuda or args.backend != "auto" else "torch"
    if args.tiny:
        args.keys = "96,300" if args.keys == "128k,1m" else args.keys
        args.batches = "1,3" if args.batches == "1,8,64" else args.batches
        args.crossover_prefixes = "0,64,512" if args.crossover_prefixes == "0,4k,16k,64k,256k,1m" else \
            args.crossover_prefixes
        args.crossover_tokens = min(args.crossover_tokens, 32)
        args.page_size = min(args.page_size, 16)
        args.iters = min(args.iters, 2)
    smoke = not cuda
    out = args.out or default_out("decode", smoke=smoke)
    info = header(f"torchrun --nproc_per_node {c} benchmarks/run.py decode --distributed", smoke=smoke)
    log = progress if rank == 0 else (lambda *_: None)
    if smoke and rank == 0:
        smoke_notice("decode --distributed")
    log(f"{info['machine']}, C={c}")
    pool = Pool(device, dtype)
    item = torch.empty((), dtype=dtype).element_size()
    rows, skipped = [], []
    try:
        for name in args.shapes.split(","):
            shape = shapes[name]
            for keys in _ints(args.keys):
                for b in _ints(args.batches):
                    gb = b * keys / c * kv_row_bytes(*shape[1:3], shape[3], shape[4], item) / 1e9
                    if gb > args.budget_gb:
                        skipped.append(f"{name} B={b} L={keys}: {gb:.0f} GB shard > budget")
                        continue
                    for q_len in _ints(args.q_lens):
                        r = _shard_case(pool, device, dtype, rank, c, name, shape, b, keys, q_len, args.page_size,
                                        backend, args.iters)
                        rows.append(r)
                        log(f"decode {name} C={c} B={b} L={_k(keys)} q={q_len}: attn {r['attn_ms']:.4f} ms, merge "
                            f"{r['merge_ms']:.4f} ms, step {r['rank_ms']:.4f} ms")
        pool.buf = None
        crossover = None
        if not args.no_crossover:
            link = _link_bandwidth(device, c)
            base = cpattn.CostModel()
            model = cpattn.CostModel(link_bytes_per_s=link, dense_flops_per_s=base.dense_flops_per_s,
                                           shard_flops_per_s=base.shard_flops_per_s,
                                           hbm_bytes_per_s=base.hbm_bytes_per_s,
                                           collective_latency_s=base.collective_latency_s)
            cr = []
            for prefix in _ints(args.crossover_prefixes):
                r = _extend_case(device, dtype, rank, c, shapes["gqa"], args.crossover_tokens, prefix,
                                 args.page_size, backend, max(3, args.iters // 4), model)
                cr.append(r)
                log(f"crossover T={r['tokens']} prefix={_k(prefix)}: pass-KV {r['pass_kv_ms']:.3f} ms, pass-Q "
                    f"{r['pass_q_ms']:.3f} ms (model {r['model']['pass_kv'] * 1e3:.3f} / {r['model']['pass_q'] * 1e3:.3f})")
            for r in cr:
                r["model_pass_kv_ms"] = r["model"]["pass_kv"] * 1e3
                r["model_pass_q_ms"] = r["model"]["pass_q"] * 1e3
            measured = crossover_point(cr, "pass_kv_ms", "pass_q_ms")
            predicted = crossover_point(cr, "model_pass_kv_ms", "model_pass_q_ms")
            crossover = dict(rows=cr, link_bytes_per_s=link, measured_crossover_prefix=measured,
                             model_crossover_prefix=predicted,
                             relative_error=abs(predicted - measured) / measured if measured and predicted else None,
                             note="real collectives; model: measured link "
                                  f"({link / 1e9:.0f} GB/s), default kernel constants")
        if rank == 0:
            payload = {**info, "rows": rows, "skipped": skipped, "crossover": crossover}
            write_json(out + f"-dist-c{c}.json", payload)
            plot(rows, crossover, out + f"-dist-c{c}.png", info, targets=not smoke)
            print_table(rows)
            if crossover:
                print(f"crossover prefix: measured {crossover['measured_crossover_prefix']}, model "
                      f"{crossover['model_crossover_prefix']}; link {crossover['link_bytes_per_s'] / 1e9:.0f} GB/s")
    finally:
        dist.destroy_process_group()
    return 0
