"""Attention backends behind one registry, each planning its launches once per forward.

A backend answers two questions at plan time, for an :class:`AttentionSpec` (heads, head dims,
dtype, window, page size, sinks) and a placement plan (:class:`cpattn.CPMetadata`): can it run
them here (:meth:`AttentionBackend.unsupported_reason`), and what does it launch
(:meth:`AttentionBackend.plan`, returning a :class:`BackendRun`: a callable holding every
launch fact, whose per-layer call does O(1) host work and only device work). ``backend="auto"``
picks the first of :data:`AUTO_ORDER` that can. Kernel families live one per module
(``reference``, ``triton_attn`` portable, ``triton_sm90`` Hopper, ``fa4``); a backend module
picks the family, a family never imports another.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Protocol

import torch
from torch import Tensor

from ..metadata import CPMetadata
from ..spec import AttentionSpec

__all__ = [
    "AUTO_ORDER",
    "AttentionBackend",
    "AttentionSpec",
    "BackendList",
    "BackendRun",
    "IndexTopkSpec",
    "KERNEL_FAMILIES",
    "KernelFamilyWarning",
    "available_backends",
    "get_backend",
    "register_backend",
    "row_positions",
    "select_backend",
]

logger = logging.getLogger("cpattn")


@dataclass(frozen=True)
class IndexTopkSpec:
    """The facts an index top-k plan (DSA lightning indexer) is bound to: indexer heads H_i,
    index head dim D_i, dtypes of q_idx and k_idx, ``topk``, page_size (None: packed index keys),
    has_k_scale (a float32 scale per index key, e.g. fp8 keys)."""

    num_heads: int
    head_dim: int
    q_dtype: torch.dtype
    k_dtype: torch.dtype
    topk: int
    page_size: Optional[int] = None
    has_k_scale: bool = False

    @property
    def paged(self) -> bool:
        return self.page_size is not None


class BackendRun(Protocol):
    """One planned attention launch: ``run(q, k, v, page_table, sinks, softmax_scale, out, lse)``
    writes ``out`` [P, Hq, Dv] (pad rows 0) and, if ``lse`` is not None, ``lse`` [P, Hq] float32
    natural log (pad rows -inf). Arguments are already validated against the spec."""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, page_table: Optional[Tensor], sinks: Optional[Tensor],
                 softmax_scale: float, out: Tensor, lse: Optional[Tensor]) -> None: ...


class AttentionBackend(Protocol):
    name: str

    def available(self) -> Optional[str]:
        """None when this backend can run on this machine at all, else why not (one line)."""

    def unsupported_reason(self, spec: AttentionSpec, meta: CPMetadata) -> Optional[str]:
        """None when this backend can run ``spec`` over ``meta`` here, else why not (one line)."""

    def plan(self, spec: AttentionSpec, meta: CPMetadata, options: Mapping) -> BackendRun:
        """Bind everything the launches need (host work, may allocate and copy once)."""


#: Plan kinds: "dense" (causal attention of local queries, :func:`cpattn.plan_attention`),
#: "shard" (attention over one rank's key shard of a sharded KV cache,
#: algorithm "shard_merge" of :func:`cpattn.plan_attention`), "sparse" (DSA attention over selected
#: keys, a spec with ``topk``), "index" (DSA index top-k, :func:`cpattn.dsa.index_topk`) and
#: "shard_index" (the index top-k candidates of one rank's key shard, decode over a sharded cache).
_REGISTRY: dict[tuple[str, str], Callable[[], AttentionBackend]] = {}
_INSTANCES: dict[tuple[str, str], AttentionBackend] = {}

#: Preference of ``backend="auto"`` per plan kind.
AUTO_ORDER: dict[str, tuple[str, ...]] = {"dense": ("fa4", "triton", "torch"), "sparse": ("triton", "torch"),
                                          "index": ("triton", "torch")}


def register_backend(name: str, factory: Callable[[], AttentionBackend], kind: str = "dense",
                     auto_rank: Optional[int] = None) -> None:
    """Register a backend factory for plans of ``kind`` under ``name`` (called lazily, once).
    ``auto_rank``: its place in ``auto``'s order for that kind (None: last)."""
    _REGISTRY[(kind, name)] = factory
    order = [n for n in AUTO_ORDER.get(kind, ()) if n != name]
    order.insert(len(order) if auto_rank is None else auto_rank, name)
    AUTO_ORDER[kind] = tuple(order)


def get_backend(name: str, kind: str = "dense") -> AttentionBackend:
    if not isinstance(name, str) or (kind, name) not in _REGISTRY:
        names = sorted(n for k, n in _REGISTRY if k == kind)
        raise ValueError(f"backend must be one of {names + ['auto']}, got {name!r}")
    if (kind, name) not in _INSTANCES:
        _INSTANCES[(kind, name)] = _REGISTRY[(kind, name)]()
    return _INSTANCES[(kind, name)]


