"""JSON + PNG of the twentieth session's A/B runs (docs/benchmarks/s24/), from the lines the calls
printed: ``s24a-lines.txt``, the 0.3.15 tree against ``ptx_warp_release.patch`` (per-warp stage
releases by a rewrite of the dense kernel's PTX) and that patch + ``ptx_warp_release_top.patch``
(also no ``bar.sync`` before the consumers' waits): dense d128 / d192 zigzag 16k / 64k C = 1..8,
two interleaved repeats; paged 64k C = 2 (pages 16, 64) and short batches once;
``s24b-lines.txt``: d128 zigzag 16k / 64k C = 1..8, three interleaved repeats of the tree, the
tree with ``--sm90-options pingpong=0``, the copy with both patches, and that copy with
``pingpong=0`` (no turn-taking and no warpgroup ``bar.sync`` in the key loop, as FA4's);
``s24d-lines.txt``: the tree against ``v_wait_after_qk.patch`` (V's wait after ``Q K^T`` is issued):
dense d128 / d192 two repeats, short once.

Writes ``ab-h200-s24.{json,png}`` ({ab, workload, variant, rep, tflops}). Run from the repository
root: ``PYTHONPATH=tools/gpu python tools/gpu/report_s24.py``.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from report_s9 import ab_line_rows, write_ab  # noqa: E402

D = Path("docs/benchmarks/s24")


def main() -> None:
    rows = ab_line_rows(D / "s24a-lines.txt", lambda g: f"{g}: per-warp stage releases (PTX rewrite)",
                        {"src": "0.3.15", "/tmp/pwa/src": "+ ptx_warp_release",
                         "/tmp/pwb/src": "+ ptx_warp_release_top"})
    rows += ab_line_rows(D / "s24b-lines.txt", lambda g: "d128: releases and turn-taking",
                         {"src": "0.3.15", "/tmp/pp0/src": "pingpong=0", "/tmp/pwb/src": "per-warp releases",
                          "/tmp/pwb0/src": "per-warp releases, pingpong=0"})
    rows += ab_line_rows(D / "s24d-lines.txt", lambda g: f"{g}: V's wait after Q K^T",
                         {"src": "0.3.15", "/tmp/vw/src": "+ v_wait_after_qk"})
    write_ab(rows, D / "ab-h200-s24", "H200, 2026-12-03, twentieth session A/B runs (s24a, s24b, s24d)", {})


if __name__ == "__main__":
    main()
