"""The density benchmark's option parser."""

from __future__ import annotations

from benchmarks.density import parse


def test_options_parse_to_numbers_none_and_words() -> None:
    assert parse("gain=0.05,life_span=100,refresh_above=None,values=fp16") == {
        "gain": 0.05, "life_span": 100, "refresh_above": None, "values": "fp16"}
    assert parse("") == {}
