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
    A sharded run (``sites``) counts its site's cross-site bytes in the floor (the
    site's ranks share one port) and gets :func:`site_traffic` as ``site_traffic``.
    Returns the same list, modified in place.
    """
    for run in runs:
        if run.get("status") != "ok":
            continue
        rate = run["rate_bps"]
        # a site's ranks share its port: the floor carries all their cross-site bytes
        share = run.get("shards_per_site", 1)
        run["floor_s"] = floor_s(run["compute_s"], share * run["wire_sent_per_step"],
                                 share * run["bytes_received_per_step"], rate)
        run["floor_ratio"] = run["median_step_s"] / run["floor_s"]
        charged = [b for b in (run.get("shaper_tx_per_step"), run.get("shaper_rx_per_step"))
                   if b is not None]
        run["wire_floor_s"] = floor_s(run["compute_s"], max(charged), 0.0, rate) if (
            charged) else None
        run["wire_floor_ratio"] = (run["median_step_s"] / run["wire_floor_s"]
                                   if run["wire_floor_s"] else None)
        # sharded runs exchange each rank's shard, so that is what dense would hand over
        dense = run.get("dense_shard_bytes", run["dense_bytes"])
        run["compression_ratio"] = dense / max(run["bytes_handed_per_step"], 1e-9)
        if run.get("sites") is not None:
            run["site_traffic"] = site_traffic(run)
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
# whose steps at n workers make the compute-only bound (native-hsdp: with sites)
DENSE = ("torch-dense", "native-hsdp", "dense")


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


# A site's shaped port must carry its ranks' cross-site bytes as frames (headers and the
# acknowledgements of what it receives on top) and nothing of its own traffic; the band
# is wide because small messages pay more headers, while a leak of the site's own
# traffic (FSDP's all-gather and reduce-scatter, ~2 (shards - 1) shards per step) would
# multiply the ratio.
SITE_RATIO_BAND = (0.9, 1.5)


def site_traffic(run: dict[str, Any]) -> dict[str, Any]:
    """Did the shaped port carry the site's cross-site bytes, and only those?

    Compares, per step over the timed window, what the site port's two shapers charged
    with what the Meter says the site's ranks send and receive across sites (the ring
    model, rank 0's bytes times the shards per site: every rank of a site holds a shard
    of the same size), and reports what the namespace's loopback carried against the
    least FSDP moves inside the site: an all-gather of the parameters and a
    reduce-scatter of the gradients, each ``(shards - 1) x shard`` bytes per rank.

    Returns:
        ``{"meter_tx", "meter_rx", "shaper_tx", "shaper_rx", "tx_ratio", "rx_ratio",
        "loopback_tx", "intra_site_least", "ok"}`` (bytes per step; ratios and ``ok``
        None where a counter could not be read).
    """
    shards = int(run["shards_per_site"])
    meter_tx = shards * run["wire_sent_per_step"]
    meter_rx = shards * run["bytes_received_per_step"]
    shaper_tx, shaper_rx = run.get("shaper_tx_per_step"), run.get("shaper_rx_per_step")
    loopback = run.get("loopback_tx_per_step")
    shard = run.get("dense_shard_bytes", 0)
    least = shards * 2 * (shards - 1) * shard

    def ratio(charged: float | None, counted: float) -> float | None:
        return None if charged is None or counted <= 0 else charged / counted

    tx_ratio, rx_ratio = ratio(shaper_tx, meter_tx), ratio(shaper_rx, meter_rx)
    low, high = SITE_RATIO_BAND
    ok = (None if tx_ratio is None or rx_ratio is None or loopback is None
          else low <= tx_ratio <= high and low <= rx_ratio <= high and loopback >= least)
    return {"meter_tx": meter_tx, "meter_rx": meter_rx, "shaper_tx": shaper_tx,
            "shaper_rx": shaper_rx, "tx_ratio": tx_ratio, "rx_ratio": rx_ratio,
            "loopback_tx": loopback, "intra_site_least": least, "ok": ok}


def site_check_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every sharded run's :func:`site_traffic` in one place, and whether all passed."""
    checks = {f"{r['rate']}-{r['workers']}w-{r['scheme']}-r{r.get('round', 0)}":
              r["site_traffic"] for r in runs if "site_traffic" in r}
    verdicts = [c["ok"] for c in checks.values()]
    return {"band": list(SITE_RATIO_BAND), "runs": checks,
            "all_ok": bool(verdicts) and all(v is True for v in verdicts),
            "meaning": "per step over each run's timed window: shaper bytes on the site's "
                       "port against the Meter's cross-site bytes of the site's ranks "
                       "(tx_ratio, rx_ratio, inside the band: frames and acknowledgements "
                       "only), and the site namespace's loopback bytes against the least "
                       "FSDP moves inside the site (loopback_tx >= intra_site_least: the "
                       "site's own traffic stayed off the shaper)"}
