"""Workers that fail and join, measured: thinwire on torchft beside torchft's own DiLoCo.

Each run trains ``--workers`` workers on the workload (one process each, one
torchft replica group each, one Lighthouse in this process), a fifth joining
half way (``--join-at``). Under faults, the same run also loses three workers,
each relaunched ``--relaunch-s`` seconds after it died:

* worker 1 kills itself in the middle of its inner steps (``--kill-inner``);
* worker 2 kills itself in the middle of an exchange: after the sync's quorum,
  as its exchange starts (``--kill-exchange``, a sync's step);
* worker 3 is killed from here while the relaunched worker 2 is being healed;

and one stalls: worker 1 (in its second life) is stopped from here (SIGSTOP)
at worker 0's step ``--stop-at`` and continued ``--stop-s`` seconds later.
Each fault's cost is the time from it to each other worker's next committed
sync (per step: step), beside the time between their commits without it.

Runs, side by side in one process tree: thinwire's local updates
(``--local``, default ``diloco+int4``), thinwire's per-step scheme
(``--per-step``), and torchft's DiLoCo (``torchft.local_sgd.DiLoCo``, dense fp32,
the same H, outer Nesterov SGD and inner optimiser as ``--local``), each
without and with the faults. Per run: steps and wall time to the workload's
target (the global weights, evaluated by worker 0 every ``--eval-every``
steps), syncs that did not commit, the quorums in which a worker was healed
and how long each took, and after every sync the hash of the weights every
live worker shares (all equal, or not). Writes ``docs/data/faults-<workload>.json``.

Usage::

    python -m benchmarks.faults --workload text-lm --steps 1600 --eval-every 50
    python -m benchmarks.faults --workload digits-mlp --steps 200 --join-at 100 ...  # a check
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from thinwire import schemes
from thinwire.jobs import local_run, workloads
from thinwire.jobs.compare import parse_options, scheme_config
from thinwire.jobs.dataparallel import RunOptions, step_seconds
from thinwire.jobs.elastic_run import EVENT_FIELDS, weights_hash
from thinwire.jobs.workloads import RECIPES

JOINER = 4  # the worker that joins half way (with 4 workers: the fifth)
STALLED = 1  # the worker stopped for a while (its second life)
POLL_S = 0.05
GRACE_S = 60.0  # after worker 0 ends, how long the others get to end too
TIMEOUT_S = 60.0  # the longest a collective, vote or state transfer waits on a peer


@dataclass(frozen=True)
class Schedule:
    faults: bool  # False: the same run without the kills (the joiner still joins)
    join_at: int  # worker 0's step at which the fifth worker starts
    kill_inner: int  # worker 1 kills itself after this inner step (not a sync step)
    kill_exchange: int  # worker 2 kills itself in the exchange of the sync at this step
    relaunch_s: float  # a killed worker is relaunched this long after it died
    stop_at: int  # worker 0's step at which worker 1 is stopped (SIGSTOP)
    stop_s: float  # and continued (SIGCONT) this long after


@dataclass(frozen=True)
class Spec:
    side: str  # "thinwire" or "torchft"
    scheme: str  # thinwire's scheme (diloco+SCHEME: local updates), or "diloco" for torchft
    config: dict[str, Any]
    options: RunOptions
    replica: int
    lighthouse: str
    folder: str
    kill_inner: int | None  # this life kills itself after this inner step
    kill_exchange: int | None  # this life kills itself in this sync's exchange
    min_workers: int


def _signal(folder: str, name: str) -> None:
    Path(folder, name).touch()


def _appender(folder: str, replica: int) -> Any:
    """Append one JSON line per event to the worker's log (a killed life keeps its lines)."""
    path = Path(folder, f"events-{replica}.jsonl")

    def append(event: dict[str, Any]) -> None:
        with path.open("a") as handle:
            handle.write(json.dumps(event) + "\n")

    return append


