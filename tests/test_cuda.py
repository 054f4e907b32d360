"""The CUDA cases: every scheme, boundary and engine on a GPU, against the CPU.

Skipped where torch finds no GPU. The codecs get the same inputs on both
devices, so a sparsifier's result must be bit-identical (selection, error
feedback and the mean are elementwise or exact); PowerSGD's products and QR
round differently on the two, so it is held to a tolerance. On one GPU, NCCL
runs one rank, and two gloo ranks share the GPU (gloo stages CUDA tensors
through host memory); NCCL with two ranks needs two GPUs and is skipped
below that.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_leaves

from thinwire import ddp, schemes
from thinwire.autodiff import MODES, DistributedAutodiff
from thinwire.comm import Meter
from thinwire.compress import TensorInfo
from thinwire.compress._select import GPU_DIRECT, largest_in_order
from thinwire.compress.cltk import chunk_topk, decode_indices, encode_indices, exact_topk
from thinwire.compress.payload import SparseLayout
from thinwire.launch import spawn
from thinwire.pipeline.boundary import compact, expand

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GPU = torch.device("cuda", 0)
STEPS = 4
CONFIGS: dict[str, dict[str, Any]] = {
    "dense": {},
    "fp16": {},
    "topk": {"ratio": 0.1, "min_numel": 20},
    "dct-dp": {"ratio": 0.1, "life_span": 2, "min_numel": 20},
    "laplace": {"ratio": 0.1, "min_numel": 20, "capacity": 1.5},
    "powersgd": {"rank": 2},
    "clt-k": {"ratio": 0.1, "min_numel": 20},
    "local-topk": {"ratio": 0.1, "min_numel": 20},
    **{kind: {"chunk": 16} for kind in ("int8", "int4", "int2", "sign")},
    **{f"topk+{kind}": {"ratio": 0.1, "chunk": 16} for kind in ("int8", "int4", "int2", "sign")},
    "sparseloco": {"chunk": 64, "k": 8},
}
# DDP runs that hold a step's buckets (label -> scheme, max_norm, with a GradScaler): one
# factor or one overflow vote, and futures relayed across the step's buckets on the GPU.
CLIPPED = {"topk+clip": ("topk", 0.05, False), "powersgd+clip": ("powersgd", 0.05, False),
           "topk+amp": ("topk", None, True)}
# Parameter shapes laid out in three buckets, the last one last, as DDP hands them over.
BUCKETS = [{"c.weight": (16, 32), "c.bias": (16,)}, {"b.weight": (32, 32)},
           {"a.weight": (32, 12), "a.bias": (32,)}]


def test_every_registered_scheme_is_covered() -> None:
    assert set(CONFIGS) == set(schemes.names())


def _assert_matches(name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    """``got`` (computed on the GPU, copied back) against the CPU's ``expected``."""
    if name == "powersgd":  # matmul and QR round differently on the two devices
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    elif name.endswith("sign") or name == "sparseloco":  # a scale or a bin's value is a
        # mean: a sum, ordered differently on a GPU
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(got, expected), name


def _bucket_steps(name: str, device: torch.device, rank: int,
                  group: dist.ProcessGroup | None) -> list[list[torch.Tensor]]:
    """``STEPS`` steps of scheme ``name`` through ``launch_flat`` on ``BUCKETS`` (every
    launch but the last may defer, as under DDP); each rank's gradients drawn on the CPU
    from one seed, so both devices see the same numbers. The results, in bucket order,
    copied to the CPU."""
    scheme = schemes.build(name, **CONFIGS[name])
    steps = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        futures = []
        for i, shapes in enumerate(BUCKETS):
            grads = {key: torch.randn(shape, generator=generator) for key, shape in shapes.items()}
            infos = [TensorInfo.of(key, grad) for key, grad in grads.items()]
            buffer = torch.cat([grad.reshape(-1) for grad in grads.values()]).to(device)
            futures.append(scheme.launch_flat(buffer, infos, group,
                                              last=i == len(BUCKETS) - 1))
        results = [future.wait() for future in futures]
        assert all(result.device == device for result in results), name
        steps.append([result.to("cpu", copy=True) for result in results])
    state = [leaf for leaf in tree_leaves(scheme.state_dict()) if isinstance(leaf, torch.Tensor)]
    assert all(leaf.device == device for leaf in state if leaf.numel() > 1), \
        f"{name} keeps state away from {device}"
    return steps


