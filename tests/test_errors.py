"""Every misuse raises ValueError/TypeError naming the argument, before any collective."""

from __future__ import annotations

import pytest
import torch

import cpattn


@pytest.fixture
def setup():
    s = cpattn.ZigzagStrategy(2)
    m = s.build_metadata([5, 3], [2, 0], rank=0)
    q = torch.zeros(m.num_physical_tokens, 4, 8)
    k = torch.zeros(m.num_kv_tokens, 2, 8)
    return s, m, q, k


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(cp_size=0), ValueError, "cp_size"),
        (dict(cp_size=2.0), TypeError, "cp_size"),
        (dict(cp_size=2, pad_multiple=0), ValueError, "pad_multiple"),
    ],
)
def test_bad_strategy_args(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        cpattn.ZigzagStrategy(**kwargs)


def test_bad_strategy_name():
    with pytest.raises(ValueError, match="strategy name"):
        cpattn.get_strategy("ring", 2)


@pytest.mark.parametrize(
    "extend, prefix, rank, exc, match",
    [
        ([3, -1], None, 0, ValueError, "extend_lens must be >= 0"),
        ([3, 1], [0, -2], 0, ValueError, "prefix_lens must be >= 0"),
        ([3, 1], [0], 0, ValueError, "same size"),
        ([3, 1.5], None, 0, TypeError, "extend_lens"),
        (torch.tensor([1.0]), None, 0, TypeError, "extend_lens"),
        (torch.zeros(2, 2, dtype=torch.int64), None, 0, ValueError, "1-D"),
        ("abc", None, 0, TypeError, "extend_lens"),
        ([3], None, 2, ValueError, "rank"),
        ([3], None, -1, ValueError, "rank"),
    ],
)
def test_bad_lengths_and_rank(extend, prefix, rank, exc, match):
    with pytest.raises(exc, match=match):
        cpattn.ZigzagStrategy(2).build_metadata(extend, prefix, rank=rank)


def test_shard_gather_rows(setup):
    s, m, q, _ = setup
    with pytest.raises(ValueError, match="num_tokens T = 8"):
        s.shard(torch.zeros(7, 3), m)
    with pytest.raises(ValueError, match="num_physical_tokens"):
        s.gather(torch.zeros(m.num_physical_tokens + 1, 3), m)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        s.shard([1, 2], m)


def test_metadata_from_other_strategy_or_size(setup):
    s, _, q, k = setup
    other = cpattn.InterleaveStrategy(2).build_metadata([5, 3], [2, 0], rank=0)
    with pytest.raises(ValueError, match="built by strategy='interleave'"):
        s.shard(torch.zeros(8, 1), other)
    bigger = cpattn.ZigzagStrategy(4).build_metadata([5, 3], [2, 0], rank=0)
    with pytest.raises(ValueError, match="cp_size=4"):
        s.attention(q, k, k, bigger)
    with pytest.raises(TypeError, match="CPMetadata"):
        s.shard(torch.zeros(8, 1), {"rank": 0})


def test_attention_inputs(setup):
    s, m, q, k = setup
    v = torch.zeros_like(k)
    with pytest.raises(ValueError, match=r"q_local must be \[P, Hq, D\] = \[5, 4, 8\], got \[3, 4, 8\]"):
        s.attention(q[:3], k, v, m)
    with pytest.raises(ValueError, match="Hq=4 must be a multiple of Hkv=3"):
        s.attention(q, torch.zeros(m.num_kv_tokens, 3, 8), torch.zeros(m.num_kv_tokens, 3, 8), m)
    with pytest.raises(ValueError, match=r"packed k/v must be \[10, 2, 8\].*rows = sum\(prefix_lens \+ extend_lens\)"):
        s.attention(q, k[:9], v[:9], m)
    with pytest.raises(TypeError, match="k dtype torch.float16 != the plan's dtype torch.float32"):
        s.attention(q, k.half(), v.half(), m)
    with pytest.raises(TypeError, match="v dtype torch.float64"):
        s.attention(q, k, v.double(), m)
    with pytest.raises(ValueError, match="head dim"):
        s.attention(q, torch.zeros(10, 2, 4), torch.zeros(10, 2, 4), m)
    with pytest.raises(ValueError, match="window_size"):
        s.attention(q, k, v, m, window_size=(4, 3))
    with pytest.raises(TypeError, match=r"window_size must be a pair \(left, right\) of ints, got 5"):
        s.attention(q, k, v, m, window_size=5)
    with pytest.raises(ValueError, match="sinks"):
        s.attention(q, k, v, m, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="backend must be one of"):
        s.attention(q, k, v, m, backend="cudnn")
    with pytest.raises(ValueError, match="page_table must be"):
        s.attention(q, torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8), m, page_table=torch.zeros(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="fewer than the longest sequence"):
        s.attention(q, torch.zeros(4, 2, 2, 8), torch.zeros(4, 2, 2, 8), m, page_table=torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(TypeError, match="page_table must be int32"):
        s.attention(q, torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8), m, page_table=torch.zeros(2, 4))


def test_gather_kv_dtype_mismatch(setup):
    s, m, _, _ = setup
    k = torch.zeros(m.num_physical_tokens, 2, 8)
    with pytest.raises(ValueError, match="dtype"):
        s.gather_kv(k, k.half(), m)


def test_collective_without_group_raises_before_any_collective(setup):
    s, m, _, _ = setup
    with pytest.raises(ValueError, match="initialized torch.distributed"):
        s.gather(torch.zeros(m.num_physical_tokens, 3), m)


def test_device_mismatch(setup):
    """A tensor on another device than the metadata (the 'meta' device stands in for a GPU)."""
    s, m, q, k = setup
    with pytest.raises(ValueError, match="meta.to"):
        s.attention(q.to("meta"), k, k, m)
    with pytest.raises(ValueError, match="device"):
        s.attention(q, k.to("meta"), k.to("meta"), m)


# ----------------------------------------------------------------------------- plan agreement
def test_build_metadata_agree_keyword():
    """Single process, no process group: group=None runs no exchange (agree only matters with a group)."""
    s = cpattn.ZigzagStrategy(2)
    m = s.build_metadata([5, 3], rank=1)
    assert m.group is None and torch.equal(m.extend_lens, s.build_metadata([5, 3], rank=1, agree=False).extend_lens)
    with pytest.raises(TypeError, match="agree must be a bool, got str"):
        s.build_metadata([5, 3], rank=1, agree="yes")
    with pytest.raises(TypeError, match="group must be None or a torch.distributed.ProcessGroup, got str"):
        s.build_metadata([5, 3], rank=1, group="x")


# ----------------------------------------------------------------------------- softmax_scale / device
def _dense_plan(setup, **kw):
    s, m, q, k = setup
    spec = cpattn.AttentionSpec(num_q_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, **kw)
    return cpattn.plan_attention(m, spec, backend="torch")


@pytest.mark.parametrize(
    "scale, exc, match",
    [
        ("abc", TypeError, r"softmax_scale must be a real number .*got str 'abc'"),
        (torch.tensor([0.1, 0.2]), ValueError, r"softmax_scale must be a number or a one-element tensor, got a "
                                               r"tensor of shape \[2\]"),
        (float("nan"), ValueError, "softmax_scale must be finite, got nan"),
        (True, TypeError, "softmax_scale must be a real number.*got bool"),
    ],
)
def test_bad_softmax_scale_names_the_argument(setup, scale, exc, match):
    s, m, q, k = setup
    plan = _dense_plan(setup)
    with pytest.raises(exc, match=match):
        plan.attend(q, k, k, softmax_scale=scale)
    with pytest.raises(exc, match=match):
        s.attention(q, k, k, m, softmax_scale=scale, backend="torch")
    p = m.num_physical_tokens
    idx = torch.zeros(p, 3, dtype=torch.int32)
    sparse = _dense_plan(setup, topk=3)
    with pytest.raises(exc, match=match):
        sparse.attend(q, k, k, idx, softmax_scale=scale)
    with pytest.raises(exc, match=match):
        s.sparse_attention(q, k, k, m, idx, softmax_scale=scale, backend="torch")
    qi, ki, w = torch.zeros(p, 2, 16), torch.zeros(m.num_kv_tokens, 16), torch.zeros(p, 2)
    with pytest.raises(exc, match=match):
        cpattn.dsa.index_topk(qi, ki, w, m, 3, softmax_scale=scale, backend="torch")


def test_good_softmax_scale_values(setup):
    from cpattn._validation import check_softmax_scale

    assert check_softmax_scale(None) is None
    assert check_softmax_scale(2) == 2.0 and type(check_softmax_scale(2)) is float
    assert check_softmax_scale(torch.tensor(0.25)) == 0.25
    assert check_softmax_scale(torch.tensor([0.5], dtype=torch.float64)) == 0.5
    with pytest.raises(TypeError, match="my_scale must be a real number"):
        check_softmax_scale([0.1], "my_scale")
    s, m, q, k = setup
    plan = _dense_plan(setup)
    assert torch.equal(plan.attend(q, k, k, softmax_scale=torch.tensor(0.3)), plan.attend(q, k, k, softmax_scale=0.3))


def test_check_device_names_the_argument():
    from cpattn._validation import check_device

    assert check_device("cpu", "device") == torch.device("cpu")
    assert check_device(torch.device("cpu"), "device") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"device must be a torch.device or a device string.*got 'banana'"):
        check_device("banana", "device")
    with pytest.raises(TypeError, match=r"where must be a torch.device, a device string or a CUDA index, got float"):
        check_device(1.5, "where")
    with pytest.raises(ValueError, match="device must be"):
        check_device(-1, "device")


