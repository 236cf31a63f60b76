"""D192/128 in the sm90 kernel: interleaved back-to-back timing of its options vs the portable kernel."""
import os

import cpattn.kernels.triton_attn as ta
from ab_common import interleaved_tflops, rank0_workload

VARIANTS = [("ws", "1", dict(overlap=0, pingpong=False)), ("ws-ov2pp", "1", dict(overlap=2, pingpong=True)),
            ("ws-ov1", "1", dict(overlap=1, pingpong=False)), ("port", "0", {})]


def _setup(env, opts):
    def run():
        os.environ["CPATTN_TRITON_SM90"] = env
        ta.SM90_OPTIONS.update(opts)
    return run


for shape, seq, cp in [("d192", 16384, 1), ("d192", 16384, 2), ("d192", 16384, 8), ("d192", 65536, 2),
                       ("d192", 131072, 1), ("d192", 131072, 4), ("d128", 16384, 2), ("d128", 131072, 2)]:
    s, meta, q, k, v, fl = rank0_workload(shape, seq, cp)
    fn = lambda: s.attention(q, k, v, meta, backend="triton")  # noqa: E731
    res = interleaved_tflops([(n, _setup(env, o), fn) for n, env, o in VARIANTS], fl, 0.15)
    print(f"{shape} S={seq} C={cp}: " + "  ".join(f"{n}={max(x):.0f}/{min(x):.0f}" for n, x in res.items()), flush=True)
