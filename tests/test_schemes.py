"""The registry: names, validation with clear messages, single-process checkpoints."""

from __future__ import annotations

import pytest
import torch

from thinwire import schemes
from thinwire.comm import Meter
from thinwire.compress import TensorInfo
from thinwire.schemes import CompressedScheme, kernel


def test_foundation_schemes_are_registered() -> None:
    assert {"dense", "fp16", "topk", "dct-dp", "laplace"} <= set(schemes.names())


@pytest.mark.parametrize("name,config,bad", [
    ("dct-dp", {"ratio": 0.0}, "ratio=0.0"),
    ("dct-dp", {"ratio": -0.5}, "ratio=-0.5"),
    ("laplace", {"ratio": 1.5}, "ratio=1.5"),
    ("dct-dp", {"exclude": (1,)}, "exclude=(1,)"),
    ("dct-dp", {"life_span": 0}, "life_span=0"),
    ("dct-dp", {"refresh_above": 0.5}, "refresh_above=0.5"),
    ("topk", {"ratio": 0.0}, "ratio=0.0"),
    ("topk", {"ratio": 1.01}, "ratio=1.01"),
    ("topk", {"values": "int2-bins"}, "values='int2-bins'"),
    ("dct-dp", {"values": "int3"}, "values='int3'"),
    ("topk", {"indices": "int16"}, "indices='int16'"),
    ("topk", {"scope": "model"}, "scope='model'"),
    ("dct-dp", {"scope": ""}, "scope=''"),
    ("dct-dp", {"capacity": 0.5}, "capacity=0.5"),
    ("laplace", {"min_numel": -1}, "min_numel=-1"),
    ("laplace", {"gain": 1.5}, "gain=1.5"),
    ("dense", {"nonfinite": "ignore"}, "nonfinite='ignore'"),
])
def test_invalid_config_names_the_value(name: str, config: dict[str, object], bad: str) -> None:
    with pytest.raises(ValueError) as error:
        schemes.build(name, **config)
    assert bad in str(error.value)


def test_unknown_scheme_and_option_are_refused_with_the_alternatives() -> None:
    with pytest.raises(ValueError, match="unknown scheme 'dct'.*dct-dp"):
        schemes.build("dct")
    with pytest.raises(ValueError, match="no option.*'rato'.*ratio"):
        schemes.build("dct-dp", rato=0.1)


@pytest.mark.parametrize(("name", "old", "new"), [
    ("dct-dp", {"sparsity": 0.99}, "pass ratio=1-x"), ("laplace", {"sparsity": 0.9}, "ratio"),
    ("topk", {"sparsity": 0.9}, "ratio"), ("clt-k", {"sparsity": 0.9}, "ratio"),
    ("dct-dp", {"include": ("fc*",)}, "exclude"),
    ("powersgd", {"start_iter": 2}, "warmup_steps"),
])
def test_an_old_spelling_is_an_error_naming_the_new_one(name: str, old: dict[str, object],
                                                         new: str) -> None:
    with pytest.raises(ValueError, match=f"{next(iter(old))} was .*{new}"):
        schemes.build(name, **old)


@pytest.mark.parametrize("name", ["topk", "dct-dp", "laplace", "clt-k", "local-topk"])
def test_every_sparsifier_keeps_ratio_of_the_entries(name: str) -> None:
    grads = {"w": torch.randn(50, 40)}
    sent = schemes.build(name, ratio=0.05, min_numel=0).reduce(grads)
    kept = int((sent["w"] != 0).sum())
    assert (kept == 100) if name != "laplace" else (0 < kept < 2000)


def test_configs_are_frozen() -> None:
    config = schemes.config_class("dct-dp")()
    with pytest.raises(AttributeError):
        config.ratio = 0.5  # type: ignore[misc]


@pytest.mark.parametrize("name", ["topk", "dct-dp", "laplace", "fp16"])
def test_state_dict_resume_continues_identically(name: str) -> None:
    grads = [{"w": torch.randn(40, 10), "b": torch.randn(10)} for _ in range(8)]
    straight = schemes.build(name)
    outputs = [straight.reduce(g) for g in grads]
    first = schemes.build(name)
    for g in grads[:4]:
        first.reduce(g)
    resumed = schemes.build(name)
    resumed.load_state_dict(first.state_dict())
    for g, expected in zip(grads[4:], outputs[4:]):
        got = resumed.reduce(g)
        for key in g:
            assert torch.equal(got[key], expected[key])