# ----------------------------------------------------------------------------- merge / gather arguments
def test_merge_and_gather_argument_types(setup):
    s, m, _, _ = setup
    o, l = torch.randn(3, 4, 8), torch.randn(3, 4)
    with pytest.raises(TypeError, match=r"meta must be None or a CPMetadata .*got str 'x'"):
        cpattn.merge_partials(o, l, None, meta="x")
    with pytest.raises(TypeError, match="group must be None or a torch.distributed.ProcessGroup, got str"):
        cpattn.merge_partials(o, l, "x")
    with pytest.raises(TypeError, match="agree must be a bool, got int"):
        cpattn.merge_partials(o, l, None, agree=1)
    with pytest.raises(TypeError, match="group must be None or a torch.distributed.ProcessGroup, got str"):
        s.gather_packed([torch.zeros(m.num_physical_tokens, 2)], m, group="x")
    with pytest.raises(TypeError, match="group must be None or a torch.distributed.ProcessGroup, got str"):
        s.gather(torch.zeros(m.num_physical_tokens, 2), m, "x")
    with pytest.raises(TypeError, match="dim must be an int, got float"):
        cpattn.merge_states(torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4), dim=1.5)
    with pytest.raises(TypeError, match="dim must be an int, got bool"):
        cpattn.merge_states(torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4), dim=True)


