"""Host cost of planning a batch: ``build_metadata`` for 1, 64 and 1024 sequences, with cached
prefixes of 0 / 1M / 4M tokens (time and the bytes of the plan's one host-to-device copy), and the
padding share of batches of many short sequences with and without rotation.

    python benchmarks/run.py metadata [--tokens 131072] [--cp 8] [--out PATH]   # default bench-out/metadata-cpu.*

A host-side measurement: on the CPU it is a real run, not a smoke run. Runs against an older
cpattn too (``PYTHONPATH=old/src python benchmarks/run.py metadata``; a cpattn without ``rotate``
skips the rotated padding rows).
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
    p.add_argument("--prefix", type=int, nargs="+", default=[0, 1 << 20, 4 << 20],
                   help="cached prefix tokens of the batch (spread over its sequences)")
    p.add_argument("--out", default=default_out("metadata-cpu"), help="output path without extension (.json, .png)")


def _batch(tokens: int, seqs: int, prefix_tokens: int) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seqs)
    weights = torch.rand(seqs, generator=g) + 0.5  # ragged lengths summing to `tokens`
    extend = (weights / weights.sum() * tokens).long()
    extend[0] += tokens - int(extend.sum())
    share = torch.rand(seqs, generator=g) + 0.5
    prefix = (share / share.sum() * prefix_tokens).long()
    prefix[0] += prefix_tokens - int(prefix.sum())
    return extend.tolist(), prefix.tolist()


def _plan_bytes(meta) -> int:
    """Bytes of every tensor the plan holds (what ``meta.to(device)`` copies)."""
    import dataclasses

    total = 0
    for f in dataclasses.fields(meta):
        value = getattr(meta, f.name)
        values = value.values() if isinstance(value, dict) else [value]
        for v in values:
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
            elif dataclasses.is_dataclass(v):  # tile maps of older plans
                total += sum(t.numel() * t.element_size() for t in vars(v).values() if isinstance(t, torch.Tensor))
    return total


#: (label, sequences, length): batches of many short sequences, where the remainder rows of each
#: sequence decide the padding share (4096 x L=2 at C=8: 75% padding without rotation, 0% with it).
SHORT_BATCHES = [("4096 x L=2", 4096, 2), ("1000 x L=5", 1000, 5), ("512 x L=13", 512, 13), ("64 x L=2048", 64, 2048)]


def _padding_rows(args) -> list[dict]:
    rows = []
    for name in ("zigzag", "contiguous"):
        for rotate in (False, True):
            try:
                strategy = cpattn.get_strategy(name, args.cp, rotate=rotate)
            except TypeError:  # an older cpattn: no rotation
                if rotate:
                    continue
                strategy = cpattn.get_strategy(name, args.cp)
            for label, seqs, length in SHORT_BATCHES:
                meta = strategy.build_metadata([length] * seqs, rank=0)
                phys = meta.num_physical_tokens * args.cp
                share = 1 - seqs * length / phys if phys else 0.0
                rows.append({"strategy": name, "rotate": rotate, "batch": label, "cp_size": args.cp,
                             "per_rank": list(meta.num_local_tokens_per_rank), "padding_share": round(share, 4)})
                progress(f"{name:10s} rotate={rotate!s:5s} {label:12s}: padding {share * 100:5.1f}% "
                         f"(rows per rank {list(meta.num_local_tokens_per_rank)})")
    return rows


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    rows = []
    for name in sorted(cpattn.STRATEGIES):
        strategy = cpattn.get_strategy(name, args.cp)
        for prefix_tokens in args.prefix:
            for seqs in args.seqs:
                extend, prefix = _batch(args.tokens, seqs, prefix_tokens)
                ms = time_host(lambda: strategy.build_metadata(extend, prefix, rank=0), iters=10)
                meta = strategy.build_metadata(extend, prefix, rank=0)
                row = {"strategy": name, "num_seqs": seqs, "tokens": args.tokens, "prefix_tokens": prefix_tokens,
                       "cp_size": args.cp, "build_ms": round(ms, 3), "plan_bytes": _plan_bytes(meta)}
                if torch.cuda.is_available():
                    row["to_cuda_ms"] = time_host(lambda: meta.to("cuda") and torch.cuda.synchronize())
                rows.append(row)
                progress(f"{name:10s} prefix={prefix_tokens:8d} seqs={seqs:5d}: build {ms:.2f} ms, "
                         f"plan {row['plan_bytes'] / 1e6:.2f} MB")
    padding_rows = _padding_rows(args)
    payload = {**header("benchmarks/run.py metadata " + f"--tokens {args.tokens} --cp {args.cp}"), "rows": rows,
               "padding": padding_rows}
    write_json(args.out + ".json", payload)
    print(f"{'strategy':10s} {'prefix':>8s} {'seqs':>6s} {'build ms':>9s} {'plan MB':>8s}")
    for r in rows:
        print(f"{r['strategy']:10s} {r['prefix_tokens']:8d} {r['num_seqs']:6d} {r['build_ms']:9.2f} "
              f"{r['plan_bytes'] / 1e6:8.2f}")
    print(f"{'strategy':10s} {'rotate':>6s} {'batch':>12s} {'padding':>8s}")
    for r in padding_rows:
        print(f"{r['strategy']:10s} {r['rotate']!s:>6s} {r['batch']:>12s} {r['padding_share'] * 100:7.1f}%")
    _plot([r for r in rows if r["prefix_tokens"] == args.prefix[0]], args.out + ".png", payload["machine"])
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
