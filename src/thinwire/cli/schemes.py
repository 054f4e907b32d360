"""List the registered schemes and their options."""

from __future__ import annotations

import argparse
import dataclasses

from thinwire import schemes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser


def run(args: argparse.Namespace) -> int:
    for name in schemes.names():
        fields = dataclasses.fields(schemes.config_class(name))
        options = ", ".join(f"{f.name}={f.default!r}" for f in fields)
        print(f"{name:12s} {options}")
    return 0