# ----------------------------------------------------------------------------- strided caches
def _bits(x):
    return x.contiguous().view(torch.uint8).clone()


@pytest.mark.parametrize("layout", ["flat_rows", "paged_rows", "flashinfer", "swa_flashinfer"])
def test_write_kv_cache_strided_caches(layout):
    """Caches whose rows or pages are strided views are written exactly like contiguous ones."""
    g = torch.Generator().manual_seed(0)
    t, pages, ps, h = 9, 6, 4, 2
    k, v = torch.randn(t, h, 8, generator=g), torch.randn(t, h, 4, generator=g)
    slots = torch.randperm(pages * ps, generator=g)[:t]
    if layout == "flat_rows":  # v rows are a slice of wider rows
        kc = torch.randn(pages * ps, h, 8, generator=g)
        vc = torch.randn(pages * ps, h, 8, generator=g)[..., :4]
    elif layout == "paged_rows":
        kc = torch.randn(pages, ps, h, 8, generator=g)
        vc = torch.randn(pages, ps, h, 8, generator=g)[..., :4]
    else:  # FlashInfer: one [pages, 2, page, H, D] buffer, K = buf[:, 0], V = buf[:, 1]
        v = torch.randn(t, h, 8, generator=g)
        buf = torch.randn(pages, 2, ps, h, 8, generator=g)
        kc, vc = buf[:, 0], buf[:, 1]
    caches = [kc, vc]
    kw = {}
    if layout == "swa_flashinfer":
        swa = torch.randn(pages, 2, ps, h, 8, generator=g)
        kw = dict(swa_writes=torch.randperm(pages * ps, generator=g)[:t], swa_k_cache=swa[:, 0], swa_v_cache=swa[:, 1])
        caches += [kw["swa_k_cache"], kw["swa_v_cache"]]
    want = [c.clone() for c in caches]  # contiguous copies, written by a reference loop
    for (c, src), sl in zip(zip(want, [k, v] * 2), [slots, slots, kw.get("swa_writes"), kw.get("swa_writes")]):
        flat = c.view(-1, *c.shape[-2:])
        for row, slot in enumerate(sl.tolist()):
            flat[slot] = src[row]
    cpattn.write_kv_cache(k, v, kc, vc, slots, **kw)
    for i, (c, w) in enumerate(zip(caches, want)):
        assert torch.equal(_bits(c), _bits(w)), f"cache {i} differs from the reference scatter"
    if layout == "flashinfer":
        meta = cpattn.ZigzagStrategy(1).build_metadata([t], rank=0)
        plan = cpattn.plan_cache_writes(meta, slots, num_slots=pages * ps)
        cpattn.write_kv_cache(k * 2, v * 2, kc, vc, plan)  # the per-layer path (a write plan) too
        assert torch.equal(kc.reshape(-1, h, 8)[slots], k * 2) and torch.equal(vc.reshape(-1, h, 8)[slots], v * 2)


