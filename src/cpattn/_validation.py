"""Argument checks shared by the public entry points (ValueError / TypeError naming the argument)."""

from __future__ import annotations

import math
import operator
import numbers
from typing import Optional

import numpy as np
import torch
from torch import Tensor


def check_tensor(x, name: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_softmax_scale(value, name: str = "softmax_scale") -> Optional[float]:
    """None (the caller's default) or the scale as a Python float: an int or float (numpy scalars
    included), or a one-element real tensor (read on the host: a sync for a CUDA tensor). TypeError
    for other types (bools included), ValueError for a tensor of several elements or a non-finite
    value; the messages name ``name`` and the value."""
    if value is None:
        return None
    if type(value) is float:  # the per-layer common case: one type check and one finiteness check
        scale = value
    elif isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got a tensor of shape "
                             f"{list(value.shape)}")
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{name} must be a real number, got a {value.dtype} tensor")
        scale = float(value.item())
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        scale = float(value)
    else:
        raise TypeError(f"{name} must be a real number (float, int or a one-element tensor) or None, got "
                        f"{type(value).__name__} {value!r}")
    if not math.isfinite(scale):
        raise ValueError(f"{name} must be finite, got {scale}")
    return scale


def check_device(value, name: str) -> torch.device:
    """A ``torch.device`` from a device, a device string ("cpu", "cuda", "cuda:1") or a CUDA index
    (int >= 0): ValueError for an unknown device string or a negative index, TypeError for other
    types (both naming ``name`` and the value)."""
    if isinstance(value, torch.device):
        return value
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError(f"{name} must be a torch.device, a device string or a CUDA index, got "
                        f"{type(value).__name__} {value!r}")
    if isinstance(value, int) and value < 0:
        raise ValueError(f"{name} must be a torch.device or a device string such as 'cpu' or 'cuda:0' "
                         f"(or a CUDA index >= 0), got {value!r}")
    try:
        return torch.device(value)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"{name} must be a torch.device or a device string such as 'cpu' or 'cuda:0', "
                         f"got {value!r}") from None


def check_process_group(group, name: str = "group") -> None:
    """TypeError naming ``name`` unless ``group`` is None (the default group) or a process group."""
    if group is None:
        return
    import torch.distributed as dist

    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        return
    raise TypeError(f"{name} must be None or a torch.distributed.ProcessGroup, got {type(group).__name__} "
                    f"{group!r}")


def as_lengths(value, name: str) -> Tensor:
    """Validate a list/tuple/1-D integer tensor or array of lengths >= 0; return int64 CPU [B].

    Accepts Python ints, numpy integers and arrays, and integer torch tensors.
    """
    if not isinstance(value, Tensor) and hasattr(value, "__array__") and not isinstance(value, (list, tuple)):
        value = torch.as_tensor(value)  # numpy arrays
    if isinstance(value, Tensor):
        if value.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got dtype {value.dtype}")
        lengths = value.detach().to("cpu", torch.int64)
    elif isinstance(value, (list, tuple)) and set(map(type, value)) <= {int}:  # the common case: plain ints
        try:  # numpy builds a small int64 array ~3x faster than torch.tensor
            arr = np.array(value, dtype=np.int64)
        except OverflowError:
            raise ValueError(f"{name} must fit in int64, got {list(value)}") from None
        if arr.size and arr.min() < 0:
            raise ValueError(f"{name} must be >= 0, got {arr.tolist()}")
        return torch.from_numpy(arr)
    elif isinstance(value, (list, tuple)):
        items = []
        for item in value:
            if isinstance(item, bool) or isinstance(item, float):
                raise TypeError(f"{name} must hold integers, got {type(item).__name__} {item!r}")
            if isinstance(item, Tensor) and (item.dim() != 0 or item.is_floating_point()):
                raise TypeError(f"{name} must hold integers, got a tensor of shape {tuple(item.shape)}")
            try:
                items.append(operator.index(item))
            except TypeError:
                raise TypeError(f"{name} must hold integers, got {type(item).__name__} {item!r}") from None
        lengths = torch.tensor(items, dtype=torch.int64)
    else:
        raise TypeError(f"{name} must be a list, tuple, 1-D int tensor or array, got {type(value).__name__}")
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"{name} must be >= 0, got {lengths.tolist()}")
    return lengths
