"""ptxas spill report of the dense D128 sm90 kernel, ``overlap`` 0 against 2, over packed / page 16
/ page 1 K/V x window x sinks x persistent (LSE on): the offline evidence behind
``triton_backend.use_overlap`` keeping windowed plans at ``overlap=0``.

Needs triton 3.6 (the GPU machine's) for sm_90a, no GPU: ``PYTHONPATH=src:tools python
tools/sm90_overlap_spills.py`` (48 builds, about 3 minutes on 2 cores)."""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor

import sm90_offline_check as oc


def _report(variant: tuple) -> tuple:
    overlap, page, window, sinks, persistent = variant
    kernel = oc.compile_variant(128, 128, 4, 3, overlap, False, window, sinks, True, page, persistent=persistent)
    return variant, oc.ptxas_report(kernel.asm["ptx"], None).split(";")[0]


def main() -> None:
    variants = [(ov, page, win, sinks, pers) for ov in (0, 2) for page in (None, 16, 1)
                for win, sinks in ((False, False), (True, False), (False, True), (True, True)) for pers in (False, True)]
    with ProcessPoolExecutor(2) as pool:
        for (ov, page, win, sinks, pers), spills in pool.map(_report, variants):
            print(f"overlap {ov} page {page or '-':>3} window {win:d} sinks {sinks:d} persistent {pers:d}: {spills}",
                  flush=True)


if __name__ == "__main__":
    main()
