"""Run an unmodified Hugging Face causal LM under cpattn context parallelism and check its logits.

Builds a tiny random-weight model from a config (no download, fp32), runs a packed ragged batch
through it with tokens sharded over C ranks (cpattn's ``"cpattn"`` attention implementation), and
compares the gathered logits with the plain model run one sequence at a time (SDPA). Exits 1 on
mismatch and prints the max difference.

    python examples/hf_cp_prefill.py --model llama --cp 2                 # spawns 2 gloo ranks (CPU)
    python examples/hf_cp_prefill.py --model llama qwen3 deepseek_v3 gpt_oss mimo_v2_flash --cp 3 --strategy interleave
    python examples/hf_cp_prefill.py --model glm_moe_dsa deepseek_v32 --cp 2 --strategy interleave   # DSA
    torchrun --nproc_per_node 2 examples/hf_cp_prefill.py --model qwen3   # NCCL on GPUs, gloo on CPU
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import launch, under_torchrun  # noqa: E402

import cpattn  # noqa: E402

MODELS = ("llama", "qwen3", "deepseek_v3", "gpt_oss", "mimo_v2_flash", "glm_moe_dsa", "deepseek_v32")


def build_model(name: str, seed: int, index_topk: int = 8):
    """A tiny random-weight model of the family ``name`` (fp32, eval mode; reference attention SDPA,
    eager for the models with attention sinks, whose SDPA path transformers does not offer).
    ``index_topk``: keys each query of the DSA models (glm_moe_dsa, deepseek_v32) attends."""
    import transformers as tf

    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        initializer_range=0.1,
        attn_implementation="sdpa",
    )
    if name == "llama":
        cfg, cls = tf.LlamaConfig(num_key_value_heads=2, **common), tf.LlamaForCausalLM
    elif name == "qwen3":
        # GQA 4/2, q/k norm; layer 1 is a sliding-window layer (window 8) to exercise window_size.
        cfg = tf.Qwen3Config(
            num_key_value_heads=2, head_dim=16, use_sliding_window=True, sliding_window=8, max_window_layers=1, **common
        )
        cls = tf.Qwen3ForCausalLM
    elif name == "deepseek_v3":
        # MLA: q/k head dim 16 + 8 (rope) = 24, v head dim 16; layer 1 is MoE (4 experts, top 2).
        cfg = tf.DeepseekV3Config(
            num_key_value_heads=4,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            **common,
        )
        cls = tf.DeepseekV3ForCausalLM
    elif name == "gpt_oss":
        # attention sinks (s_aux) on every layer, layer 0 sliding-window (window 8), MoE (4 experts, top 2).
        common.update(intermediate_size=64, attn_implementation="eager")
        cfg = tf.GptOssConfig(
            num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8, **common
        )
        cls = tf.GptOssForCausalLM
    elif name == "mimo_v2_flash":
        # The MiMo-V2 architecture (the MiMo seed): hybrid full / sliding-window layers, sinks on the
        # sliding layers (which have twice the K/V heads), q/k head dim 24 and v head dim 16 (the real
        # config has D 192 / Dv 128), partial RoPE, layer 1 MoE (4 experts, top 2).
        common.update(attn_implementation="eager")
        cfg = tf.MiMoV2FlashConfig(
            num_key_value_heads=1,
            head_dim=24,
            v_head_dim=16,
            layer_types=["full_attention", "sliding_attention"],
            mlp_layer_types=["dense", "sparse"],
            sliding_window=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            **common,
        )
        cls = tf.MiMoV2FlashForCausalLM
    elif name in ("glm_moe_dsa", "deepseek_v32"):
        # DSA: MLA (q/k 16 + 8 rope, v 16) + a lightning indexer of 16 heads x 16 selecting top-k keys;
        # glm_moe_dsa's layer 1 reuses layer 0's selection ("shared"); layers 1-2 MoE (4 experts, top 2).
        dsa = dict(
            num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            n_group=1, topk_group=1, first_k_dense_replace=1, index_topk=index_topk, index_head_dim=16,
            index_n_heads=16,
        )
        common.update(num_hidden_layers=3)
        if name == "glm_moe_dsa":
            cfg, cls = tf.GlmMoeDsaConfig(indexer_types=["full", "shared", "full"], **dsa, **common), \
                tf.GlmMoeDsaForCausalLM
        else:
            cfg, cls = tf.DeepseekV32Config(**dsa, **common), tf.DeepseekV32ForCausalLM
    else:
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for module in model.modules():  # sinks of unit scale, so they change the softmax visibly
            sinks = getattr(module, "sinks", None)
            if isinstance(sinks, torch.nn.Parameter):
                sinks.normal_(generator=torch.Generator().manual_seed(seed))
    return model


@torch.no_grad()
def run_rank(rank: int, world_size: int, device, models, strategy_name: str, lens, seed: int,
             index_topk: int = 8) -> dict:
    """Every rank: plain logits vs CP logits for each model; returns {model: max |diff|}."""
    from cpattn.integrations import hf as cphf

    group = None  # the default process group is the CP group here (None also works at C = 1)
    strategy = cpattn.get_strategy(strategy_name, world_size, pad_multiple=8)
    # Plan once per forward (host), then move the plan to the device.
    # group=: the ranks agree on the plan (one tiny all-gather) or all raise (C > 1)
    meta = strategy.build_metadata(lens, rank=rank, group=dist.group.WORLD if world_size > 1 else None).to(device)
    gen = torch.Generator().manual_seed(seed + 1)
    input_ids = torch.randint(0, 256, (1, sum(lens)), generator=gen).to(device)  # packed batch [1, T]
    diffs = {}
    for name in models:
        model = build_model(name, seed, index_topk=index_topk).to(device)
        # Reference: the unmodified model, one sequence at a time (an empty sequence has no logits:
        # the model is not run on zero tokens).
        vocab = model.config.vocab_size
        ref = torch.cat([torch.zeros(1, 0, vocab, device=device)] + [
            model(input_ids=x, use_cache=False).logits for x in input_ids.split(list(lens), 1) if x.shape[1]
        ], dim=1)

        cphf.enable(model)  # attn_implementation = "cpattn"
        # Shard at the model boundary: ids and global position ids [1, T] -> [1, P] (pad: id 0, pos 0).
        inputs = cphf.shard_inputs(strategy, meta, input_ids=input_ids)
        with cphf.cp_context(strategy, meta, group):
            logits_local = model(**inputs).logits  # [1, P, vocab]; each layer gathers K/V once
        # Gather before use: [1, T, vocab] in logical order on every rank, pad rows dropped.
        logits = cphf.gather_outputs(strategy, meta, logits_local, group)
        diffs[name] = float((logits - ref).abs().max())
    return diffs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", choices=MODELS, default=["llama"])
    p.add_argument("--cp", type=int, default=2, help="CP ranks to spawn (ignored under torchrun)")
    p.add_argument("--strategy", default="zigzag", choices=sorted(cpattn.STRATEGIES))
    p.add_argument("--lens", default="37,1,20,9", help="comma-separated sequence lengths of the batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--index-topk", type=int, default=8, help="top-k of the DSA models' indexer")
    p.add_argument("--atol", type=float, default=1e-4)
    p.add_argument("--cpu", action="store_true", help="use CPU/gloo even if CUDA is available")
    args = p.parse_args(argv)
    try:
        lens = [int(x) for x in args.lens.split(",")]
    except ValueError:
        p.error(f"--lens must be comma-separated integers, got {args.lens!r}")
    if any(n < 0 for n in lens) or not sum(lens):
        p.error(f"--lens must be >= 0 with at least one token in the batch (empty sequences are fine), got {lens}")
    use_cuda = torch.cuda.is_available() and not args.cpu
    results = launch(run_rank, args.cp, args.model, args.strategy, lens, args.seed, args.index_topk, use_cuda=use_cuda)
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.cp
    ok = True
    for rank_offset, diffs in enumerate(results):
        rank = int(os.environ["RANK"]) if under_torchrun() else rank_offset
        for name, diff in diffs.items():
            good = diff <= args.atol
            ok &= good
            if rank == 0 or not good:
                print(
                    f"{name:12s} cp={world} {args.strategy:10s} rank {rank}: max|logits - plain| = {diff:.3e} "
                    f"{'OK' if good else f'MISMATCH (atol {args.atol})'}"
                )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
