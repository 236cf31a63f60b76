"""``python benchmarks/run.py scaling``: an arithmetic model of CP prefill time for C = 1..64.

Pure arithmetic on the host (no GPU, no torch.distributed). Per attention layer, one causal
sequence of S tokens split over C ranks (zigzag: equal causal work per rank):

* attention  ``t_attn = S^2 * Hq * (D + Dv) / (C * F_attn)`` (useful causal FLOPs),
* other      ``t_other = S / C * 2 * (hidden*Hq*D + hidden*2*Hkv*D + Hq*Dv*hidden + 2*hidden*ffn) / F_gemm``,
* all-gather (cpattn): every rank receives ``(C-1)/C * S * kvb`` bytes, ``kvb = 2*Hkv*D*bytes``,
  at the bus bandwidth of the slowest link the ring crosses (NVLink inside a node, the per-GPU
  network bandwidth once C spans nodes). It can hide only behind work that does not need the
  gathered K/V: the q projection (what cpattn overlaps today), or also the attention of the local
  queries on the rank's own K/V ("local-first", what torch's allgather rotater does).
* ring pass-KV: C-1 steps; step i sends ``S/C * kvb`` bytes to the next rank while computing on
  the block received before (``t_attn / C`` per step), plus an LSE merge of the fp32 partial
  output per step (``3 * S/C * Hq * Dv * 4`` bytes of HBM traffic).

Defaults are ASSUMPTIONS (H200 attention 600 TF/s, GEMM 700 TF/s, NVLink all-gather bus bandwidth
350 GB/s, 50 GB/s per GPU across nodes) until measured numbers replace them:
``--from-json bench-out/cp.json`` (a ``cp`` run's JSON) reads the measured CP=1 attention TF/s, the
effective "other" TF/s and the CP=2 all-gather bus bandwidth and compares the model with the
measured CP=2 forward.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, replace
from typing import Optional

from .common import default_out, progress


@dataclass(frozen=True)
class Hardware:
    """Per-GPU rates. TF/s are dense bf16 achieved by the kernels; GB/s are bus bandwidths."""

    attn_tflops: float = 600.0
    gemm_tflops: float = 700.0
    nvlink_busbw_gbps: float = 350.0
    net_gbps_per_gpu: float = 50.0
    hbm_tbps: float = 4.8
    gpus_per_node: int = 8
    source: str = "assumed"


@dataclass(frozen=True)
class Model:
    """One attention layer of the benchmark's stack (GQA, bf16)."""

    hq: int = 32
    hkv: int = 8
    d: int = 128
    dv: int = 128
    hidden: int = 4096
    ffn: int = 8192
    bytes_per_value: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return self.hkv * (self.d + self.dv) * self.bytes_per_value

    @property
    def linear_flops_per_token(self) -> float:
        h = self.hidden
        return 2.0 * (h * self.hq * self.d + h * self.hkv * (self.d + self.dv) + self.hq * self.dv * h + 2 * h * self.ffn)

    @property
    def q_proj_flops_per_token(self) -> float:
        return 2.0 * self.hidden * self.hq * self.d


