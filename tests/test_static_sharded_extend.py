"""pass-KV and pass-Q (an extend over a sharded KV cache) from :class:`cpattn.StaticPlanner` plans.

Over gloo with 2 and 3 spawned ranks, one planner per rank and one plan per batch of a hypothesis
list of ragged batches (lengths 0, 1, below 2C, prefixes of any length): ``plan.run`` equals an
fp64 explicit-mask oracle, pad rows are 0, every rank's cache holds exactly its positions, every
device table a layer reads keeps its address from batch to batch, and each layer runs exactly
its algorithm's collectives (pass-KV: one all-gather; pass-Q: one all-gather and one
all-to-all). Graph replay is emulated on the CPU with the Triton interpreter: the FIRST batch's
plan object, run after later batches were planned into the same buffers, gives bit for bit what
a fresh plan of that batch gives (it reads nothing but device tables; C = 1 in process, C = 2
and 3 over gloo). Plan-time errors of static plans are checked too.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cpattn
from cpattn.metadata import DEVICE_FIELDS
from dist_utils import CountCollectives, run_distributed
from test_sharded_distributed import CountAllToAll, _explicit_oracle, _owned, _starts

HQ, HKV, D, PS = 4, 2, 16, 4
CAP = dict(max_tokens=48, max_seqs=4, max_kv_tokens=160)
NUM_PAGES = CAP["max_kv_tokens"] // PS + CAP["max_seqs"] + 2  # page 0: the pad slot's page
WIDTH = CAP["max_kv_tokens"] // PS + 1  # the page table's fixed width
LAYERS = 2


def _layer_data(ext, pre, layer, seed):
    """The logical K / V (packed per sequence of prefix + extend keys) and Q of one layer of a
    batch: the same on every rank."""
    g = torch.Generator().manual_seed(seed * 100 + layer)
    kv_lens = [e + p for e, p in zip(ext, pre)]
    keys = torch.randn(sum(kv_lens), HKV, D, generator=g)
    vals = torch.randn(sum(kv_lens), HKV, D, generator=g)
    q = torch.randn(sum(ext), HQ, D, generator=g)
    return keys, vals, q


def _rank_cache(keys, vals, kv_lens, pre, c, inter, r, seed):
    """This rank's NaN-filled cache of NUM_PAGES pages holding its prefix positions, pages
    shuffled (page 0 never used: the pad slot's), and its page table [max_seqs, WIDTH]."""
    g = torch.Generator().manual_seed(seed)
    kc = torch.full((NUM_PAGES, PS, HKV, D), float("nan"))
    vc = torch.full((NUM_PAGES, PS, HKV, D), float("nan"))
    table = torch.zeros(CAP["max_seqs"], WIDTH, dtype=torch.int32)
    perm = torch.randperm(NUM_PAGES - 1, generator=g) + 1
    used = 0
    for b, (n, p) in enumerate(zip(kv_lens, pre)):
        pages = -(-len(_owned(n, c, inter, r)) // PS)
        table[b, :pages] = perm[used : used + pages].int()
        used += pages
        for j, pos in enumerate(_owned(p, c, inter, r)):
            kc[table[b, j // PS], j % PS] = keys[_starts(kv_lens)[b] + pos]
            vc[table[b, j // PS], j % PS] = vals[_starts(kv_lens)[b] + pos]
    return kc, vc, table


def _cache_exact(kc, vc, table, keys, vals, kv_lens, c, inter, r):
    """Does the cache hold exactly this rank's positions (prefix + extend), and NaN elsewhere
    (page 0, the pad slot's page, excepted)?"""
    written = torch.zeros(NUM_PAGES * PS, dtype=torch.bool)
    written[:PS] = True
    exact = True
    for b, n in enumerate(kv_lens):
        for j, pos in enumerate(_owned(n, c, inter, r)):
            slot = int(table[b, j // PS]) * PS + j % PS
            exact &= torch.equal(kc.view(-1, HKV, D)[slot], keys[_starts(kv_lens)[b] + pos])
            exact &= torch.equal(vc.view(-1, HKV, D)[slot], vals[_starts(kv_lens)[b] + pos])
            written[slot] = True
    stray = (~kc.view(-1, HKV * D)[~written].isnan()).any(dim=1).sum() + \
        (~vc.view(-1, HKV * D)[~written].isnan()).any(dim=1).sum()
    return bool(exact) and int(stray) == 0


#: a static plan's informational views of the batch's real local rows (empty for an empty batch:
#: no address); kernels read the capacity-sized fields
_VIEWS = ("local_token_indices", "local_positions", "local_seq_ids")


def _addresses(plan) -> dict[str, int]:
    """Data pointers of every device table a layer of ``plan`` reads."""
    out = {f"table/{k}": t.data_ptr() for k, t in plan.tables.items()}
    for owner, meta in (("meta", plan.meta), ("inner", plan.attention.meta)):
        out.update((f"{owner}/{f}", getattr(meta, f).data_ptr()) for f in DEVICE_FIELDS if f not in _VIEWS)
    return out


def _local_rows(s, meta, dyn, x):
    """``strategy.shard`` of logical rows ``x`` into the static plan's P rows (pad rows 0)."""
    out = x.new_zeros((meta.num_physical_tokens, *x.shape[1:]))
    rows = s.shard(x, dyn)
    out[: rows.shape[0]] = rows
    return out


def _worker(rank, world, case, batches, backend):
    """Every batch through one static planner per (strategy, algorithm); see the module docstring."""
    name, inter, window, use_sinks = case
    group = torch.distributed.group.WORLD if world > 1 else None
    s = cpattn.get_strategy(name, world, pad_multiple=4)
    sh = cpattn.KVSharding(world, interleave=inter)
    spec = cpattn.AttentionSpec(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=torch.float32,
                                window_size=(window, 0), page_size=PS, has_sinks=use_sinks)
    sinks = torch.randn(HQ, generator=torch.Generator().manual_seed(9)) if use_sinks else None
    results = {}
    for algo in ("pass_kv", "pass_q"):
        planner = cpattn.StaticPlanner(s, device="cpu", kv=sh, **CAP)
        first = None
        for i, (ext, pre) in enumerate(batches):
            kv_lens = [e + p for e, p in zip(ext, pre)]
            meta = planner.plan(ext, pre, rank=rank, group=group)
            data = [_layer_data(ext, pre, layer, i) for layer in range(LAYERS)]
            caches = [_rank_cache(k, v, kv_lens, pre, world, inter, rank, 7 * i + rank) for k, v, _ in data]
            table = caches[0][2]  # the same pages in every layer
            plan = cpattn.plan_attention(meta, spec, algorithm=algo, backend=backend, page_table=table,
                                         num_pages=NUM_PAGES, pad_slot=0)
            key = f"{algo}/batch{i}"
            addresses = _addresses(plan)
            if first is None:
                first = (plan, addresses)
            results[key + "/same_addresses"] = addresses == first[1]
            dyn = s.build_metadata(ext, pre, rank=rank, kv=sh)
            errs, counts, pads, exact, replay = [], [], True, True, True
            for layer, ((keys, vals, q), (kc, vc, _)) in enumerate(zip(data, caches)):
                ql = _local_rows(s, meta, dyn, q)
                kl = _local_rows(s, meta, dyn, keys[dyn.kv_extend_index])
                vl = _local_rows(s, meta, dyn, vals[dyn.kv_extend_index])
                if backend == "triton":  # the first batch's plan, as a captured graph would run it
                    stale_k, stale_v = kc.clone(), vc.clone()
                    stale = first[0].run(ql, kl, vl, (stale_k, stale_v), group=group, sinks=sinks)
                with CountCollectives() as ag, CountAllToAll() as a2a:
                    out = plan.run(ql, kl, vl, (kc, vc), group=group, sinks=sinks)
                    counts.append((sum(len(c) != 1 for c in ag.calls), len(a2a.calls)))
                if backend == "triton":
                    replay &= torch.equal(stale, out) and torch.equal(stale_k.view(torch.int32), kc.view(torch.int32)) \
                        and torch.equal(stale_v.view(torch.int32), vc.view(torch.int32))
                ref = _explicit_oracle(q, keys, vals, kv_lens, ext, window, sinks)
                n = dyn.num_local_tokens
                if n:
                    errs.append((out[:n].double() - ref[dyn.local_token_indices]).abs().max().item())
                pads &= bool((out[n:] == 0).all())
                exact &= _cache_exact(kc, vc, table, keys, vals, kv_lens, world, inter, rank)
            results[key + "/err"] = max(errs, default=0.0)
            results[key + "/pad_zero"] = pads
            results[key + "/cache_exact"] = exact
            results[key + "/collectives"] = counts
            results[key + "/replay_equal"] = replay
    return results


def _check(results, num_batches, replay=False):
    for rank, res in enumerate(results):
        for algo in ("pass_kv", "pass_q"):
            for i in range(num_batches):
                key = f"{algo}/batch{i}"
                assert res[key + "/err"] < 2e-5, (rank, key, res[key + "/err"])
                assert res[key + "/pad_zero"] and res[key + "/cache_exact"], (rank, key)
                assert res[key + "/same_addresses"], (rank, key)
                # pass-KV: ONE all-gather; pass-Q: ONE all-gather + ONE all-to-all (none at C = 1)
                expect = ((1, 0) if algo == "pass_kv" else (1, 1)) if len(results) > 1 else (0, 0)
                assert res[key + "/collectives"] == [expect] * LAYERS, (rank, key, res[key + "/collectives"])
                if replay:
                    assert res[key + "/replay_equal"], (rank, key)


def _batches(world):
    """Lists of 3 ragged batches within the capacity: extend lengths 0, 1, below 2C or up to 12;
    prefixes 0, 1 or up to 24."""
    ext = st.one_of(st.sampled_from([0, 1]), st.integers(0, 2 * world - 1), st.integers(0, 12))
    pre = st.one_of(st.sampled_from([0, 1]), st.integers(0, 24))
    batch = st.integers(1, CAP["max_seqs"]).flatmap(
        lambda b: st.tuples(st.lists(ext, min_size=b, max_size=b), st.lists(pre, min_size=b, max_size=b)))
    return st.lists(batch, min_size=3, max_size=3)


CASES = [("zigzag", 1, -1, False), ("interleave", 2, 5, True), ("contiguous", 4, -1, True)]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_static_pass_kv_pass_q_over_gloo(world, data):
    """Static pass-KV / pass-Q plans over gloo on hypothesis batches (torch backend): oracle,
    pad rows, exact caches, fixed addresses, collectives per layer."""
    batches = data.draw(_batches(world))
    case = data.draw(st.sampled_from(CASES))
    _check(run_distributed(_worker, world, case, batches, "torch", pg_timeout=120), len(batches))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_static_pass_kv_pass_q_replay_over_gloo(interp, world):
    """C = 2 and 3, Triton interpreter: the first batch's plan object, run for later batches
    planned into the same buffers (what a captured graph does), equals the fresh plan bit for bit."""
    batches = [([5, 0, 3], [7, 2, 0]), ([1], [30]), ([9, 1, 0, 2], [0, 3, 11, 1])]
    _check(run_distributed(_worker, world, ("zigzag", 2, -1, True), batches, "triton", pg_timeout=300,
                           timeout=900), len(batches), replay=True)


def test_static_pass_kv_pass_q_replay_single_rank(interp):
    """C = 1, Triton interpreter, in process: oracle, fixed addresses and the stale-plan replay."""
    batches = [([5, 0, 3], [7, 2, 0]), ([1], [30]), ([0, 0], [0, 4]), ([20, 1, 1, 9], [3, 0, 11, 2])]
    _check([_worker(0, 1, ("zigzag", 1, 6, True), batches, "triton")], len(batches), replay=True)


def test_static_plan_errors():
    """A static pass-KV / pass-Q plan names its algorithm and a pad slot; plan_attention says so
    before anything is planned into the buffers."""
    s, sh = cpattn.get_strategy("zigzag", 1), cpattn.KVSharding(1)
    planner = cpattn.StaticPlanner(s, device="cpu", kv=sh, **CAP)
    meta = planner.plan([3, 1], [2, 0], rank=0)
    spec = cpattn.AttentionSpec(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=torch.float32, page_size=PS)
    table = torch.zeros(CAP["max_seqs"], WIDTH, dtype=torch.int32)
    table[0, :2], table[1, 0] = torch.tensor([1, 2]), 3
    with pytest.raises(ValueError, match="replays one algorithm: pass algorithm='pass_kv' or 'pass_q'"):
        cpattn.plan_attention(meta, spec, page_table=table, num_pages=NUM_PAGES, pad_slot=0)
    for algo in ("pass_kv", "pass_q"):
        with pytest.raises(ValueError, match="pass pad_slot"):
            cpattn.plan_attention(meta, spec, algorithm=algo, page_table=table, num_pages=NUM_PAGES)
    with pytest.raises(ValueError, match=r"page_table= / num_pages= are for an extend over a sharded cache \(pad_slot= too\)"):
        cpattn.plan_attention(cpattn.get_strategy("zigzag", 1).build_metadata([2], rank=0), spec, pad_slot=0)
