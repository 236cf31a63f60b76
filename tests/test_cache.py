"""Paged-cache writes are all-or-nothing: every rejected call leaves every cache bit-identical.

``plan_cache_writes`` validates a forward's slot array (or page table) once (host, one sync);
``write_kv_cache`` / ``write_mla_cache`` take that :class:`cpattn.CacheWritePlan` (device-only)
or a raw slot tensor (validated on the spot, exactly one slot per row); ``read_mla_cache`` takes
a raw slot tensor (repeats allowed). Valid writes are compared with a reference scatter written
here as a Python loop over rows.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpattn
from cpattn import CacheWritePlan, plan_cache_writes

FP8 = torch.float8_e4m3fn


def _meta(t: int):
    """A single-process placement plan of one sequence of ``t`` new tokens (a replicated cache:
    its write plans take ``t`` source rows)."""
    return cpattn.ContiguousStrategy(1).build_metadata([t], rank=0)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8).clone()


def _random(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random bit patterns of any dtype (fp8 included) so a byte-level mistake cannot hide."""
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), generator=gen, dtype=torch.uint8)
    return raw.view(dtype)


def _kv_case(t: int = 341, num_slots: int = 400, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(t, 2, 4, generator=gen), torch.randn(t, 2, 3, generator=gen)
    k_cache = torch.randn(num_slots, 2, 4, generator=gen)  # junk everywhere: any write is visible
    v_cache = torch.randn(num_slots, 2, 3, generator=gen)
    slots = torch.randperm(num_slots, generator=gen)[:t]
    return k, v, k_cache, v_cache, slots


def _assert_rejected(exc, match, caches, fn, *args, **kwargs):
    """``fn`` raises ``exc`` matching ``match`` and writes nothing into any of ``caches``."""
    before = [_bits(c) for c in caches]
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)
    for i, (c, b) in enumerate(zip(caches, before)):
        assert torch.equal(_bits(c), b), f"cache {i} was modified by a rejected call"


# ------------------------------------------------------------------------------------- the bug
def test_out_of_range_slot_writes_nothing():
    """341 rows, last slot out of range: before, 340 rows were written, then torch's IndexError."""
    k, v, kc, vc, slots = _kv_case()
    slots[-1] = 400
    _assert_rejected(ValueError, r"slots\[340\] = 400 is out of range \[0, num_slots=400\)", [kc, vc],
                     cpattn.write_kv_cache, k, v, kc, vc, slots)
    slots[-1] = -1
    _assert_rejected(ValueError, r"slots\[340\] = -1 is out of range", [kc, vc], cpattn.write_kv_cache, k, v, kc, vc, slots)


def test_rank_local_rows_are_rejected():
    """Rank-local K (171 rows) with the batch's 341 slots: before, 171 rows were written silently."""
    k, v, kc, vc, slots = _kv_case()
    _assert_rejected(ValueError, r"slots has 341 entries but k has 171 rows", [kc, vc],
                     cpattn.write_kv_cache, k[:171], v[:171], kc, vc, slots)


def test_duplicate_slots_are_rejected():
    k, v, kc, vc, slots = _kv_case()
    slots[200] = slots[7]
    _assert_rejected(ValueError, rf"slots has duplicate entries: slot {int(slots[7])} at rows 7 and 200", [kc, vc],
                     cpattn.write_kv_cache, k, v, kc, vc, slots)


def test_mla_out_of_range_slot_writes_nothing():
    """10 latent rows, last slot out of range: before, 9 rows were written, then IndexError."""
    gen = torch.Generator().manual_seed(1)
    kv_c, k_pe = torch.randn(10, 6, generator=gen), torch.randn(10, 2, generator=gen)
    cache = torch.randn(3, 4, 8, generator=gen)  # paged [num_pages, page_size, r + d_rope]
    slots = torch.arange(10)
    slots[-1] = 12
    _assert_rejected(ValueError, r"slots\[9\] = 12 is out of range \[0, num_slots=12\)", [cache],
                     cpattn.write_mla_cache, kv_c, k_pe, cache, slots)
    slots[-1] = 3
    _assert_rejected(ValueError, "duplicate entries: slot 3 at rows 3 and 9", [cache],
                     cpattn.write_mla_cache, kv_c, k_pe, cache, slots)
    _assert_rejected(ValueError, "slots has 10 entries but kv_c has 4 rows", [cache],
                     cpattn.write_mla_cache, kv_c[:4], k_pe[:4], cache, torch.arange(10))


