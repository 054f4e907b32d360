"""Compression overhead per step: exact top-k against DCT's reused threshold and the rest.

    python -m benchmarks.overhead [--sizes 1000000 25000000] [--repeats 7] [--out results/overhead]

Times compress + decompress of one gradient tensor per step, in this process,
all codecs side by side on the same tensors. DCT with life-span L pays one
selection every L steps: its per-step cost is (refresh + (L - 1) * reuse) / L,
both parts measured. Medians over repeats; ratios against exact top-k.

Rows ``scheme <name>`` time one whole step of a registered scheme on a
near-square matrix of the same size, in one process (collectives are no-ops
there): error feedback, compression and decompression, a fresh Gaussian
gradient each step. ``topk`` and ``dct-dp`` are the like-for-like
references for ``clt-k`` (ScaleCom) and ``powersgd``; a scheme that is not
registered in this build is skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.machine import CpuWatch, cpu_model
from thinwire.compress import DCTThreshold, Dense, LaplaceThreshold, TensorInfo, TopK

# Whole-scheme rows: the references first, then the schemes of the ScaleCom/PowerSGD work.
SCHEME_ROWS = ("topk", "dct-dp", "clt-k", "powersgd")


def _time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure(numel: int, sparsity: float, life_span: int, repeats: int) -> dict[str, float]:
    """Median seconds per step of each codec on a Gaussian gradient of ``numel`` entries."""
    grad = torch.randn(numel)
    info = TensorInfo.of("w", grad)

    def step(codec: object) -> Callable[[], object]:
        def run() -> object:
            payload = codec.compress(grad, info)  # type: ignore[attr-defined]
            return codec.decompress(payload, info)  # type: ignore[attr-defined]
        return run

    dct = DCTThreshold(sparsity, life_span=life_span)
    dct.compress(grad, info)  # tau now set: the next life_span - 1 calls reuse it

    def refresh() -> object:
        dct._refresh(grad.abs(), "w", int(numel * (1 - sparsity)))
        return None

    reuse = _time(step(dct), repeats)
    refresh_s = _time(refresh, repeats)
    return {
        "dense": _time(step(Dense()), repeats),
        "topk": _time(step(TopK(1 - sparsity)), repeats),
        "dct_reuse": reuse,
        "dct_refresh_extra": refresh_s,
        f"dct_L{life_span}": reuse + refresh_s / life_span,
        "laplace": _time(step(LaplaceThreshold(sparsity)), repeats),
    }


def matrix_shape(numel: int) -> tuple[int, int]:
    """The most nearly square (rows, cols) with rows * cols == numel."""
    rows = math.isqrt(numel)
    while numel % rows:
        rows -= 1
    return rows, numel // rows


def scheme_available(name: str) -> str | None:
    """Why scheme ``name`` cannot be timed here, or None (the optional part)."""
    try:
        from thinwire import schemes
    except ImportError as error:  # a build without the registry
        return f"thinwire.schemes is not importable ({error})"
    if name not in schemes.names():
        return f"not registered in this build (registered: {', '.join(schemes.names())})"
    return None


def measure_scheme(name: str, numel: int, sparsity: float, life_span: int, rank: int,
                   repeats: int) -> float:
    """Median seconds of one step of scheme ``name`` in one process (no collectives)."""
    from thinwire import schemes
    from thinwire.train.compare import scheme_config

    scheme = schemes.build(name, **scheme_config(name, sparsity, life_span, [f"rank={rank}"]))
    shape = matrix_shape(numel)
    samples = []
    for _ in range(repeats + 1):  # the first call allocates buffers: a warm-up
        grads = {"w": torch.randn(shape)}
        start = time.perf_counter()
        scheme.reduce(grads)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 25_000_000])
    parser.add_argument("--sparsity", type=float, default=0.99)
    parser.add_argument("--life-span", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rank", type=int, default=2, help="rank of low-rank schemes")
    parser.add_argument("--out", type=Path, default=Path("results/overhead"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = list(os.getloadavg())
    watch = CpuWatch()
    timed = [name for name in SCHEME_ROWS if scheme_available(name) is None]
    for name in SCHEME_ROWS:
        if name not in timed:
            print(f"note: skipping scheme {name!r}: {scheme_available(name)}")
    rows = {}
    for numel in tqdm(args.sizes, desc="sizes"):
        rows[numel] = measure(numel, args.sparsity, args.life_span, args.repeats)
        for name in timed:
            rows[numel][f"scheme {name}"] = measure_scheme(
                name, numel, args.sparsity, args.life_span, args.rank, args.repeats)
    dct_key = f"dct_L{args.life_span}"
    print(f"median ms per step (compress + decompress), sparsity {args.sparsity}")
    print(f"{'codec':>20s} " + " ".join(f"{n:>14,d}" for n in args.sizes))
    for codec in rows[args.sizes[0]]:
        print(f"{codec:>20s} " + " ".join(f"{1000 * rows[n][codec]:14.2f}" for n in args.sizes))
    for numel in args.sizes:
        r = rows[numel]
        print(f"{numel:,d}: {dct_key} / topk = {r[dct_key] / r['topk']:.3f}, "
              f"laplace / topk = {r['laplace'] / r['topk']:.3f}")
        if "scheme topk" in r:
            print(f"{numel:,d}: " + ", ".join(
                f"{key} / scheme topk = {r[key] / r['scheme topk']:.3f}"
                for key in r if key.startswith("scheme ") and key != "scheme topk"))
    record = {"command": "python -m benchmarks.overhead " + " ".join(
                  f"--{k.replace('_', '-')} "
                  + (" ".join(map(str, v)) if isinstance(v, list) else str(v))
                  for k, v in vars(args).items() if k != "out"),
              "machine": f"{cpu_model()}, {os.cpu_count()} cores, "
                         f"{torch.get_num_threads()} threads, torch {torch.__version__}",
              "date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
              "cores": os.cpu_count(), "load_before": load_before,
              "others_cpu_share": watch.others_share(),
              "matrix_shapes": {str(n): matrix_shape(n) for n in args.sizes},
              "seconds": {str(n): r for n, r in rows.items()},
              "ratio_vs_topk": {str(n): {k: v / r["topk"] for k, v in r.items()}
                                for n, r in rows.items()}}
    (args.out / "overhead.json").write_text(json.dumps(record, indent=2))
    plot(record, args.out / "overhead.png")
    print(f"wrote {args.out}/overhead.json and overhead.png")


def plot(record: dict[str, Any], path: Path) -> None:
    """Bars of ms per step per codec (and scheme row) for each size in ``record``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {int(n): r for n, r in record["seconds"].items()}
    first = next(iter(rows.values()))
    codecs = [c for c in first if c not in ("dct_reuse", "dct_refresh_extra")]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / len(rows)
    for i, (numel, r) in enumerate(rows.items()):
        ax.bar([c + i * width for c in range(len(codecs))], [1000 * r[c] for c in codecs],
               width, label=f"{numel:,d} entries")
    ax.set_xticks([c + width * (len(rows) - 1) / 2 for c in range(len(codecs))], codecs,
                  rotation=20, fontsize=8)
    ax.set(ylabel="ms per step (median)", yscale="log",
           title="Compression overhead per step")
    ax.legend()
    footer = textwrap.wrap(f"{record['command']} | {record['machine']} | {record['date']}", 150)
    fig.text(0.01, 0.01, "\n".join(footer), fontsize=6)
    fig.tight_layout(rect=(0, 0.025 + 0.025 * len(footer), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
