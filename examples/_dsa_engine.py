"""``examples/mini_engine.py --model dsa``: a tiny DeepSeek-V3.2-style (DSA) model whose cache is
SHARDED over the CP ranks, prefill under CP and decode with an exact global top-k.

The cache of a DSA layer holds per token the MLA latent (``kv_c``), the rope key (``k_pe``) and
the lightning indexer's key (``k_idx``, plus a float32 scale with fp8 index keys). The key at
position ``p`` lives on rank ``(p // I) % C`` only (``cpattn.KVSharding``); each rank keeps its
positions packed per request, densely by local index. Every cpattn call is commented
``# [cpattn]``. The run:

1. prefill all requests under CP (interleave or zigzag): each layer's ONE all-gather brings every
   rank the step's parts (``reference_layers.DSAAttention.forward``); each rank keeps the
   positions it owns;
2. decode steps: the "replicated" strategy puts the step's queries on every rank over the
   sharded cache (``kv=KVSharding``); per layer the new token's parts are stored by the rank
   owning its position, each rank scores ITS index keys, the ranks agree on the exact global
   top-k (ONE all-gather of per-rank candidates), attend the selected keys they own and merge
   (ONE collective). Layers listed in ``shared`` reuse the previous layer's selection (GLM-5's
   shared indexer layers): no scoring, no top-k collective.

Greedy tokens must equal the same engine at C = 1; ``main`` checks it.

    python examples/mini_engine.py --model dsa --spawn 3 --strategy interleave --decode-steps 8
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _launch.py
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repository root: reference_layers
from _launch import launch, under_torchrun  # noqa: E402

import cpattn  # noqa: E402
from reference_layers.dsa import DSAAttention, DSAConfig  # noqa: E402


@dataclass(frozen=True)
class DSAEngineConfig:
    vocab: int = 96
    layers: int = 3
    shared: tuple[int, ...] = (2,)  # layers reusing the previous layer's selection at decode
    index_topk: int = 8
    index_fp8: bool = False
    seed: int = 0
    dtype: torch.dtype = torch.float32


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class TinyDSAModel:
    """Embedding, DSA attention layers with residuals, an LM head (seeded)."""

    def __init__(self, cfg: DSAEngineConfig, device) -> None:
        self.layer_cfg = DSAConfig(index_topk=cfg.index_topk, index_fp8=cfg.index_fp8)
        gen = torch.Generator().manual_seed(cfg.seed)
        h = self.layer_cfg.hidden
        self.embed = torch.randn(cfg.vocab, h, generator=gen).to(device, cfg.dtype)
        self.lm_head = (torch.randn(h, cfg.vocab, generator=gen) * h**-0.5).to(device, cfg.dtype)
        self.layers = [DSAAttention(self.layer_cfg, seed=cfg.seed + 1 + i, device=device, dtype=cfg.dtype)
                       for i in range(cfg.layers)]


class ShardedDSAEngine:
    """Prefill under CP and decode over a sharded DSA cache (this rank's positions only)."""

    def __init__(self, cfg: DSAEngineConfig, strategy: cpattn.CPStrategy, rank: int, group, device,
                 interleave: int = 1) -> None:
        self.cfg, self.strategy, self.rank, self.group, self.device = cfg, strategy, rank, group, device
        self.model = TinyDSAModel(cfg, device)
        # [cpattn] The placement rule of the cache: key p on rank (p // I) % C.
        self.sharding = cpattn.KVSharding(strategy.cp_size, interleave=interleave)
        # [cpattn] Decode steps: every query on every rank, the keys stay sharded.
        self.decode_strategy = cpattn.get_strategy("replicated", strategy.cp_size)
        # this rank's cache: per layer, per request, per part: [n_local, ...] rows in local order
        self.cache: list[dict[int, list[Tensor]]] = [{} for _ in range(cfg.layers)]

    def _store(self, layer: int, rid: int, parts: list[Tensor], positions: Tensor) -> None:
        """Append the rows of ``parts`` whose positions this rank owns to request ``rid``'s cache."""
        mine = self.sharding.owner(positions) == self.rank  # [cpattn] the owner of each position
        old = self.cache[layer].get(rid)
        rows = [t[mine] for t in parts]
        self.cache[layer][rid] = rows if old is None else [torch.cat([a, b]) for a, b in zip(old, rows)]

    def _packed(self, layer: int, rids: list[int]) -> tuple[Tensor, ...]:
        """This rank's parts packed per request (the layout of ``meta.cu_local_kv_lens``)."""
        per = [self.cache[layer][r] for r in rids]
        return tuple(torch.cat([p[i] for p in per]) for i in range(len(per[0])))

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]]) -> list[int]:
        m, s = self.model, self.strategy
        lens = [len(p) for p in prompts]
        # [cpattn] Plan the prefill (no cached prefix) once for all layers.
        meta = s.build_metadata(lens, [0] * len(lens), rank=self.rank, group=self.group).to(self.device)
        ids = torch.tensor([t for p in prompts for t in p], device=self.device)
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        h = m.embed[s.shard(ids, meta)]  # [cpattn] [T] -> this rank's [P] rows
        pos_local = s.shard(positions, meta)
        for layer, attn in enumerate(m.layers):
            # [cpattn] (inside) ONE all-gather of latent + rope key + index key (+ scale) per layer
            o, ext, _ = attn(_norm(h), pos_local, s, meta, self.group)
            starts = [0] + torch.tensor(lens).cumsum(0).tolist()
            for b in range(len(prompts)):
                self._store(layer, b, [t[starts[b]:starts[b + 1]] for t in ext], positions[starts[b]:starts[b + 1]])
            h = h + o
        h_full = s.gather(h, meta, self.group)  # [cpattn] [P, hidden] -> [T, hidden]
        last = h_full[meta.cu_extend_lens[1:] - 1]
        self.lengths = lens
        return (_norm(last) @ m.lm_head).argmax(-1).tolist()

    @torch.no_grad()
    def decode(self, tokens: list[int]) -> list[int]:
        m, s = self.model, self.decode_strategy
        b = len(tokens)
        # [cpattn] The step's plan: replicated queries (one per request) over the sharded cache;
        # the ranks agree on the index top-k with it (no shape check before each top-k exchange).
        meta = s.build_metadata([1] * b, self.lengths, rank=self.rank, group=self.group,
                                kv=self.sharding, index_topk=self.cfg.index_topk).to(self.device)
        positions = torch.tensor(self.lengths, device=self.device)
        h = m.embed[torch.tensor(tokens, device=self.device)]
        idx = None
        for layer, attn in enumerate(m.layers):
            x = _norm(h)
            parts = attn.local_parts(x, positions)  # the step's new rows, the same on every rank
            for r in range(b):
                self._store(layer, r, [t[r:r + 1] for t in parts], positions[r:r + 1])
            shared = idx if layer in self.cfg.shared else None
            # [cpattn] (inside) the exact global top-k: each rank scores its own index keys, ONE
            # all-gather of candidates (none for a shared layer); sparse attention over the
            # selected keys this rank owns; ONE merge of the partial outputs.
            o, idx = attn.decode_sharded(x, positions, meta, self._packed(layer, list(range(b))), self.group,
                                         selection=shared)
            h = h + o
        self.lengths = [n + 1 for n in self.lengths]
        return (_norm(h) @ m.lm_head).argmax(-1).tolist()

    def local_positions(self) -> dict[int, int]:
        """Rows this rank holds per request (layer 0)."""
        return {r: int(parts[0].shape[0]) for r, parts in self.cache[0].items()}


