"""``python benchmarks/run.py hfgen``: Hugging Face ``generate`` with cpattn's sharded KV cache vs
transformers' own, on one GPU at C = 1.

Builds a real-size config of the family (random weights, ``--layers`` decoder layers, bf16) and
times greedy ``model.generate`` of ``--new-tokens`` tokens after a ``--prompt``-token prompt two
ways: transformers' own path (its attention implementation, ``DynamicCache``) and cpattn's
(``cphf.enable(model)`` + ``cphf.ShardedKVCache``: the prompt through the CP prefill path, every
decode step through the ``"shard_merge"`` plan over the paged cache) with one rank and no process
group, so the numbers are the code path's overhead, not CP's gain. Reports prefill time, decode
tokens/s, cache bytes and whether the greedy tokens agree (bf16: they may part after a near-tie).

    python benchmarks/run.py hfgen --model llama --layers 4 --prompt 4096 --new-tokens 128
    python benchmarks/run.py hfgen --model gpt_oss mimo_v2_flash deepseek_v3 --layers 2
    python benchmarks/run.py hfgen --model deepseek_v32 glm_moe_dsa --layers 2 --prompt 8192

On the CPU it is a smoke run (the tiny test configs, fp32, a short prompt).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from .common import default_out, header, progress, smoke_notice, write_json

MODELS = ("llama", "qwen3", "deepseek_v3", "gpt_oss", "mimo_v2_flash", "deepseek_v32", "glm_moe_dsa")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", nargs="+", choices=MODELS, default=["llama"])
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the real-size config")
    p.add_argument("--prompt", type=int, default=4096, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--page-size", type=int, default=64, help="ShardedKVCache page size")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per path (the best is kept)")
    p.add_argument("--out", default=None, help="output path without extension")


def real_config(name: str, layers: int):
    """(config, model class) of a real-size model of the family with ``layers`` layers: Llama-3-8B,
    Qwen3-8B, DeepSeek-V3 (MLA; dense MLPs so it fits one GPU), gpt-oss-20b, MiMo-V2-Flash (dense
    MLPs), DeepSeek-V3.2 and GLM-5 (DSA: MLA + indexer, top-k 2048; dense MLPs; GLM's default
    full / shared indexer schedule). Attention is transformers' SDPA, eager for the models with sinks."""
    import transformers as tf

    if name == "llama":
        cfg = tf.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                             num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                             max_position_embeddings=131072, attn_implementation="sdpa")
        return cfg, tf.LlamaForCausalLM
    if name == "qwen3":
        cfg = tf.Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=layers,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                             max_position_embeddings=131072, attn_implementation="sdpa")
        return cfg, tf.Qwen3ForCausalLM
    if name == "deepseek_v3":
        cfg = tf.DeepseekV3Config(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                                  num_hidden_layers=layers, first_k_dense_replace=layers, num_attention_heads=128,
                                  num_key_value_heads=128, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                                  qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=163840,
                                  attn_implementation="sdpa")
        return cfg, tf.DeepseekV3ForCausalLM
    if name == "gpt_oss":
        cfg = tf.GptOssConfig(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=layers,
                              num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                              num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072,
                              attn_implementation="eager")
        return cfg, tf.GptOssForCausalLM
    if name == "mimo_v2_flash":
        kinds = ["full_attention" if i % 6 == 0 else "sliding_attention" for i in range(layers)]
        cfg = tf.MiMoV2FlashConfig(vocab_size=152576, hidden_size=4096, intermediate_size=16384,
                                   num_hidden_layers=layers, num_attention_heads=64, num_key_value_heads=4,
                                   head_dim=192, v_head_dim=128, layer_types=kinds,
                                   mlp_layer_types=["dense"] * layers, sliding_window=128,
                                   max_position_embeddings=131072, attn_implementation="eager")
        return cfg, tf.MiMoV2FlashForCausalLM
    if name == "deepseek_v32":
        cfg = tf.DeepseekV32Config(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                                   num_hidden_layers=layers, first_k_dense_replace=layers, num_attention_heads=128,
                                   num_key_value_heads=128, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                                   qk_nope_head_dim=128, v_head_dim=128, index_topk=2048, index_head_dim=128,
                                   index_n_heads=64, max_position_embeddings=163840, attn_implementation="sdpa")
        return cfg, tf.DeepseekV32ForCausalLM
    if name == "glm_moe_dsa":
        cfg = tf.GlmMoeDsaConfig(num_hidden_layers=layers, first_k_dense_replace=layers, attn_implementation="sdpa")
        return cfg, tf.GlmMoeDsaForCausalLM
    raise ValueError(f"model must be one of {MODELS}, got {name!r}")


