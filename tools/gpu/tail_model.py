"""CPU model of the dense sm90 launch's tail per kernel-benchmark point: every zigzag rank's
programs ((tile, head group), costing ``2 + keys / 128`` key blocks as in
``_tiles.section_schedule_loss``) placed heaviest first on ``--sms`` SMs, each on the first to free
up; prints waves per rank and the efficiency (total work / SMs / makespan), lowest and mean over
the ranks. Runs without a GPU. Usage: ``PYTHONPATH=src python tools/gpu/tail_model.py --shapes
d128,d192 --seqs 16384,65536 --cps 1,2,4,8``."""

from __future__ import annotations

import argparse

import cpattn
from cpattn.bench.kernel import SHAPES
from cpattn.kernels import _tiles


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="d128,d192")
    p.add_argument("--seqs", default="16384,65536")
    p.add_argument("--cps", default="1,2,4,8")
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--block-m", type=int, default=128)
    a = p.parse_args()
    for shape in a.shapes.split(","):
        hq, hkv, _, _ = SHAPES[shape]
        g_pack, rows = _tiles.gqa_packing(hq, hkv, a.block_m)
        for seq in (int(x) for x in a.seqs.split(",")):
            for c in (int(x) for x in a.cps.split(",")):
                s = cpattn.get_strategy("zigzag", c, pad_multiple=64)
                effs = []
                for rank in range(c):
                    keys = _tiles.tile_map(s.build_metadata([seq], [0], rank=rank), rows).tile_keys.tolist()
                    cost = sorted((k / 128 + 2.0 for k in keys for _ in range(hq // g_pack)), reverse=True)
                    effs.append(sum(cost) / a.sms / _tiles._list_makespan(cost, a.sms))
                print(f"{shape} S={seq // 1024}k C={c}: {len(cost) / a.sms:.2f} waves per rank, efficiency "
                      f"min {min(effs):.3f} mean {sum(effs) / len(effs):.3f}")


if __name__ == "__main__":
    main()
