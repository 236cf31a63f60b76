"""JSON + PNG of the nineteenth session's A/B runs (docs/benchmarks/s23/), from the lines the calls
printed:

* ``s23a-lines.txt``: the 0.3.15 tree (PDL on) against ``pdl_default_off.patch``: MLA decode
  B = 1 / 8 / 64 over 4k / 32k / 128k keys q1 / q4 (graph replay, TF/s) and one rank's shard step
  (8 layers in one CUDA graph: layer calls per ms), two interleaved repeats;
* ``s23b-lines.txt``: d128 zigzag 16k / 64k C = 1..8 on the tree's defaults, with
  ``--sm90-options sections=0`` and with ``persistent=1``, two interleaved repeats;
* ``s23d-lines.txt``: the tree against ``thread_release.patch`` (per-thread stage releases):
  dense d128 / d192 two repeats, paged and short once.

Writes ``ab-h200-s23.{json,png}`` ({ab, workload, variant, rep, tflops}). The session's Nsight
Compute summary is ``ncu-d128-s23c.csv`` (+ ``-raw`` / ``-details``), its tables the bench's own
``dense-d128-fa4-s23c.*`` and ``kernel14-fa4-h200-s23f.*``. Run from the repository root:
``PYTHONPATH=tools/gpu python tools/gpu/report_s23.py``.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from report_s9 import ab_line_rows, write_ab  # noqa: E402

D = Path("docs/benchmarks/s23")
PDL = {"decode": "MLA decode, PDL on vs off (graph replay)", "layers": "shard step, PDL on vs off"}


def main() -> None:
    rows = (ab_line_rows(D / "s23a-lines.txt", PDL.get, {"src": "0.3.15 (PDL on)", "/tmp/nopdl/src": "pdl=False"})
            + ab_line_rows(D / "s23b-lines.txt", lambda g: "d128 schedule options",
                           {"src": "0.3.15", "/tmp/sec0/src": "sections=0", "/tmp/pers/src": "persistent=1"})
            + ab_line_rows(D / "s23d-lines.txt", lambda g: f"{g}: per-thread stage releases",
                           {"src": "0.3.15", "/tmp/thr/src": "+ thread_release"}))
    write_ab(rows, D / "ab-h200-s23", "H200, 2026-12-03, nineteenth session A/B runs (s23a, s23b, s23d)",
             {PDL["layers"]: "layer calls per ms (best of repeats)"})


if __name__ == "__main__":
    main()
