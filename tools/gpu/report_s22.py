"""JSON + PNG of the eighteenth session's decode A/B (docs/benchmarks/s22/), from the lines the
calls printed:

* ``s22a-lines.txt``: the 0.3.14 tree against ``split_combine_pdl.patch`` (programmatic dependent
  launch between the split-KV kernels and the combine): MLA decode B = 1 / 8 over 4k / 32k keys
  q1 / q4 (graph replay, TF/s) and one rank's shard step (``python -m cpattn.bench decode``, GQA
  and MLA, C = 1 / 8, B = 1 / 8, q1, 8 layers in one CUDA graph: layer calls per ms), two
  interleaved repeats;
* ``s22d-lines.txt``: the same workloads once on the 0.3.15 tree (the patch adopted, every
  combine program waiting).

Writes ``ab-h200-s22.{json,png}`` ({ab, workload, variant, rep, tflops}; the shard-step rows'
``tflops`` field holds layer calls per ms). Issue 14's table of the session (s22c) is the bench's
own ``kernel14-fa4-h200-s22c.{json,png,log}``. Run from the repository root:
``PYTHONPATH=tools/gpu python tools/gpu/report_s22.py``.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from report_s9 import ab_line_rows, write_ab  # noqa: E402

D = Path("docs/benchmarks/s22")
TREES_A = {"src": "0.3.14", "/tmp/pdl/src": "+ split_combine_pdl"}
TREES_D = {"src": "0.3.15 (s22d)"}
NAMES = {"decode": "MLA decode (graph replay)", "layers": "shard step, 8 layers in one graph"}


def main() -> None:
    rows = (ab_line_rows(D / "s22a-lines.txt", NAMES.get, TREES_A)
            + ab_line_rows(D / "s22d-lines.txt", NAMES.get, TREES_D))
    write_ab(rows, D / "ab-h200-s22", "H200, 2026-12-03, split -> combine with PDL (s22a), 0.3.15 (s22d)",
             {NAMES["layers"]: "layer calls per ms (best of repeats)"})


if __name__ == "__main__":
    main()
