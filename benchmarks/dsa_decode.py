"""``python benchmarks/run.py dsa_decode``: DSA decode over a sharded cache, one rank's step.

Per workload (context L tokens per sequence, B sequences, q_len new tokens each; DeepSeek-V3.2
shapes, bf16: 128 heads, latent 512 + rope 64, indexer 64 heads x 128 bf16 keys, top-k 2048) the
work of rank ``--rank`` of C = ``--cp`` ranks holding 1/C of every sequence's cache
(``KVSharding(C)``), next to the same step on one GPU holding the whole cache (C = 1):

* ``index``: this rank's index scores over its keys and its top-k candidates
  (``IndexTopkPlan.candidates``); TF/s on the score FLOPs ``2 H_i D_i (visible local keys)``;
* ``select``: the exact global top-k from the C ranks' candidates (``IndexTopkPlan.select`` over
  a [C, N, topk] buffer, what the all-gather delivers);
* ``attend``: sparse attention over the selected keys this rank owns (``plan.attend``; the
  selection: 2048 distinct positions per row spread over the context, ~1/C of them owned);
* ``merge``: the exact merge of C partials (``merge_states`` over [C, N, 128, 512]).

The two collectives are not run (one GPU): their bytes are counted and charged at ``--link-gbs``
GB/s: the top-k agreement ``(C - 1) N topk 8`` bytes received per rank per layer
(``cpattn.dsa.topk_agreement_bytes``) and the merge ``(C - 1) N 128 (512 * 2 + 4)``. The step
time is index + select + attend + merge + both charges; the ratio is step(C) / step(1) (target
<= 0.2 at B >= 8, ideal 1 / C). A C = 1 workload whose cache does not fit the free GPU memory is
skipped with a note. Timing: CUDA events around back-to-back calls (median of 3 repeats).

``--graph`` (CUDA only) also captures one whole step of the same work (index candidates,
select, attend, merge: ``graph_step_fn``, from ``StaticPlanner`` plans sized for the workload)
in a CUDA graph and times its replays: ``c{C}_graph_ms`` per step without the host work of the
eager calls, ``c{C}_graph_step_ms`` with both collectives' charges added, next to the eager
``c{C}_step_ms``; the same for C = 1 (``c1_graph_ms``, no merge) and ``graph_ratio`` =
``c{C}_graph_step_ms / c1_graph_ms`` (how an engine replays decode steps).

    python benchmarks/run.py dsa_decode                               # the GPU run (C = 8, 128k and 1M)
    python benchmarks/run.py dsa_decode --graph                       # plus CUDA-graph replays of a step
    python benchmarks/run.py dsa_decode --index-keys fp8              # the indexer's FP8 keys + scales
    python benchmarks/run.py dsa_decode --small --device cpu          # CPU smoke run
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch

from .common import default_out, device_timer, header, progress, smoke_notice, time_cuda_graph, write_json
from .sparse import dsa_shapes

#: step(C) / step(1) at B >= 8 (ideal 1 / C = 0.125) and the index scoring over a shard (TF/s).
TARGETS = {"ratio": 0.2, "index_tflops": 300.0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    cuda = torch.cuda.is_available()
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if cuda else "cpu")
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--contexts", default=None, help="tokens per sequence (default 131072,1048576; small: 512)")
    p.add_argument("--batches", default=None, help="sequences per step (default 1,8,64; small: 1,2)")
    p.add_argument("--q-lens", default="1,2", help="new tokens per sequence (speculative verification: > 1)")
    p.add_argument("--index-backend", default="auto", choices=("auto", "triton", "gemm"),
                   help="the index scorer over a shard (auto: triton where it runs, else gemm)")
    p.add_argument("--index-keys", choices=("model", "fp8"), default="model",
                   help="index key dtype: the model dtype (bf16 on the GPU) or float8_e4m3fn with a float32 scale "
                        "per key (DeepSeek-V3.2's indexer cache: 132 instead of 256 bytes per key)")
    p.add_argument("--cp", type=int, default=8)
    p.add_argument("--rank", type=int, default=0)
    # 450 GB/s: H100 SXM NVLink 4 per GPU and direction (18 links x 25 GB/s), the nominal rate; a
    # charge at it is a lower bound of the collectives' time (no latency term)
    p.add_argument("--link-gbs", type=float, default=450.0, help="GB/s at which collective bytes are charged")
    p.add_argument("--graph", action="store_true",
                   help="also time CUDA-graph replays of one static step (StaticPlanner plans; CUDA only)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None, help="output path without extension (default bench-out/dsa_decode; "
                                              "CPU smoke run: bench-out/dsa_decode-cpu-smoke)")


def _cache_bytes(keys: int, shp: dict) -> int:
    return keys * (2 * (shp["latent"] + shp["rope"]) + 2 * shp["index_dim"])


def _fits(device: torch.device, keys: int, shp: dict) -> bool:
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info()
    return _cache_bytes(keys, shp) * 1.3 < free


def index_key_cache(local: int, di: int, dtype: torch.dtype, index_keys: str, g, device):
    """This rank's index keys [local, di] and their scales: the model dtype (scales None), or
    ``"fp8"``: e4m3 values of N(0, 1) samples with a float32 scale per key in [0.5, 1.5)."""
    keys = torch.randn(local, di, generator=g, device=device, dtype=dtype)
    if index_keys != "fp8":
        return keys, None
    scale = 0.5 + torch.rand(local, generator=g, device=device)
    return keys.to(torch.float8_e4m3fn), scale


def index_key_bytes(k_idx: torch.Tensor, k_scale) -> int:
    """Bytes of one index key (and its scale)."""
    return k_idx.shape[-1] * k_idx.element_size() + (k_scale.element_size() if k_scale is not None else 0)


def graph_step_fn(c: int, rank: int, ctx: int, b: int, q_len: int, shp: dict, device: torch.device,
                  index_backend: str = "auto", index_keys: str = "model") -> tuple[Callable[[], tuple], dict]:
    """One rank's whole decode step (the work ``_step`` times part by part) over plans of a
    ``StaticPlanner`` sized for this workload, with every input and output in a fixed buffer: the
    callable a CUDA graph captures (it allocates nothing the replay needs and reads no host
    result). The agreement's all-gather is stood in for by a copy of this rank's candidates into
    the [C, N, topk] buffer ``IndexTopkPlan.select`` reads; attention runs over the fixed spread
    selection ``sel`` (as ``_step``'s attend), the merge over C copies of this rank's partial.

    Args:
        c, rank: ranks and this rank. ctx: tokens per sequence after the step. b: sequences.
        q_len: new tokens per sequence. shp: :func:`benchmarks.sparse.dsa_shapes`. device: where
            it runs (any device: the CPU test calls it eagerly). index_backend, index_keys: as
            ``--index-backend`` / ``--index-keys``.

    Returns:
        (step, bufs): ``step()`` -> (sel [N, topk] int64 agreed from the candidates, out [N, H, Dv],
        lse [N, H] float32, merged out [N, H, Dv], merged lse [N, H]); ``bufs`` the fixed inputs
        (``q_idx``, ``w``, ``k_idx``, ``sel``, ``q``, ``latent``) and plans (``iplan``, ``aplan``).
    """
    import cpattn
    from cpattn.merge import merge_states

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hi, di, topk = shp["index_heads"], shp["index_dim"], shp["topk"]
    h, d, dv = shp["heads"], shp["latent"] + shp["rope"], shp["latent"]
    planner = cpattn.StaticPlanner(cpattn.get_strategy("replicated", c), max_tokens=b * q_len, max_seqs=b,
                                   max_kv_tokens=b * ctx, max_q_len=q_len, max_seq_len=ctx, kv=cpattn.KVSharding(c),
                                   device=device)
    meta = planner.plan([q_len] * b, [ctx - q_len] * b, rank=rank, index_topk=topk)
    n, local = meta.num_physical_tokens, meta.num_local_kv_tokens
    g = torch.Generator(device=device).manual_seed(0)
    bufs = dict(q_idx=torch.randn(n, hi, di, generator=g, device=device, dtype=dtype),
                w=torch.randn(n, hi, generator=g, device=device) * hi**-0.5)
    bufs["k_idx"], bufs["k_scale"] = index_key_cache(local, di, dtype, index_keys, g, device)
    sel = (torch.randperm(ctx - q_len + 1, generator=g, device=device)[:topk]).to(torch.int32)
    bufs["sel"] = sel[None].expand(n, -1).contiguous()
    bufs["q"] = torch.randn(n, h, d, generator=g, device=device, dtype=dtype)
    bufs["latent"] = torch.randn(local, 1, d, generator=g, device=device, dtype=dtype)
    iplan = cpattn.plan_index_topk(meta, num_heads=hi, head_dim=di, q_dtype=dtype, k_dtype=bufs["k_idx"].dtype,
                                   topk=topk, has_k_scale=bufs["k_scale"] is not None, backend=index_backend)
    spec = cpattn.AttentionSpec(num_q_heads=h, num_kv_heads=1, head_dim=d, head_dim_v=dv, dtype=dtype, topk=topk)
    aplan = cpattn.plan_attention(meta, spec)
    bufs.update(iplan=iplan, aplan=aplan)
    cand = torch.empty(n, topk, dtype=torch.int64, device=device)
    gathered = torch.empty(c, n, topk, dtype=torch.int64, device=device)
    agreed = torch.empty(n, topk, dtype=torch.int32, device=device)
    out = torch.empty(n, h, dv, dtype=dtype, device=device)
    lse = torch.empty(n, h, dtype=torch.float32, device=device)
    parts = torch.empty(c, n, h, dv, dtype=dtype, device=device)
    lses = torch.empty(c, n, h, dtype=torch.float32, device=device)

    def step() -> tuple:
        iplan.candidates(bufs["q_idx"], bufs["k_idx"], bufs["w"], k_scale=bufs["k_scale"], out=cand)
        gathered.copy_(cand[None].expand(c, -1, -1))  # what the agreement's all-gather writes
        iplan.select(gathered, out=agreed)
        aplan.attend(bufs["q"], bufs["latent"], bufs["latent"][..., :dv], bufs["sel"], softmax_scale=192**-0.5,
                     out=out, lse=lse)
        if c == 1:  # one GPU holds every key: nothing to merge
            return agreed, out, lse, out, lse
        parts.copy_(out[None].expand(c, -1, -1, -1))  # what the merge's all-gather writes
        lses.copy_(lse[None].expand(c, -1, -1))
        return (agreed, out, lse, *merge_states(parts, lses))

    return step, bufs


def _step(c: int, rank: int, ctx: int, b: int, q_len: int, shp: dict, device: torch.device, timer,
          index_backend: str = "auto", index_keys: str = "model") -> dict:
    """Time one rank's decode step compute at C ranks (C = 1: the whole cache on one GPU)."""
    import cpattn
    from cpattn.merge import merge_states

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hi, di, topk = shp["index_heads"], shp["index_dim"], shp["topk"]
    h, d, dv = shp["heads"], shp["latent"] + shp["rope"], shp["latent"]
    meta = cpattn.get_strategy("replicated", c).build_metadata([q_len] * b, [ctx - q_len] * b, rank=rank,
                                                               kv=cpattn.KVSharding(c)).to(device)
    n, local = meta.num_physical_tokens, meta.num_local_kv_tokens
    g = torch.Generator(device=device).manual_seed(0)
    q_idx = torch.randn(n, hi, di, generator=g, device=device, dtype=dtype)
    w = torch.randn(n, hi, generator=g, device=device) * hi**-0.5
    k_idx, k_scale = index_key_cache(local, di, dtype, index_keys, g, device)
    iplan = cpattn.plan_index_topk(meta, num_heads=hi, head_dim=di, q_dtype=dtype, k_dtype=k_idx.dtype, topk=topk,
                                   has_k_scale=k_scale is not None, backend=index_backend)
    cand = torch.empty(n, topk, dtype=torch.int64, device=device)
    t_index = timer(lambda: iplan.candidates(q_idx, k_idx, w, k_scale=k_scale, out=cand))
    gathered = cand[None].expand(c, n, topk).contiguous()
    agreed = torch.empty(n, topk, dtype=torch.int32, device=device)
    t_select = timer(lambda: iplan.select(gathered, out=agreed))
    # the selection: topk distinct positions per row spread over its visible context
    sel = (torch.randperm(ctx - q_len + 1, generator=g, device=device)[:topk]).to(torch.int32)
    sel = sel[None].expand(n, -1).contiguous()
    q = torch.randn(n, h, d, generator=g, device=device, dtype=dtype)
    latent = torch.randn(local, 1, d, generator=g, device=device, dtype=dtype)
    spec = cpattn.AttentionSpec(num_q_heads=h, num_kv_heads=1, head_dim=d, head_dim_v=dv, dtype=dtype, topk=topk)
    aplan = cpattn.plan_attention(meta, spec)
    out = torch.empty(n, h, dv, dtype=dtype, device=device)
    lse = torch.empty(n, h, dtype=torch.float32, device=device)
    t_attend = timer(lambda: aplan.attend(q, latent, latent[..., :dv], sel, softmax_scale=192**-0.5, out=out, lse=lse))
    if c > 1:
        parts, lses = out[None].expand(c, -1, -1, -1).contiguous(), lse[None].expand(c, -1, -1).contiguous()
        t_merge = timer(lambda: merge_states(parts, lses))
    else:
        t_merge = 0.0
    visible = int(meta.local_kv_lens.sum()) * q_len  # every row sees (about) all its local keys
    return dict(index_ms=t_index, select_ms=t_select, attend_ms=t_attend, merge_ms=t_merge,
                index_tflops=2.0 * hi * di * visible / t_index / 1e9 if t_index else 0.0, local_keys=local,
                # every local key's bytes read once per step (rows of one sequence share them)
                index_gbps=local * index_key_bytes(k_idx, k_scale) / t_index / 1e6 if t_index else 0.0,
                rows=n, backend_index=f"{iplan.backend}/{iplan.family}", backend_attend=f"{aplan.backend}/{aplan.family}")


def _run_workload(ctx: int, b: int, q_len: int, args, shp: dict, device: torch.device, timer) -> dict:
    from cpattn import dsa

    c, n, topk = args.cp, b * q_len, shp["topk"]
    name = f"L={ctx // 1024}k B={b} q_len={q_len}" if ctx >= 1024 else f"L={ctx} B={b} q_len={q_len}"
    row = dict(workload=name, context=ctx, batch=b, q_len=q_len, cp=c)
    topk_bytes = dsa.topk_agreement_bytes(n, topk, c)
    merge_bytes = (c - 1) * n * shp["heads"] * (shp["latent"] * 2 + 4)
    rate = args.link_gbs * 1e9 / 1e3  # bytes per ms
    row.update(topk_bytes=topk_bytes, merge_bytes=merge_bytes, topk_ms_charged=topk_bytes / rate,
               merge_ms_charged=merge_bytes / rate)
    progress(f"{name}: C={c} rank {args.rank}")
    part = _step(c, args.rank, ctx, b, q_len, shp, device, timer, args.index_backend, args.index_keys)
    row.update({f"c{c}_{k}": v for k, v in part.items()})
    step = sum(part[k] for k in ("index_ms", "select_ms", "attend_ms", "merge_ms"))
    row[f"c{c}_step_ms"] = step + row["topk_ms_charged"] + row["merge_ms_charged"]
    if args.graph:
        progress(f"{name}: C={c} rank {args.rank}, CUDA graph of one static step")
        fn, _ = graph_step_fn(c, args.rank, ctx, b, q_len, shp, device, args.index_backend, args.index_keys)
        row[f"c{c}_graph_ms"] = time_cuda_graph(fn, warmup=args.warmup, iters=args.iters)
        row[f"c{c}_graph_step_ms"] = row[f"c{c}_graph_ms"] + row["topk_ms_charged"] + row["merge_ms_charged"]
    if _fits(device, b * ctx, shp):
        progress(f"{name}: C=1")
        one = _step(1, 0, ctx, b, q_len, shp, device, timer, args.index_backend, args.index_keys)
        row.update({f"c1_{k}": v for k, v in one.items()})
        row["c1_step_ms"] = sum(one[k] for k in ("index_ms", "select_ms", "attend_ms", "merge_ms"))
        row["ratio"] = row[f"c{c}_step_ms"] / row["c1_step_ms"]
        if args.graph:
            progress(f"{name}: C=1, CUDA graph of one static step")
            fn, _ = graph_step_fn(1, 0, ctx, b, q_len, shp, device, args.index_backend, args.index_keys)
            row["c1_graph_ms"] = time_cuda_graph(fn, warmup=args.warmup, iters=args.iters)
            row["graph_ratio"] = row[f"c{c}_graph_step_ms"] / row["c1_graph_ms"]
    else:
        row["note"] = f"C=1 skipped: {b * ctx} cached tokens ({_cache_bytes(b * ctx, shp) / 2**30:.1f} GiB) do not fit"
        progress(f"{name}: {row['note']}")
    return row


def main(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA device (use --small --device cpu for a smoke run)")
    if not 0 <= args.rank < args.cp:
        raise SystemExit(f"--rank must be in [0, --cp={args.cp})")
    if args.graph and device.type != "cuda":
        raise SystemExit("--graph captures a CUDA graph: it needs --device cuda")
    smoke = device.type == "cpu"
    if smoke:
        smoke_notice("dsa_decode")
    shp = dsa_shapes(args.small)
    contexts = [int(x) for x in (args.contexts or ("512" if args.small else "131072,1048576")).split(",") if x]
    batches = [int(x) for x in (args.batches or ("1,2" if args.small else "1,8,64")).split(",") if x]
    q_lens = [int(x) for x in args.q_lens.split(",") if x]
    timer = device_timer(device, args.iters, args.warmup)
    rows = [_run_workload(ctx, b, q, args, shp, device, timer) for ctx in contexts for b in batches for q in q_lens]
    c = args.cp
    print(f"{'workload':26s} {'C=' + str(c) + ' ms':>10s} {'C=1 ms':>10s} {'ratio':>7s} {'index':>8s} "
          f"{'select':>8s} {'attend':>8s} {'merge':>8s} {'topk MB':>8s} {'merge MB':>9s} {'comm ms':>8s} "
          f"{'idx TF/s':>9s} {'idx GB/s':>9s}")
    for r in rows:
        one = f"{r['c1_step_ms']:10.3f}" if "c1_step_ms" in r else f"{'-':>10s}"
        ratio = f"{r['ratio']:7.3f}" if "ratio" in r else f"{'-':>7s}"
        print(f"{r['workload']:26s} {r[f'c{c}_step_ms']:10.3f} {one} {ratio} {r[f'c{c}_index_ms']:8.3f} "
              f"{r[f'c{c}_select_ms']:8.3f} {r[f'c{c}_attend_ms']:8.3f} {r[f'c{c}_merge_ms']:8.3f} "
              f"{r['topk_bytes'] / 1e6:8.2f} {r['merge_bytes'] / 1e6:9.2f} "
              f"{r['topk_ms_charged'] + r['merge_ms_charged']:8.3f} {r[f'c{c}_index_tflops']:9.1f} "
              f"{r[f'c{c}_index_gbps']:9.0f}")
    if args.graph:  # the same step from CUDA-graph replays, next to the eager sum
        print(f"{'workload':26s} {'eager step':>11s} {'graph':>10s} {'graph step':>11s} {'C=1 graph':>10s} "
              f"{'ratio':>7s}  (steps: with comm charges)")
        for r in rows:
            one = f"{r['c1_graph_ms']:10.3f} {r['graph_ratio']:7.3f}" if "c1_graph_ms" in r else f"{'-':>10s} {'-':>7s}"
            print(f"{r['workload']:26s} {r[f'c{c}_step_ms']:11.3f} {r[f'c{c}_graph_ms']:10.3f} "
                  f"{r[f'c{c}_graph_step_ms']:11.3f} {one}")
    if not smoke:  # the targets: ratio at B >= 8, index TF/s over the shard
        for r in rows:
            verdicts = [f"index {r[f'c{c}_index_tflops']:.0f} TF/s (target >= {TARGETS['index_tflops']:.0f}): "
                        f"{'met' if r[f'c{c}_index_tflops'] >= TARGETS['index_tflops'] else 'missed'}"]
            for key, what in (("ratio", "eager ratio"), ("graph_ratio", "graph ratio")):
                if r["batch"] >= 8 and key in r:
                    verdicts.append(f"{what} {r[key]:.3f} (target <= {TARGETS['ratio']}, ideal {1 / c:.3f}): "
                                    f"{'met' if r[key] <= TARGETS['ratio'] else 'missed'}")
            print(f"{r['workload']:26s} " + "; ".join(verdicts))
    out = args.out or default_out("dsa_decode", smoke=smoke)
    payload = {**header("benchmarks/run.py dsa_decode", smoke=smoke), "shapes": shp, "index_keys": args.index_keys,
               "cp": c, "rank": args.rank,
               "link_gbs": args.link_gbs, **({} if smoke else {"targets": TARGETS}), "rows": rows}
    write_json(out + ".json", payload)
    return 0
