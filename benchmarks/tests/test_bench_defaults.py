"""``benchmarks/run.py``: without ``--out`` every family writes into the git-ignored ``bench-out/``
at the repository root, whatever the working directory; CPU smoke runs write ``*-cpu-smoke.*``
files (never over a GPU result), say so in their JSON and print no target verdicts."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys

import pytest

from benchmarks import common, run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATH_OPTIONS = ("out", "png", "json")
VERDICTS = ("PASS", "FAIL", "MISS", "MET", "target")


def _defaults(family: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    importlib.import_module(f"benchmarks.{family}").add_arguments(parser)
    return parser.parse_args([])


def test_out_dir_is_the_repository_bench_out():
    assert common.REPO_ROOT == ROOT
    assert common.OUT_DIR == os.path.join(ROOT, "bench-out")
    assert common.default_out("kernel") == os.path.join(ROOT, "bench-out", "kernel")
    assert common.default_out("cp.json", smoke=True) == os.path.join(ROOT, "bench-out", "cp-cpu-smoke.json")


@pytest.mark.parametrize("family", sorted(run.FAMILIES))
def test_default_outputs_are_under_bench_out(family, tmp_path, monkeypatch):
    """Parser defaults and the paths a family resolves at run time (None defaults) lie under
    ``OUT_DIR``; the CPU smoke names differ from the GPU ones."""
    out_dir = str(tmp_path / "bench-out")
    monkeypatch.setattr(common, "OUT_DIR", out_dir)
    args = _defaults(family)
    paths = [getattr(args, k) for k in PATH_OPTIONS if getattr(args, k, None) is not None]
    if family == "cp":
        from benchmarks import cp

        resolved = {}
        for device in ("cpu", "cuda"):
            a = _defaults("cp")
            a.device = device
            cp._defaults(a)
            resolved[device] = a.out
        assert resolved["cpu"].endswith("cp-cpu-smoke.json") and resolved["cuda"].endswith("cp.json")
        paths += list(resolved.values())
    if family == "mla":
        from benchmarks import mla

        assert mla.default_out_path("cpu").endswith("mla-cpu-smoke.json")
        assert mla.default_out_path("cuda").endswith("mla.json")
        paths += [mla.default_out_path("cpu"), mla.default_out_path("cuda")]
    if family in ("decode", "sparse", "placement", "hfgen", "dsa_decode"):  # resolved in main: GPU run, CPU smoke run
        assert args.out is None
        paths += [common.default_out(family), common.default_out(family, smoke=True)]
    assert paths, f"{family}: no default output path found"
    for path in paths:
        assert os.path.dirname(path) == out_dir, f"{family} writes to {path!r} by default"


def test_bench_out_and_gpu_out_are_ignored_by_git():
    with open(os.path.join(ROOT, ".gitignore")) as f:
        ignored = f.read().split()
    assert "bench-out/" in ignored and "gpu-out/" in ignored


def test_runs_write_only_into_bench_out(tmp_path, monkeypatch):
    """A run from another working directory writes nothing there: its files go to ``OUT_DIR``."""
    pytest.importorskip("matplotlib")
    out_dir = tmp_path / "bench-out"
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.setattr(common, "OUT_DIR", str(out_dir))
    monkeypatch.chdir(cwd)
    assert run.main(["metadata", "--tokens", "512", "--cp", "2", "--seqs", "1", "4"]) == 0
    assert run.main(["scaling", "--seqs", "32k", "--cps", "1,2"]) == 0
    assert sorted(p.name for p in out_dir.iterdir()) == ["metadata-cpu.json", "metadata-cpu.png", "scaling-model.png"]
    assert list(cwd.iterdir()) == []


def test_cpu_smoke_runs_say_so_and_check_no_targets(tmp_path, monkeypatch, capsys):
    """sparse, mla and placement on the CPU: ``*-cpu-smoke`` files, ``smoke`` in the JSON, no verdicts printed."""
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(common, "OUT_DIR", str(tmp_path))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert run.main(["sparse", "--small", "--device", "cpu", "--seqs", "200", "--cp", "2", "--iters", "1",
                     "--warmup", "0"]) == 0
    assert run.main(["mla", "--small", "--device", "cpu", "--tokens", "64", "--iters", "1", "--warmup", "0",
                     "--no-gather"]) == 0
    assert run.main(["placement", "--cp", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                     "--lengths", "64,256"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mla-cpu-smoke.json", "mla-cpu-smoke.png",
                                                          "placement-cpu-smoke.json", "placement-cpu-smoke.png",
                                                          "sparse-cpu-smoke.json", "sparse-cpu-smoke.png"]
    placement = json.loads((tmp_path / "placement-cpu-smoke.json").read_text())
    assert placement["smoke"] and {r["batch"] for r in placement["rows"]} >= {"1 x 64", "1 x 256"}
    sparse = json.loads((tmp_path / "sparse-cpu-smoke.json").read_text())
    mla = json.loads((tmp_path / "mla-cpu-smoke.json").read_text())
    assert sparse["smoke"] and mla["smoke"] and "targets_tflops" not in sparse and mla["targets"] == []
    captured = capsys.readouterr()
    assert "CPU smoke run" in captured.err
    assert not any(word in captured.out for word in VERDICTS), captured.out


def test_run_py_works_from_any_directory(tmp_path):
    """``python benchmarks/run.py FAMILY --help`` by path from another directory (no install of
    ``benchmarks`` or ``reference_layers`` needed)."""
    env = dict(os.environ)  # PYTHONPATH may name a cpattn, never the repository root
    keep = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != ROOT]
    env["PYTHONPATH"] = os.pathsep.join(keep)
    for family in ("metadata", "cp"):
        res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "run.py"), family, "--help"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        assert "--out" in res.stdout
    assert list(tmp_path.iterdir()) == []