@pytest.mark.parametrize("name", CONFIGS)
def test_scheme_on_the_gpu_matches_the_cpu(name: str) -> None:
    cpu = _bucket_steps(name, torch.device("cpu"), 0, None)
    gpu = _bucket_steps(name, GPU, 0, None)
    for cpu_step, gpu_step in zip(cpu, gpu):
        for expected, got in zip(cpu_step, gpu_step):
            _assert_matches(name, got, expected)


def _gloo_on_both_devices(rank: int, world_size: int) -> dict[str, Any]:
    return {name: {device.type: _bucket_steps(name, device, rank, None)
                   for device in (torch.device("cpu"), GPU)}
            for name in CONFIGS}


def test_two_gloo_ranks_sharing_the_gpu_match_the_cpu_and_each_other() -> None:
    runs = spawn(_gloo_on_both_devices, 2)
    for name in CONFIGS:
        for rank in (0, 1):
            for cpu_step, gpu_step in zip(runs[rank][name]["cpu"], runs[rank][name]["cuda"]):
                for expected, got in zip(cpu_step, gpu_step):
                    _assert_matches(name, got, expected)
        for a, b in zip(runs[0][name]["cuda"], runs[1][name]["cuda"]):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"{name}: replicas differ"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 16))


def _ddp_train(rank: int, world_size: int, device_name: str) -> dict[str, Any]:
    """Every scheme through the DDP hook for ``STEPS`` steps on ``device_name`` (``"gpu"``:
    this rank's GPU under NCCL, the shared one under gloo): parameters and bytes handed."""
    device = torch.device("cpu") if device_name == "cpu" else (
        torch.device("cuda", rank) if dist.get_backend() == "nccl" else GPU)
    out = {}
    runs = [(name, name, None, False) for name in CONFIGS] + [
        (label, *run) for label, run in CLIPPED.items()]
    for label, name, max_norm, amp in runs:
        model = _model().to(device)
        net = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda"
                                      else None, bucket_cap_mb=0.004)
        meter = Meter(rank, world_size)
        scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 16) if amp else None
        ddp.register(net, schemes.build(name, **CONFIGS[name]), meter=meter,
                     max_norm=max_norm, scaler=scaler)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        for step in range(STEPS):
            generator = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(8, 12, generator=generator), torch.randint(0, 16, (8,),
                                                                         generator=generator)
            loss = nn.functional.cross_entropy(net(x.to(device)), y.to(device))
            optimizer.zero_grad()
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            meter.next_step()
        out[label] = {"params": [p.detach().cpu() for p in model.parameters()],
                      "devices": {p.device.type for p in model.parameters()},
                      "bytes": meter.totals("nbytes", by="collective")}
    return out


def _check_ddp(gpu: list[dict[str, Any]], cpu: list[dict[str, Any]]) -> None:
    for name in [*CONFIGS, *CLIPPED]:
        for rank, run in enumerate(gpu):
            assert run[name]["devices"] == {"cuda"}
            # Bytes are what the scheme hands to torch.distributed, whatever the device.
            assert run[name]["bytes"] == cpu[rank][name]["bytes"], name
            for p in run[name]["params"]:
                assert torch.isfinite(p).all(), name
            if name in ("dense", "fp16"):  # no selection that a rounding could tip
                for got, expected in zip(run[name]["params"], cpu[rank][name]["params"]):
                    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        for a, b in zip(gpu[0][name]["params"], gpu[-1][name]["params"]):
            assert torch.equal(a, b), f"{name}: replicas differ"
    for run in gpu:  # the loss scale, a power of two, never reaches the scheme
        for a, b in zip(run["topk+amp"]["params"], run["topk"]["params"]):
            assert torch.equal(a, b)


def test_ddp_hook_under_nccl_with_one_rank() -> None:
    _check_ddp(spawn(_ddp_train, 1, "gpu", backend="nccl"), spawn(_ddp_train, 1, "cpu"))


def test_ddp_hook_under_gloo_with_two_ranks_on_one_gpu() -> None:
    _check_ddp(spawn(_ddp_train, 2, "gpu"), spawn(_ddp_train, 2, "cpu"))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank")
