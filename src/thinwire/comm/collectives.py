"""Moving bytes over torch.distributed, metered. Single-process use is a no-op.

Multi-round exchanges perform their early rounds in the caller's thread and
return a future for the last round only. Callbacks never launch or wait on
collectives: a collective issued from a callback can be ordered differently on
different ranks, and waiting inside one is how torch 2.13's ``powerSGD_hook``
deadlocks on gloo.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from thinwire.comm._metered import record_segments
from thinwire.comm.meter import Meter

Group = dist.ProcessGroup | None
Future = torch.futures.Future
T = TypeVar("T")
# One tensor gathered into one tensor: torch 2.13 renamed all_gather_into_tensor, whose old
# name (deprecated there) serves the earlier releases that GPU images often carry.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Alone:
    """This process as a group of its own, whatever process group exists: nothing is
    exchanged, and the meter still sees what a rank would hand over (simulated replicas,
    :class:`thinwire.jobs.dct_mp.SimulatedReplicas`)."""


ALONE: Any = Alone()


def world(group: Group = None) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) when not distributed or :data:`ALONE`."""
    if isinstance(group, Alone) or not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def done(value: object) -> Future[Any]:
    """A future that already holds ``value``."""
    future: Future[Any] = Future()
    future.set_result(value)
    return future


def device_future(devices: Iterable[torch.device]) -> Future[Any]:
    """An empty future that orders the CUDA work behind its value before its consumers.

    A future that names its CUDA devices records an event on their current streams
    when its result is set, and whoever waits on it, or runs a callback after it,
    waits for that event first; one that names none hands a CUDA result over while
    the kernels that write it may still be running.
    """
    cuda: list[int | str | torch.device] = sorted({d for d in devices if d.type == "cuda"},
                                                  key=str)
    return Future(devices=cuda) if cuda else Future()


def then_hold(future: Future[Any], value: Callable[[], T]) -> Future[T]:
    """A future of ``value()`` once ``future`` is done, or of ``future``'s error if it failed.

    A callback that ignores its future (``future.then(lambda _: buffer)``) swallows
    the error: a collective cut short by a lost peer would hand its half-filled
    buffer on as a result.
    """
    def hold(arrived: Future[Any]) -> T:
        arrived.value()  # raises the collective's error
        return value()

    return future.then(hold)


def collect(futures: Sequence[Future[Any]], devices: Iterable[torch.device]) -> Future[Any]:
    """``torch.futures.collect_all(futures)``, with its result ordered on ``devices``.

    ``collect_all``'s own future names no device, so CUDA kernels run after it would
    race both the collectives before it (gloo copies a CUDA result back on a stream
    of its own, NCCL writes on its stream) and the reader of the result. Here the
    streams that set the result first wait for every future (and for the work the
    caller queued before this call), and the result names ``devices``.

    Returns:
        A future of the list of ``futures``, completed when all are.
    """
    devices = list(devices)
    result = device_future(devices)
    queued = []  # what the caller queued so far: a done() future carries no event
    for device in {d for d in devices if d.type == "cuda"}:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        queued.append((device, event))

    def finish(everything: Future[list[Future[Any]]]) -> None:
        try:
            for future in everything.value():
                future.wait()  # complete already: waits only for its CUDA events
            for device, event in queued:
                event.wait(torch.cuda.current_stream(device))
            result.set_result(everything.value())
        except Exception as error:  # noqa: BLE001  (handed to whoever waits on it)
            result.set_exception(error)

    torch.futures.collect_all(list(futures)).add_done_callback(finish)
    return result


def all_reduce_mean(flat: torch.Tensor, group: Group = None) -> Future[Any]:
    """Average ``flat`` across ranks (modified in place); the future holds it.

    Divides before summing, as DDP's own all-reduce hook does.
    """
    _, n = world(group)
    if n == 1:
        return done(flat)
    flat.div_(n)
    work = dist.all_reduce(flat, group=group, async_op=True)
    assert work is not None
    result: Future[Any] = work.get_future().then(lambda f: f.value()[0])
    return result


def all_gather_bytes(payload: torch.Tensor, group: Group = None,
                     meter: Meter | None = None,
                     segments: Sequence[tuple[str, int]] = (),
                     entity: str = "W_grad") -> Future[Any]:
    """All-gather uint8 buffers whose lengths differ per rank.

    Round 1 (blocking, in this thread) all-gathers each rank's length as an
    int64; round 2 exchanges the buffers padded to the longest
    (:func:`all_gather_fixed`). The meter
    sees both rounds: each ``(layer, nbytes)`` of ``segments`` (the parts of
    ``payload``), the padding as layer ``"(padding)"`` and the lengths as
    entity ``"size"``.

    Returns:
        A future holding the list of each rank's unpadded buffer.
    """
    rank, n = world(group)
    device = payload.device  # NCCL needs every buffer on the GPU
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    if n == 1:
        return done([payload])
    lengths = torch.empty(n, dtype=torch.int64, device=device)
    all_gather_single(lengths, length, group=group)
    longest = int(lengths.max())
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    if meter is not None:
        meter.record("size", "(lengths)", "all_gather", length.numel() * 8, world_size=n)
        record_segments(meter, entity, "all_gather", [*segments, ("(padding)", longest -
                                                                   payload.numel())], n)
    sizes = lengths.tolist()
    rows = all_gather_fixed(padded, group)  # unmetered: recorded above
    unpadded: Future[Any] = rows.then(
        lambda f: [row[:size] for row, size in zip(f.value(), sizes)])
    return unpadded


