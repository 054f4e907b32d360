"""Workloads: every one builds, trains a step offline, and the CLI resolves its recipe."""

from __future__ import annotations

import argparse
import functools
import math
import os
from collections.abc import Iterator

import pytest
import torch

from thinwire.cli import compare
from thinwire.data import criteo, pysource
from thinwire.data.imagesets import FASHION_MNIST_DIR
from thinwire.jobs import workloads
from thinwire.jobs.dataparallel import RunOptions, recipe, same_trajectory
from thinwire.models import dlrm

NAMES = [name for name in workloads.WORKLOADS
         if name != "fashion-convnet" or os.path.isdir(FASHION_MNIST_DIR)]


@functools.cache
def _loaded(name: str, seed: int = 0) -> workloads.Workload:
    """``workloads.load(name, seed)`` once for every test that only reads it (a Workload is
    frozen); the tests that prove a load repeats itself load afresh."""
    return workloads.load(name, seed=seed)


@pytest.fixture(scope="module", autouse=True)
def _forget_loaded() -> Iterator[None]:
    yield
    _loaded.cache_clear()  # the data sets are large: keep them for this module only


@pytest.mark.parametrize("name", NAMES)
def test_workload_builds_the_same_model_per_seed_and_learns_a_step(name: str) -> None:
    work = _loaded(name)
    first, second = work.model(0), work.model(0)
    for a, b in zip(first.parameters(), second.parameters()):
        assert torch.equal(a, b)
    assert set(workloads.RECIPES[name]) == {"optimizer", "momentum", "lr", "batch_size",
                                            "steps"}
    if work.metric == "bits per byte":  # below a uniform guess over the 256 bytes
        assert work.lower_is_better and 0.0 < work.target < 8.0
    elif work.lower_is_better:  # a log loss of two classes: below a coin's
        assert work.metric == "test loss" and 0.0 < work.target < math.log(2)
    else:
        assert work.metric == "test accuracy" and 0.5 < work.target < 1.0
    shard = work.train.shard(1, 3)
    assert len(shard) == len(work.train) // 3
    batch = shard.rows(slice(0, 16))
    recipe = workloads.RECIPES[name]
    optimizer = workloads.optimizer(recipe["optimizer"], first.parameters(), recipe["lr"],
                                    recipe["momentum"])
    losses = []
    for _ in range(2):
        loss = work.loss(first(batch.inputs, **batch.side), batch.targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[1] < losses[0]
    assert 0.0 <= work.accuracy(first, rows=64) <= 1.0
    assert work.reached(work.target) and not work.reached(
        work.target + (1.0 if work.lower_is_better else -1.0) * 0.01)


def test_recipe_fills_what_the_command_line_leaves_unset() -> None:
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    options = compare.run_options(parser.parse_args(["--workload", "transformer-digits"]))
    assert (options.optimizer, options.lr, options.momentum, options.coupling,
            options.warmup) == ("adamw", 1e-3, 0.9, "auto", None)
    options = compare.run_options(parser.parse_args(
        ["--optimizer", "nesterov", "--lr", "0.1", "--momentum", "0.5", "--no-couple"]))
    assert (options.workload, options.optimizer, options.lr, options.momentum,
            options.coupling) == ("digits-mlp", "nesterov", 0.1, 0.5, "none")
    options = compare.run_options(parser.parse_args(["--coupling", "momentum",
                                                     "--warmup", "20"]))
    assert (options.coupling, options.warmup) == ("momentum", 20)
    assert options.weight_decay is None  # torch's own default, whichever optimiser


def test_a_recipe_recorded_before_a_field_existed_reads_it_at_its_default() -> None:
    now = recipe(RunOptions(workload="dlrm-large", steps=800))
    older = {k: v for k, v in now.items() if k not in ("beta2", "schedule", "tied")}
    assert same_trajectory(older, now) and same_trajectory(now, older)
    assert same_trajectory({**older, "steps": 4000}, now)  # a constant rate: budget aside
    assert not same_trajectory({**older, "beta2": 0.95}, now)
    assert not same_trajectory(older, {**now, "schedule": "cosine"})


def test_weight_decay_is_the_users_or_torchs_default() -> None:
    params = [torch.nn.Parameter(torch.zeros(1))]
    assert workloads.optimizer("adamw", params, 1e-3, 0.9).defaults["weight_decay"] == 0.01
    assert workloads.optimizer("sgd", params, 0.1, 0.9).defaults["weight_decay"] == 0.0
    assert workloads.optimizer("nesterov", params, 0.1, 0.9,
                               5e-4).defaults["weight_decay"] == 5e-4
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    options = compare.run_options(parser.parse_args(["--weight-decay", "1e-4"]))
    assert options.weight_decay == 1e-4
    with pytest.raises(ValueError, match="weight_decay=-0.1 must be None or >= 0"):
        RunOptions(weight_decay=-0.1)


def test_clipping_options_reach_the_run_and_bad_ones_are_refused() -> None:
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    options = compare.run_options(parser.parse_args(["--max-norm", "0.5",
                                                     "--clip-at", "after-backward",
                                                     "--eval-every", "5"]))
    assert (options.max_norm, options.clip_at) == (0.5, "after-backward")
    assert options.eval_every == 5
    assert compare.clipping(options) == "max norm 0.5 at after-backward"
    assert compare.clipping(RunOptions()) == "no clipping"
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="max_norm=.* must be None or a finite number > 0"):
            RunOptions(max_norm=bad)
    with pytest.raises(ValueError, match="clip_at='optimizer' must be one of"):
        RunOptions(clip_at="optimizer")
    with pytest.raises(ValueError, match="precision='fp8' must be one of"):
        RunOptions(precision="fp8")


