"""``python benchmarks/run.py placement``: CP per batch, the cost model's prediction vs measurement.

For a sweep of batches (single sequences of 256 to 128k tokens, and a batch of many short
sequences) at C ranks: the time of one attention layer per rank under "replicated" (every rank
attends every query: CP off, no collective) and under the CP strategy (rank 0's share under
``gather_kv``), predicted by :func:`cpattn.choose_placement` from a calibrated
:class:`cpattn.CostModel` and measured on this GPU: the kernel's time (``plan.attend``,
CUDA events) plus, for the CP strategy, its all-gather charged at the model's link rate and
latency (one GPU has no link to measure). Reports the break-even length each finds (the shortest
single sequence from which CP is faster) and whether the choice matched the measured faster one.

    python benchmarks/run.py placement [--cp 4] [--cost cpattn-cost.json] [--out PATH]

Without ``--cost`` the rates are calibrated first (``python -m cpattn.calibrate``'s measurement,
link assumed). On the CPU it is a smoke run (torch reference, tiny shapes, no verdicts).
"""

from __future__ import annotations

import argparse
import time

import torch

import cpattn

from .common import default_out, header, progress, smoke_notice, time_cuda, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cp", type=int, default=4, help="CP size C")
    p.add_argument("--strategy", default="zigzag", help="the CP strategy compared with replicated")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--lengths", default="256,512,1024,2048,4096,8192,16384,32768,65536,131072",
                   help="single-sequence lengths of the sweep")
    p.add_argument("--cost", default=None, help="a CostModel JSON (python -m cpattn.calibrate); default: calibrate")
    p.add_argument("--link-gbps", type=float, default=None, help="link rate charged to the collective (GB/s)")
    p.add_argument("--out", default=None, help="output path without extension")


def _model(args, smoke: bool) -> tuple[cpattn.CostModel, dict]:
    if args.cost:
        return cpattn.CostModel.load(args.cost), {"source": args.cost}
    from cpattn.calibrate import measure

    cal = argparse.Namespace(dtype="fp32" if smoke else "bf16", heads=args.heads, kv_heads=args.kv_heads,
                             head_dim=args.head_dim, link_gbps=args.link_gbps, latency_us=None, smoke=smoke)
    device = torch.device("cpu") if smoke else torch.device("cuda")
    t0 = time.perf_counter()
    model, info = measure(cal, device)
    progress(f"calibrated in {time.perf_counter() - t0:.1f} s: " +
             ", ".join(f"{k}={v:.3g}" for k, v in model.to_dict().items()))
    return model, info


