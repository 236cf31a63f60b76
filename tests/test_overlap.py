"""cpattn.overlap: start/wait K/V and MLA-latent gathers equal the synchronous gathers exactly."""

from __future__ import annotations

import pytest
import torch

import cpattn
from cpattn.overlap import start_gather_kv, start_gather_mla_latent
from dist_utils import run_distributed

EXTEND, PREFIX = [13, 1, 6], [0, 4, 0]


def _inputs(meta, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    p = meta.num_physical_tokens
    k = torch.randn(p, 2, 8, generator=gen)
    v = torch.randn(p, 2, 4, generator=gen).to(torch.bfloat16).float()
    kv_c = torch.randn(p, 16, generator=gen).to(torch.bfloat16)
    k_pe = torch.randn(p, 8, generator=gen)
    return [t.to(device) for t in (k, v, kv_c, k_pe)]


def _check(strategy, meta, group, seed, device="cpu", stream=None):
    k, v, kv_c, k_pe = _inputs(meta, seed, device)
    sync_kv = strategy.gather_kv(k, v, meta, group)
    sync_latent = strategy.gather_mla_latent(kv_c, k_pe, meta, group)
    handle = start_gather_kv(strategy, k, v, meta, group, stream=stream)
    latent = start_gather_mla_latent(strategy, kv_c, k_pe, meta, group, stream=stream)
    first = handle.wait()
    second = handle.wait()  # idempotent: the same tensors, no second collective
    assert all(a is b for a, b in zip(first, second))
    assert handle.is_completed() or device != "cpu"
    for got, want in zip(first + latent.wait(), sync_kv + sync_latent):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    return first


def _worker(rank: int, world: int) -> None:
    for name in cpattn.STRATEGIES:
        s = cpattn.get_strategy(name, world, pad_multiple=4)
        meta = s.build_metadata(EXTEND, PREFIX, rank=rank)
        _check(s, meta, None, seed=rank)
        # Input errors raise before any collective (every rank raises the same, nobody hangs).
        with pytest.raises(ValueError, match="num_physical_tokens"):
            start_gather_kv(s, torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), meta)
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            start_gather_kv(s, *_inputs(meta, 0)[:2], meta, stream=object())


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_async_equals_sync_gloo(world):
    run_distributed(_worker, world)


def test_single_rank_and_bad_strategy():
    s = cpattn.ZigzagStrategy(1)
    meta = s.build_metadata(EXTEND, PREFIX, rank=0)
    k, _ = _check(s, meta, None, seed=0)
    assert k.shape == (sum(EXTEND), 2, 8)
    with pytest.raises(TypeError, match="CPStrategy"):
        start_gather_kv("zigzag", k, k, meta)


@pytest.mark.gpu
def test_cuda_side_stream_single_rank():
    s = cpattn.InterleaveStrategy(1, pad_multiple=8)
    meta = s.build_metadata(EXTEND, PREFIX, rank=0).to("cuda")
    _check(s, meta, None, seed=0, device="cuda")
    _check(s, meta, None, seed=1, device="cuda", stream=torch.cuda.Stream())
    torch.cuda.synchronize()
