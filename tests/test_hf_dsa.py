"""Hugging Face DSA models (transformers' glm_moe_dsa with a "shared" indexer layer, deepseek_v32)
unmodified under CP through the plug-in: logits equal the plain model (C = 2, 3; interleave and
zigzag; top-k below and above the sequence lengths), collectives per layer counted, the
selection matters (top-k 8 and 64 give different logits), and a CP prefill's cache decodes
like the plain model's."""

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
sys.path.insert(0, EXAMPLES)
import hf_cp_prefill  # noqa: E402
from test_hf_integration import returned_cache  # noqa: E402

DSA_MODELS = ("glm_moe_dsa", "deepseek_v32")
LENS = [37, 1, 20, 9]  # top-k 8: below three of them, above one; top-k 64: above all
ATOL = 1e-4


def _logits_worker(rank: int, world: int) -> dict:
    out = {}
    for strategy in ("interleave", "zigzag"):
        for topk in (8, 64):
            with CountCollectives() as counter:
                diffs = hf_cp_prefill.run_rank(rank, world, torch.device("cpu"), list(DSA_MODELS), strategy, LENS, 0,
                                               index_topk=topk)
            data = [shape for shape in counter.calls if len(shape) == 2]  # the plan agreement is 1-D
            out[(strategy, topk)] = (diffs, len(data))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 3])
def test_dsa_logits_equal_plain_model(cp):
    for rank_results in run_distributed(_logits_worker, cp):
        for (strategy, topk), (diffs, collectives) in rank_results.items():
            for name, diff in diffs.items():
                assert diff <= ATOL, f"{name} C={cp} {strategy} topk={topk}: max |logits - plain| = {diff:.3g}"
            # per model: deepseek_v32 3 layers x (latent + index key) = 6; glm_moe_dsa full, shared, full
            # = 2 + 1 + 2 = 5; plus one logits gather each
            assert collectives == (6 + 1) + (5 + 1), (strategy, topk, collectives)


def test_example_script_runs_both_dsa_models_cp2():
    script = os.path.join(EXAMPLES, "hf_cp_prefill.py")
    proc = subprocess.run([sys.executable, script, "--model", *DSA_MODELS, "--cp", "2", "--strategy", "interleave",
                           "--cpu"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in DSA_MODELS:
        line = next(line for line in proc.stdout.splitlines() if line.split()[0] == name)
        assert line.endswith("OK"), line


def _cp1_logits(name: str, topk: int, strategy: str = "interleave", lens=LENS, seed: int = 0):
    model = hf_cp_prefill.build_model(name, seed, index_topk=topk)
    ids = torch.randint(0, 256, (1, sum(lens)), generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        ref = torch.cat([model(input_ids=x, use_cache=False).logits for x in ids.split(lens, 1)], 1)
        cphf.enable(model)
        s = cpattn.get_strategy(strategy, 1, pad_multiple=8)
        meta = s.build_metadata(lens, rank=0)
        with cphf.cp_context(s, meta):
            out = model(**cphf.shard_inputs(s, meta, input_ids=ids))
        return cphf.gather_outputs(s, meta, out.logits), ref


@pytest.mark.parametrize("name", DSA_MODELS)
def test_single_rank_and_the_selection_matters(name):
    """C = 1 (pad rows included) equals the plain model, and top-k 8 vs 64 changes the logits (so
    the equality above tests the sparse selection, not dense attention)."""
    sparse, ref_sparse = _cp1_logits(name, 8)
    dense, ref_dense = _cp1_logits(name, 64)
    assert (sparse - ref_sparse).abs().max() <= ATOL and (dense - ref_dense).abs().max() <= ATOL
    assert (ref_sparse - ref_dense).abs().max() > 1e-2


def _plain_cache(model, ids):
    with torch.no_grad():
        return returned_cache(model(input_ids=ids, use_cache=True))


def _generate_worker(rank: int, world: int) -> dict:
    """Greedy generation: CP prefill (use_cache) then plain decode from that cache == plain model;
    the cache holds the logical latent and index keys of the whole sequence."""
    results = {}
    ids = torch.randint(0, 256, (1, 23), generator=torch.Generator().manual_seed(7))
    for name in DSA_MODELS:
        model = hf_cp_prefill.build_model(name, seed=1, index_topk=8)
        plain_impl = model.config._attn_implementation
        with torch.no_grad():
            plain = model.generate(ids, max_new_tokens=5, do_sample=False)
            ref_cache = _plain_cache(model, ids)
        s = cpattn.InterleaveStrategy(world, pad_multiple=8)
        meta = s.build_metadata([23], rank=rank)
        cphf.enable(model)
        with torch.no_grad():
            with cphf.cp_context(s, meta):
                out = model(**cphf.shard_inputs(s, meta, input_ids=ids, use_cache=True))
            logits = cphf.gather_outputs(s, meta, out.logits)
            diff = 0.0
            for la, lb in zip(returned_cache(out).layers, ref_cache.layers):
                for a, b in ((la.keys, lb.keys), (la.values, lb.values), (la.indexer_keys, lb.indexer_keys)):
                    if a is None or b is None:
                        assert a is None and b is None
                        continue
                    diff = max(diff, float((a - b).abs().max()))
            cached = returned_cache(out).get_seq_length()
            first = logits[:, -1:].argmax(-1)
            model.set_attn_implementation(plain_impl)  # decode WITHOUT CP, from the CP prefill's cache
            gen = model.generate(torch.cat([ids, first], 1), **{cphf.cache_keyword(model): returned_cache(out)}, max_new_tokens=4, do_sample=False)
        results[name] = (plain[0, 23:].tolist(), gen[0, 23:].tolist(), diff, cached)
    return results


@pytest.mark.slow
def test_generate_after_cp_prefill_matches_plain_model():
    for rank_results in run_distributed(_generate_worker, 2):
        for name, (plain, cp_then_plain, diff, cached) in rank_results.items():
            assert cached == 23 and diff < 1e-5, f"{name}: cache differs from the plain prefill's by {diff}"
            assert cp_then_plain == plain and len(plain) == 5, f"{name}: {cp_then_plain} != {plain}"


def test_errors():
    model = cphf.enable(hf_cp_prefill.build_model("deepseek_v32", 0))
    s = cpattn.InterleaveStrategy(1)
    meta = s.build_metadata([6], rank=0)
    ids = torch.zeros(1, 6, dtype=torch.long)
    with torch.no_grad(), cphf.cp_context(s, meta):
        inputs = cphf.shard_inputs(s, meta, input_ids=ids, use_cache=True)
        full = _plain_cache(hf_cp_prefill.build_model("deepseek_v32", 0), ids)
        with pytest.raises(ValueError, match="empty transformers.DynamicCache"):
            model(**inputs, **{cphf.cache_keyword(model): full})
        with pytest.raises(ValueError, match="with use_cache=False"):
            model(**{**inputs, "use_cache": False}, **{cphf.cache_keyword(model): full})
