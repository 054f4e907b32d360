"""The watch on a quorum's peers (thinwire.elastic.watch): a silent peer or store cuts the group,
a beating one never does, and a cut wakes what waits on the group's connections."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

pytest.importorskip("torchft")

from thinwire.elastic.watch import (  # noqa: E402
    FIRST_BEAT_SILENCES,
    PeerWatch,
    open_sockets,
    shut_sockets,
)

SILENCE_S = 0.5
WAIT_S = 60.0  # the longest any wait here may take before the test fails (a hang guard)


@pytest.fixture
def group() -> Iterator[dist.ProcessGroup]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        assert dist.group.WORLD is not None
        yield dist.group.WORLD
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _Cuts:
    def __init__(self) -> None:
        self.why: list[str] = []
        self.event = threading.Event()

    def __call__(self, why: str) -> None:
        self.why.append(why)
        self.event.set()


def _watch(group: dist.ProcessGroup, store: Any, cuts: _Cuts, world_size: int = 3) -> PeerWatch:
    return PeerWatch(group, store, 0, world_size, SILENCE_S, cuts)


def test_a_silent_peer_cuts_the_group_once_naming_it(group: dist.ProcessGroup) -> None:
    store, cuts = dist.HashStore(), _Cuts()  # type: ignore[attr-defined]
    stop = threading.Event()

    def beating() -> None:  # rank 1 beats, rank 2 never does
        while not stop.wait(SILENCE_S / 10):
            store.add("thinwire/beat/1", 1)

    beat = threading.Thread(target=beating, daemon=True)
    beat.start()
    watch = _watch(group, store, cuts)
    try:
        assert cuts.event.wait(WAIT_S)
        time.sleep(3 * SILENCE_S)  # no second cut
        assert len(cuts.why) == 1 and "rank 2" in cuts.why[0] and watch.silent == cuts.why[0]
        assert store.add("thinwire/beat/0", 0) > 0  # it beat, itself
    finally:
        stop.set()
        watch.stop()


def test_a_peer_gets_longer_for_its_first_beat(group: dist.ProcessGroup) -> None:
    """Each worker's side of the group forms at its own moment: a peer that has not beaten
    yet is cut after FIRST_BEAT_SILENCES silences, not one."""
    store, cuts = dist.HashStore(), _Cuts()  # type: ignore[attr-defined]
    started = time.monotonic()
    watch = _watch(group, store, cuts, world_size=2)
    try:
        assert cuts.event.wait(WAIT_S)
        assert time.monotonic() - started > FIRST_BEAT_SILENCES * SILENCE_S
        assert f"more than {FIRST_BEAT_SILENCES * SILENCE_S:g} s" in cuts.why[0]
    finally:
        watch.stop()


def test_beating_peers_are_never_cut(group: dist.ProcessGroup) -> None:
    store, cuts = dist.HashStore(), _Cuts()  # type: ignore[attr-defined]
    stop = threading.Event()

    def beating() -> None:
        while not stop.wait(SILENCE_S / 10):
            for rank in (1, 2):
                store.add(f"thinwire/beat/{rank}", 1)

    beat = threading.Thread(target=beating, daemon=True)
    beat.start()
    watch = _watch(group, store, cuts)
    try:
        assert not cuts.event.wait(6 * SILENCE_S)
    finally:
        stop.set()
        watch.stop()
    assert watch.silent is None


class _Gone:
    """A store whose host is stalled: every wait on it times out."""

    def add(self, key: str, value: int) -> int:
        raise RuntimeError("Socket Timeout")


def test_a_store_that_does_not_answer_cuts_the_group(group: dist.ProcessGroup) -> None:
    cuts = _Cuts()
    watch = _watch(group, _Gone(), cuts)
    assert cuts.event.wait(WAIT_S)
    watch.stop()
    assert "store did not answer" in cuts.why[0] and "Socket Timeout" in cuts.why[0]


@pytest.mark.parametrize("end", ["stopped", "group ended"])
def test_a_watch_that_ended_cuts_nothing(end: str, group: dist.ProcessGroup) -> None:
    store, cuts = dist.HashStore(), _Cuts()  # type: ignore[attr-defined]
    watch = _watch(group, store, cuts)  # its peers never beat: it would cut after SILENCE_S
    if end == "stopped":
        watch.stop()
    else:
        dist.destroy_process_group()
    assert not cuts.event.wait(4 * SILENCE_S)
    watch.stop()


def test_bad_silence_is_refused_by_name(group: dist.ProcessGroup) -> None:
    with pytest.raises(ValueError, match="silence_s=0"):
        PeerWatch(group, dist.HashStore(), 0, 2, 0, _Cuts())  # type: ignore[attr-defined]


def test_shut_sockets_wakes_a_blocked_reader_and_leaves_listeners() -> None:
    before = open_sockets()
    listener = socket.create_server(("127.0.0.1", 0))
    ours, theirs = socket.socketpair()
    opened = open_sockets() - before
    assert len(opened) == 3
    read: list[bytes] = []
    reader = threading.Thread(target=lambda: read.append(ours.recv(1)), daemon=True)
    reader.start()
    try:
        assert shut_sockets(opened) == 2  # the pair's two ends; the listener is left open
        reader.join(WAIT_S)
        assert read == [b""]  # woken: its connection ended
        listener.settimeout(0.01)
        with pytest.raises(TimeoutError):
            listener.accept()  # still listening
    finally:
        for item in (listener, ours, theirs):
            item.close()
