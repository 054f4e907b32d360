"""ScaleCom CLT-k and local top-k: selection maths, low-pass memory, schemes, bytes."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from thinwire import ddp, schemes
from thinwire.comm import Meter
from thinwire.compress import TensorInfo
from thinwire.compress.cltk import (
    captured_energy,
    chunk_topk,
    decode_indices,
    encode_indices,
    exact_topk,
    index_nbytes,
    layer_k,
    select,
    sparsify,
)
from thinwire.compress.sparse import MIN_NUMEL
from thinwire.feedback import Estimate, LowPass, MomentumCorrection, Residual
from thinwire.launch import spawn

# ---------------------------------------------------------------- selection maths


def _chunk_reference(values: np.ndarray, k: int) -> list[int]:
    """Argmax of |x| in each of numpy's array_split chunks (sizes differ by at most one)."""
    chosen, start = [], 0
    for chunk in np.array_split(np.abs(values), k):
        chosen.append(start + int(np.argmax(chunk)))
        start += chunk.size
    return chosen


@pytest.mark.parametrize("numel,k", [(1, 1), (10, 3), (10, 10), (97, 7), (100, 1), (1000, 10),
                                     (1001, 13)])
def test_chunk_topk_takes_the_largest_of_each_chunk(numel: int, k: int) -> None:
    values = torch.randn(numel, dtype=torch.float64)
    chosen = chunk_topk(values.abs(), k)
    assert chosen.tolist() == _chunk_reference(values.numpy(), k)
    assert chosen.numel() == k and torch.equal(chosen, torch.sort(chosen).values)
    assert torch.unique(chosen).numel() == k


def test_chunk_topk_breaks_ties_at_the_first_entry() -> None:
    assert chunk_topk(torch.zeros(8), 2).tolist() == [0, 4]


@pytest.mark.parametrize("numel,k", [(10, 3), (1000, 10), (64, 64)])
def test_exact_topk_is_the_k_largest_magnitudes(numel: int, k: int) -> None:
    values = torch.randn(numel, dtype=torch.float64)
    expected = sorted(np.argsort(-np.abs(values.numpy()))[:k].tolist())
    assert exact_topk(values.abs(), k).tolist() == expected
    assert select(values.reshape(2, -1) if numel % 2 == 0 else values, k,
                  "exact").tolist() == expected


def test_selection_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="selection='best'"):
        select(torch.ones(4), 2, "best")
    with pytest.raises(ValueError, match="k=5"):
        chunk_topk(torch.ones(4), 5)
    with pytest.raises(ValueError, match="k=-1"):
        exact_topk(torch.ones(4), -1)
    assert chunk_topk(torch.ones(4), 0).numel() == 0 and exact_topk(torch.ones(4), 0).numel() == 0


def test_layer_k_uses_ratio_or_a_capped_k() -> None:
    assert layer_k(1000, 0.01) == 10 and layer_k(10, 0.01) == 1
    assert layer_k(1000, 0.01, k=7) == 7 and layer_k(5, 0.01, k=7) == 5


@pytest.mark.parametrize("selection", ["exact", "chunk"])
def test_select_into_kept_room_for_the_magnitudes_chooses_the_same(selection: str) -> None:
    tensor = torch.randn(40, 50)
    room = torch.full((2000,), float("nan"))
    chosen = select(tensor, 20, selection, out=room)
    assert torch.equal(chosen, select(tensor, 20, selection))
    assert torch.equal(room, tensor.reshape(-1).abs())  # |p| was written there


@pytest.mark.parametrize("numel,k", [(1000, 10), (1000, 31), (1000, 32), (1000, 300), (9, 9),
                                     (33, 2), (7, 0), (300_000, 3000), (300_000, 2)])
