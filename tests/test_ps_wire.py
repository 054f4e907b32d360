"""Pushes on the wire: exact bytes, exact decoding, worker-side error feedback, bad bytes."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from thinwire.comm import Meter
from thinwire.feedback import Residual
from thinwire.ps import Layout, MalformedPush, PushCodec

LAYOUT = Layout(("conv.weight", "conv.bias", "fc.weight"), ((4, 1, 3, 3), (5,), (10, 40)))


def _grad(seed: int = 0) -> torch.Tensor:
    return torch.randn(LAYOUT.numel, generator=torch.Generator().manual_seed(seed))


def _bytes(meter: Meter, collective: str) -> int:
    return sum(r.nbytes for r in meter.records if r.collective == collective)


SCHEMES = [("dense", {}), ("fp16", {}), ("topk", {"ratio": 0.1}),
           ("dct-dp", {"ratio": 0.1, "life_span": 3, "min_numel": 10}),
           ("dct-dp", {"ratio": 0.01, "values": "fp16"}), ("laplace", {"ratio": 0.2}),
           ("sparseloco", {"chunk": 64, "k": 4})]


@pytest.mark.parametrize("scheme,options", SCHEMES)
def test_server_decodes_exactly_what_the_worker_sent(scheme: str,
                                                     options: dict[str, object]) -> None:
    worker, server = PushCodec(LAYOUT, scheme, **options), PushCodec(LAYOUT, scheme, **options)
    sent_meter, received_meter = Meter(), Meter()
    handed = 0
    for seed in range(4):
        encoded = worker.encode(_grad(seed), sent_meter)
        handed += encoded.data.nbytes
        decoded = server.decode(encoded.data, encoded.dense, received_meter)
        assert decoded.dtype == torch.float32 and torch.equal(decoded, encoded.sent)
    # The Meter holds exactly the bytes handed to RPC, on both sides.
    assert _bytes(sent_meter, "send") == _bytes(received_meter, "recv") == handed


def test_dense_push_is_its_step_then_the_gradient() -> None:
    codec, meter = PushCodec(LAYOUT), Meter()
    grad = _grad()
    encoded = codec.encode(grad, meter)
    assert not encoded.dense and encoded.data.numel() == 4 + 4 * LAYOUT.numel
    assert torch.equal(encoded.data[4:].view(torch.float32), grad)
    assert torch.equal(encoded.sent, grad)
    assert {r.layer: r.nbytes for r in meter.records} == {
        "(step)": 4, "conv.weight": 144, "conv.bias": 20, "fc.weight": 1600}


def test_fp16_odd_tensor_is_padded_and_the_padding_metered() -> None:
    codec, meter = PushCodec(LAYOUT, "fp16"), Meter()
    encoded = codec.encode(_grad(), meter)
    # the step, then 36 and 5 halves (72 + 10 bytes, the latter padded to 12), 400 halves.
    assert encoded.data.numel() == 4 + 72 + 12 + 800
    assert {r.layer: r.nbytes for r in meter.records} == {
        "(step)": 4, "conv.weight": 72, "conv.bias": 10, "fc.weight": 800, "(padding)": 2}
    assert torch.equal(PushCodec(LAYOUT, "fp16").decode(encoded.data, False),
                       _grad().half().float())


def test_error_feedback_keeps_what_the_payload_left_out() -> None:
    codec = PushCodec(LAYOUT, "dct-dp", ratio=0.1, life_span=2, min_numel=0)
    grad = _grad()
    encoded = codec.encode(grad)
    assert codec.memory is not None
    residual = torch.cat([codec.memory.buffers[name].reshape(-1) for name in LAYOUT.names])
    assert torch.equal(encoded.sent + residual, grad)  # sparse: each entry sent or kept
    assert 0 < int((encoded.sent != 0).sum()) < grad.numel() // 5
    second = _grad(1)
    encoded2 = codec.encode(second)
    residual2 = torch.cat([codec.memory.buffers[name].reshape(-1) for name in LAYOUT.names])
    assert torch.equal(encoded2.sent + residual2, second + residual)


def test_nonfinite_gradient_is_pushed_raw_and_leaves_state_untouched() -> None:
    codec = PushCodec(LAYOUT, "dct-dp", ratio=0.1, life_span=5)
    codec.encode(_grad())
    state = codec.state_dict()
    poisoned = _grad(1)
    poisoned[7] = float("nan")
    encoded = codec.encode(poisoned)
    assert encoded.dense and codec.nonfinite == 1
    after, state = codec.state_dict()["scheme"], state["scheme"]
    assert after["selection"]["tau"] == state["selection"]["tau"]
    assert after["selection"]["calls"] == state["selection"]["calls"]
    for name in LAYOUT.names:
        assert torch.equal(after["memory"]["buffers"][name], state["memory"]["buffers"][name])


def _sparse_wire() -> torch.Tensor:
    return PushCodec(LAYOUT, "topk", ratio=0.01, min_numel=0, indices="int32").encode(
        _grad()).data


@pytest.mark.parametrize("damage", ["truncate", "extend", "step", "header", "index", "dtype"])
def test_malformed_pushes_are_refused(damage: str) -> None:
    server = PushCodec(LAYOUT, "topk", ratio=0.01, min_numel=0, indices="int32")
    data = _sparse_wire().clone()  # the step, the entry count, the indices, the values
    if damage == "truncate":
        data = data[:-4]
    elif damage == "extend":
        data = torch.cat([data, torch.zeros(4, dtype=torch.uint8)])
    elif damage == "step":
        data[:4] = torch.tensor([-1], dtype=torch.int32).view(torch.uint8)
    elif damage == "header":
        data[4:8] = torch.tensor([1 << 20], dtype=torch.int32).view(torch.uint8)
    elif damage == "index":
        data[8:12] = torch.tensor([10_000], dtype=torch.int32).view(torch.uint8)
    else:
        data = data.float()
    with pytest.raises(MalformedPush):
        server.decode(data, False)
    with pytest.raises(MalformedPush, match="flat torch.float32 tensor of 441 entries"):
        server.decode(torch.zeros(3), True)


def test_unknown_push_scheme_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown scheme 'gzip'"):
        PushCodec(LAYOUT, "gzip")
    with pytest.raises(ValueError, match="no option"):
        PushCodec(LAYOUT, "dct-dp", colour="red")


def _in_threads(push: Callable[[int], None], steps: int, threads: int = 4) -> None:
    """``push(seed)`` for ``steps`` seeds in each of ``threads`` threads at once; re-raises."""
    errors: list[BaseException] = []

    def body(thread: int) -> None:
        try:
            for step in range(steps):
                push(thread * 100 + step)
        except BaseException as error:  # noqa: BLE001 (re-raised below)
            errors.append(error)

    workers = [threading.Thread(target=body, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(600)  # a hang guard only: a busy 2-core machine never comes close
        assert not worker.is_alive(), "an encoding thread hung"
    if errors:
        raise errors[0]


def test_hogwild_threads_share_one_buffer_and_the_drain_empties_it() -> None:
    """Threads encode concurrently through one codec (DCT §3.3): nothing breaks, every call
    is counted, and with drain_every=1 every update empties the shared buffer."""
    codec = PushCodec(LAYOUT, "dct-dp", ratio=0.1, life_span=4, drain_every=1, min_numel=0)

    def push(seed: int) -> None:
        assert codec.encode(_grad(seed)).sent.isfinite().all()

    _in_threads(push, steps=25)
    assert isinstance(codec.memory, Residual) and codec.memory.drains == 4 * 25 * 3
    assert all(not bool(b.any()) for b in codec.memory.buffers.values())
    calls = codec.scheme.state_dict()["selection"]["calls"]
    assert sum(calls.values()) == 4 * 25 * 3  # encoding is serialised: no call is lost


def test_concurrent_streams_lose_no_gradient_and_keep_the_density_control() -> None:
    """Every gradient pushed by any thread is either sent or still in the shared memory.

    The threshold and its density control are read-modify-write state per tensor: streams
    racing on them once raised ``KeyError``.
    """
    codec = PushCodec(LAYOUT, "dct-dp", ratio=0.1, life_span=3, gain=0.05,
                      drain_every=10**6, min_numel=0)
    pushed: list[torch.Tensor] = []
    sent: list[torch.Tensor] = []

    def push(seed: int) -> None:
        grad = _grad(seed)
        sent.append(codec.encode(grad).sent)
        pushed.append(grad)

    _in_threads(push, steps=40)
    assert isinstance(codec.memory, Residual)
    residual = torch.cat([codec.memory.buffers[name].reshape(-1) for name in LAYOUT.names])
    total = torch.stack(pushed).double().sum(0)
    torch.testing.assert_close(torch.stack(sent).double().sum(0) + residual.double(), total,
                               rtol=0, atol=1e-4)


def test_codec_state_round_trips() -> None:
    codec = PushCodec(LAYOUT, "dct-dp", ratio=0.1, life_span=3, drain_every=2)
    for seed in range(4):
        codec.encode(_grad(seed))
    copy = PushCodec(LAYOUT, "dct-dp", ratio=0.1, life_span=3, drain_every=2)
    copy.load_state_dict(codec.state_dict())
    for seed in range(4, 8):
        assert torch.equal(codec.encode(_grad(seed)).data, copy.encode(_grad(seed)).data)
