"""``python benchmarks/run.py decode``: decode over a sharded KV cache, and the pass-KV / pass-Q crossover.

Decode (one GPU): what ONE rank of a C-rank sharded cache does per layer: split-KV attention of
the step's queries (q_len 1 or 4 per sequence, replicated) over its 1/C shard of every sequence
(paged, page 64, pages scattered), plus the arithmetic of the exact merge of C partials
(``merge_states`` over typed views into one packed byte buffer, as ``merge_partials`` reads
what it received: the fused Triton merge on the GPU, ``merge_path`` in each row; the collective
itself is measured by ``--distributed``). Grid: C = 1, 2, 4,
8; B = 1, 8, 64; L = 128k and 1M keys; GQA 32/8 D128 and MLA absorbed (128 heads, D 576 /
Dv 512, v a view of k); bf16. Per config: attention and merge time (median, back to back; and
``step_ms``: the attention then the merge issued together, as a model's layer issues them, so
the merge's host work overlaps the attention kernel as it does in an eager step), HBM
GB/s of the attention (KV bytes read / time; MLA reads each latent row once), KV bytes per rank
vs 1/C of replicated + one page per sequence. Configs whose shard exceeds ``--budget-gb`` are
skipped (listed).

Crossover (``--crossover``, on by default): an extend of T new tokens over a sharded prefix of
Np keys at C ranks. On one GPU the compute of each algorithm is measured (pass-KV: the dense
kernel for one rank's local queries over prefix + extend; pass-Q: the shard kernel for all T
queries over one rank's 1/C of the keys, plus the merge of C partials) and the collectives are
charged at ``--link-gbps`` with the cost model's byte counts; the smallest Np where pass-Q wins
is compared with :class:`cpattn.CostModel`'s prediction, and the model constants that the
measured kernel times imply are printed. ``--distributed`` (``torchrun --nproc_per_node C``)
runs both parts with real collectives (:mod:`._decode_distributed`).

GPU targets (checked in the summary of a GPU run): q_len-1 GQA attention >= 3.5 TB/s, per-rank
time at C = 8 <= 0.15x of C = 1 at L = 1M, KV bytes per rank <= 1/C of replicated + one page per
sequence, measured crossover within 25% of the model's.

FP8 caches (``--kv-dtype fp8``, or ``both`` for bf16 and FP8 side by side in one run): the same
grid over float8_e4m3fn caches with float32 per-KV-head scales (``AttentionSpec(kv_dtype=)``);
rows carry ``kv_dtype``. On the GPU each run also measures the device-copy bandwidth (a large
device-to-device copy, read + write bytes / time) and reports every row's attention bandwidth as
a fraction of it (``copy_fraction``), and, with both cache dtypes, each FP8 row's token-rate gain
over the bf16 row of the same config (``speedup_vs_bf16``).

    python benchmarks/run.py decode --shapes gqa --q-lens 1 --keys 32k,128k --batches 8,64 --kv-dtype both

``--kv-dtype fp8_tile`` (``tile_both``: with the bf16 latent side by side) times absorbed MLA
decode (``--shapes mla``) over the tile-scaled FP8 latent cache (656-byte rows of 512 e4m3 values,
4 float32 tile scales and the 64 bf16 rope values; ``AttentionSpec(kv_layout="fp8_tile")``);
bandwidth counts the 656 bytes per key::

    python benchmarks/run.py decode --shapes mla --q-lens 1 --keys 4k,32k --batches 8,64 --kv-dtype tile_both

CPU smoke run (tiny shapes, torch reference or the Triton interpreter; no targets checked;
bench-out/decode-cpu-smoke.*)::

    python benchmarks/run.py decode --tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import time
from typing import Callable, Optional

import torch

import cpattn
from cpattn.merge import merge_path

from .common import default_out, header, progress, smoke_notice, time_cuda_back_to_back, time_cuda_graph, write_json

#: ``--kv-dtype fp8_tile``'s cache: the tile-scaled FP8 MLA latent (:data:`cpattn.quant.FP8_TILE`).
TILE = "fp8_tile"
#: (num_q_heads, num_kv_heads, head_dim, head_dim_v, v is a view of k)
SHAPES = {"gqa": (32, 8, 128, 128, False), "mla": (128, 1, 576, 512, True)}
#: Calls captured back to back in one CUDA graph for the "layers" timing (per call): an engine's
#: decode step graph holds every layer's attention and merge, so no call pays a graph launch.
GRAPH_LAYERS = 10
TINY_SHAPES = {"gqa": (4, 2, 16, 16, False), "mla": (8, 1, 48, 32, True)}


def _ints(text: str) -> list[int]:
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if item:
            scale = 1 << 20 if item.endswith("m") else 1024 if item.endswith("k") else 1
            out.append(int(float(item.rstrip("km")) * scale))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cps", default="1,2,4,8", help="CP sizes C (one rank's 1/C shard is measured)")
    p.add_argument("--batches", default="1,8,64", help="sequences per step B")
    p.add_argument("--keys", default="128k,1m", help="keys per sequence L")
    p.add_argument("--shapes", default="gqa,mla", help="comma list of " + ",".join(SHAPES))
    p.add_argument("--q-lens", default="1,4", help="query tokens per sequence")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--budget-gb", type=float, default=96.0, help="skip configs whose shard exceeds this")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--backend", default="auto", help="shard backend (auto, triton, torch)")
    p.add_argument("--config", default=None, help="BLOCK_N,warps,stages of the split kernel (skip the default)")
    p.add_argument("--block-m", type=int, default=None, help="split kernel: most query rows x heads per program")
    p.add_argument("--programs-per-sm", type=int, default=None,
                   help="split target of the shard backend, programs per SM (default: the family's)")
    p.add_argument("--no-pdl", action="store_true",
                   help="triton shard backend: ordinary launches (backend_options pdl=False), for an A/B of "
                        "the combine's programmatic dependent launch")
    p.add_argument("--sweep", action="store_true",
                   help="also time a grid of split-kernel configs on a few workloads (tuning aid)")
    p.add_argument("--no-crossover", action="store_true", help="skip the pass-KV / pass-Q crossover")
    p.add_argument("--crossover-cp", type=int, default=4)
    p.add_argument("--crossover-tokens", type=int, default=1024, help="new tokens T of the extend")
    p.add_argument("--crossover-prefixes", default="0,4k,16k,64k,256k,1m")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="per-rank link bandwidth (GB/s) charged for the collectives (default: the cost model's)")
    p.add_argument("--distributed", action="store_true", help="under torchrun: real collectives (C = world size)")
    p.add_argument("--kv-dtype", default="model", choices=tuple(KV_DTYPE_RUNS),
                   help="cache dtype: the model's (bf16 on the GPU), fp8 (e4m3, per-head scales), both side by side, "
                        "fp8_tile (the tile-scaled FP8 MLA latent, 656-byte rows; mla shape only) or tile_both "
                        "(the model's and fp8_tile side by side)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes for a CPU smoke run")
    p.add_argument("--out", default=None,
                   help="output path without extension (default bench-out/decode, with --tiny bench-out/decode-cpu-smoke)")


# ----------------------------------------------------------------------------- timing / data
def timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    """Median ms of ``fn``: CUDA events back to back on the GPU (``iters`` calls, fewer when one
    call is long: about 100 ms per repeat), the host clock on the CPU."""
    if device.type == "cuda":
        def cuda(fn, iters):
            fn()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            n = max(2, min(iters, int(100.0 / max(a.elapsed_time(b), 1e-3))))
            return time_cuda_back_to_back(fn, warmup=1, iters=n)

        return cuda

    def host(fn, iters):
        fn()
        times = []
        for _ in range(max(1, min(iters, 3))):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return host


class Pool:
    """One reusable random K (and V) buffer, viewed as a paged cache for each config (an FP8
    ``dtype``: e4m3 values of N(0, 1) samples)."""

    def __init__(self, device, dtype):
        self.device, self.dtype, self.buf, self.key = device, dtype, None, None

    def paged(self, num_pages: int, ps: int, hkv: int, d: int, dv: int, v_from_k: bool):
        row = hkv * (d + (0 if v_from_k else dv))
        need = num_pages * ps * row
        if self.buf is None or self.buf.numel() < need:
            self.buf = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.buf = torch.empty(need, dtype=self.dtype, device=self.device)
            g = torch.Generator(device=self.device).manual_seed(0)
            for chunk in self.buf.split(1 << 28):
                if self.dtype.itemsize == 1:  # FP8: quantized samples (no normal_ for fp8)
                    chunk.copy_(torch.randn(chunk.shape, device=self.device, generator=g))
                else:
                    chunk.normal_(generator=g)
        flat = self.buf[:need].view(num_pages, ps, row)
        k = flat[..., : hkv * d].view(num_pages, ps, hkv, d)
        v = k[..., :dv] if v_from_k else flat[..., hkv * d :].view(num_pages, ps, hkv, dv)
        return k, v

    def tiled(self, num_pages: int, ps: int, r: int, d_rope: int) -> torch.Tensor:
        """A tile-scaled FP8 latent cache [num_pages, ps, 1, row] (uint8, ``self.dtype``) holding
        the quantization of N(0, 1) latent and rope samples."""
        from cpattn.quant import mla_fp8_tile_bytes, quantize_mla_fp8_tiles

        row = mla_fp8_tile_bytes(r, d_rope)
        need = num_pages * ps * row
        if self.buf is None or self.buf.numel() < need or self.key != ("tiled", r, d_rope):
            self.buf = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.buf = torch.empty(need, dtype=torch.uint8, device=self.device)
            self.key = ("tiled", r, d_rope)
            g = torch.Generator(device=self.device).manual_seed(0)
            rows = self.buf.view(-1, row)
            for chunk in rows.split(1 << 18):
                n = chunk.shape[0]
                chunk.copy_(quantize_mla_fp8_tiles(torch.randn(n, r, device=self.device, generator=g),
                                                   torch.randn(n, d_rope, device=self.device, generator=g)))
        return self.buf[:need].view(num_pages, ps, 1, row)


def random_page_table(local_lens: list[int], ps: int, seed: int, device) -> tuple[int, torch.Tensor]:
    """(pages in all, page table [B, most pages] int32 on ``device``): sequence ``i`` owns
    ``ceil(local_lens[i] / ps)`` pages of a pool, taken from a random permutation of it (a
    scattered cache, as after many allocations)."""
    pages = [-(-n // ps) for n in local_lens]
    perm = torch.randperm(sum(pages), generator=torch.Generator().manual_seed(seed))
    table = torch.zeros(len(pages), max(pages, default=0), dtype=torch.int32)
    off = 0
    for i, n in enumerate(pages):
        table[i, :n] = perm[off : off + n].int()
        off += n
    return sum(pages), table.to(device)


def kv_row_bytes(hkv: int, d: int, dv: int, v_from_k: bool, item: int, tiled: bool = False) -> int:
    """Cache bytes per token (``tiled``: the tile-scaled FP8 latent row, 656 for 576 / 512)."""
    if tiled:
        from cpattn.quant import mla_fp8_tile_bytes

        return mla_fp8_tile_bytes(dv, d - dv)
    return hkv * (d + (0 if v_from_k else dv)) * item


def received_parts(out: torch.Tensor, lse: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """C copies of one rank's (out [N, H, Dv], lse [N, H]) laid out as ``merge_partials`` receives
    them: typed strided views [C, N, H, Dv] / [C, N, H] into one packed uint8 buffer (what the
    merge arithmetic reads after the all-gather)."""
    n = out.shape[0]
    packed, layout = cpattn.collectives.pack_rows([out, lse.float()], n)
    received = packed.unsqueeze(0).expand(c, *packed.shape).contiguous()
    outs, lses = cpattn.collectives.unpack_rows(received, layout, [(out.dtype, tuple(out.shape[1:])), (torch.float32,
                                                                                       tuple(lse.shape[1:]))])
    return outs, lses


# ----------------------------------------------------------------------------- decode grid
def decode_case(pool: Pool, time_fn, *, name: str, shape, c: int, b: int, keys: int, q_len: int, ps: int, backend: str,
                options: Optional[dict], iters: int, rank: int = 0, dtype: Optional[torch.dtype] = None,
                tiled: bool = False) -> dict:
    """One config; ``pool.dtype`` is the cache dtype, ``dtype`` the query dtype (default the same;
    an FP8 pool needs bf16 / fp16 / fp32 queries). ``tiled``: the tile-scaled FP8 latent cache
    (absorbed MLA shapes; ``pool.dtype`` uint8)."""
    hq, hkv, d, dv, v_from_k = shape
    dev, kv_dtype = pool.device, pool.dtype
    dtype = dtype or kv_dtype
    sh = cpattn.KVSharding(c)
    dmeta = cpattn.get_strategy("replicated", c).build_metadata([q_len] * b, [keys - q_len] * b, rank=rank,
                                                               kv=sh).to(dev)
    local = (dmeta.host or dmeta).local_kv_lens.tolist()
    num_pages, table = random_page_table(local, ps, b * 1000 + c, dev)
    if tiled:  # k and v: the same uint8 rows
        kc = vc = pool.tiled(num_pages, ps, dv, d - dv)
    else:
        kc, vc = pool.paged(num_pages, ps, hkv, d, dv, v_from_k)
    q = torch.randn(b * q_len, hq, d, device=dev, dtype=dtype)
    spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv, dtype=dtype,
                                page_size=ps, kv_dtype=torch.float8_e4m3fn if tiled else kv_dtype,
                                kv_layout=TILE if tiled else None)
    scales = {}
    if spec.kv_quantized and not tiled:  # per-KV-head scales, device tensors as an engine holds them
        g = torch.Generator().manual_seed(1)
        scales = {name_: (0.5 + torch.rand(hkv, generator=g)).to(dev) for name_ in ("k_scale", "v_scale")}
    plan = cpattn.plan_attention(dmeta, spec, backend=backend, backend_options=options)
    out, lse = plan.attend(q, kc, vc, page_table=table, **scales)
    outs, lses = received_parts(out, lse, c)

    def attn():
        return plan.attend(q, kc, vc, page_table=table, out=out, lse=lse, **scales)

    def merge():
        return cpattn.merge_states(outs, lses)

    def step():  # one layer's rank work as a model issues it: the attention, then the merge
        attn()
        merge()

    attn_ms = time_fn(attn, iters)
    merge_ms = time_fn(merge, iters) if c > 1 else 0.0
    step_ms = time_fn(step, iters) if c > 1 else attn_ms
    attn_graph_ms = merge_graph_ms = attn_layers_ms = merge_layers_ms = None
    if dev.type == "cuda":  # the same calls replayed from a CUDA graph: GPU time only (no host work)
        try:
            attn_graph_ms = time_cuda_graph(attn, iters=iters)
            merge_graph_ms = time_cuda_graph(merge, iters=iters) if c > 1 else 0.0
            # GRAPH_LAYERS calls in one graph, per call: the layers of an engine's step graph
            attn_layers_ms = time_cuda_graph(attn, iters=iters, calls=GRAPH_LAYERS)
            merge_layers_ms = time_cuda_graph(merge, iters=iters, calls=GRAPH_LAYERS) if c > 1 else 0.0
        except RuntimeError as exc:  # capture not possible here: eager numbers only
            progress(f"graph timing skipped ({exc})")
    item = kv_dtype.itemsize
    row = kv_row_bytes(hkv, d, dv, v_from_k, item, tiled)
    read = sum(local) * row
    allocated = num_pages * ps * row
    bound = b * keys * row / c + b * ps * row
    impl = plan.launch
    return dict(
        shape=name, cp=c, batch=b, keys=keys, q_len=q_len,
        kv_dtype=TILE if tiled else str(kv_dtype).replace("torch.", ""),
        backend=plan.backend, attn_ms=round(attn_ms, 5),
        merge_ms=round(merge_ms, 5), rank_ms=round(attn_ms + merge_ms, 5), step_ms=round(step_ms, 5),
        attn_graph_ms=None if attn_graph_ms is None else round(attn_graph_ms, 5),
        merge_graph_ms=None if merge_graph_ms is None else round(merge_graph_ms, 5),
        rank_graph_ms=None if attn_graph_ms is None else round(attn_graph_ms + merge_graph_ms, 5),
        attn_layers_ms=None if attn_layers_ms is None else round(attn_layers_ms, 5),
        merge_layers_ms=None if merge_layers_ms is None else round(merge_layers_ms, 5),
        rank_layers_ms=None if attn_layers_ms is None else round(attn_layers_ms + merge_layers_ms, 5),
        hbm_gbps_graph=None if attn_graph_ms is None else round(read / (attn_graph_ms * 1e-3) / 1e9, 1),
        hbm_gbps=round(read / (attn_ms * 1e-3) / 1e9, 1), kv_bytes_rank=allocated, kv_bytes_bound=int(bound),
        kv_bytes_ok=allocated <= bound, tflops=round(2.0 * hq * (d + dv) * q_len * sum(local) / (attn_ms * 1e-3) / 1e12,
                                                    1),
        merge_path=merge_path(outs, lses) if c > 1 else None,
        splits=getattr(impl, "num_items", None), split_keys=getattr(impl, "split", None),
        config=list(getattr(impl, "config", ()) or ()), family=plan.family,
    )


def shard_options(args) -> dict | None:
    """The shard plans' ``backend_options`` the command line asks for (None: the defaults)."""
    options = {}
    if args.config:
        options["config"] = tuple(int(x) for x in args.config.split(","))
    if args.block_m:
        options["block_m"] = args.block_m
    if args.programs_per_sm:
        options["programs_per_sm"] = args.programs_per_sm
    if args.no_pdl:
        options["pdl"] = False
    return options or None


