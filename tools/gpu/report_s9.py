"""JSON + PNG of session 9's A/B runs (docs/benchmarks/s9/), parsed from the calls' printed lines.

* ``s10c-stdout.log``: the MLA decode pair mode on / off (B = 8, q4, 4k and 32k keys; back to
  back / graph-replay TF/s, two alternating repeats) and short sequences with ``persistent="auto"``
  against one program per tile;
* ``s10e-stdout.log``: the paged loader with K copies first ("new") against the interleaved
  order ("old"), and the pair merge in 128-column passes ("new") against 32 ("old"), two
  alternating repeats;
* ``s10g-stdout.log``: d192 zigzag with the L2 head sections forced on against
  ``sections="auto"`` as it was then (dropped at simulated losses > 1.02), two alternating repeats.

Writes ``ab-h200-s9.json`` ({ab, workload, variant, rep, tflops[, tflops_graph]}) and
``ab-h200-s9.png``. Run from the repository root: ``python tools/gpu/report_s9.py``.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

D = Path("docs/benchmarks/s9")
DECODE = re.compile(r"(B=\d+ L=\d+k q\d) (\d+)/(\d+)")


def rows() -> list[dict]:
    out = []
    for line in (D / "s10c-stdout.log").read_text().splitlines():
        m = re.match(r"pair=(\d) rep (\d) rc 0 (.*)", line)
        if m:
            for w, b2b, graph in DECODE.findall(m.group(3)):
                out.append(dict(ab="pair mode", workload=f"mla576 decode {w}", variant="pair" if m.group(1) == "1"
                                else "combine", rep=int(m.group(2)), tflops=float(b2b), tflops_graph=float(graph)))
        m = re.match(r"\| (d128 \d+x\d+) \| sm90 \| (\d+) \| (\d+) \|", line)
        if m:
            for variant, value in (("auto", m.group(2)), ("per tile", m.group(3))):
                out.append(dict(ab="persistent auto", workload=m.group(1), variant=variant, rep=1,
                                tflops=float(value)))
    tag = rep = None
    for line in (D / "s10e-stdout.log").read_text().splitlines():
        m = re.match(r"(new|old) rep (\d) (paged|decode) rc 0(.*)", line)
        if m:
            tag, rep = m.group(1), int(m.group(2))
            for w, b2b, graph in DECODE.findall(m.group(4)):
                out.append(dict(ab="pair merge passes", workload=f"mla576 decode {w}",
                                variant="128 columns" if tag == "new" else "32 columns", rep=rep, tflops=float(b2b),
                                tflops_graph=float(graph)))
            continue
        m = re.match(r"\s+(\S+ S=\S+ zigzag C=2 paged\d+): triton (\d+) TF/s", line)
        if m and tag:
            out.append(dict(ab="paged K first", workload=m.group(1), variant="K first" if tag == "new" else
                            "K / V interleaved", rep=rep, tflops=float(m.group(2))))
    for line in (D / "s10g-stdout.log").read_text().splitlines():
        m = re.match(r"sections=(\S+) rep (\d) rc 0 (.*)", line)
        if m:
            for w, tf in re.findall(r"(\d+k C=\d) (\d+)", m.group(3)):
                out.append(dict(ab="d192 L2 sections", workload=f"d192 S={w}", variant="sections" if m.group(1) == "1"
                                else "auto (dropped at loss > 1.02)", rep=int(m.group(2)), tflops=float(tf)))
    return out


def plot_ab(data: list[dict], path: Path, title: str, ylabels: dict[str, str] | None = None) -> None:
    """One bar panel per A/B (``ab``): the best repeat per (workload, variant), graph replay
    where it was timed; ``ylabels`` {ab: y label} for panels not in TF/s."""
    abs_ = list(dict.fromkeys(r["ab"] for r in data))
    fig, axes = plt.subplots(1, len(abs_), figsize=(4.6 * len(abs_), 4.5), squeeze=False)
    for ax, ab in zip(axes[0], abs_):
        best = defaultdict(float)  # best repeat per (workload, variant); graph replay where timed
        for r in data:
            if r["ab"] == ab:
                key = (r["workload"], r["variant"])
                best[key] = max(best[key], r.get("tflops_graph", r["tflops"]))
        loads = list(dict.fromkeys(w for w, _ in best))
        variants = list(dict.fromkeys(v for _, v in best))
        width = 0.8 / len(variants)
        for i, v in enumerate(variants):
            ax.bar([j + i * width for j in range(len(loads))], [best[(w, v)] for w in loads], width, label=v)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(loads))])
        ax.set_xticklabels([w.replace("mla576 decode ", "").replace(" zigzag C=2", "") for w in loads],
                           rotation=45, ha="right", fontsize=7)
        ax.set_title(ab)
        ax.set_ylabel((ylabels or {}).get(ab, "TF/s (best of repeats; decode: graph replay)"))
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def bar_panels(rows: list[dict], keys: list[tuple], key_of, panels: list[tuple], path: Path, title: str,
               color_of, fade_of, label_of, ylims: dict | None = None) -> None:
    """One bar chart per ``(field, y label)`` of ``panels``: per workload, one bar per key of ``keys``
    (``key_of(row)`` gives a row's key; ``color_of`` / ``fade_of`` / ``label_of`` a key's colour,
    alpha and legend label); ``ylims`` {field: (lo, hi)}. Used for the clock records (s17, s18)."""
    loads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5), squeeze=False)
    width = 0.8 / len(keys)
    for ax, (field, label) in zip(axes[0], panels):
        for i, key in enumerate(keys):
            vals = {r["workload"]: r[field] for r in rows if key_of(r) == key}
            ax.bar([j + i * width for j in range(len(loads))], [vals.get(w, 0) for w in loads], width,
                   label=label_of(key), color=color_of(key), alpha=fade_of(key))
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(loads))])
        ax.set_xticklabels([w.replace(" zigzag", "").replace("d128 ", "") if "x" in w else w.replace(" zigzag", "")
                            for w in loads], rotation=35, ha="right", fontsize=8)
        ax.set_ylabel(label)
        if ylims and field in ylims:
            ax.set_ylim(*ylims[field])
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def ab_line_rows(path: Path, ab_name, trees: dict[str, str]) -> list[dict]:
    """Rows of the lines ``_variant.sh``'s ``ab`` saved at ``path`` ("GROUP rep N TREE rc 0
    workload TF/s | ...", d128 workloads named without their head dim, MLA ones ``mla576 ...`` or,
    in older lines, ``decode ...``): ``ab`` = ``ab_name(GROUP)``, ``variant`` = ``trees[TREE]``;
    d128 rows get their ``d128`` prefix back, MLA and GQA (shard step) rows keep their name."""
    from choose_patches import _points

    out = []
    for line in path.read_text().splitlines():
        m = re.match(r"(\S+) rep (\d) (\S+) rc 0 (.*)", line)
        if m:
            for w, tf in _points(m.group(4)).items():
                w = w if w.startswith(("d192", "mla", "decode", "gqa")) or "x" in w else f"d128 {w}"
                out.append(dict(ab=ab_name(m.group(1)), workload=w, variant=trees[m.group(3)], rep=int(m.group(2)),
                                tflops=tf))
    return out


def write_ab(data: list[dict], stem: Path, title: str, ylabels: dict[str, str] | None = None) -> None:
    """``stem``.json (the rows) and ``stem``.png (:func:`plot_ab`)."""
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1))
    plot_ab(data, stem.with_suffix(".png"), title, ylabels)
    print(f"wrote {stem}.json ({len(data)} rows) and {stem}.png")


def main() -> None:
    write_ab(rows(), D / "ab-h200-s9", "H200, 2026-12-01, session 9 A/B runs (tools/gpu/s10c.sh, s10e.sh, s10g.sh)")


if __name__ == "__main__":
    main()
