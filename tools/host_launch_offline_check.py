"""Check the direct launch of :mod:`cpattn.kernels._launch` against the installed Triton's own
launcher, without a GPU.

For the dense sm_90 kernel (packed, paged TMA, paged gather), the absorbed-MLA kernel (packed,
paged, decode), the portable kernel over packed K/V (device-side descriptors: global scratch) and
the fused merge (3-D grid), each compiled offline for sm_90a: a ``CudaLauncher`` of the installed Triton is
assembled around a recording stand-in for its compiled C ``launch`` (the Python part,
``wrap_handle_tensordesc`` / ``make_tensordesc_arg``, is Triton's own), with an active-driver
stand-in whose ``fill_tma_descriptor`` returns its arguments. Then:

* the arguments that reach the C ``launch`` through Triton's path (``CompiledKernel.run`` with
  the Gluon ``TensorDescriptor`` objects, as ``JITFunction.run`` calls it) equal those of
  :class:`PlannedLaunch`'s direct path (tensors compared by address; the direct path passes the
  per-call ones as addresses);
* a repeated call with the same K/V builds no descriptor (no ``fill_tma_descriptor`` call);
  another K/V address, shape or stride builds new ones; the cache holds at most its size.

Run from the repository root with the triton of the GPU machine:
    PYTHONPATH=src:tools /tmp/t36/bin/python tools/host_launch_offline_check.py
"""

from __future__ import annotations

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia import driver as nv_driver
from triton.compiler import ASTSource

import cpattn.kernels.triton_decode as td
import cpattn.kernels.triton_mla as mla
import cpattn.kernels.triton_sm90 as ws
from cpattn.kernels import _launch
import cpattn.kernels.triton_attn as ta
from sm90_offline_check import (_attrs, _ptr_sig, compile_mla_decode_variant, compile_mla_variant,
                                compile_variant)


class _Utils:
    def __init__(self) -> None:
        self.fills = 0

    def fill_tma_descriptor(self, *args):
        self.fills += 1
        return ("CUtensorMap",) + tuple(tuple(a) if isinstance(a, list) else a for a in args)

    fill_tma_descriptor_tiled = fill_tma_descriptor  # triton 3.9's name

    def build_signature_metadata(self, signature):
        return ("signature",) + tuple(signature)


class _Driver:
    """What ``make_tensordesc_arg`` and ``PlannedLaunch`` read of the active driver."""

    def __init__(self) -> None:
        self.utils = _Utils()

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 777


def latent_sets(page, dt):
    """Three latent caches (packed: two of one shape, one of another; paged: 64 pages of 64) as
    (k, v = k[..., :512]) pairs: the K/V sets the MLA launch checks rotate through."""
    w = mla.D_LATENT + mla.D_ROPE
    shapes = [(4096, 1, w), (4096, 1, w), (2048, 1, w)] if page is None else [(64, 64, 1, w)] * 3
    return [(k, k[..., : mla.D_LATENT]) for k in (torch.zeros(*s, dtype=dt) for s in shapes)]


#: triton 3.9's layout: the kernel arguments reach the C launch as one tuple after 15 leading ones,
#: with the argument annotations and the packed signature
PACKED = hasattr(nv_driver, "annotate_arguments")


