"""DSA decode steps over a sharded cache in the Hugging Face plug-in (used by
:class:`cpattn.integrations.hf_cache.ShardedKVCache`).

transformers' DSA indexer (``deepseek_v32``, ``glm_moe_dsa``) asks the cache for the index keys
(``cache.update_indexer(k_new, layer)``), scores its queries against the keys it gets back,
masks the scores with the ``"indexed_attention"`` mask and keeps ``scores.topk(k).indices``; the
attention function receives those indices (``indices=``), and a GLM "shared" layer receives the
previous layer's. Over a sharded cache the plug-in answers ``update_indexer`` with THIS rank's
index keys, so the model scores its queries against the rank's 1/C of the context, and the mask
it is given marks which local keys each new token sees. The returned keys are a
:class:`SelectingKeys` tensor: every tensor the indexer derives from them stays one, and their
``topk`` is the exact GLOBAL top-k: the rank's candidates (its ``k`` best keys, ties to the lower
position, :mod:`cpattn.selection`) are all-gathered (ONE collective) and the ``k`` best of all
ranks' candidates kept (as :func:`cpattn.plans.sparse.select_candidates`). Every key of the global
top-k is among its owner's local top-k, so the selection equals the one a single process makes
over the whole context. ``indices`` are global positions (-1 where fewer keys exist); the
attention function runs the sparse shard-merge plan with them, and a "shared" layer reuses them.

The scores are the model's own (its projections, rope and weighting run unchanged); only the
top-k over them is distributed.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from .. import collectives
from ..kv_sharding import KVSharding
from ..selection import NO_KEY, key_positions, pack_keys, top_keys

__all__ = ["SelectingKeys", "agree_topk", "decode_mask", "selecting_keys"]

#: select(scores [1, n, m] float, k) -> (values [1, n, k'] float32, indices [1, n, k'] int32)
Selector = Callable[[Tensor, int], tuple[Tensor, Tensor]]


class SelectingKeys(Tensor):
    """A tensor whose descendants keep its selector and whose ``topk`` runs it (see the module doc).
    Built by :func:`selecting_keys`; every other operation runs as on a plain tensor."""

    _cpattn_select: Optional[Selector] = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        select = _find_selector(args) or _find_selector(tuple(kwargs.values()))
        if func in (Tensor.topk, torch.topk) and select is not None:
            scores, k = args[0], (args[1] if len(args) > 1 else kwargs["k"])
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            if dim not in (-1, scores.dim() - 1) or kwargs.get("largest", True) is False:
                raise ValueError("a DSA indexer over a ShardedKVCache must take the largest top-k over the key "
                                 f"dimension (got dim={dim}, largest={kwargs.get('largest', True)})")
            with torch._C.DisableTorchFunctionSubclass():
                plain = scores.as_subclass(Tensor)
            values, indices = select(plain, int(k))
            return torch.return_types.topk((values, indices))
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        return _wrap(out, select) if select is not None else out


def _find_selector(items) -> Optional[Selector]:
    for x in items:
        if isinstance(x, SelectingKeys) and x._cpattn_select is not None:
            return x._cpattn_select
        if isinstance(x, (tuple, list)):
            found = _find_selector(x)
            if found is not None:
                return found
    return None


def _wrap(out, select: Selector):
    if isinstance(out, Tensor) and out.is_floating_point():
        out = out.as_subclass(SelectingKeys)
        out._cpattn_select = select
        return out
    if isinstance(out, (tuple, list)) and not hasattr(out, "_fields"):
        return type(out)(_wrap(x, select) for x in out)
    return out


def selecting_keys(keys: Tensor, select: Selector) -> SelectingKeys:
    """``keys`` (a view, no copy) as a :class:`SelectingKeys` whose ``topk`` calls ``select``."""
    out = keys.as_subclass(SelectingKeys)
    out._cpattn_select = select
    return out


def decode_mask(sharding: KVSharding, rank: int, start: int, num_new: int, device: torch.device) -> Tensor:
    """bool [1, 1, n, m]: new token ``i`` (position ``start + i``) sees local key ``j`` of this
    rank iff its global position is ``<= start + i`` (``m`` = the rank's keys after the step)."""
    ends = torch.arange(start + 1, start + num_new + 1)
    counts = sharding.local_lengths(ends, rank)  # local keys at positions <= start + i
    m = int(sharding.local_lengths([start + num_new], rank)[0])
    mask = torch.arange(m)[None, :] < counts[:, None]
    return mask[None, None].to(device)


def _unpack_scores(keys: Tensor) -> Tensor:
    """float32 scores of packed keys (:mod:`cpattn.selection`), -inf for ``NO_KEY``."""
    hi = (keys >> 32).to(torch.int32)
    bits = torch.where(hi >= 0, hi, hi ^ 0x7FFFFFFF)
    scores = bits.view(torch.float32)
    return torch.where(keys == NO_KEY, torch.full((), float("-inf"), device=keys.device), scores)


def agree_topk(scores: Tensor, visible: Tensor, positions: Tensor, topk: int, cp_size: int,
               group=None) -> tuple[Tensor, Tensor]:
    """The exact global top-k of one step from this rank's scores.

    Args:
        scores: [n, m] float, the new tokens' index scores against this rank's m keys.
        visible: bool [n, m], the keys each token sees (others are never selected).
        positions: int64 [m], the keys' global positions.
        topk: keys kept per token (the same on every rank).
        cp_size: ranks of ``group`` (1: no collective).

    Returns:
        (values [n, topk] float32 scores, indices [n, topk] int32 global positions, -1 where
        fewer keys are visible in the whole context); identical on every rank. ONE all-gather of
        ``n * topk`` int64 per rank when ``cp_size > 1``.
    """
    cand = top_keys(pack_keys(scores, positions[None, :], visible), topk)  # [n, topk] int64
    if cp_size > 1:
        gathered = torch.empty((cp_size * cand.shape[0], topk), dtype=torch.int64, device=cand.device)
        collectives.all_gather_into(gathered, cand.contiguous(), group, False)  # the agreement
    else:
        gathered = cand
    # the topk best of every rank's candidates (as cpattn.plans.sparse.select_candidates), kept packed
    # so the scores come back with the positions
    best = top_keys(gathered.view(cp_size, *cand.shape).permute(1, 0, 2).reshape(cand.shape[0], -1), topk)
    return _unpack_scores(best), key_positions(best).to(torch.int32)