def _thinwire_worker(spec: Spec) -> None:
    os.environ["RUST_LOG"] = "error"
    torch.set_num_threads(1)
    from thinwire import elastic
    from thinwire.elastic.local import ElasticLocalUpdates
    from thinwire.jobs.elastic_run import run_elastic

    append = _appender(spec.folder, spec.replica)
    clock = {"step": 0}
    if spec.kill_exchange is not None:  # after the quorum (and roll call), as it starts to send
        from thinwire.elastic import ddp as elastic_ddp

        kill_at, exchange, hook = (spec.kill_exchange, ElasticLocalUpdates._exchange,
                                   elastic_ddp.comm_hook)

        def killing_exchange(self: Any, *args: Any) -> Any:
            if self.updates.steps == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return exchange(self, *args)

        def killing_hook(*args: Any) -> Any:
            if clock["step"] + 1 == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return hook(*args)

        ElasticLocalUpdates._exchange = killing_exchange  # type: ignore[method-assign]
        elastic_ddp.comm_hook = killing_hook  # type: ignore[assignment]
    def connect() -> Any:
        manager = elastic.connect(spec.lighthouse, min_workers=spec.min_workers,
                                  replica_id=f"worker{spec.replica}", timeout_s=TIMEOUT_S,
                                  quorum_timeout_s=900)
        # called when torchft loads a peer's state here: a heal under way
        manager.register_state_dict_fn(
            "probe", lambda _: _signal(spec.folder, f"healing-{spec.replica}"), lambda: None)
        return manager

    healed = {"heals": 0.0, "heal_s": 0.0}

    def on_step(step: int, event: tuple[Any, ...] | None, record: dict[str, float]) -> None:
        clock["step"] = step
        if record["heals"] > healed["heals"]:  # a heal in this step's quorum
            append({"replica": spec.replica, "heal": step, "time": time.time(),
                    "seconds": record["heal_s"] - healed["heal_s"]})
            healed.update(heals=record["heals"], heal_s=record["heal_s"])
        if spec.replica == 0:
            Path(spec.folder, "clock").write_text(str(step))
        if event is not None:
            append({"replica": spec.replica, **dict(zip(EVENT_FIELDS, event))})
        if spec.kill_inner is not None and step == spec.kill_inner:
            os.kill(os.getpid(), signal.SIGKILL)

    started = time.time()
    result = run_elastic(spec.scheme, spec.config, spec.options, connect, spec.replica,
                         on_step=on_step)
    append({"replica": spec.replica, "done": True, "started": started,
            "record": result["record"], "bytes_sent_per_step": result["bytes_sent_per_step"]})


def _torchft_worker(spec: Spec) -> None:
    os.environ["RUST_LOG"] = "error"
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from thinwire.data.digits import batches

    append = _appender(spec.folder, spec.replica)
    options, local = spec.options, spec.config
    work = workloads.load(options.workload, seed=options.seed)
    model = work.model(options.seed)
    probe = work.model(options.seed)
    inner = workloads.optimizer(options.optimizer, model.parameters(), options.lr,
                                options.momentum, options.weight_decay)
    outer = torch.optim.SGD(model.parameters(), lr=local["outer_lr"],
                            momentum=local["outer_momentum"], nesterov=True)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    manager = Manager(
        pg=ProcessGroupGloo(timeout=_seconds(TIMEOUT_S)), min_replica_size=spec.min_workers,
        use_async_quorum=False, load_state_dict=model.load_state_dict,
        state_dict=model.state_dict, replica_id=f"worker{spec.replica}",
        store_addr="localhost", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=spec.lighthouse, timeout=_seconds(TIMEOUT_S),
        quorum_timeout=_seconds(900), connect_timeout=_seconds(TIMEOUT_S),
        init_sync=False)  # one seed: the replicas start alike
    steps = 0  # inner steps this worker took

    def healing(_: Any) -> None:  # torchft loads a peer's state here: a heal
        _signal(spec.folder, f"healing-{spec.replica}")
        append({"replica": spec.replica, "heal": steps, "time": time.time(), "seconds": None})

    manager.register_state_dict_fn("probe", healing, lambda: None)
    if spec.kill_exchange is not None:
        allreduce, kill_at = manager.allreduce, spec.kill_exchange

        def killing(*args: Any, **kwargs: Any) -> Any:
            if steps == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return allreduce(*args, **kwargs)

        manager.allreduce = killing  # type: ignore[method-assign]
    stream = batches(work.train, options.batch_size, seed=options.seed * 1000 + spec.replica)
    every = local["every"]
    started = time.time()
    with DiLoCo(manager, [model], inner, outer, sync_every=every):
        while manager.current_step() < options.steps // every:
            batch = work.train.rows(next(stream))
            loss = work.loss(model(batch.inputs, **batch.side), batch.targets)
            inner.zero_grad()
            loss.backward()
            syncs = manager.current_step()
            steps += 1
            inner.step()  # torchft's hook counts the step and syncs every H
            if spec.replica == 0:
                Path(spec.folder, "clock").write_text(str(steps))
            if steps % every == 0:  # a sync: committed where torchft's step moved on
                committed = manager.current_step() > syncs
                score = None
                if committed and spec.replica == 0 and (steps % options.eval_every == 0
                                                        or steps >= options.steps):
                    probe.load_state_dict(model.state_dict())
                    score = work.score(probe, options.eval_rows)
                append({"replica": spec.replica, "step": steps, "sync": manager.current_step(),
                        "time": time.time(), "workers": manager.num_participants(),
                        "committed": committed, "score": score,
                        "weights_hash": weights_hash(list(model.parameters()))})
            if spec.kill_inner is not None and steps == spec.kill_inner:
                os.kill(os.getpid(), signal.SIGKILL)
    append({"replica": spec.replica, "done": True, "started": started,
            "record": {"commits": manager.current_step()},
            "bytes_sent_per_step": sum(p.numel() * p.element_size()
                                       for p in model.parameters()) / every})
    manager.shutdown(wait=False)


