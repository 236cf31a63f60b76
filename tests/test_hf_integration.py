"""Hugging Face plug-in: unmodified Llama / Qwen3 (GQA, sliding window) / DeepseekV3 (MLA) / gpt-oss and
MiMo-V2-Flash (sinks, hybrid sliding window) under CP; what it cannot run exactly is refused."""

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


def returned_cache(out):
    """The cache a transformers forward returned (``out.cache``; ``past_key_values`` in releases
    before the rename)."""
    return out.cache if hasattr(out, "cache") else out.past_key_values


MODELS = ("llama", "qwen3", "deepseek_v3", "gpt_oss", "mimo_v2_flash")


@pytest.mark.slow
def test_script_cp2_all_models():
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--model", *MODELS, "--cp", "2", "--cpu"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in MODELS:
        line = next(line for line in proc.stdout.splitlines() if line.split()[0] == name)
        assert "max|logits - plain|" in line and line.endswith("OK"), line


def test_script_exit_code_single_rank():
    assert hf_cp_prefill.main(["--model", "llama", "--cp", "1", "--cpu"]) == 0
    assert hf_cp_prefill.main(["--model", "llama", "--cp", "1", "--cpu", "--atol", "-1"]) == 1  # forced mismatch


def _count_worker(rank: int, world: int) -> tuple[int, float]:
    with CountCollectives() as counter:
        diffs = hf_cp_prefill.run_rank(rank, world, torch.device("cpu"), ["llama"], "zigzag", [19, 2, 11], 0)
    fingerprints = sum(1 for shape in counter.calls if len(shape) == 1)  # the plan agreement: 1-D int64
    return len(counter.calls) - fingerprints, fingerprints, diffs["llama"]


@pytest.mark.slow
def test_one_collective_per_layer_plus_logits():
    for calls, fingerprints, diff in run_distributed(_count_worker, 2):
        assert calls == 2 + 1  # 2 layers x one K/V all-gather, one logits gather
        assert fingerprints == 1  # plus the one plan agreement of the forward (plan time)
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


# ---------------------------------------------------------------------------------------- refused
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, initializer_range=0.1)


def _qwen3_next():
    """Gated DeltaNet (linear attention) + full attention: before, CP logits were off by 4.4 (C = 2)."""
    import transformers as tf

    cfg = tf.Qwen3NextConfig(
        head_dim=16, layer_types=["linear_attention", "full_attention"], num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, **TINY,
    )
    return tf.Qwen3NextForCausalLM(cfg).eval()


def _lfm2():
    """Short convolution + full attention: before, CP logits were off by 3.3 (C = 2)."""
    import transformers as tf

    return tf.Lfm2ForCausalLM(tf.Lfm2Config(layer_types=["conv", "full_attention"], **TINY)).eval()


def _llama_with_conv():
    """No layer_types at all: a convolution mixer found among the decoder's modules."""
    model = _llama()
    model.model.layers[1].token_mixer = torch.nn.Conv1d(64, 64, 3, groups=64)
    return model


def _gemma2():
    import transformers as tf

    return tf.Gemma2ForCausalLM(tf.Gemma2Config(head_dim=16, **TINY)).eval()


@pytest.mark.parametrize(
    "build, match",
    [
        (_qwen3_next, r"layer_types has token mixers other than attention at layers \[0\]: \['linear_attention'\]"),
        (_lfm2, r"layer_types has token mixers other than attention at layers \[0\]: \['conv'\]"),
        (_llama_with_conv, r"module layers\.1\.token_mixer \(Conv1d\) mixes tokens"),
        (_gemma2, r"attn_logit_softcapping=50\.0"),
    ],
)
def test_enable_refuses_what_it_cannot_run_exactly(build, match):
    model = build()
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match=match):
        cphf.enable(model)
    assert model.config._attn_implementation == before  # nothing changed
    assert not getattr(model.get_decoder(), "_cpattn_hooked", False)
    with pytest.raises(ValueError, match="cannot run exactly"):
        cphf.check_model(model)


def test_supported_models_pass_the_check():
    for name in MODELS:
        cphf.check_model(hf_cp_prefill.build_model(name, seed=0))


def test_padding_mask_with_zeros_is_rejected():
    model = cphf.enable(_llama())
    s = cpattn.ZigzagStrategy(1, pad_multiple=8)
    meta = s.build_metadata([6, 3], rank=0)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(1, 9, dtype=torch.long)
    mask[0, 7] = 0
    with pytest.raises(ValueError, match=r"shard_inputs: attention_mask of shape \(1, 9\) has 1 zero"):
        cphf.shard_inputs(s, meta, input_ids=ids, attention_mask=mask)
    inputs = cphf.shard_inputs(s, meta, input_ids=ids, attention_mask=torch.ones(9, dtype=torch.long))
    assert "attention_mask" not in inputs
    with torch.no_grad(), cphf.cp_context(s, meta):
        ref = model(**inputs).logits
        with CountCollectives() as counter:
            with pytest.raises(ValueError, match="the forward: attention_mask of shape \\(1, 16\\) has 9 zero"):
                model(**inputs, attention_mask=torch.arange(16).lt(7).long().unsqueeze(0))  # 7 real + 9 pad
        assert counter.calls == []
        out = model(**inputs, attention_mask=torch.ones(1, 16, dtype=torch.long)).logits  # all ones: fine
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_model_not_prepared_by_enable_is_refused():
    import transformers as tf

    cphf.register()
    cfg = tf.LlamaConfig(**TINY, attn_implementation=cphf.ATTN_IMPLEMENTATION)
    model = tf.LlamaForCausalLM(cfg).eval()
    s = cpattn.ZigzagStrategy(1)
    meta = s.build_metadata([4], rank=0)
    with torch.no_grad(), cphf.cp_context(s, meta):
        with pytest.raises(RuntimeError, match=r"enable\(model\)"):
            model(**cphf.shard_inputs(s, meta, input_ids=torch.zeros(1, 4, dtype=torch.long)))