# ------------------------------------------------------------------------------------- every rejection
def _swa_case():
    k, v, kc, vc, slots = _kv_case(t=12, num_slots=20, seed=3)
    gen = torch.Generator().manual_seed(4)
    skc, svc = torch.randn(15, 2, 4, generator=gen), torch.randn(15, 2, 3, generator=gen)
    swa_slots = torch.randperm(15, generator=gen)[:12]
    return k, v, kc, vc, slots, skc, svc, swa_slots


META = torch.device("meta")  # a second device on a CPU-only machine


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (lambda a: a.update(writes=a["writes"].float()), TypeError, "slots must be int32 or int64"),
        (lambda a: a.update(writes=a["writes"].view(3, 4)), ValueError, "slots must be 1-D"),
        (lambda a: a.update(writes=a["writes"][:11]), ValueError, "slots has 11 entries but k has 12 rows"),
        (lambda a: a.update(writes=torch.cat([a["writes"], a["writes"][:1] + 0])), ValueError, "slots has 13 entries"),
        (lambda a: a.update(writes=a["writes"].to(META)), ValueError, "slots is on meta"),
        (lambda a: a.update(writes=[0] * 12), TypeError, "slots must be a torch.Tensor or a CacheWritePlan"),
        (lambda a: a.update(k=a["k"].half()), TypeError, "k_cache dtype torch.float32 != the rows' dtype torch.float16"),
        (lambda a: a.update(v=a["v"].to(META)), ValueError, "v_cache is on cpu but the rows are on meta"),
        (lambda a: a.update(k=a["k"][:, :1]), ValueError, "differ before the last dim"),
        (lambda a: a.update(v_cache=a["v_cache"][:19]), ValueError,
         r"v_cache \[19, 2, 3\] and k_cache \[20, 2, 4\] differ in pages / slots"),
        (lambda a: a.update(swa_writes=a["swa_writes"].clone().fill_(3)), ValueError, "swa_slots has duplicate"),
        (lambda a: a.update(swa_writes=a["swa_writes"] + 3), ValueError, r"swa_slots\[\d+\] = 1[5-7] is out of range \[0, num_slots=15\)"),
        (lambda a: a.update(swa_writes=a["swa_writes"][:5]), ValueError, "swa_slots has 5 entries but k has 12 rows"),
        (lambda a: a.update(swa_k_cache=a["swa_k_cache"].double()), TypeError, "swa_k_cache dtype"),
        (lambda a: a.update(swa_v_cache=None), ValueError, "given together"),
    ],
)
def test_write_kv_cache_rejections_leave_caches_identical(change, exc, match):
    k, v, kc, vc, slots, skc, svc, swa_slots = _swa_case()
    args = dict(k=k, v=v, k_cache=kc, v_cache=vc, writes=slots, swa_writes=swa_slots, swa_k_cache=skc, swa_v_cache=svc)
    change(args)
    _assert_rejected(exc, match, [kc, vc, skc, svc], cpattn.write_kv_cache, **args)


