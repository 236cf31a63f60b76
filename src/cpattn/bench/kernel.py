"""``python -m cpattn.bench kernel``: attention TF/s on one rank's CP work (one GPU).

For each head shape and total sequence length S (one sequence, no prefix), rank 0's work under
zigzag C = 1, 2, 4, 8 (q = two blocks, k = the whole sequence; C = 1 is plain causal), interleave
C = 4, and zigzag C = 2 with a paged cache (page 64). Backends on the same tensors:

* ``triton``: ``plan.run(...)`` of a plan built once per workload with ``backend="triton"`` (one
  launch; on sm_90 the warp-specialized Gluon kernel wherever it applies, else the portable one).
* ``triton-portable``: the portable Triton kernel alone (``backend_options={"family": "portable"}``).
* ``fa4``: ``plan.run(...)`` of an ``backend="fa4"`` plan (one varlen launch plus output set-up).
* ``fa4-raw``: ``flash_attn.cute.flash_attn_varlen_func`` called directly with the same
  per-segment arguments, to show the fa4 backend's overhead.
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``, one call per segment (zigzag:
  two calls) with ``is_causal`` when the segment starts at position 0 and
  ``causal_lower_right(L, last + 1)`` otherwise; K/V heads expanded to Hq beforehand (not timed).
  No exact fast SDPA form exists for interleave (per-row stride causality) or a page table.

FLOPs = 2 * Hq * sum over query rows of attended keys * (D + Dv). TF/s from ``iters`` calls issued
back to back between two CUDA events (median of 3 repeats; host launch work hidden behind the
queue); ``ms_sync`` in the JSON is one call between events followed by a sync (median of 3), which
adds the host's per-call work for short kernels.
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional

import torch

from .common import default_out, header, progress, time_cuda, time_cuda_back_to_back, write_json

SHAPES = {"d128": (32, 8, 128, 128), "d192": (16, 16, 192, 128)}
BACKENDS = ("triton", "triton-portable", "fa4", "fa4-raw", "sdpa")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default="d128,d192", help="comma list of " + ",".join(SHAPES))
    p.add_argument("--seqs", default="16384,65536,131072", help="total sequence lengths S")
    p.add_argument("--cps", default="1,2,4,8", help="zigzag CP sizes (rank 0's work)")
    p.add_argument("--no-interleave", action="store_true", help="skip the interleave C=4 workload")
    p.add_argument("--no-paged", action="store_true", help="skip the paged (page 64) workload")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma list of " + ",".join(BACKENDS))
    p.add_argument("--iters", type=int, default=10, help="timed iterations (fewer for > 100 ms calls)")
    p.add_argument("--out", default=default_out("kernel"),
                   help="output path without extension (.json, .png); docs figures: --out docs/benchmarks/kernel-h200")
    p.add_argument("--triton-config", default=None, help="BLOCK_M,BLOCK_N,warps,stages: skip autotuning")


def _flops(meta, hq: int, d: int, dv: int) -> float:
    pairs = 0
    for _, _, length, pos0, stride in meta.host_segments:
        pairs += length * (pos0 + 1) + stride * length * (length - 1) // 2
    return 2.0 * hq * pairs * (d + dv)


def _sdpa_fn(q, k, v, meta, group: int) -> Callable[[], object]:
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    ke = k.repeat_interleave(group, dim=1) if group > 1 else k
    ve = v.repeat_interleave(group, dim=1) if group > 1 else v
    calls = []
    for _, row0, length, pos0, _ in meta.host_segments:
        last = pos0 + length - 1
        qs = q[row0 : row0 + length].transpose(0, 1).unsqueeze(0)
        ks = ke[: last + 1].transpose(0, 1).unsqueeze(0)
        vs = ve[: last + 1].transpose(0, 1).unsqueeze(0)
        if pos0 == 0:
            calls.append((qs, ks, vs, None))
        else:
            calls.append((qs, ks, vs, causal_lower_right(length, last + 1)))

    def run():
        for qs, ks, vs, bias in calls:
            if bias is None:
                F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            else:
                F.scaled_dot_product_attention(qs, ks, vs, attn_mask=bias)

    return run


def varlen_descriptors(meta, device) -> dict:
    """FA4's varlen arguments for the segments of ``meta`` (what the fa4 backend plans)."""
    segs = meta.host_segments
    cu_kv = meta.host.cu_kv_lens.tolist() if meta.host is not None else meta.cu_kv_lens.tolist()
    i32 = dict(dtype=torch.int32, device=device)
    return dict(
        cu_seqlens_q=torch.tensor([r0 for _, r0, *_ in segs] + [meta.num_local_tokens], **i32),
        cu_seqlens_k=torch.tensor([cu_kv[b] for b, *_ in segs] + [cu_kv[-1]], **i32),
        seqused_k=torch.tensor([p0 + (n - 1) * st + 1 for _, _, n, p0, st in segs], **i32),
        max_seqlen_q=meta.max_seg_len, max_seqlen_k=meta.max_seg_keys,
    )