def test_bad_workload_and_optimizer_names_raise_value_error() -> None:
    with pytest.raises(ValueError, match="workload='cifar'"):
        workloads.load("cifar")
    with pytest.raises(ValueError, match="optimizer='lamb'"):
        workloads.optimizer("lamb", [torch.nn.Parameter(torch.zeros(1))], 0.1, 0.9)
    with pytest.raises(ValueError, match="workload='cifar'"):
        RunOptions(workload="cifar")
    with pytest.raises(ValueError, match="optimizer='lamb'"):
        RunOptions(optimizer="lamb")
    with pytest.raises(ValueError, match="device='gpu' must name a torch device"):
        RunOptions(device="gpu")
    with pytest.raises(ValueError, match="feedback='ef21' must be one of"):
        RunOptions(feedback="ef21")  # clt-k's only: a run of several schemes says "auto"


def test_a_workload_moved_to_a_device_builds_its_models_there() -> None:
    work = workloads.load("digits-mlp").to("meta")
    assert work.train.inputs.device.type == work.test.targets.device.type == "meta"
    assert {p.device.type for p in work.model(0).parameters()} == {"meta"}


def test_dlrm_click_target_is_clearly_above_every_seeds_base_rate() -> None:
    # Always answering "no click" must stay at least two binomial standard deviations
    # below the target on the rows an evaluation point reads; the teacher must clear it.
    rows = RunOptions().eval_rows
    for seed in range(3):
        work = _loaded("dlrm-click", seed)
        labels = work.test.targets[:rows].double()
        base = float(torch.maximum(labels.mean(), 1 - labels.mean()))
        sigma = (base * (1 - base) / labels.numel()) ** 0.5
        assert work.target > base + 2 * sigma, (seed, base, work.target)
        _, test = criteo.synthetic_criteo(20_000, 5_000, seed=seed)
        assert test.rows(slice(0, rows)).oracle()["accuracy"] > work.target + 0.03


def test_dlrm_reference_init_keeps_the_logit_alive() -> None:
    work = _loaded("dlrm-click")
    batch = work.train.rows(slice(0, 512))
    model = work.model(0)
    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear):
            fan_out, fan_in = layer.weight.shape
            expected = (2.0 / (fan_in + fan_out)) ** 0.5
            assert abs(float(layer.weight.detach().std()) / expected - 1) < 0.2, (fan_in, fan_out)
    cardinalities = [int(c) for c in model.interact.cardinalities]
    default = dlrm.dlrm(work.train.inputs.shape[1], cardinalities, seed=0, init="torch")
    with torch.no_grad():
        spread = float(model(batch.inputs, **batch.side).std())
        shrunk = float(default(batch.inputs, **batch.side).std())
    assert spread > 5 * shrunk  # the default's eight layers shrink the logit towards 0
    with pytest.raises(ValueError, match="init='xavier'"):
        dlrm.dlrm(3, [2], init="xavier")


