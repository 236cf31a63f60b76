"""DSA under CP on gloo (2 and 3 spawned ranks): ``gather_packed`` of fp8 / fp32-scale / bf16
parts in ONE collective, and the reference DSA layer (MLA + indexer + sparse attention) under CP
equal to one process with exactly one collective per layer. Single-process checks of the layer
(config, fp8 quantization, bad inputs) run in the test process.

Tolerance (CP output vs the same layer on one process): fp32 1e-5 relative (the same code runs on
fewer rows; the selections are compared exactly, as sets per row). The indexer has 16 heads: a
score is exactly 0 when every head's relu is 0 (probability 2^-H per key), and torch.topk breaks
such ties arbitrarily, so few heads would make equal selections a matter of luck.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import cpattn
from reference_layers.dsa import DSAAttention, DSAConfig, quantize_index_keys

from dist_utils import CountCollectives, run_distributed

FP8 = torch.float8_e4m3fn
STRATEGIES = ("zigzag", "interleave", "contiguous")
CFG = DSAConfig(hidden=48, num_heads=4, q_lora_rank=40, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8,
                v_head_dim=10, index_n_heads=16, index_head_dim=16, index_topk=6)


def _batch(cp: int) -> tuple[list[int], list[int]]:
    """Ragged, with prefixes; extend lengths 0, 1 and < 2C; sequences shorter and longer than top-k."""
    return [0, 1, 2 * cp - 1, 2 * cp + 1, 17, 4], [3, 0, 2, 0, 6, 1]


def _positions(ext, pre) -> torch.Tensor:
    return torch.cat([torch.arange(p, p + e) for e, p in zip(ext, pre)])


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def _rel_err(a, b) -> float:
    return float((a.float() - b.float()).abs().max()) / max(1.0, float(b.float().abs().max()))


# ------------------------------------------------------------------------------- distributed worker
def _check_gather_packed(rank: int, cp: int) -> int:
    """gather_packed of latent (bf16), rope key (bf16), fp8 index key, fp32 scale and a 3-D part:
    the logical tensors bit for bit, in exactly one collective (sync and async)."""
    ext, pre = _batch(cp)
    checks = 0
    for name, pad in [(n, 1) for n in STRATEGIES] + [("interleave", 8)]:
        s = cpattn.get_strategy(name, cp, pad_multiple=pad)
        meta = s.build_metadata(ext, pre, rank=rank)
        t = meta.num_tokens
        gen = torch.Generator().manual_seed(3)
        logical = [
            torch.randn(t, 20, generator=gen).to(torch.bfloat16),
            torch.randn(t, 6, generator=gen).to(torch.bfloat16),
            torch.randint(0, 256, (t, 16), generator=gen, dtype=torch.uint8).view(FP8),  # any bit pattern
            torch.rand(t, generator=gen) + 0.5,  # fp32 scale per token, 1-D
            torch.randn(t, 2, 3, generator=gen),  # any trailing shape
        ]
        local = []
        for x in logical:
            shard = s.shard(x.view(torch.uint8) if x.dtype == FP8 else x, meta)
            shard[meta.num_local_tokens:] = 7  # garbage in pad rows must be dropped
            local.append(shard.view(FP8) if x.dtype == FP8 else shard)
        for async_op in (False, True):
            with CountCollectives() as counter:
                got = s.gather_packed(local, meta, async_op=async_op)
                if async_op:
                    got = got.wait()
            assert len(counter.calls) == (1 if cp > 1 else 0), f"{len(counter.calls)} collectives, expected 1"
            assert counter.calls[0][1] == cpattn.gathered_bytes_per_token(local)
            for g, x in zip(got, logical):
                assert g.dtype == x.dtype and g.shape == x.shape
                assert torch.equal(_bits(g), _bits(x)), f"{name} pad={pad} {x.dtype}: gathered rows differ"
            checks += 1
    return checks


def _layer_inputs(cfg: DSAConfig, ext, pre, dtype=torch.float32):
    gen = torch.Generator().manual_seed(5)
    n_pre = sum(pre)
    x = torch.randn(sum(ext), cfg.hidden, generator=gen).to(dtype)
    k_idx = torch.randn(n_pre, cfg.index_head_dim, generator=gen)
    prefix = [torch.randn(n_pre, cfg.kv_lora_rank, generator=gen).to(dtype),
              torch.randn(n_pre, cfg.qk_rope_head_dim, generator=gen).to(dtype)]
    prefix += list(quantize_index_keys(k_idx)) if cfg.index_fp8 else [k_idx.to(dtype)]
    return x, _positions(ext, pre), tuple(prefix)


def _check_layer(rank: int, cp: int, backend: str, cases) -> dict:
    ext, pre = _batch(cp)
    errs = {}
    for cfg_kw, absorb, name in cases:
        cfg = DSAConfig(**{**CFG.__dict__, **cfg_kw})
        model = DSAAttention(cfg, seed=2)
        x, pos, prefix = _layer_inputs(cfg, ext, pre)
        s1 = cpattn.get_strategy(name, 1)
        meta1 = s1.build_metadata(ext, pre, rank=0)
        ref, ref_parts, ref_idx = model(x, pos, s1, meta1, prefix=prefix, absorb=absorb, backend="torch",
                                        index_backend="torch")
        s = cpattn.get_strategy(name, cp, pad_multiple=4)
        meta = s.build_metadata(ext, pre, rank=rank)
        with CountCollectives() as counter:
            out, parts, idx = model(s.shard(x, meta), s.shard(pos, meta), s, meta, prefix=prefix, absorb=absorb,
                                    backend=backend, index_backend=backend)
        assert len(counter.calls) == 1, f"the layer ran {len(counter.calls)} collectives, expected 1"
        assert counter.calls[0][1] == cpattn.gathered_bytes_per_token(parts)
        for a, b in zip(parts, ref_parts):
            assert torch.equal(_bits(a), _bits(b)), "gathered parts differ from one process"
        n = meta.num_local_tokens
        rows = meta.local_token_indices
        same = (idx[:n].sort(1).values == ref_idx[rows].sort(1).values).all(1)
        assert bool(same.all()), f"{name}: selections differ: {idx[:n][~same].tolist()} vs {ref_idx[rows][~same].tolist()}"
        assert bool((idx[n:] == -1).all()) and bool((out[n:] == 0).all())
        key = (name, "absorbed" if absorb else "per-head", cfg.index_topk, cfg.index_fp8)
        errs[key] = err = _rel_err(s.gather(out, meta), ref)
        assert err <= 1e-5, f"{key}: CP vs one process {err:.3g}"
    return errs


LAYER_CASES = [({}, True, n) for n in STRATEGIES] + [
    ({}, False, "interleave"),
    ({"index_topk": 40}, True, "zigzag"),  # top-k above every sequence: the causal rule alone
    ({"index_fp8": True}, True, "interleave"),
    ({"index_fp8": True, "index_topk": 3}, False, "zigzag"),
]


def _cp_worker(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    return {
        "gather_checks": _check_gather_packed(rank, world_size),
        "layer_errors": _check_layer(rank, world_size, "torch", LAYER_CASES),
    }


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 3])
def test_dsa_under_cp_gloo(cp):
    results = run_distributed(_cp_worker, cp)
    assert all(r["gather_checks"] == 2 * (len(STRATEGIES) + 1) for r in results)
    assert all(r["layer_errors"] == results[0]["layer_errors"] for r in results)
    assert len(results[0]["layer_errors"]) == len(LAYER_CASES)


def _triton_worker(rank: int, world_size: int) -> dict:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are first imported (lazily)
    return _check_layer(rank, world_size, "triton", [({}, True, "interleave"), ({"index_topk": 40}, False, "zigzag")])


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (interpreter)")
def test_dsa_layer_triton_under_cp():
    """The DSA layer through backend="triton" (both DSA kernels, Triton interpreter) under CP == torch
    on one process."""
    results = run_distributed(_triton_worker, 2)
    assert len(results[0]) == 2


# ------------------------------------------------------------------------------- single process
def test_deepseek_v32_config():
    c = DSAConfig.deepseek_v32()
    assert (c.num_heads, c.latent_dim, c.kv_lora_rank, c.index_n_heads, c.index_head_dim, c.index_topk) == \
        (128, 576, 512, 64, 128, 2048)
    assert c.softmax_scale == 192**-0.5 and c.index_softmax_scale == 128**-0.5
    assert DSAConfig.deepseek_v32(index_fp8=True).index_fp8


def test_quantize_index_keys():
    k = torch.randn(9, 16) * torch.linspace(0.01, 100, 9)[:, None]
    k[3] = 0
    q, scale = quantize_index_keys(k)
    assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (9,)
    back = q.float() * scale[:, None]
    assert torch.allclose(back, k, rtol=0.07, atol=1e-6) and scale[3] == 1 and not back[3].any()


def test_layer_bad_inputs():
    import re

    with pytest.raises(ValueError, match="q_lora_rank"):
        DSAConfig(q_lora_rank=None)
    with pytest.raises(ValueError, match="index_head_dim=4 must be >= qk_rope_head_dim"):
        DSAConfig(index_head_dim=4)
    with pytest.raises(ValueError, match="index_topk must be >= 1"):
        DSAConfig(index_topk=0)
    with pytest.raises(TypeError, match="config must be a DSAConfig"):
        DSAAttention(CFG.__dict__)
    model = DSAAttention(CFG)
    s = cpattn.InterleaveStrategy(1)
    meta = s.build_metadata([3, 2], [2, 0], rank=0)
    x, pos = torch.zeros(5, CFG.hidden), torch.tensor([2, 3, 4, 0, 1])
    with pytest.raises(ValueError, match="prefix tokens: pass prefix"):
        model(x, pos, s, meta)
    with pytest.raises(ValueError, match="x must be"):
        model(x[:, :3], pos, s, meta)
    bad = (torch.zeros(2, CFG.kv_lora_rank), torch.zeros(2, CFG.qk_rope_head_dim), torch.zeros(3, 16))
    with pytest.raises(ValueError, match=re.escape("prefix k_idx must be [2, 16]")):
        model(x, pos, s, meta, prefix=bad)
    with pytest.raises(ValueError, match="prefix must hold 3 tensors"):
        model(x, pos, s, meta, prefix=bad[:2])
