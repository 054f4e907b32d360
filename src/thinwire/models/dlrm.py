"""A DLRM-style click model as a splittable chain (DCT KDD'21 §3.1, Fig. 6).

Dense features go through a bottom MLP (512, 256, 64, 16), categorical ones
through embedding tables of dimension 16; the pairwise dot products of the 27
vectors and the bottom output feed a top MLP (512, 256, 128, 1; the sigmoid
lives in ``BCEWithLogitsLoss``). The paper's splits are ``"bottom.3"`` and
``"top.3"`` (width 256). The MLPs start from PyTorch's default (``init="torch"``)
or the DLRM reference's (``init="dlrm"``: weights N(0, 2 / (fan_in + fan_out)),
biases N(0, 1 / fan_out)). Through eight layers PyTorch's default shrinks the
signal (weight variance 1 / (3 fan_in)), so SGD first sits on the constant "no
click" answer; DLRM's keeps the activations' scale.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from thinwire.pipeline.split import Chain

BOTTOM = (512, 256, 64, 16)  # §3.1: output widths of the bottom MLP's FC+ReLU layers
TOP = (512, 256, 128, 1)  # §3.1: output widths of the top MLP (last one a logit)
EMBEDDING_DIM = 16  # §3.1: embedding dimension of the sparse features
SPLITS = {1: (), 2: ("bottom.3",), 3: ("bottom.3", "top.3")}  # §3.1: after two layers of each MLP
INITS = ("torch", "dlrm")


class Interaction(nn.Module):
    """Embedding lookups and DLRM's dot-product feature interaction.

    Takes the bottom MLP's output (B, dim) and the side input ``categorical``
    (B, F) of integer ids; returns the bottom output concatenated with the
    strictly-lower-triangular dot products of the F + 1 vectors, (B, dim +
    (F + 1) F / 2). One table holds every feature's rows (offsets select a
    feature's block), as DLRM's EmbeddingBag layout does.
    """

    side_inputs = ("categorical",)
    offsets: torch.Tensor
    cardinalities: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor

    def __init__(self, cardinalities: Sequence[int], dim: int = EMBEDDING_DIM) -> None:
        super().__init__()
        if not cardinalities or min(cardinalities) < 1:
            raise ValueError(f"cardinalities={list(cardinalities)!r} must be positive counts")
        sizes = torch.tensor([0, *cardinalities[:-1]], dtype=torch.int64)
        self.register_buffer("offsets", sizes.cumsum(0), persistent=False)
        self.register_buffer("cardinalities", torch.tensor(list(cardinalities)),
                             persistent=False)
        self.table = nn.Embedding(int(sum(cardinalities)), dim)
        # DLRM's initialisation: U(-sqrt(1/n), sqrt(1/n)) per feature's table.
        with torch.no_grad():
            for offset, size in zip(self.offsets.tolist(), cardinalities):
                bound = (1.0 / size) ** 0.5
                self.table.weight[offset: offset + size].uniform_(-bound, bound)
        count = len(cardinalities) + 1
        rows, cols = torch.tril_indices(count, count, offset=-1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)

    @property
    def out_features(self) -> int:
        return self.table.embedding_dim + self.rows.numel()

    def forward(self, dense: torch.Tensor, categorical: torch.Tensor) -> torch.Tensor:
        if categorical.shape[1:] != self.cardinalities.shape:
            raise ValueError(f"categorical must be (B, {self.cardinalities.numel()}), got "
                             f"{tuple(categorical.shape)}")
        vectors = torch.cat([dense.unsqueeze(1), self.table(categorical + self.offsets)], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))
        return torch.cat([dense, dots[:, self.rows, self.cols]], dim=1)


def _mlp(widths: Sequence[int], last_relu: bool, init: str) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        layer = nn.Linear(fan_in, fan_out)
        if init == "dlrm":
            with torch.no_grad():
                layer.weight.normal_(0.0, math.sqrt(2.0 / (fan_in + fan_out)))
                layer.bias.normal_(0.0, math.sqrt(1.0 / fan_out))
        layers.append(layer)
        if last_relu or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def dlrm(num_dense: int, cardinalities: Sequence[int], *, bottom: Sequence[int] = BOTTOM,
         top: Sequence[int] = TOP, seed: int = 0, init: str = "torch") -> Chain:
    """The DLRM-style chain: ``bottom`` -> ``interact`` -> ``top`` (one logit).

    Args:
        num_dense: dense features (13 for Criteo).
        cardinalities: rows of each categorical feature's table (26 for Criteo).
        bottom, top: MLP output widths; ``bottom[-1]`` is the embedding dimension.
        seed: initialisation seed (every rank builds the same model).
        init: the MLPs' initialisation, one of :data:`INITS` (module docstring).

    Called as ``model(dense, categorical=ids)``.

    Raises:
        ValueError: ``top`` does not end in one logit, or an unknown ``init``.
    """
    if top[-1] != 1:
        raise ValueError(f"top={list(top)!r} must end in a single logit")
    if init not in INITS:
        raise ValueError(f"init={init!r} must be one of {list(INITS)}")
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        interaction = Interaction(cardinalities, bottom[-1])
        model = Chain(OrderedDict(
            bottom=_mlp([num_dense, *bottom], last_relu=True, init=init),
            interact=interaction,
            top=_mlp([interaction.out_features, *top], last_relu=False, init=init),
        ))
    finally:
        torch.random.set_rng_state(generator_state)
    return model
