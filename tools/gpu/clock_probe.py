"""SM clock and board power under the kernel benchmark's sustained timing, per (workload, backend).

Reads a ``python -m cpattn.bench kernel`` log (its progress lines ``[HH:MM:SS] <workload>
<backend> <family> <ms> ms <TF/s> TF/s ...``, one per finished (workload, backend)) and an
``nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu[,...]
--format=csv,noheader,nounits -lms 100`` log taken during the same run. A result's window runs
from the previous progress line to its own (warm-up and timed calls; whole seconds, the previous
line's own second left out); its busy samples are those drawing at least half the window's peak
power. Prints per result: TF/s, median SM MHz and W of the busy samples, TF/s per GHz (work per
clock) and J per PFLOP (energy per work), and writes them as JSON.

Usage: ``PYTHONPATH=src python3 tools/gpu/clock_probe.py BENCH_LOG SMI_LOG OUT_JSON`` (the sample
parsing and the busy filter are ``cpattn.bench.gpu_clocks``'s, which ``--clocks`` uses per row).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from datetime import datetime

from cpattn.bench.gpu_clocks import busy_samples, parse_sample

_LINE = re.compile(r"\[(\d\d:\d\d:\d\d)\] (.{38}) (\S+)\s+(\S+)\s+([\d.]+) ms\s+([\d.]+) TF/s")


def _seconds(hms: str) -> int:
    h, m, s = (int(x) for x in hms.split(":"))
    return 3600 * h + 60 * m + s


def bench_windows(text: str) -> list[dict]:
    """(workload, backend, TF/s, window start, end in seconds of the day) per result line; the first
    window starts at the log's first progress line."""
    out, prev = [], None
    for line in text.splitlines():
        t = re.match(r"\[(\d\d:\d\d:\d\d)\]", line)
        if not t:
            continue
        now = _seconds(t.group(1))
        m = _LINE.match(line)
        if m and prev is not None:
            out.append(dict(workload=m.group(2).strip(), backend=m.group(3), tflops=float(m.group(6)),
                            start=prev, end=now))
        prev = now
    return out


def smi_samples(text: str) -> list[tuple[float, float, float, list[str]]]:
    """(seconds of the day, SM MHz, W, the remaining fields) per nvidia-smi line."""
    out = []
    for line in text.splitlines():
        sample = parse_sample(line)
        if sample is not None:
            t = datetime.fromtimestamp(sample[0])
            sod = t.hour * 3600 + t.minute * 60 + t.second + t.microsecond / 1e6
            out.append((sod, sample[1], sample[2], [p.strip() for p in line.split(",")][3:]))
    return out


def summarize(windows: list[dict], samples) -> list[dict]:
    rows = []
    for w in windows:
        busy = busy_samples(samples, w["start"] + 1, w["end"] + 0.9995)  # whole seconds: [start + 1, end + 1)
        if not busy:
            continue
        mhz = statistics.median(s[1] for s in busy)
        watts = statistics.median(s[2] for s in busy)
        rows.append(dict(workload=w["workload"], backend=w["backend"], tflops=w["tflops"], sm_mhz=mhz,
                         watts=round(watts, 1), busy_samples=len(busy),
                         tflops_per_ghz=round(w["tflops"] / (mhz / 1000), 1),
                         joule_per_pflop=round(watts / w["tflops"] * 1000, 1),
                         extra=[statistics.mode(s[3][i] for s in busy) for i in range(len(busy[0][3]))]))
    return rows


def main(bench_log: str, smi_log: str, out_json: str) -> None:
    rows = summarize(bench_windows(open(bench_log).read()), smi_samples(open(smi_log).read()))
    for r in rows:
        print(f"{r['workload']:28s} {r['backend']:7s} {r['tflops']:6.1f} TF/s  {r['sm_mhz']:6.0f} MHz  "
              f"{r['watts']:6.1f} W  {r['tflops_per_ghz']:6.1f} TF/s/GHz  {r['joule_per_pflop']:6.1f} J/PFLOP  "
              f"n={r['busy_samples']} {' '.join(r['extra'])}")
    with open(out_json, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
