"""The link model's overlap rule against real shaped links: modelled and measured step times.

For each run of a :mod:`benchmarks.netem` results file, the mean step time it
measured (every step timed, a local-update sync's wait included) beside what
:func:`benchmarks.linkmodel.exposed` makes of the run's own parts: its compute
and codec per step, plus the link time per step (the bytes the shaper charged
in the busier direction, over the rate) that the overlap does not hide; and,
for contrast, the same with no overlap credited. A rule that credits overlap
where none happens shows as a measured time well above the modelled one.

Usage: ``python -m benchmarks.overlap results/netem/TIME/results.json
[--out docs/data/overlap-check.json]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from benchmarks.linkmodel import exposed
from thinwire.jobs import local_run
from thinwire.jobs.compare import split_spelling


def parts(run: dict[str, Any]) -> dict[str, Any]:
    """The fields :func:`~benchmarks.linkmodel.exposed` reads, from a shaped-link run."""
    name, _ = split_spelling(run["scheme"])
    if local_run.is_local(name):
        options, _ = local_run.parts(name, run["config"])
        return {"local": dataclasses.asdict(options)}
    return {"delayed": local_run.step_parts(run["config"])[0].delayed}


def check(run: dict[str, Any]) -> dict[str, Any] | None:
    """Measured and modelled ms per step of one run (None: the shaper was not read)."""
    wire = max(run.get("shaper_tx_per_step") or 0.0, run.get("shaper_rx_per_step") or 0.0)
    if not wire or not run.get("steps"):
        return None
    link_s = 8.0 * wire / run["rate_bps"]
    busy_s = run["compute_s"] + run["overhead_s_per_step"]
    modelled = busy_s + exposed(parts(run), link_s, busy_s)
    measured = run["train_s"] / run["steps"]
    return {"scheme": run["scheme"], "rate": run["rate"], "workers": run["workers"],
            "steps": run["steps"], "measured_ms": 1000 * measured,
            "modelled_ms": 1000 * modelled, "no_overlap_ms": 1000 * (busy_s + link_s),
            "link_ms": 1000 * link_s, "busy_ms": 1000 * busy_s,
            "measured_over_modelled": measured / modelled}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a benchmarks.netem results.json")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    record = json.loads(args.results.read_text())
    rows = [row for row in map(check, record["runs"]) if row is not None]
    for row in rows:
        print(f"{row['scheme']:60s} {row['rate']:>8s} measured {row['measured_ms']:7.1f} ms, "
              f"modelled {row['modelled_ms']:7.1f} (no overlap {row['no_overlap_ms']:7.1f}): "
              f"x{row['measured_over_modelled']:.2f}")
    if args.out is not None:
        args.out.write_text(json.dumps({"source": str(args.results),
                                        "command": record.get("command"),
                                        "load_before": record.get("load_before"),
                                        "load_after": record.get("load_after"),
                                        "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
