"""Criteo-shaped click data: a synthetic generator with a known signal, and a real small set.

Neither Criteo nor any click log ships offline, so :func:`synthetic_criteo`
draws 13 dense count features (log-normal, fed as ``log(1 + x)`` as DLRM's
Criteo pipeline does) and 26 categorical ones (Zipf ids, 3 to 1000 values), and
labels from a known logistic "teacher" (linear dense terms, a dense product,
per-id effects and factorisation-machine products of eight features' latent
vectors: the signal DLRM's dot interaction can learn), with an intercept giving
about a quarter positive labels, as Criteo's click rate; the teacher's
probabilities come with the data, so the Bayes accuracy is known (and the
teacher can be sharpened until its log loss on the test rows is a given value).
:func:`breast_cancer` puts scikit-learn's breast cancer set (569 samples, 30
features) in the same shape: standardised features as the dense input, each
feature's quantile bin (fitted on the training split) as a categorical one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

NUM_DENSE = 13  # Criteo's integer features
CARDINALITIES = tuple(int(round(3 * (1000 / 3) ** (i / 25))) for i in range(26))  # 3 .. 1000
POSITIVE_RATE = 0.25  # about Criteo's click-through rate


@dataclass(frozen=True)
class Tabular:
    """Rows of a click-style set: dense floats, categorical ids, 0/1 labels."""

    dense: torch.Tensor  # (n, num_dense) float32
    categorical: torch.Tensor  # (n, num_categorical) int64 ids, per feature from 0
    labels: torch.Tensor  # (n, 1) float32 in {0, 1}
    probability: torch.Tensor | None = None  # (n,) the teacher's P(label = 1), when known

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def rows(self, index: torch.Tensor | slice) -> Tabular:
        p = None if self.probability is None else self.probability[index]
        return Tabular(self.dense[index], self.categorical[index], self.labels[index], p)

    def oracle(self) -> dict[str, float]:
        """Accuracy and log loss of the teacher's probabilities (the best achievable)."""
        if self.probability is None:
            return {}
        p = self.probability.double().clamp(1e-12, 1 - 1e-12)
        y = self.labels.reshape(-1).double()
        loss = -(y * p.log() + (1 - y) * (1 - p).log()).mean()
        accuracy = ((p > 0.5).double() == y).double().mean()
        return {"loss": float(loss), "accuracy": float(accuracy)}


def _zipf_ids(generator: torch.Generator, n: int, cardinality: int,
              exponent: float = 1.1) -> torch.Tensor:
    weights = torch.arange(1, cardinality + 1, dtype=torch.float64) ** -exponent
    ranks = torch.multinomial(weights, n, replacement=True, generator=generator)
    shuffle = torch.randperm(cardinality, generator=generator)  # popular ids anywhere
    return shuffle[ranks]


def synthetic_criteo(n_train: int = 40_000, n_test: int = 10_000, *, seed: int = 0,
                     cardinalities: tuple[int, ...] = CARDINALITIES,
                     num_dense: int = NUM_DENSE, latent: int = 4,
                     scale: float = 1.0,
                     bayes_loss: float | None = None) -> tuple[Tabular, Tabular]:
    """Train and test sets drawn from one teacher (see the module docstring).

    Args:
        n_train, n_test: rows per split.
        seed: everything (teacher and rows) derives from it.
        cardinalities: ids per categorical feature.
        num_dense: dense features.
        latent: dimension of the teacher's factorisation-machine vectors.
        scale: multiplies the teacher's logit around its intercept (signal
            strength: larger is easier).
        bayes_loss: if given, the teacher's logit is first rescaled so that the
            teacher's own log loss on the test split's drawn labels (the best any
            model scores there) is this: a few popular ids' effects otherwise set the
            logit's spread, and the labels drawn for a few thousand test rows move
            that loss by about 0.005 more, so it varies from seed to seed.
            ``scale`` then has no effect.

    Raises:
        ValueError: no rows, or ``bayes_loss`` outside (0, the constant answer's loss).

    Returns:
        (train, test).
    """
    if n_train < 1 or n_test < 1:
        raise ValueError(f"n_train={n_train!r} and n_test={n_test!r} must be >= 1")
    constant = _entropy(torch.tensor([POSITIVE_RATE])).item()
    if bayes_loss is not None and not 0 < bayes_loss < constant:
        raise ValueError(f"bayes_loss={bayes_loss!r} must be None or in (0, {constant:.4f}), "
                         "the log loss of always answering the click rate")
    generator = torch.Generator().manual_seed(seed)
    n = n_train + n_test
    # Dense: log-normal counts with feature-specific location and spread.
    location = torch.rand(num_dense, generator=generator) * 4.0
    spread = 0.5 + torch.rand(num_dense, generator=generator) * 1.0
    normal = torch.randn(n, num_dense, generator=generator)
    counts = torch.floor(torch.exp(location + spread * normal))
    dense = torch.log1p(counts)
    standard = (dense - dense.mean(0)) / dense.std(0).clamp_min(1e-6)
    categorical = torch.stack([_zipf_ids(generator, n, c) for c in cardinalities], dim=1)
    # Teacher.
    dense_weight = torch.randn(num_dense, generator=generator) * 0.35
    logit = standard @ dense_weight + 0.3 * standard[:, 0] * standard[:, 1]
    for j, cardinality in enumerate(cardinalities):
        effect = torch.randn(cardinality, generator=generator) * (0.5 if j % 3 == 0 else 0.2)
        logit += effect[categorical[:, j]]
    paired = min(8, len(cardinalities))
    vectors = [torch.randn(c, latent, generator=generator) / math.sqrt(latent)
               for c in cardinalities[:paired]]
    for j in range(paired):
        for k in range(j + 1, paired):
            logit += 0.35 * (vectors[j][categorical[:, j]] * vectors[k][categorical[:, k]]).sum(1)
    logit = logit - logit.mean()
    if bayes_loss is None:
        logit = logit * scale
        probability = torch.sigmoid(logit + _intercept(logit, POSITIVE_RATE))
        labels = torch.bernoulli(probability, generator=generator).unsqueeze(1)
    else:
        draws = torch.rand(n, generator=generator, dtype=torch.float64)  # label: draw < p
        sharpness, intercept = _sharpness_for(logit, draws, n_train, bayes_loss)
        probability = torch.sigmoid(sharpness * logit + intercept)
        labels = (draws < probability).unsqueeze(1)
    data = Tabular(dense.float(), categorical, labels.float(), probability.float())
    return data.rows(slice(0, n_train)), data.rows(slice(n_train, n))


