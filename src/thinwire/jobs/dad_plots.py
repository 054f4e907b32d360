"""Figures of the dAD paper from :func:`thinwire.jobs.dad.run_all` results."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_DASHES = ("-", "--", ":", "-.")


def effective_rank(results: Sequence[dict[str, Any]], path: str, title: str = "") -> None:
    """Mean effective rank per layer per epoch, one panel per rank-dAD run (Fig. 4–5)."""
    runs = [r for r in results if r["effective_rank_per_epoch"]]
    if not runs:
        return
    columns = min(3, len(runs))
    rows = (len(runs) + columns - 1) // columns
    figure, axes = plt.subplots(rows, columns, figsize=(4 * columns, 3.2 * rows), squeeze=False)
    for axis in axes.flat[len(runs):]:
        axis.set_visible(False)
    for axis, result in zip(axes.flat, runs, strict=False):
        layers = result["effective_rank_per_epoch"]
        for i, (layer, series) in enumerate(layers.items()):
            # Layers often share a rank exactly: a marker and dash of their own and a
            # small shift along x keep every line visible where they coincide.
            shift = (i - (len(layers) - 1) / 2) * min(0.3 / max(1, len(layers)), 0.08)
            axis.plot([epoch + 1 + shift for epoch in range(len(series))], series,
                      marker=_MARKERS[i % len(_MARKERS)],
                      linestyle=_DASHES[i % len(_DASHES)], alpha=0.85, label=layer)
        axis.set_title(result["label"])
        axis.set_xlabel("epoch (layers shifted slightly apart)")
        axis.set_ylabel("mean effective rank")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.legend(fontsize=7, title="layer", title_fontsize=7)
    figure.suptitle(title or "rank-dAD effective rank per layer")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def auc(results: Sequence[dict[str, Any]], path: str, title: str = "") -> None:
    """Test AUC per epoch: exact modes, then rank-dAD and PowerSGD by rank (Fig. 1, 3)."""
    groups = {
        "exact": [r for r in results if r["mode"] in ("dsgd", "dad", "edad")],
        "rank-dAD": [r for r in results if r["mode"] == "rank-dad"],
        "PowerSGD": [r for r in results if r["mode"] == "powersgd"],
    }
    groups = {k: v for k, v in groups.items() if v}
    figure, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.2),
                                squeeze=False, sharey=True)
    for axis, (name, runs) in zip(axes[0], groups.items(), strict=True):
        for result in runs:
            epochs = [h["epoch"] for h in result["history"]]
            axis.plot(epochs, [h["auc"] for h in result["history"]], marker="o",
                      label=result["label"])
        axis.set_title(name)
        axis.set_xlabel("epoch")
        axis.set_ylabel("test AUC (one-vs-rest)")
        axis.legend(fontsize=7)
    figure.suptitle(title or "test AUC per mode")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def bytes_per_step(results: Sequence[dict[str, Any]], path: str, title: str = "") -> None:
    """Bytes each site hands to torch.distributed per step, per run (log scale)."""
    figure, axis = plt.subplots(figsize=(max(5.0, 0.6 * len(results)), 3.4))
    labels = [r["label"] for r in results]
    axis.bar(range(len(results)), [max(r["bytes_per_site"]) for r in results])
    axis.set_xticks(range(len(results)), labels, rotation=60, ha="right", fontsize=7)
    axis.set_yscale("log")
    axis.set_ylabel("bytes per step per site")
    axis.set_title(title or "communication per step")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
