"""FSDP2 inside a site, a scheme across sites: 4 ranks on gloo, 2 sites x 2 shards.

One spawn runs every scenario (starting 4 processes is most of the cost); the tests
read its results.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from thinwire import fsdp, optim
from thinwire.cli import main
from thinwire.comm.fingerprint import PeerMismatchError
from thinwire.jobs.compare import compare
from thinwire.jobs.dataparallel import RunOptions
from thinwire.launch import spawn
from thinwire.schemes import build

SITES, SHARDS = 2, 2
STEPS = 4
TOPK = ("topk", {"ratio": 0.2, "min_numel": 0})
DCT = ("dct-dp", {"life_span": 2, "min_numel": 0, "piece": 0})
LOSSY = {"topk": TOPK, "dct-dp": DCT, "fp16": ("fp16", {}),
         "powersgd": ("powersgd", {"rank": 1}), "clt-k": ("clt-k", {"ratio": 0.2})}


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


def _native(rank: int, mesh: Any) -> list[list[torch.Tensor]]:
    """Native HSDP on the 2-D mesh: each step's local shards."""
    model = _shard(_model(), mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
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


def _resume(rank: int, mesh: Any, split: int, directory: str) -> list[torch.Tensor]:
    """dct-dp coupled to SGD momentum; after ``split`` steps everything goes through a
    distributed checkpoint and is rebuilt."""

    def build_all() -> tuple[nn.Module, Any, torch.optim.Optimizer]:
        model = _shard(_model(), mesh["shard"])
        state = fsdp.register(model, build(*DCT[:1], **DCT[1]), mesh["site"].get_group())
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
    try:  # the state of the rank beside it in the site
        state.load_state_dict({**state.state_dict(), "shard": 1 - state.shard})
    except ValueError as error:
        out["other-shard"] = str(error)
    return out


def _all_scenarios(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    mesh = fsdp.site_mesh(SITES)
    site_group = mesh["site"].get_group()
    watched = {name: _thinwire(rank, mesh, *LOSSY[name], watch=True) for name in ("topk",
                                                                                 "dct-dp")}
    return {
        "native": _native(rank, mesh),
        "dense": _thinwire(rank, mesh, "dense", {}),
        **{name: _thinwire(rank, mesh, *LOSSY[name]) for name in ("fp16", "powersgd", "clt-k")},
        **{name: {**run, "calls": len(run["calls"]),
                  "failures": _ef_invariant(run["calls"], site_group)}
           for name, run in watched.items()},
        "straight": _resume(rank, mesh, STEPS, directory),
        "resumed": _resume(rank, mesh, 2, directory),
        "mismatch-site": _mismatch(rank, mesh, -1),
        "mismatch-rank": _mismatch(rank, mesh, 1),
        "refusals": _refusals(rank, mesh),
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


@pytest.mark.parametrize("name", LOSSY)
def test_replicas_across_sites_stay_identical(runs: list[dict[str, Any]], name: str) -> None:
    for shard in range(SHARDS):
        first, second = runs[shard][name]["history"], runs[SHARDS + shard][name]["history"]
        for a_step, b_step in zip(first, second):
            for a, b in zip(a_step, b_step):
                assert torch.equal(a, b)
    # the shards differ (each rank holds its own part), and the scheme changed training
    assert runs[0][name]["history"][-1][0].shape != runs[1][name]["history"][-1][0].shape
    assert not torch.equal(runs[0][name]["history"][-1][0], runs[0]["dense"]["history"][-1][0])


@pytest.mark.parametrize("name", ["topk", "dct-dp"])
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
        tmp_path: Any) -> None:
    results = compare(["native-hsdp", "dense", "topk"], 4,
                      RunOptions(steps=4, eval_every=2, hidden=16, eval_rows=200), 100e6,
                      extra=["ratio=0.1"], sites=2)
    native, dense, topk = results
    assert all(r["replicas_identical"] for r in results)
    assert native["sites"] == 2 and native["shards_per_site"] == 2
    # dense through the hook is native HSDP: the same model, the same bytes across sites
    assert native["test_accuracy"] == dense["test_accuracy"]
    assert native["final_loss"] == dense["final_loss"]
    assert native["bytes_sent_per_step"] == dense["bytes_sent_per_step"]
    assert dense["compression_ratio"] == 1.0  # against the shard, not the whole model
    assert topk["bytes_sent_per_step"] < dense["bytes_sent_per_step"] / 5
