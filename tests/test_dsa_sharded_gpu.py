"""DSA decode over a sharded cache on the GPU at DeepSeek-V3.2 sizes (``-m gpu``; skipped without
CUDA): 128 heads, latent 512 + rope 64 (D 576 / Dv 512), indexer 64 heads x 128, top-k 2048.
C ranks are simulated on one GPU by slicing the shards. The agreed selection equals an fp64
oracle's top-k (ties: the lower position) exactly, with the Triton shard scores and the gemm
ones (and ``IndexTopkPlan.select`` the same set as ``select_candidates``), and selects the same scores as the single-GPU prefill index top-k (Triton); the merged sparse attention over the shards equals the
single-GPU sparse attention (Triton) and an fp64 oracle; a CUDA graph of one rank's step
(candidates + sparse attention) replays for another batch of its static planner."""

from __future__ import annotations

import pytest
import torch

import cpattn
from cpattn import dsa
from cpattn.merge import merge_states
from cpattn.plans.sparse import select_candidates

pytestmark = pytest.mark.gpu
DEV = "cuda"
HI, DI, TOPK = 64, 128, 2048
HQ, D, DV = 128, 576, 512
SCALE_I = 1 / 16  # a power of two: integer-valued index scores stay exact in float32
LENS, QS = [20000, 4100, 700, 2300], [1, 2, 4, 1]


