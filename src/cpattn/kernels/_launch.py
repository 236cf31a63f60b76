"""Launching a planned Triton / Gluon kernel with little host work per layer.

``kernel[grid](**kwargs)`` binds and specializes every argument, builds a cache key and looks the
kernel up on every call: 100-200 µs of host work for the ~45 arguments of the attention kernels
(measured on H200, 2026-12-01). A :class:`PlannedLaunch` is built once per plan with the arguments
that do not change between layers (``fixed``) and the names of the per-call ones (``names``, the
order of the ``values`` tuple of each call); its first call goes through the JIT (compile or
cache lookup, autotuning) and records the compiled kernel together with a cheap signature of the
per-call arguments, which the caller builds from values it computes anyway: the 16-byte alignment
(and dtype where it can vary) of every tensor, the exact values of the int arguments (strides,
row counts) and constexpr flags. A later call with the same key hands the argument values
straight to the compiled kernel (the JIT specializes on alignment and on ints being 1 or
multiples of 16, so an equal key always means the same compiled kernel); any other key goes
through the JIT again.

Host tensor descriptors (Gluon ``TensorDescriptor``, the ``descriptors`` names) are not passed
per call: the caller gives ``make_descs`` (builds them) and ``desc_key``, a tuple of everything
they encode that can differ between calls (K/V data pointers, shapes, strides; block shapes,
layouts and dtype are fixed per launch). Where the installed Triton's launcher has a layout
this module knows (a ``CudaLauncher`` whose descriptor wrapper closes over the compiled C
``launch``, no profiling scratch, no launch hooks registered: triton 3.5 / 3.6 pass the kernel
arguments flat after 13 leading ones, triton 3.9 as one tuple after 15, with the argument
annotations and the packed signature), a call whose key matches
is sent to the C ``launch`` directly with its arguments prepared once per ``desc_key``: the
descriptors are built and converted into CUtensorMaps by Triton's own ``make_tensordesc_arg``
(so the maps are bit-identical to what Triton's launcher would make) and kept in a small LRU
(:data:`DESCRIPTOR_CACHE_SIZE` entries per launch: one per layer's distinct K/V buffers); a new
``desc_key`` (K/V moved, another shape or stride) builds and converts again. The plan's fixed
device tensors, and the per-call tensors of pointer arguments, are passed as their addresses
(the launcher's pointer check, done once at record time, resolves device memory to the same
address; a plan checks its tensors' device before it launches). A kernel that builds tensor
descriptors on the device needs global scratch memory (``global_scratch_size`` bytes per
program), which Triton's launcher allocates on every call: the direct path keeps one buffer per
stream instead, grown when a larger grid needs more, none freed before the launch is (a captured
CUDA graph holds their addresses; sequential launches of one kernel on one stream may share a
buffer: each program writes its descriptors before it reads them). Anything else
(another Triton, registered launch hooks, profiling scratch) takes the compiled kernel's ``run``
with descriptors built per call, and the interpreter always takes the plain JIT call; a C launch
that rejects the argument list (TypeError, raised before anything runs) turns the direct path off
for that kernel and takes its ``run`` from then on. Calls that
do not go direct run inside :class:`scratch_allocator` when the launch was made with
``device_scratch=True``.
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections import OrderedDict
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

logger = logging.getLogger("cpattn")

#: Prepared argument sets (one per distinct K/V descriptor set) kept per launch: a model's layers
#: with their own K/V buffers each take one.
DESCRIPTOR_CACHE_SIZE = 256
#: Leading arguments of triton 3.5 / 3.6's C ``launch`` (grid x3, stream, function, cooperative,
#: pdl, two scratch buffers, kernel metadata, launch metadata, enter / exit hooks); the kernel
#: arguments follow flat.
_BASE_ARGS = 13
#: Leading arguments of triton 3.9's C ``launch`` (grid x3, stream, function, cooperative, pdl,
#: kernel metadata, launch metadata, enter / exit hooks, two scratch buffers, argument
#: annotations, packed signature); the kernel arguments follow as one tuple.
_PACKED_BASE_ARGS = 15
#: What each direct call puts before its per-call values: the grid (x, y, z), the stream and the
#: global scratch address (None when the kernel needs none).
_HEAD = ("grid0", "grid1", "grid2", "stream", "scratch")
_DATA_PTR = Tensor.data_ptr
#: Compiled-kernel keys remembered per launch (the oldest is dropped past this).
MAX_KEYS = 8
#: Compile options of every cpattn launch: FP fusion (a * b + c as one FMA) stays on, the default of
#: triton 3.5 - 3.9 under which every kernel's accuracy and speed were measured (triton 3.9 warns
#: that 3.10 turns the default off; passing it explicitly keeps the compiled code the same).
COMPILE_OPTIONS = {"enable_fp_fusion": True}


class LRU:
    """A small least-recently-used map (``get`` refreshes; ``put`` drops the oldest past ``size``).
    Values must not be None. Holds no tensors by convention of its users."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"LRU size must be >= 1, got {size}")
        self.size = size
        self._d: OrderedDict = OrderedDict()

    def get(self, key):
        value = self._d.get(key)
        if value is not None:
            self._d.move_to_end(key)
        return value

    def put(self, key, value):
        d = self._d
        d[key] = value
        d.move_to_end(key)
        if len(d) > self.size:
            d.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key) -> bool:
        return key in self._d

    def clear(self) -> None:
        self._d.clear()


