"""Host cost of planning a batch: ``build_metadata`` for 1, 64 and 1024 sequences.

    python -m cpattn.bench metadata [--tokens 131072] [--cp 8] [--out bench-out/metadata-cpu]

The docs figure is regenerated only on purpose: ``--out docs/benchmarks/metadata-cpu``.
"""

from __future__ import annotations

import argparse

import torch

import cpattn

from .common import default_out, header, progress, time_host, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=131072, help="extend tokens in the batch (T)")
    p.add_argument("--cp", type=int, default=8, help="CP size C")
    p.add_argument("--seqs", type=int, nargs="+", default=[1, 64, 1024], help="sequences per batch")
    p.add_argument("--out", default=default_out("metadata-cpu"), help="output path without extension (.json, .png)")


def _batch(tokens: int, seqs: int) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seqs)
    weights = torch.rand(seqs, generator=g) + 0.5  # ragged lengths summing to `tokens`
    extend = (weights / weights.sum() * tokens).long()
    extend[0] += tokens - int(extend.sum())
    prefix = (torch.rand(seqs, generator=g) * 512).long()
    return extend.tolist(), prefix.tolist()


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    rows = []
    for name in sorted(cpattn.STRATEGIES):
        strategy = cpattn.get_strategy(name, args.cp)
        for seqs in args.seqs:
            extend, prefix = _batch(args.tokens, seqs)
            ms = time_host(lambda: strategy.build_metadata(extend, prefix, rank=0))
            meta = strategy.build_metadata(extend, prefix, rank=0)
            row = {"strategy": name, "num_seqs": seqs, "tokens": args.tokens, "cp_size": args.cp, "build_ms": ms}
            if torch.cuda.is_available():
                row["to_cuda_ms"] = time_host(lambda: meta.to("cuda") and torch.cuda.synchronize())
            rows.append(row)
            progress(f"{name:10s} seqs={seqs:5d}: build {ms:.2f} ms")
    payload = {**header("python -m cpattn.bench metadata " + f"--tokens {args.tokens} --cp {args.cp}"), "rows": rows}
    write_json(args.out + ".json", payload)
    print(f"{'strategy':10s} {'seqs':>6s} {'build ms':>9s}")
    for r in rows:
        print(f"{r['strategy']:10s} {r['num_seqs']:6d} {r['build_ms']:9.2f}")
    _plot(rows, args.out + ".png", payload["machine"])
    return 0


def _plot(rows: list[dict], path: str, machine: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("matplotlib missing: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = sorted({r["strategy"] for r in rows})
    seqs = sorted({r["num_seqs"] for r in rows})
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ms = [next(r["build_ms"] for r in rows if r["strategy"] == name and r["num_seqs"] == s) for s in seqs]
        ax.bar([j + i * width for j in range(len(seqs))], ms, width, label=name)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(seqs))], [f"{s} seqs" for s in seqs])
    ax.set_ylabel("build_metadata (ms, median)")
    ax.set_title(f"Planning cost, T={rows[0]['tokens']} tokens, C={rows[0]['cp_size']}\n{machine}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    progress(f"wrote {path}")
