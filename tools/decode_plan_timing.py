"""Host time of a decode step's planning (CPU; no GPU needed): what an engine runs once per step.

Prints best-of-5 µs per call of

* ``KVSharding.build_decode_metadata`` (B = 8 sequences of 100k keys, rank 0 of C = 8);
* metadata + ``plan_shard_attention`` (backend triton, GQA 32/8 D128, page 64);
* the static path: ``StaticDecodePlanner.plan`` (capacity 64) + the shard plan, and the planner alone.

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
    sh = cpattn.KVSharding(8)
    seqs = [100000] * 8
    kw = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.float32, page_size=64, backend="triton")
    planner = cpattn.StaticDecodePlanner(sh, max_seqs=64, device="cpu")
    meta = best_us(lambda: sh.build_decode_metadata(seqs, [1] * 8, rank=0), 300)
    step = best_us(lambda: cpattn.plan_shard_attention(sh.build_decode_metadata(seqs, [1] * 8, rank=0), **kw))
    static = best_us(lambda: cpattn.plan_shard_attention(planner.plan(seqs, rank=0), **kw))
    plan = best_us(lambda: planner.plan(seqs, rank=0), 300)
    print(f"B=8: build_decode_metadata {meta:.0f} us; + shard plan {step:.0f} us; "
          f"static (planner + shard plan) {static:.0f} us; planner.plan {plan:.0f} us")


if __name__ == "__main__":
    main()
