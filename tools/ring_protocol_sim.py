"""Random-interleaving model of the dense sm90 kernel's K/V stage ring (loader + two consumers,
mbarrier phase semantics, asynchronous TMA copies and wgmma groups), to check a barrier protocol
before it costs GPU time: no deadlock, and no K/V slot rewritten while a wgmma that reads it is
in flight (a wgmma is modelled as reading its operand when it completes, the latest it may).

Protocols: ``joint`` (one ``kv_empty`` mbarrier per stage, released after ``P V``), ``split``
(the kernel's since 0.3.8: K released after ``Q K^T``, V after ``P V``, each ready barrier armed
once its half is free) and ``named`` (``split`` with each half's "free" signal a named hardware
barrier, consumers ``bar.arrive``, the loader ``bar.sync`` before every refill but the first pass
over the ring; measured on an H200 and not kept: dense geomean 1.007 against ``split``, 1.002 when
limited to one work item per program); loops ``overlap`` 0 (``Q K^T``, wait, ``P V``, wait) and
2 (``Q K_j^T`` and ``P_{j-1} V_{j-1}`` issued together, ``wait(1)``, then ``wait(0)``). Work items of random block counts (0 included) run back to back on one ring, as a
persistent program's do.

Ping-pong (``overlap`` 2 only): the consumers take turns issuing their GEMMs through two named
barriers of one arriver each (consumer c syncs on turn c, then arrives on the other's), consumer
0's first turn granted by its own arrival at the start of every item with key blocks
(``pingpong="item"``, the kernel's: it ping-pongs with one item per program only, and the
self-check shows the rule breaks on a persistent program's second item) or once per program
(``"program"``, which lets persistent programs ping-pong; measured on an H200 and not kept: short
batches geomean 0.998, dense 0.983).

``python tools/ring_protocol_sim.py [--trials N]``: prints one line per (protocol, overlap,
stages) and exits non-zero on any violation, or when its self-check (four broken protocols) finds
none. A model of the protocol, not of the kernel's code. :class:`Interleaving` (the random
scheduler and the slot checks) also runs ``tools/mla_protocol_sim.py``'s model of the MLA kernel."""

from __future__ import annotations

import argparse
import random
import sys


