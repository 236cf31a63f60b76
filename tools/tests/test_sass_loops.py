"""``tools/sass_loops.py``: a loop's synchronisation
summary from a ``cuobjdump -sass`` listing, on a hand-written listing with a key loop, a wait's
retry stub that branches back into it from past the kernel's end, and a loader loop without
wgmmas."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def sass_loops(load_tool):
    return load_tool("sass_loops.py")


def _listing(lines: list[tuple[int, str]]) -> str:
    return "\n".join(f"        /*{a:04x}*/                   {body} ;   /* 0x0000000000000000 */" for a, body in lines)


LISTING = _listing([
    (0x0100, "MOV R1, c[0x0][0x28]"),
    (0x0110, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x10], R2"),   # loop start
    (0x0120, "@!P0 BRA 0x0900"),                                      # to the retry stub
    (0x0130, "BAR.SYNC.DEFER_BLOCKING 0x9, 0x100"),
    (0x0140, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT"),
    (0x0150, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], R24, gsb0"),
    (0x0160, "BAR.ARV 0x8, 0x100"),
    (0x0170, "WARPGROUP.DEPBAR.LE gsb0, 0x1"),
    (0x0180, "BAR.SYNC.DEFER_BLOCKING 0x2, 0x80"),
    (0x0190, "@!P1 SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR4+0x20], RZ"),
    (0x01a0, "MUFU.EX2 R3, R3"),
    (0x01b0, "MUFU.EX2 R4, R4"),
    (0x01c0, "WARPGROUP.DEPBAR.LE gsb0, 0x0"),
    (0x01d0, "ARRIVES.LDGSTSBAR.64.ARVCNT [UR4+0x28]"),
    (0x01e0, "@P2 BRA 0x0110"),                                       # loop end
    (0x0200, "SYNCS.PHASECHK.TRANS64.TRYWAIT P3, [UR4+0x30], R2"),    # loader loop, no wgmma
    (0x0210, "@!P3 BRA 0x0200"),
    (0x0300, "EXIT"),
    (0x0900, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x10], R2"),    # retry stub
    (0x0910, "@!P0 BRA 0x0900"),
    (0x0920, "BRA 0x0130"),
])


def test_key_loop_summary(sass_loops):
    assert sass_loops.loops(LISTING, min_gmma=2) == [
        (0x0110, 0x01E0, "wait bar(0x9,0x100) gmmax2 barv(0x8,0x100) W1 bar(0x2,0x80) arrive* Ex2 W0 arrive-cp")]


def test_loops_below_the_wgmma_floor_are_left_out(sass_loops):
    assert sass_loops.loops(LISTING, min_gmma=3) == []
    # with no floor the loader's loop and the stub's self-loop count too (innermost, disjoint)
    spans = [(s, e) for s, e, _ in sass_loops.loops(LISTING, min_gmma=0)]
    assert spans == [(0x0110, 0x01E0), (0x0200, 0x0210), (0x0900, 0x0910)]