class LaunchState:
    """What a plan keeps between its calls of a kernel family: ``launchers`` (a
    :class:`PlannedLaunch` per kernel variant, filled by the family) and ``kv`` (an :class:`LRU` of
    per-K/V-layout facts, ints and flags only). ``enabled`` False: every call through the JIT."""

    def __init__(self, enabled: bool = True, cache_size: int = DESCRIPTOR_CACHE_SIZE) -> None:
        self.enabled = enabled
        self.cache_size = cache_size
        self.launchers: dict = {}
        self.kv = LRU(cache_size)

    def launcher(self, name: str, kernel, make_fixed: Callable[[], dict], names: Sequence[str]) -> "PlannedLaunch":
        """The :class:`PlannedLaunch` ``name`` of ``kernel``, created on first use with the fixed
        keyword arguments ``make_fixed()`` returns and the per-call argument ``names``."""
        launcher = self.launchers.get(name)
        if launcher is None:
            launcher = self.launchers[name] = PlannedLaunch(kernel, make_fixed(), names, enabled=self.enabled,
                                                            cache_size=self.cache_size)
        return launcher


def align_key(*tensors) -> tuple:
    """What the JIT specializes a tensor argument on: its dtype and 16-byte alignment."""
    return tuple([(t.dtype, t.data_ptr() & 15) for t in tensors])


def int_key(x: int) -> tuple:
    """What the JIT specializes an int argument on (triton 3.5 - 3.9): equal to 1 (a constant),
    divisible by 16, and whether it fits int32 (its type). For ints that vary between calls of
    one plan (e.g. a chunk offset), where the exact value would make every call a new key."""
    return (x == 1, x % 16 == 0, -(2**31) <= x < 2**31)


def _hooks_idle(hooks) -> bool:
    """No launch enter / exit hook registered (None, or an empty triton 3.5+ ``HookChain``)."""
    for hook in (hooks.launch_enter_hook, hooks.launch_exit_hook):
        if hook is not None and (not hasattr(hook, "calls") or hook.calls):
            return False
    return True


def _scratch_alloc(size: int, alignment: int, stream) -> Tensor:
    """Triton's allocator signature: ``size`` bytes on the current CUDA device (the caching
    allocator's blocks are 512-byte aligned, more than the descriptors' 128)."""
    return new_scratch(size)


def _cpu_scratch_alloc(size: int, alignment: int, stream) -> Tensor:
    return torch.empty(size, dtype=torch.int8)


class scratch_allocator:
    """Context manager: kernels that build tensor descriptors on the device need a global-memory
    scratch allocator. Installs a torch one on ``device`` ("cuda": the current GPU; "cpu" under
    the interpreter) for the launches inside, unless the caller set one, and restores the
    previous allocator afterwards (no process-wide side effect)."""

    def __init__(self, device: str = "cuda") -> None:
        self._alloc = _cpu_scratch_alloc if device == "cpu" else _scratch_alloc

    def __enter__(self):
        self._token = None
        import triton

        try:
            from triton.runtime import _allocation

            var = _allocation._allocator
        except (ImportError, AttributeError):  # another triton: the public setter
            triton.set_allocator(self._alloc)
            return self
        if isinstance(var.get(), _allocation.NullAllocator):
            self._var, self._token = var, var.set(self._alloc)
        return self

    def __exit__(self, *exc) -> None:
        if self._token is not None:
            self._var.reset(self._token)


