"""Hugging Face plug-in: unmodified Llama / Qwen3 (GQA, sliding window) / DeepseekV3 (MLA) under CP."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

import cpattn  # noqa: E402
from cpattn.integrations import hf as cphf  # noqa: E402
from dist_utils import CountCollectives, run_distributed  # noqa: E402

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
SCRIPT = os.path.join(EXAMPLES, "hf_cp_prefill.py")
sys.path.insert(0, EXAMPLES)
import hf_cp_prefill  # noqa: E402

MODELS = ("llama", "qwen3", "deepseek_v3")


@pytest.mark.slow
def test_script_cp2_all_models():
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--model", *MODELS, "--cp", "2", "--cpu"], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in MODELS:
        line = next(line for line in proc.stdout.splitlines() if line.startswith(name))
        assert "max|logits - plain|" in line and line.endswith("OK"), line


def test_script_exit_code_single_rank():
    assert hf_cp_prefill.main(["--model", "llama", "--cp", "1", "--cpu"]) == 0
    assert hf_cp_prefill.main(["--model", "llama", "--cp", "1", "--cpu", "--atol", "-1"]) == 1  # forced mismatch


def _count_worker(rank: int, world: int) -> tuple[int, float]:
    with CountCollectives() as counter:
        diffs = hf_cp_prefill.run_rank(rank, world, torch.device("cpu"), ["llama"], "zigzag", [19, 2, 11], 0)
    return len(counter.calls), diffs["llama"]


@pytest.mark.slow
def test_one_collective_per_layer_plus_logits():
    for calls, diff in run_distributed(_count_worker, 2):
        assert calls == 2 + 1  # 2 layers x one K/V all-gather, one logits gather
        assert diff < 1e-4


# ---------------------------------------------------------------------------------------- C = 1
def _llama():
    return hf_cp_prefill.build_model("llama", seed=0)


def test_shard_inputs_and_gather_outputs_single_rank():
    s = cpattn.ZigzagStrategy(1, pad_multiple=8)
    meta = s.build_metadata([5, 4], rank=0)
    ids = torch.arange(1, 10).unsqueeze(0)
    inputs = cphf.shard_inputs(s, meta, input_ids=ids)
    assert inputs["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9] + [0] * 7]
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3] + [0] * 7]
    assert inputs["use_cache"] is False
    assert cphf.packed_position_ids(meta).tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    flat = cphf.shard_inputs(s, meta, input_ids=ids[0])  # [T] accepted too
    assert torch.equal(flat["input_ids"], inputs["input_ids"])
    out = cphf.gather_outputs(s, meta, inputs["input_ids"].unsqueeze(-1).float())
    assert out.shape == (1, 9, 1) and out[0, :, 0].tolist() == list(range(1, 10))


def test_inputs_embeds_single_rank_matches_plain():
    model = _llama()
    s = cpattn.InterleaveStrategy(1, pad_multiple=4)
    meta = s.build_metadata([6, 3], rank=0)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = torch.cat([model(input_ids=x).logits for x in ids.split([6, 3], 1)], 1)
        cphf.enable(model)
        inputs = cphf.shard_inputs(s, meta, inputs_embeds=model.get_input_embeddings()(ids))
        with cphf.cp_context(s, meta) as ctx:
            assert ctx.strategy is s
            out = cphf.gather_outputs(s, meta, model(**inputs).logits)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def test_errors():
    model = cphf.enable(_llama())
    s = cpattn.ZigzagStrategy(1)
    meta = s.build_metadata([4], rank=0)
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(RuntimeError, match="needs a CP context"):
        model(input_ids=ids)
    with pytest.raises(ValueError, match="exactly one of"):
        cphf.shard_inputs(s, meta)
    with pytest.raises(ValueError, match=r"input_ids must be \[1, num_tokens T=4"):
        cphf.shard_inputs(s, meta, input_ids=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="prefix_lens must be 0"):
        with cphf.cp_context(s, s.build_metadata([4], [2], rank=0)):
            pass
    with pytest.raises(TypeError, match="CPStrategy"):
        with cphf.cp_context("zigzag", meta):
            pass
    with pytest.raises(ValueError, match="not by"):
        with cphf.cp_context(cpattn.InterleaveStrategy(1), meta):
            pass
    with pytest.raises(ValueError, match=r"query must be \[1, heads, P=4"):
        with cphf.cp_context(s, meta):
            model(input_ids=torch.zeros(1, 5, dtype=torch.long), use_cache=False)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="explicit attention_mask"):
        with cphf.cp_context(s, meta):
            model(**cphf.shard_inputs(s, meta, input_ids=ids), attention_mask=mask)


def test_gpt_oss_sinks_and_sliding_window_single_rank():
    """s_aux (attention sinks) and sliding_window pass through (gpt-oss: both on its first layer)."""
    import transformers as tf

    cfg = tf.GptOssConfig(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        initializer_range=0.1, attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = tf.GptOssForCausalLM(cfg).eval()
    lens = [20, 9]
    ids = torch.randint(0, 256, (1, sum(lens)), generator=torch.Generator().manual_seed(1))
    s = cpattn.ZigzagStrategy(1, pad_multiple=8)
    meta = s.build_metadata(lens, rank=0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()
        ref = torch.cat([model(input_ids=x).logits for x in ids.split(lens, 1)], 1)
        cphf.enable(model)
        with cphf.cp_context(s, meta):
            out = cphf.gather_outputs(s, meta, model(**cphf.shard_inputs(s, meta, input_ids=ids)).logits)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
