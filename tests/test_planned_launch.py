"""Planned launches on the host (no GPU): the descriptor cache's keying, invalidation and bound,
the direct C-launcher call against the compiled kernel's own launcher, and every fallback.

The compiled kernel and Triton's launcher are stand-ins with the layouts of triton 3.5 / 3.6's
``CudaLauncher`` (``wrap_handle_tensordesc`` closing over the C ``launch``, kernel arguments flat)
and of triton 3.9's (``wrap_handle_tensordesc_impl``, kernel arguments as one tuple); the real
layout of the installed triton is checked by ``tools/host_launch_offline_check.py``.
"""

from __future__ import annotations

import types

import pytest
import torch

from cpattn.kernels import _launch
from cpattn.kernels._launch import LRU, PlannedLaunch

#: read by _launch from the launcher's globals, as in triton's nvidia driver module
_BASE_ARGS_FORMAT_LEN = 13
ARG_NAMES = ["Q", "k_desc", "seg", "n", "FLAG"]
SIGNATURE = {"Q": "*bf16", "k_desc": "tensordesc<bf16[64, 64],layout>", "seg": "*i32", "n": "i32",
             "FLAG": "constexpr"}


class Desc:
    """A host tensor descriptor stand-in (what make_tensordesc_arg reads)."""

    def __init__(self, base, shape, strides):
        self.base, self.shape, self.strides = base, list(shape), list(strides)


def make_tensordesc_arg(arg, meta):
    if meta is None:  # not lowered to TMA: the base tensor travels (cannot be cached)
        return [arg.base, *arg.shape, *arg.strides]
    return [("map", arg.base.data_ptr(), tuple(arg.shape), tuple(arg.strides), meta["swizzle"]), *arg.shape,
            *arg.strides]


def wrap_handle_tensordesc(launcher, signature, tensordesc_meta):
    """Triton's layout: ``inner`` closes over ``launcher`` (the C launch) and ``tensordesc_meta``."""
    idx = [i for i, s in enumerate(signature.values()) if s.startswith("tensordesc")]

    def inner(*args):
        final = list(args[:_BASE_ARGS_FORMAT_LEN])
        for i, a in enumerate(args[_BASE_ARGS_FORMAT_LEN:]):
            final.extend(make_tensordesc_arg(a, tensordesc_meta[idx.index(i)]) if i in idx else [a])
        return launcher(*final)

    return inner


class CudaLauncher:
    """The compiled kernel's ``run``: allocates global scratch from triton's current allocator
    (as triton's does, ``scratch`` bytes per program), calls ``launch``."""

    def __init__(self, c_launch, meta, scratch=0, profile_scratch=0):
        self.launch = wrap_handle_tensordesc(c_launch, SIGNATURE, meta)
        self.global_scratch_size, self.profile_scratch_size = scratch, profile_scratch
        self.global_scratch_align, self.num_ctas = 128, 1
        self.launch_cooperative_grid, self.launch_pdl = False, False
        self.runs = 0
        self.allocations = []

    def __call__(self, gx, gy, gz, stream, function, *args):
        self.runs += 1
        buf = None
        if self.global_scratch_size:
            from triton.runtime import _allocation

            buf = _allocation._allocator.get()(gx * gy * gz * self.global_scratch_size, 128, stream)
            self.allocations.append(buf)
        self.launch(gx, gy, gz, stream, function, False, False, buf, None, *args)


CudaLauncher.__module__ = "fake.backends.nvidia.driver"

#: triton 3.9's leading C-launch arguments and its two launcher attributes
PACKED_BASE = 15
ANNOTATIONS, KERNEL_SIGNATURE = ("ann",), b"sig"


def make_tensordesc_arg3(arg, meta, base_args):
    return make_tensordesc_arg(arg, meta)


def wrap_handle_tensordesc_impl(launcher, signature, tensordesc_meta, make_tensordesc_arg):
    """triton 3.9's layout: the kernel arguments come as the last argument, one tuple, and the
    descriptor expander is a closure variable taking the leading arguments as well."""
    idx = [i for i, s in enumerate(signature.values()) if s.startswith("tensordesc")]

    def inner(*args):
        base, kernel_args = args[:-1], args[-1]
        final = []
        for i, a in enumerate(kernel_args):
            final.extend(make_tensordesc_arg(a, tensordesc_meta[idx.index(i)], base) if i in idx else [a])
        return launcher(*base, tuple(final))

    return inner


