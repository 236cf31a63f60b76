"""``python benchmarks/run.py sparse``: DSA sparse attention and index top-k on one rank's CP work.

For each sequence length S (one sequence, no prefix) the work of rank ``--rank`` under
``--strategy`` with ``--cp`` ranks (default: rank 0 of interleave C = 8, as DSA models run
prefill CP), DeepSeek-V3.2 shapes, bf16:

* ``index_topk``: H_i = 64 index heads x D_i = 128, top-k 2048, bf16 keys (and ``--fp8``: fp8
  e4m3 keys with a float32 scale per key). Effective TF/s on the score FLOPs
  ``2 * H_i * D_i * (visible pairs)`` (every row scores every key at positions <= its own).
* ``sparse_attention``: absorbed MLA (128 heads, D 576 / Dv 512, ``v = k[..., :512]``) over the
  selection ``index_topk`` just made (random inputs: a near-random selection). TF/s with FLOPs
  ``2 * H * (576 + 512) * (valid selected keys)``. The triton backend runs once per kernel family
  of ``--families`` (default ``mla,portable``: the Hopper MLA sparse kernel and the portable one,
  so one run gives the before / after); each row records ``plan.family`` and the largest
  difference of its output from the first family's (a self-check: bf16 rounding, ~1e-2).

Timing: ``iters`` calls back to back between two CUDA events (median of 3 repeats), after a
warm-up that also runs the autotuner; the plans are built once per workload (per forward).
GPU targets: sparse attention >= 450 TF/s (FlashMLA's sparse prefill: 640 TF/s on H800),
index_topk >= 300 TF/s. Writes JSON rows {workload, op, backend, ms, tflops, work} and a PNG
(bench-out/sparse.*; a CPU smoke run: bench-out/sparse-cpu-smoke.*, without targets).

    python benchmarks/run.py sparse                                # the GPU run
    python benchmarks/run.py sparse --small --device cpu           # CPU smoke run (torch backend)
"""

from __future__ import annotations

import argparse
import itertools

import torch

from .common import default_out, device_timer, header, progress, smoke_notice, write_json
from .kernel import parse_options

TARGETS = {"sparse_attention": 450.0, "index_topk": 300.0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    cuda = torch.cuda.is_available()
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if cuda else "cpu")
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--seqs", default=None, help="sequence lengths (default 32768,131072; small: 256)")
    p.add_argument("--strategy", default="interleave")
    p.add_argument("--cp", type=int, default=8, help="CP size whose rank's work is timed")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--backends", default=None, help="comma list of triton,torch (default: triton on CUDA, torch on CPU)")
    p.add_argument("--fp8", action="store_true", help="also time index_topk with fp8 keys + fp32 scales")
    p.add_argument("--families", default="mla,portable",
                   help="sparse-attention kernel families of the triton backend (comma list of auto,mla,portable; "
                        "a family that cannot run here is skipped with a note)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None,
                   help="output path without extension (JSON + PNG; default bench-out/sparse, CPU smoke run: "
                        "bench-out/sparse-cpu-smoke)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--sparse-options", default="",
                   help="';'-separated backend option sets (name=value,...) of the triton sparse backend, each "
                        "timed as its own row, e.g. 'l2_prefetch=0;l2_prefetch=2' (empty: the defaults)")


def dsa_shapes(small: bool) -> dict:
    """DeepSeek-V3.2's DSA shapes, or tiny ones (CPU smoke runs)."""
    if small:
        return dict(heads=4, latent=32, rope=16, topk=16, index_heads=2, index_dim=16)
    return dict(heads=128, latent=512, rope=64, topk=2048, index_heads=64, index_dim=128)


def _visible_pairs(meta) -> int:
    pairs = 0
    for _, _, length, pos0, stride in meta.host_segments:
        pairs += length * (pos0 + 1) + stride * length * (length - 1) // 2
    return pairs


