"""Train one network per site under each mode, side by side; shared by ``thinwire dad`` and
``benchmarks/dad.py``.

Setting of the paper (§4): every site holds the same architecture and
initial weights; labels are split so no class is on two sites (§4.1.1);
Adam with a fixed learning rate; a fixed batch per site. Each run also
measures, on rank 0, the pooled gradient -- single-process training on the
concatenation of all sites' batches at the same weights -- so the maximum
gradient error of Table 2 is measured at every step of the run.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from thinwire.autodiff.engine import DistributedAutodiff
from thinwire.comm import Meter
from thinwire.data.sitedata import Data, split_by_label
from thinwire.jobs import common
from thinwire.launch import DEFAULT_TIMEOUT_S, phase, spawn
from thinwire.models.gru import GRUClassifier
from thinwire.progress import StepBar

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class Run:
    """One training run: a mode and its options on shared data and architecture."""

    label: str  # name in tables and plots, e.g. "rank-dad r=4"
    mode: str  # DistributedAutodiff mode
    options: dict[str, Any] = field(default_factory=dict)  # AutodiffConfig fields
    epochs: int = 3  # passes over the smallest site's data
    batch: int = 32  # samples per site per step (§4: 32)
    hidden: tuple[int, ...] = (1024, 1024)  # MLP hidden layers (§4.1.1); GRU head widths
    gru_hidden: int = 64  # GRU hidden size (§4.1.2)
    lr: float = 1e-3  # Adam learning rate (the paper: 1e-4 over 50 epochs)
    seed: int = 0  # weights and batch order
    dtype: str = "float32"  # "float32" or "float64"
    pooled: bool = True  # measure the gradient error against pooled training every step
    max_steps: int = 0  # stop each epoch after this many steps (0: the whole epoch)
    steps: int = 0  # stop the run after this many steps in all (0: every epoch)


def build_model(data: Data, run: Run) -> nn.Module:
    """The paper's networks: an MLP with ReLU (§4.1.1), or a GRU + MLP head (§4.1.2)."""
    torch.manual_seed(run.seed)
    if data.sequential:
        model: nn.Module = GRUClassifier(data.train_x.shape[2], data.classes, run.gru_hidden,
                                         run.hidden)
    else:
        layers: list[nn.Module] = []
        width = data.train_x.shape[1]
        for size in run.hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        layers.append(nn.Linear(width, data.classes))
        model = nn.Sequential(*layers)
    return model.to(DTYPES[run.dtype])


def steps_per_epoch(parts: Sequence[np.ndarray], run: Run) -> int:
    steps = min(len(part) for part in parts) // run.batch
    return min(steps, run.max_steps) if run.max_steps else steps


def planned_steps(parts: Sequence[np.ndarray], run: Run) -> int:
    """Steps the run takes: ``epochs`` x :func:`steps_per_epoch`, at most ``run.steps``."""
    total = run.epochs * steps_per_epoch(parts, run)
    return min(total, run.steps) if run.steps else total


def _order(part: np.ndarray, seed: int, epoch: int, site: int) -> np.ndarray:
    """A site's shuffled indices for one epoch; every rank can recompute any site's."""
    generator = np.random.default_rng([seed, epoch, site])
    return part[generator.permutation(len(part))]


def _evaluate(model: nn.Module, data: Data, dtype: torch.dtype) -> dict[str, float]:
    from sklearn.metrics import roc_auc_score

    with torch.no_grad():
        logits = model(torch.as_tensor(data.test_x, dtype=dtype))
        probs = torch.softmax(logits.double(), dim=1).numpy()
    accuracy = float((probs.argmax(1) == data.test_y).mean())
    auc = float(roc_auc_score(data.test_y, probs, multi_class="ovr",
                              labels=list(range(data.classes))))
    return {"accuracy": accuracy, "auc": auc}


def train_site(rank: int, sites: int, data: Data, runs: list[Run],
               progress: bool = False) -> list[dict[str, Any]]:
    """Spawned on every site: each run in turn; returns one result per run.

    With ``progress``, site 0 draws a bar of every run's steps, from the first.
    """
    parts = split_by_label(data.train_y, sites)
    bar = StepBar(sum(planned_steps(parts, run) for run in runs), show=progress and rank == 0)
    results = [_train(rank, sites, data, run, bar) for run in runs]
    bar.close()
    return results


