"""Generation with a sharded KV cache in Hugging Face transformers: :class:`ShardedKVCache`.

A transformers ``Cache`` whose per-layer storage is this rank's 1/C of the keys
(:class:`cpattn.KVSharding`: the key at position ``p`` lives on rank ``(p // I) % C`` only), in
pages of ``page_size`` tokens. With the model switched to cpattn's attention
(:func:`cpattn.integrations.hf.enable`), ``model.generate(input_ids, cache=cache, ...)`` runs on C
processes with the model code unchanged (:mod:`cpattn.integrations.hf` drives every forward):

* the first forward (the prompt, cache empty) runs under CP: the decoder's inputs are sharded by
  the prefill strategy (zigzag by default), every attention layer all-gathers the new K/V (ONE
  collective), attends its local queries and stores the keys this rank owns; the decoder's output
  rows are all-gathered (ONE collective) so the LM head sees the whole prompt on every rank;
* every later forward (a decode step, or any continuation of n >= 1 tokens) runs the
  ``"replicated"`` strategy over the sharded cache (``kv=KVSharding``): every rank computes every
  new token, each attention layer writes the new keys on their owner, attends this rank's keys and
  merges the ranks' partial outputs exactly (``plan.run`` of a ``"shard_merge"`` plan: ONE
  collective per layer), so hidden states and logits are the same on every rank and greedy
  decoding or sampling with a shared seed picks the same tokens everywhere.

Sliding-window layers (``config.layer_types`` entry ``"sliding_attention"``, window W: a query
at ``q`` sees keys ``k > q - W``) keep only the pages the window still needs: a page whose keys
all lie before the window of every later query returns to the layer kind's free list and is reused
for new keys. Full-attention layers keep every key they own. A rank holds at most
``ceil(L / C) + page_size`` tokens of each layer (``interleave=1``; :meth:`ShardedKVCache.local_tokens`).

Plan cost per forward: one plan agreement (a small all-gather, at plan time), one page-table
upload and one cache-write plan per layer kind (full / each window); the exact merge's header
check runs once per layer kind, on the first decode step (later steps' plans skip it: ``agree=False``). The prompt's forward holds one layer's whole K/V at a time
(the gathered ``[L, Hkv, D]`` rows it attends and stores from), never more than one layer.

DSA models (transformers' ``deepseek_v32``, ``glm_moe_dsa``: ``"indexed_attention"`` layers) store
each rank's share of the MLA latent + rope key and of the indexer keys (same pages, same
positions). The prompt's forward gathers the latent and the index keys (ONE collective each, as
:mod:`cpattn.integrations.hf_dsa`) and stores the rows this rank owns; a later forward scores the
new tokens' index queries against this rank's index keys, agrees on the exact global top-k (ONE
all-gather, :mod:`cpattn.integrations.hf_dsa_cache`), and attends the selected keys this rank owns
with the sparse shard-merge plan (``AttentionSpec(topk=)``, ONE collective); a GLM "shared" layer
reuses the previous layer's selection (no agreement).

Not covered (ValueError before any collective): token mixers other than attention, batches of
more than one sequence (beam search, ``num_return_sequences > 1``), padding masks, and rewinding
the cache (``crop``: assisted decoding; ``reorder_cache``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..cache import plan_cache_writes, write_kv_cache
from ..kv_sharding import KVSharding
from ..plans import plan_attention
from ..spec import MAX_PAGE_SIZE, AttentionSpec
from ..strategies import CPStrategy, get_strategy
from . import hf_dsa, hf_dsa_cache

try:
    from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("cpattn.integrations.hf needs Hugging Face transformers: pip install 'cpattn[hf]'") from exc

__all__ = ["DEFAULT_PAGE_SIZE", "ShardedKVCache", "ShardedKVLayer", "ShardedStep"]

#: Tokens per page of a layer's local storage. 64: the split-KV decode kernel reads one page-table
#: entry per key block when a page holds whole blocks (docs/sharded-kv.md), and a rank's overhead is
#: at most one partial page per layer.
DEFAULT_PAGE_SIZE = 64

_SUPPORTED = ("full_attention", "sliding_attention", *sorted(hf_dsa.DSA_LAYER_TYPES))


def _text_config(config):
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        try:
            return get_text(decoder=True)
        except TypeError:
            return get_text()
    return config


class _PagePool:
    """Page bookkeeping of one layer kind (all its layers hold the same local keys, so they share
    it): local page ``i`` of the sequence lives in pool page ``table[i]`` (-1: freed, out of the
    window); ``size`` pool pages exist in every layer's storage of the kind."""

    def __init__(self) -> None:
        self.table: list[int] = []
        self.free: list[int] = []
        self.size = 1  # page 0 exists from the start: a table is never empty
        self.dead = 0  # local pages [0, dead) are freed
        self.fresh = [0]  # pool pages not holding any local page yet

    def advance(self, dead: int, total: int) -> None:
        """Free local pages below ``dead``; map local pages up to ``total`` (allocating)."""
        for i in range(self.dead, min(dead, len(self.table))):
            self.free.append(self.table[i])
            self.table[i] = -1
        self.dead = max(self.dead, dead)
        while len(self.table) < total:
            if len(self.table) < self.dead:  # out of the window before it was ever written
                page = -1
            elif self.fresh:
                page = self.fresh.pop()
            elif self.free:
                page = self.free.pop()
            else:
                page, self.size = self.size, self.size + 1
            self.table.append(page)

    def page_table(self, device) -> Tensor:
        """[1, max(1, len(table))] int32; freed entries point at page 0 (any page: the keys there
        are out of every query's window, which the kernels apply by position)."""
        rows = [max(p, 0) for p in self.table] or [0]
        return torch.tensor([rows], dtype=torch.int32).to(device)


