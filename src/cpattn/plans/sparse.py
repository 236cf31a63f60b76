"""DSA plans: sparse attention over selected keys, and the lightning indexer's top-k (plan once
per forward, run per layer).

:func:`cpattn.plan_attention` with a spec's ``topk`` binds a placement plan to a sparse
attention backend (kind ``"sparse"`` of the registry); :func:`plan_index_topk` binds it to the
indexer's heads, dims, dtypes and top-k (kind ``"index"``; over a sharded cache kind
``"shard_index"``, algorithm "shard_merge": the exact global top-k of a decode step). Both upload what their kernels read
once (the per-row table of :mod:`cpattn.kernels._dsa_rows`: sequence, position, first K/V row of
every physical row). The per-layer calls check only per-layer facts (shapes, dtypes, devices),
then launch.

The causal rule of sparse attention: a row at position ``p`` of sequence ``b`` attends the keys
of ``b`` whose positions appear in its row of ``idx`` and are ``<= p``; negative entries (-1
padding), future entries and positions past the sequence are ignored. So a selection computed
without a causal mask (e.g. every key of a sequence shorter than top-k) stays causal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Optional, TypedDict

import torch
from torch import Tensor

from .._validation import check_int, check_tensor
from ..kernels import IndexTopkSpec, select_backend
from ..metadata import CPMetadata
from ..selection import top_candidate_positions
from .base import AttentionPlan, check_group_rank

if TYPE_CHECKING:  # annotations only (typing.Unpack: Python >= 3.11)
    from typing_extensions import Unpack


class IndexInputs(TypedDict, total=False):
    """The keyword inputs of :meth:`IndexTopkPlan.run` and :meth:`IndexTopkPlan.candidates` (an
    unknown one is a TypeError before any collective):

    k_scale: float32 per index key ([rows] packed / [num_pages, page_size] paged) when the plan
    has ``has_k_scale``. page_table: [B, max_pages] int32/int64 of a paged plan. softmax_scale:
    float > 0 (default D_i ** -0.5). out: the result buffer (``run``: int32 [P, topk];
    ``candidates``: int64 [N, topk]).
    """

    k_scale: Optional[Tensor]
    page_table: Optional[Tensor]
    softmax_scale: Optional[float]
    out: Optional[Tensor]


#: the keywords of :class:`IndexInputs`
INDEX_INPUTS = frozenset(IndexInputs.__annotations__)

__all__ = ["IndexTopkPlan", "check_index", "check_plan_index", "make_index_spec", "plan_index_topk", "select_candidates"]

_INDEX_DTYPES = (torch.int32, torch.int64)
#: Positions travel in the low 32 bits of a packed candidate (:mod:`cpattn.selection`).
_MAX_POSITIONS = (1 << 32) - 1


# ----------------------------------------------------------------------------- specs
def _check_page_size(page_size) -> Optional[int]:
    if page_size is None:
        return None
    page_size = check_int(page_size, "page_size", 1)
    if page_size > 256:
        raise ValueError(f"page_size must be in [1, 256], got {page_size}")
    return page_size


def make_index_spec(
    *, num_heads: int, head_dim: int, q_dtype: torch.dtype, k_dtype: torch.dtype, topk: int,
    page_size: Optional[int] = None, has_k_scale: bool = False,
) -> IndexTopkSpec:
    """Validate the facts of an index top-k plan (TypeError / ValueError naming the argument)."""
    h = check_int(num_heads, "num_heads", 1)
    d = check_int(head_dim, "head_dim", 1)
    for name, dt in (("q_dtype", q_dtype), ("k_dtype", k_dtype)):
        if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
            raise TypeError(f"{name} must be a floating torch.dtype, got {dt!r}")
    k = check_int(topk, "topk", 1)
    if not isinstance(has_k_scale, bool):
        raise TypeError(f"has_k_scale must be a bool, got {type(has_k_scale).__name__}")
    return IndexTopkSpec(h, d, q_dtype, k_dtype, k, _check_page_size(page_size), has_k_scale)


def check_index(idx, rows: int) -> int:
    """TypeError / ValueError unless ``idx`` is an int32/int64 ``[rows, K]`` tensor with K >= 1;
    returns K."""
    check_tensor(idx, "idx")
    if idx.dtype not in _INDEX_DTYPES:
        raise TypeError(f"idx must be int32 or int64, got {idx.dtype}")
    if idx.dim() != 2 or idx.shape[0] != rows:
        raise ValueError(f"idx must be [P={rows}, topk], got shape {list(idx.shape)}")
    if idx.shape[1] < 1:
        raise ValueError(f"topk (idx.shape[1]) must be >= 1, got {idx.shape[1]}")
    return idx.shape[1]


def check_plan_index(idx, shape: tuple[int, int], device: torch.device, rows_name: str = "P") -> None:
    """A sparse plan's per-call ``idx`` check: the planned ``[rows, topk]`` int32/int64 tensor on
    the plan's device passes at once; anything else gets the full checks and their messages."""
    if type(idx) is Tensor and idx.shape == shape and idx.dtype in _INDEX_DTYPES and idx.device == device:
        return
    check_index(idx, shape[0])
    if idx.shape != shape:
        raise ValueError(f"idx must be [{rows_name}, topk] = {list(shape)} (the plan's topk), got {list(idx.shape)}")
    if idx.device != device:
        raise ValueError(f"idx is on {idx.device} but the plan is on {device} (use meta.to(device))")


