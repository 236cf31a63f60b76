"""JSON + PNG of the fourteenth session's GPU runs (docs/benchmarks/s18/), from the files the calls
wrote:

* A/B lines (``_variant.sh``'s ``ab``): ``s18b-lines.txt``, the tree (L2 sequence groups in the tile
  order) against ``no_seq_groups.patch`` on short batches, two interleaved repeats;
  ``s18d-lines.txt``, the tree's L2 budget (two thirds of the L2) against a third and an eighth
  (``l2_budget_3th`` / ``_8th.patch``), dense d128 / d192 16k / 64k C = 1..8 (two repeats) and short
  batches (once); ``s18f-lines.txt``, the tree against ``named_ring_per_item.patch`` (the ring's
  slots freed through named barriers where one program runs one work item): dense two repeats,
  paged and short once; ``s18h-lines.txt``, the tree against ``mla_wait_first.patch``: MLA
  prefill and decode (the tree twice, the patch once: the call hit its time limit);
* s18b's benchmark JSON with ``--clocks`` (``short-{groups,nogroups}-rep{1,2}.json``): SM clock and
  board power per short batch.

Writes ``ab-h200-s18.{json,png}`` ({ab, workload, variant, rep, tflops}) and
``clocks-short-h200-s18.{json,png}``. Run from the repository root:
``PYTHONPATH=tools/gpu python tools/gpu/report_s18.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from report_s9 import ab_line_rows, bar_panels, write_ab  # noqa: E402

D = Path("docs/benchmarks/s18")
TREES = {"src": "tree", "/tmp/nog/src": "no sequence groups", "/tmp/b3/src": "L2 budget 1/3",
         "/tmp/b8/src": "L2 budget 1/8", "/tmp/nrp/src": "named ring per item", "/tmp/mw/src": "MLA wait first"}


def ab_rows() -> list[dict]:
    return (ab_line_rows(D / "s18b-lines.txt", lambda g: f"s18b {g}", TREES)
            + ab_line_rows(D / "s18d-lines.txt", lambda g: f"s18d {g}", TREES)
            + ab_line_rows(D / "s18f-lines.txt", lambda g: f"s18f {g}", TREES)
            + ab_line_rows(D / "s18h-lines.txt", lambda g: f"s18h {g}", TREES))


def clock_rows() -> list[dict]:
    out = []
    for variant in ("groups", "nogroups"):
        for rep in (1, 2):
            for r in json.loads((D / f"short-{variant}-rep{rep}.json").read_text()):
                out.append(dict(workload=r["workload"], variant=variant, rep=rep, tflops=r["tflops"],
                                sm_mhz=r["sm_mhz"], watts=r["watts"], tflops_per_ghz=r["tflops_per_ghz"]))
    return out


def plot_clocks(rows: list[dict], path: Path) -> None:
    """TF/s, SM clock and board power per short batch, sequence groups on and off, per repeat."""
    bar_panels(rows, [(v, rep) for rep in (1, 2) for v in ("nogroups", "groups")], lambda r: (r["variant"], r["rep"]),
               [("tflops", "TF/s"), ("sm_mhz", "SM clock (MHz, busy samples)"),
                ("watts", "board power (W, busy samples)")], path,
               "H200, 2026-12-02, short batches with and without L2 sequence groups "
               "(tools/gpu/s18b.sh, python -m cpattn.bench kernel --clocks)",
               lambda k: "C0" if k[0] == "groups" else "C1", lambda k: 1.0 if k[1] == 1 else 0.6,
               lambda k: f"{k[0]} (rep {k[1]})")


def main() -> None:
    write_ab(ab_rows(), D / "ab-h200-s18", "H200, 2026-12-02, session 14 A/B (tools/gpu/s18b.sh, s18d.sh, s18f.sh, s18h.sh)")
    rows = clock_rows()
    (D / "clocks-short-h200-s18.json").write_text(json.dumps(rows, indent=1))
    plot_clocks(rows, D / "clocks-short-h200-s18.png")
    print(f"wrote {D}/clocks-short-h200-s18.json ({len(rows)} rows) and .png")


if __name__ == "__main__":
    main()
