"""Measure the :class:`cpattn.CostModel` rates on this machine and write them as JSON.

    python -m cpattn.calibrate --out cpattn-cost.json                  # one GPU (~30 s)
    torchrun --nproc_per_node C -m cpattn.calibrate --out cpattn-cost.json   # + the link, on C GPUs

What it measures (CUDA events, median of repeated calls, on the current GPU):

* ``matmul_flops_per_s``: an ``M = N = K = 8192`` GEMM in the chosen dtype;
* ``dense_flops_per_s`` and ``launch_overhead_s``: the dense attention kernel (``plan.attend`` of
  a "local" plan; causal single sequences of 1k-16k tokens) fitted as ``t = a + W / rate``
  (W: its FLOPs): the intercept ``a`` is the fixed cost of one kernel on a small batch;
* ``shard_flops_per_s``: the split-KV kernel of a "shard_merge" plan (8 sequences, one query each,
  8k-64k keys), fitted the same way;
* ``hbm_bytes_per_s``: a device-to-device copy of 1 GiB (bytes read + written);
* ``link_bytes_per_s`` and ``collective_latency_s``: under torchrun (C > 1), an all-gather of
  64 MiB and of 4 KiB per rank (received bytes over the time difference; the small one's time).
  On one process they keep the values given (``--link-gbps``, ``--latency-us``; defaults: the
  model's) and the JSON says "assumed".

``--smoke`` runs tiny shapes on the CPU with the torch reference (a check of the command, not a
calibration: the JSON says so). Load the result with ``cpattn.CostModel.load(path)``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .cost import CostModel

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    """``time(fn, reps)``: median seconds of one call (CUDA events on a GPU, perf_counter on the
    CPU), after two warm-up calls."""
    def time_fn(fn, reps: int) -> float:
        fn()
        fn()
        samples = []
        for _ in range(reps):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) * 1e-3)
            else:
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    return time_fn


def fit_rate(work: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``seconds = a + work / rate`` over >= 2 points: ``(rate, a)`` with ``a``
    clamped to >= 1 ns and ``rate`` to the largest observed ``work / seconds`` when the fit's
    slope is not positive (noise on flat points)."""
    n = len(work)
    if n < 2 or n != len(seconds):
        raise ValueError(f"fit_rate needs >= 2 (work, seconds) pairs, got {n} and {len(seconds)}")
    mw, ms = sum(work) / n, sum(seconds) / n
    var = sum((w - mw) ** 2 for w in work)
    slope = sum((w - mw) * (s - ms) for w, s in zip(work, seconds)) / var if var > 0 else 0.0
    if slope <= 0:
        return max(w / s for w, s in zip(work, seconds)), max(min(seconds), 1e-9)
    return 1.0 / slope, max(ms - slope * mw, 1e-9)


def measure(args, device: torch.device, group=None) -> tuple[CostModel, dict]:
    """(the calibrated model, what was measured) on ``device``."""
    import cpattn

    dtype = _DTYPES[args.dtype]
    timed = _timer(device)
    reps = 3 if args.smoke else 20
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype)
    backend = "torch" if args.smoke else "auto"
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)

    info: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  "torch": torch.__version__, "dtype": args.dtype, "smoke": bool(args.smoke),
                  "date": datetime.date.today().isoformat(), "shape": {"heads": hq, "kv_heads": hkv, "head_dim": d}}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass

    # GEMM
    n = 256 if args.smoke else 8192
    a, b = randn(n, n), randn(n, n)
    t = timed(lambda: a @ b, reps)
    matmul = 2 * n**3 / t
    info["matmul"] = {"n": n, "seconds": t}

    # dense attention kernel: t = a + W / rate
    lengths = (64, 128, 256) if args.smoke else (1024, 4096, 16384)
    flop_pair = 2.0 * hq * 2 * d
    points = []
    family = None
    for length in lengths:
        meta = cpattn.get_strategy("replicated", 1).build_metadata([length], rank=0).to(device)
        plan = cpattn.plan_attention(meta, spec, backend=backend)
        family = plan.family
        q, k, v = randn(length, hq, d), randn(length, hkv, d), randn(length, hkv, d)
        points.append((length * (length + 1) / 2 * flop_pair, timed(lambda: plan.attend(q, k, v), reps)))
    dense, launch = fit_rate([w for w, _ in points], [s for _, s in points])
    info["dense"] = {"family": family, "points": [{"flops": w, "seconds": s} for w, s in points]}

    # split-KV shard kernel
    keys = (256, 1024) if args.smoke else (8192, 65536)
    batch = 8
    points = []
    for length in keys:
        meta = cpattn.get_strategy("replicated", 1).build_metadata(
            [1] * batch, [length - 1] * batch, rank=0, kv=cpattn.KVSharding(1)).to(device)
        plan = cpattn.plan_attention(meta, spec, backend=backend)
        family = plan.family
        q, k, v = randn(batch, hq, d), randn(batch * length, hkv, d), randn(batch * length, hkv, d)
        points.append((batch * length * flop_pair, timed(lambda: plan.attend(q, k, v), reps)))
    shard, _ = fit_rate([w for w, _ in points], [s for _, s in points])
    info["shard"] = {"family": family, "points": [{"flops": w, "seconds": s} for w, s in points]}

    # HBM copy
    nbytes = (1 << 20) if args.smoke else (1 << 30)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), reps)
    hbm = 2 * nbytes / t
    info["hbm"] = {"bytes": nbytes, "seconds": t}

    # link
    base = CostModel()
    link = args.link_gbps * 1e9 if args.link_gbps else base.link_bytes_per_s
    latency = args.latency_us * 1e-6 if args.latency_us else base.collective_latency_s
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if world > 1:
        big, small = (1 << 20 if args.smoke else 64 << 20), 4096
        times = {}
        for size in (small, big):
            x = torch.empty(size, dtype=torch.uint8, device=device)
            y = torch.empty(size * world, dtype=torch.uint8, device=device)
            times[size] = timed(lambda: dist.all_gather_into_tensor(y, x, group=group), reps)
        latency = times[small]
        link = (world - 1) * (big - small) / max(times[big] - times[small], 1e-9)
        info["link"] = {"measured": True, "ranks": world, "seconds": {str(k): v for k, v in times.items()}}
    else:
        info["link"] = {"measured": False, "assumed": "one process: link rate and latency as given"}
    model = CostModel(link_bytes_per_s=link, dense_flops_per_s=dense, shard_flops_per_s=shard, hbm_bytes_per_s=hbm,
                      collective_latency_s=latency, launch_overhead_s=launch, matmul_flops_per_s=matmul)
    return model, info


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cpattn.calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="cpattn-cost.json", help="JSON to write (rank 0 writes it)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument("--heads", type=int, default=32, help="query heads of the measured attention shape")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--link-gbps", type=float, default=None, help="link rate (GB/s) on one process")
    p.add_argument("--latency-us", type=float, default=None, help="collective latency (us) on one process")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the command only)")
    args = p.parse_args(argv)
    if args.smoke:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("python -m cpattn.calibrate needs a CUDA GPU (or --smoke for a CPU check of the command)",
              file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda", torch.cuda.current_device())

    group = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device.type == "cuda":
            torch.cuda.set_device(local)
            device = torch.device("cuda", local)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    model, info = measure(args, device, group)
    if not dist.is_initialized() or dist.get_rank() == 0:
        model.save(args.out, info)
        rates = model.to_dict()
        print(f"wrote {args.out}" + (" (smoke run: not a calibration)" if args.smoke else ""))
        for name in sorted(rates):
            print(f"  {name} = {rates[name]:.4g}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
