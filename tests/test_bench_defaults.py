"""``python -m cpattn.bench``: without ``--out`` every subcommand writes into the ignored bench-out/.

Run from the repository root, the defaults used to overwrite tracked files under docs/benchmarks/.
"""

from __future__ import annotations

import argparse
import importlib
import os

import pytest

from cpattn.bench import __main__ as bench_main
from cpattn.bench.common import DEFAULT_OUT_DIR

PATH_OPTIONS = ("out", "png", "json")


def _defaults(module: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    importlib.import_module(f"cpattn.bench.{module}").add_arguments(parser)
    return parser.parse_args([])


def _resolved_paths(module: str) -> list[str]:
    """Every default output path of a subcommand, on CPU and on CUDA where it differs."""
    args = _defaults(module)
    paths = [getattr(args, k) for k in PATH_OPTIONS if getattr(args, k, None) is not None]
    if module == "cp":
        from cpattn.bench import cp

        for device in ("cpu", "cuda"):
            a = _defaults("cp")
            a.device = device
            cp._defaults(a)
            paths.append(a.out)
    if module == "mla":
        from cpattn.bench import mla

        paths += [mla.default_out_path("cpu"), mla.default_out_path("cuda")]
    return paths


@pytest.mark.parametrize("name", sorted(bench_main.SUBCOMMANDS))
def test_default_outputs_are_under_bench_out(name):
    module = bench_main.SUBCOMMANDS[name][0]
    paths = _resolved_paths(module)
    assert paths, f"{name}: no default output path found"
    for path in paths:
        assert path.split(os.sep)[0] == DEFAULT_OUT_DIR, f"{name} writes to {path!r} by default"
        assert "docs" not in path.split(os.sep), path


def test_bench_out_is_ignored_by_git():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, ".gitignore")) as f:
        assert f"{DEFAULT_OUT_DIR}/" in f.read().split()


def test_runs_write_only_into_bench_out(tmp_path, monkeypatch):
    """A run from a checkout's root leaves docs/benchmarks/ untouched and fills bench-out/."""
    pytest.importorskip("matplotlib")
    tracked = tmp_path / "docs" / "benchmarks"
    tracked.mkdir(parents=True)
    (tracked / "metadata-cpu.json").write_text("tracked")
    (tracked / "scaling-model.png").write_bytes(b"tracked")
    monkeypatch.chdir(tmp_path)
    assert bench_main.main(["metadata", "--tokens", "512", "--cp", "2", "--seqs", "1", "4"]) == 0
    assert bench_main.main(["scaling", "--seqs", "32k", "--cps", "1,2"]) == 0
    assert (tracked / "metadata-cpu.json").read_text() == "tracked"
    assert (tracked / "scaling-model.png").read_bytes() == b"tracked"
    written = sorted(p.name for p in (tmp_path / DEFAULT_OUT_DIR).iterdir())
    assert written == ["metadata-cpu.json", "metadata-cpu.png", "scaling-model.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [DEFAULT_OUT_DIR, "docs"]
