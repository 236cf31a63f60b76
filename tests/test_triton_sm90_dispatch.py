"""Which calls the warp-specialized Hopper kernel takes (host-side checks, no GPU needed)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
sm90 = pytest.importorskip("cpattn.kernels.triton_sm90")
mla = pytest.importorskip("cpattn.kernels.triton_mla")
common = pytest.importorskip("cpattn.kernels._sm90_common")


def _qkv(d=128, dv=None, dtype=torch.bfloat16, hq=8, hkv=2, rows=256):
    dv = dv or d
    q = torch.zeros(rows, hq, d, dtype=dtype)
    k = torch.zeros(rows, hkv, d, dtype=dtype)
    v = torch.zeros(rows, hkv, dv, dtype=dtype)
    return q, k, v


CPU = torch.device("cpu")


def _spec_plan(meta, *, backend="auto", backend_options=None, **spec):
    """``cpattn.plan_attention`` for the layer kind of ``spec`` (:class:`cpattn.AttentionSpec`'s keywords)."""
    import cpattn

    return cpattn.plan_attention(meta, cpattn.AttentionSpec(**spec), backend=backend, backend_options=backend_options)


@pytest.mark.parametrize(
    "d,dv,dtype,page,expect",
    [
        (192, 192, torch.bfloat16, None, "head dims"),
        (128, 64, torch.bfloat16, None, "head dims"),
        (256, 256, torch.bfloat16, None, "head dims"),
        (128, 128, torch.float32, None, "dtype"),
        (128, 128, torch.float32, 16, "dtype"),
    ],
)
def test_unsupported_plans_name_the_reason(d, dv, dtype, page, expect):
    assert expect in sm90.unsupported_reason(d, dv, dtype, page, CPU)


@pytest.mark.parametrize("page", [1, 2, 4, 8, 12, 16, 24, 64, 128, 192, 256])
def test_every_page_size_is_taken(page):
    """TMA copy groups where gcd(page, 128) >= 8, the cp.async gather otherwise: only the device
    is refused here."""
    reason = sm90.unsupported_reason(128, 128, torch.bfloat16, page, CPU)
    assert reason == "not an sm_90 GPU"


def test_paged_copy_rows():
    assert common.paged_copy_rows(16, 128) == 16 and common.paged_copy_rows(256, 128) == 128
    assert common.paged_copy_rows(192, 128) == 64 and common.paged_copy_rows(24, 128) == 8
    assert common.paged_copy_rows(4, 128) == 0 and common.paged_copy_rows(12, 128) == 0
    assert common.paged_copy_rows(16, 64) == 16 and common.paged_copy_rows(256, 64) == 64


def test_paged_layout_tma_or_gather():
    k = torch.zeros(10, 16, 2, 128, dtype=torch.bfloat16)
    assert sm90.kv_layout_ok(k, k) and sm90.paged_tma_ok(k, k, 128)
    # page size without 8-row groups: gathered
    k4 = torch.zeros(10, 4, 2, 128, dtype=torch.bfloat16)
    assert sm90.kv_layout_ok(k4, k4) and not sm90.paged_tma_ok(k4, k4, 128)
    # pages not page_size rows apart (a strided slice of a larger pool): no 2-D TMA view, gathered
    assert not sm90.paged_tma_ok(k[::2], k[::2], 128) and sm90.kv_layout_ok(k[::2], k[::2])
    # K and V interleaved per slot ([pages, page, 2, Hkv, D] split into two views): TMA
    kv = torch.zeros(10, 16, 2, 2, 128, dtype=torch.bfloat16)
    assert sm90.paged_tma_ok(kv[:, :, 0], kv[:, :, 1], 128)
    # heads not adjacent (each head's row padded to 256): gathered (strides are multiples of 16)
    k_pad = torch.zeros(10, 16, 2, 256, dtype=torch.bfloat16)[..., :128]
    assert not sm90.paged_tma_ok(k_pad, k_pad, 128) and sm90.kv_layout_ok(k_pad, k_pad)
    # slot rows of 2 * 128 + 8 elements: TMA-aligned (16 bytes) but page 4 needs the gather, whose
    # 16-byte vectors need strides that are multiples of 16 elements: the portable kernel runs
    buf = torch.zeros(10 * 4 * 264, dtype=torch.bfloat16)
    odd = buf.as_strided((10, 4, 2, 128), (4 * 264, 264, 128, 1))
    assert not sm90.kv_layout_ok(odd, odd)


def test_kv_layout_must_be_tma_compatible():
    q, k, v = _qkv()
    assert sm90.kv_layout_ok(k, v)
    # heads not adjacent: a [rows, D, Hkv] tensor transposed to [rows, Hkv, D]
    k_t = torch.zeros(256, 128, 2, dtype=torch.bfloat16).transpose(1, 2)
    assert not sm90.kv_layout_ok(k_t, v)
    # rows of 2 * 128 + 3 elements: not 16-byte aligned
    buf = torch.zeros(256, 2 * 128 + 3, dtype=torch.bfloat16)
    assert not sm90.kv_layout_ok(buf[:, :256].view(256, 2, 128), v)


@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (192, 128)])
def test_supported_shape_on_cpu_is_refused_for_the_device(d, dv):
    reason = sm90.unsupported_reason(d, dv, torch.bfloat16, False, CPU)
    assert reason == "not an sm_90 GPU"


