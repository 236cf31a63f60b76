"""``tools/gpu/clock_probe.py`` (SM clock / power per benchmark result, docs/benchmarks.md's
thirteenth session): nvidia-smi samples go to the result whose window holds them (the second of
the previous progress line left out), idle samples drop out, and the derived figures are the
ratios they claim to be."""

from __future__ import annotations

import pytest
from conftest import load_tool


@pytest.fixture(scope="module")
def probe():
    return load_tool("tools/gpu/clock_probe.py")


def _result(hms: str, backend: str, tflops: float) -> str:
    name = "d128 S=16k zigzag C=1"
    return f"[{hms}] {name:38s} {backend:15s} {'sm90':8s} {3.0:9.3f} ms {tflops:7.1f} TF/s (one call + sync: 3.1 ms)"


def _smi(second: int, tenth: int, mhz: float, watts: float) -> str:
    return f"2026/12/02 14:00:{second:02d}.{tenth}00, {mhz:g}, {watts:g}, 60, Active"


def test_samples_go_to_their_window(probe):
    log = "\n".join(["[14:00:00] H200; backends ['triton', 'fa4']; 1 workloads", _result("14:00:03", "triton", 600.0),
                     _result("14:00:06", "fa4", 660.0)])
    smi = []
    for sec in range(0, 8):
        for tenth in range(10):
            idle = sec == 0 or (sec == 4 and tenth < 5)  # start-up; a gap between the two backends
            mhz = 1600 if sec <= 3 else 1500
            smi.append(_smi(sec, tenth, 1980 if idle else mhz, 90 if idle else 690))
    rows = probe.summarize(probe.bench_windows(log), probe.smi_samples("\n".join(smi)))
    assert [r["backend"] for r in rows] == ["triton", "fa4"]
    tri, fa4 = rows
    # triton: seconds 1-3 (second 0 is the first progress line's); fa4: seconds 4-6, busy only
    assert tri["busy_samples"] == 30 and fa4["busy_samples"] == 25
    assert tri["sm_mhz"] == 1600 and fa4["sm_mhz"] == 1500 and tri["watts"] == fa4["watts"] == 690
    assert tri["tflops_per_ghz"] == pytest.approx(600.0 / 1.6, abs=0.05)
    assert fa4["joule_per_pflop"] == pytest.approx(690 / 660.0 * 1000, abs=0.05)
    assert tri["extra"] == ["60", "Active"]


def test_lines_that_are_not_results_or_samples_are_skipped(probe):
    log = "\n".join(["[14:00:00] start", "some warning", "[14:00:02] d128 graph capture failed: X",
                     _result("14:00:04", "triton", 500.0)])
    windows = probe.bench_windows(log)
    assert len(windows) == 1 and windows[0]["start"] == 14 * 3600 + 2 and windows[0]["end"] == 14 * 3600 + 4
    assert probe.smi_samples("timestamp, clocks.sm\nnot a sample\n") == []