#: ``--kv-dtype`` -> the cache dtypes of a run (None: the model dtype; TILE: the tile-scaled FP8
#: MLA latent).
KV_DTYPE_RUNS = {"model": (None,), "fp8": (torch.float8_e4m3fn,), "both": (None, torch.float8_e4m3fn),
                 "fp8_tile": (TILE,), "tile_both": (None, TILE)}


def run_decode_grid(args, device, dtype, shapes) -> tuple[list[dict], list[str]]:
    rows, skipped = [], []
    for kv_dtype in KV_DTYPE_RUNS[getattr(args, "kv_dtype", "model")]:
        r, s = _decode_grid(args, device, dtype, kv_dtype or dtype, shapes)
        rows += r
        skipped += s
    return rows, skipped


def _decode_grid(args, device, dtype, kv_dtype, shapes) -> tuple[list[dict], list[str]]:
    tiled = kv_dtype == TILE
    kv_dtype = torch.uint8 if tiled else kv_dtype
    pool = Pool(device, kv_dtype)
    time_fn = timer(device)
    options = shard_options(args)
    rows, skipped = [], []
    item = kv_dtype.itemsize
    for name in args.shapes.split(","):
        shape = shapes[name]
        hq, hkv, d, dv, v_from_k = shape
        if tiled and not (v_from_k and hkv == 1 and dv % 128 == 0):
            skipped.append(f"{name}: the fp8_tile cache is absorbed MLA's latent (one KV head, Dv a multiple of 128)")
            continue
        for keys in _ints(args.keys):
            for b in _ints(args.batches):
                for c in _ints(args.cps):
                    shard_gb = b * keys / c * kv_row_bytes(hkv, d, dv, v_from_k, item, tiled) / 1e9
                    if shard_gb > args.budget_gb:
                        skipped.append(f"{name} C={c} B={b} L={keys}: {shard_gb:.0f} GB shard > budget")
                        continue
                    for q_len in _ints(args.q_lens):
                        r = decode_case(pool, time_fn, name=name, shape=shape, c=c, b=b, keys=keys, q_len=q_len,
                                        ps=args.page_size, backend=args.backend, options=options, iters=args.iters,
                                        dtype=dtype, tiled=tiled)
                        rows.append(r)
                        progress(f"decode {name} {r['kv_dtype']} C={c} B={b} L={_k(keys)} q={q_len}: attn "
                                 f"{r['attn_ms']:.4f} ms "
                                 f"{r['hbm_gbps']:.0f} GB/s ({r['tflops']} TF/s), merge {r['merge_ms']:.4f} ms "
                                 f"({r['merge_path']}), "
                                 f"{r['splits']} items x {r['split_keys']} keys")
    pool.buf = None
    return rows, skipped