def _launcher(compiled, calls: list):
    """A ``CudaLauncher`` of the installed triton around a recording C ``launch`` (the recorded
    arguments are flat in both layouts: a packed tuple is appended as its items)."""

    def c_launch(*args):
        calls.append(args[:-1] + tuple(args[-1]) if PACKED else args)

    run = nv_driver.CudaLauncher.__new__(nv_driver.CudaLauncher)
    md = compiled.metadata
    run.num_ctas = getattr(md, "num_ctas", 1)
    if PACKED:
        sig = dict(compiled.src.signature)
        expanded = nv_driver.expand_signature(sig.values(), getattr(md, "tensordesc_meta", None), "nvTmaDesc")
        if nv_driver.PyKernelArg is None:  # a C type of the driver module (not built without a GPU)
            nv_driver.PyKernelArg = lambda **kw: ("PyKernelArg", tuple(sorted(kw.items())))
        run.arg_annotations = nv_driver.annotate_arguments(expanded)
        run.kernel_signature = nv_driver.make_kernel_signature(expanded)
        run.gsan_enabled = False
    run.launch = nv_driver.wrap_handle_tensordesc(c_launch, dict(compiled.src.signature),
                                                  getattr(md, "tensordesc_meta", None))
    run.global_scratch_size, run.global_scratch_align = md.global_scratch_size, md.global_scratch_align
    run.profile_scratch_size, run.profile_scratch_align = md.profile_scratch_size, md.profile_scratch_align
    run.launch_cooperative_grid, run.launch_pdl = md.launch_cooperative_grid, md.launch_pdl
    return run


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        pa = a.data_ptr() if isinstance(a, torch.Tensor) else a
        pb = b.data_ptr() if isinstance(b, torch.Tensor) else b
        return pa == pb
    return a == b


#: Index of the global scratch address in the C launch's arguments.
_SCRATCH_ARG = 11 if PACKED else 7


def check(name: str, compiled, kernel, fixed: dict, names, descriptors, values_of, descs_of, key_of, kvs,
          grid: tuple = (132,)) -> None:
    """Triton's launch arguments == the direct path's (a kernel with global scratch: all but the
    scratch address, which must be an aligned address of a buffer large enough for the grid,
    kept across calls on one stream, another one per stream, grown for a larger grid)."""
    calls: list = []
    scratch = compiled.metadata.global_scratch_size > 0
    ptrs: dict = {}
    run = _launcher(compiled, calls)
    compiled._run, compiled.module, compiled.function = run, object(), 4242
    drv = triton.runtime.driver.active
    pl = _launch.PlannedLaunch(kernel, fixed, names, descriptors=descriptors, cache_size=2)
    key = ("k",)
    pl._record(compiled, key, values_of(*kvs[0]))
    assert pl.direct(key), f"{name}: direct launch not taken (the launcher layout is not the known one)"
    g3 = tuple(grid) + (1, 1)[:3 - len(grid)]
    for i, (k, v) in enumerate(kvs + kvs[:1]):
        values = values_of(k, v)
        # Triton's path: the compiled kernel's run with the descriptor objects in place
        full = dict(fixed, **dict(zip(names, values)), **dict(zip(descriptors, descs_of(k, v))))
        bound = [full[n] for n in kernel.arg_names]
        calls.clear()
        compiled.run(*g3, 777, compiled.function, compiled.packed_metadata, None, None, None, *bound)
        ref = calls[-1]
        fills = drv.utils.fills
        pl(grid, values, key, key_of(k, v), lambda: descs_of(k, v))
        got = calls[-1]
        assert len(ref) == len(got), f"{name}: {len(got)} launch arguments, Triton passes {len(ref)}"
        if scratch:
            assert isinstance(ref[_SCRATCH_ARG], torch.Tensor), f"{name}: Triton passed no scratch buffer"
            ptr = got[_SCRATCH_ARG]
            assert isinstance(ptr, int) and ptr % compiled.metadata.global_scratch_align == 0, \
                f"{name}: scratch address {ptr!r}"
            assert ptrs.setdefault(777, ptr) == ptr, f"{name}: the scratch moved between calls on one stream"
            ref = ref[:_SCRATCH_ARG] + (ptr,) + ref[_SCRATCH_ARG + 1:]
        bad = [j for j, (a, b) in enumerate(zip(ref, got)) if not _same(a, b)]
        # the per-call tensors of pointer arguments go as addresses (the fixed ones here are CPU
        # tensors, which the direct path leaves alone)
        addresses = sum(isinstance(a, torch.Tensor) and type(b) is int for a, b in zip(ref, got))
        assert addresses >= 3, f"{name}: {addresses} per-call tensors passed as addresses"
        assert not bad, f"{name}: launch arguments differ at {bad[:5]}: {[ (ref[j], got[j]) for j in bad[:3]]}"
        # a new K/V (the last call: the first K/V again, evicted from the 2-entry cache by then)
        # converts every descriptor argument once
        new = drv.utils.fills - fills
        assert new == len(descriptors), f"{name}: {new} descriptor fills on call {i}, expected {len(descriptors)}"
        # the same K/V again: no descriptor built
        fills = drv.utils.fills
        pl(grid, values, key, key_of(k, v), lambda: descs_of(k, v))
        assert drv.utils.fills == fills, f"{name}: a repeated call built descriptors"
        assert all(_same(a, b) for a, b in zip(calls[-1], ref)), f"{name}: a repeated call's arguments differ"
    rec = pl.records[key]
    assert len(rec.entries) <= 2, f"{name}: the descriptor cache holds {len(rec.entries)} > 2"
    if scratch:
        direct, per = rec.direct, compiled.metadata.global_scratch_size
        k, v = kvs[0]
        buf, ptr, programs = direct.scratch[777]
        assert ptr + programs * per <= buf.data_ptr() + buf.numel() and programs >= g3[0] * g3[1] * g3[2], \
            f"{name}: the scratch does not hold the grid's programs"
        pl._stream = lambda device=None: 778  # another stream: its own buffer
        pl(grid, values_of(k, v), key, key_of(k, v), lambda: descs_of(k, v))
        assert calls[-1][_SCRATCH_ARG] not in (None, ptr) and direct.scratch[777][1] == ptr, \
            f"{name}: a second stream shares the scratch"
        pl._stream = drv.get_current_stream
        big = (g3[0] * 4,) + g3[1:]  # a larger grid: the buffer grows
        pl(big, values_of(k, v), key, key_of(k, v), lambda: descs_of(k, v))
        assert direct.scratch[777][2] >= big[0] * big[1] * big[2], f"{name}: the scratch did not grow"
        print(f"{name}: global scratch {per} B per program, one buffer per stream, grown for a larger grid",
              flush=True)
    print(f"{name}: direct launch arguments == Triton's ({len(ref)} arguments, "
          f"{len(rec.direct.desc_meta)} descriptors), cache bounded", flush=True)


