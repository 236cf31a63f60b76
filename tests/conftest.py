import importlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/oracle.py, tests/dist_utils.py

CUDA = torch.cuda.is_available()


def _import_triton_interpreted() -> None:
    """Triton decorates its own library (tl.zeros, ...) when first imported, in the mode the
    environment says then; on CPU-only machines import it in interpreter mode (at collection,
    before any test module imports it), then restore the environment."""
    if CUDA or "triton" in sys.modules:
        return
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    except ImportError:
        pass
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


_import_triton_interpreted()


@pytest.fixture(scope="module")
def interp():
    """Triton interpreter for a module's CPU tests (CPU-only machines): yields the portable
    kernel module, with TRITON_INTERPRET=1 set while the module's tests run."""
    if CUDA:
        pytest.skip("interpreter tests run on CPU-only machines (GPU machines run -m gpu)")
    pytest.importorskip("triton")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language as tl

        mod = importlib.import_module("cpattn.kernels.triton_attn")
        if not mod.INTERPRETED or type(tl.zeros).__name__ != "InterpretedFunction":
            pytest.skip("cpattn.kernels.triton_attn was imported for the GPU before this module")
        yield mod
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def pytest_collection_modifyitems(config, items):
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def dsa_interp():
    """Triton interpreter for the DSA kernels (CPU-only machines); skips when a DSA kernel
    module was imported for the GPU before."""
    if CUDA:
        pytest.skip("interpreter tests run on CPU-only machines (GPU machines run -m gpu)")
    pytest.importorskip("triton")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        mods = [importlib.import_module(f"cpattn.kernels.{m}") for m in ("triton_sparse", "triton_index",
                                                                            "triton_shard_index")]
        if not all(m.INTERPRETED for m in mods):
            pytest.skip("the DSA triton kernels were imported for the GPU before this module")
        yield mods
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def load_tool(relpath: str):
    """The module of a repository script ``relpath`` (e.g. ``tools/gpu/clock_probe.py``), loaded
    from its file without putting its folder on ``sys.path`` (for standard-library-only tools)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), relpath)
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
