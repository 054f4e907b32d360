"""Boundary kinds by name: ``build_boundary("dct-mp", ...)`` gives a (sender, receiver) pair."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from thinwire.comm import Meter
from thinwire.pipeline.boundary import DCTMPConfig, Receiver, Sender, dct_mp_pair
from thinwire.schemes.registry import RENAMED

# factory(config, name, width, dtype, meter) -> (sender, receiver)
Factory = Callable[[Any, str, int, torch.dtype, Meter | None], tuple[Sender, Receiver]]

_REGISTRY: dict[str, tuple[type, Factory]] = {}


def register_boundary(name: str, config: type) -> Callable[[Factory], Factory]:
    """Register ``factory`` building the sender/receiver pair of boundary kind ``name``."""

    def decorate(factory: Factory) -> Factory:
        if name in _REGISTRY:
            raise ValueError(f"boundary kind {name!r} is already registered")
        _REGISTRY[name] = (config, factory)
        return factory

    return decorate


def boundary_kinds() -> list[str]:
    """Registered boundary kinds, in registration order."""
    return list(_REGISTRY)


def boundary_config_class(kind: str) -> type:
    """The config dataclass of boundary ``kind``.

    Raises:
        ValueError: unknown kind.
    """
    if kind not in _REGISTRY:
        raise ValueError(f"unknown boundary kind {kind!r}; choose from {boundary_kinds()}")
    return _REGISTRY[kind][0]


def boundary_config(kind: str, **options: Any) -> Any:
    """The validated config of boundary ``kind``.

    Raises:
        ValueError: unknown kind, unknown option, or an option out of range.
    """
    config_type = boundary_config_class(kind)
    fields = {f.name for f in dataclasses.fields(config_type)}
    unknown = sorted(set(options) - fields)
    for old in unknown:
        if old in RENAMED:
            raise ValueError(f"boundary {kind!r}: {RENAMED[old]}")
    if unknown:
        raise ValueError(f"boundary {kind!r} has no option(s) {unknown}; it takes {sorted(fields)}")
    return config_type(**options)


def build_boundary(kind: str, config: Any, name: str, width: int, dtype: torch.dtype,
                   meter: Meter | None = None) -> tuple[Sender, Receiver]:
    """The (sender, receiver) pair of ``kind`` for an activation of last dimension ``width``."""
    if kind not in _REGISTRY:
        raise ValueError(f"unknown boundary kind {kind!r}; choose from {boundary_kinds()}")
    return _REGISTRY[kind][1](config, name, width, dtype, meter)


register_boundary("dct-mp", DCTMPConfig)(dct_mp_pair)
