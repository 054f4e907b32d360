"""dAD, edAD, rank-dAD, dSGD and PowerSGD across 2 and 3 gloo sites against pooled training."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from thinwire.autodiff import DistributedAutodiff
from thinwire.autodiff.power import reconstruct, structured_power_iterations
from thinwire.comm import Meter
from thinwire.comm.fingerprint import PeerMismatchError
from thinwire.compress.lowrank import seeded_normal
from thinwire.launch import spawn
from thinwire.models.gru import GRUClassifier

MLP = (6, 8, 7, 4)  # input, two hidden layers, four classes
WIDE = (20, 32, 4)  # a first layer that PowerSGD compresses at rank 4
STEPS = 2
Batches = list[list[tuple[torch.Tensor, torch.Tensor]]]  # [site][step] -> (x, y)


class _Elman(nn.Module):
    """A hand-built recurrent net: h_t = tanh(W_x·x_t + W_h·h_{t-1}), logits averaged over t,
    so the output layer too is called once per time step."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 6)
        self.rec = nn.Linear(6, 6, bias=False)
        self.out = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[0], 6)
        logits = []
        for t in range(x.shape[1]):
            h = torch.tanh(self.inp(x[:, t]) + self.rec(h))
            logits.append(self.out(h))
        return torch.stack(logits).mean(0)


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gru":
        return GRUClassifier(3, 4, hidden=5, widths=(6,)).double()
    if kind == "elman":
        return _Elman().double()
    sizes = MLP if kind == "mlp" else WIDE
    layers: list[nn.Module] = []
    activations = [nn.ReLU(), nn.Tanh(), nn.LeakyReLU(0.1)]
    for i, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(activations[i])
    return nn.Sequential(*layers).double()


def _batches(kind: str, sizes: list[int]) -> Batches:
    """Per site, STEPS batches of that site's size; site s holds only its own classes."""
    generator = torch.Generator().manual_seed(1)
    classes = 4
    out: Batches = []
    for site, size in enumerate(sizes):
        own = [c for c in range(classes) if c % len(sizes) == site]
        steps = []
        for _ in range(STEPS):
            width = MLP[0] if kind == "mlp" else WIDE[0]
            shape = (size, 5, 3) if kind in RECURRENT else (size, width)
            x = torch.randn(shape, generator=generator, dtype=torch.float64)
            y = torch.tensor(own, dtype=torch.int64)[torch.randint(len(own), (size,),
                                                                   generator=generator)]
            steps.append((x, y))
        out.append(steps)
    return out


