"""FP8 tensor-core attention (``AttentionSpec(mma_dtype=torch.float8_e4m3fn)``): the spec option,
per-row query quantization, the torch reference and the portable Triton kernel.

Accuracy: against the fp64 oracle of tests/oracle.py run on the DEQUANTIZED cache values (the
e4m3 values the cache holds times their scales, in fp64), as a relative RMSE over all valid
output rows (``||out - ref|| / ||ref||``) below :data:`REL_RMSE_BOUND`, and the lse within
:data:`LSE_BOUND`. Queries and probabilities are rounded to e4m3 (3 mantissa bits) in this mode,
so the error is that of the quantization, about 20x the bf16 path's (docs/fp8.md has the measured
numbers the bounds were set from).

CPU: the torch reference, and the portable kernel under the Triton interpreter. The interpreter's
fp32 -> e4m3 conversion and its e4m3 dot are wrong (measured: NaN converts to 384, -126.3 to -64),
so there the kernel runs FP8_MMA = 2: the same quantization with values rounded to the e4m3 grid
in fp32 arithmetic (``_attn_steps.e4m3_round``, checked bit for bit against torch's conversion
below) and fp32 dots, exact for e4m3 products. That tests the scheme's arithmetic (row scales,
running-max P rounding, the 1/256, masks, NaN) but not the e4m3 instructions: the GPU tests
(tests/test_fp8_mma_gpu.py) run those.
"""

from __future__ import annotations

import math

import pytest
import torch

import cpattn
from cpattn.quant import FP8_E4M3_MAX, quantize_fp8_rows
from oracle import TOLERANCE, attention_oracle
from test_triton_kernel import _paged

FP8 = torch.float8_e4m3fn

#: Relative RMSE of the output against the fp64 oracle on the dequantized cache. Measured with
#: the torch reference over 108 cases (6 seeds x bf16 / fp16 / fp32 x 6 shapes: the ones below
#: and D128 500 keys, D192/Dv128): 0.023 - 0.038, median 0.026 (docs/fp8.md); the dequantize
#: path (mma_dtype None) measures at most 0.0018 on the same cases.
REL_RMSE_BOUND = 0.06
#: Max |lse - oracle lse| (natural log). Measured on the same cases: at most 0.090, median 0.045.
LSE_BOUND = 0.15


def rel_rmse(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| over every element (fp64)."""
    return ((out.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def _scales(x: torch.Tensor, per_head: bool) -> torch.Tensor:
    """Scales putting x's amax (per KV head or overall) at 448."""
    amax = x.abs().amax(dim=(0, 2)) if per_head else x.abs().amax()
    return (amax.float() / FP8_E4M3_MAX).clamp_min(1e-3)


def _per_head(scale: torch.Tensor) -> torch.Tensor:
    return scale.double().view(-1, 1) if scale.dim() == 1 else scale.double()


def fp8_mma_case(backend, ext, pre, *, strategy="zigzag", cp=1, rank=0, hq=4, hkv=2, d=64, dv=None,
                 dtype=torch.bfloat16, window=-1, sinks=False, page=None, per_head=True, seed=0, device="cpu",
                 nan_row=None, mma=FP8, backend_options=None):
    """One rank's FP8-MMA plan over an FP8 cache (``plan.attend``) and the oracle on the
    dequantized cache: (out, lse, ref, ref_lse) of the rank's valid rows, then its pad rows'
    (out, lse) and the plan. ``nan_row``: a global query row set to NaN in head 0."""
    dv = dv or d
    gen = torch.Generator().manual_seed(seed)
    kv_lens = [e + p for e, p in zip(ext, pre)]
    n_kv = sum(kv_lens)
    q = torch.randn(sum(ext), hq, d, generator=gen) * (0.5 + torch.rand(sum(ext), hq, 1, generator=gen))  # row scales differ
    q = q.to(dtype)
    if nan_row is not None:
        q[nan_row, 0, 3] = float("nan")
    keys = torch.randn(n_kv, hkv, d, generator=gen)
    vals = torch.randn(n_kv, hkv, dv, generator=gen)
    ks, vs = _scales(keys, per_head), _scales(vals, per_head)
    k8 = (keys / (ks.view(-1, 1) if per_head else ks)).clamp(-448, 448).to(FP8)
    v8 = (vals / (vs.view(-1, 1) if per_head else vs)).clamp(-448, 448).to(FP8)
    sk = torch.randn(hq, generator=gen) if sinks else None
    ref, ref_lse = attention_oracle(q, k8.double() * _per_head(ks), v8.double() * _per_head(vs), ext, pre,
                                    window_left=window, sinks=sk)
    s = cpattn.get_strategy(strategy, cp, pad_multiple=4)
    meta = s.build_metadata(ext, pre, rank=rank).to(device)
    spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv, dtype=dtype,
                                kv_dtype=FP8, mma_dtype=mma, page_size=page, window_size=(window, 0),
                                has_sinks=sinks)
    plan = cpattn.plan_attention(meta, spec, backend=backend, backend_options=backend_options)
    q_local = s.shard(q.to(device), meta)
    if page is not None:
        k_in, v_in, table = _paged(k8, v8, ext, pre, page, gen=gen)  # unused slots: other e4m3 values
        table = table.to(device)
    else:
        k_in, v_in, table = k8, v8, None
    out, lse = plan.attend(q_local, k_in.to(device), v_in.to(device), page_table=table,
                           sinks=None if sk is None else sk.to(device), k_scale=ks.to(device), v_scale=vs.to(device),
                           return_lse=True)
    n = meta.num_local_tokens
    idx = meta.local_token_indices.cpu()
    return (out[:n].cpu(), lse[:n].cpu(), ref[idx], ref_lse[idx], out[n:].cpu(), lse[n:].cpu(), plan)


