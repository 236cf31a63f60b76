"""Print, per dense kernel-benchmark point (rank 0 of zigzag C), what the triton plan chose for
its L2 head sections (``sections="auto"``): head groups per section, the simulated loss, the
choice, and the L2 size torch reports. Usage:
``python tools/gpu/sections_decisions.py --shapes d192,d128 --seqs 16384,65536 --cps 1,2,4,8``"""

from __future__ import annotations

import argparse

import torch

import cpattn
from cpattn.bench.kernel import SHAPES


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="d192")
    p.add_argument("--seqs", default="16384,65536,131072")
    p.add_argument("--cps", default="1,2,4,8")
    a = p.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"L2_cache_size {props.L2_cache_size} ({props.L2_cache_size / 2**20:.1f} MiB), "
          f"SMs {props.multi_processor_count}")
    for shape in a.shapes.split(","):
        hq, hkv, d, dv = SHAPES[shape]
        for seq in (int(x) for x in a.seqs.split(",")):
            for c in (int(x) for x in a.cps.split(",")):
                s = cpattn.get_strategy("zigzag", c, pad_multiple=64)
                meta = s.build_metadata([seq], [0], rank=0).to("cuda")
                plan = s.plan_attention(meta, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv,
                                        dtype=torch.bfloat16, backend="triton")
                run = plan._impl
                print(f"{shape} S={seq // 1024}k C={c}: family {run.family} persistent {run.persistent} "
                      f"heads/section {run.heads_per_section} of {run.sm90_args['num_head_groups']} "
                      f"loss {run.section_loss:.3f} sections {run.sections} "
                      f"(launched heads_per_section {run.sm90_args['heads_per_section']})")


if __name__ == "__main__":
    main()