def _train(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
           engine: DistributedAutodiff | None) -> list[dict[str, torch.Tensor]]:
    """SGD steps; the gradients used at each step (synchronised, or plain autograd)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    used = []
    for x, y in batches:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if engine is not None:
            engine.synchronize()
        used.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
    return used


def _pooled(kind: str, data: Batches) -> list[dict[str, torch.Tensor]]:
    steps = [(torch.cat([site[t][0] for site in data]), torch.cat([site[t][1] for site in data]))
             for t in range(STEPS)]
    return _train(_model(kind), steps, None)


def _sites(rank: int, world_size: int, scenarios: list[dict[str, Any]],
           group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    results = {}
    for scenario in scenarios:
        data = scenario["data"]
        site = scenario.get("assignment", list(range(world_size)))[rank]
        model = _model(scenario["kind"])
        meter = Meter(rank, world_size)
        mode, options = scenario.get("per_rank", {}).get(rank, (scenario["mode"],
                                                               scenario.get("options", {})))
        engine = DistributedAutodiff(model, mode, group, meter=meter, **options)
        try:
            grads = _train(model, data[site], engine)
        except PeerMismatchError as error:
            results[scenario["label"]] = {"error": str(error)}
            continue
        qs = engine.powersgd.state_dict()["selection"]["codec"]["qs"]
        results[scenario["label"]] = {"grads": grads, "records": meter.records, "q": qs,
                                      "ranks": engine.ranks.records}
    return results


def _max_error(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> float:
    return max(float((x[k] - y[k]).abs().max()) for x, y in zip(a, b, strict=True) for k in x)


RECURRENT = ("gru", "elman")
SIZES_2 = [5, 3]
SIZES_3 = [4, 2, 3]


def _both(rank: int, world_size: int, two: list[dict[str, Any]],
          three: list[dict[str, Any]]) -> dict[str, Any]:
    """Three sites, then two on a group of ranks 0 and 1: one spawn for every scenario."""
    pair = dist.new_group([0, 1])
    out = {"three": _sites(rank, 3, three)}
    if rank < 2:
        out["two"] = _sites(rank, 2, two, pair)
    dist.barrier()
    return out


THREE_DATA = _batches("mlp", SIZES_3)
THREE = [{"label": m, "kind": "mlp", "mode": m, "data": THREE_DATA}
         for m in ("dad", "edad", "dsgd")]
THREE += [{"label": f"{kind}-{sizes}", "kind": kind, "mode": "edad",
           "data": _batches(kind, sizes)}
          for kind in RECURRENT for sizes in (SIZES_3, [3, 3, 3])]
THREE_SCENARIOS = {scenario["label"]: scenario for scenario in THREE}


@pytest.fixture(scope="module")
def three_sites(two_and_three: tuple[list[dict[str, Any]], list[dict[str, Any]]]
                ) -> list[dict[str, Any]]:
    return two_and_three[1]


@pytest.fixture(scope="module")
def two_sites(two_and_three: tuple[list[dict[str, Any]], list[dict[str, Any]]]
              ) -> list[dict[str, Any]]:
    return two_and_three[0]


@pytest.fixture(scope="module")
def two_and_three() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    mlp, gru, elman = (_batches(k, SIZES_2) for k in ("mlp", "gru", "elman"))
    wide = _batches("wide", [3, 1])  # pooled batch 4: every gradient has rank <= 4
    equal = _batches("mlp", [4, 4])
    scenarios = [
        {"label": "dad", "kind": "mlp", "mode": "dad", "data": mlp},
        {"label": "edad", "kind": "mlp", "mode": "edad", "data": mlp},
        {"label": "dsgd", "kind": "mlp", "mode": "dsgd", "data": mlp},
        {"label": "private", "kind": "mlp", "mode": "dad", "data": mlp,
         "options": {"private_input": True}},
        {"label": "edad-private", "kind": "mlp", "mode": "edad", "data": mlp,
         "options": {"private_input": True}},
        {"label": "rank-dad", "kind": "mlp", "mode": "rank-dad", "data": mlp,
         "options": {"rank": 3, "iterations": 5}},
        {"label": "rank-dad-swapped", "kind": "mlp", "mode": "rank-dad", "data": mlp,
         "options": {"rank": 3, "iterations": 5}, "assignment": [1, 0]},
        {"label": "powersgd", "kind": "wide", "mode": "powersgd", "data": wide,
         "options": {"rank": 4}},
        {"label": "gru-dad", "kind": "gru", "mode": "dad", "data": gru},
        {"label": "gru-rank-dad", "kind": "gru", "mode": "rank-dad", "data": gru,
         "options": {"rank": 8, "iterations": 60, "theta": 0.0}},
        {"label": "dad-equal", "kind": "mlp", "mode": "dad", "data": equal},
        {"label": "edad-equal", "kind": "mlp", "mode": "edad", "data": equal},
        {"label": "gru-edad", "kind": "gru", "mode": "edad", "data": gru},
        {"label": "gru-edad-equal", "kind": "gru", "mode": "edad",
         "data": _batches("gru", [4, 4])},
        {"label": "elman-edad", "kind": "elman", "mode": "edad", "data": elman},
        {"label": "elman-edad-equal", "kind": "elman", "mode": "edad",
         "data": _batches("elman", [4, 4])},
        {"label": "mode-mismatch", "kind": "mlp", "mode": "dad", "data": mlp,
         "per_rank": {1: ("rank-dad", {})}},
        {"label": "rank-mismatch", "kind": "mlp", "mode": "rank-dad", "data": mlp,
         "per_rank": {0: ("rank-dad", {"rank": 2}), 1: ("rank-dad", {"rank": 3})}},
    ]
    results = spawn(_both, 3, scenarios, THREE)
    return ([{"scenarios": {s["label"]: s for s in scenarios}, **r["two"]} for r in results[:2]],
            [r["three"] for r in results])


@pytest.mark.parametrize("mode", ["dad", "edad", "dsgd", "private", "edad-private"])
def test_exact_modes_equal_pooled_training_on_two_sites(two_sites: list[dict[str, Any]],
                                                        mode: str) -> None:
    pooled = _pooled("mlp", two_sites[0]["scenarios"][mode]["data"])
    for rank in range(2):
        assert _max_error(two_sites[rank][mode]["grads"], pooled) < 1e-10


def test_dad_on_the_gru_equals_pooled_training(two_sites: list[dict[str, Any]]) -> None:
    pooled = _pooled("gru", two_sites[0]["scenarios"]["gru-dad"]["data"])
    for rank in range(2):
        assert _max_error(two_sites[rank]["gru-dad"]["grads"], pooled) < 1e-10


@pytest.mark.parametrize("label", ["gru-edad", "gru-edad-equal", "elman-edad",
                                   "elman-edad-equal"])
def test_edad_on_recurrent_models_equals_pooled_training_on_two_sites(
        two_sites: list[dict[str, Any]], label: str) -> None:
    scenario = two_sites[0]["scenarios"][label]
    pooled = _pooled(scenario["kind"], scenario["data"])
    for rank in range(2):
        assert _max_error(two_sites[rank][label]["grads"], pooled) < 1e-10


def test_edad_on_a_recurrent_model_sends_one_delta_block(
        two_sites: list[dict[str, Any]]) -> None:
    """Only the output layer's Δ crosses the wire; every call's inputs do (§3.5)."""
    n, steps, itemsize = 4, 5, 8
    records = two_sites[0]["elman-edad-equal"]["records"]
    assert _bytes(records, "delta") == _bytes(records, "delta", "out") == n * steps * 4 * itemsize
    assert _bytes(records, "activation", "inp") == n * steps * 3 * itemsize
    assert _bytes(records, "activation", "rec") == n * steps * 6 * itemsize


def test_rank_dad_on_the_gru_is_exact_when_each_site_fits_the_rank(
        two_sites: list[dict[str, Any]]) -> None:
    """A site's (A, Δ) of the classifier layers have ≤ batch rows, ≤ 8 = r: nothing is cut.
    The GRU cells stack 5 time steps per sample and are truncated, so only the head is exact."""
    pooled = _pooled("gru", two_sites[0]["scenarios"]["gru-rank-dad"]["data"])
    got = two_sites[0]["gru-rank-dad"]["grads"][0]
    for name in ("head.0.weight", "head.0.bias", "head.2.weight", "head.2.bias"):
        assert torch.allclose(got[name], pooled[0][name], atol=1e-7), name
    layers = {layer for _, layer, _ in two_sites[0]["gru-rank-dad"]["ranks"]}
    assert layers == {"x2h", "h2h", "head.0", "head.2"}


def _local_statistics(model: nn.Module, x: torch.Tensor, y: torch.Tensor
                      ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Each Linear layer's ``[A, 1]`` and Δ on one site's batch, by plain hooks."""
    acts: dict[str, torch.Tensor] = {}
    deltas: dict[str, torch.Tensor] = {}

    def keep(name: str):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple[torch.Tensor], out: torch.Tensor) -> None:
            a = args[0]
            acts[name] = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], 1)
            out.register_hook(lambda g: deltas.__setitem__(name, g))
        return hook

    handles = [layer.register_forward_hook(keep(name)) for name, layer in model.named_modules()
               if isinstance(layer, nn.Linear)]
    F.cross_entropy(model(x), y).backward()
    for handle in handles:
        handle.remove()
    return acts, deltas


