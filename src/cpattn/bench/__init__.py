"""Benchmarks: ``python -m cpattn.bench <subcommand> --help``. Not imported by ``cpattn``."""
