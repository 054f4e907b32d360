"""The DC-ASGD benchmark's protocol: the search reads the validation split, never the test set."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from benchmarks import async_ps
from thinwire.jobs import ps_task as task_module
from thinwire.jobs.ps_task import ClassifierTask, TaskSpec
from thinwire.ps.rules import PAPER_LAMBDA


class _Sealed:
    """Stands in for the test set: any use of it fails the test."""

    def __getattr__(self, name: str) -> Any:
        pytest.fail(f"the test set was read (.{name})")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        pytest.fail(f"the test set was read ({getattr(func, '__name__', func)})")


@pytest.fixture
def sealed_test_set(monkeypatch: pytest.MonkeyPatch) -> None:
    images = task_module._images("digits")
    sealed = dataclasses.replace(images, x_test=_Sealed(), y_test=_Sealed())
    monkeypatch.setattr(task_module, "_images", lambda name: sealed)


def _args(**changes: Any) -> Any:
    args = async_ps.parser().parse_args([])
    for key, value in {"workers": [2], "search_seeds": [0], "passes": 1, "train_limit": 200,
                       "validation": 50, "lr_grid": [0.05, 0.1], "harsh_lr": 0.15,
                       "lambda_abs_grid": [0.5, 2.0], "lambda_square_grid": [0.04, 4.0],
                       **changes}.items():
        setattr(args, key, value)
    return args


def test_the_seal_catches_a_read_of_the_test_set(sealed_test_set: None) -> None:
    task = ClassifierTask(TaskSpec(train_limit=200))
    with pytest.raises(pytest.fail.Exception, match="test set was read"):
        task.evaluate(task.initial_weights())


def test_the_search_never_reads_the_test_set(sealed_test_set: None) -> None:
    args = _args()
    chosen = async_ps.search(args, async_ps.simulated_runner)
    assert chosen["sequential_lr"] in args.lr_grid
    choice = chosen["workers=2"]
    assert choice["lr"]["harsh"] == 0.15 and choice["lr"]["paper"] in args.lr_grid
    for key, grid in (("paper/abs", args.lambda_abs_grid), ("harsh/square",
                                                            args.lambda_square_grid)):
        scores = choice["lambda"][key]["scores"]
        assert set(scores) == set(grid)
        assert choice["lambda"][key]["chosen"] == min(grid, key=lambda v: (scores[v], v))


def test_holdout_takes_the_last_training_examples_out_of_training() -> None:
    task = ClassifierTask(TaskSpec(train_limit=200, holdout=50))
    whole = ClassifierTask(TaskSpec(train_limit=200))
    assert task.train_size == 150
    assert task.x_held.equal(whole.x_train[150:])
    assert set(task.evaluate(task.initial_weights())) == {"validation_error", "validation_loss"}
    with pytest.raises(ValueError, match="holdout=200"):
        ClassifierTask(TaskSpec(train_limit=200, holdout=200))


def test_the_report_runs_the_papers_lambdas_and_the_chosen_ones_in_both_regimes() -> None:
    args = _args()
    chosen = {"sequential_lr": 0.1, "workers=2": {
        "lr": {"paper": 0.05, "harsh": 0.15},
        "lambda": {"paper/abs": {"chosen": 0.5}, "paper/square": {"chosen": 0.04},
                   "harsh/abs": {"chosen": 2.0}, "harsh/square": {"chosen": 4.0}}}}
    runs = {(regime, label): rule for regime, label, _, _, rule in async_ps.plan(args, chosen)}
    assert runs[("paper", "dc-asgd-abs paper λ=2")] == {"lr": 0.05, "variant": "abs",
                                                         "lam": PAPER_LAMBDA["abs"]}
    assert runs[("paper", "dc-asgd-abs chosen λ=0.5")]["lam"] == 0.5
    assert ("paper", "dc-asgd-square chosen λ=0.04") not in runs  # the paper's value: one run
    assert runs[("harsh", "dc-asgd-square paper λ=0.04")]["lr"] == 0.15
    assert {label for regime, label in runs if regime == "harsh"} >= {"ssgd", "asgd"}