class PackedCudaLauncher(CudaLauncher):
    """triton 3.9's ``CudaLauncher``: metadata and hooks before the scratch buffers, then the
    argument annotations, the packed signature and the kernel arguments as one tuple."""

    def __init__(self, c_launch, meta, scratch=0, profile_scratch=0):
        super().__init__(c_launch, meta, scratch, profile_scratch)
        self.launch = wrap_handle_tensordesc_impl(c_launch, SIGNATURE, meta, make_tensordesc_arg3)
        self.arg_annotations, self.kernel_signature, self.gsan_enabled = ANNOTATIONS, KERNEL_SIGNATURE, False

    def __call__(self, gx, gy, gz, stream, function, kernel_metadata, launch_metadata, enter, exit_, *args):
        self.runs += 1
        self.launch(gx, gy, gz, stream, function, False, False, kernel_metadata, launch_metadata, enter, exit_,
                    None, None, self.arg_annotations, self.kernel_signature, args)


PackedCudaLauncher.__name__, PackedCudaLauncher.__module__ = "CudaLauncher", CudaLauncher.__module__


class Compiled:
    def __init__(self, launcher):
        self.run, self.function, self.packed_metadata = launcher, 99, (4, 1, 0)
        self.src = types.SimpleNamespace(signature=dict(SIGNATURE))
        self.metadata_calls = 0

    def launch_metadata(self, grid, stream, *args):
        self.metadata_calls += 1
        return {"grid": grid}


class Kernel:
    """A JIT function stand-in: ``kernel[grid](**kwargs)`` launches through the compiled
    kernel's run and returns it."""

    arg_names = ARG_NAMES

    def __init__(self, compiled):
        self.compiled, self.jit_calls = compiled, []

    def __getitem__(self, grid):
        def call(**kwargs):
            self.jit_calls.append(kwargs)
            c = self.compiled
            c.run(grid[0], 1, 1, 5, c.function, c.packed_metadata, None, None, None,
                  *[kwargs[n] for n in ARG_NAMES])
            return c

        return call


def _setup(meta=({"swizzle": 128},), scratch=0, cache_size=4, hooks=None, profile_scratch=0, launcher=CudaLauncher,
           c_launch=None):
    c_calls = []
    compiled = Compiled(launcher(c_launch or (lambda *a: c_calls.append(a)), list(meta), scratch, profile_scratch))
    kernel = Kernel(compiled)
    seg = torch.arange(4, dtype=torch.int32)
    pl = PlannedLaunch(kernel, {"seg": seg, "FLAG": True}, ("Q", "n"), descriptors=("k_desc",), cache_size=cache_size,
                       device_scratch=bool(scratch))
    # what the constructor reads from triton's active driver (no GPU driver here)
    pl._enabled = True
    pl._hooks = hooks or types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    pl._device, pl._stream = (lambda: 0), (lambda d: 5)
    pl._arg_names = list(ARG_NAMES)
    return pl, kernel, compiled, c_calls, seg


class Builds:
    """make_descs for a K tensor, counting builds."""

    def __init__(self):
        self.count = 0

    def __call__(self, k):
        def make():
            self.count += 1
            return (Desc(k, k.shape, k.stride()),)

        return make


def _expected(q, k, n, seg, grid=7):
    """The C launch's arguments, written out: base args, then Q, the descriptor expansion, seg
    (by address when on the GPU; here the tensor), n, FLAG."""
    return [grid, 1, 1, 5, 99, False, False, None, None, (4, 1, 0), None, None, None,
            q, ("map", k.data_ptr(), tuple(k.shape), tuple(k.stride()), 128), *k.shape, *k.stride(), seg, n, True]


def _addr(x):
    return x.data_ptr() if isinstance(x, torch.Tensor) else x


def _same(a, b):
    """Equal launch arguments, a tensor equal to its address (the direct path passes per-call
    pointer tensors as addresses, Triton's launcher the tensor)."""
    return len(a) == len(b) and all(x is y or _addr(x) == _addr(y) for x, y in zip(a, b))