def test_single_process_reduce_of_dense_is_the_identity() -> None:
    grads = {"w": torch.randn(7, 3)}
    assert torch.equal(schemes.build("dense").reduce(grads)["w"], grads["w"])


@pytest.mark.parametrize("name", ["dct-dp", "topk", "laplace"])
def test_exclude_sends_the_matching_parameters_dense(name: str) -> None:
    """DCT KDD'21 §3.3 compresses only the fully connected layers; the rest travel dense."""
    grads = {"top.0.weight": torch.randn(30, 20), "emb.0.weight": torch.randn(50, 8)}
    if name != "dct-dp":  # the others' selection is not DCT's: dense routing only
        scheme = schemes.build(name, ratio=0.1, exclude="emb.*, bias", min_numel=0)
        assert scheme.origin[1].exclude == ("emb.*", "bias")
        sent = scheme.reduce(grads)
        assert torch.equal(sent["emb.0.weight"], grads["emb.0.weight"])
        assert int((sent["top.0.weight"] != 0).sum()) < 600
        return
    scheme = schemes.build("dct-dp", ratio=0.1, exclude=("emb.*",), min_numel=0)
    sent = scheme.reduce(grads)
    assert torch.equal(sent["emb.0.weight"], grads["emb.0.weight"])  # dense: exact
    kept = int((sent["top.0.weight"] != 0).sum())
    assert kept == 60  # 10 % of 600: sparsified
    assert scheme.selection.is_dense(TensorInfo("emb.0.weight", (50, 8)))
    everything = schemes.build("dct-dp", ratio=0.1, min_numel=0, scope="layer").reduce(grads)
    assert int((everything["emb.0.weight"] != 0).sum()) == 40
    with pytest.raises(ValueError, match="exclude=.*must be name patterns"):
        schemes.build("dct-dp", exclude=[3])
@pytest.mark.parametrize("name,config", [
    ("topk", {"ratio": 0.05, "min_numel": 100}),
    ("topk", {"ratio": 0.05, "min_numel": 100, "scope": "layer"}),
    ("topk", {"ratio": 0.05, "values": "fp16"}),
    ("dct-dp", {"ratio": 0.05, "life_span": 3, "min_numel": 100}),
    ("dct-dp", {"ratio": 0.05, "life_span": 3, "min_numel": 100, "scope": "bucket"}),
    ("laplace", {"ratio": 0.05, "capacity": 1.0}),
])
def test_error_feedback_invariant_holds_exactly(name: str, config: dict[str, object]) -> None:
    """grad + old_error == sent + new_error, bit for bit, for every tensor and step."""
    scheme = schemes.build(name, **config)
    assert isinstance(scheme, CompressedScheme) and scheme.memory is not None
    for _ in range(6):
        grads = {"w": torch.randn(40, 30), "b": torch.randn(30), "v": torch.randn(2000)}
        old = {key: scheme.memory.buffers.get(key, torch.zeros(g.numel())).clone()
               for key, g in grads.items()}
        sent = scheme.reduce(grads)  # one process: the mean is what this rank sent
        for key, grad in grads.items():
            # No buffer: the tensor was sent whole and exactly, so its error is zero.
            new = scheme.memory.buffers.get(key, torch.zeros(grad.numel()))
            assert torch.equal(grad.reshape(-1) + old[key], sent[key].reshape(-1) + new)
        capacity = scheme.selection.capacity  # type: ignore[attr-defined]
        if getattr(scheme.selection, "scope", "layer") == "layer":
            assert int((sent["w"] != 0).sum()) <= capacity(1200)
        else:  # one selection over the sparsified tensors (every one by default)
            sparse = [k for k, g in grads.items()
                      if g.numel() >= scheme.selection.min_numel]  # type: ignore[attr-defined]
            assert sum(int((sent[k] != 0).sum()) for k in sparse) <= capacity(
                sum(grads[k].numel() for k in sparse))


