"""The benchmarks of cpattn (not installed with the package): ``python benchmarks/run.py FAMILY --help``.

One module per family (metadata, kernel, plan, mla, cp, scaling, decode, sparse), shared plumbing
in :mod:`benchmarks.common`, benchmark-only helpers beside them (``gpu_clocks``, the ``cp``
family's torch ``context_parallel`` peer ``_cp_peer``, ``decode --distributed``'s
``_decode_distributed``). CPU smoke tests of the benchmark code are in ``benchmarks/tests``.
"""
