"""CP prefill demo on CPU: C gloo ranks prefill a ragged batch with prefix-cached tokens.

    python examples/cp_prefill_demo.py [--cp 3] [--strategy zigzag] [--layers 4]

Every rank plans the batch (build_metadata), shards hidden states and positions at the model's
input boundary, runs a multi-layer GQA attention stack in which each layer all-gathers K/V in one
collective and attends with its local queries, then gathers the hidden states back. Rank 0 then
runs the same stack on one process and prints per-rank tokens, load balance and the max error.
Exits non-zero if CP and single-process results differ.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repository root: reference_layers
import cpattn  # noqa: E402
from reference_layers import AttentionStack  # noqa: E402

EXTEND = [900, 1, 0, 37, 2500, 5]  # new tokens per request: ragged, empty and tiny ones included
PREFIX = [100, 0, 64, 0, 300, 12]  # tokens already in the KV cache (prefix caching)
HIDDEN, HQ, HKV, D = 128, 8, 2, 16


def inputs(layers: int):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(EXTEND), HIDDEN, generator=g)
    positions = torch.cat([torch.arange(p, p + e) for e, p in zip(EXTEND, PREFIX)])
    prefix_kv = [
        (torch.randn(sum(PREFIX), HKV, D, generator=g), torch.randn(sum(PREFIX), HKV, D, generator=g))
        for _ in range(layers)
    ]
    return x, positions, prefix_kv


def rank_main(rank: int, args: argparse.Namespace, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.cp)
    group = dist.new_group(list(range(args.cp)))  # the CP group is always passed explicitly
    stack = AttentionStack(args.layers, HIDDEN, HQ, HKV, D, seed=0)
    x, positions, prefix_kv = inputs(args.layers)

    strategy = cpattn.get_strategy(args.strategy, args.cp)
    # once per forward, host side; group=: the ranks check they planned the same batch (one tiny all-gather)
    meta = strategy.build_metadata(EXTEND, PREFIX, rank=rank, group=group)
    h_local = strategy.shard(x, meta)  # [P, hidden], pad rows zero
    pos_local = strategy.shard(positions, meta)  # global positions, same placement
    h_local, _ = stack(h_local, pos_local, strategy, meta, group, prefix_kv, backend=args.backend)
    h = strategy.gather(h_local, meta, group)  # [T, hidden], logical order, on every rank

    summary = torch.tensor([meta.num_local_tokens, meta.num_physical_tokens, meta.causal_work_per_rank[rank]])
    rows = [torch.zeros_like(summary) for _ in range(args.cp)]
    dist.all_gather(rows, summary, group=group)
    if rank == 0:
        single = cpattn.get_strategy(args.strategy, 1)
        meta1 = single.build_metadata(EXTEND, PREFIX, rank=0)
        ref, _ = stack(x, positions, single, meta1, None, prefix_kv, backend=args.backend)
        err = (h - ref).abs().max().item()
        print(f"cpattn CP prefill demo: strategy={args.strategy} C={args.cp} layers={args.layers}")
        print(f"batch: extend_lens={EXTEND} prefix_lens={PREFIX} (T={sum(EXTEND)})")
        mean_work = sum(meta.causal_work_per_rank) / args.cp
        for r, (n, p, work) in enumerate(row.tolist() for row in rows):
            print(f"  rank {r}: {n:5d} real tokens, {p - n:3d} pad rows, causal work {work / mean_work:.3f} x mean")
        print(f"load imbalance (max/mean causal work): {meta.load_imbalance:.3f}")
        print(f"max |CP - single process| over hidden states: {err:.2e}")
        ok = err < 1e-4
        print("OK" if ok else "MISMATCH")
        with open(os.path.join(os.path.dirname(init_file), "status"), "w") as f:
            f.write("ok" if ok else "mismatch")
    dist.barrier(group)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", type=int, default=3, help="number of CP ranks (processes)")
    parser.add_argument("--strategy", default="zigzag", choices=sorted(cpattn.STRATEGIES))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--backend", default="torch", help="attention backend (torch on CPU)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(args, os.path.join(tmp, "init")), nprocs=args.cp)
        with open(os.path.join(tmp, "status")) as f:
            return 0 if f.read() == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