def _owned(length: int, c: int, il: int, r: int) -> torch.Tensor:
    p = torch.arange(length, device=DEV)
    return p[(p // il) % c == r]


def _packed_shard(per_seq, c, il, r):
    return torch.cat([x[_owned(x.shape[0], c, il, r)] for x in per_seq])


def _paged_shard(per_seq, c, il, r, page, gen):
    """This rank's paged cache (NaN in unused slots; bytes: an fp8 NaN) and page table (random page
    order)."""
    local = [x[_owned(x.shape[0], c, il, r)] for x in per_seq]
    counts = [-(-x.shape[0] // page) for x in local]
    total = sum(counts)
    order = torch.randperm(max(total, 1), device=DEV, generator=gen)
    fill = float("nan") if per_seq[0].dtype.is_floating_point else 0x7F  # uint8 0x7F: an fp8 e4m3 NaN
    cache = torch.full((max(total, 1), page, *per_seq[0].shape[1:]), fill, device=DEV, dtype=per_seq[0].dtype)
    table = torch.zeros(len(local), max(counts + [1]), dtype=torch.int32, device=DEV)
    used = 0
    for b, x in enumerate(local):
        pages = order[used:used + counts[b]]
        used += counts[b]
        table[b, : counts[b]] = pages.to(torch.int32)
        j = torch.arange(x.shape[0], device=DEV)
        cache[pages[j // page], j % page] = x
    return cache, table


def _meta(c, il, r, lens=LENS, qs=QS):
    pre = [n - q for n, q in zip(lens, qs)]
    return cpattn.get_strategy("replicated", c).build_metadata(qs, pre, rank=r, kv=cpattn.KVSharding(c, il)).to(DEV)


def _rows(lens, qs):
    return [(b, n - q + i) for b, (n, q) in enumerate(zip(lens, qs)) for i in range(q)]


def _index_inputs(seed: int, lens=LENS, qs=QS):
    """Integer-valued bf16 index queries / keys and float32 weights (exact scores, many ties)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    keys = [torch.randint(-2, 3, (n, DI), device=DEV, generator=gen).to(torch.bfloat16) for n in lens]
    q = torch.randint(-2, 3, (sum(qs), HI, DI), device=DEV, generator=gen).to(torch.bfloat16)
    w = torch.randint(-2, 3, (sum(qs), HI), device=DEV, generator=gen).float()
    return keys, q, w, gen


def _oracle_scores(keys, q, w, lens, qs):
    out = []
    for t, (b, p) in enumerate(_rows(lens, qs)):
        s = torch.relu(SCALE_I * (q[t].double() @ keys[b][: p + 1].double().T))
        out.append((w[t].double()[:, None] * s).sum(0))
    return out


def _oracle_topk(scores):
    """Per row: the sorted topk positions (ties: the lower position; stable sort over ascending
    positions), -1 padded."""
    rows = []
    for s in scores:
        sel = torch.sort(-s, stable=True).indices[:TOPK].sort().values.tolist()
        rows.append(sel + [-1] * (TOPK - len(sel)))
    return rows


def _sorted(idx):
    return [sorted(p for p in row if p >= 0) + [-1] * sum(p < 0 for p in row) for row in idx.tolist()]


def _agreed(keys, q, w, c, il, paged, gen, lens=LENS, qs=QS, backend="auto"):
    cands = []
    for r in range(c):
        meta = _meta(c, il, r, lens, qs)
        plan = cpattn.plan_index_topk(meta, num_heads=HI, head_dim=DI, q_dtype=q.dtype, k_dtype=q.dtype, topk=TOPK,
                                      page_size=64 if paged else None, backend=backend)
        assert plan.backend == ("triton" if backend == "auto" else backend)
        if paged:
            k_loc, table = _paged_shard(keys, c, il, r, 64, gen)
            cands.append(plan.candidates(q, k_loc, w, page_table=table, softmax_scale=SCALE_I))
        else:
            cands.append(plan.candidates(q, _packed_shard(keys, c, il, r), w, softmax_scale=SCALE_I))
    agreed = select_candidates(torch.stack(cands), TOPK)
    # the plan's own agreement (what run() does after its all-gather): the same set
    assert torch.equal(plan.select(torch.stack(cands)).sort(1).values, agreed.sort(1).values)
    return agreed


@pytest.mark.parametrize("backend", ["triton", "gemm"])
@pytest.mark.parametrize("c,il,paged", [(1, 1, False), (2, 1, True), (4, 1, False), (8, 2, True), (8, 1, False)])
def test_agreed_topk_equals_oracle_and_single_gpu(c, il, paged, backend):
    keys, q, w, gen = _index_inputs(c)
    scores = _oracle_scores(keys, q, w, LENS, QS)
    got = _agreed(keys, q, w, c, il, paged, gen, backend=backend)
    assert _sorted(got) == _oracle_topk(scores)
    # the single-GPU index top-k (Triton) over the whole cache of the same step: the same scores
    pre = [n - k for n, k in zip(LENS, QS)]
    meta1 = cpattn.get_strategy("replicated", 1).build_metadata(QS, pre, rank=0).to(DEV)
    single = dsa.index_topk(q, torch.cat(keys), w, meta1, TOPK, softmax_scale=SCALE_I)
    for t, s in enumerate(scores):
        a = s[[p for p in got[t].tolist() if p >= 0]].sort().values
        b = s[[p for p in single[t].tolist() if p >= 0]].sort().values
        assert torch.equal(a, b), t


def _sparse_oracle(qa, ka, sel, lens, qs, scale):
    out = torch.zeros(qa.shape[0], HQ, DV, dtype=torch.float64, device=DEV)
    for t, (b, p) in enumerate(_rows(lens, qs)):
        chosen = torch.tensor([j for j in sel[t] if 0 <= j <= p], device=DEV, dtype=torch.long)
        k = ka[b][chosen, 0].double()  # [n, D]
        s = (qa[t].double() @ k.T) * scale  # [HQ, n]
        out[t] = torch.softmax(s, -1) @ k[:, :DV]
    return out


@pytest.mark.parametrize("c,il,paged", [(2, 1, False), (4, 1, True), (8, 1, False), (8, 4, True)])
def test_sharded_sparse_attention_equals_single_gpu(c, il, paged):
    keys, q, w, gen = _index_inputs(10 + c)
    sel = _agreed(keys, q, w, c, il, False, gen)
    ka = [torch.randn(n, 1, D, device=DEV, generator=gen).to(torch.bfloat16) for n in LENS]
    qa = torch.randn(sum(QS), HQ, D, device=DEV, generator=gen).to(torch.bfloat16)
    scale = 192**-0.5
    spec = cpattn.AttentionSpec(num_q_heads=HQ, num_kv_heads=1, head_dim=D, head_dim_v=DV, dtype=torch.bfloat16,
                                topk=TOPK, page_size=64 if paged else None)
    outs, lses = [], []
    for r in range(c):
        plan = cpattn.plan_attention(_meta(c, il, r), spec)
        assert plan.algorithm == "shard_merge" and plan.backend == "triton"
        if paged:
            k_loc, table = _paged_shard(ka, c, il, r, 64, gen)
            o, lse = plan.attend(qa, k_loc, k_loc[..., :DV], sel, page_table=table, softmax_scale=scale)
        else:
            k_loc = _packed_shard(ka, c, il, r)
            o, lse = plan.attend(qa, k_loc, k_loc[..., :DV], sel, softmax_scale=scale)
        outs.append(o)
        lses.append(lse)
    out, _ = merge_states(torch.stack(outs), torch.stack(lses))
    pre = [n - k for n, k in zip(LENS, QS)]
    meta1 = cpattn.get_strategy("replicated", 1).build_metadata(QS, pre, rank=0).to(DEV)
    single_plan = cpattn.plan_attention(meta1, spec.replace(page_size=None))
    k_all = torch.cat(ka)
    single = single_plan.attend(qa, k_all, k_all[..., :DV], sel, softmax_scale=scale)
    want = _sparse_oracle(qa, ka, sel.tolist(), LENS, QS, scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), single.float(), atol=2e-2, rtol=2e-2)


def test_cuda_graph_replay_of_one_ranks_step():
    """One rank's step (candidates over its shard + sparse attention over its selected keys,
    selection from the candidates of this rank alone) captured once from a static planner, replayed
    after planning another batch into the same buffers: equals the eager result of that batch."""
    c, il, r = 4, 1, 1
    cap_tokens, cap_seqs, cap_kv = 8, 4, 32768
    planner = cpattn.StaticPlanner(cpattn.get_strategy("replicated", c), max_tokens=cap_tokens, max_seqs=cap_seqs,
                                   max_kv_tokens=cap_kv, max_q_len=4, kv=cpattn.KVSharding(c, il), device=DEV)
    spec = cpattn.AttentionSpec(num_q_heads=HQ, num_kv_heads=1, head_dim=D, head_dim_v=DV, dtype=torch.bfloat16,
                                topk=TOPK)
    local_rows = cap_kv // c + 4
    q_buf = torch.zeros(cap_tokens, HI, DI, device=DEV, dtype=torch.bfloat16)
    w_buf = torch.zeros(cap_tokens, HI, device=DEV)
    k_buf = torch.zeros(local_rows, DI, device=DEV, dtype=torch.bfloat16)
    qa_buf = torch.zeros(cap_tokens, HQ, D, device=DEV, dtype=torch.bfloat16)
    lat_buf = torch.zeros(local_rows, 1, D, device=DEV, dtype=torch.bfloat16)
    batches = [([9000, 300, 5], [1, 4, 2]), ([15000, 12, 700, 4000], [2, 1, 1, 3])]

    def load(lens, qs, seed):
        keys, q, w, gen = _index_inputs(seed, lens, qs)
        ka = [torch.randn(n, 1, D, device=DEV, generator=gen).to(torch.bfloat16) for n in lens]
        qa = torch.randn(sum(qs), HQ, D, device=DEV, generator=gen).to(torch.bfloat16)
        n = sum(qs)
        for buf, x in ((q_buf, q), (w_buf, w), (qa_buf, qa)):
            buf.zero_()
            buf[:n] = x
        k_loc, lat_loc = _packed_shard(keys, c, il, r), _packed_shard(ka, c, il, r)
        k_buf[: k_loc.shape[0]] = k_loc
        lat_buf[: lat_loc.shape[0]] = lat_loc
        meta = planner.plan(qs, [a - b for a, b in zip(lens, qs)], rank=r)
        iplan = cpattn.plan_index_topk(meta, num_heads=HI, head_dim=DI, q_dtype=torch.bfloat16,
                                       k_dtype=torch.bfloat16, topk=TOPK)
        return iplan, cpattn.plan_attention(meta, spec)

    def step(iplan, aplan):
        cand = iplan.candidates(q_buf, k_buf, w_buf, softmax_scale=SCALE_I)
        sel = select_candidates(cand[None], TOPK)
        return (sel, *aplan.attend(qa_buf, lat_buf, lat_buf[..., :DV], sel))

    plans = load(*batches[0], seed=1)
    from graph_utils import capture_graph

    results = {}

    def captured():
        results["out"] = step(*plans)

    graph = capture_graph(captured)
    eager_plans = load(*batches[1], seed=2)  # plans the second batch into the same buffers
    graph.replay()
    torch.cuda.synchronize()
    want = step(*eager_plans)
    n = sum(batches[1][1])
    sel_g, out_g, lse_g = results["out"]
    assert torch.equal(sel_g[:n], want[0][:n])
    torch.testing.assert_close(out_g[:n].float(), want[1][:n].float(), atol=0, rtol=0)
    torch.testing.assert_close(lse_g[:n], want[2][:n], atol=0, rtol=0)


@pytest.mark.parametrize("backend", ["triton", "gemm"])
@pytest.mark.parametrize("paged", [False, True])
def test_fp8_index_keys_with_scales(backend, paged):
    """DeepSeek-V3.2's cache layout: fp8 e4m3 index keys with a float32 scale per key (powers of
    two, integer keys: exact), bf16 queries; C = 8: the oracle's top-k over the dequantized keys."""
    c, il = 8, 1
    keys, q, w, gen = _index_inputs(7)
    scales = [2.0 ** torch.randint(-2, 3, (n,), device=DEV, generator=gen).float() for n in LENS]
    deq = [k.double() * s.double()[:, None] for k, s in zip(keys, scales)]
    want = _oracle_topk(_oracle_scores(deq, q, w, LENS, QS))
    k8 = [k.float().to(torch.float8_e4m3fn) for k in keys]
    cands = []
    for r in range(c):
        meta = _meta(c, il, r)
        plan = cpattn.plan_index_topk(meta, num_heads=HI, head_dim=DI, q_dtype=q.dtype, k_dtype=torch.float8_e4m3fn,
                                      topk=TOPK, page_size=64 if paged else None, has_k_scale=True, backend=backend)
        raw = [k.view(torch.uint8) for k in k8]
        if paged:
            seed = 100 + r
            k_loc, table = _paged_shard(raw, c, il, r, 64, torch.Generator(device=DEV).manual_seed(seed))
            sc, _ = _paged_shard(scales, c, il, r, 64, torch.Generator(device=DEV).manual_seed(seed))
            cands.append(plan.candidates(q, k_loc.view(torch.float8_e4m3fn), w, k_scale=sc, page_table=table,
                                         softmax_scale=SCALE_I))
        else:
            cands.append(plan.candidates(q, _packed_shard(raw, c, il, r).view(torch.float8_e4m3fn), w,
                                         k_scale=_packed_shard(scales, c, il, r), softmax_scale=SCALE_I))
    assert _sorted(select_candidates(torch.stack(cands), TOPK)) == want
