"""The coupling simulation's bookkeeping: steps to several targets and their table."""

from __future__ import annotations

import copy

import pytest
import torch

from benchmarks import coupling


def test_every_target_gets_the_step_it_was_first_reached_and_the_rest_none() -> None:
    reached, less = coupling.simulate("topk", "coupled", "sgd", seed=0, workers=2, steps=20,
                                      warmup=0, targets=[0.05, 0.999])
    own = sorted(reached)[1]  # the workload's own target, between the two asked for
    assert sorted(reached) == [0.05, own, 0.999]
    assert reached[0.05] == 10  # above chance at the first evaluation
    assert reached[0.999] is None and reached[own] is None
    assert 1 < less < 100  # dense's bytes over topk's: fewer, not free


def test_targets_table_pairs_seeds_with_dense() -> None:
    record = {"runs": [
        {"optimizer": "sgd", "scheme": "dense", "variant": "plain",
         "steps_to": {"0.8": [30, 40], "0.9": [60, 80]}},
        {"optimizer": "sgd", "scheme": "topk", "variant": "coupled",
         "steps_to": {"0.8": [45, 60], "0.9": [90, None]}},
    ]}
    table = coupling.targets_table(record)
    assert "| sgd | dense | plain | 1.00 (+0) | 1.00 (+0) |" in table
    # 0.8: ratios 1.5, 1.5, 15 and 20 steps more; 0.9: 1.5 and never (inf), 30 more
    assert "| sgd | topk | coupled | 1.50 (+18) | inf (+30) |" in table


def test_other_workloads_run_their_own_recipe_only() -> None:
    assert coupling.recipe("digits-mlp", "adamw") == (1e-3, 0.9, 32)
    assert coupling.recipe("transformer-digits", "adamw") == (1e-3, 0.9, 32)
    with pytest.raises(ValueError, match="optimizer='sgd': transformer-digits runs"):
        coupling.recipe("transformer-digits", "sgd")
    with pytest.raises(SystemExit):
        coupling.main(["--workload", "dlrm-click", "--optimizers", "adamw"])


def test_tables_name_the_scope_when_it_is_not_the_layer() -> None:
    runs = [{"optimizer": "sgd", "scheme": "dense", "variant": "plain",
             "steps_to_target": [10], "steps_to": {}},
            {"optimizer": "sgd", "scheme": "topk", "variant": "coupled", "scope": "bucket",
             "steps_to_target": [15], "steps_to": {}},
            {"optimizer": "sgd", "scheme": "topk", "variant": "coupled", "scope": "layer",
             "steps_to_target": [20], "steps_to": {}}]
    table = coupling.table({"runs": runs})
    assert "| sgd | topk | coupled, bucket | 15 | 1.50 |" in table
    assert "| sgd | topk | coupled | 20 | 2.00 |" in table


def test_local_adam_with_nothing_dropped_is_adamw() -> None:
    """One worker whose whole direction is applied steps as torch.optim.AdamW does (up to
    rounding: the division order differs), so the variant changes only what is sent."""
    torch.manual_seed(0)
    reference = torch.nn.Linear(6, 3)
    mine = copy.deepcopy(reference)
    adamw = torch.optim.AdamW(reference.parameters(), lr=0.01, betas=(0.9, 0.999))
    local = coupling.LocalAdam(torch.optim.AdamW(mine.parameters(), lr=0.01,
                                                 betas=(0.9, 0.999)))
    params = dict(mine.named_parameters())
    for _ in range(5):
        x = torch.randn(4, 6)
        for net in (reference, mine):
            net.zero_grad()
            net(x).square().sum().backward()
        adamw.step()
        directions = local.directions({k: p.grad.clone() for k, p in params.items()})
        for key, param in params.items():
            param.grad = directions[key]
        local.apply(params)
    for a, b in zip(reference.parameters(), mine.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_local_adam_refuses_other_optimisers() -> None:
    with pytest.raises(ValueError, match="adam-local variant needs AdamW, not SGD"):
        coupling.LocalAdam(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    with pytest.raises(SystemExit):
        coupling.main(["--variants", "adam-local", "--optimizers", "sgd"])


def test_adam_virtual_runs_the_librarys_step_and_is_refused_under_sgd() -> None:
    with pytest.raises(SystemExit):
        coupling.main(["--variants", "adam-virtual", "--optimizers", "sgd"])
    reached, ratio = coupling.simulate("topk", "adam-virtual", "adamw", seed=0, workers=2,
                                       steps=20, warmup=0, eval_every=10, min_numel=0)
    assert ratio > 40  # every tensor 99 % sparse
    assert set(reached) == {0.92}


def test_the_virtual_move_under_adam_is_scaled_by_the_workers_second_moment() -> None:
    from thinwire.feedback import MomentumCorrection, Residual

    param = torch.nn.Parameter(torch.zeros(4))
    memory = MomentumCorrection(Residual(), 0.9, 0.1, beta2=0.999)
    memory.compensate("w", torch.tensor([2.0, 0.0, 0.0, 0.0]))
    memory.inner.buffers["w"] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # pending where g came
    adam = torch.optim.AdamW([param], lr=0.1, eps=1e-8)
    kept = coupling._move_to_virtual({"w": param}, memory, 0.1, adam)
    assert torch.equal(kept["w"], torch.zeros(4))
    # s_hat = g^2 = 4 after one step: entry 0 moves lr e / 2; nothing pends elsewhere
    torch.testing.assert_close(param.detach(), torch.tensor([-0.05, 0.0, 0.0, 0.0]))


def test_the_simulated_exchange_is_the_kernels_bit_for_bit() -> None:
    """The simulation's exchange (each worker's own top-k, error feedback, the mean) equals
    the kernel's rows averaged (SimulatedReplicas, itself held to the real scheme on gloo),
    means and memories, for two workers over three steps; and its bytes are the layouts'."""
    from thinwire.comm import Meter
    from thinwire.feedback import Residual
    from thinwire.jobs.dct_mp import SimulatedReplicas

    shapes = {"fc1.weight": (20, 30), "fc1.bias": (20,), "fc2.weight": (4, 20)}
    infos = [coupling.TensorInfo(key, (torch.Size(shape).numel(),)) for key, shape in
             shapes.items()]
    compressors = [coupling._compressor("topk", 0, "bucket") for _ in range(2)]
    memories = [Residual(), Residual()]
    replicas = SimulatedReplicas("topk", {"min_numel": 0, "scope": "bucket"}, 2, Meter())
    for step in range(3):
        grads = [{key: torch.randn(torch.Size(shape).numel(),
                                   generator=torch.Generator().manual_seed(10 * step + r))
                  for key, shape in shapes.items()} for r in range(2)]
        compensated = [{key: memories[r].compensate(key, grads[r][key]) for key in shapes}
                       for r in range(2)]
        mean = coupling.exchange("topk", compressors, memories, compensated, infos,
                                 list(infos), step, 0.01, "exact", "bucket")
        expected = replicas.mean([replicas.encode(r, grads[r]) for r in range(2)])
        for key in shapes:
            assert torch.equal(mean[key], expected[key])
            for r in range(2):
                kept = replicas.schemes[r].state_dict()["memory"]["buffers"][key]
                assert torch.equal(memories[r].buffers[key], kept)
    assert coupling._wire_bytes("topk", infos, 0.01, 0, "bucket", ()) == sum(
        replicas.schemes[0].payload_bytes(infos).values())
