"""PowerSGD: the maths one matrix at a time, the scheme against an independent reference,
and the scheme through DDP with several buckets on gloo."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from thinwire import ddp, schemes
from thinwire.comm import Meter
from thinwire.compress.lowrank import compressible, seeded_normal
from thinwire.compress.powersgd import PowerSGD, orthonormalize, reconstruct, right
from thinwire.launch import spawn

# ---------------------------------------------------------------- an independent reference


class Reference:
    """PowerSGD (Vogels et al. 2019, Alg. 1 + error feedback) on all workers' matrices in one
    process, in numpy: P = mean(M_w Q), P_hat = qr(P), Q = mean(M_w^T P_hat),
    G_hat = P_hat Q^T, e_w = M_w - G_hat, Q kept for the next step."""

    def __init__(self, rank: int, seed: int = 0, warm_start: bool = True) -> None:
        self.rank, self.seed, self.warm_start = rank, seed, warm_start
        self.qs: dict[str, np.ndarray] = {}
        self.draws: dict[str, int] = {}
        self.errors: dict[tuple[int, str], np.ndarray] = {}

    def step(self, key: str, grads: list[np.ndarray]) -> np.ndarray:
        shape = grads[0].shape
        matrices = [(g + self.errors.get((w, key), 0.0)).reshape(shape[0], -1)
                    for w, g in enumerate(grads)]
        if key not in self.qs or not self.warm_start:
            draw = self.draws.get(key, 0)
            self.draws[key] = draw + 1
            self.qs[key] = seeded_normal(key, (matrices[0].shape[1], self.rank),
                                         seed=self.seed + draw, dtype=torch.float64).numpy()
        p = np.mean([m @ self.qs[key] for m in matrices], axis=0)
        p_hat, _ = np.linalg.qr(p)
        q = np.mean([m.T @ p_hat for m in matrices], axis=0)
        approx = p_hat @ q.T
        for w, m in enumerate(matrices):
            self.errors[(w, key)] = (m - approx).reshape(shape)
        self.qs[key] = q
        return approx.reshape(shape)


def _matrix_of_rank(rows: int, cols: int, rank: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    left = torch.randn(rows, rank, generator=generator, dtype=torch.float64)
    return left @ torch.randn(rank, cols, generator=generator, dtype=torch.float64)


def _grads(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(500 + step)
    return {"conv.weight": torch.randn(16, 3, 3, 3, generator=generator, dtype=torch.float64),
            "fc.weight": torch.randn(20, 30, generator=generator, dtype=torch.float64),
            "fc.bias": torch.randn(20, generator=generator, dtype=torch.float64)}

# ---------------------------------------------------------------- maths, one matrix at a time


def test_initial_q_is_seeded_by_key_and_seed_only() -> None:
    matrix = torch.randn(20, 30, dtype=torch.float64)
    first, second = PowerSGD(2, seed=7), PowerSGD(2, seed=7)
    q = first.q("w", matrix)
    assert q.shape == (30, 2) and q.dtype == torch.float64
    assert torch.equal(q, second.q("w", matrix))
    assert not torch.equal(q, PowerSGD(2, seed=8).q("w", matrix))
    assert not torch.equal(q, second.q("v", matrix))


def test_each_function_is_its_algorithm_line() -> None:
    codec = PowerSGD(3)
    matrix = torch.randn(20, 30, dtype=torch.float64)
    q = codec.q("w", matrix).clone()
    p = codec.left("w", matrix)
    # Q laid out column-major: the same products, perhaps summed in another order
    torch.testing.assert_close(p, matrix @ q, rtol=1e-12, atol=1e-12)
    p_hat = orthonormalize(p)
    torch.testing.assert_close(p_hat.T @ p_hat, torch.eye(3, dtype=torch.float64))
    q_new = right(matrix, p_hat)
    # the same products, summed in another order: equal to float64 precision
    torch.testing.assert_close(q_new, matrix.T @ p_hat, rtol=1e-12, atol=1e-12)
    approx = codec.finish("w", p_hat, q_new)
    torch.testing.assert_close(approx, reconstruct(p_hat, q_new), rtol=0, atol=0)
    torch.testing.assert_close(approx, p_hat @ q_new.T, rtol=1e-12, atol=1e-12)
    assert torch.equal(codec.q("w", matrix), q_new)  # warm start: next step uses this Q


def test_finish_keeps_a_column_major_q_as_it_is_and_copies_a_row_major_one() -> None:
    """The scheme all-reduces Q transposed so that the warm start needs no copy; a Q in
    any other layout is kept as a column-major copy, never as the caller's tensor."""
    matrix = torch.randn(20, 30, dtype=torch.float64)
    p_hat = orthonormalize(torch.randn(20, 2, dtype=torch.float64))
    column_major = right(matrix, p_hat).t().contiguous().t()
    row_major = column_major.contiguous()
    for q_mean, kept_as_is in ((column_major, True), (row_major, False)):
        codec = PowerSGD(2)
        approx = codec.finish("w", p_hat, q_mean)
        kept = codec.q("w", matrix)
        assert (kept.data_ptr() == q_mean.data_ptr()) is kept_as_is
        assert kept.t().is_contiguous() and torch.equal(kept, q_mean)
        torch.testing.assert_close(approx, p_hat @ q_mean.T, rtol=1e-12, atol=1e-12)


