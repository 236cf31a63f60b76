"""The ``PINGPONG_HEAD_DIMS`` ``tools/gpu/s16d.sh`` builds (printed as a Python literal, ``()``:
none, the tree as it is) from the A/B lines ``s16c.sh`` saved, by a rule fixed before the runs:
the patched source (named-barrier ping-pong, ``pingpong="auto"`` at D128 and D192) passed its
Hopper GPU tests, and per head dim its dense points against the tree (repeats averaged) have a
geometric mean >= 1.01, none below 0.96, and its paged points a geometric mean >= 0.995.

Usage: ``python3 tools/gpu/choose_s16.py S16C_LINES``.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict

from choose_patches import MAX_LOSS, MIN_GAIN, MIN_POINT, _geomean, _points

OLD, NEW = "src", "/tmp/ppa/src"
DIMS = {"d128": (128, 128), "d192": (192, 128)}


def main(path: str) -> str:
    sums, tests_ok = defaultdict(list), False
    for line in open(path).read().splitlines():
        t = re.match(r"== ppa \(rc (\d+)\): (\d+) passed, (\d+) failed", line)
        if t:
            tests_ok = int(t.group(1)) == 0 and int(t.group(3)) == 0 and int(t.group(2)) > 0
        m = re.match(r"(?P<group>\S+) rep \d+ (?P<tree>\S+) rc 0 (?P<rest>.*)", line)
        if m:
            for w, tf in _points(m.group("rest")).items():
                sums[(m.group("group"), m.group("tree"), w)].append(tf)
    mean = {k: sum(v) / len(v) for k, v in sums.items()}
    kept = []
    for name, dims in DIMS.items():
        def ratios(group):
            return [mean[(group, NEW, w)] / mean[(group, OLD, w)] for (g, t, w) in mean
                    if g == group and t == OLD and (g, NEW, w) in mean and w.startswith("d192") == (name == "d192")]
        dense, paged = ratios("dense"), ratios("paged")
        ok = (tests_ok and bool(dense) and _geomean(dense) >= MIN_GAIN and min(dense) >= MIN_POINT
              and (not paged or _geomean(paged) >= MAX_LOSS))
        print(f"{name}: tests {tests_ok}, dense geomean {_geomean(dense):.3f} min {min(dense, default=0):.3f}, "
              f"paged geomean {_geomean(paged):.3f} -> {'pingpong' if ok else 'no'}", file=sys.stderr)
        if ok:
            kept.append(dims)
    return repr(tuple(kept))


if __name__ == "__main__":
    print(main(sys.argv[1]))
