"""Compression overhead per step: exact top-k against DCT's reused threshold and the rest.

    python -m benchmarks.overhead [--sizes 1000000 25000000] [--repeats 7] [--device cpu]
                                  [--out results/overhead]

Times compress + decompress of one gradient tensor per step, in this process,
all codecs side by side on the same tensors, interleaved round by round. DCT
with life-span L pays one selection every L steps: its per-step cost is
(refresh + (L - 1) * reuse) / L, both parts measured. Medians over repeats;
ratios against exact top-k, and against each row's floor.

Rows ``floor <name>`` do the same work written directly in plain torch ops
(``torch.topk`` or a comparison, a gather, a scatter into zeros; for the
scheme rows also the non-finite check by one reduction, the error feedback,
the residual by zeroing the sent entries, for dct-dp its density control on the
reused tau and the k largest of the passing entries, and for PowerSGD the two
products, QR and the reconstruction as r
outer products added elementwise, the least that keeps replicas bit
identical whatever thread a callback runs on), so ``<name> / floor <name>``
is what the library adds to the least the maths needs. The candidate-based
exact selection can beat its ``torch.topk`` / ``kthvalue`` floor (clt-k's
leader selects exactly, its default).

Rows ``scheme <name>`` time one whole step of a registered scheme on a
near-square matrix of the same size, in one process (collectives are no-ops
there), through ``launch_flat`` on a bucket as the DDP hook does: error
feedback, compression and decompression, a fresh Gaussian gradient each step.
``topk`` and ``dct-dp`` are the like-for-like references for ``clt-k``
(ScaleCom) and ``powersgd``; a scheme that is not registered in this build is
skipped with a note.

With ``--device cuda`` every tensor lives on the GPU and each timed call is
bracketed by ``torch.cuda.synchronize()``, so a row's time covers its kernels
and the host's waits on them (a count read back to size a payload, say).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.machine import CpuWatch, cpu_model
from benchmarks.step import FloorState, floor_dct_select, floor_decode, floor_encode, floor_largest
from thinwire.compress import DCTThreshold, LaplaceThreshold, TensorInfo, TopK, keep_count

# Whole-scheme rows: the references first, then the schemes of the ScaleCom/PowerSGD work.
SCHEME_ROWS = ("topk", "dct-dp", "clt-k", "powersgd")


Step = Callable[[], object]
CPU = torch.device("cpu")


def synchronizer(device: torch.device) -> Callable[[], None]:
    """What waits for ``device``'s queued work before a clock is read."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def interleaved(rows: dict[str, Step], repeats: int,
                prepare: dict[str, Step] | None = None,
                sync: Callable[[], None] = lambda: None,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median seconds of each row, the rows run in turn within every round.

    Interleaving spreads a change of machine load over all rows alike, so
    ratios between rows stay meaningful on a shared machine. Each round runs
    the rows in a new order (seeded, so runs repeat): in a fixed order each row
    always finds the caches as the same predecessor left them (powersgd read
    1.53x its floor at 1M entries in a fixed order, 1.26x shuffled: the files
    ``git show cddf35d:docs/data/overhead.json`` and ``docs/data/overhead.json``).

    Args:
        prepare: per row, untimed work run before each timed call (a fresh gradient).
        sync: waits for the device's queued work, before and after each timed call.
        clock: seconds read before and after each call: wall time, or
            ``time.thread_time`` (this thread's CPU time, which other processes'
            load does not add to, where the work runs in the calling thread).
    """
    prepare = prepare or {}
    for name, run in rows.items():  # warm-up: first calls allocate
        if name in prepare:
            prepare[name]()
        run()
    samples: dict[str, list[float]] = {name: [] for name in rows}
    shuffle = random.Random(0).shuffle
    for _ in range(repeats):
        order = list(rows)
        shuffle(order)
        for name in order:
            run = rows[name]
            if name in prepare:
                prepare[name]()
            sync()
            start = clock()
            run()
            sync()
            samples[name].append(clock() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


def codec_rows(grad: torch.Tensor, ratio: float, life_span: int) -> dict[str, Step]:
    """compress + decompress of one tensor by each codec (no error feedback)."""
    info = TensorInfo.of("w", grad)

    def step(codec: object) -> Step:
        def run() -> object:
            payload = codec.compress(grad, info)  # type: ignore[attr-defined]
            return codec.decompress(payload, info)  # type: ignore[attr-defined]
        return run

    options = {"min_numel": 0}
    dct = DCTThreshold(ratio, life_span=life_span, **options)  # type: ignore[arg-type]
    dct.compress(grad, info)  # tau now set: the next life_span - 1 calls reuse it
    k = keep_count(grad.numel(), ratio)
    return {
        "dense": lambda: grad.reshape(-1),  # the identity: a view of the tensor
        "topk": step(TopK(ratio, **options)),  # type: ignore[arg-type]
        "dct_reuse": step(dct),
        "dct_refresh_extra": lambda: dct._refresh(grad.abs(), "w", k),
        "laplace": step(LaplaceThreshold(ratio, **options)),  # type: ignore[arg-type]
    }


def codec_floors(grad: torch.Tensor, ratio: float, tau: float) -> dict[str, Step]:
    """The same work as :func:`codec_rows`, written directly in plain torch ops."""
    numel = grad.numel()
    k = keep_count(numel, ratio)
    scale = -math.log(ratio)

    def scatter(indices: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(grad)
        out[indices] = grad[indices]
        return out

    return {
        "floor topk": lambda: scatter(torch.topk(grad.abs(), k, sorted=False).indices),
        "floor dct_reuse": lambda: scatter((grad.abs() >= tau).nonzero().squeeze(1)),
        # kthvalue on the CPU; on a GPU, where kthvalue sorts, the end of a topk
        "floor dct_refresh_extra": (
            (lambda: torch.kthvalue(grad.abs(), numel - k + 1)) if grad.device.type == "cpu"
            else lambda: torch.topk(grad.abs(), k, sorted=False).values.min()),
        "floor laplace": lambda: scatter(
            (lambda a: (a >= a.mean() * scale).nonzero().squeeze(1))(grad.abs())),
    }


def measure(numel: int, ratio: float, life_span: int, repeats: int,
            device: torch.device = CPU) -> dict[str, float]:
    """Median seconds per step of each codec and its floor on a Gaussian gradient."""
    grad = torch.randn(numel, device=device)
    rows = codec_rows(grad, ratio, life_span)
    k = keep_count(numel, ratio)
    tau = float(torch.kthvalue(grad.abs(), numel - k + 1).values)
    rows.update(codec_floors(grad, ratio, tau))
    seconds = interleaved(rows, repeats, sync=synchronizer(device))
    for prefix in ("", "floor "):
        seconds[f"{prefix}dct_L{life_span}"] = (seconds[f"{prefix}dct_reuse"]
                                               + seconds[f"{prefix}dct_refresh_extra"]
                                               / life_span)
    return seconds


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


def scheme_step(name: str, grad: torch.Tensor, bucket: torch.Tensor, ratio: float,
                life_span: int, rank: int) -> Step:
    """One step of scheme ``name`` in one process (no collectives), as the DDP hook runs
    it: :meth:`~thinwire.schemes.base.Scheme.launch_flat` on ``bucket``, which the caller
    fills with ``grad`` before each call, untimed (DDP fills its bucket whatever the hook)."""
    from thinwire import schemes
    from thinwire.compress import TensorInfo
    from thinwire.jobs.compare import scheme_config

    scheme = schemes.build(name, **scheme_config(name, ratio, life_span, [f"rank={rank}"]))
    infos = [TensorInfo.of("w", grad)]
    return lambda: scheme.launch_flat(bucket, infos).wait()


def scheme_floor(name: str, grad: torch.Tensor, ratio: float, rank: int) -> Step | None:
    """The work of one step of scheme ``name``, written directly in plain torch ops.

    The non-finite check at the cost of one reduction (what the library's
    ``nonfinite`` policy needs: :func:`thinwire.feedback.all_finite`), error
    feedback, selection or factorisation, the residual, the payload in the
    scheme's default wire format and back (dct-dp, topk: 16-bit indices
    and fp32 values, :func:`benchmarks.step.floor_encode`) and the decoded
    result: what the scheme must do at the least, with none of its
    bookkeeping, in place into buffers kept across steps (a fresh buffer of
    25M entries costs its page faults on every step, which would flatter the
    library). None for a scheme without a floor here.
    """
    shape = tuple(grad.shape)
    numel = grad.numel()
    k = keep_count(numel, ratio)
    error = torch.zeros(numel, device=grad.device)
    out, scratch = torch.empty_like(error), torch.empty_like(error)

    def finite() -> bool:  # the one reduction the non-finite policy costs, read once
        return math.isfinite(grad.sum(dtype=torch.float32).item())

    def sparse_step(select: Callable[[torch.Tensor], torch.Tensor], wire: bool) -> Step:
        def run() -> object:
            finite()
            p = error.add_(grad.reshape(-1))  # p = g + e, in the memory
            indices = select(torch.abs(p, out=scratch))
            values = p[indices]
            p[indices] = 0.0  # the residual: p with the sent entries zeroed
            if wire:  # through the scheme's wire format and back, as one rank's exchange
                indices, values = floor_decode(floor_encode(indices, values, k, numel), k, numel)
            out.zero_()
            out.index_add_(0, indices, values)
            return out
        return run

    if name == "topk":
        return sparse_step(lambda m: floor_largest(m, k), wire=True)
    if name == "clt-k":  # the leader's exact top-k; values go by all-reduce at its indices
        return sparse_step(lambda m: torch.topk(m, k, sorted=False).indices, wire=False)
    if name == "dct-dp":
        # A reused tau nudged by dct-dp's density control at its default gain, as the
        # loopback floor does it.
        tau = [float(torch.kthvalue(grad.abs().reshape(-1), numel - k + 1).values)]

        def dct_select(m: torch.Tensor) -> torch.Tensor:
            indices, tau[0] = floor_dct_select(m, tau[0], k, FloorState().gain)
            return indices
        return sparse_step(dct_select, wire=True)
    if name == "powersgd":
        rows, cols = shape
        # column-major, as the products want it
        state = {"q": torch.randn(rank, cols, device=grad.device).t()}
        matrix, approx, term = error.view(shape), out.view(shape), scratch.view(shape)

        def power_step() -> object:
            finite()
            matrix.add_(grad)  # M = g + e, in the memory
            p_hat = torch.linalg.qr(matrix @ state["q"]).Q
            q = state["q"] = (p_hat.t() @ matrix).t()
            # r outer products added elementwise: a rank-r BLAS product may round
            # differently on ranks whose callbacks run on other threads, and replicas drift.
            torch.mul(p_hat[:, :1], q[:, 0], out=approx)
            for j in range(1, rank):
                approx.add_(torch.mul(p_hat[:, j: j + 1], q[:, j], out=term))
            matrix.sub_(approx)  # e = M - G_hat
            return approx
        return power_step
    return None


def measure_schemes(names: list[str], numel: int, ratio: float, life_span: int, rank: int,
                    repeats: int, device: torch.device = CPU) -> dict[str, float]:
    """Median seconds of one step of each scheme and of its floor, interleaved.

    Every row gets a fresh Gaussian gradient before each timed call (untimed).
    """
    grad = torch.randn(matrix_shape(numel), device=device)
    bucket = torch.empty(numel, device=device)
    rows: dict[str, Step] = {}
    prepare: dict[str, Step] = {}
    for name in names:
        rows[f"scheme {name}"] = scheme_step(name, grad, bucket, ratio, life_span, rank)
        prepare[f"scheme {name}"] = lambda: bucket.copy_(grad.normal_().reshape(-1))
        floor = scheme_floor(name, grad, ratio, rank)
        if floor is not None:
            rows[f"floor scheme {name}"] = floor
            prepare[f"floor scheme {name}"] = grad.normal_
    return interleaved(rows, repeats, prepare, synchronizer(device))


def measure_scheme(name: str, numel: int, ratio: float, life_span: int, rank: int,
                   repeats: int) -> float:
    """Median seconds of one step of scheme ``name`` in one process (no collectives)."""
    return measure_schemes([name], numel, ratio, life_span, rank, repeats)[f"scheme {name}"]


def floor_ratios(seconds: dict[str, float]) -> dict[str, float]:
    """Each row that has a floor row, as a multiple of that floor."""
    return {name: value / seconds[f"floor {name}"] for name, value in seconds.items()
            if f"floor {name}" in seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 25_000_000])
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--life-span", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rank", type=int, default=2, help="rank of low-rank schemes")
    parser.add_argument("--device", type=torch.device, default=torch.device("cpu"),
                        help="where the tensors live: cpu (default) or cuda")
    parser.add_argument("--out", type=Path, default=Path("results/overhead"))
    args = parser.parse_args()
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch finds no GPU here")
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = list(os.getloadavg())
    watch = CpuWatch()
    timed = [name for name in SCHEME_ROWS if scheme_available(name) is None]
    for name in SCHEME_ROWS:
        if name not in timed:
            print(f"note: skipping scheme {name!r}: {scheme_available(name)}")
    rows = {}
    for numel in tqdm(args.sizes, desc="sizes"):
        rows[numel] = measure(numel, args.ratio, args.life_span, args.repeats, args.device)
        rows[numel].update(measure_schemes(timed, numel, args.ratio, args.life_span,
                                           args.rank, args.repeats, args.device))
    dct_key = f"dct_L{args.life_span}"
    print(f"median ms per step (compress + decompress), ratio {args.ratio}")
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
        print(f"{numel:,d}: vs floor: " + ", ".join(
            f"{key} {ratio:.2f}x" for key, ratio in floor_ratios(r).items()))
    record = {"command": "python -m benchmarks.overhead " + " ".join(
                  f"--{k.replace('_', '-')} "
                  + (" ".join(map(str, v)) if isinstance(v, list) else str(v))
                  for k, v in vars(args).items() if k != "out"),
              "machine": f"{cpu_model()}, {os.cpu_count()} cores, "
                         f"{torch.get_num_threads()} threads, torch {torch.__version__}"
                         + (f", {torch.cuda.get_device_name(args.device)}"
                            if args.device.type == "cuda" else ""),
              "device": args.device.type,
              "date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
              "cores": os.cpu_count(), "load_before": load_before,
              "others_cpu_share": watch.others_share(),
              "matrix_shapes": {str(n): matrix_shape(n) for n in args.sizes},
              "seconds": {str(n): r for n, r in rows.items()},
              "ratio_vs_topk": {str(n): {k: v / r["topk"] for k, v in r.items()}
                                for n, r in rows.items()},
              "ratio_vs_floor": {str(n): floor_ratios(r) for n, r in rows.items()}}
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
    codecs = [c for c in first if not c.startswith("floor")
              and c not in ("dct_reuse", "dct_refresh_extra")]
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
