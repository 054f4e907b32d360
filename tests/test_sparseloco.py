"""SparseLoCo: its codecs, its decayed memory, and local updates through it against a reference.

The reference is written here, one process and W simulated workers, from the
paper's rule: ``e <- beta e + delta``; ``sent = Q(TopK_chunk(e))``;
``e <- e - sent``; ``x <- x - alpha mean(sent)``; with ``overlap`` each mean is
applied one sync late and every replica becomes the new global weights plus
its progress since its last exchange left.
"""

from __future__ import annotations

import copy
import io
import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from exchange_cases import handed_alone
from thinwire import ddp, schemes
from thinwire.comm import Meter
from thinwire.comm.fingerprint import PeerMismatchError
from thinwire.compress import Cast, SparseLayout, TensorInfo, TopK, chunk_index, codebook
from thinwire.compress.chunked import ChunkTopK, chunk_counts, chunk_topk, kept
from thinwire.compress.values import Binned
from thinwire.feedback import Decayed, Residual
from thinwire.launch import spawn
from thinwire.local import LocalUpdates
from thinwire.ps import Layout, PushCodec
from thinwire.schemes import CompressedScheme

WORLD = 3
EVERY = 3
STEPS = 12
LR = 0.05
CONFIG = {"chunk": 64, "k": 4, "beta": 0.95, "aggregate": "ranks"}  # Alg. 1's mean
SHAPES = {"w": (7, 150), "b": (5,)}  # 1050 entries: 16 chunks of 64 and one of 26; b whole


# ---------------------------------------------------------------- the codecs, alone

def _reference_topk(magnitudes: list[float], chunk: int, k: int) -> list[int]:
    """Per chunk, the positions of its largest entries, ties to the lower position."""
    out = []
    for start in range(0, len(magnitudes), chunk):
        part = magnitudes[start: start + chunk]
        count = k if len(part) == chunk else min(len(part), math.ceil(k * len(part) / chunk))
        best = sorted(range(len(part)), key=lambda i: (-part[i], i))[:count]
        out += sorted(start + i for i in best)
    return out


@pytest.mark.parametrize(("numel", "chunk", "k"), [(1050, 64, 4), (64, 64, 64), (5, 64, 4),
                                                   (4096 * 2 + 1, 4096, 64), (130, 8, 1)])
def test_chunk_topk_keeps_each_chunks_largest_with_ties_to_the_lower_position(
        numel: int, chunk: int, k: int) -> None:
    values = torch.randn(numel).round(decimals=1)  # rounded: many ties
    got = chunk_topk(values.abs(), chunk, k)
    assert got.tolist() == _reference_topk(values.abs().tolist(), chunk, k)
    assert got.numel() == kept(numel, chunk, k) == ChunkTopK(chunk, k).capacity(numel)


def test_chunk_topk_bypasses_one_dimensional_tensors_and_refuses_bad_options() -> None:
    selection = ChunkTopK(64, 4)
    assert selection.is_dense(TensorInfo("b", (5000,)))
    assert not selection.is_dense(TensorInfo("w", (50, 100)))
    assert selection.density == 4 / 64
    for chunk, k, match in ((1, 1, "chunk=1"), (64, 0, "k=0"), (64, 65, "k=65")):
        with pytest.raises(ValueError, match=match):
            ChunkTopK(chunk, k)


@pytest.mark.parametrize("fmt", chunk_index.FORMATS)
@pytest.mark.parametrize(("numel", "chunk", "k"), [(1050, 64, 4), (4096 * 3 + 700, 4096, 64),
                                                   (70, 64, 64), (9, 8, 7), (300, 16, 1)])
def test_index_codes_round_trip_in_exactly_their_bytes(fmt: str, numel: int, chunk: int,
                                                       k: int) -> None:
    plan = chunk_counts(numel, chunk, k)
    indices = chunk_topk(torch.randn(numel).abs(), chunk, k)
    code = chunk_index.encode(indices, plan, fmt)
    assert code.dtype == torch.uint8 and code.numel() == chunk_index.nbytes(plan, fmt)
    assert torch.equal(chunk_index.decode(code, plan, fmt), indices)