def compile_portable_tma():
    """(compiled, kernel, constexprs) of the portable kernel over packed bf16 D128 K/V read
    through device-side tensor descriptors (USE_TMA), for sm_90a."""
    fn = ta._cp_attn_fwd
    consts = dict(HEAD_DIM=128, HEAD_DIM_V=128, BLOCK_D1=128, BLOCK_D2=0, BLOCK_M=128, PAGED=False, PAGE_SIZE=1,
                  DOT_PRECISION="tf32", DOT_UPCAST=False, BLOCK_N=64, HAS_SINKS=False, RETURN_LSE=True, USE_TMA=True,
                  G_PACK=4, HAS_WINDOW=False, KV_FP8=False, KV_TILE=False, FP8_MMA=0)
    sig = _ptr_sig(fn, "*bf16", {})
    sig.update(KScale="*i32", VScale="*i32")  # never read without KV_FP8 (the launch passes the page table)
    sig.update({n: "constexpr" for n in consts})
    compiled = triton.compile(ASTSource(fn, sig, consts, _attrs(fn)), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=8, num_stages=3))
    assert compiled.metadata.global_scratch_size > 0, "the portable TMA kernel needs no global scratch"
    fixed = {k: v for k, v in consts.items() if k not in ta._PER_CALL and k not in ("G_PACK", "HAS_WINDOW")}
    return compiled, fn, dict(fixed, num_warps=8, num_stages=3)


