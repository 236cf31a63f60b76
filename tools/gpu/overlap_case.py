"""One case of ``tests/test_triton_hopper_gpu.py::test_gpu_sm90_overlap_modes_vs_torch`` run alone,
with timestamps and a Python stack dump after ``--stack-after`` seconds, to tell a GPU hang (stack
in ``torch.cuda.synchronize``) from a slow compile (stack in Triton's compiler / ptxas): the two
paged + window + sinks ``overlap=2`` cases did not finish in 150 s in the eighth session.

Usage (on the GPU machine, from the repository root, under a hard limit):
``timeout -s KILL 90 python tools/gpu/overlap_case.py --overlap 2 [--pingpong] [--page 16 --window 700 --sinks]``
(``PYTHONPATH`` picks the tree: ``src`` or a patched copy)."""

from __future__ import annotations

import argparse
import faulthandler
import sys
import time

import torch

sys.path.insert(0, "tests")
import test_triton_hopper_gpu as t  # noqa: E402  (the test's own case builder and checks)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--overlap", type=int, default=2)
    p.add_argument("--pingpong", action="store_true")
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--dv", type=int, default=128)
    p.add_argument("--hq", type=int, default=16)
    p.add_argument("--hkv", type=int, default=4)
    p.add_argument("--page", type=int, default=16, help="0: packed K/V")
    p.add_argument("--window", type=int, default=700)
    p.add_argument("--sinks", action="store_true")
    p.add_argument("--stack-after", type=float, default=45.0)
    a = p.parse_args()
    faulthandler.dump_traceback_later(a.stack_after, exit=False)
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.2f} s] {msg}", flush=True)

    ext, pre = [3000, 17, 1, 900], [0, 200, 5, 2999]
    lens = [e + q for e, q in zip(ext, pre)]
    s, meta, q, k, v = t._case("zigzag", 3, 1, ext, pre, a.hq, a.hkv, a.d, a.dv)
    sk = torch.randn(a.hq, device="cuda") if a.sinks else None
    page = a.page or None
    kc, vc, table = t._nan_paged(k, v, lens, page, False) if page else (k, v, None)
    ref, ref_lse = s.attention(q.float(), k.float(), v.float(), meta, backend="torch", window_size=(a.window, 0),
                               sinks=sk, return_lse=True)
    torch.cuda.synchronize()
    say("reference done")
    plan = s.plan_attention(meta, num_q_heads=a.hq, num_kv_heads=a.hkv, head_dim=a.d, head_dim_v=a.dv,
                            dtype=q.dtype, window_size=(a.window, 0), page_size=page, has_sinks=a.sinks,
                            backend="triton", backend_options={"sm90": {"overlap": a.overlap, "pingpong": a.pingpong}})
    say(f"planned: family {plan.family}; first run (compiles, then launches)")
    out, lse = plan.run(q, kc, vc, page_table=table, sinks=sk, return_lse=True)
    say("first run issued (compiled); synchronizing")
    torch.cuda.synchronize()
    say("first run done")
    t._check(out, lse, ref, ref_lse, meta, f"overlap {a.overlap} pingpong {a.pingpong} page {page}")
    faulthandler.cancel_dump_traceback_later()
    say("matches the reference")


if __name__ == "__main__":
    main()