class _Direct:
    """The compiled kernel's C ``launch`` and how to build its argument tuple (see the module
    docstring): ``entry(descs)`` -> the constant part for one descriptor set; ``pick`` maps
    ``entry + (grid0, grid1, grid2, stream, scratch) + values`` onto the C launcher's argument
    order, followed by :meth:`ptrs` of the values. ``scratch_bytes``: global scratch per program
    (0: none), ``scratch_align`` its alignment. ``num_values``: per-call values of each call;
    ``ptr_values``: those (indices) that are tensors for pointer arguments: they reach the C
    launch as their addresses (Triton's launcher would call ``data_ptr()`` and ask the driver
    whether the address is device memory, a driver call per tensor per launch; the plans have
    checked the tensors' device)."""

    def __init__(self, launch, make_arg, desc_meta: dict, layout: list, scratch_bytes: int = 0,
                 scratch_align: int = 1, num_values: int = 0, ptr_values: Sequence[int] = (),
                 packed_after: int = 0) -> None:
        self.launch, self.make_arg, self.desc_meta = launch, make_arg, desc_meta
        #: 0: the C launch takes every argument flat; n: its first n, then the rest as one tuple
        self.packed_after = packed_after
        #: per C-launcher argument: ("const", x) | ("head", 0-2 grid / 3 stream / 4 scratch) |
        #: ("value", j) | ("ptr", j) (the address of value j) | ("desc", name) (expanded into several)
        self.layout = layout
        self.num_values = num_values
        ptr_values = tuple(ptr_values)
        self._ptr_index = {j: i for i, j in enumerate(ptr_values)}
        if len(ptr_values) > 1:
            self.ptr_get: Optional[Callable] = operator.itemgetter(*ptr_values)
        elif ptr_values:
            (only,) = ptr_values
            self.ptr_get = lambda values: (values[only],)
        else:
            self.ptr_get = None
        self.pick: Optional[Callable] = None
        self.lengths: Optional[dict] = None
        self.scratch_bytes, self.scratch_align = scratch_bytes, max(1, scratch_align)
        #: stream -> (buffer, aligned address, programs it holds)
        self.scratch: dict = {}
        #: buffers a larger grid replaced: kept while the launch lives (a CUDA graph captured
        #: with them holds their address)
        self._retired: list = []

    def scratch_ptr(self, grid: tuple, stream) -> int:
        """The address of this stream's global scratch for ``grid`` (allocated, or grown, on the
        current device when it does not hold the grid's programs yet; no buffer is freed before
        the launch is)."""
        programs = grid[0] * grid[1] * grid[2]
        held = self.scratch.get(stream)
        if held is not None and held[2] >= programs:
            return held[1]
        if held is not None:
            self._retired.append(held[0])
        align = self.scratch_align
        buf = new_scratch(programs * self.scratch_bytes + align)
        ptr = -(-buf.data_ptr() // align) * align
        self.scratch[stream] = (buf, ptr, programs)
        return ptr

    def fire(self, args: tuple) -> None:
        """Call the C launch with ``args`` (the output of ``pick``) in its argument layout."""
        n = self.packed_after
        if n:
            self.launch(*args[:n], args[n:])
        else:
            self.launch(*args)

    def ptrs(self, values: tuple) -> tuple:
        """The addresses of the pointer values (appended to each call's arguments)."""
        return tuple(map(_DATA_PTR, self.ptr_get(values))) if self.ptr_get is not None else ()

    def entry(self, descs: dict) -> Optional[tuple]:
        """The constant arguments with these descriptors' CUtensorMap expansions, or None when an
        expansion cannot be kept (holds a tensor: the kernel did not lower it to TMA)."""
        consts: list = []
        src: list = []  # per C-launcher argument: index in consts, or -1 - (index in head + values)
        expanded = {name: list(self.make_arg(desc, self.desc_meta[name])) for name, desc in descs.items()}
        if any(isinstance(x, Tensor) for e in expanded.values() for x in e):
            return None
        lengths = {name: len(e) for name, e in expanded.items()}
        if self.lengths is not None and lengths != self.lengths:
            return None
        for kind, item in self.layout:
            if kind == "const":
                src.append(len(consts))
                consts.append(item)
            elif kind == "head":
                src.append(-1 - item)
            elif kind == "value":
                src.append(-1 - (len(_HEAD) + item))
            elif kind == "ptr":
                src.append(-1 - (len(_HEAD) + self.num_values + self._ptr_index[item]))
            else:
                for x in expanded[item]:
                    src.append(len(consts))
                    consts.append(x)
        if self.pick is None:
            n = len(consts)
            self.pick = operator.itemgetter(*[i if i >= 0 else n + (-1 - i) for i in src])
            self.lengths = lengths
        return tuple(consts)


class _Record:
    """One compiled kernel of a :class:`PlannedLaunch` and how to call it."""

    __slots__ = ("compiled", "template", "slots", "desc_slots", "direct", "entries")

    def __init__(self, compiled, template, slots, desc_slots, direct, cache_size) -> None:
        self.compiled, self.template, self.slots, self.desc_slots = compiled, template, slots, desc_slots
        self.direct: Optional[_Direct] = direct
        self.entries = LRU(cache_size)


class PlannedLaunch:
    """``launch(grid, values, key, desc_key, make_descs)`` of ``kernel`` (a JIT function or an
    autotuner) with the plan's ``fixed`` keyword arguments. ``names``: the per-call argument names
    (``values`` is a tuple in this order); ``key``: a tuple of ints / dtypes / bools deciding the
    compiled kernel (see above; up to :data:`MAX_KEYS` keys are remembered, e.g. calls with and
    without LSE); ``descriptors``: names of host tensor-descriptor arguments, built by
    ``make_descs()`` (a tuple in this order) and described by ``desc_key``."""

    def __init__(self, kernel, fixed: dict, names: Sequence[str], *, descriptors: Sequence[str] = (),
                 enabled: bool = True, cache_size: int = DESCRIPTOR_CACHE_SIZE, device_scratch: bool = False) -> None:
        self.kernel, self.fixed = kernel, dict(fixed)
        #: the kernel may build tensor descriptors on the device: calls that do not go direct run
        #: inside :class:`scratch_allocator`
        self.device_scratch = device_scratch
        self.names, self.descriptors = tuple(names), tuple(descriptors)
        overlap = set(self.names) & (set(self.descriptors) | set(self.fixed))
        if overlap:
            raise ValueError(f"arguments both per call and fixed / descriptors: {sorted(overlap)}")
        self.cache_size = cache_size
        self.records: dict = {}
        self._enabled = enabled
        try:
            from triton import knobs
            from triton.runtime.driver import driver

            self._hooks = knobs.runtime
            active = driver.active
            self._device, self._stream = active.get_current_device, active.get_current_stream
            jit = kernel.fn if hasattr(kernel, "configs") else kernel  # autotuner -> its JIT function
            self._arg_names = list(jit.arg_names)
        except Exception:  # another triton (or no GPU driver): plain JIT calls only
            self._enabled = False

    def direct(self, key: tuple) -> bool:
        """Calls with ``key`` go to the C launcher with cached arguments."""
        rec = self.records.get(key)
        return rec is not None and rec.direct is not None

    def __call__(self, grid: tuple, values: tuple, key: tuple, desc_key=(),
                 make_descs: Optional[Callable[[], tuple]] = None) -> None:
        rec = self.records.get(key)
        if rec is not None:
            direct = rec.direct
            if direct is not None and _hooks_idle(self._hooks):
                entry = rec.entries.get(desc_key)
                if entry is None:
                    entry = self._new_entry(rec, desc_key, make_descs)
                if entry is not None:
                    g = tuple(grid)
                    if len(g) != 3:
                        g += (1, 1)[:3 - len(g)]
                    stream = self._stream(self._device())
                    scratch = direct.scratch_ptr(g, stream) if direct.scratch_bytes else None
                    try:
                        direct.fire(direct.pick(entry + g + (stream, scratch) + values + direct.ptrs(values)))
                        return
                    except TypeError as exc:  # the C launch parses its arguments before it launches
                        logger.debug("cpattn: direct launch rejected by the C launcher (%s); using run", exc)
                        rec.direct = None
                        rec.entries.clear()
            with self._scratch_context():
                self._run_compiled(rec, grid, values, make_descs)
            return
        if len(values) != len(self.names):
            raise ValueError(f"{len(values)} per-call values for {len(self.names)} names {self.names}")
        kwargs = dict(zip(self.names, values))
        if self.descriptors:
            kwargs.update(zip(self.descriptors, make_descs()))
        with self._scratch_context():
            compiled = self.kernel[grid](**self.fixed, **kwargs, **COMPILE_OPTIONS)
        if self._enabled and compiled is not None and hasattr(compiled, "run") and hasattr(compiled, "function"):
            self._record(compiled, key, values)

    def _scratch_context(self):
        """What a call through Triton's own launcher runs inside: a scratch allocator when the
        kernel may build descriptors on the device."""
        return scratch_allocator() if self.device_scratch else contextlib.nullcontext()

    def _run_compiled(self, rec: _Record, grid: tuple, values: tuple, make_descs) -> None:
        """The compiled kernel's own launcher (descriptors built and converted by Triton)."""
        args = list(rec.template)
        for i, j in rec.slots:
            args[i] = values[j]
        if self.descriptors:
            for i, desc in zip(rec.desc_slots, make_descs()):
                args[i] = desc
        k = rec.compiled
        stream = self._stream(self._device())
        hooks = self._hooks
        g = tuple(grid) + (1, 1)
        if _hooks_idle(hooks):
            k.run(g[0], g[1], g[2], stream, k.function, k.packed_metadata, None, None, None, *args)
        else:
            meta = k.launch_metadata(grid, stream, *args)
            k.run(g[0], g[1], g[2], stream, k.function, k.packed_metadata, meta, hooks.launch_enter_hook,
                  hooks.launch_exit_hook, *args)

    def _new_entry(self, rec: _Record, desc_key, make_descs) -> Optional[tuple]:
        try:
            descs = dict(zip(self.descriptors, make_descs())) if self.descriptors else {}
            entry = rec.direct.entry(descs)
        except Exception as exc:  # pragma: no cover - depends on the triton version
            logger.debug("cpattn: direct launch disabled (%s)", exc)
            entry = None
        if entry is None:
            rec.direct = None
            rec.entries.clear()
            return None
        return rec.entries.put(desc_key, entry)

    def _record(self, compiled, key: tuple, values: tuple = ()) -> None:
        """Remember ``compiled`` for ``key`` (``values``: the recorded call's, telling which
        pointer arguments are tensors)."""
        try:
            extra = {}
            best = getattr(self.kernel, "best_config", None)
            if best is not None:
                extra = {k: v for k, v in best.all_kwargs().items() if k in self._arg_names}
            merged = {**self.fixed, **extra}
            where = {name: j for j, name in enumerate(self.names)}
            descs = set(self.descriptors)
            missing = [n for n in self._arg_names if n not in merged and n not in where and n not in descs]
            if missing:
                raise KeyError(f"arguments neither fixed nor per call: {missing}")
            template = [merged.get(name) for name in self._arg_names]
            slots = [(i, where[name]) for i, name in enumerate(self._arg_names) if name in where]
            desc_slots = [self._arg_names.index(name) for name in self.descriptors]
            tensors = {j for j, x in enumerate(values) if isinstance(x, Tensor)}
            direct = _direct_launch(compiled, self._arg_names, merged, where, descs, tensors)
            if len(self.records) >= MAX_KEYS:
                self.records.pop(next(iter(self.records)))
            self.records[key] = _Record(compiled, template, slots, desc_slots, direct, self.cache_size)
        except Exception as exc:  # pragma: no cover - depends on the triton version
            logger.debug("cpattn: planned launch disabled (%s)", exc)
            self._enabled = False
            self.records.clear()


def _c_launch_of(run, has_descs: bool):
    """(C launch function, make_tensordesc_arg(desc, meta), per-descriptor metadata list, packed)
    of a ``CudaLauncher`` whose layout is one this module knows, or None. ``packed``: triton 3.9's
    layout (kernel arguments as one tuple after :data:`_PACKED_BASE_ARGS` leading ones)."""
    if type(run).__name__ != "CudaLauncher" or not type(run).__module__.endswith("nvidia.driver"):
        return None
    if getattr(run, "profile_scratch_size", 1) or not isinstance(getattr(run, "global_scratch_size", None), int):
        return None  # profiling scratch: left to the Python launcher
    if getattr(run, "gsan_enabled", False):
        return None  # the sanitizer appends its own arguments
    packed = hasattr(run, "arg_annotations") and hasattr(run, "kernel_signature")
    launch = run.launch
    if not has_descs:  # what CudaLauncher.__call__ calls, minus the (empty) scratch allocation
        return (launch, None, [], packed) if callable(launch) else None
    # triton's descriptor wrapper: ``inner`` expands each descriptor with make_tensordesc_arg and
    # calls the compiled C launch (``launcher`` in its closure)
    qualname = getattr(launch, "__qualname__", "")
    code, closure = launch.__code__, launch.__closure__ or ()
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in closure)))
    inner, meta = cells.get("launcher"), cells.get("tensordesc_meta")
    if not packed and qualname == "wrap_handle_tensordesc.<locals>.inner":
        make_arg = launch.__globals__.get("make_tensordesc_arg")
        if launch.__globals__.get("_BASE_ARGS_FORMAT_LEN") != _BASE_ARGS:
            return None
    elif packed and qualname == "wrap_handle_tensordesc_impl.<locals>.inner":
        make3 = cells.get("make_tensordesc_arg")  # (desc, meta, base args: unused by nvidia's)
        if make3 is None or getattr(getattr(make3, "__code__", None), "co_argcount", 0) != 3:
            return None
        make_arg = lambda desc, m: make3(desc, m, None)  # noqa: E731
    else:
        return None
    if not callable(inner) or meta is None or make_arg is None:
        return None
    return inner, make_arg, list(meta), packed


