"""JSON + PNG of the twelfth session's A/B runs (docs/benchmarks/s16/), parsed from the lines the
calls saved (``s16a.sh`` / ``s16c.sh``: ``s16a-stdout.log``, ``s16c-stdout.log``), at the
defaults, d128 / d192 zigzag 16k / 64k, C = 1, 2, 4, 8, two alternating repeats; short and paged
points once:

* ``s16a``: the tree against the K/V ring's "slot free" signals as named barriers
  (``named_barrier_release`` patch; not kept);
* ``s16c``: the tree against named-barrier ping-pong made the default at D128 and D192
  (``named_pingpong`` + ``pingpong_auto``: kept at D128), and that on top of the named-barrier
  ring release.

Writes ``ab-h200-s16.json`` ({ab, workload, variant, rep, tflops}) and ``ab-h200-s16.png``.
Run from the repository root: ``PYTHONPATH=tools/gpu python tools/gpu/report_s16.py``.
"""

from __future__ import annotations

from pathlib import Path

from report_s9 import ab_line_rows, write_ab

D = Path("docs/benchmarks/s16")
TREES = {"src": "tree", "/tmp/nb/src": "named ring release", "/tmp/ppa/src": "named ping-pong",
         "/tmp/ppnb/src": "named ping-pong + ring release"}


def rows() -> list[dict]:
    return [r for call in ("s16a", "s16c")
            for r in ab_line_rows(D / f"{call}-stdout.log", lambda group, call=call: f"{call} {group}", TREES)]


def main() -> None:
    write_ab(rows(), D / "ab-h200-s16", "H200, 2026-12-02, session 12 A/B (tools/gpu/s16a.sh, s16c.sh)")


if __name__ == "__main__":
    main()
