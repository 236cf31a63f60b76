"""A reference DeepSeek-V3.2 DSA layer (MLA + lightning indexer, sparse attention) under CP.

Structure (DeepSeek-V3.2 names; small dims configurable, seeded random weights; built on
:class:`reference_layers.mla.MLAAttention`, whose projections and absorbed form it reuses)::

    q_resid     = RMSNorm(q_a_proj(x))                       -> MLA queries (q_b_proj) as in MLA
    kv_c, k_pe  = MLA latent (RMSNorm, RoPE)                 -> [N, r], [N, d_rope]
    k_idx       = RoPE(LayerNorm(index_wk(x)))               -> [N, D_i]  (fp8 + fp32 scale: index_fp8)
    kv_c, k_pe, k_idx (, scale) = strategy.gather_packed(...) # ONE all-gather per layer
    q_idx       = RoPE(index_wq_b(q_resid))                  -> [N, H_i, D_i]
    w           = index_weights_proj(x) * H_i ** -0.5        -> [N, H_i] float32
    idx         = cpattn.dsa.index_topk(q_idx, k_idx_all, w, meta, topk)        # [N, topk] positions
    o           = strategy.sparse_attention(q, K, V, meta, idx)                  # absorbed or per-head
    out         = o_proj(o)

Decode over a SHARDED cache (:meth:`DSAAttention.decode_sharded`): the step's rows on every rank,
each rank holding the parts of the positions it owns (``cpattn.KVSharding``); the indexer's exact
global top-k (one all-gather of candidates) and sparse attention over the selected keys each
rank owns, merged (one collective).

The indexer's RoPE is rotate-half on its first ``qk_rope_head_dim`` dims, on global positions;
its softmax scale is ``D_i ** -0.5``. Absorbed attention (the default) runs MQA over the latent
``[kv_c | k_pe]`` (D = r + d_rope, Dv = r, ``v`` a view of ``k``); ``absorb=False`` runs the
per-head form over up-projected K/V. With ``cp_size == 1`` no collective runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

import cpattn
from cpattn import dsa
from cpattn.kv import pack_kv
from cpattn.metadata import CPMetadata
from cpattn.plan_cache import cached_plan
from cpattn.strategies import CPStrategy

from .mla import MLAAttention, MLAConfig
from .rope import apply_rope

__all__ = ["DSAConfig", "DSAAttention", "quantize_index_keys"]

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@dataclass(frozen=True)
class DSAConfig(MLAConfig):
    """MLA dimensions plus the lightning indexer's: ``index_n_heads`` H_i, ``index_head_dim`` D_i,
    ``index_topk``; ``index_fp8``: index keys stored and gathered as fp8 e4m3 with one float32
    scale per token. Defaults are small (tests); :meth:`deepseek_v32` gives the real sizes."""

    index_n_heads: int = 4
    index_head_dim: int = 16
    index_topk: int = 8
    index_fp8: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("index_n_heads", "index_head_dim", "index_topk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.q_lora_rank is None:
            raise ValueError("DSA needs q_lora_rank (the indexer projects its queries from the low-rank query)")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(f"index_head_dim={self.index_head_dim} must be >= qk_rope_head_dim={self.qk_rope_head_dim}")
        if not isinstance(self.index_fp8, bool):
            raise TypeError(f"index_fp8 must be a bool, got {type(self.index_fp8).__name__}")

    @classmethod
    def deepseek_v32(cls, index_fp8: bool = False) -> "DSAConfig":
        """DeepSeek-V3.2: hidden 7168, 128 heads, q_lora 1536, r 512, d_nope 128, d_rope 64, d_v 128,
        indexer 64 heads x 128, top-k 2048."""
        return cls(7168, 128, 1536, 512, 128, 64, 128, index_n_heads=64, index_head_dim=128, index_topk=2048,
                   index_fp8=index_fp8)

    @property
    def index_softmax_scale(self) -> float:
        return self.index_head_dim**-0.5


def quantize_index_keys(k_idx: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token fp8 e4m3 quantization: k_idx [N, D_i] float -> (fp8 [N, D_i], float32 scale [N])
    with ``k_idx ~= fp8.float() * scale[:, None]`` (scale = amax / 448; zero rows get scale 1)."""
    amax = k_idx.float().abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (k_idx.float() / scale[:, None]).to(FP8), scale