def test_qk_split_and_stage_budget():
    assert sm90.split_qk_dim(128) == (128, 0) and sm90.split_qk_dim(64) == (64, 0)
    assert sm90.split_qk_dim(192) == (128, 64)
    assert sm90.max_stages(128, 128, 128) == 3  # 32 KiB Q + 3 x 64 KiB K/V
    assert sm90.max_stages(192, 128, 128) == 2  # 48 KiB Q + 2 x 80 KiB K/V
    assert sm90.max_stages(192, 128, 64) == 4  # 48 KiB Q + 4 x 40 KiB K/V (the ring's cap)


def _fake_gluon(version: str, drop=()):
    """The modules :func:`_sm90_common.resolve_gluon_api` reads, as triton ``version`` ("3.5",
    "3.6", "3.9") spells the calls, without the ``owner.name`` calls in ``drop``."""
    from types import SimpleNamespace

    def call(a=None, b=None, c=None, d=None, _semantic=None):  # a builtin with named parameters
        return None

    def stub(*args, _semantic=None, **kwargs):  # a removed name that raises
        raise RuntimeError("removed")

    def ws_35(default_args, default_partition, worker_args, worker_partitions, worker_num_warps, worker_num_regs,
              _semantic=None, _generator=None):
        return ("3.5", default_args, default_partition, worker_args, worker_partitions, worker_num_warps,
                worker_num_regs)

    def ws_36(functions_and_args, worker_num_warps, worker_num_regs=None, _semantic=None, _generator=None):
        return None

    mods = {owner: SimpleNamespace(**{n: call for n in names}) for owner, names in common.UNCHANGED_CALLS.items()}
    mods["tma"], mods["smem"] = SimpleNamespace(), SimpleNamespace()
    new = version == "3.9"
    mods["gl"].__dict__.update({"barrier" if new else "thread_barrier": call,
                                "warp_specialize": ws_35 if version == "3.5" else ws_36})
    if version != "3.5":
        mods["gl"].num_warps = call
    mods["tma"].async_copy_global_to_shared = stub if new else call
    mods["async_copy"].async_copy_global_to_shared = stub if new else call
    if new:
        mods["tma"].async_load = mods["async_copy"].async_load = call
    setattr(mods["smem"], "reinterpret" if new else "_reinterpret", call)
    for owner_name in drop:
        owner, name = owner_name.split(".")
        delattr(mods[owner], name)
    return mods


@pytest.mark.parametrize("version", ["3.5", "3.6", "3.9"])
def test_gluon_calls_resolve_to_each_tritons_spelling(version):
    """One kernel source for every triton: each renamed call binds to the spelling this triton has
    (never to a removal stub), triton 3.5 gets adapters for ``num_warps`` and ``warp_specialize``."""
    mods = _fake_gluon(version)
    api, reason = common.resolve_gluon_api(mods, version)
    assert reason is None
    new = version == "3.9"
    assert api.cta_barrier is getattr(mods["gl"], "barrier" if new else "thread_barrier")
    assert api.tma_load is getattr(mods["tma"], "async_load" if new else "async_copy_global_to_shared")
    assert api.cp_async_load is getattr(mods["async_copy"], "async_load" if new else "async_copy_global_to_shared")
    assert api.smem_reinterpret is getattr(mods["smem"], "reinterpret" if new else "_reinterpret")
    if version == "3.5":
        assert api.warp_specialize is not mods["gl"].warp_specialize and api.num_warps is not None
    else:
        assert api.warp_specialize is mods["gl"].warp_specialize and api.num_warps is mods["gl"].num_warps


