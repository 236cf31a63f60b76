"""The "replicated" strategy: every rank computes every query (decode steps; CP off for a batch).

CPU only, no process group. Over ragged batches (lengths 0, 1, < 2C, cached prefixes, q_len 1-4,
C = 1..4): every rank owns every row in logical order, ``shard`` is the identity with zero pad
rows and the gathers return their inputs' real rows without a collective (the collective entry
point is counted); with a sharded KV cache every new row is stored exactly once, by the owner of
its position; static plans keep their addresses and give the eager plans' results; attention
over a replicated cache equals an fp64 explicit-mask oracle written here.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import cpattn
from cpattn import collectives
from cpattn.metadata import DEVICE_FIELDS
from oracle import TOLERANCE

#: the single all-gather entry point of cpattn.collectives (what the gathers would call)
_GATHER_ENTRY = "all_gather_into"


class _CountGathers:
    """Patch the collective entry point to count calls (restored on exit)."""

    def __enter__(self):
        self.calls = []
        self._orig = getattr(collectives, _GATHER_ENTRY)

        def counting(*args, **kwargs):
            self.calls.append(args)
            return self._orig(*args, **kwargs)

        setattr(collectives, _GATHER_ENTRY, counting)
        return self

    def __exit__(self, *exc):
        setattr(collectives, _GATHER_ENTRY, self._orig)


@st.composite
def batches(draw, max_seqs=5, max_prefix=200):
    """(C, extend_lens, prefix_lens, pad_multiple): q_len 0..4 with 0, 1 and < 2C lengths,
    prefixes 0, < 2C or long."""
    c = draw(st.integers(1, 4))
    n = draw(st.integers(0, max_seqs))
    ext = draw(st.lists(st.one_of(st.integers(1, 4), st.sampled_from([0, 1]), st.integers(0, 2 * c - 1)),
                        min_size=n, max_size=n))
    pre = draw(st.lists(st.one_of(st.just(0), st.integers(0, 2 * c - 1), st.integers(0, max_prefix)),
                        min_size=n, max_size=n))
    return c, ext, pre, draw(st.sampled_from([1, 4, 8]))


def _positions(ext, pre):
    return [p + j for e, p in zip(ext, pre) for j in range(e)]


# ----------------------------------------------------------------------------- placement
@settings(max_examples=80, deadline=None)
@given(batches(), st.integers(0, 2**16))
def test_every_rank_owns_every_row_in_logical_order(batch, seed):
    c, ext, pre, pad = batch
    assert not (dist.is_available() and dist.is_initialized())  # no process group anywhere
    s = cpattn.get_strategy("replicated", c, pad_multiple=pad)
    assert isinstance(s, cpattn.ReplicatedStrategy) and s.replicated
    t = sum(ext)
    g = torch.Generator().manual_seed(seed)
    seq_of = [b for b, e in enumerate(ext) for _ in range(e)]
    fps = []
    for r in range(c):
        m = s.build_metadata(ext, pre, rank=r)
        assert m.replicated and m.strategy == "replicated" and m.kv is None
        assert m.num_local_tokens == t and m.num_local_tokens_per_rank == (t,) * c
        assert m.local_token_indices.tolist() == list(range(t))  # local row t is logical row t
        assert m.local_positions.tolist() == _positions(ext, pre)
        assert m.local_seq_ids.tolist() == seq_of and m.row_seq.tolist() == seq_of
        assert m.gather_index.tolist() == list(range(t))
        p = m.num_physical_tokens
        assert p == -(-t // pad) * pad and m.num_pad_tokens == p - t
        assert m.shard_index[:t].tolist() == list(range(t))
        assert m.row_valid.tolist() == [True] * t + [False] * (p - t)
        assert m.max_q_len == max(ext, default=0)
        assert len(set(m.causal_work_per_rank)) <= 1  # every rank does the whole batch
        fps.append(m.fingerprint)

        x = torch.randn(t, 3, generator=g)
        pos3 = torch.randint(0, 1000, (3, t), generator=g)  # M-RoPE style positions, rows on dim 1
        x_local = torch.randn(p, 5, generator=g)
        k_local = torch.randn(p, 2, 4, generator=g)
        v_local = torch.randn(p, 2, 3, generator=g).half()
        idx_local = torch.randint(-1, 50, (p, 6), generator=g)
        with _CountGathers() as calls:
            xs = s.shard(x, m)
            assert xs.shape == (p, 3) and torch.equal(xs[:t], x) and not xs[t:].any()
            ps = s.shard(pos3, m, dim=1)
            assert ps.shape == (3, p) and torch.equal(ps[:, :t], pos3) and not ps[:, t:].any()
            assert torch.equal(s.gather(x_local, m, None), x_local[:t])
            k, v = s.gather_kv(k_local, v_local.float(), m, None)
            assert torch.equal(k, k_local[:t]) and torch.equal(v, v_local[:t].float())
            kp, vp = s.gather_kv(k_local, k_local, m, None, async_op=True).wait()
            assert torch.equal(kp, k_local[:t]) and torch.equal(vp, k_local[:t])
            parts = s.gather_packed([x_local, idx_local, v_local], m, None)
            assert [tuple(q.shape) for q in parts] == [(t, 5), (t, 6), (t, 2, 3)]
            assert torch.equal(parts[0], x_local[:t]) and torch.equal(parts[1], idx_local[:t])
            assert torch.equal(parts[2], v_local[:t]) and (parts[1].dtype, parts[2].dtype) == (torch.int64,
                                                                                              torch.float16)
        assert calls.calls == []  # no collective: every rank already holds every row
    assert all(f[:-1] == fps[0][:-1] for f in fps) and [f[-1] for f in fps] == list(range(c))


@settings(max_examples=80, deadline=None)
@given(batches(), st.sampled_from([1, 2, 4]))
def test_sharded_cache_stores_every_new_row_once_on_its_owner(batch, inter):
    c, ext, pre, pad = batch
    sh = cpattn.KVSharding(c, interleave=inter)
    s = cpattn.get_strategy("replicated", c, pad_multiple=pad)
    positions = torch.tensor(_positions(ext, pre), dtype=torch.int64)
    kv_lens = [e + p for e, p in zip(ext, pre)]
    stored = torch.zeros(positions.numel(), dtype=torch.int64)
    for r in range(c):
        m = s.build_metadata(ext, pre, rank=r, kv=sh)
        assert m.kv is sh and m.num_local_tokens == sum(ext)  # the queries stay replicated
        rows = m.store_rows
        assert m.num_stored_tokens == rows.numel()
        assert rows.numel() == 0 or bool((rows[1:] > rows[:-1]).all())  # increasing
        assert bool((sh.owner(positions[rows]) == r).all())
        assert torch.equal(m.store_index, sh.local_index(positions[rows]))
        assert m.local_kv_lens.tolist() == sh.local_lengths(kv_lens, r).tolist()
        assert m.local_prefix_lens.tolist() == sh.local_lengths(pre, r).tolist()
        assert m.cu_local_kv_lens.tolist() == [0] + torch.cumsum(m.local_kv_lens, 0).tolist()
        assert m.store_seq.tolist() == [m.row_seq[j].item() for j in rows.tolist()]
        stored[rows] += 1
    assert bool((stored == 1).all())  # the union over ranks: every new row exactly once
    plain = s.build_metadata(ext, pre, rank=0)
    assert plain.fingerprint[0] != s.build_metadata(ext, pre, rank=0, kv=sh).fingerprint[0]


def test_bad_replicated_plans():
    s = cpattn.get_strategy("replicated", 2)
    with pytest.raises(ValueError, match="rank must be in"):
        s.build_metadata([1], [3], rank=2)
    with pytest.raises(ValueError, match="kv has cp_size=3"):
        s.build_metadata([1], [3], rank=0, kv=cpattn.KVSharding(3))
    with pytest.raises(ValueError, match="prefix_lens must be >= 0"):
        s.build_metadata([1], [-1], rank=0)
    with pytest.raises(ValueError, match="was built by strategy='zigzag'"):
        s.shard(torch.zeros(3, 2), cpattn.ZigzagStrategy(2).build_metadata([3], rank=0))


# ----------------------------------------------------------------------------- static plans
def _paged_shard(kv_lens, sh, rank, ps, hkv, d, g, pages_per_seq):
    """This rank's paged cache of random keys (unused slots NaN) and a shuffled page table."""
    local = sh.local_lengths(kv_lens, rank).tolist()
    b = len(kv_lens)
    num_pages = b * pages_per_seq + 1
    perm = torch.randperm(num_pages, generator=g)[: b * pages_per_seq].view(b, pages_per_seq).int()
    kc = torch.full((num_pages, ps, hkv, d), float("nan"))
    vc = torch.full((num_pages, ps, hkv, d), float("nan"))
    for i, n in enumerate(local):
        j = torch.arange(n)
        kc[perm[i, j // ps].long(), j % ps] = torch.randn(n, hkv, d, generator=g)
        vc[perm[i, j // ps].long(), j % ps] = torch.randn(n, hkv, d, generator=g)
    return kc, vc, perm


def test_static_plans_keep_addresses_and_equal_eager_plans():
    c, inter, ps, hq, hkv, d = 2, 2, 4, 4, 2, 16
    sh = cpattn.KVSharding(c, interleave=inter)
    s = cpattn.get_strategy("replicated", c)
    max_tokens, max_seqs, pages_per_seq = 8, 4, 12  # 48 local keys per sequence
    planner = cpattn.StaticPlanner(s, max_tokens=max_tokens, max_seqs=max_seqs, max_kv_tokens=256, max_q_len=4,
                                   kv=sh, device="cpu")
    spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.float32, page_size=ps)
    g = torch.Generator().manual_seed(7)
    steps = [([1, 2], [40, 9]), ([4, 1, 1, 2], [0, 60, 3, 17]), ([1], [0]), ([2, 0, 3], [90, 5, 1])]
    for rank in range(c):
        ptrs = None
        for ext, pre in steps:
            kv_lens = [e + p for e, p in zip(ext, pre)]
            kc, vc, table = _paged_shard(kv_lens, sh, rank, ps, hkv, d, g, pages_per_seq)
            full_table = torch.cat([table, table.new_zeros(max_seqs - len(ext), pages_per_seq)])
            meta = planner.plan(ext, pre, rank=rank)
            assert meta.is_static and meta.num_physical_tokens == max_tokens and meta.num_seq_rows == max_seqs
            now = {name: getattr(meta, name).data_ptr() for name in DEVICE_FIELDS}
            ptrs = ptrs or now
            assert now == ptrs, [k for k in now if now[k] != ptrs[k]]
            t = sum(ext)
            q = torch.randn(max_tokens, hq, d, generator=g)
            x = torch.randn(max_tokens, 3, generator=g)
            xs = s.shard(x, meta)
            assert torch.equal(xs[:t], x[:t]) and not xs[t:].any()
            fresh = s.build_metadata(ext, pre, rank=rank, kv=sh)
            out, lse = cpattn.plan_attention(meta, spec, backend="torch").attend(q, kc, vc, page_table=full_table)
            ref, ref_lse = cpattn.plan_attention(fresh, spec, backend="torch").attend(q[:t], kc, vc, page_table=table)
            assert torch.allclose(out[:t], ref, atol=1e-5) and torch.equal(torch.isneginf(lse[:t]),
                                                                           torch.isneginf(ref_lse))
            fin = torch.isfinite(ref_lse)
            assert torch.allclose(lse[:t][fin], ref_lse[fin], atol=1e-5)
            assert (out[t:] == 0).all() and torch.isneginf(lse[t:]).all()  # pad rows 0 / -inf


# ----------------------------------------------------------------------------- attention
def _oracle(q, k, v, ext, pre, window, sinks, scale):
    """fp64 causal attention with an explicit mask: q [T, Hq, D] (logical rows), k / v packed
    per sequence (prefix then extend) -> out [T, Hq, Dv], lse [T, Hq]."""
    hq, hkv = q.shape[1], k.shape[1]
    grp = hq // hkv
    out = torch.zeros(q.shape[0], hq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((q.shape[0], hq), float("-inf"), dtype=torch.float64)
    row = off = 0
    for e, p in zip(ext, pre):
        n = e + p
        kk, vv = k[off : off + n].double(), v[off : off + n].double()
        kpos = torch.arange(n)
        for j in range(e):
            pos = p + j
            vis = kpos <= pos
            if window >= 0:
                vis &= kpos >= pos - window
            s = torch.einsum("hgd,khd->hgk", q[row].double().view(hkv, grp, -1), kk).reshape(hq, n) * scale
            s = s.masked_fill(~vis, float("-inf"))
            if sinks is not None:
                s = torch.cat([s, sinks.double()[:, None]], 1)
            l_ = torch.logsumexp(s, 1)
            pr = torch.exp(s - l_[:, None])[:, :n].reshape(hkv, grp, n)
            out[row] = torch.einsum("hgk,khd->hgd", pr, vv).reshape(hq, -1)
            lse[row] = l_
            row += 1
        off += n
    return out, lse


@settings(max_examples=40, deadline=None)
@given(batches(max_seqs=4, max_prefix=60), st.sampled_from([(4, 2), (4, 1), (2, 2)]), st.sampled_from([-1, 0, 5]),
       st.booleans(), st.integers(0, 2**16))
def test_replicated_cache_attention_equals_fp64_oracle(batch, heads, window, use_sinks, seed):
    """Replicated queries over a replicated cache: local attention (no collective), the same
    result on every rank, equal to the fp64 oracle; pad rows exactly zero."""
    c, ext, pre, pad = batch
    hq, hkv = heads
    d, dv = 16, 8
    g = torch.Generator().manual_seed(seed)
    n_kv = sum(ext) + sum(pre)
    q = torch.randn(sum(ext), hq, d, generator=g)
    k = torch.randn(n_kv, hkv, d, generator=g)
    v = torch.randn(n_kv, hkv, dv, generator=g)
    sinks = torch.randn(hq, generator=g) if use_sinks else None
    ref, ref_lse = _oracle(q, k, v, ext, pre, window, sinks, d**-0.5)
    s = cpattn.get_strategy("replicated", c, pad_multiple=pad)
    spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv, dtype=torch.float32,
                                window_size=(window, 0), has_sinks=use_sinks)
    tol = TOLERANCE[torch.float32]
    first = None
    for r in range(c):
        meta = s.build_metadata(ext, pre, rank=r)
        t = meta.num_local_tokens
        q_local = s.shard(q, meta)
        plan = cpattn.plan_attention(meta, spec, backend="torch")
        assert plan.algorithm == "local"
        with _CountGathers() as calls:
            out, lse = s.attention(q_local, k, v, meta, window_size=(window, 0), sinks=sinks, backend="torch",
                                   return_lse=True)
            planned = plan.attend(q_local, k, v, sinks=sinks)
            # one call: this rank's new K/V rows after the cached (packed) prefix; no collective
            k_new, v_new = s.shard(k[meta.kv_extend_index], meta), s.shard(v[meta.kv_extend_index], meta)
            is_prefix = torch.ones(n_kv, dtype=torch.bool)
            is_prefix[meta.kv_extend_index] = False
            one_call = plan.run(q_local, k_new, v_new, (k[is_prefix], v[is_prefix]), group=None, sinks=sinks)
        assert calls.calls == []
        assert torch.equal(planned, out) and torch.equal(one_call, out)
        assert (out[t:] == 0).all() and torch.isneginf(lse[t:]).all()
        if t:
            assert (out[:t].double() - ref).abs().max() <= tol
            assert (lse[:t].double() - ref_lse).abs().max() <= tol
        first = out if first is None else first
        assert torch.equal(out, first)  # every rank computes the same rows