def all_gather_fixed(payload: torch.Tensor, group: Group = None, meter: Meter | None = None,
                     segments: Sequence[tuple[str, int]] = (),
                     entity: str = "W_grad") -> Future[Any]:
    """All-gather uint8 buffers of the same length on every rank, in one round.

    For payloads of a fixed capacity (:class:`thinwire.compress.SparseLayout`)
    there is no round of lengths first: nothing blocks the caller. Two gloo
    ranks exchange payloads of :data:`PAIR_MIN_BYTES` or more by one broadcast
    each, on groups of their own (:func:`_pair_groups`): the same bytes,
    without the wait gloo's two-rank all-gather puts on the rank that arrives
    second.

    Args:
        segments: ``(layer, nbytes)`` parts of ``payload`` recorded by the meter;
            they should add up to its length (padding included).

    Returns:
        A future holding the list of each rank's buffer, in rank order
        (this rank's is ``payload`` itself).
    """
    rank, n = world(group)
    if n > 1 or isinstance(group, Alone):
        record_segments(meter, entity, "all_gather", segments, n)
    if n == 1:
        return done([payload])
    roots = _pair_groups(group) if n == 2 and payload.numel() >= PAIR_MIN_BYTES else None
    if roots is not None:  # the same bytes each way, one broadcast per rank
        rows = [payload if r == rank else torch.empty_like(payload) for r in range(2)]
        futures = []
        for r, (row, side) in enumerate(zip(rows, roots)):
            work = dist.broadcast(row, group=side, async_op=True, group_src=r)
            assert work is not None
            futures.append(work.get_future())
        return then_hold(collect(futures, [payload.device]), lambda: rows)
    gathered = torch.empty(n * payload.numel(), dtype=torch.uint8, device=payload.device)
    work = all_gather_single(gathered, payload, group=group, async_op=True)
    assert work is not None
    return then_hold(work.get_future(), lambda: list(gathered.view(n, -1)))


# Below this many bytes per rank two ranks all-gather: the later rank's wait is then under
# 3 ms at 100 Mbit/s, less than two collectives and their groups' threads cost on busy
# cores (whole steps with 8.5 and 42.6 kB payloads were slower with the broadcasts).
PAIR_MIN_BYTES = 1 << 16
# group -> weak references to its two pair groups. Only torch's registry holds the pair
# groups, so destroy_process_group frees them with the rest: a gloo group freed later, as
# the interpreter exits, can abort the process.
_PAIRS: weakref.WeakKeyDictionary[dist.ProcessGroup, tuple[weakref.ref[dist.ProcessGroup], ...]] \
    = weakref.WeakKeyDictionary()
_PAIRS_LOCK = threading.Lock()


def _pair_groups(group: Group) -> list[dist.ProcessGroup] | None:
    """Two more gloo groups of ``group``'s two ranks, one per root; None off gloo.

    gloo's all-gather sends a rank's data as soon as its peer can receive,
    then posts its own receive. Between two ranks both go over one TCP
    connection, so the rank that arrives second has its notice queued behind
    its own payload and receives late; the roles then persist from step to
    step (``benchmarks.netem.skew``, ``docs/data/netem-gather-skew.json``: at
    100 Mbit/s, with one rank 13 ms late, a 261 kB all-gather took the later
    rank 31.6 ms where the bytes need 21.8). A broadcast from each rank, each on
    a group of its own, has its own connections, so each carries data one way
    only and nothing queues behind it: 26.3 ms. With more ranks gloo's
    broadcast is a tree that forwards what it receives, slower than the ring
    all-gather, which is kept there.

    Created on first use, in the order the exchanges run (every rank of
    ``group`` makes the same calls), and again after the groups were destroyed.
    """
    parent = group if group is not None else dist.group.WORLD
    if parent is None or dist.get_backend(parent) != "gloo":
        return None
    with _PAIRS_LOCK:
        pair = [side for side in (ref() for ref in _PAIRS.get(parent, ())) if side is not None]
        if len(pair) != 2:
            ranks = dist.get_process_group_ranks(parent)
            pair = [dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
                    for _ in range(2)]
            _PAIRS[parent] = tuple(weakref.ref(side) for side in pair)
    return pair


def split_flat(flat: torch.Tensor, numels: Sequence[int]) -> list[torch.Tensor]:
    """Views of consecutive segments of ``flat``."""
    return list(torch.split(flat, list(numels)))
