"""JSON + PNG of the seventeenth session's MLA A/Bs (docs/benchmarks/s21/), from the lines the
calls printed:

* ``s21a-lines.txt``: the 0.3.13 tree against 0.3.12 (``revert_to_0312_mla.patch``): decode
  B = 8 / 64 over 4k / 32k keys q1 / q4 (graph replay) and MLA prefill, two interleaved repeats;
* ``s21b-lines.txt``: the 0.3.13 tree against ``mla_staged_epilogue.patch`` (the epilogue's
  stores staged through the value buffers, 16 bytes per thread; not kept): the same workloads.

Writes ``ab-h200-s21.{json,png}`` ({ab, workload, variant, rep, tflops}). Issue 14's table of the
session (s21d) is the bench's own ``kernel14-fa4-h200-s21d.{json,png,log}``. Run from the
repository root: ``PYTHONPATH=tools/gpu python tools/gpu/report_s21.py``.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from report_s9 import ab_line_rows, write_ab  # noqa: E402

D = Path("docs/benchmarks/s21")
TREES_A = {"src": "tree (0.3.13)", "/tmp/r12/src": "0.3.12"}
TREES_B = {"src": "tree (0.3.13)", "/tmp/mse/src": "staged epilogue"}


def _name(call: str):
    return lambda g: f"{call} {g}" + (" (graph replay)" if g == "decode" else " prefill")


def main() -> None:
    rows = (ab_line_rows(D / "s21a-lines.txt", _name("s21a"), TREES_A)
            + ab_line_rows(D / "s21b-lines.txt", _name("s21b"), TREES_B))
    write_ab(rows, D / "ab-h200-s21",
             "H200, 2026-12-03, MLA: 0.3.13 vs 0.3.12 (s21a), staged epilogue (s21b)")


if __name__ == "__main__":
    main()
