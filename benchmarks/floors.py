"""Each scheme's work as the fewest plain torch ops on one flat bucket: its floor.

A floor is a function ``(bucket, error, state) -> mean``: the bucket is one flat
gradient (DDP's bucket), ``error`` one flat error memory of the same size (updated in
place), ``state`` the scheme's options and what the bucket's layout fixes (:func:`floor_of`).
It decodes the mean over a world of one, the same bits thinwire's scheme decodes from its
payload (SparseLoCo's within rounding: :func:`sparseloco`), and leaves the same error
memory; it skips what only the wire needs (index codes, the payload's byte layout, a
finiteness check, per-tensor bookkeeping), so thinwire's time over a floor's is what its
engine costs beyond the arithmetic. ``benchmarks.codec`` times them side by side;
``benchmarks/tests/test_codec.py`` checks that they decode the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from thinwire.compress.base import TensorInfo, keep_count
from thinwire.compress.codebook import BINS, RANGE
from thinwire.compress.lowrank import compressible, seeded_normal
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


def scratch(state: dict[str, Any], name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
    """1-D room for ``numel`` entries of ``like``'s dtype, kept in ``state`` under ``name``
    across calls (grown to the most asked for), as thinwire keeps its scratch: a fresh
    tensor the size of a large bucket costs its page faults on every call on CPU."""
    buffer = state.get(name)
    if buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype:
        buffer = state[name] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buffer[:numel]


def kept(state: dict[str, Any], name: str, like: torch.Tensor, op: Callable[..., torch.Tensor],
         *args: Any) -> torch.Tensor:
    """``op(*args)`` (``op(like)`` without ``args``) written into :func:`scratch` of
    ``like``'s shape: ``op`` takes ``out=``."""
    return op(*(args or (like,)), out=scratch(state, name, like.numel(), like).view(like.shape))


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
    ``sent`` at those positions and 0 elsewhere. Also local-topk's and clt-k's floor
    (``scope="bucket"``, exact selection, ``beta=1``): at a world of one, ScaleCom's
    leader is this rank, and its low-pass memory at ``beta=1`` keeps ``p - sent``.

    Args:
        state: ``ratio`` and ``values`` ("native" or "int8").

    Returns:
        ``bucket``, overwritten with the mean. Modifies ``error`` in place.
    """
    p = error.add_(bucket)
    k = keep_count(p.numel(), state["ratio"])
    # ascending, as thinwire's payload orders them (int8 chunks follow that order);
    # torch.topk breaks ties at the k-th value by no stated rule, thinwire by position
    indices = torch.topk(kept(state, "magnitudes", p, torch.abs), k,
                         sorted=False).indices.sort().values
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
    p, magnitudes, k = _opened(bucket, error, state)
    calls = state.get("calls", 0)
    state["calls"] = calls + 1
    if calls % state["life_span"] == 0:
        state["tau"] = float(torch.topk(magnitudes, k, sorted=False).values.min())
    tau = state["tau"]
    indices, factor = _above(p, magnitudes, tau, k, state)
    state["tau"] = tau * factor
    return _sent(bucket, error, p, indices, state)


def laplace(bucket: torch.Tensor, error: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
    """The Laplace fit's threshold with error feedback over the whole bucket (``scope="bucket"``).

    ``p = e + g``; ``tau = mean|p| ln(1 / ratio)`` (DCT MLSys App. B), times the density
    control's factor when ``gain`` is set; the entries with ``|p| >= tau``, the largest
    ``room = ceil(capacity k)`` of them where more pass; values and memory as :func:`topk`.

    Args:
        state: ``ratio``, ``gain``, ``capacity``, ``values``; ``scale`` (the control's
            factor) is kept in it between calls.

    Returns:
        ``bucket``, overwritten with the mean. Modifies ``error`` and ``state`` in place.
    """
    p, magnitudes, k = _opened(bucket, error, state)
    scale = state.get("scale", 1.0)
    tau = float(magnitudes.mean()) * -math.log(state["ratio"]) * scale
    indices, factor = _above(p, magnitudes, tau, k, state)
    state["scale"] = scale * factor
    return _sent(bucket, error, p, indices, state)


def powersgd(bucket: torch.Tensor, error: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
    """PowerSGD with error feedback (Vogels et al. 2019, Alg. 1 and 2), warm-started Q.

    Per matrix ``M = e + g`` (a tensor viewed as (shape[0], rest), where rank-r factors
    save half its bytes): ``P = M Q`` (line 2), ``P_hat = qr(P)`` (line 4),
    ``Q^T = P_hat^T M`` (line 5), the mean ``P_hat Q^T`` summed as r outer products
    (line 7, as :func:`thinwire.compress.powersgd.reconstruct` sums them), ``e = M - mean``;
    the next Q is this one, a zero column keeping the previous one. The factorisation is
    per matrix, so this loops over them; the other tensors are the mean as they are.

    Args:
        state: ``rank``; ``matrices`` ((start, rows, cols, key) of each matrix) and ``qs``
            (key -> its (cols, rank) Q, column-major) from :func:`floor_of`, the Qs
            replaced each call.

    Returns:
        ``bucket``, its matrices overwritten with their means. Modifies ``error`` (at the
        matrices) and ``state`` in place.
    """
    rank, qs = state["rank"], state["qs"]
    for start, rows, cols, key in state["matrices"]:
        stop = start + rows * cols
        matrix = error[start:stop].add_(bucket[start:stop]).view(rows, cols)
        p_hat = torch.linalg.qr(matrix @ qs[key], mode="reduced")[0]
        q_t = p_hat.t() @ matrix  # (rank, cols): Q^T, rows contiguous
        mean = torch.mul(p_hat[:, :1], q_t[0], out=bucket[start:stop].view(rows, cols))
        for j in range(1, rank):
            mean.add_(kept(state, "term", mean, torch.mul, p_hat[:, j: j + 1], q_t[j]))
        matrix.sub_(mean)
        warm = torch.empty(rank, cols, dtype=q_t.dtype).t()  # column-major, as left() reads
        qs[key] = torch.where(q_t.t().any(dim=0), q_t.t(), qs[key], out=warm)
    return bucket


def _first_largest(rows: torch.Tensor, threshold: torch.Tensor, counts: torch.Tensor | int,
                   total: int) -> torch.Tensor:
    """(row, column) of each row's ``counts`` largest entries, ascending, given each
    row's ``counts``-th largest (``threshold``, (rows, 1)) and ``total``, the sum of the
    counts: every entry above it, then the first of those equal to it. thinwire breaks
    ties so (towards the lower position), and here they matter: a chunk of fewer than k
    non-zero entries sends zeros, each decoded as its bin's mean, so which zeros go
    changes the mean."""
    keep = rows >= threshold
    places = keep.nonzero()
    if places.shape[0] == total:  # the usual case: no tie at any row's threshold
        return places
    above = rows > threshold
    tied = keep & ~above
    return (above | (tied & (tied.cumsum(1) <= counts - above.sum(1, keepdim=True)))).nonzero()


def sparseloco(bucket: torch.Tensor, error: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
    """SparseLoCo (Sarfi et al. 2025, Alg. 1) over the bucket, each tensor's statistics by
    segment operations.

    ``p = beta e + g``; of each matrix, the ``k`` largest ``|p|`` of every ``chunk``
    entries along its flat view (a last partial chunk of ``m``: ``ceil(k m / chunk)``), by
    one ``torch.topk`` over the chunks laid as rows (partial chunks padded with -1,
    which no magnitude falls below), ties to the lower position
    (:func:`_first_largest`); every entry of a tensor of one dimension. The values
    of each tensor as 2-bit codes of its own codebook
    (:mod:`thinwire.compress.codebook`: centred on its mean, cut at 1.5 unbiased standard
    deviations, each code read as its bin's mean); ``e = p - sent`` at the sent entries.

    The same entries, codes and memory as thinwire's, but not always the same bits:
    thinwire reduces each tensor's values on their own in fp32 (``mean``, ``norm``, a sum
    per bin), this floor all tensors at once by ``index_add_``, which adds in another
    order (one by one: in fp64, then rounded to fp32, so that it strays less), so a
    tensor's mean, spread and bin means differ in the last bits (the checking test
    allows 4 units in the last place of each tensor's largest entry: a bin's mean can
    be near 0, where a relative bound means nothing), and a value on a bin's edge could
    take the next code.

    Args:
        state: ``beta``, ``chunk``, ``k`` and the layout :func:`floor_of` derives (pieces,
            chunk rows, segments).

    Returns:
        ``bucket``, overwritten with the mean. Modifies ``error`` in place.
    """
    p = error.mul_(state["beta"]).add_(bucket)
    pieces = kept(state, "magnitudes", p, torch.abs).split(state["pieces"])
    chosen = []
    if state["full"]:  # whole chunks: every one keeps k
        rows = torch.cat([pieces[i] for i in state["full"]],
                         out=scratch(state, "full_rows", state["full_size"], p))
        rows = rows.view(-1, state["chunk"])
        threshold = torch.topk(rows, state["k"], dim=1, sorted=False).values.amin(
            1, keepdim=True)
        places = _first_largest(rows, threshold, state["k"], rows.shape[0] * state["k"])
        chosen.append(places[:, 1].view(-1, state["k"]).add_(state["full_starts"]).view(-1))
    if state["tails"]:  # partial chunks, padded to a row: each keeps its own count
        rows = torch.cat([part for i, pad in zip(state["tails"], state["pads"])
                          for part in (pieces[i], pad)],
                         out=scratch(state, "tail_rows", state["tail_size"], p))
        rows = rows.view(-1, state["chunk"])
        counts = state["tail_counts"]  # (rows, 1)
        threshold = torch.topk(rows, state["tail_k"], dim=1).values.gather(1, counts - 1)
        places = _first_largest(rows, threshold, counts, state["tail_total"])
        chosen.append(state["tail_starts"].view(-1).index_select(0, places[:, 0])
                      .add_(places[:, 1]))
    chosen.append(state["whole"])  # tensors of one dimension: every entry
    indices = torch.cat(chosen) if len(chosen) > 1 else chosen[0]
    values = p.index_select(0, indices)
    segment, counts = state["segments"], state["counts"]
    wide = values.double()  # sequential sums in fp32 would stray from thinwire's further
    mean = torch.zeros_like(counts).index_add_(0, segment, wide).div_(counts).float()
    centred = values - mean.index_select(0, segment)
    wide = centred.double()
    std = torch.zeros_like(counts).index_add_(0, segment, wide.mul_(wide)).sqrt_().float()
    scale = RANGE * std.div_(state["dof"]) / BINS
    scale = torch.where((scale > 0) & torch.isfinite(scale), scale, 1.0)
    codes = torch.round(centred / scale.index_select(0, segment) + BINS // 2).clamp_(0, BINS - 1)
    bins = segment * BINS + codes.long()
    sums = torch.zeros(counts.numel() * BINS, dtype=torch.float64).index_add_(
        0, bins, values.double()).float()
    table = sums / torch.zeros_like(sums).index_add_(0, bins, torch.ones_like(values)).clamp_(
        min=1)
    sent = table.index_select(0, bins)
    error.index_copy_(0, indices, values.sub_(sent))
    return bucket.zero_().index_copy_(0, indices, sent)


FLOORS: dict[str, Floor] = {
    "fp16": fp16, "topk": topk, "dct-dp": dct_dp, "laplace": laplace,
    # at a world of one, ScaleCom's leader is this rank: its own top-k, as topk's
    "local-topk": topk, "clt-k": topk,
    "powersgd": powersgd, "sparseloco": sparseloco}
_BUCKET = {"scope": ("bucket",), "min_numel": (0,), "exclude": ((),), "nonfinite": ("raise",)}
_SCALECOM = {**_BUCKET, "k": (None,), "selection": ("exact",), "beta": (1.0,),
             "warmup_steps": (0,)}
# Of each scheme's options, the values its floor does the same work under; an option
# not listed may take any value (it changes how the payload is laid out, not what is
# decoded). A scheme spelled outside these has no floor.
SUPPORTED: dict[str, dict[str, tuple[Any, ...]]] = {
    "fp16": {"nonfinite": ("raise",)},
    "topk": {"values": ("native", "fp32", "int8"), "error_feedback": (True,), **_BUCKET},
    "dct-dp": {"values": ("native", "fp32", "int8"), "refresh_above": (None,),
               "drain_every": (None,), **_BUCKET},
    "laplace": {"values": ("native", "fp32", "int8"), **_BUCKET},
    "local-topk": {"values": ("native", "fp32", "int8"), **_SCALECOM},
    "clt-k": {"values": ("native", "fp32"), **_SCALECOM},
    "powersgd": {"warmup_steps": (0,), "warm_start": (True,), "error_feedback": (True,),
                 "nonfinite": ("raise",)},
    "sparseloco": {"aggregate": ("senders", "ranks"), "nonfinite": ("raise",)},
}


def floor_of(name: str, config: Any, infos: Sequence[TensorInfo]
             ) -> tuple[Floor, dict[str, Any]] | None:
    """The floor of scheme ``name`` built with ``config`` (its config dataclass) for a
    bucket of ``infos``' tensors laid back to back, and its state; None where the scheme,
    or one of its options, has none. ``infos`` fixes PowerSGD's matrices and their first
    Qs, and SparseLoCo's chunks and segments; the state is built here, untimed."""
    rules = SUPPORTED.get(name)
    if rules is None or any(getattr(config, key) not in allowed
                            for key, allowed in rules.items()):
        return None
    state = {key: getattr(config, key) for key in
             ("ratio", "values", "life_span", "gain", "capacity", "rank", "beta", "chunk", "k")
             if hasattr(config, key)}
    if name == "powersgd":
        state.update(_matrices(infos, config.rank, config.seed))
    elif name == "sparseloco":
        state.update(_chunks(infos, config.chunk, config.k))
    return FLOORS[name], state