class Barrier:
    """mbarrier: ``count`` arrivals and all expected transaction bytes complete a phase."""

    def __init__(self, count: int):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def _maybe_complete(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def arrive(self) -> None:
        self.pending -= 1
        assert self.pending >= 0, "more arrivals than the barrier's count in one phase"
        self._maybe_complete()

    def expect_arrive(self, nbytes: int) -> None:
        self.tx += nbytes
        self.arrive()

    def complete_tx(self, nbytes: int) -> None:
        self.tx -= nbytes
        self._maybe_complete()

    def passed(self, parity: int) -> bool:
        """``try_wait.parity``: the phase of this parity has completed."""
        return self.phase % 2 != parity


class NamedBarrier:
    """Named hardware barrier: ``arrivers`` parties ``bar.arrive`` and one ``bar.sync``s, which
    returns once they all arrived. The ring's "slot free" signals: both consumers arrive, the
    loader syncs (``arrivers`` 2); a ping-pong turn: the other consumer arrives, the owner syncs
    (1). Arrivals have no phase: one more before the sync would count towards the same instance
    (a consumer releasing a slot twice, a turn lost), which the model reports."""

    def __init__(self, arrivers: int = 2):
        self.arrivers, self.arrivals = arrivers, 0

    def arrive(self) -> None:
        self.arrivals += 1
        assert self.arrivals <= self.arrivers, "an arrival on a named barrier before its bar.sync took the last"

    def complete(self) -> bool:
        """All parties arrived: the ``bar.sync`` returns (a predicate, no effect)."""
        return self.arrivals == self.arrivers

    def sync(self) -> None:
        """The ``bar.sync`` returned: the instance is over."""
        assert self.complete()
        self.arrivals = 0


class Violation(Exception):
    pass


def _loader(sim, items, stages, split, arm_v_early=False, named=False):
    """The loader; ``arm_v_early`` (broken, for the self-check, ``split`` only): V's ready barrier
    armed before V's slot is free, so its arrival can land in the phase the consumers still wait on.
    ``named``: the "free" signals are :class:`NamedBarrier` s, synced from the second pass on."""
    it = 0
    for n in items:
        for j in range(n):
            slot, ph = (it + j) % stages, ((it + j) // stages) & 1
            if named:
                if it + j >= stages:
                    yield lambda s=slot: sim.free_k[s].complete()
                    sim.free_k[slot].sync()
            else:
                yield lambda s=slot, p=ph: sim.free_k[s].passed(p ^ 1)
            sim.ready_k[slot].expect_arrive(1)
            sim.dma(("k", slot), it + j, sim.ready_k[slot])
            if arm_v_early:
                sim.ready_v[slot].expect_arrive(1)
            if named:
                if it + j >= stages:
                    yield lambda s=slot: sim.free_v[s].complete()
                    sim.free_v[slot].sync()
            elif split:
                yield lambda s=slot, p=ph: sim.free_v[s].passed(p ^ 1)
            if not arm_v_early:
                sim.ready_v[slot].expect_arrive(1)
            sim.dma(("v", slot), it + j, sim.ready_v[slot])
        it += n


def _consumer(sim, c, items, stages, split, overlap, pingpong=None):
    it = 0
    free_k = sim.free_k
    free_v = sim.free_v if split else sim.free_k
    turn = sim.turn

    def take_turn():
        """Wait for this consumer's turn (the caller issues its GEMMs, then :func:`pass_turn`)."""
        yield turn[c].complete
        turn[c].sync()

    def pass_turn():
        turn[1 - c].arrive()

    if pingpong == "program" and c == 0:
        turn[0].arrive()

    def wait_ready(bar, b):
        return lambda: bar[b % stages].passed((b // stages) & 1)

    def mma(kind, b):
        g = sim.group(c, (kind, b % stages), b)
        return g

    def wait_groups(outstanding):
        return lambda: sim.outstanding(c) <= outstanding

    for n in items:
        if overlap == 0:
            for j in range(n):
                b = it + j
                yield wait_ready(sim.ready_k, b)
                mma("k", b)
                yield wait_groups(0)
                if split:
                    free_k[b % stages].arrive()
                yield wait_ready(sim.ready_v, b)
                mma("v", b)
                yield wait_groups(0)
                free_v[b % stages].arrive()
        elif n > 0:
            yield wait_ready(sim.ready_k, it)
            if pingpong == "item" and c == 0:
                turn[0].arrive()
            if pingpong:
                yield from take_turn()
            mma("k", it)
            if pingpong:
                pass_turn()
            yield wait_groups(0)
            if split:
                free_k[it % stages].arrive()
            for j in range(1, n):
                b = it + j
                yield wait_ready(sim.ready_k, b)
                yield wait_ready(sim.ready_v, b - 1)
                if pingpong:
                    yield from take_turn()
                mma("k", b)
                mma("v", b - 1)
                if pingpong:
                    pass_turn()
                yield wait_groups(1)
                if split:
                    free_k[b % stages].arrive()
                yield wait_groups(0)
                free_v[(b - 1) % stages].arrive()
            last = it + n - 1
            yield wait_ready(sim.ready_v, last)
            if pingpong:
                yield from take_turn()
            mma("v", last)
            if pingpong:
                pass_turn()
            yield wait_groups(0)
            free_v[last % stages].arrive()
        it += n


class Interleaving:
    """Processes (generators yielding wait predicates), asynchronous copies into shared memory and
    per-consumer wgmma groups, run in a random order: subclasses set ``rng``, ``procs`` (``[generator,
    None]`` each), ``smem``, ``dmas`` and ``groups`` (consumer -> committed ``(where, block)`` reads).
    A copy into a slot a pending wgmma reads, a wgmma that completes over the wrong block, and a
    state where nothing can run while a process waits raise :class:`Violation`."""

    def readers(self, where):
        """(consumer, block) of every pending wgmma read of ``where``."""
        return [(c, b) for c in self.groups for w, b in self.groups[c] if w == where]

    def dma(self, where, block, barrier):
        for c, b in self.readers(where):
            raise Violation(f"slot {where} rewritten (block {block}) while consumer {c}'s wgmma reads block {b}")
        self.dmas.append((where, block, barrier))

    def group(self, c, where, block):
        self.groups[c].append((where, block))

    def outstanding(self, c):
        return len(self.groups[c])

    def run(self) -> None:
        while True:
            choices = []
            for i, pr in enumerate(self.procs):
                if pr[0] is not None and (pr[1] is None or pr[1]()):
                    choices.append(("proc", i))
            choices += [("dma", i) for i in range(len(self.dmas))]
            choices += [("mma", c) for c in self.groups if self.groups[c]]
            if not choices:
                if any(pr[0] is not None for pr in self.procs):
                    raise Violation("deadlock: " + ", ".join(f"proc {i} waiting" for i, pr in enumerate(self.procs)
                                                            if pr[0] is not None))
                return
            kind, i = self.rng.choice(choices)
            if kind == "proc":
                try:
                    self.procs[i][1] = next(self.procs[i][0])
                except StopIteration:
                    self.procs[i] = [None, None]
            elif kind == "dma":
                where, block, barrier = self.dmas.pop(i)
                self.smem[where] = block
                barrier.complete_tx(1)
            else:  # the consumer's oldest wgmma group completes (groups complete in commit order)
                where, block = self.groups[i].pop(0)
                if self.smem.get(where) != block:
                    raise Violation(f"consumer {i}'s wgmma read slot {where} holding {self.smem.get(where)}, "
                                    f"wanted block {block}")


class Sim(Interleaving):
    def __init__(self, rng, items, stages, split, overlap, arm_v_early=False, named=False, pingpong=None):
        self.rng = rng
        self.turn = [NamedBarrier(1), NamedBarrier(1)]
        split = split or named
        self.ready_k = [Barrier(1) for _ in range(stages)]
        self.ready_v = [Barrier(1) for _ in range(stages)]
        free = NamedBarrier if named else (lambda: Barrier(2))
        self.free_k = [free() for _ in range(stages)]
        self.free_v = [free() for _ in range(stages)] if split else self.free_k
        self.smem = {}  # (half, slot) -> block held
        self.dmas = []  # (half+slot, block, barrier)
        self.groups = {0: [], 1: []}  # per consumer, in commit order: (half+slot, block)
        procs = [_loader(self, items, stages, split, arm_v_early, named)] + \
            [_consumer(self, c, items, stages, split, overlap, pingpong) for c in (0, 1)]
        self.procs = [[p, None] for p in procs]


def _self_check(trials: int) -> bool:
    """The model must catch a broken protocol: the loader arming V early, and consumers releasing K before
    their ``Q K^T`` completes (``wait_groups`` made a no-op; mbarrier and named-barrier releases), and
    consumer 0's first turn granted per item in a persistent program."""
    found = [_violations(trials, 2, True, 2, arm_v_early=True)]
    found.append(_violations(trials, 2, True, 0, early_k=True))
    found.append(_violations(trials, 2, True, 2, early_k=True, named=True))
    found.append(_violations(trials, 3, True, 2, pingpong="item"))
    print(f"self-check: violations found in broken protocols: {found}")
    return all(found)


def _violations(trials: int, stages: int, split: bool, overlap: int, early_k: bool = False,
                arm_v_early: bool = False, named: bool = False, pingpong=None) -> int:
    n = 0
    for t in range(trials):
        rng = random.Random(t)
        sim = Sim(rng, [rng.choice([1, 3, 5, 8]) for _ in range(3)], stages, split, overlap, arm_v_early, named,
                  pingpong)
        if early_k:  # release K at issue: pretend no wgmma is ever outstanding when waited on
            sim.outstanding = lambda c: 0
        try:
            sim.run()
        except (Violation, AssertionError):
            n += 1
    return n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=300)
    a = p.parse_args()
    bad = 0
    cases = [(name, overlap, None) for name in ("joint", "split", "named") for overlap in (0, 2)]
    cases += [("split", 2, "program"), ("named", 2, "program")]
    for name, overlap, pingpong in cases:
        for stages in (2, 3, 4):
            rng = random.Random(1000 * stages + 10 * overlap + (name != "joint"))
            errors = []
            for _ in range(a.trials):
                items = [rng.choice([0, 1, 2, 3, 5, 8]) for _ in range(rng.randint(1, 4))]
                try:
                    Sim(rng, items, stages, name != "joint", overlap, named=name == "named", pingpong=pingpong).run()
                except (Violation, AssertionError) as e:
                    errors.append(f"{items}: {e}")
            print(f"{name:5s} overlap {overlap} stages {stages}{' pingpong' if pingpong else ''}: "
                  f"{a.trials - len(errors)}/{a.trials} ok" + (f"; first: {errors[0]}" if errors else ""))
            bad += bool(errors)
    return 1 if bad or not _self_check(a.trials) else 0


if __name__ == "__main__":
    sys.exit(main())
