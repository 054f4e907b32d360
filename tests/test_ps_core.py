"""The transport-free server: backups, staleness, SSGD rounds, membership, faults, checkpoints,
and delay compensation under injected schedules (a fake clock, no timing)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from thinwire.ps import ParameterServerCore, build_rule, load_checkpoint, save_checkpoint
from thinwire.ps.simulate import cyclic_schedule, run_schedule


def _core(streams: int = 2, rule: str = "asgd", numel: int = 4, **options: object
          ) -> ParameterServerCore:
    weights = torch.arange(numel, dtype=torch.float64)
    core = ParameterServerCore(weights, build_rule(rule, lr=0.5), streams, **options)  # type: ignore[arg-type]
    for stream in range(streams):
        core.join(stream)
    return core


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# Backups, snapshots, exactness -------------------------------------------------------


def test_backups_start_at_initial_weights_and_follow_pulls() -> None:
    core = _core(rule="dc-asgd")
    initial = core.weights.clone()
    assert all(torch.equal(b, initial) for b in core.backups)
    version, pulled = core.pull(0)
    assert version == 0 and torch.equal(pulled, initial)
    core.push(1, torch.ones(4, dtype=torch.float64))  # stream 1 never pulled: w_bak = w_0
    _, second = core.pull(0)
    assert torch.equal(core.backups[0], second) and torch.equal(core.backups[1], initial)
    assert torch.equal(pulled, initial), "a pulled snapshot changed after a later push"


def test_one_stream_without_delay_is_sequential_sgd_exactly() -> None:
    generator = torch.Generator().manual_seed(0)
    target = torch.randn(5, dtype=torch.float64, generator=generator)
    start = torch.randn(5, dtype=torch.float64, generator=generator)
    parameter = torch.nn.Parameter(start.clone())
    optimizer = torch.optim.SGD([parameter], lr=0.3)
    for name in ("asgd", "dc-asgd"):
        core = ParameterServerCore(start, build_rule(name, lr=0.3), 1)
        core.join(0)
        for _ in range(10):
            _, weights = core.pull(0)
            assert core.push(0, 2 * (weights - target)).tau == 0
        parameter.data.copy_(start)
        for _ in range(10):
            parameter.grad = 2 * (parameter.detach() - target)
            optimizer.step()
        assert torch.equal(core.weights, parameter.detach()), name


def test_concurrent_pushes_are_applied_whole() -> None:
    """Threads push uniform gradients while others pull: every pull must be uniform."""
    core = ParameterServerCore(torch.zeros(20_000), build_rule("asgd", lr=1.0), 4)
    for stream in range(4):
        core.join(stream)
    torn: list[torch.Tensor] = []

    def body(stream: int) -> None:
        for step in range(50):
            _, weights = core.pull(stream)
            if not bool((weights == weights[0]).all()):
                torn.append(weights)
            core.push(stream, torch.full((20_000,), float(stream + 1)), step)

    threads = [threading.Thread(target=body, args=(s,)) for s in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not torn
    assert torch.equal(core.weights, torch.full((20_000,), -50.0 * (1 + 2 + 3 + 4)))
    assert core.version == 200


# Staleness, drops, rejections ------------------------------------------------------


def test_tau_counts_updates_since_the_pull() -> None:
    core = _core(streams=3, audit=True)
    core.pull(0)
    core.pull(1)
    core.pull(2)
    results = [core.push(s, torch.ones(4, dtype=torch.float64)) for s in (2, 1, 0)]
    assert [r.tau for r in results] == [0, 1, 2]
    assert core.staleness.summary()["histogram"] == {0: 1, 1: 1, 2: 1}
    assert [(e.stream, e.tau, e.pulled_version) for e in core.audit or []] == [
        (2, 0, 0), (1, 1, 0), (0, 2, 0)]


def test_max_staleness_drops_and_counts() -> None:
    core = _core(streams=3, max_staleness=1)
    for stream in range(3):
        core.pull(stream)
    core.push(0, torch.ones(4, dtype=torch.float64))
    core.push(1, torch.ones(4, dtype=torch.float64))
    before = core.weights
    result = core.push(2, torch.ones(4, dtype=torch.float64))
    assert (result.outcome, result.tau) == ("stale", 2)
    assert core.weights is before and core.version == 2
    summary = core.staleness.summary()
    assert summary["dropped_histogram"] == {2: 1} and summary["outcomes"]["stale"] == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_gradients_are_rejected_and_counted(bad: float) -> None:
    core = _core(rule="dc-asgd")
    before = core.weights
    grad = torch.ones(4, dtype=torch.float64)
    grad[2] = bad
    assert core.push(0, grad).outcome == "nonfinite"
    assert core.weights is before and core.version == 0
    assert core.staleness.outcomes["nonfinite"] == 1
    assert core.push(0, torch.ones(3, dtype=torch.float64)).outcome == "malformed"
    assert core.push(0, torch.ones(4, dtype=torch.float32)).outcome == "malformed"
    assert core.weights is before


# SSGD rounds ------------------------------------------------------------------------


def test_synchronous_round_applies_the_mean_once() -> None:
    core = _core(streams=3, synchronous=True)
    start = core.weights.clone()
    for stream in range(3):
        core.pull(stream)
    grads = [torch.full((4,), float(v), dtype=torch.float64) for v in (1.0, 2.0, 6.0)]
    assert core.push(0, grads[0]).outcome == "pending"
    assert core.push(1, grads[1]).round == 0
    assert core.version == 0 and core.rounds_closed == 0
    with pytest.raises(ValueError, match="pushed twice"):
        core.push(1, grads[1])
    core.push(2, grads[2])
    assert core.rounds_closed == 1 and core.version == 1
    assert torch.equal(core.weights, start - 0.5 * 3.0)


def test_synchronous_round_stops_waiting_for_dead_and_rejected_streams() -> None:
    core = _core(streams=3, synchronous=True)
    start = core.weights.clone()
    core.push(0, torch.full((4,), 2.0, dtype=torch.float64))
    core.push(1, torch.full((4,), float("nan"), dtype=torch.float64))  # answers the barrier
    assert core.rounds_closed == 0
    core.mark_dead([2])
    assert core.rounds_closed == 1
    assert torch.equal(core.weights, start - 0.5 * 2.0)  # mean of the finite gradients only


# Membership, leases ------------------------------------------------------------------


def test_join_refuses_a_different_configuration_with_a_clear_error() -> None:
    core = ParameterServerCore(torch.zeros(3), build_rule("asgd"), 2,
                               fingerprint={"model": "convnet", "batch_size": 32})
    core.join(0, {"model": "convnet", "batch_size": 32})
    with pytest.raises(ValueError, match="model: worker has 'linear', server has 'convnet'"):
        core.join(1, {"model": "linear", "batch_size": 32})
    assert core.status == ["joined", "refused"]
    with pytest.raises(ValueError, match="stream 1 cannot pull: it is refused"):
        core.pull(1)
    with pytest.raises(ValueError, match="cannot join: it is joined"):
        core.join(0, {"model": "convnet", "batch_size": 32})
    assert not core.finished
    core.leave(0)
    assert core.finished and core.wait_finished(timeout=0)


def test_ended_streams_pushes_are_ignored() -> None:
    core = _core(streams=2)
    core.mark_dead([1])
    before = core.weights
    assert core.push(1, torch.ones(4, dtype=torch.float64)).outcome == "closed"
    assert core.weights is before
    with pytest.raises(ValueError, match=r"stream=5 must be an integer in \[0, 2\)"):
        core.pull(5)


def test_lease_expires_silent_streams_on_a_fake_clock() -> None:
    clock = FakeClock()
    core = _core(streams=2, lease_s=10.0, clock=clock)
    clock.now += 6
    core.pull(0)
    clock.now += 6
    assert core.expire() == [1]
    assert core.status == ["joined", "dead"]
    clock.now += 11
    assert core.expire() == [0] and core.finished


def test_bad_arguments_name_the_value() -> None:
    with pytest.raises(ValueError, match="streams=0"):
        ParameterServerCore(torch.zeros(2), build_rule("asgd"), 0)
    with pytest.raises(ValueError, match="max_staleness=-1"):
        ParameterServerCore(torch.zeros(2), build_rule("asgd"), 1, max_staleness=-1)
    with pytest.raises(ValueError, match="flat floating-point"):
        ParameterServerCore(torch.zeros(2, 2), build_rule("asgd"), 1)
    core = ParameterServerCore(torch.zeros(2), build_rule("asgd"), 1)
    with pytest.raises(ValueError, match="must join before pushing"):
        core.push(0, torch.zeros(2))


# Checkpoints -------------------------------------------------------------------------


def _quadratic_gradient(stream: int, weights: torch.Tensor) -> torch.Tensor:
    return (stream + 1.0) * weights - 1.0


def _assert_same_state(left: object, right: object) -> None:
    if isinstance(left, torch.Tensor):
        assert isinstance(right, torch.Tensor) and torch.equal(left, right)
    elif isinstance(left, dict):
        assert isinstance(right, dict) and left.keys() == right.keys()
        for key in left:
            if key != "elapsed":  # wall time, not state
                _assert_same_state(left[key], right[key])
    elif isinstance(left, (list, tuple)):
        assert isinstance(right, (list, tuple)) and len(left) == len(right)
        for a, b in zip(left, right, strict=True):
            _assert_same_state(a, b)
    elif isinstance(left, float) and isinstance(right, float):
        pass  # clock readings (snapshot seconds, first pull): not part of the model state
    else:
        assert left == right


def test_checkpoint_restart_resumes_with_identical_state(tmp_path: object) -> None:
    clock = FakeClock()

    def make() -> ParameterServerCore:
        rule = build_rule("dc-asgd", lr=0.1, lam=0.5, momentum=0.9, adaptive=True,
                          milestones=(9,))
        return ParameterServerCore(torch.linspace(-1, 1, 6, dtype=torch.float64), rule, 3,
                                   audit=True, max_staleness=1, snapshot_every=4, clock=clock)

    schedule = cyclic_schedule(3, 8)
    done, todo = schedule[:20], schedule[20:]
    uninterrupted = make()
    run_schedule(uninterrupted, schedule, _quadratic_gradient)

    interrupted = make()
    run_schedule(interrupted, done, _quadratic_gradient)
    path = os.path.join(str(tmp_path), "server.ckpt")
    save_checkpoint(path, {"core": interrupted.state_dict()})
    assert os.listdir(str(tmp_path)) == ["server.ckpt"], "a temporary file was left behind"
    restarted = make()
    restarted.load_state_dict(load_checkpoint(path)["core"])
    _assert_same_state(restarted.state_dict(), interrupted.state_dict())
    assert restarted.rule.step == interrupted.rule.step == interrupted.version

    # Streams that pulled before the restart and had not pushed compute their gradient
    # at their backup w_bak, which the checkpoint kept; then the schedule goes on.
    open_pulls: set[int] = set()
    for kind, stream in done:
        (open_pulls.add if kind == "pull" else open_pulls.discard)(stream)
    pending = {s: _quadratic_gradient(s, restarted.backups[s]) for s in open_pulls}
    run_schedule(restarted, todo, _quadratic_gradient, pending=pending)
    resumed, reference = restarted.state_dict(), uninterrupted.state_dict()
    for state in (resumed, reference):  # push counters restart with the schedule runner
        state["audit"] = [entry[:1] + entry[2:] for entry in state["audit"]]
    _assert_same_state(resumed, reference)


def test_checkpoint_of_another_rule_or_size_is_refused() -> None:
    core = _core(rule="dc-asgd")
    with pytest.raises(ValueError, match="written by rule 'dc-asgd'"):
        _core(rule="asgd").load_state_dict(core.state_dict())
    with pytest.raises(ValueError, match="holds 4 weights"):
        _core(rule="dc-asgd", numel=5).load_state_dict(core.state_dict())


# Delay compensation on a quadratic with a known Hessian (injected delays) --------------

HESSIAN = torch.linspace(1.0, 4.0, 6, dtype=torch.float64)  # diagonal of H
OPTIMUM = torch.tensor([0.3, -1.2, 0.8, 0.0, 2.0, -0.5], dtype=torch.float64)


def _hessian_gradient(stream: int, weights: torch.Tensor) -> torch.Tensor:
    del stream
    return HESSIAN * (weights - OPTIMUM)


def _loss(weights: torch.Tensor) -> float:
    return float(0.5 * (HESSIAN * (weights - OPTIMUM) ** 2).sum())


# lambda for each variant. At w - w* = 1 / sqrt(H) the square estimate lam * g * g equals H
# exactly with lam = 1 and the abs one, lam * |g| = sqrt(H), lies in (0, 2H); the adaptive
# lam / sqrt(MeanSquare) starts near lam / (sqrt(1 - m) |g|), so lam = sqrt(1 - m) makes it
# the abs estimate again.
DC_OPTIONS = [{"variant": "square", "lam": 1.0}, {"variant": "abs", "lam": 1.0},
              {"variant": "square", "adaptive": True, "lam": 0.05 ** 0.5}]
# How much closer than ASGD's each lands: the square estimate is the exact Hessian, and the
# Taylor expansion of a quadratic's gradient is exact, so that step is the undelayed one.
CLOSER = [1e-12, 0.5, 1.0]


@pytest.mark.parametrize("options,closer", list(zip(DC_OPTIONS, CLOSER, strict=True)))
def test_delayed_step_is_closer_to_the_undelayed_step(options: dict[str, object],
                                                      closer: float) -> None:
    """Stream 0 pulls w_t; stream 1 pushes 3 times; stream 0 pushes g(w_t) at w_{t+3}.

    The undelayed step is -lr * g(w_{t+3}). Each element of the curvature estimate
    lambda * phi(g) lies within (0, 2 H_ii) here, the range in which the first-order
    Taylor term of Eq. 4 with a diagonal Hessian must bring the step closer.
    """
    start = OPTIMUM + HESSIAN.rsqrt()
    events = [("pull", 0), ("pull", 1), ("push", 1), ("pull", 1), ("push", 1), ("pull", 1),
              ("push", 1), ("push", 0)]
    steps = {}
    for name, extra in (("asgd", {}), ("dc-asgd", options)):
        core = ParameterServerCore(start, build_rule(name, lr=0.1, **extra), 2,
                                   snapshot_every=1)
        results = run_schedule(core, events, _hessian_gradient)
        assert [r.tau for r in results] == [0, 0, 0, 3]
        before, after = core.snapshots[-2].weights, core.snapshots[-1].weights
        steps[name] = (after - before, -0.1 * _hessian_gradient(0, before))
    asgd_error = (steps["asgd"][0] - steps["asgd"][1]).norm()
    dc_error = (steps["dc-asgd"][0] - steps["dc-asgd"][1]).norm()
    assert dc_error < closer * asgd_error


@pytest.mark.parametrize("options", DC_OPTIONS)
def test_cyclic_delays_dc_asgd_tracks_sequential_sgd_better(options: dict[str, object]) -> None:
    """Four streams in a fixed cycle (tau = 3 after the first round), 100 updates."""
    start = OPTIMUM + torch.tensor([1.0, -0.5, 0.7, 1.2, -1.0, 0.4], dtype=torch.float64)
    sequential = start.clone()
    for _ in range(100):
        sequential = sequential - 0.12 * _hessian_gradient(0, sequential)
    final = {}
    for name, extra in (("asgd", {}), ("dc-asgd", options)):
        core = ParameterServerCore(start, build_rule(name, lr=0.12, **extra), 4)
        results = run_schedule(core, cyclic_schedule(4, 25), _hessian_gradient)
        assert [r.tau for r in results[4:]] == [3] * 96
        final[name] = core.weights
    assert _loss(final["dc-asgd"]) < 0.05 * _loss(final["asgd"])
    assert (final["dc-asgd"] - sequential).norm() < 0.25 * (final["asgd"] - sequential).norm()