def _matrices(infos: Sequence[TensorInfo], rank: int, seed: int) -> dict[str, Any]:
    """PowerSGD's matrices in the bucket and their first Qs, drawn as thinwire draws them."""
    matrices, qs, start = [], {}, 0
    for info in infos:
        if compressible(info.shape, rank):
            rows = info.shape[0]
            cols = info.numel // rows
            matrices.append((start, rows, cols, info.key))
            qs[info.key] = seeded_normal(info.key, (cols, rank), seed=seed,
                                         dtype=info.dtype).t().contiguous().t()
        start += info.numel
    return {"matrices": matrices, "qs": qs}


def _chunks(infos: Sequence[TensorInfo], chunk: int, k: int) -> dict[str, Any]:
    """SparseLoCo's layout of the bucket: the pieces it splits into (each matrix's whole
    chunks, its partial chunk, each vector), the whole chunks' and partial chunks' starts,
    the count kept of each partial chunk (a mask over the largest of each), the vectors'
    positions, and per value sent (whole chunks', partial chunks', vectors', in that
    order) its tensor, with each tensor's count and ``sqrt(max(count - 1, 1))``."""
    pieces: list[int] = []
    full: list[int] = []
    tails: list[int] = []
    pads, full_starts, tail_starts, tail_counts, whole = [], [], [], [], []
    full_segments, tail_segments, whole_segments, counts = [], [], [], []
    start = 0
    for info in infos:
        segment = len(counts)
        if len(info.shape) <= 1:
            pieces.append(info.numel)
            whole.append(torch.arange(start, start + info.numel))
            whole_segments += [segment] * info.numel
            counts.append(info.numel)
            start += info.numel
            continue
        chunks, rest = divmod(info.numel, chunk)
        count = 0
        if chunks:
            full.append(len(pieces))
            pieces.append(chunks * chunk)
            full_starts += range(start, start + chunks * chunk, chunk)
            full_segments += [segment] * (chunks * k)
        if rest:
            count = min(rest, math.ceil(k * rest / chunk))
            tails.append(len(pieces))
            pieces.append(rest)
            pads.append(torch.full((chunk - rest,), -1.0, dtype=info.dtype))
            tail_starts.append(start + chunks * chunk)
            tail_counts.append(count)
            tail_segments += [segment] * count
        counts.append(chunks * k + count)
        start += info.numel
    tail_k = max(tail_counts, default=0)
    full_size = sum(pieces[i] for i in full)
    sizes = torch.tensor(counts, dtype=torch.float32)
    return {"pieces": pieces, "full": full, "tails": tails, "pads": pads,
            "full_starts": torch.tensor(full_starts, dtype=torch.int64).view(-1, 1),
            "tail_starts": torch.tensor(tail_starts, dtype=torch.int64).view(-1, 1),
            "tail_k": tail_k, "full_size": full_size, "tail_size": len(tails) * chunk,
            "tail_counts": torch.tensor(tail_counts, dtype=torch.int64).view(-1, 1),
            "tail_total": sum(tail_counts),
            "whole": torch.cat(whole) if whole else torch.zeros(0, dtype=torch.int64),
            "segments": torch.tensor(full_segments + tail_segments + whole_segments,
                                     dtype=torch.int64),
            "counts": sizes.double(), "dof": (sizes - 1).clamp_(min=1).sqrt_()}


