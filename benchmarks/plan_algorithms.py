"""``python benchmarks/run.py plan_algorithms``: host cost of one ``plan.run`` per attention algorithm.

    python benchmarks/run.py plan_algorithms [--cp 2|3] [--calls N] [--rounds R] [--out PATH]

Spawns C gloo processes on the CPU and times one ``plan.run`` call (one layer: its collective,
cache write, kernel and merge) of each algorithm of :data:`cpattn.ALGORITHMS` on a small realistic
workload (perf_counter around the call on rank 0; every rank runs the same calls in lockstep):

* ``local``: replicated queries over a replicated paged cache (decode: 8 sequences, 1 new token
  each, 512-3072 cached keys);
* ``gather_kv``: zigzag prefill (4 ragged sequences, 352 new tokens) into a replicated paged cache;
* ``pass_kv`` / ``pass_q``: zigzag extend (the same 352 new tokens) over a prefix of 5632 keys
  sharded by :class:`cpattn.KVSharding` (C);
* ``shard_merge``: the decode of ``local`` over a cache sharded by :class:`cpattn.KVSharding` (C).

GQA 8/2 heads, D 128, fp32 (``--dtype bf16``), page size 16, the torch backend. The collectives
of each call are counted by wrapping ``torch.distributed``'s collective functions in this process
(the library is not touched), in a separate untimed pass. Output: a table (µs/call median, p10,
p90, collectives per call) and ``bench-out/plan-algorithms-cpu.json``.

A host-side measurement: on the CPU it is a real run (the torch kernel's arithmetic is part of
the time, the same for any code version that runs the same kernel), not a smoke run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

from .common import REPO_ROOT, default_out, header, progress, write_json

#: The algorithms timed, in the order of the table.
ALGORITHM_ORDER = ("local", "gather_kv", "pass_kv", "pass_q", "shard_merge")
#: torch.distributed functions counted as collectives (those present in this torch).
COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "all_gather", "all_gather_coalesced", "all_to_all_single",
               "all_to_all", "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "reduce_scatter_tensor",
               "reduce_scatter", "all_gather_object", "gather", "gather_object", "scatter", "broadcast_object_list",
               "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cp", type=int, default=2, help="CP size C (gloo processes)")
    p.add_argument("--calls", type=int, default=50, help="timed calls per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds (all algorithms once per round)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before each algorithm's first round")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="q/k/v and cache dtype")
    p.add_argument("--algorithms", default=",".join(ALGORITHM_ORDER), help="comma list of algorithms")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (tests): 2 heads/1, D 16, short sequences")
    p.add_argument("--dump", default=None, help="folder: each rank's output and caches after one call per "
                   "algorithm (rank<r>.pt), to compare with another code version")
    p.add_argument("--label", default="new", help="label of this code version in the JSON")
    p.add_argument("--out", default=default_out("plan-algorithms-cpu"), help="output path without extension")


# ----------------------------------------------------------------------------------------- workload
def workload(tiny: bool) -> dict:
    """Shapes of every algorithm's call: heads, head dim, page size; prefill / extend lengths
    (``extend``, ``prefix``) and decode lengths (``decode_cached``: keys before the step, one new
    token per sequence)."""
    if tiny:
        return dict(hq=2, hkv=1, d=16, ps=4, extend=[5, 9, 2], prefix=[12, 20, 7], decode_cached=[9, 30, 4])
    return dict(hq=8, hkv=2, d=128, ps=16, extend=[64, 160, 32, 96], prefix=[1024, 2560, 512, 1536],
                decode_cached=[512, 3072, 1024, 2048, 768, 1536, 2560, 1280])


def owned_positions(length: int, c: int, r: int) -> torch.Tensor:
    """Positions ``p < length`` that rank ``r`` stores under ``KVSharding(c)`` (interleave 1)."""
    return torch.arange(r, length, c, dtype=torch.int64)


def paged_cache(keys: torch.Tensor, vals: torch.Tensor, stored: list[int], room: list[int], c: int, r: int,
                ps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's paged caches and page table: ``keys`` / ``vals`` [sum(stored), Hkv, D] packed
    per sequence (its first ``stored[b]`` positions), of which rank ``r`` of ``c`` holds its
    positions (c = 1: all), with pages for ``room[b]`` positions per sequence. Pages are
    allocated in reverse order (not contiguous); one spare page. Returns (k_cache [P, ps, Hkv, D],
    v_cache, page_table [B, max pages] int32)."""
    hkv, d = keys.shape[1], keys.shape[2]
    pages = [-(-owned_positions(n, c, r).numel() // ps) for n in room]
    num_pages = sum(pages) + 1
    order = torch.arange(num_pages - 1, -1, -1, dtype=torch.int32)
    table = torch.zeros(len(room), max(max(pages), 1), dtype=torch.int32)
    kc = torch.zeros(num_pages, ps, hkv, d, dtype=keys.dtype)
    vc = torch.zeros(num_pages, ps, hkv, vals.shape[2], dtype=vals.dtype)
    off = row = 0
    for b, n in enumerate(stored):
        table[b, : pages[b]] = order[off : off + pages[b]]
        off += pages[b]
        pos = owned_positions(n, c, r)
        j = torch.arange(pos.numel())
        kc[table[b, j // ps].long(), j % ps] = keys[row + pos]
        vc[table[b, j // ps].long(), j % ps] = vals[row + pos]
        row += n
    return kc, vc, table


def packed_rows(full: list[int], lo: list[int], hi: list[int]) -> torch.Tensor:
    """Packed row indices of positions [lo[b], hi[b]) of sequences of ``full`` keys."""
    out, off = [], 0
    for n, a, b in zip(full, lo, hi):
        out.append(torch.arange(off + a, off + b))
        off += n
    return torch.cat(out)


def case_tensors(algorithm: str, w: dict, dtype: torch.dtype) -> dict:
    """The logical tensors of ``algorithm``'s workload, the same on every rank (seeded): lengths
    (``q_lens`` new tokens after ``cached`` keys, ``full`` keys after the call), ``keys`` /
    ``vals`` [sum(full), Hkv, D] packed per sequence, ``q`` [sum(q_lens), Hq, D], and the packed
    row indices of the cached (``old``) and new (``new``) keys."""
    g = torch.Generator().manual_seed(0)
    if algorithm in ("local", "shard_merge"):
        cached = w["decode_cached"]
        q_lens = [1] * len(cached)
    else:
        q_lens, cached = w["extend"], (w["prefix"] if algorithm in ("pass_kv", "pass_q") else [0] * len(w["extend"]))
    full = [a + b for a, b in zip(cached, q_lens)]
    keys = torch.randn(sum(full), w["hkv"], w["d"], generator=g).to(dtype)
    vals = torch.randn(sum(full), w["hkv"], w["d"], generator=g).to(dtype)
    q = torch.randn(sum(q_lens), w["hq"], w["d"], generator=g).to(dtype)
    return dict(q_lens=q_lens, cached=cached, full=full, keys=keys, vals=vals, q=q,
                old=packed_rows(full, [0] * len(full), cached), new=packed_rows(full, cached, full))


def build_case(algorithm: str, rank: int, c: int, w: dict, dtype: torch.dtype, group) -> dict:
    """The call of ``algorithm`` on this rank: ``fn`` (no arguments: one ``plan.run``), ``plan``
    and ``cache`` (this rank's (k_cache, v_cache), written by every call)."""
    import cpattn

    hq, hkv, d, ps = w["hq"], w["hkv"], w["d"], w["ps"]
    t = case_tensors(algorithm, w, dtype)
    q_lens, cached, full, keys, vals, q, old, new = (t[k] for k in ("q_lens", "cached", "full", "keys", "vals", "q",
                                                                    "old", "new"))
    sharded = algorithm in ("pass_kv", "pass_q", "shard_merge")
    cs, rs = (c, rank) if sharded else (1, 0)
    kc, vc, table = paged_cache(keys[old], vals[old], cached, full, cs, rs, ps)
    kv = cpattn.KVSharding(c) if sharded else None
    name = "replicated" if algorithm in ("local", "shard_merge") else "zigzag"
    s = cpattn.get_strategy(name, c)
    meta = s.build_metadata(q_lens, cached, rank=rank, group=group, kv=kv)
    spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype, page_size=ps)
    k_new, v_new = keys[new], vals[new]
    if algorithm in ("pass_kv", "pass_q"):
        plan = cpattn.plan_attention(meta, spec, backend="torch", algorithm=algorithm, page_table=table,
                                     num_pages=kc.shape[0])
        ql, kl, vl = s.shard(q, meta), s.shard(k_new, meta), s.shard(v_new, meta)
        fn = lambda: plan.run(ql, kl, vl, (kc, vc), group=group)  # noqa: E731
    else:
        plan = cpattn.plan_attention(meta, spec, backend="torch")
        writes = cpattn.plan_cache_writes(meta, table, page_size=ps, num_pages=kc.shape[0])
        if algorithm == "gather_kv":
            ql, kl, vl = s.shard(q, meta), s.shard(k_new, meta), s.shard(v_new, meta)
        else:
            ql, kl, vl = q, k_new, v_new
        fn = lambda: plan.run(ql, kl, vl, (kc, vc), writes=writes, group=group, page_table=table)  # noqa: E731
    if plan.algorithm != algorithm:
        raise RuntimeError(f"planned {plan.algorithm!r} for the {algorithm!r} workload")
    return dict(fn=fn, plan=plan, cache=(kc, vc))


# -------------------------------------------------------------------------------------- counting
class CountTorchCollectives:
    """Context manager wrapping ``torch.distributed``'s collective functions (:data:`COLLECTIVES`)
    with call counters; ``counts`` maps a function name to its calls inside the block. A
    collective that calls another one (``all_gather_single`` may run ``all_gather_into_tensor``)
    counts once, under the outer name."""

    def __enter__(self) -> "CountTorchCollectives":
        self.counts: dict[str, int] = {}
        self._saved: dict[str, Callable] = {}
        depth = [0]
        for name in COLLECTIVES:
            orig = getattr(dist, name, None)
            if orig is None:
                continue
            self._saved[name] = orig

            def counting(*args, _name=name, _orig=orig, **kwargs):
                if depth[0] == 0:
                    self.counts[_name] = self.counts.get(_name, 0) + 1
                depth[0] += 1
                try:
                    return _orig(*args, **kwargs)
                finally:
                    depth[0] -= 1

            setattr(dist, name, counting)
        return self

    def __exit__(self, *exc) -> None:
        for name, orig in self._saved.items():
            setattr(dist, name, orig)


# ---------------------------------------------------------------------------------------- timing
def _worker_body(rank: int, c: int, opts: dict) -> dict:
    torch.set_num_threads(1)
    group = dist.group.WORLD
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[opts["dtype"]]
    w = workload(opts["tiny"])
    built = {a: build_case(a, rank, c, w, dtype, group) for a in opts["algorithms"]}
    cases = {a: b["fn"] for a, b in built.items()}
    result: dict = {}
    dumped = {}
    for a, fn in cases.items():
        with CountTorchCollectives() as first:
            out = fn()  # the first call: may run one-time checks (e.g. the merge's header agreement)
        if opts.get("dump"):  # this rank's output and caches after one call (comparisons across versions)
            k_cache, v_cache = built[a]["cache"]
            dumped[a] = dict(out=out.clone(), k_cache=k_cache.clone(), v_cache=v_cache.clone())
        for _ in range(opts["warmup"]):
            fn()
        with CountTorchCollectives() as steady:
            for _ in range(opts["count_calls"]):
                fn()
        per_call = {k: v / opts["count_calls"] for k, v in steady.counts.items()}
        result[a] = dict(first_call=first.counts, per_call=per_call, rounds=[])
    if opts.get("dump"):
        os.makedirs(opts["dump"], exist_ok=True)
        torch.save(dumped, os.path.join(opts["dump"], f"rank{rank}.pt"))
    for _ in range(opts["rounds"]):
        for a, fn in cases.items():
            dist.barrier()
            times = []
            for _ in range(opts["calls"]):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            result[a]["rounds"].append(times)
    return result


def _rank_main(rank: int, world_size: int, device: torch.device, opts: dict) -> dict:
    return _worker_body(rank, world_size, opts)


def run_ranks(c: int, opts: dict) -> list[dict]:
    """Run :func:`_worker_body` on ``c`` spawned gloo ranks (the examples' launcher); every rank's
    result (a rank's error is raised here as RuntimeError with its traceback)."""
    if os.path.join(REPO_ROOT, "examples") not in sys.path:
        sys.path.insert(0, os.path.join(REPO_ROOT, "examples"))
    from _launch import launch

    return launch(_rank_main, c, opts, use_cuda=False)


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def summarize(per_rank: list[dict], algorithms: list[str]) -> list[dict]:
    """Rows of the table from rank 0's timings and every rank's collective counts."""
    rows = []
    for a in algorithms:
        r0 = per_rank[0][a]
        times = [t for rnd in r0["rounds"] for t in rnd]
        per_call = r0["per_call"]
        rows.append(dict(algorithm=a, us_median=round(statistics.median(times), 1),
                         us_p10=round(_quantile(times, 0.1), 1), us_p90=round(_quantile(times, 0.9), 1),
                         round_medians=[round(statistics.median(rnd), 1) for rnd in r0["rounds"]],
                         collectives_per_call=round(sum(per_call.values()), 3), collectives=per_call,
                         first_call_collectives=r0["first_call"],
                         same_counts_on_every_rank=all(p[a]["per_call"] == per_call for p in per_rank)))
    return rows


def main(args: argparse.Namespace) -> int:
    import cpattn

    algorithms = [a for a in args.algorithms.split(",") if a]
    unknown = [a for a in algorithms if a not in ALGORITHM_ORDER]
    if unknown:
        raise SystemExit(f"--algorithms: unknown {unknown}; choose from {list(ALGORITHM_ORDER)}")
    if args.cp < 2:
        raise SystemExit("--cp must be at least 2")
    opts = dict(dtype=args.dtype, tiny=args.tiny, algorithms=algorithms, calls=args.calls, rounds=args.rounds,
                warmup=args.warmup, count_calls=3, dump=args.dump)
    info = header(f"benchmarks/run.py plan_algorithms --cp {args.cp} --calls {args.calls} --rounds {args.rounds} "
                  f"--dtype {args.dtype}" + (" --tiny" if args.tiny else ""))
    info.update(label=args.label, cpattn=getattr(cpattn, "__version__", "?"), cp=args.cp, dtype=args.dtype,
                workload=workload(args.tiny), backend="torch", device="cpu")
    progress(f"plan_algorithms: {info['machine']}; cpattn {info['cpattn']}; C={args.cp}; "
             f"{len(algorithms)} algorithms x {args.rounds} rounds x {args.calls} calls")
    rows = summarize(run_ranks(args.cp, opts), algorithms)
    write_json(args.out + ".json", dict(info, rows=rows))
    print(f"C={args.cp} {args.dtype} cpattn {info['cpattn']} ({args.label}); {info['machine']}")
    print(f"{'algorithm':12s} {'us/call':>9s} {'p10':>9s} {'p90':>9s} {'coll/call':>9s}  collectives")
    for r in rows:
        names = ", ".join(f"{k} {v:g}" for k, v in sorted(r["collectives"].items())) or "-"
        print(f"{r['algorithm']:12s} {r['us_median']:9.1f} {r['us_p10']:9.1f} {r['us_p90']:9.1f} "
              f"{r['collectives_per_call']:9g}  {names}")
    return 0
