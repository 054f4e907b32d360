"""Catch a tensor created away from its input's device, on a machine without a GPU.

Code under test runs on CPU inputs while the default device is ``meta``: a
factory call that names no device (``torch.zeros(n)``) then lands on ``meta``
instead of silently on the CPU, and a dispatch mode records every op output
that is not on the input's device. On CUDA the same call would have allocated
on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

T = TypeVar("T")


class _Recorder(TorchDispatchMode):
    """Records ops whose tensor outputs are not on ``device``."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.strays: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device != self.device:
                self.strays.append(f"{func} made a tensor on {leaf.device}")
        return out


def on_input_device(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, failing if it creates a tensor away from the CPU inputs.

    Raises:
        AssertionError: naming the ops that created tensors elsewhere (also when
            ``fn`` then failed on the mixed devices, which a stray allocation causes).
    """
    recorder = _Recorder(torch.device("cpu"))
    try:
        with torch.device("meta"), recorder:
            result = fn(*args, **kwargs)
    except Exception as error:
        if recorder.strays:
            raise AssertionError(f"tensors created away from the input's device: "
                                 f"{recorder.strays[:5]} (then: {error!r})") from error
        raise
    assert not recorder.strays, f"tensors created away from the input's device: " \
                                f"{recorder.strays[:5]}"
    return result
