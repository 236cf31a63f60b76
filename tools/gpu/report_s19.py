"""JSON + PNG of the fifteenth session's GPU runs (docs/benchmarks/s19/), from the lines the calls
printed:

* ``s18h-rerun-lines.txt``: ``s18h.sh`` run again (``_variant.sh``'s ``ab`` lines), the tree
  against ``mla_wait_first.patch`` (now in the tree, 0.3.11): MLA prefill and decode, two
  interleaved repeats;
* ``s19f-lines.txt``: the 0.3.11 tree against ``mla_decode_pv_first.patch`` (now in the tree,
  0.3.12): MLA decode B = 8, 64 over 4k / 32k keys, q1 / q4, graph-replay TF/s, two interleaved
  repeats;
* ``s19g-lines.txt``: the 0.3.12 tree against ``mla_pv_first_all.patch`` (that order in every
  mode): MLA prefill 16k / 64k C = 1, 4 and 16k paged 64, two interleaved repeats (not kept);
* ``s19a-lines.txt``: ``s18a.sh``'s clock records, the tree against ``softmax_under_pv.patch``:
  d128 / d192 16k / 64k zigzag C = 1, 2, TF/s, SM clock (MHz, busy samples) and TF/s per GHz, two
  interleaved repeats.

* ``decode-profile-h200-s19.log`` (``s19d``, ``decode_profile.py``): graph-replay µs of MLA decode
  steps on 0.3.11 under four split geometries, and the kernels' µs (torch.profiler).

Writes ``ab-h200-s19.{json,png}`` ({ab, workload, variant, rep, tflops}),
``clocks-spv-h200-s19.{json,png}`` and ``decode-profile-h200-s19.{json,png}``. Run from the repository root:
``PYTHONPATH=tools/gpu python tools/gpu/report_s19.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from report_s9 import ab_line_rows, bar_panels, write_ab  # noqa: E402

D = Path("docs/benchmarks/s19")
TREES = {"src": "tree (0.3.10)", "/tmp/mw/src": "MLA wait first"}
TREES_F = {"src": "tree (0.3.11)", "/tmp/pvf/src": "decode P V first"}
TREES_G = {"src": "tree (0.3.12)", "/tmp/pfa/src": "P V first, every mode"}
_POINT = re.compile(r"(d\d+ S=\d+k C=\d+) (\d+) TF/s (\d+) MHz (\d+)/GHz")


def clock_rows(path: Path) -> list[dict]:
    """Rows of s19a's clock lines ("VARIANT rep N rc 0: workload T TF/s M MHz G/GHz | ...")."""
    out = []
    for line in path.read_text().splitlines():
        m = re.match(r"(tree|spv) rep (\d) rc 0: (.*)", line)
        if m:
            for w, tf, mhz, per_ghz in _POINT.findall(m.group(3)):
                out.append(dict(workload=w, variant=m.group(1), rep=int(m.group(2)), tflops=float(tf),
                                sm_mhz=float(mhz), tflops_per_ghz=float(per_ghz)))
    return out


def profile_rows(path: Path) -> list[dict]:
    """Rows of decode_profile.py's output: case, options, graph µs and TF/s, items, split keys, and
    the µs of each kernel of one eager call."""
    out: list[dict] = []
    for line in path.read_text().splitlines():
        m = re.match(r"mla C=1 B=(\d+) L=(\d+) q=(\d+) (.*): graph ([\d.]+) us \((\d+) TF/s\), (\d+) items x (\d+) keys",
                     line)
        if m:
            out.append(dict(case=f"B={m.group(1)} L={int(m.group(2)) // 1024}k q{m.group(3)}", options=m.group(4),
                            graph_us=float(m.group(5)), tflops=float(m.group(6)), items=int(m.group(7)),
                            split_keys=int(m.group(8)), kernels_us={}))
            continue
        k = re.match(r"\s+([\d.]+) us\s+(\S+)", line)
        if k and out:
            out[-1]["kernels_us"][k.group(2)] = float(k.group(1))
    return out


def plot_profile(rows: list[dict], path: Path) -> None:
    """Graph-replay TF/s per decode case, one bar per split geometry."""
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in rows))
    opts = list(dict.fromkeys(r["options"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(opts)
    for i, o in enumerate(opts):
        vals = {r["case"]: r["tflops"] for r in rows if r["options"] == o}
        ax.bar([j + i * width for j in range(len(cases))], [vals.get(c, 0) for c in cases], width, label=o)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
    ax.set_xticklabels(cases)
    ax.set_ylabel("TF/s (graph replay)")
    ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("H200, 2026-12-02, MLA decode split geometries on 0.3.11 (tools/gpu/s19d.sh)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ab = (ab_line_rows(D / "s18h-rerun-lines.txt", lambda g: f"s18h {g} (decode back to back)", TREES)
          + ab_line_rows(D / "s19f-lines.txt", lambda g: f"s19f {g} (graph replay)", TREES_F)
          + ab_line_rows(D / "s19g-lines.txt", lambda g: f"s19g {g} prefill", TREES_G))
    write_ab(ab, D / "ab-h200-s19",
             "H200, 2026-12-02/03, MLA: no injected wait (s18h again), P V first in decode (s19f), everywhere (s19g)")
    rows = clock_rows(D / "s19a-lines.txt")
    (D / "clocks-spv-h200-s19.json").write_text(json.dumps(rows, indent=1))
    bar_panels(rows, [(v, rep) for rep in (1, 2) for v in ("tree", "spv")], lambda r: (r["variant"], r["rep"]),
               [("tflops", "TF/s"), ("sm_mhz", "SM clock (MHz, busy samples)"), ("tflops_per_ghz", "TF/s per GHz")],
               D / "clocks-spv-h200-s19.png",
               "H200, 2026-12-02, softmax_under_pv.patch against the tree (tools/gpu/s18a.sh in s19a.sh, --clocks)",
               lambda k: "C0" if k[0] == "tree" else "C1", lambda k: 1.0 if k[1] == 1 else 0.6,
               lambda k: f"{k[0]} (rep {k[1]})", ylims={"sm_mhz": (1400, 1700), "tflops_per_ghz": (300, 450)})
    print(f"wrote {D}/clocks-spv-h200-s19.json ({len(rows)} rows) and .png")
    prof = profile_rows(D / "decode-profile-h200-s19.log")
    (D / "decode-profile-h200-s19.json").write_text(json.dumps(prof, indent=1))
    plot_profile(prof, D / "decode-profile-h200-s19.png")
    print(f"wrote {D}/decode-profile-h200-s19.json ({len(prof)} rows) and .png")


if __name__ == "__main__":
    main()
