"""Do the defaults transfer? Schemes against dense at equal steps on the protocol's configurations.

``benchmarks/protocol.json`` names, before any tuning, the language-model
configurations (corpus, size, workers, recipe) that choose thinwire's defaults
(``choose``) and those that only check them (``check``). Each configuration
and seed is one ``thinwire compare`` job (dense and the schemes, one process
tree, the same data and seed); each scheme's row is its final bits per byte
relative to dense's after the same steps (``vs_dense``, the figure a user of a
fixed step budget reads) and its bytes handed a step relative to dense's.
``--set check`` runs the shipped defaults only: a scheme spelled with options
is refused, so a checking configuration can never tune one. Results are
appended to a JSON file one job at a time (a rerun skips jobs already there)
and rendered as a Markdown table from that file alone.

Usage: ``python -m benchmarks.transfer --set check [--configs NAME,..] [--seeds 0,1]
[--schemes topk,..] [--out docs/data/transfer-check.json]``; ``--report FILE`` renders.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from thinwire.jobs.compare import compare, vs_dense
from thinwire.jobs.dataparallel import RunOptions
from thinwire.jobs.local_run import is_local
from thinwire.schemes.registry import split_spelling

PROTOCOL = Path(__file__).with_name("protocol.json")
SETS = ("choose", "check")
SHAPE = ("width", "layers", "context", "tied")


def load_protocol(path: Path = PROTOCOL) -> dict[str, Any]:
    """The protocol, checked: every configuration named once, in one set only, with a
    known recipe.

    Raises:
        ValueError: a name in both sets or twice, or an unknown recipe.
    """
    protocol: dict[str, Any] = json.loads(path.read_text())
    names = [config["name"] for name in SETS for config in protocol[name]]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"{path}: configurations {twice} are named twice (a configuration "
                         "chooses or checks, never both)")
    for config in (c for name in SETS for c in protocol[name]):
        if config["recipe"] not in protocol["recipes"]:
            raise ValueError(f"{path}: {config['name']!r} names recipe {config['recipe']!r}; "
                             f"known: {sorted(protocol['recipes'])}")
    return protocol


def run_options(protocol: dict[str, Any], config: dict[str, Any], seed: int) -> RunOptions:
    """The RunOptions of one configuration at ``seed`` (evaluated 10 times a run)."""
    recipe = protocol["recipes"][config["recipe"]]
    shape = {key: config[key] for key in SHAPE if key in config}
    return RunOptions(workload=config["workload"], steps=config["steps"],
                      batch_size=config["batch_size"], seed=seed,
                      eval_every=max(1, config["steps"] // 10), eval_rows=None,
                      **shape, **recipe)


def check_spellings(which: str, schemes: list[str]) -> None:
    """Refuse a scheme with options of its own in the ``check`` set.

    Raises:
        ValueError: ``which`` is ``"check"`` and a spelling carries options.
    """
    tuned = [spelling for spelling in schemes if split_spelling(spelling)[1]]
    if which == "check" and tuned:
        raise ValueError(f"--set check runs the shipped defaults only; {tuned} carry options "
                         "of their own (tune on --set choose)")


def row(result: dict[str, Any], dense: dict[str, Any]) -> dict[str, Any]:
    """What the tables show of one scheme's run beside dense's."""
    return {"scheme": result["scheme"], "local": is_local(split_spelling(result["scheme"])[0]),
            "test_score": result["test_score"], "vs_dense": vs_dense(result, dense),
            "bytes_vs_dense": result["bytes_sent_per_step"] / dense["bytes_sent_per_step"],
            "config": result["config"], "wall_s": result["wall_s"],
            "replicas_identical": result["replicas_identical"],
            "curve": [(step, score) for step, _, score in result["curve"]]}


def run(which: str, names: list[str] | None, seeds: list[int], schemes: list[str],
        out: Path, timeout_s: float) -> None:
    """Run every (configuration, seed) of ``which`` not yet in ``out``, appending each."""
    protocol = load_protocol()
    check_spellings(which, schemes)
    configs = [c for c in protocol[which] if names is None or c["name"] in names]
    unknown = sorted(set(names or ()) - {c["name"] for c in protocol[which]})
    if unknown:
        raise ValueError(f"--configs {unknown} are not in the {which!r} set: "
                         f"{[c['name'] for c in protocol[which]]}")
    record: dict[str, Any] = (json.loads(out.read_text()) if out.exists()
                              else {"set": which, "jobs": []})
    done = {(job["config"]["name"], job["seed"], tuple(r["scheme"] for r in job["rows"]))
            for job in record["jobs"]}
    jobs = [(c, s) for c in configs for s in seeds
            if (c["name"], s, tuple(schemes)) not in done]
    for config, seed in tqdm(jobs, desc=f"{which} jobs"):
        options = run_options(protocol, config, seed)
        start, load = time.perf_counter(), os.getloadavg()[0]
        results = compare(["dense", *schemes], config["workers"], options, 100e6,
                          timeout_s=timeout_s)
        dense = results[0]
        record["jobs"].append({
            "config": config, "seed": seed, "options": dataclasses.asdict(options),
            "dense": {"test_score": dense["test_score"],
                      "bytes_sent_per_step": dense["bytes_sent_per_step"],
                      "curve": [(step, score) for step, _, score in dense["curve"]]},
            "rows": [row(result, dense) for result in results[1:]],
            "load_before": load, "wall_s": time.perf_counter() - start,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        })
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1) + "\n")  # nothing lost on a later failure
        tqdm.write(table([record["jobs"][-1]], protocol["goals"]))


def meets(line: dict[str, Any], goals: dict[str, Any]) -> bool:
    """Whether a row meets its family's goals (within ``vs_dense``, at most
    ``bytes_vs_dense`` of dense's bytes a step)."""
    goal = goals["local" if line["local"] else "per_step"]
    return bool(line["vs_dense"] <= goal["vs_dense"]
                and line["bytes_vs_dense"] <= goal["bytes_vs_dense"])


