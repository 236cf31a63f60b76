"""Tests of the contributor tools under tools/ (CPU only, standard library and torch)."""

from __future__ import annotations

import importlib.util
import os

import pytest

TOOLS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def load_tool():
    """``load_tool("ring_protocol_sim.py")``: the module of a script under tools/, loaded from its
    file without putting tools/ on ``sys.path``."""

    def load(name: str):
        path = os.path.join(TOOLS, name)
        spec = importlib.util.spec_from_file_location(os.path.splitext(name)[0], path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
