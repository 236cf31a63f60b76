"""FP8 tensor-core attention on the GPU (``AttentionSpec(mma_dtype=torch.float8_e4m3fn)``): the
portable Triton kernel's e4m3 dots (FP8_MMA 1) against the fp64 oracle on the dequantized cache
with the CPU tests' bounds (tests/test_fp8_mma.py: relative RMSE, lse), D 64 / 128 / 192, packed
and paged, GQA, windows, sinks, zigzag ranks; against the torch reference of the same scheme on a
longer sequence; NaN query rows; ``backend="auto"`` picks the portable kernel (the Hopper
kernels refuse the option)."""

from __future__ import annotations

import pytest
import torch

from test_fp8_mma import LSE_BOUND, REL_RMSE_BOUND, check_case, fp8_mma_case, rel_rmse

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("page", [None, 64])
@pytest.mark.parametrize("d,dv,hq,hkv", [(64, 64, 8, 2), (128, 128, 8, 2), (192, 128, 4, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_mma_kernel_within_bound(d, dv, hq, hkv, page, dtype):
    for cp, rank in ((1, 0), (2, 1)):
        err = check_case("triton", [700, 1, 0, 300], [0, 40, 5, 1000], cp=cp, rank=rank, d=d, dv=dv, hq=hq,
                         hkv=hkv, page=page, dtype=dtype, device="cuda", seed=d + cp)
        assert err > 0  # the e4m3 rounding is there (bf16 dots would give ~0.002)


@pytest.mark.parametrize("page", [None, 64])
def test_fp8_mma_kernel_window_sinks_per_tensor(page):
    check_case("triton", [500, 77], [33, 0], cp=2, rank=0, d=128, hq=8, hkv=1, window=129, sinks=True, page=page,
               per_head=False, device="cuda", seed=3)


def test_fp8_mma_auto_picks_portable_kernel_and_matches_reference():
    """backend="auto"/"triton" on Hopper: the portable kernel's FP8 dots (plan.mma_dtype), within
    a quarter of the bound of the torch reference of the same scheme at 4k tokens."""
    ext, pre = [4096], [0]
    a = fp8_mma_case("triton", ext, pre, hq=8, hkv=2, d=128, device="cuda", seed=5)
    assert a[-1].family == "portable" and a[-1].mma_dtype == FP8
    auto = fp8_mma_case("auto", ext, pre, hq=8, hkv=2, d=128, device="cuda", seed=5)
    assert auto[-1].mma_dtype == FP8
    b = fp8_mma_case("torch", ext, pre, hq=8, hkv=2, d=128, device="cuda", seed=5)
    assert rel_rmse(a[0], a[2]) < REL_RMSE_BOUND and rel_rmse(b[0], b[2]) < REL_RMSE_BOUND
    assert rel_rmse(a[0], b[0].double()) < REL_RMSE_BOUND / 4
    assert (a[1] - b[1]).abs().max().item() < LSE_BOUND / 4


def test_fp8_mma_nan_query_row_propagates():
    out, lse, _, _, pad_out, pad_lse, _ = fp8_mma_case("triton", [300, 6], [3, 0], nan_row=4, seed=2, device="cuda")
    assert out[4, 0].isnan().all() and lse[4, 0].isnan()
    keep = torch.ones(out.shape[:2], dtype=torch.bool)
    keep[4, 0] = False
    assert not out[keep].isnan().any() and not lse[keep].isnan().any()
    assert (pad_out == 0).all() and torch.isneginf(pad_lse).all()
