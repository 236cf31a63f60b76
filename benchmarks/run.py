"""The benchmarks of cpattn: ``python benchmarks/run.py FAMILY [options]``.

    python benchmarks/run.py FAMILY --help                    # any working directory
    python -m benchmarks FAMILY ...                           # from the repository root
    torchrun --nproc_per_node C benchmarks/run.py FAMILY ...  # the multi-GPU families (cp, mla, decode --distributed)

Families: metadata, kernel, plan, mla, cp, scaling, decode, sparse, placement, hfgen, dsa_decode, plan_algorithms (below). Each lives in
``benchmarks/FAMILY.py`` exposing ``add_arguments(parser)`` and ``main(args)``; only the chosen
family's module is imported. Without ``--out`` every family writes into ``bench-out/`` at the
repository root (git-ignored), whatever the working directory; CPU smoke runs (tiny shapes on the
CPU) write ``*-cpu-smoke.*`` files there, never over a GPU result.

benchmarks/ is not installed with cpattn: this script puts the repository root on ``sys.path``
(for ``benchmarks`` and ``reference_layers``) and, when no cpattn is importable, the checkout's
``src/`` after everything else.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(_HERE)
if sys.path and os.path.abspath(sys.path[0] or os.curdir) == _HERE:
    sys.path.pop(0)  # run by path: benchmarks/ itself must not shadow top-level modules (common, plan, ...)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
if importlib.util.find_spec("cpattn") is None:  # a checkout without an install
    sys.path.append(os.path.join(ROOT, "src"))

FAMILIES = {
    "metadata": "host cost of build_metadata for 1, 64 and 1024 sequences (CPU)",
    "kernel": "attention kernels (triton, fa4, torch SDPA) on per-rank CP work (GPU)",
    "mla": "MLA latent all-gather vs full K/V gather, MLA layer at CP=1 vs CP=2 (GPUs)",
    "cp": "end-to-end CP prefill of an attention stack vs peers (torchrun, GPUs)",
    "plan": "host work per attention call: plan.attend vs strategy.attention (GPU)",
    "scaling": "arithmetic model of CP prefill time for C = 1..64 across nodes (CPU)",
    "decode": "decode over a sharded KV cache (split-KV + merge) and the pass-KV / pass-Q crossover (GPU)",
    "sparse": "DSA sparse attention and index top-k on one rank's interleave CP work (GPU)",
    "placement": "CP per batch: choose_placement's predicted vs measured time, break-even length (GPU)",
    "hfgen": "HF generate with cpattn's sharded KV cache vs transformers' own, one GPU at C = 1 (GPU)",
    "dsa_decode": "DSA decode over a sharded cache: one rank's step (exact top-k + sparse attention) vs C = 1 (GPU)",
    "plan_algorithms": "host cost of one plan.run per attention algorithm, collectives counted (gloo, CPU)",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/run.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="family", required=True, metavar="FAMILY")
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, help_text in FAMILIES.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name != chosen:
            continue
        try:
            importlib.import_module(f"benchmarks.{name}").add_arguments(p)
        except ModuleNotFoundError as exc:  # an optional extra missing
            p.set_defaults(_missing=str(exc))
    args = parser.parse_args(argv)
    if getattr(args, "_missing", None):
        parser.error(f"{args.family}: {args._missing}")
    return importlib.import_module(f"benchmarks.{args.family}").main(args) or 0


if __name__ == "__main__":
    sys.exit(main())
