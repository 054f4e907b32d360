"""Quantisers with per-chunk scales, and the quantised schemes (error feedback, top-k first)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from thinwire import schemes
from thinwire.comm import Meter
from thinwire.compress import TensorInfo
from thinwire.compress.quantise import (
    KINDS,
    QuantisedPayload,
    Quantiser,
    pack,
    quantised_bytes,
    unpack,
)
from thinwire.launch import spawn
from thinwire.schemes import CompressedScheme


def _round_trip(kind: str, x: torch.Tensor, chunk: int = 8) -> torch.Tensor:
    quantiser = Quantiser(kind, chunk)
    info = TensorInfo.of("x", x)
    payload = quantiser.compress(x, info)
    assert payload.nbytes == quantiser.nbytes(x.numel()) == payload.to_bytes().numel()
    again = QuantisedPayload.from_bytes(payload.to_bytes(), x.numel(), quantiser.bits, chunk)
    out = quantiser.decompress(again, info)
    assert torch.equal(out, quantiser.decompress(payload, info))
    return out


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("numel", [0, 1, 7, 8, 9, 33])
def test_packing_round_trips(bits: int, numel: int) -> None:
    codes = torch.randint(0, 1 << bits, (numel,), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.numel() == -(-numel * bits // 8)
    assert torch.equal(unpack(packed, numel, bits), codes)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(0,), (1,), (13,), (4, 5), (2, 3, 7)])
def test_round_trip_keeps_shape_dtype_and_bytes(kind: str, dtype: torch.dtype,
                                               shape: tuple[int, ...]) -> None:
    x = torch.randn(shape).to(dtype)
    out = _round_trip(kind, x)
    assert out.shape == x.shape and out.dtype == x.dtype
    numel = x.numel()
    bits = KINDS[kind]
    assert Quantiser(kind, 8).nbytes(numel) == (-(-numel * bits // 8) + 3) // 4 * 4 + 4 * (
        -(-numel // 8))


@pytest.mark.parametrize("kind", ["int8", "int4", "int2"])
def test_error_is_bounded_by_the_level_spacing(kind: str) -> None:
    x = torch.randn(1000, dtype=torch.float64)
    out = _round_trip(kind, x, chunk=50)
    top = x.view(-1, 50).abs().amax(dim=1, keepdim=True)
    half_step = {"int8": 0.5 / 127, "int4": 0.5 / 7, "int2": 1 / 3}[kind]
    assert bool(((out - x).view(-1, 50).abs() <= top * half_step * (1 + 1e-6)).all())


@pytest.mark.parametrize("kind", ["int8", "int4", "int2"])
def test_the_largest_entry_of_each_chunk_travels_exactly(kind: str) -> None:
    x = torch.randn(64)
    out = _round_trip(kind, x, chunk=16)
    where = x.view(4, 16).abs().argmax(dim=1)
    assert torch.equal(out.view(4, 16).gather(1, where[:, None]),
                       x.view(4, 16).gather(1, where[:, None]))


@pytest.mark.parametrize("kind", list(KINDS))
def test_scaling_by_a_power_of_two_scales_the_result(kind: str) -> None:
    x = torch.randn(40)
    assert torch.equal(_round_trip(kind, 4.0 * x), 4.0 * _round_trip(kind, x))
    assert torch.equal(_round_trip(kind, -x, chunk=8)[x != 0].abs(),
                       _round_trip(kind, x, chunk=8)[x != 0].abs())


@pytest.mark.parametrize("kind", list(KINDS))
def test_all_zero_and_constant_chunks(kind: str) -> None:
    zeros = torch.zeros(19)
    assert torch.equal(_round_trip(kind, zeros), zeros)
    constant = torch.full((16,), -0.75)  # 0.75 * n is exact, so the sign's mean is too
    assert torch.equal(_round_trip(kind, constant), constant)


def test_ties_round_half_to_even_and_the_sign_of_zero_is_plus() -> None:
    # max 127: x * (127 / 127) is x itself, so these sit exactly halfway between levels
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 0.0, 3.0])
    assert _round_trip("int8", x).tolist() == [127.0, 0.0, 2.0, 2.0, 0.0, -2.0, 0.0, 3.0]
    sign = _round_trip("sign", torch.tensor([0.0, -2.0, 2.0, 0.0]), chunk=4)
    assert sign.tolist() == [1.0, -1.0, 1.0, 1.0]


def test_unknown_kind_and_bad_chunk_are_refused() -> None:
    with pytest.raises(ValueError, match="kind='int3'"):
        Quantiser("int3")
    with pytest.raises(ValueError, match="chunk=0"):
        Quantiser("int8", 0)
    with pytest.raises(ValueError, match="chunk=0"):
        schemes.build("int4", chunk=0)
    with pytest.raises(ValueError, match="ratio=0"):
        schemes.build("topk+int2", ratio=0)


# The other own-index selections with quantised values (a scale per 128 values).
_SPELLED = ["topk:values=int8", "dct-dp:values=int4", "laplace:values=int8",
            "local-topk:values=int8"]
_NAMES = [*KINDS, *(f"topk+{kind}" for kind in KINDS), *_SPELLED]


def _config(name: str) -> dict[str, Any]:
    if name in _SPELLED:
        return {"ratio": 0.3, "min_numel": 0}
    return {"chunk": 4, **({"ratio": 0.3} if name.startswith("topk") else {})}


@pytest.mark.parametrize(("name", "dtype"), [
    *((name, torch.float64) for name in _NAMES),
    *((name, torch.float32) for name in _NAMES if name.endswith(("int8", "int4")))])
def test_error_feedback_invariant_holds_exactly(name: str, dtype: torch.dtype) -> None:
    """``delta + old_error == sent + new_error`` bit for bit, three rounds.

    fp32 values held in fp64 leave room for every difference to be exact; in
    fp32 the symmetric kinds' differences are exact by Sterbenz's lemma
    (the level nearest p is within a factor 2 of it, or 0); sign and int2
    levels may lie far from p, so they are checked in fp64 only.
    """
    scheme = schemes.build(name, **_config(name))
    assert isinstance(scheme, CompressedScheme) and scheme.memory is not None
    for _ in range(3):
        grads = {"a": torch.randn(5, 6).float().to(dtype), "b": torch.randn(7).float().to(dtype)}
        old = {key: scheme.memory.buffers.get(key, torch.zeros(g.numel(), dtype=dtype))
               for key, g in grads.items()}
        old = {key: e.clone() for key, e in old.items()}
        sent = scheme.reduce(grads)  # one process: the mean is what this rank sent
        for key, grad in grads.items():
            new = scheme.memory.buffers[key]
            assert torch.equal(grad.reshape(-1) + old[key], sent[key].reshape(-1) + new)


@pytest.mark.parametrize("name", ["int8", "topk+int4"])
def test_nonfinite_input_raises_or_skips_without_touching_memory(name: str) -> None:
    bad = {"a": torch.tensor([1.0, float("nan"), 2.0, 3.0])}
    with pytest.raises(FloatingPointError, match="'a'"):
        schemes.build(name, **_config(name)).reduce(bad)
    scheme = schemes.build(name, nonfinite="skip", **_config(name))
    assert isinstance(scheme, CompressedScheme) and scheme.memory is not None
    scheme.reduce({"a": torch.tensor([1.0, -0.3, 2.0, 3.0])})
    before = scheme.memory.state_dict()
    out = scheme.reduce(bad)
    assert scheme.skipped == 1
    assert torch.equal(out["a"], torch.zeros(4))
    assert torch.equal(scheme.memory.state_dict()["buffers"]["a"], before["buffers"]["a"])


def test_topk_with_int8_values_is_topk_plus_int8() -> None:
    spelled = schemes.build("topk:values=int8", ratio=0.2)
    chained = schemes.build("topk+int8", ratio=0.2)
    for step in range(3):
        torch.manual_seed(step)
        grads = {"w": torch.randn(40, 30), "b": torch.randn(30)}
        ours, theirs = spelled.reduce(grads), chained.reduce(grads)
        assert all(torch.equal(ours[key], theirs[key]) for key in grads)


def test_agreed_coordinates_refuse_codes() -> None:
    with pytest.raises(ValueError, match="values"):
        schemes.build("clt-k:values=int8")


def test_topk_then_quantise_sends_only_the_selected_entries() -> None:
    scheme = schemes.build("topk+int8", ratio=0.25, scope="layer", chunk=4,
                           error_feedback=False)
    grad = torch.tensor([1.0, -127.0, 2.0, 3.0, 50.0, 0.0, -1.0, 0.5])  # levels unscaled
    out = scheme.reduce({"g": grad})["g"]
    assert out.tolist() == [0.0, -127.0, 0.0, 0.0, 50.0, 0.0, 0.0, 0.0]


def _distributed(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in _NAMES:
        scheme = schemes.build(name, **_config(name))
        reference = schemes.build(name, **_config(name))  # this rank's own, alone
        meter = Meter(rank, world_size)
        scheme.meter = meter
        outs, sent = [], []
        for step in range(3):
            torch.manual_seed(100 * step + rank)
            grads = {"w": torch.randn(6, 5), "b": torch.randn(3)}
            outs.append(scheme.reduce(grads))
            sent.append({key: value.clone() for key, value in reference.reduce(grads).items()})
            meter.next_step()
        assert isinstance(scheme, CompressedScheme)
        infos = [TensorInfo("w", (6, 5)), TensorInfo("b", (3,))]
        payload = scheme.payload_bytes(infos)["all_gather"]
        results[name] = {"outs": outs, "sent": sent, "metered": meter.totals("nbytes"),
                         "payload": payload}
    return results


@pytest.fixture(scope="module")
def distributed() -> list[dict[str, Any]]:
    return spawn(_distributed, 3, timeout_s=300, deadline_s=600)


@pytest.mark.parametrize("name", _NAMES)
def test_the_mean_over_ranks_is_the_mean_of_what_each_rank_sent(
        name: str, distributed: list[dict[str, Any]]) -> None:
    for step in range(3):
        for key in ("w", "b"):
            sent = [distributed[rank][name]["sent"][step][key] for rank in range(3)]
            expected = (sent[0] + sent[1] + sent[2]) / 3
            for rank in range(3):
                got = distributed[rank][name]["outs"][step][key]
                assert torch.equal(got, distributed[0][name]["outs"][step][key])
                torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", _NAMES)
def test_bytes_metered_equal_the_payload_handed_over(name: str,
                                                     distributed: list[dict[str, Any]]) -> None:
    for rank in range(3):
        result = distributed[rank][name]
        assert sum(result["metered"].values()) == 3 * result["payload"]
    assert distributed[0]["int4"]["payload"] == quantised_bytes(30, 4, 4) + quantised_bytes(
        3, 4, 4)
