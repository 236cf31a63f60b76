"""Shared benchmark plumbing: timing, progress lines, JSON and plot output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from datetime import date
from typing import Callable

import torch

#: The repository root (benchmarks/ is not installed; it runs from a checkout).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Default output folder of every family: ``bench-out/`` at the repository root (git-ignored),
#: whatever the working directory. ``--out`` elsewhere only when asked for.
OUT_DIR = os.path.join(REPO_ROOT, "bench-out")
#: Inserted before the extension of the default output of a CPU smoke run (tiny shapes on the
#: CPU: checks that the code runs, measures nothing), so it never overwrites a GPU result.
SMOKE_SUFFIX = "-cpu-smoke"


def default_out(name: str, smoke: bool = False) -> str:
    """Default output path ``<repo>/bench-out/<name>`` of a family (``name``: file or stem);
    ``smoke``: the CPU smoke run's name, ``<stem>-cpu-smoke[.ext]``."""
    if smoke:
        stem, ext = os.path.splitext(name)
        name = stem + SMOKE_SUFFIX + ext
    return os.path.join(OUT_DIR, name)


def progress(message: str) -> None:
    """One progress line on stderr (benchmarks print results to stdout / files)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def machine_description() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}, torch {torch.__version__}"
    return f"{platform.processor() or platform.machine()} CPU ({os.cpu_count()} cores), torch {torch.__version__}"


def time_cuda(fn: Callable[[], object], warmup: int = 3, iters: int = 10) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs, timed with CUDA events around each call
    (with a sync after each, so the host's launch work before the kernel counts too)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _per_call_ms(issue: Callable[[], object], iters: int, repeats: int) -> float:
    """Milliseconds per call of ``issue`` run ``iters`` times back to back between two CUDA
    events, median of ``repeats``. One untimed call goes first each time, so the GPU is busy when
    the start event is recorded: the first timed call does not add the host's latency to an idle
    GPU (with few iterations of a short call that bias reached several percent)."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        issue()
        start.record()
        for _ in range(iters):
            issue()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def warm_up(fn: Callable[[], object], calls: int, ms: float = 0.0) -> None:
    """Run ``fn`` at least ``calls`` times and, when ``ms`` > 0, until ``ms`` milliseconds of
    wall time have passed (synchronizing every 8 calls, so the time is the GPU's), then sync: the
    clocks leave the idle state and the power draw settles before anything is timed."""
    t0, n = time.perf_counter(), 0
    while n < calls or (time.perf_counter() - t0) * 1e3 < ms:
        fn()
        n += 1
        if n % 8 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()


def time_cuda_back_to_back(fn: Callable[[], object], warmup: int = 3, iters: int = 10, repeats: int = 3,
                           warmup_ms: float = 0.0) -> float:
    """Milliseconds per call of ``fn`` issued ``iters`` times back to back between two CUDA
    events (median of ``repeats``): the GPU queue stays full, so host-side launch work that is
    shorter than the kernel is hidden, as in a steady stream of layers or a CUDA graph.
    ``warmup`` calls (and at least ``warmup_ms`` ms of them, :func:`warm_up`) go first."""
    warm_up(fn, warmup, warmup_ms)
    return _per_call_ms(fn, iters, repeats)


def time_cuda_graph(fn: Callable[[], object], warmup: int = 3, iters: int = 10, repeats: int = 3,
                    calls: int = 1) -> float:
    """Milliseconds per call of ``fn`` from a CUDA graph holding ``calls`` calls back to back,
    replayed ``iters`` times between two CUDA events (median of ``repeats``; per replay / calls):
    the call's GPU time without any host work, as an engine that captures its decode step sees
    it. ``calls`` 1 charges each call one graph launch; an engine's step graph holds every
    layer's calls, which ``calls`` > 1 models (one launch shared by ``calls`` calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    ms = _per_call_ms(graph.replay, iters, repeats) / calls
    del graph
    return ms


def time_host(fn: Callable[[], object], warmup: int = 2, iters: int = 20) -> float:
    """Median milliseconds of ``fn`` on the host clock."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def device_timer(device: torch.device, iters: int, warmup: int) -> Callable[[Callable[[], object]], float]:
    """ms per call of a function: CUDA events around back-to-back calls on a GPU, host time
    (at most 3 calls) on the CPU (smoke runs)."""
    if device.type == "cuda":
        return lambda fn: time_cuda_back_to_back(fn, warmup=warmup, iters=iters)
    return lambda fn: time_host(fn, warmup=min(warmup, 1), iters=max(1, min(iters, 3)))


def write_json(path: str, payload: object) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    progress(f"wrote {path}")


#: What a smoke run's JSON says about its numbers.
SMOKE_NOTE = "CPU smoke run: checks that the benchmark runs; its numbers are not performance results"


def header(command: str, smoke: bool = False) -> dict:
    """The JSON header of a run: command, machine, date (and ``smoke`` for a CPU smoke run)."""
    out = {"command": command, "machine": machine_description(), "date": date.today().isoformat()}
    if smoke:
        out.update(smoke=True, note=SMOKE_NOTE)
    return out


def smoke_notice(family: str) -> None:
    """The progress line that opens a CPU smoke run."""
    progress(f"{family}: {SMOKE_NOTE}; no targets are checked")