def test_fixed_code_packs_two_positions_in_three_bytes_and_elias_fano_is_tighter() -> None:
    plan = chunk_counts(4096 * 2, 4096, 2)
    indices = torch.tensor([0x123, 0xABC, 4096 + 0x0FF, 4096 + 0xF00])
    code = chunk_index.encode(indices, plan, "fixed").tolist()
    # a, b -> a & 0xFF, (a >> 8) | (b & 0xF) << 4, b >> 4: the reference code's pairs
    assert code == [0x23, 0xC1, 0xAB, 0xFF, 0x00, 0xF0]
    paper = chunk_counts(4096, 4096, 64)
    assert chunk_index.nbytes(paper, "fixed") == 96  # 64 x 12 bits
    assert chunk_index.nbytes(paper, "elias-fano") == 64  # 64 x 6 + 64 + 63 bits
    with pytest.raises(ValueError, match="indices='delta16'"):
        chunk_index.nbytes(paper, "delta16")


@pytest.mark.parametrize("fmt", chunk_index.FORMATS)
def test_a_layout_of_chunk_positions_and_a_table_per_tensor_round_trips(fmt: str) -> None:
    """Two tensors' chunk top-k in one payload: positions in a chunk code, each tensor's
    values with its own table; its metered parts add up to its size."""
    selection, infos = ChunkTopK(64, 4), [TensorInfo("a", (7, 30)), TensorInfo("b", (300,))]
    x = torch.randn(510, dtype=torch.float64)
    picked = [chunk_topk(part.abs(), 64, 4) for part in x.split([210, 300])]
    indices = torch.cat([picked[0], picked[1] + 210])
    groups = tuple(selection.capacity(info.numel) for info in infos)
    layout = SparseLayout(510, sum(groups), torch.float64, fmt, Binned(),
                          selection.plan(infos), groups)
    assert layout.index_codec.format == fmt
    payload, sent = layout.pack(indices, x[indices], ascending=True)
    got, values = layout.decode(payload)
    assert torch.equal(got, indices) and torch.equal(values, sent)
    assert torch.equal(sent, torch.cat([_reference_codebook(x[i]) for i in
                                        (picked[0], picked[1] + 210)]))
    assert sum(n for _, n in layout.segments([("a", groups[0]), ("b", groups[1])])) \
        == layout.nbytes == payload.numel()
    skipped, _ = layout.pack(indices[:0], x[:0])
    assert layout.decode(skipped)[0].numel() == 0
    with pytest.raises(ValueError, match="all 33 entries or none"):
        layout.pack(indices[:5], x[indices[:5]])


def _reference_codebook(values: torch.Tensor) -> torch.Tensor:
    """The 2-bit values as the paper's reference code decodes them (fp64)."""
    n = values.numel()
    centred = values - values.mean()
    scale = 6.0 * (centred.norm() / math.sqrt(n - 1) if n > 1 else 0.0) / 4
    scale = scale if 0 < scale < math.inf else 1.0
    bins = torch.clamp(torch.round(centred / scale + 2), 0, 3)
    table = torch.tensor([values[bins == b].mean() if bool((bins == b).any()) else 0.0
                          for b in range(4)]).float()  # sent as fp32
    return table.to(values.dtype)[bins.long()]


@pytest.mark.parametrize("numel", [1, 2, 7, 333])
def test_codebook_sends_each_bins_mean_in_its_bytes(numel: int) -> None:
    values = torch.randn(numel, dtype=torch.float64) * 3 + 0.5
    codec = Binned()
    area = torch.zeros(codec.nbytes(numel, values.dtype), dtype=torch.uint8)
    assert area.numel() == math.ceil(math.ceil(numel / 4) / 4) * 4 + 16  # codes padded to 4
    sent = codec.write(values, area, numel)
    back = codec.read(area, numel, numel, torch.float64)
    assert torch.equal(back, _reference_codebook(values)) and torch.equal(sent, back)
    assert torch.equal(codebook.decode(codebook.encode(torch.zeros(5)), torch.float32),
                       torch.zeros(5))


# ---------------------------------------------------------------- the decayed memory