def test_entries_beyond_the_capacity_are_the_smallest_and_wait_in_the_memory() -> None:
    # A stale threshold of 0.5 passes everything; capacity 1 x k = 10 sends the 10 largest.
    scheme = schemes.build("dct-dp", ratio=0.1, life_span=100, refresh_above=None,
                           min_numel=0, capacity=1.0)
    scheme.reduce({"w": torch.arange(1.0, 101.0)})  # tau = 91
    assert scheme.selection.tau["w"] == 91.0  # type: ignore[attr-defined]
    scheme.selection.tau["w"] = 0.5  # type: ignore[attr-defined]
    grad = torch.randn(100)
    sent = scheme.reduce({"w": grad})["w"]
    compensated = grad + torch.cat([torch.arange(1.0, 91.0), torch.zeros(10)])
    top = torch.topk(compensated.abs(), 10).indices
    assert set(sent.nonzero().squeeze(1).tolist()) == set(top.tolist())
    assert torch.equal(sent + scheme.memory.buffers["w"], compensated)  # type: ignore[union-attr]


def test_a_finite_round_whose_sum_overflows_is_not_skipped() -> None:
    huge = torch.full((10,), 3e38)
    out = schemes.build("dense", nonfinite="skip").reduce({"w": huge, "b": huge.clone()})
    assert torch.equal(out["w"], huge)
    scheme = schemes.build("dense", nonfinite="skip")
    out = scheme.reduce({"w": torch.tensor([1.0, float("nan")]), "b": torch.ones(3)})
    assert scheme.skipped == 1 and torch.equal(out["b"], torch.zeros(3))
    with pytest.raises(FloatingPointError, match="'w'"):
        schemes.build("topk").reduce({"b": torch.ones(3), "w": torch.tensor([float("inf")])})


def test_small_tensors_travel_dense_by_default_and_are_never_frozen() -> None:
    scheme = schemes.build("laplace")
    grad = torch.randn(32)
    assert torch.equal(scheme.reduce({"b": grad})["b"], grad)


def test_mixed_dtypes_reduce_each_in_its_own_dtype() -> None:
    grads = {"w": torch.randn(3000, dtype=torch.float64), "h": torch.randn(2000)}
    out = schemes.build("topk", ratio=0.01).reduce(grads)
    assert out["w"].dtype == torch.float64 and out["h"].dtype == torch.float32
    assert int((out["w"] != 0).sum()) == 30 and int((out["h"] != 0).sum()) == 20


def test_a_tensor_sent_whole_and_exactly_keeps_no_error_buffer() -> None:
    """Its error is zero; a lossy dense cast (fp16) keeps its rounding in the memory."""
    grads = {"b": torch.randn(30), "v": torch.randn(2000)}  # "b" is under min_numel: dense
    exact = schemes.build("topk", ratio=0.05, min_numel=100)
    lossy = schemes.build("topk", ratio=0.05, values="fp16", min_numel=100)
    for scheme in (exact, lossy):
        assert isinstance(scheme, CompressedScheme) and scheme.memory is not None
        out = scheme.reduce(grads)
        assert "v" in scheme.memory.buffers
    assert torch.equal(out["b"], grads["b"].half().float())
    assert "b" not in exact.memory.buffers  # type: ignore[union-attr]
    assert torch.equal(lossy.memory.buffers["b"],  # type: ignore[union-attr]
                       grads["b"] - grads["b"].half().float())
    # An error kept from before (a fp16 checkpoint resumed in fp32) goes out once, then is gone.
    error = torch.randn(30)
    exact.memory.buffers["b"] = error.clone()  # type: ignore[union-attr]
    assert torch.equal(exact.reduce(grads)["b"], grads["b"] + error)
    assert "b" not in exact.memory.buffers  # type: ignore[union-attr]
    assert torch.equal(exact.reduce(grads)["b"], grads["b"])


