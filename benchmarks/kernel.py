"""``python benchmarks/run.py kernel``: attention TF/s on one rank's CP work (one GPU).

Workload groups (``--workloads`` picks groups or name substrings, comma separated; default all):

* ``dense``: for each head shape (``--shapes``: d128 = 32 / 8 heads, D 128; d192 = 16 heads,
  D 192 / Dv 128; d64 = 32 / 8 heads, D 64, only on request) and total sequence length S
  (``--seqs``; one sequence, no prefix), rank 0's work under zigzag C (``--cps``; q = two
  blocks, k = the whole sequence; C = 1 is plain causal) and interleave C = 4. Names: ``d128 S=64k zigzag C=2``.
* ``paged``: zigzag C = 2 over a paged cache (``--pages``, default 16, 64, 256; shuffled pages,
  unused tail slots zero: FA4 needs finite ones), for every shape and S: ``d128 S=64k zigzag C=2 paged16``.
* ``mla``: absorbed-MLA prefill (``mla576``: 128 query heads over one latent KV head, D 576,
  Dv 512, ``v = k[..., :512]``), S in ``--mla-seqs`` under zigzag ``--mla-cps`` (default 16k / 64k,
  C = 1 / 4), packed, plus the first S at C = 1 over pages of ``--mla-pages`` keys (default 64):
  ``mla576 S=16k zigzag C=1``, ``mla576 S=16k zigzag C=1 paged64``.
* ``decode``: absorbed-MLA decode through a dense plan over a replicated cache (C = 1): B sequences
  (``--decode-batches``) of L keys (``--decode-lens``) with q new tokens each (``--decode-qlens``):
  ``mla576 decode B=64 L=32k q1``; the JSON adds ``gbps`` (latent bytes read once / time) and
  ``ms_graph`` / ``tflops_graph`` / ``gbps_graph``: the same call replayed from a CUDA graph (GPU
  time only; engines run decode steps in graphs). ``--decode-options`` tunes the split-KV family.
* ``short``: many short sequences at C = 1 (``--short``, default 1024 x 128 and 64 x 2048 tokens,
  D128 heads): ``d128 1024x128``, against FA4 varlen on the same segments.

Backends on the same tensors (``--backends``):

* ``triton``: ``plan.attend(...)`` of a plan built once per workload with ``backend="triton"`` (the
  family it picks, sm90 / mla / portable, is in the JSON row and the progress line).
* ``triton-persistent`` / ``triton-per-tile``: ``triton`` with the dense sm90 kernel's
  persistent schedule forced on / off (``backend_options={"sm90": {"persistent": True}}``: one
  resident program per SM walking the work items; ``False``: one program per work item).
  ``triton`` itself takes ``"auto"`` (persistent for short key ranges); other families ignore it.
* ``triton-portable``: the portable Triton kernel alone (``backend_options={"family": "portable"}``).
* ``triton-fp8``: FP8 tensor-core attention (``AttentionSpec(kv_dtype=mma_dtype=torch.float8_e4m3fn)``,
  the portable kernel's e4m3 dots) over the same K/V quantized to e4m3 with per-KV-head scales
  (``amax / 448``; not timed). Dense and paged workloads (not MLA). When ``triton`` runs too, its
  row gains ``rel_rmse_vs_bf16``: ``||out_fp8 - out_bf16|| / ||out_bf16||`` over the rank's rows
  against the ``triton`` (bf16) output, and the targets summary prints the TF/s ratio (target
  >= 1.5x the bf16 Hopper kernel). The FP8 target run (H100, about a minute)::

      python benchmarks/run.py kernel --workloads dense --shapes d128 --seqs 65536,131072 \
          --cps 1,2,4,8 --no-interleave --backends triton,triton-fp8 --warmup-ms 100 --min-ms 30
* ``fa4``: ``plan.attend(...)`` of an ``backend="fa4"`` plan (one varlen launch plus output set-up).
* ``fa4-raw``: ``flash_attn.cute.flash_attn_varlen_func`` called directly with the same
  per-segment arguments, to show the fa4 backend's overhead.
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``, one call per segment with
  ``is_causal`` when the segment starts at position 0 and ``causal_lower_right(L, last + 1)``
  otherwise; K/V heads expanded to Hq beforehand (not timed). Only for packed dense workloads of at
  most 64 segments (no exact SDPA form for interleave or a page table).

FA4 takes head dims up to 256, so the MLA workloads run the Triton backends only.

FLOPs = 2 * Hq * sum over query rows of attended keys * (D + Dv). TF/s from ``iters`` calls issued
back to back between two CUDA events (median of 3 repeats; host launch work hidden behind the
queue), after each backend has run for ``--warmup-ms`` (200) and with at least ``--min-ms`` (50)
per repeat, so the GPU is in the power-capped state a steady stream of layers runs in
(``--warmup-ms 0 --min-ms 0``: the timing before 2026-12-02, 2 warm-up calls). ``ms_sync`` in
the JSON is one call between events followed by a sync (median of 3), which adds the host's
per-call work for short kernels. ``--clocks`` samples the GPU with nvidia-smi while each
backend warms up and is timed (:mod:`.gpu_clocks`): at the power cap a kernel's TF/s also depends
on the clock it leaves the GPU at. Rows: {workload, group, backend, family, tflops, ms, ms_sync,
tflops_sync[, gbps][, sm_mhz, watts, clock_samples, tflops_per_ghz]}. A summary of the performance
targets (ratios in the same run) is printed after the table.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .common import default_out, header, progress, time_cuda, time_cuda_back_to_back, time_cuda_graph, write_json

#: Default timing (H200, 2026-12-01, nvidia-smi sampling every 100 ms): with 2 warm-up calls
#: and a few ms per repeat the 16k workloads ran at the boost clock
#: (mostly 1920-1980 MHz, sampled power < 370 W); run for 200 ms first they sat at the 700 W cap
#: (1425-1800 MHz) and were 10-14% slower, triton and FA4 alike. Engines run layer after layer,
#: so each backend runs >= WARMUP_MS before it is timed and one repeat lasts >= MIN_MS.
WARMUP_MS = 200.0
MIN_MS = 50.0

#: (Hq, Hkv, D, Dv) per head shape.
SHAPES = {"d64": (32, 8, 64, 64), "d128": (32, 8, 128, 128), "d192": (16, 16, 192, 128),
          "mla576": (128, 1, 576, 512)}
BACKENDS = ("triton", "triton-persistent", "triton-per-tile", "triton-portable", "triton-fp8", "fa4", "fa4-raw",
            "sdpa")
#: Backends run on request only (not in the default ``--backends``).
ON_REQUEST = ("triton-fp8",)
GROUPS = ("dense", "paged", "mla", "decode", "short")
#: Where the benchmark runs (a module constant so tests can drive ``main`` on CPU).
DEVICE = "cuda"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", default="all",
                   help="comma list of groups (" + ",".join(GROUPS) + ") and/or workload-name substrings "
                        "(e.g. 'paged16,mla576 S=16k'); default all")
    p.add_argument("--shapes", default="d128,d192", help="dense/paged head shapes: comma list of d64,d128,d192")
    p.add_argument("--seqs", default="16384,65536,131072", help="dense/paged total sequence lengths S")
    p.add_argument("--cps", default="1,2,4,8", help="dense zigzag CP sizes (rank 0's work)")
    p.add_argument("--pages", default="16,64,256", help="page sizes of the paged workloads (zigzag C=2)")
    p.add_argument("--mla-seqs", default="16384,65536", help="absorbed-MLA prefill sequence lengths")
    p.add_argument("--mla-cps", default="1,4", help="absorbed-MLA prefill zigzag CP sizes")
    p.add_argument("--mla-pages", default="64",
                   help="page sizes of the paged absorbed-MLA prefill workloads (the first --mla-seqs, C=1)")
    p.add_argument("--decode-batches", default="1,8,64", help="absorbed-MLA decode batch sizes B")
    p.add_argument("--decode-lens", default="4096,32768,131072", help="absorbed-MLA decode keys per sequence L")
    p.add_argument("--decode-qlens", default="1,4", help="absorbed-MLA decode new tokens per sequence")
    p.add_argument("--short", default="1024x128,64x2048", help="short-sequence batches BxN (C=1, d128)")
    p.add_argument("--no-interleave", action="store_true", help="skip the dense interleave C=4 workloads")
    p.add_argument("--no-paged", action="store_true", help="skip the paged group (same as leaving it out)")
    p.add_argument("--backends", default=",".join(b for b in BACKENDS if b not in ON_REQUEST),
                   help="comma list of " + ",".join(BACKENDS) + " (default: all but " + ",".join(ON_REQUEST) + ")")
    p.add_argument("--iters", type=int, default=10, help="timed iterations (fewer for > 100 ms calls)")
    p.add_argument("--warmup-ms", type=float, default=WARMUP_MS,
                   help="run each backend at least this many ms (and 2 calls) before timing it; 0: 2 calls only")
    p.add_argument("--min-ms", type=float, default=MIN_MS,
                   help="more timed calls than --iters where needed, so one repeat lasts about this many ms")
    p.add_argument("--clocks", action="store_true",
                   help="sample SM clock and board power with nvidia-smi while timing: rows gain sm_mhz, watts, "
                        "tflops_per_ghz (median of the busy samples of the backend's warm-up and timed calls)")
    p.add_argument("--list", action="store_true", help="print the selected workload names and exit")
    p.add_argument("--out", default=default_out("kernel"), help="output path without extension")
    p.add_argument("--triton-config", default=None, help="BLOCK_M,BLOCK_N,warps,stages: skip autotuning")
    p.add_argument("--sm90-options", default=None,
                   help="key=value list passed to the dense sm90 kernel of the 'triton' backend "
                        "(backend_options sm90), e.g. block_n=64,stages=4 or overlap=2,pingpong=1")
    p.add_argument("--decode-options", default=None,
                   help="key=value list passed to the split-KV family of decode-shaped 'triton' plans "
                        "(backend_options decode), e.g. programs_per_sm=1")


def parse_options(text: str, flag: str = "--sm90-options") -> dict:
    """``"block_n=64,stages=4,pingpong=1"`` -> ``{"block_n": 64, "stages": 4, "pingpong": True}``
    (``family=`` and ``persistent`` / ``sections`` / ``overlap=auto`` stay strings,
    ``persistent=0/1`` is a bool)."""
    out = {}
    for item in [t for t in text.split(",") if t]:
        key, _, value = item.partition("=")
        key = key.strip()
        if not value:
            raise SystemExit(f"{flag} items are key=value, got {item!r}")
        if key == "family" or (key in ("persistent", "sections", "overlap") and value == "auto"):
            out[key] = value
        else:
            out[key] = bool(int(value)) if key in ("pingpong", "persistent", "pair", "sections", "pdl") else int(value)
    return out


def timed_iters(est_ms: float, iters: int, min_ms: float) -> int:
    """Timed calls per repeat for a call estimated at ``est_ms`` ms: ``iters``, fewer (>= 3) when
    that would pass one second, more (<= 2000) when one repeat would be shorter than ``min_ms``."""
    est_ms = max(est_ms, 1e-3)
    return max(3, min(iters, int(1000 / est_ms)), min(2000, math.ceil(min_ms / est_ms)))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


@dataclass(frozen=True)
class Workload:
    """One timed problem: ``strategy`` C ``cp`` rank 0 of sequences ``ext`` (+ ``pre`` cached)."""

    name: str
    group: str
    shape: str
    strategy: str
    cp: int
    ext: tuple[int, ...]
    pre: tuple[int, ...] = field(default=())
    page: Optional[int] = None

    @property
    def prefix(self) -> tuple[int, ...]:
        return self.pre or (0,) * len(self.ext)


def all_workloads(args) -> list[Workload]:
    """Every workload the arguments describe, in run order (K/V shared between neighbours)."""
    out: list[Workload] = []
    for shape in [s for s in args.shapes.split(",") if s]:
        if shape not in ("d64", "d128", "d192"):
            raise SystemExit(f"--shapes takes d64,d128,d192, got {shape!r}")
        for seq in _ints(args.seqs):
            base = f"{shape} S={_k(seq)}"
            for c in _ints(args.cps):
                out.append(Workload(f"{base} zigzag C={c}", "dense", shape, "zigzag", c, (seq,)))
            if not args.no_interleave:
                out.append(Workload(f"{base} interleave C=4", "dense", shape, "interleave", 4, (seq,)))
            if not args.no_paged:
                for page in _ints(args.pages):
                    out.append(Workload(f"{base} zigzag C=2 paged{page}", "paged", shape, "zigzag", 2, (seq,),
                                        page=page))
    for seq in _ints(args.mla_seqs):
        for c in _ints(args.mla_cps):
            out.append(Workload(f"mla576 S={_k(seq)} zigzag C={c}", "mla", "mla576", "zigzag", c, (seq,)))
    if _ints(args.mla_seqs):
        seq = _ints(args.mla_seqs)[0]
        for page in _ints(args.mla_pages):
            out.append(Workload(f"mla576 S={_k(seq)} zigzag C=1 paged{page}", "mla", "mla576", "zigzag", 1, (seq,),
                                page=page))
    for length in _ints(args.decode_lens):
        for b in _ints(args.decode_batches):
            for ql in _ints(args.decode_qlens):
                out.append(Workload(f"mla576 decode B={b} L={_k(length)} q{ql}", "decode", "mla576", "contiguous", 1,
                                    (ql,) * b, (length - ql,) * b))
    for spec in [s for s in args.short.split(",") if s]:
        b, n = (int(x) for x in spec.lower().split("x"))
        out.append(Workload(f"d128 {b}x{n}", "short", "d128", "contiguous", 1, (n,) * b))
    return out


def select(workloads: list[Workload], spec: str) -> list[Workload]:
    """``spec``: "all", or comma-separated group names and name substrings (any match keeps). A
    kept paged workload keeps its packed baseline (same name without `` pagedN``) too, so the
    paged / packed ratio is always measured in the same run."""
    if spec.strip() in ("", "all"):
        return workloads
    tokens = [t.strip() for t in spec.split(",") if t.strip()]
    names = set()
    for w in workloads:
        if any(t == w.group or (t not in GROUPS and t in w.name) for t in tokens):
            names.add(w.name)
            if w.page is not None:
                names.add(re.sub(r" paged\d+$", "", w.name))
    return [w for w in workloads if w.name in names]


def _flops(meta, hq: int, d: int, dv: int) -> float:
    pairs = 0
    for _, _, length, pos0, stride in meta.host_segments:
        pairs += length * (pos0 + 1) + stride * length * (length - 1) // 2
    return 2.0 * hq * pairs * (d + dv)


def _sdpa_fn(q, k, v, meta, group: int) -> Callable[[], object]:
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    ke = k.repeat_interleave(group, dim=1) if group > 1 else k
    ve = v.repeat_interleave(group, dim=1) if group > 1 else v
    host = meta.host if meta.host is not None else meta
    cu_kv = host.cu_kv_lens.tolist()
    calls = []
    for seq, row0, length, pos0, _ in meta.host_segments:
        last = pos0 + length - 1
        qs = q[row0 : row0 + length].transpose(0, 1).unsqueeze(0)
        ks = ke[cu_kv[seq] : cu_kv[seq] + last + 1].transpose(0, 1).unsqueeze(0)
        vs = ve[cu_kv[seq] : cu_kv[seq] + last + 1].transpose(0, 1).unsqueeze(0)
        calls.append((qs, ks, vs, None if pos0 == 0 else causal_lower_right(length, last + 1)))

    def run():
        for qs, ks, vs, bias in calls:
            if bias is None:
                F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            else:
                F.scaled_dot_product_attention(qs, ks, vs, attn_mask=bias)

    return run


def varlen_descriptors(meta, device) -> dict:
    """FA4's varlen arguments for the segments of ``meta`` (what the fa4 backend plans)."""
    segs = meta.host_segments
    cu_kv = meta.host.cu_kv_lens.tolist() if meta.host is not None else meta.cu_kv_lens.tolist()
    i32 = dict(dtype=torch.int32, device=device)
    return dict(
        cu_seqlens_q=torch.tensor([r0 for _, r0, *_ in segs] + [meta.num_local_tokens], **i32),
        cu_seqlens_k=torch.tensor([cu_kv[b] for b, *_ in segs] + [cu_kv[-1]], **i32),
        seqused_k=torch.tensor([p0 + (n - 1) * st + 1 for _, _, n, p0, st in segs], **i32),
        max_seqlen_q=meta.max_seg_len, max_seqlen_k=meta.max_seg_keys,
    )