def main(args: argparse.Namespace) -> int:
    smoke = not torch.cuda.is_available()
    if smoke:
        smoke_notice("placement")
    out = args.out or default_out("placement", smoke)
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    backend = "torch" if smoke else "auto"
    c, hq, hkv, d = args.cp, args.heads, args.kv_heads, args.head_dim
    model, calibration = _model(args, smoke)
    spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype)
    kv_row = hkv * 2 * d * torch.empty((), dtype=dtype).element_size()
    lengths = [int(x) for x in args.lengths.split(",")]
    if smoke:
        lengths = [n for n in lengths if n <= 1024][:3] or [64, 256]
    batches = [(f"1 x {n}", [n]) for n in lengths] + [("64 x 64", [64] * 64), ("16 x 1024", [1024] * 16)]
    if smoke:
        batches = batches[:3]
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)

    def attend_ms(strategy: str, ext: list[int]) -> tuple[float, int]:
        """(ms of rank 0's kernel, its physical rows P) under ``strategy``."""
        meta = cpattn.get_strategy(strategy, c).build_metadata(ext, rank=0).to(device)
        plan = cpattn.plan_attention(meta, spec, backend=backend)
        t = sum(ext)
        q, k, v = randn(meta.num_physical_tokens, hq, d), randn(t, hkv, d), randn(t, hkv, d)
        if smoke:
            t0 = time.perf_counter()
            plan.attend(q, k, v)
            return (time.perf_counter() - t0) * 1e3, meta.num_physical_tokens
        return time_cuda(lambda: plan.attend(q, k, v), warmup=2, iters=5 if t > 32768 else 10), \
            meta.num_physical_tokens

    rows = []
    for label, ext in batches:
        choice = cpattn.choose_placement(ext, spec=spec, cp_size=c, candidates=(args.strategy, "replicated"),
                                         cost_model=model)
        rep_ms, _ = attend_ms("replicated", ext)
        cp_kernel_ms, p = attend_ms(args.strategy, ext)
        comm_ms = (model.collective_latency_s + (c - 1) * p * kv_row / model.link_bytes_per_s) * 1e3
        cp_key = f"{args.strategy}/gather_kv"
        measured = {"replicated/local": rep_ms, cp_key: cp_kernel_ms + comm_ms}
        predicted = {k: v * 1e3 for k, v in choice.estimates.items()}
        best = min(measured, key=measured.get)
        row = {"batch": label, "tokens": sum(ext), "predicted_ms": predicted, "measured_ms": measured,
               "cp_kernel_ms": cp_kernel_ms, "cp_comm_ms": comm_ms, "chosen": f"{choice.strategy}/{choice.algorithm}",
               "measured_best": best}
        rows.append(row)
        progress(f"{label:10s}: predicted rep {predicted['replicated/local']:.3f} / cp {predicted[cp_key]:.3f} ms; "
                 f"measured rep {rep_ms:.3f} / cp {measured[cp_key]:.3f} ms (kernel {cp_kernel_ms:.3f} + comm "
                 f"{comm_ms:.3f}); chose {row['chosen']}, measured best {best}")

    def break_even(which: str) -> int | None:
        singles = [r for r in rows if r["batch"].startswith("1 x ")]
        for r in singles:
            t = r[which]
            if t[f"{args.strategy}/gather_kv"] < t["replicated/local"]:
                return r["tokens"]
        return None

    summary = {"break_even_predicted": break_even("predicted_ms"), "break_even_measured": break_even("measured_ms"),
               "choices_matching_measured": sum(r["chosen"] == r["measured_best"] for r in rows), "batches": len(rows)}
    payload = {**header(f"benchmarks/run.py placement --cp {c}", smoke), "cp_size": c, "strategy": args.strategy,
               "shape": {"heads": hq, "kv_heads": hkv, "head_dim": d, "dtype": str(dtype)},
               "cost_model": model.to_dict(), "calibration": calibration, "rows": rows, "summary": summary}
    write_json(out + ".json", payload)
    print(f"| batch | predicted replicated / {args.strategy} (ms) | measured replicated / {args.strategy} (ms) | "
          "chosen | measured faster |")
    print("| --- | ---: | ---: | --- | --- |")
    for r in rows:
        pr, me = r["predicted_ms"], r["measured_ms"]
        cp_key = f"{args.strategy}/gather_kv"
        print(f"| {r['batch']} | {pr['replicated/local']:.3f} / {pr[cp_key]:.3f} | {me['replicated/local']:.3f} / "
              f"{me[cp_key]:.3f} | {r['chosen'].split('/')[0]} | {r['measured_best'].split('/')[0]} |")
    print(f"break-even (single sequence): predicted {summary['break_even_predicted']}, measured "
          f"{summary['break_even_measured']} tokens; choices matching the measured faster: "
          f"{summary['choices_matching_measured']} / {summary['batches']}")
    _plot(rows, args.strategy, out + ".png", payload["machine"], c)
    return 0


def _plot(rows: list[dict], strategy: str, path: str, machine: str, c: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("matplotlib missing: no plot")
        return
    singles = [r for r in rows if r["batch"].startswith("1 x ")]
    if not singles:
        return
    x = [r["tokens"] for r in singles]
    cp_key = f"{strategy}/gather_kv"
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label, color in (("replicated/local", "replicated (CP off)", "C0"), (cp_key, f"{strategy} C={c}", "C1")):
        ax.plot(x, [r["measured_ms"][key] for r in singles], "o-", color=color, label=f"{label}, measured")
        ax.plot(x, [r["predicted_ms"][key] for r in singles], "--", color=color, label=f"{label}, predicted")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens (one sequence)")
    ax.set_ylabel("attention per layer per rank (ms)")
    ax.set_title(f"CP per batch: predicted vs measured\n{machine}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    progress(f"wrote {path}")
