"""Choose the kernel patches ``tools/gpu/s13c.sh`` applies (``PATCHES=auto``) from the A/B lines
``s13a.sh`` and ``s13b.sh`` saved on the warm GPU machine, by a rule fixed before the runs:

* ``split_kv_release`` is kept when its Hopper GPU tests passed and, against the tree's defaults
  (D128 at ``overlap=2``, D192 at ``overlap=0``), the patched source at its better D192 overlap
  mode gains >= 1% (geometric mean over all A/B points, repeats averaged), neither head dim loses
  more than 0.5% (geomean) and no point falls below 0.96x. ``d192_overlap`` (D192 joins
  ``OVERLAP_HEAD_DIMS``) comes with it when D192 ran faster at ``overlap=2`` on the patched source.
* ``o_smem_epilogue`` is kept when its tests passed, the short-batch points gain >= 1% (geomean),
  the dense points lose at most 0.5% and no point falls below 0.96x.

Prints the chosen names on stdout (space separated, possibly none) and the reasons on stderr.
Usage: ``python3 tools/gpu/choose_patches.py S13A_LINES S13B_LINES``.
"""

from __future__ import annotations

import math
import re
import sys
from collections import defaultdict
from pathlib import Path

MIN_GAIN, MAX_LOSS, MIN_POINT = 1.01, 0.995, 0.96


def _points(text: str) -> dict[str, float]:
    """``"d128 S=16k C=1 612 | d128 S=16k C=2 598"`` -> {workload: TF/s}."""
    out = {}
    for item in text.split(" | "):
        name, _, value = item.strip().rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


def _read(path: str, pattern: str) -> tuple[dict, dict]:
    """(mean TF/s per (variant, workload), tests summary per group) from one script's saved lines."""
    sums, tests = defaultdict(list), {}
    if not Path(path).is_file():
        return {}, {}
    for line in Path(path).read_text().splitlines():
        t = re.match(r"== (\S+) \(rc (\d+)\): (\d+) passed, (\d+) failed", line)
        if t:
            tests[t.group(1)] = int(t.group(2)) == 0 and int(t.group(4)) == 0 and int(t.group(3)) > 0
            continue
        m = re.match(pattern, line)
        if m:
            for w, tf in _points(m.group("rest")).items():
                sums[(m.group("variant"), w)].append(tf)
    return {k: sum(v) / len(v) for k, v in sums.items()}, tests


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def _ratios(tf: dict, new: dict[str, str], old: dict[str, str], workloads: list[str]) -> dict[str, float]:
    """Per workload: TF/s of variant ``new[w]`` / TF/s of variant ``old[w]``."""
    return {w: tf[(new[w], w)] / tf[(old[w], w)] for w in workloads
            if (new[w], w) in tf and (old[w], w) in tf}


def _tested(path: str, pattern: str, group: str, patch: str):
    """(mean TF/s per (variant, workload), the workloads) of one script's lines, or None with the
    reason on stderr when its test group did not pass."""
    tf, tests = _read(path, pattern)
    if not tests.get(group):
        print(f"{patch}: tests not passed ({tests})", file=sys.stderr)
        return None
    return tf, sorted({w for _, w in tf})


def choose_split(path: str) -> list[str]:
    got = _tested(path, r"(?P<variant>\S+ \S+) rep \d rc 0 (?P<rest>.*)", "split", "split_kv_release")
    if got is None:
        return []
    tf, workloads = got
    d192 = [w for w in workloads if w.startswith("d192")]
    d128 = [w for w in workloads if w.startswith("d128")]
    tree = {w: "src overlap=2" if w in d128 else "src overlap=0" for w in workloads}
    split_ov = {o: _geomean([tf[(f"/tmp/split/src overlap={o}", w)] for w in d192
                             if (f"/tmp/split/src overlap={o}", w) in tf]) for o in (0, 2)}
    d192_mode = 2 if split_ov[2] > split_ov[0] else 0
    new = {w: "/tmp/split/src overlap=2" if w in d128 else f"/tmp/split/src overlap={d192_mode}" for w in workloads}
    r = _ratios(tf, new, tree, workloads)
    if not r:
        print("split_kv_release: no A/B points", file=sys.stderr)
        return []
    g_all, g128 = _geomean(list(r.values())), _geomean([r[w] for w in d128 if w in r])
    g192 = _geomean([r[w] for w in d192 if w in r])
    keep = g_all >= MIN_GAIN and g128 >= MAX_LOSS and g192 >= MAX_LOSS and min(r.values()) >= MIN_POINT
    print(f"split_kv_release: d192 at overlap={d192_mode} (split geomean ov0 {split_ov[0]:.0f} / ov2 "
          f"{split_ov[2]:.0f} TF/s); vs tree geomean {g_all:.3f} (d128 {g128:.3f}, d192 {g192:.3f}), "
          f"min {min(r.values()):.3f} -> {'keep' if keep else 'drop'}", file=sys.stderr)
    return (["split_kv_release"] + (["d192_overlap"] if d192_mode == 2 else [])) if keep else []


def choose_osmem(path: str) -> list[str]:
    got = _tested(path, r"(?P<kind>short|dense) rep \d (?P<variant>\S+) rc 0 (?P<rest>.*)", "osmem", "o_smem_epilogue")
    if got is None:
        return []
    tf, workloads = got
    r = _ratios(tf, dict.fromkeys(workloads, "/tmp/osmem/src"), dict.fromkeys(workloads, "src"), workloads)
    if not r:
        print("o_smem_epilogue: no A/B points", file=sys.stderr)
        return []
    short = [x for w, x in r.items() if "x" in w.split()[-1]]  # short workloads end in "NxL"
    dense = [x for w, x in r.items() if "x" not in w.split()[-1]]
    g_short, g_dense = _geomean(short), _geomean(dense)
    keep = g_short >= MIN_GAIN and (not dense or g_dense >= MAX_LOSS) and min(r.values()) >= MIN_POINT
    print(f"o_smem_epilogue: short geomean {g_short:.3f}, dense {g_dense:.3f}, min {min(r.values()):.3f} -> "
          f"{'keep' if keep else 'drop'}", file=sys.stderr)
    return ["o_smem_epilogue"] if keep else []


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit(__doc__)
    print(" ".join(choose_split(argv[0]) + choose_osmem(argv[1])))


if __name__ == "__main__":
    main(sys.argv[1:])
