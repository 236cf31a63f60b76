"""Attention backends for the local queries of a CP rank, behind one registry.

Every backend computes the same thing (see :class:`AttentionCall`); ``backend="auto"`` picks the
first of :data:`AUTO_ORDER` that is installed and supports the call. Backends register themselves
here; the hot path does one dictionary lookup, no if/else chain per backend.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from torch import Tensor

from ..metadata import CPMetadata

__all__ = [
    "AUTO_ORDER",
    "AttentionBackend",
    "AttentionCall",
    "available_backends",
    "get_backend",
    "register_backend",
    "resolve_backend",
]

logger = logging.getLogger("cpattn")


@dataclass(frozen=True)
class AttentionCall:
    """One validated attention call for a rank's local queries.

    q: [P, Hq, D]. k, v: packed [num_kv_tokens, Hkv, D] / [.., Hkv, Dv], or paged caches
    [num_pages, page_size, Hkv, D] / [.., Dv] when ``page_table`` ([B, max_pages] int32) is given.
    softmax_scale: float. window_left: keys at positions >= position - window_left (-1: none).
    sinks: [Hq] float logits or None. Returns out [P, Hq, Dv] (pad rows 0) and, if asked, lse
    [P, Hq] float32 natural log (-inf on pad rows, sinks counted).
    """

    q: Tensor
    k: Tensor
    v: Tensor
    meta: CPMetadata
    softmax_scale: float
    window_left: int
    sinks: Optional[Tensor]
    page_table: Optional[Tensor]
    return_lse: bool

    @property
    def paged(self) -> bool:
        return self.page_table is not None


class AttentionBackend(Protocol):
    name: str

    def unsupported_reason(self, call: AttentionCall) -> Optional[str]:
        """None when this backend can run ``call`` here, else why not (one line)."""

    def run(self, call: AttentionCall) -> tuple[Tensor, Optional[Tensor]]:
        """Return (out [P, Hq, Dv], lse [P, Hq] float32 or None)."""


_REGISTRY: dict[str, Callable[[], AttentionBackend]] = {}
_INSTANCES: dict[str, AttentionBackend] = {}

#: Preference of ``backend="auto"``.
AUTO_ORDER: tuple[str, ...] = ("fa4", "triton", "torch")


def register_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    """Register a backend factory under ``name`` (called lazily, once)."""
    _REGISTRY[name] = factory


def get_backend(name: str) -> AttentionBackend:
    if name not in _REGISTRY:
        raise ValueError(f"backend must be one of {sorted(_REGISTRY) + ['auto']}, got {name!r}")
    if name not in _INSTANCES:
        _INSTANCES[name] = _REGISTRY[name]()
    return _INSTANCES[name]


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def resolve_backend(call: AttentionCall, backend: str = "auto") -> AttentionBackend:
    """The backend that runs ``call``: the named one (ValueError/NotImplementedError if it cannot),
    or for "auto" the first of :data:`AUTO_ORDER` that can. Logged at DEBUG level."""
    if backend != "auto":
        chosen = get_backend(backend)
        reason = chosen.unsupported_reason(call)
        if reason is not None:
            raise NotImplementedError(f"backend {backend!r} cannot run this call: {reason}")
        return chosen
    reasons = []
    for name in AUTO_ORDER:
        try:
            candidate = get_backend(name)
        except ImportError as exc:  # a backend module that cannot load here is just unavailable
            reasons.append(f"{name}: {exc}")
            continue
        reason = candidate.unsupported_reason(call)
        if reason is None:
            logger.debug("cpattn: backend 'auto' -> %r (%s)", name, "; ".join(reasons) or "first choice")
            return candidate
        reasons.append(f"{name}: {reason}")
    raise NotImplementedError("no attention backend can run this call: " + "; ".join(reasons))


def _lazy(module: str, attr: str) -> Callable[[], AttentionBackend]:
    def factory() -> AttentionBackend:
        import importlib

        return getattr(importlib.import_module(module, __name__), attr)()

    return factory


register_backend("torch", _lazy(".reference", "TorchReferenceBackend"))
register_backend("triton", _lazy(".triton_backend", "TritonBackend"))
register_backend("fa4", _lazy(".fa4", "FA4Backend"))
