"""The K/V stage-ring protocols of the dense sm90 kernel, checked in ``tools/ring_protocol_sim.py``'s
random-interleaving model (the kernel itself runs only on Hopper): no deadlock and no slot
rewritten under a wgmma for the mbarrier protocols and the named-barrier release, the consumers'
ping-pong turns alternate (consumer 0's first turn granted per item holds for one item per
program, the kernel's case, and not across a persistent program's items), and the model's
self-check finds the broken protocols it plants."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def sim(load_tool):
    return load_tool("ring_protocol_sim.py")


@pytest.mark.parametrize("name", ["joint", "split", "named"])
@pytest.mark.parametrize("overlap", [0, 2])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_ring_protocol_holds(sim, name, overlap, stages):
    import random

    rng = random.Random(7 * stages + overlap)
    for _ in range(60):
        items = [rng.choice([0, 1, 2, 3, 5, 8]) for _ in range(rng.randint(1, 4))]
        sim.Sim(rng, items, stages, name != "joint", overlap, named=name == "named").run()


@pytest.mark.parametrize("stages", [2, 3])
def test_pingpong_turns(sim, stages):
    """Ping-pong on the split ring, overlap 2: turns granted once per program hold for any items
    (0 key blocks included); granted per item (the kernel's, with one item per program) hold for
    one item and break on a persistent program's second item with key blocks."""
    import random

    rng = random.Random(11 + stages)
    for _ in range(60):
        items = [rng.choice([0, 1, 2, 3, 5, 8]) for _ in range(rng.randint(1, 4))]
        sim.Sim(rng, items, stages, True, 2, pingpong="program").run()
        sim.Sim(rng, items[:1], stages, True, 2, pingpong="item").run()
    with pytest.raises(AssertionError, match="an arrival on a named barrier before its bar.sync"):
        sim.Sim(rng, [2, 3], stages, True, 2, pingpong="item").run()


def test_model_catches_broken_protocols(sim):
    assert sim._violations(60, 2, True, 2, arm_v_early=True) > 0
    assert sim._violations(60, 2, True, 0, early_k=True) > 0
    assert sim._violations(60, 2, True, 2, early_k=True, named=True) > 0
    assert sim._violations(60, 3, True, 2, pingpong="item") > 0