def test_index_codec_round_trips_in_its_declared_bytes(numel: int, k: int) -> None:
    indices = torch.sort(torch.randperm(numel)[:k]).values
    wire = encode_indices(indices, numel)
    assert wire.dtype == torch.uint8
    code16 = (2 * k + 3) // 4 * 4 + 4 * (numel // 65536 + 1)
    assert wire.numel() == index_nbytes(k, numel) == min(4 * k, code16,
                                                         (-(-numel // 8) + 3) // 4 * 4)
    assert torch.equal(decode_indices(wire, k, numel), indices)


def test_index_code_keeps_16_bit_offsets_and_the_count_before_each_block_end() -> None:
    # blocks of 65536: one entry in block 0, one in block 1, one in block 3, 40 in block 4
    chosen = torch.tensor([65_535, 65_536, 200_000, *range(299_960, 300_000)])
    wire = encode_indices(chosen, 300_000)
    assert wire.numel() == 88 + 4 * 5 < 4 * 43  # 43 offsets padded, 5 block ends: not int32
    offsets = wire[:86].view(torch.int16).to(torch.int64) & 0xFFFF
    assert torch.equal(offsets, chosen % 65_536)
    assert wire[88:].view(torch.int32).tolist() == [1, 2, 2, 3, 43]
    assert torch.equal(decode_indices(wire, 43, 300_000), chosen)


def test_sparsify_keeps_only_the_indices() -> None:
    tensor = torch.arange(1.0, 7.0).reshape(2, 3)
    assert torch.equal(sparsify(tensor, torch.tensor([1, 5])),
                       torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 6.0]]))

# ---------------------------------------------------------------- low-pass memory


def test_lowpass_with_beta_one_is_plain_error_feedback() -> None:
    lowpass, residual = LowPass(1.0), Residual()
    for _ in range(4):
        grad = torch.randn(20, dtype=torch.float64)
        for memory in (lowpass, residual):
            compensated = memory.compensate("w", grad)
            memory.update("w", compensated, sparsify(compensated, torch.tensor([1, 7])))
        assert torch.equal(lowpass.buffers["w"], residual.buffers["w"])


def test_lowpass_filters_the_residual() -> None:
    memory = LowPass(0.25)
    m = torch.zeros(6, dtype=torch.float64)
    for _ in range(3):
        grad = torch.randn(6, dtype=torch.float64)
        p = memory.compensate("w", grad)
        assert torch.equal(p, grad + m)
        sent = sparsify(p, torch.tensor([0, 3]))
        memory.update("w", p, sent)
        m = 0.75 * m + 0.25 * (p - sent)
        torch.testing.assert_close(memory.buffers["w"], m, rtol=1e-15, atol=0.0)
    restored = LowPass(0.25)
    restored.load_state_dict(copy.deepcopy(memory.state_dict()))
    assert torch.equal(restored.buffers["w"], memory.buffers["w"])
    grad = torch.randn(6, dtype=torch.float64)
    for twin in (memory, restored):
        p = twin.compensate("w", grad)
        twin.update("w", p, sparsify(p, torch.tensor([2])))
    assert torch.equal(restored.buffers["w"], memory.buffers["w"])


@pytest.mark.parametrize("beta", [0.0, -0.1, 1.5, float("nan")])
def test_lowpass_rejects_beta_outside_the_unit_interval(beta: float) -> None:
    with pytest.raises(ValueError, match="beta"):
        LowPass(beta)

# ---------------------------------------------------------------- schemes, one process

ALL = {"min_numel": 0}  # these small tensors sparsified too (by default they travel dense)


