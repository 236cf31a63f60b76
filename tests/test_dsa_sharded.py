"""DSA decode over a sharded KV cache: the exact global top-k agreement and sparse attention over
the selected keys each rank owns, against fp64 oracles written here (explicit causal mask, top-k
with ties broken by the lower position). C = 1..4 ranks simulated in-process by slicing the
shards (the candidates stacked as the all-gather would); gloo with 2 and 3 ranks; static plans;
bad inputs raising before any collective."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpattn
from cpattn import dsa
from cpattn.merge import merge_states
from cpattn.plans.sparse import select_candidates
from cpattn.selection import pack_keys
from dist_utils import CountCollectives, run_distributed

H_I, D_I = 2, 16
FP8 = torch.float8_e4m3fn


# ----------------------------------------------------------------------------- batches and shards
@st.composite
def decode_batches(draw, max_len: int = 3000):
    """(C, interleave, seq_lens, q_lens, topk): C 1..4; lengths 0 .. max_len (after the step:
    the q_len newest keys are the step's own), q_len 1..4 (<= length), topk below and above."""
    c = draw(st.integers(1, 4))
    il = draw(st.sampled_from([1, 2, 4]))
    n = draw(st.integers(1, 3))
    lens, qs = [], []
    for _ in range(n):
        length = draw(st.one_of(st.integers(0, 2 * c * il), st.integers(0, max_len)))
        q = draw(st.integers(1, 4))
        lens.append(max(length, q))
        qs.append(q)
    topk = draw(st.sampled_from([1, 3, 16, 64, 4096]))
    return c, il, lens, qs, topk


def _int_inputs(lens, qs, gen, h=H_I, d=D_I, levels=3):
    """Integer-valued index queries / keys / weights (scores are exact in float32 and fp64, and
    tie often): per sequence keys [L, d]; per query row q_idx [N, h, d], weights [N, h]."""
    keys = [torch.randint(-levels, levels + 1, (length, d), generator=gen).float() for length in lens]
    n = sum(qs)
    q = torch.randint(-levels, levels + 1, (n, h, d), generator=gen).float()
    w = torch.randint(-2, 3, (n, h), generator=gen).float()
    return keys, q, w


def _rows(lens, qs):
    """(sequence, global position) of every query row, sequence after sequence."""
    return [(b, length - q + i) for b, (length, q) in enumerate(zip(lens, qs)) for i in range(q)]


def _shard_packed(per_seq, c, il, r):
    """This rank's packed cache: the rows of each sequence at positions it owns, in order."""
    parts = [x[[p for p in range(x.shape[0]) if (p // il) % c == r]] for x in per_seq]
    return torch.cat(parts) if parts else torch.zeros(0, *per_seq[0].shape[1:])


def _shard_paged(per_seq, c, il, r, page_size, gen):
    """This rank's paged cache [num_pages, page_size, ...] (pages in random order, unused table
    entries a huge page number) and its page table [B, max_pages] int32."""
    local = [x[[p for p in range(x.shape[0]) if (p // il) % c == r]] for x in per_seq]
    counts = [-(-x.shape[0] // page_size) for x in local]
    num = sum(counts) + 1
    order = torch.randperm(num, generator=gen).tolist()
    cache = torch.zeros(num, page_size, *per_seq[0].shape[1:], dtype=per_seq[0].dtype)
    table = torch.full((len(local), max(counts + [1])), 10**6, dtype=torch.int32)
    used = 0
    for b, x in enumerate(local):
        for j in range(counts[b]):
            page = order[used]
            used += 1
            table[b, j] = page
            chunk = x[j * page_size:(j + 1) * page_size]
            cache[page, : chunk.shape[0]] = chunk
    return cache, table


def _meta(c, il, lens, qs, r):
    pre = [length - q for length, q in zip(lens, qs)]
    return cpattn.get_strategy("replicated", c).build_metadata(qs, pre, rank=r, kv=cpattn.KVSharding(c, il))


# ----------------------------------------------------------------------------- fp64 oracles
def topk_oracle(keys, q, w, lens, qs, topk, scale):
    """Per query row the set of its topk best visible keys (fp64 scores; ties: lower position)
    as a sorted list, padded with -1 to topk entries."""
    out = []
    for t, (b, p) in enumerate(_rows(lens, qs)):
        k = keys[b][: p + 1].double()
        s = (w[t].double()[:, None] * torch.relu(scale * (q[t].double() @ k.T))).sum(0)
        order = sorted(range(p + 1), key=lambda j: (-float(s[j]), j))[:topk]
        out.append(sorted(order) + [-1] * (topk - len(order)))
    return out


def sparse_oracle(qa, ka, va, sel, lens, qs, scale, sinks=None):
    """fp64 attention of each row over exactly its selected positions (explicit mask)."""
    n, hq, _ = qa.shape
    out = torch.zeros(n, hq, va[0].shape[-1], dtype=torch.float64)
    for t, (b, p) in enumerate(_rows(lens, qs)):
        chosen = [j for j in sel[t] if 0 <= j <= p]
        for h in range(hq):
            s = (ka[b][chosen, 0].double() @ qa[t, h].double()) * scale
            if sinks is not None:
                s = torch.cat([s, sinks[h:h + 1].double()])
            if s.numel() == 0:
                continue
            pr = torch.softmax(s, 0)[: len(chosen)]
            out[t, h] = pr @ va[b][chosen, 0].double()
    return out


def _sorted_sel(idx):
    """Each row's selected positions sorted, then its -1 padding."""
    return [sorted(p for p in row if p >= 0) + [-1] * sum(p < 0 for p in row) for row in idx.tolist()]


def _simulate_topk(c, il, lens, qs, topk, keys, q, w, scale, paged, gen, backend_options=None, backend="gemm",
                   k_scale=None):
    """The agreed selection with C ranks simulated in-process: each rank's candidates over its
    shard, stacked as the all-gather stacks them (``k_scale``: per-sequence [L] scales of fp8 keys)."""
    cands = []
    k_dtype = keys[0].dtype if keys else q.dtype
    for r in range(c):
        meta = _meta(c, il, lens, qs, r)
        plan = cpattn.plan_index_topk(meta, num_heads=H_I, head_dim=D_I, q_dtype=q.dtype, k_dtype=k_dtype, topk=topk,
                                      page_size=4 * il if paged else None, has_k_scale=k_scale is not None,
                                      backend=backend, backend_options=backend_options)
        assert plan.algorithm == "shard_merge" and plan.backend == backend
        assert isinstance(plan, cpattn.AttentionPlan)  # the indexer is on the plan base too
        raw = [x.view(torch.uint8) for x in keys] if k_dtype == FP8 else keys  # slicing / paging as bytes
        if paged:  # one page order for keys and scales (one seed)
            seed = int(torch.randint(0, 1 << 30, (1,), generator=gen))
            k_loc, table = _shard_paged(raw, c, il, r, 4 * il, torch.Generator().manual_seed(seed))
            sc = None if k_scale is None else \
                _shard_paged(k_scale, c, il, r, 4 * il, torch.Generator().manual_seed(seed))[0]
            kw = {"page_table": table}
        else:
            k_loc = _shard_packed(raw, c, il, r)
            sc = _shard_packed(k_scale, c, il, r) if k_scale is not None else None
            kw = {}
        if k_dtype == FP8:
            k_loc = k_loc.view(FP8)
        cands.append(plan.candidates(q, k_loc, w, softmax_scale=scale, k_scale=sc, **kw))
    return select_candidates(torch.stack(cands), topk)


# ----------------------------------------------------------------------------- top-k agreement
@settings(max_examples=30, deadline=None)
@given(decode_batches(), st.booleans(), st.integers(0, 99))
def test_agreed_topk_equals_the_single_rank_oracle(batch, paged, seed):
    c, il, lens, qs, topk = batch
    gen = torch.Generator().manual_seed(seed)
    keys, q, w = _int_inputs(lens, qs, gen)
    scale = 0.25
    want = topk_oracle(keys, q, w, lens, qs, topk, scale)
    got = _simulate_topk(c, il, lens, qs, topk, keys, q, w, scale, paged, gen)
    assert got.dtype == torch.int32 and got.shape == (sum(qs), topk)
    assert _sorted_sel(got) == want


@pytest.mark.parametrize("c", [1, 2, 3, 4])
def test_ties_go_to_the_lower_position_on_every_rank_count(c):
    """Every key equal: each row selects positions 0 .. topk-1, whichever ranks hold them; the
    single-rank prefill path (torch) picks the same set."""
    lens, qs, topk = [50, 9], [2, 1], 7
    keys = [torch.ones(length, D_I) for length in lens]
    q, w = torch.ones(3, H_I, D_I), torch.ones(3, H_I)
    got = _simulate_topk(c, 1, lens, qs, topk, keys, q, w, 0.25, False, torch.Generator())
    assert _sorted_sel(got) == [list(range(topk))] * 3
    prefill = cpattn.get_strategy("replicated", 1).build_metadata(qs, [48, 8], rank=0)
    single = dsa.index_topk(q, torch.cat(keys), w, prefill, topk, softmax_scale=0.25, backend="torch")
    assert _sorted_sel(single) == _sorted_sel(got)


@pytest.mark.parametrize("c,il", [(2, 1), (3, 2), (4, 1)])
def test_every_selected_key_on_one_rank(c, il):
    """The winners all live on rank 1 (its keys score high): the other ranks' candidates all lose."""
    lens, qs, topk = [300, 41], [3, 2], 8
    gen = torch.Generator().manual_seed(3)
    keys, q, w = _int_inputs(lens, qs, gen)
    q, w = q.abs() + 1, w.abs() + 1
    for x in keys:
        owner = (torch.arange(x.shape[0]) // il) % c
        x[owner != 1] = 0.0
        x[owner == 1] = x[owner == 1].abs() + 1
    got = _simulate_topk(c, il, lens, qs, topk, keys, q, w, 0.25, False, gen)
    assert _sorted_sel(got) == topk_oracle(keys, q, w, lens, qs, topk, 0.25)
    assert all(((p // il) % c == 1) for row in got.tolist() for p in row if p >= 0)


def test_key_chunks_merge_exactly():
    """A tiny score budget (many key chunks, running top-k across them) selects the same set."""
    lens, qs, topk = [700, 5], [2, 1], 24
    gen = torch.Generator().manual_seed(1)
    keys, q, w = _int_inputs(lens, qs, gen)
    want = topk_oracle(keys, q, w, lens, qs, topk, 0.25)
    got = _simulate_topk(2, 1, lens, qs, topk, keys, q, w, 0.25, True, gen, {"max_score_elems": 3 * 16 * 16})
    assert _sorted_sel(got) == want


def test_run_without_a_process_group_raises_before_scoring():
    """C > 1 and no initialized process group: ValueError naming it (no collective attempted)."""
    lens, qs = [40, 9], [1, 2]
    keys, q, w = _int_inputs(lens, qs, torch.Generator().manual_seed(0))
    plan = cpattn.plan_index_topk(_meta(2, 1, lens, qs, 0), num_heads=H_I, head_dim=D_I, q_dtype=q.dtype,
                                  k_dtype=q.dtype, topk=4)
    with pytest.raises(ValueError, match="process group"):
        plan.run(q, _shard_packed(keys, 2, 1, 0), w)
    with pytest.raises(ValueError, match="candidates\\(\\) is for a plan over a sharded cache"):
        cpattn.plan_index_topk(cpattn.get_strategy("replicated", 1).build_metadata(qs, [39, 7], rank=0),
                               num_heads=H_I, head_dim=D_I, q_dtype=q.dtype, k_dtype=q.dtype,
                               topk=4).candidates(q, torch.cat(keys), w)


def test_agreement_bytes():
    assert dsa.topk_agreement_bytes(64, 2048, 8) == 7 * 64 * 2048 * 8
    assert dsa.topk_agreement_bytes(5, 3, 1) == 0
    with pytest.raises(ValueError, match="cp_size"):
        dsa.topk_agreement_bytes(1, 1, 0)


# ----------------------------------------------------------------------------- sparse attention
HQ, D, DV = 4, 24, 16  # absorbed-MLA-like: one latent KV head, v = k[..., :DV]


def _attn_inputs(lens, qs, gen, dtype=torch.float32):
    ka = [torch.randn(length, 1, D, generator=gen).to(dtype) for length in lens]
    qa = torch.randn(sum(qs), HQ, D, generator=gen).to(dtype)
    return ka, qa


def _simulate_sparse(c, il, lens, qs, sel, ka, qa, scale, paged, gen, backend="torch", sinks=None):
    """Merged output of C simulated ranks: each attends its shard's selected keys (v = k[..., :DV])."""
    outs, lses = [], []
    for r in range(c):
        meta = _meta(c, il, lens, qs, r)
        spec = cpattn.AttentionSpec(num_q_heads=HQ, num_kv_heads=1, head_dim=D, head_dim_v=DV, dtype=qa.dtype,
                                    topk=sel.shape[1], page_size=4 * il if paged else None, has_sinks=sinks is not None)
        plan = cpattn.plan_attention(meta, spec, backend=backend)
        assert plan.algorithm == "shard_merge" and type(plan).__name__ == "SparseShardMergePlan"
        kw = {"sinks": sinks}
        if paged:
            k_loc, kw["page_table"] = _shard_paged(ka, c, il, r, 4 * il, gen)
        else:
            k_loc = _shard_packed(ka, c, il, r)
        o, l = plan.attend(qa, k_loc, k_loc[..., :DV], sel, softmax_scale=scale, **kw)
        outs.append(o)
        lses.append(l)
    return merge_states(torch.stack(outs), torch.stack(lses))


@settings(max_examples=25, deadline=None)
@given(decode_batches(max_len=600), st.booleans(), st.booleans(), st.integers(0, 99))
def test_sparse_attention_over_the_agreed_selection(batch, paged, sinks, seed):
    """The agreed selection, then each rank's sparse attention over its own selected keys,
    merged: equals fp64 attention over the oracle's selection (same set) with an explicit mask."""
    c, il, lens, qs, topk = batch
    gen = torch.Generator().manual_seed(seed)
    keys, q, w = _int_inputs(lens, qs, gen)
    sel = _simulate_topk(c, il, lens, qs, topk, keys, q, w, 0.25, paged, gen)
    want_sel = topk_oracle(keys, q, w, lens, qs, topk, 0.25)
    assert _sorted_sel(sel) == want_sel
    ka, qa = _attn_inputs(lens, qs, gen)
    sk = torch.randn(HQ, generator=gen) if sinks else None
    out, lse = _simulate_sparse(c, il, lens, qs, sel, ka, qa, 0.2, paged, gen, sinks=sk)
    want = sparse_oracle(qa, ka, [k[..., :DV] for k in ka], want_sel, lens, qs, 0.2, sk)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    assert torch.isfinite(lse).all() if sk is not None else True


def test_rows_without_owned_keys_and_empty_sequences():
    """A rank owning none of a row's selection gives 0 / -inf for it; a sequence of 0 cached keys
    never occurs in a decode step (q_len >= 1), but pad rows and ranks with no key of a
    1-key sequence do: merged rows equal the oracle, no NaN."""
    lens, qs, topk = [1, 2, 9], [1, 2, 1], 4
    gen = torch.Generator().manual_seed(0)
    keys, q, w = _int_inputs(lens, qs, gen)
    sel = _simulate_topk(4, 1, lens, qs, topk, keys, q, w, 0.25, False, gen)
    ka, qa = _attn_inputs(lens, qs, gen)
    meta = _meta(4, 1, lens, qs, 3)  # rank 3 owns position 3 and 7 of the 9-key sequence only
    spec = cpattn.AttentionSpec(num_q_heads=HQ, num_kv_heads=1, head_dim=D, head_dim_v=DV, dtype=qa.dtype, topk=topk)
    plan = cpattn.plan_attention(meta, spec, backend="torch")
    k3 = _shard_packed(ka, 4, 1, 3)
    o, l = plan.attend(qa, k3, k3[..., :DV], sel)
    for t, (b, p) in enumerate(_rows(lens, qs)):
        owned = [j for j in sel[t].tolist() if j >= 0 and j % 4 == 3]
        if not owned:
            assert bool((o[t] == 0).all()) and bool(torch.isneginf(l[t]).all())
    out, _ = _simulate_sparse(4, 1, lens, qs, sel, ka, qa, 0.2, False, gen)
    want = sparse_oracle(qa, ka, [k[..., :DV] for k in ka], _sorted_sel(sel), lens, qs, 0.2)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


def _user_selection(lens, qs, topk, gen):
    """A user-given selection [N, topk] int64: per row distinct positions drawn from -1 .. past the
    sequence's end (negative, future and past-the-sequence entries included), unsorted."""
    rows = []
    for b, _ in _rows(lens, qs):
        pool = torch.randperm(lens[b] + 6, generator=gen)[:topk] - 1
        rows.append(torch.cat([pool, torch.full((topk - pool.numel(),), -1, dtype=torch.int64)]))
    return torch.stack(rows)


def _check_given_selection(c, il, paged, seed, tol, backend="torch"):
    """Merged partials over a user-given selection equal fp64 attention over each row's entries
    in 0..position (see :func:`_user_selection`)."""
    lens, qs, topk = [37, 5, 20], [2, 1, 4], 12
    gen = torch.Generator().manual_seed(seed)
    sel = _user_selection(lens, qs, topk, gen)
    ka, qa = _attn_inputs(lens, qs, gen)
    out, _ = _simulate_sparse(c, il, lens, qs, sel, ka, qa, 0.2, paged, gen, backend=backend)
    want = sparse_oracle(qa, ka, [k[..., :DV] for k in ka], sel.tolist(), lens, qs, 0.2)
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("c,il", [(2, 1), (3, 2), (4, 1)])
@pytest.mark.parametrize("paged", [False, True])
def test_future_positions_in_a_given_selection_are_ignored(c, il, paged):
    """Entries of a user-given ``idx`` larger than the row's position (future, or past its
    sequence) are ignored on every rank, as single-GPU sparse attention ignores them."""
    _check_given_selection(c, il, paged, 11, 2e-5)


@pytest.mark.parametrize("paged", [False, True])
def test_future_positions_ignored_triton_interpreter(dsa_interp, paged):
    """As above through the Triton sparse kernel over a shard."""
    _check_given_selection(3, 2, paged, 12, 2e-4, backend="triton")


@pytest.mark.parametrize("paged", [False, True])
def test_sparse_shard_triton_interpreter(dsa_interp, paged):
    """The Triton sparse kernel over a shard (local view of the packed rows / the page table)."""
    lens, qs, topk = [70, 13, 33], [2, 1, 4], 16
    gen = torch.Generator().manual_seed(5)
    keys, q, w = _int_inputs(lens, qs, gen)
    sel = _simulate_topk(3, 2, lens, qs, topk, keys, q, w, 0.25, paged, gen)
    ka, qa = _attn_inputs(lens, qs, gen)
    out, _ = _simulate_sparse(3, 2, lens, qs, sel, ka, qa, 0.2, paged, torch.Generator().manual_seed(1),
                              backend="triton")
    want = sparse_oracle(qa, ka, [k[..., :DV] for k in ka], _sorted_sel(sel), lens, qs, 0.2)
    torch.testing.assert_close(out.double(), want, atol=2e-4, rtol=2e-4)


# ----------------------------------------------------------------------------- real collectives (gloo)
def _gloo_case(rank, world, il, paged):
    """One DSA decode layer on ``world`` gloo ranks: the agreed top-k (ONE all-gather) and the
    sparse attention over each rank's selected keys merged (ONE data all-gather after a one-time
    shape check), against the fp64 oracles; bad inputs raising before any collective."""
    lens, qs, topk = [400, 37, 5], [1, 4, 2], 32
    gen = torch.Generator().manual_seed(11)
    keys, q, w = _int_inputs(lens, qs, gen)
    ka, qa = _attn_inputs(lens, qs, gen)
    pre = [length - n for length, n in zip(lens, qs)]
    meta = cpattn.get_strategy("replicated", world).build_metadata(qs, pre, rank=rank, group=None,
                                                                   kv=cpattn.KVSharding(world, il))
    ps = 4 * il if paged else None
    iplan = cpattn.plan_index_topk(meta, num_heads=H_I, head_dim=D_I, q_dtype=q.dtype, k_dtype=q.dtype, topk=topk,
                                   page_size=ps)
    spec = cpattn.AttentionSpec(num_q_heads=HQ, num_kv_heads=1, head_dim=D, head_dim_v=DV, dtype=qa.dtype, topk=topk,
                                page_size=ps)
    aplan = cpattn.plan_attention(meta, spec, backend="torch")
    kw = {}
    if paged:  # one page order for both caches (same seed): one page table
        k_idx, kw["page_table"] = _shard_paged(keys, world, il, rank, ps, torch.Generator().manual_seed(rank))
        k_lat, _ = _shard_paged(ka, world, il, rank, ps, torch.Generator().manual_seed(rank))
    else:
        k_idx, k_lat = _shard_packed(keys, world, il, rank), _shard_packed(ka, world, il, rank)
    with CountCollectives() as cc:
        sel = iplan.run(q, k_idx, w, softmax_scale=0.25, **kw)
        n_index = len(cc.calls)
        again = iplan.run(q, k_idx, w, softmax_scale=0.25, **kw)  # later steps: the data collective alone
        n_again = len(cc.calls) - n_index
        assert torch.equal(again, sel)
        n_index = (n_index, n_again)
        mark = len(cc.calls)
        # caches already hold the step's keys (writes=None); the new rows only feed the checks
        out = aplan.run(qa, qa[:, :1], qa[:, :1, :DV], (k_lat, k_lat[..., :DV]), idx=sel, softmax_scale=0.2, **kw)
        n_attn = [len(s) for s in cc.calls[mark:]]
    errors = []
    with CountCollectives() as bad:
        for fn in (lambda: iplan.run(q, k_idx[..., :8], w, **kw),  # wrong index head dim
                   lambda: iplan.run(q.double(), k_idx, w, **kw),  # wrong dtype
                   lambda: iplan.run(q, k_idx, w, scale=0.25, **kw),  # not an IndexInputs keyword
                   lambda: iplan.candidates(q, k_idx, w, groups=None, **kw),
                   lambda: aplan.run(qa, qa[:, :1], qa[:, :1, :DV], (k_lat, k_lat[..., :DV]), idx=sel[:, :3], **kw),
                   lambda: aplan.run(qa, qa[:, :1], qa[:, :1, :DV], (k_lat, k_lat[..., :DV]), idx=None, **kw)):
            try:
                fn()
            except (ValueError, TypeError) as exc:
                errors.append(type(exc).__name__)
        bad_calls = len(bad.calls)
    return sel, out, n_index, n_attn, errors, bad_calls


@pytest.mark.parametrize("world,il,paged", [(2, 1, False), (3, 2, True)])
def test_gloo_decode_layer(world, il, paged):
    results = run_distributed(_gloo_case, world, il, paged)
    lens, qs, topk = [400, 37, 5], [1, 4, 2], 32
    gen = torch.Generator().manual_seed(11)
    keys, q, w = _int_inputs(lens, qs, gen)
    ka, qa = _attn_inputs(lens, qs, gen)
    want_sel = topk_oracle(keys, q, w, lens, qs, topk, 0.25)
    want = sparse_oracle(qa, ka, [k[..., :DV] for k in ka], want_sel, lens, qs, 0.2)
    for sel, out, n_index, n_attn, errors, bad_calls in results:
        assert _sorted_sel(sel) == want_sel
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
        assert n_index == (2, 1)  # a one-time [2] shape check, then the one all-gather of [N, topk] candidates
        assert n_attn == [1, 2]  # merge_partials: a one-time [5] shape check, then the one data all-gather
        assert errors == ["ValueError", "TypeError", "TypeError", "TypeError", "ValueError", "ValueError"]
        assert bad_calls == 0


# ----------------------------------------------------------------------------- static plans
def test_static_plans_equal_dynamic_plans():
    """Plans from a StaticPlanner (fixed buffers sized for a capacity; the index plan's key
    chunks from the capacity, not the batch) select and attend as the batch-sized plans, over
    several batches of one planner."""
    c, il, topk = 3, 2, 12
    planners = [cpattn.StaticPlanner(cpattn.get_strategy("replicated", c), max_tokens=8, max_seqs=3,
                                     max_kv_tokens=900, max_q_len=4, kv=cpattn.KVSharding(c, il), device="cpu")
                for _ in range(c)]  # one planner per rank (its buffers hold its plan until its next plan)
    for step, (lens, qs) in enumerate([([300, 7], [1, 3]), ([500, 2, 90], [2, 1, 4]), ([4], [4])]):
        gen = torch.Generator().manual_seed(step)
        keys, q, w = _int_inputs(lens, qs, gen)
        ka, qa = _attn_inputs(lens, qs, gen)
        want_sel = topk_oracle(keys, q, w, lens, qs, topk, 0.25)
        want = sparse_oracle(qa, ka, [k[..., :DV] for k in ka], want_sel, lens, qs, 0.2)
        n = sum(qs)
        cands, outs = [], []
        for r in range(c):
            meta = planners[r].plan(qs, [length - k for length, k in zip(lens, qs)], rank=r)
            rows = meta.num_physical_tokens
            assert rows == 8  # the capacity
            iplan = cpattn.plan_index_topk(meta, num_heads=H_I, head_dim=D_I, q_dtype=q.dtype, k_dtype=q.dtype,
                                           topk=topk)
            assert iplan.launch.num_keys == 300  # rank 0 holds <= 900 // 6 * 2 keys of any sequence, whatever the batch
            pad = rows - n
            qp, wp = torch.cat([q, q.new_zeros(pad, H_I, D_I)]), torch.cat([w, w.new_zeros(pad, H_I)])
            cands.append(iplan.candidates(qp, _shard_packed(keys, c, il, r), wp, softmax_scale=0.25))
            spec = cpattn.AttentionSpec(num_q_heads=HQ, num_kv_heads=1, head_dim=D, head_dim_v=DV, dtype=qa.dtype,
                                        topk=topk)
            aplan = cpattn.plan_attention(meta, spec, backend="torch")
            outs.append((aplan, r))
        sel = select_candidates(torch.stack(cands), topk)
        assert _sorted_sel(sel[:n]) == want_sel and bool((sel[n:] == -1).all())
        qp = torch.cat([qa, qa.new_zeros(8 - n, HQ, D)])
        parts = []
        for aplan, r in outs:
            k_lat = _shard_packed(ka, c, il, r)
            parts.append(aplan.attend(qp, k_lat, k_lat[..., :DV], sel, softmax_scale=0.2))
        out, lse = merge_states(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
        torch.testing.assert_close(out[:n].double(), want, atol=2e-5, rtol=2e-5)
        assert bool((out[n:] == 0).all()) and bool(torch.isneginf(lse[n:]).all())


def test_bench_dsa_decode_smoke(tmp_path):
    """``python benchmarks/run.py dsa_decode --small --device cpu``: every part timed at C and
    C = 1, the agreement and merge bytes by their formulas."""
    import argparse
    import json

    from benchmarks import dsa_decode

    parser = argparse.ArgumentParser()
    dsa_decode.add_arguments(parser)
    args = parser.parse_args(["--small", "--device", "cpu", "--contexts", "300", "--batches", "1,2", "--q-lens", "2",
                              "--cp", "3", "--rank", "2", "--iters", "1", "--warmup", "0", "--out",
                              str(tmp_path / "d")])
    assert dsa_decode.main(args) == 0
    rows = json.loads((tmp_path / "d.json").read_text())["rows"]
    assert [(r["batch"], r["q_len"]) for r in rows] == [(1, 2), (2, 2)]
    for r in rows:
        n = r["batch"] * r["q_len"]
        assert r["topk_bytes"] == 2 * n * 16 * 8 and r["merge_bytes"] == 2 * n * 4 * (32 * 2 + 4)
        assert all(r[f"c{c}_{k}_ms"] > 0 for c in (3, 1) for k in ("index", "select", "attend"))
        assert r["c3_local_keys"] == r["batch"] * 100 and r["c1_local_keys"] == r["batch"] * 300
        assert r["ratio"] == r["c3_step_ms"] / r["c1_step_ms"]


def _mismatch_case(rank, world):
    """Rank 0 plans topk 8, the others 16: every rank raises the same ValueError, none hangs."""
    lens, qs = [40, 9], [1, 2]
    keys, q, w = _int_inputs(lens, qs, torch.Generator().manual_seed(0))
    meta = _meta(world, 1, lens, qs, rank)
    plan = cpattn.plan_index_topk(meta, num_heads=H_I, head_dim=D_I, q_dtype=q.dtype, k_dtype=q.dtype,
                                  topk=8 if rank == 0 else 16)
    try:
        plan.run(q, _shard_packed(keys, world, 1, rank), w)
    except ValueError as exc:
        return str(exc)
    return None


def test_gloo_ranks_with_different_topk_all_raise():
    errors = run_distributed(_mismatch_case, 2)
    assert errors[0] is not None and errors[0] == errors[1] and "topk=8" in errors[0] and "topk=16" in errors[0]


def _agreed_topk_case(rank, world):
    """Decode steps whose plans agree on the index top-k (``build_metadata(index_topk=)``): each
    step's index plan runs the candidate all-gather alone, from its first run; a step planned
    without it checks the shape once per plan; a plan whose topk differs from the agreed one
    raises before any collective."""
    topk, s, sh = 16, cpattn.get_strategy("replicated", world), cpattn.KVSharding(world, 1)
    calls, sels = [], []
    for step, (lens, qs) in enumerate([([40, 9], [1, 2]), ([41, 11], [1, 2]), ([300], [3])]):
        keys, q, w = _int_inputs(lens, qs, torch.Generator().manual_seed(step))
        pre = [length - n for length, n in zip(lens, qs)]
        declared = step < 2
        meta = s.build_metadata(qs, pre, rank=rank, kv=sh, index_topk=topk if declared else None)
        assert meta.index_topk == (topk if declared else 0)
        plan = cpattn.plan_index_topk(meta, num_heads=H_I, head_dim=D_I, q_dtype=q.dtype, k_dtype=q.dtype, topk=topk)
        assert plan.candidates_agreed == declared
        with CountCollectives() as cc:
            for _ in range(2):  # two layers of the step
                sels.append(plan.run(q, _shard_packed(keys, world, 1, rank), w, softmax_scale=0.25))
        calls.append(len(cc.calls))
        assert plan.candidates_agreed
        agreed_meta = meta if declared else agreed_meta
    with CountCollectives() as cc:
        try:
            cpattn.plan_index_topk(agreed_meta, num_heads=H_I, head_dim=D_I, q_dtype=q.dtype, k_dtype=q.dtype, topk=8)
            error = None
        except ValueError as exc:
            error = str(exc)
    return calls, sels, error, len(cc.calls)


def test_gloo_agreed_topk_needs_no_shape_check():
    results = run_distributed(_agreed_topk_case, 2)
    for step, (lens, qs) in enumerate([([40, 9], [1, 2]), ([41, 11], [1, 2]), ([300], [3])]):
        keys, q, w = _int_inputs(lens, qs, torch.Generator().manual_seed(step))
        want = topk_oracle(keys, q, w, lens, qs, 16, 0.25)
        for _, sels, _, _ in results:
            assert _sorted_sel(sels[2 * step]) == want and torch.equal(sels[2 * step + 1], sels[2 * step])
    for calls, _, error, bad_calls in results:
        assert calls == [2, 2, 3]  # two layers: the data all-gather each; undeclared: + one shape check
        assert "topk=8" in error and "index_topk=16" in error and bad_calls == 0


def test_index_topk_joins_the_plan_fingerprint():
    """``index_topk`` changes only its own fingerprint entry (dynamic and static plans), is kept
    on the plan, is checked like every argument, and binds the index plans built on it."""
    s, sh = cpattn.get_strategy("replicated", 2), cpattn.KVSharding(2)
    planner = cpattn.StaticPlanner(s, max_tokens=4, max_seqs=2, max_kv_tokens=64, max_q_len=2, kv=sh, device="cpu")
    for build in (lambda **kw: s.build_metadata([1, 2], [39, 7], rank=1, kv=sh, **kw),
                  lambda **kw: planner.plan([1, 2], [39, 7], rank=1, **kw)):
        plain, agreed = build(), build(index_topk=16)
        assert (plain.index_topk, agreed.index_topk) == (0, 16)
        diff = [i for i, (a, b) in enumerate(zip(plain.fingerprint, agreed.fingerprint)) if a != b]
        assert diff == [len(plain.fingerprint) - 2] and agreed.fingerprint[-2:] == (16, 1)
        for bad, err in ((0, ValueError), (True, TypeError), ("16", TypeError)):
            with pytest.raises(err, match="index_topk"):
                build(index_topk=bad)
        kw = dict(num_heads=H_I, head_dim=D_I, q_dtype=torch.float32, k_dtype=torch.float32)
        assert cpattn.plan_index_topk(agreed, topk=16, **kw).candidates_agreed
        assert not cpattn.plan_index_topk(plain, topk=16, **kw).candidates_agreed
        with pytest.raises(ValueError, match=r"topk=8 .*index_topk=16"):
            cpattn.plan_index_topk(agreed, topk=8, **kw)
    local = cpattn.InterleaveStrategy(2).build_metadata([9], [3], rank=0, index_topk=16)  # a replicated cache
    plan = cpattn.plan_index_topk(local, num_heads=H_I, head_dim=D_I, q_dtype=torch.float32,
                                  k_dtype=torch.float32, topk=4, backend="torch")
    assert plan.algorithm == "local" and not plan.candidates_agreed


def _agreed_topk_mismatch_case(rank, world):
    """Ranks that declare different index top-k fail the plan agreement together."""
    try:
        cpattn.get_strategy("replicated", world).build_metadata([1, 2], [39, 7], rank=rank,
                                                                kv=cpattn.KVSharding(world),
                                                                index_topk=8 if rank == 0 else 16)
    except cpattn.PlanDisagreement as exc:
        return str(exc)
    return None


def test_gloo_ranks_agreeing_different_topk_all_raise_at_planning():
    errors = run_distributed(_agreed_topk_mismatch_case, 2)
    assert errors[0] is not None and errors[0] == errors[1] and "index top-k" in errors[0] and "[8, 16]" in errors[0]


# ----------------------------------------------------------------------------- triton scores (interpreter)
@settings(max_examples=6, deadline=None)
@given(decode_batches(max_len=300), st.booleans(), st.integers(0, 99))
def test_triton_shard_scores_select_the_oracle_set(dsa_interp, batch, paged, seed):
    """The Triton score kernel over each rank's shard (packed / paged; chunks of 64 keys, top-k
    parts of 16), then the same agreement: the oracle's top-k exactly (integer-valued inputs:
    exact scores)."""
    c, il, lens, qs, topk = batch
    gen = torch.Generator().manual_seed(seed)
    keys, q, w = _int_inputs(lens, qs, gen)
    got = _simulate_topk(c, il, lens, qs, topk, keys, q, w, 0.25, paged, gen, backend="triton",
                         backend_options={"max_score_elems": 64 * sum(qs), "select_part": 16})
    assert _sorted_sel(got) == topk_oracle(keys, q, w, lens, qs, topk, 0.25)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3), st.integers(0, 300), st.integers(1, 70), st.sampled_from(["normal", "ties", "huge"]),
       st.floats(0.0, 0.5), st.booleans(), st.integers(1, 3), st.integers(0, 99))
def test_top_columns_kernel_is_torch_topk_over_packed_keys(dsa_interp, n, width, topk, kind, no_key_frac, nan, parts,
                                                           seed):
    """The Triton top-k of a score chunk (radix selection over the 32-bit score order, several
    score blocks per row, one program per (row, part)) selects, in each part of ceil(width /
    parts) columns, exactly the set ``torch.topk`` selects over the part's packed (score, global
    position) keys: ties at the threshold go to the lower position, "no key" entries only where
    fewer scores than k exist, a NaN first, NO_KEY padding past a narrow part."""
    from cpattn.kernels import triton_shard_index
    from cpattn.selection import NO_KEY, pack_keys, top_keys

    gen = torch.Generator().manual_seed(seed)
    if kind == "normal":
        s = torch.randn(n, width, generator=gen)
    elif kind == "ties":  # few distinct values: long runs of equal scores, -0.0 next to +0.0
        s = torch.randint(-2, 3, (n, width), generator=gen).float() * 0.5
        s[s == 0] = torch.where(torch.rand(int((s == 0).sum()), generator=gen) < 0.5, -0.0, 0.0)
    else:  # +-inf and values near the float32 range
        s = torch.tensor([float("-inf"), -3e38, 3e38, float("inf"), 1.0])[torch.randint(0, 5, (n, width), generator=gen)]
    if nan and width:
        s[0, int(torch.randint(0, width, (1,), generator=gen))] = float("nan")
    valid = torch.rand(n, width, generator=gen) >= no_key_frac
    c, il, r, j0 = 3, 2, 1, int(torch.randint(0, 50, (1,), generator=gen))
    j = torch.arange(j0, j0 + width)
    gpos = (j // il) * (c * il) + r * il + j % il
    packed = pack_keys(s, gpos[None, :], valid)
    ordered = torch.where(packed == NO_KEY, torch.full((), -(2**31)), packed >> 32).to(torch.int32)
    out = torch.full((n, parts, topk), 7, dtype=torch.int64)
    triton_shard_index.top_columns(ordered, out, (c, il, r), select_args=dict(BLOCK=32, num_warps=4, num_stages=1))(j0)
    part_len = -(-width // parts)
    for p in range(parts):
        want = top_keys(packed[:, p * part_len:(p + 1) * part_len], topk)
        assert torch.equal(out[:, p].sort(1).values, want.sort(1).values), p


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 40), st.integers(1, 70), st.floats(0.0, 1.0),
       st.integers(0, 3), st.integers(0, 99))
def test_top_candidates_kernel_is_select_candidates(dsa_interp, c, n, m, topk, no_key_frac, levels, seed):
    """The Triton agreement's top-k (radix selection over 64-bit packed keys, read in place from
    the all-gather's [C, N, m] layout) returns the positions :func:`select_candidates` returns:
    equal scores across ranks broken by the lower position, -1 padding where fewer than topk;
    into an int64 ``out``, the packed keys ``torch.topk`` selects (NO_KEY padding)."""
    from cpattn.kernels import triton_shard_index
    from cpattn.selection import top_keys
    from cpattn.selection import pack_keys

    gen = torch.Generator().manual_seed(seed)
    s = (torch.randint(0, levels + 1, (c, n, m), generator=gen).float() - 1.0) if levels else \
        torch.randn(c, n, m, generator=gen)
    pos = torch.randperm(c * n * m * 3, generator=gen)[: c * n * m].view(c, n, m)  # distinct positions per row
    valid = torch.rand(c, n, m, generator=gen) >= no_key_frac
    packed = pack_keys(s, pos, valid)
    out = torch.full((n, topk), 7, dtype=torch.int32)
    triton_shard_index.top_candidates(packed, out, select_args=dict(BLOCK=16, num_warps=4, num_stages=1))
    want = select_candidates(packed, topk)
    assert torch.equal(out.sort(1).values, want.sort(1).values)
    keys = torch.full((n, topk), 7, dtype=torch.int64)  # an int64 out: the packed keys themselves
    triton_shard_index.top_candidates(packed, keys, select_args=dict(BLOCK=16, num_warps=4, num_stages=1))
    flat = packed.permute(1, 0, 2).reshape(n, c * m)
    assert torch.equal(keys.sort(1).values, top_keys(flat, topk).sort(1).values)


@pytest.mark.parametrize("backend", ["gemm", "triton"])
def test_plan_select_is_select_candidates_and_checks_its_input(request, backend):
    """``IndexTopkPlan.select`` (what ``run`` does after its all-gather) returns the set
    :func:`select_candidates` returns, into ``out`` when given; a wrong shape / dtype / layout, a
    wrong ``out`` or a "local" plan raise before anything is written."""
    if backend == "triton":
        request.getfixturevalue("dsa_interp")
    c, topk = 3, 8
    meta = cpattn.get_strategy("replicated", c).build_metadata([2, 1], [40, 17], rank=1, kv=cpattn.KVSharding(c))
    plan = cpattn.plan_index_topk(meta, num_heads=H_I, head_dim=D_I, q_dtype=torch.float32, k_dtype=torch.float32,
                                  topk=topk, backend=backend)
    n = meta.num_physical_tokens
    gen = torch.Generator().manual_seed(5)
    scores = torch.randint(0, 3, (c, n, topk), generator=gen).float()
    pos = torch.randperm(c * n * topk, generator=gen).view(c, n, topk)
    cand = pack_keys(scores, pos, torch.rand(c, n, topk, generator=gen) > 0.3)
    want = select_candidates(cand, topk).sort(1).values
    assert torch.equal(plan.select(cand).sort(1).values, want)
    out = torch.full((n, topk), 9, dtype=torch.int32)
    assert plan.select(cand, out=out) is out and torch.equal(out.sort(1).values, want)
    strided = torch.full((topk, n), 9, dtype=torch.int32).T  # an out of any strides
    assert plan.select(cand, out=strided) is strided and torch.equal(strided.sort(1).values, want)
    # this rank's candidates into an out of any strides: the same keys as into a contiguous one
    gen_q = torch.Generator().manual_seed(6)
    keys, q, w = _int_inputs([42, 18], [2, 1], gen_q)
    k_loc = torch.cat([k[1::c] for k in keys])
    q_pad, w_pad = torch.zeros(n, H_I, D_I), torch.zeros(n, H_I)
    q_pad[:3], w_pad[:3] = q, w
    mine = plan.candidates(q_pad, k_loc, w_pad, softmax_scale=0.25)
    strided64 = torch.zeros(topk, n, dtype=torch.int64).T
    assert plan.candidates(q_pad, k_loc, w_pad, softmax_scale=0.25, out=strided64) is strided64
    assert torch.equal(strided64.sort(1).values, mine.sort(1).values)
    for bad in (cand[:2], cand.int(), cand.transpose(1, 2).contiguous().transpose(1, 2), cand[..., :4]):
        with pytest.raises(ValueError, match="candidates must be int64"):
            plan.select(bad)
    before = out.clone()
    with pytest.raises(ValueError, match="out must be"):
        plan.select(cand, out=torch.zeros(n, topk, dtype=torch.int64))
    assert torch.equal(out, before)
    local = cpattn.plan_index_topk(cpattn.InterleaveStrategy(2).build_metadata([9], [3], rank=0), num_heads=H_I,
                                   head_dim=D_I, q_dtype=torch.float32, k_dtype=torch.float32, topk=4, backend="torch")
    with pytest.raises(ValueError, match="sharded cache"):
        local.select(cand)


@pytest.mark.parametrize("backend", ["gemm", "triton"])
@pytest.mark.parametrize("paged", [False, True])
def test_fp8_index_keys_with_scales(request, backend, paged):
    """fp8 e4m3 index keys with a float32 scale per key (powers of two: exact), fp32 queries
    (gemm) or fp8 queries (triton: an fp8 dot): the oracle's top-k over the dequantized keys."""
    if backend == "triton":
        request.getfixturevalue("dsa_interp")
    lens, qs, topk = [130, 17, 40], [2, 1, 3], 12
    gen = torch.Generator().manual_seed(4)
    keys, q, w = _int_inputs(lens, qs, gen)
    q8 = q.to(FP8) if backend == "triton" else q
    scales = [2.0 ** torch.randint(-2, 3, (n,), generator=gen).float() for n in lens]
    k8 = [k.to(FP8) for k in keys]
    deq = [k.float() * sc[:, None] for k, sc in zip(keys, scales)]
    q_used = q8.float()
    want = topk_oracle(deq, q_used, w, lens, qs, topk, 0.25)
    got = _simulate_topk(3, 1, lens, qs, topk, k8, q8, w, 0.25, paged, gen, backend=backend, k_scale=scales)
    assert _sorted_sel(got) == want


@pytest.mark.parametrize("backend", ["gemm", "triton"])
def test_nan_index_key_is_selected_by_the_rows_that_see_it(request, backend):
    """A NaN index key scores NaN for every row that sees it and ranks first (as torch.topk ranks
    NaN): those rows select it on whichever rank holds it; earlier rows and other sequences never."""
    if backend == "triton":
        request.getfixturevalue("dsa_interp")
    lens, qs, topk, nan_pos = [60, 30], [3, 1], 4, 58
    gen = torch.Generator().manual_seed(2)
    keys, q, w = _int_inputs(lens, qs, gen)
    keys[0][nan_pos, 5] = float("nan")
    got = _simulate_topk(3, 1, lens, qs, topk, keys, q, w, 0.25, False, gen, backend=backend)
    for t, (b, p) in enumerate(_rows(lens, qs)):
        assert (nan_pos in got[t].tolist()) == (b == 0 and p >= nan_pos), (t, b, p, got[t].tolist())


def test_bench_dsa_decode_graph_step_eagerly():
    """``dsa_decode --graph``'s captured step, run eagerly on the CPU (all but the capture): from
    StaticPlanner plans it selects as the batch-sized plans do, its attention over this rank's
    keys equals an fp64 oracle, the merge of C equal partials keeps ``out`` and adds log C to
    ``lse`` (at C = 1 nothing is merged); a second call gives the same result; ``--graph`` on the CPU is refused."""
    import argparse
    import math

    from benchmarks import dsa_decode
    from benchmarks.sparse import dsa_shapes

    c, rank, ctx, b, q_len = 3, 1, 200, 2, 2
    shp = dsa_shapes(True)
    step, bufs = dsa_decode.graph_step_fn(c, rank, ctx, b, q_len, shp, torch.device("cpu"), "gemm")
    assert bufs["iplan"].meta.is_static and bufs["aplan"].meta.is_static
    agreed, out, lse, merged, merged_lse = [x.clone() for x in step()]
    again = step()
    assert all(torch.equal(x, y) for x, y in zip((agreed, out, lse, merged, merged_lse), again))
    meta = _meta(c, 1, [ctx] * b, [q_len] * b, rank)
    iplan = cpattn.plan_index_topk(meta, num_heads=shp["index_heads"], head_dim=shp["index_dim"],
                                   q_dtype=torch.float32, k_dtype=torch.float32, topk=shp["topk"], backend="gemm")
    cand = iplan.candidates(bufs["q_idx"], bufs["k_idx"], bufs["w"])
    want_sel = select_candidates(cand[None].expand(c, -1, -1).contiguous(), shp["topk"])
    assert torch.equal(agreed.sort(-1).values, want_sel.sort(-1).values)  # order inside a row is unspecified
    dv, lat, sel = shp["latent"], bufs["latent"], bufs["sel"]
    want = torch.zeros(out.shape, dtype=torch.float64)
    for t, (seq, p) in enumerate(_rows([ctx] * b, [q_len] * b)):  # sequence seq's local keys from row seq * ctx / C
        rows = [seq * len(range(rank, ctx, c)) + j // c for j in sel[t].tolist() if 0 <= j <= p and j % c == rank]
        if rows:
            s = (bufs["q"][t].double() @ lat[rows, 0].double().T) * 192**-0.5
            want[t] = torch.softmax(s, -1) @ lat[rows, 0, :dv].double()
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(merged, out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(merged_lse, lse + math.log(c), atol=1e-5, rtol=1e-5)
    # C = 1 (the graph ratio's baseline): one rank holds every key, nothing is merged
    step1, bufs1 = dsa_decode.graph_step_fn(1, 0, ctx, b, q_len, shp, torch.device("cpu"), "gemm")
    agreed1, out1, lse1, merged1, merged_lse1 = step1()
    assert merged1 is out1 and merged_lse1 is lse1
    assert bufs1["k_idx"].shape[0] == b * ctx and bool((agreed1 >= 0).all())
    parser = argparse.ArgumentParser()
    dsa_decode.add_arguments(parser)
    with pytest.raises(SystemExit, match="--graph"):
        dsa_decode.main(parser.parse_args(["--small", "--device", "cpu", "--graph"]))


def test_static_planner_max_seq_len_bounds_the_index_keys_per_row():
    """``StaticPlanner(max_seq_len=L)``: the sharded index plan scores ``L / C`` local keys per
    row instead of ``max_kv_tokens / C`` (fewer chunks for the same capacity), still selects
    the oracle's top-k, and a batch with a longer sequence raises a ValueError naming
    max_seq_len before anything is planned; a max_seq_len above max_kv_tokens is refused."""
    c, topk, lens, qs = 2, 8, [300, 7], [1, 3]
    kw = dict(max_tokens=8, max_seqs=3, max_kv_tokens=900, max_q_len=4, kv=cpattn.KVSharding(c), device="cpu")
    plans = {}
    for seq_len in (None, 320):
        planner = cpattn.StaticPlanner(cpattn.get_strategy("replicated", c), max_seq_len=seq_len, **kw)
        meta = planner.plan(qs, [n - q for n, q in zip(lens, qs)], rank=0)
        plans[seq_len] = cpattn.plan_index_topk(meta, num_heads=H_I, head_dim=D_I, q_dtype=torch.float32,
                                                k_dtype=torch.float32, topk=topk, backend="gemm")
        if seq_len:
            with pytest.raises(ValueError, match=r"max_seq_len\) 321 > 320"):
                planner.plan([1], [320], rank=0)
    assert plans[None].launch.num_keys == 450 and plans[320].launch.num_keys == 160
    gen = torch.Generator().manual_seed(3)
    keys, q, w = _int_inputs(lens, qs, gen)
    k_loc = torch.cat([k[0::c] for k in keys])  # rank 0's packed shard
    rows = sum(qs)
    q_pad = torch.zeros(plans[320].meta.num_physical_tokens, H_I, D_I)
    w_pad = torch.zeros(plans[320].meta.num_physical_tokens, H_I)
    q_pad[:rows], w_pad[:rows] = q, w
    a = plans[None].candidates(q_pad, k_loc, w_pad, softmax_scale=0.25)
    b = plans[320].candidates(q_pad, k_loc, w_pad, softmax_scale=0.25)
    assert torch.equal(a.sort(1).values, b.sort(1).values)
    with pytest.raises(ValueError, match="max_seq_len must be <= max_kv_tokens"):
        cpattn.StaticPlanner(cpattn.get_strategy("replicated", c), max_seq_len=901, **kw)


def test_static_index_plan_reads_the_current_batch():
    """A static index plan keeps no per-batch state of its own: called after its planner planned
    the next batch (what a CUDA-graph replay of its step does), it selects that batch's top-k
    (the fp64 oracle's set), as the plan of that batch does."""
    c, il, r, topk = 2, 1, 0, 8
    planner = cpattn.StaticPlanner(cpattn.get_strategy("replicated", c), max_tokens=8, max_seqs=3,
                                   max_kv_tokens=900, max_q_len=4, kv=cpattn.KVSharding(c, il), device="cpu")

    def plan(lens, qs):
        meta = planner.plan(qs, [length - k for length, k in zip(lens, qs)], rank=r)
        return cpattn.plan_index_topk(meta, num_heads=H_I, head_dim=D_I, q_dtype=torch.float32,
                                      k_dtype=torch.float32, topk=topk)

    first = plan([300, 7], [1, 3])
    lens, qs = [90, 500, 2], [4, 2, 1]
    second = plan(lens, qs)
    keys, q, w = _int_inputs(lens, qs, torch.Generator().manual_seed(3))
    n = sum(qs)
    qp, wp = torch.cat([q, q.new_zeros(8 - n, H_I, D_I)]), torch.cat([w, w.new_zeros(8 - n, H_I)])
    cands = [p.candidates(qp, _shard_packed(keys, c, il, r), wp, softmax_scale=0.25) for p in (first, second)]
    assert torch.equal(cands[0], cands[1])
    # rank 0's candidates are the top-k of its own keys: the oracle over keys it owns
    sel = select_candidates(cands[0][None], topk)[:n]
    for t, (b, p) in enumerate(_rows(lens, qs)):
        mine = [j for j in range(p + 1) if (j // il) % c == r]
        s = {j: float((w[t].double()[:, None] * torch.relu(0.25 * (q[t].double() @ keys[b][mine].double().T)))
                      .sum(0)[i]) for i, j in enumerate(mine)}
        want = sorted(sorted(mine, key=lambda j: (-s[j], j))[:topk])
        assert sorted(x for x in sel[t].tolist() if x >= 0) == want