def _life(spec: Spec) -> None:
    """One life of a worker. Its events written and its group ended, it leaves without the
    interpreter's shutdown, where gloo's threads can still abort it (as
    :func:`thinwire.launch.spawn`'s ranks do): an abort would read as a death here."""
    from thinwire.launch import end_process_group

    (_thinwire_worker if spec.side == "thinwire" else _torchft_worker)(spec)
    end_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _seconds(value: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=value)


def run(side: str, scheme: str, config: dict[str, Any], options: RunOptions, workers: int,
        schedule: Schedule, min_workers: int, deadline_s: float,
        target: tuple[float, bool]) -> dict[str, Any]:
    """One run under ``schedule``; returns its events and what they show."""
    from thinwire.elastic import start_lighthouse

    context = mp.get_context("spawn")
    lighthouse = start_lighthouse("[::]:0", min_workers=min_workers)
    processes: dict[int, Any] = {}
    lives: dict[int, int] = {}
    kills: list[dict[str, Any]] = []
    stop: dict[str, Any] = {}  # worker 1's stall: when it was stopped and continued
    relaunch: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="faults-") as folder:
        def launch(replica: int) -> None:
            first = replica not in lives
            lives[replica] = lives.get(replica, 0) + 1
            spec = Spec(side, scheme, config, options, replica, lighthouse.address(), folder,
                        schedule.kill_inner if schedule.faults and first and replica == 1
                        else None,
                        schedule.kill_exchange if schedule.faults and first and replica == 2
                        else None, min_workers)
            processes[replica] = context.Process(target=_life, args=(spec,))
            processes[replica].start()

        start = time.time()
        try:
            for replica in range(workers):
                launch(replica)
            killed_while_healing, finished, step = False, 0.0, 0
            while True:
                now = time.time()
                if now - start > deadline_s:
                    raise TimeoutError(f"{side} {scheme}: not done within {deadline_s} s")
                clock = Path(folder, "clock")
                if clock.exists():  # empty while worker 0 rewrites it: keep the last step
                    step = int(clock.read_text() or step)
                if JOINER not in lives and step >= schedule.join_at:
                    launch(JOINER)
                for replica, process in processes.items():
                    if process.exitcode not in (None, 0) and replica not in relaunch:
                        kills.append({"replica": replica, "died": now, "step": step,
                                      "exitcode": process.exitcode})
                        relaunch[replica] = now + schedule.relaunch_s
                for replica, due in list(relaunch.items()):
                    if due <= now and processes[replica].exitcode not in (None, 0):
                        del relaunch[replica]
                        next(k for k in kills if k["replica"] == replica
                             and "relaunched" not in k)["relaunched"] = now
                        Path(folder, f"healing-{replica}").unlink(missing_ok=True)
                        launch(replica)
                if schedule.faults and not stop and step >= schedule.stop_at:
                    if processes[STALLED].is_alive():
                        os.kill(processes[STALLED].pid, signal.SIGSTOP)
                        stop.update(replica=STALLED, stopped=now, step=step)
                if stop and "continued" not in stop and now - stop["stopped"] >= schedule.stop_s:
                    os.kill(processes[STALLED].pid, signal.SIGCONT)
                    stop["continued"] = now
                if (schedule.faults and not killed_while_healing and lives.get(2, 0) > 1
                        and Path(folder, "healing-2").exists()):
                    killed_while_healing = True  # worker 3, while worker 2 heals
                    if processes[3].is_alive():
                        processes[3].kill()
                if processes[0].exitcode == 0:  # worker 0 is done: the others end with it
                    finished = finished or now
                    if all(p.exitcode == 0 for p in processes.values()) or (
                            now - finished > GRACE_S):
                        break
                time.sleep(POLL_S)
        finally:
            stragglers = [replica for replica, process in processes.items()
                          if process.is_alive()]  # waiting for a quorum that never comes
            for replica in stragglers:
                os.kill(processes[replica].pid, signal.SIGCONT)  # a stopped one, too
                processes[replica].kill()
            lighthouse.shutdown()
        lines = []
        for path in Path(folder).glob("events-*.jsonl"):
            lines += [json.loads(line) for line in path.read_text().splitlines()]
    return {**summarise(side, scheme, lines, kills, start, target, stop),
            "stragglers": stragglers}


