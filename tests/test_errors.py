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
