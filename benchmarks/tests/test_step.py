"""The loopback step benchmark's pure parts: round order and the summary."""

from __future__ import annotations

import copy

import pytest

from benchmarks.step import RATIOS, VARIANTS, order, summarise


def test_rounds_rotate_so_every_variant_leads_once_per_cycle() -> None:
    variants = list(VARIANTS)
    rounds = [order(variants, index) for index in range(len(variants))]
    assert all(sorted(r) == sorted(variants) for r in rounds)
    assert [r[0] for r in rounds] == variants
    assert order(variants, len(variants)) == variants


def test_summary_takes_medians_over_rounds_and_divides_them() -> None:
    times = {"compute": [1.0, 3.0, 2.0], "ddp": [2.0, 2.0, 9.0], "dense": [2.2, 2.1, 2.3],
             "dct-dp": [2.6, 2.5, 2.4], "powersgd": [1.0], "torch-powersgd": [2.0]}
    result = summarise(times)
    assert result["median_s"]["compute"] == 2.0 and result["median_s"]["ddp"] == 2.0
    assert result["ratios"]["dense/ddp"] == pytest.approx(1.1)
    assert result["ratios"]["dct-dp/compute"] == pytest.approx(1.25)
    assert result["ratios"]["powersgd/torch-powersgd"] == pytest.approx(0.5)
    assert "topk/compute" not in result["ratios"]  # not measured: left out
    assert set(result["ratios"]) <= set(RATIOS)


def test_floor_hook_loses_nothing_its_error_memory_does_not_hold(tmp_path: object) -> None:
    """One rank: the floor hook applies what it sends and keeps the rest, so its weights
    differ from plain SGD with momentum by exactly ``lr`` times its error memory
    (sum of sent + error == sum of velocities). The floor does all of dct-dp's maths."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from benchmarks.step import FloorState, floor_hook

    store = dist.FileStore(str(tmp_path) + "/store", 1)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        # A loss linear in the weights: both models see the same gradients at any weights.
        reference = torch.nn.Linear(40, 60)
        model = DistributedDataParallel(copy.deepcopy(reference))
        state = FloorState(density=0.05, min_numel=1024)
        model.register_comm_hook(state, lambda state, bucket: floor_hook(state, bucket))
        plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        coupled = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0)
        for _ in range(6):
            x, weights = torch.randn(16, 40), torch.randn(16, 60)
            for net, optimizer in ((reference, plain), (model, coupled)):
                optimizer.zero_grad()
                (net(x) * weights).sum().backward()
                optimizer.step()
        held = 0
        for mine, theirs in zip(model.module.parameters(), reference.parameters()):
            error = state.error[id(mine)].view(mine.shape)
            held += int(error.count_nonzero())
            torch.testing.assert_close(mine - theirs, 0.1 * error, rtol=0, atol=1e-5)
        assert held > 0  # most entries waited: the check compares something
    finally:
        dist.destroy_process_group()


def test_powersgd_floor_reconstructs_a_gradient_of_rank_below_r(tmp_path: object) -> None:
    """One rank, batch 1: a linear layer's weight gradient is an outer product (rank 1),
    which rank-2 PowerSGD reconstructs exactly from any Q; so the floor hook trains like
    plain DDP up to rounding and its error memory stays at rounding level."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from benchmarks.step import PowerFloorState, floor_powersgd_hook

    store = dist.FileStore(str(tmp_path) + "/store", 1)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        reference = torch.nn.Linear(40, 60)
        model = DistributedDataParallel(copy.deepcopy(reference))
        state = PowerFloorState(rank=2)
        model.register_comm_hook(state, lambda state, bucket: floor_powersgd_hook(state, bucket))
        optimizers = [torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
                      for net in (reference, model)]
        for _ in range(5):
            x, weights = torch.randn(1, 40), torch.randn(1, 60)
            for net, optimizer in zip((reference, model), optimizers):
                optimizer.zero_grad()
                (net(x) * weights).sum().backward()
                optimizer.step()
        for mine, theirs in zip(model.module.parameters(), reference.parameters()):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)
        assert state.error and all(float(e.abs().max()) < 1e-4 for e in state.error.values())
        assert any(float((mine - theirs).detach().abs().max()) > 0  # rounding differs: a real path
                   for mine, theirs in zip(model.module.parameters(), reference.parameters()))
    finally:
        dist.destroy_process_group()