def test_ddp_hook_under_nccl_with_two_ranks() -> None:
    _check_ddp(spawn(_ddp_train, 2, "gpu", backend="nccl"), spawn(_ddp_train, 2, "cpu"))


def test_train_runs_on_the_gpu_under_nccl_by_default(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from test_cli import _free_port
    from thinwire.cli import main

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(key, value)
    results = {}
    for device in ("default", "cpu"):
        monkeypatch.setenv("MASTER_PORT", str(_free_port()))
        argv = [] if device == "default" else ["--device", "cpu"]
        assert main(["train", "--scheme", "dct-dp", "--steps", "30", "--batch-size", "32",
                     *argv, "--out", str(tmp_path / device),
                     "--json", str(tmp_path / f"{device}.json")]) == 0
        results[device] = json.loads((tmp_path / f"{device}.json").read_text())["runs"][0]
    on_gpu, on_cpu = results["default"], results["cpu"]
    assert (on_gpu["device"], on_cpu["device"]) == ("cuda:0", "cpu")
    assert on_gpu["steps"] == 30 and on_gpu["test_accuracy"] > 0.2  # chance is 0.1
    assert abs(on_gpu["test_accuracy"] - on_cpu["test_accuracy"]) < 0.1
    assert on_gpu["bytes_sent_per_step"] == on_cpu["bytes_sent_per_step"]


@pytest.mark.parametrize("threshold", ["topk", "laplace"])
def test_boundary_on_the_gpu_matches_the_cpu(threshold: str) -> None:
    acts = torch.randn(6, 40)
    results = []
    for device in (torch.device("cpu"), GPU):
        x = acts.to(device, copy=True).requires_grad_()
        values, indices = compact(x, 0.25, threshold=threshold)
        out = expand(values, indices, 40)
        out.backward(torch.arange(out.numel(), dtype=out.dtype, device=device).view_as(out))
        assert x.grad is not None
        results.append((out.detach().cpu(), x.grad.cpu()))
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("k", [1, 7, 100])
def test_cltk_selection_and_index_encoding_on_the_gpu(k: int) -> None:
    magnitudes = torch.rand(100)
    for select in (chunk_topk, exact_topk):
        on_cpu = select(magnitudes, k)
        on_gpu = select(magnitudes.to(GPU), k)
        assert on_gpu.device.type == "cuda"
        assert torch.equal(on_gpu.sort().values.cpu(), on_cpu.sort().values)
        assert torch.equal(encode_indices(on_gpu.sort().values, 100).cpu(),
                           encode_indices(on_cpu.sort().values, 100))


@pytest.mark.parametrize("count", [0, 1, 3000, 10_000])
def test_16_bit_index_code_across_blocks_on_the_gpu_is_the_cpus_bytes(count: int) -> None:
    """Payloads and CLT-k index sets spanning several blocks of 65536 entries: the GPU
    writes the CPU's bytes and reads them back."""
    numel = 300_000
    indices = torch.randperm(numel, generator=torch.Generator().manual_seed(count))[:count]
    indices = indices.sort().values
    values = torch.randn(count)
    layout = SparseLayout(numel, 10_000, torch.float32, "delta16")
    assert not layout.uses_bitmap
    on_cpu = layout.encode(indices, values)
    on_gpu = layout.encode(indices.to(GPU), values.to(GPU), ascending=True)
    assert on_gpu.device.type == "cuda" and torch.equal(on_gpu.cpu(), on_cpu)
    got_indices, got_values = layout.decode(on_gpu)
    assert torch.equal(got_indices.cpu(), indices) and torch.equal(got_values.cpu(), values)
    if count:
        wire = encode_indices(indices.to(GPU), numel)
        assert torch.equal(wire.cpu(), encode_indices(indices, numel))
        assert torch.equal(decode_indices(wire, count, numel).cpu(), indices)


def _tied(case: str, numel: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(numel)
    if case == "constant":
        return torch.ones(numel)
    if case == "zeros":
        return torch.zeros(numel)
    if case == "few values":
        return torch.randint(0, 4, (numel,), generator=generator).float()
    huge = torch.zeros(numel)
    huge[numel // 3] = 1e30
    return huge


@pytest.mark.parametrize("numel", [100, 70_000, 1_000_000, GPU_DIRECT + 4096])
@pytest.mark.parametrize("case", ["constant", "zeros", "few values", "one huge"])
def test_largest_in_order_on_the_gpu_keeps_the_same_tied_positions(case: str,
                                                                   numel: int) -> None:
    """The GPU's direct path (torch.topk, then a sort) and its candidates path
    (above GPU_DIRECT) keep the lowest positions of the entries tied at the k-th
    value, as the CPU does."""
    magnitudes = _tied(case, numel)
    on_gpu = magnitudes.to(GPU)
    for k in sorted({1, 7, numel // 100, numel // 2, numel - 1}):
        expected = largest_in_order(magnitudes, k)
        assert torch.equal(largest_in_order(on_gpu, k).cpu(), expected), (case, numel, k)


@pytest.mark.parametrize("mode", MODES)
def test_autodiff_engine_on_the_gpu_matches_the_cpu(mode: str) -> None:
    inputs = torch.randn(6, 5, dtype=torch.float64)
    labels = torch.arange(6) % 3
    grads = []
    for device in (torch.device("cpu"), GPU):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)).double().to(device)
        options = {"rank": 2} if mode in ("rank-dad", "powersgd") else {}
        engine = DistributedAutodiff(model, mode, **options)
        nn.functional.cross_entropy(model(inputs.to(device)), labels.to(device)).backward()
        grads.append(engine.synchronize())
    for key, expected in grads[0].items():
        assert grads[1][key].device.type == "cuda"
        torch.testing.assert_close(grads[1][key].cpu(), expected, rtol=1e-9, atol=1e-12)


def _autodiff_sites(rank: int, world_size: int) -> dict[str, dict[str, list[torch.Tensor]]]:
    """Each mode's synchronised gradients at this site, on the CPU and on the shared GPU."""
    generator = torch.Generator().manual_seed(rank)
    inputs = torch.randn(6, 5, dtype=torch.float64, generator=generator)
    labels = torch.randint(0, 3, (6,), generator=generator)
    out: dict[str, dict[str, list[torch.Tensor]]] = {}
    for mode in MODES:
        for device in (torch.device("cpu"), GPU):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)).double()
            model.to(device)
            options = {"rank": 2} if mode in ("rank-dad", "powersgd") else {}
            engine = DistributedAutodiff(model, mode, **options)
            nn.functional.cross_entropy(model(inputs.to(device)), labels.to(device)).backward()
            grads = engine.synchronize()
            out.setdefault(mode, {})[device.type] = [grads[key].cpu() for key in sorted(grads)]
    return out


def test_autodiff_engine_across_two_gloo_sites_on_the_gpu_matches_the_cpu() -> None:
    sites = spawn(_autodiff_sites, 2)
    for mode in MODES:
        for site in sites:
            for got, expected in zip(site[mode]["cuda"], site[mode]["cpu"]):
                torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)
        for a, b in zip(sites[0][mode]["cuda"], sites[1][mode]["cuda"]):
            assert torch.equal(a, b), f"{mode}: sites disagree"


def test_burst_aware_adam_and_its_look_ahead_on_the_gpu_match_the_cpu() -> None:
    from thinwire.feedback import MomentumCorrection, Residual
    from thinwire.optim.adam import AgedAdam, look_ahead

    torch.manual_seed(0)
    grads = [torch.randn(64) * (torch.rand(64) < 0.2) for _ in range(6)]
    error = torch.randn(64) * 1e-2
    out = {}
    for device in ("cpu", GPU):
        weights = nn.Parameter(torch.ones(64, device=device))
        memory = MomentumCorrection(Residual(), 0.9, 0.1, beta2=0.999)
        adam = torch.optim.AdamW([weights], lr=0.01)
        AgedAdam(adam, {id(weights): "w"}, memory)
        for grad in grads:
            memory.compensate("w", grad.to(device))
            weights.grad = grad.to(device)
            adam.step()
        move = look_ahead(memory)("w", error.to(device), adam.param_groups[0])
        assert move is not None and move.device == weights.device
        out[str(device)] = (weights.detach().cpu(), move.cpu())
    for cpu, gpu in zip(out["cpu"], out[str(GPU)]):
        torch.testing.assert_close(gpu, cpu, rtol=1e-6, atol=1e-7)