def test_write_kv_cache_rejects_an_overlapping_cache_before_any_write():
    """A cache whose slots alias each other (an expanded view) cannot take distinct rows: raise
    ValueError naming it before the first write, every cache bit-identical."""
    g = torch.Generator().manual_seed(1)
    t, n = 5, 16
    k, v = torch.randn(t, 2, 8, generator=g), torch.randn(t, 2, 8, generator=g)
    buf = torch.randn(n, 2, 2, 8, generator=g)
    kc, vc = buf[:, 0], buf[:, 1]
    swa_k = torch.randn(n, 2, 8, generator=g)
    swa_v = torch.randn(1, 2, 8, generator=g).expand(n, 2, 8)
    slots = torch.randperm(n, generator=g)[:t]
    before = [_bits(c) for c in (kc, vc, swa_k, swa_v)]
    with pytest.raises(ValueError, match="swa_v_cache .*overlap"):
        cpattn.write_kv_cache(k, v, kc, vc, slots, swa_writes=slots, swa_k_cache=swa_k, swa_v_cache=swa_v)
    for c, b in zip((kc, vc, swa_k, swa_v), before):
        assert torch.equal(_bits(c), b)


def test_write_mla_cache_strided_rows():
    g = torch.Generator().manual_seed(2)
    kv_c, k_pe = torch.randn(7, 12, generator=g), torch.randn(7, 4, generator=g)
    cache = torch.randn(5, 4, 20, generator=g)[..., :16]  # [pages, page, r + d_rope] of wider rows
    slots = torch.randperm(20, generator=g)[:7]
    want = cache.clone()
    want.view(-1, 16)[slots] = torch.cat([kv_c, k_pe], 1)
    cpattn.write_mla_cache(kv_c, k_pe, cache, slots)
    assert torch.equal(cache, want)
    a, b = cpattn.read_mla_cache(cache, slots, 12)
    assert torch.equal(a, kv_c) and torch.equal(b, k_pe)