def _fa4_raw_fn(q, k, v, meta, page_table) -> Optional[Callable[[], object]]:
    from flash_attn.cute import flash_attn_varlen_func

    kw = dict(varlen_descriptors(meta, q.device), causal=True)
    if page_table is not None:
        kw.pop("cu_seqlens_k")
        kw["page_table"] = page_table.index_select(0, meta.seg_seq[: meta.num_segments].long()).contiguous()
    return lambda: flash_attn_varlen_func(q, k, v, **kw)


def _workloads(args) -> list[tuple[str, str, int, Optional[int]]]:
    out = [(f"zigzag C={c}", "zigzag", c, None) for c in (int(x) for x in args.cps.split(","))]
    if not args.no_interleave:
        out.append(("interleave C=4", "interleave", 4, None))
    if not args.no_paged:
        out.append(("zigzag C=2 paged64", "zigzag", 2, 64))
    return out


def main(args: argparse.Namespace) -> int:
    import cpattn

    if not torch.cuda.is_available():
        raise SystemExit("the kernel benchmark needs a CUDA device")
    backends = [b for b in args.backends.split(",") if b]
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as exc:
        progress(f"flash_attn.cute not importable ({exc}); skipping fa4 and fa4-raw")
        backends = [b for b in backends if not b.startswith("fa4")]
    triton_kw = {}
    if args.triton_config:
        bm, bn, w, s = (int(x) for x in args.triton_config.split(","))
        triton_kw = dict(block_m=bm, config=(bn, w, s), family="portable")
    info = header("python -m cpattn.bench kernel " + " ".join(_argv_summary(args)))
    progress(f"{info['machine']}; backends {backends}")
    dev = "cuda"
    rows: list[dict] = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for shape in args.shapes.split(","):
        hq, hkv, d, dv = SHAPES[shape]
        for seq in (int(x) for x in args.seqs.split(",")):
            k = torch.randn(seq, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
            v = torch.randn(seq, hkv, dv, device=dev, dtype=torch.bfloat16, generator=gen)
            for name, strategy_name, cp, page in _workloads(args):
                s = cpattn.get_strategy(strategy_name, cp, pad_multiple=64)
                meta = s.build_metadata([seq], rank=0).to(dev)
                q = torch.randn(meta.num_physical_tokens, hq, d, device=dev, dtype=torch.bfloat16, generator=gen)
                kk, vv, table = k, v, None
                if page is not None:
                    pages = -(-seq // page)
                    perm = torch.randperm(pages, device=dev)
                    kk = torch.zeros(pages, page, hkv, d, device=dev, dtype=k.dtype)  # finite tail rows
                    vv = torch.zeros(pages, page, hkv, dv, device=dev, dtype=v.dtype)
                    kk.view(-1, hkv, d)[: seq].copy_(k)  # logical page j at physical page perm[j]
                    vv.view(-1, hkv, dv)[: seq].copy_(v)
                    kk, vv = kk[torch.argsort(perm)], vv[torch.argsort(perm)]
                    table = perm[None, :].to(torch.int32)
                flops = _flops(meta, hq, d, dv)
                workload = f"{shape} S={seq // 1024}k {name}"
                for backend in backends:
                    fn = _make_fn(backend, s, q, kk, vv, meta, table, hq // hkv, strategy_name, triton_kw)
                    if fn is None:
                        continue
                    est = flops / 500e12 * 1e3
                    iters = max(3, min(args.iters, int(1000 / max(est, 1e-3))))
                    try:
                        ms = time_cuda_back_to_back(fn, warmup=2, iters=iters)
                        ms_sync = time_cuda(fn, warmup=0, iters=3)
                    except Exception as exc:  # a backend that cannot run this shape
                        progress(f"{workload:38s} {backend:8s} failed: {type(exc).__name__}: {exc}"[:300])
                        continue
                    tflops = flops / (ms * 1e-3) / 1e12
                    rows.append(dict(workload=workload, backend=backend, tflops=round(tflops, 1), ms=round(ms, 4),
                                     ms_sync=round(ms_sync, 4), tflops_sync=round(flops / (ms_sync * 1e-3) / 1e12, 1)))
                    progress(f"{workload:38s} {backend:15s} {ms:9.3f} ms {tflops:7.1f} TF/s "
                             f"(one call + sync: {ms_sync:.3f} ms)")
                del q
            del k, v
    try:
        from ..kernels.triton_attn import tuned_configs

        for key, cfg in tuned_configs().items():
            progress(f"triton autotune {key}: {cfg}")
    except Exception:
        pass
    write_json(args.out + ".json", rows)
    _plot(rows, args.out + ".png", info)
    _print_table(rows, backends)
    return 0


def _plan_fn(s, q, k, v, meta, table, backend, options):
    hq, d = q.shape[1], q.shape[2]
    plan = s.plan_attention(meta, num_q_heads=hq, num_kv_heads=k.shape[-2], head_dim=d, head_dim_v=v.shape[-1],
                            dtype=q.dtype, page_size=k.shape[1] if table is not None else None, backend=backend,
                            backend_options=options)
    return lambda: plan.run(q, k, v, page_table=table)


def _make_fn(backend, s, q, k, v, meta, table, group, strategy_name, triton_kw):
    if backend == "triton":
        return _plan_fn(s, q, k, v, meta, table, "triton", triton_kw)
    if backend == "triton-portable":
        return _plan_fn(s, q, k, v, meta, table, "triton", {**triton_kw, "family": "portable"})
    if backend == "fa4":
        if strategy_name == "interleave":
            return None
        return _plan_fn(s, q, k, v, meta, table, "fa4", {})
    if backend == "fa4-raw":
        if strategy_name == "interleave":
            return None
        return _fa4_raw_fn(q, k, v, meta, table)
    if backend == "sdpa":
        if strategy_name == "interleave" or table is not None:
            return None
        return _sdpa_fn(q, k, v, meta, group)
    raise ValueError(f"unknown backend {backend!r}")


def _argv_summary(args) -> list[str]:
    out = [f"--shapes {args.shapes}", f"--seqs {args.seqs}", f"--cps {args.cps}"]
    if args.no_interleave:
        out.append("--no-interleave")
    if args.no_paged:
        out.append("--no-paged")
    return out


def _print_table(rows: list[dict], backends: list[str]) -> None:
    table: dict[str, dict[str, float]] = {}
    for r in rows:
        table.setdefault(r["workload"], {})[r["backend"]] = r["tflops"]
    print("| workload | " + " | ".join(backends) + " |")
    print("| --- | " + " | ".join("---:" for _ in backends) + " |")
    for workload, vals in table.items():
        cells = [f"{vals[b]:.0f}" if b in vals else "-" for b in backends]
        print(f"| {workload} | " + " | ".join(cells) + " |")


def _plot(rows: list[dict], path: str, info: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("matplotlib missing: no plot")
        return
    shapes = sorted({r["workload"].split(" ")[0] for r in rows})
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    fig, axes = plt.subplots(len(shapes), 1, figsize=(14, 4.5 * max(1, len(shapes))), squeeze=False)
    for ax, shape in zip(axes[:, 0], shapes):
        workloads = list(dict.fromkeys(r["workload"] for r in rows if r["workload"].startswith(shape + " ")))
        width = 0.8 / max(1, len(backends))
        for i, b in enumerate(backends):
            vals = {r["workload"]: r["tflops"] for r in rows if r["backend"] == b}
            xs = [j + i * width for j, w in enumerate(workloads) if w in vals]
            ax.bar(xs, [vals[w] for w in workloads if w in vals], width, label=b)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))])
        ax.set_xticklabels([w[len(shape) + 1 :] for w in workloads], rotation=45, ha="right", fontsize=8)
        ax.set_ylabel("TF/s")
        ax.set_title(f"{shape}: rank-0 CP attention work, causal bf16")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{info['machine']}, {info['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    progress(f"wrote {path}")
