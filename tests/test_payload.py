"""Wire encodings: exact byte sizes, index list vs bitmap, round trips."""

from __future__ import annotations

import pytest
import torch

from thinwire.compress import DensePayload, LowRankPayload, SparsePayload
from thinwire.compress.payload import SparseLayout, pack_bits, unpack_bits


def sparse(numel: int, indices: list[int], dtype: torch.dtype = torch.float32) -> SparsePayload:
    index = torch.tensor(indices, dtype=torch.int64)
    return SparsePayload(torch.arange(1, len(indices) + 1, dtype=dtype), index, numel)


def test_index_list_size_is_header_indices_values() -> None:
    payload = sparse(1000, [3, 500, 999])
    assert not payload.uses_bitmap
    assert payload.nbytes == 4 + 3 * 4 + 3 * 4
    assert payload.to_bytes().numel() == payload.nbytes


def test_bitmap_chosen_when_denser_than_one_in_32() -> None:
    numel = 64  # bitmap: 8 bytes; index list: 4 bytes per entry
    below = sparse(numel, [0])  # 4 bytes of indices < 8 of bitmap
    above = sparse(numel, [0, 5, 9])  # 12 > 8
    assert not below.uses_bitmap and above.uses_bitmap
    assert above.nbytes == 4 + 8 + 3 * 4


def test_bitmap_and_half_values_are_padded_to_four_bytes() -> None:
    payload = sparse(20, [1, 2, 3], torch.float16)  # bitmap 3 bytes -> 4; values 6 -> 8
    assert payload.uses_bitmap
    assert payload.nbytes == 4 + 4 + 8
    assert payload.to_bytes().numel() == payload.nbytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("numel,count", [(1, 1), (7, 0), (100, 2), (100, 50), (4096, 4096)])
def test_sparse_round_trip(dtype: torch.dtype, numel: int, count: int) -> None:
    indices = torch.randperm(numel)[:count]
    payload = SparsePayload(torch.randn(count).to(dtype), indices, numel)
    wire = payload.to_bytes()
    assert wire.dtype == torch.uint8 and wire.numel() == payload.nbytes
    back, used = SparsePayload.from_bytes(torch.cat([wire, torch.ones(5, dtype=torch.uint8)]),
                                          numel, dtype)
    assert used == payload.nbytes
    original = torch.zeros(numel, dtype=dtype).index_put_((indices,), payload.values)
    decoded = torch.zeros(numel, dtype=dtype).index_put_((back.indices,), back.values)
    assert torch.equal(original, decoded)


def test_dense_and_low_rank_sizes() -> None:
    assert DensePayload(torch.zeros(10)).nbytes == 40
    assert DensePayload(torch.zeros(10, dtype=torch.float16)).nbytes == 20
    low_rank = LowRankPayload(torch.zeros(6, 2), torch.zeros(5, 2))
    assert low_rank.nbytes == (12 + 10) * 4 == low_rank.to_bytes().numel()


@pytest.mark.parametrize("numel", [1, 8, 9, 63, 1000])
def test_bits_round_trip(numel: int) -> None:
    mask = torch.rand(numel) > 0.5
    packed = pack_bits(mask)
    assert packed.numel() == (numel + 7) // 8
    assert torch.equal(unpack_bits(packed, numel), mask)


