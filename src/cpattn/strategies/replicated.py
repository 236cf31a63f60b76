"""Replicated placement: every rank computes every query (decode steps; CP off for one batch)."""

from __future__ import annotations

from torch import Tensor

from .base import CPStrategy


class ReplicatedStrategy(CPStrategy):
    """Every rank owns every extend token: local row t is logical row t on each of the C ranks.

    ``shard`` keeps all rows, ``gather`` / ``gather_kv`` / ``gather_packed`` run no collective.
    With a replicated KV cache attention is local (no collective at all: CP switched off for a
    short batch without changing the engine's code path); with a sharded cache
    (``build_metadata(..., kv=cpattn.KVSharding(C))``) each rank attends its key shard and the
    partials merge exactly in one collective (decode context parallelism, q_len >= 1).

    Example (a decode step of B sequences, one new token each)::

        s = cpattn.get_strategy("replicated", C)
        meta = s.build_metadata(q_lens, seq_lens - q_lens, rank=r, group=g, kv=cpattn.KVSharding(C))
    """

    name = "replicated"

    def _token_owner(self, seq_ids: Tensor, offsets: Tensor, extend_lens: Tensor) -> Tensor:
        raise NotImplementedError("replicated placement has no single owner per token")  # never called

    @property
    def replicated(self) -> bool:
        return True

    def max_local_tokens(self, max_tokens: int, max_seqs: int) -> int:
        return max_tokens