def layer_times(seq: int, cp: int, hw: Hardware, m: Model, imbalance: float = 1.0) -> dict:
    """Milliseconds per layer for sequence length ``seq`` on ``cp`` ranks (see module docstring)."""
    ms = 1e3
    t_attn = seq * seq * m.hq * (m.d + m.dv) / (cp * hw.attn_tflops * 1e12) * ms * imbalance
    t_other = seq / cp * m.linear_flops_per_token / (hw.gemm_tflops * 1e12) * ms
    t_qproj = seq / cp * m.q_proj_flops_per_token / (hw.gemm_tflops * 1e12) * ms
    nodes = -(-cp // hw.gpus_per_node)
    bw = (hw.nvlink_busbw_gbps if nodes == 1 else hw.net_gbps_per_gpu) * 1e9
    kv_total = seq * m.kv_bytes_per_token
    t_ag = (cp - 1) / cp * kv_total / bw * ms if cp > 1 else 0.0
    ag_exposed = max(0.0, t_ag - t_qproj)
    ag_local_first_exposed = max(0.0, t_ag - t_qproj - t_attn / cp)
    step_comm = seq / cp * m.kv_bytes_per_token / bw * ms if cp > 1 else 0.0
    step_attn = t_attn / cp
    merge = 3 * seq / cp * m.hq * m.dv * 4 / (hw.hbm_tbps * 1e12) * ms
    ring_exposed = (cp - 1) * (max(0.0, step_comm - step_attn) + merge) if cp > 1 else 0.0
    return {
        "seq": seq, "cp": cp, "nodes": nodes, "t_attn": t_attn, "t_other": t_other, "t_qproj": t_qproj,
        "t_ag": t_ag, "ag_exposed": ag_exposed, "ag_local_first_exposed": ag_local_first_exposed,
        "ring_step_comm": step_comm, "ring_step_attn": step_attn, "ring_exposed": ring_exposed,
        "total_ag": t_attn + t_other + ag_exposed,
        "total_ag_local_first": t_attn + t_other + ag_local_first_exposed,
        "total_ring": t_attn + t_other + ring_exposed,
        "ag_hidable": t_ag <= t_qproj, "ag_local_first_hidable": t_ag <= t_qproj + t_attn / cp,
    }


def table(seqs: list[int], cps: list[int], hw: Hardware, m: Model) -> list[dict]:
    rows = []
    for seq in seqs:
        base = layer_times(seq, 1, hw, m)["total_ag"]
        for cp in cps:
            r = layer_times(seq, cp, hw, m)
            r["speedup_ag"] = base / r["total_ag"]
            r["speedup_ag_local_first"] = base / r["total_ag_local_first"]
            r["speedup_ring"] = base / r["total_ring"]
            rows.append(r)
    return rows


def _label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def format_rows(rows: list[dict]) -> str:
    head = (f"{'S':>6} {'C':>3} {'nodes':>5} {'attn':>9} {'other':>8} {'AG':>8} {'AGexp':>8} {'AGlfexp':>8} "
            f"{'ringstep':>9} {'ringexp':>8} {'xAG':>6} {'xAGlf':>6} {'xring':>6}")
    lines = [head, "(ms per layer; x = speedup of the layer vs C=1; AGlf = all-gather with local-first attention)"]
    for r in rows:
        s = _label(r["seq"])
        lines.append(
            f"{s:>6} {r['cp']:>3} {r['nodes']:>5} {r['t_attn']:9.2f} {r['t_other']:8.2f} {r['t_ag']:8.3f} "
            f"{r['ag_exposed']:8.3f} {r['ag_local_first_exposed']:8.3f} {r['ring_step_comm']:4.2f}/{r['ring_step_attn']:<4.2f} "
            f"{r['ring_exposed']:8.3f} {r['speedup_ag']:6.2f} {r['speedup_ag_local_first']:6.2f} {r['speedup_ring']:6.2f}"
        )
    return "\n".join(lines)


def hidable_limits(seqs: list[int], hw: Hardware, m: Model, max_cp: int = 1024) -> dict[int, dict[str, Optional[int]]]:
    """Smallest power-of-two C at which the all-gather stops hiding (None: hidden up to max_cp)."""
    out = {}
    for seq in seqs:
        first = {"q_proj_only": None, "local_first": None, "exposed_over_5pct_of_attention": None}
        cp = 2
        while cp <= max_cp:
            r = layer_times(seq, cp, hw, m)
            if first["q_proj_only"] is None and not r["ag_hidable"]:
                first["q_proj_only"] = cp
            if first["local_first"] is None and not r["ag_local_first_hidable"]:
                first["local_first"] = cp
            if first["exposed_over_5pct_of_attention"] is None and r["ag_exposed"] > 0.05 * r["t_attn"]:
                first["exposed_over_5pct_of_attention"] = cp
            cp *= 2
        out[seq] = first
    return out


def from_measurement(path: str, hw: Hardware, m: Model) -> tuple[Hardware, Model, list[dict]]:
    """Replace the assumed rates by those measured in a ``benchmarks/run.py cp`` JSON; compare the model
    with every measured CP=C zigzag single-sequence config."""
    with open(path) as f:
        data = json.load(f)
    m = replace(m, hq=data["num_q_heads"], hkv=data["num_kv_heads"], d=data["head_dim"], dv=data["head_dim"],
                hidden=data["hidden"], ffn=2 * data["hidden"])
    layers = data["layers"]
    ok = [c for c in data["configs"] if c.get("status") == "ok" and c["batch"] == "single"]
    base = [c for c in ok if c["cp"] == 1]
    changes = {"source": f"measured ({path})"}
    if base:
        c = max(base, key=lambda c: c["tokens"])
        s = c["tokens"]
        changes["attn_tflops"] = s * s * m.hq * (m.d + m.dv) * layers / (c["attention_ms"] / 1e3) / 1e12
        changes["gemm_tflops"] = s * m.linear_flops_per_token * layers / (c["other_ms"] / 1e3) / 1e12
    cps = [c for c in ok if c["cp"] > 1 and c["strategy"] == "zigzag"]
    bws = [r.get("collective_busbw_GBps") for c in cps for r in c["per_rank"] if r.get("collective_busbw_GBps")]
    if bws:
        changes["nvlink_busbw_gbps"] = max(bws)
    hw = replace(hw, **changes)
    checks = []
    for c in cps:
        r = layer_times(c["tokens"], c["cp"], hw, m, imbalance=c.get("attention_imbalance", 1.0))
        checks.append({"tokens": c["tokens"], "cp": c["cp"], "measured_wall_ms": c["wall_ms"],
                       "model_wall_ms": r["total_ag"] * layers, "measured_exposed_ms": c["exposed_comm_ms"],
                       "model_exposed_ms": r["ag_exposed"] * layers})
    return hw, m, checks


def plot(rows: list[dict], hw: Hardware, path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    seqs = sorted({r["seq"] for r in rows})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, seq in enumerate(seqs):
        rs = [r for r in rows if r["seq"] == seq]
        color = f"C{i}"
        cps = [r["cp"] for r in rs]
        ax1.plot(cps, [r["speedup_ag"] for r in rs], "-o", color=color, ms=3, label=f"{seq // 1024}k all-gather")
        ax1.plot(cps, [r["speedup_ring"] for r in rs], ":", color=color, label=f"{seq // 1024}k ring pass-KV")
        ax2.plot(cps, [100 * r["ag_exposed"] / r["t_attn"] for r in rs], "-o", color=color, ms=3,
                 label=f"{seq // 1024}k all-gather")
        ax2.plot(cps, [100 * r["ring_exposed"] / r["t_attn"] for r in rs], ":", color=color, label=f"{seq // 1024}k ring")
    cmax = max(r["cp"] for r in rows)
    ax1.plot([1, cmax], [1, cmax], color="gray", lw=0.7)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.axvline(hw.gpus_per_node + 0.5, color="gray", ls="--", lw=0.7)
        ax.set_xlabel("CP ranks C (dashed: node boundary)")
    ax1.set_yscale("log", base=2)
    ax1.set_ylabel("layer speedup vs C=1")
    ax2.set_yscale("log")
    ax2.set_ylabel("exposed comm, % of attention")
    ax2.axhline(5, color="red", lw=0.7)
    ax1.legend(fontsize=6, ncol=2)
    fig.suptitle(
        f"CP prefill model ({hw.source}): attention {hw.attn_tflops:.0f} TF/s, GEMM {hw.gemm_tflops:.0f} TF/s, "
        f"NVLink AG {hw.nvlink_busbw_gbps:.0f} GB/s, network {hw.net_gbps_per_gpu:.0f} GB/s/GPU", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    hw, m = Hardware(), Model()
    parser.add_argument("--attn-tflops", type=float, default=hw.attn_tflops, help="per-GPU attention TF/s (assumed)")
    parser.add_argument("--gemm-tflops", type=float, default=hw.gemm_tflops, help="per-GPU GEMM TF/s (assumed)")
    parser.add_argument("--nvlink-busbw", type=float, default=hw.nvlink_busbw_gbps, help="GB/s all-gather bus BW in a node")
    parser.add_argument("--net-bw", type=float, default=hw.net_gbps_per_gpu, help="GB/s per GPU across nodes (IB)")
    parser.add_argument("--gpus-per-node", type=int, default=hw.gpus_per_node)
    parser.add_argument("--seqs", default="32k,128k,256k,1024k")
    parser.add_argument("--cps", default="1,2,4,8,16,32,64")
    parser.add_argument("--heads", type=int, default=m.hq)
    parser.add_argument("--kv-heads", type=int, default=m.hkv)
    parser.add_argument("--head-dim", type=int, default=m.d)
    parser.add_argument("--hidden", type=int, default=m.hidden)
    parser.add_argument("--from-json", default=None,
                        help="JSON of a measured 'benchmarks/run.py cp' run (replaces the assumptions)")
    parser.add_argument("--png", default=default_out("scaling-model.png"), help="figure path")
    parser.add_argument("--json", default=None, help="also write the table as JSON here")


def main(args: argparse.Namespace) -> int:
    from .cp import _parse_tokens

    hw = Hardware(args.attn_tflops, args.gemm_tflops, args.nvlink_busbw, args.net_bw, gpus_per_node=args.gpus_per_node)
    m = Model(hq=args.heads, hkv=args.kv_heads, d=args.head_dim, dv=args.head_dim, hidden=args.hidden, ffn=2 * args.hidden)
    checks = []
    if args.from_json:
        hw, m, checks = from_measurement(args.from_json, hw, m)
    seqs = _parse_tokens(args.seqs)
    cps = [int(c) for c in args.cps.split(",")]
    rows = table(seqs, cps, hw, m)
    print(f"# rates ({hw.source}): attention {hw.attn_tflops:.0f} TF/s, GEMM {hw.gemm_tflops:.0f} TF/s, "
          f"NVLink all-gather {hw.nvlink_busbw_gbps:.0f} GB/s, network {hw.net_gbps_per_gpu:.0f} GB/s/GPU, "
          f"{hw.gpus_per_node} GPUs/node; K/V {m.kv_bytes_per_token} B/token/layer")
    print(format_rows(rows))
    print("\n# first C (powers of two) where the all-gather is no longer hidden:")
    for seq, lim in hidable_limits(seqs, hw, m).items():
        print(f"  S={_label(seq)}: behind q-proj only: C={lim['q_proj_only']}; behind q-proj + local attention: "
              f"C={lim['local_first']}; exposed > 5% of attention: C={lim['exposed_over_5pct_of_attention']}")
    if checks:
        print("\n# model vs measured (whole forward, all layers):")
        for c in checks:
            print(f"  {_label(c['tokens'])} CP={c['cp']}: wall measured {c['measured_wall_ms']:.1f} ms, model "
                  f"{c['model_wall_ms']:.1f} ms; exposed comm measured {c['measured_exposed_ms']:.2f} ms, model "
                  f"{c['model_exposed_ms']:.2f} ms")
    path = plot(rows, hw, args.png)
    if path:
        progress(f"wrote {path}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hardware": hw.__dict__, "model": m.__dict__, "rows": rows, "checks": checks}, f, indent=1)
        progress(f"wrote {args.json}")
    return 0
