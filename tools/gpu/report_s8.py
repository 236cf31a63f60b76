"""JSON + PNG of session 8's host rounds and 16-bit-partials A/B (docs/benchmarks/s8/).

Parses the summary lines ``tools/gpu/host_rounds.py`` printed in each run's log into
``host-rounds-h200-s8.json`` ({run, plan, mode, median, min, max, python_us, launch_us}) with a
bar plot of the medians (error bars: min / max over rounds), and plots the graph-replay TF/s of
the decode kernel table with float32 vs 16-bit split partials (``ab/kernel-decode-partials-*.json``).
Run from the repository root: ``python tools/gpu/report_s8.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

D = Path("docs/benchmarks/s8")
RUNS = [("s8b", "host-rounds-h200-s8b.log"), ("s8d", "host-rounds-h200-s8d.log"),
        ("s8e", "host-rounds-h200-s8e.log"), ("s8g", "host-rounds-h200-s8g.log")]
#: s8d ran host_rounds three times: plain, ``--pin 3``, ``--pin 3 --no-gc``
VARIANTS = {2: "pinned", 3: "pinned, gc off"}
LINE = re.compile(r"^\s+(\S+ \S+)\s+out=\s+([\d.]+) \[\s*([\d.]+),\s*([\d.]+)\] \| (?:rotating\s+([\d.]+) "
                  r"\[\s*([\d.]+),\s*([\d.]+)\] \| )?allocating\s+([\d.]+) \[\s*([\d.]+),\s*([\d.]+)\] \| "
                  r"Python\s+([\d.]+) \+ C launch\s+([\d.]+)")


def host_rows() -> list[dict]:
    rows = []
    for run, name in RUNS:
        variant = 0
        for line in (D / name).read_text().splitlines():
            if line.startswith("host us per plan.run"):
                variant += 1
            m = LINE.match(line)
            if not m:
                continue
            g = m.groups()
            label = run if variant <= 1 else f"{run} {VARIANTS[variant]}"
            for mode, i in (("out=", 1), ("rotating", 4), ("allocating", 7)):
                if g[i] is None:
                    continue
                rows.append(dict(run=label, plan=g[0], mode=mode, median=float(g[i]), min=float(g[i + 1]),
                                 max=float(g[i + 2]), python_us=float(g[10]), launch_us=float(g[11])))
    return rows


def main() -> None:
    rows = host_rows()
    (D / "host-rounds-h200-s8.json").write_text(json.dumps(rows, indent=1))
    runs = list(dict.fromkeys(r["run"] for r in rows))
    plans = list(dict.fromkeys(r["plan"] for r in rows))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(runs)
    for j, run in enumerate(runs):
        sel = {r["plan"]: r for r in rows if r["run"] == run and r["mode"] == "out="}
        xs = [i + j * width for i, p in enumerate(plans) if p in sel]
        med = [sel[p]["median"] for p in plans if p in sel]
        lo = [sel[p]["median"] - sel[p]["min"] for p in plans if p in sel]
        hi = [sel[p]["max"] - sel[p]["median"] for p in plans if p in sel]
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=2, label=run)
    ax.axhline(30, color="k", ls="--", lw=1, label="target 30 us")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(plans))], plans)
    ax.set_ylabel("host us per plan.run (out=, same K/V)")
    ax.set_title("H200 host, 2026-12-01: median over rounds (bars: min / max)")
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(D / "host-rounds-h200-s8.png", dpi=110)

    fig, ax = plt.subplots(figsize=(11, 4.5))
    series = {}
    for pd in ("float32", "auto"):
        for rep in (1, 2):
            d = json.loads((D / "ab" / f"kernel-decode-partials-{pd}-{rep}.json").read_text())
            rs = d["rows"] if isinstance(d, dict) else d
            series[f"{pd} run {rep}"] = {r["workload"].replace("mla576 decode ", ""): r["tflops_graph"] for r in rs}
    names = list(next(iter(series.values())))
    width = 0.8 / len(series)
    for j, (label, vals) in enumerate(series.items()):
        ax.bar([i + j * width for i in range(len(names))], [vals[n] for n in names], width,
               label=label.replace("auto", "16-bit (bf16)"))
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("TF/s under graph replay")
    ax.set_title("absorbed-MLA decode kernel, split partials float32 vs bf16 (H200, 2026-12-01)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(D / "ab" / "kernel-decode-partials.png", dpi=110)
    print(f"{len(rows)} host rows; plots written")


if __name__ == "__main__":
    main()
