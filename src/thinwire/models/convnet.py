"""A small convolutional network for single-channel images (8x8 digits, 28x28 Fashion-MNIST)."""

from __future__ import annotations

import torch
from torch import nn


class SmallConvNet(nn.Module):
    """conv3x3 -> ReLU -> max-pool 2 -> conv3x3 -> ReLU -> adaptive avg-pool 4x4 -> linear.

    No batch normalisation: its running statistics are state outside the
    parameters, which a parameter server would have to ship and average
    separately, and a functional gradient call could not share them between
    threads. About 10k parameters with the defaults.

    Args:
        classes: number of output classes.
        channels: input channels.
        widths: output channels of the two convolutions.
    """

    def __init__(self, classes: int = 10, channels: int = 1,
                 widths: tuple[int, int] = (16, 32)) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, widths[0], 3, padding=1)
        self.conv2 = nn.Conv2d(widths[0], widths[1], 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.fc = nn.Linear(widths[1] * 16, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.conv1(images))
        hidden = nn.functional.max_pool2d(hidden, 2)
        hidden = self.pool(torch.relu(self.conv2(hidden)))
        logits: torch.Tensor = self.fc(hidden.flatten(1))
        return logits


class SoftmaxRegression(nn.Module):
    """A linear classifier on flattened pixels (fast; for tests and smoke runs)."""

    def __init__(self, classes: int = 10, features: int = 64) -> None:
        super().__init__()
        self.fc = nn.Linear(features, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.fc(images.flatten(1))
        return logits