def test_warm_start_keeps_the_previous_column_only_where_q_is_exactly_zero() -> None:
    """A zero column of the averaged Q would zero the next P's column: the previous one is
    kept there. A column of tiny entries (whose 2-norm underflows to 0 in fp32) is not zero
    and is kept as it came."""
    codec = PowerSGD(3)
    matrix = torch.randn(4, 5)
    previous = codec.q("w", matrix).clone()
    q_mean = torch.randn(5, 3)
    q_mean[:, 1] = 0.0
    q_mean[:, 2] = 1e-30
    codec.finish("w", orthonormalize(torch.randn(4, 3)), q_mean)
    kept = codec.q("w", matrix)
    assert torch.equal(kept[:, 0], q_mean[:, 0])
    assert torch.equal(kept[:, 1], previous[:, 1])
    assert torch.equal(kept[:, 2], q_mean[:, 2])


def test_without_warm_start_every_step_draws_a_fresh_shared_q() -> None:
    matrix = torch.randn(20, 30, dtype=torch.float64)
    codec, twin = PowerSGD(2, warm_start=False), PowerSGD(2, warm_start=False)
    qs = []
    for _ in range(2):
        q = codec.q("w", matrix)
        assert torch.equal(q, twin.q("w", matrix))
        codec.finish("w", orthonormalize(matrix @ q), q)
        twin.finish("w", orthonormalize(matrix @ q), q)
        qs.append(q)
    assert not torch.equal(qs[0], qs[1])


@pytest.mark.parametrize("shape", [(1000, 1000), (257, 1031), (3, 5)])
def test_reconstruct_is_the_elementwise_sum_of_outer_products_at_any_thread_count(
        shape: tuple[int, int]) -> None:
    """Bit for bit ``p_1 q_1 + p_2 q_2 + p_3 q_3``, each product rounded once, whatever
    the intra-op thread count (replicas must not depend on the thread a callback runs on)."""
    rows, cols = shape
    p_hat = orthonormalize(torch.randn(rows, 3))  # column-major, as QR returns it
    q = torch.randn(cols, 3)
    expected = p_hat[:, :1] * q[:, 0]
    for j in (1, 2):
        expected = expected + p_hat[:, j: j + 1] * q[:, j]
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            assert torch.equal(reconstruct(p_hat, q), expected)
    finally:
        torch.set_num_threads(threads)


def test_orthonormalize_survives_zero_and_repeated_columns() -> None:
    p = torch.zeros(10, 3, dtype=torch.float64)
    p[:, 1] = torch.arange(10.0)
    p[:, 2] = p[:, 1]
    p_hat = orthonormalize(p)
    assert bool(torch.isfinite(p_hat).all())
    torch.testing.assert_close(p_hat.T @ p_hat, torch.eye(3, dtype=torch.float64))

# ---------------------------------------------------------------- the scheme, one process


@pytest.mark.parametrize("rank", [2, 3])
def test_rank_at_least_the_matrix_rank_reconstructs_exactly(rank: int) -> None:
    matrix = _matrix_of_rank(20, 30, 2, seed=1)
    scheme = schemes.build("powersgd", rank=rank)
    out = scheme.reduce({"w": matrix})["w"]
    torch.testing.assert_close(out, matrix, rtol=1e-12, atol=1e-12)
    assert float(scheme.memory.buffers["w"].abs().max()) < 1e-12


def test_error_feedback_keeps_what_was_not_sent() -> None:
    scheme = schemes.build("powersgd", rank=1)
    error = {key: torch.zeros_like(g) for key, g in _grads(0).items()}
    for step in range(4):
        grads = _grads(step)
        out = scheme.reduce(grads)
        for key in ("conv.weight", "fc.weight"):
            new_error = scheme.memory.buffers[key].view(grads[key].shape)
            # M == G_hat + e, in float64.
            torch.testing.assert_close(grads[key] + error[key], out[key] + new_error,
                                       rtol=1e-13, atol=1e-13)
            assert float(new_error.abs().max()) > 1e-3  # rank 1 does lose something
            error[key] = new_error.clone()


