"""Tuning aid (GPU): the fused cross-rank merge (``merge_parts``) against plain bandwidth.

C = 8 parts [C, N, H, Dv] (contiguous, bf16 and fp32) for decode shapes: µs per call (20 calls
in one CUDA graph) of the fused kernel for several (BLOCK_S, BLOCK_H, BLOCK_DV, num_warps), and
of ``parts.sum(0)`` (a bandwidth reference reading the same bytes).

Run: ``PYTHONPATH=src:tools/gpu python tools/gpu/merge_probe.py``.
"""

from __future__ import annotations

import torch

from cpattn.kernels import triton_decode as td

from combine_sweep import graph_us


def main() -> None:
    for dtype in (torch.bfloat16, torch.float32):
        for c, n, h, dv in ((8, 64, 128, 512), (8, 8, 128, 512), (8, 64, 32, 128)):
            parts = torch.randn(c, n, h, dv, device="cuda", dtype=dtype)
            plse = torch.randn(c, n, h, device="cuda") * 4
            out = torch.empty(n, h, dv, device="cuda", dtype=dtype)
            lse = torch.empty(n, h, device="cuda")
            nbytes = parts.numel() * parts.element_size()
            us = graph_us(lambda: parts.sum(0))
            print(f"{dtype} C={c} N={n} H={h} Dv={dv}: parts.sum(0) {us:6.1f} us ({nbytes / us / 1e3:5.0f} GB/s)",
                  flush=True)
            ps, ls = parts.stride(), plse.stride()
            variants = [(bs, bh, bd, w, one) for bs, bh, bd in ((8, 4, 128), (8, 1, 512), (8, 4, 256), (8, 2, 256))
                        for w in (1, 2, 4) for one in (False, True)]
            for bs, bh, bd, w, one in variants:
                if bd > dv:
                    continue
                grid = (n, -(-h // bh), -(-dv // bd))

                def fn():
                    td._merge_parts[grid](out, lse, parts, plse, c, h, ps[0], ps[1], ps[2], ls[0], ls[1], ls[2],
                                          out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
                                          HEAD_DIM_V=dv, BLOCK_H=bh, BLOCK_S=bs, BLOCK_DV=bd, ONE_PASS=one,
                                          num_warps=w)

                us = graph_us(fn)
                print(f"    ({bs}, {bh}, {bd}, w{w}{', one pass' if one else ''}): {us:6.1f} us ({nbytes / us / 1e3:5.0f} GB/s)", flush=True)


if __name__ == "__main__":
    main()