def test_slot_plan_checks_rows_and_cache_size():
    k, v, kc, vc, slots, skc, svc, swa_slots = _swa_case()
    meta = cpattn.ZigzagStrategy(2).build_metadata([7, 5], rank=1)  # T = 12 on every rank
    padded = torch.cat([slots, torch.tensor([-1, 10**6])])  # an engine's array padded past T
    plan = plan_cache_writes(meta, padded, num_slots=20)
    swa_plan = plan_cache_writes(meta, swa_slots, num_slots=15, name="swa_slots")
    assert isinstance(plan, CacheWritePlan) and (plan.num_source_rows, plan.num_writes, plan.num_slots) == (12, 12, 20)
    assert plan.rows is None and plan.slots.dtype == torch.int64 and torch.equal(plan.slots, slots)
    caches = [kc, vc, skc, svc]
    w = cpattn.write_kv_cache
    _assert_rejected(ValueError, "slots plans 12 source rows but k has 5 rows", caches, w, k[:5], v[:5], kc, vc, plan)
    _assert_rejected(ValueError, "slots was planned for num_slots=20 but k_cache has 21 slots", caches,
                     w, k, v, torch.zeros(21, 2, 4), torch.zeros(21, 2, 3), plan)
    _assert_rejected(ValueError, "swa_slots was planned for num_slots=15 but swa_k_cache has 20 slots", caches,
                     w, k, v, kc, vc, plan, swa_writes=swa_plan, swa_k_cache=kc, swa_v_cache=vc)
    # the plan path writes exactly what the raw path writes
    ref = [c.clone() for c in caches]
    w(k, v, ref[0], ref[1], slots, swa_writes=swa_slots, swa_k_cache=ref[2], swa_v_cache=ref[3])
    w(k, v, kc, vc, plan, swa_writes=swa_plan, swa_k_cache=skc, swa_v_cache=svc)
    for a, b in zip(caches, ref):
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        ((5, torch.arange(4)), dict(num_slots=10), ValueError, "slots has 4 entries, fewer than the 5 extend tokens"),
        ((3, torch.tensor([0, 10, 1])), dict(num_slots=10), ValueError,
         r"slots\[1\] = 10 is out of range \[0, num_slots=10\)"),
        ((3, torch.tensor([0, -3, 1])), dict(num_slots=10), ValueError, r"slots\[1\] = -3 is out of range"),
        ((3, torch.tensor([4, 1, 4])), dict(num_slots=10), ValueError, "duplicate entries: slot 4 at rows 0 and 2"),
        ((3, torch.arange(3.0)), dict(num_slots=10), TypeError, "slots must be int32 or int64"),
        ((3, torch.arange(3)), dict(num_slots=-1), ValueError, "num_slots must be >= 0"),
        ((3, torch.arange(3)), dict(num_slots=10.0), TypeError, "num_slots must be an int"),
        ((3, torch.arange(3)), {}, ValueError, "1-D slots need num_slots="),
        ((3, torch.arange(3)), dict(num_slots=10, page_size=2), ValueError, "page_size= / num_pages= are for a page"),
        ((3, torch.arange(3)), dict(num_slots=10, pad_slot=10), ValueError, r"pad_slot must be in \[0, num_slots=10\)"),
        ((3, torch.arange(3)), dict(num_slots=10, pad_slot=1), ValueError, "pad_slot=1 is also the slot of a written"),
        ((3, torch.arange(3)), dict(num_slots=10, name=1), TypeError, "name must be a str"),
        ((3, [0, 1, 2]), dict(num_slots=10), TypeError, "slots_or_page_table must be a 1-D slot tensor"),
        (("3", torch.arange(3)), dict(num_slots=10), TypeError, "meta must be a CPMetadata"),
        ((None, torch.arange(3)), dict(num_slots=10), TypeError, "meta must be a CPMetadata"),  # no bare row counts
        ((2, torch.arange(3).to(META)), dict(num_slots=10), ValueError, "slots is on meta: cache slots need"),
        ((3, torch.zeros(1, 2, dtype=torch.int32)), dict(page_size=2), ValueError, "a page table needs page_size= and"),
        ((3, torch.zeros(1, 2, dtype=torch.int32)), dict(page_size=2, num_pages=4, num_slots=8), ValueError,
         "num_slots= is for 1-D slots"),
        ((3, torch.tensor([[0]], dtype=torch.int32)), dict(page_size=2, num_pages=4), ValueError,
         "page_table does not cover sequence 0"),
        ((3, torch.tensor([[0, 4]], dtype=torch.int32)), dict(page_size=2, num_pages=4), ValueError,
         r"page_table\[0, 1\] = 4 is outside \[0, num_pages=4\)"),
        ((3, torch.zeros(1, 2)), dict(page_size=2, num_pages=4), TypeError, "page_table must be int32 or int64"),
        ((3, torch.zeros(2, 2, dtype=torch.int32)), dict(page_size=2, num_pages=4), ValueError,
         r"page_table must be \[B=1, max_pages\]"),
        ((3, torch.tensor([[1, 1]], dtype=torch.int32)), dict(page_size=2, num_pages=4), ValueError,
         "page_table maps two written rows to the same cache slot"),
    ],
)
def test_plan_cache_writes_bad_inputs(args, kwargs, exc, match):
    meta, table = args
    meta = _meta(meta) if isinstance(meta, int) else meta
    with pytest.raises(exc, match=match):
        plan_cache_writes(meta, table, **kwargs)


