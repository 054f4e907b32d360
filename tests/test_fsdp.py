"""FSDP2 inside a site, a scheme across sites: 4 ranks on gloo, 2 sites x 2 shards.

One spawn runs every scenario (starting 4 processes is most of the cost), the compare
job's ranks included; the tests read its results.
"""

from __future__ import annotations

import copy
import io
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import randomk
from thinwire import fsdp, optim
from thinwire.cli import main
from thinwire.comm.fingerprint import PeerMismatchError
from thinwire.jobs import compare as compare_job
from thinwire.jobs.dataparallel import RunOptions
from thinwire.launch import spawn
from thinwire.local import LocalUpdates, nesterov
from thinwire.schemes import build

SITES, SHARDS = 2, 2
STEPS = 4
WARM = 2  # steps of a warm-up
TOPK = ("topk", {"ratio": 0.2, "min_numel": 0})
DCT = ("dct-dp", {"life_span": 2, "min_numel": 0, "piece": 0})
LOSSY = {"topk": TOPK, "dct-dp": DCT, "fp16": ("fp16", {}),
         "powersgd": ("powersgd", {"rank": 1}), "clt-k": ("clt-k", {"ratio": 0.2}),
         randomk.NAME: (randomk.NAME, {"ratio": 0.2})}  # a new selection, in one class
WATCHED = ("topk", "dct-dp", randomk.NAME)


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 33 and 5 rows over 2 shards: the last shard of each is padded
    return nn.Sequential(nn.Linear(12, 33), nn.ReLU(), nn.Linear(33, 5))


def _shard(model: nn.Module, mesh: Any) -> nn.Module:
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 12, generator=generator), torch.randint(0, 5, (6,), generator=generator)


def _local(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().to_local().clone() for p in model.parameters()]  # type: ignore[operator]


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = _batch(rank, step)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


def _native(rank: int, mesh: Any, adamw: bool = False) -> list[list[torch.Tensor]]:
    """Native HSDP on the 2-D mesh: each step's local shards."""
    model = _shard(_model(), mesh)
    optimizer = (torch.optim.AdamW(model.parameters(), lr=0.01) if adamw
                 else torch.optim.SGD(model.parameters(), lr=0.1))
    history = []
    for step in range(STEPS):
        _step(model, optimizer, rank, step)
        history.append(_local(model))
    return history


def _thinwire(rank: int, mesh: Any, name: str, config: dict[str, Any],
              watch: bool = False) -> dict[str, Any]:
    """FSDP on the shard mesh, ``name`` across sites. ``watch``: record each hook call's
    input, error before and after, and result (for the error-feedback invariant)."""
    model = _shard(_model(), mesh["shard"])
    scheme = build(name, **config)
    state = fsdp.register(model, scheme, mesh["site"].get_group())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: list[dict[str, Any]] = []
    if watch:
        for sub in fsdp.fsdp_modules(model):
            group = sub._get_fsdp_state()._fsdp_param_groups[0]
            sub.set_all_reduce_hook(_watched(group._all_reduce_hook, calls))
    history = []
    for step in range(STEPS):
        _step(model, optimizer, rank, step)
        history.append(_local(model))
    return {"history": history, "calls": calls, "hook_calls": state.calls}