def _entropy(probability: torch.Tensor) -> torch.Tensor:
    p = probability.double().clamp(1e-12, 1 - 1e-12)
    return -(p * p.log() + (1 - p) * (1 - p).log())


INTERCEPT_ROWS = 20_000  # the bayes_loss teacher's intercept is fitted on these first rows,
# which keeps its search (an intercept per candidate sharpness) to about a second


def _sharpness_for(logit: torch.Tensor, draws: torch.Tensor, n_train: int,
                   loss: float) -> tuple[float, float]:
    """(s, b) where the teacher ``p = sigmoid(s logit + b)``, its intercept b keeping the
    click rate on the first rows, scores log loss ``loss`` on the test rows
    (``logit[n_train:]``) with labels ``draws < p``, by bisection (the loss falls as s
    grows)."""
    low, high = 0.0, 64.0
    sample, test, test_draws = logit[:INTERCEPT_ROWS], logit[n_train:], draws[n_train:]
    for _ in range(32):
        middle = (low + high) / 2
        p = torch.sigmoid(middle * test + _intercept(middle * sample, POSITIVE_RATE)).double()
        p = p.clamp(1e-12, 1 - 1e-12)
        scored = float(torch.where(test_draws < p, -p.log(), -(1 - p).log()).mean())
        if scored > loss:
            low = middle
        else:
            high = middle
    sharpness = (low + high) / 2
    return sharpness, _intercept(sharpness * sample, POSITIVE_RATE)


def _intercept(logit: torch.Tensor, rate: float) -> float:
    """b with mean(sigmoid(logit + b)) = rate, by bisection."""
    low, high = -20.0, 20.0
    for _ in range(60):
        middle = (low + high) / 2
        if float(torch.sigmoid(logit + middle).mean()) < rate:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def breast_cancer(*, seed: int = 0, test_fraction: float = 0.25,
                  bins: int = 8) -> tuple[Tabular, Tabular]:
    """scikit-learn's breast cancer set, Criteo-shaped (see the module docstring).

    Label 1 is "malignant". Standardisation and bin edges are fitted on the
    training split only.

    Returns:
        (train, test), split stratified with ``seed``.
    """
    from sklearn.datasets import load_breast_cancer
    from sklearn.model_selection import train_test_split

    if bins < 2:
        raise ValueError(f"bins={bins!r} must be >= 2")
    features, target = load_breast_cancer(return_X_y=True)
    malignant = (target == 0).astype(np.float32)  # sklearn: 0 = malignant
    train_x, test_x, train_y, test_y = train_test_split(
        features, malignant, test_size=test_fraction, random_state=seed, stratify=malignant)
    mean, std = train_x.mean(0), train_x.std(0) + 1e-8
    edges = np.quantile(train_x, np.linspace(0, 1, bins + 1)[1:-1], axis=0)  # (bins-1, F)

    def convert(x: np.ndarray, y: np.ndarray) -> Tabular:
        ids = np.stack([np.searchsorted(edges[:, j], x[:, j], side="right")
                        for j in range(x.shape[1])], axis=1)
        return Tabular(torch.tensor((x - mean) / std, dtype=torch.float32),
                       torch.tensor(ids, dtype=torch.int64),
                       torch.tensor(y, dtype=torch.float32).unsqueeze(1))

    return convert(train_x, train_y), convert(test_x, test_y)