def _opened(bucket: torch.Tensor, error: torch.Tensor,
            state: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``p = e + g`` (in ``error``), ``|p|`` (in a kept buffer) and ``k``, the entries to keep."""
    p = error.add_(bucket)
    return p, kept(state, "magnitudes", p, torch.abs), keep_count(p.numel(), state["ratio"])


def _above(p: torch.Tensor, magnitudes: torch.Tensor, tau: float, k: int,
           state: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """The positions with ``|p| >= tau`` (``> 0`` where ``tau`` is 0), the largest
    ``room = ceil(capacity k)`` of them where more pass, ascending; and the density
    control's factor for the threshold (1 without ``gain``)."""
    indices = (magnitudes >= tau if tau > 0 else magnitudes > 0).nonzero().view(-1)
    passed = indices.numel()
    room = min(p.numel(), math.ceil(state["capacity"] * k - 1e-9))
    if passed > room:  # the largest go now, in ascending order; the rest wait in memory
        top = torch.topk(magnitudes.index_select(0, indices), room, sorted=False).indices
        indices = indices.index_select(0, top.sort().values)
    if state["gain"] is None or tau <= 0:
        return indices, 1.0
    return indices, correction(state["gain"], magnitudes, passed, k, room)


def _sent(bucket: torch.Tensor, error: torch.Tensor, p: torch.Tensor, indices: torch.Tensor,
          state: dict[str, Any]) -> torch.Tensor:
    """``p`` at ``indices`` sent as is or as int8 codes, taken out of ``error``; ``bucket``
    overwritten with the mean (the sent values there, 0 elsewhere)."""
    taken = p.index_select(0, indices)
    sent = int8(taken) if state["values"] == "int8" else taken
    error.index_add_(0, indices, sent, alpha=-1)
    return bucket.zero_().index_copy_(0, indices, sent)
