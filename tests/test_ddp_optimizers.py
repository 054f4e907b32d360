"""The DDP hook with the user's optimiser: nothing dropped is that optimiser, per family."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from thinwire import ddp, optim, schemes
from thinwire.launch import spawn
from thinwire.optim import defaults

STEPS = 8
# Adam's default warm-up, shortened in the worker processes: what is tested is the
# mechanism (dense, then compressed, resumed across the switch), not its length.
WARMUP = 4
# Each scheme with nothing dropped: every entry sent (dct-dp refreshing its threshold
# every step), or a rank that covers every matrix, at which PowerSGD sends them dense.
EVERYTHING = {
    "topk": {"ratio": 1.0},
    "dct-dp": {"ratio": 1.0, "life_span": 1},
    "laplace": {"ratio": 1.0, "min_numel": 0},
    "clt-k": {"ratio": 1.0},
    "local-topk": {"ratio": 1.0},
    "powersgd": {"rank": 4},
}
OPTIMIZERS = ("sgd", "nesterov", "adam", "adamw")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 4)).double()


def _optimizer(name: str, parameters: Any) -> torch.optim.Optimizer:
    """The recipes users run, weight decay included."""
    if name in ("sgd", "nesterov"):
        return torch.optim.SGD(parameters, lr=0.1, momentum=0.9, nesterov=name == "nesterov",
                               weight_decay=1e-2)
    if name == "adam":
        return torch.optim.Adam(parameters, lr=1e-2, betas=(0.9, 0.99))
    return torch.optim.AdamW(parameters, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)


def _train(rank: int, net: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 4, generator=generator, dtype=torch.float64)
        loss = (net(x) - x.flip(1)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _run(rank: int, scheme: str | None, config: dict[str, Any], optimizer: str,
         steps: int = STEPS, warmup: int | None = None) -> dict[str, Any]:
    model = _model()
    net = DistributedDataParallel(model, bucket_cap_mb=0.0001)  # several buckets
    chosen = _optimizer(optimizer, net.parameters())
    coupling, options = None, None
    if scheme is not None:
        state = ddp.register(net, schemes.build(scheme, **config), optimizer=chosen,
                             warmup=warmup)
        assert state.coupling is not None
        coupling = (state.coupling.rule, state.coupling.coupled, state.coupling.warmup)
        options = (dict(state.coupling.options), state.scheme.origin[1])
    _train(rank, net, chosen, range(steps))
    return {"params": [p.detach().clone() for p in model.parameters()], "coupling": coupling,
            "options": options}


def _all(rank: int, world_size: int) -> dict[str, Any]:
    defaults.ADAM_WARMUP = WARMUP  # where default_warmup reads it
    out: dict[str, Any] = {}
    for optimizer in OPTIMIZERS:
        out[f"plain-{optimizer}"] = _run(rank, None, {}, optimizer)
        out[f"plain-long-{optimizer}"] = _run(rank, None, {}, optimizer, LONG)
        for name, config in EVERYTHING.items():
            # no warm-up: the coupled path from the first step
            out[f"{name}-{optimizer}"] = _run(rank, name, config, optimizer, warmup=0)
            out[f"{name}-{optimizer}-lossy"] = _run(rank, name, LOSSY[name], optimizer, LONG)
        for name in optim.ADAM_OPTIONS:  # built with no options: the family's own
            out[f"{name}-{optimizer}-own"] = _run(rank, name, {}, optimizer, LONG)
    return out


# The defaults at work: each scheme dropping most of every tensor, past Adam's warm-up.
LONG = WARMUP + 6
LOSSY = {
    "topk": {"ratio": 0.1},
    "dct-dp": {"ratio": 0.1, "life_span": 4},
    "laplace": {"ratio": 0.1, "min_numel": 0},
    "clt-k": {"ratio": 0.1},
    "local-topk": {"ratio": 0.1},
    "powersgd": {"rank": 1},
}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return spawn(_all, 2)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("name", list(EVERYTHING))
def test_nothing_dropped_is_the_users_optimizer(runs: list[dict[str, Any]], name: str,
                                                optimizer: str) -> None:
    """float64, 2 ranks, several buckets: the coupled step (SGD: momentum and weight decay
    in the workers, gradients at the virtual iterate) is the optimiser's own."""
    rule, coupled, _ = runs[0][f"{name}-{optimizer}"]["coupling"]
    sgd = optimizer in ("sgd", "nesterov")
    if name == "powersgd":  # its error feedback is its own, not a momentum's
        assert (rule, coupled) == ("none", False)
    else:
        assert (rule, coupled) == ("momentum" if sgd else "none", sgd)
    for rank in runs:
        for a, b in zip(rank[f"plain-{optimizer}"]["params"],
                        rank[f"{name}-{optimizer}"]["params"]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("name", list(optim.ADAM_OPTIONS))
def test_adams_family_sends_its_own_options_and_replicas_agree(
        runs: list[dict[str, Any]], name: str, optimizer: str) -> None:
    """A scheme built with none of ADAM_OPTIONS' options sends them under Adam and AdamW
    (and only there), registered as a scheme built with them and the family's warm-up;
    replicas stay bit-identical."""
    label = f"{name}-{optimizer}-own"
    chosen, config = runs[0][label]["options"]
    if optimizer in ("sgd", "nesterov"):
        assert chosen == {}
        assert config == schemes.build(name).origin[1]
    else:
        assert chosen == optim.ADAM_OPTIONS[name]  # and the family's warm-up, in the config
        assert config == schemes.build(name, **chosen, warmup_steps=WARMUP).origin[1]
    for a, b in zip(runs[0][label]["params"], runs[1][label]["params"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("name", list(LOSSY))
def test_replicas_stay_bit_identical_under_the_defaults(runs: list[dict[str, Any]], name: str,
                                                        optimizer: str) -> None:
    """register(..., optimizer=) with nothing else: Adam's family warms up dense for
    ADAM_WARMUP steps, then compresses; the replicas agree bit for bit throughout."""
    label = f"{name}-{optimizer}-lossy"
    sgd = optimizer in ("sgd", "nesterov")
    assert runs[0][label]["coupling"][2] == (0 if sgd else WARMUP)
    for a, b in zip(runs[0][label]["params"], runs[1][label]["params"]):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(
        runs[0][label]["params"], runs[0][f"plain-long-{optimizer}"]["params"]))  # it dropped


def _resume(rank: int, name: str, optimizer: str, split: int, steps: int, directory: str,
            order: str) -> list[torch.Tensor]:
    """The checkpoint recipe: train ``split`` steps; each rank saves the model, the
    optimiser and its own scheme state to its own file; everything is rebuilt and
    loaded, the optimiser's state ``order`` register, and training goes on to ``steps``."""
    def build(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
        net = DistributedDataParallel(model, bucket_cap_mb=0.0001)
        return net, _optimizer(optimizer, net.parameters())

    model = _model()
    net, chosen = build(model)
    state = ddp.register(net, schemes.build(name, **LOSSY[name]), optimizer=chosen)
    _train(rank, net, chosen, range(split))
    path = os.path.join(directory, f"{name}-{optimizer}-{split}-{order}-rank{rank}.pt")
    torch.save({"model": model.state_dict(), "optimizer": chosen.state_dict(),
                "scheme": state.state_dict()}, path)
    checkpoint = torch.load(path)
    model = _model()
    model.load_state_dict(checkpoint["model"])
    net, chosen = build(model)
    if order == "before":  # as a script that restores the optimiser before DDP exists
        chosen.load_state_dict(checkpoint["optimizer"])
    state = ddp.register(net, schemes.build(name, **LOSSY[name]), optimizer=chosen)
    if order == "after":
        chosen.load_state_dict(checkpoint["optimizer"])
    state.load_state_dict(checkpoint["scheme"])
    _train(rank, net, chosen, range(split, steps))
    return [p.detach().clone() for p in model.parameters()]


# (optimizer, split, steps): SGD compresses from the first step; AdamW is saved inside
# its dense warm-up and resumed across the switch, and saved after it.
RESUMES = [("sgd", 3, STEPS), ("adamw", WARMUP - 2, LONG), ("adamw", WARMUP + 3, LONG)]


def _resumes(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    defaults.ADAM_WARMUP = WARMUP  # where default_warmup reads it
    out: dict[str, Any] = {}
    for name in LOSSY:
        out[f"{name}-sgd-straight"] = _run(rank, name, LOSSY[name], "sgd")["params"]
        for optimizer, split, steps in RESUMES:
            for order in ("before", "after"):
                out[f"{name}-{optimizer}-{split}-{order}"] = _resume(
                    rank, name, optimizer, split, steps, directory, order)
    return out


@pytest.fixture(scope="module")
def resumed(runs: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory,
            ) -> list[dict[str, Any]]:
    return spawn(_resumes, 2, str(tmp_path_factory.mktemp("checkpoints")))


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize(("optimizer", "split", "steps"), RESUMES)
@pytest.mark.parametrize("name", list(LOSSY))
def test_a_per_rank_checkpoint_resumes_bit_identically(
        runs: list[dict[str, Any]], resumed: list[dict[str, Any]], name: str, optimizer: str,
        split: int, steps: int, order: str) -> None:
    """Loading the optimiser's state before register or after it couples alike."""
    for rank in (0, 1):
        straight = (resumed[rank][f"{name}-sgd-straight"] if optimizer == "sgd"
                    else runs[rank][f"{name}-{optimizer}-lossy"]["params"])
        for a, b in zip(straight, resumed[rank][f"{name}-{optimizer}-{split}-{order}"]):
            assert torch.equal(a, b)


def test_a_disabled_grad_scaler_adds_no_exchange() -> None:
    """float32 training passes ``GradScaler(enabled=False)``: no overflow vote is taken."""
    net = nn.Linear(4, 4)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    state = ddp.hook_state(net, schemes.build("topk"), scaler=scaler)
    assert state.loss_scale is None and state.hold is None
    assert not state.fields["scaler"]
    enabled = ddp.hook_state(net, schemes.build("topk"), scaler=torch.amp.GradScaler("cpu"))
    assert enabled.loss_scale is not None


@pytest.mark.parametrize(("name", "in_hook"), [("topk", True), ("dct-dp", True),
                                               ("clt-k", True), ("powersgd", False),
                                               ("dense", False), ("fp16", False)])
def test_the_hook_state_says_where_clipping_goes(name: str, in_hook: bool) -> None:
    state = ddp.hook_state(nn.Linear(4, 4), schemes.build(name))
    assert state.clips_in_hook is in_hook


def test_register_logs_what_it_chose_and_why(caplog: pytest.LogCaptureFixture) -> None:
    net = nn.Linear(4, 4)
    adamw = torch.optim.AdamW(net.parameters())
    with caplog.at_level("INFO", logger="thinwire.ddp"):
        state = ddp.hook_state(net, schemes.build("topk"), optimizer=adamw)
    assert state.coupling is not None and state.coupling.rule == "none"
    assert [r.getMessage() for r in caplog.records] == [
        f"thinwire.ddp: topk coupled by rule 'none': {state.coupling.reason}"]
    assert f"the first {optim.ADAM_WARMUP} steps averaged dense" in state.coupling.reason
    assert "sends ratio=0.07, values='int8', indices='delta8', the AdamW defaults" in (
        state.coupling.reason)


@pytest.mark.parametrize("spelling", ["topk:ratio=0.01", "topk:values=native",
                                      "topk:ratio=1.0:values=fp16"])
def test_an_option_the_user_gave_keeps_the_scheme_as_built(spelling: str) -> None:
    """Any one of the family's options given: none is chosen, nothing is mixed."""
    net = nn.Linear(4, 4)
    scheme = schemes.build(spelling)
    state = ddp.hook_state(net, scheme, optimizer=torch.optim.AdamW(net.parameters()))
    assert state.coupling is not None and state.coupling.options == {}
    # as built, with the family's warm-up (its own option)
    assert state.scheme.origin == schemes.build(spelling,
                                                warmup_steps=optim.ADAM_WARMUP).origin
    assert "defaults" not in state.coupling.reason


def test_a_scheme_not_built_by_name_is_kept() -> None:
    adam = torch.optim.Adam(nn.Linear(4, 4).parameters())
    bare = schemes.CompressedScheme(schemes.build("topk").values)
    assert optim.follow(adam, bare) == (bare, {})


@pytest.mark.parametrize(("spelling", "warmup"), [
    ("clt-k:warmup_steps=3", 3), ("topk:warmup_steps=3", 3), ("topk:warmup_steps=0", 0)])
def test_a_warm_up_of_the_users_own_is_kept(spelling: str, warmup: int) -> None:
    """A warm-up given to the scheme stays what it was, none (0) too; the options still
    follow."""
    net = nn.Linear(4, 4)
    state = ddp.hook_state(net, schemes.build(spelling),
                           optimizer=torch.optim.AdamW(net.parameters()))
    assert state.scheme.warmup_steps == warmup and state.coupling.warmup == warmup
    assert state.scheme.origin[1].warmup_steps == warmup
    assert state.coupling.options == optim.ADAM_OPTIONS[spelling.split(":")[0]]


def test_the_families_warm_up_is_the_registered_schemes_option() -> None:
    """AdamW's warm-up is in the registered scheme's config, so its fingerprint (what the
    ranks compare) and a rebuild (a rollback) carry it."""
    net = nn.Linear(4, 4)
    state = ddp.hook_state(net, schemes.build("topk"),
                           optimizer=torch.optim.AdamW(net.parameters()))
    assert state.scheme.warmup_steps == optim.ADAM_WARMUP
    assert schemes.fingerprint(state.scheme)["config"]["warmup_steps"] == optim.ADAM_WARMUP
    assert schemes.rebuild(state.scheme).origin == state.scheme.origin


@pytest.mark.parametrize(("family", "warmup", "named"), [
    ("sgd", 2, "warmup_steps=2"), ("adamw", None, "ratio=0.07")])
def test_a_scheme_that_has_run_is_not_rebuilt(family: str, warmup: int | None,
                                              named: str) -> None:
    """A warm-up or the family's options rebuild the scheme, which would lose its state."""
    net = nn.Linear(4, 4)
    scheme = schemes.build("topk")
    scheme.launch({"w": torch.ones(4)})
    optimizer = (torch.optim.SGD(net.parameters(), lr=0.1) if family == "sgd"
                 else torch.optim.AdamW(net.parameters()))
    with pytest.raises(ValueError, match=f"launched or loaded state.*{named}"):
        ddp.hook_state(net, scheme, optimizer=optimizer, warmup=warmup)