def summarise(side: str, scheme: str, lines: list[dict[str, Any]], kills: list[dict[str, Any]],
              start: float, target: tuple[float, bool],
              stop: dict[str, Any] | None = None) -> dict[str, Any]:
    """Steps and seconds to ``target`` (value, lower is better), syncs lost, heals, the
    weights' agreement after each sync (keyed by torchft's sync count, or thinwire's step)
    and what each fault cost the others (:func:`fault_costs`). Seconds count from worker 0's
    first sync (all the workers' start-up is behind it)."""
    events = sorted((e for e in lines if "step" in e), key=lambda e: e["time"])
    done = [e for e in lines if e.get("done")]
    start = min((e["time"] for e in events if e["replica"] == 0), default=start)  # 1st sync
    work_target, lower = target
    scored = [e for e in events if e["score"] is not None]
    reached = next((e for e in scored if (e["score"] <= work_target if lower
                                          else e["score"] >= work_target)), None)
    hashes: dict[int, set[str]] = {}
    for event in events:
        if event["committed"]:
            hashes.setdefault(event.get("sync", event["step"]), set()).add(event["weights_hash"])
    unequal = sorted(sync for sync, seen in hashes.items() if len(seen) > 1)
    first = [e for e in events if e["replica"] == 0]
    heals = [{"replica": e["replica"], "step": e["heal"], "after_s": e["time"] - start,
              "seconds": e["seconds"]} for e in lines
             if "heal" in e and e["time"] > start]  # the start's are before the first sync
    return {
        "side": side, "scheme": scheme, "kills": [{**k, "died": k["died"] - start,
                                                   "relaunched": k.get("relaunched", start)
                                                   - start} for k in kills],
        "steps_to_target": reached["step"] if reached else None,
        "seconds_to_target": reached["time"] - start if reached else None,
        "final_score": scored[-1]["score"] if scored else None,
        "wall_s": max(e["time"] for e in events) - start if events else None,
        "syncs": len(first), "syncs_failed": sum(not e["committed"] for e in first),
        "heals": heals,
        "syncs_checked": len(hashes), "weights_equal_after_every_sync": not unequal,
        "syncs_unequal": unequal,
        "workers_per_sync": [(e["step"], e["workers"]) for e in first],
        "curve": [(e["step"], e["time"] - start, e["score"]) for e in scored],
        "bytes_sent_per_step": next((e["bytes_sent_per_step"] for e in done
                                     if e["replica"] == 0), None),
        "stop": {key: value - start if key in ("stopped", "continued") else value
                 for key, value in (stop or {}).items()},
        "fault_costs": fault_costs(events, kills, stop or {}),
        "commit_gap_s": _commit_gap(events),
    }


