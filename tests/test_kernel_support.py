"""Kernel families the installed triton cannot run (CPU): the first plan that would use one warns
once (:class:`cpattn.kernels.KernelFamilyWarning`, naming the family, its fallback and the
reason) and ``cpattn.available_backends()`` says the same."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("triton")
import cpattn  # noqa: E402
from cpattn import kernels  # noqa: E402

common = pytest.importorskip("cpattn.kernels._sm90_common")
sm90 = pytest.importorskip("cpattn.kernels.triton_sm90")
mla = pytest.importorskip("cpattn.kernels.triton_mla")

REASON = "Gluon API of triton 9.9.0 (the Hopper kernels need gl.barrier / gl.thread_barrier)"
GPU = torch.device("cuda", 0)
BF16 = torch.bfloat16


@pytest.fixture
def unsupported(monkeypatch):
    """This triton reported unable to build the Gluon families, on a (pretended) sm_90 GPU, with no
    family warned yet."""
    monkeypatch.setattr(common, "GLUON_API_REASON", REASON)
    monkeypatch.setattr(common, "HAVE_GLUON", False)
    monkeypatch.setattr(kernels, "_WARNED_FAMILIES", set())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.delenv("CPATTN_TRITON_SM90", raising=False)


def _family_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, kernels.KernelFamilyWarning)]


def test_first_plan_of_each_family_warns_once(unsupported):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):  # dense plans that would run sm90
            assert sm90.unsupported_reason(128, 128, BF16, None, GPU) == REASON
            assert sm90.unsupported_reason(64, 64, BF16, 16, GPU) == REASON
        assert mla.unsupported_reason(576, 512, 1, BF16, 64, GPU) == REASON  # absorbed MLA
        assert mla.sparse_unsupported_reason(576, 512, 1, BF16, GPU) == REASON  # its sparse mode
    messages = _family_warnings(caught)
    assert len(messages) == 2, messages
    assert messages[0] == ("cpattn: the sm90 kernel family cannot run with the installed triton (" + REASON
                           + "); the portable family runs instead")
    assert "the mla kernel family" in messages[1] and "the portable family" in messages[1] and REASON in messages[1]
    family = [w for w in caught if issubclass(w.category, kernels.KernelFamilyWarning)]
    assert all(w.filename == __file__ for w in family)  # points at the caller outside cpattn
    assert issubclass(kernels.KernelFamilyWarning, RuntimeWarning)


def test_plans_that_would_not_use_the_family_do_not_warn(unsupported, monkeypatch):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert "head dims" in sm90.unsupported_reason(128, 64, BF16, None, GPU)
        assert "dtype" in sm90.unsupported_reason(128, 128, torch.float32, None, GPU)
        assert mla.unsupported_reason(576, 512, 1, BF16, 64, torch.device("cpu")) == "not an sm_90 GPU"
        assert "num_kv_heads" in mla.unsupported_reason(576, 512, 2, BF16, None, GPU)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
        assert sm90.unsupported_reason(128, 128, BF16, None, GPU) == "not an sm_90 GPU"
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        monkeypatch.setenv("CPATTN_TRITON_SM90", "0")  # the Hopper families turned off
        assert sm90.unsupported_reason(128, 128, BF16, None, GPU) == REASON
    assert _family_warnings(caught) == []


def test_available_backends_reports_the_unavailable_families(unsupported, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the triton backends available on the CPU
    dense = cpattn.available_backends()
    assert "triton" in dense and list(dense) == sorted(dense)
    assert set(dense.unavailable_families) == {"sm90", "mla"}
    for family, message in dense.unavailable_families.items():
        assert message == kernels.family_fallback_message(family, REASON)
        assert f"the {family} kernel family" in message and "portable family" in message and REASON in message
        assert message in repr(dense)
    assert set(cpattn.available_backends("shard").unavailable_families) == {"mla"}
    assert set(cpattn.available_backends("sparse").unavailable_families) == {"mla"}
    assert cpattn.available_backends("index").unavailable_families == {}
    # reporting does not warn: only a plan that would have used the family does
    assert kernels._WARNED_FAMILIES == set()


def test_available_backends_without_triton_backends_reports_no_family(unsupported, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    names = cpattn.available_backends()
    assert "triton" not in names and names.unavailable_families == {} and repr(names) == repr(list(names))


def test_this_triton_builds_the_families():
    """The installed triton (3.5-3.9) resolves every Gluon call the kernels make: no family is
    reported (a process that loaded triton for the CPU interpreter first has no Gluon, which is
    not the installed triton's fault: not reported either)."""
    import triton

    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 5):
        pytest.skip(f"triton {triton.__version__} has no Gluon")
    assert common.GLUON_API_REASON is None
    assert kernels.family_unavailable_reason("sm90") is None and kernels.family_unavailable_reason("mla") is None
    if common.HAVE_GLUON:
        assert callable(common.cta_barrier) and callable(common.warp_specialize)
