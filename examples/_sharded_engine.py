"""``examples/mini_engine.py --kv sharded``: the mini engine with a SHARDED KV cache.

Same model, requests and scheduling as ``mini_engine.py``; what changes is where the keys live:
the key at position ``p`` of every request is stored on rank ``(p // I) % C`` only
(``cpattn.KVSharding``), in that rank's own page pool, so each rank holds about 1/C of the
cache. Every cpattn call is commented ``# [cpattn]``. The run:

1. prefill a ragged batch under CP: the extend tokens are sharded by the strategy, every rank
   writes only the keys it owns (``cpattn.plan_attention`` with this rank's page table: pass-KV
   or pass-Q, see below; ``plan.run`` once per layer);
2. prefill a second batch where one request reuses a cached prompt prefix: the prefix is itself
   sharded, so local queries need every rank's prefix keys: **pass-KV** gathers the prefix
   shards, **pass-Q** all-gathers the new queries and merges the ranks' partial results back
   (the plan picks one from a cost model; ``--extend`` forces one);
3. decode steps for all requests: the "replicated" strategy places every query on every rank
   (hidden states replicated), the cache stays sharded (``kv=KVSharding``), so the plan is
   "shard_merge": ONE ``plan.run`` per layer writes the new token's K/V only on the rank that
   owns its position, attends over this rank's shard and merges the ranks' partial outputs
   exactly in ONE collective.

Greedy tokens must equal the replicated engine (``mini_engine.run_engine``); ``main`` checks it.

    python examples/mini_engine.py --kv sharded --spawn 3 --strategy zigzag --decode-steps 16
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _launch.py, mini_engine.py
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repository root: reference_layers
import mini_engine  # noqa: E402
from _launch import launch, under_torchrun  # noqa: E402
from mini_engine import EngineConfig, PagedKVCache, Request, TinyGQAModel, make_requests, rms_norm  # noqa: E402

import cpattn  # noqa: E402
from reference_layers import apply_rope  # noqa: E402


class ShardedMiniEngine:
    """Prefill / extend under CP and decode with context parallelism, one SHARDED paged cache.

    ``self.cache`` is this rank's page pool: its pages hold only keys this rank owns, densely by
    local index (local key j of a request at ``page_table[req, j // page_size]``, slot
    ``j % page_size``). Requests are this rank's view: ``req.pages`` are local pages.
    """

    def __init__(self, cfg: EngineConfig, strategy: cpattn.CPStrategy, rank: int, group, device,
                 interleave: int = 1, extend_algorithm: str = "auto") -> None:
        self.cfg, self.strategy, self.rank, self.group, self.device = cfg, strategy, rank, group, device
        self.model = TinyGQAModel(cfg, device)
        self.cache = PagedKVCache(cfg, device)
        # [cpattn] The placement rule of the cache: key p on rank (p // I) % C.
        self.sharding = cpattn.KVSharding(strategy.cp_size, interleave=interleave)
        self.sharding.check_page_size(cfg.page_size)
        # [cpattn] The layer kind, once (GQA over the paged cache; page_size a multiple of I).
        self.spec = cpattn.AttentionSpec(num_q_heads=cfg.q_heads, num_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                                         dtype=cfg.dtype, page_size=cfg.page_size, kv_dtype=cfg.kv_dtype)
        # [cpattn] Decode steps place their queries with the "replicated" strategy (every rank
        # computes every query) over the same C ranks; the keys stay sharded.
        self.decode_strategy = cpattn.get_strategy("replicated", strategy.cp_size)
        # [cpattn] Whether the ranks merged this spec's partials once: the first decode step's plan
        # checks their header (one tiny all-gather); later steps' plans skip it (agree=False).
        self.partials_agreed = False
        self.extend_algorithm = extend_algorithm
        self.cached_requests: list[Request] = []
        self.extend_algorithms_used: list[str] = []
        self.logits: list[Tensor] = []  # every forward's next-token logits (float32, CPU)

    # ------------------------------------------------------------------ scheduling (host)
    def _local(self, n: int) -> int:
        """Keys of the first n positions this rank holds."""
        return int(self.sharding.local_lengths([n], self.rank)[0])

    def _match_prefix(self, req: Request) -> None:
        """Reuse the longest cached prompt prefix, rounded down to full (global) pages as the
        replicated engine does. This rank shares the local pages the prefix fills and copies the
        prefix's keys of its last, partial local page into a fresh page (copy-on-write)."""
        ps, best = self.cache.page_size, None
        for other in self.cached_requests:
            n = 0
            limit = min(len(req.tokens) - 1, other.cached)
            while n < limit and req.tokens[n] == other.tokens[n]:
                n += 1
            n = (n // ps) * ps
            if n and (best is None or n > best[1]):
                best = (other, n)
        if best is None:
            return
        other, n = best
        local = self._local(n)
        full, rest = divmod(local, ps)
        req.pages = self.cache.share(other.pages[:full])
        if rest:
            (page,) = self.cache.alloc(1)
            src = other.pages[full]
            self.cache.k[:, page, :rest] = self.cache.k[:, src, :rest]
            self.cache.v[:, page, :rest] = self.cache.v[:, src, :rest]
            req.pages.append(page)
        req.cached = n

    def _reserve(self, req: Request, total_tokens: int) -> None:
        need = -(-self._local(total_tokens) // self.cache.page_size) - len(req.pages)
        if need > 0:
            req.pages += self.cache.alloc(need)

    def _page_table(self, reqs: list[Request]) -> Tensor:
        """This rank's page table [B, max_local_pages] int32 (host)."""
        table = torch.zeros(len(reqs), max([len(r.pages) for r in reqs] + [1]), dtype=torch.int32)
        for b, r in enumerate(reqs):
            table[b, : len(r.pages)] = torch.tensor(r.pages, dtype=torch.int32)
        return table

    def _layer_tail(self, h: Tensor, o: Tensor, w: dict) -> Tensor:
        h = h + o.reshape(h.shape[0], -1) @ w["wo"]
        x = rms_norm(h, w["mlp_norm"])
        return h + (F.silu(x @ w["w_gate"]) * (x @ w["w_up"])) @ w["w_down"]

    def _qkv(self, h: Tensor, positions: Tensor, w: dict) -> tuple[Tensor, Tensor, Tensor]:
        cfg, n = self.cfg, h.shape[0]
        x = rms_norm(h, w["attn_norm"])
        q = apply_rope((x @ w["wq"]).view(n, cfg.q_heads, cfg.head_dim), positions)
        k = apply_rope((x @ w["wk"]).view(n, cfg.kv_heads, cfg.head_dim), positions)
        v = (x @ w["wv"]).view(n, cfg.kv_heads, cfg.head_dim)
        return q, k, v

    # ------------------------------------------------------------------ extend (prefill) under CP
    @torch.no_grad()
    def _extend(self, reqs: list[Request], new: list[list[int]]) -> Tensor:
        cfg, m, s = self.cfg, self.model, self.strategy
        extend_lens = [len(t) for t in new]
        prefix_lens = [r.cached for r in reqs]
        # [cpattn] Plan once per forward with the cache's sharding (kv=): the plan also says which
        # extend rows this rank stores and their local cache indices.
        meta = s.build_metadata(extend_lens, prefix_lens, rank=self.rank, group=self.group,
                                kv=self.sharding).to(self.device)
        for r, n in zip(reqs, extend_lens):
            self._reserve(r, r.cached + n)
        table = self._page_table(reqs)
        # [cpattn] Plan the extend over the (sharded) prefix once per forward: sharded queries over
        # a sharded cache, so plan_attention picks pass-KV or pass-Q from its cost model (every
        # rank the same; algorithm= forces one), plans and validates this rank's cache writes from
        # its page table (read once here) and uploads its tables in one copy.
        plan = cpattn.plan_attention(meta, self.spec, page_table=table, num_pages=cfg.num_pages,
                                     algorithm=self.extend_algorithm)
        self.extend_algorithms_used.append(plan.algorithm)
        ids = torch.tensor([t for toks in new for t in toks], device=self.device)
        positions = torch.cat([torch.arange(r.cached, r.cached + n) for r, n in zip(reqs, extend_lens)]).to(self.device)
        ids_local, pos_local = s.shard(ids, meta), s.shard(positions, meta)  # [cpattn] [T] -> [P]
        h = m.embed[ids_local]
        for layer, w in enumerate(m.layers):
            q, k, v = self._qkv(h, pos_local, w)
            # [cpattn] One call per layer: its collectives (pass-KV: 1, pass-Q: 2), the write of
            # this rank's share of the new K/V into its cache, attention -> [P, Hq, D].
            o = plan.run(q, k, v, (self.cache.k[layer], self.cache.v[layer]), group=self.group,
                         **self.cache.layer_scales(layer))
            h = self._layer_tail(h, o, w)
        h_full = s.gather(h, meta, self.group)  # [cpattn] [P, hidden] -> [T, hidden]
        last = h_full[meta.cu_extend_lens[1:] - 1]
        for r, n in zip(reqs, extend_lens):
            r.cached += n
        logits = rms_norm(last, m.final_norm) @ m.lm_head
        self.logits.append(logits.float().cpu())
        return logits

    # ------------------------------------------------------------------ decode with CP
    @torch.no_grad()
    def _decode_forward(self, reqs: list[Request], tokens: list[int]) -> Tensor:
        cfg, m, s = self.cfg, self.model, self.decode_strategy
        q_lens, prefix_lens = [1] * len(reqs), [r.cached for r in reqs]
        # [cpattn] The plan of this decode step: the "replicated" strategy (the step's queries on
        # every rank) over the sharded cache (kv=): each rank's keys are 1/C of every request.
        dmeta = s.build_metadata(q_lens, prefix_lens, rank=self.rank, group=self.group,
                                 kv=self.sharding).to(self.device)
        for r in reqs:
            self._reserve(r, r.cached + 1)
        table = self._page_table(reqs)
        # [cpattn] Which of the new tokens this rank stores, and where (validated once per step).
        writes = cpattn.plan_cache_writes(dmeta, table, page_size=cfg.page_size, num_pages=cfg.num_pages)
        # [cpattn] Replicated queries over a sharded cache: plan_attention picks "shard_merge".
        plan = cpattn.plan_attention(dmeta, self.spec)
        table = table.to(self.device)
        ids = torch.tensor(tokens, device=self.device)
        positions = torch.tensor(prefix_lens, device=self.device)
        ids_local, pos_local = s.shard(ids, dmeta), s.shard(positions, dmeta)  # [cpattn] every row, on every rank
        h = m.embed[ids_local]  # [P, hidden], the same on every rank
        for layer, w in enumerate(m.layers):
            q, k, v = self._qkv(h, pos_local, w)
            # [cpattn] ONE call per layer: write the new K/V where this rank owns the position (only
            # the owner stores a new key), attend over this rank's keys, and merge the ranks'
            # partial outputs exactly in ONE collective -> [P, Hq, D], the same on every rank.
            o = plan.run(q, k, v, (self.cache.k[layer], self.cache.v[layer]), writes=writes, group=self.group,
                         page_table=table, agree=not self.partials_agreed, **self.cache.layer_scales(layer))
            self.partials_agreed = self.partials_agreed or bool(plan.agreed_partials)
            h = self._layer_tail(h, o, w)
        h = s.gather(h, dmeta, self.group)  # [cpattn] replicated rows: [P, hidden] -> [B, hidden], no collective
        for r in reqs:
            r.cached += 1
        logits = rms_norm(h, m.final_norm) @ m.lm_head
        self.logits.append(logits.float().cpu())
        return logits

    # ------------------------------------------------------------------ public steps
    def prefill(self, reqs: list[Request]) -> list[int]:
        for r in reqs:
            self._match_prefix(r)
            r.prefix_hit = r.cached
        logits = self._extend(reqs, [r.tokens[r.cached :] for r in reqs])
        self.cached_requests.extend(reqs)
        return mini_engine.MiniEngine._sample(reqs, logits)

    def decode(self, reqs: list[Request]) -> list[int]:
        tokens = [r.generated[-1] for r in reqs]
        for r in reqs:
            r.tokens.append(r.generated[-1])
        return mini_engine.MiniEngine._sample(reqs, self._decode_forward(reqs, tokens))

    def local_cache_contents(self, reqs: list[Request]) -> dict:
        """{rid: (k [layers, n_local, Hkv, D], v)} of this rank's cached keys, local order."""
        ps, out = self.cache.page_size, {}
        for r in reqs:
            j = torch.arange(self._local(r.cached))
            pages = torch.tensor(r.pages, dtype=torch.int64)[j // ps] if j.numel() else j
            out[r.rid] = (mini_engine.portable_cache(self.cache.k[:, pages, j % ps]),
                          mini_engine.portable_cache(self.cache.v[:, pages, j % ps]))
        return out


def run_sharded_engine(strategy_name: str, cp_size: int, rank: int, group, device, decode_steps: int = 4,
                       pad_multiple: int = 8, interleave: int = 1, extend_algorithm: str = "auto",
                       dtype: torch.dtype = torch.float32, kv_dtype: Optional[torch.dtype] = None) -> dict:
    """The mini engine scenario with a sharded cache on one rank."""
    cfg = EngineConfig(dtype=dtype, kv_dtype=kv_dtype)
    strategy = cpattn.get_strategy(strategy_name, cp_size, pad_multiple=pad_multiple)
    engine = ShardedMiniEngine(cfg, strategy, rank, group, device, interleave, extend_algorithm)
    batch1, batch2 = make_requests(cfg)
    engine.prefill(batch1)
    engine.prefill(batch2)
    everyone = batch1 + batch2
    for _ in range(decode_steps):
        engine.decode(everyone)
    used_pages = sum(1 for refs in engine.cache.refs if refs)
    return {
        "tokens": {r.rid: r.generated for r in everyone},
        "prefix_hits": {r.rid: r.prefix_hit for r in everyone},
        "extend_algorithms": engine.extend_algorithms_used,
        "local_cache": engine.local_cache_contents(everyone),
        "cached": {r.rid: r.cached for r in everyone},
        "used_pages": used_pages,
        "logits": engine.logits,
    }


def run_rank(rank: int, world_size: int, device, strategy_name: str, decode_steps: int, interleave: int,
             extend_algorithm: str, kv_dtype: Optional[torch.dtype] = None) -> dict:
    return run_sharded_engine(strategy_name, world_size, rank, None, device, decode_steps, interleave=interleave,
                              extend_algorithm=extend_algorithm, kv_dtype=kv_dtype)


def main(args) -> int:
    """``mini_engine.py --kv sharded``: run the scenario on C ranks, compare with the replicated
    engine at C = 1 (exit 1 if any rank's greedy tokens differ)."""
    use_cuda = torch.cuda.is_available() and not args.cpu
    algorithm = getattr(args, "extend", "auto")
    kv_dtype = mini_engine.KV_DTYPES[getattr(args, "kv_dtype", "auto")]
    results = launch(run_rank, args.spawn, args.strategy, args.decode_steps, getattr(args, "interleave", 1),
                     algorithm, kv_dtype, use_cuda=use_cuda)
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.spawn
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    reference = mini_engine.run_engine(args.strategy, 1, 0, None, device, decode_steps=args.decode_steps,
                                       kv_dtype=kv_dtype)["tokens"]
    ok = True
    for i, res in enumerate(results):
        rank = int(os.environ["RANK"]) if under_torchrun() else i
        same = res["tokens"] == reference
        ok &= same
        if rank == 0 or not same:
            for rid, toks in res["tokens"].items():
                print(f"rank {rank} C={world} {args.strategy} sharded KV: request {rid} greedy tokens {toks}")
            print(f"rank {rank}: extend algorithms {res['extend_algorithms']}, {res['used_pages']} local pages")
            print(f"rank {rank}: {'equal to' if same else 'DIFFERENT from'} the replicated C = 1 engine")
    return 0 if ok else 1