def test_decay_one_is_plain_error_feedback_to_the_bit() -> None:
    decayed, residual = Decayed(1.0), Residual()
    for _ in range(3):
        grad = torch.randn(40)
        got, want = decayed.compensate("w", grad), residual.compensate("w", grad)
        assert torch.equal(got, want)
        picked = torch.tensor([1, 5, 9])
        decayed.update_sparse("w", got, picked, got[picked].half())
        residual.update_sparse("w", want, picked, want[picked].half())
    assert torch.equal(decayed.buffers["w"], residual.buffers["w"])
    assert Decayed.rule == "decayed"
    with pytest.raises(ValueError, match="beta=1.5"):
        Decayed(1.5)


@pytest.mark.parametrize("beta", [0.5, 0.75, 0.0])
def test_invariant_old_error_times_beta_plus_delta_is_sent_plus_new_error(beta: float) -> None:
    """Exact, in fp64 on fp32 deltas with a beta of few bits: each ``p - sent`` then fits."""
    scheme = schemes.build("sparseloco", **{**CONFIG, "beta": beta})
    assert isinstance(scheme, CompressedScheme)
    for _ in range(4):
        deltas = {k: torch.randn(s).float().double() for k, s in SHAPES.items()}
        old = {k: scheme.memory.buffers.get(k, torch.zeros(math.prod(SHAPES[k]),
                                                           dtype=torch.float64)).clone()
               for k in SHAPES}
        sent = scheme.reduce(deltas)  # one process: the mean is what it sent
        for key, delta in deltas.items():
            new = scheme.memory.buffers[key].reshape(-1)
            assert torch.equal(old[key] * beta + delta.reshape(-1),
                               sent[key].reshape(-1) + new)


def test_the_paper_decay_keeps_the_invariant_to_float64_precision() -> None:
    scheme = schemes.build("sparseloco", **CONFIG)
    assert isinstance(scheme, CompressedScheme)
    for _ in range(4):
        deltas = {k: torch.randn(s, dtype=torch.float64) for k, s in SHAPES.items()}
        old = {k: scheme.memory.buffers.get(k, torch.zeros(math.prod(SHAPES[k]),
                                                           dtype=torch.float64)).clone()
               for k in SHAPES}
        sent = scheme.reduce(deltas)
        for key, delta in deltas.items():
            torch.testing.assert_close(old[key] * 0.95 + delta.reshape(-1),
                                       sent[key].reshape(-1) + scheme.memory.buffers[key],
                                       rtol=0, atol=1e-15)


def test_scheme_declares_its_traits_and_refuses_bad_options() -> None:
    traits = schemes.build("sparseloco").traits
    assert (traits.density, traits.memory, traits.collectives) == (64 / 4096, "decayed",
                                                                   ("all_gather",))
    assert traits.sparse and not traits.shared_indices
    for option, match in (({"beta": -0.1}, "beta=-0.1"), ({"indices": "int32"}, "indices"),
                          ({"k": 5000}, "k=5000"), ({"nonfinite": "drop"}, "nonfinite")):
        with pytest.raises(ValueError, match=match):
            schemes.build("sparseloco", **option)


def test_chunk_codes_and_per_tensor_values_need_a_selection_of_fixed_counts() -> None:
    with pytest.raises(ValueError, match="indices='fixed'"):
        CompressedScheme(Cast("fp32"), TopK(0.1), indices="fixed")
    with pytest.raises(ValueError, match="int2-bins"):
        CompressedScheme(Binned(), TopK(0.1))
    with pytest.raises(ValueError, match="mean='all'"):
        CompressedScheme(Binned(), ChunkTopK(64, 4), mean="all")
    CompressedScheme(Binned())  # every tensor whole, a table each


