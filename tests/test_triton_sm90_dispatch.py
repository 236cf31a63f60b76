"""Which calls the warp-specialized Hopper kernel takes (host-side checks, no GPU needed)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
sm90 = pytest.importorskip("cpattn.kernels.triton_sm90")


def _qkv(d=128, dv=None, dtype=torch.bfloat16, hq=8, hkv=2, rows=256):
    dv = dv or d
    q = torch.zeros(rows, hq, d, dtype=dtype)
    k = torch.zeros(rows, hkv, d, dtype=dtype)
    v = torch.zeros(rows, hkv, dv, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize(
    "make,paged,expect",
    [
        (lambda: _qkv(), True, "paged"),
        (lambda: _qkv(d=192, dv=128), False, "head dims"),
        (lambda: _qkv(d=256), False, "head dims"),
        (lambda: _qkv(dtype=torch.float32), False, "dtype"),
    ],
)
def test_unsupported_calls_name_the_reason(make, paged, expect):
    q, k, v = make()
    assert expect in sm90.ws_unsupported_reason(q, k, v, paged)


def test_kv_layout_must_be_tma_compatible():
    q, k, v = _qkv()
    # heads not adjacent: a [rows, D, Hkv] tensor transposed to [rows, Hkv, D]
    k_t = torch.zeros(256, 128, 2, dtype=torch.bfloat16).transpose(1, 2)
    assert "TMA" in sm90.ws_unsupported_reason(q, k_t, v, False)
    # rows of 2 * 128 + 3 elements: not 16-byte aligned
    buf = torch.zeros(256, 2 * 128 + 3, dtype=torch.bfloat16)
    assert "TMA" in sm90.ws_unsupported_reason(q, buf[:, :256].view(256, 2, 128), v, False)


def test_supported_shape_on_cpu_is_refused_for_the_device():
    q, k, v = _qkv(d=64)
    reason = sm90.ws_unsupported_reason(q, k, v, False)
    assert reason == "not an sm_90 GPU" or reason.startswith("Gluon unavailable")
