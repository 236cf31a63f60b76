"""``plan.run`` (write + kernel + merge, the one-call layer path) captured once in a CUDA graph and
replayed across ragged batches, for every algorithm one GPU can run without a peer: "local"
(replicated queries over a replicated cache, C = 4: no collective; and a sharded placement at
C = 1), "shard_merge" (replicated queries over a sharded cache at C = 1) and "pass_kv" / "pass_q"
(an extend over a sharded cache at C = 1: the plan's own page table and write plan, its gather /
return maps and pass-Q's replicated view, all at the planner's fixed addresses). The collectives
of "gather_kv" and of "shard_merge" / "pass_kv" / "pass_q" at C > 1 need several GPUs (their
device tables are the same static buffers these tests replay). Each replay equals an eager
``plan.run`` of a fresh plan of the batch on a copy of the caches taken before the step; pad
rows are 0 / -inf."""

from __future__ import annotations

import pytest
import torch

import cpattn
from graph_utils import capture_graph

pytestmark = pytest.mark.gpu

HQ, HKV, D, PAGE = 16, 4, 128, 64
# (extend_lens, prefix_lens): prefill-like, decode-like (q_len 1..2) and mixed ragged batches
BATCHES = [([300, 17, 1, 90], [0, 200, 5, 3000]), ([2, 1, 1, 2, 1], [9000, 17, 5000, 1, 3]),
           ([1000], [100]), ([5, 250, 70, 64, 1, 1], [0, 0, 40, 900, 7, 0])]
CASES = {  # name: (strategy, cp_size, rank, kv layout)
    "local-replicated": ("replicated", 4, 2, None),
    "local-zigzag-c1": ("zigzag", 1, 0, None),
    "shard_merge-c1": ("replicated", 1, 0, "sharded"),
    "pass_kv-zigzag-c1": ("zigzag", 1, 0, "sharded"),
    "pass_q-zigzag-c1": ("zigzag", 1, 0, "sharded"),
}
#: algorithms whose plan owns its page table and cache writes (planned from the table at plan time)
EXTEND = ("pass_kv", "pass_q")


def _fill_caches(kc, vc, table, lens, gen):
    """Random keys at every position of each sequence through a shuffled page table (host)."""
    kc.normal_(generator=gen)
    vc.normal_(generator=gen)
    perm = torch.randperm(kc.shape[0] - 1, generator=torch.Generator().manual_seed(sum(lens))) + 1
    table.fill_(0)
    used = 0
    for b, n in enumerate(lens):
        pages = -(-n // PAGE)
        table[b, :pages] = perm[used : used + pages].to(table.dtype)
        used += pages


@pytest.mark.parametrize("case", list(CASES))
def test_gpu_plan_run_graph_replays_for_other_batches(case):
    name, cp, rank, layout = CASES[case]
    dev = torch.device("cuda")
    kv = cpattn.KVSharding(cp) if layout else None
    s = cpattn.get_strategy(name, cp, pad_multiple=16)
    planner = cpattn.StaticPlanner(s, max_tokens=2048, max_seqs=8, max_kv_tokens=32768, device=dev, kv=kv)
    cap = planner.capacity
    spec = cpattn.AttentionSpec(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=torch.bfloat16, page_size=PAGE)
    num_pages = cap.max_kv_tokens // PAGE + cap.max_seqs + 1  # page 0: the static write plan's pad slot
    kc = torch.empty(num_pages, PAGE, HKV, D, device=dev, dtype=torch.bfloat16)
    vc = torch.empty_like(kc)
    table_host = torch.zeros(cap.max_seqs, cap.max_kv_tokens // PAGE + 1, dtype=torch.int32)
    table = table_host.to(dev)
    p = cap.max_local_tokens
    q_buf = torch.zeros(p, HQ, D, device=dev, dtype=torch.bfloat16)
    k_buf = torch.zeros(p, HKV, D, device=dev, dtype=torch.bfloat16)
    v_buf = torch.zeros_like(k_buf)
    gen = torch.Generator(device=dev).manual_seed(5)

    algorithm = case.split("-")[0]

    def plan_batch(ext, pre):
        meta = planner.plan(ext, pre, rank=rank)
        if algorithm in EXTEND:
            plan = cpattn.plan_attention(meta, spec, backend="triton", algorithm=algorithm, page_table=table_host,
                                         num_pages=num_pages, pad_slot=0)
            return meta, plan, None
        plan = cpattn.plan_attention(meta, spec, backend="triton")
        writes = cpattn.plan_cache_writes(meta, table_host, page_size=PAGE, num_pages=num_pages, pad_slot=0)
        return meta, plan, writes

    _fill_caches(kc, vc, table_host, [e + q for e, q in zip(*BATCHES[0])], gen)
    table.copy_(table_host)
    meta, plan, writes = plan_batch(*BATCHES[0])
    assert plan.algorithm == algorithm

    def step():
        if algorithm in EXTEND:
            return plan.run(q_buf, k_buf, v_buf, (kc, vc), return_lse=True)
        return plan.run(q_buf, k_buf, v_buf, (kc, vc), writes=writes, page_table=table, return_lse=True)

    captured = []
    graph = capture_graph(lambda: captured.append(step()))
    g_out, g_lse = captured[-1]  # the tensors the graph writes on every replay
    for ext, pre in BATCHES:
        lens = [e + q for e, q in zip(ext, pre)]
        _fill_caches(kc, vc, table_host, lens, gen)
        table.copy_(table_host)
        meta_b, plan_b, writes_b = plan_batch(ext, pre)  # rewrites the fixed buffers the graph reads
        assert plan_b.algorithm == plan.algorithm
        fresh = s.build_metadata(ext, pre, rank=rank, kv=kv).to(dev)
        n = fresh.num_physical_tokens
        n_real = fresh.num_local_tokens
        q_buf.normal_(generator=gen)
        k_buf.normal_(generator=gen)
        v_buf.normal_(generator=gen)
        q_buf[n:] = 0
        k_ref, v_ref = kc.clone(), vc.clone()
        graph.replay()
        torch.cuda.synchronize()
        if algorithm in EXTEND:
            ref_plan = cpattn.plan_attention(fresh, spec, backend="triton", algorithm=algorithm,
                                             page_table=table_host[: len(ext)], num_pages=num_pages)
            ref, ref_lse = ref_plan.run(q_buf[:n], k_buf[:n], v_buf[:n], (k_ref, v_ref), return_lse=True)
        else:
            ref_plan = cpattn.plan_attention(fresh, spec, backend="triton")
            ref_writes = cpattn.plan_cache_writes(fresh, table_host[: len(ext)], page_size=PAGE, num_pages=num_pages)
            ref, ref_lse = ref_plan.run(q_buf[:n], k_buf[:n], v_buf[:n], (k_ref, v_ref), writes=ref_writes,
                                        page_table=table[: len(ext)], return_lse=True)
        assert torch.isfinite(g_out[:n_real]).all()
        assert (g_out[:n].float() - ref.float()).abs().max().item() < 2e-2, (case, ext, pre)
        valid = fresh.row_valid
        assert (g_lse[:n][valid] - ref_lse[valid]).abs().max().item() < 1e-3
        assert (g_out[n:] == 0).all() and torch.isneginf(g_lse[n:]).all()
        # page 0 holds the static plan's pad slot (pad rows write there); every other slot is equal
        assert torch.equal(kc[1:], k_ref[1:]) and torch.equal(vc[1:], v_ref[1:]), "replayed write != eager"
