"""torchft's DiLoCo beside thinwire's ``diloco``: same workload, shards, batches and optimisers.

torchft 0.2.0 runs on CPU/gloo here: a ``LighthouseServer`` in this process,
and per worker one replica group of one process with its own ``TCPStore``,
``Manager`` (synchronous quorum) and ``ProcessGroupGloo``, wrapped around the
workload's model by ``torchft.local_sgd.DiLoCo`` (outer Nesterov SGD lr 0.7,
momentum 0.9, sync every H). thinwire's ``diloco`` runs the same recipe
through ``thinwire compare``'s job. Both evaluate the global weights at each
sync; torchft's bytes are its fp32 all-reduce of every parameter per sync (it
meters nothing), thinwire's are metered. Writes
``docs/data/local-updates-torchft.json``.

Usage::

    python -m benchmarks.torchft_diloco --workload digits-mlp --every 25 --steps 300
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from thinwire.data.digits import batches
from thinwire.jobs import workloads
from thinwire.jobs.compare import compare
from thinwire.jobs.dataparallel import RunOptions
from thinwire.jobs.workloads import RECIPES


def _worker(replica: int, workers: int, lighthouse: str, workload: str, every: int,
            steps: int, out: str) -> None:
    import torch.distributed as dist
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    torch.set_num_threads(1)
    recipe = RECIPES[workload]
    work = workloads.load(workload, seed=0)
    shard = work.train.shard(replica, workers)
    model = work.model(0)
    inner = workloads.optimizer(recipe["optimizer"], model.parameters(), recipe["lr"],
                                recipe["momentum"])
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=120)), min_replica_size=workers,
        use_async_quorum=False, load_state_dict=model.load_state_dict,
        state_dict=model.state_dict, replica_id=str(replica), store_addr="localhost",
        store_port=store.port, rank=0, world_size=1, lighthouse_addr=lighthouse,
        port=19700 + replica, timeout=timedelta(seconds=120),
        quorum_timeout=timedelta(seconds=120), connect_timeout=timedelta(seconds=60),
        init_sync=False)  # the replicas start alike (one seed); True heals all but one at step 0
    stream = batches(shard, recipe["batch_size"], seed=replica)  # thinwire's seed*1000+rank
    curve = []
    start = time.perf_counter()
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=every):
            for step in range(1, steps + 1):
                batch = shard.rows(next(stream))
                loss = work.loss(model(batch.inputs, **batch.side), batch.targets)
                inner.zero_grad()
                loss.backward()
                inner.step()  # torchft's hook counts the step and syncs every H
                if step % every == 0:
                    curve.append((step, work.accuracy(model, 2000)))
        wall = time.perf_counter() - start
    finally:
        manager.shutdown(wait=False)
    torch.save({"curve": curve, "wall_s": wall,
                "weights": [p.detach().clone() for p in model.parameters()],
                "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())},
               os.path.join(out, f"{replica}.pt"))


def run_torchft(workload: str, workers: int, every: int, steps: int) -> dict[str, Any]:
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=workers)
    try:
        with tempfile.TemporaryDirectory() as out:
            context = mp.get_context("spawn")
            processes = [context.Process(target=_worker, args=(r, workers, lighthouse.address(),
                                                               workload, every, steps, out))
                         for r in range(workers)]
            for process in processes:
                process.start()
            for process in processes:
                process.join(timeout=1800)
            codes = [process.exitcode for process in processes]
            if any(code != 0 for code in codes):
                raise RuntimeError(f"torchft workers exited with {codes}")
            ranks = [torch.load(os.path.join(out, f"{r}.pt")) for r in range(workers)]
    finally:
        lighthouse.shutdown()
    identical = all(all(torch.equal(a, b) for a, b in zip(ranks[0]["weights"], r["weights"]))
                    for r in ranks[1:])
    syncs = steps // every
    return {"curve": ranks[0]["curve"], "wall_s": max(r["wall_s"] for r in ranks),
            "replicas_identical": identical, "syncs": syncs,
            "allreduce_bytes_per_sync": ranks[0]["param_bytes"],
            "handed_bytes_per_step": ranks[0]["param_bytes"] * syncs / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="digits-mlp")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("docs/data"))
    args = parser.parse_args()
    torchft = run_torchft(args.workload, args.workers, args.every, args.steps)
    recipe = RECIPES[args.workload]
    options = RunOptions(workload=args.workload, optimizer=recipe["optimizer"],
                         momentum=recipe["momentum"], lr=recipe["lr"],
                         batch_size=recipe["batch_size"], steps=args.steps,
                         eval_every=args.every)
    ours = compare(["diloco"], args.workers, options, 10e6, extra=[f"every={args.every}"],
                   timeout_s=600)[0]
    target = ours["target"]
    record = {
        "workload": args.workload, "workers": args.workers, "every": args.every,
        "steps": args.steps, "target": target,
        "torchft": {**torchft, "steps_to_target": next(
            (s for s, a in torchft["curve"] if a >= target), None)},
        "thinwire": {"curve": [(s, a) for s, _, a in ours["curve"]], "wall_s": ours["wall_s"],
                     "replicas_identical": ours["replicas_identical"],
                     "handed_bytes_per_step": ours["bytes_sent_per_step"],
                     "steps_to_target": ours["steps_to_target"],
                     "syncs": ours["local"]["syncs"]},
        "machine": {"load_average": os.getloadavg(), "cpus": os.cpu_count()},
        "note": "same initial weights, shards, batches, inner and outer optimisers",
    }
    path = args.out / "local-updates-torchft.json"
    path.write_text(json.dumps(record, indent=1, default=str))
    print(json.dumps({k: v for k, v in record.items() if k not in ("torchft", "thinwire")}))
    for side in ("torchft", "thinwire"):
        print(side, record[side]["curve"], record[side]["steps_to_target"],
              f"{record[side]['wall_s']:.1f} s", record[side]["handed_bytes_per_step"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
