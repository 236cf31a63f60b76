"""Child process of the ``cp`` benchmark: the same GQA stack under torch's ``context_parallel``.

Started by path once per rank by :func:`benchmarks.cp.run_peer` with RANK/WORLD_SIZE/MASTER_* set; it
forms its own process group, so a hang here can be killed without touching the benchmark's.
Every step appends one JSON line to ``--status`` (``{"stage": ...}``, ``{"result": ...}``,
``{"error": ...}``); the parent's watchdog reads it.

How the peer is driven (torch/distributed/tensor/experimental/_context_parallel/_attention.py):

* ``torch.cuda.set_device(LOCAL_RANK)`` before any CUDA tensor, ``init_process_group("nccl",
  device_id=...)`` (eager communicator) and ``init_device_mesh("cuda", (C,))``.
* ``set_rotate_method("allgather")`` (the default; "alltoall" is the pass-KV ring).
* ``context_parallel(mesh, buffers=[x, positions], buffer_seq_dims=[1, 1])`` shards the model
  inputs in place with the head-tail load balancer (needs S % 2C == 0) and monkey-patches
  ``F.scaled_dot_product_attention``; inside, the model runs on its shard and every SDPA call
  becomes ring attention (wrapped into DTensor ``Shard(2)``, dispatched by ``_sdpa_handler``).
* ``sdpa_kernel([FLASH, EFFICIENT, CUDNN])``: only those three aten ops have a CP handler; if SDPA
  fell back to MATH, DTensor would decompose it into matmuls on ``Shard(2)`` tensors, redistribute
  (all-gather) q/k/v and materialize S x S scores — at 128k that runs for minutes and then dies.
  Excluding MATH turns that into an immediate error.
* GQA: ``enable_gqa=True`` (flash handles Hkv < Hq natively); if the kernel refuses it, K/V heads
  are repeated to Hq (4x the ring traffic; recorded as ``gqa: "repeat_kv"``).

If the public API cannot run (e.g. on CPU: ``_scaled_dot_product_flash_attention_for_cpu`` has
no CP sharding rule), the same ring algorithm is called directly (``_templated_ring_attention``
with the device's flash op, head-tail sharding done here) and the result says ``mode:
"ring-direct"``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
from datetime import timedelta

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path and os.path.abspath(sys.path[0] or os.curdir) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run by path: benchmarks/ itself must not shadow top-level modules
sys.path.insert(0, _ROOT)  # the repository root: reference_layers
if importlib.util.find_spec("cpattn") is None:  # a checkout without an install (as benchmarks/run.py)
    sys.path.append(os.path.join(_ROOT, "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from reference_layers import AttentionStack  # noqa: E402
from reference_layers.rope import apply_rope  # noqa: E402


class _Status:
    def __init__(self, path: str, rank: int) -> None:
        self.path, self.rank = path, rank

    def emit(self, **item) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(item) + "\n")
        if self.rank == 0 and "stage" in item:
            print(f"[{time.strftime('%H:%M:%S')}] [peer] {item['stage']}", file=sys.stderr, flush=True)


def _head_tail_index(seq_len: int, world: int, rank: int) -> torch.Tensor:
    blk = seq_len // (2 * world)
    return torch.cat([torch.arange(rank * blk, (rank + 1) * blk),
                      torch.arange((2 * world - 1 - rank) * blk, (2 * world - rank) * blk)])


def _forward(stack: AttentionStack, x: torch.Tensor, pos: torch.Tensor, attn, gqa: bool, marks: list) -> torch.Tensor:
    """x [n, hidden], pos [n] (this rank's shard) -> x [n, hidden]; attn(q, k, v) on [1, H, n, D]."""
    for layer in stack.layers:
        h = layer.norm(x)
        n = x.shape[0]
        k, v = layer.kv_proj(h).view(n, 2, layer.hkv, layer.d).unbind(1)
        k = apply_rope(k, pos)
        q = apply_rope(layer.q_proj(h).view(n, layer.hq, layer.d), pos)
        qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if not gqa:
            rep = layer.hq // layer.hkv
            kt, vt = kt.repeat_interleave(rep, dim=1), vt.repeat_interleave(rep, dim=1)
        marks.append(_mark(x.device))
        o = attn(qt, kt, vt)
        marks.append(_mark(x.device))
        o = o[0].transpose(0, 1).reshape(n, -1)
        x = x + layer.o_proj(o)
        x = x + layer.mlp(x)
    return x


def _mark(device: torch.device):
    if device.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def _ms(a, b) -> float:
    return a.elapsed_time(b) if isinstance(a, torch.cuda.Event) else (b - a) * 1e3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _barrier(device: torch.device) -> None:
    dist.barrier(device_ids=[device.index]) if device.type == "cuda" else dist.barrier()


def _time(fn, device: torch.device, iters: int) -> tuple[float, float]:
    """Median (wall ms, attention ms) over ``iters`` forwards, after one warmup."""
    fn([])
    _sync(device)
    walls, atts = [], []
    for _ in range(iters):
        _barrier(device)
        marks: list = []
        a = _mark(device)
        fn(marks)
        b = _mark(device)
        _sync(device)
        walls.append(_ms(a, b))
        atts.append(sum(_ms(marks[i], marks[i + 1]) for i in range(0, len(marks), 2)))
    return statistics.median(walls), statistics.median(atts)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--status", required=True)
    p.add_argument("--tokens", required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--long-iters", type=int, default=2)
    p.add_argument("--rotate", default="allgather")
    p.add_argument("--pg-timeout", type=int, default=180)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    status = _Status(args.status, rank)
    status.emit(stage="start", torch=torch.__version__)
    timeout = timedelta(seconds=args.pg_timeout)
    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
        dtype = torch.bfloat16
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
        dtype = torch.float32
    status.emit(stage="process group up")
    try:
        return _run(args, status, rank, world, device, dtype)
    except Exception as exc:  # noqa: BLE001 - reported to the parent through the status file
        status.emit(error=f"{type(exc).__name__}: {exc}"[:400], traceback=traceback.format_exc()[-2000:])
        return 1
    finally:
        dist.destroy_process_group()


def _run(args, status: _Status, rank: int, world: int, device: torch.device, dtype: torch.dtype) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental import _attention as cp_attention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh(device.type, (world,))
    cp_attention.set_rotate_method(args.rotate)
    status.emit(stage=f"mesh up, rotate={args.rotate}, options={cp_attention._cp_options}")
    stack = AttentionStack(args.layers, args.hidden, args.heads, args.kv_heads, args.head_dim, seed=0).to(device, dtype)
    group = mesh.get_group()
    kernels = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    public_ok, gqa = True, True
    tokens_list = [int(t) for t in args.tokens.split(",") if t]
    for i, seq_len in enumerate(tokens_list):
        iters = args.long_iters if seq_len >= 256 * 1024 else args.iters
        gen = torch.Generator(device=device).manual_seed(7 + seq_len)
        x_full = torch.randn((1, seq_len, args.hidden), generator=gen, device=device, dtype=dtype)
        pos_full = torch.arange(seq_len, device=device)[None]
        idx = _head_tail_index(seq_len, world, rank).to(device)
        ref = None
        if i == 0:  # correctness: same stack, plain SDPA on the whole sequence, this rank's rows
            # K/V heads repeated and MATH excluded: a math fallback would materialize S x S scores.
            plain = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
            with torch.no_grad(), (sdpa_kernel(kernels) if device.type == "cuda" else _nullcontext()):
                ref = _forward(stack, x_full[0], pos_full[0], plain, False, [])[idx]
            status.emit(stage=f"{seq_len}: single-GPU reference done")
        result = None
        while result is None:
            mode = "public" if public_ok else "ring-direct"
            status.emit(stage=f"{seq_len}: {mode} gqa={gqa} first forward")
            try:
                result = _one(args, stack, x_full, pos_full, idx, mesh, group, mode, gqa, kernels, device, iters,
                              context_parallel, cp_attention, sdpa_kernel, ref)
            except Exception as exc:  # noqa: BLE001 - decide the fallback, report why
                msg = f"{seq_len} tokens, {mode}, gqa={gqa}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
                status.emit(error=msg)
                if gqa and ("gqa" in str(exc).lower() or "head" in str(exc).lower() or "No available kernel" in str(exc)):
                    gqa = False
                elif public_ok:
                    public_ok, gqa = False, True
                else:
                    raise
        result.update(tokens=seq_len, mode=mode, gqa="enable_gqa" if gqa else "repeat_kv", rotate=args.rotate)
        status.emit(result=result)
        status.emit(stage=f"{seq_len}: done wall={result['wall_ms']:.2f} ms attention={result['attention_ms']:.2f} ms")
        del x_full, pos_full, ref
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


def _one(args, stack, x_full, pos_full, idx, mesh, group, mode, gqa, kernels, device, iters,
         context_parallel, cp_attention, sdpa_kernel, ref) -> dict:
    world = mesh.size()
    if mode == "public":
        x, pos = x_full.clone(), pos_full.clone()
        with torch.no_grad(), context_parallel(mesh, buffers=[x, pos], buffer_seq_dims=[1, 1], no_restore_buffers={x, pos}):
            attn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)  # noqa: E731
            ctx = sdpa_kernel(kernels) if device.type == "cuda" else _nullcontext()
            with ctx:
                fn = lambda marks: _forward(stack, x[0], pos[0], attn, gqa, marks)  # noqa: E731
                wall, att = _time(fn, device, iters)
                diff = None
                if ref is not None:
                    diff = float((fn([]).float() - ref.float()).abs().max())
        return {"wall_ms": wall, "attention_ms": att, "max_abs_diff": diff}
    # ring-direct: torch's ring algorithm on this device's flash op, head-tail shards made here.
    if cp_attention._cp_options.enable_load_balance is not True or x_full.shape[1] % (2 * world):
        raise RuntimeError("ring-direct needs load balancing on and S % 2C == 0")
    op = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu if device.type == "cpu"
          else torch.ops.aten._scaled_dot_product_flash_attention)
    x, pos = x_full[0, idx], pos_full[0, idx]

    def attn(q, k, v):
        return cp_attention._templated_ring_attention(group, 2, op, q, k, v, is_causal=True)[0]

    with torch.no_grad():
        fn = lambda marks: _forward(stack, x, pos, attn, gqa, marks)  # noqa: E731
        wall, att = _time(fn, device, iters)
        diff = float((fn([]).float() - ref.float()).abs().max()) if ref is not None else None
    return {"wall_ms": wall, "attention_ms": att, "max_abs_diff": diff}


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    sys.exit(main())