class DSAAttention(MLAAttention):
    """One DSA attention layer (prefill). x [N, hidden] -> [N, hidden]. No residual, no MLP."""

    def __init__(
        self,
        config: DSAConfig = DSAConfig(),
        *,
        seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if not isinstance(config, DSAConfig):
            raise TypeError(f"config must be a DSAConfig, got {type(config).__name__}")
        super().__init__(config, seed=seed, device=device, dtype=dtype)
        c, kw = config, {"bias": False, "device": device, "dtype": dtype}
        self.index_wq_b = nn.Linear(c.q_lora_rank, c.index_n_heads * c.index_head_dim, **kw)
        self.index_wk = nn.Linear(c.hidden, c.index_head_dim, **kw)
        self.index_k_norm = nn.LayerNorm(c.index_head_dim, eps=1e-6, device=device, dtype=dtype)
        self.index_weights_proj = nn.Linear(c.hidden, c.index_n_heads, bias=False, device=device,
                                            dtype=torch.float32)
        # (spec, group) pairs whose partials every rank merged: decode steps' plans check a
        # partials header once per layer and group, not once per step
        self._agreed_partials: set = set()
        self.reset_parameters(seed)

    # ------------------------------------------------------------------ pieces (also used by the bench)
    def index_key(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        """x [N, hidden], positions [N] -> the index key [N, D_i] (RoPE'd; fp8 with index_fp8) and
        its float32 scale [N] (None without index_fp8). Row-local."""
        c = self.config
        k = self.index_k_norm(self.index_wk(x))
        k = self._index_rope(k.unsqueeze(1), positions).squeeze(1)
        if c.index_fp8:
            return quantize_index_keys(k)
        return k, None

    def index_query(self, x: Tensor, positions: Tensor, q_resid: Tensor) -> tuple[Tensor, Tensor]:
        """-> q_idx [N, H_i, D_i] (RoPE'd) and weights [N, H_i] float32 (``* H_i ** -0.5``)."""
        c, n = self.config, x.shape[0]
        q = self.index_wq_b(q_resid).view(n, c.index_n_heads, c.index_head_dim)
        w = self.index_weights_proj(x.float()) * c.index_n_heads**-0.5
        return self._index_rope(q, positions), w

    def _index_rope(self, x: Tensor, positions: Tensor) -> Tensor:
        r = self.config.qk_rope_head_dim
        return torch.cat([apply_rope(x[..., :r], positions, self.config.rope_theta), x[..., r:]], dim=-1)

    def local_parts(self, x: Tensor, positions: Tensor) -> list[Tensor]:
        """What this rank gathers: [kv_c [N, r], k_pe [N, d_rope], k_idx [N, D_i]] (+ [scale [N]]
        with index_fp8), in ONE all-gather."""
        kv_c, k_pe = self._latent(x, positions)
        k_idx, scale = self.index_key(x, positions)
        return [kv_c, k_pe, k_idx] + ([scale] if scale is not None else [])

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
        prefix: Optional[tuple[Tensor, ...]] = None,
        absorb: bool = True,
        backend: str = "auto",
        index_backend: str = "auto",
    ) -> tuple[Tensor, tuple[Tensor, ...], Tensor]:
        """This rank's rows through the layer.

        Args:
            x: [P, hidden] rank-local physical rows (``strategy.shard`` of the hidden states).
            positions: [P] global positions (``strategy.shard`` of the logical positions).
            strategy, meta, group: the CP plan and process group (cp_size 1: single process).
            prefix: the cached prefix, packed per sequence: (kv_c [sum(prefix_lens), r], k_pe
                [.., d_rope], k_idx [.., D_i]) (+ scale [..] with index_fp8), as the gathered parts.
            absorb: attention in the latent space (MQA, D = r + d_rope, Dv = r) or per head.
            backend, index_backend: sparse attention / index top-k backends ("auto", "triton", "torch").

        Returns:
            out [P, hidden] (pad rows zero), the logical extend parts (kv_c [T, r], k_pe, k_idx
            (, scale)) and the selection idx [P, topk] int32.
        """
        c = self.config
        if not isinstance(absorb, bool):
            raise TypeError(f"absorb must be a bool, got {type(absorb).__name__}")
        if x.dim() != 2 or x.shape[-1] != c.hidden:
            raise ValueError(f"x must be [P, hidden={c.hidden}], got shape {tuple(x.shape)}")
        if positions.dim() != 1 or positions.shape[0] != x.shape[0]:
            raise ValueError(f"positions must be [P={x.shape[0]}], got shape {tuple(positions.shape)}")
        num_prefix = meta.num_kv_tokens - meta.num_tokens
        widths = [c.kv_lora_rank, c.qk_rope_head_dim, c.index_head_dim] + ([None] if c.index_fp8 else [])
        if num_prefix and prefix is None:
            raise ValueError(f"the batch has {num_prefix} prefix tokens: pass prefix=(kv_c, k_pe, k_idx"
                             f"{', scale' if c.index_fp8 else ''})")
        if prefix is not None:
            if not isinstance(prefix, (tuple, list)) or len(prefix) != len(widths):
                raise ValueError(f"prefix must hold {len(widths)} tensors (kv_c, k_pe, k_idx"
                                 f"{', scale' if c.index_fp8 else ''})")
            for name, t, width in zip(("kv_c", "k_pe", "k_idx", "scale"), prefix, widths):
                shape = (num_prefix,) if width is None else (num_prefix, width)
                if not isinstance(t, Tensor) or tuple(t.shape) != shape:
                    got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                    raise ValueError(f"prefix {name} must be {list(shape)} (sum(prefix_lens) rows), got {got}")

        parts = self.local_parts(x, positions)
        pending = strategy.gather_packed(parts, meta, group, async_op=True)  # ONE collective
        q_resid = self._q_resid(x)  # overlaps the gather
        q_nope, q_pe = self._query(x, positions, q_resid)
        q_idx, weights = self.index_query(x, positions, q_resid)
        ext = pending.wait()

        packed = self._pack(ext, meta, prefix)
        kv_c_all, k_pe_all, k_idx_all = packed[:3]
        k_scale = packed[3] if c.index_fp8 else None
        idx = dsa.index_topk(q_idx, k_idx_all, weights, meta, c.index_topk, softmax_scale=c.index_softmax_scale,
                             k_scale=k_scale, backend=index_backend)
        q_in, k, v = self.attention_inputs(q_nope, q_pe, kv_c_all, k_pe_all, absorb)
        o = strategy.sparse_attention(q_in, k, v, meta, idx, softmax_scale=c.softmax_scale, backend=backend)
        return self.output(o, absorb), tuple(ext), idx

    # ------------------------------------------------------------------ decode over a sharded cache
    @torch.no_grad()
    def decode_sharded(
        self,
        x: Tensor,
        positions: Tensor,
        meta: CPMetadata,
        cache: tuple[Tensor, ...],
        group=None,
        *,
        selection: Optional[Tensor] = None,
        backend: str = "auto",
    ) -> tuple[Tensor, Tensor]:
        """One decode step of this layer over a SHARDED cache (absorbed attention).

        Args:
            x: [N, hidden] the step's rows, the same on every rank (replicated queries).
            positions: [N] their global positions.
            meta: the step's plan: the "replicated" strategy with ``kv=KVSharding(C)``.
            cache: this rank's parts, packed per sequence by ``meta.cu_local_kv_lens`` and
                already holding the step's keys this rank owns: (kv_c [>= n_local, r], k_pe [..,
                d_rope], k_idx [.., D_i]) (+ scale [..] with index_fp8). The step's rows to store
                come from :meth:`local_parts` (rows ``meta.store_rows`` go to local indices
                ``meta.store_index``).
            group: the CP group (None: the default group).
            selection: [N, topk] global positions of a previous layer's selection to reuse (a
                "shared" indexer layer, GLM-5): no scoring and no top-k collective.
            backend: the sparse attention backend.

        Returns:
            (out [N, hidden], idx [N, topk] int32 global positions: the exact global top-k, the
            same on every rank). Collectives: ONE all-gather of top-k candidates (none with
            ``selection``) and ONE merge of the partial outputs.
        """
        c = self.config
        kv_c, k_pe, k_idx = cache[:3]
        k_scale = cache[3] if c.index_fp8 else None
        q_resid = self._q_resid(x)
        q_nope, q_pe = self._query(x, positions, q_resid)
        if selection is None:
            q_idx, weights = self.index_query(x, positions, q_resid)
            idx = dsa.index_topk(q_idx, k_idx, weights, meta, c.index_topk, softmax_scale=c.index_softmax_scale,
                                 k_scale=k_scale, group=group)  # ONE all-gather of candidates
        else:
            idx = selection
        q_in, k, v = self.attention_inputs(q_nope, q_pe, kv_c, k_pe, True)
        spec = cpattn.AttentionSpec(num_q_heads=q_in.shape[1], num_kv_heads=1, head_dim=k.shape[-1],
                                    head_dim_v=v.shape[-1], dtype=q_in.dtype, topk=c.index_topk)
        plan = cached_plan(meta, ("dsa-decode", spec, backend), lambda: cpattn.plan_attention(meta, spec,
                                                                                                backend=backend))
        out_p, lse_p = plan.attend(q_in, k, v, idx, softmax_scale=c.softmax_scale)
        key = (spec, group)
        o = plan.merge(out_p, lse_p, group, agree=key not in self._agreed_partials)  # ONE collective
        if plan.agreed_partials:
            self._agreed_partials.add(key)
        return self.output(o, True), idx

    @staticmethod
    def _pack(ext: list[Tensor], meta: CPMetadata, prefix) -> list[Tensor]:
        """Gathered extend parts [T, ...] (+ prefix parts) -> packed K/V layout, pairwise."""
        if meta.num_kv_tokens == meta.num_tokens:
            return [t.contiguous() for t in ext]
        out = []
        for i in range(0, len(ext), 2):
            pair = ext[i : i + 2]
            pre = list(prefix[i : i + 2])
            if len(pair) == 1:  # odd count: pair the last part with itself
                pair, pre = pair * 2, pre * 2
            a, b = pack_kv(pair[0], pair[1], meta, pre[0], pre[1])
            out += [a, b][: min(2, len(ext) - i)]
        return out
