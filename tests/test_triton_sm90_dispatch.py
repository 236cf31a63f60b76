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


CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "d,dv,dtype,paged,expect",
    [
        (128, 128, torch.bfloat16, True, "paged"),
        (192, 192, torch.bfloat16, False, "head dims"),
        (128, 64, torch.bfloat16, False, "head dims"),
        (256, 256, torch.bfloat16, False, "head dims"),
        (128, 128, torch.float32, False, "dtype"),
    ],
)
def test_unsupported_plans_name_the_reason(d, dv, dtype, paged, expect):
    assert expect in sm90.unsupported_reason(d, dv, dtype, paged, CPU)


def test_kv_layout_must_be_tma_compatible():
    q, k, v = _qkv()
    assert sm90.kv_layout_ok(k, v)
    # heads not adjacent: a [rows, D, Hkv] tensor transposed to [rows, Hkv, D]
    k_t = torch.zeros(256, 128, 2, dtype=torch.bfloat16).transpose(1, 2)
    assert not sm90.kv_layout_ok(k_t, v)
    # rows of 2 * 128 + 3 elements: not 16-byte aligned
    buf = torch.zeros(256, 2 * 128 + 3, dtype=torch.bfloat16)
    assert not sm90.kv_layout_ok(buf[:, :256].view(256, 2, 128), v)


@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (192, 128)])
def test_supported_shape_on_cpu_is_refused_for_the_device(d, dv):
    reason = sm90.unsupported_reason(d, dv, torch.bfloat16, False, CPU)
    assert reason == "not an sm_90 GPU" or reason.startswith("Gluon unavailable")


def test_qk_split_and_stage_budget():
    assert sm90.split_qk_dim(128) == (128, 0) and sm90.split_qk_dim(64) == (64, 0)
    assert sm90.split_qk_dim(192) == (128, 64)
    assert sm90.max_stages(128, 128, 128) == 3  # 32 KiB Q + 3 x 64 KiB K/V
    assert sm90.max_stages(192, 128, 128) == 2  # 48 KiB Q + 2 x 80 KiB K/V
