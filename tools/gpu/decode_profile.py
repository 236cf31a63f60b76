"""Tuning aid (GPU): where a sharded decode step's GPU time goes (issue 13's small-shard ratios).

For each case ``shape:C:B:L:q`` (shape ``mla`` or ``gqa`` as ``python -m cpattn.bench decode``;
rank 0's 1/C shard of B sequences of L keys, q query tokens each, paged 64), prints the plan's
items and split size, the graph-replay ms of ``plan.run`` (how an engine runs decode) and a
torch.profiler breakdown of one eager call (CUDA µs per kernel name), for each option set of
``--options`` (``;``-separated ``name=value,...`` backend options; empty: the defaults).

Run: ``PYTHONPATH=src python tools/gpu/decode_profile.py [--cases mla:8:1:1m:1,...]
[--options "programs_per_sm=1;programs_per_sm=2"]``.
"""

from __future__ import annotations

import argparse

import torch

import cpattn
from cpattn.bench.common import time_cuda_graph
from cpattn.bench.decode import SHAPES, Pool, _ints, random_page_table
from cpattn.bench.kernel import parse_options

from index_topk_sweep import breakdown


def case_plan(pool: Pool, shape, c: int, b: int, keys: int, q_len: int, options: dict, ps: int = 64):
    """(plan, q, k cache, v cache, page table) of rank 0's shard (random pages, as the bench)."""
    hq, hkv, d, dv, v_from_k = shape
    dev, dtype = pool.device, pool.dtype
    dmeta = cpattn.KVSharding(c).build_decode_metadata([keys] * b, [q_len] * b, rank=0).to(dev)
    local = (dmeta.host or dmeta).local_kv_lens.tolist()
    num_pages, table = random_page_table(local, ps, b, dev)
    kc, vc = pool.paged(num_pages, ps, hkv, d, dv, v_from_k)
    q = torch.randn(b * q_len, hq, d, device=dev, dtype=dtype)
    plan = cpattn.plan_shard_attention(dmeta, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv,
                                       dtype=dtype, page_size=ps, backend_options=options or None)
    return plan, q, kc, vc, table


def case(pool: Pool, shape, c: int, b: int, keys: int, q_len: int, options: dict, ps: int = 64):
    plan, q, kc, vc, table = case_plan(pool, shape, c, b, keys, q_len, options, ps)
    out, lse = plan.run(q, kc, vc, page_table=table)

    def fn():
        return plan.run(q, kc, vc, page_table=table, out=out, lse=lse)

    graph_ms = time_cuda_graph(fn, iters=20)
    impl = plan._impl
    local_keys = int((plan.dmeta.host or plan.dmeta).local_kv_lens.sum())
    return graph_ms, getattr(impl, "num_items", None), getattr(impl, "split", None), breakdown(fn), local_keys


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="mla:1:1:1m:1,mla:8:1:1m:1,mla:8:1:1m:4,gqa:1:1:1m:1,gqa:8:1:1m:1")
    ap.add_argument("--options", default="")
    args = ap.parse_args()
    pool = Pool(torch.device("cuda"), torch.bfloat16)
    for spec in args.cases.split(","):
        name, c, b, keys, q_len = spec.split(":")
        c, b, q_len = int(c), int(b), int(q_len)
        keys = _ints(keys)[0]
        shape = SHAPES[name]
        for opts in [parse_options(t, "--options") for t in args.options.split(";")]:
            ms, items, split, per, nkeys = case(pool, shape, c, b, keys, q_len, opts)
            hq, hkv, d, dv, v_from_k = shape
            tf = 2.0 * hq * (d + dv) * q_len * nkeys / (ms * 1e-3) / 1e12
            print(f"{name} C={c} B={b} L={keys} q={q_len} {opts or 'defaults'}: graph {ms * 1e3:.1f} us "
                  f"({tf:.0f} TF/s), {items} items x {split} keys", flush=True)
            for kname, us in per:
                print(f"    {us:9.1f} us  {kname}")


if __name__ == "__main__":
    main()
