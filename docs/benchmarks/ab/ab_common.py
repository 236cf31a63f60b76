"""Set-up shared by the interleaved A/B scripts in this folder. Run them from the repository root
on a CUDA machine: ``PYTHONPATH=src python docs/benchmarks/ab/<script>.py``."""
from __future__ import annotations

import torch

import cpattn
from cpattn.bench.common import time_cuda_back_to_back
from cpattn.bench.kernel import SHAPES, _flops


def rank0_workload(shape: str, seq: int, cp: int, strategy: str = "zigzag"):
    """Rank 0's attention work for one sequence of ``seq`` tokens over ``cp`` ranks, as in
    ``python -m cpattn.bench kernel``: (strategy, metadata, q, k, v, FLOPs)."""
    hq, hkv, d, dv = SHAPES[shape]
    s = cpattn.get_strategy(strategy, cp, pad_multiple=64)
    meta = s.build_metadata([seq], rank=0).to("cuda")
    q = torch.randn(meta.num_physical_tokens, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(seq, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(seq, hkv, dv, device="cuda", dtype=torch.bfloat16)
    return s, meta, q, k, v, _flops(meta, hq, d, dv)


def interleaved_tflops(variants, flops: float, seconds: float, repeats: int = 2) -> dict[str, list[float]]:
    """TF/s of each ``(name, setup, fn)`` variant, ``repeats`` rounds in alternating order (``setup``
    runs before each timing); each timing issues about ``seconds`` of calls back to back."""
    iters = max(3, int(seconds / (flops / 600e12)))
    res: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    for rep in range(repeats):
        for name, setup, fn in variants if rep % 2 == 0 else variants[::-1]:
            setup()
            res[name].append(flops / time_cuda_back_to_back(fn, 2, iters, 2) / 1e9)
    return res
