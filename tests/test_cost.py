"""The cost model and the per-batch placement choice: rates and their JSON, the loads it prices,
the choice being the minimum of its own estimates, identical on every rank, and exact whichever
placement it picks (fp64 oracle on gloo ranks)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpattn
from cpattn.calibrate import fit_rate, main as calibrate_main
from dist_utils import run_distributed
from oracle import TOLERANCE, attention_oracle

SPEC = cpattn.AttentionSpec(num_q_heads=8, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)


@st.composite
def batches(draw):
    """(C, extend_lens, prefix_lens): ragged, lengths 0, 1, < 2C, and cached prefixes."""
    c = draw(st.integers(1, 4))
    n = draw(st.integers(0, 5))
    small = st.integers(0, 2 * c + 1)
    ext = draw(st.lists(st.one_of(small, st.integers(0, 300)), min_size=n, max_size=n))
    pre = draw(st.lists(st.one_of(st.just(0), small, st.integers(0, 5000)), min_size=n, max_size=n))
    return c, ext, pre


# ----------------------------------------------------------------------------- the model
def test_rates_are_validated_and_round_trip_through_json(tmp_path):
    model = cpattn.CostModel(link_bytes_per_s=1e11, launch_overhead_s=5e-6)
    path = tmp_path / "cost.json"
    model.save(str(path), {"device": "test"})
    doc = json.loads(path.read_text())
    assert doc["calibration"] == {"device": "test"} and doc["cost_model"]["link_bytes_per_s"] == 1e11
    assert cpattn.CostModel.load(str(path)) == model
    for name in model.to_dict():
        for bad in (0, -1.0, float("nan"), float("inf"), True, "1"):
            with pytest.raises(ValueError, match=name):
                cpattn.CostModel(**{name: bad})
    with pytest.raises(ValueError, match="unknown cost model field.*'link_gbps'"):
        cpattn.CostModel.from_dict({"link_gbps": 3})
    (tmp_path / "bad.json").write_text('{"rates": {}}')
    with pytest.raises(ValueError, match="no 'cost_model' object"):
        cpattn.CostModel.load(str(tmp_path / "bad.json"))
    with pytest.raises(TypeError, match="path"):
        cpattn.CostModel.load(3)


def test_fit_rate_recovers_a_line_and_never_returns_a_negative_rate():
    work = [1e9, 4e9, 16e9]
    rate, a = fit_rate(work, [2e-5 + w / 5e11 for w in work])
    assert rate == pytest.approx(5e11, rel=1e-9) and a == pytest.approx(2e-5, rel=1e-6)
    rate, a = fit_rate(work, [3e-3, 2e-3, 1e-3])  # a falling line (noise): the best observed rate
    assert rate == pytest.approx(16e9 / 1e-3) and a == pytest.approx(1e-3)
    with pytest.raises(ValueError, match=">= 2"):
        fit_rate([1.0], [1.0])


def test_calibrate_smoke_writes_a_loadable_model(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert calibrate_main(["--smoke", "--out", str(out), "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]) == 0
    doc = json.loads(out.read_text())
    assert doc["calibration"]["smoke"] is True and doc["calibration"]["link"]["measured"] is False
    model = cpattn.CostModel.load(str(out))
    assert model.link_bytes_per_s == cpattn.CostModel().link_bytes_per_s  # assumed on one process
    assert "smoke run: not a calibration" in capsys.readouterr().out


# ----------------------------------------------------------------------------- loads
@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from([None, 1, 3, 64]))
def test_rank_loads_equal_the_plans_and_an_explicit_count(batch, cap):
    c, ext, pre = batch
    for name in cpattn.STRATEGIES:
        s = cpattn.get_strategy(name, c)
        rows, pairs = s.rank_loads(ext, pre, keys_cap=cap)
        assert rows.shape == (c,) and pairs.shape == (c,)
        for r in range(c):
            m = s.build_metadata(ext, pre, rank=r)
            assert rows[r] == m.num_local_tokens
            seen = [min(int(p) + 1, cap or 1 << 62) for p in m.local_positions.tolist()]
            assert pairs[r] == sum(seen)
            if cap is None:
                assert pairs[r] == m.causal_work_per_rank[r]


# ----------------------------------------------------------------------------- the choice
@settings(max_examples=80, deadline=None)
@given(batches(), st.booleans(), st.permutations(["zigzag", "interleave", "replicated"]),
       st.sampled_from([0.0, 1e6, 1e9]), st.floats(1e8, 1e13))
def test_the_choice_is_the_first_minimum_of_its_estimates(batch, sharded, order, token_flops, link):
    c, ext, pre = batch
    kv = cpattn.KVSharding(c) if sharded else None
    model = cpattn.CostModel(link_bytes_per_s=link)
    candidates = tuple(order[: 1 + len(ext) % 3])
    choice = cpattn.choose_placement(ext, pre, spec=SPEC, cp_size=c, kv=kv, candidates=candidates,
                                     token_flops=token_flops, cost_model=model)
    keys = list(choice.estimates)
    assert [k.split("/")[0] for k in keys] == [n for n in candidates for k in keys if k.startswith(n + "/")]
    assert choice.seconds == min(choice.estimates.values())
    assert keys.index(f"{choice.strategy}/{choice.algorithm}") == min(
        i for i, k in enumerate(keys) if choice.estimates[k] == choice.seconds)
    assert set(choice.bytes) == set(choice.estimates) and all(b >= 0 for b in choice.bytes.values())
    assert all(math.isfinite(t) and t > 0 for t in choice.estimates.values())
    for key in keys:  # each algorithm is what the (placement, KV layout) pair runs
        name, algo = key.split("/")
        if name == "replicated":
            assert algo == ("shard_merge" if sharded else "local")
        elif sharded:
            assert algo in ("pass_kv", "pass_q")
        else:
            assert algo == ("gather_kv" if c > 1 else "local")
    # deterministic: the same arguments give the same choice (every rank computes it alone)
    again = cpattn.choose_placement(list(ext), list(pre), spec=SPEC, cp_size=c, kv=kv, candidates=candidates,
                                    token_flops=token_flops, cost_model=model)
    assert again == choice


def test_the_estimates_follow_the_documented_formulas():
    model = cpattn.CostModel()
    hq, hkv, d = SPEC.num_q_heads, SPEC.num_kv_heads, SPEC.head_dim
    flop, kv_row = 2.0 * hq * 2 * d, hkv * 2 * d * 2
    ext, pre, c, tf = [1000, 24], [0, 100], 4, 3e7
    choice = cpattn.choose_placement(ext, pre, spec=SPEC, cp_size=c, token_flops=tf, cost_model=model)
    total = sum((p + e) * (p + e + 1) / 2 - p * (p + 1) / 2 for e, p in zip(ext, pre))
    local = model.launch_overhead_s + total * flop / model.dense_flops_per_s + sum(ext) * tf / model.matmul_flops_per_s
    assert choice.estimates["replicated/local"] == pytest.approx(local, rel=1e-12)
    rows, pairs = cpattn.get_strategy("zigzag", c).rank_loads(ext, pre)
    p = int(rows.max())
    gather = (model.collective_latency_s + model.launch_overhead_s + (c - 1) * p * kv_row / model.link_bytes_per_s
              + pairs.max() * flop / model.dense_flops_per_s + p * tf / model.matmul_flops_per_s)
    assert choice.estimates["zigzag/gather_kv"] == pytest.approx(gather, rel=1e-12)
    assert choice.bytes["zigzag/gather_kv"] == (c - 1) * p * kv_row and choice.bytes["replicated/local"] == 0


def test_short_batches_switch_cp_off_and_long_ones_on():
    """With attention priced alone, a short sequence pays the collective for nothing: the choice
    is "replicated" up to a break-even length and the CP strategy past it, with one crossover."""
    chosen = [cpattn.choose_placement([n], spec=SPEC, cp_size=4).strategy for n in (2**k for k in range(4, 18))]
    assert chosen[0] == "replicated" and chosen[-1] == "zigzag"
    flips = sum(a != b for a, b in zip(chosen, chosen[1:]))
    assert flips == 1, chosen
    # a window bounds the work: a long windowed batch gains less, so the break-even moves out
    win = SPEC.replace(window_size=(63, 0))
    assert cpattn.choose_placement([4096], spec=win, cp_size=4).estimates["replicated/local"] < \
        cpattn.choose_placement([4096], spec=SPEC, cp_size=4).estimates["replicated/local"]
    # decode steps over a sharded cache: replicated queries over the shard
    dec = cpattn.choose_placement([1] * 8, [100_000] * 8, spec=SPEC, cp_size=4, kv=cpattn.KVSharding(4))
    assert (dec.strategy, dec.algorithm) == ("replicated", "shard_merge")


def test_bad_arguments_name_themselves():
    ok = dict(spec=SPEC, cp_size=2)
    cases = [
        (dict(ok, spec="x"), TypeError, "spec"),
        (dict(ok, cp_size=0), ValueError, "cp_size"),
        (dict(ok, kv=3), TypeError, "kv"),
        (dict(ok, kv=cpattn.KVSharding(3)), ValueError, "kv has cp_size=3"),
        (dict(ok, candidates="zigzag"), TypeError, "candidates"),
        (dict(ok, candidates=()), TypeError, "candidates"),
        (dict(ok, candidates=("zigzag", "ring")), ValueError, "unknown strategy 'ring'"),
        (dict(ok, candidates=("zigzag", "zigzag")), ValueError, "each strategy once"),
        (dict(ok, token_flops=-1.0), ValueError, "token_flops"),
        (dict(ok, token_flops=float("nan")), ValueError, "token_flops"),
        (dict(ok, token_flops=True), ValueError, "token_flops"),
        (dict(ok, cost_model={}), TypeError, "cost_model"),
    ]
    for kwargs, exc, match in cases:
        with pytest.raises(exc, match=match):
            cpattn.choose_placement([4], [0], **kwargs)
    with pytest.raises(ValueError, match="same size"):
        cpattn.choose_placement([4, 1], [0], **ok)
    with pytest.raises(ValueError, match="extend_lens must be >= 0"):
        cpattn.choose_placement([-1], **ok)
    with pytest.raises(ValueError, match="keys_cap"):
        cpattn.get_strategy("zigzag", 2).rank_loads([3], keys_cap=0)


# ----------------------------------------------------------------------------- gloo: exact, agreed
_HQ, _HKV, _D, _PS = 4, 2, 8, 4
_BATCHES = [([3], [0]), ([40, 1, 0], [5, 0, 2]), ([90], [17])]


def _paged(keys, vals, lens, room, c, r, g):
    """Rank r's positions (of C, interleave 1) of packed per-sequence ``keys`` of ``lens`` in
    shuffled pages of a NaN-filled cache with room for ``room`` keys per sequence."""
    local = [len(range(r, n, c)) for n in room]
    pages = [-(-n // _PS) + 1 for n in local]
    perm = torch.randperm(sum(pages) + 1, generator=g)
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    kc = torch.full((sum(pages) + 1, _PS, _HKV, _D), float("nan"))
    vc = torch.full_like(kc, float("nan"))
    off = row = 0
    for b, n in enumerate(lens):
        table[b, : pages[b]] = perm[off : off + pages[b]].int()
        off += pages[b]
        pos = torch.arange(n)[r::c]
        j = torch.arange(pos.numel())
        kc[table[b, j // _PS].long(), j % _PS] = keys[row + pos]
        vc[table[b, j // _PS].long(), j % _PS] = vals[row + pos]
        row += n
    return kc, vc, table


def _choose_and_run(rank, world):
    group = torch.distributed.group.WORLD
    spec = cpattn.AttentionSpec(num_q_heads=_HQ, num_kv_heads=_HKV, head_dim=_D, dtype=torch.float32,
                                page_size=_PS)
    fast_link = cpattn.CostModel(link_bytes_per_s=1e15, collective_latency_s=1e-9)
    results = []
    for bi, (ext, pre) in enumerate(_BATCHES):
        g = torch.Generator().manual_seed(bi)  # the same logical tensors on every rank
        kv_lens = [e + p for e, p in zip(ext, pre)]
        keys = torch.randn(sum(kv_lens), _HKV, _D, generator=g)
        vals = torch.randn(sum(kv_lens), _HKV, _D, generator=g)
        q = torch.randn(sum(ext), _HQ, _D, generator=g)
        ref, _ = attention_oracle(q, keys, vals, ext, pre)
        starts = [sum(kv_lens[:b]) for b in range(len(ext))]
        pre_rows = torch.tensor([s + j for s, p in zip(starts, pre) for j in range(p)], dtype=torch.int64)
        new_rows = torch.tensor([s + p + j for s, p, e in zip(starts, pre, ext) for j in range(e)], dtype=torch.int64)
        for sharded in (False, True):
            kv = cpattn.KVSharding(world) if sharded else None
            for candidates, model in ((("zigzag",), None), (("replicated",), None),
                                      (("zigzag", "replicated"), None), (("replicated", "zigzag"), fast_link)):
                choice = cpattn.choose_placement(ext, pre, spec=spec, cp_size=world, kv=kv, candidates=candidates,
                                                 cost_model=model)
                s = cpattn.get_strategy(choice.strategy, world)
                meta = s.build_metadata(ext, pre, rank=rank, group=group, kv=kv)  # agreed: same choice
                c, r = (world, rank) if sharded else (1, 0)
                kc, vc, table = _paged(keys[pre_rows], vals[pre_rows], pre, kv_lens, c, r,
                                       torch.Generator().manual_seed(100 + rank))
                k_new, v_new = keys[new_rows], vals[new_rows]
                if choice.algorithm in ("pass_kv", "pass_q"):
                    plan = cpattn.plan_attention(meta, spec, backend="torch", algorithm=choice.algorithm,
                                                 page_table=table, num_pages=kc.shape[0])
                    out = plan.run(s.shard(q, meta), s.shard(k_new, meta), s.shard(v_new, meta), (kc, vc), group=group)
                else:
                    plan = cpattn.plan_attention(meta, spec, backend="torch", algorithm=choice.algorithm)
                    writes = cpattn.plan_cache_writes(meta, table, page_size=_PS, num_pages=kc.shape[0])
                    out = plan.run(s.shard(q, meta), s.shard(k_new, meta), s.shard(v_new, meta), (kc, vc),
                                   writes=writes, group=group, page_table=table)
                full = s.gather(out, meta, group)
                results.append((bi, sharded, candidates, choice.strategy, choice.algorithm, plan.algorithm,
                                (full.double() - ref).abs().max().item()))
    # ranks whose cost models differ choose differently: the plan agreement refuses, on every rank
    slow = cpattn.CostModel(link_bytes_per_s=1e3) if rank == 0 else cpattn.CostModel(link_bytes_per_s=1e15,
                                                                                      collective_latency_s=1e-9)
    choice = cpattn.choose_placement([4000], spec=spec, cp_size=world, cost_model=slow)
    try:
        cpattn.get_strategy(choice.strategy, world).build_metadata([4000], rank=rank, group=group)
        disagreement = None
    except cpattn.PlanDisagreement as exc:
        disagreement = str(exc)
    return results, choice.strategy, disagreement


@pytest.mark.parametrize("world", [2, 3])
def test_every_choice_is_exact_and_agreed_over_gloo(world):
    per_rank = run_distributed(_choose_and_run, world, pg_timeout=120)
    first = per_rank[0][0]
    assert all(r[0] == first for r in per_rank)  # every rank made the same choices
    chosen = {(row[3], row[4]) for row in first}
    assert {("zigzag", "gather_kv"), ("replicated", "local"), ("replicated", "shard_merge")} <= chosen
    assert chosen & {("zigzag", "pass_kv"), ("zigzag", "pass_q")}
    for bi, sharded, candidates, strategy, algorithm, ran, err in first:
        assert ran == algorithm and err < TOLERANCE[torch.float32], (bi, sharded, candidates, strategy, algorithm, err)
    assert [r[1] for r in per_rank] == ["replicated"] + ["zigzag"] * (world - 1)
    assert all(r[2] is not None for r in per_rank)