def _bucket_reference(grads: dict[str, torch.Tensor], error: dict[str, torch.Tensor],
                      k: int) -> dict[str, torch.Tensor]:
    """Plain torch: the k largest |g + e| over all tensors at once, zero elsewhere."""
    compensated = {key: g.reshape(-1) + error[key] for key, g in grads.items()}
    flat = torch.cat(list(compensated.values()))
    mask = torch.zeros_like(flat, dtype=torch.bool)
    mask[torch.topk(flat.abs(), k).indices] = True
    masks = mask.split([g.numel() for g in grads.values()])
    return {key: torch.where(m, p, 0.0).view(grads[key].shape)
            for (key, p), m in zip(compensated.items(), masks)}


def test_bucket_scope_sends_the_largest_of_all_tensors_and_keeps_the_rest() -> None:
    """scope="bucket": one top-k over every sparsified tensor (k = 1 % of all of them),
    so a small tensor with large entries takes more than its 1 %; error feedback exact."""
    scheme = schemes.build("topk", ratio=0.01, scope="bucket")
    assert isinstance(scheme, CompressedScheme) and scheme.memory is not None
    error = {"big": torch.zeros(50_000), "small": torch.zeros(2_000)}
    for step in range(5):
        generator = torch.Generator().manual_seed(step)
        grads = {"big": torch.randn(250, 200, generator=generator),
                 "small": 30 * torch.randn(2_000, generator=generator)}
        expected = _bucket_reference(grads, error, 520)  # ceil(0.01 * 52,000)
        sent = scheme.reduce(grads)
        for key, grad in grads.items():
            assert torch.equal(sent[key], expected[key]), (step, key)
            error[key] = grad.reshape(-1) + error[key] - expected[key].reshape(-1)
            assert torch.equal(scheme.memory.buffers[key], error[key])
        assert int((sent["small"] != 0).sum()) > 20 * 2  # far beyond its own 1 %
    trace = scheme.selection.trace  # type: ignore[attr-defined]
    assert set(trace) == {"big", "small"}  # each tensor's share, per call
    shares = [trace["big"][-1][2] * 50_000, trace["small"][-1][2] * 2_000]
    assert sum(shares) == 520


def test_bucket_scope_of_one_tensor_is_the_layer_scope() -> None:
    layer, bucket = (schemes.build("dct-dp", ratio=0.01, life_span=2, scope=scope,
                                   min_numel=11)
                     for scope in ("layer", "bucket"))
    for step in range(4):
        grads = {"w": torch.randn(3000, generator=torch.Generator().manual_seed(step)),
                 "b": torch.randn(10)}  # "b" travels dense
        a, b = layer.reduce(grads), bucket.reduce(grads)
        assert all(torch.equal(a[key], b[key]) for key in grads)
    assert isinstance(layer, CompressedScheme) and isinstance(bucket, CompressedScheme)
    kept = bucket.selection.state_dict()
    assert kept.pop("groups") == {"w": ("w",)}
    same = layer.selection.state_dict()
    assert same.pop("groups") == {}
    assert kept == same  # the same thresholds, refreshes and call counts


