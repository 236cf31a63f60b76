"""One call of each backend on dense zigzag workloads, each inside its own profiler range, for
Nsight Compute (``ncu --profile-from-start off``): where the triton sm90 kernel's time goes
against FA4's on the points where it trails (16k C = 1 at d128 / d192, issue 14).

Usage (GPU machine, repository root; FA4 optional):
``ncu --profile-from-start off --clock-control none --section SpeedOfLight ... \\
    python3 tools/gpu/ncu_dense.py --workloads "d128 S=16k zigzag C=1,d128 S=16k zigzag C=2"``
Each backend is warmed up (compiled, 3 calls) before its profiled call; the printed lines give
the order of the profiled ranges (workload, backend, plan family) and the call's event time.
``--bench-args`` are ``python -m cpattn.bench kernel``'s workload options (which workloads exist,
e.g. ``"--mla-seqs 16384 --decode-batches 8,64 --decode-lens 4096"`` for the absorbed-MLA prefill
and decode points); K/V (or the latent) come from the benchmark's own tensor pool.
"""

from __future__ import annotations

import argparse

import torch

import cpattn
from cpattn.bench import kernel as kb


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workloads", default="d128 S=16k zigzag C=1,d128 S=16k zigzag C=2,d192 S=16k zigzag C=1")
    p.add_argument("--backends", default="triton,fa4")
    p.add_argument("--bench-args", default="--shapes d128,d192 --seqs 16384,65536 --no-paged",
                   help="python -m cpattn.bench kernel's workload options")
    a = p.parse_args()
    names = [w.strip() for w in a.workloads.split(",") if w.strip()]
    parser = argparse.ArgumentParser()
    kb.add_arguments(parser)
    args = parser.parse_args(a.bench_args.split())
    by_name = {w.name: w for w in kb.all_workloads(args)}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise SystemExit(f"unknown workloads {missing} (known: {sorted(by_name)})")
    tensors = kb._Tensors("cuda")
    for name in names:
        w = by_name[name]
        if w.page is not None:
            raise SystemExit(f"{name}: paged workloads are not profiled here")
        hq, hkv, d, dv = kb.SHAPES[w.shape]
        k, v = tensors.get(w.shape, tuple(e + p for e, p in zip(w.ext, w.prefix)))
        s = cpattn.get_strategy(w.strategy, w.cp, pad_multiple=64)
        meta = s.build_metadata(list(w.ext), list(w.prefix), rank=0).to("cuda")
        q = torch.randn(meta.num_physical_tokens, hq, d, device="cuda", dtype=torch.bfloat16, generator=tensors.gen)
        for backend in [b for b in a.backends.split(",") if b]:
            try:
                fn, family = kb._plan_fn(s, q, k, v, meta, None, backend, {})
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
            except Exception as exc:  # FA4 not installed, say
                print(f"{name} {backend}: skipped ({type(exc).__name__}: {exc})"[:200], flush=True)
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.profiler.start()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            print(f"profiled: {name} | {backend} | {family} | {start.elapsed_time(end):.3f} ms", flush=True)


if __name__ == "__main__":
    main()