def main() -> int:
    drv = _Driver()
    triton.runtime.driver.set_active(drv)
    dt = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    plan_tensors = {n: torch.zeros(64, dtype=torch.int32) for n in
                    ("tile_segment", "tile_row_offset", "NumTiles", "seg_seq", "seg_row0", "seg_len", "seg_pos0",
                     "seg_stride", "cu_kv_lens")}
    plan_ints = dict(window=-1, num_head_groups=8, heads_per_section=8, group_size=4, G_PACK=4, HAS_WINDOW=False)
    q = torch.zeros(512, 32, 128, dtype=dt)
    out = torch.zeros(512, 32, 128, dtype=dt)
    lse = torch.zeros(512, 32, dtype=torch.float32)
    for label, page, gather in (("sm90 packed", None, False), ("sm90 paged64", 64, False), ("sm90 paged4", 4, True)):
        compiled = compile_variant(128, 128, 4, 3, 0, False, False, False, True, page)
        if page is None:
            kvs = [(torch.zeros(4096, 8, 128, dtype=dt), torch.zeros(4096, 8, 128, dtype=dt)) for _ in range(3)]
            kvs[2] = (torch.zeros(4000, 8, 128, dtype=dt), torch.zeros(4000, 8, 128, dtype=dt))  # another shape
        else:
            kvs = [(torch.zeros(4096 // page, page, 8, 128, dtype=dt), torch.zeros(4096 // page, page, 8, 128, dtype=dt))
                   for _ in range(3)]
        fixed = dict(plan_tensors, **plan_ints, **ws.kernel_constexprs(128, 128, dt, page, gather=gather),
                     HAS_SINKS=False, RETURN_LSE=True)
        fixed = {k: v for k, v in fixed.items() if k not in ("HAS_SINKS", "RETURN_LSE")}
        names = ws._PER_CALL + (ws._DESCRIPTORS if gather else ())
        descriptors = () if gather else ws._DESCRIPTORS

        def values_of(k, v, gather=gather):
            _, ints, _ = ws.kv_facts(k, v)
            vals = (q, k, v, out, lse, out, q, 0.1, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                    lse.stride(0), lse.stride(1), 0, 0) + ints + (False, True)
            return vals + ((k, k, k) if gather else ())

        check(label, compiled, ws._cp_attn_fwd_sm90, fixed, names, descriptors, values_of,
              (lambda k, v: ()) if gather else (lambda k, v: ws.kv_descriptors(k, v, 128)), ws.kv_key, kvs)
    for label, page in (("mla packed", None), ("mla paged64", 64)):
        compiled = compile_mla_variant(4, False, False, True, page)
        w = mla.D_LATENT + mla.D_ROPE
        kvs = latent_sets(page, dt)
        qm, om = torch.zeros(256, 16, w, dtype=dt), torch.zeros(256, 16, mla.D_LATENT, dtype=dt)
        lm = torch.zeros(256, 16, dtype=torch.float32)
        fixed = dict(plan_tensors, **plan_ints, **mla.kernel_constexprs(dt, page))

        def values_of(k, v, qm=qm, om=om, lm=lm):
            return (qm, om, lm, om, qm, 0.1, qm.stride(0), qm.stride(1), om.stride(0), om.stride(1), lm.stride(0),
                    lm.stride(1), 0, 0, False, True)

        check(label, compiled, mla._mla_fwd_sm90, fixed, mla._PER_CALL, mla._DESCRIPTORS, values_of,
              lambda k, v: mla.k_descriptors(k), mla.kv_key, kvs)
    dec_tensors = {n: torch.zeros(64, dtype=torch.int32) for n in
                   ("item_seq", "item_r0", "item_k0", "item_k1", "item_ws", "NumItems", "q_lens", "seq_lens",
                    "cu_q_lens", "cu_local_kv")}
    for label, page in (("mla decode packed", None), ("mla decode paged64", 64)):
        compiled = compile_mla_decode_variant(64, False, page, 2, 1)
        w = mla.D_LATENT + mla.D_ROPE
        kvs = latent_sets(page, dt)
        qm, om = torch.zeros(8, 128, w, dtype=dt), torch.zeros(8, 128, mla.D_LATENT, dtype=dt)
        lm = torch.zeros(8, 128, dtype=torch.float32)
        wo, wl = torch.zeros(40, 1, 128, mla.D_LATENT), torch.zeros(40, 1, 128)
        fixed = dict(dec_tensors, rank=1, num_head_groups=2, G_PACK=64, CP_SIZE=2, INTERLEAVE=1,
                     PairSem=torch.zeros(1, dtype=torch.int32), PairLse=torch.zeros(1, 1, 1), PAIR=False, PDL=False,
                     **mla.kernel_constexprs(dt, page))

        def values_of(k, v, qm=qm, om=om, lm=lm, wo=wo, wl=wl):
            return (qm, om, lm, om, qm, wo, wl, 0.1, qm.stride(0), qm.stride(1), om.stride(0), om.stride(1),
                    lm.stride(0), lm.stride(1), 0, 0, wo.stride(0), wo.stride(1), wo.stride(2), wl.stride(0),
                    wl.stride(1), False)

        check(label, compiled, mla._mla_decode_sm90, fixed, mla._DECODE_PER_CALL, mla._DESCRIPTORS, values_of,
              lambda k, v: mla.k_descriptors(k), mla.kv_key, kvs)
    # the portable kernel over packed K/V: device-side descriptors in the launch's global scratch
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
    _launch.new_scratch = lambda nbytes: torch.empty(nbytes, dtype=torch.int8)
    compiled, fn, fixed = compile_portable_tma()
    pq, po = torch.zeros(512, 32, 128, dtype=dt), torch.zeros(512, 32, 128, dtype=dt)
    pkvs = [(torch.zeros(4096, 8, 128, dtype=dt), torch.zeros(4096, 8, 128, dtype=dt)) for _ in range(3)]
    pkvs[2] = (torch.zeros(4000, 8, 128, dtype=dt), torch.zeros(4000, 8, 128, dtype=dt))

    def portable_values(k, v):
        _, ints, _ = ta.kv_facts(k, v, False)
        cu = plan_tensors["cu_kv_lens"]
        return (pq, k, v, po, lse, po, cu, cu, cu, 0.1, k.shape[0], pq.stride(0), pq.stride(1), 0) \
            + ints + (po.stride(0), po.stride(1), lse.stride(0), lse.stride(1), 0, 0, 0, False, True, True)

    check("portable packed (device descriptors)", compiled, fn, dict(plan_tensors, **plan_ints, **fixed),
          ta._PER_CALL, (), portable_values, lambda k, v: (), lambda k, v: (k.data_ptr(), v.data_ptr()), pkvs)
    # a kernel without descriptors on a 3-D grid: the fused merge (and the combine, launched alike)
    import decode_offline_check as doc

    blocks = (8, 1, 256)
    fn, sig, consts = doc._merge_sig(512, "bf16", blocks, True)
    compiled = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=1))
    parts = torch.zeros(8, 4, 128, 512, dtype=dt)
    plse = torch.zeros(8, 4, 128)
    mo, ml = torch.zeros(4, 128, 512, dtype=dt), torch.zeros(4, 128)

    def merge_values(k, v):
        ps, ls = k.stride(), v.stride()
        return (mo, ml, k, v, 8, 128, ps[0], ps[1], ps[2], ls[0], ls[1], ls[2], mo.stride(0), mo.stride(1),
                ml.stride(0), ml.stride(1))

    check("merge C=8 (3-D grid)", compiled, fn, dict(consts, num_warps=1), td._MERGE_PER_CALL, (), merge_values,
          lambda k, v: (), lambda k, v: (), [(parts, plse)] * 3, grid=(4, 128, 2))
    print("all direct launches match triton", triton.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
