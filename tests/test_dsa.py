"""DSA (DeepSeek sparse attention) under CP: key ranges, index top-k and sparse attention against
fp64 oracles written here (explicit causal / index masks), on the torch backend and the real
Triton kernels under the interpreter; static plans; bad inputs. The distributed checks (one
gather per layer, the DSA layer under CP) are in tests/test_dsa_layer.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpattn
from cpattn import dsa
from cpattn.plan_cache import _PLANS

NAMES = ["zigzag", "interleave", "contiguous"]
FP8 = torch.float8_e4m3fn


@st.composite
def batches(draw, max_seqs: int = 4, max_len: int = 40, max_prefix: int = 20):
    """(C, extend_lens, prefix_lens, pad_multiple): C 1..8, ragged lengths incl. 0 and < 2C."""
    cp_size = draw(st.integers(1, 8))
    n = draw(st.integers(0, max_seqs))
    small = st.integers(0, 2 * cp_size)
    extend = draw(st.lists(st.one_of(small, st.integers(0, max_len)), min_size=n, max_size=n))
    prefix = draw(st.lists(st.one_of(st.just(0), st.integers(0, max_prefix)), min_size=n, max_size=n))
    return cp_size, extend, prefix, draw(st.sampled_from([1, 4]))


def _logical(extend, prefix):
    """Per logical token: (sequence, position); and the packed K/V start of every sequence."""
    seq, pos, starts, off = [], [], [], 0
    for b, (e, p) in enumerate(zip(extend, prefix)):
        starts.append(off)
        seq += [b] * e
        pos += list(range(p, p + e))
        off += e + p
    return seq, pos, starts


def _paged(parts, extend, prefix, page_size: int, gen: torch.Generator):
    """Packed per-sequence rows [N, ...] of each part -> (caches [num_pages, page_size, ...], page_table
    [B, max_pages] int32), one page assignment for all parts, pages in random order; unused table
    entries hold a huge page number (reading one would fail)."""
    kv = [e + p for e, p in zip(extend, prefix)]
    counts = [-(-n // page_size) for n in kv]
    num_pages = sum(counts) + 2
    order = torch.randperm(num_pages, generator=gen)
    caches = [torch.zeros((num_pages, page_size, *x.shape[1:]), dtype=x.dtype) for x in parts]
    table = torch.full((len(kv), max(counts + [1])), 10**6, dtype=torch.int32)
    off = used = 0
    for b, n in enumerate(kv):
        for j in range(counts[b]):
            page = int(order[used])
            used += 1
            table[b, j] = page
            lo, hi = off + j * page_size, off + min(n, (j + 1) * page_size)
            for cache, x in zip(caches, parts):
                cache[page, : hi - lo] = x[lo:hi]
        off += n
    return caches, table


# ----------------------------------------------------------------------------- fp64 oracles
def index_scores_oracle(q, k, w, extend, prefix, scale, k_scale=None):
    """fp64 index scores of every logical token over the keys of its sequence at positions
    <= its own (explicit causal mask): a list of [visible] tensors."""
    seq, pos, starts = _logical(extend, prefix)
    kd = k.double() * (k_scale.double()[:, None] if k_scale is not None else 1.0)
    out = []
    for t, (b, p) in enumerate(zip(seq, pos)):
        kv = extend[b] + prefix[b]
        mask = torch.arange(kv) <= p
        keys = kd[starts[b] : starts[b] + kv]
        s = torch.relu(scale * (q[t].double() @ keys.T))  # [H, kv]
        score = (w[t].double()[:, None] * s).sum(0)
        out.append(score[mask])
    return out


def check_selection(idx_local, meta, oracle, topk, tol):
    """Every real row selects min(topk, visible) distinct visible positions whose oracle scores
    are the top ones (compared as sorted values, so ties cannot fail it); the rest is -1."""
    n = meta.num_local_tokens
    rows = meta.local_token_indices.tolist()
    for r, t in enumerate(rows):
        scores = oracle[t]
        kk = min(topk, scores.numel())
        sel = idx_local[r].long()
        chosen = sel[sel >= 0]
        assert int((sel == -1).sum()) == topk - kk and chosen.numel() == kk, (r, sel.tolist(), kk)
        assert len(set(chosen.tolist())) == kk and all(0 <= c < scores.numel() for c in chosen.tolist())
        got = scores[chosen].sort(descending=True).values
        want = torch.topk(scores, kk).values
        assert torch.allclose(got, want, atol=tol, rtol=tol), (r, got, want)
    assert bool((idx_local[n:] == -1).all()), "pad rows must be all -1"


def sparse_oracle(q, k, v, idx, extend, prefix, scale, sinks=None):
    """fp64 sparse attention with an explicit index-and-causal mask: logical token t (position p)
    sees key j of its sequence iff j is in idx[t] and j <= p. Returns out [T, Hq, Dv], lse [T, Hq]."""
    seq, pos, starts = _logical(extend, prefix)
    t_total, hq, _ = q.shape
    g = hq // k.shape[1]
    out = torch.zeros(t_total, hq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((t_total, hq), float("-inf"), dtype=torch.float64)
    for t, (b, p) in enumerate(zip(seq, pos)):
        kv = extend[b] + prefix[b]
        mask = torch.zeros(kv, dtype=torch.bool)
        for j in idx[t].tolist():
            if 0 <= j < kv and j <= p:
                mask[j] = True
        keys, vals = k[starts[b] : starts[b] + kv].double(), v[starts[b] : starts[b] + kv].double()
        for h in range(hq):
            s = (keys[:, h // g] @ q[t, h].double()) * scale
            s = s.masked_fill(~mask, float("-inf"))
            if sinks is not None:
                s = torch.cat([s, sinks[h : h + 1].double()])
            m = s.max() if s.numel() else torch.tensor(float("-inf"), dtype=torch.float64)
            if torch.isneginf(m):
                continue
            e = torch.exp(s - m)
            denom = e.sum()
            out[t, h] = (e[:kv] / denom) @ vals[:, h // g]
            lse[t, h] = m + torch.log(denom)
    return out, lse


def _selection(extend, prefix, topk, gen):
    """Logical idx [T, topk] int32: distinct positions in [-1, kv_len + 3) per row: -1 padding,
    past (visible), future and out-of-sequence entries mixed, no duplicates."""
    seq, pos, _ = _logical(extend, prefix)
    rows = []
    for b in seq:
        span = extend[b] + prefix[b] + 4
        perm = torch.randperm(span, generator=gen)[:topk] - 1
        row = torch.full((topk,), -1, dtype=torch.int64)
        row[: perm.numel()] = perm
        rows.append(row)
    return (torch.stack(rows) if rows else torch.zeros(0, topk, dtype=torch.int64)).to(torch.int32)


# ----------------------------------------------------------------------------- key ranges
@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from(NAMES))
def test_key_ranges(batch, name):
    cp, extend, prefix, pad = batch
    s = cpattn.get_strategy(name, cp, pad_multiple=pad)
    seq, pos, starts = _logical(extend, prefix)
    for rank in range(cp):
        meta = s.build_metadata(extend, prefix, rank=rank)
        ks, ke = dsa.key_ranges(meta)
        assert ks.dtype == ke.dtype == torch.int32 and ks.shape == (meta.num_physical_tokens,)
        n = meta.num_local_tokens
        for r, t in enumerate(meta.local_token_indices.tolist()):
            assert (int(ks[r]), int(ke[r])) == (starts[seq[t]], starts[seq[t]] + pos[t] + 1)
        assert not ks[n:].any() and not ke[n:].any()


# ----------------------------------------------------------------------------- index top-k
def _index_inputs(extend, prefix, h, d, seed, dtype=torch.float32, fp8=False):
    g = torch.Generator().manual_seed(seed)
    t, n_kv = sum(extend), sum(e + p for e, p in zip(extend, prefix))
    q = torch.randn(t, h, d, generator=g).to(dtype)
    k = torch.randn(n_kv, d, generator=g)
    w = torch.randn(t, h, generator=g)
    scale = None
    if fp8:
        scale = torch.rand(n_kv, generator=g) + 0.5
        k = (k / scale[:, None]).to(FP8)
    else:
        k = k.to(dtype)
    return q, k, w, scale, g


def _check_index_topk(batch, name, backend, topk_mode, paged, fp8, seed, page_size=4):
    cp, extend, prefix, pad = batch
    s = cpattn.get_strategy(name, cp, pad_multiple=pad)
    h, d = 4, 16
    q, k, w, k_scale, g = _index_inputs(extend, prefix, h, d, seed, fp8=fp8)
    longest = max([e + p for e, p in zip(extend, prefix)] + [1])
    topk = {"below": max(1, longest // 3), "above": longest + 3}[topk_mode]
    scale = 0.3
    oracle = index_scores_oracle(q, k.float() if fp8 else k, w, extend, prefix, scale, k_scale)
    kwargs = {}
    k_all, sc = k, k_scale
    if paged:
        parts = [k.view(torch.uint8) if fp8 else k] + ([k_scale] if k_scale is not None else [])
        caches, kwargs["page_table"] = _paged(parts, extend, prefix, page_size, g)
        k_all = caches[0].view(FP8) if fp8 else caches[0]
        sc = caches[1] if k_scale is not None else None
    for rank in range(cp):
        meta = s.build_metadata(extend, prefix, rank=rank)
        ql, wl = s.shard(q, meta), s.shard(w, meta)
        idx = dsa.index_topk(ql, k_all, wl, meta, topk, softmax_scale=scale, k_scale=sc, backend=backend, **kwargs)
        assert idx.dtype == torch.int32 and idx.shape == (meta.num_physical_tokens, topk)
        check_selection(idx, meta, oracle, topk, 1e-4)


@settings(max_examples=30, deadline=None)
@given(batches(), st.sampled_from(NAMES), st.sampled_from(["below", "above"]), st.booleans(), st.integers(0, 99))
def test_index_topk_torch(batch, name, topk_mode, paged, seed):
    _check_index_topk(batch, name, "torch", topk_mode, paged, False, seed)


@settings(max_examples=8, deadline=None)
@given(batches(max_seqs=3, max_len=30), st.sampled_from(NAMES), st.sampled_from(["below", "above"]), st.booleans(),
       st.integers(0, 99))
def test_index_topk_triton(dsa_interp, batch, name, topk_mode, paged, seed):
    _check_index_topk(batch, name, "triton", topk_mode, paged, False, seed)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("paged", [False, True])
def test_index_topk_fp8_keys_with_scale(request, backend, paged):
    """fp8 e4m3 index keys with a float32 scale per key (as DeepSeek-V3.2 caches them)."""
    if backend == "triton":
        request.getfixturevalue("dsa_interp")
    _check_index_topk((3, [23, 1, 6, 0], [5, 0, 9, 3], 4), "interleave", backend, "below", paged, True, 5)


@pytest.mark.parametrize("fp8", [False, True])
def test_index_topk_whole_pages(dsa_interp, fp8):
    """Pages that hold whole key blocks (page_size 16 = the interpreter's BLOCK_N): the kernel
    reads each key block as one box of the flattened cache."""
    _check_index_topk((2, [37, 5, 20], [11, 0, 16], 1), "zigzag", "triton", "below", True, fp8, 2, page_size=16)


@pytest.mark.parametrize("page_size,block_n", [(None, 16), (16, 16), (64, 64), (5, 16)])
def test_index_topk_chunks_and_windows(dsa_interp, page_size, block_n):
    """Tiny score budgets force many row chunks and key windows merged by the running top-k:
    the selection is the same as one chunk (packed, whole-block pages, partial pages; key windows
    start BLOCK_N-aligned, so a block read as one box of a 64-key page never straddles pages)."""
    extend, prefix = [45, 3, 30], [20, 0, 77]
    s = cpattn.InterleaveStrategy(2)
    q, k, w, _, g = _index_inputs(extend, prefix, 2, 16, 3)
    oracle = index_scores_oracle(q, k, w, extend, prefix, 16**-0.5)
    kw, k_in = {}, k
    if page_size:
        (k_in,), kw["page_table"] = _paged([k], extend, prefix, page_size, g)
    for rank in range(2):
        meta = s.build_metadata(extend, prefix, rank=rank)
        ql, wl = s.shard(q, meta), s.shard(w, meta)
        for budget in (16 * 16, 16 * 48, 1 << 16):
            plan = cpattn.plans.plan_index_topk(meta, num_heads=2, head_dim=16, q_dtype=q.dtype, k_dtype=k.dtype,
                                                topk=9, page_size=page_size, backend="triton",
                                                backend_options={"max_score_elems": budget, "block_m": 16,
                                                                 "config": (block_n, 4, 1)})
            if budget == 16 * 16:
                assert max(len(c[4]) for c in plan._impl.chunks) > 1  # key windows exercised
            check_selection(plan.run(ql, k_in, wl, **kw), meta, oracle, 9, 1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_index_topk_nan_key_reaches_rows_that_see_it(request, backend):
    """A NaN index key scores NaN for every row that sees it (relu keeps NaN), and NaN ranks
    first (as in torch.topk): rows at positions >= its position select it, earlier rows and
    the other sequence never do."""
    if backend == "triton":
        request.getfixturevalue("dsa_interp")
    extend, prefix = [40, 12], [10, 0]
    s = cpattn.ZigzagStrategy(2)
    q, k, w, _, _ = _index_inputs(extend, prefix, 2, 16, 7)
    nan_pos = 23  # key position 23 of sequence 0
    k[nan_pos, 3] = float("nan")
    for rank in range(2):
        meta = s.build_metadata(extend, prefix, rank=rank)
        idx = dsa.index_topk(s.shard(q, meta), k, s.shard(w, meta), meta, 4, backend=backend)
        for sq, row0, length, pos0, stride in meta.host_segments:
            for i in range(length):
                p = pos0 + i * stride
                picked = nan_pos in idx[row0 + i].tolist()
                assert picked == (sq == 0 and p >= nan_pos), (rank, sq, p, idx[row0 + i].tolist())


def test_index_topk_writes_a_strided_out_buffer(dsa_interp):
    """``out=`` may be any int32 [P, topk] view (here a transposed buffer holding garbage):
    the selection written into it equals the one written into a fresh contiguous buffer."""
    extend, prefix = [45, 3, 30], [20, 0, 77]
    s = cpattn.InterleaveStrategy(2)
    q, k, w, _, _ = _index_inputs(extend, prefix, 2, 16, 5)
    meta = s.build_metadata(extend, prefix, rank=0)
    ql, wl = s.shard(q, meta), s.shard(w, meta)
    plan = cpattn.plans.plan_index_topk(meta, num_heads=2, head_dim=16, q_dtype=q.dtype, k_dtype=k.dtype, topk=40,
                                        backend="triton")
    want = plan.run(ql, k, wl)
    strided = torch.full((40, meta.num_physical_tokens), 7, dtype=torch.int32).t()
    got = plan.run(ql, k, wl, out=strided)
    assert got.data_ptr() == strided.data_ptr() and torch.equal(strided, want)
    assert bool((want == -1).any())  # rows with fewer than 40 visible keys: -1 slots written too


def topk_set_oracle(q, k, w, extend, prefix, scale, topk):
    """Per logical token the positions of its ``topk`` best visible keys by fp64 score, ties to
    the LOWER position (explicit causal mask), sorted and padded with -1 to ``topk`` entries."""
    out = []
    for scores in index_scores_oracle(q, k, w, extend, prefix, scale):
        order = sorted(range(scores.numel()), key=lambda j: (-float(scores[j]), j))[:topk]
        out.append(sorted(order) + [-1] * (topk - len(order)))
    return out


def _tied_inputs(extend, prefix, h, d, seed, kind):
    """Index inputs whose float32 scores are exact and tie often: integer queries in [-2, 2],
    weights in [-2, 2] (negative weights give -0.0 scores, equal to +0.0), and keys either
    quantized to {-1, 0, 1} ("quantized") or copied from a pool of 3 rows ("duplicated");
    "flat": every key equal (every visible score ties)."""
    g = torch.Generator().manual_seed(seed)
    t, n_kv = sum(extend), sum(e + p for e, p in zip(extend, prefix))
    q = torch.randint(-2, 3, (t, h, d), generator=g).float()
    w = torch.randint(-2, 3, (t, h), generator=g).float()
    if kind == "quantized":
        k = torch.randint(-1, 2, (n_kv, d), generator=g).float()
    elif kind == "duplicated":
        k = torch.randint(-2, 3, (3, d), generator=g).float()[torch.randint(0, 3, (n_kv,), generator=g)]
    else:
        k = torch.ones(n_kv, d)
    return q, k, w, g


@settings(max_examples=10, deadline=None)
@given(batches(max_seqs=3, max_len=40, max_prefix=30), st.sampled_from(NAMES),
       st.sampled_from(["quantized", "duplicated", "flat"]), st.integers(1, 12), st.booleans(),
       st.sampled_from([16 * 16, 1 << 16]), st.integers(0, 99))
def test_index_topk_ties_go_to_the_lower_position(dsa_interp, batch, name, kind, topk, paged, budget, seed):
    """Scores with many exact ties: the Triton path (interpreter; a tiny score budget cuts rows
    into chunks and keys into windows merged by the running top-k) and the torch reference
    select exactly the fp64 oracle's set per row (ties to the lower position), with the same -1
    padding; pad rows all -1."""
    cp, extend, prefix, pad = batch
    s = cpattn.get_strategy(name, cp, pad_multiple=pad)
    h, d, scale = 2, 16, 0.25
    q, k, w, g = _tied_inputs(extend, prefix, h, d, seed, kind)
    want = topk_set_oracle(q, k, w, extend, prefix, scale, topk)
    kw, k_in = {}, k
    if paged:
        (k_in,), kw["page_table"] = _paged([k], extend, prefix, 4, g)
    for rank in range(cp):
        meta = s.build_metadata(extend, prefix, rank=rank)
        ql, wl = s.shard(q, meta), s.shard(w, meta)
        got = {}
        for backend, options in (("torch", None), ("triton", {"max_score_elems": budget, "config": (16, 4, 1)})):
            plan = cpattn.plans.plan_index_topk(meta, num_heads=h, head_dim=d, q_dtype=q.dtype, k_dtype=k.dtype,
                                                topk=topk, page_size=4 if paged else None, backend=backend,
                                                backend_options=options)
            got[backend] = plan.run(ql, k_in, wl, softmax_scale=scale, **kw)
        rows = meta.local_token_indices.tolist()
        for backend, idx in got.items():
            sets = [sorted(r) for r in idx.tolist()]
            assert [sorted(x for x in r if x >= 0) + [-1] * r.count(-1) for r in sets[: len(rows)]] == \
                [want[t] for t in rows], backend
            assert bool((idx[len(rows):] == -1).all()), backend
        assert torch.equal(got["triton"].sort(1).values, got["torch"].sort(1).values)


def test_index_topk_flat_scores_select_the_first_positions(dsa_interp):
    """Every visible key scores the same: each row selects positions 0 .. topk - 1 (or all it
    sees), on both backends, whichever rank and key window holds them."""
    extend, prefix, topk = [70, 9], [30, 0], 7
    s = cpattn.ZigzagStrategy(2)
    q, k, w, _ = _tied_inputs(extend, prefix, 2, 16, 0, "flat")
    w = w.abs() + 1  # positive scores (w > 0 with q . k of either sign)
    for rank in range(2):
        meta = s.build_metadata(extend, prefix, rank=rank)
        for backend, options in (("torch", None), ("triton", {"max_score_elems": 16 * 16})):
            idx = dsa.index_topk(s.shard(q, meta), k, s.shard(w, meta), meta, topk, backend=backend,
                                 backend_options=options)
            for r, p in enumerate(meta.local_positions.tolist()):
                assert sorted(idx[r].tolist()) == [-1] * max(0, topk - p - 1) + list(range(min(topk, p + 1))), \
                    (backend, r, p)


@settings(max_examples=40, deadline=None)
@given(batches(max_seqs=4, max_len=700, max_prefix=300), st.sampled_from(NAMES),
       st.sampled_from([16 * 16, 16 * 48, 1 << 12, 1 << 16]), st.integers(0, 7))
def test_index_chunks_follow_the_triangle_and_fill_launch_groups(batch, name, budget, rank_seed):
    """The index plan's host geometry over ragged batches: chunks are consecutive whole tiles
    under the budget and (when they hold several tiles) within CHUNK_SLACK of their tiles' own
    rows x keys; their windows cover [0, width) once; launch groups hold the pieces (chunk
    windows) in order, at most ``budget`` values unless one piece is larger, and list every
    (tile, window) entry exactly once with its piece's place in the group buffer."""
    from cpattn.kernels import dsa_backend as db

    cp, extend, prefix, pad = batch
    meta = cpattn.get_strategy(name, cp, pad_multiple=pad).build_metadata(extend, prefix, rank=rank_seed % cp)
    tiles = db._row_order_tiles(meta, 16)
    chunks = db._chunks(tiles, budget, 16, 16)
    keys, lens = tiles["keys"].tolist(), tiles["len"].tolist()
    assert [c[0] for c in chunks] == [sum(c[1] for c in chunks[:i]) for i in range(len(chunks))]
    assert sum(c[1] for c in chunks) == len(keys)
    for t0, nt, r0, rows, windows in chunks:
        width = sum(w for _, w in windows)
        assert [p for p, _ in windows] == [sum(w for _, w in windows[:i]) for i in range(len(windows))]
        assert width >= max(keys[t0 : t0 + nt]) and width % 16 == 0
        if nt > 1:
            area = sum(lens[t] * keys[t] for t in range(t0, t0 + nt))
            assert rows * width <= budget and rows * width <= db.CHUNK_SLACK * area
    groups, tab = db._launch_groups(chunks, budget)
    flat = [pc for g in groups for pc in g[4]]
    assert [(rows, r0, p_lo, w, last) for rows, r0, _, p_lo, w, last in flat] == [
        (c[3], c[2], p, w, i == len(c[4]) - 1) for c in chunks for i, (p, w) in enumerate(c[4])]
    seen = []
    for e0, entries, widest, used, pieces in groups:
        assert used <= budget or len(pieces) == 1
        assert widest == max(pc[4] for pc in pieces)
        base = 0
        for rows, _, b, _, w, _ in pieces:
            assert b == base
            base += rows * w
        assert base == used
        for e in range(e0, e0 + entries):
            t, piece = int(tab["entry_tile"][e]), int(tab["entry_piece"][e])
            seen.append((t, int(tab["piece_plo"][piece])))
            assert int(tab["piece_row0"][piece]) <= int(tiles["row0"][t])
    want = [(t, p) for t0, nt, _, _, windows in chunks for p, _ in windows for t in range(t0, t0 + nt)]
    assert sorted(seen) == sorted(want) and len(seen) == len(want)


# ----------------------------------------------------------------------------- sparse attention
def _sparse_inputs(extend, prefix, form, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    t, n_kv = sum(extend), sum(e + p for e, p in zip(extend, prefix))
    if form == "absorbed":  # MQA over a latent: D = 32 + 16, Dv = 32, v a view of k
        hq, d, dv = 4, 48, 32
        k = torch.randn(n_kv, 1, d, generator=g).to(dtype)
        v = k[..., :dv]
    else:  # per-head GQA 4 / 2, D 24 (16 + 8 padded), Dv 16
        hq, d, dv = 4, 24, 16
        k = torch.randn(n_kv, 2, d, generator=g).to(dtype)
        v = torch.randn(n_kv, 2, dv, generator=g).to(dtype)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    return q, k, v, g


def _check_sparse(batch, name, backend, form, paged, sinks, topk_mode, seed, dtype=torch.float32, tol=2e-5):
    cp, extend, prefix, pad = batch
    s = cpattn.get_strategy(name, cp, pad_multiple=pad)
    q, k, v, g = _sparse_inputs(extend, prefix, form, seed, dtype)
    longest = max([e + p for e, p in zip(extend, prefix)] + [1])
    topk = {"below": max(1, longest // 2), "above": longest + 5}[topk_mode]
    idx = _selection(extend, prefix, topk, g)
    sk = torch.randn(q.shape[1], generator=g) if sinks else None
    ref, ref_lse = sparse_oracle(q, k, v, idx, extend, prefix, 0.2, sk)
    kw = {}
    k_in, v_in = k, v
    if paged:
        (k_in, v_full), kw["page_table"] = _paged([k, v.contiguous()], extend, prefix, 4, g)
        v_in = k_in[..., : v.shape[-1]] if form == "absorbed" else v_full
    for rank in range(cp):
        meta = s.build_metadata(extend, prefix, rank=rank)
        ql, il = s.shard(q, meta), s.shard(idx, meta)
        out, lse = s.sparse_attention(ql, k_in, v_in, meta, il, softmax_scale=0.2, sinks=sk, backend=backend,
                                      return_lse=True, **kw)
        n, rows = meta.num_local_tokens, meta.local_token_indices
        assert out.shape == (meta.num_physical_tokens, q.shape[1], v.shape[-1]) and out.dtype == q.dtype
        if n:
            assert (out[:n].double() - ref[rows]).abs().max() <= tol
            want = ref_lse[rows]
            assert torch.equal(torch.isneginf(lse[:n]), torch.isneginf(want))  # no valid key (no sink): -inf
            fin = torch.isfinite(want)
            if fin.any():
                assert (lse[:n].double()[fin] - want[fin]).abs().max() <= tol
        assert bool((out[n:] == 0).all()) and bool(torch.isneginf(lse[n:]).all()), "pad rows must be 0 / -inf"


@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from(NAMES), st.sampled_from(["absorbed", "gqa"]), st.booleans(), st.booleans(),
       st.sampled_from(["below", "above"]), st.integers(0, 99))
def test_sparse_attention_torch(batch, name, form, paged, sinks, topk_mode, seed):
    _check_sparse(batch, name, "torch", form, paged, sinks, topk_mode, seed)


@settings(max_examples=10, deadline=None)
@given(batches(max_seqs=3, max_len=30), st.sampled_from(NAMES), st.sampled_from(["absorbed", "gqa"]), st.booleans(),
       st.booleans(), st.sampled_from(["below", "above"]), st.integers(0, 99))
def test_sparse_attention_triton(dsa_interp, batch, name, form, paged, sinks, topk_mode, seed):
    _check_sparse(batch, name, "triton", form, paged, sinks, topk_mode, seed)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sparse_attention_bf16(request, backend):
    if backend == "triton":
        request.getfixturevalue("dsa_interp")
    _check_sparse((2, [19, 4, 0], [6, 0, 3], 1), "interleave", backend, "absorbed", False, False, "below", 1,
                  dtype=torch.bfloat16, tol=3e-2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sparse_equals_dense_when_every_key_is_selected(request, backend):
    """Selecting all keys (topk above every sequence, no causal mask in the selection) gives
    dense causal attention: the causal rule alone keeps it causal."""
    if backend == "triton":
        request.getfixturevalue("dsa_interp")
    extend, prefix = [17, 5, 1], [4, 0, 2]
    s = cpattn.InterleaveStrategy(3)
    q, k, v, _ = _sparse_inputs(extend, prefix, "gqa", 2)
    seq, _, _ = _logical(extend, prefix)
    idx = torch.arange(24, dtype=torch.int32).repeat(len(seq), 1)
    for rank in range(3):
        meta = s.build_metadata(extend, prefix, rank=rank)
        ql, il = s.shard(q, meta), s.shard(idx, meta)
        out, lse = s.sparse_attention(ql, k, v, meta, il, backend=backend, return_lse=True)
        ref, ref_lse = s.attention(ql, k, v, meta, backend="torch", return_lse=True)
        assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sparse_nan_reaches_only_rows_that_select_it(request, backend):
    if backend == "triton":
        request.getfixturevalue("dsa_interp")
    extend = [12]
    s = cpattn.ContiguousStrategy(1, pad_multiple=4)
    meta = s.build_metadata(extend, rank=0)
    q, k, v, _ = _sparse_inputs(extend, [0], "absorbed", 3)
    k[5, 0, 2] = float("nan")  # key 5 (also its value: v is a view of k)
    idx = torch.full((12, 3), -1, dtype=torch.int32)
    for t in range(12):
        idx[t, 0] = t  # itself
        idx[t, 1] = 5 if t % 2 == 0 else max(0, t - 1)  # even rows select key 5 (visible from row 5 on)
    out, lse = s.sparse_attention(q, k, k[..., :32], meta, idx, backend=backend, return_lse=True)
    for t in range(12):
        sees = t == 5 or (t % 2 == 0 and t >= 5)
        assert bool(out[t].isnan().any()) == sees, t
        assert bool(lse[t].isnan().any()) == sees, t


# ----------------------------------------------------------------------------- static plans
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_static_plans(request, backend):
    """StaticPlanner plans (capacity-sized tensors): sparse attention's row table stays at one
    address across batches; sparse attention and index top-k give the fresh plans' results."""
    if backend == "triton":
        request.getfixturevalue("dsa_interp")
    s = cpattn.InterleaveStrategy(2, pad_multiple=4)
    planner = cpattn.StaticPlanner(s, max_tokens=48, max_seqs=4, max_kv_tokens=80, device="cpu")
    cap = planner.capacity
    addrs = set()
    for extend, prefix in (([20, 3, 0], [5, 0, 4]), ([31, 9], [0, 11])):
        t, n_kv = sum(extend), sum(e + p for e, p in zip(extend, prefix))
        q, k, v, g = _sparse_inputs(extend, prefix, "absorbed", 4)
        idx = _selection(extend, prefix, 6, g)
        qi, ki, wi, _, _ = _index_inputs(extend, prefix, 2, 16, 4)
        pad_rows = lambda x, n: torch.cat([x, x.new_zeros(n - x.shape[0], *x.shape[1:])])  # noqa: E731
        for rank in range(2):
            meta = planner.plan(extend, prefix, rank=rank)
            fresh = s.build_metadata(extend, prefix, rank=rank)
            n = fresh.num_local_tokens
            ql, il = s.shard(pad_rows(q, cap.max_tokens), meta), s.shard(pad_rows(idx, cap.max_tokens), meta)
            kc = pad_rows(k, cap.max_kv_tokens)
            out = s.sparse_attention(ql, kc, kc[..., :32], meta, il, backend=backend)
            ref = s.sparse_attention(s.shard(q, fresh), k, k[..., :32], fresh, s.shard(idx, fresh), backend="torch")
            assert torch.allclose(out[:n], ref[:n], atol=1e-5) and not out[n:].any()
            plan = next(p for key, p in _PLANS[meta].items()
                        if isinstance(key[0], cpattn.AttentionSpec) and key[0].sparse)
            if backend == "triton":
                addrs.add(plan._impl.plan_args["row_pos"].data_ptr())
            sel = dsa.index_topk(s.shard(pad_rows(qi, cap.max_tokens), meta), pad_rows(ki, cap.max_kv_tokens),
                                 s.shard(pad_rows(wi, cap.max_tokens), meta), meta, 5, backend=backend)
            check_selection(sel, fresh, index_scores_oracle(qi, ki, wi, extend, prefix, 16**-0.5), 5, 1e-4)
            assert sel.shape[0] == cap.max_local_tokens and bool((sel[n:] == -1).all())
    assert len(addrs) <= 1


# ----------------------------------------------------------------------------- bad inputs
def test_bad_inputs():
    s = cpattn.ZigzagStrategy(2)
    meta = s.build_metadata([6, 4], [2, 0], rank=0)
    p = meta.num_physical_tokens
    q, k, v = torch.zeros(p, 4, 48), torch.zeros(12, 1, 48), torch.zeros(12, 1, 32)
    idx = torch.zeros(p, 5, dtype=torch.int32)
    sa = s.sparse_attention
    cases = [
        (lambda: sa(q, k, v, meta, idx.float()), TypeError, "idx must be int32 or int64"),
        (lambda: sa(q, k, v, meta, idx[:-1]), ValueError, r"idx must be \[P="),
        (lambda: sa(q, k, v, meta, idx[:, :0]), ValueError, "topk .* must be >= 1"),
        (lambda: sa(q, k, v, meta, [[0]]), TypeError, "idx must be a torch.Tensor"),
        (lambda: sa(q, k[:, :, :40], v, meta, idx), ValueError, "k head dim"),
        (lambda: sa(q, k[:-1], v[:-1], meta, idx, backend="torch"), ValueError, "packed k/v must be"),
        (lambda: sa(q.half(), k, v, meta, idx, backend="torch"), TypeError, "dtype"),
        (lambda: sa(q[:, :3], k.expand(12, 2, 48), v.expand(12, 2, 32), meta, idx), ValueError, "multiple of Hkv"),
        (lambda: sa(q, k, v, meta, idx, backend="cudnn"), ValueError, "backend must be one of"),
        (lambda: sa(q, k, v, meta, idx, page_table=torch.zeros(2, 3, dtype=torch.int32)), ValueError, "k and v must be"),
    ]
    for fn, exc, match in cases:
        with pytest.raises(exc, match=match):
            fn()
    big = torch.zeros(12, 1, 1100)
    with pytest.raises(NotImplementedError, match="backend 'triton'"):
        sa(torch.zeros(p, 4, 1100), big, big, meta, idx, backend="triton")

    qi, ki, w = torch.zeros(p, 2, 16), torch.zeros(12, 16), torch.zeros(p, 2)
    it = dsa.index_topk
    cases = [
        (lambda: it(qi, ki, w, meta, 0), ValueError, "topk must be >= 1"),
        (lambda: it(qi, ki, w, meta, 2.0), TypeError, "topk must be an int"),
        (lambda: it(qi, ki, w[:, :1], meta, 3), ValueError, "weights must be"),
        (lambda: it(qi, ki[:, :8], w, meta, 3), ValueError, "k_idx_all must be"),
        (lambda: it(qi[:-1], ki, w[:-1], meta, 3, backend="torch"), ValueError, "q_idx must be"),
        (lambda: it(qi, ki[:-1], w, meta, 3, backend="torch"), ValueError, "k_idx must be"),
        (lambda: it(qi, ki, w, meta, 3, k_scale=torch.ones(12, dtype=torch.float16), backend="torch"), ValueError,
         "k_scale must be float32"),
        (lambda: it(qi, ki.long(), w, meta, 3), TypeError, "k_idx_all must be a float"),
        (lambda: it(qi, ki, w, "meta", 3), TypeError, "meta must be a CPMetadata"),
    ]
    for fn, exc, match in cases:
        with pytest.raises(exc, match=match):
            fn()
    with pytest.raises(NotImplementedError, match="backend 'triton'"):
        it(qi, ki.double(), w, meta, 3, backend="triton")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_strided_views(request, backend):
    """Row-strided views (as gather_packed returns), transposed weights and a strided idx give
    the results of their contiguous copies."""
    if backend == "triton":
        request.getfixturevalue("dsa_interp")
    extend, prefix = [21, 6], [3, 0]
    s = cpattn.InterleaveStrategy(2, pad_multiple=4)
    q, k, w, _, g = _index_inputs(extend, prefix, 2, 16, 8)
    k_wide = torch.randn(k.shape[0], 40, generator=g)
    k_wide[:, 8:24] = k
    k_view = k_wide[:, 8:24]  # row stride 40
    qs, ks, vs, _ = _sparse_inputs(extend, prefix, "absorbed", 8)
    idx = _selection(extend, prefix, 7, g)
    for rank in range(2):
        meta = s.build_metadata(extend, prefix, rank=rank)
        ql, wl = s.shard(q, meta), s.shard(w, meta)
        w_t = wl.t().contiguous().t()  # column-major [P, H]
        a = dsa.index_topk(ql, k_view, w_t, meta, 5, backend=backend)
        b = dsa.index_topk(ql.contiguous(), k_view.contiguous(), wl.contiguous(), meta, 5, backend=backend)
        assert torch.equal(a.sort(1).values, b.sort(1).values)
        qsl, il = s.shard(qs, meta), s.shard(idx, meta)
        il_strided = torch.cat([il, il], 1)[:, ::2]
        q_pad = torch.cat([qsl, qsl], 2)[..., :48]
        o1 = s.sparse_attention(q_pad, ks, vs, meta, il_strided, backend=backend)
        o2 = s.sparse_attention(qsl.contiguous(), ks, vs.contiguous(), meta, il.contiguous(), backend=backend)
        assert torch.allclose(o1, o2, atol=1e-6)


def test_sparse_family_dispatch(dsa_interp):
    """The triton sparse backend picks its kernel family at plan time (``plan.family``): the
    portable kernel under the interpreter (the mla family needs Gluon on sm_90), ``family="mla"``
    raises naming why it cannot run, unknown families raise; the mla family's host checks (``v``
    a view of ``k[..., :512]`` with 16-byte rows; heads per program) hold on CPU tensors."""
    from cpattn.kernels import triton_mla

    s = cpattn.get_strategy("interleave", 2)
    meta = s.build_metadata([40], [3], rank=1)
    spec = cpattn.AttentionSpec(num_q_heads=16, num_kv_heads=1, head_dim=576, head_dim_v=512, dtype=torch.float32,
                                topk=8)
    assert cpattn.plan_attention(meta, spec, backend="triton").family == "portable"
    assert cpattn.plan_attention(meta, spec, backend="torch").family == "torch"
    forced = cpattn.plan_attention(meta, spec, backend="triton", backend_options={"family": "portable"})
    assert forced.family == "portable"
    with pytest.raises(ValueError, match="mla sparse kernel cannot run this plan: the CPU interpreter"):
        cpattn.plan_attention(meta, spec, backend="triton", backend_options={"family": "mla"})
    with pytest.raises(ValueError, match="family must be one of"):
        cpattn.plan_attention(meta, spec, backend="triton", backend_options={"family": "sm90"})
    assert "head dims" in triton_mla.sparse_unsupported_reason(192, 128, 1, torch.bfloat16, torch.device("cpu"))
    assert "num_kv_heads" in triton_mla.sparse_unsupported_reason(576, 512, 2, torch.bfloat16, torch.device("cpu"))
    assert "dtype" in triton_mla.sparse_unsupported_reason(576, 512, 1, torch.float32, torch.device("cpu"))
    lat = torch.zeros(10, 1, 576, dtype=torch.bfloat16)
    assert triton_mla.sparse_layout_ok(lat, lat[..., :512])
    assert not triton_mla.sparse_layout_ok(lat, lat[..., :512].clone())  # a separate value tensor
    assert not triton_mla.sparse_layout_ok(lat[:, :, 1:], lat[:, :, 1:513])  # rows not 16-byte aligned
    wide = torch.zeros(10, 1, 580, dtype=torch.bfloat16)[..., :576]  # 1160-byte rows: not a multiple of 16
    assert not triton_mla.sparse_layout_ok(wide, wide[..., :512])
    paged = torch.zeros(3, 5, 1, 576, dtype=torch.bfloat16)
    assert triton_mla.sparse_layout_ok(paged, paged[..., :512])
    assert [triton_mla.sparse_head_pack(h) for h in (128, 64, 16, 96, 7)] == [64, 64, 16, 48, 7]


def test_bench_sparse_smoke(tmp_path):
    """``python benchmarks/run.py sparse --small --device cpu``: both ops timed, JSON and PNG written."""
    import argparse
    import json

    from benchmarks import sparse as bench_sparse

    parser = argparse.ArgumentParser()
    bench_sparse.add_arguments(parser)
    out = tmp_path / "sparse"
    args = parser.parse_args(["--small", "--device", "cpu", "--seqs", "200", "--cp", "2", "--iters", "1",
                              "--warmup", "0", "--out", str(out)])
    assert bench_sparse.main(args) == 0
    rows = json.loads((tmp_path / "sparse.json").read_text())["rows"]
    assert [r["op"] for r in rows] == ["index_topk", "sparse_attention"]
    assert rows[1]["options"] == {}
    assert all(r["ms"] > 0 and r["work"] > 0 for r in rows)
    pytest.importorskip("matplotlib")
    assert (tmp_path / "sparse.png").exists()
