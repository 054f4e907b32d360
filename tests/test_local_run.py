"""``diloco`` and ``diloco+SCHEME`` in thinwire compare: names, options, one small run."""

from __future__ import annotations

import pytest
import torch

from thinwire import schemes
from thinwire.jobs import local_run
from thinwire.jobs.compare import compare, parse_options, scheme_config
from thinwire.jobs.dataparallel import RunOptions
from thinwire.local import LocalUpdates


def test_names_split_into_local_updates_and_their_scheme() -> None:
    assert local_run.is_local("diloco") and local_run.is_local("diloco+topk+int2")
    assert not local_run.is_local("dense") and not local_run.is_local("dilocox")
    assert local_run.inner_scheme("diloco") == "dense"
    assert local_run.inner_scheme("diloco+topk+int2") == "topk+int2"


def test_options_reach_the_local_run_and_its_scheme_alike() -> None:
    names = ["dense", "diloco+dct-dp", "diloco+int4"]
    assert parse_options(["every=20", "chunk=64"], names) == {"every": 20, "chunk": 64}
    with pytest.raises(ValueError, match="'nothing' is not an option of dense, ddp, diloco"):
        parse_options(["nothing=1"], names)
    config = scheme_config("diloco+dct-dp", 0.1, 10, ["every=20", "chunk=64"])
    assert config == {"ratio": 0.1, "life_span": 10, "every": 20}
    assert scheme_config("dense", 0.1, 10, ["every=20"]) == {}
    options, scheme = local_run.parts("diloco+dct-dp", config)
    assert options.every == 20 and scheme == {"ratio": 0.1, "life_span": 10}
    assert parse_options(["eager=true"], ["diloco+sparseloco"]) == {"eager": True}
    options, scheme = local_run.parts("diloco+sparseloco", {"eager": True, "k": 2})
    assert options.eager and scheme == {"k": 2}
    local_run.validate("diloco+sparseloco", {"eager": True})


def test_h_follows_the_scheme_unless_given() -> None:
    sparse = local_run.parts("diloco+sparseloco", {})[0].resolved(schemes.build("sparseloco"))
    plain = local_run.parts("diloco+int4", {})[0].resolved(schemes.build("int4"))
    assert (sparse.every, sparse.outer_lr, sparse.outer_momentum) == (10, 1.0, 0.0)
    assert (plain.every, plain.outer_lr, plain.outer_momentum) == (50, 0.7, 0.9)
    given = local_run.parts("diloco+sparseloco", {"every": 30})[0]
    assert given.resolved(schemes.build("sparseloco")).every == 30
    model = torch.nn.Linear(3, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    assert LocalUpdates(model, inner, schemes.build("sparseloco")).config.every == 10
    assert LocalUpdates(model, inner).config.every == 50
    assert LocalUpdates(model, inner, schemes.build("sparseloco"), every=7).config.every == 7


@pytest.mark.parametrize(("name", "config", "match"), [
    ("diloco", {"every": 0}, "every=0"), ("diloco", {"outer_lr": 0.0}, "outer_lr=0.0"),
    ("diloco+int4", {"chunk": 0}, "chunk=0"), ("diloco+nothing", {}, "unknown scheme"),
    ("diloco", {"eager": True, "overlap": True}, "eager=True .*overlap=True")])
def test_bad_local_runs_are_refused_before_anything_is_spawned(name: str, config: dict[str, int],
                                                               match: str) -> None:
    with pytest.raises(ValueError, match=match):
        local_run.validate(name, config)


def test_a_local_run_through_compare_keeps_replicas_identical_and_meters_the_syncs() -> None:
    options = RunOptions(steps=8, eval_every=4, batch_size=16, hidden=16)
    results = compare(["diloco", "diloco+int8"], 2, options, 1e8, extra=["every=4"],
                      timeout_s=300)
    for result in results:
        assert result["replicas_identical"]
        assert result["local"]["syncs"] == 2
    dense, int8 = results
    # dense pseudo-gradients: every parameter's fp32 bytes once a sync, over 8 steps
    assert dense["bytes_sent_per_step"] == pytest.approx(dense["dense_bytes_per_step"] * 2 / 8)
    assert int8["bytes_sent_per_step"] < dense["bytes_sent_per_step"] / 3
