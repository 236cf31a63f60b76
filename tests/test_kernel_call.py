"""The plans' kernel keywords (``cpattn.plans.base.KernelCall``): each ``attend`` / ``run`` takes
its documented subset; any other keyword is a TypeError naming it, raised before any write (the
caches stay bit-identical), and the keywords it takes reach the kernel (checked against calls
with and without them)."""

from __future__ import annotations

import pytest
import torch

import cpattn


def _paged(kv=None, strategy="replicated"):
    meta = cpattn.get_strategy(strategy, 1).build_metadata([2, 1], [3, 4], rank=0, kv=kv)
    spec = cpattn.AttentionSpec(num_q_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, page_size=4,
                                has_sinks=True)
    table = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(6, 4, 2, 8, generator=g), torch.randn(6, 4, 2, 8, generator=g)
    q, k = torch.randn(meta.num_physical_tokens, 4, 8, generator=g), torch.randn(meta.num_physical_tokens, 2, 8,
                                                                                    generator=g)
    return meta, spec, table, kc, vc, q, k, torch.randn(4, generator=g)


@pytest.mark.parametrize("kv", [None, "sharded"])
def test_unknown_keywords_raise_before_the_write(kv):
    meta, spec, table, kc, vc, q, k, sinks = _paged(cpattn.KVSharding(1) if kv else None)
    plan = cpattn.plan_attention(meta, spec, backend="torch")
    writes = cpattn.plan_cache_writes(meta, table, page_size=4, num_pages=6)
    before = (kc.clone(), vc.clone())
    refused = {"bogus": 1} if kv is None else {"out": torch.empty(3, 4, 8)}  # shard_merge's run returns the merge
    with pytest.raises(TypeError, match=f"run\\(\\) got unexpected keyword argument\\(s\\) \\['{next(iter(refused))}'\\]"):
        plan.run(q, k, k, (kc, vc), writes=writes, page_table=table, sinks=sinks, **refused)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    out, lse = plan.run(q, k, k, (kc, vc), writes=writes, page_table=table, sinks=sinks, return_lse=True)
    half = plan.run(q, k, k, (kc, vc), writes=writes, page_table=table, sinks=sinks, softmax_scale=0.5 * 8 ** -0.5)
    assert lse.shape == (3, 4) and not torch.equal(half, out)  # softmax_scale reached the kernel
    if kv is not None:
        with pytest.raises(TypeError, match=r"attend\(\) got unexpected keyword argument\(s\) \['return_lse'\]"):
            plan.attend(q, kc, vc, page_table=table, sinks=sinks, return_lse=True)


def test_extend_plan_refuses_out_and_convenience_forms_take_buffers():
    meta, spec, table, kc, vc, q, k, sinks = _paged(cpattn.KVSharding(1), strategy="zigzag")
    plan = cpattn.plan_attention(meta, spec, backend="torch", page_table=table, num_pages=6, algorithm="pass_q")
    before = kc.clone()
    with pytest.raises(TypeError, match=r"run\(\) got unexpected keyword argument\(s\) \['lse', 'out'\]"):
        plan.run(q, k, k, (kc, vc), sinks=sinks, out=torch.empty(0), lse=torch.empty(0))
    assert torch.equal(kc, before)
    s = cpattn.get_strategy("zigzag", 1)
    m = s.build_metadata([3], rank=0)
    qq, kk = torch.randn(m.num_physical_tokens, 4, 8), torch.randn(3, 2, 8)
    buf = torch.full((m.num_physical_tokens, 4, 8), float("nan"))
    res = s.attention(qq, kk, kk, m, out=buf, backend="torch")
    assert res is buf and torch.equal(res, s.attention(qq, kk, kk, m, backend="torch"))
    with pytest.raises(TypeError, match="bogus"):
        s.attention(qq, kk, kk, m, backend="torch", bogus=None)
