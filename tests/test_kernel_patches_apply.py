"""The kernel patches the GPU session scripts apply to a copy of the tree (through
``tools/gpu/_variant.sh``; now ``tools/gpu/s14b.sh``'s joint K / V release, the named-barrier
ring release of the twelfth session, the thirteenth's persistent ping-pong and softmax under
``P V``) still apply, alone
and together, and leave Python that compiles: a patch that no longer applies would only show on
the GPU machine, as a lost call."""

from __future__ import annotations

import py_compile
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATCHES = ROOT / "tools" / "gpu" / "patches"
#: The patch sets the scripts that still apply to the tree use, in their order (split_kv_release,
#: o_smem_epilogue and d192_overlap are in the tree since the eleventh session, named_pingpong and
#: pingpong_auto since the twelfth; named_barrier_release is named_ring_release's first form:
#: records only). persistent_pingpong and softmax_under_pv were measured in the thirteenth session
#: and not kept; tools/gpu/s18a.sh still applies the second. no_seq_groups (fourteenth session) turns
#: the L2 sequence groups of the tile order off for tools/gpu/s18b.sh's A/B; l2_budget_3th / _8th
#: plan the tile order for a third / an eighth of the L2 instead of two thirds (s18d.sh);
#: named_ring_per_item: named_ring_release for one-program-per-item launches only (s18f.sh);
#: mla_wait_first, mla_decode_pv_first, mla_pv_first_paged and mla_chunk_ready are in the tree
#: since 0.3.11 / 0.3.12 / 0.3.13 / 0.3.13 (records); mla_pv_first_all (s19g.sh, not kept) gave
#: packed MLA prefill decode's loop order too and no longer applies over mla_pv_first_paged
#: (records only). revert_to_0312_mla takes the MLA kernel back to 0.3.12 for s21a.sh's A/B of
#: the two together. mla_staged_epilogue (s21b.sh, measured in the seventeenth session, not kept):
#: the MLA epilogue's stores through the value buffers, 16 bytes per thread. split_combine_pdl
#: (s22a.sh, eighteenth session): programmatic dependent launch between the split-KV kernels and the
#: combine, in the tree since 0.3.15 (record). pdl_default_off (s23a.sh, prepared): the shard plans'
#: default pdl=False, the tree's other side of an A/B of that launch. thread_release (s23d.sh,
#: not kept): per-thread stage releases. ptx_warp_release (+ ptx_warp_release_top) (s24a.sh): the
#: dense kernel's stage releases made per warp by a rewrite of its PTX (and without the bar.sync
#: before each consumer wait). v_wait_after_qk (s24d.sh): the overlapped loop waits for V_{j-1}
#: after issuing Q K_j^T, as FA4's does.
PENDING = [("joint_release_overlap0",), ("named_ring_release",), ("persistent_pingpong",), ("softmax_under_pv",),
           ("no_seq_groups",), ("l2_budget_3th",), ("l2_budget_8th",),
           ("named_ring_per_item",), ("revert_to_0312_mla",), ("mla_staged_epilogue",),
           ("pdl_default_off",), ("thread_release",), ("ptx_warp_release",),
           ("ptx_warp_release", "ptx_warp_release_top"), ("v_wait_after_qk",)]

pytestmark = pytest.mark.skipif(shutil.which("git") is None or not PATCHES.is_dir(),
                                reason="needs git and the repository's tools/gpu/patches")


@pytest.mark.parametrize("names", PENDING, ids=["+".join(n) for n in PENDING])
def test_pending_patches_apply_and_compile(tmp_path, names):
    shutil.copytree(ROOT / "src", tmp_path / "src")
    for name in names:
        r = subprocess.run(["git", "apply", str(PATCHES / f"{name}.patch")], cwd=tmp_path,
                           capture_output=True, text=True)
        assert r.returncode == 0, f"{name}.patch does not apply: {r.stderr}"
    changed = {line[len("+++ b/"):].strip() for name in names
               for line in (PATCHES / f"{name}.patch").read_text().splitlines() if line.startswith("+++ b/")}
    assert changed, "the patches name no files"
    for rel in sorted(changed):
        py_compile.compile(str(tmp_path / rel), doraise=True)
        if (ROOT / rel).exists():  # else a file the patches add
            assert (tmp_path / rel).read_text() != (ROOT / rel).read_text(), f"{rel} unchanged by {names}"