def _check_device(t: Tensor, name: str, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the plan is on {device} (use meta.to(device))")


def _check_page_table(page_table, meta: CPMetadata, page_size: int, max_keys: int) -> None:
    check_tensor(page_table, "page_table")
    if page_table.dtype not in _INDEX_DTYPES:
        raise TypeError(f"page_table must be int32 or int64, got {page_table.dtype}")
    if page_table.dim() != 2 or page_table.shape[0] != meta.num_seq_rows:
        raise ValueError(f"page_table must be [B={meta.num_seq_rows}, max_pages], got {list(page_table.shape)}")
    _check_device(page_table, "page_table", meta.device)
    if page_table.shape[1] * page_size < max_keys:
        raise ValueError(
            f"page_table holds {page_table.shape[1]} pages of {page_size} = {page_table.shape[1] * page_size} keys, "
            f"fewer than the longest sequence ({max_keys})"
        )


# ----------------------------------------------------------------------------- index top-k
class IndexTopkPlan(AttentionPlan):
    """The DSA lightning indexer's top-k selection for a rank's query rows, bound to one placement
    plan (on the plan base, like the sparse attention it feeds). Build with
    :func:`plan_index_topk`; ``run`` per layer.

    ``algorithm``: "local" (a replicated index-key cache: every key is given; no collective) or
    "shard_merge" (replicated queries over a sharded cache: each rank scores its own keys,
    :meth:`candidates`, and ONE all-gather of the candidates gives every rank the exact global
    top-k, :func:`select_candidates`).

    ``candidates_agreed`` ("shard_merge"): whether every rank is known to exchange candidates of
    this plan's shape [N, topk]: True from planning when the ranks agreed on ``topk`` with the
    placement plan (``build_metadata(index_topk=)``: ``meta.index_topk``), else after this plan's
    first :meth:`run` over a group (one tiny shape check).
    """

    def __init__(self, meta: CPMetadata, spec: IndexTopkSpec, backend: str, run_impl, algorithm: str) -> None:
        self._bind(meta, spec, backend, run_impl)
        self.algorithm = algorithm
        p = meta.num_physical_tokens
        self._q_shape = (p, spec.num_heads, spec.head_dim)
        self._w_shape = (p, spec.num_heads)
        self._out_shape = (p, spec.topk)
        self._scale = spec.head_dim**-0.5
        self._sharded = algorithm == "shard_merge"
        self._candidates_agreed = self._sharded and meta.index_topk == spec.topk

    @property
    def candidates_agreed(self) -> bool:
        """See the class docstring ("shard_merge" only; False for "local")."""
        return self._candidates_agreed

    def __repr__(self) -> str:
        return (f"IndexTopkPlan(algorithm={self.algorithm!r}, backend={self.backend!r}, {self.spec}, "
                f"P={self.meta.num_physical_tokens})")

    def _check_inputs(self, q_idx, k_idx, weights, k_scale, page_table) -> None:
        """The per-layer checks of an index call (raises on the first failure, naming it)."""
        spec, meta = self.spec, self.meta
        device = self._device
        check_tensor(q_idx, "q_idx")
        check_tensor(k_idx, "k_idx")
        check_tensor(weights, "weights")
        if q_idx.dtype != spec.q_dtype or k_idx.dtype != spec.k_dtype:
            raise TypeError(f"q_idx / k_idx dtypes {q_idx.dtype} / {k_idx.dtype} != the plan's "
                            f"{spec.q_dtype} / {spec.k_dtype}")
        if q_idx.shape != self._q_shape:
            raise ValueError(f"q_idx must be [P, H_i, D_i] = {list(self._q_shape)}, got {list(q_idx.shape)}")
        if weights.shape != self._w_shape or not weights.dtype.is_floating_point:
            raise ValueError(f"weights must be a float [P, H_i] = {list(self._w_shape)} tensor, got "
                             f"{weights.dtype} {list(weights.shape)}")
        max_keys = meta.max_local_kv_len if self._sharded else meta.max_kv_len
        if spec.paged:
            if page_table is None:
                raise ValueError(f"the plan is paged (page_size={spec.page_size}): pass page_table")
            want = f"[num_pages, {spec.page_size}, {spec.head_dim}]"
            if k_idx.dim() != 3 or k_idx.shape[1:] != (spec.page_size, spec.head_dim):
                raise ValueError(f"paged k_idx must be {want}, got {list(k_idx.shape)}")
            _check_page_table(page_table, meta, spec.page_size, max_keys)
            scale_shape = tuple(k_idx.shape[:2])
        else:
            if page_table is not None:
                raise ValueError("page_table given but the plan is for packed index keys (plan with page_size=)")
            if self._sharded:
                if k_idx.dim() != 2 or k_idx.shape[1] != spec.head_dim or k_idx.shape[0] < meta.num_local_kv_tokens:
                    raise ValueError(f"k_idx must be this rank's packed index keys [>= {meta.num_local_kv_tokens}, "
                                     f"{spec.head_dim}] (local key j of sequence b at row cu_local_kv_lens[b] + j), "
                                     f"got {list(k_idx.shape)}")
                scale_shape = (k_idx.shape[0],)
            else:
                if k_idx.shape != (meta.num_kv_rows, spec.head_dim):
                    raise ValueError(f"k_idx must be [num_kv_tokens, D_i] = {[meta.num_kv_rows, spec.head_dim]} "
                                     f"(rows = sum(prefix_lens + extend_lens)), got {list(k_idx.shape)}")
                scale_shape = (meta.num_kv_rows,)
        if (k_scale is not None) != spec.has_k_scale:
            raise ValueError(f"the plan was built with has_k_scale={spec.has_k_scale}; "
                             f"got k_scale={'a tensor' if k_scale is not None else None}")
        if k_scale is not None:
            check_tensor(k_scale, "k_scale")
            if tuple(k_scale.shape) != scale_shape or k_scale.dtype != torch.float32:
                raise ValueError(f"k_scale must be float32 {list(scale_shape)} (one scale per index key), got "
                                 f"{k_scale.dtype} {list(k_scale.shape)}")
        for name, t in (("q_idx", q_idx), ("k_idx", k_idx), ("weights", weights), ("k_scale", k_scale)):
            if t is not None:
                _check_device(t, name, device)

    def _index_inputs(self, inputs: dict, method: str) -> tuple:
        """(k_scale, page_table, softmax_scale, out) of a call's keywords (absent: None);
        TypeError naming any keyword :class:`IndexInputs` does not list."""
        if not inputs.keys() <= INDEX_INPUTS:
            raise TypeError(f"IndexTopkPlan.{method}() got unexpected keyword argument(s) "
                            f"{sorted(inputs.keys() - INDEX_INPUTS)}")
        get = inputs.get
        return get("k_scale"), get("page_table"), get("softmax_scale"), get("out")

    def _check_out(self, out, shape, dtype, what: str) -> Tensor:
        if out is None:
            return torch.empty(shape, dtype=dtype, device=self._device)
        check_tensor(out, "out")
        if out.shape != shape or out.dtype != dtype or out.device != self._device:
            raise ValueError(f"out must be {what} {list(shape)} on {self._device}, got "
                             f"{out.dtype} {list(out.shape)} on {out.device}")
        return out

    def candidates(self, q_idx: Tensor, k_idx: Tensor, weights: Tensor, **inputs: Unpack[IndexInputs]) -> Tensor:
        """"shard_merge" only: this rank's top-k candidates, no collective (device-only).

        Args:
            q_idx: [N, H_i, D_i], weights: [N, H_i]: the step's index queries, the same on every rank.
            k_idx: this rank's index keys: packed [>= num_local_kv_tokens, D_i] (local key j of
                sequence b at row ``cu_local_kv_lens[b] + j``) or paged [num_pages, page_size,
                D_i] with ``page_table`` [B, max_pages] (this rank's pages); ``k_scale``
                float32 per key ([rows] / [num_pages, page_size]) when the plan has it.
            **inputs: :class:`IndexInputs` (``k_scale``, ``page_table``, ``softmax_scale``,
                ``out``: an int64 [N, topk] buffer).

        Returns:
            int64 [N, topk] packed (score, global position) keys (:mod:`cpattn.selection`): the
            ``topk`` best of this rank's keys at global positions <= each row's position
            (ties: the lower position), :data:`cpattn.selection.NO_KEY` where fewer.
        """
        if not self._sharded:
            raise ValueError(f"candidates() is for a plan over a sharded cache (algorithm 'shard_merge'); "
                             f"this plan's algorithm is {self.algorithm!r}: call run()")
        k_scale, page_table, softmax_scale, out = self._index_inputs(inputs, "candidates")
        self._check_inputs(q_idx, k_idx, weights, k_scale, page_table)
        out = self._check_out(out, self._out_shape, torch.int64, "int64 [N, topk] =")
        scale = self._softmax_scale(softmax_scale)
        self._impl(q_idx, k_idx, weights, k_scale, page_table, scale, out)
        return out

    def run(self, q_idx: Tensor, k_idx: Tensor, weights: Tensor, *, group=None,
            **inputs: Unpack[IndexInputs]) -> Tensor:
        """Top-k key positions per row (see :func:`cpattn.dsa.index_topk` for the arguments);
        ``**inputs``: :class:`IndexInputs` (``out``: an int32 [P, topk] buffer to write).

        "local": the keys of every sequence are given (``k_idx`` packed like K/V or paged);
        device work plus a host loop over the plan's score chunks (no host sync).
        "shard_merge": ``k_idx`` / ``k_scale`` / ``page_table`` are this rank's shard (as
        :meth:`candidates`); ONE all-gather over ``group`` of every rank's candidates (8 bytes
        each: :func:`cpattn.dsa.topk_agreement_bytes`), then every rank returns the same exact
        global top-k (global positions; ties: the lower position; -1 padding). Every check runs
        before the collective. Ranks planned with different ``topk`` all raise the same error
        instead of hanging: PlanDisagreement at planning when ``topk`` was agreed with the
        placement plan (``build_metadata(index_topk=)``: then no collective here but the one
        all-gather), else a ValueError from a tiny [2] int64 all-gather that this plan's first
        run over a group runs first (:attr:`candidates_agreed`; its later runs skip it).
        """
        k_scale, page_table, softmax_scale, out = self._index_inputs(inputs, "run")
        if not self._sharded and group is not None:
            raise ValueError("group= is for a plan over a sharded cache (algorithm 'shard_merge')")
        self._check_inputs(q_idx, k_idx, weights, k_scale, page_table)
        out = self._check_out(out, self._out_shape, torch.int32, "int32 [P, topk] =")
        if not self._sharded:
            scale = self._softmax_scale(softmax_scale)
            self._impl(q_idx, k_idx, weights, k_scale, page_table, scale, out)
            return out
        from ..collectives import all_gather_into, check_group

        scale = self._softmax_scale(softmax_scale)
        check_group(self.meta, group)  # local checks, before the collective
        _check_group_size(self.meta, group)
        cand = torch.empty(self._out_shape, dtype=torch.int64, device=self._device)
        self._impl(q_idx, k_idx, weights, k_scale, page_table, scale, cand)
        c = self.meta.cp_size
        if c > 1:
            if not self._candidates_agreed:
                self._candidates_agreed = _check_same_candidates((cand.shape[0], cand.shape[1]), group, c)
            gathered = torch.empty((c * cand.shape[0], cand.shape[1]), dtype=torch.int64, device=self._device)
            all_gather_into(gathered, cand, group, False)  # the one collective
        else:
            gathered = cand
        self._impl.select(gathered.view(c, *cand.shape), out)
        return out

    def select(self, candidates: Tensor, *, out: Optional[Tensor] = None) -> Tensor:
        """"shard_merge" only: the exact global top-k of every rank's candidates on this plan's
        backend (what :meth:`run` does after its all-gather; device-only, graph-safe).

        Args:
            candidates: int64 [C, N, topk] packed keys, rank r's :meth:`candidates` at ``[r]``
                (the all-gather's layout).
            out: an int32 [N, topk] buffer to write (None: a new one).

        Returns:
            int32 [N, topk] global positions (unordered; ties: the lower position; -1 where the
            ranks hold fewer than ``topk`` visible keys in all): the set
            :func:`select_candidates` selects.
        """
        if not self._sharded:
            raise ValueError(f"select() is for a plan over a sharded cache (algorithm 'shard_merge'); "
                             f"this plan's algorithm is {self.algorithm!r}: call run()")
        check_tensor(candidates, "candidates")
        want = (self.meta.cp_size, *self._out_shape)
        if candidates.dtype != torch.int64 or tuple(candidates.shape) != want or candidates.stride(-1) != 1:
            raise ValueError(f"candidates must be int64 [C, N, topk] = {list(want)} with unit column stride, got "
                             f"{candidates.dtype} {list(candidates.shape)}")
        _check_device(candidates, "candidates", self._device)
        out = self._check_out(out, self._out_shape, torch.int32, "int32 [N, topk] =")
        self._impl.select(candidates, out)
        return out


def _check_group_size(meta: CPMetadata, group) -> None:
    """ValueError unless ``group`` (None: the default group) has ``meta.cp_size`` ranks with this
    process at ``meta.rank`` (``check_group`` lets replicated plans pass without a group)."""
    import torch.distributed as dist

    if meta.cp_size == 1:
        return
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"cp_size={meta.cp_size} needs an initialized torch.distributed process group (pass group=)")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size != meta.cp_size or rank != meta.rank:
        raise ValueError(f"the group has {size} ranks with this process at rank {rank}, but the plan is rank "
                         f"{meta.rank} of cp_size {meta.cp_size}")