def _grads(step: int, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return {"conv.weight": torch.randn(4, 3, 3, 3, generator=generator, dtype=dtype),
            "fc.weight": torch.randn(10, 20, generator=generator, dtype=dtype),
            "fc.bias": torch.randn(10, generator=generator, dtype=dtype)}


@pytest.mark.parametrize("scope", ["layer", "bucket"])
@pytest.mark.parametrize("name", ["clt-k", "local-topk"])
def test_one_worker_with_beta_one_is_topk_with_error_feedback(name: str, scope: str) -> None:
    ours = schemes.build(name, ratio=0.1, selection="exact", beta=1.0, scope=scope, **ALL)
    reference = schemes.build("topk", ratio=0.1, min_numel=0, scope=scope)
    for step in range(5):
        grads = _grads(step, torch.float32)  # the topk scheme sends fp32 values
        got, expected = ours.reduce(grads), reference.reduce(grads)
        for key in grads:
            assert torch.equal(got[key], expected[key]), (step, key)


def test_one_worker_chunk_selection_with_lowpass_matches_a_reference() -> None:
    scheme = schemes.build("clt-k", ratio=0.05, beta=0.5, selection="chunk", scope="layer",
                           **ALL)
    memory = {key: torch.zeros_like(g) for key, g in _grads(0).items()}
    for step in range(4):
        grads = _grads(step)
        got = scheme.reduce(grads)
        for key, grad in grads.items():
            p = grad + memory[key]
            k = max(1, int(np.ceil(p.numel() * 0.05)))
            chosen = torch.tensor(_chunk_reference(p.reshape(-1).numpy(), k))
            expected = sparsify(p, chosen)
            assert torch.equal(got[key], expected)
            memory[key] = 0.5 * memory[key] + 0.5 * (p - expected)
            torch.testing.assert_close(scheme.memory.buffers[key].view(memory[key].shape),
                                       memory[key], rtol=1e-15, atol=0.0)


def test_warmup_exclusions_and_small_tensors_travel_dense() -> None:
    scheme = schemes.build("clt-k", ratio=0.05, warmup_steps=2, exclude="conv.*",
                           min_numel=11)
    for step in range(3):
        grads = _grads(step)
        got = scheme.reduce(grads)
        dense = {"conv.weight", "fc.bias"} | ({"fc.weight"} if step < 2 else set())
        for key in grads:
            if key in dense:
                # sent whole through the memory (a coupled momentum covers it): no error left
                assert torch.equal(got[key], grads[key])
                assert not scheme.memory.buffers[key].any()
            else:
                assert int((got[key] != 0).sum()) == 10 and key in scheme.memory.buffers


@pytest.mark.parametrize("name", ["clt-k", "local-topk"])
def test_by_default_every_tensor_is_sparse_and_min_numel_sends_small_ones_dense(
        name: str) -> None:
    assert MIN_NUMEL == 0
    grads = {"w": torch.randn(1100, dtype=torch.float64),
             "b": torch.randn(30, dtype=torch.float64)}
    got = schemes.build(name).reduce(grads)  # one selection over both: 1 % of 1130
    assert sum(int(got[key].count_nonzero()) for key in grads) == int(np.ceil(0.01 * 1130))
    assert int(got["b"].count_nonzero()) < 30
    got = schemes.build(name, min_numel=1024).reduce(grads)
    assert torch.equal(got["b"], grads["b"])
    assert int(got["w"].count_nonzero()) == int(np.ceil(0.01 * 1100))


def test_nonfinite_gradients_are_skipped_without_touching_memory() -> None:
    scheme = schemes.build("clt-k", ratio=0.1, nonfinite="skip", **ALL)
    scheme.reduce(_grads(0))
    before = copy.deepcopy(scheme.memory.state_dict())
    bad = _grads(1)
    bad["fc.weight"][0, 0] = float("nan")
    got = scheme.reduce(bad)
    assert scheme.skipped == 1 and all(bool((v == 0).all()) for v in got.values())
    for key, buffer in before["buffers"].items():
        assert torch.equal(scheme.memory.buffers[key], buffer)
    with pytest.raises(FloatingPointError, match="fc.weight"):
        schemes.build("clt-k").reduce(bad)


@pytest.mark.parametrize("scope", ["layer", "bucket"])
@pytest.mark.parametrize("name", ["clt-k", "local-topk"])
def test_state_dict_resumes_exactly(name: str, scope: str) -> None:
    scheme = schemes.build(name, ratio=0.1, beta=0.5, scope=scope, **ALL)
    for step in range(3):
        scheme.reduce(_grads(step))
    state = copy.deepcopy(scheme.state_dict())
    resumed = schemes.build(name, ratio=0.1, beta=0.5, scope=scope, **ALL)
    resumed.load_state_dict(state)
    for step in range(3, 6):
        got, expected = resumed.reduce(_grads(step)), scheme.reduce(_grads(step))
        for key in got:
            assert torch.equal(got[key], expected[key])
    assert resumed.state_dict()["steps"] == scheme.state_dict()["steps"] == {
        key: 6 for key in _grads(0)}


@pytest.mark.parametrize("name", ["clt-k", "local-topk"])
@pytest.mark.parametrize("option,value", [
    ("beta", 0.0), ("beta", 1.01), ("ratio", 0.0), ("ratio", 1.5), ("k", 0), ("k", 2.5),
    ("selection", "sorted"), ("warmup_steps", -1), ("exclude", [3]), ("nonfinite", "ignore"),
    ("scope", "model"),
])
def test_bad_config_is_a_value_error(name: str, option: str, value: object) -> None:
    with pytest.raises(ValueError, match=option):
        schemes.build(name, **{option: value})


def test_a_per_layer_k_with_bucket_scope_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="k=5 is per layer"):
        schemes.build("clt-k", k=5, scope="bucket")

