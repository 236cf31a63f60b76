"""The absorbed-MLA kernel's latent ring and P hand-off (``kernels/triton_mla.py``), checked in
``tools/mla_protocol_sim.py``'s random-interleaving model (the kernel runs only on Hopper): both
key-loop orders (packed prefill's ``Q K^T`` first; the other-block-first order of sparse, decode
since 0.3.12 and paged prefill since 0.3.13) with one ready barrier per stage (sparse) or one per
part (the TMA modes since 0.3.13) never
deadlock, rewrite a latent slot under a wgmma or overwrite P before it is read; the model finds
the broken protocols it plants."""

from __future__ import annotations

import random

import pytest


@pytest.fixture(scope="module")
def sim(load_tool):
    return load_tool("mla_protocol_sim.py")


@pytest.mark.parametrize("order", ["qk_first", "pv_first"])
@pytest.mark.parametrize("parts", [1, 3])
def test_mla_protocol_holds(sim, order, parts):
    rng = random.Random(3 * parts + (order == "pv_first"))
    for n in list(range(10)) * 8:  # every block count 0-9, several interleavings each
        sim.Sim(rng, n, order, parts).run()


@pytest.mark.parametrize("order", ["qk_first", "pv_first"])
def test_model_catches_an_early_stage_release(sim, order):
    """A stage freed when its P V is issued, not completed: the loader rewrites it under the wgmma."""
    assert sim.violations(60, order, 1, early_release=True) > 0
    with pytest.raises(sim.Violation, match="rewritten .* while consumer"):
        for seed in range(60):
            sim.Sim(random.Random(seed), 6, order, 1, early_release=True).run()


def test_model_catches_p_overwritten_under_its_reader(sim):
    assert sim.violations(60, "qk_first", 1, p_before_wait=True) > 0
    with pytest.raises(sim.Violation, match="stores p .* while consumer"):
        for seed in range(60):
            sim.Sim(random.Random(seed), 6, "qk_first", 1, p_before_wait=True).run()


def test_model_catches_a_part_read_before_it_landed(sim):
    """With a ready barrier per part, Q K^T over part b must wait for b's barrier."""
    assert sim.violations(300, "pv_first", 3, skip_part_wait=True) > 0
    assert sim.violations(300, "pv_first", 1, skip_part_wait=True) == 0  # one barrier covers all parts