def fault_costs(events: list[dict[str, Any]], kills: list[dict[str, Any]],
                stop: dict[str, Any]) -> list[dict[str, Any]]:
    """Per fault (each kill, the stall), each other worker's wait from the fault to its first
    committed sync or step without the lost worker (fewer workers than its last before the
    fault): what the fault cost it, its own step or sync time included. A commit the lost
    worker had already taken part in does not end the wait."""
    faults = [("SIGKILL", kill["replica"], kill["died"], kill["step"]) for kill in kills]
    if stop:
        faults.append(("SIGSTOP", stop["replica"], stop["stopped"], stop["step"]))
    costs = []
    for kind, replica, at, step in sorted(faults, key=lambda fault: fault[2]):
        waits = {}
        for other in sorted({e["replica"] for e in events} - {replica}):
            before = [e for e in events if e["replica"] == other and e["time"] <= at]
            if not before:  # not training then
                continue
            after = next((e["time"] for e in events if e["replica"] == other
                          and e["committed"] and e["time"] > at
                          and e["workers"] < before[-1]["workers"]), None)
            if after is not None:
                waits[other] = after - at
        costs.append({"fault": kind, "replica": replica, "step": step, "waits_s": waits})
    return costs


def _commit_gap(events: list[dict[str, Any]]) -> float | None:
    """Worker 0's median time between two committed syncs or steps: a fault's cost without
    the fault."""
    times = [e["time"] for e in events if e["replica"] == 0 and e["committed"]]
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    return gaps[len(gaps) // 2] if gaps else None


def _rounded(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.0f}" if seconds >= 10 else f"{seconds:.1f}"


def section(record: dict[str, Any], docs: Path) -> str:
    """The results page's part for one workload (under "Workers that fail and join"): each run
    against the same run without faults, with the lone worker and the compute-only bound
    beside them."""
    machine, schedule = record["machine"], record["schedule"]
    compute_ms = record["compute_ms_per_step"]
    source = f"docs/data/faults-{record['workload']}.json"
    lines = [f"### {record['workload']}", "",
             f"`{record['command']}` ({machine['when']}, {machine['cpus']} cores, 1-minute load "
             f"{machine['load_before'][0]:.1f} before and {machine['load_after'][0]:.1f} after: "
             "the machine was shared, so seconds are slow and noisy, steps are not; data: "
             f"`{source}`). {record['workers']} workers on {record['workload']} "
             f"({record['metric']}, target {record['target']:g}), one process each on torchft "
             f"(one Lighthouse, at least {record['min_workers']} workers to commit), a fifth "
             f"joining at worker 0's step {schedule['join_at']}. With faults, worker 1 kills "
             f"itself after inner step {schedule['kill_inner']}, worker 2 in the exchange of "
             f"the sync at step {schedule['kill_exchange']}, and worker 3 is killed while the "
             "relaunched worker 2 is healed; each is relaunched "
             f"{schedule['relaunch_s']:g} s after it died."
             + (f" Worker 1 is stopped (SIGSTOP) at worker 0's step {schedule['stop_at']} and "
                f"continued {schedule['stop_s']:g} s later." if "stop_at" in schedule else "")
             + " Seconds count from worker 0's first "
             "sync; the global weights are evaluated by worker 0 every "
             f"{record['eval_every']} steps.", "",
             "| run | faults | steps to target | s to target | x fault-free | s to the end "
             "| x fault-free | syncs failed | heals (s each) | weights equal after every sync "
             "| bytes/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    clean = {run["label"]: run for run in record["runs"] if not run["faults"]}

    def ratio(run: dict[str, Any], key: str) -> str:
        base = clean.get(run["label"])
        return (f"{run[key] / base[key]:.2f}" if run["faults"] and run[key] and base
                and base[key] else "-")

    for run in record["runs"]:
        seconds = run["seconds_to_target"]
        steps = "not reached" if run["steps_to_target"] is None else run["steps_to_target"]
        heals = ", ".join("?" if h["seconds"] is None else f"{h['seconds']:.1f}"
                          for h in run["heals"]) or "-"
        equal = "yes" if run["weights_equal_after_every_sync"] else "NO"
        lines.append(f"| {run['label']} `{run['scheme']}` | {'yes' if run['faults'] else 'no'} "
                     f"| {steps} | {_rounded(seconds)} | {ratio(run, 'seconds_to_target')} "
                     f"| {_rounded(run['wall_s'])} | {ratio(run, 'wall_s')} "
                     f"| {run['syncs_failed']} of {run['syncs']} | {heals} "
                     f"| {equal} ({run['syncs_checked']}) "
                     f"| {run['bytes_sent_per_step'] or 0:,.0f} |")
    lines += _cost_table(record)
    efficiency = docs / "data" / f"efficiency-{record['workload']}.json"
    if efficiency.exists():
        steps = json.loads(efficiency.read_text())["steps_to_target"]
        for label, workers in (("lone worker", "1"),
                               (f"compute-only bound ({record['workers']} workers)",
                                str(record["workers"]))):
            if workers in steps:
                lines.append(f"| {label} | no | {steps[workers]:.0f} | "
                             f"{_rounded(steps[workers] * compute_ms / 1000)} (modelled) | - "
                             "| - | - | - | - | - | - |")
        lines += ["", f"Lone worker and bound: steps from `docs/data/{efficiency.name}`, "
                  f"seconds at this run's compute step of {compute_ms:.0f} ms (one thread, "
                  "measured before the runs, under the same load)."]
    lines += ["", "*syncs failed*: syncs (per step: steps) of worker 0 that did not commit; "
              "*heals*: each quorum in which a joining, relaunched or lagging worker took a live "
              "peer's state, with its wait from its quorum request (torchft's: not timed, ?); "
              "a worker lost or stalled in an exchange, or within a quorum (while the others "
              "heal from it or form its group), can cost torchft's DiLoCo workers the group's "
              f"timeout ({TIMEOUT_S:g} s) or more; thinwire's workers cut a silent peer off "
              "after the heartbeat timeout (5 s) where it stalls in an exchange; "
              "*s to the end*: to worker 0's last step; *weights equal*: every "
              "committed sync's weight hashes agreed across the live workers (syncs compared). "
              "torchft's DiLoCo exchanges dense fp32 and resets every replica to the last "
              "global weights when a sync fails; thinwire keeps each replica's inner steps."]
    return "\n".join(lines) + "\n"


def _cost_table(record: dict[str, Any]) -> list[str]:
    """What each fault cost the other workers, per run with faults (files that hold it)."""
    rows = [(run, cost) for run in record["runs"] for cost in run.get("fault_costs", ())]
    if not rows:
        return []
    lines = ["", "What each fault cost the others: from the fault to each other worker's first "
             "committed sync (per step: step) without the lost worker, against the time "
             "between two of worker 0's commits without faults. A stalled worker was stopped for "
             f"{record['schedule'].get('stop_s', 0):g} s.", "",
             "| run | fault | worker | worker 0's step | others' wait, s (median, max) "
             "| usual gap, s |", "|---|---|---|---|---|---|"]
    for run, cost in rows:
        waits = sorted(cost["waits_s"].values())
        wait = (f"{_rounded(waits[len(waits) // 2])}, {_rounded(waits[-1])}" if waits
                else "-")
        lines.append(f"| {run['label']} `{run['scheme']}` | {cost['fault']} | {cost['replica']} "
                     f"| {cost['step']} | {wait} | {_rounded(run.get('commit_gap_s'))} |")
    return lines


def _added_to(earlier: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """``earlier``'s runs and machine, ``record``'s command after its own, for more runs."""
    same = ("workload", "workers", "min_workers", "steps", "eval_every", "schedule", "local",
            "per_step")
    differ = [key for key in same if earlier[key] != record[key]]
    if differ:
        raise ValueError(f"--add-to: the file's {differ} differ from this run's")
    return {**earlier, "command": f"{earlier['command']}; then {record['command']}",
            "machine": {**earlier["machine"], "load_after": record["machine"]["load_before"]}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="text-lm")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--min-workers", type=int, default=3,
                        help="more than half the workers, so that those that join or are "
                             "relaunched cannot form a quorum of their own")
    parser.add_argument("--steps", type=int, default=1600)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--local", default="diloco+int4")
    parser.add_argument("--per-step", default="powersgd")
    parser.add_argument("--option", action="append", default=["every=10", "outer_lr=0.4"],
                        help="KEY=VALUE for --local (and torchft's DiLoCo: every, outer_lr)")
    parser.add_argument("--per-step-option", action="append", default=["rank=8"])
    parser.add_argument("--join-at", type=int, default=None,
                        help="worker 0's step when the fifth worker starts (default: half way)")
    parser.add_argument("--kill-inner", type=int, default=None)
    parser.add_argument("--kill-exchange", type=int, default=None)
    parser.add_argument("--relaunch-s", type=float, default=5.0)
    parser.add_argument("--stop-at", type=int, default=None,
                        help="worker 0's step at which worker 1 is stopped (default: between "
                             "its kill and the join)")
    parser.add_argument("--stop-s", type=float, default=20.0,
                        help="how long worker 1 stays stopped")
    parser.add_argument("--sides", default="thinwire-local,torchft,thinwire-per-step")
    parser.add_argument("--deadline-s", type=float, default=7200.0)
    parser.add_argument("--out", type=Path, default=Path("docs/data"))
    parser.add_argument("--add-to", type=Path, default=None,
                        help="a data file of this benchmark with the same workload, workers, "
                             "steps and schedule: its runs, then these (more sides, later)")
    args = parser.parse_args(argv)
    os.environ.setdefault("RUST_LOG", "error")  # torchft's own logging, read at its import
    recipe = RECIPES[args.workload]
    work = workloads.load(args.workload, seed=0)
    options = RunOptions(workload=args.workload, optimizer=recipe["optimizer"],
                         momentum=recipe["momentum"], lr=recipe["lr"],
                         batch_size=recipe["batch_size"], steps=args.steps,
                         eval_every=args.eval_every, eval_rows=None)
    parse_options(args.option, [args.local])
    local_config = scheme_config(args.local, 0.01, 1000, args.option)
    local_run.validate(args.local, local_config)
    local, inner_config = local_run.parts(args.local, local_config)
    local = local.resolved(schemes.build(local_run.inner_scheme(args.local), **inner_config))
    assert local.every is not None  # resolved fills it
    per_step_config = scheme_config(args.per_step, 0.01, 1000, args.per_step_option)
    every = local.every
    join_at = args.join_at or args.steps // 2 // every * every
    kill_inner = args.kill_inner or join_at // 2 + every // 2
    schedule = Schedule(True, join_at, kill_inner,
                        args.kill_exchange or (join_at * 3 // 2) // every * every,
                        args.relaunch_s, args.stop_at or (kill_inner + join_at) // 2,
                        args.stop_s)
    sides = {"thinwire-local": ("thinwire", args.local, local_config),
             "torchft": ("torchft", "diloco", asdict(local)),
             "thinwire-per-step": ("thinwire", args.per_step, per_step_config)}
    compute_ms = 1000 * step_seconds(work.model(0), work, work.train, recipe["batch_size"])
    record: dict[str, Any] = {
        "workload": args.workload, "workers": args.workers, "joiner": JOINER,
        "min_workers": args.min_workers, "steps": args.steps, "eval_every": args.eval_every,
        "target": work.target, "metric": work.metric, "lower_is_better": work.lower_is_better,
        "recipe": recipe, "local": {"scheme": args.local, "config": local_config},
        "per_step": {"scheme": args.per_step, "config": per_step_config},
        "schedule": asdict(schedule), "compute_ms_per_step": compute_ms,
        "command": " ".join(["python -m benchmarks.faults",
                             *(sys.argv[1:] if argv is None else argv)]),
        "machine": {"cpus": os.cpu_count(), "load_before": os.getloadavg(),
                    "when": time.strftime("%Y-%m-%d %H:%M %Z")},
        "runs": [],
    }
    if args.add_to is not None:
        record = _added_to(json.loads(args.add_to.read_text()), record)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"faults-{args.workload}.json"
    for label in args.sides.split(","):
        side, scheme, config = sides[label]
        for faults in (False, True):
            begun = time.time()
            result = run(side, scheme, config, options, args.workers,
                         dataclasses.replace(schedule, faults=faults), args.min_workers,
                         args.deadline_s, (work.target, work.lower_is_better))
            result.update(label=label, faults=faults, load=os.getloadavg(),
                          elapsed_s=time.time() - begun)
            record["runs"].append(result)
            record["machine"]["load_after"] = os.getloadavg()
            path.write_text(json.dumps(record, indent=1, default=str))  # each run as it ends
            print(json.dumps({k: v for k, v in result.items()
                              if k not in ("curve", "workers_per_sync")}, default=str),
                  flush=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
