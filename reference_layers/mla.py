"""A reference DeepSeek-V3 MLA (multi-head latent attention) prefill layer that runs under CP.

Structure (names as in the DeepSeek-V3 checkpoints; small dims configurable, seeded random weights;
not tied to any engine)::

    q      = q_b_proj(RMSNorm(q_a_proj(x)))           -> [N, H, d_nope + d_rope]; RoPE on the rope part
    kv_c, k_pe = kv_a_proj_with_mqa(x)                -> [N, r], [N, d_rope]; RMSNorm(kv_c), RoPE(k_pe)
    kv_c, k_pe = strategy.gather_mla_latent(...)      # ONE all-gather of (r + d_rope) values per token
    (optional) write_mla_cache(kv_c, k_pe, cache, writes); prefix latent given or read from the cache
    up-projected: K = [kv_b_proj(kv_c)_nope | k_pe]   -> [N_kv, H, d_nope + d_rope], V -> [N_kv, H, d_v]
                  o = strategy.attention(q, K, V)
    absorbed:     q_lat = q_nope @ W_UK               -> [N, H, r]; attention with D = r + d_rope,
                  Dv = r, one KV head (MQA) directly on the latent [kv_c | k_pe]; o = o_lat @ W_UV^T
    out    = o_proj(o)

RoPE is rotate-half (:func:`reference_layers.rope.apply_rope`) on global positions; ``k_pe`` is one
rotary key shared by all heads. The softmax scale is ``(d_nope + d_rope) ** -0.5`` in both forms,
so both compute the same function. With ``cp_size == 1`` the strategy runs no collective: the
single-process forward is the same code path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from cpattn.cache import CacheWritePlan, plan_cache_writes, read_mla_cache, write_mla_cache
from cpattn.kv import pack_kv
from cpattn.metadata import CPMetadata
from cpattn.strategies import CPStrategy

from .rope import apply_rope

__all__ = ["MLAConfig", "MLAAttention"]


def _num_slots(cache: Tensor) -> int:
    """Slots of a flat [num_slots, row] or paged [num_pages, page_size, row] cache (host ints)."""
    if not isinstance(cache, Tensor):
        raise TypeError(f"cache must be a torch.Tensor, got {type(cache).__name__}")
    return cache.shape[0] * cache.shape[1] if cache.dim() == 3 else cache.shape[0]


def _check_latent_write(cache: Tensor, writes: CacheWritePlan, rows: int, r: int, d_rope: int, dtype: torch.dtype,
                        device: torch.device) -> None:
    """The checks of :func:`cpattn.write_mla_cache` that public facts allow (cache dtype, device,
    row width; the plan's source rows and slot count), run before the collective so a bad cache
    raises on every rank before any rank gathers (host ints only: no sync). ``write_mla_cache``
    checks everything again when it writes."""
    num_slots = _num_slots(cache)  # TypeError unless a tensor
    if cache.device != device:
        raise ValueError(f"cache is on {cache.device} but the latent rows are on {device}")
    if cache.dtype == torch.uint8 and dtype != torch.uint8:
        width, what = (r + d_rope) * dtype.itemsize, "bytes (raw uint8 cache)"
    elif cache.dtype == dtype:
        width, what = r + d_rope, "values"
    else:
        raise TypeError(f"cache dtype {cache.dtype} must equal the latent dtype {dtype} (or be uint8 for a raw-byte "
                        "cache)")
    if cache.dim() not in (2, 3):
        raise ValueError(f"cache must be [num_slots, r + d_rope] or [num_pages, page_size, r + d_rope], got "
                         f"{list(cache.shape)}")
    if cache.shape[-1] != width:
        raise ValueError(f"cache rows hold {cache.shape[-1]} {what}, expected r + d_rope = {r} + {d_rope} -> {width}")
    if writes.num_source_rows != rows:
        raise ValueError(f"{writes.name} plans {writes.num_source_rows} source rows but the gathered latent has "
                         f"{rows} rows")
    if writes.num_slots != num_slots:
        raise ValueError(f"{writes.name} was planned for num_slots={writes.num_slots} but cache has {num_slots} slots")
    if writes.device != cache.device:
        raise ValueError(f"{writes.name} is on {writes.device} but the cache is on {cache.device}")


def _check_prefix_slots(prefix_slots, num_prefix: int, num_slots: int, device: torch.device) -> None:
    """``prefix_slots``: an int32/int64 [sum(prefix_lens)] tensor of slots in [0, num_slots) on
    the cache's device (repeats allowed: shared prefix pages); one host sync for the range."""
    if not isinstance(prefix_slots, Tensor):
        raise TypeError(f"prefix_slots must be a torch.Tensor, got {type(prefix_slots).__name__}")
    if prefix_slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"prefix_slots must be int32 or int64, got {prefix_slots.dtype}")
    if prefix_slots.dim() != 1 or prefix_slots.shape[0] != num_prefix:
        raise ValueError(f"prefix_slots must have sum(prefix_lens)={num_prefix} entries, got shape "
                         f"{tuple(prefix_slots.shape)}")
    if prefix_slots.device != device:
        raise ValueError(f"prefix_slots is on {prefix_slots.device} but the cache is on {device}")
    if num_prefix:
        bad = (prefix_slots < 0) | (prefix_slots >= num_slots)
        if bool(bad.any()):
            row = int(torch.nonzero(bad)[0])
            raise ValueError(f"prefix_slots[{row}] = {int(prefix_slots[row])} is out of range "
                             f"[0, num_slots={num_slots})")


