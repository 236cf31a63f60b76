"""JSON + PNG of the eleventh session's A/B runs (docs/benchmarks/s13/), parsed from the lines the
calls saved (``s13a.sh`` / ``s13b.sh``: ``s13a-stdout.log``, ``s13b-stdout.log``).

* ``s13a``: the tree at ``overlap`` 0 / 1 / 2 and with 64-key blocks x 4 stages at ``overlap=2``,
  against the split K / V release patch at ``overlap`` 0 / 2; d128 and d192 zigzag at 16k / 64k,
  C = 1, 2, 4, 8; two alternating repeats.
* ``s13b``: the tree against O stored through the Q tile (``o_smem_epilogue`` patch) at the
  defaults; short batches and d128 / d192 zigzag 16k / 64k at C = 1, 2, 8; two alternating repeats.
* ``s14b``: at ``overlap=0``, K released after ``Q K^T`` (the tree: "/tmp/early/src" as run)
  against K and V released together after ``P V`` ("src" as run); d192 zigzag 16k / 64k, C = 1..8.

Writes ``ab-h200-s13.json`` ({ab, workload, variant, rep, tflops}) and ``ab-h200-s13.png``.
Run from the repository root: ``python tools/gpu/report_s13.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

from choose_patches import _points
from report_s9 import ab_line_rows, write_ab

D = Path("docs/benchmarks/s13")
TREES = {"src": "tree", "/tmp/split/src": "split release", "/tmp/osmem/src": "O via Q tile"}
S14B = {"src": "K + V after P V", "/tmp/early/src": "K after Q K^T (tree)"}


def rows() -> list[dict]:
    out = []
    for line in (D / "s13a-stdout.log").read_text().splitlines():
        m = re.match(r"(\S+) (\S+) rep (\d) rc 0 (.*)", line)
        if m:
            variant = f"{TREES[m.group(1)]} {m.group(2).replace('block_n=64,stages=4,', '64x4 ')}"
            for w, tf in _points(m.group(4)).items():
                out.append(dict(ab=f"{w.split()[0]} ring release", workload=w, variant=variant, rep=int(m.group(3)),
                                tflops=tf))
    out += ab_line_rows(D / "s13b-stdout.log", lambda group: f"{group}: O epilogue", TREES)
    for line in (D / "s14b-stdout.log").read_text().splitlines():
        m = re.match(r"(\S+) overlap=0 rep (\d) rc 0 (.*)", line)
        if m:
            for w, tf in _points(m.group(3)).items():
                out.append(dict(ab="d192 overlap=0: K release", workload=w, variant=S14B[m.group(1)],
                                rep=int(m.group(2)), tflops=tf))
    return out


def main() -> None:
    write_ab(rows(), D / "ab-h200-s13", "H200, 2026-12-02, session 11 A/B (tools/gpu/s13a.sh, s13b.sh, s14b.sh)")


if __name__ == "__main__":
    main()
