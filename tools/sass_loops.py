"""Summarise the loops of a SASS listing (``cuobjdump -sass``) by their synchronisation: for every
backward branch, the loop body's sequence of mbarrier waits and arrivals, named / warpgroup
barriers, wgmma issue runs and waits, and softmax ``EX2`` runs, with runs of one kind counted.

For comparing key loops without a GPU: the dense sm90 kernel's SASS comes from
``tools/sm90_offline_check.py --sass DIR``, FA4's from ``tools/fa4_offline_sass.py``. Usage:
``python tools/sass_loops.py FILE.sass [--min-gmma 8]`` (loops with fewer wgmmas than that are
skipped: the loader's and the scheduler's loops).

Tokens: ``wait`` mbarrier try-wait, ``arrive`` mbarrier arrival (``arrive*`` predicated: one
thread or lane; ``arrive-cp`` ``cp.async.mbarrier.arrive``), ``bar(ID,N)`` ``BAR.SYNC`` of N
threads (``bar(ID)``: the whole CTA), ``barv(ID,N)`` ``BAR.ARV``, ``gmma`` a wgmma, ``W0`` / ``W1``
``WARPGROUP.DEPBAR.LE gsb0, 0`` / ``1``, ``E`` ``MUFU.EX2``.
"""

from __future__ import annotations

import argparse
import re

_ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def _token(ins: str) -> str | None:
    pred = ins.startswith("@")
    op = ins.split()[1] if pred else ins.split()[0]
    if op.startswith("SYNCS.PHASECHK"):
        return "wait"
    if op.startswith("SYNCS.ARRIVE"):
        return "arrive*" if pred else "arrive"
    if op.startswith("ARRIVES"):
        return "arrive-cp"
    if op.startswith(("BAR.SYNC", "BAR.ARV")):
        args = [a.strip() for a in ins.split(op, 1)[1].split(",")]
        kind = "bar" if op.startswith("BAR.SYNC") else "barv"
        return f"{kind}({','.join(args)})"
    if op.startswith("HGMMA"):
        return "gmma"
    if op.startswith("WARPGROUP.DEPBAR"):
        return "W0" if ins.rstrip().endswith("0x0") else "W1"
    if op == "MUFU.EX2":
        return "E"
    return None


def runs(tokens: list[str]) -> str:
    """``tokens`` with each run of one kind written once, counted: ``a a b`` -> ``ax2 b``."""
    seq: list[list] = []
    for t in tokens:
        if seq and seq[-1][0] == t:
            seq[-1][1] += 1
        else:
            seq.append([t, 1])
    return " ".join(f"{t}x{n}" if n > 1 else t for t, n in seq)


def loops(sass: str, min_gmma: int = 8) -> list[tuple[int, int, str]]:
    """``(start, end, summary)`` per innermost loop (a branch to a lower address whose span holds
    no other such loop) with at least ``min_gmma`` wgmmas."""
    ins = [(int(a, 16), body) for a, body in _ADDR.findall(sass)]
    out = []
    for addr, body in ins:
        m = re.match(r"(?:@!?U?P\w+\s+)?BRA\b.*?(0x[0-9a-f]+)", body)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target >= addr:
            continue
        tokens = [t for t in (_token(b) for a, b in ins if target <= a <= addr) if t is not None]
        if tokens.count("gmma") >= min_gmma:
            out.append((target, addr, runs(tokens)))
    # innermost loops only: a wait's retry path, placed after the kernel's body, branches back
    # into a loop, so its span holds that loop or starts inside one and ends past it
    def nested_or_crossing(lp, o):
        return o != lp and (lp[0] <= o[0] and o[1] <= lp[1] or o[0] < lp[0] <= o[1] < lp[1])
    return [lp for lp in out if not any(nested_or_crossing(lp, o) for o in out)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sass")
    p.add_argument("--min-gmma", type=int, default=8)
    a = p.parse_args()
    with open(a.sass) as f:
        for start, end, summary in loops(f.read(), a.min_gmma):
            print(f"{start:#06x}-{end:#06x}: {summary}")


if __name__ == "__main__":
    main()
