"""cpattn.padding: the CP padding rules, property-tested (single process, CPU).

Expected values are computed here in plain Python from the rules (ceil to a multiple, lcm,
subtraction of logical lengths); each test names the seed bug it rules out (docs/design.md).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpattn
from cpattn import padding

NAMES = ["zigzag", "interleave", "contiguous"]
counts_lists = st.lists(st.integers(0, 5000), min_size=1, max_size=16)
aligns = st.integers(1, 128)


@st.composite
def batches(draw, max_seqs: int = 6, max_len: int = 200):
    """Ragged batches with the interesting lengths (0, 1, < 2C) and prefixes."""
    cp_size = draw(st.integers(1, 8))
    n = draw(st.integers(0, max_seqs))
    small = st.integers(0, 2 * cp_size)
    extend = draw(st.lists(st.one_of(small, st.integers(0, max_len)), min_size=n, max_size=n))
    prefix = draw(st.lists(st.one_of(st.just(0), st.integers(0, 50)), min_size=n, max_size=n))
    return cp_size, extend, prefix


def _ceil_to(n: int, a: int) -> int:
    return ((n + a - 1) // a) * a


# ---------------------------------------------------------------------------------- physical_rows
@settings(max_examples=300, deadline=None)
@given(counts=counts_lists, align=aligns)
def test_physical_rows_is_smallest_aligned_cover(counts, align):
    p = padding.physical_rows(counts, align)
    assert type(p) is int
    assert p == _ceil_to(max(counts), align)
    assert p % align == 0 and p >= max(counts) and p - max(counts) < align
    assert padding.physical_rows(torch.tensor(counts), align) == p  # tensor and list agree
    assert padding.physical_rows(torch.tensor(counts, dtype=torch.int32), align) == p
    # Padding is applied once: the padded rows are already a fixed point (padding twice adds nothing).
    assert padding.physical_rows([p] * len(counts), align) == p


@given(c=st.integers(1, 16), align=aligns)
def test_physical_rows_zero_tokens_is_zero_rows(c, align):
    """No tokens -> no rows on any rank: no dummy pad row (the 'padding when CP was off' bug)."""
    assert padding.physical_rows([0] * c, align) == 0


@given(counts=counts_lists)
def test_physical_rows_align_one_is_exact(counts):
    """align 1 pads nothing beyond the largest rank; one rank (CP off) holds exactly T rows."""
    assert padding.physical_rows(counts, 1) == max(counts)
    assert padding.physical_rows([sum(counts)], 1) == sum(counts)


@settings(max_examples=150, deadline=None)
@given(batch=batches(), pad=st.sampled_from([1, 2, 3, 8, 64]), name=st.sampled_from(NAMES))
def test_physical_rows_matches_the_plan(batch, pad, name):
    """The plan's P is physical_rows of its LOGICAL per-rank counts (engine padding never enters)."""
    cp_size, extend, prefix = batch
    meta = cpattn.get_strategy(name, cp_size, pad_multiple=pad).build_metadata(extend, prefix, rank=0)
    assert sum(meta.num_local_tokens_per_rank) == sum(extend)  # logical: no pad token among them
    assert meta.num_physical_tokens == padding.physical_rows(meta.num_local_tokens_per_rank, pad)
    if cp_size == 1 and pad == 1:
        assert meta.num_physical_tokens == sum(extend)  # CP off: not one dummy row


@pytest.mark.parametrize(
    "counts, align, exc, match",
    [
        ([3, -1], 8, ValueError, r"logical_counts_per_rank must be >= 0"),
        ([], 8, ValueError, "at least one"),
        ([3, 1.5], 8, TypeError, "must hold integers"),
        ([3, True], 8, TypeError, "must hold integers"),
        (torch.tensor([1.0, 2.0]), 8, TypeError, "must hold integers"),
        (torch.zeros(2, 2, dtype=torch.int64), 8, ValueError, "must be 1-D"),
        ("12", 8, TypeError, "logical_counts_per_rank must be a list"),
        ([3], 0, ValueError, "align must be >= 1"),
        ([3], 8.0, TypeError, "align must be an int"),
        ([3], True, TypeError, "align must be an int"),
    ],
)
def test_physical_rows_bad_inputs(counts, align, exc, match):
    with pytest.raises(exc, match=match):
        padding.physical_rows(counts, align)


# ---------------------------------------------------------------------------------- combined_alignment
@given(a=st.integers(1, 200), b=st.integers(1, 200))
def test_combined_alignment_is_lcm(a, b):
    m = padding.combined_alignment(a, b)
    assert m % a == 0 and m % b == 0
    assert all(k % a or k % b for k in range(1, m))  # the smallest common multiple
    assert m == padding.combined_alignment(b, a) == a * b // math.gcd(a, b)


