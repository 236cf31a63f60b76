"""Hugging Face transformers plug-in: run an unmodified model's forward with tokens sharded over a
CP group.

cpattn registers an attention function under the name ``"cpattn"`` in transformers'
``AttentionInterface``. Inside :func:`cp_context`, every attention layer of the model receives its
rank-local Q/K/V ``[1, H, P, D]`` (``P = meta.num_physical_tokens``), all-gathers K/V of the
whole batch with ``strategy.gather_kv`` (one collective per layer), and runs
``strategy.attention`` for the local queries. The mask comes from the CP metadata (packed ragged
batch, bottom-right causal, per-sequence boundaries), never from transformers: ``"cpattn"`` is not
registered as a mask function, so transformers builds no mask at all.

Adoption, on every rank of the CP group::

    from cpattn.integrations import hf as cphf

    s = cpattn.ZigzagStrategy(cp_size)
    meta = s.build_metadata(extend_lens, rank=rank).to(device)       # plan once per forward
    cphf.enable(model)                                               # attn_implementation="cpattn"
    inputs = cphf.shard_inputs(s, meta, input_ids=ids)               # ids [1, T] -> [1, P]
    with cphf.cp_context(s, meta, group):
        logits_local = model(**inputs).logits                        # [1, P, vocab]
    logits = cphf.gather_outputs(s, meta, logits_local, group)       # [1, T, vocab], every rank

``input_ids`` is the packed batch (sequence after sequence, ``sum(extend_lens)`` tokens); position
ids are global and restart at every sequence (derived from ``meta`` unless given). Pad rows see
token 0 at position 0; their outputs are dropped by :func:`gather_outputs`.

Limits: batch dim 1 (packed), no HF KV cache (``use_cache=False``; prefix lengths must be 0: an
engine with a paged cache uses the strategy API directly, see docs/integration.md), no dropout,
no softcap, no custom 4-D masks. MLA models (DeepseekV3) gather the up-projected per-head K/V that
the attention function receives; gathering the compressed latent instead needs a change in the
model's attention module (``strategy.gather_mla_latent`` before ``expand_kv``).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch import Tensor

from ..collectives import check_group
from ..metadata import CPMetadata
from ..strategies import CPStrategy

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CPContext",
    "cp_context",
    "cpattn_attention_forward",
    "enable",
    "gather_outputs",
    "packed_position_ids",
    "register",
    "shard_inputs",
]

logger = logging.getLogger("cpattn")

#: Name under which the attention function is registered in transformers' AttentionInterface.
ATTN_IMPLEMENTATION = "cpattn"


@dataclass(frozen=True)
class CPContext:
    """What the attention function needs for one forward: strategy, the rank's plan (on the
    model's device), the CP process group (None: default group) and the attention backend."""

    strategy: CPStrategy
    meta: CPMetadata
    group: Any = None
    backend: str = "auto"


_CONTEXT: contextvars.ContextVar[Optional[CPContext]] = contextvars.ContextVar("cpattn_hf_context", default=None)


