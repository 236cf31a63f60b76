"""``strategy.attention`` (torch backend) against the independent fp64 oracle, on every rank."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpattn
from oracle import TOLERANCE, attention_oracle

NAMES = ["zigzag", "interleave", "contiguous"]


def make_inputs(extend, prefix, hq, hkv, d, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, nkv = sum(extend), sum(extend) + sum(prefix)
    q = torch.randn(T, hq, d, generator=g).to(dtype)
    k = torch.randn(nkv, hkv, d, generator=g).to(dtype)
    v = torch.randn(nkv, hkv, dv, generator=g).to(dtype)
    return q, k, v


def check_all_ranks(name, cp_size, extend, prefix, q, k, v, *, window=-1, sinks=None, pad_multiple=1):
    s = cpattn.get_strategy(name, cp_size, pad_multiple=pad_multiple)
    ref_o, ref_lse = attention_oracle(q, k, v, extend, prefix, window_left=window, sinks=sinks)
    tol = TOLERANCE[q.dtype]
    for rank in range(cp_size):
        m = s.build_metadata(extend, prefix, rank=rank)
        q_local = s.shard(q, m)
        kw = dict(window_size=(window, 0), sinks=sinks, backend="torch", return_lse=True)
        o, lse = s.attention(q_local, k, v, m, **kw)
        n, idx = m.num_local_tokens, m.local_token_indices
        assert o.shape == (m.num_physical_tokens, q.shape[1], v.shape[-1]) and o.dtype == q.dtype
        assert lse.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32)
        torch.testing.assert_close(o[:n].double(), ref_o[idx], atol=tol, rtol=0)
        # float64 inputs: a float64 lse, checked at the fp64 tolerance
        lse_tol = tol if q.dtype == torch.float64 else max(tol, 1e-5)
        torch.testing.assert_close(lse[:n].double(), ref_lse[idx], atol=lse_tol, rtol=0)
        assert torch.equal(o[n:], torch.zeros_like(o[n:]))
        assert torch.isneginf(lse[n:]).all()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_gqa_prefix_window_sinks(name, dtype):
    extend, prefix = [13, 1, 0, 7, 30], [5, 0, 3, 0, 2]
    q, k, v = make_inputs(extend, prefix, hq=6, hkv=2, d=16, dv=8, dtype=dtype)
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(3)).to(dtype)
    check_all_ranks(name, 3, extend, prefix, q, k, v)
    check_all_ranks(name, 3, extend, prefix, q, k, v, window=4, sinks=sinks, pad_multiple=8)


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from(NAMES),
    st.integers(1, 5),
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 20)), min_size=0, max_size=4),
    st.sampled_from([-1, 0, 1, 5]),
    st.sampled_from([(4, 4), (4, 1), (4, 2)]),
)
def test_random_batches_fp32(name, cp_size, seqs, window, heads):
    extend, prefix = [e for e, _ in seqs], [p for _, p in seqs]
    q, k, v = make_inputs(extend, prefix, heads[0], heads[1], 8, 8, torch.float32, seed=len(seqs))
    check_all_ranks(name, cp_size, extend, prefix, q, k, v, window=window)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_paged_equals_packed(page_size):
    extend, prefix = [11, 4, 0, 9], [6, 0, 2, 1]
    q, k, v = make_inputs(extend, prefix, 4, 2, 8, 8, torch.float32)
    g = torch.Generator().manual_seed(7)

    def paged(meta):
        kv_lens = meta.kv_lens.tolist()
        max_pages = max(-(-n // page_size) for n in kv_lens)
        num_pages = sum(max_pages for _ in kv_lens) + 3
        perm = torch.randperm(num_pages, generator=g)  # pages scattered over the pool
        table = perm[: len(kv_lens) * max_pages].view(len(kv_lens), max_pages).to(torch.int32)
        k_cache = torch.randn(num_pages, page_size, 2, 8, generator=g)  # junk outside the sequences
        v_cache = torch.randn(num_pages, page_size, 2, 8, generator=g)
        start = 0
        for b, n in enumerate(kv_lens):
            for j in range(n):
                k_cache[table[b, j // page_size], j % page_size] = k[start + j]
                v_cache[table[b, j // page_size], j % page_size] = v[start + j]
            start += n
        return k_cache, v_cache, {"page_table": table}

    s = cpattn.ZigzagStrategy(2)
    ref_o, _ = attention_oracle(q, k, v, extend, prefix)
    for rank in range(2):
        m = s.build_metadata(extend, prefix, rank=rank)
        k_cache, v_cache, kw = paged(m)
        o = s.attention(s.shard(q, m), k_cache, v_cache, m, backend="torch", **kw)
        torch.testing.assert_close(o[: m.num_local_tokens].double(), ref_o[m.local_token_indices], atol=2e-5, rtol=0)


def test_default_scale_and_explicit_scale():
    extend, prefix = [9], [2]
    q, k, v = make_inputs(extend, prefix, 2, 2, 8, 8, torch.float64)
    s = cpattn.ZigzagStrategy(2)
    m = s.build_metadata(extend, prefix, rank=1)
    o = s.attention(s.shard(q, m), k, v, m, softmax_scale=0.3, backend="torch")
    ref_o, _ = attention_oracle(q, k, v, extend, prefix, scale=0.3)
    torch.testing.assert_close(o[: m.num_local_tokens], ref_o[m.local_token_indices], atol=1e-10, rtol=0)


def test_auto_backend_on_cpu_is_visible():
    s = cpattn.ZigzagStrategy(1)
    m = s.build_metadata([4], rank=0)
    q, k, v = make_inputs([4], [0], 2, 2, 8, 8, torch.float32)
    plan = cpattn.plan_attention(m, cpattn.AttentionSpec(num_q_heads=2, num_kv_heads=2, head_dim=8, dtype=q.dtype))
    assert plan.backend in cpattn.available_backends()
    # the plan strategy.attention runs (cached beside m) says the same
    assert s._cached_plan(s.shard(q, m), k, v, m, {}, "auto").backend == plan.backend