def test_plan_cache_writes_names_the_argument_and_reads_allow_repeats():
    with pytest.raises(ValueError, match=r"prefix_slots\[2\] = 99"):
        plan_cache_writes(_meta(3), torch.tensor([1, 2, 99]), num_slots=10, name="prefix_slots")
    with pytest.raises(ValueError, match="prefix_slots has duplicate entries: slot 5 at rows 0 and 2"):
        plan_cache_writes(_meta(4), torch.tensor([5, 6, 5, 6]), num_slots=10, name="prefix_slots")
    k, v = torch.zeros(4, 1, 2), torch.zeros(4, 1, 2)
    kc, vc = torch.randn(10, 1, 2), torch.randn(10, 1, 2)
    _assert_rejected(ValueError, "slots has duplicate entries: slot 5 at rows 0 and 2", [kc, vc],
                     cpattn.write_kv_cache, k, v, kc, vc, torch.tensor([5, 6, 5, 6]))  # a write may not repeat
    got_k, _ = cpattn.read_mla_cache(kc.view(10, 2), torch.tensor([5, 6, 5, 6]), 1)  # a read may (shared pages)
    assert torch.equal(got_k[:2], got_k[2:])
    empty = plan_cache_writes(_meta(0), torch.arange(0), num_slots=10)
    assert (empty.num_writes, empty.num_source_rows, empty.slots.numel()) == (0, 0, 0)  # nothing to write
    cpattn.write_kv_cache(k[:0], v[:0], kc, vc, empty)


def test_cache_write_plan_fields():
    """What the removed ``SlotPlan.__post_init__`` enforced, through ``plan_cache_writes``: the
    plan's slots are an int64 index (from int32 input too) with one entry per written row, and its
    row counts match; a static plan pads its index to the capacity rows at a fixed address."""
    meta = _meta(3)
    plan = plan_cache_writes(meta, torch.tensor([4, 0, 2, 9], dtype=torch.int32), num_slots=5 * 2)
    assert plan.slots.dtype == torch.int64 and plan.slots.tolist() == [4, 0, 2]  # entries past T dropped
    assert (plan.num_writes, plan.num_source_rows, plan.num_slots, plan.rows) == (3, 3, 10, None)
    assert plan.name == "slots" and plan.pad_slot is None and plan.device == torch.device("cpu")
    planner = cpattn.StaticPlanner(cpattn.ContiguousStrategy(1), max_tokens=8, max_seqs=2, max_kv_tokens=16,
                                   device="cpu")
    static = plan_cache_writes(planner.plan([3], rank=0), torch.tensor([4, 0, 2]), num_slots=10)
    assert static.slots.dtype == torch.int64 and static.slots.tolist() == [4, 0, 2, 2, 2, 2, 2, 2]
    assert (static.num_writes, static.num_source_rows) == (3, 8)
    again = plan_cache_writes(planner.plan([1, 2], rank=0), torch.tensor([7, 1, 3]), num_slots=10, pad_slot=9)
    assert again.slots.data_ptr() == static.slots.data_ptr() and again.slots.tolist() == [7, 1, 3] + [9] * 5


