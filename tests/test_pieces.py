"""DCT-DP in pieces: the cut, the two ways to compute it, and error feedback kept exact."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from thinwire import schemes
from thinwire.compress import TensorInfo
from thinwire.compress.pieces import TRIALS, cut, pay
from thinwire.feedback import MomentumCorrection
from thinwire.schemes import CompressedScheme, streaming
from thinwire.schemes.streaming import Streaming

SHAPES = {"w": (40, 30), "v": (900,), "b": (30,)}  # b travels dense (min_numel)


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Yields the number of piece-wise launches so far."""
    calls = [0]
    launch = Streaming.launch

    def counted(self: Streaming, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(Streaming, "launch", counted)
    yield calls


def _grads(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    grads = {key: torch.randn(shape, generator=generator) for key, shape in SHAPES.items()}
    grads["v"][:300] *= 8  # the first third is hot: its parts pass more than their share
    return grads


def _scheme(momentum: bool = False, **config: Any) -> CompressedScheme:
    scheme = schemes.build("dct-dp", **{"ratio": 0.05, "life_span": 3, "min_numel": 100,
                                        "piece": 100, "stream": "always", **config})
    assert isinstance(scheme, CompressedScheme) and scheme.memory is not None
    if momentum:
        scheme.memory = MomentumCorrection(scheme.memory, 0.9)
    return scheme


def _run(scheme: CompressedScheme, steps: int = 7) -> list[dict[str, torch.Tensor]]:
    return [scheme.reduce(_grads(step)) for step in range(steps)]


def test_cut_covers_every_tensor_once_and_shares_each_room_exactly() -> None:
    infos = [TensorInfo("a", (1000,)), TensorInfo("e", (0,)), TensorInfo("b", (30,)),
             TensorInfo("c", (250,))]
    rooms = [13, 0, 2, 7]
    pieces = cut(infos, rooms, entries=300)
    parts = [part for piece in pieces for part in piece]
    for info, room in zip(infos, rooms):
        mine = [part for part in parts if part.info is info]
        assert [(p.start, p.stop) for p in mine] == list(zip(
            [0, *[p.stop for p in mine[:-1]]], [p.stop for p in mine])) or not info.numel
        assert sum(p.stop - p.start for p in mine) == info.numel
        assert sum(p.room for p in mine) == room
        assert all(0 <= p.room <= p.stop - p.start for p in mine)
    assert [sum(p.stop - p.start for p in piece) for piece in pieces] == [333, 333, 334, 280]
    with pytest.raises(ValueError, match="entries=0"):
        cut(infos, rooms, entries=0)
    with pytest.raises(ValueError, match="3 rooms for 4 tensors"):
        cut(infos, rooms[:3])


@pytest.mark.parametrize("config,pieces", [
    ({}, 2),  # 1,200 + 900 sparse entries: at least two pieces of 1,000
    ({"piece": 1100}, 0),  # not two pieces' worth: one payload
    ({"scope": "bucket"}, 0),  # one threshold over the bucket needs all of it first
    ({"refresh_above": 2.0}, 0),  # the guard re-selects a whole tensor at once
])
def test_which_buckets_go_in_pieces(config: dict[str, Any], pieces: int) -> None:
    scheme = _scheme(**{"piece": 1000, **config})
    grads = _grads(0)
    infos = [TensorInfo.of(key, grads[key]) for key in ("w", "v")]
    assert scheme.pieces is not None  # dct-dp's threshold streams
    cuts = scheme.pieces.cuts(torch.zeros(2100), infos)
    assert (len(scheme.pieces.cut(infos)) if cuts else 0) == pieces
    assert all(other.pieces is None for other in (schemes.build("topk"),
                                                  schemes.build("laplace")))
    with pytest.raises(ValueError, match="piece=-1"):
        schemes.build("dct-dp", piece=-1)


@pytest.mark.parametrize("momentum", [False, True])
def test_streamed_pieces_equal_the_tensors_absorbed_whole_first(
        small_pieces: list[int], momentum: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reuse calls stream part by part; refresh calls absorb whole first: same bits."""
    streamed = _run(_scheme(momentum))
    assert small_pieces[0] == 7
    monkeypatch.setattr(Streaming, "streams", lambda *_: False)
    whole = _run(_scheme(momentum))
    for a, b in zip(streamed, whole):
        for key in a:
            assert torch.equal(a[key], b[key])


def test_pieces_keep_error_feedback_exact_and_each_part_within_its_room(
        small_pieces: list[int]) -> None:
    """grad + old_error == sent + new_error bit for bit, with parts passing beyond their room."""
    scheme = _scheme(capacity=1.0)
    memory = scheme.memory
    assert memory is not None
    cut_somewhere = False
    for step in range(7):
        grads = _grads(step)
        old = {key: memory.buffers.get(key, torch.zeros(g.numel())).clone()
               for key, g in grads.items()}
        taus = dict(scheme.selection.tau)  # type: ignore[attr-defined]
        sent = scheme.reduce(grads)
        for key, grad in grads.items():
            new = memory.buffers.get(key, torch.zeros(grad.numel()))
            assert torch.equal(grad.reshape(-1) + old[key], sent[key].reshape(-1) + new)
        infos = [TensorInfo.of(key, grads[key]) for key in ("w", "v")]
        rooms = [scheme.selection.capacity(info.numel) for info in infos]
        for piece in cut(infos, rooms, entries=100):
            for part in piece:
                flat = sent[part.info.key].reshape(-1)[part.start: part.stop]
                assert int(flat.count_nonzero()) <= part.room
                if part.info.key in taus:  # a reused tau: how many passed it
                    p = grads[part.info.key].reshape(-1) + old[part.info.key]
                    passing = int((p[part.start: part.stop].abs() >= taus[part.info.key]).sum())
                    cut_somewhere |= passing > part.room
    assert small_pieces[0] == 7 and cut_somewhere


def test_pieces_with_room_for_every_entry_equal_one_payload(small_pieces: list[int]) -> None:
    """No part can pass more than its room: what goes, the thresholds and the traces are
    those of the one-payload path."""
    pieced = _scheme(momentum=True, capacity=20.0)
    outputs = _run(pieced)
    assert small_pieces[0] == 7
    whole = _scheme(momentum=True, capacity=20.0, piece=0)
    for a, b in zip(outputs, _run(whole)):
        for key in a:
            assert torch.equal(a[key], b[key])
    assert small_pieces[0] == 7  # the second run went as one payload
    assert pieced.selection.state_dict() == whole.selection.state_dict()
    assert pieced.selection.trace == whole.selection.trace


def test_checkpoint_resume_in_pieces_is_bit_identical(small_pieces: list[int]) -> None:
    straight = _run(_scheme(momentum=True))
    first = _scheme(momentum=True)
    for step in range(4):
        first.reduce(_grads(step))
    resumed = _scheme(momentum=True)
    resumed.load_state_dict(first.state_dict())
    for step in range(4, 7):
        got = resumed.reduce(_grads(step))
        for key in got:
            assert torch.equal(got[key], straight[step][key])


def test_a_non_finite_round_in_pieces_changes_nothing(small_pieces: list[int]) -> None:
    scheme = _scheme(nonfinite="skip")
    scheme.reduce(_grads(0))
    before = scheme.state_dict()
    bad = _grads(1)
    bad["v"][5] = float("inf")
    out = scheme.reduce(bad)
    assert scheme.skipped == 1 and not any(t.count_nonzero() for t in out.values())
    after = scheme.state_dict()
    assert after["selection"] == before["selection"]
    for key, buffer in before["memory"]["buffers"].items():
        assert torch.equal(after["memory"]["buffers"][key], buffer)


def test_pieces_pay_where_the_exchange_takes_half_the_codec_or_more() -> None:
    assert pay(0.022, 0.016) and pay(0.008, 0.016)  # 100 Mbit/s; the line
    assert not pay(0.0025, 0.016)  # 1 Gbit/s
    assert not pay(math.inf, 0.0)  # nothing timed anywhere
    with pytest.raises(ValueError, match="stream='never'"):
        schemes.build("dct-dp", stream="never")


def test_auto_stream_times_one_payload_then_keeps_the_choice(
        small_pieces: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[float, float]] = []

    def always(wire_s: float, codec_s: float) -> bool:
        asked.append((wire_s, codec_s))
        return True

    monkeypatch.setattr(streaming, "pay", always)
    scheme = _scheme(stream="auto")
    _run(scheme, TRIALS + 4)
    assert small_pieces[0] == 3  # one payload for TRIALS + 1 rounds, then pieces
    [(wire, codec)] = asked  # decided once, from timed rounds
    assert 0.0 <= wire < math.inf and 0.0 < codec
    resumed = _scheme(stream="auto")
    resumed.load_state_dict(scheme.state_dict())
    _run(resumed, 2)
    assert small_pieces[0] == 5 and len(asked) == 1  # the checkpoint keeps the choice


def test_auto_stream_that_finds_no_gain_trains_as_one_payload(
        small_pieces: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streaming, "pay", lambda wire_s, codec_s: False)
    auto, whole = _scheme(momentum=True, stream="auto"), _scheme(momentum=True, piece=0)
    for a, b in zip(_run(auto, 10), _run(whole, 10)):
        assert all(torch.equal(a[key], b[key]) for key in SHAPES)
    assert small_pieces[0] == 0
    assert auto.state_dict()["streaming"] == [[["w", "v"], False]]
    assert auto.pieces is not None and not auto.pieces.trials  # nothing more is timed