def _adamw(rank: int, mesh: Any, warmup: int | None) -> dict[str, Any]:
    """``topk`` registered with AdamW, as a user would: the family's options and warm-up."""
    model = _shard(_model(), mesh["shard"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = fsdp.register(model, build("topk", min_numel=0), mesh["site"].get_group(),
                          optimizer=optimizer, warmup=warmup)
    history = []
    for step in range(STEPS):
        _step(model, optimizer, rank, step)
        history.append(_local(model))
    return {"history": history, "coupling": state.coupling,
            "config": state.scheme.origin[1], "warmup": state.scheme.warmup_steps}


def _watched(exchange: Any, calls: list[dict[str, Any]]) -> Any:
    memory = exchange.state.scheme.memory

    def hook(buffer: torch.Tensor) -> None:
        keys = [s.name for s in exchange.layout]
        before = {key: memory.buffers[key].clone() if key in memory.buffers else None
                  for key in keys}
        grad = buffer.clone()
        exchange(buffer)
        after = {key: memory.buffers[key].clone() for key in keys}
        calls.append({"grad": grad, "before": before, "after": after, "result": buffer.clone(),
                      "numels": [s.shape for s in exchange.layout]})

    return hook


def _ef_invariant(calls: list[dict[str, Any]], group: Any) -> list[str]:
    """Per call and shard: p = g + e_old is sent + e_new exactly (disjoint supports), and
    the mean of what the sites sent is the result, bit for bit."""
    failures = []
    for index, call in enumerate(calls):
        offset = 0
        sent_all = []
        for key, shape in zip(call["after"], call["numels"]):
            numel = int(torch.tensor(shape).prod())
            grad = call["grad"][offset: offset + numel]
            offset += numel
            old = call["before"][key]
            p = grad if old is None else grad + old.reshape(-1)
            new = call["after"][key].reshape(-1)
            sent = torch.where(new == 0, p, torch.zeros_like(p))
            if not torch.equal(sent + new, p) or bool((sent * new != 0).any()):
                failures.append(f"call {index} {key}: p != sent + e_new")
            sent_all.append(sent)
        sent_flat = torch.cat(sent_all)
        gathered = [torch.empty_like(sent_flat) for _ in range(SITES)]
        dist.all_gather(gathered, sent_flat, group=group)
        mean = (gathered[0] + gathered[1]) / SITES
        if not torch.equal(mean, call["result"]):
            failures.append(f"call {index}: result is not the mean of what was sent")
    return failures


def _resume(rank: int, mesh: Any, split: int, directory: str,
            adamw: bool = False) -> list[torch.Tensor]:
    """dct-dp coupled to SGD momentum (``adamw``: registered with AdamW, its options and a
    warm-up of WARM steps); after ``split`` steps everything goes through a distributed
    checkpoint and is rebuilt."""

    def build_all() -> tuple[nn.Module, Any, torch.optim.Optimizer]:
        model = _shard(_model(), mesh["shard"])
        group = mesh["site"].get_group()
        if adamw:
            optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
            state = fsdp.register(model, build(*DCT[:1], **DCT[1]), group,
                                  optimizer=optimizer, warmup=WARM)
            return model, state, optimizer
        state = fsdp.register(model, build(*DCT[:1], **DCT[1]), group)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        assert optim.couple(optimizer, state).coupled
        return model, state, optimizer

    model, state, optimizer = build_all()
    for step in range(split):
        _step(model, optimizer, rank, step)
    if split < STEPS:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd, "thinwire": state.checkpoint()},
                 checkpoint_id=directory)
        model, state, optimizer = build_all()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        loaded = {"model": model_sd, "optim": optim_sd, "thinwire": state.checkpoint()}
        dcp.load(loaded, checkpoint_id=directory)
        set_state_dict(model, optimizer, model_state_dict=loaded["model"],
                       optim_state_dict=loaded["optim"])
        for step in range(split, STEPS):
            _step(model, optimizer, rank, step)
    return _local(model)


def _mismatch(rank: int, mesh: Any, odd: int) -> str:
    """Rank ``odd`` (every rank of site 1 when -1) registers topk, the others dct-dp."""
    model = _shard(_model(), mesh["shard"])
    differs = rank == odd or (odd == -1 and rank >= SHARDS)
    name, config = TOPK if differs else DCT
    try:
        fsdp.register(model, build(name, **config), mesh["site"].get_group())
    except PeerMismatchError as error:
        return str(error)
    return ""


