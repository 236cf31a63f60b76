"""The layer-kind facts an attention plan binds: :class:`AttentionSpec`.

One spec type for every algorithm and kernel family: dense or sparse (``topk``), packed or
paged K/V (``page_size``), sliding window, attention sinks, GQA / MQA / absorbed MLA (by heads and
head dims), the K/V cache dtype (``kv_dtype``: FP8 e4m3 caches with per-tensor or per-KV-head scales)
and the dense prefill kernels' multiply dtype (``mma_dtype``: FP8 tensor-core attention).
Validated once, at construction (TypeError / ValueError naming the argument).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ._validation import check_int
from .quant import FP8_TILE, MLA_FP8_TILE_SIZE, mla_fp8_tile_bytes

__all__ = ["AttentionSpec", "window_left"]

#: Largest page the kernels take (tokens per page).
MAX_PAGE_SIZE = 256

#: Quantized K/V cache dtypes a spec's ``kv_dtype`` may name (besides the query dtype itself).
FP8_KV_DTYPES = (torch.float8_e4m3fn,)

#: Cache layouts a spec's ``kv_layout`` may name besides None (one value per element): the
#: tile-scaled FP8 MLA latent (:data:`cpattn.quant.FP8_TILE`).
KV_LAYOUTS = (FP8_TILE,)

#: Dtypes a spec's ``mma_dtype`` may name (the dense prefill kernels' FP8 tensor-core mode).
FP8_MMA_DTYPES = (torch.float8_e4m3fn,)


def window_left(window_size) -> int:
    """The left window of flash-attn's (left, right) causal ``window_size`` (TypeError /
    ValueError naming the argument)."""
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__"):
        raise TypeError(f"window_size must be a pair (left, right) of ints, got {window_size!r}")
    window = tuple(window_size)
    if len(window) != 2 or any(isinstance(w, bool) or not isinstance(w, int) for w in window):
        raise TypeError(f"window_size must be a pair (left, right) of ints, got {window_size!r}")
    if window[0] < -1 or window[1] not in (-1, 0):
        raise ValueError(
            f"window_size must be (left >= -1, right in (-1, 0)) for causal attention, got {window}"
        )
    return window[0]


@dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """What one layer kind's attention is (heads, head dims, dtype, window, paging, sinks, top-k).

    Args:
        num_q_heads: Hq query heads. num_kv_heads: Hkv key/value heads (Hq a multiple of Hkv;
            query head h reads KV head ``h // (Hq / Hkv)``). Absorbed MLA: Hkv = 1.
        head_dim: D of q and k. head_dim_v: Dv of v and the output (default D). Absorbed MLA:
            D = 576 (latent 512 + rope 64), Dv = 512.
        dtype: dtype of q / k / v and of the output (a floating torch.dtype).
        window_size: flash-attn's (left, right); a row at position p sees keys at positions in
            ``[p - left, p]`` (left -1: no limit; positions are global, prefix counted); right
            must be -1 or 0 (causal).
        page_size: tokens per page of a paged K/V cache (1..256), None for packed K/V.
        has_sinks: the layer passes attention sinks ([Hq] float logits joining each row's
            softmax denominator).
        topk: sparse (DSA) attention: columns of the per-row key-position index each row
            attends (None: dense attention). Sparse attention takes no window.
        kv_dtype: dtype of the K/V caches the kernels read: None (the default) or ``dtype``: the
            same as q; ``torch.float8_e4m3fn``: an FP8 cache holding ``x / scale`` rounded to
            nearest and saturated to +-448, read with float32 scales (per tensor ``[]`` or per KV
            head ``[Hkv]``, one for K and one for V) passed per call as device tensors
            (``plan.run(..., k_scale=, v_scale=)``, :mod:`cpattn.quant`).
        kv_layout: None (the default: one value per cache element, as ``kv_dtype`` says) or
            ``"fp8_tile"`` (:data:`cpattn.quant.FP8_TILE`): absorbed MLA over FlashMLA's
            tile-scaled FP8 latent cache, uint8 rows of ``Dv`` e4m3 latent values, ``Dv / 128``
            float32 tile scales and ``D - Dv`` bfloat16 rope values (656 bytes for DeepSeek-V3's
            512 + 64; :func:`cpattn.quant.quantize_mla_fp8_tiles`). Needs ``kv_dtype=
            torch.float8_e4m3fn``, one KV head, ``head_dim_v`` a multiple of 128 and
            ``head_dim > head_dim_v``. The scales live in the rows: calls pass no ``k_scale``.
        mma_dtype: the dtype the dense prefill kernels multiply in: None (the default: FP8 K/V
            are dequantized to ``dtype`` in registers and multiplied there) or
            ``torch.float8_e4m3fn``: FP8 tensor-core attention (FA3's scheme). Queries are quantized
            per (token, head) row in the kernel (scale ``amax / 448``), scores are ``(q8 . k8)``
            times the row's and the KV head's K scales, the online softmax runs in fp32 and the
            probabilities are quantized to e4m3 for ``P V`` (V read from the cache as it is, its
            scale applied to the output). Needs ``kv_dtype=torch.float8_e4m3fn``, ``kv_layout``
            None, dense attention (``topk`` None) and ``dtype`` bfloat16, float16 or float32. Plans
            of the dense kind (prefill / extend: the portable Triton kernel, the torch reference)
            multiply in FP8; the split-KV decode (shard) kernels are memory-bound and keep
            dequantizing in registers (their plans ignore the field); the Hopper Gluon kernels
            and FA4 refuse it. Accuracy: docs/fp8.md.

    Example::

        spec = cpattn.AttentionSpec(num_q_heads=32, num_kv_heads=8, head_dim=128,
                                    dtype=torch.bfloat16, page_size=64)
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: Optional[int] = None
    dtype: torch.dtype
    window_size: Sequence[int] = (-1, -1)
    page_size: Optional[int] = None
    has_sinks: bool = False
    topk: Optional[int] = None
    kv_dtype: Optional[torch.dtype] = None
    kv_layout: Optional[str] = None
    mma_dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        hq = check_int(self.num_q_heads, "num_q_heads", 1)
        hkv = check_int(self.num_kv_heads, "num_kv_heads", 1)
        if hq % hkv:
            raise ValueError(f"num_q_heads={hq} must be a multiple of num_kv_heads={hkv}")
        d = check_int(self.head_dim, "head_dim", 1)
        dv = d if self.head_dim_v is None else check_int(self.head_dim_v, "head_dim_v", 1)
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {self.dtype!r}")
        left = window_left(self.window_size)
        if self.page_size is not None:
            ps = check_int(self.page_size, "page_size", 1)
            if ps > MAX_PAGE_SIZE:
                raise ValueError(f"page_size must be in [1, {MAX_PAGE_SIZE}], got {ps}")
        if not isinstance(self.has_sinks, bool):
            raise TypeError(f"has_sinks must be a bool, got {type(self.has_sinks).__name__}")
        if self.topk is not None:
            check_int(self.topk, "topk", 1)
            if left != -1:
                raise ValueError(f"sparse attention (topk={self.topk}) takes no window, got window_size="
                                 f"{tuple(self.window_size)}")
        kv_dtype = self.dtype if self.kv_dtype is None else self.kv_dtype
        if not isinstance(kv_dtype, torch.dtype):
            raise TypeError(f"kv_dtype must be a torch.dtype or None, got {type(kv_dtype).__name__}")
        if kv_dtype != self.dtype and kv_dtype not in FP8_KV_DTYPES:
            raise ValueError(f"kv_dtype must be None, dtype ({self.dtype}) or one of {list(FP8_KV_DTYPES)}, got "
                             f"{kv_dtype}")
        if kv_dtype in FP8_KV_DTYPES and self.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"an FP8 kv_dtype needs dtype bfloat16, float16 or float32, got {self.dtype}")
        self._check_layout(kv_dtype, hkv, d, dv)
        self._check_mma(kv_dtype)
        object.__setattr__(self, "kv_dtype", kv_dtype)
        object.__setattr__(self, "head_dim_v", dv)
        object.__setattr__(self, "window_size", (left, 0))

    def _check_layout(self, kv_dtype: torch.dtype, hkv: int, d: int, dv: int) -> None:
        """ValueError / TypeError naming ``kv_layout`` for a layout the other fields do not fit."""
        layout = self.kv_layout
        if layout is None:
            return
        if not isinstance(layout, str):
            raise TypeError(f"kv_layout must be None or a str, got {type(layout).__name__}")
        if layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be None or one of {list(KV_LAYOUTS)}, got {layout!r}")
        if kv_dtype != torch.float8_e4m3fn:
            raise ValueError(f"kv_layout={layout!r} needs kv_dtype=torch.float8_e4m3fn, got {kv_dtype}")
        if hkv != 1 or dv % MLA_FP8_TILE_SIZE or d <= dv:
            raise ValueError(f"kv_layout={layout!r} is absorbed MLA's latent: num_kv_heads=1, head_dim_v a multiple of "
                             f"{MLA_FP8_TILE_SIZE} and head_dim > head_dim_v (the rope part), got num_kv_heads={hkv}, "
                             f"head_dim={d}, head_dim_v={dv}")

    def _check_mma(self, kv_dtype: torch.dtype) -> None:
        """ValueError / TypeError naming ``mma_dtype`` for an FP8 MMA mode the other fields do not fit."""
        mma = self.mma_dtype
        if mma is None:
            return
        if not isinstance(mma, torch.dtype):
            raise TypeError(f"mma_dtype must be None or a torch.dtype, got {type(mma).__name__}")
        if mma not in FP8_MMA_DTYPES:
            raise ValueError(f"mma_dtype must be None or one of {list(FP8_MMA_DTYPES)}, got {mma}")
        if kv_dtype != mma:
            raise ValueError(f"mma_dtype={mma} needs kv_dtype={mma} (the FP8 cache the dots read), got {kv_dtype}")
        if self.kv_layout is not None:
            raise ValueError(f"mma_dtype={mma} needs kv_layout None, got {self.kv_layout!r}")
        if self.topk is not None:
            raise ValueError(f"mma_dtype={mma} is for dense attention, got topk={self.topk}")

    def replace(self, **changes) -> "AttentionSpec":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def window_left(self) -> int:
        """Keys at positions >= position - window_left are visible (-1: no window)."""
        return self.window_size[0]

    @property
    def paged(self) -> bool:
        return self.page_size is not None

    @property
    def sparse(self) -> bool:
        return self.topk is not None

    @property
    def kv_quantized(self) -> bool:
        """The K/V caches hold FP8 values read with scales (``kv_dtype`` is an FP8 dtype)."""
        return self.kv_dtype in FP8_KV_DTYPES

    @property
    def fp8_mma(self) -> bool:
        """The dense prefill kernels multiply in FP8 (``mma_dtype`` is an FP8 dtype)."""
        return self.mma_dtype in FP8_MMA_DTYPES

    @property
    def kv_tiled(self) -> bool:
        """The cache is the tile-scaled FP8 MLA layout (``kv_layout="fp8_tile"``): uint8 rows
        carrying their own scales."""
        return self.kv_layout == FP8_TILE

    @property
    def kv_row_bytes(self) -> int:
        """Bytes one token's K and V cache rows take (what a gather of new rows moves per token):
        ``Hkv (D + Dv)`` values of ``kv_dtype``, or one tile-scaled FP8 latent row (``D - Dv`` rope
        values in bf16 beside it; DeepSeek-V3: 656 bytes)."""
        if self.kv_tiled:
            return mla_fp8_tile_bytes(self.head_dim_v, self.head_dim - self.head_dim_v)
        return self.num_kv_heads * (self.head_dim + self.head_dim_v) * self.kv_dtype.itemsize

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads
