"""Planned launches on the GPU (``-m gpu``, H100/H200): the direct launch with prepared TMA
descriptors (the portable packed kernel: device-side descriptors in a kept global scratch
buffer) gives bit-identical results to the plain JIT call, for the sm90 packed / paged, MLA
packed / paged and portable paths, with K/V rotating among several buffers (layers), after the
K/V move to new addresses, after a stride or page-count change, and under CUDA graph capture."""

from __future__ import annotations

import pytest
import torch

import cpattn
from graph_utils import capture_graph

pytest.importorskip("triton")

pytestmark = pytest.mark.gpu


def _spec_plan(meta, *, backend="auto", backend_options=None, **spec):
    """``cpattn.plan_attention`` for the layer kind of ``spec`` (:class:`cpattn.AttentionSpec`'s keywords)."""
    return cpattn.plan_attention(meta, cpattn.AttentionSpec(**spec), backend=backend, backend_options=backend_options)


def _is_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _is_sm90(), reason="needs an sm_90 GPU")

#: (family, D, Dv, Hq, Hkv, page_size)
CASES = [
    ("sm90", 128, 128, 16, 4, None),
    ("sm90", 128, 128, 16, 4, 64),
    ("sm90", 128, 128, 16, 4, 4),  # the cp.async gather loader: no descriptors
    ("sm90", 192, 128, 16, 4, None),
    ("mla", 576, 512, 16, 1, None),
    ("mla", 576, 512, 16, 1, 64),
    ("portable", 128, 128, 16, 4, None),
    ("portable", 128, 128, 16, 4, 16),
]


def _layer_kv(n_kv, hkv, d, dv, family, gen):
    """One layer's packed K/V in fresh buffers (MLA: ``v`` = ``k[..., :Dv]``)."""
    k = torch.randn(n_kv, hkv, d, device="cuda", generator=gen).to(torch.bfloat16)
    if family == "mla":
        return k, k[..., :dv]
    return k, torch.randn(n_kv, hkv, dv, device="cuda", generator=gen).to(torch.bfloat16)