class _Unused(nn.Module):
    """The test model and a layer its forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.unused = _model(), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]


def _refusals(rank: int, mesh: Any) -> dict[str, str]:
    """What register and the hook refuse: native HSDP's 2-D sharding; a parameter without
    a gradient (and that FSDP's own switch for it fixes it)."""
    out = {}
    try:
        fsdp.register(_shard(_model(), mesh), build("dense"), mesh["site"].get_group())
    except ValueError as error:
        out["2-d"] = str(error)
    for unused in (False, True):
        model = _Unused()
        fully_shard(model, mesh=mesh["shard"])
        if unused:
            model.set_reduce_scatter_unused_params(True)
        state = fsdp.register(model, build("topk", ratio=0.5, min_numel=0),
                              mesh["site"].get_group())
        x, y = _batch(rank, 0)
        try:
            nn.functional.cross_entropy(model(x), y).backward()
            out[f"unused-{unused}"] = "trained"
        except RuntimeError as error:
            out[f"unused-{unused}"] = str(error)
    try:  # local updates on native HSDP's sharding: FSDP would cross sites every step
        model = _shard(_model(), mesh)
        LocalUpdates(model, _inner(model), group=mesh["site"].get_group())
    except ValueError as error:
        out["local 2-d"] = str(error)
    try:  # the state of the rank beside it in the site
        state.load_state_dict({**state.state_dict(), "shard": 1 - state.shard})
    except ValueError as error:
        out["other-shard"] = str(error)
    return out


# DiLoCo on the sharded model: every site trains its own replica (FSDP inside it), each
# shard's pseudo-gradient crosses sites. Dense: H = 2, one fragment, 4 steps (2 syncs).
# Lossy: Streaming DiLoCo, H = 4 in 2 fragments landing tau = 1 step late, 6 steps.
LOCAL_STEPS = {"dense": 4, "topk+int4": 6}
LOCAL_OPTIONS = {"dense": {"every": 2}, "topk+int4": {"every": 4, "fragments": 2, "delay": 1}}
LOCAL_SCHEMES = {"dense": {}, "topk+int4": {"ratio": 0.2, "chunk": 4, "min_numel": 0}}


def _inner(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _diloco_build(mesh: Any, name: str) -> tuple[nn.Module, LocalUpdates]:
    model = _shard(_model(), mesh["shard"])
    return model, LocalUpdates(model, _inner(model), build(name, **LOCAL_SCHEMES[name]),
                               group=mesh["site"].get_group(), **LOCAL_OPTIONS[name])


def _diloco(rank: int, mesh: Any, name: str, stop: int | None = None) -> dict[str, Any]:
    """Each step's local shards, globals, fragments landed and (after a landing) the whole
    landed parameters. ``stop``: after that many steps the state goes through
    torch.save / torch.load into a fresh model, inner optimiser and LocalUpdates."""
    model, updates = _diloco_build(mesh, name)
    out: dict[str, Any] = {"fragments": updates.fragments, "history": [], "globals": [],
                           "landed": [], "whole": []}
    for step in range(LOCAL_STEPS[name]):
        if step == stop:
            buffer = io.BytesIO()
            torch.save(updates.state_dict(), buffer)
            del model, updates
            model, updates = _diloco_build(mesh, name)
            buffer.seek(0)
            updates.load_state_dict(torch.load(buffer, weights_only=False))
        _step(model, updates.inner, rank, step)
        landed = updates.step()
        out["history"].append(_local(model))
        out["globals"].append([g.clone() for g in updates.global_state().values()])
        out["landed"].append(landed)
        params = dict(model.named_parameters())
        out["whole"].append({key: params[key].detach().full_tensor()  # type: ignore[operator]
                             for fragment in landed for key in updates.fragments[fragment]})
    return out


# The compare job with sites, and the work it hands its ranks: (scheme, options) per run.
SITES_SCHEMES, SITES_EXTRA = ["native-hsdp", "dense", "topk"], ["ratio=0.1"]
SITES_OPTIONS = RunOptions(steps=4, eval_every=2, hidden=16, eval_rows=200)
SITES_RUNS = [("native-hsdp", {}), ("dense", {}), ("topk", {"ratio": 0.1})]


def _all_scenarios(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    randomk.register()
    mesh = fsdp.site_mesh(SITES)
    site_group = mesh["site"].get_group()
    watched = {name: _thinwire(rank, mesh, *LOSSY[name], watch=True) for name in WATCHED}
    return {
        "native": _native(rank, mesh),
        "native adamw": _native(rank, mesh, adamw=True),
        "adamw": _adamw(rank, mesh, WARM),
        "adamw default": _adamw(rank, mesh, None),
        "dense": _thinwire(rank, mesh, "dense", {}),
        **{name: _thinwire(rank, mesh, *LOSSY[name]) for name in ("fp16", "powersgd", "clt-k")},
        **{name: {**run, "calls": len(run["calls"]),
                  "failures": _ef_invariant(run["calls"], site_group)}
           for name, run in watched.items()},
        "straight": _resume(rank, mesh, STEPS, directory),
        "resumed": _resume(rank, mesh, 2, directory),
        **{f"adamw resumed {split}": _resume(rank, mesh, split, f"{directory}/adamw-{split}",
                                             adamw=True) for split in (WARM - 1, WARM + 1, STEPS)},
        "mismatch-site": _mismatch(rank, mesh, -1),
        "mismatch-rank": _mismatch(rank, mesh, 1),
        "refusals": _refusals(rank, mesh),
        "diloco dense": _diloco(rank, mesh, "dense"),
        "diloco topk+int4": _diloco(rank, mesh, "topk+int4"),
        "diloco resumed": _diloco(rank, mesh, "topk+int4", stop=3),
        # in a rank, on its threads, as the sharded runs compute
        "diloco reference": _diloco_reference() if rank == 0 else None,
        # what the ranks of `compare(SITES_SCHEMES, ...)` do (the test answers its spawn)
        "compare": compare_job._worker(rank, world_size, SITES_RUNS, SITES_OPTIONS, SITES),
    }


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="thinwire-dcp-") as directory:
        return spawn(_all_scenarios, SITES * SHARDS, directory, deadline_s=600.0)


def test_dense_is_bit_identical_to_native_hsdp(runs: list[dict[str, Any]]) -> None:
    # 2 x 2 ranks: FSDP averages pairs inside the site, dense averages pairs across sites
    # by halving before summing; halving is exact and a sum of two is commutative, so
    # the result is native HSDP's average of four, bit for bit.
    for rank in runs:
        assert rank["dense"]["hook_calls"] == 2 * STEPS  # one per sharded Linear per step
        for native, dense in zip(rank["native"], rank["dense"]["history"]):
            for a, b in zip(native, dense):
                assert torch.equal(a, b)
    assert not torch.equal(runs[0]["native"][0][0], runs[0]["native"][-1][0])  # it trained


def test_register_with_adamw_chooses_its_options_and_warms_up_per_launch(
        runs: list[dict[str, Any]]) -> None:
    """Each sharded Linear is launched on its own (FSDP); a shard's warm-up counts its own
    launches, so the first steps are native HSDP's to the bit, and the options follow."""
    for rank in runs:
        run = rank["adamw"]
        for step, (native, warmed) in enumerate(zip(rank["native adamw"], run["history"])):
            same = all(torch.equal(a, b) for a, b in zip(native, warmed))
            assert same == (step < WARM), step
        assert run["coupling"].warmup == run["warmup"] == WARM
        assert run["coupling"].options == optim.ADAM_OPTIONS["topk"]
        assert run["config"].ratio == optim.ADAM_OPTIONS["topk"]["ratio"]
        assert run["config"].min_numel == 0  # what the user gave stays
        assert rank["adamw default"]["warmup"] == optim.ADAM_WARMUP
        assert "averaged dense" in rank["adamw default"]["coupling"].reason


@pytest.mark.parametrize("name", ["adamw", *LOSSY])
def test_replicas_across_sites_stay_identical(runs: list[dict[str, Any]], name: str) -> None:
    for shard in range(SHARDS):
        first, second = runs[shard][name]["history"], runs[SHARDS + shard][name]["history"]
        for a_step, b_step in zip(first, second):
            for a, b in zip(a_step, b_step):
                assert torch.equal(a, b)
    # the shards differ (each rank holds its own part), and the scheme changed training
    assert runs[0][name]["history"][-1][0].shape != runs[1][name]["history"][-1][0].shape
    assert not torch.equal(runs[0][name]["history"][-1][0], runs[0]["dense"]["history"][-1][0])


@pytest.mark.parametrize("name", WATCHED)
def test_error_feedback_invariant_holds_exactly_per_shard(runs: list[dict[str, Any]],
                                                          name: str) -> None:
    for rank in runs:
        assert rank[name]["calls"] == 2 * STEPS
        assert rank[name]["failures"] == []


def test_resume_through_distributed_checkpoint_is_bit_identical(
        runs: list[dict[str, Any]]) -> None:
    for rank in runs:
        for a, b in zip(rank["straight"], rank["resumed"]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("split", [WARM - 1, WARM + 1])
def test_resume_on_either_side_of_the_warm_up_is_bit_identical(
        runs: list[dict[str, Any]], split: int) -> None:
    """Registered with AdamW: the shards' warm-up counts and the options' state resume."""
    for rank in runs:
        for a, b in zip(rank[f"adamw resumed {STEPS}"], rank[f"adamw resumed {split}"]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["mismatch-site", "mismatch-rank"])
def test_mismatched_schemes_are_refused_on_every_rank(runs: list[dict[str, Any]],
                                                      case: str) -> None:
    messages = [rank[case] for rank in runs]
    assert all("'scheme' is" in message for message in messages), messages
    assert len(set(messages)) == 1  # the same error everywhere


def test_register_refuses_what_it_cannot_exchange(runs: list[dict[str, Any]]) -> None:
    with pytest.raises(ValueError, match="no parameter of the module was sharded"):
        fsdp.register(_model(), build("dense"), None)
    for rank in runs:
        refusals = rank["refusals"]
        assert "native HSDP" in refusals["2-d"]
        assert "set_reduce_scatter_unused_params(True)" in refusals["unused-False"]
        assert refusals["unused-True"] == "trained"
        assert "the checkpoint's shard is" in refusals["other-shard"]
        assert "sharded on a 2-D mesh" in refusals["local 2-d"]


@pytest.mark.parametrize("argv", [
    ["compare", "--workers", "4", "--sites", "3"],
    ["compare", "--workers", "4", "--sites", "0"],
    ["compare", "--workers", "2", "--sites", "4"],
    ["compare", "--workers", "4", "--schemes", "native-hsdp"],  # the anchor needs --sites
])
def test_cli_refuses_sites_that_do_not_split_the_workers(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "--sites" in error and "Traceback" not in error


def test_train_refuses_sites_that_do_not_split_the_world(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "6")
    assert main(["train", "--scheme", "topk", "--sites", "4"]) == 2
    assert "choose one of [1, 2, 3, 6]" in capsys.readouterr().err


def test_compare_with_sites_trains_sharded_and_meters_the_cross_site_link(
        runs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """compare() itself, its spawn answered by the module's ranks, which ran the same work."""

    def spawned(fn: Any, workers: int, *args: Any, **kwargs: Any) -> list[Any]:
        assert (fn, workers, args) == (compare_job._worker, SITES * SHARDS,
                                       (SITES_RUNS, SITES_OPTIONS, SITES))
        return copy.deepcopy([rank["compare"] for rank in runs])

    monkeypatch.setattr(compare_job, "spawn", spawned)
    results = compare_job.compare(SITES_SCHEMES, SITES * SHARDS, SITES_OPTIONS, 100e6,
                                  extra=SITES_EXTRA, sites=SITES)
    native, dense, topk = results
    assert all(r["replicas_identical"] for r in results)
    assert native["sites"] == 2 and native["shards_per_site"] == 2
    # dense through the hook is native HSDP: the same model, the same bytes across sites
    assert native["test_accuracy"] == dense["test_accuracy"]
    assert native["final_loss"] == dense["final_loss"]
    assert native["bytes_sent_per_step"] == dense["bytes_sent_per_step"]
    assert dense["compression_ratio"] == 1.0  # against the shard, not the whole model
    assert topk["bytes_sent_per_step"] < dense["bytes_sent_per_step"] / 5


def _diloco_reference() -> list[list[list[torch.Tensor]]]:
    """DiLoCo of the SITES sites in one process, each on the whole model: a site's gradient
    is the mean of its SHARDS ranks' gradients, halved before summing as FSDP does on gloo
    (exact), the pseudo-gradients averaged likewise (the dense scheme). Each step's weights,
    by site."""
    models = [_model() for _ in range(SITES)]
    inners = [_inner(m) for m in models]
    globals_ = [p.detach().clone() for p in models[0].parameters()]
    outer = nesterov()(globals_)
    history: list[list[list[torch.Tensor]]] = [[] for _ in range(SITES)]
    for step in range(LOCAL_STEPS["dense"]):
        for site, (model, inner) in enumerate(zip(models, inners)):
            grads = []
            for shard in range(SHARDS):
                model.zero_grad()
                x, y = _batch(site * SHARDS + shard, step)
                nn.functional.cross_entropy(model(x), y).backward()
                grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
            for p, *shard_grads in zip(model.parameters(), *grads):
                p.grad = sum(g / SHARDS for g in shard_grads[1:]) + shard_grads[0] / SHARDS
            inner.step()
        if (step + 1) % LOCAL_OPTIONS["dense"]["every"] == 0:
            with torch.no_grad():
                for position, weight in enumerate(globals_):
                    deltas = [weight - list(m.parameters())[position] for m in models]
                    weight.grad = deltas[0] / SITES + deltas[1] / SITES
                outer.step()
                for weight in globals_:
                    weight.grad = None
                for model in models:
                    for p, weight in zip(model.parameters(), globals_):
                        p.copy_(weight)
        for site, model in enumerate(models):
            history[site].append(_weights(model))
    return history


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_diloco_on_a_sharded_model_with_dense_exchange_equals_the_unsharded_reference(
        runs: list[dict[str, Any]]) -> None:
    # Bit for bit: the rank computes its gradient on the all-gathered (whole) weights as
    # the reference does, FSDP's mean of two is exact halving and one commutative sum, and
    # the inner and outer optimisers are elementwise, so a shard of the whole is the whole's
    # shard. The reference runs inside a rank: on another thread count the batch sums of
    # the backward round differently (by an ulp).
    reference = runs[0]["diloco reference"]
    for rank, run in enumerate(runs):
        site, shard = divmod(rank, SHARDS)
        assert run["diloco dense"]["landed"] == [[], [0], [], [0]]
        for got_step, want_step in zip(run["diloco dense"]["history"], reference[site]):
            for got, want in zip(got_step, want_step):
                assert torch.equal(got, torch.chunk(want, SHARDS, dim=0)[shard])
    # not trivially: the sites trained apart between syncs, and the syncs moved the weights
    assert not torch.equal(reference[0][0][0], reference[1][0][0])
    assert torch.equal(reference[0][1][0], reference[1][1][0])
    assert not torch.equal(reference[0][1][0], _weights(_model())[0])


def test_diloco_with_a_lossy_scheme_keeps_sites_identical_and_shards_consistent(
        runs: list[dict[str, Any]]) -> None:
    run = [rank["diloco topk+int4"] for rank in runs]
    # the ranks of a site agree on the fragments (whole parameters) and on when they land
    assert all(r["fragments"] == run[0]["fragments"] for r in run)
    assert len(run[0]["fragments"]) == 2
    assert all(r["landed"] == run[0]["landed"] for r in run)
    assert run[0]["landed"] == [[], [0], [], [1], [], [0]]
    landings = 0
    for shard in range(SHARDS):
        first, second = run[shard], run[SHARDS + shard]
        for step in range(LOCAL_STEPS["topk+int4"]):
            # the global weights are the same on both sites at every step
            for a, b in zip(first["globals"][step], second["globals"][step]):
                assert torch.equal(a, b)
            # a landed fragment's weights are the global ones on both sites, shard by
            # shard and as whole parameters assembled inside each site
            names = [n for n, _ in _model().named_parameters()]
            for fragment in first["landed"][step]:
                for key in first["fragments"][fragment]:
                    position = names.index(key)
                    assert torch.equal(first["history"][step][position],
                                       first["globals"][step][position])
                    assert torch.equal(first["history"][step][position],
                                       second["history"][step][position])
                    assert torch.equal(first["whole"][step][key], second["whole"][step][key])
                    landings += 1
    assert landings > 0
    # the sites trained apart between landings
    assert not torch.equal(run[0]["history"][0][0], run[SHARDS]["history"][0][0])


def test_diloco_on_a_sharded_model_resumes_bit_identically(runs: list[dict[str, Any]]) -> None:
    # stopped at step 3 with fragment 1's exchange in flight (it lands at step 4)
    for rank in runs:
        straight, resumed = rank["diloco topk+int4"], rank["diloco resumed"]
        assert resumed["landed"] == straight["landed"]
        for a_step, b_step in zip(straight["history"], resumed["history"]):
            for a, b in zip(a_step, b_step):
                assert torch.equal(a, b)
