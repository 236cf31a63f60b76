"""The cost model: which placement and which algorithm a batch should run (host, per forward).

Two exact ways often exist to run one batch, and which is faster depends on the batch:

* where the queries are computed: a CP placement ("zigzag", "interleave", "contiguous": each rank
  computes 1/C of the new tokens, at the price of a collective per layer) or "replicated" (every
  rank computes every token with no collective for the queries: CP switched off for this batch,
  the right choice for short batches where the collective's latency and the replicated
  non-attention work cost less than what sharding saves);
* over a sharded KV cache, for a sharded placement: pass-KV or pass-Q.

:class:`CostModel` prices each candidate per layer and per rank from the batch's lengths, the
layer's shape and a few machine rates (kernel FLOP rates, HBM and link bandwidth, fixed costs);
:func:`choose_placement` returns the cheapest. Everything it reads is batch-wide (lengths, the
spec, the model), so every rank of a CP group chooses the same; the strategy name then enters the
plan fingerprint of ``build_metadata``, so ranks whose models differ fail the plan agreement
instead of mixing placements. No choice changes the numerics: every candidate is exact.

The rates default to one H200 with NVLink (constants below); ``python -m cpattn.calibrate``
measures them on the user's GPU (and link, under torchrun) and writes the JSON that
:meth:`CostModel.load` reads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ._validation import check_int
from .kv_sharding import KVSharding, local_key_counts
from .spec import AttentionSpec

__all__ = ["CostModel", "PlacementChoice", "choose_extend_algorithm", "choose_placement"]


@dataclass(frozen=True)
class CostModel:
    """Machine rates of the time model (per rank, seconds; every value a number > 0).

    Per layer, with P the physical rows a rank computes, C the ranks, W the (query, key) pairs
    a rank attends (``2 Hq (D + Dv)`` FLOPs each), ``kv_row`` / ``q_row`` / ``part_row`` the bytes
    of one token's K+V, q and (out, lse) partial, ``token_flops`` the layer's non-attention FLOPs
    per token (the caller's; 0 prices attention alone):

    * ``local`` (replicated queries and cache): ``launch + W / dense + P token_flops / matmul``;
    * ``gather_kv`` (sharded queries, replicated cache): ``latency + launch + (C - 1) P kv_row /
      link + W_max / dense + P token_flops / matmul``;
    * ``shard_merge`` (replicated queries, sharded cache): ``latency + 2 launch + (C - 1) P
      part_row / link + W_mean / shard + C P part_row / hbm + P token_flops / matmul``;
    * ``pass_kv`` / ``pass_q`` (sharded queries, sharded cache): see :meth:`estimate` (Np: the
      most prefix keys one rank holds).

    Attributes:
        link_bytes_per_s: all-gather bus bandwidth per rank (bytes/s).
        dense_flops_per_s: the dense attention kernel (prefill / extend shapes).
        shard_flops_per_s: the split-KV kernel over a rank's key shard.
        hbm_bytes_per_s: device memory bandwidth (the merge of partials).
        collective_latency_s: the fixed cost of one collective.
        launch_overhead_s: the fixed cost of one kernel launch.
        matmul_flops_per_s: dense GEMM rate in the model's dtype (the non-attention work).
    """

    link_bytes_per_s: float = 300e9
    #: calibrated on one H200, 2026-12-01 (decode benchmark, crossover):
    #: the dense kernel on extend-shaped work (few query tiles over a long prefix) and the
    #: split-KV shard kernel at 16k-1M keys, and one kernel's fixed cost
    dense_flops_per_s: float = 400e12
    shard_flops_per_s: float = 300e12
    hbm_bytes_per_s: float = 4.0e12
    collective_latency_s: float = 25e-6
    launch_overhead_s: float = 30e-6
    #: bf16 GEMM on one H100 (785 TF/s measured 2026-12-05), rounded down for mid-size shapes
    matmul_flops_per_s: float = 700e12

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and
                                                                                     math.isfinite(value)):
                raise ValueError(f"{f.name} must be a finite number > 0, got {value!r}")

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        """The rates as a plain dict (JSON-ready)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "CostModel":
        """A model from :meth:`to_dict`'s keys (missing ones keep their default; an unknown key
        is a ValueError naming it)."""
        if not isinstance(values, dict):
            raise TypeError(f"values must be a dict, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown cost model field(s) {unknown}; known: {sorted(known)}")
        return cls(**values)

    def save(self, path: str, calibration: Optional[dict] = None) -> None:
        """Write ``{"cost_model": rates, "calibration": how they were measured}`` to ``path``."""
        doc = {"cost_model": self.to_dict(), "calibration": dict(calibration or {})}
        with open(path, "w") as f:
            json.dump(doc, f, indent=2, sort_keys=True)
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> "CostModel":
        """The model of a JSON file written by :meth:`save` (``python -m cpattn.calibrate``)."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        with open(path) as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or not isinstance(doc.get("cost_model"), dict):
            raise ValueError(f"{path} has no 'cost_model' object (write it with CostModel.save or "
                             "python -m cpattn.calibrate)")
        return cls.from_dict(doc["cost_model"])

    # ------------------------------------------------------------------ terms
    def _pass_kv(self, c: int, p: int, np_max: int, kv_row: int, work_max: float) -> tuple[float, float]:
        lat = self.collective_latency_s if c > 1 else 0.0
        nbytes = (c - 1) * (p + np_max) * kv_row
        return lat + self.launch_overhead_s + nbytes / self.link_bytes_per_s + work_max / self.dense_flops_per_s, \
            float(nbytes)

    def _pass_q(self, c: int, p: int, kv_row: int, q_row: int, part_row: int, work_mean: float) -> tuple[float, float]:
        lat = self.collective_latency_s if c > 1 else 0.0
        nbytes = (c - 1) * p * (q_row + kv_row + part_row)
        t = (2 * lat + 3 * self.launch_overhead_s + nbytes / self.link_bytes_per_s
             + work_mean / self.shard_flops_per_s + c * p * part_row / self.hbm_bytes_per_s)
        return t, float(nbytes)

    def estimate(self, meta, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 head_dim_v: Optional[int] = None, dtype: torch.dtype,
                 kv_dtype: Optional[torch.dtype] = None, kv_row_bytes: Optional[int] = None) -> dict:
        """pass-KV vs pass-Q for an extend over a sharded prefix planned as ``meta`` (a
        ``CPMetadata`` with a sharded ``kv``): ``{"pass_kv": s, "pass_q": s, "bytes_pass_kv": n,
        "bytes_pass_q": n}``, the same on every rank (only batch-wide numbers enter).

        pass-KV: ONE all-gather of [extend K/V rows, prefix shard rows]; every rank then runs the
        dense kernel for its queries over the whole prefix + extend:
        ``latency + launch + (C - 1) (P + Np) kv_row / link + W_max / dense``.
        pass-Q: ONE all-gather of [q, extend K/V] rows, the shard kernel for ALL new queries over
        this rank's keys, ONE all-to-all of the partials back to the owners, a local merge:
        ``2 latency + 3 launch + (C - 1) P (q_row + kv_row + part_row) / link + W_mean / shard
        + C P part_row / hbm``. ``kv_row`` counts ``kv_dtype``'s bytes (default ``dtype``; an FP8
        cache's rows are gathered as FP8: one byte per value); ``kv_row_bytes`` overrides it for a
        cache layout that is not one value per element (``AttentionSpec.kv_row_bytes``: a
        tile-scaled FP8 MLA latent row is 656 bytes, not Hkv (D + Dv) = 1088).
        """
        hq = check_int(num_q_heads, "num_q_heads", 1)
        hkv = check_int(num_kv_heads, "num_kv_heads", 1)
        d = check_int(head_dim, "head_dim", 1)
        dv = d if head_dim_v is None else check_int(head_dim_v, "head_dim_v", 1)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        if getattr(meta, "kv", None) is None:
            raise ValueError("meta has no sharded KV cache: build it with strategy.build_metadata(..., kv=KVSharding(C))")
        if kv_dtype is not None and not isinstance(kv_dtype, torch.dtype):
            raise TypeError(f"kv_dtype must be a torch.dtype or None, got {kv_dtype!r}")
        kv_row, q_row, part_row, flop = _row_bytes(hq, hkv, d, dv, dtype, kv_dtype)
        if kv_row_bytes is not None:
            kv_row = check_int(kv_row_bytes, "kv_row_bytes", 1)
        c, p = meta.cp_size, meta.num_physical_tokens
        np_max = max(meta.num_local_prefix_tokens_per_rank) if meta.num_local_prefix_tokens_per_rank else 0
        work = meta.causal_work_per_rank
        t_kv, b_kv = self._pass_kv(c, p, np_max, kv_row, max(work) * flop if work else 0.0)
        t_q, b_q = self._pass_q(c, p, kv_row, q_row, part_row, sum(work) * flop / c)
        return {"pass_kv": t_kv, "pass_q": t_q, "bytes_pass_kv": b_kv, "bytes_pass_q": b_q}


def _row_bytes(hq: int, hkv: int, d: int, dv: int, dtype: torch.dtype,
               kv_dtype: Optional[torch.dtype] = None) -> tuple[int, int, int, float]:
    """(kv_row, q_row, part_row bytes, FLOPs per (query, key) pair) of a layer shape (K/V rows in
    ``kv_dtype``, default ``dtype``)."""
    item = torch.empty((), dtype=dtype).element_size()
    kv_item = item if kv_dtype is None else kv_dtype.itemsize
    return hkv * (d + dv) * kv_item, hq * d * item, hq * (dv * item + 4), 2.0 * hq * (d + dv)


def choose_extend_algorithm(meta, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                            head_dim_v: Optional[int] = None, dtype: torch.dtype,
                            cost_model: Optional[CostModel] = None, kv_dtype: Optional[torch.dtype] = None,
                            kv_row_bytes: Optional[int] = None) -> str:
    """"pass_kv" or "pass_q" for an extend over a sharded prefix: the smaller estimate of
    ``cost_model`` (default :class:`CostModel`); "pass_kv" without any cached prefix or at
    C = 1. Deterministic from batch-wide numbers, so every rank picks the same one."""
    model = _check_model(cost_model)
    est = model.estimate(meta, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         head_dim_v=head_dim_v, dtype=dtype, kv_dtype=kv_dtype, kv_row_bytes=kv_row_bytes)
    if meta.cp_size == 1 or meta.num_kv_tokens == meta.num_tokens:
        return "pass_kv"
    return "pass_q" if est["pass_q"] < est["pass_kv"] else "pass_kv"


def _check_model(cost_model) -> CostModel:
    if cost_model is None:
        return CostModel()
    if not isinstance(cost_model, CostModel):
        raise TypeError(f"cost_model must be a cpattn.CostModel, got {type(cost_model).__name__}")
    return cost_model


# ----------------------------------------------------------------------------- placement
@dataclass(frozen=True)
class PlacementChoice:
    """What :func:`choose_placement` picked for one batch.

    Attributes:
        strategy: the placement to build the batch with (``cpattn.get_strategy(strategy, C)``).
        algorithm: the algorithm to pass to ``cpattn.plan_attention(..., algorithm=)``.
        seconds: the chosen candidate's predicted time per layer per rank.
        estimates: ``{"strategy/algorithm": seconds}`` of every candidate priced.
        bytes: ``{"strategy/algorithm": bytes}`` each candidate moves per layer per rank.
    """

    strategy: str
    algorithm: str
    seconds: float
    estimates: dict
    bytes: dict


def choose_placement(
    extend_lens,
    prefix_lens=None,
    *,
    spec: AttentionSpec,
    cp_size: int,
    kv: Optional[KVSharding] = None,
    candidates: Sequence[str] = ("zigzag", "replicated"),
    token_flops: float = 0.0,
    cost_model: Optional[CostModel] = None,
) -> PlacementChoice:
    """The placement (and algorithm) the cost model predicts fastest for this batch (host; O(B)
    for "replicated", O(T) per sharded candidate; call it before ``build_metadata``).

    Args:
        extend_lens: [B] new tokens per sequence; prefix_lens: [B] cached keys (None: 0).
        spec: the layer's :class:`cpattn.AttentionSpec` (heads, head dims, dtype; a window or a
            ``topk`` bounds the keys each query attends).
        cp_size: the CP group's ranks C.
        kv: None (a replicated cache) or the :class:`cpattn.KVSharding` of a sharded one.
        candidates: strategy names to price, in order of preference on a tie (each at most
            once): the engine's CP strategy and "replicated" (CP off for this batch).
        token_flops: the layer's non-attention FLOPs per token (e.g. ``2 x`` its matmul
            parameters); a placement pays them for every row a rank computes, which is what
            makes "replicated" lose on long batches. 0: price attention alone.
        cost_model: a :class:`CostModel` (default rates: H200 + NVLink; ``CostModel.load`` for
            the user's calibrated one).

    Returns:
        A :class:`PlacementChoice`; ties go to the earlier candidate. Every rank of a group that
        passes the same arguments and model gets the same choice.

    Example::

        choice = cpattn.choose_placement(extend_lens, prefix_lens, spec=spec, cp_size=C)
        s = cpattn.get_strategy(choice.strategy, C)
        meta = s.build_metadata(extend_lens, prefix_lens, rank=rank, group=group)
        plan = cpattn.plan_attention(meta.to(device), spec, algorithm=choice.algorithm)
    """
    from .metadata import as_lengths
    from .strategies import STRATEGIES, get_strategy

    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"spec must be a cpattn.AttentionSpec, got {type(spec).__name__}")
    c = check_int(cp_size, "cp_size", 1)
    if kv is not None:
        if not isinstance(kv, KVSharding):
            raise TypeError(f"kv must be None or a cpattn.KVSharding, got {type(kv).__name__}")
        if kv.cp_size != c:
            raise ValueError(f"kv has cp_size={kv.cp_size} but cp_size={c}")
    if isinstance(candidates, str) or not isinstance(candidates, (list, tuple)) or not candidates:
        raise TypeError(f"candidates must be a non-empty list or tuple of strategy names, got {candidates!r}")
    for name in candidates:
        if name not in STRATEGIES:
            raise ValueError(f"candidates: unknown strategy {name!r}; known: {sorted(STRATEGIES)}")
    if len(set(candidates)) != len(candidates):
        raise ValueError(f"candidates must name each strategy once, got {list(candidates)}")
    if isinstance(token_flops, bool) or not isinstance(token_flops, (int, float)) or not (
            token_flops >= 0 and math.isfinite(token_flops)):
        raise ValueError(f"token_flops must be a finite number >= 0, got {token_flops!r}")
    model = _check_model(cost_model)
    ext = as_lengths(extend_lens, "extend_lens")
    pre = torch.zeros_like(ext) if prefix_lens is None else as_lengths(prefix_lens, "prefix_lens")
    if pre.numel() != ext.numel():
        raise ValueError(f"extend_lens and prefix_lens must have the same size, got {ext.numel()} and {pre.numel()}")

    _, q_row, part_row, flop = _row_bytes(spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.head_dim_v,
                                          spec.dtype, spec.kv_dtype)
    kv_row = spec.kv_row_bytes
    caps = [x for x in (spec.window_left + 1 if spec.window_left >= 0 else None, spec.topk) if x is not None]
    cap = min(caps) if caps else None
    rest = float(token_flops) / model.matmul_flops_per_s  # seconds per row of non-attention work
    launch, link = model.launch_overhead_s, model.link_bytes_per_s
    lat = model.collective_latency_s if c > 1 else 0.0
    has_prefix = bool(int(pre.sum()))
    np_max = 0
    if kv is not None and has_prefix:
        per_rank = local_key_counts(pre.numpy()[None, :], np.arange(c)[:, None], c, kv.interleave)  # [C, B]
        np_max = int(per_rank.sum(1).max())
    estimates: dict = {}
    nbytes: dict = {}
    for name in candidates:
        rows, pairs = get_strategy(name, c).rank_loads(ext, pre, keys_cap=cap)
        p = int(rows.max()) if rows.size else 0
        work_max, work_mean = float(pairs.max()) * flop, float(pairs.sum()) * flop / c
        if name == "replicated":
            if kv is None:  # every rank attends everything: no collective at all
                options = {"local": (launch + work_max / model.dense_flops_per_s, 0.0)}
            else:  # the local key shard, then one collective of partials
                b = float((c - 1) * p * part_row)
                options = {"shard_merge": (lat + 2 * launch + b / link + work_mean / model.shard_flops_per_s
                                           + c * p * part_row / model.hbm_bytes_per_s, b)}
        elif kv is None:
            b = float((c - 1) * p * kv_row)
            options = {("gather_kv" if c > 1 else "local"): (lat + launch + b / link + work_max / model.dense_flops_per_s,
                                                              b)}
        else:
            options = {"pass_kv": model._pass_kv(c, p, np_max, kv_row, work_max)}
            if c > 1 and has_prefix:
                options["pass_q"] = model._pass_q(c, p, kv_row, q_row, part_row, work_mean)
        for algorithm, (t, b) in options.items():
            key = f"{name}/{algorithm}"
            estimates[key], nbytes[key] = t + p * rest, b
    best = min(estimates, key=lambda k: estimates[k])  # the first minimum: candidate order breaks ties
    strategy, algorithm = best.split("/")
    return PlacementChoice(strategy, algorithm, estimates[best], estimates, nbytes)