# ---------------------------------------------------------------------------------------- use_cache
def _plain_cache(model, ids):
    with torch.no_grad():
        return returned_cache(model(input_ids=ids, use_cache=True))


def _max_cache_diff(a, b) -> float:
    assert len(a.layers) == len(b.layers)
    diff = 0.0
    for la, lb in zip(a.layers, b.layers):
        assert type(la) is type(lb) and la.keys.shape == lb.keys.shape and la.values.shape == lb.values.shape
        assert la.get_seq_length() == lb.get_seq_length()
        diff = max(diff, float((la.keys - lb.keys).abs().max()), float((la.values - lb.values).abs().max()))
    return diff


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_use_cache_holds_the_logical_kv_single_rank(name):
    """C = 1 with pad rows (P = 24 > T = 19): before, the cache held the 24 physical rows."""
    model = hf_cp_prefill.build_model(name, seed=0)
    ids = torch.randint(0, 256, (1, 19), generator=torch.Generator().manual_seed(2))
    ref = _plain_cache(model, ids)
    cphf.enable(model)
    s = cpattn.InterleaveStrategy(1, pad_multiple=8)
    meta = s.build_metadata([19], rank=0)
    with torch.no_grad(), cphf.cp_context(s, meta):
        out = model(**cphf.shard_inputs(s, meta, input_ids=ids, use_cache=True))
    assert returned_cache(out).get_seq_length() == 19
    assert _max_cache_diff(returned_cache(out), ref) < 1e-5


def test_use_cache_errors():
    model = cphf.enable(_llama())
    s = cpattn.ZigzagStrategy(1)
    two = s.build_metadata([3, 2], rank=0)
    ids = torch.zeros(1, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="use_cache=True needs a single sequence.*got 2 packed sequences"):
        cphf.shard_inputs(s, two, input_ids=ids, use_cache=True)
    with pytest.raises(TypeError, match="use_cache must be a bool"):
        cphf.shard_inputs(s, two, input_ids=ids, use_cache=1)
    inputs = cphf.shard_inputs(s, two, input_ids=ids)
    with torch.no_grad(), cphf.cp_context(s, two):
        with pytest.raises(ValueError, match="got 2 packed sequences"):
            model(**{**inputs, "use_cache": True})
    one = s.build_metadata([5], rank=0)
    inputs = cphf.shard_inputs(s, one, input_ids=ids, use_cache=True)
    full = _plain_cache(_llama(), ids)
    with torch.no_grad(), cphf.cp_context(s, one):
        with pytest.raises(ValueError, match="already holds 5 tokens"):
            model(**inputs, **{cphf.cache_keyword(model): full})
        with pytest.raises(ValueError, match="with use_cache=False"):
            model(**{**inputs, "use_cache": False}, **{cphf.cache_keyword(model): full})


GENERATE_MODELS = ("llama", "qwen3", "mimo_v2_flash")


def _generate_worker(rank: int, world: int) -> dict:
    """Greedy generation: CP prefill (use_cache) then plain decode from that cache == plain model."""
    results = {}
    ids = torch.randint(0, 256, (1, 21), generator=torch.Generator().manual_seed(7))
    for name in GENERATE_MODELS:
        model = hf_cp_prefill.build_model(name, seed=1)
        plain_impl = model.config._attn_implementation
        with torch.no_grad():
            plain = model.generate(ids, max_new_tokens=6, do_sample=False)
            ref_cache = _plain_cache(model, ids)
        s = cpattn.ZigzagStrategy(world, pad_multiple=8)
        meta = s.build_metadata([21], rank=rank)
        cphf.enable(model)
        with torch.no_grad():
            with cphf.cp_context(s, meta):
                out = model(**cphf.shard_inputs(s, meta, input_ids=ids, use_cache=True))
            logits = cphf.gather_outputs(s, meta, out.logits)
            kv_diff = _max_cache_diff(returned_cache(out), ref_cache)
            first = logits[:, -1:].argmax(-1)
            model.set_attn_implementation(plain_impl)  # decode WITHOUT CP, from the CP prefill's cache
            gen = model.generate(torch.cat([ids, first], 1), **{cphf.cache_keyword(model): returned_cache(out)}, max_new_tokens=5, do_sample=False)
        results[name] = (plain[0, 21:].tolist(), gen[0, 21:].tolist(), kv_diff)
    return results


@pytest.mark.slow
def test_generate_after_cp_prefill_matches_plain_model():
    for rank_results in run_distributed(_generate_worker, 2):
        for name, (plain, cp_then_plain, kv_diff) in rank_results.items():
            assert cp_then_plain == plain, f"{name}: {cp_then_plain} != {plain}"
            assert len(plain) == 6
            assert kv_diff < 1e-5, f"{name}: cache K/V differ from the plain prefill's by {kv_diff}"
