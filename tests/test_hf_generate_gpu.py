"""``cphf.ShardedKVCache`` on one GPU at C = 1 (no process group): greedy ``generate`` of the tiny
fp32 configs through the GPU kernels (the split-KV shard kernel, paged; window + sinks; absorbed
MLA over the latent; DSA: the top-k over the sharded index keys and sparse attention, top-k 8 of
up to 315 keys) equals the plain model's tokens, and bf16 runs (the Triton sparse kernel)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("transformers")

from cpattn.integrations import hf as cphf  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import hf_cp_prefill  # noqa: E402

pytestmark = pytest.mark.gpu

MODELS = ("llama", "qwen3", "deepseek_v3", "gpt_oss", "mimo_v2_flash", "deepseek_v32", "glm_moe_dsa")


def _generate(model, ids, cache=None):
    kw = {} if cache is None else {cphf.cache_keyword(model): cache}
    with torch.no_grad():
        try:
            out = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0, **kw)
        except ValueError as exc:  # the documented refusal of a release that caches expanded DSA K/V
            if "caches up-projected per-head K/V" in str(exc):
                pytest.skip(str(exc))
            raise
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("page_size", [16, 64])
def test_generate_equals_plain_model_on_gpu(name, page_size):
    model = hf_cp_prefill.build_model(name, seed=0).cuda()
    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(1)).cuda()
    plain = _generate(model, ids)
    cphf.enable(model)
    cache = cphf.ShardedKVCache(model.config, page_size=page_size)
    assert _generate(model, ids, cache) == plain
    assert all(cache.local_tokens(i) <= cache.num_tokens + page_size for i in range(len(cache.layers)))


@pytest.mark.parametrize("name", MODELS)
def test_generate_bf16_runs_on_gpu(name):
    model = hf_cp_prefill.build_model(name, seed=0).cuda().to(torch.bfloat16)
    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(1)).cuda()
    cphf.enable(model)
    cache = cphf.ShardedKVCache(model.config, page_size=64)
    tokens = _generate(model, ids, cache)
    assert len(tokens) == 16 and cache.num_tokens == 215
    assert all(x.keys.dtype == torch.bfloat16 for x in cache.layers)