class ShardedKVLayer(CacheLayerMixin):
    """One attention layer's storage on this rank: ``keys`` [pages, page_size, Hkv, D], ``values``
    [pages, page_size, Hkv, Dv] (allocated on the first write, grown a page at a time; local key
    ``j`` at page ``table[j // page_size]`` of its layer kind, slot ``j % page_size``).

    Attributes: ``window`` (transformers' ``sliding_window`` W, None for full attention),
    ``layer_type`` (``"full_attention"`` / ``"sliding_attention"`` / ``"indexed_attention"``),
    ``index_keys`` (a DSA layer with an indexer: [pages, page_size, D_i], local key ``j`` at
    row ``j`` of its flat view; else None)."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, cache: "ShardedKVCache", layer_type: str, window: Optional[int]) -> None:
        super().__init__()
        self._cache = cache
        self.layer_type, self.window = layer_type, window
        self.is_sliding = window is not None
        self.latent_dim: Optional[int] = None  # an MLA latent layer: values = keys[..., :latent_dim]
        self.index_keys: Optional[Tensor] = None  # a DSA layer's indexer keys [pages, page_size, D_i]

    def __repr__(self) -> str:
        return f"ShardedKVLayer({self.layer_type}, window={self.window}, pages={self.num_pages})"

    @property
    def num_pages(self) -> int:
        return 0 if self.keys is None else self.keys.shape[0]

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Storage of one page for rows like ``key_states`` [n, Hkv, D] / ``value_states``
        [n, Hkv, Dv]; ``value_states`` an int Dv: an MLA latent layer, whose values are the first
        Dv columns of its keys (``values`` is a view of ``keys``)."""
        ps = self._cache.page_size
        self.keys = key_states.new_zeros((1, ps, *key_states.shape[1:]))
        if isinstance(value_states, int):
            self.latent_dim = value_states
            self.values = self.keys[..., :value_states]
        else:
            self.latent_dim = None
            self.values = value_states.new_zeros((1, ps, *value_states.shape[1:]))
        self.is_initialized = True

    def reserve(self, pages: int, k: Tensor, v) -> None:
        """Grow the storage to ``pages`` pages for rows like ``k`` [n, Hkv, D] / ``v`` [n, Hkv, Dv]
        (``v`` an int Dv: an MLA latent layer, see :meth:`lazy_initialization`)."""
        if self.keys is None:
            self.lazy_initialization(k, v)
        v_tail = (*k.shape[1:-1], v) if isinstance(v, int) else v.shape[1:]
        if (tuple(self.keys.shape[2:]), tuple(self.values.shape[2:]), self.keys.dtype, self.keys.device) != \
                (tuple(k.shape[1:]), tuple(v_tail), k.dtype, k.device):
            raise ValueError(f"layer K/V changed shape, dtype or device between forwards: cache "
                             f"{tuple(self.keys.shape[2:])}/{tuple(self.values.shape[2:])} {self.keys.dtype} on "
                             f"{self.keys.device}, new rows {tuple(k.shape[1:])}/{tuple(v_tail)} {k.dtype} on "
                             f"{k.device}")
        grow = pages - self.keys.shape[0]
        if grow > 0:
            self.keys = torch.cat([self.keys, self.keys.new_zeros((grow, *self.keys.shape[1:]))])
            if self.latent_dim is not None:
                self.values = self.keys[..., : self.latent_dim]
            else:
                self.values = torch.cat([self.values, self.values.new_zeros((grow, *self.values.shape[1:]))])

    def reserve_index(self, pages: int, k_idx: Tensor) -> None:
        """Grow the indexer-key storage to ``pages`` pages for rows like ``k_idx`` [n, D_i]."""
        if self.index_keys is None:
            self.index_keys = k_idx.new_zeros((1, self._cache.page_size, k_idx.shape[-1]))
        if (self.index_keys.shape[-1], self.index_keys.dtype, self.index_keys.device) != \
                (k_idx.shape[-1], k_idx.dtype, k_idx.device):
            raise ValueError(f"indexer keys changed shape, dtype or device between forwards: cache "
                             f"{self.index_keys.shape[-1]} {self.index_keys.dtype} on {self.index_keys.device}, new "
                             f"rows {tuple(k_idx.shape)} {k_idx.dtype} on {k_idx.device}")
        grow = pages - self.index_keys.shape[0]
        if grow > 0:
            pad = self.index_keys.new_zeros((grow, *self.index_keys.shape[1:]))
            self.index_keys = torch.cat([self.index_keys, pad])

    def storage_bytes(self) -> int:
        """Bytes of this layer's storage on this rank (keys, values unless a view of them, and a
        DSA layer's indexer keys)."""
        if self.keys is None:
            return 0
        own = self.keys.numel() * self.keys.element_size()
        if self.index_keys is not None:
            own += self.index_keys.numel() * self.index_keys.element_size()
        return own if self.latent_dim is not None else own + self.values.numel() * self.values.element_size()

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        raise RuntimeError("a ShardedKVLayer is written through its ShardedKVCache (cache.update(..., layer_idx))")

    # transformers' per-layer interface (what generate and the masks read)
    def get_seq_length(self) -> int:
        return self._cache.num_tokens

    def get_max_length(self) -> int:
        return -1 if self.window is None else self.window

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        n = self._cache.num_tokens
        if self.window is None:
            return n + query_length, 0
        return min(n, self.window - 1) + query_length, max(n - self.window + 1, 0)

    def reset(self) -> None:
        self.keys = self.values = self.index_keys = None
        self.is_initialized = False

    def reorder_cache(self, beam_idx) -> None:
        self._cache.reorder_cache(beam_idx)