@pytest.mark.parametrize("warm_start", [True, False])
def test_matches_the_independent_reference_step_by_step(warm_start: bool) -> None:
    scheme = schemes.build("powersgd", rank=2, seed=5, warm_start=warm_start)
    reference = Reference(rank=2, seed=5, warm_start=warm_start)
    for step in range(6):
        grads = _grads(step)
        out = scheme.reduce(grads)
        for key in ("conv.weight", "fc.weight"):
            expected = reference.step(key, [grads[key].numpy()])
            torch.testing.assert_close(out[key], torch.from_numpy(expected), rtol=1e-10,
                                       atol=1e-10)
        assert torch.equal(out["fc.bias"], grads["fc.bias"])  # 1-D: dense


def test_tensors_that_do_not_compress_and_early_steps_travel_dense() -> None:
    assert not compressible((8, 8), 2) and compressible((20, 30), 2)
    scheme = schemes.build("powersgd", rank=2, warmup_steps=2)
    for step in range(3):
        grads = {**_grads(step), "small": torch.randn(8, 8, dtype=torch.float64)}
        out = scheme.reduce(grads)
        for key in ("fc.bias", "small") + (("conv.weight", "fc.weight") if step < 2 else ()):
            assert torch.equal(out[key], grads[key])
            assert key not in scheme.memory.buffers
    assert not torch.equal(out["fc.weight"], grads["fc.weight"])


def test_zero_gradients_give_no_nan_and_training_goes_on() -> None:
    scheme = schemes.build("powersgd", rank=2)
    zero = scheme.reduce({"w": torch.zeros(20, 30, dtype=torch.float64)})["w"]
    assert torch.equal(zero, torch.zeros(20, 30, dtype=torch.float64))
    matrix = _matrix_of_rank(20, 30, 1, seed=2)
    out = scheme.reduce({"w": matrix})["w"]
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out, matrix, rtol=1e-12, atol=1e-12)


def test_both_rounds_are_metered() -> None:
    scheme = schemes.build("powersgd", rank=2)
    scheme.meter = Meter()
    scheme.reduce(_grads(0))
    scheme.meter.next_step()
    records = [(r.layer, r.nbytes) for r in scheme.meter.records]
    # Round 1: P of each matrix (rows x r); round 2: Q (cols x r), then the dense bias.
    assert records == [("conv.weight", 16 * 2 * 8), ("fc.weight", 20 * 2 * 8),
                       ("conv.weight", 27 * 2 * 8), ("fc.weight", 30 * 2 * 8),
                       ("fc.bias", 20 * 8)]
    assert scheme.meter.summary()["bytes_sent_per_step"] == sum(n for _, n in records)


def test_nonfinite_steps_are_skipped_and_keep_the_error() -> None:
    scheme = schemes.build("powersgd", rank=1, nonfinite="skip")
    scheme.reduce(_grads(0))
    before = copy.deepcopy(scheme.memory.state_dict())
    bad = _grads(1)
    bad["fc.weight"][3, 3] = float("inf")
    out = scheme.reduce(bad)
    assert scheme.skipped == 1 and all(bool((v == 0).all()) for v in out.values())
    for key, buffer in before["buffers"].items():
        assert torch.equal(scheme.memory.buffers[key], buffer)
    with pytest.raises(FloatingPointError, match="fc.weight"):
        schemes.build("powersgd").reduce(bad)


def test_state_dict_resumes_exactly() -> None:
    scheme = schemes.build("powersgd", rank=2, warmup_steps=1)
    for step in range(3):
        scheme.reduce(_grads(step))
    resumed = schemes.build("powersgd", rank=2, warmup_steps=1)
    resumed.load_state_dict(copy.deepcopy(scheme.state_dict()))
    for step in range(3, 6):
        got, expected = resumed.reduce(_grads(step)), scheme.reduce(_grads(step))
        for key in got:
            assert torch.equal(got[key], expected[key])


@pytest.mark.parametrize("option,value", [
    ("rank", 0), ("rank", -2), ("rank", 1.5), ("warmup_steps", -1), ("seed", "a"),
    ("warm_start", "yes"), ("error_feedback", 1), ("nonfinite", "ignore"),
])
def test_bad_config_is_a_value_error(option: str, value: object) -> None:
    with pytest.raises(ValueError, match=option):
        schemes.build("powersgd", **{option: value})
    with pytest.raises(ValueError, match="rank"):
        PowerSGD(0)

# ---------------------------------------------------------------- DDP, several buckets, gloo


STEPS = 4
WARMUP_STEPS = 1


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.ReLU(), torch.nn.Linear(12, 8),
                               torch.nn.ReLU(), torch.nn.Linear(8, 3)).double()


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10 * rank + step)
    return (torch.randn(8, 16, generator=generator, dtype=torch.float64),
            torch.randn(8, 3, generator=generator, dtype=torch.float64))


