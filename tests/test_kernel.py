"""The exchange kernel: contracts kept where they are made, one byte count per layout, one
PowerSGD error rule, declared capabilities, and a new selection through every front door."""

from __future__ import annotations

import ast
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import randomk
from exchange_cases import handed_alone
from thinwire import ddp, optim, schemes
from thinwire.autodiff import DistributedAutodiff
from thinwire.comm.collectives import ALONE
from thinwire.compress import Cast, Sparsifier, TensorInfo, keep_count
from thinwire.compress.lowrank import orthonormalize, seeded_normal
from thinwire.feedback import MomentumCorrection, Residual
from thinwire.launch import spawn
from thinwire.local import LocalUpdates
from thinwire.ps import Layout, PushCodec
from thinwire.schemes import CompressedScheme

SRC = Path(__file__).resolve().parents[1] / "src" / "thinwire"
SHAPES = {"conv.weight": (8, 1, 5, 5), "conv.bias": (8,), "fc.weight": (10, 300),
          "fc.bias": (10,)}


@pytest.fixture
def random_k() -> Iterator[None]:
    with randomk.registered():
        yield


def _grads(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {key: torch.randn(shape, generator=generator, dtype=dtype)
            for key, shape in SHAPES.items()}


@pytest.mark.parametrize("indices", ["delta16", "delta8", "int32"])
@pytest.mark.parametrize("ratio", [0.05, 0.5])  # 0.5: a bitmap is smaller
def test_an_unordered_selection_decodes_where_it_was_taken(indices: str, ratio: float) -> None:
    """Random-k's indices come unordered; the 16-bit code and the bitmap need them
    ascending. The contract is kept where the selection is made, so what arrives is
    exactly p at the drawn indices and ``grad + old_error == sent + new_error``."""
    scheme = CompressedScheme(Cast("native"), randomk.RandomK(ratio), Residual(),
                              indices=indices)
    for step in range(3):
        grads = _grads(step, torch.float64)
        old = {key: scheme.memory.buffers.get(key, torch.zeros(grad.numel(),  # type: ignore[union-attr]
                                                              dtype=grad.dtype)).clone()
               for key, grad in grads.items()}
        sent = scheme.reduce(grads, ALONE)
        for key, grad in grads.items():
            p = grad.reshape(-1) + old[key].reshape(-1)
            new = scheme.memory.buffers[key].reshape(-1)  # type: ignore[union-attr]
            nonzero = sent[key].reshape(-1) != 0
            assert int(nonzero.sum()) == keep_count(grad.numel(), ratio)
            assert torch.equal(sent[key].reshape(-1)[nonzero], p[nonzero])
            assert torch.equal(grad.reshape(-1) + old[key].reshape(-1),
                               sent[key].reshape(-1) + new)


def test_the_8_bit_gap_code_sends_the_same_entries_in_fewer_bytes() -> None:
    """topk at 5 % with 8-bit index offsets: the results of the 16-bit code to the bit, and
    the bytes handed smaller by a byte an index less the 8-bit code's block counts."""
    grads = _grads(0)
    infos = [TensorInfo.of(key, grad) for key, grad in grads.items()]
    flat = torch.cat([grad.reshape(-1) for grad in grads.values()])
    wide, narrow = (schemes.build("topk", ratio=0.05, indices=code)
                    for code in ("delta16", "delta8"))
    ours, theirs = narrow.reduce(grads, ALONE), wide.reduce(grads, ALONE)
    assert all(torch.equal(ours[key], theirs[key]) for key in grads)
    k, numel = keep_count(flat.numel(), 0.05), flat.numel()
    saved = (k * 2 + 3) // 4 * 4 - (k + 3) // 4 * 4 - 4 * (numel // 256)
    assert handed_alone(wide, flat, infos) - handed_alone(narrow, flat, infos) == saved > 0


class _Twice(Sparsifier):
    """Selects index 0 twice: not a selection."""

    density = 0.1  # type: ignore[assignment]

    def _select(self, magnitudes: torch.Tensor, info: TensorInfo,
                call: int) -> tuple[torch.Tensor, float]:
        return torch.tensor([3, 0, 0]), 0.0


def test_a_selection_that_repeats_an_index_is_refused() -> None:
    scheme = CompressedScheme(Cast("native"), _Twice(), Residual())
    with pytest.raises(ValueError, match="twice"):
        scheme.reduce({"w": torch.randn(100)}, ALONE)


@pytest.mark.parametrize("options", [{}, {"scope": "layer"}, {"ratio": 0.3},
                                     {"values": "fp16", "min_numel": 20}])
def test_a_push_carries_the_ddp_engines_bytes_and_its_step(options: dict[str, Any]) -> None:
    """The same tensors in one bucket: what the DDP engine hands its collectives, per rank,
    and a push's row differ by the 4-byte step header and, for half precision values of
    tensors sent whole, their padding to 4 bytes (here 10 biases: 20 B + 4)."""
    grad = torch.cat([g.reshape(-1) for g in _grads(0).values()])
    infos = [TensorInfo(key, shape) for key, shape in SHAPES.items()]
    engine = schemes.build("topk", **options)
    handed = handed_alone(engine, grad, infos)
    assert handed == sum(engine.payload_bytes(infos).values())
    layout = Layout(tuple(SHAPES), tuple(SHAPES.values()))
    pushed = PushCodec(layout, "topk", **options).encode(grad).data.numel()
    padding = sum((-2 * numel) % 4 for numel in (8, 10)) if options.get("values") else 0
    assert pushed == handed + 4 + padding


def _powersgd_errors(rank: int, world_size: int) -> dict[str, Any]:
    """dAD's powersgd mode and the powersgd scheme on the same gradient (equal batches,
    so the site weights are 1), and torch's rule written out: e = M - P_hat mean(Q)^T."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 40), nn.ReLU(), nn.Linear(40, 3)).double()
    engine = DistributedAutodiff(model, "powersgd", rank=2)
    x = torch.randn(8, 30, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    nn.functional.cross_entropy(model(x), torch.arange(8) % 3).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}  # type: ignore[union-attr]
    engine.synchronize()
    scheme = schemes.build("powersgd", rank=2)
    scheme.reduce(grads)
    matrix = grads["0.weight"]  # (40, 30), the one matrix that compresses at rank 2
    q = seeded_normal("0.weight", (30, 2), seed=0, dtype=torch.float64)
    p = matrix @ q
    torch.distributed.all_reduce(p)
    p_hat = orthonormalize(p / world_size)
    q_mean = matrix.t() @ p_hat
    torch.distributed.all_reduce(q_mean)
    return {"engine": engine.powersgd.state_dict()["memory"]["buffers"],
            "scheme": scheme.state_dict()["memory"]["buffers"],
            "torch": matrix - p_hat @ (q_mean / world_size).t()}


def test_powersgd_keeps_one_error_rule_torchs() -> None:
    for rank in spawn(_powersgd_errors, 2):
        assert set(rank["engine"]) == set(rank["scheme"]) == {"0.weight"}
        assert torch.equal(rank["engine"]["0.weight"], rank["scheme"]["0.weight"])
        torch.testing.assert_close(rank["engine"]["0.weight"].view(40, 30), rank["torch"],
                                   rtol=0, atol=1e-12)


def test_schemes_of_two_rounds_are_refused_by_the_server() -> None:
    layout = Layout(("w",), ((4, 4),))
    for name in ("clt-k", "powersgd"):
        with pytest.raises(ValueError, match="first round"):
            PushCodec(layout, name)


def test_topk_with_codes_couples_as_the_other_sparsifiers() -> None:
    scheme = schemes.build("topk+int2", ratio=0.1)
    assert scheme.traits.density == 0.1 and scheme.traits.memory == "residual"
    assert scheme.traits.clips_in_hook
    net = nn.Linear(20, 10)
    coupling = optim.couple(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), scheme)
    assert coupling.coupled and isinstance(scheme.error_memory, MomentumCorrection)
    out = scheme.reduce({"w": torch.randn(10, 20), "b": torch.randn(10)}, ALONE)
    assert int((out["w"] != 0).sum()) == 20


def test_every_scheme_declares_what_it_is() -> None:
    for name in schemes.names():
        traits = schemes.build(name).traits
        assert traits.rounds == (2 if name in ("clt-k", "powersgd") else 1), name
        assert traits.sparse == (traits.density is not None and traits.memory is not None)
        assert traits.collectives, name


def _scheme_names() -> set[str]:
    return {"CompressedScheme", "Sparsifier", "TopK", "DCTThreshold",
            "LaplaceThreshold", "Selection", "Agreed", "LeaderIndices", "LowRankBasis",
            "Quantised", "Cast", "ValueCodec"}


def test_no_layer_above_the_schemes_asks_a_scheme_its_class() -> None:
    """Outside ``schemes/`` and ``compress/`` no ``isinstance`` names a scheme, selection or
    codec class, and no ``getattr`` or ``hasattr`` reads a scheme: they read its traits."""
    found = []
    for path in SRC.rglob("*.py"):
        if path.parent.name in ("schemes", "compress"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                continue
            args = node.args
            if node.func.id == "isinstance" and len(args) == 2:
                named = {n.id if isinstance(n, ast.Name) else getattr(n, "attr", "")
                         for n in ast.walk(args[1])}
                if named & _scheme_names():
                    found.append(f"{path.name}:{node.lineno} isinstance {sorted(named)}")
            if node.func.id in ("getattr", "hasattr") and args and "scheme" in ast.unparse(
                    args[0]):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not found, found


# -- a new selection through every front door (the FSDP one: tests/test_fsdp.py) --------

def _front_doors(rank: int, world_size: int) -> dict[str, Any]:
    randomk.register()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))
    alone = copy.deepcopy(net)  # the same weights, for this rank's own gradient
    model = DistributedDataParallel(net)
    state = ddp.register(model, schemes.build(randomk.NAME, ratio=0.25))
    memory = state.scheme.error_memory
    assert memory is not None
    generator = torch.Generator().manual_seed(rank)
    steps = []
    for _ in range(2):
        x, y = torch.randn(8, 12, generator=generator), torch.randint(0, 3, (8,),
                                                                      generator=generator)
        before = {k: v.clone() for k, v in memory.buffers.items()}
        alone.zero_grad()
        nn.functional.cross_entropy(alone(x), y).backward()
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        sent = {}  # p - new error: exactly what this rank sent (p at the drawn entries)
        for (name, local), p in zip(alone.named_parameters(), net.parameters()):
            assert local.grad is not None and p.grad is not None
            compensated = local.grad.reshape(-1) + before.get(name, torch.zeros(p.numel()))
            sent[name] = compensated - memory.buffers[name].reshape(-1)
        steps.append({"sent": sent, "mean": {name: p.grad.reshape(-1).clone()  # type: ignore[union-attr]
                                             for name, p in net.named_parameters()}})
    replica = nn.Linear(6, 2)
    inner = torch.optim.SGD(replica.parameters(), lr=0.1)
    updates = LocalUpdates(replica, inner, schemes.build(randomk.NAME, ratio=0.25), every=2)
    torch.manual_seed(rank)  # each rank trains its own batches from the same weights
    for _ in range(4):
        inner.zero_grad()
        replica(torch.randn(5, 6)).square().mean().backward()
        inner.step()
        updates.step()
    return {"hook": steps, "global": {k: v.clone() for k, v in updates.global_state().items()}}


@pytest.fixture(scope="module")
def doors() -> list[dict[str, Any]]:
    return spawn(_front_doors, 2)


def test_a_new_selection_runs_through_the_ddp_hook_and_local_updates(
        doors: list[dict[str, Any]]) -> None:
    """Through the hook, ``.grad`` is the mean of what each rank sent, on both ranks; through
    local updates, both workers end with the same global weights."""
    for step in range(2):
        mine, theirs = doors[0]["hook"][step], doors[1]["hook"][step]
        for name, mean in mine["mean"].items():
            assert torch.equal(mean, theirs["mean"][name])
            assert torch.equal(mean, (mine["sent"][name] + theirs["sent"][name]) / 2)
            assert 0 < int((mine["sent"][name] != 0).sum()) < mean.numel()
    for key, value in doors[0]["global"].items():
        assert torch.equal(value, doors[1]["global"][key])


def test_a_new_selection_runs_through_the_parameter_server(random_k: None) -> None:
    layout = Layout(tuple(SHAPES), tuple(SHAPES.values()))
    worker = PushCodec(layout, randomk.NAME, ratio=0.2)
    server = PushCodec(layout, randomk.NAME, ratio=0.2)
    for seed in range(3):
        grad = torch.cat([g.reshape(-1) for g in _grads(seed).values()])
        encoded = worker.encode(grad)
        decoded = server.decode(encoded.data, encoded.dense)
        assert torch.equal(decoded, encoded.sent)
        assert int((decoded != 0).sum()) == sum(keep_count(torch.Size(shape).numel(), 0.2)
                                                for shape in SHAPES.values())
