"""Interleaved back-to-back timing: L2 head sections on/off, sm90 overlap options, portable kernel."""
import os
import statistics

import cpattn.kernels.triton_attn as ta
from ab_common import interleaved_tflops, rank0_workload

print("L2", __import__("torch").cuda.get_device_properties(0).L2_cache_size >> 20, "MiB", flush=True)
V = [("ws-l2", "1", None, dict(overlap=0, pingpong=False)), ("ws-flat", "1", 1 << 50, dict(overlap=0, pingpong=False)),
     ("ws-l2-ov2pp", "1", None, dict(overlap=2, pingpong=True)), ("ws-l2-ov1", "1", None, dict(overlap=1, pingpong=False)),
     ("port-l2", "0", None, {}), ("port-flat", "0", 1 << 50, {})]


def _setup(env, l2, opts):
    def run():
        os.environ["CPATTN_TRITON_SM90"] = env
        ta.L2_KV_BYTES = l2
        ta.SM90_OPTIONS.update(opts)
    return run


summary = {v[0]: [] for v in V}
for shape, seq, cp in [("d128", 16384, 1), ("d128", 16384, 2), ("d128", 16384, 8), ("d128", 65536, 1),
                       ("d128", 65536, 4), ("d128", 131072, 1), ("d128", 131072, 2), ("d128", 131072, 8),
                       ("d192", 131072, 2)]:
    s, meta, q, k, v, fl = rank0_workload(shape, seq, cp)
    fn = lambda: s.attention(q, k, v, meta, backend="triton")  # noqa: E731
    # at d192 (portable kernel then) only the section on/off pair of the portable kernel and one sm90 row
    sel = [x for x in V if shape == "d128" or x[1] == "0" or x[0] == "ws-l2"]
    res = interleaved_tflops([(n, _setup(env, l2, o), fn) for n, env, l2, o in sel], fl, 0.2)
    for n in res:
        if shape == "d128":
            summary[n].append(max(res[n]))
    print(f"{shape} S={seq} C={cp}: " + "  ".join(f"{n}={max(x):.0f}/{min(x):.0f}" for n, x in res.items()), flush=True)
print("geomean d128:", "  ".join(f"{n}={statistics.geometric_mean(v):.0f}" for n, v in summary.items()), flush=True)
