"""Random-interleaving model of the absorbed-MLA Hopper kernel's latent ring and P hand-off
(``kernels/triton_mla.py``: a TMA loader and two consumer warpgroups), to check a barrier protocol
before it costs GPU time: no deadlock, no latent slot rewritten while a wgmma that reads it is in
flight, and no shared P / rescale buffer overwritten before the other warpgroup has read it (a
wgmma reads its operands when it completes, the latest it may; shared-memory loads and stores of
the warpgroups are immediate).

The protocol: two stages; warpgroup ``W`` owns blocks ``j % 2 == W`` (stage ``W``), computes
``S_j = Q K_j^T`` over the stage's three parts (columns 0-255 ``a``, 256-511 ``b``, rope ``r``),
writes ``P_j`` and its rescale factor to the one shared buffer and signals the other warpgroup
(``p_bar[1 - W]``), then adds ``P_j V_j`` over its value half (``a`` for warpgroup 0, ``b`` for
1); the other warpgroup adds ``P_j V_j`` over its half from the shared ``P_j``. A stage is free
(``kv_empty``, count 2) once both halves' ``P V`` completed. Orders: ``"qk_first"`` (prefill: a
warpgroup issues ``Q K_j^T``, then waits for ``P_{j-1}`` and adds it, one wait for both) and
``"pv_first"`` (decode since 0.3.12, paged prefill since 0.3.13, sparse: ``P_{j-1} V_{j-1}``
added and its stage released before the wait for block ``j``). Ready barriers: one per stage
(``parts=1``: the sparse mode's cp.async arrivals, and the TMA modes before 0.3.13) or one per part
(``parts=3``, the TMA modes since 0.3.13: each wgmma of ``Q K^T`` waits for its own part; H200 A/B
against one barrier per stage: MLA decode geomean 1.014, prefill 1.022).

``python tools/mla_protocol_sim.py [--trials N]`` prints one line per case and exits non-zero on a
violation, or when its self-check (three broken protocols) finds none. A model of the protocol,
not of the kernel's code."""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import sys

_spec = importlib.util.spec_from_file_location(
    "ring_protocol_sim", os.path.join(os.path.dirname(os.path.abspath(__file__)), "ring_protocol_sim.py"))
_ring = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ring)
Barrier, Interleaving, Violation = _ring.Barrier, _ring.Interleaving, _ring.Violation

PARTS = ("a", "b", "r")
STAGES = 2


