"""Accuracy against bytes for dct-dp's wire format: payload capacity, index list, value dtype.

A sparse bucket travels as one fixed-capacity payload
(:class:`~thinwire.compress.payload.SparseLayout`): its size depends on the
capacity (room for ``capacity * k`` entries per tensor), the index list
(int32, or 16 bits an index ``delta16``; a bitmap replaces either when smaller,
which at 1 % density it never is) and the value dtype, never on the data. So
bytes per step are a property of the format, while accuracy depends on the
capacity (what a threshold passes beyond it waits in the error memory) and on
the value dtype (fp16 rounding, also kept in the error memory). The index
list is lossless: int32 and delta16 train bit for bit alike.

Each (capacity, values) pair trains the digits-mlp workload at 4 workers
with its recipe (SGD momentum 0.9, coupled into the scheme as the quick
start does) for every seed; dense trains alongside as the reference. The
bytes of the other index format are computed from the layout and checked
against the Meter on the format that ran. Bytes on the shaped-link MLP
(64-2048-2048-10, DDP's default buckets) are computed the same way.

Results go to ``docs/data/wire-format.json``; ``python -m benchmarks.report``
renders the table into ``docs/results.md``.

Usage::

    python -m benchmarks.wire_format            # 2 seeds x 6 formats + dense
    python -m benchmarks.wire_format --seeds 0  # one seed
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.machine import cpu_model
from thinwire import schemes
from thinwire.compress import TensorInfo
from thinwire.jobs.compare import compare
from thinwire.jobs.dataparallel import RunOptions
from thinwire.jobs.workloads import RECIPES, load

DATA = Path("docs/data/wire-format.json")
CAPACITIES = (1.0, 1.1, 1.25)
VALUES = ("fp32", "fp16")
INDICES = ("int32", "delta16")
METERED = "int32"  # the index list training runs with; the other's bytes are computed
SHAPED_LINK = ((2048, 64), (2048,), (2048, 2048), (2048,), (10, 2048), (10,))
FIRST_BUCKET = 1 << 20  # DDP's first bucket (bytes) ...
BUCKET = 25 << 20  # ... and every later one


def buckets(shapes: Sequence[tuple[int, ...]]) -> list[list[TensorInfo]]:
    """DDP's buckets of fp32 parameters of ``shapes`` (model order): reverse order, each
    closed once it reaches its cap (1 MiB for the first, 25 MiB after)."""
    infos = [TensorInfo(f"p{i}", shape) for i, shape in enumerate(shapes)]
    out: list[list[TensorInfo]] = [[]]
    size = 0
    for info in reversed(infos):
        out[-1].append(info)
        size += 4 * info.numel
        if size >= (FIRST_BUCKET if len(out) == 1 else BUCKET):
            out.append([])
            size = 0
    return [bucket for bucket in out if bucket]


def step_bytes(scheme: schemes.Scheme, bucket_list: Sequence[Sequence[TensorInfo]]) -> int:
    """Bytes a rank hands to torch.distributed per step: the scheme's own count of each
    bucket's payloads (:meth:`~thinwire.schemes.Scheme.payload_bytes`)."""
    return sum(sum(scheme.payload_bytes(bucket).values()) for bucket in bucket_list)


def formats() -> list[dict[str, Any]]:
    return [{"capacity": c, "values": v} for c, v in itertools.product(CAPACITIES, VALUES)]


def measure(seed: int, workers: int, steps: int | None) -> list[dict[str, Any]]:
    """Dense and every (capacity, values) format of dct-dp on digits-mlp, one seed."""
    recipe = RECIPES["digits-mlp"]
    options = RunOptions(steps=steps or recipe["steps"], batch_size=recipe["batch_size"],
                         lr=recipe["lr"], momentum=recipe["momentum"], seed=seed,
                         workload="digits-mlp", optimizer=recipe["optimizer"])
    shapes = [tuple(p.shape) for p in load("digits-mlp").model(0).parameters()]
    rows = []
    for fmt in [None, *formats()]:
        name = "dense" if fmt is None else "dct-dp"
        extra = [] if fmt is None else [f"{key}={value}" for key, value in
                                        {**fmt, "indices": METERED}.items()]
        result = compare([name], workers, options, 100e6, ratio=0.01, life_span=1000,
                         extra=extra)[0]
        row = {"seed": seed, "workers": workers, "scheme": name, "format": fmt,
               "steps": options.steps, "target": result["target"],
               "steps_to_target": result["steps_to_target"],
               "test_accuracy": result["test_accuracy"],
               "bytes_sent_per_step": result["bytes_sent_per_step"],
               "dense_bytes_per_step": result["dense_bytes_per_step"],
               "density_per_layer": result.get("density_per_layer", {})}
        if fmt is not None:
            row["bytes_by_indices"] = {}
            for indices in INDICES:
                scheme = schemes.build("dct-dp", ratio=0.01, indices=indices, **fmt)
                computed = step_bytes(scheme, [[TensorInfo(f"p{i}", shape)
                                                for i, shape in enumerate(shapes)]])
                row["bytes_by_indices"][indices] = computed
            if row["bytes_by_indices"][METERED] != round(result["bytes_sent_per_step"]):
                raise AssertionError(f"layout arithmetic {row['bytes_by_indices'][METERED]} B "
                                     f"!= metered {result['bytes_sent_per_step']} B")
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("seed", "scheme", "format", "steps_to_target",
                                                "test_accuracy", "bytes_sent_per_step")}),
              flush=True)
    return rows


