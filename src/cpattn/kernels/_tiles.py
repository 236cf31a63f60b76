"""Launch geometry shared by the Triton kernel families: query tile maps, GQA head packing, L2
head sections, constants. Pure host code (no triton import), planned once per forward."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..metadata import CPMetadata

#: Query-tile heights (rows) the kernels are planned for.
TILE_ROWS: tuple[int, ...] = (16, 32, 64, 128)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

#: Bytes of shared memory one block may use on sm_90 (H100 / H200).
SM90_SMEM_PER_BLOCK = 232448

#: Bytes of L2 the launch order plans to keep K/V in (None: two thirds of the GPU's L2; 32 MiB
#: on the CPU). See :func:`heads_per_l2_section`.
L2_KV_BYTES: Optional[int] = None


@dataclass(frozen=True)
class TileMap:
    """Query tiles of ``rows`` rows each, heaviest first (largest last position; by L2 sequence
    group first where :func:`tile_map` was given ``group_keys``), pad tiles last.

    segment [N] / row_offset [N] int32 host tensors: the tile's segment and first row in it.
    ``num_tiles`` real entries; ``N`` may be larger (a static plan's capacity). ``mean_keys``:
    keys a tile's causal (and window) range spans, averaged over the tiles of real rows (0.0
    when there are none): what one program streams, against which its fixed cost counts.
    """

    rows: int
    num_tiles: int
    segment: Tensor
    row_offset: Tensor
    mean_keys: float = 0.0
    #: keys each of the ``num_tiles`` tiles spans, in tile order (host float64; pad tiles 0)
    tile_keys: Optional[Tensor] = None


def kv_strides(k, v, paged: bool) -> tuple[int, int, int, int, int, int]:
    """(page, row, head) element strides of K then V for the Triton kernels: paged caches
    ``[pages, page_size, Hkv, D]``; packed ``[rows, Hkv, D]`` (page stride 0)."""
    if paged:
        return k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2)
    return 0, k.stride(0), k.stride(1), 0, v.stride(0), v.stride(1)


def index_key_strides(k, k_scale, page_table, fallback) -> tuple:
    """(stride_kp, stride_kn, stride_sp, stride_sn, page table, stride_pt) of the indexer's keys
    for the Triton index kernels: paged keys ``[pages, page_size, D]`` with scales
    ``[pages, page_size]``; packed ``[rows, D]`` / ``[rows]`` (page strides 0; ``fallback``, any
    int32 tensor, stands in for the unread page table). ``k_scale`` None: scale strides 0."""
    if page_table is not None:
        ssp, ssn = (k_scale.stride(0), k_scale.stride(1)) if k_scale is not None else (0, 0)
        return k.stride(0), k.stride(1), ssp, ssn, page_table, page_table.stride(0)
    ssn = k_scale.stride(0) if k_scale is not None else 0
    return 0, k.stride(0), 0, ssn, fallback, 0


def segment_tiles(seg_len: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """(segment, row offset) [num_tiles] int64 of the tiles of ``rows`` rows that cover each
    segment of ``seg_len`` [S] int64 (host), in segment order (a segment's last tile may be
    short; an empty segment has none)."""
    counts = (seg_len + rows - 1) // rows
    num_tiles = int(counts.sum())
    segment = torch.repeat_interleave(torch.arange(seg_len.numel()), counts, output_size=num_tiles)
    first = torch.cumsum(counts, 0) - counts
    return segment, (torch.arange(num_tiles) - first[segment]) * rows


def tile_map(meta: CPMetadata, rows: int, capacity: Optional[int] = None, window_left: int = -1,
             group_keys: Optional[int] = None) -> TileMap:
    """Tiles over every segment of ``meta`` including the pad segment (so kernels write pad
    rows). ``capacity``: pad the arrays to this many entries (static plans). ``window_left``:
    the sliding window (-1: none), for ``mean_keys`` only. ``group_keys`` (see
    :func:`l2_group_keys`): the sequences go in L2 groups, sequence ``b`` in group
    ``cu_kv_lens[b] // group_keys`` (so a group spans at most ``group_keys`` keys plus its last
    sequence's), and the tiles run group by group, heaviest first inside a group; None: one
    group (heaviest first over the batch)."""
    host = meta.host if meta.host is not None else meta
    s = meta.num_segments + 1
    seg_len = host.seg_len[:s].long()
    seg_pos0 = host.seg_pos0[:s].long()
    seg_stride = host.seg_stride[:s].long()
    segment, row_offset = segment_tiles(seg_len, rows)
    num_tiles = segment.numel()
    last_row = torch.minimum(row_offset + rows, seg_len[segment]) - 1
    last_pos = seg_pos0[segment] + seg_stride[segment] * last_row
    real = last_pos >= 0  # not the pad segment's tiles (position -1)
    first_key = torch.zeros_like(last_pos)
    if window_left >= 0:
        first_key = (seg_pos0[segment] + seg_stride[segment] * row_offset - window_left).clamp_min(0)
    span = torch.where(real, last_pos + 1 - first_key, 0).double()
    mean_keys = float(span[real].mean()) if bool(real.any()) else 0.0
    order = torch.argsort(last_pos, descending=True, stable=True)  # heaviest first, pad (-1) last
    if group_keys is not None:
        if group_keys < 1:
            raise ValueError(f"group_keys must be >= 1, got {group_keys}")
        seq_group = host.cu_kv_lens[: meta.num_seqs].long() // group_keys
        seg_group = seq_group[host.seg_seq[: s - 1].long()]
        # pad tiles after every group; a stable sort keeps heaviest first inside each group
        group = torch.cat([seg_group, seg_group.new_full((1,), 1 << 62)])[segment]
        order = order[torch.argsort(group[order], stable=True)]
    size = num_tiles if capacity is None else capacity
    if num_tiles > size:
        raise ValueError(f"{num_tiles} query tiles exceed the plan's capacity of {size}")
    seg_out = torch.zeros(size, dtype=torch.int32)
    off_out = torch.zeros(size, dtype=torch.int32)
    seg_out[:num_tiles] = segment[order].to(torch.int32)
    off_out[:num_tiles] = row_offset[order].to(torch.int32)
    return TileMap(rows=rows, num_tiles=num_tiles, segment=seg_out, row_offset=off_out, mean_keys=mean_keys,
                   tile_keys=span[order])


def max_tiles(meta: CPMetadata, rows: int) -> int:
    """Most tiles any batch within a static plan's capacity can need (grid size)."""
    cap = meta.capacity
    return -(-cap.max_local_tokens // rows) + cap.max_segments + 1


def gqa_packing(num_q_heads: int, num_kv_heads: int, block_m: int) -> tuple[int, int]:
    """(G_PACK, rows): query heads of one KV head packed into a program's M dimension, and the
    tile height ``block_m // G_PACK`` (a :data:`TILE_ROWS` entry)."""
    group = num_q_heads // num_kv_heads
    g_pack = 1
    while group % (g_pack * 2) == 0 and (block_m // (g_pack * 2)) in TILE_ROWS:
        g_pack *= 2
    rows = block_m // g_pack
    if rows not in TILE_ROWS:
        raise ValueError(f"block_m={block_m} gives {rows}-row tiles; tiles have {TILE_ROWS} rows")
    return g_pack, rows


#: Section schedules are checked (:func:`section_schedule_loss`) up to this many programs per SM;
#: beyond it the imbalance they add is small and their L2 reuse counts more.
SECTION_CHECK_WAVES = 16


def _list_makespan(costs: list[float], num_sms: int) -> float:
    """Makespan of programs started in grid order on ``num_sms`` SMs, one at a time each (the
    block scheduler's behaviour for programs that fill an SM)."""
    free = [0.0] * num_sms
    end = 0.0
    for c in costs:
        t = free[0] + c
        heapq.heapreplace(free, t)
        end = t if t > end else end
    return end


def section_schedule_loss(tile_keys: Tensor, num_head_groups: int, heads_per_section: int, num_sms: int,
                          block_n: int = 128, fixed_blocks: float = 2.0) -> float:
    """Simulated makespan of the L2-section grid order (all tiles, heaviest first, of
    ``heads_per_section`` head groups, then the next section) over that of heaviest-first with
    head groups fastest, one program per (tile, head group) costing ``fixed_blocks + keys /
    block_n`` key blocks. Sections start the heaviest tiles of later sections late: with few
    programs per SM that is a long tail (d192 16k zigzag C = 8, rank 0, 132 SMs: 1.09 with 4 heads
    per section, 1.22 with 3). 1.0 when there is a single section or more than
    :data:`SECTION_CHECK_WAVES` programs per SM: a Python loop over programs (not tokens), O(programs
    log SMs), ~1 ms on the CPU VM at the bound."""
    programs = int(tile_keys.numel()) * num_head_groups
    if heads_per_section >= num_head_groups or not programs or programs > SECTION_CHECK_WAVES * num_sms:
        return 1.0
    cost = (tile_keys / block_n + fixed_blocks).tolist()
    lpt = [c for c in cost for _ in range(num_head_groups)]
    sections = section_order(cost, num_head_groups, heads_per_section)
    return _list_makespan(sections, num_sms) / _list_makespan(lpt, num_sms)


def section_order(costs: list[float], num_head_groups: int, heads_per_section: int) -> list[float]:
    """Per-tile ``costs`` (heaviest first) repeated in the L2-section grid order of the work
    items: every tile of ``heads_per_section`` head groups (head groups fastest), then the next
    section (``_sm90_common.tile_item`` on the device)."""
    order = []
    for first in range(0, num_head_groups, heads_per_section):
        n = min(heads_per_section, num_head_groups - first)
        order += [c for c in costs for _ in range(n)]
    return order


def l2_kv_budget(device: torch.device) -> int:
    """Bytes of L2 the launch order plans to keep K/V in: :data:`L2_KV_BYTES`, else two thirds of
    the GPU's L2 (32 MiB on the CPU)."""
    if L2_KV_BYTES is not None:
        return L2_KV_BYTES
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).L2_cache_size * 2 // 3
    return 32 << 20


def l2_group_keys(num_kv_tokens: int, kv_row_bytes: int, device: torch.device) -> Optional[int]:
    """Keys of one KV head whose K/V fit the L2 budget (:func:`l2_kv_budget`), where the batch's
    ``num_kv_tokens`` keys of one KV head do not (None where they do: a section then holds whole KV
    heads, see :func:`heads_per_l2_section`). With many sequences, heaviest first over the whole
    batch runs tiles of every sequence at once (1 KV head x 32 x 4096 keys, D128: 64 MiB), so tiles
    re-read K/V from HBM; :func:`tile_map` groups the sequences by this many keys instead."""
    budget = l2_kv_budget(device)
    if num_kv_tokens * kv_row_bytes <= budget:
        return None
    return max(1, budget // max(1, kv_row_bytes))


def heads_per_l2_section(
    num_kv_tokens: int, kv_row_bytes: int, head_groups_per_kv_head: int, num_head_groups: int, device: torch.device
) -> int:
    """Head groups whose programs run together, so the K/V they stream stays in L2.

    Programs are launched section by section: all tiles (heaviest first) of ``n`` head groups,
    then the next ``n``. Head groups fastest over the whole grid would have every KV head's
    stream in flight at once (8 heads x 64 MiB at 128k keys, D128), and tiles that start at
    different times would re-read it from HBM. ``kv_row_bytes`` is one key's K + V bytes for one
    KV head, ``num_kv_tokens`` the batch's keys; at least one KV head per section.
    """
    budget = l2_kv_budget(device)
    kv_heads = max(1, budget // max(1, num_kv_tokens * kv_row_bytes))
    return max(1, min(num_head_groups, kv_heads * head_groups_per_kv_head))