class Sim(Interleaving):
    """One program: ``num_blocks`` latent blocks. ``order``: "qk_first" or "pv_first"; ``parts``: 1 or
    3 ready barriers per stage. Broken variants for the self-check: ``early_release`` (a warpgroup
    frees its stage before its ``P V`` completed, then waits), ``p_before_wait`` (a warpgroup
    stores ``P_j`` while its own ``P_{j-1} V_{j-1}`` may still read the buffer), ``skip_part_wait``
    (with 3 parts: ``Q K^T`` reads part ``b`` without waiting for it)."""

    def __init__(self, rng, num_blocks, order, parts, early_release=False, p_before_wait=False,
                 skip_part_wait=False):
        self.rng, self.n, self.order, self.parts = rng, num_blocks, order, parts
        self.early_release, self.p_before_wait, self.skip_part_wait = early_release, p_before_wait, skip_part_wait
        self.ready = [[Barrier(1) for _ in range(parts)] for _ in range(STAGES)]
        self.kv_empty = [Barrier(2) for _ in range(STAGES)]
        self.p_bar = [Barrier(1) for _ in range(2)]
        self.smem = {}  # ("a"/"b"/"r", slot) or "p" / "alpha" -> the block it holds
        self.dmas = []  # ((part, slot), block, barrier)
        self.groups = {0: [], 1: []}  # per warpgroup, in commit order: (resource, block) reads
        procs = [self._loader(), self._consumer(0), self._consumer(1)]
        self.procs = [[p, None] for p in procs]

    # -- the loader --------------------------------------------------------------------------
    def _loader(self):
        for j in range(self.n):
            slot, ph = j % STAGES, (j // STAGES) & 1
            yield lambda s=slot, p=ph: self.kv_empty[s].passed(p ^ 1)
            for i, part in enumerate(PARTS):
                bar = self.ready[slot][i if self.parts == 3 else 0]
                if self.parts == 3 or i == 0:  # one expect per barrier, for all its bytes
                    bar.expect_arrive(1 if self.parts == 3 else 3)
                self.dma((part, slot), j, bar)

    # -- the consumers -----------------------------------------------------------------------
    def _store(self, c, where, block):
        """A warpgroup's immediate shared-memory store: no wgmma may still read ``where``."""
        for cc, b in self.readers(where):
            raise Violation(f"warpgroup {c} stores {where} (block {block}) while consumer {cc}'s wgmma reads "
                            f"block {b} there")
        self.smem[where] = block

    def _load(self, c, where, block):
        if self.smem.get(where) != block:
            raise Violation(f"warpgroup {c} loads {where} holding {self.smem.get(where)}, wanted block {block}")

    def _wait_ready(self, slot, part, j):
        bar = self.ready[slot][PARTS.index(part) if self.parts == 3 else 0]
        return lambda: bar.passed((j // STAGES) & 1)

    def _wait_groups(self, c, outstanding=0):
        return lambda: len(self.groups[c]) <= outstanding

    def _qk(self, c, j):
        """Issue ``Q K_j^T`` (three wgmmas; with 3 parts each waits for its part first)."""
        slot = j % STAGES
        yield self._wait_ready(slot, "a", j)
        for part in PARTS:
            if self.parts == 3 and part != "a" and not (self.skip_part_wait and part == "b"):
                yield self._wait_ready(slot, part, j)
            self.group(c, (part, slot), j)

    def _pv_other(self, c, jr):
        """The other warpgroup's block ``jr``: wait for its P, load its rescale factor, add
        ``P_jr V_jr`` over this warpgroup's half from shared memory."""
        yield lambda: self.p_bar[c].passed((jr // 2) & 1)
        self._load(c, "alpha", jr)
        half = PARTS[c]
        self.group(c, "p", jr)  # one wgmma reading both operands: modelled as two reads committed together
        self.group(c, (half, jr % STAGES), jr)

    def _release(self, c, slot):
        """Wait for this warpgroup's wgmmas, then free its hold on ``slot`` (``early_release``,
        broken: free it first, then wait)."""
        if self.early_release:
            self.kv_empty[slot].arrive()
        yield self._wait_groups(c)
        if not self.early_release:
            self.kv_empty[slot].arrive()

    def _softmax_store(self, c, j):
        """``P_j`` and its rescale factor to the shared buffers (immediate stores)."""
        self._store(c, "p", j)
        self._store(c, "alpha", j)

    def _consumer(self, c):
        half = PARTS[c]  # this warpgroup's value half
        for j in range(c, self.n, 2):
            slot = j % STAGES
            stored = False
            if self.order == "pv_first":
                if j > 0:
                    yield from self._pv_other(c, j - 1)
                    yield from self._release(c, (j - 1) % STAGES)
                yield from self._qk(c, j)
                yield self._wait_groups(c)
            else:
                yield from self._qk(c, j)
                if j > 0:
                    yield from self._pv_other(c, j - 1)
                    if self.p_before_wait:  # broken: P_j written while P_{j-1} V_{j-1} may read the buffer
                        self._softmax_store(c, j)
                        stored = True
                    yield from self._release(c, (j - 1) % STAGES)  # one wait for Q K_j^T and P_{j-1} V_{j-1}
                else:
                    yield self._wait_groups(c)
            if j == self.n - 1:  # the last block's value rows past the keys are zeroed in place
                self._store(c, ("a", slot), j)
                self._store(c, ("b", slot), j)
            if not stored:
                self._softmax_store(c, j)
            self.p_bar[1 - c].arrive()
            # P_j V_j over this warpgroup's half (P from registers), then this warpgroup's hold on the stage ends
            self.group(c, (half, slot), j)
            yield from self._release(c, slot)
        last = self.n - 1
        if self.n > 0 and last % 2 != c:
            yield from self._pv_other(c, last)
            yield from self._release(c, last % STAGES)


def violations(trials: int, order: str, parts: int, **broken) -> int:
    """How many of ``trials`` random runs (1-9 blocks) of a protocol end in a violation."""
    n = 0
    for t in range(trials):
        rng = random.Random(t)
        try:
            Sim(rng, rng.randint(1, 9), order, parts, **broken).run()
        except (Violation, AssertionError):
            n += 1
    return n


def _self_check(trials: int) -> bool:
    found = [violations(trials, "qk_first", 1, early_release=True),
             violations(trials, "qk_first", 1, p_before_wait=True),
             violations(trials, "pv_first", 3, skip_part_wait=True)]
    print(f"self-check: violations found in broken protocols: {found}")
    return all(found)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=300)
    a = p.parse_args()
    bad = 0
    for order in ("qk_first", "pv_first"):
        for parts in (1, 3):
            rng = random.Random(10 * parts + (order == "pv_first"))
            errors = []
            for _ in range(a.trials):
                n = rng.randint(0, 9)
                try:
                    Sim(rng, n, order, parts).run()
                except (Violation, AssertionError) as e:
                    errors.append(f"{n} blocks: {e}")
            print(f"{order:8s} parts {parts}: {a.trials - len(errors)}/{a.trials} ok"
                  + (f"; first: {errors[0]}" if errors else ""))
            bad += bool(errors)
    return 1 if bad or not _self_check(a.trials) else 0


if __name__ == "__main__":
    sys.exit(main())
