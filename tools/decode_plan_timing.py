"""Host time of a decode step's planning (CPU; no GPU needed): what an engine runs once per step.

Prints best-of-5 µs per call of

* the decode step's placement plan: ``get_strategy("replicated", C).build_metadata(q_lens,
  seq_lens - q_lens, rank=0, kv=KVSharding(C))`` (B = 8 sequences of 100k keys, rank 0 of C = 8);
* metadata + ``cpattn.plan_attention`` (algorithm "shard_merge", backend triton, GQA 32/8 D128,
  page 64);
* the static path: ``StaticPlanner.plan`` (capacity 64 sequences) + the shard plan, and the
  planner alone.

The triton backend plans under the interpreter (``TRITON_INTERPRET=1``, set here): the same host
code as on a GPU, without the device upload. Compare two checkouts by running it with
``PYTHONPATH=<checkout>/src`` for each, alternating.

Run: ``PYTHONPATH=src python tools/decode_plan_timing.py``.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import time  # noqa: E402

import torch  # noqa: E402

import cpattn  # noqa: E402


def best_us(fn, calls: int = 100, rounds: int = 5) -> float:
    for _ in range(10):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls // rounds):
            fn()
        best = min(best, (time.perf_counter() - t0) / (calls // rounds) * 1e6)
    return best


def main() -> None:
    c = 8
    sh = cpattn.KVSharding(c)
    s = cpattn.get_strategy("replicated", c)
    seqs = [100000] * 8
    q_lens = [1] * len(seqs)
    prefix = [n - q for n, q in zip(seqs, q_lens)]
    spec = cpattn.AttentionSpec(num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.float32, page_size=64)
    planner = cpattn.StaticPlanner(s, max_tokens=64, max_seqs=64, max_kv_tokens=64 * 131072, max_q_len=1, kv=sh,
                                   device="cpu")
    algorithm = cpattn.plan_attention(s.build_metadata(q_lens, prefix, rank=0, kv=sh), spec, backend="triton").algorithm
    assert algorithm == "shard_merge", algorithm
    meta = best_us(lambda: s.build_metadata(q_lens, prefix, rank=0, kv=sh), 300)
    step = best_us(lambda: cpattn.plan_attention(s.build_metadata(q_lens, prefix, rank=0, kv=sh), spec,
                                                 backend="triton"))
    static = best_us(lambda: cpattn.plan_attention(planner.plan(q_lens, prefix, rank=0), spec, backend="triton"))
    plan = best_us(lambda: planner.plan(q_lens, prefix, rank=0), 300)
    print(f"B=8: build_metadata {meta:.0f} us; + shard plan {step:.0f} us; "
          f"static (planner + shard plan) {static:.0f} us; planner.plan {plan:.0f} us")


if __name__ == "__main__":
    main()
