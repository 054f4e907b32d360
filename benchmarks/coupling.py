"""Which optimiser coupling makes 99 %-sparse error feedback converge like dense?

n data-parallel workers are simulated in one process: each computes its
gradient on its own shard, compresses it with its own compressor and
error-feedback memory (the library's), and the optimiser steps on the mean
of what was sent -- what the DDP hook computes, without processes, so a
sweep over candidates and seeds fits a busy machine. Candidates:

* ``plain``: the optimiser's momentum after the all-reduce (the user's code unchanged);
* ``coupled``: momentum correction, :class:`thinwire.feedback.MomentumCorrection`
  (what ``thinwire.optim.couple`` installs; DGC §3.2);
* ``masked``: coupled plus DGC's factor masking (velocity zeroed where sent);
* ``warmup``: coupled with DGC's exponential sparsity warm-up (density 25 %,
  6.25 %, 1.6 %, then 1 % over the first ``--warmup`` steps; its bytes count);
* ``ef21``: momentum correction in front of EF21 (:class:`thinwire.feedback.Estimate`):
  the optimiser steps with a dense estimate of the mean velocity that the
  sent entries refresh (what ``couple`` installs for clt-k);
* ``virtual``: coupled, and each worker takes its gradient at ``x - lr * e``, its
  weights with its pending error applied (:class:`thinwire.optim.virtual.VirtualIterate`,
  what ``couple`` installs for SGD through a DDP hook);
* ``adam-virtual`` (AdamW): coupled, with the burst-aware Adam step
  (:class:`thinwire.optim.adam.AgedAdam`) and each worker's gradient at
  ``x - lr e / (sqrt(s_hat) + eps)`` (:func:`thinwire.optim.adam.look_ahead`),
  what ``couple`` installs for Adam/AdamW through a DDP hook;
* ``adam-local`` (AdamW): each worker runs both of Adam's moments on its own
  gradient and sends the normalised direction.

topk and dct-dp are the registered schemes' sparsifiers at their defaults:
``--scopes bucket`` (the default) selects once over all the sparsified tensors
of a worker (for clt-k: the leader's, over its sparsified tensors), as ``scope="bucket"``
does on a DDP bucket; ``layer`` per tensor.
The digits MLP has a recipe per optimiser; ``--workload`` runs another
workload under its own recipe. Tensors under
``--min-numels`` entries (default 1024, the schemes' own default; a list sweeps) travel
dense for topk, dct-dp and clt-k, as do parameters named by ``--exclude`` patterns.
Bytes are counted as the schemes' payload layouts count them
(:meth:`~thinwire.schemes.Scheme.payload_bytes`: values, 16-bit indices, headers, room).

Usage: ``python -m benchmarks.coupling [--workload digits-mlp] [--seeds 8] [--workers 4]
[--scopes layer,bucket] [--out docs/data/coupling.json]``
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from thinwire import schemes
from thinwire.compress import Sparsifier, TensorInfo
from thinwire.compress.cltk import layer_k, select, sparsify
from thinwire.compress.grouping import split_ascending
from thinwire.compress.sparse import MIN_NUMEL, SCOPES
from thinwire.data.digits import batches
from thinwire.feedback import Estimate, LowPass, Memory, MomentumCorrection, Residual
from thinwire.jobs import workloads
from thinwire.optim.adam import AgedAdam, look_ahead

RECIPES = {  # optimiser -> (lr, momentum) a user starts from on the digits MLP
    "sgd": (0.05, 0.9),
    "nesterov": (0.05, 0.9),
    "adamw": (1e-3, 0.9),
}


def simulate(scheme: str, variant: str, optimizer_name: str, seed: int, workers: int,
             steps: int, warmup: int, eval_every: int = 10,
             selection: str = "exact", min_numel: int = MIN_NUMEL,
             targets: Sequence[float] = (),
             scope: str = "layer", workload: str = "digits-mlp",
             exclude: tuple[str, ...] = (),
             ) -> tuple[dict[float, int | None], float]:
    """Steps until ``workload`` first reaches each test metric of ``targets`` and its own
    target (None: not in ``steps``), and dense's bytes over the bytes each worker sent, up
    to the last of them."""
    work = workloads.load(workload, seed=seed)
    wanted = sorted({*targets, work.target})
    reached: dict[float, int | None] = dict.fromkeys(wanted)
    shards = [work.train.shard(r, workers) for r in range(workers)]
    lr, momentum, batch_size = recipe(workload, optimizer_name)
    streams = [batches(s, batch_size, seed * 1000 + r) for r, s in enumerate(shards)]
    model = work.model(seed)
    params = dict(model.named_parameters())
    optimizer = workloads.optimizer(optimizer_name, model.parameters(), lr, momentum)
    coupled = variant not in ("plain", "adam-local") and scheme != "dense"
    memories: list[Memory] = [Estimate() if variant == "ef21" else
                              LowPass(1.0) if scheme == "clt-k" else Residual()
                              for _ in range(workers)]
    if coupled:
        adam = optimizer_name == "adamw"
        beta2 = optimizer.param_groups[0]["betas"][1] if variant == "adam-virtual" else None
        memories = [MomentumCorrection(m, momentum, 1 - momentum if adam else 0.0,
                                       optimizer_name == "nesterov", beta2) for m in memories]
        for group in optimizer.param_groups:
            if adam:
                group["betas"] = (0.0, group["betas"][1])
            else:
                group.update(momentum=0.0, nesterov=False)
    local = [LocalAdam(optimizer) for _ in range(workers)] if variant == "adam-local" else []
    if variant == "adam-virtual":  # one step for all ranks: worker 0's memory keeps it
        AgedAdam(optimizer, {id(p): key for key, p in params.items()},
                 memories[0])  # type: ignore[arg-type]
    compressors = [_compressor(scheme, min_numel, scope, exclude) for _ in range(workers)]
    infos = [TensorInfo.of(key, param.reshape(-1)) for key, param in params.items()]
    sparse = [info for info in infos if not compressors[0].is_dense(info)]
    sent_bytes = dense_bytes = 0
    for step in range(steps):
        grads = []
        for r in range(workers):
            batch = shards[r].rows(next(streams[r]))
            model.zero_grad()
            kept = (_move_to_virtual(params, memories[r], lr, optimizer)
                    if variant in ("virtual", "adam-virtual") else {})
            work.loss(model(batch.inputs, **batch.side), batch.targets).backward()
            with torch.no_grad():
                for key, x in kept.items():
                    params[key].copy_(x)
            grads.append({k: p.grad.detach().clone() for k, p in params.items()})  # type: ignore[union-attr]
        dense_bytes += _wire_bytes("dense", infos, 1.0, 0, scope, ())
        if scheme == "dense":
            for key, param in params.items():
                param.grad = sum(g[key] for g in grads) / workers  # type: ignore[assignment]
            sent_bytes += _wire_bytes("dense", infos, 1.0, 0, scope, ())
            optimizer.step()
            if _evaluate(work, model, step, eval_every, reached):
                break
            continue
        density = 0.01
        if variant == "warmup" and step < warmup:
            density = max(0.01, 0.25 ** (1 + 4 * step // warmup))
        if local:
            grads = [local[r].directions(grads[r]) for r in range(workers)]
        compensated = [{key: memories[r].compensate(key, grads[r][key]) for key in params}
                       for r in range(workers)]
        totals = exchange(scheme, compressors, memories, compensated, infos, sparse, step,
                          density, selection, scope, masked=variant == "masked")
        sent_bytes += _wire_bytes(scheme, infos, density, min_numel, scope, exclude)
        for key, param in params.items():
            param.grad = memories[0].settle(key, totals[key])
            for memory in memories[1:]:  # every rank keeps the same estimate
                memory.settle(key, totals[key])
        if local:
            local[0].apply(params)
        else:
            optimizer.step()
        if _evaluate(work, model, step, eval_every, reached):
            break
    return reached, dense_bytes / sent_bytes


def exchange(scheme: str, compressors: Sequence[Sparsifier], memories: Sequence[Memory],
             compensated: Sequence[dict[str, torch.Tensor]], infos: Sequence[TensorInfo],
             sparse: list[TensorInfo], step: int, density: float, selection: str,
             scope: str, masked: bool = False) -> dict[str, torch.Tensor]:
    """One step of the simulated workers' exchange: each worker's choice of its ``p``, its
    memory told what it sent, and the mean of what was sent, summed in worker order and
    divided (the kernel's bits for a power-of-two worker count; a test holds it to
    :class:`~thinwire.jobs.dct_mp.SimulatedReplicas`). ``masked``: DGC's factor masking."""
    workers = len(memories)
    totals = {info.key: torch.zeros_like(compensated[0][info.key]) for info in infos}
    for r in range(workers):
        chosen = _choose(scheme, compressors[r], compensated, r, step, sparse, density,
                         selection, scope)
        for info in infos:
            p = compensated[r][info.key]
            sent = sparsify(p, chosen[info.key]) if info.key in chosen else p.clone()
            memories[r].update(info.key, p, sent)
            if masked:  # DGC Eq. 8: no momentum left where it was sent
                memories[r].velocity[info.key][sent != 0] = 0  # type: ignore[attr-defined]
            totals[info.key] += sent
    return {key: total / workers for key, total in totals.items()}


