"""The registry: names, validation with clear messages, single-process checkpoints."""

from __future__ import annotations

import pytest
import torch

from thinwire import schemes
from thinwire.compress import TensorInfo


def test_foundation_schemes_are_registered() -> None:
    assert {"dense", "fp16", "topk", "dct-dp", "laplace"} <= set(schemes.names())


@pytest.mark.parametrize("name,config,bad", [
    ("dct-dp", {"sparsity": 1.0}, "sparsity=1.0"),
    ("dct-dp", {"sparsity": -0.5}, "sparsity=-0.5"),
    ("dct-dp", {"life_span": 0}, "life_span=0"),
    ("dct-dp", {"refresh_above": 0.5}, "refresh_above=0.5"),
    ("topk", {"ratio": 0.0}, "ratio=0.0"),
    ("topk", {"ratio": 1.01}, "ratio=1.01"),
    ("topk", {"values": "bf16"}, "values='bf16'"),
    ("laplace", {"min_numel": -1}, "min_numel=-1"),
    ("dense", {"nonfinite": "ignore"}, "nonfinite='ignore'"),
])
def test_invalid_config_names_the_value(name: str, config: dict[str, object], bad: str) -> None:
    with pytest.raises(ValueError) as error:
        schemes.build(name, **config)
    assert bad in str(error.value)


def test_unknown_scheme_and_option_are_refused_with_the_alternatives() -> None:
    with pytest.raises(ValueError, match="unknown scheme 'dct'.*dct-dp"):
        schemes.build("dct")
    with pytest.raises(ValueError, match="no option.*'sparsty'.*sparsity"):
        schemes.build("dct-dp", sparsty=0.9)


def test_configs_are_frozen() -> None:
    config = schemes.config_class("dct-dp")()
    with pytest.raises(AttributeError):
        config.sparsity = 0.5  # type: ignore[misc]


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


def test_dct_dp_include_compresses_only_the_matching_parameters() -> None:
    """DCT KDD'21 §3.3 compresses only the fully connected layers; the rest travel dense."""
    grads = {"top.0.weight": torch.randn(30, 20), "emb.0.weight": torch.randn(50, 8)}
    scheme = schemes.build("dct-dp", sparsity=0.9, include=("top.*",))
    sent = scheme.reduce(grads)
    assert torch.equal(sent["emb.0.weight"], grads["emb.0.weight"])  # dense: exact
    kept = int((sent["top.0.weight"] != 0).sum())
    assert kept == 60  # 10 % of 600: sparsified
    assert scheme.compressor.is_dense(TensorInfo("emb.0.weight", (50, 8)))
    everything = schemes.build("dct-dp", sparsity=0.9).reduce(grads)
    assert int((everything["emb.0.weight"] != 0).sum()) == 40
    with pytest.raises(ValueError, match="include='top.*'"):
        schemes.build("dct-dp", include="top.*")