class KernelFamilyWarning(RuntimeWarning):
    """A kernel family cannot run with the installed triton: the plans that would use it run its
    fallback family (:data:`KERNEL_FAMILIES`). Warned once per family and process."""


#: Kernel families that need more of triton than their backend does: family -> (plan kinds,
#: backend, fallback family). Both are Gluon kernels for sm_90, which need triton >= 3.5 and the
#: Gluon calls ``_sm90_common.resolve_gluon_api`` finds.
KERNEL_FAMILIES: dict[str, tuple[tuple[str, ...], str, str]] = {
    "sm90": (("dense",), "triton", "portable"),
    "mla": (("dense", "shard", "sparse"), "triton", "portable"),
}
_WARNED_FAMILIES: set[str] = set()


def family_unavailable_reason(family: str) -> Optional[str]:
    """Why a kernel family of :data:`KERNEL_FAMILIES` cannot run with the installed triton (None
    if it can; imports triton)."""
    try:
        from . import _sm90_common
    except ImportError as exc:
        return str(exc)
    return _sm90_common.GLUON_API_REASON


def family_fallback_message(family: str, reason: str) -> str:
    """What :class:`KernelFamilyWarning` and :func:`available_backends` say of a family that
    cannot run: the family, its fallback and the reason."""
    return (f"the {family} kernel family cannot run with the installed triton ({reason}); "
            f"the {KERNEL_FAMILIES[family][2]} family runs instead")


def warn_family_fallback(family: str, reason: str) -> None:
    """Warn (:class:`KernelFamilyWarning`) that a plan which would use ``family`` runs its
    fallback for ``reason``: the first time per family and process, later calls do nothing. The
    warning points at the first caller outside cpattn."""
    if family in _WARNED_FAMILIES:
        return
    _WARNED_FAMILIES.add(family)
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    warnings.warn("cpattn: " + family_fallback_message(family, reason), KernelFamilyWarning, stacklevel=level)


class BackendList(list):
    """:func:`available_backends`' answer: the backend names, and ``unavailable_families``: the
    kernel families of those backends that cannot run with the installed triton (family -> what
    :class:`KernelFamilyWarning` says: fallback family and reason), also shown by ``repr``."""

    def __init__(self, names=(), unavailable_families: Optional[Mapping[str, str]] = None) -> None:
        super().__init__(names)
        self.unavailable_families = dict(unavailable_families or {})

    def __repr__(self) -> str:
        if not self.unavailable_families:
            return super().__repr__()
        return f"{super().__repr__()} ({'; '.join(self.unavailable_families.values())})"


def available_backends(kind: str = "dense") -> BackendList:
    """Backends of a plan kind that can run on this machine now (installed, with a device
    they support): a list of names whose ``unavailable_families`` names the kernel families of
    those backends that the installed triton cannot run (:data:`KERNEL_FAMILIES`), each with its
    fallback family and the reason."""
    out = []
    for k, name in sorted(_REGISTRY):
        if k != kind:
            continue
        try:
            if get_backend(name, kind).available() is None:
                out.append(name)
        except ImportError:
            continue
    families = {}
    for family, (kinds, backend, _) in KERNEL_FAMILIES.items():
        if kind in kinds and backend in out:
            reason = family_unavailable_reason(family)
            if reason is not None:
                families[family] = family_fallback_message(family, reason)
    return BackendList(out, families)


def select_backend(spec, meta: CPMetadata, backend: str = "auto", kind: str = "dense") -> AttentionBackend:
    """The backend that runs ``spec`` over ``meta`` for plans of ``kind``: the named one
    (NotImplementedError naming the reason if it cannot), or for "auto" the first of
    ``AUTO_ORDER[kind]`` that can. A CUDA plan that falls back to a torch reference warns
    (once per call site)."""
    if backend != "auto":
        chosen = get_backend(backend, kind)
        reason = chosen.available() or chosen.unsupported_reason(spec, meta)
        if reason is not None:
            raise NotImplementedError(f"backend {backend!r} cannot run this call: {reason}")
        return chosen
    reasons = []
    for name in AUTO_ORDER.get(kind, ()):
        try:
            candidate = get_backend(name, kind)
            reason = candidate.available() or candidate.unsupported_reason(spec, meta)
        except ImportError as exc:  # a backend module that cannot load here is just unavailable
            reason = str(exc)
        if reason is None:
            logger.debug("cpattn: backend 'auto' -> %r (%s)", name, "; ".join(reasons) or "first choice")
            if name == "torch" and meta.device.type == "cuda":
                warnings.warn(
                    "cpattn: backend='auto' runs the slow torch reference on CUDA (" + "; ".join(reasons) + ")",
                    RuntimeWarning,
                    stacklevel=4,
                )
            return candidate
        reasons.append(f"{name}: {reason}")
    raise NotImplementedError("no attention backend can run this call: " + "; ".join(reasons))


