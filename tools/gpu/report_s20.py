"""JSON + PNG of the sixteenth session's MLA A/Bs (docs/benchmarks/s20/), from the lines the calls
printed:

* ``s20a-lines.txt``: the 0.3.12 tree against ``mla_pv_first_paged.patch`` (decode's key-loop order
  for paged MLA prefill; in the tree since 0.3.13): MLA prefill 16k C = 1, packed and over pages
  of 16 / 64 / 256 keys, two interleaved repeats; ``s20a-64k-partial.log``: the 64k runs' own
  log lines (each run killed by the 80 s A/B limit before its last workload);
* ``s20b-lines.txt``: the 0.3.12 tree against ``mla_chunk_ready.patch`` (three ready barriers per
  latent stage; in the tree since 0.3.13): decode B = 8 / 64 over 4k / 32k keys q1 / q4 (graph
  replay) and MLA prefill, two interleaved repeats;
* ``s20d-lines.txt``: the 0.3.13 tree (both), one run of MLA prefill 16k C = 1 packed / paged and
  decode B = 8 / 64 over 4k keys (graph replay).

Writes ``ab-h200-s20.{json,png}`` ({ab, workload, variant, rep, tflops}). Run from the repository
root: ``PYTHONPATH=tools/gpu python tools/gpu/report_s20.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from choose_patches import _points  # noqa: E402
from report_s9 import ab_line_rows, write_ab  # noqa: E402

D = Path("docs/benchmarks/s20")
TREES_A = {"src": "tree (0.3.12)", "/tmp/pfp/src": "P V first, paged"}
TREES_B = {"src": "tree (0.3.12)", "/tmp/mcr/src": "ready per part"}
_LOG = re.compile(r"\] (mla576 S=\d+k) zigzag (C=\d+)( paged\d+)?\s.*?([\d.]+) TF/s")


def partial_rows(path: Path, ab: str) -> list[dict]:
    """Rows of the bench's own log lines under "== GROUP rep N TREE" headers."""
    out, head = [], None
    for line in path.read_text().splitlines():
        h = re.match(r"== \S+ rep (\d) (\S+)", line)
        if h:
            head = (int(h.group(1)), TREES_A[h.group(2)])
            continue
        m = _LOG.search(line)
        if m and head:
            out.append(dict(ab=ab, workload=f"{m.group(1)} {m.group(2)}{m.group(3) or ''}", variant=head[1],
                            rep=head[0], tflops=float(m.group(4))))
    return out


def single_rows(path: Path, variant: str) -> list[dict]:
    """Rows of one-run lines ("GROUP TREE rc 0 workload TF/s | ...")."""
    out = []
    for line in path.read_text().splitlines():
        m = re.match(r"(\w+) \S+ rc 0 (.*)", line)
        if m:
            for w, tf in _points(m.group(2)).items():
                out.append(dict(ab=f"s20d {m.group(1)}", workload=w, variant=variant, rep=1, tflops=tf))
    return out


def main() -> None:
    rows = (ab_line_rows(D / "s20a-lines.txt", lambda g: f"s20a {g} prefill", TREES_A)
            + partial_rows(D / "s20a-64k-partial.log", "s20a p64k prefill (partial)")
            + ab_line_rows(D / "s20b-lines.txt", lambda g: f"s20b {g}" + (" (graph replay)" if g == "decode" else ""),
                           TREES_B)
            + single_rows(D / "s20d-lines.txt", "tree (0.3.13)"))
    write_ab(rows, D / "ab-h200-s20",
             "H200, 2026-12-03, MLA: P V first for paged prefill (s20a), ready barrier per part (s20b), both (s20d)")


if __name__ == "__main__":
    main()
