"""JSON + PNG of session 10's A/B runs (docs/benchmarks/s10/), parsed from the calls' printed lines.

* ``s11a-stdout.log``: d192 zigzag, L2 head sections forced on against ``sections="auto"``
  (1.05 threshold), two alternating repeats;
* ``s11b-stdout.log``: the 16k dense points, triton and FA4, with the old timing (2 warm-up
  calls) and sustained timing (``--warmup-ms 200 --min-ms 50``), each backend order;
* ``s11c-stdout.log``: sm90 options at 16k under sustained timing, two repeats;
* ``s11d-stdout.log`` / ``s11e-stdout.log``: short sequences, the persistent consumers' Q
  prefetch (v1: next item located and its Q loaded before the epilogue, kept; v2: located
  before the key blocks, dropped) against the tree before it;
* ``s11g-stdout.log``: ``overlap=2`` with its wait for ``P V`` gated on the softmax (not kept)
  against the default, two alternating repeats.

Writes ``ab-h200-s10.json`` ({ab, workload, variant, rep, tflops}) and ``ab-h200-s10.png``.
Run from the repository root: ``python tools/gpu/report_s10.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

from report_s9 import write_ab

D = Path("docs/benchmarks/s10")


def _lines(name: str) -> list[str]:
    return (D / name).read_text().splitlines()


def rows() -> list[dict]:
    out = []
    for line in _lines("s11a-stdout.log"):
        m = re.match(r"sections=(\S+) rep (\d) rc 0 (.*)", line)
        if m:
            for w, tf in re.findall(r"(\d+k C=\d) (\d+)", m.group(3)):
                out.append(dict(ab="d192 L2 sections", workload=f"d192 S={w}",
                                variant="sections" if m.group(1) == "1" else "auto (1.05)", rep=int(m.group(2)),
                                tflops=float(tf)))
    for line in _lines("s11b-stdout.log"):
        m = re.match(r"(tf|ft)-(default|warm) rc 0 \[[^]]*\] (.*)", line)
        if m:
            timing = "2 warm-up calls" if m.group(2) == "default" else "200 ms warm-up"
            for w, backend, tf in re.findall(r"(d\d+ C=\d) (triton|fa4) (\d+)", m.group(3)):
                out.append(dict(ab="16k timing", workload=f"{w.replace(' C=', ' 16k C=')}",
                                variant=f"{backend}, {timing}", rep=1 if m.group(1) == "tf" else 2,
                                tflops=float(tf)))
    for line in _lines("s11c-stdout.log"):
        m = re.match(r"(\S+)-(\d) rc 0 (d.*)", line)
        if m and not m.group(1).startswith("short"):
            for w, tf in re.findall(r"(d\d+ 16k C=\d) t (\d+)", m.group(3)):
                out.append(dict(ab="16k sm90 options", workload=w, variant=m.group(1), rep=int(m.group(2)),
                                tflops=float(tf)))
    for name, tag in (("s11d-stdout.log", {"old": "before", "new": "v1 (kept)"}),
                      ("s11e-stdout.log", {"old": "before", "v1": "v1 (kept)", "new": "v2 (dropped)"})):
        for line in _lines(name):
            m = re.match(r"(old|v1|new) rep (\d) rc 0 (.*)", line)
            if m:
                for w, tf in re.findall(r"(\d+x\d+) (\d+)", m.group(3)):
                    out.append(dict(ab="persistent Q prefetch", workload=f"d128 {w}", variant=tag[m.group(1)],
                                    rep=int(m.group(2)) + (2 if name.startswith("s11e") else 0), tflops=float(tf)))
    names = {"overlap=0": "overlap 0 (default)", "overlap=2": "overlap 2, gated wait",
             "overlap=2,pingpong=1": "overlap 2 + pingpong, gated wait"}
    for line in _lines("s11g-stdout.log"):
        m = re.match(r"(overlap=\S+) rep (\d) rc 0 (.*)", line)
        if m:
            for w, tf in re.findall(r"(d\d+ \d+k C=\d) (\d+)", m.group(3)):
                out.append(dict(ab="sm90 overlap (gated wait)", workload=w, variant=names[m.group(1)],
                                rep=int(m.group(2)), tflops=float(tf)))
    return out


def main() -> None:
    write_ab(rows(), D / "ab-h200-s10", "H200, 2026-12-01/02, session 10 A/B runs (tools/gpu/s11a-s11g.sh)")


if __name__ == "__main__":
    main()
