"""``python -m cpattn.bench {metadata,kernel,plan,mla,cp,scaling,decode,sparse} [options]``.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``main(args)``;
modules are imported only when their subcommand runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "metadata": ("metadata", "host cost of build_metadata for 1, 64 and 1024 sequences (CPU)"),
    "kernel": ("kernel", "attention kernels (triton, fa4, torch SDPA) on per-rank CP work (GPU)"),
    "mla": ("mla", "MLA latent all-gather vs full K/V gather, MLA layer at CP=1 vs CP=2 (GPUs)"),
    "cp": ("cp", "end-to-end CP prefill of an attention stack vs peers (torchrun, GPUs)"),
    "plan": ("plan", "host work per attention call: plan.run vs strategy.attention (GPU)"),
    "scaling": ("scaling", "arithmetic model of CP prefill time for C = 1..64 across nodes (CPU)"),
    "decode": ("decode", "decode over a sharded KV cache (split-KV + merge) and the pass-KV / pass-Q crossover (GPU)"),
    "sparse": ("sparse", "DSA sparse attention and index top-k on one rank's interleave CP work (GPU)"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cpattn.bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module)
        try:
            importlib.import_module(f"cpattn.bench.{module}").add_arguments(p)
        except ModuleNotFoundError as exc:  # subcommand not written yet, or an optional extra missing
            p.set_defaults(_missing=str(exc))
    args = parser.parse_args(argv)
    if getattr(args, "_missing", None):
        parser.error(f"{args.command}: {args._missing}")
    return importlib.import_module(f"cpattn.bench.{args._module}").main(args) or 0


if __name__ == "__main__":
    sys.exit(main())