def test_triton_35_warp_specialize_adapter():
    """triton 3.5 passes one argument tuple to every worker: the adapter passes the first worker's
    and refuses workers whose tuples differ (a different constexpr included)."""
    from triton.language import core as gl

    mods = _fake_gluon("3.5")
    ws = common.resolve_gluon_api(mods, "3.5")[0].warp_specialize
    smem, flag = object(), gl.constexpr(True)
    args = (smem, gl.constexpr(True), 4)
    got = ws([("default", (smem,)), ("w0", args), ("w1", (smem, flag, 4))], [4, 1], [240, 24], _semantic=object(),
             _generator=None)
    assert got == ("3.5", (smem,), "default", args, ["w0", "w1"], [4, 1], [240, 24])
    with pytest.raises(ValueError, match="same arguments"):
        ws([("default", ()), ("w0", (smem, gl.constexpr(0))), ("w1", (smem, gl.constexpr(1)))], [4, 4], [240, 240],
           _semantic=object(), _generator=None)


def test_gluon_without_a_call_is_reported_not_launched():
    """A Gluon without a call the kernels make (a later triton, or a removal stub with no new
    spelling) is a reason the families cannot run, naming each missing call (the portable kernel
    then runs), not a compile error at the first launch; this triton's answer agrees."""
    mods = _fake_gluon("3.9", drop=("tma.async_load", "mbarrier.expect"))
    api, reason = common.resolve_gluon_api(mods, "4.0.0")
    assert api is None and reason.startswith("Gluon API of triton 4.0.0")
    assert "tma.async_load / tma.async_copy_global_to_shared" in reason and "mbarrier.expect" in reason
    assert "gl.barrier" not in reason
    mods = _fake_gluon("3.6")
    mods["gl"].warp_specialize = lambda fns, _semantic=None: None  # neither 3.5's nor 3.6's signature
    assert "gl.warp_specialize" in common.resolve_gluon_api(mods, "4.0.0")[1]
    if common.GLUON_API_REASON is not None:  # this triton's Gluon cannot build the kernels
        assert not common.HAVE_GLUON
    elif common.HAVE_GLUON:  # bound to real calls, none of them a stub (not in interpreter mode)
        for name in ("cta_barrier", "tma_load", "cp_async_load", "smem_reinterpret"):
            assert not common._is_stub(getattr(common, name)), name


def test_gather_loader_on_two_stages_runs_without_overlap():
    """The cp.async gather loader signals block j after issuing block j + 1; at 2 stages an
    overlapped consumer would hold block j - 1's V while waiting for block j (a hang on the H200,
    D192 / 128 at page 2): such variants compile with OVERLAP 0, every other keeps its overlap."""
    assert sm90.ring_overlap(2, 2, True) == 0 and sm90.ring_overlap(1, 2, True) == 0
    assert sm90.ring_overlap(2, 3, True) == 2 and sm90.ring_overlap(2, 2, False) == 2
    assert sm90.ring_overlap(0, 3, False) == 0 and sm90.ring_overlap(1, 4, True) == 1
    if not hasattr(common, "gl"):  # no Gluon to build the shared-memory layouts (interpreter mode)
        return
    bf16 = torch.bfloat16
    for page, gather, want in ((2, False, 0), (12, False, 0), (16, True, 0), (16, False, 2), (None, False, 2)):
        c = sm90.kernel_constexprs(192, 128, bf16, page, overlap=2, pingpong=True, gather=gather)
        assert c["STAGES"] == 2 and c["OVERLAP"] == want and c["PINGPONG"] == bool(want), (page, gather)
    assert sm90.kernel_constexprs(128, 128, bf16, 2, overlap=2)["OVERLAP"] == 2  # 3 stages
    assert sm90.kernel_constexprs(192, 128, bf16, 2, block_n=64, overlap=2)["OVERLAP"] == 2  # 4 stages


@pytest.mark.parametrize(
    "d,dv,hkv,dtype,page,expect",
    [
        (576, 512, 2, torch.bfloat16, None, "num_kv_heads=2"),
        (576, 256, 1, torch.bfloat16, None, "head dims"),
        (192, 128, 1, torch.bfloat16, None, "head dims"),
        (576, 512, 1, torch.float32, None, "dtype"),
        (576, 512, 1, torch.bfloat16, 4, "page_size=4"),
    ],
)
def test_mla_unsupported_plans_name_the_reason(d, dv, hkv, dtype, page, expect):
    assert expect in mla.unsupported_reason(d, dv, hkv, dtype, page, CPU)