def _check_same_candidates(shape: tuple[int, int], group, size: int) -> bool:
    """Every rank passes candidates [N, topk] of one shape (else the same ValueError on every
    rank, instead of an all-gather of mismatched sizes, which aborts or hangs): a tiny [2] int64
    all-gather. Skipped while a CUDA graph is being captured (the check reads its result on the
    host). Returns whether it checked."""
    from ..collectives import all_gather_into, group_device

    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    device = group_device(group)
    table = torch.empty(size * 2, dtype=torch.int64, device=device)
    all_gather_into(table, torch.tensor(shape, dtype=torch.int64).to(device), group, False)
    rows = table.view(size, 2).tolist()
    if any(row != rows[0] for row in rows):
        per_rank = "; ".join(f"rank {r}: [N={n}, topk={k}]" for r, (n, k) in enumerate(rows))
        raise ValueError(f"index top-k over a sharded cache: the ranks planned different candidates (rows or topk "
                         f"differ; nothing was selected): {per_rank}")
    return True


def select_candidates(candidates: Tensor, topk: int) -> Tensor:
    """The exact global top-k from every rank's candidates: ``candidates`` int64 [C, N, k]
    packed keys (:meth:`IndexTopkPlan.candidates` of each rank) -> int32 [N, topk] global
    positions (ties: the lower position; -1 where the ranks hold fewer than ``topk`` visible
    keys in all). Pure device work: the same on every rank."""
    check_tensor(candidates, "candidates")
    if candidates.dtype != torch.int64 or candidates.dim() != 3:
        raise ValueError(f"candidates must be int64 [C, N, k], got {candidates.dtype} {list(candidates.shape)}")
    topk = check_int(topk, "topk", 1)
    return top_candidate_positions(candidates, topk).to(torch.int32)


