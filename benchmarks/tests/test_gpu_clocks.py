"""``benchmarks.gpu_clocks`` (``python benchmarks/run.py kernel --clocks``): nvidia-smi lines parse
to epoch seconds, a window's figures come from its busy samples only, and the sampler reads a
running nvidia-smi (here a stand-in script on PATH printing the same CSV) until stopped."""

from __future__ import annotations

import os
import stat
import time
from datetime import datetime

import pytest

from benchmarks.gpu_clocks import ClockSampler, parse_sample, window_stats


def _line(t: float, mhz: float, watts: float) -> str:
    return datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3] + f", {mhz:g}, {watts:g}"


def test_parse_sample_round_trips_local_time():
    t = 1_796_300_000.25
    stamp, mhz, watts = parse_sample(_line(t, 1665, 690.5))
    assert stamp == pytest.approx(t, abs=1e-3) and mhz == 1665 and watts == 690.5
    assert parse_sample("timestamp, clocks.sm [MHz], power.draw [W]") is None
    assert parse_sample("[N/A]") is None


def test_window_stats_take_the_busy_samples_of_the_window():
    samples = [(float(i), 1980.0 if i < 3 else 1600.0 + (i % 2) * 30, 80.0 if i < 3 else 690.0) for i in range(20)]
    st = window_stats(samples, 0.0, 10.0)  # 3 idle samples (80 W < half of 690) drop out; 4 + 4 left
    assert st == dict(sm_mhz=1615.0, watts=690.0, clock_samples=8)
    assert window_stats(samples, 30.0, 40.0) is None
    assert window_stats(samples, 12.0, 12.0)["clock_samples"] == 1


def test_sampler_reads_a_running_nvidia_smi(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/usr/bin/env python3\n"
                    "import sys, time\nfrom datetime import datetime\n"
                    "assert '-i' in sys.argv and '-lms' in sys.argv\n"
                    "while True:\n"
                    "    now = datetime.now().strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]\n"
                    "    print(f'{now}, 1500, 700.0', flush=True)\n"
                    "    time.sleep(0.05)\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with ClockSampler(0) as sampler:
        t0 = time.time()
        time.sleep(0.5)
        st = sampler.stats(t0, time.time())
    assert st is not None and st["sm_mhz"] == 1500 and st["watts"] == 700.0 and st["clock_samples"] >= 3
    assert sampler._proc is None  # stopped on exit


def test_sampler_needs_nvidia_smi(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ValueError, match="--clocks needs nvidia-smi"):
        ClockSampler(0)
