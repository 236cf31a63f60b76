"""The offline direct-launch check (tools/host_launch_offline_check.py) against the installed
Triton: the dense sm_90, absorbed-MLA, portable and merge kernels are compiled for sm_90a without a
GPU and the direct path's C-launch arguments must equal Triton's own launcher's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

TOOLS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TOOLS)


def test_direct_launch_matches_the_installed_triton():
    pytest.importorskip("triton.backends.nvidia.driver")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), TOOLS, env.get("PYTHONPATH", "")])
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, os.path.join(TOOLS, "host_launch_offline_check.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all direct launches match triton" in proc.stdout