_BYTES: dict[tuple[Any, ...], int] = {}


def _wire_bytes(scheme: str, infos: Sequence[TensorInfo], density: float, min_numel: int,
                scope: str, exclude: tuple[str, ...]) -> int:
    """Bytes a worker hands over a step, as the scheme's payload layouts count them (the
    registered scheme at this density, its parameters as one bucket)."""
    key = (scheme, density, min_numel, scope, exclude, tuple(infos))
    if key not in _BYTES:
        options = {} if scheme == "dense" else {"ratio": density, "min_numel": min_numel,
                                                 "scope": scope, "exclude": exclude}
        _BYTES[key] = sum(schemes.build(scheme, **options).payload_bytes(list(infos)).values())
    return _BYTES[key]


def _move_to_virtual(params: dict[str, torch.nn.Parameter], memory: Memory,
                     lr: float, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Move ``params`` to ``x - lr * e`` (``memory``'s pending error; under Adam, scaled as
    :func:`look_ahead` does); the old ``x`` by key."""
    move = (look_ahead(memory) if isinstance(memory, MomentumCorrection) and memory.beta2
            is not None else None)
    kept = {}
    with torch.no_grad():
        for key, error in memory.buffers.items():
            step = error if move is None else move(key, error, optimizer.param_groups[0])
            if step is None:
                continue
            kept[key] = params[key].detach().clone()
            params[key].sub_(step.view(params[key].shape), alpha=lr)
    return kept


class LocalAdam:
    """One worker's Adam moments on its own gradients (the ``adam-local`` variant).

    Reads lr, betas, eps and weight decay from the AdamW optimiser the recipe built
    (its own state is left unused).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        group = optimizer.param_groups[0]
        if not isinstance(optimizer, torch.optim.AdamW):
            raise ValueError(f"the adam-local variant needs AdamW, not "
                             f"{type(optimizer).__name__}")
        self.lr, self.eps, self.decay = group["lr"], group["eps"], group["weight_decay"]
        self.beta1, self.beta2 = group["betas"]
        self.first: dict[str, torch.Tensor] = {}
        self.second: dict[str, torch.Tensor] = {}
        self.steps = 0

    def directions(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Advance the moments with ``grads``; Adam's bias-corrected direction per key."""
        self.steps += 1
        out = {}
        for key, grad in grads.items():
            m = self.first.setdefault(key, torch.zeros_like(grad))
            v = self.second.setdefault(key, torch.zeros_like(grad))
            m.mul_(self.beta1).add_(grad, alpha=1 - self.beta1)
            v.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
            v_hat = v / (1 - self.beta2 ** self.steps)
            out[key] = m / (1 - self.beta1 ** self.steps) / (v_hat.sqrt() + self.eps)
        return out

    def apply(self, params: dict[str, torch.nn.Parameter]) -> None:
        """``w <- w (1 - lr wd) - lr d`` with ``d`` each parameter's ``.grad``."""
        with torch.no_grad():
            for param in params.values():
                param.mul_(1 - self.lr * self.decay).add_(param.grad, alpha=-self.lr)


def recipe(workload: str, optimizer_name: str) -> tuple[float, float, int]:
    """(lr, momentum, batch size): the digits MLP's for each optimiser, else the workload's own.

    Raises:
        ValueError: another workload with an optimiser other than its recipe's.
    """
    if workload == "digits-mlp":
        return (*RECIPES[optimizer_name], 32)
    own = workloads.RECIPES[workload]
    if optimizer_name != own["optimizer"]:
        raise ValueError(f"optimizer={optimizer_name!r}: {workload} runs its own recipe's "
                         f"optimiser, {own['optimizer']!r}")
    return own["lr"], own["momentum"], own["batch_size"]


def _compressor(scheme: str, min_numel: int, scope: str,
                exclude: tuple[str, ...] = ()) -> Sparsifier:
    """The scheme's own sparsifier at its defaults (99 % sparsity); topk's for clt-k.
    Parameters matching an ``exclude`` pattern travel dense."""
    built = schemes.build("dct-dp" if scheme == "dct-dp" else "topk", min_numel=min_numel,
                          scope=scope, exclude=exclude)
    selection: Sparsifier = built.selection  # type: ignore[attr-defined]  # the kernel's
    return selection


def _choose(scheme: str, compressor: Sparsifier,
            compensated: list[dict[str, torch.Tensor]], rank: int, step: int,
            sparse: list[TensorInfo], density: float, selection: str,
            scope: str = "layer") -> dict[str, torch.Tensor]:
    """Indices rank ``rank`` sends of each sparsified tensor (absent keys go dense)."""
    mine = compensated[rank]
    if scheme == "clt-k":  # the step's leader picks for everyone, every sparsified tensor
        leader = compensated[step % len(compensated)]
        keys = [info.key for info in sparse]
        if scope == "bucket" and keys:  # one selection over all of them
            together = torch.cat([leader[key].reshape(-1) for key in keys])
            picked = select(together, layer_k(together.numel(), density), selection)
            return dict(zip(keys, split_ascending(picked, [mine[key].numel() for key in keys])))
        return {key: select(leader[key], layer_k(mine[key].numel(), density), selection)
                for key in keys}
    if density > 0.01:  # sparsity warm-up: exact top-k at the warm-up's density
        return {info.key: select(mine[info.key], layer_k(info.numel, density), "exact")
                for info in sparse}
    if not sparse:
        return {}
    magnitudes = torch.cat([mine[info.key].reshape(-1).abs() for info in sparse])
    return dict(zip([info.key for info in sparse], compressor.select_all(magnitudes, sparse)))


def _evaluate(work: workloads.Workload, model: torch.nn.Module, step: int, every: int,
              reached: dict[float, int | None]) -> bool:
    """Record the targets first reached at this step; whether all of them are."""
    if (step + 1) % every:
        return False
    score = work.score(model)
    for target in reached:
        if reached[target] is None and (score <= target if work.lower_is_better
                                        else score >= target):
            reached[target] = step + 1
    return all(reached.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--workload", default="digits-mlp", choices=sorted(workloads.WORKLOADS),
                        help="model and data (default: digits-mlp, with a recipe per "
                             "optimiser; the others run their own recipe)")
    parser.add_argument("--optimizers", default=None,
                        help="comma-separated (default: sgd,nesterov,adamw on digits-mlp, "
                             "else the workload's recipe)")
    parser.add_argument("--schemes", default="dense,topk,dct-dp,clt-k")
    parser.add_argument("--variants", default="plain,coupled,masked,warmup,ef21,virtual")
    parser.add_argument("--selection", default="exact",
                        help="clt-k's leader selection (default: exact)")
    parser.add_argument("--min-numels", default=str(MIN_NUMEL),
                        help="comma-separated: topk, dct-dp and clt-k send tensors under this many "
                             f"entries dense (default {MIN_NUMEL}; 0: every tensor sparse)")
    parser.add_argument("--scopes", default="bucket",
                        help="comma-separated selection scopes of topk, dct-dp and clt-k: "
                             "layer (each tensor at 1 %%) and/or bucket (1 %% of all, one "
                             "selection)")
    parser.add_argument("--targets", default="",
                        help="comma-separated test accuracies to record the steps to as well "
                             "(each run goes on until it has reached them all): whether a "
                             "scheme lags by a number of steps or by a factor")
    parser.add_argument("--exclude", default="",
                        help="comma-separated name patterns of parameters topk, dct-dp and "
                             "clt-k send dense (e.g. 'interact.*': a DLRM's embedding tables)")
    parser.add_argument("--out", type=Path, default=Path("docs/data/coupling.json"))
    args = parser.parse_args(argv)
    exclude = tuple(p.strip() for p in args.exclude.split(",") if p.strip())
    try:
        targets = [float(t) for t in args.targets.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--targets {args.targets!r}: comma-separated numbers in (0, 1]")
    if any(not 0 < t <= 1 for t in targets):
        parser.error(f"--targets {args.targets!r}: each must be in (0, 1]")
    scope_list = args.scopes.split(",")
    try:
        min_numels = [int(m) for m in args.min_numels.split(",")]
    except ValueError:
        parser.error(f"--min-numels {args.min_numels!r}: comma-separated integers >= 0")
    if any(m < 0 for m in min_numels):
        parser.error(f"--min-numels {args.min_numels!r}: each must be >= 0")
    if any(scope not in SCOPES for scope in scope_list):
        parser.error(f"--scopes {args.scopes!r}: each must be one of {SCOPES}")
    if args.optimizers is None:
        args.optimizers = ("sgd,nesterov,adamw" if args.workload == "digits-mlp"
                           else workloads.RECIPES[args.workload]["optimizer"])
    try:
        for name in args.optimizers.split(","):
            recipe(args.workload, name)
    except (KeyError, ValueError) as error:
        parser.error(f"--optimizers {args.optimizers!r}: {error}")
    if "virtual" in args.variants.split(",") and "adamw" in args.optimizers.split(","):
        parser.error("--variants virtual is for SGD (under AdamW: adam-virtual): drop adamw "
                     "from --optimizers")
    for variant in ("adam-local", "adam-virtual"):
        if variant in args.variants.split(",") and args.optimizers != "adamw":
            parser.error(f"--variants {variant} needs --optimizers adamw, not "
                         f"{args.optimizers!r}")
    own = workloads.load(args.workload).target  # the workload's own, always recorded
    torch.set_num_threads(1)
    runs: list[dict[str, Any]] = []
    for optimizer_name in args.optimizers.split(","):
        for scheme in args.schemes.split(","):
            variants = args.variants.split(",") if scheme != "dense" else ["plain"]
            scopes = scope_list if scheme != "dense" else ["layer"]
            for variant, scope, min_numel in itertools.product(
                    variants, scopes, min_numels if scheme != "dense" else [MIN_NUMEL]):
                got = [simulate(scheme, variant, optimizer_name, seed, args.workers,
                                args.steps, args.warmup, selection=args.selection,
                                min_numel=min_numel, targets=targets, scope=scope,
                                workload=args.workload, exclude=exclude)
                       for seed in range(args.seeds)]
                runs.append({"optimizer": optimizer_name, "scheme": scheme, "variant": variant,
                             "scope": scope, "min_numel": min_numel,
                             "steps_to_target": [steps[own] for steps, _ in got],
                             "steps_to": {str(t): [steps[t] for steps, _ in got]
                                          for t in targets},
                             "dense_over_sent_bytes": [ratio for _, ratio in got]})
                print(optimizer_name, scheme, variant, scope, min_numel, got, flush=True)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout
    record = {"config": vars(args) | {"out": str(args.out)}, "runs": runs,
              "when": time.strftime("%Y-%m-%d %H:%M %Z"),
              "load": load.split("load average:")[-1].strip()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(table(record))
    if targets:
        print(targets_table(record))
    return 0


def table(record: dict[str, Any]) -> str:
    """Markdown: steps to target per seed, and the median ratio to dense's steps."""
    dense = {r["optimizer"]: r["steps_to_target"] for r in record["runs"]
             if r["scheme"] == "dense"}
    lines = ["| optimiser | scheme | variant | steps to target per seed | median x dense | "
             "bytes: x less than dense |", "|---|---|---|---|---|---|"]
    for r in record["runs"]:
        base = dense.get(r["optimizer"], [])
        ratios = [float("inf") if s is None else s / b
                  for s, b in zip(r["steps_to_target"], base) if b]
        shown = ", ".join("-" if s is None else str(s) for s in r["steps_to_target"])
        ratio = f"{statistics.median(ratios):.2f}" if ratios else "-"
        less = statistics.median(r.get("dense_over_sent_bytes") or [float("nan")])
        lines.append(f"| {r['optimizer']} | {r['scheme']} | {_variant(r)} | {shown} | "
                     f"{ratio} | {less:.0f}x |")
    return "\n".join(lines)


def targets_table(record: dict[str, Any]) -> str:
    """Markdown: per accuracy of ``--targets``, each run's median steps as a multiple of
    dense's and the median number of steps more than dense (seeds paired)."""
    targets = sorted({t for r in record["runs"] for t in r.get("steps_to", {})}, key=float)
    dense = {r["optimizer"]: r["steps_to"] for r in record["runs"] if r["scheme"] == "dense"}
    lines = ["| optimiser | scheme | variant | " + " | ".join(
        f"{float(t):.0%}: x dense (+steps)" for t in targets) + " |",
        "|---|---|---|" + "---|" * len(targets)]
    for r in record["runs"]:
        cells = []
        for t in targets:
            pairs = list(zip(r["steps_to"][t], dense.get(r["optimizer"], {}).get(t, [])))
            ratios = [float("inf") if s is None else s / b for s, b in pairs if b]
            extra = [s - b for s, b in pairs if b and s is not None]
            cells.append(f"{statistics.median(ratios):.2f} (+{statistics.median(extra):.0f})"
                         if ratios and extra else "-")
        lines.append(f"| {r['optimizer']} | {r['scheme']} | {_variant(r)} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def _variant(run: dict[str, Any]) -> str:
    """The variant, with the selection scope when it is not the layer and ``min_numel`` when
    it is not the default (older files have neither)."""
    label = run["variant"]
    if run.get("scope", "layer") != "layer":
        label += f", {run['scope']}"
    if run.get("min_numel", MIN_NUMEL) != MIN_NUMEL:
        label += f", min_numel={run['min_numel']}"
    return label


if __name__ == "__main__":
    raise SystemExit(main())