@dataclass
class ShardedStep:
    """One forward over a :class:`ShardedKVCache` (built by :meth:`ShardedKVCache.begin_step`).

    ``strategy`` / ``meta``: the placement plan (the prefill strategy for the prompt, the
    "replicated" strategy with the cache's sharding afterwards); ``decode``: False for the
    prompt's forward; ``num_new``: new tokens; ``start``: their first position."""

    strategy: CPStrategy
    meta: Any
    decode: bool
    num_new: int
    start: int
    tables: dict = field(default_factory=dict)  # window -> page table [1, pages] (device)
    writes: dict = field(default_factory=dict)  # window -> CacheWritePlan (decode)
    stores: dict = field(default_factory=dict)  # window -> (logical rows, slots) to store (prompt)
    plans: dict = field(default_factory=dict)  # spec -> AttentionPlan (decode)
    pages: dict = field(default_factory=dict)  # window -> pages of each layer's storage after the step
    latents: dict = field(default_factory=dict)  # layer -> the MLA latent rows the model cached
    # DSA: the "indexed_attention" mask (prompt: hf_dsa.cp_mask [1, 1, P, T]; later: the local keys
    # each new token sees [1, 1, n, m]), the top-k per token, the new index keys this rank stores
    # (rows of the step, local slots), the local keys' global positions [m], and the selections made
    dsa_mask: Optional[Tensor] = None
    topk: int = 0
    index_rows: Optional[tuple] = None
    index_positions: Optional[Tensor] = None
    selections: list = field(default_factory=list)


