"""SM clock and board power while a benchmark times something (``--clocks`` of ``python
benchmarks/run.py kernel``).

Under sustained load an H100 / H200 runs against its power cap, so the TF/s of two kernels also
differ by the clock each one leaves the GPU at: a kernel that does more work per clock draws more
power and gets a lower clock (H200 at the 700 W cap, dense d128 / d192 16k / 64k: FA4 did 4-10%
more work per SM clock than the triton kernel and ran 45-105 MHz lower, leaving a 1-6% TF/s
gap). :class:`ClockSampler` runs ``nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw -lms
100`` for one GPU in the background and reports the median SM clock (MHz) and power (W) of the
busy samples of a time window, so a benchmark row can carry ``sm_mhz``, ``watts`` and
``tflops_per_ghz``.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
from datetime import datetime
from typing import Optional

#: nvidia-smi's sampling period (ms).
PERIOD_MS = 100


def parse_sample(line: str) -> Optional[tuple[float, float, float]]:
    """``(seconds since the epoch, SM MHz, W)`` of one ``timestamp, clocks.sm, power.draw`` CSV line
    (nvidia-smi's local-time timestamp ``YYYY/MM/DD HH:MM:SS.mmm``), or None for anything else."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) < 3:
        return None
    try:
        stamp = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        return stamp, float(parts[1]), float(parts[2])
    except ValueError:
        return None


def busy_samples(samples: list[tuple], t0: float, t1: float) -> list[tuple]:
    """The samples ``(time, MHz, W, ...)`` taken in ``[t0, t1]`` that draw at least half of the
    window's peak power (the GPU busy)."""
    inside = [s for s in samples if t0 <= s[0] <= t1]
    peak = max((s[2] for s in inside), default=0.0)
    return [s for s in inside if s[2] >= 0.5 * peak]


def window_stats(samples: list[tuple[float, float, float]], t0: float, t1: float) -> Optional[dict]:
    """Median SM MHz and W of the :func:`busy_samples` of ``[t0, t1]`` (seconds since the epoch),
    with their count; None when the window holds no sample."""
    busy = busy_samples(samples, t0, t1)
    if not busy:
        return None
    return dict(sm_mhz=statistics.median(s[1] for s in busy), watts=round(statistics.median(s[2] for s in busy), 1),
                clock_samples=len(busy))


class ClockSampler:
    """``nvidia-smi`` sampling GPU ``index`` every :data:`PERIOD_MS` ms from :meth:`start` to
    :meth:`stop`; :meth:`stats` of a window (``time.time()`` values) once its samples are in."""

    def __init__(self, index: int = 0) -> None:
        if shutil.which("nvidia-smi") is None:
            raise ValueError("--clocks needs nvidia-smi on PATH")
        self.index = index
        self.samples: list[tuple[float, float, float]] = []
        self._proc: Optional[subprocess.Popen] = None
        self._reader: Optional[threading.Thread] = None

    def start(self) -> "ClockSampler":
        self._proc = subprocess.Popen(
            ["nvidia-smi", "-i", str(self.index), "--query-gpu=timestamp,clocks.sm,power.draw",
             "--format=csv,noheader,nounits", "-lms", str(PERIOD_MS)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            sample = parse_sample(line)
            if sample is not None:
                self.samples.append(sample)

    def stats(self, t0: float, t1: float) -> Optional[dict]:
        """:func:`window_stats` of ``[t0, t1]``, after waiting up to two sampling periods for the
        samples that close the window."""
        deadline = time.time() + 2 * PERIOD_MS / 1000
        while time.time() < deadline and not any(s[0] >= t1 for s in self.samples):
            time.sleep(PERIOD_MS / 4000)
        return window_stats(list(self.samples), t0, t1)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=5)
            self._reader.join(timeout=5)
            self._proc = None

    def __enter__(self) -> "ClockSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