def test_a_short_dense_run_lowers_text_lm_validation_bits_per_byte() -> None:
    work = _loaded("text-lm")
    assert work.train.inputs.shape[1] == work.train.targets.shape[1] == workloads.LMShape().context
    assert torch.equal(work.train.inputs[:, 1:], work.train.targets[:, :-1])  # the next byte
    assert torch.equal(work.test.inputs, workloads.load("text-lm", seed=1).test.inputs)
    recipe = workloads.RECIPES["text-lm"]
    model = work.model(0)
    optimizer = workloads.optimizer(recipe["optimizer"], model.parameters(), recipe["lr"],
                                    recipe["momentum"])
    before = work.score(model, rows=64)
    assert abs(before - 8.0) < 0.5  # about a uniform guess over 256 bytes at the start
    for step in range(30):
        batch = work.train.rows(slice(8 * step, 8 * step + 8))
        loss = work.loss(model(batch.inputs), batch.targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert work.score(model, rows=64) < before - 1.0


@pytest.fixture(scope="module")
def dlrm_large() -> workloads.Workload:
    return _loaded("dlrm-large")


def test_dlrm_large_loads_the_same_rows_per_seed_and_its_splits_are_disjoint(
        dlrm_large: workloads.Workload) -> None:
    first, again = dlrm_large, workloads.load("dlrm-large", seed=0)
    assert (len(first.train), len(first.test)) == workloads.LARGE_ROWS
    for a, b in ((first.train, again.train), (first.test, again.test)):
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
        assert torch.equal(a.side["categorical"], b.side["categorical"])
    other = workloads.load("dlrm-large", seed=1)
    assert not torch.equal(first.test.side["categorical"], other.test.side["categorical"])
    # a row's fingerprint: its features through a random projection (distinct rows collide
    # with probability about 0)
    weights = torch.randn(first.train.inputs.shape[1], dtype=torch.float64)
    id_weights = torch.randn(first.train.side["categorical"].shape[1], dtype=torch.float64)

    def fingerprint(data: workloads.Data) -> torch.Tensor:
        return data.inputs.double() @ weights + data.side["categorical"].double() @ id_weights

    assert not torch.isin(fingerprint(first.test), fingerprint(first.train)).any()
    ids = first.train.side["categorical"]
    assert ids.min() >= 0 and (ids.max(0).values < torch.tensor(
        workloads.LARGE_CARDINALITIES)).all()


def test_dlrm_large_target_lies_between_the_teacher_and_the_constant_answer(
        dlrm_large: workloads.Workload) -> None:
    # The target is a test log loss: the teacher that drew the labels must beat it clearly
    # (else no model reaches it) and the constant click rate must miss it clearly (else it
    # says nothing about the per-id effects).
    target = dlrm_large.target
    for seed in range(2):
        _, test = criteo.synthetic_criteo(*workloads.LARGE_ROWS, seed=seed,
                                          cardinalities=workloads.LARGE_CARDINALITIES,
                                          bayes_loss=workloads.LARGE_BAYES_LOSS)
        rate = float(test.labels.mean())
        constant = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
        assert abs(test.oracle()["loss"] - workloads.LARGE_BAYES_LOSS) < 1e-3
        assert test.oracle()["loss"] < target - 0.05 < target + 0.1 < constant, seed
    assert workloads.RECIPES["dlrm-large"]["optimizer"] == "adamw"


def test_a_short_dense_run_lowers_dlrm_large_test_loss(dlrm_large: workloads.Workload) -> None:
    work = dlrm_large
    recipe = workloads.RECIPES["dlrm-large"]
    model = work.model(0)
    optimizer = workloads.optimizer(recipe["optimizer"], model.parameters(), recipe["lr"],
                                    recipe["momentum"])
    before = work.score(model, rows=1024)
    size = recipe["batch_size"]
    for step in range(40):
        batch = work.train.rows(slice(size * step, size * (step + 1)))
        loss = work.loss(model(batch.inputs, **batch.side), batch.targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert work.score(model, rows=1024) < before - 0.05


def test_the_teachers_spread_sets_its_log_loss() -> None:
    for seed in range(2):  # the teacher's loss on the test split's drawn labels, within
        # what one label flipping as the teacher sharpens moves it (a few 0.001 on 2,000 rows)
        _, test = criteo.synthetic_criteo(20_000, 2_000, seed=seed, bayes_loss=0.4)
        assert abs(test.oracle()["loss"] - 0.4) < 5e-3
    for bad in (0.0, 0.6):  # the constant 25 % answer scores 0.562
        with pytest.raises(ValueError, match=f"bayes_loss={bad} must be None or in"):
            criteo.synthetic_criteo(10, 10, bayes_loss=bad)


def test_code_lm_reads_the_standard_library_split_by_file(tmp_path: pytest.TempPathFactory
                                                          ) -> None:
    root = tmp_path / "lib"  # type: ignore[operator]
    for index in range(12):
        folder = root / ("test" if index == 5 else "pkg")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"m{index:02d}.py").write_text(f"x = {index}\n")
    files = pysource.source_files(root)
    assert [path.name for path in files] == [f"m{i:02d}.py" for i in range(12) if i != 5]
    corpus = pysource.corpus(root)
    assert corpus.validation_plays == ("pkg/m10.py",)  # the tenth file, path order
    assert b"x = 10\n" == corpus.validation and b"x = 10" not in corpus.train
    assert corpus == pysource.corpus(root)  # the same bytes on every call
    with pytest.raises(FileNotFoundError, match="fewer than 10"):
        pysource.corpus(root / "pkg" / "nothing")
    real = pysource.corpus()  # this interpreter's own library: megabytes of code
    assert len(real.train) > 2_000_000 and len(real.validation) > 200_000
    assert not set(real.train_plays) & set(real.validation_plays)


def test_language_models_take_a_shape_and_other_workloads_refuse_one() -> None:
    small = workloads.LMShape(width=64, layers=2, context=32, tied=True)
    work = workloads.load("code-lm", seed=0, shape=small)
    model = work.model(0)
    assert model.head.weight is model.embed.weight  # tied, as nanoGPT
    assert work.train.inputs.shape[1] == 32 and model.position.shape == (32, 64)
    assert torch.equal(work.train.inputs, workloads.load("code-lm", seed=0,
                                                         shape=small).train.inputs)
    assert not torch.equal(work.train.inputs[:64],
                           workloads.load("code-lm", seed=1, shape=small).train.inputs[:64])
    sizes = [sum(p.numel() for p in workloads.load("text-lm", shape=workloads.LMShape(
        width=w, layers=d, tied=True)).model(0).parameters()) for w, d in ((64, 2), (256, 4))]
    assert sizes[1] > 3_000_000 and sizes[1] > 10 * sizes[0]  # the family spans 10x
    for bad, match in (({"width": 40}, "multiple of 16"), ({"layers": 0}, "layers=0"),
                       ({"context": 5000}, "context=5000"), ({"tied": 1}, "tied=1")):
        with pytest.raises(ValueError, match=match):
            workloads.LMShape(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="takes no model shape"):
        workloads.load("digits-mlp", shape=small)
    with pytest.raises(ValueError, match="takes no width"):
        RunOptions(workload="digits-mlp", width=64)
    assert RunOptions(workload="text-lm").shape() is None
    assert RunOptions(workload="text-lm", layers=3).shape() == workloads.LMShape(layers=3)


def test_the_schedule_rises_then_decays_as_nanogpts() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = workloads.optimizer("adamw", [param], 1e-3, 0.9, beta2=0.95)
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    schedule = workloads.schedule(optimizer, "cosine", steps=110, warmup=10, min_lr=0.1)
    rates = []
    for _ in range(110):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert rates[0] == pytest.approx(1e-3 / 11) and rates[9] == pytest.approx(1e-3 * 10 / 11)
    assert rates[10] == pytest.approx(1e-3) and rates[60] == pytest.approx(0.55e-3)
    assert rates[109] == pytest.approx(1e-4, rel=1e-2)  # min_lr x lr at the last step
    assert all(a >= b for a, b in zip(rates[10:], rates[11:]))
    constant = workloads.schedule(workloads.optimizer("sgd", [param], 0.1, 0.9), "constant",
                                  steps=5)
    assert constant.get_last_lr() == [0.1]
    for kwargs, match in (({"name": "linear"}, "schedule='linear'"),
                          ({"warmup": 5}, r"in \[0, 5\)"), ({"min_lr": 2.0}, "min_lr=2.0")):
        with pytest.raises(ValueError, match=match):
            workloads.schedule(optimizer, **{"name": "cosine", "steps": 5, **kwargs})
    with pytest.raises(ValueError, match="lr_warmup=500"):
        RunOptions(lr_warmup=500, steps=500)
    with pytest.raises(ValueError, match="beta2=1.0"):
        RunOptions(beta2=1.0)
