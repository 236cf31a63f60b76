"""Tuning aid (GPU): where ``index_topk``'s time goes, and which plan options shorten it.

For rank 0 of interleave C = 8 at the given sequence lengths (DeepSeek-V3.2 indexer: 64 heads x
128, top-k 2048, bf16), prints

* a torch.profiler breakdown of one planned call (CUDA time per kernel name, summed);
* back-to-back ms and effective TF/s (``2 * H_i * D_i`` per visible pair, as
  ``python -m cpattn.bench sparse``) for each option set of the sweep (kernel ``config``
  (BLOCK_N, warps, stages), ``block_m``, ``keys_per_program``, ``max_score_elems``, and the
  chunk slack ``dsa_backend.CHUNK_SLACK``), and whether each set selects the same keys as the default
  (as sets per row; ties may differ: the count of rows whose sets differ is printed).

Run: ``PYTHONPATH=src python tools/gpu/index_topk_sweep.py [--seqs 32768,131072]``.
"""

from __future__ import annotations

import argparse
import collections

import torch

import cpattn
from cpattn.bench.common import time_cuda_back_to_back
from cpattn.bench.sparse import _visible_pairs

SWEEP = [  # plan options; "slack" sets dsa_backend.CHUNK_SLACK for that plan
    {},
    {"config": (128, 8, 2)},  # the no-autotune default before 2026-12-01's third session
    {"config": (128, 4, 4)},
    {"slack": 1.1},
    {"slack": 1.5},
    {"slack": 2.0},
    {"slack": 1.5, "config": (128, 4, 4)},
]


def breakdown(fn) -> list[tuple[str, float]]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    per = collections.Counter()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            per[e.name[:70]] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return per.most_common(8)


def main() -> None:
    from cpattn.kernels import dsa_backend

    default_slack = dsa_backend.CHUNK_SLACK
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="32768,131072")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    dev = "cuda"
    hi, di, topk = 64, 128, 2048
    g = torch.Generator(device=dev).manual_seed(0)
    for s_len in (int(x) for x in args.seqs.split(",")):
        s = cpattn.get_strategy("interleave", 8)
        meta = s.build_metadata([s_len], rank=0).to(dev)
        p = meta.num_physical_tokens
        q = torch.randn(p, hi, di, generator=g, device=dev).bfloat16()
        k = torch.randn(s_len, di, generator=g, device=dev).bfloat16()
        w = torch.randn(p, hi, generator=g, device=dev) * hi**-0.5
        pairs = _visible_pairs(meta)
        ref = None
        for opts in SWEEP:
            dsa_backend.CHUNK_SLACK = opts.get("slack", default_slack)
            plan = cpattn.plan_index_topk(meta, num_heads=hi, head_dim=di, q_dtype=q.dtype, k_dtype=k.dtype,
                                          topk=topk, backend="triton",
                                          backend_options={k_: v_ for k_, v_ in opts.items() if k_ != "slack"})
            out = torch.empty(p, topk, dtype=torch.int32, device=dev)
            fn = lambda: plan.run(q, k, w, out=out)  # noqa: E731
            ms = time_cuda_back_to_back(fn, warmup=2, iters=args.iters)
            sel = out.sort(1).values
            if ref is None:
                ref, differ = sel.clone(), 0
                impl = plan._impl
                print(f"S={s_len // 1024}k: {len(impl.chunks)} chunks, buffer {impl.buffer_elems / 2**20:.0f} Mi "
                      f"floats, windows {[len(c[4]) for c in impl.chunks]}")
                for name, us in breakdown(fn):
                    print(f"    {us / 1e3:8.3f} ms  {name}")
            else:
                differ = int((sel != ref).any(1).sum())
            print(f"S={s_len // 1024}k {str(opts):40s} {ms:8.3f} ms {2.0 * hi * di * pairs / ms / 1e9:6.1f} TF/s "
                  f"(rows whose set differs from the default: {differ})", flush=True)


if __name__ == "__main__":
    main()
