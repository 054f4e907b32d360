"""Collectives over gloo: sparse all-gather sums exactly, the Meter counts what was handed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from thinwire.comm import Meter, all_gather_bytes
from thinwire.comm.collectives import (
    _PAIRS,
    PAIR_MIN_BYTES,
    _pair_groups,
    all_gather_fixed,
    then_hold,
)
from thinwire.comm.fingerprint import check_peers, describe, digest, flatten
from thinwire.comm.meter import TRAFFIC
from thinwire.comm.rounds import TwoRounds, all_reduce_round
from thinwire.compress import SparsePayload
from thinwire.launch import spawn
from thinwire.schemes import build


def test_traffic_model_of_each_collective() -> None:
    assert TRAFFIC["all_reduce"](1000, 4, 0, 0) == (1500.0, 1500.0)
    assert TRAFFIC["all_gather"](1000, 4, 0, 0) == (3000.0, 3000.0)
    assert TRAFFIC["broadcast"](100, 3, 0, 0) == (100.0, 0.0)  # root sends only
    assert TRAFFIC["broadcast"](100, 3, 2, 0) == (0.0, 100.0)  # end of the chain
    assert TRAFFIC["broadcast"](100, 3, 1, 0) == (100.0, 100.0)


def test_meter_groups_by_entity_and_layer_and_rejects_unknown_names() -> None:
    meter = Meter(rank=0, world_size=2)
    meter.record("W_grad", "a", "all_reduce", 100)
    meter.record("index", "a", "broadcast", 8)
    meter.next_step()
    meter.record("W_grad", "b", "all_gather", 50)
    meter.next_step()
    assert meter.bytes_per_step() == {"total": 79.0}
    assert meter.bytes_per_step("entity") == {"W_grad": 75.0, "index": 4.0}
    assert meter.bytes_per_step("layer") == {"a": 54.0, "b": 25.0}
    with pytest.raises(ValueError, match="'weights'"):
        meter.record("weights", "a", "all_reduce", 1)
    with pytest.raises(ValueError, match="'scatter'"):
        meter.record("W_grad", "a", "scatter", 1)


def test_meter_memory_is_bounded_over_a_long_run_and_its_sums_stay_exact() -> None:
    bounded, full = Meter(rank=1, world_size=3, window=64), Meter(rank=1, world_size=3,
                                                                   window=None)
    for step in range(10_000):
        for meter in (bounded, full):
            for layer in range(6):
                meter.record("W_grad", f"layer{layer}", "all_gather", 4 * (layer + step % 7))
                meter.record("index", f"layer{layer}", "broadcast", 8, root=step % 3)
            meter.next_step()
    assert len(bounded.records) == 64 and len(full.records) == 120_000
    assert list(bounded.records) == list(full.records)[-64:]
    assert bounded.summary() == full.summary()
    assert bounded.totals("received", by="collective") == full.totals("received",
                                                                       by="collective")
    expected = sum(r.nbytes for r in full.records)
    assert bounded.totals() == {"total": float(expected)}


def test_a_collectives_error_reaches_whoever_waits_for_its_result() -> None:
    """A peer lost mid-exchange fails the collective's future: what is chained on it must
    fail too, not hand on the half-filled buffer (a lost worker's exchange would otherwise
    be averaged from garbage)."""
    failed: torch.futures.Future[None] = torch.futures.Future()
    held = then_hold(failed, lambda: "half-filled buffer")
    failed.set_exception(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="Connection closed"):
        held.wait()
    arrived: torch.futures.Future[None] = torch.futures.Future()
    arrived.set_result(None)
    assert then_hold(arrived, lambda: "rows").wait() == "rows"


def test_meter_rejects_bad_window_and_fields() -> None:
    with pytest.raises(ValueError, match="window=-1"):
        Meter(window=-1)
    with pytest.raises(ValueError, match="field='bytes'"):
        Meter().totals("bytes")
    with pytest.raises(ValueError, match="by='step'"):
        Meter().totals(by="step")


def _gather_payloads(rank: int, world_size: int) -> tuple[list[bytes], list[int], float]:
    numel = 64
    count = [1, 40, 5][rank]  # different sizes per rank; rank 1 uses a bitmap
    generator = torch.Generator().manual_seed(rank)
    indices = torch.randperm(numel, generator=generator)[:count]
    payload = SparsePayload(torch.randn(count, generator=generator), indices, numel)
    meter = Meter(rank, world_size)
    buffers = all_gather_bytes(payload.to_bytes(), meter=meter,
                               segments=[("w", payload.nbytes)]).wait()
    meter.next_step()
    total = torch.zeros(numel)
    for buffer in buffers:
        decoded, _ = SparsePayload.from_bytes(buffer, numel, torch.float32)
        total.index_add_(0, decoded.indices, decoded.values)
    return [bytes(b.numpy()) for b in buffers], [payload.nbytes], float(meter.bytes_per_step()
                                                                          ["total"])


def _gather_fixed(rank: int, pair: dist.ProcessGroup) -> dict[str, Any]:
    """all_gather_fixed over all three ranks (one all-gather), twice, and over ranks 0 and 1
    with a small payload (an all-gather) and a large one (one broadcast each, on pair
    groups made then)."""
    out: dict[str, Any] = {"world": [], "pair": [], "same_pair_groups": None}
    meter = Meter(rank, 3)
    for step in range(2):
        payload = torch.arange(6, dtype=torch.uint8) + 10 * rank + 100 * step
        rows = all_gather_fixed(payload, meter=meter, segments=[("w", 6)]).wait()
        out["world"].append([row.tolist() for row in rows])
    out["handed"] = meter.totals()
    if rank < 2:
        for size in (6, PAIR_MIN_BYTES):
            rows = all_gather_fixed(torch.full((size,), rank + 1, dtype=torch.uint8), pair).wait()
            out["pair"].append(([torch.equal(row, torch.full_like(row, r + 1))
                                 for r, row in enumerate(rows)],
                                [row.numel() for row in rows], pair in _PAIRS))
        out["same_pair_groups"] = _pair_groups(pair) == _pair_groups(pair)
    return out


def _all(rank: int, world_size: int) -> dict[str, Any]:
    """Every multi-process case in one spawn of three ranks; the scheme cases run on a
    group of ranks 0 and 1."""
    pair = dist.new_group([0, 1])
    return {"gather": _gather_payloads(rank, world_size), "fixed": _gather_fixed(rank, pair),
            **{name: _reduce_with_scheme(rank, name, pair) if rank < 2 else None
               for name in SCHEMES}}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return spawn(_all, 3)


def test_fixed_all_gather_gives_every_rank_every_row_in_rank_order(
        runs: list[dict[str, Any]]) -> None:
    for step in range(2):
        world = [(torch.arange(6) + 10 * r + 100 * step).tolist() for r in range(3)]
        assert all(run["fixed"]["world"][step] == world for run in runs)
    assert all(run["fixed"]["handed"] == {"total": 12.0} for run in runs)
    for run in runs[:2]:  # two ranks: the large payload goes by one broadcast each
        assert run["fixed"]["pair"] == [([True, True], [6, 6], False),
                                        ([True, True], [PAIR_MIN_BYTES] * 2, True)]
        assert run["fixed"]["same_pair_groups"]


def test_sparse_all_gather_reconstructs_the_exact_sum(runs: list[dict[str, Any]]) -> None:
    results = [r["gather"] for r in runs]
    sizes = [r[1][0] for r in results]
    for buffers, _, handed in results:
        assert [len(b) for b in buffers] == sizes  # each rank's bytes, unpadded
        assert buffers == results[0][0]  # every rank holds the same bytes
        assert handed == 8 + max(sizes)  # the length, then the padded buffer
    # every rank decodes the identical sum of all three payloads
    numel = 64
    expected = torch.zeros(numel)
    for rank in range(3):
        generator = torch.Generator().manual_seed(rank)
        count = [1, 40, 5][rank]
        indices = torch.randperm(numel, generator=generator)[:count]
        expected.index_add_(0, indices, torch.randn(count, generator=generator))
    for buffers, _, _ in results:
        total = torch.zeros(numel)
        for buffer in buffers:
            decoded, _ = SparsePayload.from_bytes(torch.frombuffer(bytearray(buffer),
                                                                   dtype=torch.uint8),
                                                  numel, torch.float32)
            total.index_add_(0, decoded.indices, decoded.values)
        assert torch.equal(total, expected)


SCHEMES = ("dense", "dct-dp")


def _reduce_with_scheme(rank: int, name: str, group: dist.ProcessGroup
                        ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor],
                                   dict[str, float], float]:
    generator = torch.Generator().manual_seed(10 + rank)
    grads = {"w": torch.randn(32, 8, generator=generator, dtype=torch.float64),
             "b": torch.randn(8, generator=generator, dtype=torch.float64)}
    options = {"ratio": 0.1, "life_span": 1, "min_numel": 0, "capacity": 1.25,
               "scope": "layer", "values": "fp32"}
    scheme = build(name, **options) if name == "dct-dp" else build(name)
    scheme.meter = Meter(rank, 2)
    out = scheme.reduce(grads, group)
    scheme.meter.next_step()
    return (grads, out, scheme.meter.bytes_per_step("layer"),
            scheme.meter.collectives_per_step())


@pytest.mark.parametrize("name", SCHEMES)
def test_scheme_reduce_averages_what_each_rank_sent(runs: list[dict[str, Any]],
                                                    name: str) -> None:
    results = [r[name] for r in runs[:2]]
    grads = [r[0] for r in results]
    for key in ("w", "b"):
        if name == "dense":
            expected = (grads[0][key] / 2 + grads[1][key] / 2)
        else:  # each rank's own top-10% (no ties in random data), then the mean
            sent = []
            for g in grads:
                flat = g[key].reshape(-1)
                k = -(-flat.numel() // 10)
                mask = torch.zeros_like(flat)
                mask[torch.topk(flat.abs(), k).indices] = 1
                on_wire = flat.float().double()  # values travel as fp32
                sent.append((on_wire * mask).reshape(g[key].shape))
            expected = (sent[0] + sent[1]) / 2
        for _, out, _, _ in results:
            torch.testing.assert_close(out[key], expected, rtol=0, atol=1e-15)
    layers, collectives = results[0][2], results[0][3]
    # one call per buffer, whatever its segments: dense one all-reduce of w and b, dct-dp
    # one all-gather of its fixed-size payload (no lengths round)
    assert collectives == 1
    if name == "dense":
        assert layers == {"w": 32 * 8 * 8, "b": 8 * 8}
    else:  # one payload with room for 1.25 k per layer (33 + 2): a bitmap of 264 entries
        assert layers["w"] == 26 * 4 and layers["b"] == 1 * 4  # the fp32 values sent
        assert layers["(header)"] == 4 and layers["(bitmap)"] == 36
        assert layers["(padding)"] == (33 + 2 - 26 - 1) * 4


def test_fingerprint_fields_flatten_and_a_mismatch_names_each_differing_field() -> None:
    ranks = [flatten({"scheme": "dct-dp", "config": {"ratio": 0.1, "life_span": 10}}),
             flatten({"scheme": "dct-dp", "config": {"ratio": 0.01, "life_span": 10}})]
    assert ranks[0] == {"scheme": '"dct-dp"', "config.ratio": "0.1", "config.life_span": "10"}
    assert digest(ranks[0]) != digest(ranks[1])
    assert digest(ranks[0]) == digest(dict(reversed(ranks[0].items())))  # order-free
    message = describe(ranks, "the DDP hook")
    assert "'config.ratio' is 0.1 on rank 0, 0.01 on rank 1" in message
    assert "life_span" not in message
    many = [flatten({f"f{i}": i for i in range(7)}), flatten({f"f{i}": -i for i in range(7)})]
    assert describe(many, "x").count(" is ") == 4 and "and 2 more field(s)" in describe(many, "x")


def test_peer_check_is_a_no_op_in_one_process() -> None:
    check_peers({"scheme": "anything"}, "the DDP hook")


def test_two_rounds_leave_a_launch_pending_until_the_steps_last() -> None:
    rounds, calls = TwoRounds(), []

    def second(tag: str):  # type: ignore[no-untyped-def]
        def make(mean: torch.Tensor) -> torch.Tensor:
            calls.append(tag)
            return mean * 10
        return make

    cpu = torch.device("cpu")
    a = rounds.launch(lambda: all_reduce_round(torch.ones(2)), second("a"), device=cpu,
                      last=False)
    assert not a.done() and calls == []  # round 1 of "a" may still be on the wire
    b = rounds.launch(lambda: all_reduce_round(torch.full((3,), 2.0)), second("b"), device=cpu,
                      last=True)
    assert calls == ["a", "b"]  # "a"'s round 2 started before "b"'s round 1 was waited on
    assert torch.equal(a.wait(), torch.full((2,), 10.0))
    assert torch.equal(b.wait(), torch.full((3,), 20.0))
    rounds.flush()  # nothing pending: a no-op


def test_two_rounds_hand_a_failure_to_the_pending_launchs_future() -> None:
    rounds = TwoRounds()

    def broken(mean: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("orthonormalisation failed")

    cpu = torch.device("cpu")
    pending = rounds.launch(lambda: all_reduce_round(torch.ones(2)), broken, device=cpu,
                            last=False)
    with pytest.raises(RuntimeError, match="orthonormalisation failed"):
        rounds.launch(lambda: all_reduce_round(torch.ones(2)), lambda mean: mean, device=cpu)
    with pytest.raises(RuntimeError, match="orthonormalisation failed"):
        pending.wait()
