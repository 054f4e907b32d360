"""Schemes by name: frozen configs, validated, built from a dict registry."""

from __future__ import annotations

import ast
import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from thinwire.compress.base import check_fraction
from thinwire.compress.payload import INDEX_FORMATS
from thinwire.compress.quantise import KINDS
from thinwire.compress.sparse import SCOPES
from thinwire.compress.values import CASTS
from thinwire.feedback import check_policy
from thinwire.schemes.base import Scheme
from thinwire.schemes.kernel import CompressedScheme

ConfigT = TypeVar("ConfigT")
Factory = Callable[[Any], Scheme]

_REGISTRY: dict[str, tuple[type, Factory]] = {}


# The option every scheme's config has: launches of each tensor sent dense first.
WARMUP = "warmup_steps"


def register(name: str, config: type) -> Callable[[Factory], Factory]:
    """Register ``factory(config_instance) -> Scheme`` under ``name``.

    ``config`` is a frozen dataclass with a ``warmup_steps`` field (an ``int``, default 0,
    checked by :func:`validate_warmup`): :func:`build` gives the scheme its warm-up from
    it, so a scheme's whole setting is its name and config.

    Raises:
        ValueError: ``name`` is registered already.
        TypeError: ``config`` is not a dataclass with a ``warmup_steps`` field.
    """
    fields = {f.name for f in dataclasses.fields(config)} if dataclasses.is_dataclass(config) \
        else set()
    if WARMUP not in fields:
        raise TypeError(f"scheme {name!r}: its config {config.__name__} needs a field "
                        f"'{WARMUP}: int = 0' (launches sent dense first; validate it with "
                        "thinwire.schemes.registry.validate_warmup)")

    def decorate(factory: Factory) -> Factory:
        if name in _REGISTRY:
            raise ValueError(f"scheme {name!r} is already registered")
        _REGISTRY[name] = (config, factory)
        return factory

    return decorate


def names() -> list[str]:
    """Registered scheme names, in registration order."""
    return list(_REGISTRY)


def config_class(name: str) -> type:
    """The config dataclass of scheme ``name``."""
    _known(name)
    return _REGISTRY[name][0]


def build(name: str, **config: Any) -> Scheme:
    """Build scheme ``name`` from keyword config (see ``config_class(name)``).

    ``name`` may carry options as the command line spells them,
    ``"powersgd:rank=8"`` or ``"topk:ratio=0.05:scope=layer"`` (:func:`parse_spelling`);
    a keyword may not set one of them again.

    Every scheme takes ``warmup_steps``: each tensor's first that many launches travel
    whole at their own width, bit for bit what ``dense`` sends, before the scheme
    compresses it (ScaleCom's compression warm-up, App. E.4; Deep Gradient Compression's
    warm-up, §3.3). Each tensor counts its own launches (so DDP's buckets and FSDP's
    per-module launches count alike) and the counts are in ``state_dict``, so a resume on
    either side of the switch is exact. Under ``dense`` it changes nothing: dense sends
    that anyway (accepted, so one ``--warmup`` serves a comparison that includes it).

    Raises:
        ValueError: unknown name, unknown option, an option given twice or out of range.
        TypeError: a warm-up for a registered scheme that is not the exchange kernel's
            (:class:`~thinwire.schemes.CompressedScheme`), which has no dense steps.
    """
    name, spelled = parse_spelling(name)
    twice = sorted(set(spelled) & set(config))
    if twice:
        raise ValueError(f"scheme {name!r}: {twice} given in the name and as keywords")
    config = {**spelled, **config}
    _known(name)
    config_type, factory = _REGISTRY[name]
    fields = {f.name for f in dataclasses.fields(config_type)}
    unknown = sorted(set(config) - fields)
    for old in unknown:
        if old in RENAMED:
            raise ValueError(f"scheme {name!r}: {RENAMED[old]}")
    if unknown:
        raise ValueError(f"scheme {name!r} has no option(s) {unknown}; it takes {sorted(fields)}")
    config_instance = config_type(**config)
    scheme = factory(config_instance)
    steps = getattr(config_instance, WARMUP)
    if steps and not isinstance(scheme, CompressedScheme):
        raise TypeError(f"scheme {name!r} builds a {type(scheme).__name__}, which sends no "
                        f"dense steps first: {WARMUP}={steps!r} must be 0")
    scheme.warmup_steps = steps
    scheme.origin = (name, config_instance)
    scheme.given = frozenset(config)
    return scheme


