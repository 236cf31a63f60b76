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
    meta = s.build_metadata(extend_lens, rank=rank, group=group).to(device)   # plan once per forward
    cphf.enable(model)                                               # attn_implementation="cpattn"
    inputs = cphf.shard_inputs(s, meta, input_ids=ids)               # ids [1, T] -> [1, P]
    with cphf.cp_context(s, meta, group):
        logits_local = model(**inputs).logits                        # [1, P, vocab]
    logits = cphf.gather_outputs(s, meta, logits_local, group)       # [1, T, vocab], every rank

``input_ids`` is the packed batch (sequence after sequence, ``sum(extend_lens)`` tokens); position
ids are global and restart at every sequence (derived from ``meta`` unless given). Pad rows see
token 0 at position 0; their outputs are dropped by :func:`gather_outputs`.

``use_cache=True`` (one sequence): the returned ``DynamicCache`` holds the whole logical K/V
``[1, Hkv, T, D]`` of every layer on every rank (the gathered K/V, written into the cache by the
attention function), so the plain model can decode from it without CP (``model.generate(...,
cache=out.cache)`` after ``model.set_attn_implementation("sdpa")``).

Generation with a sharded KV cache: pass a :class:`cpattn.integrations.hf_cache.ShardedKVCache`
(``cphf.ShardedKVCache(model.config, group)``) as the cache of ``model.generate`` on every rank of
the group: the decoder hook runs the prompt's forward under CP (each rank stores the keys it owns)
and every later forward with replicated queries over the sharded cache (exact merge), no
``cp_context`` needed (see :mod:`cpattn.integrations.hf_cache`; DSA models also shard their index
keys and agree on the exact global top-k per step: :mod:`cpattn.integrations.hf_dsa_cache`).

