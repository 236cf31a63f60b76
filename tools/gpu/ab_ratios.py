"""Ratios of an A/B run's two sources from the lines ``_variant.sh``'s ``ab`` saved
(``"GROUP rep N TREE rc 0 workload TF/s | ..."``): per group the geometric mean of new / old
(repeats averaged first), the lowest point, and the verdict of the rule fixed before the runs
(``choose_patches.py``'s: tests passed, all points' geomean >= 1.01, no group below 0.995, no
point below 0.96).

Usage: ``python3 tools/gpu/ab_ratios.py LINES OLD_TREE NEW_TREE [--host-only]``. ``--host-only``: the
two trees differ only in host planning (the launch order, e.g. ``l2_budget_*.patch``), not in kernel
code, so no GPU test run of the new tree is required by the rule.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict

from choose_patches import MAX_LOSS, MIN_GAIN, MIN_POINT, _geomean, _points


def main(path: str, old: str, new: str, *flags: str) -> None:
    sums, tests_ok = defaultdict(list), None
    for line in open(path).read().splitlines():
        t = re.match(r"== (\S+) \(rc (\d+)\): (\d+) passed, (\d+) failed", line)
        if t:
            tests_ok = int(t.group(2)) == 0 and int(t.group(4)) == 0 and int(t.group(3)) > 0
            continue
        m = re.match(r"(?P<group>\S+) rep \d+ (?P<tree>\S+) rc 0 (?P<rest>.*)", line)
        if m:
            for w, tf in _points(m.group("rest")).items():
                sums[(m.group("group"), m.group("tree"), w)].append(tf)
    mean = {k: sum(v) / len(v) for k, v in sums.items()}
    ratios = {(g, w): mean[(g, new, w)] / mean[(g, old, w)] for (g, t, w) in mean
              if t == old and (g, new, w) in mean}
    groups = sorted({g for g, _ in ratios})
    for g in groups:
        r = {w: x for (gg, w), x in ratios.items() if gg == g}
        print(f"{g}: geomean {_geomean(list(r.values())):.3f}, min {min(r.values()):.3f} | "
              + " | ".join(f"{w} {x:.3f}" for w, x in sorted(r.items())))
    all_r = list(ratios.values())
    if "--host-only" in flags:
        tests_ok = True
    keep = (bool(tests_ok) and _geomean(all_r) >= MIN_GAIN and min(all_r, default=0) >= MIN_POINT
            and all(_geomean([x for (gg, _), x in ratios.items() if gg == g]) >= MAX_LOSS for g in groups))
    print(f"tests passed: {tests_ok}; all points geomean {_geomean(all_r):.3f}; verdict: {'keep' if keep else 'drop'}")


if __name__ == "__main__":
    main(*sys.argv[1:])