@pytest.mark.parametrize("page", [None, 8, 16, 64, 256])
def test_mla_supported_shape_on_cpu_is_refused_for_the_device(page):
    reason = mla.unsupported_reason(576, 512, 1, torch.bfloat16, page, CPU)
    assert reason == "not an sm_90 GPU"


def test_mla_layout_needs_v_to_view_k():
    k = torch.zeros(256, 1, 576, dtype=torch.bfloat16)
    assert mla.kv_layout_ok(k, k[..., :512])
    assert not mla.kv_layout_ok(k, k[..., :512].clone())  # a separate value tensor
    assert not mla.kv_layout_ok(k, k[..., 64:])  # not the first 512 columns
    paged = torch.zeros(8, 64, 1, 576, dtype=torch.bfloat16)
    assert mla.kv_layout_ok(paged, paged[..., :512])
    assert not mla.kv_layout_ok(paged[::2], paged[::2][..., :512])  # pages not evenly spaced


def test_backend_family_choice(interp):
    """The family is a plan-time choice; under the interpreter both Hopper families name why they
    cannot run and "auto" plans the portable kernel."""
    import cpattn

    s = cpattn.get_strategy("zigzag", 2, pad_multiple=4)
    meta = s.build_metadata([40], rank=0)
    for d, dv, hkv in ((128, 128, 2), (576, 512, 1)):
        kw = dict(num_q_heads=8, num_kv_heads=hkv, head_dim=d, head_dim_v=dv, dtype=torch.bfloat16, backend="triton")
        assert _spec_plan(meta, **kw).family == "portable"
        for family in ("sm90", "mla"):
            with pytest.raises(ValueError, match=f"the {family} kernel cannot run this plan: the CPU interpreter"):
                _spec_plan(meta, **kw, backend_options={"family": family})
        with pytest.raises(ValueError, match="family must be one of"):
            _spec_plan(meta, **kw, backend_options={"family": "fast"})


def test_sm90_options_are_validated_at_plan_time(interp):
    import cpattn

    s = cpattn.get_strategy("zigzag", 2, pad_multiple=4)
    meta = s.build_metadata([40], rank=0)
    kw = dict(num_q_heads=8, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16, backend="triton")
    with pytest.raises(ValueError, match="unknown backend_options sm90 keys \\['block_m'\\]"):
        _spec_plan(meta, **kw, backend_options={"sm90": {"block_m": 64}})
    with pytest.raises(ValueError, match="persistent runs without pingpong"):
        _spec_plan(meta, **kw, backend_options={"sm90": {"persistent": True, "overlap": 2, "pingpong": True}})
    assert _spec_plan(meta, **kw, backend_options={"sm90": {"persistent": True, "overlap": 2}})
    assert _spec_plan(meta, **kw, backend_options={"sm90": {"persistent": True}}).family == "portable"
    with pytest.raises(ValueError, match="persistent must be True, False or 'auto', got 'yes'"):
        _spec_plan(meta, **kw, backend_options={"sm90": {"persistent": "yes"}})
    # "auto" with pingpong is allowed (it then stays off); only an explicit True conflicts
    assert _spec_plan(meta, **kw, backend_options={"sm90": {"persistent": "auto", "pingpong": True,
                                                            "overlap": 2}})
    for bad in (3, -1, True, "2", 2.0):
        with pytest.raises(ValueError, match="sm90 overlap must be 0, 1, 2 or 'auto'"):
            _spec_plan(meta, **kw, backend_options={"sm90": {"overlap": bad}})


