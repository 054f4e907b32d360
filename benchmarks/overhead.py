"""Compression overhead per step: exact top-k against DCT's reused threshold and the rest.

    python -m benchmarks.overhead [--sizes 1000000 25000000] [--repeats 7] [--out results/overhead]

Times compress + decompress of one gradient tensor per step, in this process,
all codecs side by side on the same tensors. DCT with life-span L pays one
selection every L steps: its per-step cost is (refresh + (L - 1) * reuse) / L,
both parts measured. Medians over repeats; ratios against exact top-k.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from thinwire.compress import DCTThreshold, Dense, LaplaceThreshold, TensorInfo, TopK


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 25_000_000])
    parser.add_argument("--sparsity", type=float, default=0.99)
    parser.add_argument("--life-span", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("results/overhead"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for numel in tqdm(args.sizes, desc="sizes"):
        rows[numel] = measure(numel, args.sparsity, args.life_span, args.repeats)
    dct_key = f"dct_L{args.life_span}"
    print(f"median ms per step (compress + decompress), sparsity {args.sparsity}")
    print(f"{'codec':>20s} " + " ".join(f"{n:>14,d}" for n in args.sizes))
    for codec in rows[args.sizes[0]]:
        print(f"{codec:>20s} " + " ".join(f"{1000 * rows[n][codec]:14.2f}" for n in args.sizes))
    for numel in args.sizes:
        r = rows[numel]
        print(f"{numel:,d}: {dct_key} / topk = {r[dct_key] / r['topk']:.3f}, "
              f"laplace / topk = {r['laplace'] / r['topk']:.3f}")
    record = {"command": "python -m benchmarks.overhead " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                  if k not in ("sizes", "out")),
              "machine": f"{platform.machine()} {platform.processor()} "
                         f"{torch.get_num_threads()} threads",
              "date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
              "seconds": {str(n): r for n, r in rows.items()},
              "ratio_vs_topk": {str(n): {k: v / r["topk"] for k, v in r.items()}
                                for n, r in rows.items()}}
    (args.out / "overhead.json").write_text(json.dumps(record, indent=2))
    _plot(rows, args.out / "overhead.png", dct_key, record)
    print(f"wrote {args.out}/overhead.json and overhead.png")


def _plot(rows: dict[int, dict[str, float]], path: Path, dct_key: str,
          record: dict[str, object]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    codecs = ["dense", "topk", dct_key, "laplace"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(rows)
    for i, (numel, r) in enumerate(rows.items()):
        ax.bar([c + i * width for c in range(len(codecs))], [1000 * r[c] for c in codecs],
               width, label=f"{numel:,d} entries")
    ax.set_xticks([c + width * (len(rows) - 1) / 2 for c in range(len(codecs))], codecs)
    ax.set(ylabel="ms per step (median)", yscale="log",
           title="Compression overhead per step")
    ax.legend()
    fig.text(0.01, 0.01, f"{record['command']} | {record['machine']} | {record['date']}",
             fontsize=6)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