# ---------------------------------------------------------------- distributed (gloo)


STEPS = 6  # a multiple of 2 and 3: every rank leads equally often


def _worker_grads(rank: int, step: int) -> dict[str, torch.Tensor]:
    """Float64 multiples of 3/4096 in a wide range (ties are rare): means over 3 ranks,
    and the low-pass halvings, are exact, so no sum rounds in any order."""
    generator = torch.Generator().manual_seed(1000 * rank + step)
    shapes = {"conv.weight": (4, 3, 3, 3), "fc.weight": (20, 100), "fc.bias": (20,)}
    return {key: torch.randint(-2**20, 2**20, shape, generator=generator).double() * 3 / 4096
            for key, shape in shapes.items()}


LAYER = {"scope": "layer", **ALL}  # ScaleCom's k per layer
CONFIGS = {  # name -> (scheme, options)
    "chunk": ("clt-k", {"ratio": 0.02, "beta": 1.0, "selection": "chunk", **LAYER}),  # int32
    "exact": ("clt-k", {"ratio": 0.2, "beta": 0.5, "selection": "exact", **LAYER}),  # bitmaps
    "local": ("local-topk", {"ratio": 0.02, "selection": "chunk", **LAYER}),
    # as thinwire.optim.couple leaves it under SGD momentum: EF21 behind momentum correction
    # (momentum 0.5 keeps the sums exact, so a bucket's layout cannot change their rounding)
    "coupled": ("clt-k", {"ratio": 0.2, "selection": "exact", **LAYER}),
    # one leader top-k over all three tensors (k = 20 % of them all)
    "bucket": ("clt-k", {"ratio": 0.2, "beta": 0.5, "selection": "exact", "scope": "bucket",
                         **ALL}),
    # "exact" with its values all-reduced at 16 bits
    "fp16": ("clt-k", {"ratio": 0.2, "beta": 0.5, "selection": "exact", "values": "fp16",
                       **LAYER}),
}


def _build(label: str) -> Any:
    name, options = CONFIGS[label]
    scheme = schemes.build(name, **options)
    if label == "coupled":
        scheme.memory = MomentumCorrection(Estimate(), momentum=0.5)
    return scheme


def _cltk_worker(rank: int, world_size: int, group: dist.ProcessGroup | None = None
                 ) -> dict[str, object]:
    built = {label: _build(label) for label in CONFIGS}
    meters = {}
    for label, scheme in built.items():
        scheme.meter = meters[label] = Meter(rank, world_size)
    trace: dict[str, list[dict[str, object]]] = {label: [] for label in built}
    for step in range(STEPS):
        grads = _worker_grads(rank, step)
        for label, scheme in built.items():
            result = scheme.reduce(grads, group)
            record: dict[str, object] = {"result": result,
                                         "memory": {key: m.clone().view(grads[key].shape)
                                                    for key, m
                                                    in scheme.memory.buffers.items()}}
            if label != "local":
                record["leader"] = scheme.selection.leader
                record["indices"] = dict(scheme.selection.indices)
            trace[label].append(record)
            meters[label].next_step()
    return {"trace": trace, "bytes": {label: m.summary() for label, m in meters.items()},
            "flat": _flat_run(rank, group),
            "ddp": {scope: _ddp_run(rank, group, scope) for scope in ("layer", "bucket")}
            if world_size == 2 else None}