def test_sections_option_and_schedule_loss(interp):
    """``sections``: validated at plan time; the simulated loss of the L2-section order is large
    where few programs per SM meet skewed causal costs and 1.0 for one section or many waves."""
    import cpattn
    from cpattn.kernels._tiles import section_schedule_loss, tile_map
    from cpattn.kernels.triton_backend import SECTION_MAX_LOSS, use_sections

    s = cpattn.get_strategy("zigzag", 2, pad_multiple=4)
    meta = s.build_metadata([40], rank=0)
    kw = dict(num_q_heads=8, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16, backend="triton")
    with pytest.raises(ValueError, match="sections must be True, False or 'auto', got 2"):
        _spec_plan(meta, **kw, backend_options={"sm90": {"sections": 2}})
    z8 = cpattn.get_strategy("zigzag", 8, pad_multiple=64).build_metadata([16384], rank=0)
    keys = tile_map(z8, 128).tile_keys
    loss = section_schedule_loss(keys, 16, 3, 132)
    assert loss > 1.15 and not use_sections("auto", loss)
    assert section_schedule_loss(keys, 16, 16, 132) == 1.0  # one section
    assert section_schedule_loss(keys, 16, 3, 1) == 1.0  # 256 programs on 1 SM: beyond the checked waves
    assert use_sections("auto", SECTION_MAX_LOSS) and use_sections(True, 9.0) and not use_sections(False, 1.0)
    # where the H200 A/B measured sections faster (64k C = 4, one KV head per section), auto keeps them
    z4 = cpattn.get_strategy("zigzag", 4, pad_multiple=64).build_metadata([65536], rank=0)
    assert 1.0 < section_schedule_loss(tile_map(z4, 128).tile_keys, 16, 1, 132) <= SECTION_MAX_LOSS
    # the list schedule against hand schedules on 2 SMs: a program starts on the first SM to free up
    from cpattn.kernels._tiles import _list_makespan

    assert _list_makespan([4.0, 3.0, 3.0, 2.0], 2) == 6.0  # (4 | 3, 3 at 3) then 2 at 4
    assert _list_makespan([2.0, 3.0, 3.0, 4.0], 2) == 7.0  # (2 | 3), 3 at 2, 4 at 3


def test_persistent_auto_rule():
    """``persistent="auto"``: on for short mean key ranges per tile, off for long ones, static plans
    and pingpong; True / False are taken as given."""
    from cpattn.kernels.triton_backend import PERSISTENT_MAX_MEAN_KEYS as cap, use_persistent

    assert use_persistent("auto", 1024.0, False, False)
    assert use_persistent("auto", float(cap), False, False)
    assert not use_persistent("auto", cap + 1.0, False, False)
    assert not use_persistent("auto", 0.0, False, False)  # only pad tiles
    assert not use_persistent("auto", 1024.0, True, False)  # static plan
    assert not use_persistent("auto", 1024.0, False, True)  # pingpong
    assert use_persistent("auto", 1024.0, False, "auto")  # pingpong "auto" yields to persistent programs
    assert use_persistent(True, 1e9, True, False) and not use_persistent(False, 1.0, False, False)


def test_pingpong_auto_rule(interp):
    """``pingpong="auto"`` (the default): on at D128 with overlap and one program per work item,
    off with overlap 0 (a sliding window, say), for persistent programs and at D192 / D64, where
    the H200 measured it no faster; True / False are taken as given; anything else is refused."""
    import cpattn
    from cpattn.kernels.triton_backend import PINGPONG_HEAD_DIMS, SM90_OPTIONS, use_pingpong

    assert SM90_OPTIONS["pingpong"] == "auto" and PINGPONG_HEAD_DIMS == ((128, 128),)
    assert use_pingpong("auto", 128, 128, 2, False)
    assert use_pingpong("auto", 128, 128, 1, False)
    assert not use_pingpong("auto", 128, 128, 0, False)
    assert not use_pingpong("auto", 128, 128, 2, True)
    assert not use_pingpong("auto", 192, 128, 2, False) and not use_pingpong("auto", 64, 64, 2, False)
    assert use_pingpong(True, 192, 128, 0, False) and not use_pingpong(False, 128, 128, 2, False)
    s = cpattn.get_strategy("zigzag", 2, pad_multiple=4)
    meta = s.build_metadata([40], rank=0)
    kw = dict(num_q_heads=8, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16, backend="triton")
    with pytest.raises(ValueError, match="pingpong must be True, False or 'auto', got 1"):
        _spec_plan(meta, **kw, backend_options={"sm90": {"pingpong": 1}})


def test_overlap_auto_rule():
    """``overlap="auto"``: 2 at the head dims where the H200 measured it faster (D128, D192 / 128)
    without a sliding window (whose overlapped builds spill), 0 otherwise (D64); explicit values
    are taken as given."""
    from cpattn.kernels.triton_backend import OVERLAP_HEAD_DIMS, SM90_OPTIONS, use_overlap

    assert SM90_OPTIONS["overlap"] == "auto" and {(128, 128), (192, 128)} <= set(OVERLAP_HEAD_DIMS)
    assert use_overlap("auto", 128, 128, False) == 2
    assert use_overlap("auto", 128, 128, True) == 0
    assert use_overlap("auto", 192, 128, False) == 2
    assert use_overlap("auto", 192, 128, True) == 0
    assert use_overlap("auto", 64, 64, False) == 0
    assert [use_overlap(o, 192, 128, True) for o in (0, 1, 2)] == [0, 1, 2]
