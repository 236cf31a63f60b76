"""Interleaved back-to-back timing: L2 head sections on/off, sm90 modes, portable kernel."""
import os, statistics, torch
import cpattn
import cpattn.kernels.triton_attn as ta
from cpattn.bench.common import time_cuda_back_to_back
from cpattn.bench.kernel import _flops
print("L2", torch.cuda.get_device_properties(0).L2_cache_size >> 20, "MiB", flush=True)
V = [("ws-l2", "1", None, dict(overlap=0, pingpong=False)), ("ws-flat", "1", 1 << 50, dict(overlap=0, pingpong=False)),
     ("ws-l2-ov2pp", "1", None, dict(overlap=2, pingpong=True)), ("ws-l2-ov1", "1", None, dict(overlap=1, pingpong=False)),
     ("port-l2", "0", None, {}), ("port-flat", "0", 1 << 50, {})]
summary = {v[0]: [] for v in V}
for d, dv, hq, hkv, seq, cp, strat in [(128, 128, 32, 8, 16384, 1, "zigzag"), (128, 128, 32, 8, 16384, 2, "zigzag"),
                                       (128, 128, 32, 8, 16384, 8, "zigzag"), (128, 128, 32, 8, 65536, 1, "zigzag"),
                                       (128, 128, 32, 8, 65536, 4, "zigzag"), (128, 128, 32, 8, 131072, 1, "zigzag"),
                                       (128, 128, 32, 8, 131072, 2, "zigzag"), (128, 128, 32, 8, 131072, 8, "zigzag"),
                                       (192, 128, 16, 16, 131072, 2, "zigzag")]:
    s = cpattn.get_strategy(strat, cp, pad_multiple=64)
    meta = s.build_metadata([seq], rank=0).to("cuda")
    q = torch.randn(meta.num_physical_tokens, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(seq, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(seq, hkv, dv, device="cuda", dtype=torch.bfloat16)
    fl = _flops(meta, hq, d, dv)
    iters = max(3, int(0.2 / (fl / 600e12)))
    res = {n: [] for n, *_ in V}
    for rep in range(2):
        for n, env, l2, o in (V if rep % 2 == 0 else V[::-1]):
            if d != 128 and env == "1" and n != "ws-l2":
                continue
            os.environ["CPATTN_TRITON_SM90"] = env
            ta.L2_KV_BYTES = l2
            ta.SM90_OPTIONS.update(o)
            ms = time_cuda_back_to_back(lambda: s.attention(q, k, v, meta, backend="triton"), 2, iters, 2)
            res[n].append(fl / ms / 1e9)
    for n in res:
        if res[n] and d == 128:
            summary[n].append(max(res[n]))
    print(f"d{d} S={seq} C={cp} iters={iters}: " + "  ".join(f"{n}={max(x):.0f}/{min(x):.0f}" for n, x in res.items() if x), flush=True)
print("geomean d128:", "  ".join(f"{n}={statistics.geometric_mean(v):.0f}" for n, v in summary.items()), flush=True)