def table(jobs: list[dict[str, Any]], goals: dict[str, Any]) -> str:
    """A Markdown table: one row per scheme, configuration and seed."""
    lines = ["| configuration | seed | scheme | bits per byte | vs dense | bytes a step vs "
             "dense | meets the goals |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for job in jobs:
        name, seed = job["config"]["name"], job["seed"]
        lines.append(f"| {name} | {seed} | dense | {job['dense']['test_score']:.4f} | - | 1 | - |")
        for line in job["rows"]:
            lines.append(f"| {name} | {seed} | `{line['scheme']}` | {line['test_score']:.4f} | "
                         f"{100 * line['vs_dense']:+.1f} % | 1/{1 / line['bytes_vs_dense']:,.1f}"
                         f" | {'yes' if meets(line, goals) else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", dest="which", choices=SETS, default="check")
    parser.add_argument("--configs", default=None, help="comma-separated names (default: all)")
    parser.add_argument("--seeds", default=None, help="comma-separated (default: the protocol's)")
    parser.add_argument("--schemes", default=None,
                        help="comma-separated (default: the protocol's); options only with "
                             "--set choose")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file, appended (default: docs/data/transfer-SET.json)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="process-group timeout")
    parser.add_argument("--report", type=Path, default=None,
                        help="render this JSON file as a Markdown table and exit")
    args = parser.parse_args()
    protocol = load_protocol()
    if args.report is not None:
        print(table(json.loads(args.report.read_text())["jobs"], protocol["goals"]))
        return
    seeds = ([int(s) for s in args.seeds.split(",")] if args.seeds else protocol["seeds"])
    schemes = args.schemes.split(",") if args.schemes else protocol["schemes"]
    run(args.which, args.configs.split(",") if args.configs else None, seeds, schemes,
        args.out or Path(f"docs/data/transfer-{args.which}.json"), args.timeout)


if __name__ == "__main__":
    main()