def sweep_configs(args, device, dtype, shapes) -> list[dict]:
    """Time split-kernel configs on a few representative workloads (a tuning aid), over the
    cache dtypes of ``--kv-dtype``."""
    out = []
    for kv_dtype in KV_DTYPE_RUNS[getattr(args, "kv_dtype", "model")]:
        out += _sweep(args, device, dtype, kv_dtype or dtype, shapes)
    return out


def _sweep(args, device, dtype, kv_dtype, shapes) -> list[dict]:
    pool = Pool(device, kv_dtype)
    time_fn = timer(device)
    out = []
    grid = {"gqa": [((64, 4, 2), None), ((64, 4, 3), None), ((64, 4, 4), None), ((128, 4, 2), None),
                    ((128, 4, 3), None), ((128, 8, 3), None), ((32, 4, 4), None), ((64, 4, 3), 16)],
            "mla": [((32, 8, 2), None), ((32, 4, 2), None), ((32, 4, 3), None), ((16, 4, 3), None),
                    ((32, 8, 2), 64), ((16, 8, 3), 64)]}
    for name, b, c, q_len in (("gqa", 1, 1, 1), ("gqa", 64, 8, 1), ("gqa", 8, 1, 4), ("mla", 1, 1, 1),
                              ("mla", 64, 8, 1)):
        if name not in args.shapes.split(","):
            continue
        for cfg, block_m in grid[name]:
            opts = {"config": cfg, **({"block_m": block_m} if block_m else {})}
            try:
                r = decode_case(pool, time_fn, name=name, shape=shapes[name], c=c, b=b, keys=128 * 1024, q_len=q_len,
                                ps=args.page_size, backend="triton", options=opts, iters=args.iters, dtype=dtype)
            except Exception as exc:  # a config that does not compile or fit
                progress(f"sweep {name} B={b} C={c} q={q_len} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            r["block_m"] = block_m
            out.append(r)
            progress(f"sweep {name} {r['kv_dtype']} B={b} C={c} q={q_len} config {cfg} block_m {block_m}: "
                     f"{r['attn_ms']:.4f} ms "
                     f"{r['hbm_gbps']:.0f} GB/s {r['tflops']} TF/s")
    pool.buf = None
    return out


# ----------------------------------------------------------------------------- crossover
def crossover_case(device, dtype, time_fn, *, c: int, tokens: int, prefix: int, shape, ps: int, iters: int,
                   model: cpattn.CostModel, backend: str) -> dict:
    """Measured compute of pass-KV and pass-Q for rank 0 of an extend over a sharded prefix."""
    hq, hkv, d, dv, _ = shape
    s = cpattn.ZigzagStrategy(c)
    sh = cpattn.KVSharding(c)
    meta = s.build_metadata([tokens], [prefix], rank=0, kv=sh).to(device)
    kw = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv, dtype=dtype)
    est = model.estimate(meta, **kw)
    n_kv = prefix + tokens
    k = torch.randn(n_kv, hkv, d, device=device, dtype=dtype)
    v = torch.randn(n_kv, hkv, dv, device=device, dtype=dtype)
    q_local = torch.randn(meta.num_physical_tokens, hq, d, device=device, dtype=dtype)
    dense_backend = "auto" if backend == "auto" else ("torch" if backend == "torch" else "triton")
    dense_meta = s.build_metadata([tokens], [prefix], rank=0).to(device)  # pass-KV: the prefix gathered
    dense = cpattn.plan_attention(dense_meta, cpattn.AttentionSpec(**kw), backend=dense_backend)
    dense_ms = time_fn(lambda: dense.attend(q_local, k, v), iters)
    # pass-Q: all T queries over rank 0's keys (prefix + extend), paged
    dmeta = cpattn.get_strategy("replicated", c).build_metadata([tokens], [prefix], rank=0, kv=sh).to(device)
    local = (dmeta.host or dmeta).local_kv_lens.tolist()[0]
    pages = -(-local // ps)
    kc = torch.randn(pages, ps, hkv, d, device=device, dtype=dtype)
    vc = torch.randn(pages, ps, hkv, dv, device=device, dtype=dtype)
    table = torch.randperm(pages, device=device).int()[None]
    q_all = torch.randn(tokens, hq, d, device=device, dtype=dtype)
    shard = cpattn.plan_attention(dmeta, cpattn.AttentionSpec(page_size=ps, **kw), backend=backend)
    shard_ms = time_fn(lambda: shard.attend(q_all, kc, vc, page_table=table), iters)
    p = meta.num_physical_tokens
    outs, lses = received_parts(torch.randn(p, hq, dv, device=device, dtype=dtype), torch.randn(p, hq, device=device),
                                c)
    merge_ms = time_fn(lambda: cpattn.merge_states(outs, lses), iters) if c > 1 else 0.0
    link = model.link_bytes_per_s
    lat = model.collective_latency_s * 1e3 if c > 1 else 0.0
    t_kv = lat + est["bytes_pass_kv"] / link * 1e3 + dense_ms
    t_q = 2 * lat + est["bytes_pass_q"] / link * 1e3 + shard_ms + merge_ms
    fpp = 2.0 * hq * (d + dv)
    return dict(cp=c, tokens=tokens, prefix=prefix, dense_ms=round(dense_ms, 4), shard_ms=round(shard_ms, 4),
                merge_ms=round(merge_ms, 4), pass_kv_ms=round(t_kv, 4), pass_q_ms=round(t_q, 4),
                model_pass_kv_ms=round(est["pass_kv"] * 1e3, 4), model_pass_q_ms=round(est["pass_q"] * 1e3, 4),
                bytes_pass_kv=est["bytes_pass_kv"], bytes_pass_q=est["bytes_pass_q"],
                dense_tflops=round(max(meta.causal_work_per_rank) * fpp / (dense_ms * 1e-3) / 1e12, 1),
                shard_tflops=round(sum(meta.causal_work_per_rank) / c * fpp / (shard_ms * 1e-3) / 1e12, 1))


def crossover_point(rows: list[dict], kv_key: str, q_key: str) -> Optional[float]:
    """Smallest prefix where pass-Q is faster, interpolated between sweep points (log scale)."""
    prev = None
    for r in rows:
        diff = r[q_key] - r[kv_key]
        if diff < 0:
            if prev is None:
                return float(r["prefix"])
            p0, d0 = prev
            p1 = r["prefix"]
            if p0 <= 0:
                return p1 * d0 / (d0 - diff) if d0 != diff else float(p1)
            x0, x1 = math.log(p0), math.log(p1)
            return math.exp(x0 + (x1 - x0) * d0 / (d0 - diff))
        prev = (r["prefix"], diff)
    return None


def run_crossover(args, device, dtype, shapes) -> dict:
    base = cpattn.CostModel()
    link = args.link_gbps * 1e9 if args.link_gbps else base.link_bytes_per_s
    model = dataclasses.replace(base, link_bytes_per_s=link)
    time_fn = timer(device)
    rows = []
    for prefix in _ints(args.crossover_prefixes):
        r = crossover_case(device, dtype, time_fn, c=args.crossover_cp, tokens=args.crossover_tokens, prefix=prefix,
                           shape=shapes["gqa"], ps=args.page_size, iters=max(3, args.iters // 4), model=model,
                           backend=args.backend)
        rows.append(r)
        progress(f"crossover C={r['cp']} T={r['tokens']} prefix={_k(prefix)}: pass-KV {r['pass_kv_ms']:.3f} ms "
                 f"(model {r['model_pass_kv_ms']:.3f}), pass-Q {r['pass_q_ms']:.3f} ms (model {r['model_pass_q_ms']:.3f});"
                 f" dense {r['dense_tflops']} TF/s, shard {r['shard_tflops']} TF/s")
    measured = crossover_point(rows, "pass_kv_ms", "pass_q_ms")
    predicted = crossover_point(rows, "model_pass_kv_ms", "model_pass_q_ms")
    big = rows[-1]
    fitted = dict(dense_flops_per_s=big["dense_tflops"] * 1e12, shard_flops_per_s=big["shard_tflops"] * 1e12)
    agree = None
    if measured and predicted:
        agree = abs(predicted - measured) / measured
    return dict(rows=rows, link_bytes_per_s=link, measured_crossover_prefix=measured,
                model_crossover_prefix=predicted, relative_error=agree, fitted_constants=fitted,
                note="compute measured on one GPU; collectives charged at link_bytes_per_s with the model's bytes")


# ----------------------------------------------------------------------------- summary / output
def _k(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n // 1024}k" if n >= 1024 else str(n)


def copy_gbps(device: torch.device, nbytes: int = 1 << 30, iters: int = 20) -> Optional[float]:
    """Device-copy bandwidth (GB/s: bytes read + written per second) of a ``nbytes`` device-to-
    device copy, the bound a memory-bound kernel is compared with (None off the GPU)."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_cuda_back_to_back(lambda: dst.copy_(src), warmup=3, iters=iters)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def add_bandwidth_ratios(rows: list[dict], copy: Optional[float]) -> None:
    """``copy_fraction`` (attention GB/s over the device copy's; graph replay where timed) and,
    for FP8 rows with a bf16 twin, ``speedup_vs_bf16`` (the twin's attention time over this one's)."""
    for r in rows:
        gbps = r.get("hbm_gbps_graph") or r["hbm_gbps"]
        r["copy_fraction"] = None if copy is None else round(gbps / copy, 3)
    key = ("shape", "cp", "batch", "keys", "q_len")
    quantized = ("float8_e4m3fn", TILE)
    for r in rows:
        if r.get("kv_dtype") not in quantized:
            continue
        twin = next((x for x in rows if x.get("kv_dtype") not in quantized and all(x[k] == r[k] for k in key)), None)
        if twin is not None:
            t, t0 = r.get("attn_graph_ms") or r["attn_ms"], twin.get("attn_graph_ms") or twin["attn_ms"]
            r["speedup_vs_bf16"] = round(t0 / t, 3)


def summarize(rows: list[dict], crossover: Optional[dict], targets: bool = True) -> list[str]:
    """The summary lines: each GPU target with its verdict, or (``targets`` False, a CPU smoke run)
    only the measured crossover against the model's."""
    if not targets:
        if not crossover:
            return []
        m, p = crossover["measured_crossover_prefix"], crossover["model_crossover_prefix"]
        return [f"pass-KV / pass-Q crossover (prefix keys): measured {m and round(m)}, model {p and round(p)}"]
    lines = []
    fp8 = [r for r in rows if r.get("kv_dtype") == "float8_e4m3fn" and r["shape"] == "gqa" and r["q_len"] == 1
           and r["batch"] >= 8 and r["keys"] >= 32768 and r.get("copy_fraction") is not None]
    if fp8:  # FP8 caches: >= 85% of the device-copy bandwidth at B >= 8, L >= 32k
        worst = min(fp8, key=lambda r: r["copy_fraction"])
        lines.append(f"q_len-1 GQA attention over an FP8 cache >= 85% of the device copy (B >= 8, L >= 32k): "
                     f"{'PASS' if worst['copy_fraction'] >= 0.85 else 'FAIL'} (lowest {worst['copy_fraction']:.2f} at "
                     f"C={worst['cp']} B={worst['batch']} L={_k(worst['keys'])}"
                     + (f", {worst['speedup_vs_bf16']:.2f}x the bf16 token rate" if worst.get("speedup_vs_bf16")
                        else "") + ")")
    rows = [r for r in rows if r.get("kv_dtype") != "float8_e4m3fn"]  # the targets below are the bf16 cache's
    gqa1 = [r for r in rows if r["shape"] == "gqa" and r["q_len"] == 1]
    for how, gbps in (("eager", "hbm_gbps"), ("graph replay", "hbm_gbps_graph")):
        have = [r for r in gqa1 if r.get(gbps) is not None]
        for label, sel in (("at every config", have), ("at C=1 (unsharded cache)", [r for r in have if r["cp"] == 1])):
            if not sel:
                continue
            worst = min(sel, key=lambda r: r[gbps])
            ok = worst[gbps] >= 3500
            lines.append(f"q_len-1 GQA attention >= 3.5 TB/s {label}, {how}: {'PASS' if ok else 'FAIL'} (lowest "
                         f"{worst[gbps]:.0f} GB/s at C={worst['cp']} B={worst['batch']} L={_k(worst['keys'])})")
    for how, key in (("eager, attention + merge timed apart", "rank_ms"),
                     ("eager, attention + merge issued as one step", "step_ms"), ("graph replay", "rank_graph_ms"),
                     (f"{GRAPH_LAYERS} layers per graph", "rank_layers_ms")):
        for r in rows:
            if r["cp"] != 8 or r["keys"] < (1 << 20) or r.get(key) is None:
                continue
            one = next((x for x in rows if x["cp"] == 1 and all(x[k] == r[k] for k in ("shape", "batch", "keys",
                                                                                         "q_len"))), None)
            if one and one.get(key):
                ratio = r[key] / one[key]
                lines.append(f"C=8 / C=1 per-rank time ({how}) {r['shape']} B={r['batch']} L={_k(r['keys'])} "
                             f"q={r['q_len']}: {ratio:.3f} ({'PASS' if ratio <= 0.15 else 'FAIL'}, target <= 0.15)")
    bad = [r for r in rows if not r["kv_bytes_ok"]]
    lines.append(f"KV bytes per rank <= 1/C of replicated + one page per sequence: {'PASS' if not bad else 'FAIL'}")
    if crossover:
        m, p, e = (crossover["measured_crossover_prefix"], crossover["model_crossover_prefix"],
                   crossover["relative_error"])
        lines.append(f"pass-KV / pass-Q crossover (prefix keys): measured {m and round(m)}, model {p and round(p)}"
                     + (f", {e * 100:.0f}% apart ({'PASS' if e <= 0.25 else 'FAIL'}, target <= 25%)" if e is not None
                        else ""))
    return lines


def print_table(rows: list[dict]) -> None:
    print(f"| shape | kv | C | B | L | q | attn ms | merge ms | GB/s | TF/s | graph: attn ms | merge ms | GB/s | "
          f"{GRAPH_LAYERS} per graph: attn ms | merge ms | KV bytes/rank | splits | of copy |")
    print("| --- | --- " + "| ---: " * 16 + "|")

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    for r in rows:
        print(f"| {r['shape']} | {r.get('kv_dtype', '-')} | {r['cp']} | {r['batch']} | {_k(r['keys'])} | "
              f"{r['q_len']} | {r['attn_ms']:.4f} | "
              f"{r['merge_ms']:.4f} | {r['hbm_gbps']:.0f} | {r['tflops']} | {f(r.get('attn_graph_ms'), '.4f')} | "
              f"{f(r.get('merge_graph_ms'), '.4f')} | {f(r.get('hbm_gbps_graph'), '.0f')} | "
              f"{f(r.get('attn_layers_ms'), '.4f')} | {f(r.get('merge_layers_ms'), '.4f')} | "
              f"{r['kv_bytes_rank'] / 1e9:.2f} GB | {r['splits']} | {f(r.get('copy_fraction'), '.2f')} |")


def plot(rows: list[dict], crossover: Optional[dict], path: str, info: dict, targets: bool = True) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("matplotlib missing: no plot")
        return
    fig, axes = plt.subplots(1, 2 if crossover else 1, figsize=(14 if crossover else 8, 4.5), squeeze=False)
    ax = axes[0, 0]
    def config(r):
        return r["shape"], r["batch"], r["keys"], r["q_len"], r.get("kv_dtype", "")

    for key in sorted({config(r) for r in rows}):
        pts = sorted((r["cp"], r["hbm_gbps"]) for r in rows if config(r) == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                label=f"{key[0]} {key[4]} B={key[1]} L={_k(key[2])} q={key[3]}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("C (one rank's 1/C shard)")
    ax.set_ylabel("attention HBM GB/s")
    if targets:
        ax.axhline(3500, color="gray", ls="--", lw=0.8)
    ax.legend(fontsize=6, ncol=2)
    ax.set_title("decode over a sharded cache, per rank")
    if crossover:
        ax = axes[0, 1]
        cr = crossover["rows"]
        xs = [max(r["prefix"], 1) for r in cr]
        for key, label in (("pass_kv_ms", "pass-KV measured"), ("pass_q_ms", "pass-Q measured"),
                           ("model_pass_kv_ms", "pass-KV model"), ("model_pass_q_ms", "pass-Q model")):
            ax.plot(xs, [r[key] for r in cr], marker="o" if "model" not in key else "x",
                    ls="-" if "model" not in key else ":", label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("cached prefix keys")
        ax.set_ylabel("ms per layer (rank 0)")
        ax.set_title(f"extend of {cr[0]['tokens']} tokens at C={cr[0]['cp']}")
        ax.legend(fontsize=7)
    fig.suptitle(f"{info['machine']}, {info['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    progress(f"wrote {path}")


def main(args: argparse.Namespace) -> int:
    if args.distributed:
        from ._decode_distributed import main as distributed_main

        return distributed_main(args)
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    if args.tiny:
        shapes = TINY_SHAPES
        for name, default, tiny in (("cps", "1,2,4,8", "1,2"), ("batches", "1,8,64", "1,3"),
                                    ("keys", "128k,1m", "96,300"), ("crossover_prefixes", "0,4k,16k,64k,256k,1m",
                                                                    "0,64,512"), ):
            if getattr(args, name) == default:
                setattr(args, name, tiny)
        args.crossover_tokens = min(args.crossover_tokens, 32)
        args.crossover_cp = min(args.crossover_cp, 2)
        args.page_size = min(args.page_size, 16)
        args.iters = min(args.iters, 2)
        if args.backend == "auto" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            args.backend = "torch"
    else:
        shapes = SHAPES
        if not cuda:
            raise SystemExit("the decode benchmark needs a CUDA device (or --tiny on the CPU)")
    dtype = torch.float32 if not cuda else torch.bfloat16
    smoke = not cuda
    if smoke:
        smoke_notice("decode")
    out = args.out or default_out("decode", smoke=smoke)
    info = header("benchmarks/run.py decode" + (" --tiny" if args.tiny else ""), smoke=smoke)
    progress(f"{info['machine']}")
    rows, skipped = run_decode_grid(args, device, dtype, shapes)
    copy = copy_gbps(device)
    add_bandwidth_ratios(rows, copy)
    info["device_copy_gbps"] = None if copy is None else round(copy, 1)
    sweep = sweep_configs(args, device, dtype, shapes) if args.sweep and cuda else []
    crossover = None if args.no_crossover else run_crossover(args, device, dtype, shapes)
    summary = summarize(rows, crossover, targets=not smoke)
    payload = {**info, "rows": rows, "skipped": skipped, "sweep": sweep, "crossover": crossover, "summary": summary}
    write_json(out + ".json", payload)
    plot(rows, crossover, out + ".png", info, targets=not smoke)
    print_table(rows)
    for line in skipped:
        print(f"skipped: {line}")
    for line in summary:
        print(line)
    if crossover:
        print(f"model constants implied by the measured kernels: {crossover['fitted_constants']}")
    for r in sweep:
        print(f"sweep {r['shape']} {r['kv_dtype']} B={r['batch']} C={r['cp']} q={r['q_len']} config {r['config']} "
              f"block_m {r['block_m']}: {r['attn_ms']:.4f} ms {r['hbm_gbps']:.0f} GB/s")
    return 0
