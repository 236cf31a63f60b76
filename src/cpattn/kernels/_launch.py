"""Launching a planned Triton / Gluon kernel with little host work per layer.

``kernel[grid](**kwargs)`` binds and specializes every argument, builds a cache key and looks the
kernel up on every call: 100-200 µs of host work for the ~45 arguments of the attention kernels
(measured on H200, 2026-12-01). A :class:`PlannedLaunch` is built once per plan with the arguments
that do not change between layers (``fixed``); its first call goes through the JIT (compile or
cache lookup, autotuning) and records the compiled kernel together with a cheap signature of the
per-call arguments, which the caller builds from values it computes anyway: the 16-byte alignment
(and dtype where it can vary) of every tensor, the exact values of the int arguments (strides,
row counts) and constexpr flags. A later call with the same key hands the argument values
straight to the compiled kernel's launcher; any other key goes through the JIT again (which
specializes on alignment and on ints being 1 or multiples of 16, so an equal key always means
the same compiled kernel). Falls back to the plain JIT call where the Triton version's internals are
not the expected ones, and always under the interpreter.
"""

from __future__ import annotations

import logging
from typing import Optional

from torch import Tensor

logger = logging.getLogger("cpattn")


class PlannedLaunch:
    """``launch(grid, per_call, key)`` of ``kernel`` (a JIT function or an autotuner) with the
    plan's ``fixed`` keyword arguments. ``per_call``: the arguments that may differ between
    layers; ``key``: a tuple of ints / dtypes / bools deciding the compiled kernel (see above)."""

    def __init__(self, kernel, fixed: dict, enabled: bool = True) -> None:
        self.kernel, self.fixed = kernel, dict(fixed)
        self._compiled = None
        self._sig: Optional[tuple] = None
        self._values_template: Optional[list] = None
        self._per_call_slots: list[tuple[int, str]] = []
        self._enabled = enabled
        try:
            from triton.runtime.driver import driver
            from triton import knobs

            self._knobs = knobs
            active = driver.active
            self._device, self._stream = active.get_current_device, active.get_current_stream
            jit = kernel.fn if hasattr(kernel, "configs") else kernel  # autotuner -> its JIT function
            self._arg_names = list(jit.arg_names)
        except Exception:  # another triton: plain JIT calls only
            self._enabled = False

    def __call__(self, grid: tuple, per_call: dict, key: tuple) -> None:
        if self._compiled is not None:
            if key == self._sig:
                values = list(self._values_template)
                for i, name in self._per_call_slots:
                    values[i] = per_call[name]
                k = self._compiled
                stream = self._stream(self._device())
                hooks = self._knobs.runtime
                enter = hooks.launch_enter_hook
                meta = k.launch_metadata(grid, stream, *values) if enter is not None else None
                k.run(grid[0], 1, 1, stream, k.function, k.packed_metadata, meta, enter, hooks.launch_exit_hook,
                      *values)
                return
        compiled = self.kernel[grid](**self.fixed, **per_call)
        if self._enabled and compiled is not None and hasattr(compiled, "run") and hasattr(compiled, "function"):
            self._record(compiled, per_call, key)

    def _record(self, compiled, per_call: dict, key: tuple) -> None:
        try:
            extra = {}
            best = getattr(self.kernel, "best_config", None)
            if best is not None:
                extra = {k: v for k, v in best.all_kwargs().items() if k in self._arg_names}
            merged = {**self.fixed, **extra, **per_call}
            self._values_template = [merged[name] for name in self._arg_names]
            self._per_call_slots = [(i, name) for i, name in enumerate(self._arg_names) if name in per_call]
            self._sig = key
            self._compiled = compiled
        except Exception as exc:  # pragma: no cover - depends on the triton version
            logger.debug("cpattn: planned launch disabled (%s)", exc)
            self._enabled = False
