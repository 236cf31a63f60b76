"""Tiny launcher shared by the examples: torchrun (env://) or ``--spawn C`` local processes.

``launch(worker, cp, *args)`` calls ``worker(rank, world_size, device, *args)`` on every rank
with a process group initialized (NCCL on CUDA, gloo on CPU) and returns the results this process
can see: all ranks' results when it spawned them, its own rank's result under torchrun. cp == 1
without torchrun runs in-process with no process group (cpattn needs none at C = 1).
"""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _device(use_cuda: bool, local_rank: int) -> torch.device:
    if use_cuda:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _spawned(rank, world_size, init_file, out_dir, use_cuda, worker, args) -> None:
    torch.set_num_threads(1)
    device = _device(use_cuda, rank)
    backend = "nccl" if use_cuda else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        result = ("ok", worker(rank, world_size, device, *args))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result = ("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    _shutdown()


def _shutdown() -> None:
    # Every rank leaves together: a gloo group destroyed while a peer is still inside its last
    # collective can abort the process ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


def launch(worker, cp: int, *args, use_cuda: bool | None = None) -> list:
    """Run ``worker(rank, world_size, device, *args)`` on ``cp`` ranks; return the visible results.

    A rank's exception is re-raised here as RuntimeError carrying that rank's traceback.
    """
    if use_cuda is None:
        use_cuda = torch.cuda.is_available()
    if under_torchrun():
        world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        device = _device(use_cuda, int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl" if use_cuda else "gloo")
        try:
            return [worker(rank, world_size, device, *args)]
        finally:
            _shutdown()
    if cp == 1:
        return [worker(0, 1, _device(use_cuda, 0), *args)]
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.start_processes(
            _spawned, args=(cp, init_file, tmp, use_cuda, worker, args), nprocs=cp, join=True, start_method="spawn"
        )
        results = []
        for rank in range(cp):
            with open(os.path.join(tmp, f"{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise RuntimeError(value)
            results.append(value)
        return results