def check_case(*args, **kwargs) -> float:
    """:func:`fp8_mma_case` within the bounds (pad rows exactly 0 / -inf); returns the rel RMSE."""
    out, lse, ref, ref_lse, pad_out, pad_lse, _ = fp8_mma_case(*args, **kwargs)
    assert (pad_out == 0).all() and torch.isneginf(pad_lse).all()
    assert not out.isnan().any() and not lse.isnan().any()
    if not out.numel():
        return 0.0
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse), ~finite)  # rows with no visible key: -inf
    assert (out[~finite] == 0).all()
    err = rel_rmse(out, ref)
    assert err < REL_RMSE_BOUND, f"relative RMSE {err:.4f} >= {REL_RMSE_BOUND}"
    lse_err = (lse[finite].double() - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    assert lse_err < LSE_BOUND, f"max |lse - oracle| {lse_err:.4f} >= {LSE_BOUND}"
    return err


# ---------------------------------------------------------------------------------------- spec
def test_spec_mma_dtype():
    base = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    plain = cpattn.AttentionSpec(**base, kv_dtype=FP8)
    fp8 = cpattn.AttentionSpec(**base, kv_dtype=FP8, mma_dtype=FP8)
    assert plain.mma_dtype is None and not plain.fp8_mma
    assert fp8.fp8_mma and fp8.mma_dtype == FP8
    assert fp8 != plain and hash(fp8) != hash(plain)  # plan-cache keys differ
    assert fp8.replace(page_size=16).fp8_mma
    assert cpattn.AttentionSpec(**dict(base, dtype=torch.float16), kv_dtype=FP8, mma_dtype=FP8).fp8_mma
    assert cpattn.AttentionSpec(**dict(base, dtype=torch.float32), kv_dtype=FP8, mma_dtype=FP8).fp8_mma
    with pytest.raises(TypeError, match="mma_dtype"):
        cpattn.AttentionSpec(**base, kv_dtype=FP8, mma_dtype="fp8")
    with pytest.raises(ValueError, match="mma_dtype"):
        cpattn.AttentionSpec(**base, kv_dtype=FP8, mma_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="mma_dtype"):
        cpattn.AttentionSpec(**base, kv_dtype=FP8, mma_dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match="mma_dtype"):
        cpattn.AttentionSpec(**base, mma_dtype=FP8)  # a bf16 cache
    with pytest.raises(ValueError, match="mma_dtype"):
        cpattn.AttentionSpec(**base, kv_dtype=FP8, mma_dtype=FP8, topk=64)
    with pytest.raises(ValueError, match="mma_dtype"):
        cpattn.AttentionSpec(num_q_heads=4, num_kv_heads=1, head_dim=576, head_dim_v=512, dtype=torch.bfloat16,
                             kv_dtype=FP8, kv_layout="fp8_tile", mma_dtype=FP8)
    with pytest.raises(ValueError, match="kv_dtype"):  # an FP8 cache (so mma_dtype too) needs a 16/32-bit dtype
        cpattn.AttentionSpec(**dict(base, dtype=torch.float64), kv_dtype=FP8, mma_dtype=FP8)


# ---------------------------------------------------------------------------------------- quantization
def test_quantize_fp8_rows():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 3, 40, generator=g) * torch.rand(7, 3, 1, generator=g) * 50
    x[1, 2] = 0.0
    x[2, 0, 5] = float("nan")
    x[3, 1, 0] = float("inf")
    x[4, 2, 9] = -float("inf")
    q, s = quantize_fp8_rows(x.bfloat16())
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (7, 3)
    xb = x.bfloat16().float()
    amax = xb.abs().amax(-1)
    for r, h in [(2, 0), (3, 1), (4, 2)]:
        assert s[r, h].isnan() and q[r, h].float().isnan().all()
    ok = amax.isfinite()
    ok[1, 2] = False
    assert s[1, 2] == 1.0 and (q[1, 2].float() == 0).all()
    assert torch.equal(s[ok], amax[ok] / 448.0)
    want = (xb[ok] / s[ok][:, None]).clamp(-448, 448).to(FP8)
    assert torch.equal(q[ok].view(torch.uint8), want.view(torch.uint8))
    assert (q[ok].float().abs().amax(-1) == 448.0).all()  # each row's amax lands on 448
    back = q[ok].double() * s[ok][:, None].double()
    assert ((back - xb[ok].double()).abs() <= amax[ok][:, None].double() / 448 * 16 + 1e-30).all()


