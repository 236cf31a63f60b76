"""A tiny inference engine with a paged KV cache that prefills under context parallelism.

Every cpattn call sits where a real engine (SGLang, vLLM, ...) would make it and is commented
``# [cpattn]``. The run:

1. prefill a ragged batch (a long and a very short request) under CP over C ranks;
2. prefill a second batch: one request reuses the first request's prompt prefix from the paged
   cache (pages shared, ``prefix_len > 0``: only the new tokens are sharded), one is new;
3. a few greedy decode steps for all four requests with the "replicated" strategy: every rank
   holds the whole cache (the prefill wrote every new key on every rank), so each rank computes
   every query of the step itself (algorithm "local": no collective).

Per layer the attention is ONE call, ``plan.run(q, k, v, (k_cache, v_cache), writes=, group=,
page_table=)``: the plan (``cpattn.plan_attention``, once per forward) does the all-gather of the
new K/V where the placement needs one, the cache write and the kernel.

The greedy tokens must equal the same engine at C = 1; ``main`` checks that and exits 1 if not.

    python examples/mini_engine.py                                 # C = 1
    python examples/mini_engine.py --spawn 3 --strategy interleave # 3 local gloo ranks (CPU)
    python examples/mini_engine.py --spawn 2 --kv-dtype fp8        # an FP8 (e4m3) KV cache
    torchrun --nproc_per_node 2 examples/mini_engine.py --strategy zigzag   # NCCL on GPUs

Model: embedding, N x (RMSNorm, GQA attention with RoPE, RMSNorm, SiLU-gated MLP), RMSNorm,
lm head; seeded random weights. The cache is ``[layers, num_pages, page_size, Hkv, D]`` with
``slot = page * page_size + offset``; pages are allocated deterministically, so every rank builds
the same page tables without talking to the others.

``--kv-dtype fp8``: the cache holds float8_e4m3fn values with float32 scales per layer and KV head
(``AttentionSpec(kv_dtype=)``; ``plan.run(..., k_scale=, v_scale=)`` quantizes the new rows on the
rank that computes them, the gather moves FP8 bytes). The greedy tokens are then compared with
the FP8 engine at C = 1; ``logit_error`` measures the FP8 engine against the unquantized one.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _launch.py, mini_engine.py
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repository root: reference_layers
from _launch import launch, under_torchrun  # noqa: E402

import cpattn  # noqa: E402
from reference_layers import apply_rope  # noqa: E402


@dataclass(frozen=True)
class EngineConfig:
    vocab: int = 128
    hidden: int = 64
    layers: int = 2
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    mlp: int = 128
    page_size: int = 4
    num_pages: int = 64
    seed: int = 0
    dtype: torch.dtype = torch.float32
    #: the cache dtype: None (the model dtype) or torch.float8_e4m3fn
    kv_dtype: Optional[torch.dtype] = None
    #: FP8 caches: the K and V scale of every layer and KV head (x / scale is stored; |k|, |v| of
    #: this model stay below ~8, so 1/32 keeps them inside e4m3's normal range, +-448 * scale = 14;
    #: an engine calibrates them, e.g. amax / 448 over a calibration batch)
    kv_scale: float = 1 / 32


class TinyGQAModel:
    """Weights only (seeded); the forward lives in the engine because CP calls sit inside it."""

    def __init__(self, cfg: EngineConfig, device) -> None:
        gen = torch.Generator().manual_seed(cfg.seed)

        def w(*shape: int) -> Tensor:
            return (torch.randn(*shape, generator=gen) * shape[0] ** -0.5).to(device, cfg.dtype)

        h, qd, kd = cfg.hidden, cfg.q_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.embed = (torch.randn(cfg.vocab, h, generator=gen)).to(device, cfg.dtype)
        self.layers = [
            dict(
                attn_norm=1 + 0.1 * w(h),
                wq=w(h, qd),
                wk=w(h, kd),
                wv=w(h, kd),
                wo=w(qd, h),
                mlp_norm=1 + 0.1 * w(h),
                w_gate=w(h, cfg.mlp),
                w_up=w(h, cfg.mlp),
                w_down=w(cfg.mlp, h),
            )
            for _ in range(cfg.layers)
        ]
        self.final_norm = 1 + 0.1 * w(h)
        self.lm_head = w(h, cfg.vocab)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class PagedKVCache:
    """K/V page pool ``[layers, num_pages, page_size, Hkv, D]`` with reference-counted pages
    (shared prefix pages count their users; this example never evicts)."""

    def __init__(self, cfg: EngineConfig, device) -> None:
        shape = (cfg.layers, cfg.num_pages, cfg.page_size, cfg.kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=cfg.kv_dtype or cfg.dtype, device=device)
        self.v = torch.zeros(shape, dtype=cfg.kv_dtype or cfg.dtype, device=device)
        # FP8 caches: float32 scales [layers, Hkv] (device tensors: an engine may recalibrate them)
        fp8 = cfg.kv_dtype is not None and cfg.kv_dtype != cfg.dtype
        self.scales = torch.full((2, cfg.layers, cfg.kv_heads), cfg.kv_scale, device=device) if fp8 else None
        self.page_size = cfg.page_size
        self.free = list(range(cfg.num_pages))  # deterministic order: the same on every rank
        self.refs = [0] * cfg.num_pages

    def alloc(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"out of KV pages: need {n}, {len(self.free)} free")
        pages, self.free = self.free[:n], self.free[n:]
        for p in pages:
            self.refs[p] = 1
        return pages

    def layer_scales(self, layer: int) -> dict:
        """``plan.run``'s ``k_scale`` / ``v_scale`` of one layer (none for an unquantized cache)."""
        if self.scales is None:
            return {}
        return {"k_scale": self.scales[0, layer], "v_scale": self.scales[1, layer]}

    def share(self, pages: list[int]) -> list[int]:
        for p in pages:
            self.refs[p] += 1
        return list(pages)


