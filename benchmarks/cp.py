"""``torchrun --nproc_per_node C benchmarks/run.py cp``: end-to-end CP prefill of an attention stack.

For each total token count (default 32k, 128k, 256k) and batch shape (one sequence; a ragged batch
of 4 sequences with cached prefixes) it runs an N-layer GQA :class:`reference_layers.AttentionStack`
(Hq/Hkv = 32/8, D = 128, hidden 4096, bf16) at CP=1 and at CP=C for every strategy, and reports
per rank:

* ``wall_ms``: the real forward (``AttentionStack.forward``, K/V gather async, overlapped with the
  q projection), CUDA events, median over iterations, ranks started together by a barrier.
* ``wall_nocomm_ms``: the same forward with the one collective (``cpattn.collectives.all_gather_into``)
  replaced by a local copy of the same size into the same output buffer; everything else
  (packing, reorder, attention over all T keys) is unchanged.
* ``exposed_comm_ms`` = wall - wall_nocomm (per rank). The headline ``exposed_comm_ms`` of a
  config is ``max_r wall - max_r wall_nocomm``: the time the collective adds to the slowest rank,
  so load imbalance (which makes the faster rank wait inside the collective) is not counted as
  communication.
* an instrumented copy of the layer forward with the gather made synchronous and CUDA events
  between stages: ``gather_inforward_ms`` (collective + pack + reorder, including waiting for the
  other rank), ``attention_ms`` (the attention call alone), ``other_ms`` (norm, projections, RoPE,
  ``pack_kv``, MLP). Its output is checked against the real forward.
* ``gather_isolated_ms``: ``strategy.gather_kv`` alone (barrier before each call) times layers, and
  ``collective_isolated_ms``: the bare ``all_gather_into_tensor`` of the packed rows, with the
  algorithm / bus bandwidth it implies.
* load imbalance: max/mean over ranks of ``attention_ms``, and ``meta.causal_work_per_rank``.

The peer, ``torch.distributed.tensor.experimental.context_parallel`` (ring attention over SDPA),
runs the same stack on one sequence in a child process per rank (see :mod:`benchmarks._cp_peer`)
behind a stall watchdog, so a hang is reported (with the last stage reached), never fatal.

Optional: the DeepSeek-V3 MLA layer (:mod:`reference_layers.mla`, 16 heads = one TP-8 shard) at CP=1
and CP=C zigzag, wall and no-comm wall only.

GPU targets at 128k (checked in the summary of a GPU run, not in a CPU smoke run): CP=C zigzag
>= 1.9x faster than CP=1, exposed communication <= 5% of attention, attention imbalance <= 3%,
cpattn >= 1.5x faster than torch ``context_parallel``.

CPU smoke run (gloo, tiny shapes, torch backend; bench-out/cp-cpu-smoke.json)::

    torchrun --nproc_per_node 2 benchmarks/run.py cp --device cpu --small
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

import cpattn
from cpattn import collectives as _collectives
from cpattn.kv import pack_kv
from reference_layers import AttentionStack
from reference_layers.rope import apply_rope

from .common import default_out, header, progress, smoke_notice, write_json

TORCH_BACKEND_MAX_TOKENS = 16 * 1024  # the torch reference backend materializes score chunks
RAGGED_EXTEND_FRACTIONS = (0.4, 0.3, 0.2, 0.1)
RAGGED_PREFIX_FRACTIONS = (0.0, 1 / 8, 1 / 16, 0.0)


# ---------------------------------------------------------------------------------------- CLI
def _parse_tokens(text: str) -> list[int]:
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        scale = 1024 if item.endswith("k") else 1
        out.append(int(float(item.rstrip("k")) * scale))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if cuda else "cpu")
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU debugging): 256 and 1k tokens")
    parser.add_argument("--tokens", default=None, help="total extend tokens, e.g. 32k,128k,256k")
    parser.add_argument("--batches", default="single,ragged", help="single and/or ragged")
    parser.add_argument("--strategies", default="zigzag,interleave,contiguous")
    parser.add_argument("--layers", type=int, default=None, help="attention-stack layers (default 4; small: 2)")
    parser.add_argument("--hidden", type=int, default=None, help="default 4096 (small: 128)")
    parser.add_argument("--heads", type=int, default=None, help="Hq (default 32; small: 8)")
    parser.add_argument("--kv-heads", type=int, default=None, help="Hkv (default 8; small: 2)")
    parser.add_argument("--head-dim", type=int, default=None, help="D (default 128; small: 16)")
    parser.add_argument("--backend", default=None, help="attention backend (default auto; cpu: torch)")
    parser.add_argument("--iters", type=int, default=5, help="timed forwards per config below 256k")
    parser.add_argument("--long-iters", type=int, default=2, help="timed forwards per config at >= 256k")
    parser.add_argument("--no-peer", action="store_true", help="skip torch context_parallel")
    parser.add_argument("--peer-rotate", default="allgather", choices=("allgather", "alltoall"))
    parser.add_argument("--peer-stall-timeout", type=float, default=180.0,
                        help="seconds without progress before the peer child is declared hung and killed")
    parser.add_argument("--no-mla", action="store_true", help="skip the MLA layer")
    parser.add_argument("--mla-tokens", default=None, help="token counts for MLA (default 32k,128k)")
    parser.add_argument("--mla-layers", type=int, default=2)
    parser.add_argument("--time-budget", type=float, default=400.0,
                        help="seconds; cpattn/MLA configs not started by then are skipped (the long sizes run last)")
    parser.add_argument("--long-from", default="256k", help="sizes from here on run after the peer and MLA")
    parser.add_argument("--out", default=None,
                        help="JSON path (default bench-out/cp.json on GPU, bench-out/cp-cpu-smoke.json on CPU); "
                        "PNGs are written beside it")


# ---------------------------------------------------------------------------------------- helpers
class _Clock:
    """Marks on the current CUDA stream (events) or the host clock; ``ms(a, b)`` after ``sync``."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