# A DDP bucket layout per step: grouping and order change, as DDP's re-bucketing does.
BUCKETS = ([["conv.weight", "fc.weight"], ["fc.bias"]],
           [["fc.bias", "fc.weight"], ["conv.weight"]],
           [["fc.weight", "fc.bias", "conv.weight"]])
# scope="bucket" selects over a bucket, so only the order may change: the tensors are
# selected together in their first grouping (and order) whatever the order they arrive in.
ONE_BUCKET = ([["conv.weight", "fc.weight", "fc.bias"]],
              [["fc.bias", "conv.weight", "fc.weight"]],
              [["fc.weight", "fc.bias", "conv.weight"]])


def _flat_run(rank: int, group: dist.ProcessGroup | None) -> dict[str, list[dict[str, object]]]:
    """The clt-k configurations through ``launch_flat``, several buckets per step."""
    trace: dict[str, list[dict[str, object]]] = {}
    for label, (name, _) in CONFIGS.items():
        if name != "clt-k":
            continue
        scheme = _build(label)
        trace[label] = []
        for step in range(STEPS):
            grads = _worker_grads(rank, step)
            before = {key: m.clone().view(grads[key].shape)
                      for key, m in scheme.memory.buffers.items()}
            result: dict[str, torch.Tensor] = {}
            layouts = ONE_BUCKET if label == "bucket" else BUCKETS
            for keys in layouts[step % len(layouts)]:
                buffer = torch.cat([grads[key].reshape(-1) for key in keys])
                infos = [TensorInfo.of(key, grads[key]) for key in keys]
                out = scheme.launch_flat(buffer, infos, group).wait()
                assert out is buffer  # decoded in place
                for info, part in zip(infos, torch.split(out, [i.numel for i in infos])):
                    result[info.key] = part.view(info.shape)
            after = {key: m.clone().view(grads[key].shape)
                     for key, m in scheme.memory.buffers.items()}
            trace[label].append({"result": result, "leader": scheme.selection.leader,
                                 "indices": dict(scheme.selection.indices), "grads": grads,
                                 "before": before, "memory": after})
    return trace


def _both_sizes(rank: int, world_size: int) -> dict[int, dict[str, object]]:
    """World sizes 3 and 2 in one spawn: the 2-rank runs use a group of ranks 0 and 1."""
    pair = dist.new_group([0, 1])
    out = {3: _cltk_worker(rank, 3)}
    if rank < 2:
        out[2] = _cltk_worker(rank, 2, pair)
    dist.barrier()
    return out