def rebuild(scheme: Scheme, **options: Any) -> Scheme:
    """``scheme`` built again by :func:`build` from its name and the options it was given,
    ``options`` added or replacing them, with the live attachments a caller set on it:
    its meter, its energy record, its overhead seconds and a coupled memory (the same
    object, which the optimiser's hooks hold: :func:`thinwire.optim.couple`). Its state is
    not carried (load it: ``load_state_dict``).

    Everything else, warm-up included, is in the config, so with no ``options`` the fresh
    scheme equals ``scheme`` in every setting (``origin``, ``given``, fingerprint). Built
    from the options ``scheme`` was given (``scheme.given``), not its whole config, so the
    fresh one's ``given`` is ``scheme``'s plus ``options``' (the rest stay defaults, which
    :func:`thinwire.optim.default_options` may still choose).

    Raises:
        ValueError: ``scheme`` was not built by :func:`build` (it has no ``origin``), or
            ``options`` as :func:`build` refuses them.
    """
    if scheme.origin is None:
        raise ValueError(f"a {type(scheme).__name__} not built by thinwire.schemes.build "
                         "has no name and options to be rebuilt from")
    name, config = scheme.origin
    given = {key: getattr(config, key) for key in scheme.given}
    fresh = build(name, **{**given, **options})
    fresh.meter, fresh.energy, fresh.overhead_s = scheme.meter, scheme.energy, scheme.overhead_s
    if scheme.coupled is not None:
        fresh.couple_memory(scheme.coupled)
    return fresh


def warm_up(scheme: Scheme, steps: int) -> Scheme:
    """``scheme`` with a warm-up of ``steps`` launches, set in place: kept for code written
    before the warm-up was an option. Build with it instead: ``build(name,
    warmup_steps=steps)``, or the spelling ``"NAME:warmup_steps=STEPS"``.

    Sets the ``warmup_steps`` of the scheme's config (and adds it to ``given``), so its
    fingerprint and :func:`rebuild` carry it, as if it had been built with it.

    Raises:
        TypeError: ``scheme`` is not the exchange kernel's (it has no dense steps).
        ValueError: ``steps`` is not an integer >= 0, or the scheme has launched already.
    """
    warnings.warn(f"thinwire.schemes.warm_up is kept for old code: build the scheme with "
                  f"{WARMUP}={steps!r} (or spell it NAME:{WARMUP}={steps!r})",
                  DeprecationWarning, stacklevel=2)
    if not isinstance(scheme, CompressedScheme):
        raise TypeError(f"expected a scheme from thinwire.schemes.build to warm up, got "
                        f"{type(scheme).__name__}")
    validate_warmup(steps)
    if scheme.started and steps != scheme.warmup_steps:
        raise ValueError("the scheme has launched already: give it a warm-up before its "
                         "first launch (build it with warmup_steps)")
    if scheme.origin is not None:
        name, config = scheme.origin
        scheme.origin = (name, dataclasses.replace(config, **{WARMUP: steps}))
        scheme.given = scheme.given | {WARMUP}
    scheme.warmup_steps = steps
    return scheme


def parse_value(text: str) -> Any:
    """A Python literal (``0.9``, ``(1, 2)``, ``None``, ``true`` in any case), else the text."""
    lowered = text.strip().lower()
    if lowered in ("true", "false", "none"):
        return {"true": True, "false": False, "none": None}[lowered]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_spelling(spelling: str) -> tuple[str, dict[str, Any]]:
    """``"powersgd:rank=8"`` -> ``("powersgd", {"rank": 8})``, as ``--schemes`` spells a
    scheme (a dash in a key reads as an underscore: ``life-span=10``).

    Raises:
        ValueError: an option without ``=`` or with an empty key.
    """
    name, options = split_spelling(spelling)
    return name, dict(split_option(option, f"scheme {spelling!r}: option") for option in options)


