"""``torchrun --nproc_per_node 2 benchmarks/run.py mla``: MLA (DeepSeek-V3) under CP.

Three parts, DeepSeek-V3 shapes by default (128 heads, hidden 7168, q_lora 1536, r = 512,
d_rope = 64, d_nope = 128, d_v = 128), bf16, one sequence per token count (32k, 128k):

1. bytes per token: the latent (``cpattn.mla_bytes_per_token``) vs up-projected K/V
   (``cpattn.kv_bytes_per_token``), and the packed all-gather row actually sent (alignment included).
2. gather (CP = world size, zigzag): ``strategy.gather_mla_latent`` (kv_c [P, 512] + k_pe [P, 64])
   vs ``strategy.gather_kv`` of the full K [P, 128, 192] / V [P, 128, 128], per call, CUDA events,
   median, max over ranks; plus the effective bandwidth (bytes gathered per rank / time).
3. layer: one :class:`reference_layers.mla.MLAAttention` prefill forward (latent gather, up-projection,
   attention through ``strategy.attention`` with ``--backend``, o_proj) at CP=1 (every rank runs the
   whole sequence alone, rank 0 reported) vs CP=world zigzag (max over ranks), and the speedup.
   GPU target: CP=2 >= 1.85x at 128k (not checked in a CPU smoke run).

Progress on stderr; results on stdout, in ``--out`` (JSON) and a PNG beside it. Without torchrun
(one process) only parts 1 and the CP=1 layer run.

GPU (2 x H200, NCCL, bf16; leave NCCL_NVLS_ENABLE=0 as set)::

    torchrun --nproc_per_node 2 benchmarks/run.py mla

CPU smoke run (gloo, tiny shapes, fp32, torch backend; bench-out/mla-cpu-smoke.json)::

    torchrun --nproc_per_node 2 benchmarks/run.py mla --small --device cpu
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Callable, Optional

import torch
import torch.distributed as dist

import cpattn
from reference_layers.mla import MLAAttention, MLAConfig

from .common import default_out, header, progress, smoke_notice, time_cuda, time_host, write_json

#: The torch reference backend materializes fp32 score chunks: do not time it past this size.
TORCH_BACKEND_MAX_TOKENS = 16 * 1024
TARGET_SPEEDUP = 1.85


def _parse_tokens(text: str) -> list[int]:
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if item:
            out.append(int(float(item.rstrip("k")) * (1024 if item.endswith("k") else 1)))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if cuda else "cpu")
    parser.add_argument("--small", action="store_true",
                        help="tiny shapes for CPU debugging (MLAConfig() defaults, 256 and 1k tokens)")
    parser.add_argument("--tokens", default=None, help="total tokens per config, e.g. 32k,128k (small: 256,1024)")
    parser.add_argument("--strategy", default="zigzag", choices=sorted(cpattn.STRATEGIES))
    parser.add_argument("--backend", default="auto", help="attention backend for the layer (auto, fa4, triton, torch)")
    parser.add_argument("--forms", default="up",
                        help="layer forms to time: up (up-projected K/V), absorbed (latent MQA), or up,absorbed")
    parser.add_argument("--heads", type=int, default=None, help="override the number of heads (default 128)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--no-gather", action="store_true", help="skip the gather comparison")
    parser.add_argument("--no-layer", action="store_true", help="skip the layer comparison")
    parser.add_argument("--out", default=None,
                        help="JSON path (default bench-out/mla.json on GPU, bench-out/mla-cpu-smoke.json on "
                        "CPU); the PNG is written beside it")
    parser.add_argument("--no-plot", action="store_true")


def default_out_path(device_type: str) -> str:
    """JSON path used without ``--out``: bench-out/mla.json, bench-out/mla-cpu-smoke.json on the CPU."""
    return default_out("mla.json", smoke=device_type != "cuda")


# ---------------------------------------------------------------------------------------- helpers
class _Ctx:
    """Device, dtype, process group and the timer of this run."""

    def __init__(self, device: torch.device, dtype: torch.dtype, rank: int, world: int, group) -> None:
        self.device, self.dtype, self.rank, self.world, self.group = device, dtype, rank, world, group

    def time_ms(self, fn: Callable[[], object], warmup: int, iters: int) -> float:
        if self.device.type == "cuda":
            return time_cuda(fn, warmup=warmup, iters=iters)
        return time_host(fn, warmup=warmup, iters=iters)

    def max_over_ranks(self, value: float) -> float:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t.item())

    def free(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _randn(shape, ctx: _Ctx, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=ctx.device).manual_seed(seed)
    return torch.randn(shape, generator=gen, device=ctx.device, dtype=torch.float32).to(ctx.dtype)


def bytes_section(cfg: MLAConfig, dtype: torch.dtype) -> dict:
    latent = cpattn.mla_bytes_per_token(cfg.kv_lora_rank, cfg.qk_rope_head_dim, dtype)
    sent = cpattn.mla_bytes_per_token(cfg.kv_lora_rank, cfg.qk_rope_head_dim, dtype, aligned=True)
    kv = cpattn.kv_bytes_per_token(cfg.num_heads, cfg.qk_head_dim, cfg.v_head_dim, dtype)
    return {
        "latent_bytes_per_token": latent,
        "latent_allgather_row_bytes": sent,
        "kv_bytes_per_token": kv,
        "kv_over_latent": kv / latent,
    }


# ---------------------------------------------------------------------------------------- gather
def run_gather(ctx: _Ctx, cfg: MLAConfig, tokens: int, args) -> dict:
    """gather_mla_latent vs gather_kv for one sequence of ``tokens`` over the CP group."""
    s = cpattn.get_strategy(args.strategy, ctx.world)
    meta = s.build_metadata([tokens], rank=ctx.rank).to(ctx.device)
    p = meta.num_physical_tokens
    rec: dict = {"tokens": tokens, "cp": ctx.world, "strategy": args.strategy}

    kv_c, k_pe = _randn((p, cfg.kv_lora_rank), ctx, 1), _randn((p, cfg.qk_rope_head_dim), ctx, 2)
    ms = ctx.time_ms(lambda: s.gather_mla_latent(kv_c, k_pe, meta, ctx.group), args.warmup, args.iters)
    rec["latent_ms"] = ctx.max_over_ranks(ms)
    rec["latent_row_bytes"] = cpattn.gathered_bytes_per_token([kv_c, k_pe])
    del kv_c, k_pe
    ctx.free()

    k = _randn((p, cfg.num_heads, cfg.qk_head_dim), ctx, 3)
    v = _randn((p, cfg.num_heads, cfg.v_head_dim), ctx, 4)
    ms = ctx.time_ms(lambda: s.gather_kv(k, v, meta, ctx.group), args.warmup, args.iters)
    rec["kv_ms"] = ctx.max_over_ranks(ms)
    rec["kv_row_bytes"] = cpattn.gathered_bytes_per_token([k, v])
    del k, v
    ctx.free()

    gathered = ctx.world * p  # rows in the all-gathered buffer
    for name in ("latent", "kv"):
        rec[f"{name}_gathered_mb"] = gathered * rec[f"{name}_row_bytes"] / 1e6
        rec[f"{name}_gb_per_s"] = gathered * rec[f"{name}_row_bytes"] / (rec[f"{name}_ms"] * 1e6)
    rec["kv_over_latent_time"] = rec["kv_ms"] / rec["latent_ms"]
    return rec


# ---------------------------------------------------------------------------------------- layer
def _resolve(layer: MLAAttention, s, meta, absorb: bool, backend: str, ctx: _Ctx) -> str:
    """Backend name ``s.attention`` would pick, from zero-storage stand-ins of the real shapes."""
    c = layer.config
    if absorb:
        d, dv, hkv = c.latent_dim, c.kv_lora_rank, 1
    else:
        d, dv, hkv = c.qk_head_dim, c.v_head_dim, c.num_heads
    spec = cpattn.AttentionSpec(num_q_heads=c.num_heads, num_kv_heads=hkv, head_dim=d, head_dim_v=dv, dtype=ctx.dtype)
    return cpattn.plan_attention(meta, spec, backend=backend).backend


def run_layer(ctx: _Ctx, layer: MLAAttention, tokens: int, cp: int, absorb: bool, args) -> dict:
    """One MLA forward for one sequence at CP=cp (cp=1: this rank alone, no collective)."""
    rec: dict = {"tokens": tokens, "cp": cp, "strategy": args.strategy if cp > 1 else "none",
                 "form": "absorbed" if absorb else "up"}
    s = cpattn.get_strategy(args.strategy, cp)
    meta = s.build_metadata([tokens], rank=ctx.rank if cp > 1 else 0).to(ctx.device)
    group = ctx.group if cp > 1 else None
    try:
        backend = _resolve(layer, s, meta, absorb, args.backend, ctx)
    except (NotImplementedError, ValueError) as exc:
        rec["status"] = f"skipped: no backend ({exc})"
        return rec
    rec["backend"] = backend
    if backend == "torch" and tokens > TORCH_BACKEND_MAX_TOKENS:
        rec["status"] = f"skipped: backend 'torch' at {tokens} tokens (> {TORCH_BACKEND_MAX_TOKENS})"
        return rec
    x_full = _randn((tokens, layer.config.hidden), ctx, 5)
    x = s.shard(x_full, meta)
    positions = s.shard(torch.arange(tokens, device=ctx.device), meta)
    del x_full
    try:
        ms = ctx.time_ms(lambda: layer(x, positions, s, meta, group, absorb=absorb, backend=backend),
                         args.warmup, args.iters)
        rec["status"] = "ok"
    except torch.cuda.OutOfMemoryError as exc:  # same shapes on every rank: all fail alike
        ms = float("nan")
        rec["status"] = f"skipped: out of memory ({str(exc).splitlines()[0]})"
    del x, positions
    ctx.free()
    rec["rank_ms"] = ms
    rec["ms"] = ctx.max_over_ranks(ms) if cp > 1 else ms
    return rec


# ---------------------------------------------------------------------------------------- output
def format_tables(payload: dict) -> str:
    b = payload["bytes"]
    lines = [
        f"bytes/token: latent {b['latent_bytes_per_token']} (all-gather row {b['latent_allgather_row_bytes']}), "
        f"full K/V {b['kv_bytes_per_token']} ({b['kv_over_latent']:.1f}x)",
    ]
    if payload["gather"]:
        lines += ["", "| tokens | CP | latent gather ms | full K/V gather ms | K/V / latent | latent GB/s | K/V GB/s |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in payload["gather"]:
            lines.append(f"| {r['tokens']} | {r['cp']} | {r['latent_ms']:.3f} | {r['kv_ms']:.3f} | "
                         f"{r['kv_over_latent_time']:.1f}x | {r['latent_gb_per_s']:.1f} | {r['kv_gb_per_s']:.1f} |")
    if payload["layer"]:
        lines += ["", "| tokens | form | CP | strategy | backend | ms | speedup vs CP=1 |",
                  "| ---: | --- | ---: | --- | --- | ---: | ---: |"]
        for r in payload["layer"]:
            if r.get("status") != "ok":
                lines.append(f"| {r['tokens']} | {r['form']} | {r['cp']} | {r['strategy']} | "
                             f"{r.get('backend', '-')} | {r['status']} | |")
                continue
            sp = r.get("speedup_vs_cp1")
            lines.append(f"| {r['tokens']} | {r['form']} | {r['cp']} | {r['strategy']} | {r['backend']} | "
                         f"{r['ms']:.2f} | {'' if sp is None else f'{sp:.2f}x'} |")
    for t in payload.get("targets", []):
        lines.append(f"target: {t['what']}: {t['value']} (target {t['target']}) -> {'MET' if t['met'] else 'NOT MET'}")
    return "\n".join(lines)


def plot(payload: dict, path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("matplotlib missing: no plot")
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    ax = axes[0]
    g = payload["gather"]
    if g:
        xs = range(len(g))
        c = payload["config"]
        latent = f"MLA latent ({c['kv_lora_rank']} + {c['qk_rope_head_dim']} per token)"
        full = f"full K/V ({c['num_heads']} x ({c['qk_nope_head_dim'] + c['qk_rope_head_dim']} + {c['v_head_dim']}))"
        ax.bar([x - 0.2 for x in xs], [r["latent_ms"] for r in g], width=0.4, label=latent)
        ax.bar([x + 0.2 for x in xs], [r["kv_ms"] for r in g], width=0.4, label=full)
        ax.set_xticks(list(xs), [f"{r['tokens'] // 1024}k" if r["tokens"] >= 1024 else str(r["tokens"]) for r in g])
        ax.set_yscale("log")
        ax.set_ylabel(f"all-gather ms (CP={g[0]['cp']}, max rank)")
        ax.legend(fontsize=7)
    ax.set_title("latent vs full K/V all-gather", fontsize=9)
    ax = axes[1]
    ok = [r for r in payload["layer"] if r.get("status") == "ok"]
    keys = sorted({(r["tokens"], r["form"]) for r in ok})
    cps = sorted({r["cp"] for r in ok})
    width = 0.8 / max(1, len(cps))
    for i, cp in enumerate(cps):
        vals = []
        for key in keys:
            match = [r for r in ok if (r["tokens"], r["form"]) == key and r["cp"] == cp]
            vals.append(match[0]["ms"] if match else 0.0)
        bars = ax.bar([j + (i - (len(cps) - 1) / 2) * width for j in range(len(keys))], vals, width=width,
                      label=f"CP={cp}")
        if cp > 1:
            for bar, key in zip(bars, keys):
                match = [r for r in ok if (r["tokens"], r["form"]) == key and r["cp"] == cp]
                if match and match[0].get("speedup_vs_cp1"):
                    ax.annotate(f"{match[0]['speedup_vs_cp1']:.2f}x", (bar.get_x() + bar.get_width() / 2,
                                bar.get_height()), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(range(len(keys))), [f"{t // 1024 if t >= 1024 else t}{'k' if t >= 1024 else ''}\n{f}"
                                           for t, f in keys], fontsize=7)
    ax.set_ylabel("ms per MLA layer forward")
    ax.set_title(f"MLA prefill layer, {payload['strategy']}", fontsize=9)
    if ok:
        ax.legend(fontsize=7)
    fig.suptitle(f"cpattn MLA — {payload['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------- main
def _setup(args) -> _Ctx:
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda but no CUDA device; use --device cpu --small")
        if os.environ.get("NCCL_NVLS_ENABLE") != "0":
            progress(f"note: NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')!r} (left as is)")
        torch.cuda.set_device(local_rank)  # before any CUDA tensor or communicator
        device, dtype = torch.device("cuda", local_rank), torch.bfloat16
    else:
        device, dtype = torch.device("cpu"), torch.float32
    if world_env > 1:
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
        return _Ctx(device, dtype, dist.get_rank(), dist.get_world_size(), dist.group.WORLD)
    return _Ctx(device, dtype, 0, 1, None)


def main(args: argparse.Namespace) -> int:
    ctx = _setup(args)
    log = progress if ctx.rank == 0 else (lambda m: None)
    smoke = ctx.device.type == "cpu"
    if smoke and ctx.rank == 0:
        smoke_notice("mla")
    tokens_list = _parse_tokens(args.tokens or ("256,1024" if args.small else "32k,128k"))
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    if any(f not in ("up", "absorbed") for f in forms):
        raise SystemExit(f"--forms must list 'up' and/or 'absorbed', got {args.forms!r}")
    cfg = MLAConfig() if args.small else MLAConfig.deepseek_v3()
    if args.heads:
        cfg = dataclasses.replace(cfg, num_heads=args.heads)
    out_path = args.out or default_out_path(ctx.device.type)
    log(f"mla bench: world={ctx.world} device={ctx.device} dtype={ctx.dtype} tokens={tokens_list} "
        f"forms={forms} strategy={args.strategy} backend={args.backend} config={cfg}")

    payload = header("benchmarks/run.py mla", smoke=smoke)
    payload.update(
        world_size=ctx.world, dtype=str(ctx.dtype), strategy=args.strategy, requested_backend=args.backend,
        config=dataclasses.asdict(cfg), torch_version=torch.__version__,
        nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"),
        method={
            "gather": "strategy.gather_mla_latent / gather_kv per call (pack + all-gather + reorder), "
                      "median of --iters, max over ranks; GB/s = gathered bytes / time",
            "layer": "MLAAttention.forward (latent gather async, overlapped with the q path), median; "
                     "CP=1: each rank alone, rank 0; CP=C: max over ranks",
            "timer": "CUDA events (benchmarks.common.time_cuda)" if ctx.device.type == "cuda" else "host clock",
        },
        bytes=bytes_section(cfg, ctx.dtype), gather=[], layer=[], targets=[],
    )

    if ctx.world > 1 and not args.no_gather:
        for tokens in tokens_list:
            log(f"gather {tokens} tokens, CP={ctx.world} ...")
            try:
                rec = run_gather(ctx, cfg, tokens, args)
            except torch.cuda.OutOfMemoryError as exc:
                rec = {"tokens": tokens, "cp": ctx.world, "status": f"skipped: out of memory ({exc})"}
                ctx.free()
            else:
                log(f"  latent {rec['latent_ms']:.3f} ms, full K/V {rec['kv_ms']:.3f} ms")
            if "latent_ms" in rec:
                payload["gather"].append(rec)

    if not args.no_layer:
        layer = MLAAttention(cfg, seed=0, device=ctx.device, dtype=ctx.dtype)
        for tokens in tokens_list:
            for form in forms:
                absorb = form == "absorbed"
                base = None
                for cp in ([1, ctx.world] if ctx.world > 1 else [1]):
                    log(f"layer {tokens} tokens, {form}, CP={cp} ...")
                    rec = run_layer(ctx, layer, tokens, cp, absorb, args)
                    if rec.get("status") == "ok":
                        if cp == 1:
                            base = rec
                        elif base is not None:
                            rec["speedup_vs_cp1"] = base["ms"] / rec["ms"]
                        log(f"  {rec['backend']}: {rec['ms']:.2f} ms"
                            + (f", speedup {rec['speedup_vs_cp1']:.2f}x" if "speedup_vs_cp1" in rec else ""))
                    else:
                        log(f"  {rec['status']}")
                    payload["layer"].append(rec)
        del layer
        ctx.free()

    speedups = [r for r in payload["layer"] if r.get("speedup_vs_cp1") and r["form"] == "up" and r["cp"] == 2]
    if speedups and not smoke:
        top = max(speedups, key=lambda r: r["tokens"])
        payload["targets"].append({
            "what": f"CP=2 speedup of one MLA layer at {top['tokens']} tokens ({top['backend']})",
            "value": round(top["speedup_vs_cp1"], 3), "target": TARGET_SPEEDUP,
            "met": top["speedup_vs_cp1"] >= TARGET_SPEEDUP,
        })

    if ctx.rank == 0:
        print(format_tables(payload), flush=True)
        write_json(out_path, payload)
        if not args.no_plot:
            png = plot(payload, os.path.splitext(out_path)[0] + ".png")
            if png:
                progress(f"wrote {png}")
    if ctx.world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0
