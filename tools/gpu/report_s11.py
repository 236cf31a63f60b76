"""JSON + PNG of session 11's A/B runs (docs/benchmarks/s11/), parsed from the calls' printed lines.

* ``s12a-stdout.log``: d128 zigzag, ``overlap=0`` (then the default) / ``overlap=2`` (the
  committed wait) / ``overlap=2`` with the softmax-gated wait patch, two alternating repeats
  (the lines after the two overlap test cases run alone);
* ``s12b-stdout.log``: ``overlap=0`` / ``overlap=2`` at d192 and d64 zigzag, paged 64k C = 2
  (d128, d192, with the packed baseline) and interleave C = 4, two alternating repeats.

Writes ``ab-h200-s11.json`` ({ab, workload, variant, rep, tflops}) and ``ab-h200-s11.png``.
Run from the repository root: ``python tools/gpu/report_s11.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

from report_s9 import write_ab

D = Path("docs/benchmarks/s11")


def rows() -> list[dict]:
    out = []
    for line in (D / "s12a-stdout.log").read_text().splitlines():
        m = re.match(r"(src|/tmp/gated/src) (overlap=\d) rep (\d) rc 0 (.*)", line)
        if m:
            variant = "overlap 2, gated wait" if m.group(1) != "src" else m.group(2).replace("=", " ")
            for w, tf in re.findall(r"(\d+k C=\d) (\d+)", m.group(4)):
                out.append(dict(ab="d128 overlap", workload=f"d128 {w}", variant=variant, rep=int(m.group(3)),
                                tflops=float(tf)))
    for line in (D / "s12b-stdout.log").read_text().splitlines():
        m = re.match(r"(d192|d64|paged|inter) rep (\d) (overlap=\d) rc 0 (.*)", line)
        if m:
            ab = {"d192": "d192 overlap", "d64": "d64 overlap", "paged": "paged 64k C=2 overlap",
                  "inter": "interleave C=4 overlap"}[m.group(1)]
            for w, tf in re.findall(r"(d\d+ S=\d+k (?:C=\d(?: paged\d+)?|interleave C=4)) (\d+)", m.group(4)):
                out.append(dict(ab=ab, workload=w, variant=m.group(3).replace("=", " "), rep=int(m.group(2)),
                                tflops=float(tf)))
    return out


def main() -> None:
    write_ab(rows(), D / "ab-h200-s11", "H200, 2026-12-02, session 11 overlap A/B (tools/gpu/s12a-s12b.sh)")


if __name__ == "__main__":
    main()