def shaped_link() -> list[dict[str, Any]]:
    """Computed bytes per step of every format on the shaped-link MLP."""
    dense = 4 * sum(TensorInfo("x", shape).numel for shape in SHAPED_LINK)
    out = []
    for fmt in formats():
        for indices in INDICES:
            scheme = schemes.build("dct-dp", ratio=0.01, indices=indices, **fmt)
            nbytes = step_bytes(scheme, buckets(SHAPED_LINK))
            out.append({**fmt, "indices": indices, "bytes_per_step": nbytes,
                        "below_dense": dense / nbytes})
    return out


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per format x index list: median steps to target over seeds, its ratio to dense's,
    mean final accuracy, bytes per step and the ratio below dense."""
    dense = {r["seed"]: r for r in rows if r["scheme"] == "dense"}
    out = []
    for fmt in formats():
        mine = [r for r in rows if r["format"] == fmt]
        if not mine:
            continue
        reached = [r["steps_to_target"] for r in mine]
        ratios = [r["steps_to_target"] / dense[r["seed"]]["steps_to_target"]
                  for r in mine if r["steps_to_target"] and dense[r["seed"]]["steps_to_target"]]
        for indices in INDICES:
            nbytes = statistics.fmean(r["bytes_by_indices"][indices] for r in mine)
            out.append({**fmt, "indices": indices, "seeds": len(mine),
                        "steps_to_target": reached,
                        "steps_ratio": statistics.median(ratios) if len(ratios) == len(mine)
                        else None,
                        "test_accuracy": statistics.fmean(r["test_accuracy"] for r in mine),
                        "bytes_per_step": nbytes,
                        "below_dense": mine[0]["dense_bytes_per_step"] / nbytes})
    return out


def section(record: dict[str, Any]) -> str:
    """The results-page section: one row per format, digits-mlp and shaped-link bytes."""
    link = {(r["capacity"], r["values"], r["indices"]): r for r in record["shaped_link"]}
    dense = [r for r in record["runs"] if r["scheme"] == "dense"]
    lines = ["## dct-dp wire format: bytes against steps", "",
             f"`{record['command']}` ({record['date']}, {record['machine']['cpu']}, load "
             f"{record['load_before'][0]:.1f} before, {record['load_after'][0]:.1f} after; "
             "data: `docs/data/wire-format.json`). digits-mlp at "
             f"{dense[0]['workers'] if dense else '?'} workers, sparsity "
             f"{record['sparsity']}, SGD momentum 0.9 coupled, "
             f"{len({r['seed'] for r in record['runs']})} seeds; dense reached the target in "
             f"{[r['steps_to_target'] for r in dense]} steps (evaluated every 25). Bytes are "
             f"what one rank hands to torch.distributed per step (metered with {METERED} "
             "indices, computed from the layout for the other list: the index list is "
             "lossless, so training is the same). Shaped-link bytes: the MLP 64-2048-2048-10 "
             "in DDP's default buckets, computed from the layout.", "",
             "| capacity | values | indices | digits B/step | below dense | steps to target "
             "| vs dense | final acc | shaped-link B/step | below dense |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in record["summary"]:
        shaped = link[(row["capacity"], row["values"], row["indices"])]
        ratio = "-" if row["steps_ratio"] is None else f"{row['steps_ratio']:.2f}"
        lines.append(f"| {row['capacity']} | {row['values']} | {row['indices']} | "
                     f"{row['bytes_per_step']:,.0f} | {row['below_dense']:.1f}x | "
                     f"{row['steps_to_target']} | {ratio} | {row['test_accuracy']:.3f} | "
                     f"{shaped['bytes_per_step']:,} | {shaped['below_dense']:.1f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=None, help="default: the recipe's")
    parser.add_argument("--out", type=Path, default=DATA)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    begin = time.time()
    rows = [row for seed in args.seeds for row in measure(seed, args.workers, args.steps)]
    record: dict[str, Any] = {
        "command": "python -m benchmarks.wire_format", "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "load_before": load_before, "load_after": os.getloadavg(),
        "wall_s": time.time() - begin, "workload": "digits-mlp", "sparsity": 0.99,
        "runs": rows, "summary": summarise(rows), "shaped_link": shaped_link()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    for line in record["summary"] + record["shaped_link"]:
        print(json.dumps(line))


if __name__ == "__main__":
    main()