# ---------------------------------------------------------------------------------------- torch reference
BATCHES = [
    ([37, 50, 5], [0, 9, 3]),
    ([0, 1, 33, 2], [4, 0, 17, 60]),
    ([64], [0]),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("batch", BATCHES)
def test_torch_reference_within_bound(batch, dtype):
    ext, pre = batch
    check_case("torch", ext, pre, dtype=dtype, seed=len(ext))


@pytest.mark.parametrize("strategy,cp,rank", [("zigzag", 1, 0), ("zigzag", 2, 1), ("zigzag", 3, 2)])
def test_torch_reference_cp_ranks_gqa_window_sinks_paged(strategy, cp, rank):
    check_case("torch", [45, 12, 1, 0], [7, 0, 30, 5], strategy=strategy, cp=cp, rank=rank, hq=6, hkv=2, d=128,
               window=19, sinks=True, page=8, per_head=False, seed=cp)


def test_torch_reference_scheme_differs_from_dequantize_path():
    """The option is not ignored: the FP8-MMA reference differs from the dequantize path, whose
    error is ~20x smaller."""
    ext, pre = [40, 20], [10, 0]
    out8, _, ref, _, _, _, _ = fp8_mma_case("torch", ext, pre, seed=5)
    out16, _, ref16, _, _, _, _ = fp8_mma_case("torch", ext, pre, seed=5, mma=None)
    assert torch.equal(ref, ref16)
    assert fp8_mma_case("torch", ext, pre, seed=5)[-1].mma_dtype == FP8
    assert rel_rmse(out16, ref) < 0.004 < rel_rmse(out8, ref)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_nan_query_row_propagates(backend, request):
    """A NaN in one query row (head 0): that row's output and lse are NaN, every other row finite."""
    if backend == "triton":
        request.getfixturevalue("interp")
    out, lse, _, _, pad_out, pad_lse, _ = fp8_mma_case(backend, [9, 6], [3, 0], nan_row=4, seed=2)
    assert out[4, 0].isnan().all() and lse[4, 0].isnan()
    keep = torch.ones(out.shape[:2], dtype=torch.bool)
    keep[4, 0] = False
    assert not out[keep].isnan().any() and not lse[keep].isnan().any()
    assert (pad_out == 0).all() and torch.isneginf(pad_lse).all()


# ---------------------------------------------------------------------------------------- Triton (interpreter)
def test_emulated_e4m3_rounding_matches_torch(interp):
    """The interpreter's FP8 emulation rounds exactly as torch's e4m3 conversion (saturating)."""
    global tl, _attn_steps  # the interpreted kernel reads module globals (imported in interpreter mode here)
    import triton
    import triton.language as tl

    from cpattn.kernels import _attn_steps

    @triton.jit
    def _round(X, Y, N: tl.constexpr):
        o = tl.arange(0, N)
        tl.store(Y + o, _attn_steps.e4m3_round(tl.load(X + o)))

    g = torch.Generator().manual_seed(0)
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()]
    mids = (grid.sort().values[1:] + grid.sort().values[:-1]) / 2  # ties: to even
    x = torch.cat([torch.randn(4096, generator=g) * 10 ** torch.randint(-4, 3, (4096,), generator=g).float(),
                   grid, mids, torch.tensor([1e-12, -3e-3, 447.9, 460.0, 464.0, 470.0, 1e6, -1e6, float("nan")])])
    x = torch.cat([x, torch.zeros(8192 - x.numel())])
    y = torch.empty_like(x)
    _round[(1,)](x, y, 8192)
    want = x.clamp(-448, 448).to(FP8).float()
    assert torch.equal(y.isnan(), x.isnan())
    fin = ~x.isnan()
    assert torch.equal(y[fin], want[fin])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_portable_kernel_within_bound(interp, dtype):
    out, lse, ref, ref_lse, pad_out, pad_lse, plan = fp8_mma_case("triton", [37, 50, 5], [0, 9, 3], dtype=dtype)
    assert plan.family == "portable" and plan.mma_dtype == FP8 and plan.launch.portable_args["FP8_MMA"] == 2
    assert (pad_out == 0).all() and torch.isneginf(pad_lse).all()
    assert rel_rmse(out, ref) < REL_RMSE_BOUND
    assert (lse.double() - ref_lse).abs().max().item() < LSE_BOUND