@settings(max_examples=200, deadline=None)
@given(counts=counts_lists, cp_align=st.integers(1, 64), engine_align=st.integers(1, 64))
def test_pad_once_to_combined_alignment(counts, cp_align, engine_align):
    """Padding applied twice (engine padding, then CP padding on top) is replaced by padding once:
    the result satisfies both alignments and is the smallest such cover of the logical rows."""
    m = padding.combined_alignment(cp_align, engine_align)
    once = padding.physical_rows(counts, m)
    assert once % cp_align == 0 and once % engine_align == 0
    assert once >= max(counts) and once - max(counts) < m
    twice = _ceil_to(_ceil_to(max(counts), engine_align), cp_align)  # the bug: two rounds
    assert once <= twice or twice % engine_align != 0  # twice pads more, or breaks the engine alignment


@pytest.mark.parametrize("a, b, exc, match", [(0, 4, ValueError, "cp_align"), (4, 0, ValueError, "engine_align"),
                                              (4, 2.0, TypeError, "engine_align")])
def test_combined_alignment_bad_inputs(a, b, exc, match):
    with pytest.raises(exc, match=match):
        padding.combined_alignment(a, b)


# ---------------------------------------------------------------------------------- pad / unpad
@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), min_size=1, max_size=3),
    extra=st.integers(0, 9),
    dim_choice=st.integers(0, 2),
    negative=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool]),
)
def test_pad_unpad_round_trip(shape, extra, dim_choice, negative, dtype):
    dim = dim_choice % len(shape)
    gen = torch.Generator().manual_seed(sum(shape) + extra)
    x = torch.randint(0, 200, shape, generator=gen).to(dtype)
    n = shape[dim]
    rows = n + extra
    d = dim - len(shape) if negative else dim
    padded = padding.pad_rows(x, rows, dim=d)
    assert padded.shape[dim] == rows and padded.dtype == dtype
    assert torch.equal(padded.narrow(dim, 0, n), x)
    assert not padded.narrow(dim, n, extra).any()  # pad rows are zero
    if extra == 0:
        assert padded is x  # nothing to pad: no copy, no dummy row
    back = padding.unpad_rows(padded, n, dim=d)
    assert torch.equal(back, x) and back.shape == x.shape


def test_pad_unpad_bad_inputs():
    x = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="cannot pad down"):
        padding.pad_rows(x, 3)
    with pytest.raises(ValueError, match="rows=5 exceeds the 4 rows"):
        padding.unpad_rows(x, 5)
    with pytest.raises(ValueError, match="rows must be >= 0"):
        padding.pad_rows(x, -1)
    with pytest.raises(ValueError, match="dim=2 out of range"):
        padding.pad_rows(x, 8, dim=2)
    with pytest.raises(ValueError, match="dim=-3 out of range"):
        padding.unpad_rows(x, 2, dim=-3)
    with pytest.raises(ValueError, match="out of range"):
        padding.pad_rows(torch.tensor(1.0), 2)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        padding.pad_rows([1, 2], 4)
    with pytest.raises(TypeError, match="dim must be an int"):
        padding.unpad_rows(x, 2, dim=0.0)


# ---------------------------------------------------------------------------------- prefix / key length
@given(batch=batches())
def test_prefix_lens_from_logical_lengths(batch):
    _, extend, prefix = batch
    kv = [p + e for p, e in zip(prefix, extend)]
    got = padding.prefix_lens(kv, extend)
    assert got.dtype == torch.int64 and got.tolist() == prefix
    assert padding.prefix_lens(torch.tensor(kv, dtype=torch.int32), torch.tensor(extend, dtype=torch.int64)).tolist() == prefix


def test_prefix_lens_rejects_padded_counts():
    """The seed bug: seq_lens 3671 with an extend count padded to 3672 gave a prefix of -1."""
    with pytest.raises(ValueError, match=r"extend_lens\[1\]=3672 > kv_lens\[1\]=3671 \(prefix -1\).*not padded"):
        padding.prefix_lens([10, 3671], [4, 3672])
    with pytest.raises(ValueError, match="same size"):
        padding.prefix_lens([3], [1, 2])
    with pytest.raises(ValueError, match="kv_lens must be >= 0"):
        padding.prefix_lens([-1], [0])


@settings(max_examples=100, deadline=None)
@given(batch=batches(), name=st.sampled_from(NAMES))
def test_max_key_len_is_logical(batch, name):
    """The key length comes from logical lengths: the same for every pad_multiple (no pad delta)."""
    cp_size, extend, prefix = batch
    expected = max((p + e for p, e in zip(prefix, extend)), default=0)
    assert padding.max_key_len(extend, prefix) == expected
    assert padding.max_key_len(extend) == max(extend, default=0)
    for pad in (1, 8, 64):
        meta = cpattn.get_strategy(name, cp_size, pad_multiple=pad).build_metadata(extend, prefix, rank=0)
        assert meta.max_kv_len == expected


def test_max_key_len_bad_inputs():
    with pytest.raises(ValueError, match="same size"):
        padding.max_key_len([1, 2], [0])
    with pytest.raises(ValueError, match="prefix_lens must be >= 0"):
        padding.max_key_len([1], [-3])