def _ddp_worker(rank: int, world_size: int) -> dict[str, object]:
    model = _model()
    # torch 2.13 rebuilds a small model into one bucket after the first step unless it
    # looks for unused parameters; then the small cap keeps several buckets every step.
    wrapped = DistributedDataParallel(model, bucket_cap_mb=0.001, find_unused_parameters=True)
    scheme = schemes.build("powersgd", rank=2, warmup_steps=WARMUP_STEPS, seed=3)
    launches: list[list[str]] = []
    lasts: list[bool] = []
    launch = scheme.launch_flat

    def counted(buffer, infos, group=None, *, last=True):  # type: ignore[no-untyped-def]
        launches.append([info.key for info in infos])
        lasts.append(last)
        return launch(buffer, infos, group, last=last)

    scheme.launch_flat = counted  # type: ignore[method-assign]
    meter = Meter(rank, world_size)
    ddp.register(wrapped, scheme, meter=meter)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    grads = []
    for step in range(STEPS):
        optimizer.zero_grad()
        inputs, targets = _batch(rank, step)
        (wrapped(inputs) - targets).square().mean().backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        meter.next_step()
    # The mean of rank-2 matrices that share a row space has rank 2.
    shared = _matrix_of_rank(2, 30, 2, seed=9)
    mine = _matrix_of_rank(20, 2, 2, seed=rank) @ shared
    exact = schemes.build("powersgd", rank=2).reduce({"w": mine})["w"]
    return {"grads": grads, "launches": launches, "lasts": lasts, "exact": exact,
            "bytes": meter.summary(), "replica": _replica_run(rank)}


@pytest.fixture(scope="module")
def ddp_runs() -> list[dict[str, object]]:
    return spawn(_ddp_worker, 2, threads=2)


def test_ddp_with_several_buckets_on_gloo_completes(ddp_runs: list[dict[str, object]]) -> None:
    for run in ddp_runs:
        launches = run["launches"]
        assert len(launches) > STEPS  # more than one bucket per step
        # every bucket but the step's last leaves its P round on the wire until the next
        assert run["lasts"].count(True) == STEPS and run["lasts"][-1]
        assert sorted(sum(launches, [])) == sorted(list(dict(_model().named_parameters())) * STEPS)
        assert run["bytes"]["steps"] == STEPS and run["bytes"]["bytes_sent_per_step"] > 0


def test_ddp_matches_the_single_process_reference(ddp_runs: list[dict[str, object]]) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    reference = Reference(rank=2, seed=3)
    names = [name for name, _ in model.named_parameters()]
    for step in range(STEPS):
        local = []
        for rank in range(2):
            model.zero_grad()
            inputs, targets = _batch(rank, step)
            (model(inputs) - targets).square().mean().backward()
            local.append({name: p.grad.clone() for name, p in model.named_parameters()})
        for name, param in model.named_parameters():
            worker_grads = [local[rank][name] for rank in range(2)]
            if step >= WARMUP_STEPS and compressible(tuple(param.shape), 2):
                mean = torch.from_numpy(reference.step(name, [g.numpy() for g in worker_grads]))
            else:
                mean = (worker_grads[0] + worker_grads[1]) / 2
            for run in ddp_runs:
                torch.testing.assert_close(run["grads"][step][name], mean, rtol=1e-9,
                                           atol=1e-11, msg=f"step {step} {name}")
            param.grad = mean
        optimizer.step()
    assert sum(compressible(tuple(dict(model.named_parameters())[n].shape), 2)
               for n in names) == 2  # both weight kinds are exercised


def test_rank_at_least_the_mean_rank_reconstructs_the_mean_across_ranks(
        ddp_runs: list[dict[str, object]]) -> None:
    shared = _matrix_of_rank(2, 30, 2, seed=9)
    mean = (_matrix_of_rank(20, 2, 2, seed=0) @ shared + _matrix_of_rank(20, 2, 2, seed=1)
            @ shared) / 2
    for run in ddp_runs:
        torch.testing.assert_close(run["exact"], mean, rtol=1e-12, atol=1e-12)


def _replica_run(rank: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 384), torch.nn.ReLU(),
                                torch.nn.Linear(384, 384), torch.nn.ReLU(),
                                torch.nn.Linear(384, 4))
    wrapped = DistributedDataParallel(model, bucket_cap_mb=0.3)
    ddp.register(wrapped, schemes.build("powersgd", rank=2))
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    for step in range(6):
        generator = torch.Generator().manual_seed(10 * rank + step)
        inputs = torch.randn(16, 32, generator=generator)
        optimizer.zero_grad()
        wrapped(inputs).square().mean().backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def test_replicas_stay_bit_identical_with_several_intra_op_threads(
        ddp_runs: list[dict[str, object]]) -> None:
    """Callbacks run on the caller's or a gloo thread, whose thread counts differ."""
    first, second = (run["replica"] for run in ddp_runs)
    for a, b in zip(first, second):  # type: ignore[call-overload]
        assert torch.equal(a, b)
