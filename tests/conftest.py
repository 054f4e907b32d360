"""Shared fixtures: every test starts from the same random state, on one intra-op thread."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

# The tests' tensors are small, so a second OpenMP thread gains little, and on a machine
# whose cores other processes share its waiting costs far more than it saves
# (tests/test_compress.py: 4 s on one thread, 28 s on two, at a load of 5 on 2 cores).
# One thread is also what each spawned rank runs on (thinwire.launch.spawn's default).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def seed_everything() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
