"""Hugging Face generate over a sharded KV cache (``cphf.ShardedKVCache``): unmodified Llama, Qwen3
(with its sliding-window layer), DeepseekV3 (MLA), gpt-oss and MiMo-V2-Flash (sinks, window
layers) generate the plain model's tokens on C = 2 and 3 gloo ranks, each rank holding at most
ceil(L / C) + one page of every layer; sampling with a shared seed picks the same tokens on every
rank; what the cache cannot run is refused before any collective."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from cpattn.integrations import hf as cphf  # noqa: E402
from dist_utils import CountCollectives, run_distributed  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import hf_cp_prefill  # noqa: E402

MODELS = ("llama", "qwen3", "deepseek_v3", "gpt_oss", "mimo_v2_flash")
NEW_TOKENS = 16
PAGE = 4
PROMPT = 23  # with 16 new tokens: 38 cached tokens, uneven over 3 ranks; window 8 recycles pages


def _prompt(length: int = PROMPT, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(seed))


def generate_tokens(model, ids, cache=None, *, sample_seed=None, new_tokens=NEW_TOKENS):
    """The new tokens of greedy (or, with ``sample_seed``, seeded sampling) ``generate``, over
    ``cache`` when given."""
    kw = dict(max_new_tokens=new_tokens, pad_token_id=0)
    if sample_seed is None:
        kw.update(do_sample=False)
    else:
        torch.manual_seed(sample_seed)
        kw.update(do_sample=True, top_k=0, top_p=1.0, temperature=1.0)
    if cache is not None:
        kw[cphf.cache_keyword(model)] = cache
    with torch.no_grad():
        return model.generate(ids, **kw)[0, ids.shape[1]:].tolist()


def _family_worker(rank: int, world: int, models, sample_models) -> dict:
    """Per model: the plain model's greedy tokens, the sharded-cache tokens, each layer's local
    storage (tokens) and the tokens cached; sampling (sample_models) with seed 7 both ways."""
    out = {}
    ids = _prompt()
    for name in models:
        model = hf_cp_prefill.build_model(name, seed=0)
        plain = generate_tokens(model, ids)
        plain_sample = generate_tokens(model, ids, sample_seed=7) if name in sample_models else None
        cphf.enable(model)
        cache = cphf.ShardedKVCache(model.config, page_size=PAGE)
        tokens = generate_tokens(model, ids, cache)
        row = dict(plain=plain, tokens=tokens, cached=cache.num_tokens, pages=[x.num_pages for x in cache.layers],
                   local=[cache.local_tokens(i) for i in range(len(cache.layers))],
                   windows=[x.window for x in cache.layers], nbytes=cache.local_bytes(),
                   latent=[x.latent_dim for x in cache.layers],
                   row_bytes=[x.keys.shape[-1] * x.keys.shape[-2] * x.keys.element_size() for x in cache.layers])
        if name in sample_models:
            cache.reset()
            row.update(plain_sample=plain_sample, sample=generate_tokens(model, ids, cache, sample_seed=7))
        out[name] = row
    for length in (1, 4):  # prompts shorter than 2C: some ranks own none of the prompt's keys
        for name in ("llama", "gpt_oss"):
            model = hf_cp_prefill.build_model(name, seed=0)
            short = _prompt(length, seed=2)
            plain = generate_tokens(model, short)
            cphf.enable(model)
            out[f"{name}/{length}"] = dict(plain=plain, tokens=generate_tokens(model, short,
                                                                       cphf.ShardedKVCache(model.config, page_size=2)))
    return out


def _check_family_results(results, world: int, models, sample_models) -> None:
    for name in models:
        rows = [r[name] for r in results]
        assert rows[0]["tokens"] == rows[0]["plain"], (name, rows[0])
        cached = PROMPT + NEW_TOKENS - 1  # the last token is never fed back
        for row in rows:
            assert row["tokens"] == rows[0]["tokens"] and row["cached"] == cached, name
            for local, window in zip(row["local"], row["windows"]):
                assert local <= math.ceil(cached / world) + PAGE, (name, row["local"])
                if window is not None:  # a window layer keeps what the window needs (+ a partial page each end)
                    assert local <= math.ceil((window - 1) / world) + 2 * PAGE, (name, row["local"])
        if name == "deepseek_v3":  # MLA: the compressed latent (r 32 + rope 8, fp32), not per-head K/V
            assert rows[0]["latent"] == [32, 32] and rows[0]["row_bytes"] == [40 * 4, 40 * 4], rows[0]
        else:
            assert rows[0]["latent"] == [None, None], (name, rows[0]["latent"])
        if name in sample_models:
            assert all(row["sample"] == rows[0]["sample"] for row in rows), name
            assert rows[0]["sample"] == rows[0]["plain_sample"], name
            assert rows[0]["sample"] != rows[0]["tokens"], name  # it did sample


@pytest.mark.parametrize("world", [2, 3])
def test_generate_equals_plain_model(world):
    sample = ("llama", "mimo_v2_flash")
    results = run_distributed(_family_worker, world, MODELS, sample)
    _check_family_results(results, world, MODELS, sample)
    for key in ("llama/1", "gpt_oss/1", "llama/4", "gpt_oss/4"):
        assert all(r[key]["tokens"] == r[key]["plain"] for r in results), key
    total = [sum(r[name]["nbytes"] for r in results) for name in MODELS]
    assert all(t > 0 for t in total)


def test_generate_single_rank_no_process_group():
    results = [_family_worker(0, 1, ("llama", "gpt_oss"), ("gpt_oss",))]
    assert all(results[0][k]["tokens"] == results[0][k]["plain"] for k in ("llama/1", "gpt_oss/4"))
    _check_family_results(results, 1, ("llama", "gpt_oss"), ("gpt_oss",))


# ---------------------------------------------------------------------------------------- refusals
def _refusal_worker(rank: int, world: int) -> dict:
    """Every refusal on every rank, with zero collectives; the cache stays usable afterwards."""
    errors = {}
    with CountCollectives() as counter:
        model = cphf.enable(hf_cp_prefill.build_model("llama", seed=0))
        cache = cphf.ShardedKVCache(model.config, page_size=PAGE)
        kw = {cphf.cache_keyword(model): cache}
        for key, call in (
            ("batch", lambda: model.generate(_prompt().repeat(2, 1), **kw, max_new_tokens=2, do_sample=False)),
            ("mask", lambda: model(input_ids=_prompt(), attention_mask=torch.tensor([[0] + [1] * (PROMPT - 1)]),
                                   **kw)),
            ("use_cache", lambda: model(input_ids=_prompt(), **kw, use_cache=False)),
            ("hidden", lambda: model(input_ids=_prompt(), **kw, output_hidden_states=True)),
            ("beams", lambda: model.generate(_prompt(), **kw, max_new_tokens=2, num_beams=2, do_sample=False)),
        ):
            try:
                with torch.no_grad():
                    call()
            except ValueError as exc:
                errors[key] = str(exc)
        for key, kwargs in (("page_size", dict(page_size=0)), ("strategy", dict(prefill_strategy="replicated"))):
            try:
                cphf.ShardedKVCache(model.config, **kwargs)
            except ValueError as exc:
                errors[key] = str(exc)
        plain = cphf.ShardedKVCache(hf_cp_prefill.build_model("llama", seed=0).config)
        try:  # the model was not switched to cpattn's attention
            with torch.no_grad():
                hf_cp_prefill.build_model("llama", seed=0)(input_ids=_prompt(), **{cphf.cache_keyword(model): plain})
        except RuntimeError as exc:
            errors["not_enabled"] = str(exc)
    errors["collectives"] = len(counter.calls)
    with CountCollectives() as counter:  # a whole generate: collectives per forward
        generate_tokens(model, _prompt(), cphf.ShardedKVCache(model.config, page_size=PAGE))
    errors["generate_calls"] = counter.calls
    errors["untouched"] = cache.num_tokens
    plain = generate_tokens(hf_cp_prefill.build_model("llama", seed=0), _prompt())
    errors["after"] = generate_tokens(model, _prompt(), cache) == plain
    return errors


def test_refusals_before_any_collective():
    for errors in run_distributed(_refusal_worker, 2):
        assert "batch must have 1 row" in errors["batch"]
        assert "attention_mask" in errors["mask"] and "zero" in errors["mask"]
        assert "use_cache=True" in errors["use_cache"]
        assert "output_hidden_states" in errors["hidden"]
        assert "beam" in errors["beams"] or "1 row" in errors["beams"]
        assert "page_size" in errors["page_size"]
        assert "prefill_strategy" in errors["strategy"]
        assert "enable(model)" in errors["not_enabled"]
        assert errors["collectives"] == 0
        assert errors["untouched"] == 0
        assert errors["after"] is True
        # 2 layers, 16 forwards: the prompt's K/V gather per layer + its output gather, then ONE merge
        # per layer per decode step; plan agreements (1-D): one per forward, plus the merge's
        # header check on the first decode step
        calls = errors["generate_calls"]
        data = [c for c in calls if len(c) > 1]
        agreements = [c for c in calls if len(c) == 1]
        assert len(data) == 2 + 1 + (NEW_TOKENS - 1) * 2, calls
        assert len(agreements) == NEW_TOKENS + 1, calls


# ---------------------------------------------------------------------------------------- page bookkeeping
def _config(window: int):
    import transformers as tf

    return tf.Qwen3Config(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8, use_sliding_window=True,
                          sliding_window=window, max_window_layers=1)


@settings(max_examples=60, deadline=None)
@given(cp=st.integers(1, 4), data=st.data(), window=st.integers(1, 12), page=st.sampled_from([1, 2, 4, 8]),
       prompt=st.integers(1, 40), steps=st.lists(st.integers(1, 3), max_size=20))
def test_page_tables_hold_every_needed_key_within_the_bound(cp, data, window, page, prompt, steps):
    """Host bookkeeping of one rank of C (no collective: the plans of C > 1 without a process group):
    after every forward, every key a later query can see is mapped to a distinct live page, and the
    storage stays within ceil(L / C) + page tokens (window layers: the window's keys + 2 pages)."""
    import cpattn

    rank = data.draw(st.integers(0, cp - 1))
    cache = cphf.ShardedKVCache(_config(window), page_size=page)
    cache.sharding, cache.rank, cache.cp_size = cpattn.KVSharding(cp), rank, cp
    cache.prefill_strategy = cpattn.get_strategy("zigzag", cp)
    cache.decode_strategy = cpattn.get_strategy("replicated", cp)
    for i, n in enumerate([prompt, *steps]):
        step = cache.begin_step(n, torch.device("cpu"))
        end = cache.num_tokens + n
        cache.finish_step(True)
        assert step.decode == (i > 0) and cache.num_tokens == end
        for layer_idx, w in ((0, None), (1, window)):
            table = cache.page_table(layer_idx)
            first = 0 if w is None else max(end - w + 1, 0)  # the next query (position end) sees keys >= first
            pos = torch.arange(first, end)
            local = cache.sharding.local_index(pos[cache.sharding.owner(pos) == rank])
            pages = sorted({int(j) // page for j in local})
            assert all(table[i] >= 0 for i in pages), (table, pages)
            live = [p for p in table if p >= 0]
            assert len(live) == len(set(live))
            size = step.pages[w]
            assert max(live, default=0) < size
            assert size * page <= math.ceil(end / cp) + page
            if w is not None:
                assert size * page <= math.ceil((w - 1 + max(steps, default=1)) / cp) + 2 * page


def test_example_script_single_rank(capsys):
    import hf_generate

    assert hf_generate.main(["--model", "llama", "--cp", "1", "--cpu", "--prompt", "20", "--new-tokens", "4",
                             "--page-size", "4"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("llama") and "tokens/s" in line and "B on this rank" in line and line.endswith("OK")