def test_rank_dad_is_the_weighted_sum_of_site_approximations(
        two_sites: list[dict[str, Any]]) -> None:
    """Recompute each site's factors here, with the engine's seeds, and sum them."""
    data = two_sites[0]["scenarios"]["rank-dad"]["data"]
    model = _model("mlp")
    x = [site[0][0] for site in data]
    y = [site[0][1] for site in data]
    total = sum(len(v) for v in y)
    expected: dict[str, torch.Tensor] = {}
    for s in range(2):
        acts, deltas = _local_statistics(model, x[s], y[s])
        for name in acts:
            def start(j: int, name: str = name, width: int = deltas[name].shape[1]
                      ) -> torch.Tensor:
                return seeded_normal(f"{name}/0/{j}", (width,), 0, dtype=torch.float64)
            f = structured_power_iterations(acts[name], deltas[name], 3, start, iterations=5)
            part = reconstruct(f.acts, f.deltas) * (len(y[s]) / total)
            expected[name] = expected.get(name, 0) + part
    for rank in range(2):
        got = two_sites[rank]["rank-dad"]["grads"][0]
        for name, aug in expected.items():
            assert torch.allclose(got[f"{name}.weight"], aug[:, :-1], atol=1e-12)
            assert torch.allclose(got[f"{name}.bias"], aug[:, -1], atol=1e-12)