def test_a_non_finite_round_is_skipped_without_touching_memory() -> None:
    scheme = schemes.build("sparseloco", nonfinite="skip", **CONFIG)
    assert isinstance(scheme, CompressedScheme)
    scheme.reduce({k: torch.randn(s) for k, s in SHAPES.items()})
    before = {k: v.clone() for k, v in scheme.memory.buffers.items()}
    bad = {k: torch.randn(s) for k, s in SHAPES.items()}
    bad["w"][0, 0] = math.nan
    out = scheme.reduce(bad)
    assert scheme.skipped == 1 and all(bool((v == 0).all()) for v in out.values())
    assert all(torch.equal(before[k], scheme.memory.buffers[k]) for k in before)
    with pytest.raises(FloatingPointError, match="'w'"):
        schemes.build("sparseloco", **CONFIG).reduce(bad)


def test_a_push_carries_the_ddp_engines_bytes_and_its_step() -> None:
    """The parameter server's push of the whole model is the DDP engine's payload of one
    bucket and the 4-byte step (codes are padded to 4 bytes already), decoded exactly."""
    infos = [TensorInfo(key, shape) for key, shape in SHAPES.items()]
    grad = torch.randn(sum(math.prod(shape) for shape in SHAPES.values()))
    engine = schemes.build("sparseloco", **CONFIG)
    handed = handed_alone(engine, grad, infos)
    assert handed == sum(engine.payload_bytes(infos).values())
    layout = Layout(tuple(SHAPES), tuple(SHAPES.values()))
    worker, server = PushCodec(layout, "sparseloco", **CONFIG), PushCodec(layout, "sparseloco",
                                                                          **CONFIG)
    pushed = worker.encode(grad)
    assert pushed.data.numel() == handed + 4
    assert torch.equal(server.decode(pushed.data, pushed.dense), pushed.sent)


# ---------------------------------------------------------------- local updates, W workers

def _grad(rank: int, step: int, weights: torch.Tensor) -> torch.Tensor:
    """A noisy gradient of ``|w|^2 / 4``: the steps depend on the weights, so when a
    mean lands matters."""
    generator = torch.Generator().manual_seed(1000 * rank + 10 * step + weights.dim())
    noise = torch.randn(weights.shape, generator=generator, dtype=torch.float64)
    return noise + 0.5 * weights.detach()