def _build(name: str, layers: int, smoke: bool, device: torch.device):
    if smoke:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
        from hf_cp_prefill import build_model

        return build_model(name, seed=0)
    cfg, cls = real_config(name, layers)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            model = cls(cfg).eval()
    finally:
        torch.set_default_dtype(previous)
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(model, ids, device, new_tokens: int, cache_factory) -> tuple[float, list[int], object]:
    from cpattn.integrations import hf as cphf

    cache = cache_factory()
    kw = {cphf.cache_keyword(model): cache}  # "cache" (transformers 5) or "past_key_values"
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0, **kw)
    _sync(device)
    return time.perf_counter() - t0, out[0, ids.shape[1]:].tolist(), cache


def _path(model, ids, device, args, cache_factory) -> dict:
    """Best-of-repeats prefill time (generate of 1 token) and full generate (after one warm-up
    generate: kernel compilation, allocator); decode tokens/s from their difference."""
    _timed(model, ids, device, min(args.new_tokens, 4), cache_factory)
    prefill = min(_timed(model, ids, device, 1, cache_factory)[0] for _ in range(args.repeats))
    runs = [_timed(model, ids, device, args.new_tokens, cache_factory) for _ in range(args.repeats)]
    total, tokens, cache = min(runs, key=lambda r: r[0])
    decode_s = max(total - prefill, 1e-9)
    return {"prefill_s": prefill, "generate_s": total, "decode_tokens_per_s": (args.new_tokens - 1) / decode_s,
            "tokens": tokens, "cache": cache}


def _cache_bytes(cache) -> int:
    local = getattr(cache, "local_bytes", None)
    if callable(local):
        return local()
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (layer.keys, layer.values, getattr(layer, "indexer_keys", None)) if isinstance(t, torch.Tensor))


def main(args: argparse.Namespace) -> int:
    from transformers import DynamicCache

    from cpattn.integrations import hf as cphf

    smoke = not torch.cuda.is_available()
    if smoke:
        smoke_notice("hfgen")
    device = torch.device("cpu" if smoke else "cuda")
    prompt = min(args.prompt, 48) if smoke else args.prompt
    new_tokens = min(args.new_tokens, 8) if smoke else args.new_tokens
    args = argparse.Namespace(**{**vars(args), "prompt": prompt, "new_tokens": new_tokens})
    out = args.out or default_out("hfgen", smoke)
    rows = []
    for name in args.model:
        model = _build(name, args.layers, smoke, device)
        vocab = model.config.vocab_size
        ids = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(1)).to(device)
        progress(f"{name}: transformers' own path ({model.config._attn_implementation}, DynamicCache)")
        own = _path(model, ids, device, args, lambda: DynamicCache(config=model.config))
        cphf.enable(model)
        progress(f"{name}: cpattn's sharded-cache path (C = 1)")
        ours = _path(model, ids, device, args, lambda: cphf.ShardedKVCache(model.config, page_size=args.page_size))
        agree = next((i for i, (a, b) in enumerate(zip(own["tokens"], ours["tokens"])) if a != b), len(own["tokens"]))
        row = {"model": name, "layers": model.config.num_hidden_layers, "prompt": prompt, "new_tokens": new_tokens,
               "dtype": str(next(model.parameters()).dtype), "tokens_agree": agree}
        for key, r in (("transformers", own), ("cpattn", ours)):
            row[key] = {k: r[k] for k in ("prefill_s", "generate_s", "decode_tokens_per_s")}
            row[key]["cache_bytes"] = _cache_bytes(r["cache"])
        rows.append(row)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    payload = {**header("benchmarks/run.py hfgen " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in (
        ("model", " ".join(args.model)), ("layers", args.layers), ("prompt", prompt), ("new_tokens", new_tokens))),
        smoke), "rows": rows}
    write_json(out + ".json", payload)
    print("| model | layers | prompt | prefill ms (transformers / cpattn) | decode tokens/s (transformers / cpattn) "
          "| cache MiB (transformers / cpattn) | greedy tokens equal |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        a, b = r["transformers"], r["cpattn"]
        print(f"| {r['model']} | {r['layers']} | {r['prompt']} | "
              f"{a['prefill_s'] * 1e3:.1f} / {b['prefill_s'] * 1e3:.1f} "
              f"| {a['decode_tokens_per_s']:.1f} / {b['decode_tokens_per_s']:.1f} | {a['cache_bytes'] / 2**20:.1f} / "
              f"{b['cache_bytes'] / 2**20:.1f} | {r['tokens_agree']} of {r['new_tokens']} |")
    return 0
