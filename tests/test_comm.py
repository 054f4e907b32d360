"""Collectives over gloo: sparse all-gather sums exactly, the Meter counts what was handed."""

from __future__ import annotations

import pytest
import torch

from thinwire.comm import Meter, all_gather_bytes
from thinwire.comm.meter import TRAFFIC
from thinwire.compress import SparsePayload
from thinwire.schemes import build
from thinwire.train.launch import spawn


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


def test_sparse_all_gather_reconstructs_the_exact_sum() -> None:
    results = spawn(_gather_payloads, 3, timeout_s=60)
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


def _reduce_with_scheme(rank: int, world_size: int, name: str) -> tuple[dict[str, torch.Tensor],
                                                                         dict[str, torch.Tensor],
                                                                         dict[str, float]]:
    generator = torch.Generator().manual_seed(10 + rank)
    grads = {"w": torch.randn(32, 8, generator=generator, dtype=torch.float64),
             "b": torch.randn(8, generator=generator, dtype=torch.float64)}
    scheme = build(name, sparsity=0.9, life_span=1, min_numel=0) if name == "dct-dp" \
        else build(name)
    scheme.meter = Meter(rank, world_size)
    out = scheme.reduce(grads)
    scheme.meter.next_step()
    return grads, out, scheme.meter.bytes_per_step("layer")


@pytest.mark.parametrize("name", ["dense", "dct-dp"])
def test_scheme_reduce_averages_what_each_rank_sent(name: str) -> None:
    results = spawn(_reduce_with_scheme, 2, name, timeout_s=60)
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
        for _, out, _ in results:
            torch.testing.assert_close(out[key], expected, rtol=0, atol=1e-15)
    layers = results[0][2]
    if name == "dense":
        assert layers == {"w": 32 * 8 * 8, "b": 8 * 8}
    else:  # one payload with room for 1.25 k per layer (33 + 2): a bitmap of 264 entries
        assert layers["w"] == 26 * 4 and layers["b"] == 1 * 4  # the fp32 values sent
        assert layers["(header)"] == 4 and layers["(bitmap)"] == 36
        assert layers["(padding)"] == (33 + 2 - 26 - 1) * 4
