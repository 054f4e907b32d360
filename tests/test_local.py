"""Local updates (DiLoCo, Streaming DiLoCo): against DDP, a single-process reference, resume."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from thinwire import ddp, schemes
from thinwire.comm.fingerprint import PeerMismatchError
from thinwire.launch import spawn
from thinwire.local import LocalConfig, LocalUpdates, split

WORLD = 2
STEPS = 12


def _model(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def _batch(rank: int, step: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor,
                                                                             torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return (torch.randn(5, 6, generator=generator).to(dtype),
            torch.randint(0, 3, (5,), generator=generator))


def _inner_step(model: nn.Module, inner: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = _batch(rank, step, next(model.parameters()).dtype)
    inner.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    inner.step()


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _plain_sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1.0)


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


STREAMING = {"every": 4, "fragments": 2, "delay": 1, "mix": 0.5}


def _updates(rank: int, name: str, **options: Any) -> tuple[nn.Module, LocalUpdates]:
    model = _model()
    return model, LocalUpdates(model, _sgd(model), schemes.build(name, **_CONFIGS[name]),
                               **options)


_CONFIGS: dict[str, dict[str, Any]] = {"dense": {}, "int8": {"chunk": 8},
                                       "topk+int4": {"ratio": 0.3, "chunk": 4}}


def _scenarios(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # DDP with the same inner optimiser
    model = _model()
    net = DistributedDataParallel(model)
    inner = _sgd(net)
    for step in range(STEPS):
        _inner_step(net, inner, rank, step)
    out["ddp"] = _weights(model)
    model = _model()
    updates = LocalUpdates(model, _sgd(model), every=1, outer=_plain_sgd)
    for step in range(STEPS):
        _inner_step(model, updates.inner, rank, step)
        updates.step()
    out["h1"] = _weights(model)
    # Streaming DiLoCo under each scheme, straight through, and stopped and resumed
    for name in _CONFIGS:
        model, updates = _updates(rank, name, **STREAMING)
        landed = []
        for step in range(STEPS):
            _inner_step(model, updates.inner, rank, step)
            landed.append(updates.step())
        out[f"straight {name}"] = _weights(model)
        out[f"landed {name}"] = landed
        out[f"globals {name}"] = {k: v.clone() for k, v in updates.global_state().items()}
    for stop in (1, 3, 4, 5, 7):
        model, updates = _updates(rank, "topk+int4", **STREAMING)
        for step in range(stop):
            _inner_step(model, updates.inner, rank, step)
            updates.step()
        buffer = io.BytesIO()
        torch.save(updates.state_dict(), buffer)
        del model, updates
        model, updates = _updates(rank, "topk+int4", **STREAMING)
        buffer.seek(0)
        updates.load_state_dict(torch.load(buffer, weights_only=False))
        for step in range(stop, STEPS):
            _inner_step(model, updates.inner, rank, step)
            updates.step()
        out[f"resumed {stop}"] = _weights(model)
    # Every registered scheme averages pseudo-gradients
    for name in schemes.names():
        model = _model(torch.float32)
        updates = LocalUpdates(model, _sgd(model), schemes.build(name), every=2)
        for step in range(4):
            _inner_step(model, updates.inner, rank, step)
            updates.step()
        out[f"every scheme {name}"] = _weights(model)
    # Peers that differ are refused on every rank
    for label, options, name in (("every", {"every": 4 + rank}, "dense"),
                                 ("fragments", {"every": 4, "fragments": 1 + rank}, "dense"),
                                 ("scheme", {"every": 4}, "dense" if rank else "int8"),
                                 ("eager", {"every": 4, "eager": rank == 1}, "dense")):
        try:
            _updates(rank, name, **options)
            out[f"refused {label}"] = None
        except PeerMismatchError as error:
            out[f"refused {label}"] = str(error)
    # Ranks seeded differently start from rank 0's weights (and resume with its outer state)
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(torch.float64)
    out["own initial weights"] = _weights(model)
    updates = LocalUpdates(model, _sgd(model), every=2)
    out["started"] = (_weights(model), [g.clone() for g in updates.global_state().values()])
    for step in range(4):
        _inner_step(model, updates.inner, rank, step)
        updates.step()
    state = updates.state_dict()
    for momentum in state["outer"]["state"].values():  # each rank's own outer momentum
        momentum["momentum_buffer"].add_(rank)
    state["steps"] += rank
    updates.load_state_dict(state)
    out["resumed outer"] = (updates.outer.state_dict(), updates.steps)
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(torch.float64)
    try:
        LocalUpdates(model, _sgd(model), every=2, broadcast=False)
        out["refused own weights"] = None
    except PeerMismatchError as error:
        out["refused own weights"] = str(error)
    # A quantised scheme through the DDP hook keeps the replicas identical
    model = _model(torch.float32)
    net = DistributedDataParallel(model)
    ddp.register(net, schemes.build("int4", chunk=8))
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(3):
        _inner_step(net, inner, rank, step)
    gathered = [torch.zeros(sum(p.numel() for p in model.parameters())) for _ in range(world_size)]
    dist.all_gather(gathered, torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    out["hook replicas identical"] = all(torch.equal(gathered[0], g) for g in gathered)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return spawn(_scenarios, WORLD, timeout_s=300, deadline_s=600)


def test_h1_with_plain_outer_sgd_and_dense_exchange_equals_ddp(
        runs: list[dict[str, Any]]) -> None:
    """Equal within 1e-12 in fp64, not bit for bit: the pseudo-gradient is a difference
    of weights, rounded at the weights' magnitude rather than the update's."""
    for rank in range(WORLD):
        for got, expected in zip(runs[rank]["h1"], runs[rank]["ddp"]):
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    # and not trivially: training moved the weights
    assert not torch.allclose(runs[0]["ddp"][0], _weights(_model())[0])


def _reference(name: str) -> list[list[torch.Tensor]]:
    """Streaming DiLoCo of WORLD workers in one process: each worker's own scheme instance
    (its error memory) encodes its delta alone; the mean is taken in rank order."""
    config = LocalConfig(**STREAMING)
    models = [_model() for _ in range(WORLD)]
    inners = [_sgd(m) for m in models]
    codecs = [schemes.build(name, **_CONFIGS[name]) for _ in range(WORLD)]
    names = [n for n, _ in models[0].named_parameters()]
    fragments = [[names[i] for i in run]
                 for run in split([p.numel() for p in models[0].parameters()], 2)]
    globals_ = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    outer = torch.optim.SGD(list(globals_.values()), lr=0.7, momentum=0.9, nesterov=True)
    in_flight: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}
    for step in range(1, STEPS + 1):
        for rank in range(WORLD):
            _inner_step(models[rank], inners[rank], rank, step - 1)
        for f, keys in enumerate(fragments):
            if (step + config.delay - config.offset(f)) % config.every == 0:
                sent = []
                for rank in range(WORLD):
                    params = dict(models[rank].named_parameters())
                    deltas = {k: globals_[k] - params[k].detach() for k in keys}
                    sent.append(codecs[rank].reduce(deltas))  # alone: what it sent
                mean = {k: torch.zeros_like(globals_[k]) for k in keys}
                for contribution in sent:
                    for k in keys:
                        mean[k].add_(contribution[k])
                in_flight[f] = (step + config.delay,
                                {k: v / WORLD if name != "dense" else v / WORLD
                                 for k, v in mean.items()})
            if f in in_flight and in_flight[f][0] == step:
                _, mean = in_flight.pop(f)
                for k in keys:
                    globals_[k].grad = mean[k]
                outer.step()
                for k in keys:
                    globals_[k].grad = None
                    for model in models:
                        local = dict(model.named_parameters())[k].detach()
                        local.lerp_(globals_[k], 1.0 - config.mix)
    return [_weights(m) for m in models]


@pytest.mark.parametrize("name", list(_CONFIGS))
def test_the_exchange_of_two_workers_equals_a_single_process_reference(
        name: str, runs: list[dict[str, Any]]) -> None:
    expected = _reference(name)
    for rank in range(WORLD):
        for got, want in zip(runs[rank][f"straight {name}"], expected[rank]):
            if name == "dense":  # gloo's all-reduce divides first, then sums
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            else:  # decoded and summed in rank order, as the reference does
                assert torch.equal(got, want)
    for key, value in runs[0][f"globals {name}"].items():
        assert torch.equal(value, runs[1][f"globals {name}"][key])


@pytest.mark.parametrize("name", schemes.names())
def test_every_scheme_averages_pseudo_gradients_into_identical_replicas(
        name: str, runs: list[dict[str, Any]]) -> None:
    start = _weights(_model(torch.float32))
    for got, other in zip(runs[0][f"every scheme {name}"], runs[1][f"every scheme {name}"]):
        assert torch.equal(got, other) and bool(torch.isfinite(got).all())
    assert any(not torch.equal(got, initial)
               for got, initial in zip(runs[0][f"every scheme {name}"], start))


def test_fragments_land_at_staggered_steps(runs: list[dict[str, Any]]) -> None:
    # every 4, two fragments, delay 1: fragment 0 lands at steps 2, 6, 10; fragment 1 at 4, 8, 12
    assert runs[0]["landed dense"] == [[], [0], [], [1], [], [0], [], [1], [], [0], [], [1]]


@pytest.mark.parametrize("stop", [1, 3, 4, 5, 7])
def test_resume_is_bit_identical_after_a_stop_at_any_step(
        stop: int, runs: list[dict[str, Any]]) -> None:
    for rank in range(WORLD):
        for got, want in zip(runs[rank][f"resumed {stop}"], runs[rank]["straight topk+int4"]):
            assert torch.equal(got, want)


@pytest.mark.parametrize(("label", "field"), [("every", "local.every"),
                                              ("fragments", "local.fragments"),
                                              ("scheme", "'scheme'"),
                                              ("eager", "local.eager")])
def test_peers_that_differ_are_refused_on_every_rank(label: str, field: str,
                                                     runs: list[dict[str, Any]]) -> None:
    messages = [runs[rank][f"refused {label}"] for rank in range(WORLD)]
    assert messages[0] is not None and messages[0] == messages[1]
    assert field in messages[0] and "local updates" in messages[0]


def test_ranks_seeded_differently_start_from_rank_0s_weights_to_the_bit(
        runs: list[dict[str, Any]]) -> None:
    own = [runs[rank]["own initial weights"] for rank in range(WORLD)]
    assert not torch.equal(own[0][0], own[1][0])  # the seeds did differ
    for rank in range(WORLD):
        local, global_ = runs[rank]["started"]
        for got_local, got_global, want in zip(local, global_, own[0]):
            assert torch.equal(got_local, want) and torch.equal(got_global, want)


def test_a_resumed_outer_optimiser_state_and_step_count_are_rank_0s(
        runs: list[dict[str, Any]]) -> None:
    (outer_0, steps_0), (outer_1, steps_1) = (runs[rank]["resumed outer"] for rank in range(2))
    assert steps_0 == steps_1 == 4
    assert outer_0["state"].keys() == outer_1["state"].keys() and outer_0["state"]
    for key, state in outer_0["state"].items():
        assert torch.equal(state["momentum_buffer"], outer_1["state"][key]["momentum_buffer"])


def test_ranks_that_keep_their_own_differing_weights_are_refused_on_every_rank(
        runs: list[dict[str, Any]]) -> None:
    messages = [runs[rank]["refused own weights"] for rank in range(WORLD)]
    assert messages[0] is not None and messages[0] == messages[1]
    assert "'weights'" in messages[0] and "broadcast=False" in messages[0]


def test_a_quantised_scheme_through_the_ddp_hook_keeps_replicas_identical(
        runs: list[dict[str, Any]]) -> None:
    assert runs[0]["hook replicas identical"] and runs[1]["hook replicas identical"]


@pytest.mark.parametrize(("every", "fragments"), [(1, 1), (6, 1), (6, 3), (7, 2), (10, 4)])
def test_fragments_cover_every_parameter_exactly_once_per_cycle(every: int,
                                                                fragments: int) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    updates = LocalUpdates(model, torch.optim.SGD(model.parameters(), lr=0.1), every=every,
                           fragments=fragments)
    synced: list[list[str]] = []
    for _ in range(3 * every):
        synced.append([name for f in updates.step() for name in updates.fragments[f]])
    for cycle in range(3):
        names = [n for step in synced[cycle * every: (cycle + 1) * every] for n in step]
        assert sorted(names) == sorted(n for n, _ in model.named_parameters())


def test_split_is_contiguous_balanced_and_never_empty() -> None:
    assert split([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert split([1000, 1, 1, 1], 3) == [[0], [1], [2, 3]]
    assert split([1, 1, 1, 1000], 2) == [[0, 1, 2], [3]]
    with pytest.raises(ValueError, match="fragments=3 exceeds the 2"):
        split([1, 1], 3)


@pytest.mark.parametrize(("options", "match"), [
    ({"every": 0}, "every=0"), ({"fragments": 0}, "fragments=0"),
    ({"every": 2, "fragments": 3}, "fragments=3"), ({"every": 4, "fragments": 2, "delay": 2},
                                                    "delay=2"),
    ({"mix": 1.0}, "mix=1.0"), ({"delay": -1}, "delay=-1")])
def test_bad_options_are_refused_by_name(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LocalConfig(**options)


def test_a_state_saved_under_other_options_is_refused() -> None:
    model = _model()
    state = LocalUpdates(model, _sgd(model), every=4).state_dict()
    with pytest.raises(ValueError, match="saved with"):
        LocalUpdates(model, _sgd(model), every=5).load_state_dict(state)