class _DoneWork:
    def wait(self) -> bool:
        return True


@contextlib.contextmanager
def local_copy_collective():
    """Replace cpattn's single collective by a local copy of the same size (no communication).

    The output ``[C * P, row_bytes]`` is filled with C copies of this rank's rows: same bytes
    written, same buffers, so everything around the collective costs what it costs for real.
    """
    original = _collectives.all_gather_into

    def fake(output: Tensor, input: Tensor, group, async_op: bool):
        copies = output.shape[0] // max(1, input.shape[0])
        output.view(copies, *input.shape).copy_(input.unsqueeze(0).expand(copies, *input.shape))
        return _DoneWork() if async_op else None

    _collectives.all_gather_into = fake
    try:
        yield
    finally:
        _collectives.all_gather_into = original


def _barrier(device: torch.device) -> None:
    if dist.is_initialized():
        if device.type == "cuda":
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()


def _time(
    fn: Callable[[], object], clock: _Clock, device: torch.device, warmup: int, iters: int
) -> tuple[list[float], object]:
    """(per-iteration milliseconds of ``fn``, its last result); every iteration is started on all
    ranks together by a barrier."""
    result = None
    for _ in range(warmup):
        result = fn()
    clock.sync()
    times = []
    for _ in range(iters):
        _barrier(device)
        a = clock.mark()
        result = fn()
        b = clock.mark()
        clock.sync()
        times.append(clock.ms(a, b))
    return times, result


