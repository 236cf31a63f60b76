"""Run a function on N gloo ranks in spawned processes and collect what each rank returns."""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, init_file: str, out_dir: str, fn, args, pg_timeout, barrier) -> None:
    torch.set_num_threads(1)
    kw = {} if pg_timeout is None else {"timeout": datetime.timedelta(seconds=pg_timeout)}
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, **kw)
    try:
        result = ("ok", fn(rank, world_size, *args))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result = ("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    if not barrier:  # a test that left collectives unmatched on purpose: leave without teardown
        os._exit(0)
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # The result is written and every rank passed the barrier: leave without interpreter
    # finalization, where gloo's worker threads can still hold finished work whose tensors
    # need the GIL being torn down ("terminate called without an active exception", SIGABRT,
    # seen in about one full-suite run in three on the 2-core CI machine).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0, pg_timeout: float | None = None,
                    barrier: bool = True) -> list:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the ranks' results.

    ``fn`` must be a module-level function (picklable). A rank's exception is re-raised here as an
    AssertionError with that rank's traceback. ``pg_timeout``: the process group's timeout (s).
    ``barrier=False``: ranks exit without the final barrier (for tests that break collectives).
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = mp.start_processes(
            _worker, args=(world_size, init_file, tmp, fn, args, pg_timeout, barrier), nprocs=world_size, join=False,
            start_method="spawn",
        )
        while not ctx.join(timeout=timeout):
            pass
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise AssertionError(value)
            results.append(value)
        return results


class CountCollectives:
    """Context manager patching ``cpattn.collectives.all_gather_into`` (the single collective
    entry point) to count calls; ``calls`` holds each call's packed input shape."""

    def __enter__(self) -> "CountCollectives":
        from cpattn import collectives

        self.calls: list[tuple[int, ...]] = []
        self._module, self._orig = collectives, collectives.all_gather_into

        def counting(output, input, group, async_op):
            self.calls.append(tuple(input.shape))
            return self._orig(output, input, group, async_op)

        collectives.all_gather_into = counting
        return self

    def __exit__(self, *exc) -> None:
        self._module.all_gather_into = self._orig
