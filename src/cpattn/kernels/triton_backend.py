"""``backend="triton"``: the one-launch Triton kernel of :mod:`cpattn.kernels.triton_attn`.

Runs on CUDA tensors, or on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1`` set
before the kernel module is first imported; Triton fixes the mode when it decorates the kernel).
Triton is imported lazily: ``import cpattn`` works without it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Optional

from torch import Tensor

from . import AttentionCall

_KERNEL_MODULE = "cpattn.kernels.triton_attn"


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class TritonBackend:
    name = "triton"

    def __init__(self) -> None:
        self._has_triton: Optional[bool] = None

    def _triton_available(self) -> bool:
        if self._has_triton is None:
            self._has_triton = importlib.util.find_spec("triton") is not None
        return self._has_triton

    def unsupported_reason(self, call: AttentionCall) -> Optional[str]:
        if not self._triton_available():
            return "triton is not installed (pip install cpattn[triton])"
        loaded = sys.modules.get(_KERNEL_MODULE)
        if call.q.is_cuda:
            if loaded is not None and loaded.INTERPRETED:
                return "the triton kernel was built for the CPU interpreter in this process"
        elif call.q.device.type == "cpu":
            if not _interpret_env():
                return "CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter)"
            if loaded is not None and not loaded.INTERPRETED:
                return "the triton kernel was built for the GPU in this process (TRITON_INTERPRET set too late)"
        else:
            return f"device {call.q.device} not supported"
        if not call.softmax_scale > 0:
            return f"softmax_scale must be > 0 for the triton kernel, got {call.softmax_scale}"
        from .triton_attn import shape_unsupported_reason

        reason = shape_unsupported_reason(call.q.shape[-1], call.v.shape[-1], call.q.dtype)
        if reason is None and call.q.dtype.itemsize == 4 and call.q.is_cuda:
            reason = "fp32 runs only under the interpreter (use bf16/fp16 on the GPU)"
        return reason

    def run(self, call: AttentionCall) -> tuple[Tensor, Optional[Tensor]]:
        from .triton_attn import cp_attention_fwd

        return cp_attention_fwd(
            call.q,
            call.k,
            call.v,
            call.meta,
            call.softmax_scale,
            call.window_left,
            call.sinks,
            call.page_table,
            call.return_lse,
        )
