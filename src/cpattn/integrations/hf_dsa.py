"""DSA (DeepSeek sparse attention) models in the Hugging Face plug-in: transformers' DeepSeek-V3.2
and GLM-5 (``deepseek_v32``, ``glm_moe_dsa``; every model whose ``config.layer_types`` holds
``"indexed_attention"``), run unmodified under CP by :mod:`cpattn.integrations.hf`.

transformers' DSA layers call three generic hooks, and the plug-in serves each (no model code is
copied, nothing is recomputed per rank):

* ``cache.update(k_latent, k_rope, layer)``: the MLA latent and rope key of the rank's rows
  ``[1, 1, P, r]`` / ``[1, 1, P, d_rope]``. The plug-in hands the model a gathering cache for the
  forward, whose ``update`` all-gathers both in ONE collective and returns the logical ``[1, 1, T,
  ...]`` latent of the whole batch (stored in the real cache with ``use_cache=True``). The model
  then up-projects K/V of all T tokens itself.
* ``cache.update_indexer(k_idx, layer)``: the lightning indexer's key ``[1, P, D_i]``: gathered the
  same way (ONE collective), so the indexer scores every key of the sequence, not the rank's own.
* the ``"indexed_attention"`` entry of the mask mapping (given as ``attention_mask={...}``): a
  bool ``[1, 1, P, T]`` mask, True where key ``j`` is in row ``i``'s sequence at a position ``<=``
  its own (:func:`cpattn.dsa.key_ranges`). The indexer masks its scores with it, so its top-k
  never crosses sequences or looks ahead.

The attention function then receives the model's ``indices`` ``[1, P, topk]`` (indices into the
gathered T keys; "shared" GLM layers reuse the previous layer's) and calls
``strategy.sparse_attention`` with them converted to positions (``indices - ks``): entries of
other sequences become negative or future positions, which the causal rule drops. Collectives per
layer: two (latent, index key) for layers with an indexer, one for "shared" layers.

Memory: the indexer's dense ``[P, T]`` scores and this mask are transformers' design (its own
path builds them too); the engine path (``cpattn.dsa.index_topk``) never materializes them.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
from torch import Tensor

from .. import dsa

__all__ = ["DSA_LAYER_TYPES", "cp_mask", "is_dsa_config", "prepare_forward", "finish_forward",
           "sparse_attention_forward"]

#: The ``layer_types`` entries (and mask-mapping keys) of transformers' DSA layers: the name
#: differs between transformers releases ("deepseek_sparse_attention" before "indexed_attention").
DSA_LAYER_TYPES = frozenset({"indexed_attention", "deepseek_sparse_attention"})


def is_dsa_config(config) -> bool:
    """Does the (decoder) config describe DSA layers (a :data:`DSA_LAYER_TYPES` entry in ``layer_types``)?"""
    return not DSA_LAYER_TYPES.isdisjoint(getattr(config, "layer_types", None) or ())


def mask_mapping(mask) -> dict:
    """The attention-mask mapping a DSA decoder reads its layers' mask from (every DSA name)."""
    return dict.fromkeys(DSA_LAYER_TYPES, mask)


def _rows_to_tokens(x: Tensor) -> Tensor:
    """[1, H, N, D] -> [N, H, D] (a view)."""
    return x[0].transpose(0, 1)


class _GatheringCache:
    """The cache a DSA model sees during one CP forward: ``update`` / ``update_indexer`` gather
    the rank's rows of the latent / index keys over the CP group (one collective each) and return
    (or, with ``inner``, store in it and return) the logical rows of the whole batch."""

    def __init__(self, ctx, inner: Optional[Any]) -> None:
        self._ctx, self._inner = ctx, inner

    def _gather(self, parts: list[Tensor]) -> list[Tensor]:
        ctx = self._ctx
        return ctx.strategy.gather_packed(parts, ctx.meta, ctx.group)

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """key_states [1, Hk, P, Dk], value_states [1, Hv, P, Dv] (DSA: latent and rope key) ->
        the logical [1, Hk, T, Dk], [1, Hv, T, Dv], gathered in ONE collective."""
        k_all, v_all = self._gather([_rows_to_tokens(key_states), _rows_to_tokens(value_states)])
        k_all, v_all = k_all.transpose(0, 1).unsqueeze(0), v_all.transpose(0, 1).unsqueeze(0)
        if self._inner is not None:
            return self._inner.update(k_all, v_all, layer_idx, *args, **kwargs)
        return k_all, v_all

    def update_indexer(self, indexer_key_states: Tensor, layer_idx: int) -> Tensor:
        """[1, P, D_i] -> the logical [1, T, D_i] index keys (ONE collective)."""
        (k_all,) = self._gather([indexer_key_states[0]])
        k_all = k_all.unsqueeze(0)
        if self._inner is not None:
            return self._inner.update_indexer(k_all, layer_idx)
        return k_all

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self._inner is None else self._inner.get_seq_length(layer_idx)