DSA models (transformers' ``deepseek_v32``, ``glm_moe_dsa``: ``"indexed_attention"`` layers) run
through :mod:`cpattn.integrations.hf_dsa`: their latent and index keys are gathered in the cache
hooks, the indexer's mask comes from the plan, and the attention function runs
``strategy.sparse_attention`` over the model's top-k ``indices``.

Refused, with a ValueError before any collective (nothing here can run them exactly):
:func:`enable` rejects models with token mixers other than full / sliding-window attention
(``layer_types`` such as ``linear_attention`` or ``conv``, convolution or recurrent mixer modules:
Qwen3-Next, Lfm2, Mamba hybrids; they mix tokens across the sequence outside attention) and
attention logit softcapping (Gemma 2); a 2-D ``attention_mask`` containing zeros (padding) is
rejected by :func:`shard_inputs` and by the forward (all ones is fine). Also: batch dim 1 (packed),
prefix lengths 0, no dropout, no custom 4-D masks. MLA models (DeepseekV3) gather the up-projected
per-head K/V that the attention function receives; gathering the compressed latent instead needs a
change in the model's attention module (``strategy.gather_mla_latent`` before ``expand_kv``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch import Tensor

from ..collectives import check_group
from ..metadata import CPMetadata
from ..strategies import CPStrategy
from . import hf_dsa

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CPContext",
    "cp_context",
    "SUPPORTED_LAYER_TYPES",
    "ShardedKVCache",
    "cache_keyword",
    "check_model",
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


#: ``layer_types`` entries the plug-in runs exactly (attention over the whole sequence or a window;
#: DSA sparse attention through :mod:`cpattn.integrations.hf_dsa`).
SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"}) | hf_dsa.DSA_LAYER_TYPES

#: Class-name pattern of known token mixers that are not attention (recurrent / SSM / conv blocks).
_MIXER_CLASS = re.compile(
    r"Mamba|GatedDeltaNet|DeltaNet|LinearAttention|Lightning|ShortConv|Rwkv|RWKV|RecurrentBlock|Rglru|SSM"
)


@dataclass(frozen=True)
class CPContext:
    """What the attention function needs for one forward: strategy, the rank's plan (on the
    model's device), the CP process group (None: default group) and the attention backend."""

    strategy: CPStrategy
    meta: CPMetadata
    group: Any = None
    backend: str = "auto"
    # Per-forward state set by the model's pre-hook (see enable): {"cache": DynamicCache or None}.
    _forward: dict = field(default_factory=dict, compare=False, repr=False)


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


def _configs(model: torch.nn.Module) -> list:
    config = model.config
    configs = [config]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        text = get_text(decoder=True) if "decoder" in inspect.signature(get_text).parameters else get_text()
        if text is not None and text is not config:
            configs.append(text)
    return configs


def check_model(model: torch.nn.Module) -> None:
    """ValueError unless every token mixer of ``model`` is attention the plug-in runs exactly.

    Checks, without changing the model: ``config.layer_types`` (and ``layers_block_type``) hold
    only full / sliding-window attention; no convolution (``nn.Conv1d``) or known recurrent /
    linear-attention mixer module in the decoder (they mix tokens along the sequence outside
    attention, so rank-local rows would silently give wrong outputs); no attention logit
    softcapping (``config.attn_logit_softcapping``, Gemma 2). :func:`enable` calls it first.
    """
    problems = []
    for config in _configs(model):
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None:
            bad = {i: t for i, t in enumerate(layer_types) if t not in SUPPORTED_LAYER_TYPES}
            if bad:
                problems.append(
                    f"config.layer_types has token mixers other than attention at layers {sorted(bad)}: "
                    f"{sorted(set(bad.values()))} (supported: {sorted(SUPPORTED_LAYER_TYPES)})"
                )
        block_types = getattr(config, "layers_block_type", None)
        if block_types is not None:
            bad = sorted({t for t in block_types if t != "attention"})
            if bad:
                problems.append(f"config.layers_block_type has non-attention blocks {bad}")
        softcap = getattr(config, "attn_logit_softcapping", None)
        if softcap:
            problems.append(f"config.attn_logit_softcapping={softcap} (attention logit softcapping is not supported)")
    decoder = _decoder(model)
    for path, module in decoder.named_modules():
        kind = type(module).__name__
        if isinstance(module, torch.nn.Conv1d) or _MIXER_CLASS.search(kind):
            problems.append(f"module {path or '<root>'} ({kind}) mixes tokens along the sequence outside attention")
            break
    if problems:
        raise ValueError(
            f"{type(model).__name__} cannot run exactly under cpattn CP (rank-local rows would give wrong "
            "outputs): " + "; ".join(dict.fromkeys(problems))
        )


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    get = getattr(model, "get_decoder", None)
    try:
        decoder = get() if callable(get) else None
    except Exception:  # noqa: BLE001 - exotic wrappers raise; the whole model is then checked
        decoder = None
    return decoder if isinstance(decoder, torch.nn.Module) else model


def enable(model: torch.nn.Module, name: str = ATTN_IMPLEMENTATION) -> torch.nn.Module:
    """Check ``model`` (:func:`check_model`), register the attention function, switch ``model`` to
    it and install the input checks / cache hook on its decoder; returns ``model``.

    Raises ValueError, leaving the model unchanged, for models the plug-in cannot run exactly.
    Idempotent. Switch back with ``model.set_attn_implementation("sdpa")`` (e.g. to decode without
    CP from the prefill's cache); the hook is inactive then.
    """
    check_model(model)
    previous = getattr(model.config, "_attn_implementation", None)
    register(name)
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        if previous is not None and previous != model.config._attn_implementation:
            model.set_attn_implementation(previous)
        raise ValueError(
            f"{type(model).__name__} did not switch to attn_implementation={name!r} "
            f"(it reports {model.config._attn_implementation!r}); it may not use transformers' AttentionInterface"
        )
    decoder = _decoder(model)
    if not getattr(decoder, "_cpattn_hooked", False):
        decoder.register_forward_pre_hook(functools.partial(_before_forward, name=name), with_kwargs=True)
        decoder.register_forward_hook(_after_forward, always_call=True)
        decoder._cpattn_hooked = True
    return model


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword ``model``'s forward (and so ``model.generate``) takes its cache by: ``"cache"``
    in current transformers, ``"past_key_values"`` in releases before the rename. Pass a
    :class:`ShardedKVCache` as ``model.generate(ids, **{cphf.cache_keyword(model): cache})`` to run on
    either."""
    return _cache_argument(_decoder(model))


def _forward_signature(module: torch.nn.Module) -> inspect.Signature:
    """``inspect.signature(module.forward)``, computed once per module (every forward's hook binds
    its arguments: a decode step of a 2-layer model spent ~0.7 ms of CPU in ``inspect`` without it)."""
    sig = module.__dict__.get("_cpattn_forward_signature")
    if sig is None:
        sig = module.__dict__["_cpattn_forward_signature"] = inspect.signature(module.forward)
    return sig


def _cache_argument(decoder: torch.nn.Module) -> str:
    params = _forward_signature(decoder).parameters
    return "cache" if "cache" in params else "past_key_values"


def _check_mask(mask: Any, where: str) -> None:
    """A 2-D padding mask is only exact when it is all ones (the plan gives the boundaries)."""
    if isinstance(mask, Tensor) and mask.dim() == 2 and not bool((mask != 0).all()):
        zeros = int((mask == 0).sum())
        raise ValueError(
            f"{where}: attention_mask of shape {tuple(mask.shape)} has {zeros} zero(s) (padding); cpattn takes the "
            "sequence boundaries from the plan and cannot mask single tokens: pack the batch without pad tokens "
            "(give the real lengths as extend_lens) and pass no mask, or an all-ones mask"
        )


def _before_forward(module: torch.nn.Module, args: tuple, kwargs: dict, *, name: str) -> Optional[tuple[tuple, dict]]:
    """Decoder pre-hook (installed by enable): under a CP context with the cpattn attention, reject
    a 2-D mask with zeros and, for ``use_cache``, hand the model an empty DynamicCache whose layers
    the attention function fills with the gathered K/V. Runs before any collective."""
    if getattr(module.config, "_attn_implementation", None) != name:
        return None
    ctx = _CONTEXT.get()
    sharded_cls = _sharded_cache_class()
    if ctx is None and sharded_cls is None:
        return None
    try:
        bound = _forward_signature(module).bind_partial(*args, **kwargs)
    except TypeError:
        return None  # the model raises its own error for bad arguments

    def argument(key: str):
        value = bound.arguments.get(key)
        return kwargs.get(key) if value is None or key == "kwargs" else value

    cache_name = _cache_argument(module)
    cache = argument(cache_name)
    if cache is None and cache_name != "past_key_values":
        cache = kwargs.get("past_key_values")  # the deprecated name of the same argument
    if sharded_cls is not None and isinstance(cache, sharded_cls):
        if ctx is not None:
            raise ValueError("a ShardedKVCache plans its own CP steps: do not run it inside cp_context")
        return _begin_sharded_forward(module, bound, argument, cache_name, cache)
    if ctx is None:
        return None
    ctx._forward.clear()
    _check_mask(argument("attention_mask"), "the forward")
    use_cache = argument("use_cache")
    if use_cache is None:
        use_cache = bool(getattr(module.config, "use_cache", False))
    if not use_cache and cache is not None:
        raise ValueError("a cache was passed with use_cache=False: pass use_cache=True to fill it under CP")
    if use_cache:
        _check_cache_use(ctx.meta)
    if hf_dsa.is_dsa_config(module.config):  # DSA: a gathering cache + the CP mask (hf_dsa)
        return hf_dsa.prepare_forward(module, ctx, bound, kwargs, cache_name, cache, use_cache, _import_transformers())
    if not use_cache:
        ctx._forward["active"] = True
        return None
    transformers = _import_transformers()
    if cache is None:
        cache = transformers.DynamicCache(config=module.config)
        kwargs = {k: v for k, v in kwargs.items() if k != "past_key_values"}
        kwargs[cache_name] = cache
    _check_cache_object(cache, transformers)
    ctx._forward.update(active=True, cache=cache)
    return args, kwargs


def _after_forward(module: torch.nn.Module, args: tuple, output: Any) -> Any:
    ctx = _CONTEXT.get()
    if ctx is not None and ctx._forward.get("sharded") is not None:
        return _finish_sharded_forward(ctx, output)
    if ctx is not None:
        hf_dsa.finish_forward(ctx, output)
        ctx._forward.clear()
    return None


def _sharded_cache_class():
    """:class:`hf_cache.ShardedKVCache` once its module is imported (no instance exists before)."""
    module = sys.modules.get(f"{__package__}.hf_cache")
    return None if module is None else module.ShardedKVCache


def _begin_sharded_forward(module: torch.nn.Module, bound, argument, cache_name: str, cache) -> tuple[tuple, dict]:
    """Pre-hook of a forward over a ShardedKVCache: checks (before any collective), the step's
    plan (``cache.begin_step``), the prompt's inputs sharded by the prefill strategy, and the CP
    context the attention function reads (reset by :func:`_finish_sharded_forward`)."""
    _check_mask(argument("attention_mask"), "the forward")
    if argument("use_cache") is False:
        raise ValueError("a forward over a ShardedKVCache stores its keys there: pass use_cache=True "
                         "(or leave it unset)")
    ids, embeds, pos = argument("input_ids"), argument("inputs_embeds"), argument("position_ids")
    x = ids if ids is not None else embeds
    if not isinstance(x, Tensor) or x.dim() < 2:
        raise ValueError("a forward over a ShardedKVCache needs input_ids [1, n] or inputs_embeds [1, n, hidden]")
    if x.shape[0] != 1:
        raise ValueError(f"a ShardedKVCache holds one sequence: the batch must have 1 row, got input shape "
                         f"{tuple(x.shape)} (beam search and num_return_sequences > 1 are not supported)")
    n = x.shape[1]
    if pos is not None and (not isinstance(pos, Tensor) or pos.shape[-1] != n):
        raise ValueError(f"position_ids must have {n} positions (the new tokens), got {getattr(pos, 'shape', pos)}")
    if module.training and getattr(module.config, "attention_dropout", 0.0):
        raise ValueError("cpattn attention is for inference: call model.eval() (attention dropout is on)")
    if cache.get_seq_length() == 0 and argument("output_hidden_states"):
        raise ValueError("output_hidden_states=True: the prompt's forward over a ShardedKVCache gathers only "
                         "last_hidden_state (the other layers' rows stay sharded)")
    cache.check_decoder(module)
    step = cache.begin_step(n, x.device)  # the plan agreement: the first collective of the forward
    call = {k: v for k, v in bound.arguments.items() if k != "kwargs"}
    call.update(bound.arguments.get("kwargs", {}))
    call.pop("past_key_values", None)
    call.update({cache_name: cache, "attention_mask": None, "use_cache": True})
    if not step.decode:
        if pos is None:
            pos = torch.arange(n, device=x.device).unsqueeze(0)
        key = "input_ids" if ids is not None else "inputs_embeds"
        sharded = shard_inputs(step.strategy, step.meta, **{key: x}, position_ids=pos.reshape(1, n))
        call.update(input_ids=sharded.get("input_ids"), inputs_embeds=sharded.get("inputs_embeds"),
                    position_ids=sharded["position_ids"])
    if step.dsa_mask is not None:  # DSA: the indexer's mask (hf_dsa_cache), passed as the mask mapping
        call["attention_mask"] = hf_dsa.mask_mapping(step.dsa_mask)
    ctx = CPContext(step.strategy, step.meta, cache.group, cache.backend)
    ctx._forward.update(active=True, cache=cache, sharded=step, module=module, dsa_mask=step.dsa_mask)
    ctx._forward["token"] = _CONTEXT.set(ctx)
    return (), call


def _finish_sharded_forward(ctx: CPContext, output: Any) -> Any:
    """Post-hook: gather the prompt's output rows (ONE collective) and close the cache's step."""
    cache, step, token = ctx._forward["cache"], ctx._forward["sharded"], ctx._forward["token"]
    ctx._forward.clear()
    _CONTEXT.reset(token)
    if output is None:  # the forward raised
        cache.finish_step(False)
        return None
    try:
        if not step.decode:
            hidden = output[0]
            full = gather_outputs(step.strategy, step.meta, hidden, cache.group)
            if isinstance(output, tuple):
                output = (full, *output[1:])
            else:
                output["last_hidden_state"] = full
    except BaseException:
        cache.finish_step(False)
        raise
    cache.finish_step(True)
    return output


def _check_cache_use(meta: CPMetadata) -> None:
    if meta.num_seqs != 1:
        raise ValueError(
            f"use_cache=True needs a single sequence (a transformers cache holds one contiguous K/V per layer), "
            f"got {meta.num_seqs} packed sequences; run them one at a time or pass use_cache=False"
        )


def _check_cache_object(cache: Any, transformers: Any) -> None:
    layer_types = (transformers.cache_utils.DynamicLayer, transformers.cache_utils.DynamicSlidingWindowLayer)
    if not isinstance(cache, transformers.DynamicCache) or any(type(x) not in layer_types for x in cache.layers):
        raise ValueError(
            f"the cache must be an empty transformers.DynamicCache (dynamic full / sliding layers), got "
            f"{type(cache).__name__}"
        )
    if cache.get_seq_length() != 0:
        raise ValueError(
            f"the cache already holds {cache.get_seq_length()} tokens: a CP prefill starts from an empty cache "
            "(prefix_lens must be 0)"
        )


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
    attention_mask: Optional[Tensor] = None,
    use_cache: bool = False,
) -> dict[str, Tensor | bool]:
    """Shard the packed model inputs of the whole batch for this rank.

    Args:
        input_ids: [1, T] (or [T]) token ids, sequences packed one after another. Or
        inputs_embeds: [1, T, hidden].
        position_ids: [1, T] global positions; default :func:`packed_position_ids`.
        attention_mask: optional [1, T] (or [T]) padding mask; must be all ones (a zero would
            mask a token the plan treats as real: ValueError). It is not passed on.
        use_cache: return a cache (``out.cache``) holding the whole logical K/V; one sequence only.

    Returns:
        keyword arguments for ``model(**kwargs)``: ``input_ids`` [1, P] (or ``inputs_embeds``
        [1, P, hidden]), ``position_ids`` [1, P] (pad rows: token 0 / zero embedding, position 0)
        and ``use_cache``.
    """
    strategy.check_metadata(meta)
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    if not isinstance(use_cache, bool):
        raise TypeError(f"use_cache must be a bool, got {type(use_cache).__name__}")
    if use_cache:
        _check_cache_use(meta)
    if attention_mask is not None:
        mask = _as_batch_rows(attention_mask, "attention_mask", meta.num_tokens, "num_tokens T")
        if mask.dim() != 2:
            raise ValueError(
                f"attention_mask must be [1, T={meta.num_tokens}], got shape {tuple(attention_mask.shape)}"
            )
        _check_mask(mask, "shard_inputs")
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
    out["use_cache"] = use_cache
    return out


def gather_outputs(strategy: CPStrategy, meta: CPMetadata, x_local: Tensor, group=None) -> Tensor:
    """Rank-local model outputs ``[1, P, ...]`` (logits or hidden states) -> ``[1, T, ...]`` of the
    whole packed batch in logical order, identical on every rank (ONE all-gather; pad dropped)."""
    x_local = _as_batch_rows(x_local, "x_local", meta.num_physical_tokens, "num_physical_tokens P")
    return strategy.gather(x_local, meta, group, dim=1)


def _layer_index(module: torch.nn.Module) -> int:
    idx = getattr(module, "layer_idx", None)
    if isinstance(idx, bool) or not isinstance(idx, int):
        raise ValueError(f"{type(module).__name__} has no integer layer_idx: cannot write its K/V into the cache")
    return idx


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
    ``k > q - W``) maps to window_size ``(W - 1, 0)``; ``s_aux`` are attention sinks [Hq]. With
    ``use_cache`` the gathered K/V ``[1, Hkv, T, D]`` replace the rank-local rows in the cache.
    """
    ctx = _CONTEXT.get()
    if ctx is None:
        raise RuntimeError(
            "attn_implementation='cpattn' needs a CP context: run the forward inside "
            "`with cpattn.integrations.hf.cp_context(strategy, meta, group):`"
        )
    if not ctx._forward.get("active"):
        raise RuntimeError(
            "the model's decoder has no cpattn input hook: prepare the model with "
            "cpattn.integrations.hf.enable(model) (not only attn_implementation='cpattn')"
        )
    indices, sharded = kwargs.get("indices"), ctx._forward.get("sharded")
    if sharded is not None and sharded.decode:  # a later forward over a ShardedKVCache (hf_cache)
        dsa_mask = ctx._forward.get("dsa_mask")
        _check_attention_args(None if dsa_mask is not None and attention_mask is dsa_mask else attention_mask,
                              dropout, softcap)
        out = ctx._forward["cache"].decode_attention(_layer_index(module), query, key, value, scaling=scaling,
                                                     sliding_window=sliding_window, sinks=s_aux,
                                                     module=module, indices=indices)
        return out, None
    if indices is not None:  # a DSA layer: sparse attention over the model's top-k (hf_dsa)
        return hf_dsa.sparse_attention_forward(ctx, module, query, key, value, attention_mask, indices,
                                               scaling, dropout)
    meta = ctx.meta
    rows = meta.num_physical_tokens
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4 or t.shape[0] != 1 or t.shape[2] != rows:
            raise ValueError(
                f"{name} must be [1, heads, P={rows}, head_dim] (packed batch of the rank's physical rows; "
                f"use shard_inputs), got shape {tuple(t.shape)}"
            )
    _check_attention_args(attention_mask, dropout, softcap)
    window = (-1, -1) if sliding_window is None else (int(sliding_window) - 1, 0)
    q = query[0].transpose(0, 1).contiguous()  # [P, Hq, D]
    k = key[0].transpose(0, 1)  # [P, Hkv, D]
    v = value[0].transpose(0, 1)  # [P, Hkv, Dv]
    # Per layer: ONE all-gather of this rank's K/V -> logical [T, Hkv, D] / [T, Hkv, Dv]. Without
    # prefix, the logical extend K/V is already the packed layout strategy.attention reads.
    k_all, v_all = ctx.strategy.gather_kv(k, v, meta, ctx.group)
    cache = ctx._forward.get("cache")
    if sharded is not None:  # the prompt's forward over a ShardedKVCache: store the keys this rank owns
        cache.store_prefill(_layer_index(module), k_all, v_all, sliding_window)
    elif cache is not None:  # the model cached its rank-local rows: replace them by the logical K/V
        layer = cache.layers[_layer_index(module)]
        layer.reset()
        layer.is_initialized = False  # older releases' reset zeroes the rows in place; update would extend them
        layer.update(k_all.transpose(0, 1).unsqueeze(0), v_all.transpose(0, 1).unsqueeze(0))
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


def _check_attention_args(attention_mask: Optional[Tensor], dropout: float, softcap: Optional[float]) -> None:
    if attention_mask is not None:
        raise ValueError(
            "attn_implementation='cpattn' takes its mask from the CP metadata; the model passed an explicit "
            f"attention_mask of shape {tuple(attention_mask.shape)} (do not pass custom 4-D masks)"
        )
    if dropout:
        raise ValueError(f"cpattn attention is for inference: dropout must be 0, got {dropout} (call model.eval())")
    if softcap:
        raise NotImplementedError(f"cpattn attention does not support logit softcapping (softcap={softcap})")


def __getattr__(name: str):
    if name in ("ShardedKVCache", "hf_cache"):  # imports transformers
        from . import hf_cache

        return hf_cache if name == "hf_cache" else hf_cache.ShardedKVCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