def split_spelling(spelling: str) -> tuple[str, list[str]]:
    """A scheme as ``--schemes`` spells it to its name and its own options:
    ``"powersgd:rank=4"`` -> ``("powersgd", ["rank=4"])``, so one run can compare
    settings of one scheme side by side (``powersgd,powersgd:rank=4``)."""
    name, *options = spelling.split(":")
    return name.strip(), [option.strip() for option in options]


def split_option(text: str, flag: str = "--option") -> tuple[str, Any]:
    """``"life-span=10"`` -> ``("life_span", 10)`` (the value by :func:`parse_value`).

    Raises:
        ValueError: no ``=``, or an empty key.
    """
    key, sep, value = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key:
        raise ValueError(f"{flag} {text!r} must look like KEY=VALUE, e.g. ratio=0.1")
    return key, parse_value(value)


# Options spelled another way before, or as another interface spells them: naming the
# scheme's spelling beats "no option".
RENAMED = {
    "sparsity": "sparsity was renamed: pass ratio=1-x (the fraction kept)",
    "include": "include was replaced: pass exclude=(patterns always sent dense)",
    "start_iter": "start_iter was renamed: pass warmup_steps (steps sent dense first)",
    "warmup": "warmup is register's and --warmup's name: a scheme's option is warmup_steps "
              "(steps sent dense first)",
}


def fingerprint(scheme: Scheme) -> dict[str, Any]:
    """What every rank's scheme must share: registered name, full config (its warm-up
    included), traits.

    A scheme built without :func:`build` is described by its class and traits only.
    """
    name, config = scheme.origin or (type(scheme).__name__, None)
    return {"scheme": name,
            "config": dataclasses.asdict(config) if config is not None else {},
            "traits": dataclasses.asdict(scheme.traits)}


def _known(name: str) -> None:
    if name not in _REGISTRY:
        raise ValueError(f"unknown scheme {name!r}; choose from {names()}")


# Shared validation, called from each config's __post_init__.

def validate_common(config: Any) -> None:
    check_policy(config.nonfinite)
    validate_warmup(config.warmup_steps)
    if hasattr(config, "min_numel") and (not isinstance(config.min_numel, int)
                                         or config.min_numel < 0):
        raise ValueError(f"min_numel={config.min_numel!r} must be an integer >= 0")
    if hasattr(config, "values"):
        allowed = list(CASTS) + (list(KINDS) if getattr(config, "codes", False) else [])
        if config.values not in allowed:
            raise ValueError(f"values={config.values!r} must be one of {allowed}")
    if hasattr(config, "indices") and config.indices not in INDEX_FORMATS:
        raise ValueError(f"indices={config.indices!r} must be one of {list(INDEX_FORMATS)}")
    if hasattr(config, "scope") and config.scope not in SCOPES:
        raise ValueError(f"scope={config.scope!r} must be one of {SCOPES}")


def validate_patterns(config: Any) -> None:
    """Normalise ``config.exclude`` to a tuple of fnmatch patterns (a comma-separated
    string, as a command line gives, is a list of them)."""
    patterns = config.exclude.split(",") if isinstance(config.exclude, str) else config.exclude
    if not all(isinstance(p, str) for p in patterns):
        raise ValueError(f"exclude={config.exclude!r} must be name patterns (strings)")
    object.__setattr__(config, "exclude", tuple(p.strip() for p in patterns if p.strip()))


def validate_warmup(steps: int) -> None:
    """A warm-up's length: an integer >= 0 (launches of each tensor sent dense first).

    Raises:
        ValueError: ``steps`` is not an integer >= 0 (a bool is not a count).
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"{WARMUP}={steps!r} must be an integer >= 0 (launches sent dense "
                         "first)")


def validate_ratio(ratio: float) -> None:
    check_fraction("ratio", ratio, 0.0, 1.0, closed_low=False, closed_high=True)


def validate_gain(gain: float | None) -> None:
    """A density control's gain: None (off) or in (0, 1]."""
    if gain is not None and not 0.0 < gain <= 1.0:
        raise ValueError(f"gain={gain!r} must be None or in (0, 1]")


def validate_capacity(capacity: float) -> None:
    if not (isinstance(capacity, (int, float)) and not isinstance(capacity, bool)
            and math.isfinite(capacity) and capacity >= 1.0):
        raise ValueError(f"capacity={capacity!r} must be a number >= 1")