def interpret_env() -> bool:
    """Is ``TRITON_INTERPRET`` set (Triton's CPU interpreter)?"""
    import os

    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_available() -> Optional[str]:
    """None when Triton kernels can run on this machine (triton installed; a CUDA device or the
    interpreter), else why not. Shared by every Triton backend's ``available()``."""
    if not module_available("triton"):
        return "triton is not installed (pip install cpattn[triton])"
    import torch

    if not torch.cuda.is_available() and not interpret_env():
        return "no CUDA device (CPU tensors need TRITON_INTERPRET=1, the Triton interpreter)"
    return None


def triton_device_reason(device, kernel_module: str) -> Optional[str]:
    """Why a Triton kernel module cannot run on ``device`` in this process (None if it can):
    Triton fixes interpreter vs GPU mode when a module is first imported."""
    loaded = sys.modules.get(kernel_module)
    if device.type == "cuda":
        if loaded is not None and loaded.INTERPRETED:
            return "the triton kernel was built for the CPU interpreter in this process"
    elif device.type == "cpu":
        if not interpret_env():
            return "CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter)"
        if loaded is not None and not loaded.INTERPRETED:
            return "the triton kernel was built for the GPU in this process (TRITON_INTERPRET set too late)"
    else:
        return f"device {device} not supported"
    return None


def triton_unsupported_reason(spec: "AttentionSpec", device, kernel_module: str, fp8: bool = False,
                              tiled: bool = False) -> Optional[str]:
    """Why the Triton kernels of ``kernel_module`` (dense or shard plans) cannot take ``spec`` on
    ``device`` (None if they can): the process's interpreter / GPU mode, the head dims and dtypes
    the kernels accept, fp32 only under the interpreter, FP8 caches only where ``fp8`` (kernels
    that dequantize them), tile-scaled FP8 latent caches only where ``tiled``."""
    reason = triton_device_reason(device, kernel_module)
    if reason is not None:
        return reason
    if spec.kv_quantized and not fp8:
        return f"these kernels do not read FP8 K/V caches (kv_dtype={spec.kv_dtype})"
    if spec.kv_tiled and not tiled:
        return f"these kernels do not read kv_layout={spec.kv_layout!r} caches (the torch reference does)"
    from .triton_attn import shape_unsupported_reason, split_head_dim

    if spec.kv_tiled and split_head_dim(spec.head_dim) != (spec.head_dim_v, spec.head_dim - spec.head_dim_v):
        return (f"kv_layout={spec.kv_layout!r} needs head_dim_v a power of two and a smaller power-of-two rope "
                f"part >= 16, got D={spec.head_dim}, Dv={spec.head_dim_v}")

    reason = shape_unsupported_reason(spec.head_dim, spec.head_dim_v, spec.dtype)
    if reason is None and spec.dtype == torch.float32 and device.type == "cuda":
        reason = "fp32 runs only under the interpreter (use bf16/fp16 on the GPU)"
    return reason


def row_positions(meta: CPMetadata) -> Tensor:
    """The global position of every physical row of ``meta``: int32 [P] on ``meta.device``, pad
    rows -1. The DSA kernels' per-row table (uploaded once per plan and cached on it; a static
    plan's sits in its arena at a fixed address, so a captured graph reads the current plan's)."""
    from ._dsa_rows import device_rows

    return device_rows(meta)["row_pos"]


def module_available(name: str) -> bool:
    """Is a module importable here (without importing it)? Imported modules answer at once; others
    are looked up once per process (a lookup costs ~35 µs and the merge asks on every call)."""
    return name in sys.modules or _found(name)


@functools.lru_cache(maxsize=None)
def _found(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _lazy(module: str, attr: str) -> Callable[[], AttentionBackend]:
    def factory() -> AttentionBackend:
        return getattr(importlib.import_module(module, __name__), attr)()

    return factory


register_backend("fa4", _lazy(".fa4", "FA4Backend"))
register_backend("triton", _lazy(".triton_backend", "TritonBackend"))
register_backend("torch", _lazy(".reference", "TorchReferenceBackend"))
# shard plans (attention over one rank's key shard of a sharded KV cache: cpattn.plans.shard)
register_backend("triton", _lazy(".decode_backend", "TritonShardBackend"), kind="shard")
register_backend("torch", _lazy(".reference", "TorchShardBackend"), kind="shard")

# DSA: sparse attention and index top-k (kernels/dsa_backend.py picks the Triton families)
register_backend("triton", _lazy(".dsa_backend", "TritonSparseBackend"), kind="sparse")
register_backend("torch", _lazy(".reference", "TorchSparseBackend"), kind="sparse")
register_backend("triton", _lazy(".dsa_backend", "TritonIndexBackend"), kind="index")
register_backend("torch", _lazy(".reference", "TorchIndexBackend"), kind="index")
# DSA index top-k candidates over one rank's key shard (decode over a sharded cache)
register_backend("triton", _lazy(".shard_index", "TritonShardIndexBackend"), kind="shard_index")
register_backend("gemm", _lazy(".shard_index", "GemmShardIndexBackend"), kind="shard_index")