@pytest.mark.parametrize("numel,capacity,count", [(1000, 10, 7), (1000, 10, 0), (1000, 200, 200),
                                                  (37, 37, 5), (0, 0, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("formats", ["int32", "delta16", "delta8"])
def test_fixed_capacity_layout_round_trips_and_has_its_declared_size(
        numel: int, capacity: int, count: int, dtype: torch.dtype, formats: str) -> None:
    layout = SparseLayout(numel, capacity, dtype, formats)
    indices = torch.randperm(numel)[:count]
    values = torch.randn(count).to(dtype)
    wire = layout.encode(indices, values)
    assert wire.dtype == torch.uint8 and wire.numel() == layout.nbytes
    assert layout.nbytes % max(4, values.element_size()) == 0  # rows of a gather stay aligned
    got_indices, got_values = layout.decode(wire)
    order = torch.argsort(indices)
    if layout.uses_bitmap or formats != "int32":  # ascending order on the wire
        assert torch.equal(got_indices, indices[order]) and torch.equal(got_values, values[order])
    else:
        assert torch.equal(got_indices, indices) and torch.equal(got_values, values)


def test_fixed_capacity_layout_refuses_overflow_and_bad_sizes() -> None:
    with pytest.raises(ValueError, match="exceed the payload capacity 2"):
        SparseLayout(10, 2).encode(torch.arange(3), torch.ones(3))
    with pytest.raises(ValueError, match="capacity=11"):
        SparseLayout(10, 11)


def test_16_bit_code_spans_blocks_of_65536_and_halves_index_bytes() -> None:
    numel = 400_000
    indices = torch.tensor([0, 1, 65_535, 65_536 + 65_535, 300_000, 399_999, 65_536])
    layout = SparseLayout(numel, 10, torch.float32, "delta16")
    assert not layout.uses_bitmap and layout.index_bytes == 20 + 4 * 7
    values = torch.arange(7.0)
    got_indices, got_values = layout.decode(layout.encode(indices, values))
    order = torch.argsort(indices)
    assert torch.equal(got_indices, indices[order]) and torch.equal(got_values, values[order])
    wide = SparseLayout(numel, 2000, torch.float32, "int32")
    assert SparseLayout(numel, 2000, torch.float32, "delta16").index_bytes == 4000 + 4 * 7
    assert wide.index_bytes == 8000


def test_8_bit_code_spans_blocks_of_256_and_beats_the_bitmap_below_about_11_percent() -> None:
    numel = 100_000
    # gaps of 0, 1, 255, 256, thousands (empty blocks between), and both ends
    indices = torch.tensor([0, 1, 256, 511, 767, 5_000, 99_999, 255])
    layout = SparseLayout(numel, 10, torch.float32, "delta8")
    assert not layout.uses_bitmap and layout.index_bytes == 12 + 4 * (numel // 256 + 1)
    values = torch.arange(8.0)
    got_indices, got_values = layout.decode(layout.encode(indices, values))
    order = torch.argsort(indices)
    assert torch.equal(got_indices, indices[order]) and torch.equal(got_values, values[order])
    seven = SparseLayout(numel, 7_000, torch.float32, "delta8")  # 7 %: a byte an index
    assert not seven.uses_bitmap and seven.index_bytes == 7_000 + 4 * 391
    assert SparseLayout(numel, 12_000, torch.float32, "delta8").uses_bitmap  # 12 %


@pytest.mark.parametrize("indices", ["delta16", "delta8", "int32"])
def test_layout_bytes_do_not_depend_on_the_order_entries_come_in(indices: str) -> None:
    """Ascending indices skip the sort; shuffled ones are sorted: the same payload."""
    numel = 300_000
    chosen = torch.randperm(numel)[:900].sort().values
    values = torch.randn(900)
    layout = SparseLayout(numel, 1000, torch.float32, indices)
    shuffle = torch.randperm(900)
    ascending = layout.encode(chosen, values)
    shuffled = layout.encode(chosen[shuffle], values[shuffle])
    if indices != "int32":
        assert torch.equal(ascending, shuffled)
    got_indices, got_values = layout.decode(shuffled)
    order = torch.argsort(got_indices)
    assert torch.equal(got_indices[order], chosen) and torch.equal(got_values[order], values)


@pytest.mark.parametrize("indices", ["delta16", "delta8", "int32"])
def test_vouched_ascending_indices_make_the_same_payload_and_counts_read_every_header(
        indices: str) -> None:
    numel = 300_000
    layout = SparseLayout(numel, 1000, torch.float32, indices)
    rows = []
    for count in (900, 0, 17):
        chosen = torch.randperm(numel)[:count].sort().values
        values = torch.randn(count)
        vouched = layout.encode(chosen, values, ascending=True)
        assert torch.equal(vouched, layout.encode(chosen, values))
        rows.append(vouched)
    assert layout.counts(rows) == [900, 0, 17] and layout.counts(rows[2:]) == [17]
    for row, count in zip(rows, layout.counts(rows)):
        assert all(torch.equal(a, b) for a, b in zip(layout.decode(row, count),
                                                       layout.decode(row)))