def cp_mask(meta) -> Tensor:
    """bool [1, 1, P, T]: key j visible to row i iff ks[i] <= j < ke[i] (prefix 0: packed K/V rows
    are the logical token indices)."""
    ks, ke = dsa.key_ranges(meta)
    j = torch.arange(meta.num_tokens, device=meta.device, dtype=torch.int32)
    return ((j[None, :] >= ks[:, None]) & (j[None, :] < ke[:, None]))[None, None]


def prepare_forward(module, ctx, bound, kwargs: dict, cache_name: str, cache: Optional[Any], use_cache: bool,
                    transformers) -> tuple[tuple, dict]:
    """Decoder pre-hook for DSA models (called by the plug-in's hook under a CP context): returns
    the forward's (args, kwargs) with the gathering cache (wrapping ``cache`` when ``use_cache``;
    a new ``DynamicCache`` when none was given) and the CP mask mapping. Raises ValueError before
    any collective for a cache it cannot fill."""
    inner = None
    if use_cache:
        inner = cache if cache is not None else transformers.DynamicCache(config=module.config)
        if not isinstance(inner, transformers.DynamicCache) or inner.get_seq_length() != 0:
            raise ValueError(f"the cache must be an empty transformers.DynamicCache, got {type(inner).__name__} "
                             f"holding {inner.get_seq_length() if hasattr(inner, 'get_seq_length') else '?'} tokens")
    mask = cp_mask(ctx.meta)
    new_args, new_kwargs = (), {}
    for name, value in bound.arguments.items():  # every argument by name (positional ones too)
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            new_kwargs.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            new_args = tuple(value)
        else:
            new_kwargs[name] = value
    new_kwargs.pop("past_key_values", None)
    new_kwargs[cache_name] = _GatheringCache(ctx, inner)
    new_kwargs["attention_mask"] = mask_mapping(mask)
    new_kwargs["use_cache"] = use_cache
    ctx._forward.update(active=True, dsa_mask=mask, dsa_cache=inner)
    return new_args, new_kwargs


def finish_forward(ctx, output: Any) -> None:
    """Decoder post-hook: the forward's output holds the real cache (or none), not the gathering one."""
    if "dsa_mask" not in ctx._forward or output is None:
        return
    for name in ("cache", "past_key_values"):  # the output's field (renamed in newer transformers)
        if isinstance(getattr(output, name, None), _GatheringCache):
            setattr(output, name, ctx._forward.get("dsa_cache"))


def sparse_attention_forward(ctx, module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                             indices: Tensor, scaling: Optional[float], dropout: float) -> tuple[Tensor, None]:
    """The attention function's DSA path: query [1, Hq, P, D] (local rows), key / value
    [1, Hkv, T, D] / [.., Dv] (the model's K/V over the gathered latent), indices [1, P, topk]
    int (into the T keys) -> (out [1, P, Hq, Dv], None) through ``strategy.sparse_attention``."""
    meta = ctx.meta
    p, t = meta.num_physical_tokens, meta.num_tokens
    if attention_mask is not ctx._forward.get("dsa_mask"):
        raise ValueError("a DSA layer under cpattn got an attention mask the plug-in did not build (do not pass "
                         "custom masks)")
    if dropout:
        raise ValueError(f"cpattn attention is for inference: dropout must be 0, got {dropout} (call model.eval())")
    for name, x, rows in (("query", query, p), ("key", key, t), ("value", value, t)):
        if x.dim() != 4 or x.shape[0] != 1 or x.shape[2] != rows:
            raise ValueError(f"DSA {name} must be [1, heads, {rows}, head_dim], got shape {tuple(x.shape)}")
    if not isinstance(indices, Tensor) or indices.dim() != 3 or indices.shape[:2] != (1, p):
        raise ValueError(f"DSA indices must be [1, P={p}, topk], got {getattr(indices, 'shape', indices)}")
    ks, _ = dsa.key_ranges(meta)
    idx = indices[0].to(torch.int64) - ks[:, None].to(torch.int64)  # token index -> position in its sequence
    out = ctx.strategy.sparse_attention(
        query[0].transpose(0, 1), _rows_to_tokens(key), _rows_to_tokens(value), meta, idx,
        softmax_scale=scaling, backend=ctx.backend,
    )
    return out.unsqueeze(0), None