def test_lru_bound_and_refresh():
    lru = LRU(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1  # refreshes a: b is now the oldest
    lru.put("c", 3)
    assert "b" not in lru and lru.get("a") == 1 and lru.get("c") == 3 and len(lru) == 2
    assert lru.get("zzz") is None
    with pytest.raises(ValueError):
        LRU(0)


def test_direct_launch_matches_the_compiled_kernels_launcher():
    pl, kernel, compiled, c_calls, seg = _setup()
    builds = Builds()
    q, k = torch.zeros(8, 4), torch.zeros(16, 64)
    key = ("align", 0)
    pl((7,), (q, 3), key, ("k", k.data_ptr(), k.shape, k.stride()), builds(k))
    assert len(kernel.jit_calls) == 1 and builds.count == 1 and pl.direct(key)
    jit_args = c_calls[-1]
    pl((7,), (q, 3), key, ("k", k.data_ptr(), k.shape, k.stride()), builds(k))
    assert len(kernel.jit_calls) == 1, "a recorded key went through the JIT again"
    assert compiled.run.runs == 1, "the direct path called the Python launcher"
    assert builds.count == 2, "the first direct call builds the descriptor once"
    assert _same(c_calls[-1], jit_args) and _same(c_calls[-1], _expected(q, k, 3, seg))
    assert jit_args[13] is q and c_calls[-1][13] == q.data_ptr() and type(c_calls[-1][13]) is int, \
        "a per-call pointer tensor goes as its address"
    q2 = torch.zeros(8, 4)  # another tensor under the same key: its own address
    pl((7,), (q2, 3), key, ("k", k.data_ptr(), k.shape, k.stride()), builds(k))
    assert c_calls[-1][13] == q2.data_ptr() != q.data_ptr()
    for _ in range(3):  # same K: nothing built
        pl((7,), (q, 3), key, ("k", k.data_ptr(), k.shape, k.stride()), builds(k))
    assert builds.count == 2 and _same(c_calls[-1], _expected(q, k, 3, seg))


@pytest.mark.parametrize("change", ["pointer", "shape", "stride"])
def test_descriptor_rebuilt_when_k_changes(change):
    pl, kernel, compiled, c_calls, seg = _setup()
    builds = Builds()
    q = torch.zeros(8, 4)
    base = torch.zeros(40, 64)
    k = base[:16]
    key = ("align", 0)

    def call(kk):
        pl((7,), (q, 3), key, (kk.data_ptr(), kk.shape, kk.stride()), builds(kk))

    call(k)
    call(k)
    before = builds.count
    k2 = {"pointer": base[8:24], "shape": base[:32], "stride": base.view(20, 128)[:16, :64]}[change]
    call(k2)
    assert builds.count == before + 1
    assert _same(c_calls[-1], _expected(q, k2, 3, seg)), "the new K's descriptor was not used"
    call(k)
    assert builds.count == before + 1 and _same(c_calls[-1], _expected(q, k, 3, seg)), "the old entry was lost"


def test_descriptor_cache_is_bounded():
    pl, kernel, compiled, c_calls, seg = _setup(cache_size=2)
    builds = Builds()
    q = torch.zeros(8, 4)
    ks = [torch.zeros(16, 64) for _ in range(3)]
    key = ("align", 0)
    for kk in ks + ks[:1]:
        pl((7,), (q, 3), key, (kk.data_ptr(),), builds(kk))
    rec = pl.records[key]
    assert len(rec.entries) == 2 and (ks[1].data_ptr(),) not in rec.entries  # oldest dropped
    assert builds.count == 4  # JIT call + 2 new + the evicted first one again
    assert _same(c_calls[-1], _expected(q, ks[0], 3, seg))


def test_new_key_goes_through_the_jit_and_both_are_kept():
    pl, kernel, compiled, c_calls, seg = _setup()
    builds = Builds()
    q, k = torch.zeros(8, 4), torch.zeros(16, 64)
    for key, n in ((("a",), 3), (("b",), 4), (("a",), 3), (("b",), 4)):
        pl((7,), (q, n), key, (k.data_ptr(),), builds(k))
        assert _same(c_calls[-1], _expected(q, k, n, seg))
    assert len(kernel.jit_calls) == 2 and set(pl.records) == {("a",), ("b",)}
    for i in range(_launch.MAX_KEYS + 2):
        pl((7,), (q, 3), ("x", i), (k.data_ptr(),), builds(k))
    assert len(pl.records) == _launch.MAX_KEYS


def test_launch_hooks_take_the_compiled_kernels_run():
    hooks = types.SimpleNamespace(launch_enter_hook=types.SimpleNamespace(calls=[print]), launch_exit_hook=None)
    pl, kernel, compiled, c_calls, seg = _setup(hooks=hooks)
    builds = Builds()
    q, k = torch.zeros(8, 4), torch.zeros(16, 64)
    pl((7,), (q, 3), ("a",), (k.data_ptr(),), builds(k))
    pl((7,), (q, 3), ("a",), (k.data_ptr(),), builds(k))
    assert compiled.run.runs == 2 and compiled.metadata_calls == 1 and builds.count == 2
    exp = _expected(q, k, 3, seg)
    exp[10:13] = [{"grid": (7,)}, hooks.launch_enter_hook, None]
    assert _same(c_calls[-1], exp)
    hooks.launch_enter_hook.calls.clear()  # an empty hook chain: the direct path again
    pl((7,), (q, 3), ("a",), (k.data_ptr(),), builds(k))
    assert compiled.run.runs == 2 and _same(c_calls[-1], _expected(q, k, 3, seg))


@pytest.mark.parametrize("why", ["profile scratch", "not lowered to TMA", "unknown launcher", "disabled"])
def test_fallbacks_give_the_same_launch(why):
    meta = ({"swizzle": 128},) if why != "not lowered to TMA" else (None,)
    pl, kernel, compiled, c_calls, seg = _setup(meta=meta, profile_scratch=64 if why == "profile scratch" else 0)
    if why == "unknown launcher":
        run_calls = []
        compiled.run = lambda *a: run_calls.append(a)
    if why == "disabled":
        pl._enabled = False
    builds = Builds()
    q, k = torch.zeros(8, 4), torch.zeros(16, 64)
    for _ in range(3):
        pl((7,), (q, 3), ("a",), (k.data_ptr(),), builds(k))
    assert not pl.direct(("a",))
    # built per call on these paths (+ once by the direct attempt that finds a tensor in it)
    assert builds.count == 3 + (meta[0] is None)
    if why == "unknown launcher":
        assert len(run_calls) == 3
        return
    if why == "disabled":
        assert len(kernel.jit_calls) == 3
    else:
        assert len(kernel.jit_calls) == 1 and compiled.run.runs == 3
    if meta[0] is None:
        assert c_calls[-1][14] is k  # the base tensor itself
    else:
        assert _same(c_calls[-1], _expected(q, k, 3, seg))


def test_global_scratch_is_kept_per_stream_and_grown(monkeypatch):
    """A kernel with global scratch (device-side descriptors) goes direct: the scratch address is
    aligned, the same on every call of one stream (no allocation per call), another stream's own,
    and grows for a larger grid without freeing the old buffer; the arguments are otherwise
    Triton's. Calls through the JIT run
    with a scratch allocator installed (and removed after)."""
    from triton.runtime import _allocation

    allocated = []

    def new_scratch(nbytes):
        allocated.append(nbytes)
        return torch.empty(nbytes, dtype=torch.int8)

    monkeypatch.setattr(_launch, "new_scratch", new_scratch)
    pl, kernel, compiled, c_calls, seg = _setup(scratch=256)
    builds = Builds()
    q, k = torch.zeros(8, 4), torch.zeros(16, 64)
    key = ("a",)
    before = _allocation._allocator.get()
    pl((7,), (q, 3), key, (k.data_ptr(),), builds(k))  # the JIT call: triton's launcher allocates
    assert _allocation._allocator.get() is before  # the allocator was put back
    assert pl.direct(key) and len(compiled.run.allocations) == 1 and allocated == [7 * 256]
    jit_args = c_calls[-1]
    ptrs = set()
    for _ in range(3):
        pl((7,), (q, 3), key, (k.data_ptr(),), builds(k))
        got = c_calls[-1]
        assert isinstance(got[7], int) and got[7] % 128 == 0
        assert _same(got[:7] + got[8:], jit_args[:7] + jit_args[8:])
        ptrs.add(got[7])
    buf, ptr, programs = pl.records[key].direct.scratch[5]
    assert len(ptrs) == 1 and compiled.run.runs == 1 and programs == 7
    assert buf.data_ptr() <= ptr and ptr + 7 * 256 <= buf.data_ptr() + buf.numel()
    assert len(allocated) == 2  # one buffer for stream 5 (plus the JIT call's)
    pl._stream = lambda d: 6  # another stream: its own buffer
    pl((7,), (q, 3), key, (k.data_ptr(),), builds(k))
    assert c_calls[-1][7] != ptr and len(allocated) == 3
    pl._stream = lambda d: 5
    pl((7,), (q, 3), key, (k.data_ptr(),), builds(k))
    assert c_calls[-1][7] == ptr and len(allocated) == 3
    old = pl.records[key].direct.scratch[5][0]
    pl((20,), (q, 3), key, (k.data_ptr(),), builds(k))  # a larger grid: grown
    assert allocated[-1] >= 20 * 256 and pl.records[key].direct.scratch[5][2] == 20
    # the replaced buffer stays alive (a CUDA graph captured with it would still write there)
    assert any(b is old for b in pl.records[key].direct._retired)
    pl((7,), (q, 3), key, (k.data_ptr(),), builds(k))  # a smaller one fits the grown buffer
    assert len(allocated) == 4


def test_triton39_layout_packs_the_kernel_arguments_into_one_tuple():
    calls = []
    pl, kernel, compiled, _, seg = _setup(launcher=PackedCudaLauncher, c_launch=lambda *a: calls.append(a))
    builds = Builds()
    q, k = torch.zeros(8, 4), torch.zeros(16, 64)
    key = ("a",)
    pl((7,), (q, 3), key, (k.data_ptr(),), builds(k))
    assert pl.direct(key) and pl.records[key].direct.packed_after == PACKED_BASE
    jit_args = calls[-1]
    for _ in range(2):
        pl((7,), (q, 3), key, (k.data_ptr(),), builds(k))
    got = calls[-1]
    assert compiled.run.runs == 1 and builds.count == 2, "the direct path called the Python launcher"
    assert len(got) == PACKED_BASE + 1 and isinstance(got[-1], tuple)
    flat = _expected(q, k, 3, seg)
    base = [7, 1, 1, 5, 99, False, False, (4, 1, 0), None, None, None, None, None, ANNOTATIONS, KERNEL_SIGNATURE]
    assert list(got[:-1]) == base and _same(got[-1], flat[13:])
    assert list(jit_args[:-1]) == base and _same(jit_args[-1], got[-1])
    assert got[-1][0] == q.data_ptr() and type(got[-1][0]) is int


def test_a_launcher_that_rejects_the_arguments_turns_the_direct_path_off():
    """A C launch whose argument layout is not the one recorded raises TypeError before it
    launches: that call and every later one go through the compiled kernel's run instead."""
    calls = []

    def strict_launch(*args):  # triton 3.5 / 3.6's arity for this kernel
        if len(args) != len(_expected(torch.zeros(1), torch.zeros(1, 1), 0, None)):
            raise TypeError(f"function takes exactly 23 arguments ({len(args)} given)")
        calls.append(args)

    pl, kernel, compiled, _, seg = _setup(c_launch=strict_launch)
    builds = Builds()
    q, k = torch.zeros(8, 4), torch.zeros(16, 64)
    key = ("a",)
    pl((7,), (q, 3), key, (k.data_ptr(),), builds(k))
    assert pl.direct(key)
    pl.records[key].direct.packed_after = PACKED_BASE  # as if the layout were misread
    pl((7,), (q, 3), key, (k.data_ptr(),), builds(k))
    assert not pl.direct(key) and compiled.run.runs == 2 and len(calls) == 2
    assert _same(calls[-1], _expected(q, k, 3, seg))
    pl((7,), (q, 3), key, (k.data_ptr(),), builds(k))
    assert compiled.run.runs == 3 and len(kernel.jit_calls) == 1


def test_per_call_values_must_match_the_names():
    pl, kernel, *_ = _setup()
    with pytest.raises(ValueError, match="per-call values"):
        pl((7,), (torch.zeros(1),), ("a",), (), lambda: (None,))
    with pytest.raises(ValueError, match="both per call and fixed"):
        PlannedLaunch(kernel, {"n": 1}, ("n",))


# ----------------------------------------------------------------------------- family side
def test_sm90_kv_key_and_facts():
    sm90 = pytest.importorskip("cpattn.kernels.triton_sm90")
    base = torch.zeros(64, 4, 128, dtype=torch.bfloat16)
    k, v = base[:32], base[32:]
    key = sm90.kv_key(k, v)
    assert key != sm90.kv_key(base[1:33], v)  # pointer
    assert key != sm90.kv_key(base[:16], v)  # shape
    assert key != sm90.kv_key(base.view(32, 8, 128)[:, ::2], v)  # stride
    variant, ints, part = sm90.kv_facts(k, v)
    assert variant == (None, False) and ints == (0, 512, 128, 0, 512, 128)
    paged = torch.zeros(8, 4, 2, 128, dtype=torch.bfloat16)  # page 4: the cp.async gather
    assert sm90.kv_facts(paged, paged)[0] == (4, True)
    assert sm90.kv_facts(torch.zeros(8, 16, 2, 128, dtype=torch.bfloat16),
                         torch.zeros(8, 16, 2, 128, dtype=torch.bfloat16))[0] == (16, False)
    assert sm90.kv_facts(base[:, :, :64].contiguous()[:, ::2], v) is False  # heads not adjacent


def test_sm90_launch_caches_kv_facts_and_reports_layouts_it_cannot_take():
    sm90 = pytest.importorskip("cpattn.kernels.triton_sm90")
    state = _launch.LaunchState(cache_size=2)
    seen = []
    state.launchers[(None, False)] = lambda grid, values, key, desc_key=(), make=None: seen.append(
        (values, key, desc_key))
    q = torch.zeros(16, 8, 128, dtype=torch.bfloat16)
    out = torch.zeros_like(q)
    k = torch.zeros(32, 2, 128, dtype=torch.bfloat16)
    v = torch.zeros(32, 2, 128, dtype=torch.bfloat16)
    kw = dict(grid=(4,), plan_args={}, softmax_scale=0.5, state=state)
    assert sm90.launch(q, k, v, out, None, None, None, **kw)
    values, key, desc_key = seen[-1]
    named = dict(zip(sm90._PER_CALL, values))
    assert named["K"] is k and named["stride_kn"] == 256 and named["stride_qm"] == 1024 and not named["HAS_SINKS"]
    assert desc_key == sm90.kv_key(k, v) and desc_key in state.kv
    k2 = torch.zeros(32, 2, 128, dtype=torch.bfloat16)
    assert sm90.launch(q, k2, v, out, None, None, None, **kw) and seen[-1][2] == sm90.kv_key(k2, v)
    assert len(state.kv) == 2
    odd = torch.zeros(32, 2, 256, dtype=torch.bfloat16)[..., :128]  # heads not adjacent
    assert not sm90.launch(q, odd, odd, out, None, None, None, **kw) and len(seen) == 2
    assert len(state.kv) == 2  # bounded


def test_mla_launch_reports_a_separate_value_tensor():
    mla = pytest.importorskip("cpattn.kernels.triton_mla")
    state = _launch.LaunchState()
    seen = []
    state.launchers[0] = lambda grid, values, key, desc_key=(), make=None: seen.append(desc_key)
    q = torch.zeros(16, 4, 576, dtype=torch.bfloat16)
    out = torch.zeros(16, 4, 512, dtype=torch.bfloat16)
    k = torch.zeros(32, 1, 576, dtype=torch.bfloat16)
    kw = dict(grid=(4,), plan_args={}, softmax_scale=0.5, state=state)
    assert mla.launch(q, k, k[..., :512], out, None, None, None, **kw) and seen == [mla.kv_key(k, k[..., :512])]
    assert not mla.launch(q, k, k[..., :512].clone(), out, None, None, None, **kw) and len(seen) == 1


def test_mla_decode_launch_takes_its_own_variant_and_the_kv_facts(interp):
    """The split-KV decode launch reads the same per-K/V facts as the prefill launch, under its
    own launcher variant ("decode", page size), with the workspace strides in its values.
    (``interp``: triton_decode, imported here, must be imported in interpreter mode on CPU
    machines, or the interpreter tests after this one would get its kernels compiled for a GPU.)"""
    mla = pytest.importorskip("cpattn.kernels.triton_mla")
    state = _launch.LaunchState()
    seen = []
    state.launchers[("decode", 0)] = lambda grid, values, key, desc_key=(), make=None: seen.append(
        (values, desc_key))
    q = torch.zeros(8, 128, 576, dtype=torch.bfloat16)
    out = torch.zeros(8, 128, 512, dtype=torch.bfloat16)
    lse = torch.zeros(8, 128)
    ws_o, ws_lse = torch.zeros(3, 1, 128, 512), torch.zeros(3, 1, 128)
    from cpattn.kernels.triton_decode import Workspace

    ws = Workspace(ws_o, ws_lse)
    k = torch.zeros(64, 1, 576, dtype=torch.bfloat16)
    kw = dict(grid=(4,), plan_args={}, softmax_scale=0.5, state=state)
    assert mla.launch_decode(q, k, k[..., :512], out, lse, None, None, ws, **kw)
    values, desc_key = seen[-1]
    named = dict(zip(mla._DECODE_PER_CALL, values))
    assert named["WsO"] is ws_o and named["stride_wi"] == 128 * 512 and named["stride_li"] == 128
    assert desc_key == mla.kv_key(k, k[..., :512]) and state.kv.get(desc_key) == 0
    assert not mla.launch_decode(q, k, k[..., :512].clone(), out, lse, None, None, ws, **kw)
    assert len(seen) == 1


# ----------------------------------------------------------------------------- portable, interpreter
def test_portable_plan_right_after_kv_moves_and_strides_change(interp):
    """Layer after layer with different K/V buffers (and a strided view) through one portable
    plan: the per-K/V facts are cached per address / shape / stride, results equal the oracle."""
    import cpattn
    from oracle import attention_oracle

    s = cpattn.ZigzagStrategy(2, pad_multiple=8)
    ext, pre = [9, 20], [5, 0]
    n_kv = sum(ext) + sum(pre)
    g = torch.Generator().manual_seed(4)
    meta = s.build_metadata(ext, pre, rank=1)
    spec = cpattn.AttentionSpec(num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    plan = cpattn.plan_attention(meta, spec, backend="triton")
    assert plan.family == "portable"
    state = plan._impl._portable_state
    q = torch.randn(sum(ext), 4, 16, generator=g)
    ql = s.shard(q, meta)
    layers = [(torch.randn(n_kv, 2, 16, generator=g), torch.randn(n_kv, 2, 16, generator=g)) for _ in range(3)]
    fused = torch.randn(n_kv, 2, 2, 16, generator=g)  # K / V interleaved: row stride 64, not 32
    layers.append((fused[:, :, 0], fused[:, :, 1]))
    n = meta.num_local_tokens
    for rounds in range(2):
        for k, v in layers:
            out = plan.attend(ql, k, v)
            ref, _ = attention_oracle(q, k, v, ext, pre)
            assert (out[:n].double() - ref[meta.local_token_indices]).abs().max() < 2e-5
            assert (out[n:] == 0).all()
    assert len(state.kv) == len(layers)


# ----------------------------------------------------------------------------- programmatic dependent launch
def test_pdl_only_on_cuda_sm90_and_the_combine_waits_on_every_path(interp, monkeypatch):
    """Programmatic dependent launch (split kernel -> combine) is used only on a CUDA device of
    compute capability >= 9.0 and only with the plan's ``pdl`` option (default True): a CPU
    plan's split has ``PDL=False`` and its combine no launch options; with the option off
    nothing changes; a non-bool is refused. The combine's source waits before its one-split
    early return (every program waits, so the ordinary launch after the combine cannot overtake
    the split kernel's stores)."""
    import inspect

    import cpattn
    from cpattn.kernels import triton_decode as td

    cpu = torch.device("cpu")
    assert td.pdl_capable(cpu) is False
    assert td.pdl_launch(False) == {} and td.pdl_launch(True) == {"PDL": True, "launch_pdl": True}
    for cap, expected in (((9, 0), True), ((10, 0), True), ((8, 9), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cap=cap: cap)
        assert td.pdl_capable(torch.device("cuda", 0)) is expected
    monkeypatch.undo()

    # a decode step (one query per sequence, 900 and 40 keys) over a KV cache sharded on 2 ranks
    dmeta = cpattn.get_strategy("replicated", 2).build_metadata([1, 1], [899, 39], rank=0, kv=cpattn.KVSharding(2))
    spec = cpattn.AttentionSpec(num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    for options in (None, {"pdl": True}, {"pdl": False}):
        plan = cpattn.plan_attention(dmeta, spec, backend="triton", backend_options=options)
        assert plan.algorithm == "shard_merge"
        run = plan._impl
        assert run.pdl is False and run.plan_args["PDL"] is False
        assert "launch_pdl" not in run.combine_args and "PDL" not in run.combine_args
    with pytest.raises(ValueError, match="backend_options pdl must be a bool, got 1"):
        cpattn.plan_attention(dmeta, spec, backend="triton", backend_options={"pdl": 1})
    body = inspect.getsource(td._shard_attn_combine.fn)
    assert body.index("gdc_wait()") < body.index("if ns == 1:\n        return")


def _launch_calls(tree):
    """Every ``kernel[grid](...)`` call of a module's syntax tree."""
    import ast

    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)
            and not (isinstance(n.func.value, ast.Name) and n.func.value.id in {"_REGISTRY", "STRATEGIES"})]


def test_every_kernel_launch_pins_the_compile_options():
    """Each Triton / Gluon launch in the library passes ``**COMPILE_OPTIONS`` (FP fusion on, as
    the kernels were measured; triton 3.10 changes the default), so no launch depends on the
    installed triton's default."""
    import ast
    import pathlib

    import cpattn.kernels

    assert _launch.COMPILE_OPTIONS == {"enable_fp_fusion": True}
    root = pathlib.Path(cpattn.kernels.__file__).parent
    sites, unpinned = 0, []
    for path in sorted(root.glob("*.py")):
        for call in _launch_calls(ast.parse(path.read_text())):
            sites += 1
            pinned = any(k.arg is None and isinstance(k.value, ast.Name) and k.value.id == "COMPILE_OPTIONS"
                         for k in call.keywords)
            if not pinned:
                unpinned.append(f"{path.name}:{call.lineno}")
    assert sites >= 6, sites  # the planned launch, index (3), sparse (2)
    assert not unpinned, unpinned


def test_planned_launch_passes_the_compile_options_to_the_jit():
    seen = {}

    class Kernel:
        def __getitem__(self, grid):
            def call(**kwargs):
                seen.update(kwargs)
            return call

    PlannedLaunch(Kernel(), {"A": 1}, ("B",), enabled=False)((1,), (2,), key=("k",))
    assert seen == {"A": 1, "B": 2, "enable_fp_fusion": True}


def test_launch_state_keeps_one_launcher_per_name_and_int_keys_follow_the_jit():
    """``LaunchState.launcher`` builds a name's launch once (its fixed arguments made once);
    ``int_key`` tells apart exactly what the JIT specializes an int on (1, multiples of 16, int32)."""
    made = []

    def fixed():
        made.append(1)
        return {"A": 1}

    state = _launch.LaunchState(enabled=False)
    first = state.launcher("k", object(), fixed, ("B",))
    assert state.launcher("k", object(), fixed, ("B",)) is first and made == [1]
    assert state.launcher("other", object(), fixed, ("B",)) is not first and made == [1, 1]
    key = _launch.int_key
    assert key(0) == key(16) == key(4096) and key(3) == key(17)
    assert len({key(1), key(16), key(17), key(2**31), key(2**31 + 1)}) == 5 and key(2**31) == key(2**31 + 16)
    t = torch.zeros(8)
    assert _launch.align_key(t, t[1:]) == ((torch.float32, t.data_ptr() & 15), (torch.float32, (t.data_ptr() + 4) & 15))