def test_rank_dad_does_not_depend_on_which_rank_holds_which_site(
        two_sites: list[dict[str, Any]]) -> None:
    assert _max_error(two_sites[0]["rank-dad"]["grads"],
                      two_sites[0]["rank-dad-swapped"]["grads"]) < 1e-12
    assert _max_error(two_sites[1]["rank-dad"]["grads"],
                      two_sites[0]["rank-dad"]["grads"]) == 0.0


def test_powersgd_is_exact_when_the_pooled_gradient_fits_the_rank(
        two_sites: list[dict[str, Any]]) -> None:
    pooled = _pooled("wide", two_sites[0]["scenarios"]["powersgd"]["data"])
    for rank in range(2):
        assert _max_error(two_sites[rank]["powersgd"]["grads"], pooled) < 1e-9
    q0, q1 = two_sites[0]["powersgd"]["q"], two_sites[1]["powersgd"]["q"]
    assert set(q0) == {"0.weight"}  # the 4x32 output layer does not compress: dense
    assert torch.equal(q0["0.weight"], q1["0.weight"])


def _bytes(records: list[Any], entity: str, layer: str | None = None) -> int:
    return sum(r.nbytes for r in records if r.entity == entity and r.step == 0
               and (layer is None or r.layer == layer))


def test_bytes_per_step_follow_the_formulas_of_section_3(
        two_sites: list[dict[str, Any]]) -> None:
    """dAD sends N·(h_in + h_out) per layer (§3.2), edAD N·h_in plus N·C once (§3.3)."""
    n, itemsize = 4, 8
    layers = list(zip(MLP, MLP[1:], strict=False))
    names = ["0", "2", "4"]
    for rank in range(2):
        dad = two_sites[rank]["dad-equal"]["records"]
        edad = two_sites[rank]["edad-equal"]["records"]
        for name, (h_in, h_out) in zip(names, layers, strict=True):
            assert _bytes(dad, "activation", name) == n * h_in * itemsize
            assert _bytes(dad, "delta", name) == n * h_out * itemsize
            assert _bytes(edad, "activation", name) == n * h_in * itemsize
        assert _bytes(edad, "delta") == n * MLP[-1] * itemsize
        header = 8 * (1 + 2 * len(layers)) + 8  # batch and row counts, and the length round
        assert _bytes(dad, "size") == header
        assert _bytes(dad, "activation", "(padding)") == 0
        dad_total = sum(r.nbytes for r in dad if r.step == 0)
        edad_total = sum(r.nbytes for r in edad if r.step == 0)
        payload = n * itemsize * sum(a + b for a, b in layers)
        assert dad_total == payload + header
        assert _bytes(edad, "size") == 8 * (1 + len(layers) + 1) + 8
        edad_header = 8 * (1 + len(layers) + 1) + 8
        assert edad_total == n * itemsize * (sum(MLP[:-1]) + MLP[-1]) + edad_header


def test_private_input_keeps_the_first_layers_inputs_home(
        two_sites: list[dict[str, Any]]) -> None:
    for label in ("private", "edad-private"):
        records = two_sites[0][label]["records"]
        assert _bytes(records, "activation", "0") == 0
        assert _bytes(records, "W_grad", "0") == MLP[1] * (MLP[0] + 1) * 8
        assert _bytes(records, "activation", "2") > 0


def test_unequal_batches_pad_the_smaller_site(two_sites: list[dict[str, Any]]) -> None:
    big, small = (two_sites[r]["dad"]["records"] for r in range(2))
    width = sum(a + b for a, b in zip(MLP, MLP[1:], strict=False)) * 8
    assert _bytes(big, "activation", "(padding)") == 0
    assert _bytes(small, "activation", "(padding)") == (SIZES_2[0] - SIZES_2[1]) * width


def test_exact_modes_equal_pooled_training_on_three_sites(
        three_sites: list[dict[str, Any]]) -> None:
    for label, scenario in THREE_SCENARIOS.items():
        pooled = _pooled(scenario["kind"], scenario["data"])
        for result in three_sites:
            assert _max_error(result[label]["grads"], pooled) < 1e-10, label


@pytest.mark.parametrize(("label", "field"), [("mode-mismatch", "'config.mode'"),
                                              ("rank-mismatch", "'config.rank'")])
def test_mismatched_sites_raise_the_same_error_on_every_site(two_sites: list[dict[str, Any]],
                                                             label: str, field: str) -> None:
    errors = [two_sites[rank][label]["error"] for rank in range(2)]
    assert errors[0] == errors[1] and "the dAD engine" in errors[0]
    assert f"{field} is" in errors[0]
