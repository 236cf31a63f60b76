"""merge_states (the exact local merge of partial attention results): property tests in fp64
against attention over the union of the key sets, and the -inf / huge / NaN edge cases."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpattn


def _partial(scores: torch.Tensor, values: torch.Tensor, keep: torch.Tensor):
    """fp64 (out, lse) of softmax over the kept keys: scores [N, M], values [M, Dv], keep [M]."""
    s = scores.masked_fill(~keep[None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=1)
    p = torch.where(torch.isneginf(lse)[:, None], 0.0, torch.exp(s - lse[:, None].clamp(min=-1e300)))
    return p @ values, lse


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 8), st.integers(0, 40), st.integers(1, 5), st.integers(0, 10**6), st.floats(-800, 800))
def test_merge_of_disjoint_parts_equals_full_softmax(parts, keys, rows, seed, shift):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, keys, generator=g, dtype=torch.float64) * 3
    values = torch.randn(keys, 4, generator=g, dtype=torch.float64)
    owner = torch.randint(0, parts, (keys,), generator=g)
    outs, lses = zip(*[_partial(scores, values, owner == c) for c in range(parts)])
    ref_out, ref_lse = _partial(scores, values, torch.ones(keys, dtype=torch.bool))
    lse_parts = torch.stack(lses) + shift  # a common shift (|800| overflows exp in fp64): same result
    out, lse = cpattn.merge_states(torch.stack(outs), lse_parts)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    assert not out.isnan().any() and not lse.isnan().any()
    if keys:
        assert torch.allclose(out, ref_out, atol=1e-12, rtol=0)
        assert torch.allclose(lse - shift, ref_lse, atol=1e-9, rtol=0)
    else:
        assert (out == 0).all() and torch.isneginf(lse).all()
    # order of the parts does not matter
    perm = torch.randperm(parts, generator=g)
    out2, _ = cpattn.merge_states(torch.stack(outs)[perm], lse_parts[perm])
    assert torch.allclose(out, out2, atol=1e-12, rtol=0)


def test_merge_edge_values_float32():
    o = torch.randn(4, 6, 3, 8)
    lse = torch.randn(4, 6, 3)
    lse[:, 0] = float("-inf")  # every part empty: 0 / -inf
    o[:, 0] = float("nan")  # ... and garbage out never read
    lse[:, 1] = torch.tensor([3e38, 0.0, -3e38, float("-inf")])[:, None]  # huge: the largest dominates
    lse[:, 2] = torch.tensor([1e30, 1e30, float("-inf"), 1e30])[:, None]  # equal huge values: equal weights
    lse[:, 3] = torch.tensor([float("inf"), 0.0, 1.0, 2.0])[:, None]  # +inf (overflowed upstream): no NaN
    lse[2, 4] = float("nan")  # a NaN lse reaches its row
    o[1, 5, 1, 2] = float("nan")  # a NaN in a part with weight > 0 reaches its row / head
    out, m = cpattn.merge_states(o, lse)
    assert (out[0] == 0).all() and torch.isneginf(m[0]).all()
    assert torch.equal(out[1], o[0, 1]) and (m[1] == 3e38).all()
    assert torch.allclose(out[2], (o[0, 2] + o[1, 2] + o[3, 2]) / 3, atol=1e-6) and (m[2] == 1e30).all()
    assert not out[3].isnan().any() and torch.isposinf(m[3]).all()
    assert out[4].isnan().all() and m[4].isnan().all()
    assert out[5, 1, 2].isnan() and not out[5, 0].isnan().any() and not out[5, 1, :2].isnan().any()
    assert out.dtype == torch.float32 and m.dtype == torch.float32


def test_merge_dim_dtypes_and_errors():
    o = torch.randn(5, 2, 3, 4).bfloat16()
    lse = torch.randn(5, 2, 3)
    a, la = cpattn.merge_states(o, lse)
    b, lb = cpattn.merge_states(o.transpose(0, 1), lse.transpose(0, 1), dim=1)
    assert a.dtype == torch.bfloat16 and torch.equal(a, b) and torch.equal(la, lb)
    empty_o, empty_l = cpattn.merge_states(o[:0], lse[:0])
    assert (empty_o == 0).all() and torch.isneginf(empty_l).all() and empty_o.shape == (2, 3, 4)
    with pytest.raises(ValueError, match="lse_parts must be out_parts without its last dim"):
        cpattn.merge_states(o, lse[:, :1])
    with pytest.raises(TypeError, match="must be floating"):
        cpattn.merge_states(o, lse.long())
    with pytest.raises(ValueError, match="dim 3 out of range"):
        cpattn.merge_states(o, lse, dim=3)


def test_merge_partials_single_rank_needs_no_group():
    o, l = torch.randn(3, 4, 8), torch.randn(3, 4)
    assert cpattn.merge_partials(o, l, None) is o
    dmeta = cpattn.get_strategy("replicated", 1).build_metadata([1, 1, 1], [3, 4, 5], rank=0, kv=cpattn.KVSharding(1))
    out, lse = cpattn.merge_partials(o, l, None, meta=dmeta, return_lse=True)
    assert out is o and lse is l
    with pytest.raises(ValueError, match="out_part has 2 rows but the plan has 3"):
        cpattn.merge_partials(o[:2], l[:2], None, meta=dmeta)
    with pytest.raises(ValueError, match="lse_part must be float32"):
        cpattn.merge_partials(o, l[:, :2], None)
    with pytest.raises(ValueError, match="lse_part must be float32"):
        cpattn.merge_partials(o, l.double(), None)
    with pytest.raises(ValueError, match="cp_size 2"):
        cpattn.merge_partials(o, l, None, meta=cpattn.get_strategy("replicated", 2).build_metadata(
            [1, 1, 1], [3, 4, 5], rank=0, kv=cpattn.KVSharding(2)))


def test_merge_keeps_no_module_state():
    """Which headers were checked lives on the plan (``agreed_partials``), never in the module:
    no mutable module-level value (dict / set / list / weak mapping), and a single-rank merge
    leaves a plan's record empty (nothing was exchanged)."""
    import types
    import weakref

    import cpattn.merge as merge

    mutable = (dict, set, list, bytearray, weakref.WeakKeyDictionary, weakref.WeakValueDictionary, weakref.WeakSet)
    state = {name: type(v).__name__ for name, v in vars(merge).items()
             if isinstance(v, mutable) and not name.startswith("__") and not isinstance(v, types.ModuleType)}
    assert state == {}, state
    assert not hasattr(merge, "_CHECKED") and not hasattr(merge, "_CHECKED_DEFAULT")
    meta = cpattn.get_strategy("replicated", 1).build_metadata([1, 2], [3, 4], rank=0, kv=cpattn.KVSharding(1))
    spec = cpattn.AttentionSpec(num_q_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    plan = cpattn.plan_attention(meta, spec, backend="torch")
    q, kc, vc = torch.randn(3, 4, 8), torch.randn(meta.num_local_kv_tokens, 2, 8), torch.randn(meta.num_local_kv_tokens, 2, 8)
    out_p, lse_p = plan.attend(q, kc, vc)
    assert plan.merge(out_p, lse_p) is out_p and plan.agreed_partials == frozenset()
    assert merge.partials_header(out_p, True) == (3, 4, 8, 3, 1)  # float32: dtype code 3
    with pytest.raises(TypeError, match="agree must be a bool, got str"):
        plan.merge(out_p, lse_p, agree="no")
