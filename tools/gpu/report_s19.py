"""JSON + PNG of the fifteenth session's GPU runs (docs/benchmarks/s19/), from the lines the calls
printed:

* ``s18h-rerun-lines.txt``: ``s18h.sh`` run again (``_variant.sh``'s ``ab`` lines), the tree
  against ``mla_wait_first.patch`` (now in the tree, 0.3.11): MLA prefill and decode, two
  interleaved repeats;
* ``s19a-lines.txt``: ``s18a.sh``'s clock records, the tree against ``softmax_under_pv.patch``:
  d128 / d192 16k / 64k zigzag C = 1, 2, TF/s, SM clock (MHz, busy samples) and TF/s per GHz, two
  interleaved repeats.

Writes ``ab-h200-s19.{json,png}`` ({ab, workload, variant, rep, tflops}) and
``clocks-spv-h200-s19.{json,png}``. Run from the repository root:
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


def main() -> None:
    ab = ab_line_rows(D / "s18h-rerun-lines.txt", lambda g: f"s18h {g}", TREES)
    for r in ab:  # ab_line_rows names d128 points without their head dim; these are MLA's
        r["workload"] = r["workload"].removeprefix("d128 ")
    write_ab(ab, D / "ab-h200-s19",
             "H200, 2026-12-02, MLA kernel without ptxas's injected wait (tools/gpu/s18h.sh run again)")
    rows = clock_rows(D / "s19a-lines.txt")
    (D / "clocks-spv-h200-s19.json").write_text(json.dumps(rows, indent=1))
    bar_panels(rows, [(v, rep) for rep in (1, 2) for v in ("tree", "spv")], lambda r: (r["variant"], r["rep"]),
               [("tflops", "TF/s"), ("sm_mhz", "SM clock (MHz, busy samples)"), ("tflops_per_ghz", "TF/s per GHz")],
               D / "clocks-spv-h200-s19.png",
               "H200, 2026-12-02, softmax_under_pv.patch against the tree (tools/gpu/s18a.sh in s19a.sh, --clocks)",
               lambda k: "C0" if k[0] == "tree" else "C1", lambda k: 1.0 if k[1] == 1 else 0.6,
               lambda k: f"{k[0]} (rep {k[1]})", ylims={"sm_mhz": (1400, 1700), "tflops_per_ghz": (300, 450)})
    print(f"wrote {D}/clocks-spv-h200-s19.json ({len(rows)} rows) and .png")


if __name__ == "__main__":
    main()