def _table(lens, page):
    """The page table of :func:`_paged_from_packed` (sequence b from its first page on), or None."""
    if page is None:
        return None
    table = torch.zeros(len(lens), -(-max(lens) // page), dtype=torch.int32, device="cuda")
    used = 0
    for b, n in enumerate(lens):
        p = -(-n // page)
        table[b, :p] = torch.arange(used, used + p, device="cuda")
        used += p
    return table


def _plans(s, meta, family, d, dv, hq, hkv, page):
    kw = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv, dtype=torch.bfloat16, page_size=page,
              has_sinks=True, backend="triton")
    opts = {"family": family}
    fast = _spec_plan(meta, **kw, backend_options=opts)
    jit = _spec_plan(meta, **kw, backend_options={**opts, "planned_launch": False})
    assert fast.family == family and jit.family == family
    return fast, jit


def _records(plan):
    impl = plan._impl
    state = impl._portable_state if plan.family == "portable" else impl._fast_state
    launchers = list(state.launchers.values()) if plan.family != "portable" else [impl._portable_launch]
    return [r for launcher in launchers for r in launcher.records.values()]


@needs_sm90
@pytest.mark.parametrize("family,d,dv,hq,hkv,page", CASES)
def test_gpu_direct_launch_is_bit_identical_to_the_jit(family, d, dv, hq, hkv, page):
    """Four layers with their own K/V buffers, in rotation, then the K/V moved (new buffers), a
    stride change (packed: K/V views of a fused buffer) or page-count change (paged): every
    planned-launch result equals the JIT call's bit for bit (the JIT builds its descriptors per
    call), and the first equals the torch reference."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    s = cpattn.ZigzagStrategy(2, pad_multiple=64)
    ext, pre = [1500, 700], [300, 0]
    lens = [e + p for e, p in zip(ext, pre)]
    n_kv = sum(lens)
    meta = s.build_metadata(ext, pre, rank=1).to("cuda")
    q = torch.randn(meta.num_physical_tokens, hq, d, device="cuda", generator=gen).to(torch.bfloat16)
    sinks = torch.randn(hq, device="cuda", generator=gen)
    fast, jit = _plans(s, meta, family, d, dv, hq, hkv, page)
    table = _table(lens, page)
    layers = [_layer_kv(n_kv, hkv, d, dv, family, gen) for _ in range(4)]
    if page is not None:
        layers = [_paged_from_packed(k, v, lens, page, family, dv) for k, v in layers]

    def both(k, v, return_lse=False):
        kw = dict(page_table=table, sinks=sinks, return_lse=return_lse)
        return fast.attend(q, k, v, **kw), jit.attend(q, k, v, **kw)

    a, b = both(*layers[0], return_lse=True)
    ref, ref_lse = _reference(s, q, layers[0], meta, lens, page, family, dv, sinks)
    n = meta.num_local_tokens
    assert (a[0][:n].float() - ref[:n]).abs().max().item() < 2e-2 and (a[1][:n] - ref_lse[:n]).abs().max() < 1e-2
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for rnd in range(3):
        for i, (k, v) in enumerate(layers):
            a, b = both(k, v)
            assert torch.equal(a, b), f"round {rnd} layer {i}: planned launch != JIT"
    recs = _records(fast)
    assert recs, "no compiled kernel was recorded"
    assert all(r.direct is not None for r in recs), "the direct launch was not taken"
    if family == "portable":  # packed: device-side descriptors in a kept global scratch buffer
        assert all(bool(r.direct.scratch_bytes) == (page is None) for r in recs)
        assert all(len(r.direct.scratch) <= 1 for r in recs)
    else:
        with_descs = [r for r in recs if r.direct.desc_meta]
        # the return_lse record served only its recording (JIT) call; the rotation's record holds
        # one prepared descriptor set per layer
        used = [len(r.entries) for r in with_descs if r.entries]
        assert all(n == len(layers) for n in used) and (used or not with_descs), [len(r.entries) for r in with_descs]
    # moved: new values in new buffers while the old ones live (a stale descriptor would read those)
    moved = [_layer_kv(n_kv, hkv, d, dv, family, gen) for _ in range(2)]
    if page is not None:
        moved = [_paged_from_packed(k, v, lens, page, family, dv) for k, v in moved]
    for k, v in moved:
        a, b = both(k, v)
        assert torch.equal(a, b), "after the K/V moved"
    # another stride (packed) or page count (paged)
    k, v = moved[0]
    if page is None:
        if family == "mla":
            wide = torch.zeros(k.shape[0], 1, 640, device="cuda", dtype=k.dtype)
            wide[..., :576] = k
            k2 = wide[..., :576]
            v2 = k2[..., :dv]
        else:  # K / V as views of buffers holding two rows per key (row stride doubled)
            fk = torch.zeros(k.shape[0], 2, hkv, d, device="cuda", dtype=k.dtype)
            fv = torch.zeros(k.shape[0], 2, hkv, dv, device="cuda", dtype=k.dtype)
            fk[:, 0], fv[:, 0] = k, v
            k2, v2 = fk[:, 0], fv[:, 0]
    else:
        extra = 3
        k2 = torch.cat([k, torch.zeros(extra, *k.shape[1:], device="cuda", dtype=k.dtype)])
        v2 = k2[..., :dv] if family == "mla" else torch.cat(
            [v, torch.zeros(extra, *v.shape[1:], device="cuda", dtype=v.dtype)])
    a, b = both(k2, v2)
    assert torch.equal(a, b), "after the stride / page-count change"
    assert torch.equal(a, both(k, v)[0]), "the same keys through another layout gave another result"
    if page is None and family != "mla":  # the same addresses as k2 / v2, other strides
        k3 = fk.view(-1)[: k.numel()].view(k.shape)
        v3 = fv.view(-1)[: v.numel()].view(v.shape)
        assert k3.data_ptr() == k2.data_ptr() and k3.stride() != k2.stride()
        a, b = both(k3, v3)
        assert torch.equal(a, b), "same address, other strides: a stale descriptor"


def _paged_from_packed(k, v, lens, page, family, dv):
    """A paged cache whose sequence b starts at page sum(ceil(len / page)) of the ones before."""
    hkv, d = k.shape[1], k.shape[2]
    pages = sum(-(-n // page) for n in lens)
    kc = torch.zeros(pages, page, hkv, d, device="cuda", dtype=k.dtype)
    vc = None if family == "mla" else torch.zeros(pages, page, hkv, v.shape[-1], device="cuda", dtype=v.dtype)
    off, used = 0, 0
    for n in lens:
        kc.view(-1, hkv, d)[used * page : used * page + n] = k[off : off + n]
        if vc is not None:
            vc.view(-1, hkv, v.shape[-1])[used * page : used * page + n] = v[off : off + n]
        off += n
        used += -(-n // page)
    return kc, (kc[..., :dv] if family == "mla" else vc)


def _reference(s, q, kv, meta, lens, page, family, dv, sinks):
    """torch backend over the packed keys (float32)."""
    k, v = kv
    if page is not None:
        hkv, d = k.shape[2], k.shape[3]
        rows, used = [], 0
        for n in lens:
            rows.append(k.reshape(-1, hkv, d)[used * page : used * page + n])
            used += -(-n // page)
        k = torch.cat(rows)
        v = k[..., :dv] if family == "mla" else None
        if v is None:
            vrows, used = [], 0
            vv = kv[1]
            for n in lens:
                vrows.append(vv.reshape(-1, vv.shape[2], vv.shape[3])[used * page : used * page + n])
                used += -(-n // page)
            v = torch.cat(vrows)
    return s.attention(q.float(), k.float(), v.float(), meta, sinks=sinks, backend="torch", return_lse=True)


@needs_sm90
@pytest.mark.parametrize("family,d,dv,hq,hkv,page", CASES)
def test_gpu_direct_launch_under_graph_capture(family, d, dv, hq, hkv, page):
    """Two layers with their own K/V captured in one CUDA graph after warm-up (the direct path,
    prepared descriptors; the portable packed kernel's global scratch kept by the launch); new
    values written into the same buffers replay right (== the JIT)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    s = cpattn.ZigzagStrategy(2, pad_multiple=64)
    ext, pre = [1200, 400], [0, 200]
    lens = [e + p for e, p in zip(ext, pre)]
    meta = s.build_metadata(ext, pre, rank=0).to("cuda")
    fast, jit = _plans(s, meta, family, d, dv, hq, hkv, page)
    q = torch.randn(meta.num_physical_tokens, hq, d, device="cuda", generator=gen).to(torch.bfloat16)
    sinks = torch.randn(hq, device="cuda", generator=gen)
    n_kv = sum(lens)
    table = _table(lens, page)
    layers = [_layer_kv(n_kv, hkv, d, dv, family, gen) for _ in range(2)]
    if page is not None:
        layers = [_paged_from_packed(k, v, lens, page, family, dv) for k, v in layers]
    outs = [torch.empty(meta.num_physical_tokens, hq, dv, device="cuda", dtype=torch.bfloat16) for _ in layers]

    def step():
        for (k, v), o in zip(layers, outs):
            fast.attend(q, k, v, page_table=table, sinks=sinks, out=o)

    graph = capture_graph(step)
    for _ in range(2):
        for k, v in layers:
            k.normal_(generator=gen)
            if family != "mla":
                v.normal_(generator=gen)
        q.normal_(generator=gen)
        graph.replay()
        torch.cuda.synchronize()
        for (k, v), o in zip(layers, outs):
            assert torch.equal(o, jit.attend(q, k, v, page_table=table, sinks=sinks)), "graph replay != JIT"


@pytest.mark.parametrize("shape", ["gqa", "mla"])
def test_gpu_decode_step_launches_are_direct_and_bit_identical(shape):
    """A decode step's split + combine (3-D grid) and the fused merge (3-D grid) take the direct
    launch after their first call, and give the same bits as the plain JIT call."""
    from cpattn.kernels import triton_decode

    hq, hkv, d, dv, ps = (32, 8, 128, 128, 64) if shape == "gqa" else (128, 1, 576, 512, 64)
    gen = torch.Generator(device="cuda").manual_seed(5)
    # a decode step (q_lens 1, 2, 1 over 9000, 77, 1 keys) over a KV cache sharded on 2 ranks
    dmeta = cpattn.get_strategy("replicated", 2).build_metadata([1, 2, 1], [8999, 75, 0], rank=1,
                                                                kv=cpattn.KVSharding(2)).to("cuda")
    local = dmeta.host.local_kv_lens.tolist()
    pages = [-(-n // ps) for n in local]
    table = torch.zeros(len(local), max(pages), dtype=torch.int32, device="cuda")
    table[:] = torch.arange(table.numel(), dtype=torch.int32, device="cuda").view(table.shape)
    kc = torch.randn(table.numel(), ps, hkv, d, device="cuda", generator=gen).to(torch.bfloat16)
    vc = kc[..., :dv] if shape == "mla" else torch.randn(table.numel(), ps, hkv, dv, device="cuda",
                                                          generator=gen).to(torch.bfloat16)
    q = torch.randn(dmeta.num_physical_tokens, hq, d, device="cuda", generator=gen).to(torch.bfloat16)
    kw = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv, dtype=torch.bfloat16, page_size=ps,
              backend="triton")
    planned = _spec_plan(dmeta, **kw)
    assert planned.algorithm == "shard_merge"
    impl = planned._impl
    runner = impl._mla if impl._mla is not None else impl
    assert runner.run_combine  # the 9000-key sequence is split
    results = [planned.attend(q, kc, vc, page_table=table) for _ in range(3)]
    for name in ("split", "combine") if impl._mla is None else ("combine",):
        launcher = runner._state.launchers[name]
        assert any(launcher.direct(key) for key in launcher.records), f"{name} not launched directly"
    # the JIT reference: the same plan with planned launches disabled
    ref_plan = _spec_plan(dmeta, **kw)
    ref_runner = ref_plan._impl._mla if ref_plan._impl._mla is not None else ref_plan._impl
    ref_runner._state.enabled = False
    ref = ref_plan.attend(q, kc, vc, page_table=table)
    for out, lse in results:
        assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
    # the fused merge of C = 4 parts: direct from its second call, the same bits every call
    parts = torch.randn(4, *results[0][0].shape, device="cuda", generator=gen).to(torch.bfloat16)
    part_lse = torch.randn(4, *results[0][1].shape, device="cuda", generator=gen)
    merged = [cpattn.merge_states(parts, part_lse) for _ in range(3)]
    assert any(launcher.direct(key) for launcher in triton_decode._MERGE_LAUNCHES.launchers.values()
               for key in launcher.records)
    for out, lse in merged[1:]:
        assert torch.equal(out, merged[0][0]) and torch.equal(lse, merged[0][1])


@pytest.mark.parametrize("shape", ["gqa", "mla"])
def test_gpu_decode_shaped_dense_plan_pad_rows_in_one_direct_launch(shape):
    """A decode-shaped dense plan (C = 1, 8 sequences, 56 pad rows) writes its pad rows with one
    pad-row launch that goes direct after its first call: into NaN-filled engine buffers, pad rows
    exactly 0 / -inf, local rows equal to the torch backend's (and the same bits every call)."""
    hq, hkv, d, dv = (32, 8, 128, 128) if shape == "gqa" else (128, 1, 576, 512)
    gen = torch.Generator(device="cuda").manual_seed(6)
    s = cpattn.ContiguousStrategy(1, pad_multiple=64)
    ext, pre = [1] * 8, [4000 + 37 * i for i in range(8)]
    meta = s.build_metadata(ext, pre, rank=0).to("cuda")
    n_kv = sum(e + p for e, p in zip(ext, pre))
    k, v = _layer_kv(n_kv, hkv, d, dv, "mla" if shape == "mla" else "sm90", gen)
    q = torch.randn(meta.num_physical_tokens, hq, d, device="cuda", generator=gen).to(torch.bfloat16)
    plan = _spec_plan(meta, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv, dtype=torch.bfloat16,
                      backend="triton")
    assert plan.family == "decode"
    n, p = meta.num_local_tokens, meta.num_physical_tokens
    assert p - n == 56
    results = []
    for _ in range(3):
        out = torch.full((p, hq, dv), float("nan"), device="cuda", dtype=torch.bfloat16)
        lse = torch.full((p, hq), float("nan"), device="cuda")
        plan.attend(q, k, v, out=out, lse=lse)
        results.append((out, lse))
    launcher = plan._impl._pad_state.launchers["pad"]
    assert any(launcher.direct(key) for key in launcher.records), "the pad-row launch did not go direct"
    ref, ref_lse = s.attention(q.float(), k.float(), v.float(), meta, backend="torch", return_lse=True)
    for out, lse in results:
        assert (out[n:] == 0).all() and torch.isneginf(lse[n:]).all()
        assert (out[:n].float() - ref[:n]).abs().max().item() < 2e-2 and (lse[:n] - ref_lse[:n]).abs().max() < 1e-2
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
