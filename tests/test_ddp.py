"""The DDP hook over gloo: identity is bit-exact, keying survives buckets, state resumes."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from thinwire import ddp, optim
from thinwire.comm import Meter, collectives
from thinwire.comm.fingerprint import PeerMismatchError
from thinwire.compress import DensePayload, SparsePayload, TensorInfo, decode
from thinwire.ddp.hold import Stage
from thinwire.launch import spawn
from thinwire.schemes import CompressedScheme, build, streaming

STEPS = 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(),
                         nn.Linear(16, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 12, generator=generator), torch.randint(0, 3, (8,), generator=generator)


def _train(net: nn.Module, rank: int, steps: range, optimizer: torch.optim.Optimizer,
           poison: tuple[int, int] | None = None, clip_after: float | None = None,
           scaler: torch.amp.GradScaler | None = None, skip: int | None = None) -> None:
    """``skip``: a step whose batch is drawn but not trained on, on every rank."""
    for step in steps:
        x, y = _batch(rank, step)
        if step == skip:
            continue
        if poison == (rank, step):
            x = x.clone()
            x[0, 0] = float("nan")
        loss = nn.functional.cross_entropy(net(x), y)
        optimizer.zero_grad()
        if scaler is None:
            loss.backward()
        else:  # torch's AMP recipe; the loss scale is a power of two, so exact
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        if clip_after is not None:  # as a script written for dense training does
            nn.utils.clip_grad_norm_(net.parameters(), clip_after)
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()


def _ddp_run(rank: int, world_size: int, scheme: str | None, config: dict[str, Any],
             bucket_cap_mb: float, poison: tuple[int, int] | None = None,
             couple: bool = False, feedback: str = "auto",
             virtual: bool = True, adamw: bool = False,
             bucket_view: bool = False, max_norm: float | None = None,
             clip_after: float | None = None, amp: bool = False,
             skip: int | None = None, via_hook_state: bool = False,
             one_call: bool = False) -> dict[str, Any]:
    """``one_call``: the optimiser is coupled by ``register``/``hook_state`` themselves."""
    model = _model()
    net = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb,
                                  gradient_as_bucket_view=bucket_view)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16) if amp else None
    optimizer: torch.optim.Optimizer = (
        torch.optim.AdamW(net.parameters(), lr=0.01) if adamw
        else torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    given = optimizer if one_call else None
    state = None
    if scheme is not None and via_hook_state:  # as Lightning's strategy registers it
        state = ddp.hook_state(model, build(scheme, **config), max_norm=max_norm,
                               scaler=scaler, optimizer=given)
        net.register_comm_hook(state, ddp.comm_hook)
    elif scheme is not None:
        state = ddp.register(net, build(scheme, **config), meter=Meter(rank, world_size),
                             max_norm=max_norm, scaler=scaler, optimizer=given)
    if couple and not one_call:
        optim.couple(optimizer, state, feedback=feedback, virtual=virtual)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(net, rank, range(STEPS), optimizer, poison, clip_after, scaler, skip)
    out: dict[str, Any] = {"params": [p.detach().clone() for p in model.parameters()],
                           "warnings": [str(w.message) for w in caught]}
    if state is not None:
        out["scheme"] = state.scheme.state_dict()
        out["skipped"] = state.scheme.skipped
    if state is not None and state.clip is not None:
        out["clipped"] = state.clip.clipped
    if scaler is not None and state is not None and state.loss_scale is not None:
        out["scale"], out["overflows"] = scaler.get_scale(), state.loss_scale.skipped
    return out


def _reference_reduce(scheme: Any, grads: dict[str, torch.Tensor],
                      world_size: int) -> dict[str, torch.Tensor]:
    """The per-tensor path the flat engine must match bit for bit: compensate, compress,
    decode and update each tensor on its own; dense payloads all-reduced (divided
    first), sparse ones decoded and summed in rank order, then divided."""
    compressor, memory = scheme.selection, scheme.memory
    out = {}
    for key, grad in grads.items():
        flat = grad.reshape(-1)
        info = TensorInfo.of(key, flat)
        compensated = flat.clone() if memory is None else memory.compensate(key, flat)
        payload = compressor.compress(compensated, info)
        cast = scheme.values.cast  # the scheme's value codec (fp16 values, say)
        payload = (DensePayload(cast(payload.values)) if isinstance(payload, DensePayload)
                   else SparsePayload(cast(payload.values), payload.indices, payload.numel))
        decoded = decode(payload, info)
        if memory is not None:
            memory.update(key, compensated, decoded)
        if isinstance(payload, DensePayload):
            mean = payload.values.clone().div_(world_size)
            dist.all_reduce(mean)
            out[key] = mean.to(grad.dtype).view(grad.shape)
        else:
            parts = [torch.empty_like(decoded) for _ in range(world_size)]
            dist.all_gather(parts, decoded)
            total = torch.zeros_like(decoded)
            for part in parts:
                total += part
            out[key] = (total / world_size).view(grad.shape)
    return out


def _train_without_ddp(rank: int, scheme: Any,
                       reduce: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
                       ) -> list[torch.Tensor]:
    """The training of ``_ddp_run`` without DDP: local gradients through ``reduce``."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(rank, step)
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        reduced = reduce({name: p.grad for name, p in model.named_parameters()})
        for name, p in model.named_parameters():
            p.grad = reduced[name]
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _manual_run(rank: int, world_size: int, config: dict[str, Any],
                name: str = "dct-dp", local_clip: float | None = None) -> list[torch.Tensor]:
    """The same training through ``scheme.reduce`` (every rank starts from equal weights);
    ``local_clip``: each rank's gradients clipped at that norm first."""
    scheme = build(name, **config)

    def reduce(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if local_clip is not None:  # clip_grad_norm_'s rule, on the gradients themselves
            norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads.values()]))
            scale = min(1.0, local_clip / (float(norm) + 1e-6))
            grads = {key: g * scale for key, g in grads.items()}
        return scheme.reduce(grads)

    return _train_without_ddp(rank, scheme, reduce)


