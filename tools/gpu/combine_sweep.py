"""Tuning aid (GPU): the split-KV combine kernel's block geometry and warps on decode shapes.

For each case ``shape:C:B:L:q`` (as ``decode_profile.py``) builds the shard plan, fills its
workspace with random partials (finite LSEs), and times the combine launch alone for the plan's
own geometry and for every (BLOCK_S, BLOCK_H, BLOCK_DV, num_warps) of the sweep: 20 launches
captured in one CUDA graph, µs per launch (kernel time plus the inter-kernel gap, as inside an
engine's decode graph), and the effective GB/s on the partials read. Every variant's output is
compared with the plan's (max |diff|).

Run: ``PYTHONPATH=src:tools/gpu python tools/gpu/combine_sweep.py [--cases mla:8:1:1m:1,...]``.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from cpattn.bench.common import time_cuda_graph
from cpattn.bench.decode import SHAPES, Pool, _ints
from cpattn.kernels import triton_decode

from decode_profile import case_plan


NUM_SMS = 132
#: merge_blocks rules compared: (budget, max_block_dv, programs_per_sm); the first is the default.
RULES = [(8192, 256, 2), (4096, 128, 2), (8192, 256, 1), (16384, 256, 2)]


def base_splits(run) -> int:
    """The ``parts`` argument the plan gave merge_blocks (its most splits of one tile)."""
    return int(run.combine_args["row_nsplit"].max())


def merge_case(c: int, n: int, h: int, dv: int, dtype=torch.bfloat16) -> None:
    """The cross-rank merge (``merge_states`` of C received parts) for each rule's blocks."""
    parts = torch.randn(c, n, h, dv, device="cuda", dtype=dtype)
    plse = torch.randn(c, n, h, device="cuda") * 4
    out = torch.empty(n, h, dv, device="cuda", dtype=dtype)
    lse = torch.empty(n, h, device="cuda")
    nbytes = parts.numel() * parts.element_size() + plse.numel() * 4
    for r in RULES:
        blocks = triton_decode.merge_blocks(c, h, dv, n, NUM_SMS, *r)
        us = graph_us(lambda: triton_decode.merge_parts(parts, plse, out, lse, num_sms=NUM_SMS, blocks=blocks))
        print(f"merge C={c} N={n} H={h} Dv={dv}: rule {r} -> {blocks}: {us:6.1f} us ({nbytes / us / 1e3:5.0f} GB/s)",
              flush=True)


def graph_us(fn, calls: int = 20) -> float:
    """µs per call of ``fn``, ``calls`` calls captured in one CUDA graph."""
    return time_cuda_graph(fn, iters=5, calls=calls) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="mla:8:1:1m:1,mla:1:8:32k:1,mla:1:8:4k:1,mla:8:1:1m:4,mla:8:8:1m:1,"
                                       "gqa:8:1:1m:1,gqa:1:1:1m:1,gqa:8:8:1m:1")
    args = ap.parse_args()
    for c, n, h, dv in ((8, 1, 128, 512), (8, 8, 128, 512), (8, 64, 128, 512), (8, 1, 32, 128), (8, 64, 32, 128)):
        merge_case(c, n, h, dv)
    pool = Pool(torch.device("cuda"), torch.bfloat16)
    for spec in args.cases.split(","):
        name, c, b, keys, q_len = spec.split(":")
        plan, q, kc, vc, table = case_plan(pool, SHAPES[name], int(c), int(b), _ints(keys)[0], int(q_len), {})
        impl = plan._impl
        run = impl._mla if getattr(impl, "_mla", None) is not None else impl
        if not run.run_combine:
            print(f"{spec}: one split per tile, no combine")
            continue
        out, lse = plan.run(q, kc, vc, page_table=table)
        ws_o = torch.randn(run.ws_shape, device=q.device, dtype=torch.float32)
        ws_lse = torch.randn(run.ws_shape[:3], device=q.device, dtype=torch.float32) * 4
        ws = triton_decode.Workspace(ws_o, ws_lse)
        base = run.combine_args
        hq, dv = out.shape[1], out.shape[2]
        bytes_read = ws_o.numel() * 4 + ws_lse.numel() * 4

        def launch(args_, grid, o=out, l_=lse):
            return triton_decode.launch_combine(o, l_, None, ws, grid=grid, combine_args=args_)

        launch(base, run.combine_grid)
        ref = out.clone()
        own = (base["BLOCK_S"], base["BLOCK_H"], base["BLOCK_DV"], 4)
        us = graph_us(lambda: launch(base, run.combine_grid))
        print(f"{spec}: {run.ws_shape[0]} splits, combine grid {run.combine_grid}, plan blocks {own}: {us:.1f} us "
              f"({bytes_read / us / 1e3:.0f} GB/s)", flush=True)
        splits = max(triton_decode._next_pow2(int(run.combine_args["row_nsplit"].max())), 1)
        rows = run.combine_grid[0]
        rules = {f"rule {r}": triton_decode.merge_blocks(base_splits(run), hq, dv, rows, NUM_SMS, *r) for r in RULES}
        for label, (bs, bh, bd) in rules.items():
            args_ = dict(base, BLOCK_S=bs, BLOCK_H=bh, BLOCK_DV=bd, ONE_PASS=base_splits(run) <= bs)
            grid = (rows, -(-hq // bh), -(-dv // bd))
            us = graph_us(lambda: launch(args_, grid))
            print(f"    {label} -> {(bs, bh, bd)}: {us:6.1f} us ({bytes_read / us / 1e3:5.0f} GB/s)", flush=True)
        results = []
        for bs, bh, bd, w in itertools.product((8, 16, 32, 64, 128, 256), (1, 2, 4), (32, 64, 128, 256), (2, 4)):
            if bs * bh * bd > 16384 or bd > dv or bs > 2 * splits:
                continue
            args_ = dict(base, BLOCK_S=bs, BLOCK_H=bh, BLOCK_DV=bd, num_warps=w, ONE_PASS=base_splits(run) <= bs)
            grid = (run.combine_grid[0], -(-hq // bh), -(-dv // bd))
            o2 = torch.empty_like(out)
            launch(args_, grid, o2)
            diff = (o2.float() - ref.float()).abs().max().item()
            results.append((graph_us(lambda: launch(args_, grid, o2)), (bs, bh, bd, w), diff))
        results.sort()
        for us, blocks, diff in results[:6]:
            print(f"    {blocks}: {us:6.1f} us ({bytes_read / us / 1e3:5.0f} GB/s) max|diff| {diff:.1e}")


if __name__ == "__main__":
    main()
