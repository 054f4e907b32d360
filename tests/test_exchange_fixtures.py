"""Every scheme equals what it gave before its exchange became one kernel, to the bit.

Means, every rank's error memory and the metered bytes of each case of
:mod:`exchange_cases`, on 2 and 3 gloo ranks, through ``launch`` and through
DDP-like buckets (``launch_flat``), against ``tests/fixtures/exchange.json``.

The means and memories are those of the schemes before the kernel. The bytes
are too, but where two exchanges had laid payloads out two ways and the kernel
keeps one: an own-index payload addresses only the tensors its selection
covers (as ``topk+KIND`` did), so where a bitmap is chosen it no longer spans
tensors sent whole (``laplace`` here, 12 B less a payload; ``topk`` with
``exclude``); and a quantised payload of a round that was not finite is metered
per tensor, as every other payload is, not as one ``"(skipped)"`` part.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest

from exchange_cases import CASES, FIXTURE, WORLDS, condensed, differences, run_all
from thinwire.launch import spawn


@functools.cache
def recorded() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module", params=WORLDS, ids=lambda world: f"{world}-ranks")
def measured(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    world: int = request.param
    return world, condensed(spawn(run_all, world))


@pytest.mark.parametrize("label", list(CASES))
def test_scheme_equals_its_recorded_exchange(measured: tuple[int, list[dict[str, Any]]],
                                             label: str) -> None:
    world, ranks = measured
    expected = recorded()[str(world)]
    found = [d for rank, (want, got) in enumerate(zip(expected, ranks))
             for d in differences(want[label], got[label], f"rank {rank}")]
    assert not found, "\n".join(found[:20])