# ----------------------------------------------------------------------------- torch reference backend
class _NewStorage:
    """Record the largest tensor storage the torch ops under it allocate (inputs' storages excluded)."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        rec = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                ins = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs or {}))
                       if isinstance(t, torch.Tensor)}
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in ins:
                        rec.largest = max(rec.largest, t.untyped_storage().nbytes())
                return out

        self.largest = 0
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


@pytest.mark.parametrize("kind", ["dense", "sparse", "index"])
def test_reference_reads_a_strided_paged_cache_without_copying_it(kind):
    """FlashInfer's [pages, 2, page, H, D] layout (k = buf[:, 0], v = buf[:, 1]): the torch
    reference gathers the rows it needs (no copy of the whole pool per segment), same results as
    contiguous caches."""
    g = torch.Generator().manual_seed(3)
    extend, prefix, ps, pages, hkv, d = [5, 3], [2, 4], 4, 512, 2, 8
    s = cpattn.ZigzagStrategy(2)
    m = s.build_metadata(extend, prefix, rank=0)
    buf = torch.randn(pages, 2, ps, hkv, d, generator=g)
    k, v = buf[:, 0], buf[:, 1]
    table = torch.randperm(pages, generator=g)[:4].view(2, 2).int()
    q = torch.randn(m.num_physical_tokens, 4, d, generator=g)
    pool_bytes = k.numel() * k.element_size()
    with _NewStorage() as rec:
        if kind == "dense":
            got = s.attention(q, k, v, m, page_table=table, backend="torch", return_lse=True)
        elif kind == "sparse":
            idx = torch.randint(0, 6, (m.num_physical_tokens, 3), generator=g, dtype=torch.int32)
            got = s.sparse_attention(q, k, v, m, idx, page_table=table, backend="torch", return_lse=True)
        else:
            ki = buf[:, 0, :, 0]  # [pages, page, D] index keys, strided pages
            qi, w = torch.randn(m.num_physical_tokens, 2, d, generator=g), torch.rand(m.num_physical_tokens, 2)
            got = (cpattn.dsa.index_topk(qi, ki, w, m, 3, page_table=table, backend="torch"),)
    assert rec.largest < pool_bytes // 8, f"allocated {rec.largest} bytes for a {pool_bytes}-byte pool"
    if kind == "dense":
        want = s.attention(q, k.contiguous(), v.contiguous(), m, page_table=table, backend="torch", return_lse=True)
    elif kind == "sparse":
        want = s.sparse_attention(q, k.contiguous(), v.contiguous(), m, idx, page_table=table, backend="torch",
                                  return_lse=True)
    else:
        want = (cpattn.dsa.index_topk(qi, ki.contiguous(), w, m, 3, page_table=table, backend="torch"),)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_reference_lse_is_float64_for_float64_inputs(setup):
    from oracle import attention_oracle

    s, m, _, _ = setup
    g = torch.Generator().manual_seed(4)
    q = torch.randn(8, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(10, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(10, 2, 8, generator=g, dtype=torch.float64)
    ref_o, ref_lse = attention_oracle(q, k, v, [5, 3], [2, 0])
    o, lse = s.attention(s.shard(q, m), k, v, m, backend="torch", return_lse=True)
    n, rows = m.num_local_tokens, m.local_token_indices
    assert lse.dtype == torch.float64
    torch.testing.assert_close(lse[:n], ref_lse[rows], atol=1e-12, rtol=0)
    torch.testing.assert_close(o[:n], ref_o[rows], atol=1e-12, rtol=0)
    o32, lse32 = s.attention(s.shard(q, m).float(), k.float(), v.float(), m, backend="torch", return_lse=True)
    assert lse32.dtype == torch.float32


# ----------------------------------------------------------------------------- examples
def test_hf_example_with_an_empty_sequence():
    import os
    import sys

    pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import hf_cp_prefill

    assert hf_cp_prefill.main(["--model", "llama", "--cp", "1", "--cpu", "--lens", "5,0,3"]) == 0
    with pytest.raises(SystemExit):  # no token at all: a usage error, not a crash in the model
        hf_cp_prefill.main(["--model", "llama", "--cp", "1", "--cpu", "--lens", "0,0"])