class _Params(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(7)
        for key, shape in SHAPES.items():
            self.register_parameter(key, nn.Parameter(
                torch.randn(shape, generator=generator, dtype=torch.float64)))


def _inner_step(model: nn.Module, inner: torch.optim.Optimizer, rank: int, step: int) -> None:
    for p in model.parameters():
        p.grad = _grad(rank, step, p)
    inner.step()


def _updates(rank: int, **options: Any) -> tuple[nn.Module, LocalUpdates]:
    model = _Params()
    config = {**CONFIG, **options.pop("config", {})}
    return model, LocalUpdates(model, torch.optim.SGD(model.parameters(), lr=LR),
                               schemes.build("sparseloco", **config), every=EVERY, **options)


def _run(rank: int, stop: int | None = None, **options: Any) -> dict[str, Any]:
    """Train STEPS inner steps (from a checkpoint taken after ``stop`` steps, if given)."""
    model, updates = _updates(rank, **options)
    syncs = []
    for step in range(STEPS):
        if step == stop:
            buffer = io.BytesIO()
            torch.save(updates.state_dict(), buffer)
            model, updates = _updates(rank, **options)
            buffer.seek(0)
            updates.load_state_dict(torch.load(buffer, weights_only=False))
        _inner_step(model, updates.inner, rank, step)
        if updates.step():
            syncs.append({k: v.clone() for k, v in updates.global_state().items()})
    updates.finish()
    return {"syncs": syncs, "final": {k: v.clone() for k, v in updates.global_state().items()},
            "local": {k: p.detach().clone() for k, p in model.named_parameters()},
            "outer": type(updates.outer).__name__,
            "outer groups": updates.outer.param_groups[0]["momentum"]}


def _scenarios(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {"plain": _run(rank), "overlap": _run(rank, overlap=True),
                           "senders": _run(rank, config={"aggregate": "senders"})}
    for stop in (4, 7):  # mid-cycle: under overlap an exchange is in flight
        out[f"resumed {stop}"] = _run(rank, stop, overlap=True)
    meter = Meter(rank, world_size)
    model, updates = _updates(rank, meter=meter)
    for step in range(EVERY * 2):
        _inner_step(model, updates.inner, rank, step)
        updates.step()
    out["metered"] = sum(meter.totals("nbytes").values())
    assert isinstance(updates.scheme, CompressedScheme)
    out["payload"] = updates.scheme.payload_bytes(
        [TensorInfo(k, s, torch.float64) for k, s in SHAPES.items()])
    try:
        _updates(rank, config={"beta": 0.9 if rank == 0 else 0.95})
        out["refused"] = None
    except PeerMismatchError as error:
        out["refused"] = str(error)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return spawn(_scenarios, WORLD, timeout_s=300, deadline_s=600)


def _quantise(e: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """What a worker sends of its compensated memory ``e`` (flat), chunk top-k at 2 bits,
    and where it sent (1.0, else 0.0)."""
    if len(shape) == 1:
        return _reference_codebook(e), torch.ones_like(e)
    picked = torch.tensor(_reference_topk(e.abs().tolist(), CONFIG["chunk"], CONFIG["k"]))
    sent, where = torch.zeros_like(e), torch.zeros_like(e)
    sent[picked] = _reference_codebook(e[picked])
    where[picked] = 1.0
    return sent, where


def _reference(overlap: bool, senders: bool = False) -> dict[str, Any]:
    """SparseLoCo of WORLD workers in one process, alpha 1, each mean applied at its sync
    or (``overlap``) at the next; ``senders``: an entry's sum over the workers that sent it."""
    beta = CONFIG["beta"]
    start = dict(_Params().named_parameters())
    global_ = {k: p.detach().clone() for k, p in start.items()}
    local = [{k: p.detach().clone().requires_grad_() for k, p in start.items()}
             for _ in range(WORLD)]
    inners = [torch.optim.SGD(list(x.values()), lr=LR) for x in local]
    anchor = [{k: p.detach().clone() for k, p in start.items()} for _ in range(WORLD)]
    error = [{k: torch.zeros(p.numel(), dtype=torch.float64) for k, p in start.items()}
             for _ in range(WORLD)]
    waiting: dict[str, torch.Tensor] | None = None
    landed = []  # the global weights after each landing, in order

    def land(mean: dict[str, torch.Tensor]) -> None:
        for k in global_:
            global_[k] = global_[k] - mean[k]  # alpha = 1, no momentum
        with torch.no_grad():
            for r in range(WORLD):
                for k in global_:
                    moved = global_[k] + (local[r][k] - anchor[r][k]) if overlap else global_[k]
                    local[r][k].copy_(moved)
        landed.append({k: v.clone() for k, v in global_.items()})

    for step in range(STEPS):
        for r in range(WORLD):
            for p in local[r].values():
                p.grad = _grad(r, step, p)
            inners[r].step()
        if (step + 1) % EVERY:
            continue
        sent, where = [], []
        for r in range(WORLD):
            mine, mask = {}, {}
            for k in global_:
                origin = anchor[r][k] if overlap else global_[k]
                p = error[r][k] * beta + (origin - local[r][k].detach()).reshape(-1)
                mine[k], mask[k] = _quantise(p, SHAPES[k])
                error[r][k] = p - mine[k]
            sent.append(mine)
            where.append(mask)
        count = {k: (where[0][k] + where[1][k] + where[2][k]).clamp(min=1) if senders
                 else WORLD for k in global_}
        mean = {k: ((sent[0][k] + sent[1][k] + sent[2][k]) / count[k]).view(SHAPES[k])
                for k in global_}
        if not overlap:
            land(mean)
            continue
        if waiting is not None:  # the last sync's mean lands as this one leaves
            land(waiting)
        waiting = mean
        anchor = [{k: p.detach().clone() for k, p in x.items()} for x in local]
    if waiting is not None:  # finish(): the exchange still in flight
        land(waiting)
    return {"landed": landed, "local": [{k: p.detach() for k, p in x.items()} for x in local]}


@pytest.mark.parametrize("mode", ["plain", "overlap", "senders"])
def test_local_updates_through_sparseloco_equal_the_reference_to_float64_precision(
        mode: str, runs: list[dict[str, Any]]) -> None:
    reference = _reference(overlap=mode == "overlap", senders=mode == "senders")
    expected = reference["landed"]
    assert len(expected) == STEPS // EVERY
    for rank in range(WORLD):
        got = runs[rank][mode]
        # overlap: the first sync lands nothing, the last lands in finish()
        assert len(got["syncs"]) == len(expected) - (mode == "overlap")
        for mine, theirs in zip([*got["syncs"], got["final"]],
                                [*expected[: len(got["syncs"])], expected[-1]]):
            for key in SHAPES:
                torch.testing.assert_close(mine[key], theirs[key], rtol=1e-12, atol=1e-12)
        for key in SHAPES:
            torch.testing.assert_close(got["local"][key], reference["local"][rank][key],
                                       rtol=1e-12, atol=1e-12)
        assert got["outer"] == "SGD" and got["outer groups"] == 0.0  # the paper's outer rule
    for key in SHAPES:  # every rank holds the same global weights, to the bit
        assert all(torch.equal(runs[0][mode]["final"][key], runs[r][mode]["final"][key])
                   for r in range(WORLD))
    assert not torch.equal(runs[0]["plain"]["final"]["w"], runs[0][mode]["final"]["w"]) or (
        mode == "plain")


@pytest.mark.parametrize("stop", [4, 7])
def test_resume_with_an_exchange_in_flight_is_bit_identical(
        stop: int, runs: list[dict[str, Any]]) -> None:
    for rank in range(WORLD):
        for part in ("final", "local"):
            for key in SHAPES:
                assert torch.equal(runs[rank][f"resumed {stop}"][part][key],
                                   runs[rank]["overlap"][part][key])


def test_bytes_metered_are_the_payload_every_rank_hands_over(runs: list[dict[str, Any]]) -> None:
    # b, sent whole: 5 codes in 2 bytes padded to 4, and a table of 16; w: the count (4
    # bytes), 16 full chunks (Elias-Fano, 4 of 64: L = 4, 4 x 4 + 4 + 3 = 23 bits each) and
    # one of 26 keeping 2 (L = 3: 6 + 2 + 3 = 11 bits) in 48 bytes, 66 codes in 17 bytes
    # padded to 20, and a table of 16
    expected = 4 + 16 + 4 + (16 * 23 + 11 + 7) // 8 + 20 + 16
    for rank in range(WORLD):
        assert runs[rank]["payload"] == {"all_gather": expected}
        assert runs[rank]["metered"] == 2 * expected  # two syncs


def test_peers_that_differ_in_beta_are_refused_on_every_rank(
        runs: list[dict[str, Any]]) -> None:
    messages = [runs[rank]["refused"] for rank in range(WORLD)]
    assert messages[0] is not None and all(m == messages[0] for m in messages)
    assert "beta" in messages[0]


# ---------------------------------------------------------------- per step, through DDP

def _through_ddp(rank: int, world_size: int) -> list[bool]:
    """Per step: whether ``.grad`` after DDP's backward equals the scheme's own mean of the
    same gradients (one dict, one bucket), bit for bit."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))
    alone = copy.deepcopy(net)  # the same weights, for this rank's own gradient
    model = DistributedDataParallel(net)
    ddp.register(model, schemes.build("sparseloco", **CONFIG))
    reference = schemes.build("sparseloco", **CONFIG)
    generator = torch.Generator().manual_seed(rank)
    equal = []
    for _ in range(3):
        x, y = torch.randn(8, 12, generator=generator), torch.randint(0, 3, (8,),
                                                                      generator=generator)
        alone.zero_grad()
        nn.functional.cross_entropy(alone(x), y).backward()
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        mean = reference.reduce({name: p.grad for name, p in alone.named_parameters()
                                 if p.grad is not None})
        equal.append(all(p.grad is not None and torch.equal(p.grad, mean[name])
                         for name, p in net.named_parameters()))
    return equal


def test_per_step_through_the_ddp_hook_grad_is_the_schemes_mean() -> None:
    """Chunks, tables and memory are each tensor's, so DDP's buckets give what one dict of
    the same gradients gives."""
    assert spawn(_through_ddp, 2) == [[True] * 3] * 2