def test_bucket_room_is_the_capacity_of_its_selection_not_one_per_tensor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Forty 30-entry tensors at 1 %: per layer each has room for 1 entry (40), one
    selection over the bucket keeps ceil(0.01 * 1200) = 12, and the payload has room for 12."""
    grads = {f"t{i}": torch.randn(30, generator=torch.Generator().manual_seed(i))
             for i in range(40)}
    infos = [TensorInfo.of(key, grad) for key, grad in grads.items()]
    handed: list[int] = []
    original = kernel.all_gather_fixed

    def gather(payload: torch.Tensor, *args: object, **kwargs: object) -> object:
        handed.append(payload.numel())
        return original(payload, *args, **kwargs)

    monkeypatch.setattr(kernel, "all_gather_fixed", gather)
    for scope in ("layer", "bucket"):
        scheme = schemes.build("topk", ratio=0.01, min_numel=0, scope=scope)
        assert isinstance(scheme, CompressedScheme)
        assert scheme.selection.room(infos) == {"layer": 40, "bucket": 12}[scope]
        out = scheme.reduce(grads)
    expected = _bucket_reference(grads, {key: torch.zeros(30) for key in grads}, 12)
    assert all(torch.equal(out[key], expected[key]) for key in grads)
    layer, bucket = handed
    assert layer - bucket == (40 - 12) * (4 + 2)  # fp32 values, 16-bit indices


def test_the_generic_engine_and_optim_name_no_concrete_codec_or_scheme() -> None:
    """Scheme-specific mechanisms (streaming in pieces, CLT-k's shared indices, a
    sparsifier's density) reach the engine and optim through interfaces only."""
    from pathlib import Path

    import thinwire.optim
    import thinwire.schemes.base
    import thinwire.schemes.kernel

    concrete = ["DCTThreshold", "TopK", "LaplaceThreshold", "Selection", "Quantised", "Cast",
                "LeaderIndices", "LowRankBasis", "Residual", "LowPass"]
    for module in (thinwire.schemes.base, thinwire.schemes.kernel, thinwire.optim):
        source = Path(str(module.__file__)).read_text()
        code = "\n".join(line.split("#")[0] for line in source.splitlines())
        named = [name for name in concrete
                 if f"{name}(" in code or f"{name})" in code or f"{name}," in code
                 or f"import {name}" in code]
        assert not named, (module.__name__, named)


def test_build_takes_the_command_lines_spelling() -> None:
    """``NAME:KEY=VALUE`` as ``--schemes`` spells it, parsed by the same function."""
    assert schemes.build("powersgd:rank=8").origin == schemes.build("powersgd", rank=8).origin
    spelled = schemes.build("topk:ratio=0.05:min-numel=0")
    assert spelled.origin == schemes.build("topk", ratio=0.05, min_numel=0).origin
    assert schemes.parse_spelling("dct-dp:life-span=4") == ("dct-dp", {"life_span": 4})
    with pytest.raises(ValueError, match="must look like KEY=VALUE"):
        schemes.build("powersgd:rank")
    with pytest.raises(ValueError, match="given in the name and as keywords"):
        schemes.build("powersgd:rank=8", rank=4)


@pytest.mark.parametrize("name", schemes.names())
def test_a_rebuilt_scheme_equals_the_original_in_every_setting(name: str) -> None:
    """What ``rebuild`` makes (a rollback's scheme, register's under Adam) is the scheme as
    built (options, warm-up) with what was attached after (meter, energy record); a fresh
    state."""
    scheme = schemes.build(name, warmup_steps=4)
    scheme.meter, scheme.energy = Meter(0, 1), {}
    scheme.reduce({"w": torch.randn(40, 30), "b": torch.randn(30)})
    fresh = schemes.rebuild(scheme)
    assert fresh is not scheme and type(fresh) is type(scheme)
    assert fresh.origin == scheme.origin and fresh.given == scheme.given
    assert schemes.fingerprint(fresh) == schemes.fingerprint(scheme)
    assert fresh.warmup_steps == 4 and fresh.traits == scheme.traits
    assert fresh.meter is scheme.meter and fresh.energy is scheme.energy
    assert fresh.overhead_s == scheme.overhead_s
    assert fresh.state_dict().keys() == scheme.state_dict().keys()
    assert fresh.state_dict() == schemes.build(name, warmup_steps=4).state_dict()


def test_rebuild_adds_options_to_those_given_and_keeps_the_warm_up() -> None:
    scheme = schemes.build("topk:ratio=0.05:warmup_steps=30", values="int8")
    fresh = schemes.rebuild(scheme, indices="delta8")
    assert fresh.given == {"ratio", "values", "indices", "warmup_steps"}
    assert fresh.origin == schemes.build("topk", ratio=0.05, values="int8",
                                         indices="delta8", warmup_steps=30).origin
    assert fresh.warmup_steps == 30
    assert schemes.rebuild(scheme, ratio=0.2).origin[1].ratio == 0.2
    # a warm-up option replaces the one it had, in the config and the scheme alike
    powersgd = schemes.build("powersgd", warmup_steps=2)
    assert schemes.rebuild(powersgd).warmup_steps == 2
    five = schemes.rebuild(powersgd, warmup_steps=5)
    assert five.warmup_steps == five.origin[1].warmup_steps == 5


def test_a_scheme_not_built_by_name_is_not_rebuilt() -> None:
    bare = CompressedScheme(schemes.build("topk").values)
    with pytest.raises(ValueError, match="not built by thinwire.schemes.build"):
        schemes.rebuild(bare)