def _fa4_raw_fn(q, k, v, meta, page_table) -> Optional[Callable[[], object]]:
    from flash_attn.cute import flash_attn_varlen_func

    kw = dict(varlen_descriptors(meta, q.device), causal=True)
    if page_table is not None:
        kw.pop("cu_seqlens_k")
        kw["page_table"] = page_table.index_select(0, meta.seg_seq[: meta.num_segments].long()).contiguous()
    return lambda: flash_attn_varlen_func(q, k, v, **kw)


def paged_cache(k: torch.Tensor, v: Optional[torch.Tensor], lens: list[int], page: int, gen: torch.Generator):
    """Packed K/V of sequences ``lens`` (in order) copied into shuffled pages; unused tail slots
    are zero (finite, as FA4 requires). ``v`` None: K only. Returns (k_cache, v_cache, table int32)."""
    dev = k.device
    pages_per = [-(-n // page) for n in lens]
    total, max_pages = sum(pages_per), max(pages_per)
    perm = torch.randperm(total, device=dev, generator=gen)
    kc = torch.zeros(total, page, *k.shape[1:], device=dev, dtype=k.dtype)
    vc = None if v is None else torch.zeros(total, page, *v.shape[1:], device=dev, dtype=v.dtype)
    table = torch.zeros(len(lens), max_pages, dtype=torch.int32, device=dev)
    first, row = 0, 0
    for b, n in enumerate(lens):
        logical = torch.arange(first, first + pages_per[b], device=dev)
        table[b, : pages_per[b]] = perm[logical].to(torch.int32)
        flat = kc.view(-1, *k.shape[1:])
        slots = (perm[logical].repeat_interleave(page) * page + torch.arange(page, device=dev).repeat(pages_per[b]))[:n]
        flat[slots] = k[row : row + n]
        if vc is not None:
            vc.view(-1, *v.shape[1:])[slots] = v[row : row + n]
        first += pages_per[b]
        row += n
    return kc, vc, table


class _Tensors:
    """K/V of the last (shape, lengths) asked for, kept for the next workload with the same ones."""

    def __init__(self, device: str) -> None:
        self.key, self.kv, self.device = None, None, device
        self.gen = torch.Generator(device=device).manual_seed(0)

    def get(self, shape: str, lens: tuple[int, ...]):
        if self.key != (shape, lens):
            self.kv = None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            _, hkv, d, dv = SHAPES[shape]
            n = sum(lens)
            k = torch.randn(n, hkv, d, device=self.device, dtype=torch.bfloat16, generator=self.gen)
            v = k[..., :dv] if shape == "mla576" else torch.randn(n, hkv, dv, device=self.device, dtype=torch.bfloat16,
                                                                  generator=self.gen)
            self.key, self.kv = (shape, lens), (k, v)
        return self.kv


def main(args: argparse.Namespace) -> int:
    workloads = select(all_workloads(args), args.workloads)
    if args.list:
        for w in workloads:
            print(f"{w.group:7s} {w.name}")
        return 0
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the kernel benchmark needs a CUDA device")
    backends = [b for b in args.backends.split(",") if b]
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        raise SystemExit(f"unknown --backends {sorted(unknown)} (known: {BACKENDS})")
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as exc:
        progress(f"flash_attn.cute not importable ({exc}); skipping fa4 and fa4-raw")
        backends = [b for b in backends if not b.startswith("fa4")]
    triton_kw = {}
    if args.triton_config:
        bm, bn, w, s = (int(x) for x in args.triton_config.split(","))
        triton_kw = dict(block_m=bm, config=(bn, w, s), family="portable")
    if args.sm90_options:
        triton_kw["sm90"] = parse_options(args.sm90_options)
    if args.decode_options:
        triton_kw["decode"] = parse_options(args.decode_options, "--decode-options")
    sampler = None
    if args.clocks:
        from .gpu_clocks import ClockSampler

        try:
            sampler = ClockSampler(torch.cuda.current_device()).start()
        except ValueError as exc:
            raise SystemExit(str(exc))
    try:
        return _run(args, workloads, backends, triton_kw, sampler)
    finally:
        if sampler is not None:
            sampler.stop()


def _run(args, workloads, backends, triton_kw, sampler) -> int:
    import cpattn

    info = header("benchmarks/run.py kernel " + " ".join(_argv_summary(args)))
    progress(f"{info['machine']}; backends {backends}; {len(workloads)} workloads")
    dev = DEVICE
    rows: list[dict] = []
    tensors = _Tensors(dev)
    for w in workloads:
        hq, hkv, d, dv = SHAPES[w.shape]
        lens = tuple(e + p for e, p in zip(w.ext, w.prefix))
        k, v = tensors.get(w.shape, lens)
        s = cpattn.get_strategy(w.strategy, w.cp, pad_multiple=64)
        meta = s.build_metadata(list(w.ext), list(w.prefix), rank=0).to(dev)
        q = torch.randn(meta.num_physical_tokens, hq, d, device=dev, dtype=torch.bfloat16, generator=tensors.gen)
        kk, vv, table = k, v, None
        if w.page is not None:
            if w.shape == "mla576":
                kk, _, table = paged_cache(k, None, list(lens), w.page, tensors.gen)
                vv = kk[..., :dv]
            else:
                kk, vv, table = paged_cache(k, v, list(lens), w.page, tensors.gen)
        flops = _flops(meta, hq, d, dv)
        kv_bytes = k.numel() * k.element_size() + (0 if w.shape == "mla576" else v.numel() * v.element_size())
        outputs: dict = {}  # backend -> its output (triton and triton-fp8: the FP8 path's RMSE)
        for backend in backends:
            made = _make_fn(backend, s, q, kk, vv, meta, table, hq // hkv, w, triton_kw)
            if made is None:
                continue
            fn, family = made
            est = flops / 500e12 * 1e3
            iters = timed_iters(est, args.iters, args.min_ms)
            try:
                t0 = time.time()
                ms = time_cuda_back_to_back(fn, warmup=2, iters=iters, warmup_ms=args.warmup_ms)
                t1 = time.time()
                ms_sync = time_cuda(fn, warmup=0, iters=3)
            except Exception as exc:  # a backend that cannot run this shape
                progress(f"{w.name:38s} {backend:15s} failed: {type(exc).__name__}: {exc}"[:300])
                continue
            tflops = flops / (ms * 1e-3) / 1e12
            row = dict(workload=w.name, group=w.group, backend=backend, family=family, tflops=round(tflops, 1),
                       ms=round(ms, 4), ms_sync=round(ms_sync, 4),
                       tflops_sync=round(flops / (ms_sync * 1e-3) / 1e12, 1))
            extra = ""
            if backend in ("triton", "triton-fp8"):
                outputs[backend] = fn()[: meta.num_local_tokens].float()
                if len(outputs) == 2:
                    row["rel_rmse_vs_bf16"] = round(rel_rmse(outputs["triton-fp8"], outputs["triton"]), 5)
                    extra = f" rel RMSE vs bf16 {row['rel_rmse_vs_bf16']:.4f}"
            clocks = sampler.stats(t0, t1) if sampler is not None else None
            if clocks:
                row.update(clocks, tflops_per_ghz=round(tflops / (clocks["sm_mhz"] / 1000), 1))
                extra = f" @ {clocks['sm_mhz']:.0f} MHz {clocks['watts']:.0f} W"
            if w.group == "decode":
                row["gbps"] = round(kv_bytes / (ms * 1e-3) / 1e9, 1)
                extra = f" {row['gbps']:8.1f} GB/s" + extra
                try:  # decode runs in CUDA graphs in engines: the replayed step's GPU time
                    ms_graph = time_cuda_graph(fn, warmup=1, iters=iters)
                    row.update(ms_graph=round(ms_graph, 4), tflops_graph=round(flops / (ms_graph * 1e-3) / 1e12, 1),
                               gbps_graph=round(kv_bytes / (ms_graph * 1e-3) / 1e9, 1))
                    extra += f" (graph {ms_graph:.4f} ms {row['tflops_graph']:.1f} TF/s {row['gbps_graph']:.0f} GB/s)"
                except Exception as exc:  # a backend whose call cannot be captured
                    progress(f"{w.name}: graph capture failed: {type(exc).__name__}: {exc}"[:300])
            rows.append(row)
            progress(f"{w.name:38s} {backend:15s} {family:8s} {ms:9.3f} ms {tflops:7.1f} TF/s{extra} "
                     f"(one call + sync: {ms_sync:.3f} ms)")
        del q, kk, vv, table, outputs
    try:
        from cpattn.kernels.triton_attn import tuned_configs

        for key, cfg in tuned_configs().items():
            progress(f"triton autotune {key}: {cfg}")
    except Exception:
        pass
    write_json(args.out + ".json", rows)
    _plot(rows, args.out + ".png", info)
    _print_table(rows, backends)
    if dev == "cuda":  # the targets are GPU performance targets
        _print_targets(rows)
    return 0


def rel_rmse(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` (float64 sums)."""
    return ((out.double() - ref.double()).pow(2).sum().sqrt() / ref.double().pow(2).sum().sqrt()).item()


def fp8_kv(k: torch.Tensor, v: torch.Tensor):
    """K/V [..., Hkv, D] quantized to e4m3 with per-KV-head scales ``amax / 448``:
    (k8, v8, k_scale [Hkv], v_scale [Hkv]) (:func:`cpattn.quant.quantize_fp8`)."""
    from cpattn.quant import FP8_E4M3_MAX, quantize_fp8

    def scale(x):
        return (x.float().abs().flatten(0, -3).amax(dim=(0, 2)) / FP8_E4M3_MAX).clamp_min(1e-12)

    ks, vs = scale(k), scale(v)
    return quantize_fp8(k, ks), quantize_fp8(v, vs), ks, vs


def _plan_fn(s, q, k, v, meta, table, backend, options, fp8: bool = False):
    import cpattn

    hq, d = q.shape[1], q.shape[2]
    call = {}
    extra = {}
    if fp8:  # FP8 tensor-core attention over the K/V quantized here (not timed)
        k, v, ks, vs = fp8_kv(k, v)
        call = dict(k_scale=ks, v_scale=vs)
        extra = dict(kv_dtype=torch.float8_e4m3fn, mma_dtype=torch.float8_e4m3fn)
    spec = cpattn.AttentionSpec(num_q_heads=hq, num_kv_heads=k.shape[-2], head_dim=d, head_dim_v=v.shape[-1],
                                dtype=q.dtype, page_size=k.shape[1] if table is not None else None, **extra)
    plan = cpattn.plan_attention(meta, spec, backend=backend, backend_options=options)
    family = plan.family + ("-fp8mma" if plan.mma_dtype is not None else "")
    return (lambda: plan.attend(q, k, v, page_table=table, **call)), family


def _make_fn(backend, s, q, k, v, meta, table, group, w: Workload, triton_kw):
    """(callable, family) for ``backend`` on workload ``w``, or None when it does not apply."""
    d = q.shape[-1]
    if backend == "triton":
        return _plan_fn(s, q, k, v, meta, table, "triton", triton_kw)
    if backend in ("triton-persistent", "triton-per-tile"):  # the dense sm90 schedule forced on / off
        persistent = backend == "triton-persistent"
        options = {**triton_kw, "sm90": {**triton_kw.get("sm90", {}), "persistent": persistent}}
        return _plan_fn(s, q, k, v, meta, table, "triton", options)
    if backend in ("triton-portable", "triton-fp8"):
        if backend == "triton-fp8" and w.shape == "mla576":
            return None
        portable = {k_: v_ for k_, v_ in triton_kw.items() if k_ != "sm90"}
        return _plan_fn(s, q, k, v, meta, table, "triton", {**portable, "family": "portable"},
                        fp8=backend == "triton-fp8")
    if backend.startswith("fa4") and (w.strategy == "interleave" or d > 256):
        return None
    if backend == "fa4":
        return _plan_fn(s, q, k, v, meta, table, "fa4", {})
    if backend == "fa4-raw":
        return _fa4_raw_fn(q, k, v, meta, table), "fa4"
    if backend == "sdpa":
        if w.strategy == "interleave" or table is not None or d > 256 or meta.num_segments > 64:
            return None
        return _sdpa_fn(q, k, v, meta, group), "sdpa"
    raise ValueError(f"unknown backend {backend!r}")


def _argv_summary(args) -> list[str]:
    out = [f"--workloads '{args.workloads}'", f"--sm90-options {args.sm90_options}",
           f"--decode-options {args.decode_options}", f"--shapes {args.shapes}", f"--seqs {args.seqs}",
           f"--cps {args.cps}", f"--pages {args.pages}", f"--mla-seqs {args.mla_seqs}", f"--mla-cps {args.mla_cps}",
           f"--mla-pages {args.mla_pages}",
           f"--decode-batches {args.decode_batches}", f"--decode-lens {args.decode_lens}",
           f"--decode-qlens {args.decode_qlens}", f"--short {args.short}", f"--iters {args.iters}",
           f"--warmup-ms {args.warmup_ms:g}", f"--min-ms {args.min_ms:g}"]
    if args.no_interleave:
        out.append("--no-interleave")
    if args.no_paged:
        out.append("--no-paged")
    if args.clocks:
        out.append("--clocks")
    return out


def _table(rows: list[dict]) -> dict[str, dict[str, float]]:
    table: dict[str, dict[str, float]] = {}
    for r in rows:
        table.setdefault(r["workload"], {})[r["backend"]] = r["tflops"]
    return table


def _print_table(rows: list[dict], backends: list[str]) -> None:
    table = _table(rows)
    family = {r["workload"]: r["family"] for r in rows if r["backend"] == "triton"}
    gbps = {r["workload"]: r["gbps"] for r in rows if r["backend"] == "triton" and "gbps" in r}
    print("| workload | triton family | " + " | ".join(backends) + " | triton / fa4 | triton GB/s |")
    print("| --- | --- | " + " | ".join("---:" for _ in backends) + " | ---: | ---: |")
    for workload, vals in table.items():
        cells = [f"{vals[b]:.0f}" if b in vals else "-" for b in backends]
        ratio = f"{vals['triton'] / vals['fa4']:.2f}" if "triton" in vals and vals.get("fa4") else "-"
        bw = f"{gbps[workload]:.0f}" if workload in gbps else "-"
        print(f"| {workload} | {family.get(workload, '-')} | " + " | ".join(cells) + f" | {ratio} | {bw} |")


def _print_targets(rows: list[dict]) -> None:
    """The kernel performance targets, computed from this run's rows (ratios within the run)."""
    table = _table(rows)
    lines = []

    def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
        return a / b if a and b else None

    for shape, want_median in (("d128", 1.00), ("d192", 0.95)):
        rs = [ratio(v.get("triton"), v.get("fa4")) for w, v in table.items()
              if re.fullmatch(rf"{shape} S=\w+ zigzag C=\d+", w)]
        rs = [r for r in rs if r is not None]
        if rs:
            lines.append(f"dense {shape} zigzag triton/fa4: median {statistics.median(rs):.3f} (target >= "
                         f"{want_median:.2f}), min {min(rs):.3f} (target >= 0.93) over {len(rs)} points")
    for w, v in table.items():
        m = re.fullmatch(r"(d\d+ S=\w+ zigzag C=2) paged(\d+)", w)
        if m and "triton" in v:
            own = ratio(v["triton"], table.get(m.group(1), {}).get("triton"))
            fa4 = ratio(v["triton"], v.get("fa4"))
            lines.append(f"{w}: triton {v['triton']:.0f} TF/s = "
                         f"{'-' if own is None else f'{own:.2f}'}x its packed (target >= 0.95), "
                         f"{'-' if fa4 is None else f'{fa4:.2f}'}x fa4 paged (target >= 0.95)")
    rmse = {r["workload"]: r["rel_rmse_vs_bf16"] for r in rows if "rel_rmse_vs_bf16" in r}
    for w, v in table.items():
        if "triton-fp8" in v and "triton" in v:
            err = f", rel RMSE vs bf16 {rmse[w]:.4f}" if w in rmse else ""
            lines.append(f"{w}: triton-fp8 {v['triton-fp8']:.0f} TF/s = {v['triton-fp8'] / v['triton']:.2f}x triton "
                         f"bf16 (target >= 1.50){err}")
    for w, v in table.items():
        if w.startswith("mla576 S=") and "triton" in v:
            lines.append(f"{w}: triton {v['triton']:.0f} TF/s (target >= 500)")
    for r in rows:
        if r["group"] == "decode" and r["backend"] == "triton":
            graph = (f"; graph replay {r['gbps_graph']:.0f} GB/s, {r['tflops_graph']:.0f} TF/s"
                     if "tflops_graph" in r else "")
            lines.append(f"{r['workload']}: triton back to back {r['gbps']:.0f} GB/s, {r['tflops']:.0f} TF/s{graph} "
                         f"(target at B >= 8: >= 2500 GB/s or >= 400 TF/s)")
    for w, v in table.items():
        if re.fullmatch(r"d128 \d+x\d+", w) and "triton" in v:
            fa4 = ratio(v["triton"], v.get("fa4"))
            lines.append(f"{w}: triton {v['triton']:.0f} TF/s = {'-' if fa4 is None else f'{fa4:.2f}'}x fa4 varlen "
                         "(target >= 0.9)")
    if lines:
        print("\nTargets:")
        for line in lines:
            print("  " + line)


def _plot(rows: list[dict], path: str, info: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("matplotlib missing: no plot")
        return
    panels = []
    for r in rows:
        key = (r["group"], r["workload"].split(" ")[0])
        if key not in panels:
            panels.append(key)
    if not panels:
        return
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, 4.2 * len(panels)), squeeze=False)
    for ax, (group, shape) in zip(axes[:, 0], panels):
        sel = [r for r in rows if r["group"] == group and r["workload"].split(" ")[0] == shape]
        workloads = list(dict.fromkeys(r["workload"] for r in sel))
        width = 0.8 / max(1, len(backends))
        for i, b in enumerate(backends):
            vals = {r["workload"]: r["tflops"] for r in sel if r["backend"] == b}
            xs = [j + i * width for j, w in enumerate(workloads) if w in vals]
            ax.bar(xs, [vals[w] for w in workloads if w in vals], width, label=b)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))])
        ax.set_xticklabels([w[len(shape) + 1 :] for w in workloads], rotation=45, ha="right", fontsize=8)
        ax.set_ylabel("TF/s")
        ax.set_title(f"{shape} {group}: rank-0 CP attention work, causal bf16")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{info['machine']}, {info['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    progress(f"wrote {path}")