def _reference_run(rank: int, world_size: int, scheme_name: str,
                   config: dict[str, Any]) -> dict[str, Any]:
    """The same training through the per-tensor path, :func:`_reference_reduce`."""
    scheme = build(scheme_name, **config)
    params = _train_without_ddp(rank, scheme,
                                lambda grads: _reference_reduce(scheme, grads, world_size))
    return {"params": params, "scheme": scheme.state_dict()}


def _resume_run(rank: int, world_size: int, split: int,
                config: dict[str, Any] | None = None,
                adamw: bool = False) -> list[torch.Tensor]:
    """Train STEPS steps, checkpointing and rebuilding everything after ``split``.

    ``adamw``: topk under a coupled AdamW (the burst-aware Adam step and its look-ahead),
    else dct-dp under uncoupled SGD with momentum.
    """
    name = "topk" if adamw else "dct-dp"
    config = config or ({"ratio": 0.1, "min_numel": 0} if adamw
                        else {"ratio": 0.2, "life_span": 4})

    def build_all(model: nn.Module) -> tuple[nn.Module, Any, torch.optim.Optimizer]:
        net = DistributedDataParallel(model, bucket_cap_mb=0.001)
        state = ddp.register(net, build(name, **config))
        optimizer: torch.optim.Optimizer = (
            torch.optim.AdamW(net.parameters(), lr=0.01) if adamw
            else torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
        if adamw:
            optim.couple(optimizer, state)
        return net, state, optimizer

    model = _model()
    net, state, optimizer = build_all(model)
    _train(net, rank, range(split), optimizer)
    if split < STEPS:
        checkpoint = copy.deepcopy({"model": model.state_dict(), "opt": optimizer.state_dict(),
                                    "scheme": state.scheme.state_dict()})
        model = _model()
        model.load_state_dict(checkpoint["model"])
        net, state, optimizer = build_all(model)  # coupled before the state loads
        state.scheme.load_state_dict(checkpoint["scheme"])
        optimizer.load_state_dict(checkpoint["opt"])
        _train(net, rank, range(split, STEPS), optimizer)
    return [p.detach().clone() for p in model.parameters()]


DCT = {"ratio": 0.1, "life_span": 3}
# Per pair, what each of two ranks registers: (name, config) for rank 0 and rank 1.
MISMATCHES: dict[str, tuple[tuple[str, dict[str, Any]], tuple[str, dict[str, Any]]]] = {
    "ratio": (("dct-dp", {"ratio": 0.1}), ("dct-dp", {"ratio": 0.01})),
    "scheme": (("dct-dp", {}), ("topk", {})),
    "dense-vs-sparse": (("dense", {}), ("dct-dp", {})),
    "values": (("dct-dp", {}), ("dct-dp", {"values": "fp16"})),
    "agree": (("dct-dp", DCT), ("dct-dp", DCT)),
}


def _mismatch_run(rank: int, pair: str) -> str:
    """Register rank's half of ``pair``; the error message, or "" when the peers agree."""
    name, config = MISMATCHES[pair][rank]
    net = DistributedDataParallel(_model())
    try:
        ddp.register(net, build(name, **config))
    except PeerMismatchError as error:
        return str(error)
    return ""


def _mismatch_at_first_call(rank: int) -> str:
    """Frameworks that register the hook themselves (``hook_state``): the peers are
    compared at the hook's first call, inside backward."""
    name, config = MISMATCHES["ratio"][rank]
    model = _model()
    net = DistributedDataParallel(model)
    net.register_comm_hook(ddp.hook_state(model, build(name, **config)), ddp.comm_hook)
    x, y = _batch(rank, 0)
    try:
        nn.functional.cross_entropy(net(x), y).backward()
    except Exception as error:  # DDP's reducer re-raises the hook's error as its own
        return str(error)
    return ""
# Tensors of 3 and 16 entries travel dense, the rest sparse: both paths in each bucket.
# Per layer, so that the per-tensor path is the reference (bucket scope: test_schemes).
LAYER = {"min_numel": 20, "scope": "layer"}
FLAT = {
    "topk": ("topk", {"ratio": 0.1, **LAYER}),
    "topk-no-feedback": ("topk", {"ratio": 0.1, "error_feedback": False, **LAYER}),
    "topk-fp16": ("topk", {"ratio": 0.1, "values": "fp16", **LAYER}),
    "dct-dp": ("dct-dp", {"ratio": 0.1, "life_span": 2, **LAYER}),
    "dct-dp-drain": ("dct-dp", {"ratio": 0.1, "life_span": 2, "drain_every": 2, **LAYER}),
    "laplace": ("laplace", {"ratio": 0.1, "min_numel": 20, "capacity": 1.5}),
    "dct-dp-delta16": ("dct-dp", {"ratio": 0.03, "life_span": 2, "indices": "delta16",
                                  **LAYER}),
}
PAIRED = ("topk", "dct-dp-delta16", "laplace")  # also run with the two-rank broadcasts
# dct-dp in pieces of 64 entries (piece=64), against one payload (piece=0): with room for
# every entry (10 x k at 90 % sparsity) no part can pass more than its room, so the bits
# must agree.
PIECED = {
    "roomy": ({"ratio": 0.1, "life_span": 2, "capacity": 10.0, **LAYER}, False),
    "roomy-coupled": ({"ratio": 0.1, "life_span": 3, "capacity": 10.0, **LAYER}, True),
    "roomy-drain": ({"ratio": 0.1, "life_span": 2, "capacity": 10.0, "drain_every": 2,
                     **LAYER}, False),
    "tight": ({"ratio": 0.1, "life_span": 3, "capacity": 1.0, **LAYER}, True),
}
CLIPPED = {"ratio": 0.1, "min_numel": 0, "scope": "layer"}
# Sparse tensors in several buckets, which DDP builds anew after its first step.
DRAIN = {"ratio": 0.2, "life_span": 4, "min_numel": 20, "drain_every": 2,
         "scope": "bucket"}


def _with_pairs(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run`` with every two-rank sparse exchange by broadcasts, however small; its
    ``"paired"`` counts the exchanges that took them."""
    saved, pair_groups = collectives.PAIR_MIN_BYTES, collectives._pair_groups
    paired = []

    def counted(group: dist.ProcessGroup | None) -> Any:
        pair = pair_groups(group)
        paired.append(pair is not None)
        return pair

    collectives.PAIR_MIN_BYTES, collectives._pair_groups = 0, counted
    try:
        return {**run(), "paired": sum(paired)}
    finally:
        collectives.PAIR_MIN_BYTES, collectives._pair_groups = saved, pair_groups


def _counting_pieces(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run``, its ``"pieced"`` counting the launches that went in pieces."""
    launch = streaming.Streaming.launch
    pieced = []

    def counted(self: streaming.Streaming, *args: Any, **kwargs: Any) -> Any:
        pieced.append(True)
        return launch(self, *args, **kwargs)

    streaming.Streaming.launch = counted  # type: ignore[method-assign]
    try:
        return {**run(), "pieced": len(pieced)}
    finally:
        streaming.Streaming.launch = launch  # type: ignore[method-assign]


def _auto_pieces(rank: int, world_size: int) -> dict[str, Any]:
    """dct-dp with ``stream="auto"``, one trial round, and a rule that always says pieces pay."""
    saved = streaming.TRIALS, streaming.pay
    streaming.TRIALS, streaming.pay = 1, lambda wire_s, codec_s: True
    try:
        return _counting_pieces(lambda: _ddp_run(
            rank, world_size, "dct-dp", {**PIECED["tight"][0], "piece": 64}, 0.001, couple=True))
    finally:
        streaming.TRIALS, streaming.pay = saved


def _agreed(rank: int) -> dict[str, bool]:
    """The stream choice from trials that differ by rank (see the test)."""
    scheme = build("dct-dp")
    assert isinstance(scheme, CompressedScheme) and scheme.pieces is not None
    pieces = scheme.pieces
    return {"quick-link": pieces._agree([[(0.010, 0.030)], [(0.020, 0.005)]][rank], None),
            "slow-link": pieces._agree([[(0.010, 0.030), (0.012, 0.040), (0.011, 0.035)],
                                        []][rank], None)}


def _all_scenarios(rank: int, world_size: int) -> dict[str, Any]:
    """Every DDP scenario in one process group: one spawn instead of ten."""
    return {
        "plain": _ddp_run(rank, world_size, None, {}, 25.0),
        "dense": _ddp_run(rank, world_size, "dense", {}, 0.001),
        "dense-coupled": _ddp_run(rank, world_size, "dense", {}, 0.001, couple=True),
        "topk-all-coupled": _ddp_run(rank, world_size, "topk", {"ratio": 1.0}, 0.001,
                                     couple=True),
        "topk-coupled": _ddp_run(rank, world_size, "topk", {"ratio": 0.1, "min_numel": 100},
                                 0.001, couple=True),  # biases and the last layer dense
        "topk-sparse-coupled": _ddp_run(rank, world_size, "topk",
                                        {"ratio": 0.1, "min_numel": 0}, 0.001, couple=True),
        "topk-sparse-coupled-view": _ddp_run(rank, world_size, "topk",
                                             {"ratio": 0.1, "min_numel": 0}, 0.001,
                                             couple=True, bucket_view=True),
        "topk-sparse-at-x": _ddp_run(rank, world_size, "topk", {"ratio": 0.1, "min_numel": 0},
                                     0.001, couple=True, virtual=False),
        "topk-adamw-coupled": _ddp_run(rank, world_size, "topk", {"ratio": 0.1, "min_numel": 0},
                                       0.001, couple=True, adamw=True),
        "topk-adamw-at-x": _ddp_run(rank, world_size, "topk", {"ratio": 0.1, "min_numel": 0},
                                    0.001, couple=True, virtual=False, adamw=True),
        "clt-k-all-coupled": _ddp_run(rank, world_size, "clt-k", {"ratio": 1.0}, 0.001,
                                      couple=True),
        "clt-k-coupled": _ddp_run(rank, world_size, "clt-k", {"ratio": 0.1, "min_numel": 0},
                                  0.001, couple=True),
        **{f"{name}-{how}": _ddp_run(rank, world_size, scheme, {"ratio": 0.1, "min_numel": 0},
                                     0.001, couple=True, adamw=adamw, one_call=how == "one-call",
                                     via_hook_state=hook)
           for name, scheme, adamw, hook in (("topk", "topk", False, False),
                                             ("clt-k", "clt-k", False, False),
                                             ("adamw", "topk", True, False),
                                             ("hook-state", "dct-dp", False, True))
           for how in ("one-call", "two-calls")},
        "clt-k-all-ef21": _ddp_run(rank, world_size, "clt-k", {"ratio": 1.0}, 0.001,
                                   couple=True, feedback="ef21"),
        "clt-k-ef21": _ddp_run(rank, world_size, "clt-k", {"ratio": 0.1, "min_numel": 0},
                               0.001, couple=True, feedback="ef21"),
        "dct-small-buckets": _ddp_run(rank, world_size, "dct-dp", DCT, 0.001),
        "dct-one-bucket": _ddp_run(rank, world_size, "dct-dp", DCT, 25.0),
        "manual": _manual_run(rank, world_size, DCT),
        # Local clipping (several buckets): never reached, and on every step.
        "clip-never": _ddp_run(rank, world_size, "topk", CLIPPED, 0.001, max_norm=1e9),
        "clip-always": _ddp_run(rank, world_size, "topk", CLIPPED, 0.001, max_norm=1e-3),
        "clip-unclipped": _ddp_run(rank, world_size, "topk", CLIPPED, 0.001),
        "clip-hook-state": _ddp_run(rank, world_size, "topk", CLIPPED, 0.001, max_norm=1e-3,
                                    via_hook_state=True),
        "clip-manual": _manual_run(rank, world_size, CLIPPED, "topk",
                                   local_clip=1e-3 * world_size ** 0.5),
        "clip-after-backward": _ddp_run(rank, world_size, "topk", CLIPPED, 0.001,
                                        couple=True, clip_after=1.0),
        "clip-after-backward-dense": _ddp_run(rank, world_size, "dense", {}, 0.001,
                                              clip_after=1.0),
        # fp16 autocast's GradScaler registered with the hook; rank 1 overflows at step 2.
        "amp": _ddp_run(rank, world_size, "topk", {"ratio": 0.1, "min_numel": 0}, 0.001,
                        couple=True, amp=True),
        "amp-overflow": _ddp_run(rank, world_size, "topk", {"ratio": 0.1, "min_numel": 0},
                                 0.001, (1, 2), couple=True, amp=True),
        "amp-skipped": _ddp_run(rank, world_size, "topk", {"ratio": 0.1, "min_numel": 0},
                                0.001, couple=True, skip=2),
        "amp-clip-after": _ddp_run(rank, world_size, "topk", {"ratio": 0.1, "min_numel": 0},
                                   0.001, couple=True, amp=True, clip_after=1.0),
        "straight": _resume_run(rank, world_size, STEPS),
        "resumed": _resume_run(rank, world_size, 3),
        "nan": _ddp_run(rank, world_size, "dct-dp", {**DCT, "nonfinite": "skip"}, 0.001,
                        (1, 2)),
        "drain-straight": _resume_run(rank, world_size, STEPS, DRAIN),
        "drain-resumed": _resume_run(rank, world_size, 3, DRAIN),
        "layer-drain-straight": _resume_run(rank, world_size, STEPS, {**DRAIN, "scope": "layer"}),
        "layer-drain-resumed": _resume_run(rank, world_size, 3, {**DRAIN, "scope": "layer"}),
        "adamw-straight": _resume_run(rank, world_size, STEPS, adamw=True),
        "adamw-resumed": _resume_run(rank, world_size, 3, adamw=True),
        **{f"flat-{name}": _ddp_run(rank, world_size, scheme, config, 0.001)
           for name, (scheme, config) in FLAT.items()},
        **{f"reference-{name}": _reference_run(rank, world_size, scheme, config)
           for name, (scheme, config) in FLAT.items()},
        **{f"pairs-{name}": _with_pairs(
            lambda scheme=scheme, config=config: _ddp_run(rank, world_size, scheme, config,
                                                          0.001))
           for name, (scheme, config) in FLAT.items() if name in PAIRED},
        **{f"{label}-{name}": _counting_pieces(
            lambda config=config, couple=couple, piece=piece: _ddp_run(
                rank, world_size, "dct-dp", {**config, "piece": piece, "stream": "always"},
                0.001, couple=couple))
           for name, (config, couple) in PIECED.items()
           for label, piece in (("pieces", 64), ("one-payload", 0))},
        "pieces-nan": _counting_pieces(lambda: _ddp_run(
            rank, world_size, "dct-dp", {**PIECED["roomy"][0], "piece": 64, "stream": "always",
                                         "nonfinite": "skip"}, 0.001, (1, 2))),
        "pieces-auto": _auto_pieces(rank, world_size),
        "stream-agreed": _agreed(rank),
        "mismatch": {pair: _mismatch_run(rank, pair) for pair in MISMATCHES},
        "mismatch-at-first-call": _mismatch_at_first_call(rank),  # last: it breaks a DDP
    }


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return spawn(_all_scenarios, 2)


@pytest.mark.parametrize("name", ["topk", "clt-k", "adamw", "hook-state"])
def test_register_with_the_optimizer_equals_register_then_couple_bit_for_bit(
        runs: list[dict[str, Any]], name: str) -> None:
    for rank in runs:
        one, two = rank[f"{name}-one-call"], rank[f"{name}-two-calls"]
        for a, b in zip(one["params"], two["params"]):
            assert torch.equal(a, b)
        assert one["warnings"] == two["warnings"]
        assert not torch.equal(one["params"][0], _model()[0].weight)  # it trained


def test_dense_hook_is_bit_identical_to_ddp_without_hook(runs: list[dict[str, Any]]) -> None:
    for a, b in zip(runs[0]["plain"]["params"], runs[0]["dense"]["params"]):
        assert torch.equal(a, b)
    assert not torch.equal(runs[0]["plain"]["params"][0], _model()[0].weight)  # it trained


def test_coupling_leaves_dense_bit_identical_to_ddp_without_hook(
        runs: list[dict[str, Any]]) -> None:
    for a, b in zip(runs[0]["plain"]["params"], runs[0]["dense-coupled"]["params"]):
        assert torch.equal(a, b)


def test_coupled_topk_sending_everything_is_sgd_momentum_up_to_rounding(
        runs: list[dict[str, Any]]) -> None:
    """The mean of the workers' velocities is plain SGD's velocity (summed in another order)."""
    for a, b in zip(runs[0]["plain"]["params"], runs[0]["topk-all-coupled"]["params"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("feedback", ["coupled", "ef21"])
def test_coupled_clt_k_sending_everything_is_sgd_momentum_up_to_rounding(
        runs: list[dict[str, Any]], feedback: str) -> None:
    """k = N: plain error feedback keeps nothing back, and the EF21 estimate every rank
    steps with is the mean velocity, so SGD's either way; at k < N the replicas agree
    (the default moves each rank's weights to its own x - lr e for the gradient and back)."""
    for a, b in zip(runs[0]["plain"]["params"], runs[0][f"clt-k-all-{feedback}"]["params"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(runs[0][f"clt-k-{feedback}"]["params"],
                    runs[1][f"clt-k-{feedback}"]["params"]):
        assert torch.equal(a, b)
    assert not [w for w in runs[0][f"clt-k-{feedback}"]["warnings"] if "couple" in w]
    assert not all(torch.equal(a, b) for a, b in zip(runs[0]["clt-k-ef21"]["params"],
                                                     runs[0]["clt-k-coupled"]["params"]))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_gradients_at_the_virtual_iterate_change_training_and_keep_replicas_identical(
        runs: list[dict[str, Any]], optimizer: str) -> None:
    ahead, at_x = (("topk-sparse-coupled", "topk-sparse-at-x") if optimizer == "sgd"
                   else ("topk-adamw-coupled", "topk-adamw-at-x"))
    for label in (ahead, at_x):
        for a, b in zip(runs[0][label]["params"], runs[1][label]["params"]):
            assert torch.equal(a, b)
        assert all(torch.isfinite(p).all() for p in runs[0][label]["params"])
    assert not all(torch.equal(a, b) for a, b in zip(runs[0][ahead]["params"],
                                                     runs[0][at_x]["params"]))
    if optimizer == "adamw":  # the burst-aware step's state travels in the scheme's
        arrivals = runs[0][ahead]["scheme"]["memory"]["arrivals"]
        assert arrivals and all(set(v) == {"age", "square", "weight"} for v in arrivals.values())
        assert not runs[0][at_x]["scheme"]["memory"]["arrivals"]


def test_the_virtual_iterate_trains_alike_when_gradients_are_views_of_the_buckets(
        runs: list[dict[str, Any]]) -> None:
    """DDP's gradient_as_bucket_view: the parameters swap storages, the gradients stay."""
    for rank in range(2):
        for a, b in zip(runs[rank]["topk-sparse-coupled"]["params"],
                        runs[rank]["topk-sparse-coupled-view"]["params"]):
            assert torch.equal(a, b)


def test_forgetting_to_couple_warns_once_and_coupling_silences_it(
        runs: list[dict[str, Any]]) -> None:
    for rank in range(2):
        assert len([w for w in runs[rank]["dct-one-bucket"]["warnings"] if "couple" in w]) == 1
        for label in ("topk-coupled", "dense", "plain"):
            assert not [w for w in runs[rank][label]["warnings"] if "couple" in w]
    for a, b in zip(runs[0]["topk-coupled"]["params"], runs[1]["topk-coupled"]["params"]):
        assert torch.equal(a, b)  # replicas agree


def test_local_clipping_below_its_threshold_is_bit_identical_to_none(
        runs: list[dict[str, Any]]) -> None:
    """Buckets held to the step's last one and launched together change no bit."""
    for rank in range(2):
        assert runs[rank]["clip-never"]["clipped"] == 0
        for a, b in zip(runs[rank]["clip-never"]["params"],
                        runs[rank]["clip-unclipped"]["params"]):
            assert torch.equal(a, b)


def test_local_clipping_equals_clipping_each_ranks_gradient_before_the_scheme(
        runs: list[dict[str, Any]]) -> None:
    """At max_norm m each rank clips its whole gradient, across buckets, at m sqrt(N); the
    norm is summed in another order than clip_grad_norm_'s, hence the rounding."""
    for rank in range(2):
        assert runs[rank]["clip-always"]["clipped"] == STEPS
        for a, b in zip(runs[rank]["clip-always"]["params"], runs[rank]["clip-manual"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for a, b in zip(runs[0]["clip-always"]["params"], runs[1]["clip-always"]["params"]):
        assert torch.equal(a, b)
    for a, b in zip(runs[0]["clip-always"]["params"], runs[0]["clip-hook-state"]["params"]):
        assert torch.equal(a, b)  # hook_state, for frameworks that register the hook
    assert not all(torch.equal(a, b) for a, b in zip(runs[0]["clip-always"]["params"],
                                                     runs[0]["clip-unclipped"]["params"]))


def test_clipping_a_sparse_update_after_backward_warns_once(runs: list[dict[str, Any]]) -> None:
    def written(label: str, rank: int) -> list[str]:
        return [w for w in runs[rank][label]["warnings"] if "written between backward" in w]

    for rank in range(2):
        assert len(written("clip-after-backward", rank)) == 1
        for label in ("clip-after-backward-dense", "clip-always", "topk-sparse-coupled"):
            assert not written(label, rank)


def test_sparse_embedding_gradients_are_refused_by_name() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.EmbeddingBag(10, 4, sparse=True))
    with pytest.raises(ValueError, match=r"modules \['1'\] have sparse=True"):
        ddp.hook_state(model, build("topk"))
    model[1] = nn.EmbeddingBag(10, 4)
    assert ddp.hook_state(model, build("topk")).names  # dense gradients: accepted


def test_a_registered_grad_scaler_leaves_training_bit_identical(
        runs: list[dict[str, Any]]) -> None:
    """The loss scale (a power of two) is divided out before the scheme and put back
    after, so the scheme's state never holds it; its unscale_ is no reason to warn."""
    for rank in range(2):
        run = runs[rank]["amp"]
        assert (run["scale"], run["overflows"]) == (2.0 ** 16, 0)
        for a, b in zip(run["params"], runs[rank]["topk-sparse-coupled"]["params"]):
            assert torch.equal(a, b)
        assert not [w for w in run["warnings"] if "written between backward" in w]
        assert [w for w in runs[rank]["amp-clip-after"]["warnings"]
                if "written between backward" in w]


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(
        runs: list[dict[str, Any]]) -> None:
    """Every rank's GradScaler sees the overflow and halves its scale, nothing is sent and
    no state moves: as if neither rank had trained on that step's batch."""
    for rank in range(2):
        run = runs[rank]["amp-overflow"]
        assert (run["scale"], run["overflows"]) == (2.0 ** 15, 1)
        for a, b in zip(run["params"], runs[rank]["amp-skipped"]["params"]):
            assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(runs[0]["amp-overflow"]["params"],
                                                     runs[0]["amp"]["params"]))


def _held(value: float) -> tuple[torch.Tensor, Callable[[bool], Any], list[bool]]:
    """A bucket of two entries and a launch that records its ``last`` flag."""
    buffer, flags = torch.full((2,), value), []

    def start(last: bool) -> Any:
        flags.append(last)
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(buffer)
        return future

    return buffer, start, flags


def test_local_clip_scales_every_bucket_of_a_step_by_one_factor_at_the_last() -> None:
    clip = ddp.LocalClip(max_norm=1.0, world_size=4)  # 2 per worker
    hold = ddp.StepHold([clip])
    (first, start_first, first_flags), (last, start_last, last_flags) = _held(3.0), _held(4.0)
    held = hold.launch(first, start_first, last=False)
    assert not held.done() and not first_flags and torch.equal(first, torch.full((2,), 3.0))
    assert hold.launch(last, start_last, last=True).done()
    assert held.done() and first_flags == [False] and last_flags == [True]
    norm = (2 * 9.0 + 2 * 16.0) ** 0.5
    for buffer, value in ((first, 3.0), (last, 4.0)):
        torch.testing.assert_close(buffer, torch.full((2,), value * 2.0 / (norm + 1e-6)))
    assert (clip.clipped, clip.steps) == (1, 1)


class _Refuse(Stage):
    """A stage that stops the step: nothing is launched, the buffers are the result."""

    def prepare(self, buffers: list[torch.Tensor]) -> bool:
        for buffer in buffers:
            buffer.fill_(-1.0)
        return False


def test_a_stage_that_stops_the_step_launches_nothing_and_completes_every_bucket() -> None:
    clip = ddp.LocalClip(max_norm=1.0, world_size=1)
    hold = ddp.StepHold([_Refuse(), clip])
    (first, start_first, first_flags), (last, start_last, last_flags) = _held(3.0), _held(4.0)
    held = hold.launch(first, start_first, last=False)
    done = hold.launch(last, start_last, last=True)
    assert not first_flags and not last_flags and clip.steps == 0  # stopped before the clip
    for future, buffer in ((held, first), (done, last)):
        assert future.wait() is buffer and torch.equal(buffer, torch.full((2,), -1.0))


def test_a_launch_that_fails_fails_the_held_buckets_too() -> None:
    """The step's last hook raises the first held bucket's error (as DDP reports a hook's)
    and every held future carries it."""
    hold = ddp.StepHold([ddp.LocalClip(max_norm=1.0, world_size=1)])

    def refuse(last: bool) -> Any:
        raise FloatingPointError("non-finite gradient in 'w'")

    failing = hold.launch(torch.ones(2), refuse, last=False)
    second, start_second, second_flags = _held(1.0)
    held = hold.launch(second, start_second, last=False)
    last, start_last, last_flags = _held(1.0)
    with pytest.raises(FloatingPointError):
        hold.launch(last, start_last, last=True)
    assert not second_flags and not last_flags  # nothing launched after the failure
    for future in (failing, held):
        with pytest.raises(FloatingPointError):
            future.wait()


def test_local_clip_leaves_a_non_finite_gradient_to_the_schemes_policy() -> None:
    clip = ddp.LocalClip(max_norm=1.0, world_size=1)
    buffer = torch.full((2,), float("inf"))
    assert clip.prepare([buffer])
    assert torch.isinf(buffer).all() and clip.clipped == 0


@pytest.mark.parametrize("max_norm", [0.0, -1.0, float("inf"), float("nan")])
def test_local_clip_rejects_a_threshold_that_is_not_a_finite_positive_number(
        max_norm: float) -> None:
    with pytest.raises(ValueError, match="max_norm"):
        ddp.LocalClip(max_norm, world_size=2)


@pytest.mark.parametrize("name", PAIRED)
def test_two_rank_broadcast_exchange_trains_bit_identically_to_the_all_gather(
        runs: list[dict[str, Any]], name: str) -> None:
    for rank in range(2):
        paired = runs[rank][f"pairs-{name}"]
        assert paired["paired"] >= STEPS  # the broadcasts ran, every step
        for a, b in zip(runs[rank][f"flat-{name}"]["params"], paired["params"]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("bucketing", ["dct-small-buckets", "dct-one-bucket"])
def test_dct_hook_equals_reduce_without_ddp_for_any_bucketing(runs: list[dict[str, Any]],
                                                             bucketing: str) -> None:
    for rank in range(2):
        for a, b in zip(runs[rank][bucketing]["params"], runs[rank]["manual"]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["", "drain-", "layer-drain-", "adamw-"])
def test_checkpoint_resume_is_bit_identical_to_an_uninterrupted_run(
        runs: list[dict[str, Any]], name: str) -> None:
    """Bucket scope too: the resumed run's first step, in DDP's first-step buckets,
    selects in the groups the uninterrupted run had."""
    for a, b in zip(runs[0][f"{name}straight"], runs[0][f"{name}resumed"]):
        assert torch.equal(a, b)
    if name == "drain-":  # the scope changes what is sent
        assert not all(torch.equal(a, b) for a, b in zip(runs[0]["drain-straight"],
                                                           runs[0]["layer-drain-straight"]))


@pytest.mark.parametrize("name", list(FLAT))
def test_flat_bucket_path_is_bit_identical_to_the_per_tensor_path(
        runs: list[dict[str, Any]], name: str) -> None:
    """Several buckets, re-bucketed after step one, dense and sparse tensors in each."""
    for rank in range(2):
        flat, reference = runs[rank][f"flat-{name}"], runs[rank][f"reference-{name}"]
        for a, b in zip(flat["params"], reference["params"]):
            assert torch.equal(a, b)
        memory, expected = flat["scheme"]["memory"], reference["scheme"]["memory"]
        if expected is not None:
            assert memory["buffers"].keys() <= expected["buffers"].keys()
            for key, buffer in expected["buffers"].items():
                kept = memory["buffers"].get(key)
                if kept is None:  # a tensor sent whole and exactly leaves no error to keep
                    assert not buffer.any()
                else:
                    assert torch.equal(kept, buffer)
        assert flat["scheme"]["selection"] == reference["scheme"]["selection"]
    if name == "dct-dp-drain":
        assert runs[0][f"flat-{name}"]["scheme"]["memory"]["drains"] > 0


@pytest.mark.parametrize("name", [name for name in PIECED if name.startswith("roomy")])
def test_dct_in_pieces_with_room_for_every_entry_trains_as_one_payload(
        runs: list[dict[str, Any]], name: str) -> None:
    for rank in range(2):
        pieced, whole = runs[rank][f"pieces-{name}"], runs[rank][f"one-payload-{name}"]
        assert pieced["pieced"] >= STEPS and whole["pieced"] == 0
        for a, b in zip(pieced["params"], whole["params"]):
            assert torch.equal(a, b)
        assert pieced["scheme"]["selection"] == whole["scheme"]["selection"]


def test_dct_in_pieces_keeps_replicas_identical_when_parts_pass_beyond_their_room(
        runs: list[dict[str, Any]]) -> None:
    for a, b in zip(runs[0]["pieces-tight"]["params"], runs[1]["pieces-tight"]["params"]):
        assert torch.equal(a, b) and torch.isfinite(a).all()
    assert not all(torch.equal(a, b) for a, b in zip(runs[0]["pieces-tight"]["params"],
                                                      runs[0]["one-payload-tight"]["params"]))


def test_ranks_take_one_stream_choice_from_the_least_wait_and_the_most_codec(
        runs: list[dict[str, Any]]) -> None:
    """Rank 0 alone would choose pieces on the first trials (30 ms of exchange against
    10 ms of codec), rank 1 not (5 against 20); agreed, the least exchange (5 ms) against
    the most codec (20 ms) says one payload. On the second, rank 1 timed nothing (its
    rounds skipped): rank 0's medians (35 against 11 ms) decide for both."""
    assert [r["stream-agreed"] for r in runs] == [{"quick-link": False, "slow-link": True}] * 2


def test_auto_stream_sends_one_payload_while_timing_then_pieces_on_every_rank(
        runs: list[dict[str, Any]]) -> None:
    results = [r["pieces-auto"] for r in runs]
    for result in results:
        assert result["pieced"] >= 2  # rounds 3 to 6 of each bucket with enough entries
        choices = result["scheme"]["streaming"]
        assert choices and all(choice for _, choice in choices)
    assert results[0]["scheme"]["streaming"] == results[1]["scheme"]["streaming"]
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


def test_nan_on_one_rank_in_pieces_is_skipped_and_replicas_stay_identical(
        runs: list[dict[str, Any]]) -> None:
    """The skipping rank sends empty pieces of the same sizes: nothing hangs."""
    results = [r["pieces-nan"] for r in runs]
    assert results[0]["skipped"] == 0 and results[1]["skipped"] >= 1
    assert results[1]["pieced"] >= STEPS
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b) and torch.isfinite(a).all()


def test_nan_on_one_rank_is_skipped_and_replicas_stay_identical(
        runs: list[dict[str, Any]]) -> None:
    results = [r["nan"] for r in runs]
    # skipped counts reduce calls (one per DDP bucket) whose gradients were dropped
    assert results[0]["skipped"] == 0 and results[1]["skipped"] >= 1
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b) and torch.isfinite(a).all()
    for buffer in results[1]["scheme"]["memory"]["buffers"].values():
        assert torch.isfinite(buffer).all()


def test_register_rejects_a_plain_module() -> None:
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        ddp.register(_model(), build("dense"))  # type: ignore[arg-type]


@pytest.mark.parametrize(("pair", "field"), [("ratio", "'config.ratio'"),
                                             ("scheme", "'scheme'"),
                                             ("dense-vs-sparse", "'scheme'"),
                                             ("values", "'config.values'")])
def test_mismatched_peers_raise_the_same_error_on_every_rank_naming_the_field(
        runs: list[dict[str, Any]], pair: str, field: str) -> None:
    messages = [r["mismatch"][pair] for r in runs]
    assert messages[0] == messages[1]
    assert field in messages[0] and "rank 0" in messages[0] and "rank 1" in messages[0]


def test_agreeing_peers_register_without_error(runs: list[dict[str, Any]]) -> None:
    assert [r["mismatch"]["agree"] for r in runs] == ["", ""]


def test_hook_state_users_get_the_mismatch_at_the_first_backward(
        runs: list[dict[str, Any]]) -> None:
    for r in runs:
        assert "peers of the DDP hook disagree" in r["mismatch-at-first-call"]
        assert "'config.ratio' is 0.1 on rank 0, 0.01 on rank 1" in r["mismatch-at-first-call"]