def plan_index_topk(
    meta: CPMetadata,
    *,
    num_heads: int,
    head_dim: int,
    q_dtype: torch.dtype,
    k_dtype: torch.dtype,
    topk: int,
    page_size: Optional[int] = None,
    has_k_scale: bool = False,
    backend: str = "auto",
    backend_options: Optional[Mapping] = None,
) -> IndexTopkPlan:
    """Plan the DSA index top-k over ``meta`` (host, once per forward). ``num_heads`` H_i,
    ``head_dim`` D_i, dtypes of q_idx / k_idx (fp8 index keys with ``has_k_scale``), ``topk``,
    ``page_size`` of a paged index-key cache (None: packed). ``backend``: "auto" (triton, then
    torch; over a sharded cache: triton on CUDA, "gemm" on the CPU), "triton", "torch" or "gemm".

    The algorithm follows from ``meta`` as for :func:`cpattn.plan_attention`: a replicated
    index-key cache (``meta.kv`` None) -> "local"; replicated queries over a sharded cache
    (``kv=KVSharding(C)``, a decode step) -> "shard_merge" (static plans replay in CUDA graphs);
    sharded queries over a sharded cache: NotImplementedError."""
    if not isinstance(meta, CPMetadata):
        raise TypeError(f"meta must be a CPMetadata, got {type(meta).__name__}")
    spec = make_index_spec(num_heads=num_heads, head_dim=head_dim, q_dtype=q_dtype, k_dtype=k_dtype, topk=topk,
                           page_size=page_size, has_k_scale=has_k_scale)
    options = dict(backend_options or {})
    check_group_rank(meta)
    if meta.kv is None:
        chosen = select_backend(spec, meta, backend, kind="index")
        return IndexTopkPlan(meta, spec, chosen.name, chosen.plan(spec, meta, options), "local")
    if not meta.replicated:
        raise NotImplementedError("the index top-k over a sharded cache runs replicated queries (a decode step: the "
                                  "'replicated' strategy with kv=KVSharding); an extend over a sharded cache is not "
                                  "supported")
    if meta.index_topk and meta.index_topk != spec.topk:
        raise ValueError(f"topk={spec.topk} differs from the index top-k the ranks agreed on with the placement plan "
                         f"(build_metadata(index_topk={meta.index_topk}))")
    if page_size is not None:
        meta.kv.check_page_size(page_size)
    if max(meta.max_kv_len, meta.capacity.max_kv_tokens if meta.capacity else 0) >= _MAX_POSITIONS:
        raise ValueError(f"the index top-k over a sharded cache packs positions in 32 bits: sequences must be "
                         f"shorter than {_MAX_POSITIONS} keys")
    if backend == "auto":  # Triton on CUDA (H100, C = 8 rank, 128k local keys x 128 rows: 2.0 ms vs 81 ms for
        # the gemm scorer); torch matmuls on the CPU, where Triton is the interpreter
        backend = "triton" if meta.device.type == "cuda" else "gemm"
    chosen = select_backend(spec, meta, backend, kind="shard_index")
    return IndexTopkPlan(meta, spec, chosen.name, chosen.plan(spec, meta, options), "shard_merge")