def _ddp_run(rank: int, group: dist.ProcessGroup | None, scope: str
             ) -> tuple[list[torch.Tensor], list[int]]:
    """Three SGD steps of a small model through DDP with several buckets and clt-k."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 3)).double()
    # torch 2.13 rebuilds a small model into one bucket after the first step unless it
    # looks for unused parameters; then the small cap keeps several buckets.
    wrapped = DistributedDataParallel(model, bucket_cap_mb=0.001, find_unused_parameters=True,
                                      process_group=group)
    scheme = schemes.build("clt-k", ratio=0.1, scope=scope, **ALL)
    launches: list[int] = []
    launch_flat = scheme.launch_flat

    def counted(buffer, infos, group=None, **options):  # type: ignore[no-untyped-def]
        launches.append(len(infos))
        return launch_flat(buffer, infos, group, **options)

    scheme.launch_flat = counted  # type: ignore[method-assign]
    ddp.register(wrapped, scheme)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):
        optimizer.zero_grad()
        inputs = torch.randn(8, 16, generator=generator, dtype=torch.float64)
        wrapped(inputs).square().mean().backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()], launches


def _reference(label: str, world_size: int) -> list[dict[str, object]]:
    """CLT-k written out on all ranks' p in one process (App. E)."""
    name, options = CONFIGS[label]
    ratio, beta = options["ratio"], options.get("beta", 1.0)
    selection = options.get("selection", "chunk")
    memory = [{key: torch.zeros_like(g) for key, g in _worker_grads(0, 0).items()}
              for _ in range(world_size)]
    steps = []
    for step in range(STEPS):
        grads = [_worker_grads(rank, step) for rank in range(world_size)]
        leader = step % world_size
        expected: dict[str, object] = {"leader": leader, "result": {}, "indices": {},
                                       "memory": [{} for _ in range(world_size)]}
        if options.get("scope") == "bucket":  # one top-k over the tensors back to back
            together = torch.cat([(grads[leader][key] + memory[leader][key]).reshape(-1)
                                  for key in grads[0]]).numpy()
            k = int(np.ceil(together.size * ratio - 1e-9))
            picked = sorted(np.argsort(-np.abs(together))[:k].tolist())
            ends = np.cumsum([0] + [g.numel() for g in grads[0].values()])
            shares = {key: torch.tensor([i - ends[j] for i in picked if ends[j] <= i < ends[j + 1]],
                                        dtype=torch.int64)
                      for j, key in enumerate(grads[0])}
        for key in grads[0]:
            ps = [grads[r][key] + memory[r][key] for r in range(world_size)]
            k = max(1, int(np.ceil(ps[0].numel() * ratio - 1e-9)))
            lead = ps[leader].reshape(-1).numpy()
            if options.get("scope") == "bucket":
                chosen = shares[key]
            elif selection == "chunk":
                chosen = torch.tensor(_chunk_reference(lead, k))
            else:
                chosen = torch.tensor(sorted(np.argsort(-np.abs(lead))[:k].tolist()))
            wire = [p.half().to(p.dtype) if options.get("values") == "fp16" else p for p in ps]
            mean = torch.stack(wire).mean(dim=0)
            expected["result"][key] = sparsify(mean, chosen)  # CLT_k of the mean
            expected["indices"][key] = chosen
            for r in range(world_size):
                memory[r][key] = (1 - beta) * memory[r][key] + beta * (
                    ps[r] - sparsify(wire[r], chosen))
                expected["memory"][r][key] = memory[r][key]
        steps.append(expected)
    return steps


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict[str, object]]]:
    per_rank = spawn(_both_sizes, 3)
    return {n: [ranks[n] for ranks in per_rank if n in ranks] for n in (2, 3)}


@pytest.mark.parametrize("label", ["chunk", "exact", "bucket"])
def test_cltk_result_is_cltk_of_the_mean_at_the_leaders_indices(
        runs: dict[int, list[dict[str, object]]], label: str) -> None:
    for n, ranks in runs.items():
        for step, expected in enumerate(_reference(label, n)):
            for rank, run in enumerate(ranks):
                got = run["trace"][label][step]
                assert got["leader"] == expected["leader"] == step % n
                for key, value in expected["result"].items():
                    # float64, exact: the values are chosen so that no sum rounds.
                    assert torch.equal(got["result"][key], value), (n, step, rank, key)
                    assert torch.equal(got["indices"][key], expected["indices"][key])
                    assert torch.equal(got["memory"][key], expected["memory"][rank][key])


def test_cltk_values_at_16_bits_are_averaged_and_remember_what_the_cast_left_out(
        runs: dict[int, list[dict[str, object]]]) -> None:
    """The leader's indices as at full width; the memory keeps ``p - fp16(p)`` there, to the
    bit; the mean is of the fp16 values, summed at 16 bits (so within their rounding)."""
    for n, ranks in runs.items():
        for step, expected in enumerate(_reference("fp16", n)):
            for rank, run in enumerate(ranks):
                got = run["trace"]["fp16"][step]
                for key, value in expected["result"].items():
                    assert torch.equal(got["indices"][key], expected["indices"][key])
                    assert torch.equal(got["memory"][key], expected["memory"][rank][key])
                    rounding = float(value.abs().max()) * 2.0**-8  # a few fp16 ulps of it
                    torch.testing.assert_close(got["result"][key], value, rtol=0, atol=rounding)
                    assert torch.equal(got["result"][key], ranks[0]["trace"]["fp16"][step][
                        "result"][key])
        for run in ranks:  # the same entries as "exact" (fp64), at a quarter of the bytes
            exact, half = (run["bytes"][label]["bytes_per_entity"] for label in ("exact", "fp16"))
            assert half["W_grad"] * 4 == exact["W_grad"] and half["index"] == exact["index"]