@dataclass
class Request:
    rid: str
    tokens: list[int]  # prompt, then generated tokens
    pages: list[int] = field(default_factory=list)
    cached: int = 0  # tokens whose K/V are in the cache (the prefix of the next forward)
    prefix_hit: int = 0  # prompt tokens found in the cache at prefill
    generated: list[int] = field(default_factory=list)


class MiniEngine:
    """Prefill under CP (``strategy`` over ``group``), decode with replicated queries, one
    replicated paged cache (every rank holds every key)."""

    def __init__(self, cfg: EngineConfig, strategy: cpattn.CPStrategy, rank: int, group, device) -> None:
        self.cfg, self.strategy, self.rank, self.group, self.device = cfg, strategy, rank, group, device
        self.model = TinyGQAModel(cfg, device)
        self.cache = PagedKVCache(cfg, device)
        # [cpattn] The layer kind, once: every layer of this model attends alike (GQA over the
        # paged cache); plan_attention binds it to each forward's placement plan.
        self.spec = cpattn.AttentionSpec(num_q_heads=cfg.q_heads, num_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                                         dtype=cfg.dtype, page_size=cfg.page_size, kv_dtype=cfg.kv_dtype)
        # [cpattn] Decode steps place their queries with the "replicated" strategy over the same
        # C ranks: every rank computes every query of the step over its full cache.
        self.decode_strategy = cpattn.get_strategy("replicated", strategy.cp_size)
        self.cached_requests: list[Request] = []
        #: every forward's next-token logits [B, vocab] (float32, CPU), in order
        self.logits: list[Tensor] = []

    # ------------------------------------------------------------------ scheduling (host)
    def _match_prefix(self, req: Request) -> None:
        """Share the full pages of the longest cached prompt prefix (a one-level radix cache)."""
        ps, best = self.cache.page_size, None
        for other in self.cached_requests:
            n = 0
            limit = min(len(req.tokens) - 1, other.cached)  # keep >= 1 new token to compute logits
            while n < limit and req.tokens[n] == other.tokens[n]:
                n += 1
            shared_pages = n // ps
            if shared_pages and (best is None or shared_pages > best[1]):
                best = (other, shared_pages)
        if best is not None:
            other, shared_pages = best
            req.pages = self.cache.share(other.pages[:shared_pages])
            req.cached = shared_pages * ps

    def _reserve(self, req: Request, total_tokens: int) -> None:
        need = -(-total_tokens // self.cache.page_size) - len(req.pages)
        if need > 0:
            req.pages += self.cache.alloc(need)

    def _page_table_and_slots(self, reqs: list[Request], new: list[list[int]]) -> tuple[Tensor, Tensor]:
        """page_table [B, max_pages] int32 and the slot of every extend token in logical order [T]."""
        ps = self.cache.page_size
        max_pages = max(len(r.pages) for r in reqs)
        table = torch.zeros(len(reqs), max_pages, dtype=torch.int32)
        slots = []
        for b, (r, toks) in enumerate(zip(reqs, new)):
            table[b, : len(r.pages)] = torch.tensor(r.pages, dtype=torch.int32)
            pos = torch.arange(r.cached, r.cached + len(toks))
            slots.append(table[b].long()[pos // ps] * ps + pos % ps)
        return table.to(self.device), torch.cat(slots).to(self.device)

    # ------------------------------------------------------------------ one forward (extend)
    @torch.no_grad()
    def _forward(self, reqs: list[Request], new: list[list[int]], strategy: cpattn.CPStrategy, rank: int, group) -> Tensor:
        """Extend every request by its ``new`` tokens; return next-token logits [B, vocab]."""
        cfg, m = self.cfg, self.model
        extend_lens = [len(t) for t in new]
        prefix_lens = [r.cached for r in reqs]
        # [cpattn] Plan once per forward, on the host, from the logical extend and prefix lengths
        # (prefix-cached tokens are never sharded; they only lengthen the key range). Then one
        # host-to-device copy; nothing on the per-layer path reads it back. Over the CP group
        # (None: the default one) the ranks check in one tiny all-gather that they all planned
        # this batch, or all raise.
        meta = strategy.build_metadata(extend_lens, prefix_lens, rank=rank, group=group).to(self.device)
        for r, n in zip(reqs, extend_lens):
            self._reserve(r, r.cached + n)
        page_table, slots = self._page_table_and_slots(reqs, new)  # slots: [T], logical order, real tokens only
        # [cpattn] Validate the slots ONCE per forward (host: in range, no duplicates, one per token);
        # every layer's cache write then takes the plan and does no host sync.
        writes = cpattn.plan_cache_writes(meta, slots, num_slots=cfg.num_pages * cfg.page_size)
        # [cpattn] Plan the attention of this forward once (host): the algorithm follows from the
        # placement: "gather_kv" for sharded queries over this replicated cache (one all-gather of
        # the new K/V per layer), "local" for replicated queries (decode) or C = 1 (no collective).
        plan = cpattn.plan_attention(meta, self.spec)
        ids = torch.tensor([t for toks in new for t in toks], device=self.device)
        positions = torch.cat([torch.arange(r.cached, r.cached + n) for r, n in zip(reqs, extend_lens)]).to(self.device)

        # [cpattn] Shard at the model's input boundary: ids and GLOBAL positions [T] -> [P]
        # (the same permutation for both; pad rows are token 0 at position 0, never queries).
        ids_local = strategy.shard(ids, meta)
        pos_local = strategy.shard(positions, meta)

        h = m.embed[ids_local]  # [P, hidden]
        n_rows = h.shape[0]
        for layer, w in enumerate(m.layers):
            x = rms_norm(h, w["attn_norm"])
            q = apply_rope((x @ w["wq"]).view(n_rows, cfg.q_heads, cfg.head_dim), pos_local)
            k = apply_rope((x @ w["wk"]).view(n_rows, cfg.kv_heads, cfg.head_dim), pos_local)
            v = (x @ w["wv"]).view(n_rows, cfg.kv_heads, cfg.head_dim)
            # [cpattn] ONE call per layer with this rank's new rows [P, ...]: the all-gather of every
            # rank's new K/V ("gather_kv"; none for "local"), the write of ALL extend tokens through
            # the write plan (so every rank keeps the full, replicated cache that decode needs; all
            # or nothing), and attention of the local queries over prefix + extend through the page
            # table (the causal bound of each query comes from the metadata) -> [P, Hq, D].
            # (An engine that overlaps the gather with the query projection calls
            # cpattn.start_gather_kv, cpattn.write_kv_cache and plan.attend itself.)
            # (FP8 cache: the new rows are quantized here, before the gather, with the layer's scales.)
            o = plan.run(q, k, v, (self.cache.k[layer], self.cache.v[layer]), writes=writes, group=group,
                         page_table=page_table, **self.cache.layer_scales(layer))
            h = h + o.reshape(n_rows, -1) @ w["wo"]
            x = rms_norm(h, w["mlp_norm"])
            h = h + (F.silu(x @ w["w_gate"]) * (x @ w["w_up"])) @ w["w_down"]

        # [cpattn] Gather hidden states before the logits: [P, hidden] of every rank -> [T, hidden]
        # in logical order (one all-gather; none with the "replicated" strategy, whose rows already
        # are every row). An engine that only samples the last token of each request could gather
        # just those rows; gathering all keeps the example short.
        h_full = strategy.gather(h, meta, group)
        last = h_full[meta.cu_extend_lens[1:] - 1]  # [B, hidden]
        for r, n in zip(reqs, extend_lens):
            r.cached += n
        logits = rms_norm(last, m.final_norm) @ m.lm_head
        self.logits.append(logits.float().cpu())
        return logits

    # ------------------------------------------------------------------ public steps
    def prefill(self, reqs: list[Request]) -> list[int]:
        """Prefill a ragged batch under CP, reusing cached prompt prefixes; greedy next tokens."""
        for r in reqs:
            self._match_prefix(r)
            r.prefix_hit = r.cached
        new = [r.tokens[r.cached :] for r in reqs]
        logits = self._forward(reqs, new, self.strategy, self.rank, self.group)
        self.cached_requests.extend(reqs)
        return self._sample(reqs, logits)

    def decode(self, reqs: list[Request]) -> list[int]:
        """One decode step for every request: replicated queries over the replicated cache
        (the "replicated" strategy on every rank, algorithm "local": no collective)."""
        new = [[r.generated[-1]] for r in reqs]
        for r in reqs:
            r.tokens.append(r.generated[-1])
        logits = self._forward(reqs, new, self.decode_strategy, self.rank, self.group)
        return self._sample(reqs, logits)

    @staticmethod
    def _sample(reqs: list[Request], logits: Tensor) -> list[int]:
        toks = logits.argmax(-1).tolist()
        for r, t in zip(reqs, toks):
            r.generated.append(t)
        return toks


def make_requests(cfg: EngineConfig, seed: int = 1) -> tuple[list[Request], list[Request]]:
    """Two prefill batches. Batch 2's first request starts with 13 tokens of batch 1's first."""
    gen = torch.Generator().manual_seed(seed)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, cfg.vocab, (n,), generator=gen).tolist()

    a, b = prompt(23), prompt(3)
    c = a[:13] + prompt(10)
    d = prompt(9)
    return [Request("A", a), Request("B", b)], [Request("C", c), Request("D", d)]


def run_engine(
    strategy_name: str, cp_size: int, rank: int, group, device, decode_steps: int = 4, pad_multiple: int = 8,
    dtype: torch.dtype = torch.float32, kv_dtype: Optional[torch.dtype] = None,
) -> dict:
    """The whole scenario on one rank; returns generated tokens, prefix hits, the cache and
    every forward's logits."""
    cfg = EngineConfig(dtype=dtype, kv_dtype=kv_dtype)
    strategy = cpattn.get_strategy(strategy_name, cp_size, pad_multiple=pad_multiple)
    engine = MiniEngine(cfg, strategy, rank, group, device)
    batch1, batch2 = make_requests(cfg)
    engine.prefill(batch1)
    engine.prefill(batch2)
    everyone = batch1 + batch2
    for _ in range(decode_steps):
        engine.decode(everyone)
    return {
        "tokens": {r.rid: r.generated for r in everyone},
        "shared_pages": batch2[0].pages[:3] == batch1[0].pages[:3],
        "prefix_hits": {r.rid: r.prefix_hit for r in everyone},
        "k_cache": portable_cache(engine.cache.k),
        "v_cache": portable_cache(engine.cache.v),
        "logits": engine.logits,
    }


def portable_cache(t: Tensor) -> Tensor:
    """A cache on the CPU for a rank's result: FP8 caches as their raw bytes (uint8 views; FP8
    tensors do not survive the pickling between processes of this torch version)."""
    t = t.cpu()
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


#: ``--kv-dtype`` names -> cache dtypes (None: the model dtype).
KV_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn}

#: Bound of :func:`logit_error` for an FP8 cache against the unquantized one (this model, CPU,
#: torch reference: measured 0.026 in fp32 and 0.025 in bf16 at C = 1; e4m3 keeps 3 mantissa
#: bits, 2^-4 relative per cached value).
FP8_LOGIT_BOUND = 0.05


def logit_error(logits: list[Tensor], reference: list[Tensor]) -> float:
    """Largest logit difference over the forwards of two runs of the scenario, relative to the
    reference forward's largest |logit|. Only forwards before the first different greedy token
    compare (later ones have different inputs)."""
    worst = 0.0
    for a, b in zip(logits, reference):
        worst = max(worst, ((a - b).abs().max() / b.abs().max()).item())
        if not torch.equal(a.argmax(-1), b.argmax(-1)):
            break
    return worst


def run_rank(rank: int, world_size: int, device, strategies, decode_steps: int = 4, pad_multiple: int = 8,
             kv_dtype: Optional[torch.dtype] = None) -> dict:
    """Worker: the scenario for each strategy name (the default group is the CP group)."""
    group = None
    return {
        name: run_engine(name, world_size, rank, group, device, decode_steps, pad_multiple, kv_dtype=kv_dtype)
        for name in strategies
    }


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", default="zigzag", choices=sorted(cpattn.STRATEGIES))
    p.add_argument("--spawn", type=int, default=1, metavar="C", help="spawn C local ranks (no torchrun)")
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--cpu", action="store_true", help="use CPU/gloo even if CUDA is available")
    p.add_argument("--kv", default="replicated", choices=("replicated", "sharded"),
                   help="KV cache replicated on every rank, or sharded over the CP ranks (examples/_sharded_engine.py)")
    p.add_argument("--extend", default="auto", choices=("auto", "pass_kv", "pass_q"),
                   help="with --kv sharded: the algorithm of an extend over a sharded prefix")
    p.add_argument("--kv-dtype", default="auto", choices=sorted(KV_DTYPES),
                   help="the KV cache dtype: auto (the model's) or fp8 (e4m3 with per-layer, per-head scales)")
    p.add_argument("--model", default="gqa", choices=("gqa", "dsa"),
                   help="dsa: a DeepSeek-V3.2-style model decoding over a sharded cache (examples/_dsa_engine.py)")
    args = p.parse_args(argv)
    if args.model == "dsa" and args.kv_dtype != "auto":
        p.error("--kv-dtype applies to --model gqa (the DSA engine's latent cache is in the model dtype)")
    if args.model == "dsa":
        import _dsa_engine

        return _dsa_engine.main(args)
    if args.kv == "sharded":
        import _sharded_engine

        return _sharded_engine.main(args)
    use_cuda = torch.cuda.is_available() and not args.cpu
    kv_dtype = KV_DTYPES[args.kv_dtype]
    results = launch(run_rank, args.spawn, [args.strategy], args.decode_steps, 8, kv_dtype, use_cuda=use_cuda)
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.spawn
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    reference = run_engine(args.strategy, 1, 0, None, device, decode_steps=args.decode_steps,
                           kv_dtype=kv_dtype)["tokens"]
    ok = True
    for i, res in enumerate(results):
        rank = int(os.environ["RANK"]) if under_torchrun() else i
        tokens = res[args.strategy]["tokens"]
        same = tokens == reference
        ok &= same
        if rank == 0 or not same:
            for rid, toks in tokens.items():
                print(f"rank {rank} C={world} {args.strategy}: request {rid} greedy tokens {toks}")
            print(f"rank {rank}: {'equal to' if same else 'DIFFERENT from'} the C = 1 engine")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
