"""Start / wait API for engines that schedule their own CUDA streams around the K/V all-gather.

``strategy.gather_kv(..., async_op=True)`` already overlaps the collective with whatever the
current stream runs before ``wait()`` (NCCL has its own stream). What it does not do is move the
*packing* (the copy of K/V into one send buffer) and the *reorder* (``index_select`` into logical
order) off the compute stream. :func:`start_gather_kv` does: it runs pack, all-gather and reorder on
a side stream that starts after the producer of K/V, so the compute stream is free for the query
projection / RoPE of this layer (or anything else the engine puts there) until it calls
:meth:`GatherHandle.wait`::

    handle = cpattn.overlap.start_gather_kv(s, k_local, v_local, meta, group)   # after k/v proj
    q = rope(q_proj(h), positions)                                             # overlaps
    k_ext, v_ext = handle.wait()       # the current stream waits for the side stream (no host sync)

Stream discipline (CUDA): the side stream waits on the producer stream before it reads K/V; the
inputs are ``record_stream``-ed on the side stream (the caller may drop them right away); ``wait()``
makes the *calling* stream wait on an event recorded after the reorder and ``record_stream``-s the
results on it. No host synchronization anywhere (the side stream forks from and joins the compute
stream through events only).

Without CUDA (CPU tensors, gloo) there are no streams: the collective is issued with
``async_op=True`` (gloo runs it on its own thread) and ``wait()`` blocks the host until it is done.
Results are bit-identical to ``strategy.gather_kv`` in every mode.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from .collectives import PendingGather
from .metadata import CPMetadata
from .strategies import CPStrategy

__all__ = ["GatherHandle", "side_stream", "start_gather_kv", "start_gather_mla_latent"]

_SIDE_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def side_stream(device: torch.device | str | int | None = None) -> "torch.cuda.Stream":
    """The default side stream of a CUDA device (one per device, created on first use)."""
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"side_stream needs a CUDA device, got {dev}")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


class GatherHandle:
    """A K/V (or MLA latent) all-gather started by :func:`start_gather_kv` /
    :func:`start_gather_mla_latent`.

    :meth:`wait` returns the logical-order tensors (``[T, ...]``, views of one buffer) and, on CUDA,
    makes the calling stream wait for them. It is idempotent: every call returns the same tensors
    (and on CUDA adds the dependency for the stream current at that call, so a second consumer
    stream may call it too).
    """

    def __init__(
        self,
        *,
        pending: Optional[PendingGather] = None,
        result: Optional[list[Tensor]] = None,
        done: Optional["torch.cuda.Event"] = None,
    ) -> None:
        self._pending = pending
        self._result = result
        self._done = done

    @property
    def on_cuda(self) -> bool:
        """True when the gather runs on a CUDA side stream (False: CPU fallback)."""
        return self._done is not None

    def is_completed(self) -> bool:
        """Non-blocking: has the gather (and reorder) finished? (CPU fallback: after ``wait()``.)"""
        if self._done is not None:
            return self._done.query()
        return self._result is not None

    def wait(self) -> tuple[Tensor, ...]:
        """Make the current stream wait for the gather; return the logical-order tensors."""
        if self._done is not None:
            consumer = torch.cuda.current_stream(self._result[0].device)
            consumer.wait_event(self._done)
            for t in self._result:
                t.record_stream(consumer)  # allocated on the side stream, used on the consumer
        elif self._result is None:
            self._result = self._pending.wait()
            self._pending = None
        return tuple(self._result)


def _start(
    issue: Callable[[], PendingGather], inputs: tuple[Tensor, ...], stream: Optional["torch.cuda.Stream"]
) -> GatherHandle:
    device = inputs[0].device
    if device.type != "cuda":
        if stream is not None:
            raise ValueError(f"stream= needs CUDA tensors, got tensors on {device}")
        return GatherHandle(pending=issue())
    if stream is not None and not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}")
    side = side_stream(device) if stream is None else stream
    producer = torch.cuda.current_stream(device)
    side.wait_stream(producer)  # pack only after the kernels that produced K/V
    with torch.cuda.stream(side):
        pending = issue()  # pack + all-gather (NCCL stream waits on `side`)
        result = pending.wait()  # `side` waits on the collective (no host block); reorder on `side`
        done = torch.cuda.Event()
        done.record(side)
    for t in inputs:
        t.record_stream(side)  # the producer may free them before `side` has read them
    return GatherHandle(result=result, done=done)


def _check_strategy(strategy) -> None:
    if not isinstance(strategy, CPStrategy):
        raise TypeError(f"strategy must be a cpattn.CPStrategy, got {type(strategy).__name__}")


def start_gather_kv(
    strategy: CPStrategy,
    k_local: Tensor,
    v_local: Tensor,
    meta: CPMetadata,
    group=None,
    *,
    stream: Optional["torch.cuda.Stream"] = None,
) -> GatherHandle:
    """Start the K/V all-gather of one layer; ``handle.wait()`` gives ``(k [T, Hkv, D], v [T, Hkv, Dv])``.

    Args:
        strategy, meta, group: as for :meth:`CPStrategy.gather_kv` (k_local [P, Hkv, D],
            v_local [P, Hkv, Dv], P = meta.num_physical_tokens).
        stream: CUDA side stream for pack, collective and reorder (default: one per device, see
            :func:`side_stream`). Must be None for CPU tensors.

    Results equal ``strategy.gather_kv(k_local, v_local, meta, group)`` exactly. Input errors
    raise (ValueError / TypeError) before any collective, as in ``gather_kv``.
    """
    _check_strategy(strategy)
    return _start(
        lambda: strategy.gather_kv(k_local, v_local, meta, group, async_op=True), (k_local, v_local), stream
    )


def start_gather_mla_latent(
    strategy: CPStrategy,
    kv_c_local: Tensor,
    k_pe_local: Tensor,
    meta: CPMetadata,
    group=None,
    *,
    stream: Optional["torch.cuda.Stream"] = None,
) -> GatherHandle:
    """Start the MLA latent all-gather (kv_c [P, r], k_pe [P, d_rope]); ``wait()`` gives
    ``(kv_c [T, r], k_pe [T, d_rope])``. Same stream discipline as :func:`start_gather_kv`."""
    _check_strategy(strategy)
    return _start(
        lambda: strategy.gather_mla_latent(kv_c_local, k_pe_local, meta, group, async_op=True),
        (kv_c_local, k_pe_local),
        stream,
    )
