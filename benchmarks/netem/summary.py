"""What the harness derives from the workers' measurements: floors, projections, tables.

Pure functions over result dictionaries, so the report and the tests use them
without root or namespaces.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

FRAME_OVERHEAD = 1514 / 1448  # Ethernet + IPv4 + TCP (timestamps) headers per full segment


def floor_s(compute_s: float, sent_bytes: float, received_bytes: float,
            rate_bps: float) -> float:
    """The physical limit of one step: ``compute + bytes / rate``.

    Links are full duplex and shaped per direction, so the busier direction
    counts: ``max(sent, received)``.

    Raises:
        ValueError: a negative time or byte count, or a rate that is not positive.
    """
    if not rate_bps > 0:
        raise ValueError(f"rate_bps={rate_bps!r} must be > 0")
    if min(compute_s, sent_bytes, received_bytes) < 0:
        raise ValueError(f"compute_s={compute_s!r}, sent_bytes={sent_bytes!r} and "
                         f"received_bytes={received_bytes!r} must be >= 0")
    return compute_s + 8.0 * max(sent_bytes, received_bytes) / rate_bps


def same_trajectory(a: list[float], b: list[float]) -> bool:
    """Whether two runs' per-step losses agree bit for bit over their common prefix."""
    common = min(len(a), len(b))
    return common > 0 and a[:common] == b[:common]


def derive(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add floors, physical-limit ratios and time to target to each finished run.

    Time to target is *measured* when the run reached the target accuracy
    before its time cap. Otherwise, if a run of the same scheme and worker
    count reached it (at another rate) after ``S`` steps, it is *projected*:
    this run's training seconds so far plus its median step time for each of
    the remaining steps. Runs with the same seed follow the same trajectory
    whatever the link (``trajectory_matches`` checks this on the losses).
    Returns the same list, modified in place.
    """
    for run in runs:
        if run.get("status") != "ok":
            continue
        rate = run["rate_bps"]
        run["floor_s"] = floor_s(run["compute_s"], run["wire_sent_per_step"],
                                 run["bytes_received_per_step"], rate)
        run["floor_ratio"] = run["median_step_s"] / run["floor_s"]
        charged = [b for b in (run.get("shaper_tx_per_step"), run.get("shaper_rx_per_step"))
                   if b is not None]
        run["wire_floor_s"] = floor_s(run["compute_s"], max(charged), 0.0, rate) if (
            charged) else None
        run["wire_floor_ratio"] = (run["median_step_s"] / run["wire_floor_s"]
                                   if run["wire_floor_s"] else None)
        run["compression_ratio"] = run["dense_bytes"] / max(run["bytes_handed_per_step"], 1e-9)
    for run in runs:
        if run.get("status") != "ok":
            continue
        if run["reached_step"] is not None:
            run.update(time_to_target_s=run["reached_train_s"], time_to_target_kind="measured",
                       steps_to_target=run["reached_step"], trajectory_matches=None)
            continue
        reference = _reference(run, runs)
        if reference is None:
            run.update(time_to_target_s=None, time_to_target_kind="not reached",
                       steps_to_target=None, trajectory_matches=None)
            continue
        remaining = max(0, reference["reached_step"] - run["steps"])
        run.update(time_to_target_s=run["train_s"] + remaining * run["median_step_s"],
                   time_to_target_kind="projected", steps_to_target=reference["reached_step"],
                   projected_from=reference["rate"],
                   trajectory_matches=same_trajectory(run["losses"], reference["losses"]))
    return runs


def _reference(run: dict[str, Any], runs: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    for other in runs:
        if (other is not run and other.get("status") == "ok"
                and other.get("reached_step") is not None and other["rate"] != run["rate"]
                and (other["scheme"], other["workers"]) == (run["scheme"], run["workers"])):
            return other
    return None


def median_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One run per (rate, workers, scheme): the median of its rounds by time to target.

    A run that never reached the target counts as slower than any that did; with
    an even number of rounds the lower median is taken. The run chosen is a
    whole run (its step times, bytes and curve belong together), with the times
    to target of every round added as ``time_to_target_rounds_s``. Failed runs
    stand only where a cell has no finished one. With one round, ``runs`` as is.
    """
    cells: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for run in runs:
        cells.setdefault((run["rate"], run["workers"], run["scheme"]), []).append(run)
    out = []
    for group in cells.values():
        ok = [run for run in group if run.get("status") == "ok"]
        if len(group) == 1 or not ok:
            out.append(group[0])
            continue
        ranked = sorted(ok, key=lambda run: (run["time_to_target_s"] is None,
                                             run["time_to_target_s"] or 0.0))
        out.append({**ranked[(len(ranked) - 1) // 2],
                    "time_to_target_rounds_s": [run["time_to_target_s"] for run in ok]})
    return out


def speedups(runs: list[dict[str, Any]], baseline: str) -> dict[tuple[str, int, str], float]:
    """(rate, workers, scheme) -> baseline's time to target / the scheme's."""
    times = {(r["rate"], r["workers"], r["scheme"]): r.get("time_to_target_s") for r in runs}
    out = {}
    for (rate, workers, scheme), seconds in times.items():
        base = times.get((rate, workers, baseline))
        if seconds and base:
            out[(rate, workers, scheme)] = base / seconds
    return out


def fmt_seconds(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:.2f}" if value < 100 else f"{value:.0f}"


# The rows every time-to-target table carries beside the schemes.
REFERENCE_ROWS = ("lone worker", "compute-only bound")
DENSE = ("torch-dense", "dense")  # whose steps at n workers make the compute-only bound


def reference_rows(runs: list[dict[str, Any]],
                   lone: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Per (rate, workers) cell, the lone worker and compute-only bound, and each run's
    ``bound_multiple`` (``runs`` modified in place).

    * lone worker: dense with the same recipe on one worker and no link (``lone``, a
      worker's result; its measured training time to the target), the same in every cell;
    * compute-only bound: the cell's dense run's steps to target x the cell's median
      compute step: n workers with free communication.

    A row carries the recipe (``recipe``) of the run it is built from; None where the
    lone run or the cell's dense run is missing or did not reach the target.
    """
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for run in runs:
        if run.get("status") == "ok":
            cells.setdefault((run["rate"], run["workers"]), []).append(run)
    rows = []
    reached = lone is not None and lone.get("status") == "ok" and lone["reached_step"]
    for (rate, workers), group in cells.items():
        dense = next((r for r in group if r["scheme"] in DENSE), None)
        compute_s = statistics.median(r["compute_s"] for r in group)
        steps = None if dense is None else dense.get("steps_to_target")
        bound = {"scheme": "compute-only bound", "rate": rate, "workers": workers,
                 "reference": True, "recipe": (dense or group[0]).get("recipe"),
                 "compute_s": compute_s, "steps_to_target": steps,
                 "time_to_target_s": None if steps is None else steps * compute_s,
                 "time_to_target_kind": "modelled"}
        alone = {"scheme": "lone worker", "rate": rate, "workers": 1, "reference": True,
                 "recipe": None if lone is None else lone.get("recipe"),
                 "compute_s": None if lone is None else lone.get("compute_s"),
                 "steps_to_target": lone["reached_step"] if reached and lone else None,
                 "time_to_target_s": lone["reached_train_s"] if reached and lone else None,
                 "time_to_target_kind": "measured"}
        for row in [*group, alone, bound]:
            seconds = row.get("time_to_target_s")
            row["bound_multiple"] = (seconds / bound["time_to_target_s"]
                                     if seconds and bound["time_to_target_s"] else None)
        rows += [alone, bound]
    return rows
