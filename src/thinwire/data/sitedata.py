"""Offline data sets for the dAD experiments, with labels split so no class is on two sites.

* ``digits``: scikit-learn's 8x8 digits (ships with scikit-learn), 80/20
  stratified split.
* ``fashion-mnist``: the IDX files of Debian's ``dataset-fashion-mnist``
  package (``/usr/share/datasets/fashion-mnist``), used when installed.
* ``uea:NAME``: a multivariate UEA set that sktime ships offline
  (``BasicMotions``, ``JapaneseVowels``), when sktime is installed
  (``pip install thinwire[bench]``); sequences are (time, features),
  shorter ones zero-padded at the front so every sequence ends on data.

Nothing is downloaded; an absent optional set raises :class:`Unavailable`.
"""

from __future__ import annotations

import gzip
import os
from dataclasses import dataclass

import numpy as np

FASHION_DIR = "/usr/share/datasets/fashion-mnist"
UEA_LOADERS = {"BasicMotions": "load_basic_motions", "JapaneseVowels": "load_japanese_vowels"}


class Unavailable(RuntimeError):
    """An optional data set is not installed on this machine."""


@dataclass(frozen=True)
class Data:
    """Train and test arrays; x is (N, features) or (N, time, features) float32."""

    name: str
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    classes: int

    @property
    def sequential(self) -> bool:
        return self.train_x.ndim == 3


def names() -> list[str]:
    return ["digits", "fashion-mnist", *(f"uea:{name}" for name in UEA_LOADERS)]


def load(name: str, seed: int = 0) -> Data:
    """Load a data set by name (see :func:`names`).

    Raises:
        ValueError: an unknown name.
        Unavailable: an optional set that is not installed.
    """
    if name == "digits":
        return _digits(seed)
    if name == "fashion-mnist":
        return _fashion()
    if name.startswith("uea:"):
        return _uea(name[4:])
    raise ValueError(f"dataset={name!r} must be one of {names()}")


def _digits(seed: int) -> Data:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    train_x, test_x, train_y, test_y = train_test_split(
        x, digits.target, test_size=0.2, stratify=digits.target, random_state=seed)
    return Data("digits", train_x, train_y.astype(np.int64), test_x, test_y.astype(np.int64), 10)


def _idx(path: str) -> np.ndarray:
    with gzip.open(path, "rb") as handle:
        raw = handle.read()
    dims = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims))
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def _fashion() -> Data:
    files = {part: os.path.join(FASHION_DIR, f"{part}-ubyte.gz") for part in
             ("train-images-idx3", "train-labels-idx1", "t10k-images-idx3", "t10k-labels-idx1")}
    missing = [path for path in files.values() if not os.path.exists(path)]
    if missing:
        raise Unavailable(f"Fashion-MNIST is not installed ({missing[0]} is missing); "
                          "apt-get install dataset-fashion-mnist")
    images = {k: _idx(v) for k, v in files.items()}
    flat = {k: (v.reshape(v.shape[0], -1) / 255.0).astype(np.float32) for k, v in images.items()
            if "images" in k}
    return Data("fashion-mnist", flat["train-images-idx3"],
                images["train-labels-idx1"].astype(np.int64), flat["t10k-images-idx3"],
                images["t10k-labels-idx1"].astype(np.int64), 10)


def _uea(name: str) -> Data:
    if name not in UEA_LOADERS:
        raise ValueError(f"UEA set {name!r} must be one of {sorted(UEA_LOADERS)}")
    try:
        from sktime import datasets
    except ImportError as error:
        raise Unavailable("UEA sets need sktime: pip install 'thinwire[bench]'") from error
    loader = getattr(datasets, UEA_LOADERS[name])
    parts = {split: loader(split=split) for split in ("train", "test")}
    sequences = {split: _pad_front(frame) for split, (frame, _) in parts.items()}
    labels = np.concatenate([y for _, y in parts.values()])
    classes = sorted(set(labels.tolist()))
    code = {label: i for i, label in enumerate(classes)}
    length = max(s.shape[1] for s in sequences.values())
    train, test = (_pad_to(sequences[split], length) for split in ("train", "test"))
    mean = train.reshape(-1, train.shape[2]).mean(axis=0)
    std = train.reshape(-1, train.shape[2]).std(axis=0) + 1e-8
    train_y, test_y = (np.array([code[v] for v in parts[s][1]], dtype=np.int64)
                       for s in ("train", "test"))
    return Data(f"uea:{name}", ((train - mean) / std).astype(np.float32), train_y,
                ((test - mean) / std).astype(np.float32), test_y, len(classes))


def _pad_front(frame: object) -> np.ndarray:
    """A nested sktime frame (one series per cell) as (N, time, features), front-padded."""
    rows = frame.to_numpy()  # type: ignore[attr-defined]
    length = max(len(cell) for row in rows for cell in row)
    out = np.zeros((rows.shape[0], length, rows.shape[1]), dtype=np.float64)
    for i, row in enumerate(rows):
        for j, cell in enumerate(row):
            values = np.asarray(cell, dtype=np.float64)
            out[i, length - len(values):, j] = values
    return out


def _pad_to(sequences: np.ndarray, length: int) -> np.ndarray:
    pad = length - sequences.shape[1]
    return np.pad(sequences, ((0, 0), (pad, 0), (0, 0))) if pad else sequences


def split_by_label(labels: np.ndarray, sites: int) -> list[np.ndarray]:
    """Sample indices per site such that no class is on two sites (dAD §4.1.1).

    The sorted classes are cut into ``sites`` contiguous groups as evenly as
    possible (10 classes on 3 sites: 4, 3, 3).

    Raises:
        ValueError: fewer classes than sites, or ``sites`` < 1.
    """
    classes = np.unique(labels)
    if sites < 1 or sites > len(classes):
        raise ValueError(f"sites={sites!r} must be between 1 and the number of classes "
                         f"({len(classes)}) so that every site holds at least one class")
    groups = np.array_split(classes, sites)
    return [np.flatnonzero(np.isin(labels, group)) for group in groups]