@pytest.mark.parametrize("label", ["chunk", "exact", "coupled", "bucket"])
def test_cltk_flat_path_is_bit_identical_to_the_per_tensor_path_across_rebucketing(
        runs: dict[int, list[dict[str, object]]], label: str) -> None:
    for n, ranks in runs.items():
        for rank, run in enumerate(ranks):
            for step, (flat, reference) in enumerate(zip(run["flat"][label],
                                                         run["trace"][label], strict=True)):
                assert flat["leader"] == reference["leader"], (n, rank, step)
                for key, value in reference["result"].items():
                    assert torch.equal(flat["result"][key], value), (n, rank, step, key)
                    assert torch.equal(flat["indices"][key], reference["indices"][key])
                    assert torch.equal(flat["memory"][key], reference["memory"][key])


def test_cltk_flat_path_keeps_the_error_feedback_invariant_exactly(
        runs: dict[int, list[dict[str, object]]]) -> None:
    """beta = 1: ``g + m_old == C(p) + m_new`` entry for entry, on every rank and step."""
    for ranks in runs.values():
        for run in ranks:
            for record in run["flat"]["chunk"]:
                for key, grad in record["grads"].items():
                    old = record["before"].get(key, torch.zeros_like(grad))
                    p = grad + old
                    sent = sparsify(p, record["indices"][key])
                    assert torch.equal(p, sent + record["memory"][key].view(grad.shape))


def test_the_leader_rotates_through_every_rank(
        runs: dict[int, list[dict[str, object]]]) -> None:
    for n, ranks in runs.items():
        for run in ranks:
            leaders = [record["leader"] for record in run["trace"]["chunk"]]
            assert leaders == [step % n for step in range(STEPS)]
            assert set(leaders) == set(range(n))


def test_local_topk_sums_every_ranks_own_topk(runs: dict[int, list[dict[str, object]]]) -> None:
    for n, ranks in runs.items():
        memory = [{key: torch.zeros_like(g) for key, g in _worker_grads(0, 0).items()}
                  for _ in range(n)]
        for step in range(STEPS):
            for key in memory[0]:
                ps = [_worker_grads(r, step)[key] + memory[r][key] for r in range(n)]
                k = max(1, int(np.ceil(ps[0].numel() * 0.02 - 1e-9)))
                sent = [sparsify(p, torch.tensor(_chunk_reference(p.reshape(-1).numpy(), k)))
                        for p in ps]
                expected = torch.stack(sent).sum(dim=0) / n
                for rank in range(n):
                    assert torch.equal(ranks[rank]["trace"]["local"][step]["result"][key],
                                       expected)
                    memory[rank][key] = ps[rank] - sent[rank]