def _run_workload(s_len: int, args, shp: dict, backends: list[str], device: torch.device, timer) -> list[dict]:
    import cpattn
    from cpattn import dsa

    strategy = cpattn.get_strategy(args.strategy, args.cp)
    meta = strategy.build_metadata([s_len], rank=args.rank).to(device)
    p, n = meta.num_physical_tokens, meta.num_local_tokens
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    hi, di, topk = shp["index_heads"], shp["index_dim"], shp["topk"]
    h, d, dv = shp["heads"], shp["latent"] + shp["rope"], shp["latent"]
    name = f"S={s_len // 1024}k {args.strategy} C={args.cp} rank {args.rank}" if s_len >= 1024 else \
        f"S={s_len} {args.strategy} C={args.cp} rank {args.rank}"
    rows = []

    q_idx = torch.randn(p, hi, di, generator=g, device=device).to(dtype)
    k_idx = torch.randn(s_len, di, generator=g, device=device).to(dtype)
    w = torch.randn(p, hi, generator=g, device=device) * hi**-0.5
    pairs = _visible_pairs(meta)
    index_cases = [("bf16 keys", k_idx, None)]
    if args.fp8:
        scale = k_idx.float().abs().amax(-1) / 448.0
        index_cases.append(("fp8 keys", (k_idx.float() / scale[:, None]).to(torch.float8_e4m3fn), scale))
    idx = None
    for backend in backends:
        for label, keys, k_scale in index_cases:
            if backend == "torch" and k_scale is not None:
                continue
            progress(f"{name}: index_topk {label} backend={backend}")
            out = torch.empty(p, topk, dtype=torch.int32, device=device)
            fn = lambda: dsa.index_topk(q_idx, keys, w, meta, topk, k_scale=k_scale, backend=backend, out=out)  # noqa: E731
            ms = timer(fn)
            rows.append(dict(workload=name, op="index_topk", variant=label, backend=backend, family="-", ms=ms,
                             tflops=2.0 * hi * di * pairs / ms / 1e9, work=pairs, rows=n))
            if idx is None and k_scale is None:
                idx = out.clone()

    q = torch.randn(p, h, d, generator=g, device=device).to(dtype)
    latent = torch.randn(s_len, 1, d, generator=g, device=device).to(dtype)
    pos = torch.full((p,), -1, dtype=torch.long, device=device)
    pos[:n] = meta.local_positions
    valid = int(((idx >= 0) & (idx <= pos[:, None])).sum())
    first = None
    for backend in backends:
        families = [f for f in args.families.split(",") if f] if backend == "triton" else [None]
        option_sets = [parse_options(t, "--sparse-options") for t in args.sparse_options.split(";")] \
            if backend == "triton" else [{}]
        for family, opts in itertools.product(families, option_sets):
            label = f"backend={backend}" + (f" family={family}" if family else "") + (f" {opts}" if opts else "")
            progress(f"{name}: sparse_attention {label} ({valid} valid selected keys)")
            options = dict({"family": family} if family else {}, **opts)
            try:
                spec = cpattn.AttentionSpec(num_q_heads=h, num_kv_heads=1, head_dim=d, head_dim_v=dv, dtype=dtype,
                                            topk=topk)
                plan = cpattn.plan_attention(meta, spec, backend=backend, backend_options=options or None)
            except (ValueError, NotImplementedError) as exc:
                progress(f"{name}: skipped {label}: {exc}")
                continue
            out = torch.empty(p, h, dv, dtype=dtype, device=device)
            ms = timer(lambda: plan.attend(q, latent, latent[..., :dv], idx, softmax_scale=192**-0.5, out=out))
            if first is None:
                first, diff = out.clone(), 0.0
            else:
                diff = (out[:n].float() - first[:n].float()).abs().max().item() if n else 0.0
            rows.append(dict(workload=name, op="sparse_attention", variant=f"absorbed {d}/{dv}", backend=backend,
                             family=plan.family, options=opts, ms=ms, tflops=2.0 * h * (d + dv) * valid / ms / 1e9,
                             work=valid, rows=n, max_diff_vs_first=diff))
    return rows


def _tuned() -> dict:
    """Autotuner choices of the DSA kernels in this run (GPU; empty under the interpreter)."""
    import sys

    out = {}
    for name in ("triton_sparse", "triton_index"):
        mod = sys.modules.get(f"cpattn.kernels.{name}")
        if mod is not None:
            out[name] = mod.tuned_configs()
    return out


def _plot(rows: list[dict], path: str, targets: bool = True) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("matplotlib missing: no plot")
        return
    ops = ["index_topk", "sparse_attention"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, op in zip(axes, ops):
        sel = [r for r in rows if r["op"] == op]
        labels = [f"{r['workload'].split(' ')[0]}\n{r['variant']}\n{r['backend']} {r['family']}" for r in sel]
        ax.bar(range(len(sel)), [r["tflops"] for r in sel], color="tab:blue")
        if targets:
            ax.axhline(TARGETS[op], color="tab:red", linestyle="--", label=f"target {TARGETS[op]:.0f} TF/s")
        ax.set_xticks(range(len(sel)), labels, fontsize=7)
        ax.set_ylabel("TF/s")
        ax.set_title(op)
        if targets:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    progress(f"wrote {path}")


def main(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA device (use --small --device cpu for a smoke run)")
    smoke = device.type == "cpu"  # tiny shapes or not, CPU numbers measure nothing of the kernels
    if smoke:
        smoke_notice("sparse")
    shp = dsa_shapes(args.small)
    seqs = [int(x) for x in (args.seqs or ("256" if args.small else "32768,131072")).split(",") if x]
    backends = (args.backends or ("triton" if device.type == "cuda" else "torch")).split(",")
    timer = device_timer(device, args.iters, args.warmup)
    rows = []
    for s_len in seqs:
        rows += _run_workload(s_len, args, shp, backends, device, timer)
    target_head = "" if smoke else f" {'target':>7s}"
    print(f"{'workload':34s} {'op':17s} {'variant':17s} {'backend':8s} {'family':9s} {'ms':>10s} {'TF/s':>8s}"
          f"{target_head} {'max|diff|':>9s}")
    for r in rows:
        diff = f"{r['max_diff_vs_first']:9.2e}" if "max_diff_vs_first" in r else f"{'-':>9s}"
        target = "" if smoke else f" {TARGETS[r['op']]:7.0f}"
        print(f"{r['workload']:34s} {r['op']:17s} {r['variant']:17s} {r['backend']:8s} {r['family']:9s} "
              f"{r['ms']:10.3f} {r['tflops']:8.1f}{target} {diff} {r.get('options') or ''}")
    out = args.out or default_out("sparse", smoke=smoke)
    payload = {**header("benchmarks/run.py sparse", smoke=smoke), "shapes": shp, "strategy": args.strategy,
               "cp": args.cp, "rank": args.rank, **({} if smoke else {"targets_tflops": TARGETS}), "rows": rows,
               "tuned_configs": _tuned()}
    write_json(out + ".json", payload)
    if not args.no_plot:
        _plot(rows, out + ".png", targets=not smoke)
    return 0
