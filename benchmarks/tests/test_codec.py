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
             ("dct-dp", {"ratio": 0.1, "scope": "bucket", "life_span": 3, "capacity": 1.25}),
             ("laplace", {"ratio": 0.07, "scope": "bucket", "min_numel": 0}),
             ("laplace", {"ratio": 0.1, "scope": "bucket", "min_numel": 0, "capacity": 1.0,
                          "gain": 0.5, "values": "int8"}),
             ("local-topk", {"ratio": 0.07}),
             ("local-topk", {"ratio": 0.07, "values": "int8"}),
             ("clt-k", {"ratio": 0.07}),
             ("powersgd", {}),
             ("powersgd", {"rank": 3, "seed": 5})]


def side_by_side(name: str, options: dict[str, object], grads: list[dict[str, torch.Tensor]],
                 ulps: int = 0) -> None:
    """Each of ``grads`` in turn through thinwire's scheme and through its plain version:
    the same mean, and the same error memory, at every step: bit for bit, or, where the
    plain version reduces in another order, each tensor's within ``ulps`` units in the
    last place of its largest decoded entry."""
    scheme = schemes.build(name, **options)
    assert scheme.origin is not None
    infos = [TensorInfo.of(key, grad) for key, grad in grads[0].items()]
    found = floors.floor_of(name, scheme.origin[1], infos)
    assert found is not None
    plain, state = found
    error = torch.zeros(sum(info.numel for info in infos))
    for grad in grads:
        flat = torch.cat([g.reshape(-1) for g in grad.values()])
        mean = scheme.launch_flat(flat.clone(), infos, ALONE).wait()
        got = plain(flat.clone(), error, state)
        memory = scheme.memory
        # one buffer per tensor, laid back to back; a tensor without one keeps nothing
        kept = mean if memory is None else torch.cat([
            memory.buffers[info.key].reshape(-1) if info.key in memory.buffers
            else torch.zeros(info.numel) for info in infos])
        if not ulps:
            assert torch.equal(got, mean)
            assert memory is None or torch.equal(kept, error)
            continue
        sizes = [info.numel for info in infos]
        for ours, theirs, memo, floor_memo in zip(got.split(sizes), mean.split(sizes),
                                                  kept.split(sizes), error.split(sizes)):
            step = ulps * torch.finfo(torch.float32).eps / 2 * 2.0 ** torch.frexp(
                theirs.abs().max()).exponent  # ulps of the tensor's largest entry
            assert (ours - theirs).abs().max() <= step
            assert (memo - floor_memo).abs().max() <= step


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


def test_sparselocos_plain_version_decodes_within_rounding() -> None:
    shapes = {"w1": (40, 37), "b1": (37,), "w2": (300, 3), "ln": (5,), "w3": (3, 4, 5),
              "w4": (16, 32)}  # whole chunks of 256, partial ones, vectors and one alone
    generator = torch.Generator().manual_seed(0)
    grads = [{key: torch.randn(shape, generator=generator) * scale
              for (key, shape), scale in zip(shapes.items(), [1.0, 1e-3, 0.1, 10.0, 2, 0.5])}
             for _ in range(6)]
    side_by_side("sparseloco", {"chunk": 256, "k": 8}, grads, ulps=4)
    side_by_side("sparseloco", {}, grads, ulps=4)  # 4096: partial chunks only


def test_a_plain_version_decodes_a_real_gradient_alike() -> None:
    grad = codec.gradient("digits-mlp")
    steps = [grad, {key: g * 0.5 for key, g in grad.items()}, grad]
    side_by_side("topk", {"ratio": 0.07, "values": "int8", "indices": "delta8"}, steps)
    side_by_side("sparseloco", {"chunk": 256, "k": 8}, steps, ulps=4)


def test_options_a_plain_version_does_not_do_have_no_floor() -> None:
    for spelling in [{"scope": "layer"}, {"values": "int4"}, {"error_feedback": False}]:
        scheme = schemes.build("topk", **spelling)
        assert scheme.origin is not None
        assert floors.floor_of("topk", scheme.origin[1], []) is None
    for name, spelling in [("laplace", {}), ("powersgd", {"warm_start": False}),
                           ("clt-k", {"beta": 0.5}), ("sparseloco", {"nonfinite": "skip"})]:
        scheme = schemes.build(name, **spelling)
        assert scheme.origin is not None
        assert floors.floor_of(name, scheme.origin[1], []) is None


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
    page = codec.section([(record, out)])  # the results page: rows with a plain version
    row = next(line for line in page.splitlines() if line.startswith("| `topk:ratio=0.1`"))
    ms = record["ms_per_step"]["topk:ratio=0.1"]
    assert f"{ms / record['plain_ms_per_step']['topk:ratio=0.1']:.2f}" in row
    assert "| `dense`" not in page and out.as_posix() in page


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


def test_one_large_matrix_has_the_entries_asked_for(tmp_path: Path) -> None:
    assert codec.entries(1_000_000)["weight"].shape == (15_625, 64)
    assert codec.entries(3 * 4096 * 5)["weight"].shape == (15, 4096)
    out = tmp_path / "codec.json"
    assert codec.main(["--entries", "20000", "--schemes", "sparseloco,powersgd",
                       "--repeats", "1", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["workload"] == "entries-20000" and record["tensors"] == 1
    assert record["entries"] == 20000
    assert set(record["plain_ms_per_step"]) == {"sparseloco", "powersgd"}


def test_a_run_adds_its_schemes_to_an_earlier_one(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "codec.json"
    assert codec.main(["--entries", "5000", "--schemes", "fp16,topk", "--repeats", "1",
                       "--out", str(out)]) == 0
    assert codec.main(["--entries", "5000", "--schemes", "topk,laplace:scope=bucket:min_numel=0",
                       "--repeats", "1", "--add-to", str(out)]) == 0
    record = json.loads(out.read_text())
    assert set(record["plain_ms_per_step"]) == {"fp16", "topk", "laplace:scope=bucket:min_numel=0"}
    assert set(record["ms_per_step"]) == {*record["plain_ms_per_step"], "floor"}
    assert [run["command"].split()[-1] for run in record["earlier"]] == [str(out)]
    assert "--add-to" in record["command"]
    with pytest.raises(SystemExit):
        codec.main(["--entries", "4000", "--schemes", "fp16", "--add-to", str(out)])
    assert "not this run's" in capsys.readouterr().err


def test_a_bad_option_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        codec.main(["--workload", "digits-mlp", "--schemes", "topk:rank=2"])
    assert caught.value.code == 2
    assert "'rank' is not an option of topk" in capsys.readouterr().err