@pytest.mark.parametrize("case", [
    dict(ext=[0, 1, 33, 2], pre=[4, 0, 17, 60]),
    dict(ext=[45, 12, 1], pre=[7, 0, 30], strategy="zigzag", cp=2, rank=1, hq=6, hkv=2, window=19, sinks=True),
    dict(ext=[30, 3], pre=[20, 0], page=16, per_head=False, d=128),
    dict(ext=[21, 8], pre=[5, 40], page=8, cp=2, rank=0, d=192, dv=128, hq=4, hkv=1),
])
def test_portable_kernel_shapes(interp, case):
    case = dict(case)
    check_case("triton", case.pop("ext"), case.pop("pre"), seed=7, **case)


def test_portable_kernel_matches_torch_reference(interp):
    """The kernel and the reference implement one scheme: they differ only where P's rounding
    differs (the kernel's running max vs the row's final max), far below the bound."""
    ext, pre = [40, 9, 30], [0, 25, 70]
    a = fp8_mma_case("triton", ext, pre, hq=4, hkv=1, window=33, sinks=True, seed=11)
    b = fp8_mma_case("torch", ext, pre, hq=4, hkv=1, window=33, sinks=True, seed=11)
    assert torch.equal(a[2], b[2])
    err = rel_rmse(a[0], b[0].double())
    assert err < REL_RMSE_BOUND / 4, err
    assert (a[1] - b[1]).abs().max().item() < 1e-3


def test_decode_shaped_dense_plan_keeps_fp8_mma(interp):
    """A decode-shaped dense plan of an FP8-MMA spec runs the portable kernel's FP8 dots, not
    the split-KV family (which dequantizes)."""
    out, lse, ref, ref_lse, _, _, plan = fp8_mma_case("triton", [1, 1, 2], [300, 77, 150], seed=4,
                                                      backend_options={"decode": {"num_sms": 64, "min_split": 16}})
    assert plan.family == "portable" and plan.mma_dtype == FP8 and plan.launch.portable_args["FP8_MMA"] == 2
    assert rel_rmse(out, ref) < REL_RMSE_BOUND
    with pytest.raises(ValueError, match="mma_dtype"):
        fp8_mma_case("triton", [1, 1, 2], [300, 77, 150], seed=4, backend_options={"family": "decode"})


def test_lse_is_natural_log(interp):
    """Sanity of the units: one visible key gives lse = its scaled score (log 1 = 0 added)."""
    out, lse, ref, ref_lse, *_ = fp8_mma_case("triton", [1], [0], seed=9)
    assert math.isfinite(lse[0, 0].item())
    assert abs(lse[0, 0].item() - ref_lse[0, 0].item()) < LSE_BOUND


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_shard_plans_ignore_mma_dtype(backend, request):
    """Shard plans (decode over a sharded cache; memory-bound) dequantize in registers whatever
    ``mma_dtype`` says, and say so: ``plan.mma_dtype`` is None and the output meets the
    dequantize path's tolerance, far tighter than the FP8-MMA bound."""
    if backend == "triton":
        request.getfixturevalue("interp")
    ext, pre = [1, 2, 1], [40, 70, 33]
    g = torch.Generator().manual_seed(21)
    hq, hkv, d = 8, 2, 32
    n_kv = sum(e + p for e, p in zip(ext, pre))
    q = torch.randn(sum(ext), hq, d, generator=g)
    keys, vals = torch.randn(n_kv, hkv, d, generator=g), torch.randn(n_kv, hkv, d, generator=g)
    ks, vs = _scales(keys, True), _scales(vals, True)
    k8, v8 = (keys / ks.view(-1, 1)).to(FP8), (vals / vs.view(-1, 1)).to(FP8)
    meta = cpattn.get_strategy("replicated", 1).build_metadata(ext, pre, rank=0, kv=cpattn.KVSharding(1))
    spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.float32, kv_dtype=FP8,
                                mma_dtype=FP8)
    plan = cpattn.plan_attention(meta, spec, backend=backend)
    assert plan.mma_dtype is None
    out, lse = plan.attend(q, k8, v8, k_scale=ks, v_scale=vs)
    ref, ref_lse = attention_oracle(q, k8.double() * _per_head(ks), v8.double() * _per_head(vs), ext, pre)
    assert (out.double() - ref).abs().max().item() < TOLERANCE[torch.float32]
    assert (lse.double() - ref_lse).abs().max().item() < TOLERANCE[torch.float32]
