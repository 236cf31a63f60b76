"""CPU model of the dense sm90 launch's tail per kernel-benchmark point: every zigzag rank's
programs ((tile, head group), costing ``2 + keys / 128`` key blocks as in
``_tiles.section_schedule_loss``) placed heaviest first on ``--sms`` SMs, each on the first to free
up; prints waves per rank and the efficiency (total work / SMs / makespan), lowest and mean over
the ranks. With ``--persistent`` also the persistent schedule's makespan against that one
(rank 0): one program per SM taking the items in the kernel's L2-section order
(``_tiles.section_order``) round by round in a snake (``triton_sm90._ws_work``), a static
assignment. Runs without a GPU. Usage: ``PYTHONPATH=src python tools/gpu/tail_model.py --shapes
d128,d192 --seqs 16384,65536 --cps 1,2,4,8 [--persistent]``."""

from __future__ import annotations

import argparse

import cpattn
from cpattn.bench.kernel import SHAPES
from cpattn.kernels import _tiles


def snake_makespan(items: list[float], sms: int) -> float:
    """Makespan of persistent programs: program ``p`` takes item ``r * sms + p`` on even rounds
    ``r`` and ``r * sms + sms - 1 - p`` on odd ones."""
    load = [0.0] * sms
    for w, c in enumerate(items):
        r, i = divmod(w, sms)
        load[i if r % 2 == 0 else sms - 1 - i] += c
    return max(load)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="d128,d192")
    p.add_argument("--seqs", default="16384,65536")
    p.add_argument("--cps", default="1,2,4,8")
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--block-m", type=int, default=128)
    p.add_argument("--persistent", action="store_true",
                   help="also the persistent snake schedule's makespan over the grid order's (rank 0)")
    a = p.parse_args()
    for shape in a.shapes.split(","):
        hq, hkv, d, dv = SHAPES[shape]
        g_pack, rows = _tiles.gqa_packing(hq, hkv, a.block_m)
        for seq in (int(x) for x in a.seqs.split(",")):
            for c in (int(x) for x in a.cps.split(",")):
                s = cpattn.get_strategy("zigzag", c, pad_multiple=64)
                effs = []
                for rank in range(c):
                    meta = s.build_metadata([seq], [0], rank=rank)
                    keys = _tiles.tile_map(meta, rows).tile_keys
                    cost = sorted((k / 128 + 2.0 for k in keys.tolist() for _ in range(hq // g_pack)), reverse=True)
                    effs.append(sum(cost) / a.sms / _tiles._list_makespan(cost, a.sms))
                    if rank == 0:
                        meta0, keys0 = meta, keys
                line = (f"{shape} S={seq // 1024}k C={c}: {len(cost) / a.sms:.2f} waves per rank, efficiency "
                        f"min {min(effs):.3f} mean {sum(effs) / len(effs):.3f}")
                if a.persistent:
                    groups = hq // g_pack
                    # the CPU's L2 budget (32 MiB) plans the H200's sections (2/3 of 50 MiB) at these sizes
                    section = _tiles.heads_per_l2_section(meta0.num_kv_rows, (d + dv) * 2, hq // hkv // g_pack,
                                                          groups, meta0.device)
                    items = _tiles.section_order((keys0 / 128 + 2.0).tolist(), groups, section)
                    ratio = snake_makespan(items, a.sms) / _tiles._list_makespan(items, a.sms)
                    line += f"; persistent snake / grid order {ratio:.3f}"
                print(line)


if __name__ == "__main__":
    main()