def _direct_launch(compiled, arg_names: list, merged: dict, where: dict, descs: set,
                   tensors: set = frozenset()) -> Optional[_Direct]:
    """The direct-launch plan of a compiled kernel (None: take its ``run``). ``tensors``: indices
    of the per-call values that were tensors (pointer arguments among them go as addresses)."""
    sig = getattr(getattr(compiled, "src", None), "signature", None)
    if not isinstance(sig, dict) or list(sig) != arg_names or any(isinstance(t, tuple) for t in sig.values()):
        return None
    sig_descs = [n for n, t in sig.items() if isinstance(t, str) and t.startswith("tensordesc")]
    if set(sig_descs) != descs:
        return None
    found = _c_launch_of(compiled.run, bool(sig_descs))
    if found is None:
        return None
    launch, make_arg, meta, packed = found
    if len(meta) != len(sig_descs):
        return None
    k = compiled
    run = k.run
    # what CudaLauncher.__call__ allocates per call: global_scratch_size bytes per program of each CTA
    scratch_bytes = run.global_scratch_size * getattr(run, "num_ctas", 1)
    scratch = ("head", 4) if scratch_bytes else ("const", None)
    layout: list = [("head", 0), ("head", 1), ("head", 2), ("head", 3), ("const", k.function),
                    ("const", run.launch_cooperative_grid), ("const", run.launch_pdl)]
    if packed:  # metadata, launch metadata, hooks, scratch x2, annotations, signature
        layout += [("const", k.packed_metadata), ("const", None), ("const", None), ("const", None), scratch,
                   ("const", None), ("const", run.arg_annotations), ("const", run.kernel_signature)]
    else:  # scratch x2, metadata, launch metadata, hooks
        layout += [scratch, ("const", None), ("const", k.packed_metadata), ("const", None), ("const", None),
                   ("const", None)]
    ptr_values: list = []
    for name in arg_names:
        if name in descs:
            layout.append(("desc", name))
        elif name in where:
            j = where[name]
            ty = sig[name]
            if j in tensors and isinstance(ty, str) and ty.startswith("*"):
                ptr_values.append(j)
                layout.append(("ptr", j))
            else:
                layout.append(("value", j))
        else:
            x = merged[name]
            if isinstance(x, Tensor) and x.is_cuda:
                x = x.data_ptr()  # the plan keeps the tensor (fixed); device memory: same address
            layout.append(("const", x))
    return _Direct(launch, make_arg, dict(zip(sig_descs, meta)), layout, scratch_bytes,
                   getattr(run, "global_scratch_align", 1), len(where), ptr_values,
                   _PACKED_BASE_ARGS if packed else 0)


def new_scratch(nbytes: int) -> Tensor:
    """A global scratch buffer of ``nbytes`` on the current CUDA device (the offline launch check
    replaces this)."""
    return torch.empty(nbytes, dtype=torch.int8, device="cuda")
