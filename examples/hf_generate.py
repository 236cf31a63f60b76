"""``model.generate`` of an unmodified Hugging Face causal LM on C processes over a SHARDED KV cache.

Every rank holds 1/C of every layer's keys (``cphf.ShardedKVCache``); the prompt's forward runs
under CP (tokens sharded, each rank stores the keys it owns), every decode step computes the new
token on every rank over the sharded cache and merges the ranks' partial attention exactly (one
collective per layer). Builds a tiny random-weight model (no download, fp32), generates greedily
on C ranks, and checks the tokens equal the plain model's (``generate`` with transformers' own
cache on one process). Prints tokens/s and each rank's cache bytes (and the plain cache's); exits
1 on a mismatch.

    python examples/hf_generate.py --model llama --cp 2                  # spawns 2 gloo ranks (CPU)
    python examples/hf_generate.py --model qwen3 gpt_oss mimo_v2_flash deepseek_v3 --cp 3 --prompt 200
    python examples/hf_generate.py --model deepseek_v32 glm_moe_dsa --cp 2   # DSA: sharded index keys too
    torchrun --nproc_per_node 2 examples/hf_generate.py --model llama   # NCCL on GPUs, gloo on CPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import launch, under_torchrun  # noqa: E402
from hf_cp_prefill import build_model  # noqa: E402

MODELS = ("llama", "qwen3", "deepseek_v3", "gpt_oss", "mimo_v2_flash", "deepseek_v32", "glm_moe_dsa")


def _timed_generate(model, ids, device, cache, **kwargs) -> tuple[list[int], float]:
    from cpattn.integrations import hf as cphf

    kwargs[cphf.cache_keyword(model)] = cache  # "cache" (transformers 5) or "past_key_values"
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, pad_token_id=0, **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out[0, ids.shape[1]:].tolist(), time.perf_counter() - t0


def run_rank(rank: int, world_size: int, device, models, prompt_len: int, new_tokens: int, page_size: int,
             seed: int) -> dict:
    """Every rank: plain generate (transformers' DynamicCache, one process) and sharded-cache
    generate (C processes) of each model; returns {model: {...}}."""
    from transformers import DynamicCache

    from cpattn.integrations import hf as cphf

    ids = torch.randint(0, 256, (1, prompt_len), generator=torch.Generator().manual_seed(seed + 1)).to(device)
    results = {}
    for name in models:
        model = build_model(name, seed).to(device)
        plain_cache = DynamicCache(config=model.config)
        plain, plain_s = _timed_generate(model, ids, device, max_new_tokens=new_tokens, cache=plain_cache)
        plain_bytes = sum(t.numel() * t.element_size() for x in plain_cache.layers
                          for t in (x.keys, x.values, getattr(x, "indexer_keys", None)) if t is not None)
        cphf.enable(model)  # attn_implementation = "cpattn"
        # The cache: this rank's 1/C of every layer's keys, in pages (group None: the default group).
        cache = cphf.ShardedKVCache(model.config, page_size=page_size)
        tokens, seconds = _timed_generate(model, ids, device, max_new_tokens=new_tokens, cache=cache)
        results[name] = dict(tokens=tokens, plain=plain, seconds=seconds, plain_seconds=plain_s,
                             cache_bytes=cache.local_bytes(), plain_bytes=plain_bytes, cached=cache.num_tokens)
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", choices=MODELS, default=["llama"])
    p.add_argument("--cp", type=int, default=2, help="CP ranks to spawn (ignored under torchrun)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="use CPU/gloo even if CUDA is available")
    args = p.parse_args(argv)
    if args.prompt < 1 or args.new_tokens < 1 or args.cp < 1:
        p.error("--prompt, --new-tokens and --cp must be >= 1")
    use_cuda = torch.cuda.is_available() and not args.cpu
    results = launch(run_rank, args.cp, args.model, args.prompt, args.new_tokens, args.page_size, args.seed,
                     use_cuda=use_cuda)
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.cp
    ok = True
    for offset, per_model in enumerate(results):
        rank = int(os.environ["RANK"]) if under_torchrun() else offset
        for name, r in per_model.items():
            same = r["tokens"] == r["plain"]
            ok &= same
            if rank == 0 or not same:
                n = len(r["tokens"])
                print(f"{name:14s} cp={world} rank {rank}: {n / r['seconds']:8.1f} tokens/s "
                      f"(plain {n / r['plain_seconds']:.1f}), cache {r['cache_bytes']} B on this rank "
                      f"(plain {r['plain_bytes']} B, {r['cached']} tokens) "
                      f"{'OK' if same else 'MISMATCH ' + str(r['tokens']) + ' != ' + str(r['plain'])}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