def test_mla_rejections_leave_cache_identical():
    gen = torch.Generator().manual_seed(5)
    kv_c, k_pe = torch.randn(4, 6, generator=gen), torch.randn(4, 2, generator=gen)
    cache, slots = torch.randn(10, 8, generator=gen), torch.tensor([9, 0, 4, 5])
    w = cpattn.write_mla_cache
    for exc, match, args in [
        (ValueError, "kv_c must be 2-D", (kv_c[0], k_pe, cache, slots)),
        (ValueError, "k_pe has 3", (kv_c, k_pe[:3], cache, slots)),
        (ValueError, "slots has 3 entries but kv_c has 4 rows", (kv_c, k_pe, cache, slots[:3])),
        (TypeError, "slots must be int32 or int64", (kv_c, k_pe, cache, slots.double())),
        (ValueError, r"cache rows are \[8\], expected \[9\]", (kv_c, torch.zeros(4, 3), cache, slots)),
        (TypeError, "cache dtype", (kv_c.half(), k_pe.half(), cache, slots)),
        (ValueError, "kv_c is on meta but k_pe on cpu", (kv_c.to(META), k_pe, cache, slots)),
        (ValueError, "slots is on meta: cache slots need their values", (kv_c, k_pe, cache, slots.to(META))),
        (ValueError, "slots plans 5 source rows but kv_c has 4",
         (kv_c, k_pe, cache, plan_cache_writes(_meta(5), torch.arange(5), num_slots=10))),
        (ValueError, "planned for num_slots=11 but cache has 10",
         (kv_c, k_pe, cache, plan_cache_writes(_meta(4), slots, num_slots=11))),
    ]:
        _assert_rejected(exc, match, [cache], w, *args)
    r = cpattn.read_mla_cache
    with pytest.raises(ValueError, match=r"slots\[1\] = 10 is out of range"):
        r(cache, torch.tensor([0, 10]), 6)
    with pytest.raises(TypeError, match="slots must be a torch.Tensor"):  # reads take raw slots, no plans
        r(cache, plan_cache_writes(_meta(4), slots, num_slots=10), 6)
    got_c, _ = r(cache, torch.tensor([3, 3]), 6)  # a read may repeat a slot (shared prefix pages)
    assert torch.equal(got_c[0], got_c[1])


# ------------------------------------------------------------------------------------- property
@st.composite
def writes(draw):
    t = draw(st.one_of(st.integers(0, 2), st.integers(0, 40)))
    page_size = draw(st.sampled_from([1, 4, 8]))
    num_pages = draw(st.integers(max(1, -(-t // page_size)), -(-t // page_size) + 4))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, FP8]))
    return t, page_size, num_pages, dtype, draw(st.integers(0, 2**16)), draw(st.integers(0, 6))


@settings(max_examples=60, deadline=None)
@given(case=writes())
def test_valid_writes_equal_a_reference_scatter(case):
    t, page_size, num_pages, dtype, seed, extra = case
    num_slots = num_pages * page_size
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=gen)[:t]
    slots = slots.to(torch.int32) if seed % 2 else slots
    k, v = _random(gen, (t, 2, 3), dtype), _random(gen, (t, 2, 5), dtype)
    kc = _random(gen, (num_pages, page_size, 2, 3), dtype)  # paged layout (the plan's write)
    vc = _random(gen, (num_pages, page_size, 2, 5), dtype)
    ref_k, ref_v = _bits(kc).view(num_slots, -1), _bits(vc).view(num_slots, -1)
    for row in range(t):  # the reference scatter: one row at a time
        ref_k[int(slots[row])] = _bits(k[row]).flatten()
        ref_v[int(slots[row])] = _bits(v[row]).flatten()
    got = [kc.clone().view(num_slots, 2, 3), vc.clone().view(num_slots, 2, 5)]  # flat layout (the raw write)
    cpattn.write_kv_cache(k, v, got[0], got[1], slots)  # raw slots: exactly T entries
    padded = torch.cat([slots, torch.full((extra,), -5, dtype=slots.dtype)])  # garbage past T is ignored
    plan = plan_cache_writes(_meta(t), padded, num_slots=num_slots)
    cpattn.write_kv_cache(k, v, kc, vc, plan)
    for a in (got[0], kc):
        assert torch.equal(_bits(a).view(num_slots, -1), ref_k)
    for a in (got[1], vc):
        assert torch.equal(_bits(a).view(num_slots, -1), ref_v)

    # MLA latent into a typed cache and into a raw-byte cache (fp8/bf16 mixed)
    kv_c, k_pe = _random(gen, (t, 6), dtype), _random(gen, (t, 2), dtype)
    cache = _random(gen, (num_pages, page_size, 8), dtype)
    ref = _bits(cache).view(num_slots, -1)
    for row in range(t):
        ref[int(slots[row])] = torch.cat([_bits(kv_c[row]), _bits(k_pe[row])])
    assert cpattn.write_mla_cache(kv_c, k_pe, cache, plan) is cache
    assert torch.equal(_bits(cache).view(num_slots, -1), ref)
    if t:
        got_c, got_pe = cpattn.read_mla_cache(cache, slots, 6)
        assert torch.equal(_bits(got_c), _bits(kv_c)) and torch.equal(_bits(got_pe), _bits(k_pe))
