"""JSON + PNG of the thirteenth session's GPU runs (docs/benchmarks/s17/), from the files the calls
wrote:

* A/B lines (``s17a-lines.txt``, ``s17b-lines.txt``, ``s17e-lines.txt``: ``_variant.sh``'s ``ab``),
  d128 / d192 at the defaults unless the group says otherwise: ``s17a`` 3 against 2 K/V stages
  (D128 with ping-pong) and persistent programs against one per item (short batches); ``s17b``
  the tree against ping-pong in persistent programs (``persistent_pingpong`` patch) and, on that
  patch, 16 x 8192 / 8 x 16384 persistent or not; ``s17e`` the tree against softmax_j's EX2s
  under ``P_{j-1} V_{j-1}`` (``softmax_under_pv`` patch);
* SM clock / board power per (workload, backend) under sustained timing (``s17d``:
  ``clocks-*-probe.json`` of ``clock_probe.py``, two runs in opposite backend order).

Writes ``ab-h200-s17.{json,png}`` ({ab, workload, variant, rep, tflops}) and
``clocks-h200-s17.{json,png}``. Run from the repository root:
``PYTHONPATH=tools/gpu python tools/gpu/report_s17.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from report_s9 import ab_line_rows, bar_panels, write_ab  # noqa: E402

D = Path("docs/benchmarks/s17")
TREES = {"src": "tree", "/tmp/ppp/src": "persistent ping-pong", "/tmp/spv/src": "softmax under P V"}


def _s17a_variant(row: dict) -> dict:
    """s17a compares options on the tree: the variant is the option (the group's name)."""
    group = row["ab"].split(" ", 1)[1]
    name = "stages" if group.startswith("stages") else "persistent"
    return dict(row, ab=f"s17a {name}", variant=group)


def ab_rows() -> list[dict]:
    out = [_s17a_variant(r) for r in ab_line_rows(D / "s17a-lines.txt", lambda g: f"s17a {g}", TREES)]
    for call in ("s17b", "s17e"):
        path = D / f"{call}-lines.txt"
        if not path.exists():
            continue
        for r in ab_line_rows(path, lambda g, call=call: f"{call} {g}", TREES):
            if "persistent" in r["ab"]:  # s17b's persistent / per-item runs of the patched source
                r = dict(r, ab=f"{call} long-short", variant=r["ab"].split("-")[-1])
            out.append(r)
    return out


def clock_rows() -> list[dict]:
    out = []
    for run, order in enumerate(("triton-fa4", "fa4-triton"), 1):
        for r in json.loads((D / f"clocks-{order}-probe.json").read_text()):
            out.append(dict(r, run=run, order=order))
    return out


def plot_clocks(rows: list[dict], path: Path) -> None:
    """Work per clock (TF/s per GHz) and SM clock per (workload, backend, run)."""
    bar_panels(rows, [(b, run) for run in (1, 2) for b in ("triton", "fa4")], lambda r: (r["backend"], r["run"]),
               [("tflops_per_ghz", "TF/s per GHz of SM clock"), ("sm_mhz", "SM clock (MHz, median of busy samples)")],
               path, "H200, 2026-12-02, sustained timing at the 700 W cap: triton does less work per clock, "
               "at a higher clock (tools/gpu/s17d.sh)", lambda k: "C0" if k[0] == "triton" else "C1",
               lambda k: 1.0 if k[1] == 1 else 0.6, lambda k: f"{k[0]} (run {k[1]})", {"sm_mhz": (1300, 1800)})


def main() -> None:
    write_ab(ab_rows(), D / "ab-h200-s17", "H200, 2026-12-02, session 13 A/B (tools/gpu/s17a.sh, s17b.sh, s17e.sh)")
    rows = clock_rows()
    (D / "clocks-h200-s17.json").write_text(json.dumps(rows, indent=1))
    plot_clocks(rows, D / "clocks-h200-s17.png")
    print(f"wrote {D}/clocks-h200-s17.json ({len(rows)} rows) and .png")


if __name__ == "__main__":
    main()
