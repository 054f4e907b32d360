"""Server checkpoints, written atomically: a crash mid-write leaves the previous one intact."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from typing import Any

import torch


def save_checkpoint(path: str, state: Mapping[str, Any]) -> None:
    """Write ``state`` to ``path``: a temporary file in the same folder, fsync, ``os.replace``.

    ``os.replace`` is atomic on POSIX, so readers see the old file or the new
    one, never a partial one.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=".checkpoint-", dir=folder)
    try:
        with os.fdopen(handle, "wb") as stream:
            torch.save(dict(state), stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def load_checkpoint(path: str) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`.

    Loaded with ``weights_only=True``: checkpoints hold only tensors and plain
    containers, so loading one cannot run code.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}")
    state: dict[str, Any] = torch.load(path, weights_only=True)
    return state