@dataclass(frozen=True)
class MLAConfig:
    """MLA dimensions. Defaults are small (tests); :meth:`deepseek_v3` gives the real sizes.

    ``q_lora_rank=None`` projects q directly from x (DeepSeek-V2-Lite style).
    """

    hidden: int = 64
    num_heads: int = 4
    q_lora_rank: Optional[int] = 48
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("hidden", "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.q_lora_rank is not None and (
            isinstance(self.q_lora_rank, bool) or not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 1
        ):
            raise ValueError(f"q_lora_rank must be None or an int >= 1, got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")

    @classmethod
    def deepseek_v3(cls) -> "MLAConfig":
        """DeepSeek-V3/R1: hidden 7168, 128 heads, q_lora 1536, r 512, d_nope 128, d_rope 64, d_v 128."""
        return cls(7168, 128, 1536, 512, 128, 64, 128)

    @property
    def qk_head_dim(self) -> int:
        """D of the up-projected form: d_nope + d_rope (192 for DeepSeek-V3)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token in the latent cache / all-gather: r + d_rope (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """(d_nope + d_rope) ** -0.5, used by both forms."""
        return self.qk_head_dim**-0.5


class MLAAttention(nn.Module):
    """One MLA attention layer (prefill). x [N, hidden] -> [N, hidden]. No residual, no MLP."""

    def __init__(
        self,
        config: MLAConfig = MLAConfig(),
        *,
        seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if not isinstance(config, MLAConfig):
            raise TypeError(f"config must be an MLAConfig, got {type(config).__name__}")
        c = self.config = config
        h, kw = c.num_heads, {"bias": False, "device": device, "dtype": dtype}
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.hidden, h * c.qk_head_dim, **kw)
        else:
            self.q_a_proj = nn.Linear(c.hidden, c.q_lora_rank, **kw)
            self.q_a_layernorm = nn.RMSNorm(c.q_lora_rank, eps=c.rms_norm_eps, device=device, dtype=dtype)
            self.q_b_proj = nn.Linear(c.q_lora_rank, h * c.qk_head_dim, **kw)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden, c.latent_dim, **kw)
        self.kv_a_layernorm = nn.RMSNorm(c.kv_lora_rank, eps=c.rms_norm_eps, device=device, dtype=dtype)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim), **kw)
        self.o_proj = nn.Linear(h * c.v_head_dim, c.hidden, **kw)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Seeded random weights: N(0, 1/fan_in) for projections, 1 + N(0, 0.1) for norm gains.
        Same seed and device type -> same weights on every rank."""
        params = list(self.parameters())
        gen = torch.Generator(device=params[0].device).manual_seed(seed)
        for p in params:
            if p.dim() > 1:
                w = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32) * p.shape[-1] ** -0.5
            else:
                w = 1.0 + 0.1 * torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
            p.copy_(w)

    # ------------------------------------------------------------------ pieces (also used by the bench)
    def project_local(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x [N, hidden], positions [N] (global) -> q_nope [N, H, d_nope], q_pe [N, H, d_rope] (RoPE'd),
        kv_c [N, r] (normed), k_pe [N, d_rope] (RoPE'd). Row-local: no communication."""
        kv_c, k_pe = self._latent(x, positions)
        return (*self._query(x, positions), kv_c, k_pe)

    def _latent(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        c, n = self.config, x.shape[0]
        kv = self.kv_a_proj_with_mqa(x)
        kv_c = self.kv_a_layernorm(kv[:, : c.kv_lora_rank])
        k_pe = apply_rope(kv[:, c.kv_lora_rank :].reshape(n, 1, -1), positions, c.rope_theta).view(n, -1)
        return kv_c, k_pe

    def _query(self, x: Tensor, positions: Tensor, q_resid: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        c, n = self.config, x.shape[0]
        q = self._q(x, q_resid).view(n, c.num_heads, c.qk_head_dim)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        return q_nope, apply_rope(q_pe, positions, c.rope_theta)

    def _q(self, x: Tensor, q_resid: Optional[Tensor] = None) -> Tensor:
        if self.config.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self._q_resid(x) if q_resid is None else q_resid)

    def _q_resid(self, x: Tensor) -> Tensor:
        """The normalized low-rank query ``q_a_layernorm(q_a_proj(x))`` [N, q_lora_rank] (the
        DSA indexer projects its queries from it too)."""
        return self.q_a_layernorm(self.q_a_proj(x))

    def _w_uk_uv(self) -> tuple[Tensor, Tensor]:
        """kv_b_proj split per head: W_UK [H, d_nope, r], W_UV [H, d_v, r]."""
        c = self.config
        w = self.kv_b_proj.weight.view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]

    def attention_inputs(
        self, q_nope: Tensor, q_pe: Tensor, kv_c: Tensor, k_pe: Tensor, absorb: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Local queries and packed latent [N_kv, r], [N_kv, d_rope] -> (q, k, v) for ``s.attention``.

        Up-projected: q [N, H, d_nope + d_rope], k [N_kv, H, d_nope + d_rope], v [N_kv, H, d_v].
        Absorbed: q [N, H, r + d_rope], k [N_kv, 1, r + d_rope], v [N_kv, 1, r] (a view of k).
        """
        c, n_kv = self.config, kv_c.shape[0]
        if absorb:
            w_uk, _ = self._w_uk_uv()
            q_lat = torch.einsum("nhd,hdr->nhr", q_nope, w_uk)
            q = torch.cat([q_lat, q_pe], dim=-1)
            k = torch.cat([kv_c, k_pe], dim=-1).unsqueeze(1)
            return q, k, k[..., : c.kv_lora_rank]
        kv = self.kv_b_proj(kv_c).view(n_kv, c.num_heads, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(n_kv, c.num_heads, c.qk_rope_head_dim)], dim=-1)
        return torch.cat([q_nope, q_pe], dim=-1), k, v.contiguous()

    def output(self, o: Tensor, absorb: bool) -> Tensor:
        """Attention output [N, H, d_v] (or [N, H, r] absorbed) -> [N, hidden]."""
        if absorb:
            _, w_uv = self._w_uk_uv()
            o = torch.einsum("nhr,hvr->nhv", o, w_uv)
        return self.o_proj(o.reshape(o.shape[0], -1))

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        strategy: CPStrategy,
        meta: CPMetadata,
        group=None,
        *,
        prefix_latent: Optional[tuple[Tensor, Tensor]] = None,
        cache: Optional[Tensor] = None,
        slots: Optional[Tensor | CacheWritePlan] = None,
        prefix_slots: Optional[Tensor] = None,
        absorb: bool = False,
        backend: str = "auto",
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """This rank's rows through the layer.

        Args:
            x: [P, hidden] rank-local physical rows (``strategy.shard`` of the logical hidden states).
            positions: [P] global positions (``strategy.shard`` of the logical positions).
            strategy, meta, group: the CP plan and process group (cp_size 1: single process).
            prefix_latent: cached prefix latent (kv_c [sum(prefix_lens), r], k_pe [.., d_rope]),
                packed per sequence; or give ``cache`` + ``prefix_slots`` to read it from the cache.
            cache: MLA latent cache (see :func:`cpattn.write_mla_cache`); with ``slots`` the gathered
                extend latent is written there.
            slots: a :class:`cpattn.CacheWritePlan` from ``cpattn.plan_cache_writes(meta, slots,
                num_slots=...)`` (or from a page table; validated once per forward; the layer then
                does no host sync for the write), or a raw [>= T] int tensor in logical order
                (planned here: one host sync per call).
            prefix_slots: cache slots of the prefix tokens, packed per sequence: a raw
                [sum(prefix_lens)] int32/int64 tensor (repeats allowed: shared prefix pages;
                checked here: one host sync, read through :func:`cpattn.read_mla_cache`).
            absorb: run attention in the latent space (D = r + d_rope, Dv = r, one KV head).
            backend: attention backend ("auto", "torch", "triton", "fa4").

        Returns:
            out [P, hidden] (pad rows zero) and the logical extend latent (kv_c [T, r], k_pe [T, d_rope]).
        """
        c = self.config
        if not isinstance(absorb, bool):
            raise TypeError(f"absorb must be a bool, got {type(absorb).__name__}")
        if x.dim() != 2 or x.shape[-1] != c.hidden:
            raise ValueError(f"x must be [P, hidden={c.hidden}], got shape {tuple(x.shape)}")
        if positions.dim() != 1 or positions.shape[0] != x.shape[0]:
            raise ValueError(f"positions must be [P={x.shape[0]}], got shape {tuple(positions.shape)}")
        if (cache is None) != (slots is None):
            raise ValueError("cache and slots must be given together")
        num_prefix = meta.num_kv_tokens - meta.num_tokens
        if prefix_latent is not None and prefix_slots is not None:
            raise ValueError("give prefix_latent or prefix_slots, not both")
        if prefix_slots is not None and cache is None:
            raise ValueError("prefix_slots needs cache")
        if num_prefix and prefix_latent is None and prefix_slots is None:
            raise ValueError(f"the batch has {num_prefix} prefix tokens: pass prefix_latent or prefix_slots")
        if prefix_latent is not None:
            if len(prefix_latent) != 2:
                raise ValueError("prefix_latent must be a pair (kv_c [sum(prefix_lens), r], k_pe [.., d_rope])")
            for name, t, width in zip(("kv_c", "k_pe"), prefix_latent, (c.kv_lora_rank, c.qk_rope_head_dim)):
                if not isinstance(t, Tensor) or tuple(t.shape) != (num_prefix, width):
                    got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                    raise ValueError(
                        f"prefix_latent {name} must be [sum(prefix_lens)={num_prefix}, {width}], got {got}"
                    )

        if cache is not None:  # validated before the collective: a bad cache raises on every rank
            if not isinstance(slots, CacheWritePlan):
                slots = plan_cache_writes(meta, slots, num_slots=_num_slots(cache))
            _check_latent_write(cache, slots, meta.num_token_rows, c.kv_lora_rank, c.qk_rope_head_dim, x.dtype,
                                x.device)
        if prefix_slots is not None:  # the read comes after the collective: check it against the cache now
            _check_prefix_slots(prefix_slots, num_prefix, _num_slots(cache), cache.device)

        kv_c, k_pe = self._latent(x, positions)
        pending = strategy.gather_mla_latent(kv_c, k_pe, meta, group, async_op=True)
        q_nope, q_pe = self._query(x, positions)  # overlaps the gather
        kv_c_ext, k_pe_ext = pending.wait()

        if cache is not None:
            write_mla_cache(kv_c_ext, k_pe_ext, cache, slots)
        if prefix_slots is not None:
            prefix_latent = read_mla_cache(cache, prefix_slots, c.kv_lora_rank)
        kv_c_all, k_pe_all = pack_kv(kv_c_ext, k_pe_ext, meta, *(prefix_latent or (None, None)))

        q_in, k, v = self.attention_inputs(q_nope, q_pe, kv_c_all, k_pe_all, absorb)
        o = strategy.attention(q_in, k, v, meta, softmax_scale=c.softmax_scale, backend=backend)
        return self.output(o, absorb), (kv_c_ext, k_pe_ext)