def _import_transformers():
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "cpattn.integrations.hf needs Hugging Face transformers: pip install 'cpattn[hf]'"
        ) from exc
    return transformers


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register the cpattn attention function with transformers under ``name`` (idempotent)."""
    transformers = _import_transformers()
    transformers.AttentionInterface.register(name, cpattn_attention_forward)
    logger.debug("cpattn: attention function registered with transformers as %r", name)
    return name


def enable(model, name: str = ATTN_IMPLEMENTATION):
    """Register (if needed) and switch ``model`` to the cpattn attention function; returns model.

    Equivalent to building the model with ``attn_implementation="cpattn"`` after :func:`register`.
    """
    register(name)
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise ValueError(
            f"{type(model).__name__} did not switch to attn_implementation={name!r} "
            f"(it reports {model.config._attn_implementation!r}); it may not use transformers' AttentionInterface"
        )
    return model


@contextlib.contextmanager
def cp_context(
    strategy: CPStrategy, meta: CPMetadata, group=None, *, backend: str = "auto"
) -> Iterator[CPContext]:
    """Run model forwards under CP: inside the block, cpattn attention layers use ``strategy``,
    ``meta`` (this rank's plan, already on the model's device) and ``group``.

    Validates locally (strategy/meta match, group size and rank) before any collective, so a
    misconfigured rank raises instead of hanging the others. Nests and is thread/async safe
    (a ``contextvars`` variable, restored on exit).
    """
    if not isinstance(strategy, CPStrategy):
        raise TypeError(f"strategy must be a cpattn.CPStrategy, got {type(strategy).__name__}")
    strategy.check_metadata(meta)
    if meta.num_kv_tokens != meta.num_tokens:
        raise ValueError(
            f"the HF plug-in runs without a KV cache: prefix_lens must be 0, got "
            f"sum(prefix_lens) = {meta.num_kv_tokens - meta.num_tokens}"
        )
    check_group(meta, group)
    register()
    token = _CONTEXT.set(CPContext(strategy, meta, group, backend))
    try:
        yield _CONTEXT.get()
    finally:
        _CONTEXT.reset(token)


def packed_position_ids(meta: CPMetadata) -> Tensor:
    """Global position ids of the packed batch, ``[1, T]`` int64 on ``meta.device``: every
    sequence counts from its prefix length (0 without prefix)."""
    seq = torch.repeat_interleave(torch.arange(meta.num_seqs, device=meta.device), meta.extend_lens)
    offsets = torch.arange(meta.num_tokens, device=meta.device) - meta.cu_extend_lens[seq]
    return (meta.prefix_lens[seq] + offsets).unsqueeze(0)


def _as_batch_rows(x: Tensor, name: str, rows: int, what: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() >= 1 and x.shape[0] == rows and x.dim() == (1 if name != "inputs_embeds" else 2):
        x = x.unsqueeze(0)  # [T, ...] -> [1, T, ...]
    if x.dim() < 2 or x.shape[0] != 1 or x.shape[1] != rows:
        raise ValueError(f"{name} must be [1, {what}={rows}, ...] (packed batch), got shape {tuple(x.shape)}")
    return x


def shard_inputs(
    strategy: CPStrategy,
    meta: CPMetadata,
    *,
    input_ids: Optional[Tensor] = None,
    inputs_embeds: Optional[Tensor] = None,
    position_ids: Optional[Tensor] = None,
) -> dict[str, Tensor | bool]:
    """Shard the packed model inputs of the whole batch for this rank.

    Args:
        input_ids: [1, T] (or [T]) token ids, sequences packed one after another. Or
        inputs_embeds: [1, T, hidden].
        position_ids: [1, T] global positions; default :func:`packed_position_ids`.

    Returns:
        keyword arguments for ``model(**kwargs)``: ``input_ids`` [1, P] (or ``inputs_embeds``
        [1, P, hidden]), ``position_ids`` [1, P] (pad rows: token 0 / zero embedding, position 0)
        and ``use_cache=False``.
    """
    strategy.check_metadata(meta)
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    out: dict[str, Tensor | bool] = {}
    if input_ids is not None:
        ids = _as_batch_rows(input_ids, "input_ids", meta.num_tokens, "num_tokens T")
        out["input_ids"] = strategy.shard(ids, meta, dim=1)
    else:
        emb = _as_batch_rows(inputs_embeds, "inputs_embeds", meta.num_tokens, "num_tokens T")
        out["inputs_embeds"] = strategy.shard(emb, meta, dim=1)
    pos = packed_position_ids(meta) if position_ids is None else position_ids
    pos = _as_batch_rows(pos, "position_ids", meta.num_tokens, "num_tokens T")
    out["position_ids"] = strategy.shard(pos, meta, dim=1)
    out["use_cache"] = False
    return out


def gather_outputs(strategy: CPStrategy, meta: CPMetadata, x_local: Tensor, group=None) -> Tensor:
    """Rank-local model outputs ``[1, P, ...]`` (logits or hidden states) -> ``[1, T, ...]`` of the
    whole packed batch in logical order, identical on every rank (ONE all-gather; pad dropped)."""
    x_local = _as_batch_rows(x_local, "x_local", meta.num_physical_tokens, "num_physical_tokens P")
    return strategy.gather(x_local, meta, group, dim=1)


def cpattn_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    s_aux: Optional[Tensor] = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers attention function: query [1, Hq, P, D], key [1, Hkv, P, D], value
    [1, Hkv, P, Dv] (rank-local rows) -> (out [1, P, Hq, Dv], None).

    K/V of all ranks are gathered in one collective; the local queries attend causally within
    their own sequence (from the CP metadata). ``sliding_window`` W (transformers: keys with
    ``k > q - W``) maps to window_size ``(W - 1, 0)``; ``s_aux`` are attention sinks [Hq].
    """
    ctx = _CONTEXT.get()
    if ctx is None:
        raise RuntimeError(
            "attn_implementation='cpattn' needs a CP context: run the forward inside "
            "`with cpattn.integrations.hf.cp_context(strategy, meta, group):`"
        )
    meta = ctx.meta
    rows = meta.num_physical_tokens
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4 or t.shape[0] != 1 or t.shape[2] != rows:
            raise ValueError(
                f"{name} must be [1, heads, P={rows}, head_dim] (packed batch of the rank's physical rows; "
                f"use shard_inputs), got shape {tuple(t.shape)}"
            )
    if attention_mask is not None:
        raise ValueError(
            "attn_implementation='cpattn' takes its mask from the CP metadata; the model passed an explicit "
            f"attention_mask of shape {tuple(attention_mask.shape)} (do not pass custom 4-D masks)"
        )
    if dropout:
        raise ValueError(f"cpattn attention is for inference: dropout must be 0, got {dropout} (call model.eval())")
    if softcap:
        raise NotImplementedError(f"cpattn attention does not support logit softcapping (softcap={softcap})")
    window = (-1, -1) if sliding_window is None else (int(sliding_window) - 1, 0)
    q = query[0].transpose(0, 1).contiguous()  # [P, Hq, D]
    k = key[0].transpose(0, 1)  # [P, Hkv, D]
    v = value[0].transpose(0, 1)  # [P, Hkv, Dv]
    # Per layer: ONE all-gather of this rank's K/V -> logical [T, Hkv, D] / [T, Hkv, Dv]. Without
    # prefix, the logical extend K/V is already the packed layout strategy.attention reads.
    k_all, v_all = ctx.strategy.gather_kv(k, v, meta, ctx.group)
    out = ctx.strategy.attention(
        q,
        k_all,
        v_all,
        meta,
        softmax_scale=scaling,
        window_size=window,
        sinks=s_aux,
        backend=ctx.backend,
    )
    return out.unsqueeze(0), None  # [1, P, Hq, Dv]; pad rows are zero
