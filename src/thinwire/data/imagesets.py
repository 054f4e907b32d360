"""Offline image sets as (N, 1, H, W) float tensors: scikit-learn digits, Debian Fashion-MNIST."""

from __future__ import annotations

import gzip
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"


@dataclass(frozen=True)
class ImageSet:
    """A train/test split, standardised with the training set's mean and deviation."""

    name: str
    x_train: torch.Tensor  # (N, 1, H, W) float32
    y_train: torch.Tensor  # (N,) int64
    x_test: torch.Tensor
    y_test: torch.Tensor
    classes: int


def _standardise(name: str, x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray,
                 y_test: np.ndarray) -> ImageSet:
    mean, std = float(x_train.mean()), float(x_train.std())
    def as_images(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(((x - mean) / std).astype(np.float32)).unsqueeze(1)
    return ImageSet(name, as_images(x_train), torch.from_numpy(y_train.astype(np.int64)),
                    as_images(x_test), torch.from_numpy(y_test.astype(np.int64)),
                    int(y_train.max()) + 1)


def digits() -> ImageSet:
    """scikit-learn's 8x8 digits (1797 images, ships in the wheel): a fixed stratified
    80/20 split (1437 train, 360 test)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    images = bunch.images.astype(np.float64) / 16.0
    x_train, x_test, y_train, y_test = train_test_split(
        images, bunch.target, test_size=0.2, random_state=0, stratify=bunch.target)
    return _standardise("digits", x_train, y_train, x_test, y_test)


def _read_idx(path: str) -> np.ndarray:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as handle:
        data = handle.read()
    dims = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def _find(directory: str, stem: str) -> str:
    for suffix in ("", ".gz"):
        path = os.path.join(directory, stem + suffix)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(
        f"{stem} not found in {directory}; install the Debian package dataset-fashion-mnist "
        "(apt-get install dataset-fashion-mnist) or use the digits set")


def fashion_mnist(directory: str = FASHION_MNIST_DIR) -> ImageSet:
    """Fashion-MNIST 28x28 (60k train, 10k test) from the IDX files of the Debian package.

    Raises:
        FileNotFoundError: the package is not installed.
    """
    x_train = _read_idx(_find(directory, "train-images-idx3-ubyte")) / 255.0
    y_train = _read_idx(_find(directory, "train-labels-idx1-ubyte"))
    x_test = _read_idx(_find(directory, "t10k-images-idx3-ubyte")) / 255.0
    y_test = _read_idx(_find(directory, "t10k-labels-idx1-ubyte"))
    return _standardise("fashion-mnist", x_train, y_train, x_test, y_test)


IMAGE_SETS: dict[str, Callable[[], ImageSet]] = {
    "digits": digits,
    "fashion-mnist": fashion_mnist,
}


def load_image_set(name: str) -> ImageSet:
    """The image set ``name`` (one of :data:`IMAGE_SETS`).

    Raises:
        ValueError: unknown name.
        FileNotFoundError: the set's files are not installed.
    """
    if name not in IMAGE_SETS:
        raise ValueError(f"unknown image set {name!r}; choose from {sorted(IMAGE_SETS)}")
    return IMAGE_SETS[name]()
