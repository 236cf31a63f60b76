"""Hugging Face generate over a sharded KV cache for the DSA models (``cphf.ShardedKVCache``):
unmodified DeepSeek-V3.2 and GLM-5 (with a "shared" indexer layer) generate the plain model's
tokens on C = 2 and 3 gloo ranks (top-k 8 of up to 38 keys: the selection matters), each rank
holding at most ceil(L / C) + one page of every layer (latent + rope key + index keys); one
top-k agreement per indexer layer and one merge per layer per decode step; sampling with a
shared seed picks the same tokens on every rank; the global top-k equals a single process's."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

import cpattn  # noqa: E402
from cpattn.integrations import hf as cphf  # noqa: E402
from cpattn.integrations import hf_dsa_cache  # noqa: E402
from dist_utils import CountCollectives, run_distributed  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import hf_cp_prefill  # noqa: E402
from test_hf_generate import generate_tokens  # noqa: E402

DSA_MODELS = ("deepseek_v32", "glm_moe_dsa")
NEW_TOKENS = 16
PAGE = 4
PROMPT = 23  # with 16 new tokens: 38 cached tokens, uneven over 3 ranks; top-k 8 < 38
TOPK = 8
LATENT = 32 + 8  # kv_lora_rank + qk_rope_head_dim of the tiny configs
INDEX_DIM = 16


def _prompt(length: int = PROMPT, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(seed))


def _dsa_worker(rank: int, world: int, sample: bool) -> dict:
    out = {}
    ids = _prompt()
    for name in DSA_MODELS:
        model = hf_cp_prefill.build_model(name, seed=0, index_topk=TOPK)
        plain = generate_tokens(model, ids)
        dense = generate_tokens(hf_cp_prefill.build_model(name, seed=0, index_topk=64), ids)  # every key selected
        plain_sample = generate_tokens(model, ids, sample_seed=7) if sample else None
        cphf.enable(model)
        cache = cphf.ShardedKVCache(model.config, page_size=PAGE)
        with CountCollectives() as counter:
            tokens = generate_tokens(model, ids, cache)
        layers = cache.layers
        row = dict(plain=plain, dense=dense, tokens=tokens, cached=cache.num_tokens, calls=counter.calls,
                   local=[cache.local_tokens(i) for i in range(len(layers))],
                   index_rows=[0 if x.index_keys is None else x.index_keys.shape[0] * x.index_keys.shape[1]
                               for x in layers],
                   latent=[x.latent_dim for x in layers], key_dim=[x.keys.shape[-1] for x in layers],
                   nbytes=cache.local_bytes())
        # a continuation of 3 tokens in one forward (rows see different local key counts) == the plain model
        cont = _prompt(3, seed=3)
        full = torch.cat([ids, torch.tensor([tokens[:-1]]), cont], 1)
        with torch.no_grad():
            logits = model(input_ids=cont, **{cphf.cache_keyword(model): cache}).logits
            ref = hf_cp_prefill.build_model(name, seed=0, index_topk=TOPK)(input_ids=full).logits[:, -3:]
        row["continuation"] = float((logits - ref).abs().max())
        if sample:
            cache.reset()
            row.update(plain_sample=plain_sample, sample=generate_tokens(model, ids, cache, sample_seed=7))
        out[name] = row
    # a one-token prompt: at C > 1 some ranks hold no key of the prompt (and no index key) at first
    model = hf_cp_prefill.build_model("glm_moe_dsa", seed=0, index_topk=TOPK)
    short = _prompt(1, seed=2)
    plain = generate_tokens(model, short, new_tokens=10)
    cphf.enable(model)
    short_cache = cphf.ShardedKVCache(model.config, page_size=2)
    out["short"] = dict(plain=plain, tokens=generate_tokens(model, short, short_cache, new_tokens=10))
    return out


def _check(results, world: int, sample: bool) -> None:
    cached = PROMPT + NEW_TOKENS - 1  # the last token is never fed back
    for name in DSA_MODELS:
        rows = [r[name] for r in results]
        assert rows[0]["plain"] != rows[0]["dense"], name  # top-k 8 changes the tokens: the selection is tested
        for row in rows:
            assert row["tokens"] == row["plain"] and row["cached"] == cached, (name, row)
            assert row["continuation"] <= 1e-4, (name, row["continuation"])
            for local, index_rows in zip(row["local"], row["index_rows"]):
                assert local <= math.ceil(cached / world) + PAGE, (name, row["local"])
            assert row["latent"] == [32] * 3 and row["key_dim"] == [LATENT] * 3, row
            # deepseek_v32: an indexer per layer; glm_moe_dsa: layer 1 is "shared" (no index keys)
            shared = [False, name == "glm_moe_dsa", False]
            assert [n == 0 for n in row["index_rows"]] == shared, row["index_rows"]
            assert all(n == local for n, local, s in zip(row["index_rows"], row["local"], shared) if not s)
            # collectives: prompt = per layer the latent gather + per indexer layer the index-key gather
            # + the output gather; each decode step = per indexer layer one agreement [1, 8] + per layer
            # one merge; plan agreements (1-D) aside
            indexers = 3 - sum(shared)
            data = [c for c in row["calls"] if len(c) > 1]
            agreements = [c for c in data if c == (1, TOPK)]
            if world > 1:
                assert len(agreements) == (NEW_TOKENS - 1) * indexers, (name, row["calls"])
                assert len(data) == 3 + indexers + 1 + (NEW_TOKENS - 1) * (indexers + 3), (name, row["calls"])
        if sample:
            assert all(row["sample"] == rows[0]["sample"] for row in rows), name
            assert rows[0]["sample"] == rows[0]["plain_sample"] and rows[0]["sample"] != rows[0]["tokens"], name
    assert all(r["short"]["tokens"] == r["short"]["plain"] for r in results), [r["short"] for r in results]
    total = sum(r["deepseek_v32"]["nbytes"] for r in results)
    # latent + rope (40) and index key (16) fp32 per cached token, over all ranks (pages round up)
    assert total >= cached * 3 * (LATENT + INDEX_DIM) * 4


@pytest.mark.parametrize("world", [2, 3])
def test_dsa_generate_equals_plain_model(world):
    _check(run_distributed(_dsa_worker, world, world == 2), world, world == 2)


def test_dsa_generate_single_rank_no_process_group():
    _check([_dsa_worker(0, 1, True)], 1, True)


# ---------------------------------------------------------------------------------------- the agreement
@settings(max_examples=40, deadline=None)
@given(cp=st.integers(1, 4), n=st.integers(1, 3), start=st.integers(0, 30), topk=st.integers(1, 12),
       interleave=st.sampled_from([1, 2]), ties=st.booleans(), seed=st.integers(0, 1000))
def test_agreement_equals_a_single_process_topk(cp, n, start, topk, interleave, ties, seed):
    """The ranks' candidates (each rank's scores of its own keys) merged as agree_topk does give
    exactly the single-process top-k of the whole context (ties: the lower position), whatever
    the sharding; -1 where a token sees fewer than topk keys."""
    from cpattn.plans.sparse import select_candidates
    from cpattn.selection import pack_keys, top_keys

    g = torch.Generator().manual_seed(seed)
    total = start + n
    scores = torch.randn(n, total, generator=g)
    if ties:
        scores = scores.round()  # many equal scores
    sh = cpattn.KVSharding(cp, interleave=interleave)
    cands = []
    for rank in range(cp):
        mask = hf_dsa_cache.decode_mask(sh, rank, start, n, torch.device("cpu"))[0, 0]
        pos = sh.global_position(torch.arange(mask.shape[1]), rank)
        assert bool((mask == (pos[None, :] <= torch.arange(start, total)[:, None])).all())
        cands.append(top_keys(pack_keys(scores[:, pos], pos[None, :], mask), topk))
    k = min(topk, total)
    one = hf_dsa_cache.decode_mask(cpattn.KVSharding(1), 0, start, n, torch.device("cpu"))[0, 0]
    values, indices = hf_dsa_cache.agree_topk(scores, one, torch.arange(total), k, 1)
    merged = select_candidates(torch.stack(cands), topk)  # what every rank computes from the all-gather
    for i in range(n):  # the oracle: sort by (score desc, position asc) over the visible keys
        visible = start + i + 1
        order = sorted(range(visible), key=lambda p: (-float(scores[i, p]), p))[:k]
        got = sorted(int(p) for p in indices[i] if p >= 0)
        assert got == sorted(order), (i, got, order)
        assert sorted(float(v) for v in values[i] if v != float("-inf")) == sorted(float(scores[i, p]) for p in order)
        assert sorted(int(p) for p in merged[i] if p >= 0) == sorted(order)


# ---------------------------------------------------------------------------------------- refusals
def test_dsa_config_refusals():
    model = hf_cp_prefill.build_model("deepseek_v32", seed=0)
    bad = model.config.__class__(**{**model.config.to_dict(), "index_topk": 0})
    with pytest.raises(ValueError, match="index_topk"):
        cphf.ShardedKVCache(bad)
    mixed = model.config.__class__(**model.config.to_dict())
    mixed.layer_types = ["indexed_attention", "full_attention", "indexed_attention"]
    with pytest.raises(ValueError, match="indexed_attention"):
        cphf.ShardedKVCache(mixed)
    model = cphf.enable(hf_cp_prefill.build_model("glm_moe_dsa", seed=0))
    cache = cphf.ShardedKVCache(model.config, page_size=PAGE)
    model.model.layers[0].self_attn.indexer.index_topk = TOPK + 1  # the agreement's K comes from the config
    with CountCollectives() as counter, pytest.raises(ValueError, match="index_topk"):
        generate_tokens(model, _prompt(), cache)
    assert counter.calls == [] and cache.num_tokens == 0 and cache.step is None
    model.model.layers[0].self_attn.indexer.index_topk = TOPK  # the cache is still usable
    plain = generate_tokens(hf_cp_prefill.build_model("glm_moe_dsa", seed=0), _prompt())
    assert generate_tokens(model, _prompt(), cache) == plain


def test_example_script_dsa_cp2():
    import subprocess

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "hf_generate.py")
    proc = subprocess.run([sys.executable, script, "--model", *DSA_MODELS, "--cp", "2", "--cpu", "--prompt", "20",
                           "--new-tokens", "6", "--page-size", "4"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in DSA_MODELS:
        line = next(line for line in proc.stdout.splitlines() if line.split()[0] == name)
        assert "tokens/s" in line and line.endswith("OK"), line


def test_expanded_dsa_keys_are_refused():
    """A DSA layer that hands the cache up-projected per-head K/V (transformers releases whose DSA
    attention caches K/V after ``expand_kv``) is refused with a ValueError naming the layer: the
    sharded cache stores and selects over the MLA latent only."""
    model = hf_cp_prefill.build_model("deepseek_v32", seed=0, index_topk=TOPK)
    cache = cphf.ShardedKVCache(model.config, page_size=PAGE)
    cache.begin_step(PROMPT, torch.device("cpu"))
    heads = model.config.num_attention_heads
    k = torch.zeros(1, heads, PROMPT, model.config.qk_head_dim)
    v = torch.zeros(1, heads, PROMPT, model.config.v_head_dim)
    with pytest.raises(ValueError, match="DSA layer 0 caches up-projected per-head K/V"):
        cache.update(k, v, 0)
    cache.finish_step(False)
    assert cache.num_tokens == 0
