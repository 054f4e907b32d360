"""Each scheme's work as the fewest plain torch ops on one flat bucket: its floor.

A floor is a function ``(bucket, error, state) -> mean``: the bucket is one flat
gradient (DDP's bucket), ``error`` one flat error memory of the same size (updated in
place), ``state`` the scheme's options (:func:`floor_of`). It decodes the mean over a
world of one, the same bits thinwire's scheme decodes from its payload, and leaves the
same error memory; it skips what only the wire needs (index codes, the payload's byte
layout, a finiteness check, per-tensor bookkeeping), so thinwire's time over a floor's
is what its engine costs beyond the arithmetic. ``benchmarks.codec`` times them side
by side; ``benchmarks/tests/test_codec.py`` checks that they decode the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from thinwire.compress.base import keep_count
from thinwire.compress.sparse import correction

Floor = Callable[[torch.Tensor, torch.Tensor, dict[str, Any]], torch.Tensor]
CHUNK = 128  # values sharing one int8 scale (thinwire.compress.quantise.CHUNK)
QMAX = 127  # int8 codes in [-127, 127]


def fp16(bucket: torch.Tensor, error: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
    """The bucket cast to fp16 and back: what an fp16 all-reduce over one rank decodes.

    No error memory (``error`` is not touched). Modifies ``bucket`` in place and
    returns it.
    """
    return bucket.copy_(bucket.to(torch.float16))


def int8(values: torch.Tensor) -> torch.Tensor:
    """``values`` (1-D, fp32) as int8 codes with one scale per :data:`CHUNK`, decoded.

    ``q = round(x * (127 / max|x|))`` (half to even) per chunk, sent as int8, and
    ``q / 127 * max|x|`` decoded: the arithmetic of
    :class:`thinwire.compress.quantise.Quantiser` ("int8"), in the same order, so the
    same bits; the chunk's largest entry travels exactly, an all-zero chunk decodes 0.
    """
    count = values.numel()
    padded = torch.nn.functional.pad(values, (0, -count % CHUNK)).view(-1, CHUNK)
    scale = padded.abs().amax(dim=1, keepdim=True)
    codes = torch.round(padded * (float(QMAX) / torch.where(scale > 0, scale, 1.0)))
    codes = codes.clamp_(-QMAX, QMAX).to(torch.int8)  # the wire's bytes
    return codes.to(values.dtype).div_(float(QMAX)).mul_(scale).view(-1)[:count]


def topk(bucket: torch.Tensor, error: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
    """Top-k with error feedback over the whole bucket (``scope="bucket"``).

    ``p = e + g``; the ``k = ceil(ratio N)`` largest ``|p|`` in ascending position
    order; their values sent as they are (``values="native"``) or as int8 codes
    (:func:`int8`); ``e = p - sent`` at those positions, ``p`` elsewhere; the mean is
    ``sent`` at those positions and 0 elsewhere.

    Args:
        state: ``ratio`` and ``values`` ("native" or "int8").

    Returns:
        ``bucket``, overwritten with the mean. Modifies ``error`` in place.
    """
    p = error.add_(bucket)
    k = keep_count(p.numel(), state["ratio"])
    # ascending, as thinwire's payload orders them (int8 chunks follow that order);
    # torch.topk breaks ties at the k-th value by no stated rule, thinwire by position
    indices = torch.topk(p.abs(), k, sorted=False).indices.sort().values
    taken = p.index_select(0, indices)
    sent = int8(taken) if state["values"] == "int8" else taken
    error.index_add_(0, indices, sent, alpha=-1)  # p - s, exactly as p + (-s)
    return bucket.zero_().index_copy_(0, indices, sent)


def dct_dp(bucket: torch.Tensor, error: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
    """DCT-DP's reused threshold with error feedback over the whole bucket (``scope="bucket"``).

    ``p = e + g``; every ``life_span`` calls tau is the k-th largest ``|p|`` (DCT Alg. 1
    lines 4-6), else reused (line 8); the entries with ``|p| >= tau`` (line 9), the
    largest ``room = ceil(capacity k)`` of them where more pass; values and memory as
    :func:`topk`; then tau moves by thinwire's density control
    (:func:`thinwire.compress.sparse.correction`, a scalar rule, not torch work).

    Args:
        state: ``ratio``, ``life_span``, ``gain``, ``capacity``, ``values``; ``tau`` and
            ``calls`` are kept in it between calls.

    Returns:
        ``bucket``, overwritten with the mean. Modifies ``error`` and ``state`` in place.
    """
    p = error.add_(bucket)
    magnitudes = p.abs()
    numel = p.numel()
    k = keep_count(numel, state["ratio"])
    calls = state.get("calls", 0)
    state["calls"] = calls + 1
    if calls % state["life_span"] == 0:
        state["tau"] = float(torch.topk(magnitudes, k, sorted=False).values.min())
    tau = state["tau"]
    indices = (magnitudes >= tau if tau > 0 else magnitudes > 0).nonzero().view(-1)
    passed = indices.numel()
    room = min(numel, math.ceil(state["capacity"] * k - 1e-9))
    if passed > room:  # the largest go now, in ascending order; the rest wait in memory
        top = torch.topk(magnitudes.index_select(0, indices), room, sorted=False).indices
        indices = indices.index_select(0, top.sort().values)
    if state["gain"] is not None and tau > 0:
        state["tau"] = tau * correction(state["gain"], magnitudes, passed, k, room)
    taken = p.index_select(0, indices)
    sent = int8(taken) if state["values"] == "int8" else taken
    error.index_add_(0, indices, sent, alpha=-1)
    return bucket.zero_().index_copy_(0, indices, sent)


FLOORS: dict[str, Floor] = {"fp16": fp16, "topk": topk, "dct-dp": dct_dp}
# Of each scheme's options, the values its floor does the same work under; an option
# not listed may take any value (it changes how the payload is laid out, not what is
# decoded). A scheme spelled outside these has no floor.
SUPPORTED: dict[str, dict[str, tuple[Any, ...]]] = {
    "fp16": {"nonfinite": ("raise",)},
    "topk": {"values": ("native", "fp32", "int8"), "scope": ("bucket",),
             "error_feedback": (True,), "min_numel": (0,), "exclude": ((),),
             "nonfinite": ("raise",)},
    "dct-dp": {"values": ("native", "fp32", "int8"), "scope": ("bucket",),
               "refresh_above": (None,), "drain_every": (None,), "min_numel": (0,),
               "exclude": ((),), "nonfinite": ("raise",)},
}


def floor_of(name: str, config: Any) -> tuple[Floor, dict[str, Any]] | None:
    """The floor of scheme ``name`` built with ``config`` (its config dataclass), and its
    state; None where the scheme, or one of its options, has none."""
    rules = SUPPORTED.get(name)
    if rules is None or any(getattr(config, key) not in allowed
                            for key, allowed in rules.items()):
        return None
    state = {key: getattr(config, key) for key in
             ("ratio", "values", "life_span", "gain", "capacity") if hasattr(config, key)}
    return FLOORS[name], state