def make_prompts(cfg: DSAEngineConfig, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab, (n,), generator=gen).tolist() for n in (37, 5, 20, 1)]


def run_dsa_engine(strategy_name: str, cp_size: int, rank: int, group, device, decode_steps: int = 6,
                   interleave: int = 1, index_fp8: bool = False, pad_multiple: int = 4) -> dict:
    """The scenario on one rank: greedy tokens per request and this rank's cached rows."""
    cfg = DSAEngineConfig(index_fp8=index_fp8)
    strategy = cpattn.get_strategy(strategy_name, cp_size, pad_multiple=pad_multiple)
    engine = ShardedDSAEngine(cfg, strategy, rank, group, device, interleave)
    prompts = make_prompts(cfg)
    tokens = engine.prefill(prompts)
    out = [[t] for t in tokens]
    for _ in range(decode_steps):
        tokens = engine.decode(tokens)
        for seq, t in zip(out, tokens):
            seq.append(t)
    return {"tokens": out, "local_rows": engine.local_positions(), "lengths": engine.lengths}


def run_rank(rank: int, world_size: int, device, strategy_name: str, decode_steps: int, interleave: int) -> dict:
    return run_dsa_engine(strategy_name, world_size, rank, None, device, decode_steps, interleave)


def main(args) -> int:
    """``mini_engine.py --model dsa``: run on C ranks, compare with C = 1 (exit 1 if different)."""
    use_cuda = torch.cuda.is_available() and not args.cpu
    results = launch(run_rank, args.spawn, args.strategy, args.decode_steps, getattr(args, "interleave", 1),
                     use_cuda=use_cuda)
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.spawn
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    reference = run_dsa_engine(args.strategy, 1, 0, None, device, args.decode_steps)["tokens"]
    ok = True
    for i, res in enumerate(results):
        rank = int(os.environ["RANK"]) if under_torchrun() else i
        same = res["tokens"] == reference
        ok &= same
        if rank == 0 or not same:
            print(f"rank {rank} C={world} {args.strategy} sharded DSA cache: greedy tokens {res['tokens']}")
            print(f"rank {rank}: {'equal to' if same else 'DIFFERENT from'} the C = 1 engine")
    return 0 if ok else 1