def test_cltk_bytes_per_worker_do_not_grow_with_world_size_but_local_topks_do(
        runs: dict[int, list[dict[str, object]]]) -> None:
    def mean_over_ranks(n: int, label: str, field: str) -> float:
        return float(np.mean([run["bytes"][label][field] for run in runs[n]]))

    # k = 3 + 40 + 1 entries per step: fp64 values all-reduced, indices broadcast (int32 for
    # the conv and the bias, the 16-bit code for fc.weight's 40: 84 bytes instead of 160).
    values = 8 * (3 + 40 + 1)
    index = index_nbytes(3, 108) + index_nbytes(40, 2000) + index_nbytes(1, 20)
    assert index == 12 + 84 + 4
    for n in (2, 3):
        assert mean_over_ranks(n, "chunk", "bytes_sent_per_step") == values + index
        entities = runs[n][0]["bytes"]["chunk"]["bytes_per_entity"]
        assert entities == {"W_grad": values, "index": index}
        # Ring model: all-reduce moves 2(n-1)/n of the values, the rotating broadcast
        # brings the indices into all ranks but the leader; both are bounded in n.
        expected_received = (n - 1) / n * (2 * values + index)
        assert mean_over_ranks(n, "chunk", "bytes_received_per_step") == pytest.approx(
            expected_received)
    # Local top-k hands the same bytes, but every rank receives all n - 1 others'.
    handed = [mean_over_ranks(n, "local", "bytes_sent_per_step") for n in (2, 3)]
    received = [mean_over_ranks(n, "local", "bytes_received_per_step") for n in (2, 3)]
    assert handed[0] == handed[1]
    assert received[1] == pytest.approx(2 * received[0])
    cltk = [mean_over_ranks(n, "chunk", "bytes_received_per_step") for n in (2, 3)]
    assert cltk[1] / cltk[0] == pytest.approx((2 / 3) / (1 / 2))  # ring's 2(n-1)/n, < 2


@pytest.mark.parametrize("scope", ["layer", "bucket"])
def test_cltk_through_the_ddp_hook_with_several_buckets_keeps_replicas_equal(
        runs: dict[int, list[dict[str, object]]], scope: str) -> None:
    (params, launches), (other, _) = (run["ddp"][scope] for run in runs[2])
    assert len(launches) > 3 and sum(launches) == 3 * 4  # several buckets per step
    for mine, theirs in zip(params, other, strict=True):
        assert torch.equal(mine, theirs)
    torch.manual_seed(0)
    start = [p.detach().double() for p in torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3)).parameters()]
    moved = [not torch.equal(a, b) for a, b in zip(start, params, strict=True)]
    # Per layer every tensor sends each step; one selection over a bucket may leave a
    # quiet tensor waiting in the error memory for three steps, but the model trains.
    assert all(moved) if scope == "layer" else any(moved)


@pytest.mark.parametrize("numel,k", [(1, 1), (10, 3), (10, 10), (97, 7), (1001, 13),
                                     (5000, 50), (4096, 1), (50_000, 500)])
def test_exact_selection_returns_k_valid_distinct_indices(numel: int, k: int) -> None:
    values = torch.randn(numel, dtype=torch.float64)
    values[: numel // 4] *= 20  # the largest entries crowd into the first chunks
    chosen = exact_topk(values.abs(), k)
    assert chosen.numel() == k and torch.unique(chosen).numel() == k
    assert torch.equal(chosen, torch.sort(chosen).values)
    assert 0 <= int(chosen.min()) and int(chosen.max()) < numel
    assert captured_energy(values, chosen) == pytest.approx(1.0, abs=1e-12)


def test_captured_energy_against_exact_topk_on_a_known_input() -> None:
    # Chunks of 4 entries for k = 2: chunk 0 holds the top three (4, 3, 2), chunk 1 only 1s.
    values = torch.tensor([4.0, -3.0, 2.0, 0.0, 1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    assert exact_topk(values.abs(), 2).tolist() == [0, 1]
    chunk = chunk_topk(values.abs(), 2)
    assert chunk.tolist() == [0, 4]
    assert captured_energy(values, chunk) == pytest.approx((16 + 1) / (16 + 9), abs=1e-15)
    assert captured_energy(values, exact_topk(values.abs(), 2)) == 1.0
    assert captured_energy(torch.zeros(8), torch.tensor([1, 2])) == 1.0


def test_exact_selection_keeps_the_energy_that_chunks_lose() -> None:
    # Heavy entries clustered in a few rows, as in a layer whose inputs are sparse.
    values = torch.randn(256, 64, dtype=torch.float64) * 0.01
    values[torch.arange(0, 256, 16)] += torch.randn(16, 64, dtype=torch.float64)
    k = layer_k(values.numel(), 0.01)
    exact = captured_energy(values, select(values, k, "exact"))
    chunk = captured_energy(values, select(values, k, "chunk"))
    assert exact == pytest.approx(1.0, abs=1e-12) and chunk < 0.9
