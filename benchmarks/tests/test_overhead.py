"""The overhead benchmark's timing loop (no timings asserted)."""

from __future__ import annotations

from benchmarks.overhead import interleaved


def test_interleaved_runs_every_row_each_round_in_changing_order_after_its_preparation() -> None:
    log: list[str] = []
    rows = {name: (lambda name=name: log.append(name)) for name in "abcd"}
    prepare = {"b": lambda: log.append("prepare b")}
    seconds = interleaved(rows, 6, prepare)
    assert set(seconds) == set(rows) and all(value >= 0 for value in seconds.values())
    timed = [entry for entry in log if not entry.startswith("prepare")]
    rounds = [timed[i: i + 4] for i in range(4, len(timed), 4)]  # after one warm-up call each
    assert len(rounds) == 6 and all(sorted(order) == list("abcd") for order in rounds)
    assert len({tuple(order) for order in rounds}) > 1  # not one fixed order
    assert all(log[i - 1] == "prepare b" for i, entry in enumerate(log) if entry == "b")