def _train(rank: int, sites: int, data: Data, run: Run, bar: StepBar) -> dict[str, Any]:
    dtype = DTYPES[run.dtype]
    parts = split_by_label(data.train_y, sites)
    model = build_model(data, run)
    pooled_model = copy.deepcopy(model) if run.pooled and rank == 0 else None
    meter = Meter(rank, sites)
    engine = DistributedAutodiff(model, run.mode, meter=meter, **run.options)
    optimizer = torch.optim.Adam(model.parameters(), lr=run.lr)
    steps = steps_per_epoch(parts, run)
    left = planned_steps(parts, run)
    errors: dict[str, float] = {}  # layer parameter -> max |g - g_pooled| over the run
    first_epoch_error: dict[str, float] = {}
    history = []
    compute = 0.0
    sync: list[float] = []  # seconds per synchronize()
    begin = time.perf_counter()
    for epoch in range(run.epochs):
        if left == 0:
            break
        orders = [_order(part, run.seed, epoch, s) for s, part in enumerate(parts)]
        losses = []
        for step in range(min(steps, left)):
            phase(f"{run.label} step {step}")
            rows = [order[step * run.batch: (step + 1) * run.batch] for order in orders]
            x = torch.as_tensor(data.train_x[rows[rank]], dtype=dtype)
            y = torch.as_tensor(data.train_y[rows[rank]])
            tick = time.perf_counter()
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            compute += time.perf_counter() - tick
            tick = time.perf_counter()
            grads = engine.synchronize()
            sync.append(time.perf_counter() - tick)
            losses.append(float(loss.detach()))
            if pooled_model is not None:
                reference = _pooled_grads(pooled_model, model, data, rows, dtype)
                for name, grad in grads.items():
                    error = float((grad - reference[name]).abs().max())
                    errors[name] = max(errors.get(name, 0.0), error)
                    if epoch == 0:
                        first_epoch_error[name] = max(first_epoch_error.get(name, 0.0), error)
            optimizer.step()
            bar.update(1, run.label)
        left -= min(steps, left)
        history.append({"epoch": epoch + 1, "loss": float(np.mean(losses)) if losses else 0.0,
                        **_evaluate(model, data, dtype)})
    return {
        "label": run.label, "mode": run.mode, "run": asdict(run), "site": rank,
        "steps_per_epoch": steps, "history": history, "meter": meter.summary(),
        "max_grad_error": errors, "max_grad_error_first_epoch": first_epoch_error,
        "effective_rank_per_epoch": engine.ranks.mean_per(max(1, steps)),
        "seconds": time.perf_counter() - begin, "compute_seconds": compute,
        "median_sync_seconds": float(np.median(sync)) if sync else 0.0,
    }


def _pooled_grads(pooled: nn.Module, model: nn.Module, data: Data, rows: list[np.ndarray],
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Single-process gradients on every site's batch at once, at ``model``'s weights."""
    pooled.load_state_dict(model.state_dict())
    pooled.zero_grad()
    index = np.concatenate(rows)
    x = torch.as_tensor(data.train_x[index], dtype=dtype)
    loss = F.cross_entropy(pooled(x), torch.as_tensor(data.train_y[index]))
    loss.backward()
    return {name: p.grad.clone() for name, p in pooled.named_parameters() if p.grad is not None}


def run_all(data: Data, runs: list[Run], sites: int = 2,
            timeout_s: float = DEFAULT_TIMEOUT_S, progress: bool = False) -> list[dict[str, Any]]:
    """Every run on ``sites`` gloo processes; per run, rank 0's result with each site's bytes.

    ``timeout_s`` is the process group's: the longest a site waits on a stalled peer.
    ``progress`` shows a bar of the training steps once the sites have met.

    Raises:
        ValueError: fewer classes than sites.
    """
    split_by_label(data.train_y, sites)  # validates before spawning
    per_rank = spawn(train_site, sites, data, runs, progress, timeout_s=timeout_s)
    results = []
    for i, _ in enumerate(runs):
        result = dict(per_rank[0][i])
        result["bytes_per_site"] = [r[i]["meter"]["bytes_sent_per_step"] for r in per_rank]
        result["wire_per_site"] = [r[i]["meter"]["wire_sent_per_step"] for r in per_rank]
        results.append(result)
    return results


HEADER = ["mode", "bytes/step", "vs dsgd", "max|g-pooled|", "AUC", "acc"]


def table_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    """One row per run: bytes per step, max gradient error, final AUC and accuracy."""
    dense = next((max(r["bytes_per_site"]) for r in results if r["mode"] == "dsgd"), None)
    rows = []
    for r in results:
        sent = max(r["bytes_per_site"])
        error = max(r["max_grad_error"].values()) if r["max_grad_error"] else float("nan")
        last = r["history"][-1] if r["history"] else {"auc": float("nan"),
                                                      "accuracy": float("nan")}
        rows.append([r["label"], f"{sent:.0f}", f"{sent / dense:.3f}" if dense else "-",
                     f"{error:.3e}", f"{last['auc']:.4f}", f"{last['accuracy']:.4f}"])
    return rows


def table(results: list[dict[str, Any]]) -> str:
    """:func:`table_rows` as aligned plain text."""
    return common.text_table(HEADER, table_rows(results))
