"""fp64 attention oracle, written independently of cpattn: an explicit per-sequence mask.

Logical inputs only: q for all extend tokens [T, Hq, D], K/V packed per sequence (prefix then
extend) [sum(prefix + extend), Hkv, D/Dv]. Returns out [T, Hq, Dv] and lse [T, Hq] in fp64.
"""

from __future__ import annotations

import math

import torch


def attention_oracle(q, k, v, extend_lens, prefix_lens, *, scale=None, window_left=-1, sinks=None):
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    t_total, hq, d = q.shape
    hkv = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(t_total, hq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((t_total, hq), float("-inf"), dtype=torch.float64)
    q_off = kv_off = 0
    for ext, pre in zip(extend_lens, prefix_lens):
        ext, pre = int(ext), int(pre)
        n_kv = ext + pre
        if ext == 0:  # no query rows (its keys, if any, are only skipped)
            kv_off += n_kv
            continue
        mask = torch.zeros(ext, n_kv, dtype=torch.bool)
        for i in range(ext):
            pos = pre + i
            lo = 0 if window_left < 0 else max(0, pos - window_left)
            mask[i, lo : pos + 1] = True
        for h in range(hq):
            hk = h // (hq // hkv)
            s = q[q_off : q_off + ext, h] @ k[kv_off : kv_off + n_kv, hk].T * scale
            s = s.masked_fill(~mask, float("-inf"))
            if sinks is not None:
                s = torch.cat([s, torch.full((ext, 1), float(sinks[h]), dtype=torch.float64)], dim=1)
            m = s.max(dim=1, keepdim=True).values
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            e = torch.exp(s - m)
            denom = e.sum(dim=1, keepdim=True)
            p = e / denom
            if sinks is not None:
                p = p[:, :-1]
            out[q_off : q_off + ext, h] = p @ v[kv_off : kv_off + n_kv, hk]
            lse[q_off : q_off + ext, h] = (m + torch.log(denom)).squeeze(1)
        q_off += ext
        kv_off += n_kv
    return out, lse


#: max |error| allowed against the fp64 oracle, per input dtype (inputs ~N(0, 1), scale D**-0.5).
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
