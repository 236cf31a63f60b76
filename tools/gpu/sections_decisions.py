"""Print, per dense kernel-benchmark point, the L2-section decision the triton plan takes
(``sections="auto"``): heads per section, the simulated loss, the choice, and the L2 size torch
reports. Usage: python tools/gpu/sections_decisions.py --shapes d192 --seqs 16384,65536 --cps 1,2,4,8"""

from __future__ import annotations

import argparse

import torch

import cpattn
from cpattn.bench.kernel import SHAPES
from cpattn.kernels._tiles import gqa_packing, heads_per_l2_section, section_schedule_loss, tile_map
from cpattn.kernels.triton_attn import default_block_m


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
                args = run.sm90_args
                g_pack, rows = gqa_packing(hq, hkv, default_block_m(d, dv))
                tiles = tile_map(meta, rows)
                groups = args["num_head_groups"]
                section = heads_per_l2_section(meta.num_kv_rows, (d + dv) * 2, hq // hkv // g_pack, groups,
                                               meta.device)
                loss = section_schedule_loss(tiles.tile_keys, groups, section, props.multi_processor_count)
                print(f"{shape} S={seq // 1024}k C={c}: family {run.family} persistent {run.persistent} "
                      f"heads/section {section} of {groups} loss {loss:.3f} sections {run.sections} "
                      f"(launched heads_per_section {args['heads_per_section']})")


if __name__ == "__main__":
    main()