class ShardedKVCache(Cache):
    """A transformers ``Cache`` holding this rank's 1/C of every layer's keys (see the module doc).

    Args:
        config: the model's config (its decoder's ``layer_types`` / ``sliding_window`` give
            each layer's kind).
        group: the CP process group (None: the default group; no process group at all: one
            rank, C = 1). The cache's C is the group's size, its rank this process's rank there.
        page_size: tokens per page of each layer's local storage (a multiple of
            ``interleave``, at most 256).
        interleave: the sharding's I (consecutive positions per rank).
        prefill_strategy: how the prompt's tokens are placed: a name ("zigzag", "interleave",
            "contiguous") or a :class:`cpattn.CPStrategy` of C ranks.
        backend: the attention backend ("auto", "triton", "torch", ...).

    Use on every rank, with the same prompt (and seed, for sampling)::

        cphf.enable(model)
        cache = cphf.ShardedKVCache(model.config, group)
        out = model.generate(input_ids, cache=cache, max_new_tokens=64, do_sample=False)

    ``cache.local_tokens(layer)``: tokens of storage this rank holds for a layer;
    ``cache.local_bytes()``: this rank's bytes of K/V storage over all layers.
    """

    def __init__(self, config, group=None, *, page_size: int = DEFAULT_PAGE_SIZE, interleave: int = 1,
                 prefill_strategy: "str | CPStrategy" = "zigzag", backend: str = "auto") -> None:
        text = _text_config(config)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
        if isinstance(layer_kwargs, dict):  # older transformers: one kwargs dict for every layer
            layer_kwargs = [layer_kwargs] * len(layer_types)
        bad = sorted({t for t in layer_types if t not in _SUPPORTED})
        if bad:
            raise ValueError(f"config: ShardedKVCache holds {list(_SUPPORTED)} layers only, got layer types {bad}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or not 1 <= page_size <= MAX_PAGE_SIZE:
            raise ValueError(f"page_size must be an int in [1, {MAX_PAGE_SIZE}], got {page_size!r}")
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str, got {type(backend).__name__}")
        if group is not None and not dist.is_initialized():
            raise ValueError("group given but torch.distributed is not initialized")
        if dist.is_initialized():
            cp_size, rank = dist.get_world_size(group), dist.get_rank(group)
            if rank < 0:
                raise ValueError("this process is not a member of group")
        else:
            cp_size, rank = 1, 0
        self.sharding = KVSharding(cp_size, interleave=interleave)
        self.page_size = self.sharding.check_page_size(page_size)
        if isinstance(prefill_strategy, str):
            if prefill_strategy == "replicated":
                raise ValueError("prefill_strategy must shard the prompt: 'zigzag', 'interleave' or 'contiguous'")
            prefill_strategy = get_strategy(prefill_strategy, cp_size)
        if not isinstance(prefill_strategy, CPStrategy):
            raise TypeError(f"prefill_strategy must be a name or a cpattn.CPStrategy, got "
                            f"{type(prefill_strategy).__name__}")
        if prefill_strategy.cp_size != cp_size or prefill_strategy.name == "replicated":
            raise ValueError(f"prefill_strategy must shard over the group's {cp_size} ranks, got {prefill_strategy}")
        self.group, self.cp_size, self.rank, self.backend = group, cp_size, rank, backend
        self.prefill_strategy = prefill_strategy
        self.decode_strategy = get_strategy("replicated", cp_size)
        self.num_tokens = 0
        self.broken: Optional[str] = None
        self.step: Optional[ShardedStep] = None
        layers = []
        for layer_type, kw in zip(layer_types, layer_kwargs):
            window = kw.get("sliding_window") if layer_type == "sliding_attention" else None
            if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
                raise ValueError(f"config: sliding_window must be a positive int, got {window!r}")
            layers.append(ShardedKVLayer(self, layer_type, window))
        self._pools = {w: _PagePool() for w in {x.window for x in layers}}
        # MLA models that cache the compressed latent (transformers' DeepseekV3: cache.update(kv_latent
        # [1, 1, n, r], k_rope [1, 1, n, d_rope])): their layers store the latent, not per-head K/V.
        rank_r, rope = getattr(text, "kv_lora_rank", None), getattr(text, "qk_rope_head_dim", None)
        self._mla = (rank_r, rope) if isinstance(rank_r, int) and isinstance(rope, int) else None
        self.index_topk: Optional[int] = None  # DSA: keys each token attends (config.index_topk)
        if not hf_dsa.DSA_LAYER_TYPES.isdisjoint(layer_types):
            topk = getattr(text, "index_topk", None)
            if self._mla is None or len(set(layer_types)) != 1:
                raise ValueError("config: ShardedKVCache runs DSA layers of MLA models "
                                 "(kv_lora_rank, qk_rope_head_dim) whose every layer is one, got layer types "
                                 f"{sorted(set(layer_types))}")
            if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
                raise ValueError(f"config: index_topk must be a positive int for DSA layers, got {topk!r}")
            self.index_topk = topk
        self._checked: set[int] = set()  # ids of decoders whose indexers check_decoder accepted
        # layer kinds (spec keys) whose partials every rank of the group merged: a decode step's
        # plan checks a kind's partials header once (one tiny all-gather); later steps' plans skip it
        self._agreed_partials: set = set()
        super().__init__(layers=layers)

    def __repr__(self) -> str:
        return (f"ShardedKVCache(C={self.cp_size}, rank={self.rank}, tokens={self.num_tokens}, "
                f"page_size={self.page_size}, layers={len(self.layers)})")

    # ------------------------------------------------------------------ sizes
    def local_tokens(self, layer_idx: int) -> int:
        """Tokens of storage (pages x page_size) this rank holds for layer ``layer_idx``."""
        return self.layers[layer_idx].num_pages * self.page_size

    def page_table(self, layer_idx: int) -> list[int]:
        """Local page ``i`` of the layer's keys -> its page in the layer's storage (-1: freed, out
        of the window; layers of one kind share the table)."""
        return list(self._pools[self.layers[layer_idx].window].table)

    def local_bytes(self) -> int:
        """Bytes of K/V storage this rank holds over all layers."""
        return sum(x.storage_bytes() for x in self.layers)

    # ------------------------------------------------------------------ transformers' interface
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens of the sequence cached so far (logical, the same on every rank)."""
        return self.num_tokens

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """Called by the model's attention layer with its new K/V: returned unchanged (the cpattn
        attention function stores them on their owner and attends the shards)."""
        if self.step is None:
            raise RuntimeError(
                "ShardedKVCache is filled by cpattn's attention function: switch the model to it with "
                "cpattn.integrations.hf.enable(model) and pass the cache as cache= (generate or forward)"
            )
        latent = self._mla is not None and tuple(key_states.shape[1::2]) == (1, self._mla[0]) \
            and tuple(value_states.shape[1::2]) == (1, self._mla[1])
        if self.index_topk is not None and not latent:
            raise ValueError(
                f"DSA layer {layer_idx} caches up-projected per-head K/V {tuple(key_states.shape)}, not the "
                f"compressed MLA latent [1, 1, n, {self._mla[0]}]: this transformers release's DSA attention "
                "cannot run over a ShardedKVCache (releases whose DSA attention calls cache.update(k_pass, "
                "k_rot) can); generate with cpattn's CP prefill and a transformers cache instead")
        if latent and self.index_topk is not None and not self.step.decode:
            return self._store_dsa_prefill(layer_idx, key_states, value_states)
        if latent:
            self.step.latents[layer_idx] = (key_states, value_states)  # [1, 1, n, r] / [1, 1, n, d_rope]
        return key_states, value_states

    def _store_dsa_prefill(self, layer_idx: int, kv_latent: Tensor, k_rope: Tensor) -> tuple[Tensor, Tensor]:
        """The prompt's forward of a DSA layer: gather the latent + rope key of every rank (ONE
        collective), store the rows this rank owns, return the logical [1, 1, L, r] / [1, 1, L, d_rope]
        (the model up-projects K/V and runs the indexer over the whole prompt)."""
        step, layer = self.step, self._layer(layer_idx, None)
        k_all = step.strategy.gather(_latent_rows((kv_latent, k_rope)), step.meta, self.group)  # [L, 1, r + d]
        r = kv_latent.shape[-1]
        layer.reserve(self._pools[None].size, k_all, r)
        rows, slots = step.stores[None]
        if rows.numel():
            write_kv_cache(k_all[rows], k_all[rows][..., :r], layer.keys, layer.values, slots)
        logical = k_all.transpose(0, 1).unsqueeze(0)  # [1, 1, L, r + d]
        return logical[..., :r], logical[..., r:]

    def update_indexer(self, indexer_key_states: Tensor, layer_idx: int) -> Tensor:
        """Called by a DSA layer's indexer with its new index keys [1, n, D_i]. The prompt's forward:
        gathers them (ONE collective), stores the rows this rank owns and returns the logical
        [1, L, D_i]. A later forward: stores the new keys this rank owns and returns this rank's
        index keys [1, m, D_i] as :class:`hf_dsa_cache.SelectingKeys`, whose ``topk`` is the exact
        global top-k (ONE collective)."""
        step = self.step
        if step is None or self.index_topk is None:
            raise RuntimeError("update_indexer runs inside a forward of a DSA model over the cache")
        layer = self._layer(layer_idx, None)
        k = indexer_key_states
        if k.dim() != 3 or k.shape[0] != 1:
            raise ValueError(f"indexer keys must be [1, n, D_i], got shape {tuple(k.shape)}")
        layer.reserve_index(self._pools[None].size, k[0])
        flat = layer.index_keys.view(-1, k.shape[-1])  # local key j at row j (see _plan_dsa)
        if not step.decode:
            k_all = step.strategy.gather(k[0], step.meta, self.group)  # [L, D_i]
            rows, slots = step.stores[None]
            flat[slots] = k_all[rows]
            return k_all.unsqueeze(0)
        rows, slots = step.index_rows
        flat[slots] = k[0][rows]
        m = step.dsa_mask.shape[-1]
        return hf_dsa_cache.selecting_keys(flat[:m].unsqueeze(0), functools.partial(self._select, m))

    def _select(self, m: int, scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """The indexer's ``topk(k)`` over its scores [1, n, m] of this rank's keys -> the global
        top-k (values [1, n, K] float32, indices [1, n, K] int32 global positions; ONE collective)."""
        step = self.step
        if k != min(self.index_topk, m) or tuple(scores.shape) != (1, step.num_new, m):
            raise ValueError(f"the DSA indexer took top-{k} of scores {tuple(scores.shape)}; the cache expects "
                             f"top-min(index_topk={self.index_topk}, {m}) of [1, {step.num_new}, {m}]")
        values, indices = hf_dsa_cache.agree_topk(scores[0], step.dsa_mask[0, 0], step.index_positions, step.topk,
                                                  self.cp_size, self.group)
        indices = indices.unsqueeze(0)
        step.selections.append(indices)
        return values.unsqueeze(0), indices

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("ShardedKVCache cannot be cropped (assisted / speculative decoding through generate is "
                         "not supported)")

    def reorder_cache(self, beam_idx) -> None:
        raise ValueError("ShardedKVCache holds one sequence: beam search is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ValueError("ShardedKVCache holds one sequence: a batch of several is not supported")

    def batch_select_indices(self, indices) -> None:
        raise ValueError("ShardedKVCache holds one sequence: a batch of several is not supported")

    def reset(self) -> None:
        """Drop every layer's storage and the token count (the cache can take a new prompt)."""
        for layer in self.layers:
            layer.reset()
        self._pools = {w: _PagePool() for w in self._pools}
        self.num_tokens, self.broken, self.step = 0, None, None

    # ------------------------------------------------------------------ one forward
    def check_decoder(self, decoder: torch.nn.Module) -> None:
        """DSA: ValueError (before any collective) when an indexer module of ``decoder`` selects a
        top-k other than the config's ``index_topk`` (the agreement's K is planned from the config)."""
        if self.index_topk is None or id(decoder) in self._checked:
            return
        for path, module in decoder.named_modules():
            k = getattr(module, "index_topk", None)
            if isinstance(k, int) and k != self.index_topk:
                raise ValueError(f"{path} ({type(module).__name__}) selects index_topk={k} but the cache's config "
                                 f"gives {self.index_topk}: build the cache from the model's config")
        self._checked.add(id(decoder))

    def begin_step(self, num_new: int, device: torch.device) -> ShardedStep:
        """Plan the forward of ``num_new`` tokens (host; the plan agreement is its one collective):
        the prompt's CP prefill when the cache is empty, a replicated-query step otherwise."""
        if self.broken is not None:
            raise RuntimeError(f"this ShardedKVCache is unusable after a failed forward ({self.broken}); "
                               "call cache.reset()")
        if self.step is not None:
            raise RuntimeError("a forward over this ShardedKVCache is already running (nested forwards)")
        if isinstance(num_new, bool) or not isinstance(num_new, int) or num_new < 1:
            raise ValueError(f"a forward over a ShardedKVCache needs >= 1 new tokens, got {num_new}")
        start, end, decode = self.num_tokens, self.num_tokens + num_new, self.num_tokens > 0
        if decode:
            strategy = self.decode_strategy
            meta = strategy.build_metadata([num_new], [start], rank=self.rank, group=self.group,
                                           kv=self.sharding)
        else:
            strategy = self.prefill_strategy
            meta = strategy.build_metadata([num_new], rank=self.rank, group=self.group)
        meta = meta.to(device)
        step = ShardedStep(strategy, meta, decode, num_new, start)
        ps, sh, rank = self.page_size, self.sharding, self.rank
        for window, pool in self._pools.items():
            # keys every query of this step and later needs: positions >= first_needed
            first_query = start if decode else end
            first_needed = 0 if window is None else max(first_query - window + 1, 0)
            j0 = int(sh.local_lengths([first_needed], rank)[0])
            j1 = int(sh.local_lengths([end], rank)[0])
            pool.advance(j0 // ps, -(-j1 // ps))
            table = pool.page_table(device)
            step.tables[window], step.pages[window] = table, pool.size
            if decode:
                step.writes[window] = plan_cache_writes(meta, table, page_size=ps, num_pages=pool.size)
            else:  # the prompt's keys this rank owns and keeps, and their slots
                pos = torch.arange(first_needed, end)
                pos = pos[sh.owner(pos) == rank]
                j = sh.local_index(pos)
                slots = torch.tensor(pool.table, dtype=torch.int64)[j // ps] * ps + j % ps if pos.numel() else j
                step.stores[window] = (pos.to(device), slots.to(device))
        if self.index_topk is not None:
            self._plan_dsa(step, device)
        self.step = step
        return step

    def _plan_dsa(self, step: ShardedStep, device: torch.device) -> None:
        """A DSA step's mask, top-k and index-key rows (host; no collective). DSA layers are full
        attention: local key ``j`` lives at slot ``j`` of their storage (their pages are never freed,
        so page ``i`` of the table is pool page ``i``)."""
        sh, rank, start, n = self.sharding, self.rank, step.start, step.num_new
        if not step.decode:
            step.dsa_mask = hf_dsa.cp_mask(step.meta)
            return
        step.dsa_mask = hf_dsa_cache.decode_mask(sh, rank, start, n, device)
        step.topk = min(self.index_topk, start + n)
        m = step.dsa_mask.shape[-1]
        step.index_positions = sh.global_position(torch.arange(m), rank).to(device)
        pos = torch.arange(start, start + n)
        pos = pos[sh.owner(pos) == rank]
        step.index_rows = ((pos - start).to(device), sh.local_index(pos).to(device))

    def finish_step(self, ok: bool) -> None:
        """End the forward: count its tokens (``ok``) or mark the cache unusable."""
        step, self.step = self.step, None
        if step is None:
            return
        if ok:
            self.num_tokens += step.num_new
        else:
            self.broken = "a forward raised after the cache was planned"

    def _layer(self, layer_idx: int, sliding_window) -> ShardedKVLayer:
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"layer_idx {layer_idx} out of range for a cache of {len(self.layers)} layers")
        layer = self.layers[layer_idx]
        window = None if sliding_window is None else int(sliding_window)
        if window != layer.window:
            raise ValueError(f"layer {layer_idx} attends with sliding_window={sliding_window} but the config "
                             f"gives it {layer.window} ({layer.layer_type})")
        return layer

    def store_prefill(self, layer_idx: int, k_all: Tensor, v_all: Tensor, sliding_window=None) -> None:
        """The prompt's forward: store the keys this rank owns (and the window keeps) of the
        layer's logical K/V ``k_all`` [L, Hkv, D] / ``v_all`` [L, Hkv, Dv]."""
        step = self.step
        if step is None or step.decode:
            raise RuntimeError("store_prefill runs inside the prompt's forward over the cache")
        layer = self._layer(layer_idx, sliding_window)
        rows, slots = step.stores[layer.window]
        latent = step.latents.pop(layer_idx, None)
        if latent is not None:  # MLA: store the latent rows instead (ONE all-gather of [P, 1, r + d_rope])
            r = latent[0].shape[-1]
            k_all = step.strategy.gather(_latent_rows(latent), step.meta, self.group)  # [L, 1, r + d_rope]
            v_all = k_all[..., :r]
        layer.reserve(self._pools[layer.window].size, k_all, v_all if latent is None else r)
        if rows.numel():
            write_kv_cache(k_all[rows], v_all[rows], layer.keys, layer.values, slots)

    def decode_attention(self, layer_idx: int, query: Tensor, key: Tensor, value: Tensor, *,
                         scaling: Optional[float] = None, sliding_window=None,
                         sinks: Optional[Tensor] = None, module: Optional[torch.nn.Module] = None,
                         indices: Optional[Tensor] = None) -> Tensor:
        """A later forward's attention for one layer: query [1, Hq, n, D], key [1, Hkv, n, D],
        value [1, Hkv, n, Dv] (the new tokens, the same on every rank) -> [1, n, Hq, Dv]. Writes
        the new keys on their owner, attends this rank's keys, merges exactly (ONE collective).
        A DSA layer: ``indices`` [1, n, K] is the step's agreed selection (global positions, from
        :meth:`update_indexer`'s top-k, or the previous layer's on a GLM "shared" layer); the
        layer attends the selected keys this rank owns."""
        step = self.step
        if step is None or not step.decode:
            raise RuntimeError("decode_attention runs inside a later forward over the cache")
        layer = self._layer(layer_idx, sliding_window)
        n = step.num_new
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dim() != 4 or t.shape[0] != 1 or t.shape[2] != n:
                raise ValueError(f"{name} must be [1, heads, n={n}, head_dim], got shape {tuple(t.shape)}")
        latent = step.latents.pop(layer_idx, None)
        if latent is not None:  # MLA: absorbed attention over the sharded latent
            w_uk, w_uv = _mla_up_projections(module, latent[0].shape[-1], query.shape[1])
            q = query[0].transpose(0, 1)  # [n, H, d_nope + d_rope]
            d_nope = w_uk.shape[1]
            q = torch.cat([torch.einsum("nhd,hdr->nhr", q[..., :d_nope], w_uk), q[..., d_nope:]], -1).contiguous()
            k = _latent_rows(latent)  # [n, 1, r + d_rope]
            v = k[..., : w_uk.shape[2]]
        else:
            q = query[0].transpose(0, 1).contiguous()  # [n, Hq, D]
            k = key[0].transpose(0, 1).contiguous()  # [n, Hkv, D]
            v = value[0].transpose(0, 1).contiguous()  # [n, Hkv, Dv]
        window = (-1, -1) if layer.window is None else (layer.window - 1, 0)
        topk, idx = self._selection(layer_idx, layer, indices, latent is not None)
        spec_key = (q.shape[1:], k.shape[1:], v.shape[-1], q.dtype, window, sinks is not None, topk)
        plan = step.plans.get(spec_key)
        if plan is None:
            spec = AttentionSpec(num_q_heads=q.shape[1], num_kv_heads=k.shape[1], head_dim=q.shape[2],
                                 head_dim_v=v.shape[2], dtype=q.dtype, window_size=window,
                                 page_size=self.page_size, has_sinks=sinks is not None, topk=topk)
            plan = step.plans[spec_key] = plan_attention(step.meta, spec, backend=self.backend)
        layer.reserve(self._pools[layer.window].size, k, v if latent is None else v.shape[-1])
        sparse = {} if idx is None else {"idx": idx}
        out = plan.run(q, k, v, (layer.keys, layer.values), writes=step.writes[layer.window], group=self.group,
                       page_table=step.tables[layer.window], sinks=sinks, softmax_scale=scaling,
                       agree=spec_key not in self._agreed_partials, **sparse)
        if plan.agreed_partials:  # checked over the group: later steps' plans of this kind skip the check
            self._agreed_partials.add(spec_key)
        if latent is not None:
            out = torch.einsum("nhr,hvr->nhv", out, w_uv)  # latent -> per-head values [n, H, Dv]
        return out.unsqueeze(0)  # [1, n, Hq, Dv]

    def _selection(self, layer_idx: int, layer: ShardedKVLayer, indices: Optional[Tensor],
                   latent: bool) -> tuple[Optional[int], Optional[Tensor]]:
        """(topk, idx [n, topk]) of a DSA layer (the step's agreed selection), (None, None) else."""
        if layer.layer_type not in hf_dsa.DSA_LAYER_TYPES:
            if indices is not None:
                raise ValueError(f"layer {layer_idx} ({layer.layer_type}) got DSA indices")
            return None, None
        if not latent:
            raise ValueError(f"DSA layer {layer_idx} did not cache its MLA latent through cache.update")
        if indices is None or not any(indices is s for s in self.step.selections):
            raise ValueError(f"DSA layer {layer_idx}: its top-k indices are not a selection the cache agreed on "
                             "(the indexer must take scores.topk of the keys cache.update_indexer returned)")
        return self.step.topk, indices[0]


def _latent_rows(latent: tuple[Tensor, Tensor]) -> Tensor:
    """(kv latent [1, 1, n, r], k_rope [1, 1, n, d_rope]) -> rows [n, 1, r + d_rope]."""
    return torch.cat([latent[0][0].transpose(0, 1), latent[1][0].transpose(0, 1)], -1)


def _mla_up_projections(module, rank_r: int, heads: int) -> tuple[Tensor, Tensor]:
    """W_UK [H, d_nope, r] and W_UV [H, Dv, r] of an MLA attention module's ``kv_b_proj`` (the
    up-projection ``expand_kv`` applies to the latent), for absorbed attention (ValueError when the
    module has no plain bias-free ``kv_b_proj`` of that shape)."""
    proj = getattr(module, "kv_b_proj", None)
    d_nope, d_v = getattr(module, "qk_nope_head_dim", None), getattr(module, "v_head_dim", None)
    if not isinstance(proj, torch.nn.Linear) or proj.bias is not None or not isinstance(d_nope, int) \
            or not isinstance(d_v, int) or tuple(proj.weight.shape) != (heads * (d_nope + d_v), rank_r):
        raise ValueError(f"{type(module).__name__} caches an MLA latent but has no bias-free kv_b_proj Linear of "
                         f"[{heads} x (qk_nope_head_dim + v_head_dim), {rank_r}]: cannot absorb it exactly")
    w = proj.weight.view(heads, d_nope + d_v, rank_r)
    return w[:, :d_nope], w[:, d_nope:]
