"""The codec benchmark: every scheme on the workload's own gradient, beside its floor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import codec, floors
from thinwire import schemes
from thinwire.comm.collectives import ALONE
from thinwire.compress import TensorInfo

# Plain versions whose ops run as thinwire's do, value for value: equal bits expected.
SPELLINGS = [("fp16", {}), ("topk", {"ratio": 0.07}),
             ("topk", {"ratio": 0.07, "values": "int8", "indices": "delta8"}),
             ("topk", {"ratio": 0.3, "values": "int8", "indices": "delta16"}),
             ("dct-dp", {"ratio": 0.07, "values": "int8", "indices": "delta8", "scope": "bucket"}),
             ("dct-dp", {"ratio": 0.1, "scope": "bucket", "life_span": 3, "capacity": 1.25})]


def side_by_side(name: str, options: dict[str, object], grads: list[dict[str, torch.Tensor]]
                 ) -> None:
    """Each of ``grads`` in turn through thinwire's scheme and through its plain version:
    the same mean, and the same error memory, bit for bit, at every step."""
    scheme = schemes.build(name, **options)
    assert scheme.origin is not None
    found = floors.floor_of(name, scheme.origin[1])
    assert found is not None
    plain, state = found
    infos = [TensorInfo.of(key, grad) for key, grad in grads[0].items()]
    error = torch.zeros(sum(info.numel for info in infos))
    for grad in grads:
        flat = torch.cat([g.reshape(-1) for g in grad.values()])
        mean = scheme.launch_flat(flat.clone(), infos, ALONE).wait()
        assert torch.equal(plain(flat.clone(), error, state), mean)
        memory = scheme.memory
        if memory is not None:  # one buffer per tensor, laid back to back
            assert torch.equal(torch.cat([memory.buffers[info.key].reshape(-1)
                                          for info in infos]), error)


@pytest.mark.parametrize(("name", "options"), SPELLINGS)
def test_a_plain_version_decodes_what_its_scheme_decodes(name: str,
                                                         options: dict[str, object]) -> None:
    shapes = {"w1": (40, 37), "b1": (37,), "ln": (5,), "w2": (300, 3), "scalar": (1,),
              "w3": (3, 4, 5)}
    generator = torch.Generator().manual_seed(0)
    side_by_side(name, options, [{key: torch.randn(shape, generator=generator) * scale
                                  for (key, shape), scale in zip(shapes.items(),
                                                                 [1.0, 1e-3, 10.0, 0.1, 1, 2])}
                                 for _ in range(6)])


def test_a_plain_version_decodes_a_real_gradient_alike() -> None:
    grad = codec.gradient("digits-mlp")
    side_by_side("topk", {"ratio": 0.07, "values": "int8", "indices": "delta8"},
                 [grad, {key: g * 0.5 for key, g in grad.items()}, grad])


def test_options_a_plain_version_does_not_do_have_no_floor() -> None:
    for spelling in [{"scope": "layer"}, {"values": "int4"}, {"error_feedback": False}]:
        scheme = schemes.build("topk", **spelling)
        assert scheme.origin is not None
        assert floors.floor_of("topk", scheme.origin[1]) is None
    assert floors.floor_of("powersgd", schemes.build("powersgd").origin[1]) is None


def test_each_spelling_times_its_own_scheme_beside_the_floor(tmp_path: Path) -> None:
    out = tmp_path / "codec.json"
    assert codec.main(["--workload", "digits-mlp", "--schemes", "dense,topk:ratio=0.1",
                       "--repeats", "2", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert set(record["ms_per_step"]) == {"dense", "topk:ratio=0.1", "floor"}
    assert all(ms > 0 for ms in record["ms_per_step"].values())
    assert record["over_floor"]["floor"] == 1.0 and record["load_before"]
    assert set(record["plain_ms_per_step"]) == {"topk:ratio=0.1"}  # dense has no floor
    assert set(record["calls_per_step"]) == {"dense", "topk:ratio=0.1", "floor"}
    assert record["calls_per_step"]["floor"] == 1
    assert 0 < record["plain_calls_per_step"]["topk:ratio=0.1"] \
        < record["calls_per_step"]["topk:ratio=0.1"]


def test_a_synthetic_gradient_has_the_tensors_asked_for(tmp_path: Path) -> None:
    grads = codec.synthetic(300)
    sizes = sorted(grad.numel() for grad in grads.values())
    assert len(grads) == 300 and sizes[0] < 100 < 10_000 < sizes[-1]
    out = tmp_path / "codec.json"
    assert codec.main(["--synthetic", "40", "--schemes", "fp16", "--repeats", "1",
                       "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["workload"] == "synthetic-40" and record["tensors"] == 40
    assert set(record["plain_ms_per_step"]) == {"fp16"}


def test_a_bad_option_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        codec.main(["--workload", "digits-mlp", "--schemes", "topk:rank=2"])
    assert caught.value.code == 2
    assert "'rank' is not an option of topk" in capsys.readouterr().err