def _median(xs: list[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def batch_lengths(kind: str, tokens: int) -> tuple[list[int], list[int]]:
    """(extend_lens, prefix_lens) of a batch with ``tokens`` extend tokens in total."""
    if kind == "single":
        return [tokens], [0]
    if kind != "ragged":
        raise ValueError(f"batch must be 'single' or 'ragged', got {kind!r}")
    ext = [int(tokens * f) for f in RAGGED_EXTEND_FRACTIONS]
    ext[0] += tokens - sum(ext)
    pre = [int(tokens * f) for f in RAGGED_PREFIX_FRACTIONS]
    return ext, pre


def causal_attention_flops(extend_lens: list[int], prefix_lens: list[int], hq: int, d: int, dv: int) -> float:
    """Useful FLOPs of causal attention for a batch (QK^T and PV, masked half not counted)."""
    pairs = sum(e * p + e * (e + 1) / 2 for e, p in zip(extend_lens, prefix_lens))
    return 2.0 * pairs * hq * (d + dv)


# ---------------------------------------------------------------------------------------- forwards
def instrumented_forward(
    stack: AttentionStack,
    x: Tensor,
    positions: Tensor,
    strategy: cpattn.CPStrategy,
    meta: cpattn.CPMetadata,
    group,
    prefix_kv: Optional[list[tuple[Tensor, Tensor]]],
    backend: str,
    clock: _Clock,
) -> tuple[Tensor, dict[str, float]]:
    """The layer math of :class:`GQAAttentionLayer` with a synchronous gather and clock marks
    between stages. Returns (x [P, hidden], per-stage milliseconds summed over layers)."""
    marks = []
    with torch.no_grad():
        for i, layer in enumerate(stack.layers):
            m0 = clock.mark()
            h = layer.norm(x)
            n = x.shape[0]
            k_local, v_local = layer.kv_proj(h).view(n, 2, layer.hkv, layer.d).unbind(1)
            k_local = apply_rope(k_local, positions)
            v_local = v_local.contiguous()
            m1 = clock.mark()
            k_ext, v_ext = strategy.gather_kv(k_local, v_local, meta, group)
            m2 = clock.mark()
            q = apply_rope(layer.q_proj(h).view(n, layer.hq, layer.d), positions)
            k, v = pack_kv(k_ext, v_ext, meta, *(prefix_kv[i] if prefix_kv else (None, None)))
            m3 = clock.mark()
            o = strategy.attention(q, k, v, meta, backend=backend)
            m4 = clock.mark()
            x = x + layer.o_proj(o.reshape(n, -1))
            x = x + layer.mlp(x)
            m5 = clock.mark()
            marks.append((m0, m1, m2, m3, m4, m5))
    clock.sync()
    parts = {"pre": 0.0, "gather": 0.0, "q_and_pack": 0.0, "attention": 0.0, "post": 0.0}
    for m0, m1, m2, m3, m4, m5 in marks:
        parts["pre"] += clock.ms(m0, m1)
        parts["gather"] += clock.ms(m1, m2)
        parts["q_and_pack"] += clock.ms(m2, m3)
        parts["attention"] += clock.ms(m3, m4)
        parts["post"] += clock.ms(m4, m5)
    return x, parts


# ---------------------------------------------------------------------------------------- one config
def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_config(ctx: dict, tokens: int, batch: str, cp: int, strategy_name: str) -> dict:
    """Measure one (tokens, batch, cp, strategy) on this rank; returns this rank's numbers."""
    args, device, dtype, stack = ctx["args"], ctx["device"], ctx["dtype"], ctx["stack"]
    rank = ctx["rank"]
    group = ctx["group"] if cp > 1 else None
    clock = _Clock(device)
    ext, pre = batch_lengths(batch, tokens)
    strategy = cpattn.get_strategy(strategy_name, cp)
    meta_rank = rank if cp > 1 else 0
    meta = strategy.build_metadata(ext, pre, rank=meta_rank).to(device)
    out: dict = {
        "rank": rank,
        "local_tokens": meta.num_local_tokens,
        "physical_tokens": meta.num_physical_tokens,
        "causal_work_per_rank": list(meta.causal_work_per_rank),
        "metadata_imbalance": meta.load_imbalance,
    }
    hq, hkv, d, hidden = args.heads, args.kv_heads, args.head_dim, args.hidden

    # Which backend would run; the torch reference must never run long sequences.
    probe_q = torch.empty((meta.num_physical_tokens, hq, d), device=device, dtype=dtype)
    probe_k = torch.empty((meta.num_kv_tokens, hkv, d), device=device, dtype=dtype)
    try:
        spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype)
        backend = cpattn.plan_attention(meta, spec, backend=args.backend).backend
    except (NotImplementedError, ValueError) as exc:
        out["status"] = f"skipped: no backend ({exc})"
        return out
    finally:
        del probe_q, probe_k
    out["backend"] = backend
    if backend == "torch" and tokens > TORCH_BACKEND_MAX_TOKENS:
        out["status"] = f"skipped: backend 'torch' at {tokens} tokens (> {TORCH_BACKEND_MAX_TOKENS}; materializes scores)"
        return out

    gen = torch.Generator(device=device).manual_seed(1234 + tokens)
    x_full = torch.randn((tokens, hidden), generator=gen, device=device, dtype=dtype)
    positions_full = torch.cat([torch.arange(p, p + e) for e, p in zip(ext, pre)]).to(device)
    x = strategy.shard(x_full, meta)
    positions = strategy.shard(positions_full, meta)
    del x_full
    num_prefix = sum(pre)
    prefix_kv = None
    if num_prefix:
        prefix_kv = [
            tuple(torch.randn((num_prefix, hkv, d), generator=gen, device=device, dtype=dtype) for _ in range(2))
            for _ in range(len(stack.layers))
        ]

    iters = args.long_iters if tokens >= 256 * 1024 else args.iters
    fwd = lambda: stack(x, positions, strategy, meta, group, prefix_kv, backend)  # noqa: E731

    times, (ref, _) = _time(fwd, clock, device, warmup=1, iters=iters)
    out["wall_ms"] = _median(times)
    out["wall_ms_all"] = times
    if cp > 1:
        with local_copy_collective():
            times_nc, _ = _time(fwd, clock, device, warmup=0 if tokens >= 256 * 1024 else 1, iters=iters)
        out["wall_nocomm_ms"] = _median(times_nc)
        out["exposed_comm_ms"] = out["wall_ms"] - out["wall_nocomm_ms"]
    else:
        out["wall_nocomm_ms"] = out["wall_ms"]
        out["exposed_comm_ms"] = 0.0

    # Instrumented forward (synchronous gather, marks between stages); checked against the real one.
    _barrier(device)
    y, parts = instrumented_forward(stack, x, positions, strategy, meta, group, prefix_kv, backend, clock)
    n = meta.num_local_tokens
    scale = ref[:n].float().abs().max().clamp(min=1e-6)
    out["instrumented_max_rel_diff"] = float(((y[:n].float() - ref[:n].float()).abs().max() / scale).item())
    del ref, y
    out["breakdown_ms"] = parts
    out["attention_ms"] = parts["attention"]
    out["gather_inforward_ms"] = parts["gather"]
    out["other_ms"] = parts["pre"] + parts["q_and_pack"] + parts["post"]

    # The gather alone: strategy.gather_kv (pack + collective + reorder) and the bare collective.
    if cp > 1:
        k_s = torch.randn((meta.num_physical_tokens, hkv, d), generator=gen, device=device, dtype=dtype)
        v_s = torch.randn_like(k_s)
        g, _ = _time(lambda: strategy.gather_kv(k_s, v_s, meta, group), clock, device, warmup=2, iters=5)
        row_bytes = cpattn.gathered_bytes_per_token([k_s, v_s])
        packed = torch.empty((meta.num_physical_tokens, row_bytes), device=device, dtype=torch.uint8)
        gathered = torch.empty((cp * meta.num_physical_tokens, row_bytes), device=device, dtype=torch.uint8)
        c, _ = _time(lambda: dist.all_gather_into_tensor(gathered, packed, group=group), clock, device, warmup=2, iters=5)
        layers = len(stack.layers)
        out["gather_isolated_ms"] = _median(g) * layers
        out["collective_isolated_ms"] = _median(c) * layers
        total = gathered.numel()
        coll_s = _median(c) / 1e3
        out["collective_bytes"] = total
        out["collective_algbw_GBps"] = total / coll_s / 1e9 if coll_s > 0 else None
        out["collective_busbw_GBps"] = total * (cp - 1) / cp / coll_s / 1e9 if coll_s > 0 else None
        del k_s, v_s, packed, gathered
    else:
        out["gather_isolated_ms"] = out["collective_isolated_ms"] = 0.0
    out["attention_tflops"] = (
        causal_attention_flops(ext, pre, hq, d, d) / cp / (out["attention_ms"] / 1e3) / 1e12
        if out["attention_ms"] > 0 else None
    )
    out["status"] = "ok"
    del x, positions, prefix_kv
    _free(device)
    return out


def run_mla_config(ctx: dict, mla_stack, tokens: int, cp: int) -> dict:
    """MLA stack (zigzag), one sequence: wall and no-comm wall on this rank."""
    args, device, dtype, rank = ctx["args"], ctx["device"], ctx["dtype"], ctx["rank"]
    group = ctx["group"] if cp > 1 else None
    clock = _Clock(device)
    strategy = cpattn.get_strategy("zigzag", cp)
    meta = strategy.build_metadata([tokens], [0], rank=rank if cp > 1 else 0).to(device)
    cfg = mla_stack[0].config
    out: dict = {"rank": rank, "tokens": tokens, "cp": cp}
    q = torch.empty((meta.num_physical_tokens, cfg.num_heads, cfg.qk_head_dim), device=device, dtype=dtype)
    kv = torch.empty((meta.num_kv_tokens, cfg.num_heads, cfg.qk_head_dim), device=device, dtype=dtype)
    vv = torch.empty((meta.num_kv_tokens, cfg.num_heads, cfg.v_head_dim), device=device, dtype=dtype)
    try:
        spec = cpattn.AttentionSpec(num_q_heads=cfg.num_heads, num_kv_heads=cfg.num_heads, head_dim=cfg.qk_head_dim,
                                    head_dim_v=cfg.v_head_dim, dtype=dtype)
        backend = cpattn.plan_attention(meta, spec, backend=args.backend).backend
    except (NotImplementedError, ValueError) as exc:
        out["status"] = f"skipped: no backend ({exc})"
        return out
    finally:
        del q, kv, vv
    out["backend"] = backend
    if backend == "torch" and tokens > TORCH_BACKEND_MAX_TOKENS:
        out["status"] = f"skipped: backend 'torch' at {tokens} tokens"
        return out
    gen = torch.Generator(device=device).manual_seed(99)
    x = strategy.shard(torch.randn((tokens, cfg.hidden), generator=gen, device=device, dtype=dtype), meta)
    positions = strategy.shard(torch.arange(tokens, device=device), meta)

    def fwd():
        h = x
        for layer in mla_stack:
            o, _ = layer(h, positions, strategy, meta, group, backend=backend)
            h = h + o
        return h

    iters = args.long_iters if tokens >= 256 * 1024 else args.iters
    out["wall_ms"] = _median(_time(fwd, clock, device, warmup=1, iters=iters)[0])
    if cp > 1:
        with local_copy_collective():
            out["wall_nocomm_ms"] = _median(_time(fwd, clock, device, warmup=0, iters=iters)[0])
    else:
        out["wall_nocomm_ms"] = out["wall_ms"]
    out["exposed_comm_ms"] = out["wall_ms"] - out["wall_nocomm_ms"]
    out["latent_bytes_per_token"] = cfg.latent_dim * torch.empty((), dtype=dtype).element_size()
    out["status"] = "ok"
    del x, positions
    _free(device)
    return out


# ---------------------------------------------------------------------------------------- peer
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_peer(ctx: dict, tokens_list: list[int]) -> dict:
    """Run torch context_parallel in a child process per rank with a stall watchdog.

    Both ranks start a child (``python benchmarks/_cp_peer.py``) that forms its own process
    group on a fresh port. A child that writes no progress line for ``--peer-stall-timeout``
    seconds is killed (by its pid) and the last stage it reported is recorded.
    """
    args, rank, world, device = ctx["args"], ctx["rank"], ctx["world"], ctx["device"]
    port = [_free_port() if rank == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    out_dir = os.path.join(os.path.dirname(os.path.abspath(args.out)), ".peer")
    os.makedirs(out_dir, exist_ok=True)
    status_path = os.path.join(out_dir, f"peer-rank{rank}.jsonl")
    if os.path.exists(status_path):
        os.remove(status_path)
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port[0]), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(ctx["local_rank"]), LOCAL_WORLD_SIZE=str(world),
        TORCH_NCCL_ASYNC_ERROR_HANDLING=env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"),
        NCCL_NVLS_ENABLE=env.get("NCCL_NVLS_ENABLE", "0"),
        TORCH_SYMM_MEM_DISABLE_MULTICAST=env.get("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    )
    # torchrun's TORCHELASTIC_USE_AGENT_STORE makes rank 0 a *client* of the agent's store: the
    # child's own rendezvous on a fresh port would then wait forever for a server nobody starts.
    for key in [k for k in env if k.startswith("TORCHELASTIC_")] + ["GROUP_RANK", "ROLE_RANK", "ROLE_NAME"]:
        env.pop(key, None)
    cmd = [
        sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_cp_peer.py"),
        "--device", device.type, "--status", status_path,
        "--tokens", ",".join(str(t) for t in tokens_list),
        "--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
        "--kv-heads", str(args.kv_heads), "--head-dim", str(args.head_dim),
        "--iters", str(args.iters), "--long-iters", str(args.long_iters), "--rotate", args.peer_rotate,
        "--pg-timeout", str(int(args.peer_stall_timeout)),
    ]
    _free(device)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=None)
    last_change, last_size, hung = time.monotonic(), -1, False
    while proc.poll() is None:
        time.sleep(1.0)
        size = os.path.getsize(status_path) if os.path.exists(status_path) else 0
        if size != last_size:
            last_size, last_change = size, time.monotonic()
        elif time.monotonic() - last_change > args.peer_stall_timeout:
            hung = True
            proc.kill()  # our own child, by its handle
            proc.wait()
            break
    lines = []
    if os.path.exists(status_path):
        with open(status_path) as f:
            for line in f:
                with contextlib.suppress(json.JSONDecodeError):
                    lines.append(json.loads(line))
    stages = [ln["stage"] for ln in lines if "stage" in ln]
    results = [ln["result"] for ln in lines if "result" in ln]
    errors = [ln["error"] for ln in lines if "error" in ln]
    return {
        "rank": rank,
        "returncode": proc.returncode,
        "hung": hung,
        "last_stage": stages[-1] if stages else None,
        "stages": stages,
        "results": results,
        "errors": errors,
        "seconds": time.monotonic() - t0,
    }


# ---------------------------------------------------------------------------------------- assembly
def _merge(per_rank: list[dict], base: dict) -> dict:
    rec = dict(base)
    rec["per_rank"] = per_rank
    ok = [r for r in per_rank if r.get("status") == "ok"]
    if len(ok) != len(per_rank):
        rec["status"] = next((r.get("status") for r in per_rank if r.get("status") != "ok"), "failed")
        return rec
    rec["status"] = "ok"
    rec["backend"] = per_rank[0]["backend"]
    rec["causal_work_per_rank"] = per_rank[0]["causal_work_per_rank"]
    rec["metadata_imbalance"] = per_rank[0]["metadata_imbalance"]
    if base["cp"] == 1:
        ranks = per_rank[:1]  # every rank ran the whole CP=1 problem; report rank 0
    else:
        ranks = per_rank
    rec["wall_ms"] = max(r["wall_ms"] for r in ranks)
    rec["wall_nocomm_ms"] = max(r["wall_nocomm_ms"] for r in ranks)
    rec["exposed_comm_ms"] = rec["wall_ms"] - rec["wall_nocomm_ms"]
    att = [r["attention_ms"] for r in ranks]
    rec["attention_ms"] = max(att)
    rec["attention_imbalance"] = max(att) / (sum(att) / len(att)) if sum(att) > 0 else 1.0
    rec["other_ms"] = max(r["other_ms"] for r in ranks)
    rec["gather_inforward_ms"] = max(r["gather_inforward_ms"] for r in ranks)
    rec["gather_isolated_ms"] = max(r["gather_isolated_ms"] for r in ranks)
    rec["collective_isolated_ms"] = max(r["collective_isolated_ms"] for r in ranks)
    rec["exposed_comm_pct_of_attention"] = 100.0 * rec["exposed_comm_ms"] / rec["attention_ms"] if rec["attention_ms"] else None
    return rec


def _tok(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def _find(records: list[dict], **kw) -> Optional[dict]:
    for r in records:
        if all(r.get(k) == v for k, v in kw.items()) and r.get("status") == "ok":
            return r
    return None


def summarize(payload: dict, key_tokens: int) -> list[dict]:
    """Rows of the target table (value, target, verdict)."""
    recs, world = payload["configs"], payload["world_size"]
    rows = []

    def row(name, value, target, ok, note=""):
        rows.append({"metric": name, "value": value, "target": target,
                     "verdict": "n/a" if value is None else ("PASS" if ok(value) else "MISS"), "note": note})

    tk = _tok(key_tokens)
    for batch in ("single", "ragged"):
        base = _find(recs, tokens=key_tokens, batch=batch, cp=1)
        zz = _find(recs, tokens=key_tokens, batch=batch, cp=world, strategy="zigzag")
        sp = base["wall_ms"] / zz["wall_ms"] if base and zz else None
        row(f"speedup CP={world} zigzag vs CP=1, {tk} {batch}", sp, ">= 1.9x", lambda v: v >= 1.9)
        ex = zz["exposed_comm_pct_of_attention"] if zz else None
        row(f"exposed comm / attention, zigzag {tk} {batch} (%)", ex, "<= 5%", lambda v: v <= 5.0)
        imb = 100.0 * (zz["attention_imbalance"] - 1.0) if zz else None
        row(f"attention imbalance max/mean-1, zigzag {tk} {batch} (%)", imb, "<= 3%", lambda v: v <= 3.0,
            f"metadata {100 * (zz['metadata_imbalance'] - 1):.2f}%" if zz else "")
    peer = payload.get("peer") or {}
    pres = {r["tokens"]: r for r in peer.get("results", [])}
    zz = _find(recs, tokens=key_tokens, batch="single", cp=world, strategy="zigzag")
    p = pres.get(key_tokens)
    ratio = p["wall_ms"] / zz["wall_ms"] if p and zz and p.get("wall_ms") else None
    note = f"peer {peer.get('status', 'not run')}"
    if p:
        note += f", mode={p.get('mode')}, {p.get('gqa')}"
    if peer.get("note"):
        note += f"; {peer['note']}"
    row(f"cpattn CP={world} zigzag vs torch context_parallel, {tk} single", ratio, ">= 1.5x",
        lambda v: v >= 1.5, note[:300])
    return rows


def format_summary(rows: list[dict]) -> str:
    lines = [f"{'metric':<58} {'value':>9} {'target':>9}  verdict"]
    for r in rows:
        v = "-" if r["value"] is None else f"{r['value']:.3g}"
        lines.append(f"{r['metric']:<58} {v:>9} {r['target']:>9}  {r['verdict']}" + (f"  ({r['note']})" if r["note"] else ""))
    return "\n".join(lines)


def format_table(payload: dict) -> str:
    lines = [f"{'tokens':>7} {'batch':<7} {'cp':>2} {'strategy':<10} {'backend':<7} {'wall':>9} {'nocomm':>9} "
             f"{'exposed':>8} {'attn':>9} {'other':>8} {'gath(iso)':>9} {'imb':>6} {'speedup':>7}"]
    for r in payload["configs"]:
        head = f"{r['tokens']:>7} {r['batch']:<7} {r['cp']:>2} {r['strategy']:<10} "
        if r["status"] != "ok":
            lines.append(head + r["status"])
            continue
        sp = r.get("speedup_vs_cp1")
        lines.append(
            head + f"{r['backend']:<7} {r['wall_ms']:9.2f} {r['wall_nocomm_ms']:9.2f} {r['exposed_comm_ms']:8.2f} "
            f"{r['attention_ms']:9.2f} {r['other_ms']:8.2f} {r['gather_isolated_ms']:9.3f} "
            f"{r['attention_imbalance']:6.3f} {'' if sp is None else f'{sp:7.2f}'}"
        )
    return "\n".join(lines)


def plot(payload: dict, png_prefix: str, targets: bool = True) -> list[str]:
    """Stacked time breakdown per config, and speedup vs CP=1. Returns the written paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("matplotlib missing: no plots")
        return []
    recs = [r for r in payload["configs"] if r["status"] == "ok"]
    if not recs:
        return []
    written = []
    groups = sorted({(r["tokens"], r["batch"]) for r in recs})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 4.2), squeeze=False)
    for ax, (tok, batch) in zip(axes[0], groups):
        rs = [r for r in recs if r["tokens"] == tok and r["batch"] == batch]
        labels = [f"CP{r['cp']}\n{r['strategy'] if r['cp'] > 1 else ''}" for r in rs]
        att = [r["attention_ms"] for r in rs]
        oth = [r["other_ms"] for r in rs]
        exp = [max(0.0, r["exposed_comm_ms"]) for r in rs]
        xs = range(len(rs))
        ax.bar(xs, att, label="attention (max rank)")
        ax.bar(xs, oth, bottom=att, label="other (proj, MLP)")
        ax.bar(xs, exp, bottom=[a + o for a, o in zip(att, oth)], label="exposed comm")
        ax.scatter(xs, [r["wall_ms"] for r in rs], marker="_", s=300, color="k", zorder=3, label="wall (max rank)")
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_title(f"{_tok(tok)} tokens, {batch}", fontsize=9)
        ax.set_ylabel("ms per forward")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"cpattn CP prefill, {payload['layers']}-layer GQA stack — {payload['machine']}", fontsize=9)
    fig.tight_layout()
    path = f"{png_prefix}-breakdown.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(6, 4))
    for strat in sorted({r["strategy"] for r in recs if r["cp"] > 1}):
        for batch, style in (("single", "-o"), ("ragged", "--s")):
            pts = sorted((r["tokens"], r["speedup_vs_cp1"]) for r in recs
                         if r["cp"] > 1 and r["strategy"] == strat and r["batch"] == batch and r.get("speedup_vs_cp1"))
            if pts:
                ax.plot([p[0] / 1024 for p in pts], [p[1] for p in pts], style, label=f"{strat} {batch}")
    peer = payload.get("peer") or {}
    pts = []
    for pr in peer.get("results", []):
        base = _find(recs, tokens=pr["tokens"], batch="single", cp=1)
        if base and pr.get("wall_ms"):
            pts.append((pr["tokens"] / 1024, base["wall_ms"] / pr["wall_ms"]))
    if pts:
        ax.plot([p[0] for p in sorted(pts)], [p[1] for p in sorted(pts)], ":^k", label="torch context_parallel")
    ax.axhline(payload["world_size"], color="gray", lw=0.8)
    if targets:
        ax.axhline(1.9, color="red", lw=0.8, ls="--", label="target 1.9x")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("total tokens (k)")
    ax.set_ylabel(f"speedup vs CP=1 (CP={payload['world_size']})")
    ax.legend(fontsize=7)
    ax.set_title(payload["machine"], fontsize=8)
    fig.tight_layout()
    path = f"{png_prefix}-speedup.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


# ---------------------------------------------------------------------------------------- main
def _defaults(args: argparse.Namespace) -> None:
    small = args.small
    args.layers = args.layers or (2 if small else 4)
    args.hidden = args.hidden or (128 if small else 4096)
    args.heads = args.heads or (8 if small else 32)
    args.kv_heads = args.kv_heads or (2 if small else 8)
    args.head_dim = args.head_dim or (16 if small else 128)
    args.tokens = _parse_tokens(args.tokens or ("256,1024" if small else "32k,128k,256k"))
    args.mla_tokens = _parse_tokens(args.mla_tokens or ("256" if small else "32k,128k"))
    args.long_from = _parse_tokens(str(args.long_from))[0]
    args.backend = args.backend or ("torch" if args.device == "cpu" else "auto")
    if args.out is None:
        args.out = default_out("cp.json", smoke=args.device != "cuda")


def _build_mla(args, device, dtype):
    try:
        from reference_layers import mla as mla_mod
    except Exception as exc:  # noqa: BLE001 - optional layer, any import problem means "skip"
        return None, f"reference_layers.mla not importable: {type(exc).__name__}: {exc}"
    try:
        if args.small:
            cfg = mla_mod.MLAConfig()
        else:
            v3 = mla_mod.MLAConfig.deepseek_v3()
            import dataclasses

            cfg = dataclasses.replace(v3, num_heads=16)  # one TP-8 shard of DeepSeek-V3's 128 heads
        layers = [mla_mod.MLAAttention(cfg, seed=i, device=device, dtype=dtype) for i in range(args.mla_layers)]
        return layers, None
    except Exception as exc:  # noqa: BLE001
        return None, f"MLA layer API not as expected: {type(exc).__name__}: {exc}"


def run_cpattn(ctx: dict, plan: list, payload: dict, over_budget: Callable[[], bool], log) -> None:
    """Run ``plan`` [(tokens, batch, cp, strategy)] on every rank; append merged records."""
    args, rank, world, group, device = ctx["args"], ctx["rank"], ctx["world"], ctx["group"], ctx["device"]
    for tokens, batch, cp, strat in plan:
        ext, pre = batch_lengths(batch, tokens)
        base = {"tokens": tokens, "batch": batch, "cp": cp, "strategy": strat if cp > 1 else "none",
                "extend_lens": ext, "prefix_lens": pre}
        if over_budget():
            payload["configs"].append({**base, "status": f"skipped: time budget {args.time_budget:.0f}s spent"})
            log(f"skip {tokens} {batch} cp={cp} {strat}: time budget")
            continue
        log(f"run {tokens} tokens {batch} cp={cp} {base['strategy']} ...")
        try:
            mine = run_config(ctx, tokens, batch, cp, strat)
        except torch.cuda.OutOfMemoryError as exc:  # symmetric shapes: every rank fails alike
            mine = {"rank": rank, "status": f"skipped: out of memory ({str(exc).splitlines()[0]})"}
            _free(device)
        per_rank = [None] * world
        dist.all_gather_object(per_rank, mine, group=group)
        rec = _merge(per_rank, base)
        payload["configs"].append(rec)
        if rec["status"] == "ok":
            log(f"  backend={rec['backend']} wall={rec['wall_ms']:.2f} ms nocomm={rec['wall_nocomm_ms']:.2f} "
                f"attn={rec['attention_ms']:.2f} exposed={rec['exposed_comm_ms']:.2f} imb={rec['attention_imbalance']:.3f}")
        else:
            log(f"  {rec['status']}")


def run_mla(ctx: dict, over_budget: Callable[[], bool], log) -> dict:
    """MLA stack at CP=1 and CP=C zigzag (skipped with the reason if the layer is unavailable)."""
    args, device, dtype, rank, world, group = (ctx[k] for k in ("args", "device", "dtype", "rank", "world", "group"))
    layers, why = _build_mla(args, device, dtype)
    if layers is None:
        log(f"mla: {why}")
        return {"status": f"skipped: {why}"}
    recs = []
    for tokens in args.mla_tokens:
        for cp in ([1, world] if world > 1 else [1]):
            if over_budget():
                recs.append({"tokens": tokens, "cp": cp, "status": "skipped: time budget"})
                continue
            log(f"mla {tokens} tokens cp={cp} ...")
            try:
                mine = run_mla_config(ctx, layers, tokens, cp)
            except Exception as exc:  # noqa: BLE001 - the layer is new; report, don't die
                mine = {"rank": rank, "status": f"failed: {type(exc).__name__}: {exc}"[:300]}
                _free(device)
            per_rank = [None] * world
            dist.all_gather_object(per_rank, mine, group=group)
            rec = {"tokens": tokens, "cp": cp, "strategy": "zigzag", "per_rank": per_rank}
            if all(r.get("status") == "ok" for r in per_rank):
                rk = per_rank[:1] if cp == 1 else per_rank
                rec.update(status="ok", backend=per_rank[0]["backend"],
                           wall_ms=max(r["wall_ms"] for r in rk), wall_nocomm_ms=max(r["wall_nocomm_ms"] for r in rk))
                rec["exposed_comm_ms"] = rec["wall_ms"] - rec["wall_nocomm_ms"]
                log(f"  backend={rec['backend']} wall={rec['wall_ms']:.2f} ms exposed={rec['exposed_comm_ms']:.2f}")
            else:
                rec["status"] = next(r["status"] for r in per_rank if r.get("status") != "ok")
                log(f"  {rec['status']}")
            recs.append(rec)
    for rec in recs:
        base = next((r for r in recs if r["tokens"] == rec["tokens"] and r["cp"] == 1 and r["status"] == "ok"), None)
        if rec["status"] == "ok" and rec["cp"] > 1 and base:
            rec["speedup_vs_cp1"] = base["wall_ms"] / rec["wall_ms"]
    del layers
    _free(device)
    note = "MLAConfig() defaults" if args.small else "DeepSeek-V3 dims, 16 heads (one TP-8 shard)"
    return {"status": "ok", "config": {"layers": args.mla_layers, "note": note}, "results": recs}


def main(args: argparse.Namespace) -> int:
    _defaults(args)
    t_start = time.monotonic()
    if "RANK" not in os.environ:
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda but no CUDA device; use --device cpu --small")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(local_rank)  # before any CUDA tensor or communicator
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
        dtype = torch.bfloat16
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        dtype = torch.float32
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))  # the CP group (here: every rank)
    log = progress if rank == 0 else (lambda m: None)
    log(f"cp bench: world={world} device={device.type} dtype={dtype} layers={args.layers} hidden={args.hidden} "
        f"Hq/Hkv={args.heads}/{args.kv_heads} D={args.head_dim} tokens={args.tokens} backend={args.backend}")

    stack = AttentionStack(args.layers, args.hidden, args.heads, args.kv_heads, args.head_dim, seed=0).to(device, dtype)
    ctx = {"args": args, "device": device, "dtype": dtype, "stack": stack, "group": group,
           "rank": rank, "world": world, "local_rank": local_rank}
    smoke = device.type == "cpu"
    if smoke and rank == 0:
        smoke_notice("cp")
    payload = header("benchmarks/run.py cp", smoke=smoke)
    payload.update(
        world_size=world, layers=args.layers, hidden=args.hidden, num_q_heads=args.heads,
        num_kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=str(dtype), requested_backend=args.backend,
        torch_version=torch.__version__, available_backends=cpattn.available_backends(),
        method={
            "wall": "AttentionStack.forward (async gather overlapped with q proj), CUDA events, median; barrier before each",
            "exposed_comm": "max_r wall - max_r wall_nocomm; nocomm = collective replaced by a local copy of the same size",
            "breakdown": "instrumented copy of the layer forward, synchronous gather, CUDA events between stages",
            "gather_isolated": "strategy.gather_kv alone x layers; collective_isolated: bare all_gather_into_tensor x layers",
            "attention_imbalance": "max/mean over ranks of attention_ms (CP=C)",
        },
        configs=[],
    )
    strategies = [s for s in args.strategies.split(",") if s]
    batches = [b for b in args.batches.split(",") if b]
    long_at = args.long_from

    def plan(tokens_list: list[int]) -> list[tuple[int, str, int, str]]:
        out = []
        for tokens in tokens_list:
            for batch in batches:
                out.append((tokens, batch, 1, "zigzag"))
                if world > 1:
                    out += [(tokens, batch, world, s) for s in strategies]
        return out

    def over_budget() -> bool:
        flag = [time.monotonic() - t_start > args.time_budget if rank == 0 else False]
        dist.broadcast_object_list(flag, src=0)  # every rank takes the same decision
        return bool(flag[0])

    # Order: the sizes below --long-from (the targets live there), the peer, MLA, then the long
    # sizes, so a spent time budget drops the long sizes first.
    run_cpattn(ctx, plan([t for t in args.tokens if t < long_at]), payload, over_budget, log)
    if world > 1 and not args.no_peer:
        peer_tokens = [t for t in args.tokens if t % (2 * world) == 0]
        log(f"peer: torch context_parallel (rotate={args.peer_rotate}) at {peer_tokens} in child processes ...")
        _free(device)
        mine = run_peer(ctx, peer_tokens)
        per_rank = [None] * world
        dist.all_gather_object(per_rank, mine, group=group)
        payload["peer"] = _merge_peer(per_rank)
        log(f"peer: {payload['peer']['status']} {payload['peer'].get('note', '')}")
    if not args.no_mla:
        payload["mla"] = run_mla(ctx, over_budget, log)
    run_cpattn(ctx, plan([t for t in args.tokens if t >= long_at]), payload, over_budget, log)
    for rec in payload["configs"]:
        if rec["status"] == "ok" and rec["cp"] > 1:
            base = _find(payload["configs"], tokens=rec["tokens"], batch=rec["batch"], cp=1)
            rec["speedup_vs_cp1"] = base["wall_ms"] / rec["wall_ms"] if base else None

    if rank == 0:
        if not smoke:  # the targets are for GPUs; a CPU smoke run checks none
            payload["summary"] = summarize(payload, 128 * 1024 if not args.small else max(args.tokens))
        payload["elapsed_s"] = time.monotonic() - t_start
        write_json(args.out, payload)
        pngs = plot(payload, os.path.splitext(args.out)[0], targets=not smoke)
        for p in pngs:
            progress(f"wrote {p}")
        md = os.path.splitext(args.out)[0] + ".md"
        with open(md, "w") as f:
            title = "cp benchmark, CPU smoke run" if smoke else "cp benchmark"
            f.write(f"# {title} — {payload['machine']}, {payload['date']}\n\n```\n{format_table(payload)}\n```\n")
            if not smoke:
                f.write(f"\nTargets:\n\n```\n{format_summary(payload['summary'])}\n```\n")
        progress(f"wrote {md}")
        print(format_table(payload))
        if not smoke:
            print()
            print(format_summary(payload["summary"]))
        print(f"\nelapsed {payload['elapsed_s']:.0f} s")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _merge_peer(per_rank: list[dict]) -> dict:
    rec: dict = {"per_rank": per_rank}
    if any(r["hung"] for r in per_rank):
        stages = {r["rank"]: r["last_stage"] for r in per_rank}
        rec["status"] = "hung"
        rec["note"] = f"no progress for the stall timeout; last stage per rank: {stages}"
    elif any(r["returncode"] != 0 for r in per_rank):
        rec["status"] = "failed"
        rec["note"] = "; ".join(sorted({e for r in per_rank for e in r["errors"]}))[:500] or \
            f"exit codes {[r['returncode'] for r in per_rank]}"
    else:
        rec["status"] = "ok"
        notes = {e for r in per_rank for e in r["errors"]}
        rec["note"] = "; ".join(sorted(notes))[:500]
    # per-token results: wall = max over ranks
    by_tokens: dict[int, list[dict]] = {}
    for r in per_rank:
        for res in r["results"]:
            by_tokens.setdefault(res["tokens"], []).append(res)
    results = []
    for tokens, rs in sorted(by_tokens.items()):
        row = {"tokens": tokens, "mode": rs[0].get("mode"), "gqa": rs[0].get("gqa")}
        for key in ("wall_ms", "attention_ms"):
            vals = [x[key] for x in rs if x.get(key) is not None]
            row[key] = max(vals) if len(vals) == len(per_rank) else None
        row["max_abs_diff_vs_reference"] = max((x.get("max_abs_diff") or 0.0) for x in rs) \
            if any(x.get("max_abs_diff") is not None for x in rs) else None
        results.append(row)
    rec["results"] = results
    return rec
