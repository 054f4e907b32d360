"""What a front door installs under the user's optimiser family: options, warm-up, one log line.

Under Adam and AdamW a scheme built with none of :data:`ADAM_OPTIONS`' options is
rebuilt with them (:func:`follow`), and one that compresses averages its first
:data:`ADAM_WARMUP` steps dense unless its user chose a warm-up (:func:`default_warmup`);
:func:`prepare` applies both through :func:`~thinwire.schemes.rebuild`, so the scheme's
config (what the ranks compare) says what it runs. :func:`announce` couples
(:func:`~thinwire.optim.couple`) and logs what was chosen, and why.

Floor: with :mod:`thinwire.optim`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch

from thinwire.optim._family import ADAMS
from thinwire.optim.coupling import Coupling, couple, scheme_of
from thinwire.schemes.base import Scheme
from thinwire.schemes.registry import WARMUP, fingerprint, rebuild, validate_warmup

# Steps Adam and AdamW average dense before a compressing scheme starts (ScaleCom App. E's
# compression warm-up). On the language model at ADAM_OPTIONS, 20 steps took 1.27x dense's
# steps, 30 1.19x; 50 cost a third more bytes for no fewer steps
# (docs/record/adamw-screening.md, "How long a warm-up").
ADAM_WARMUP = 30


def default_warmup(optimizer: torch.optim.Optimizer, scheme: Scheme) -> int:
    """Steps :func:`thinwire.ddp.register` averages dense before ``scheme`` compresses:
    the scheme's own warm-up where its user chose one (``warmup_steps`` given to
    ``schemes.build``, 0 included) or it has one, else :data:`ADAM_WARMUP` under Adam and
    AdamW for a scheme built by name with error feedback (one that compresses), else 0
    (a scheme not built by name has no config to carry a warm-up)."""
    own = scheme.warmup_steps
    if own or WARMUP in scheme.given or scheme.origin is None or not (
            isinstance(optimizer, ADAMS) and scheme.traits.memory is not None):
        return own
    return ADAM_WARMUP


# What a scheme sends under Adam and AdamW where its user chose none of these options: more
# entries at 8 bits, a byte an index. At the defaults for SGD (1 %, full-width values) the
# language model missed its target in 1,500 steps; 7 % at 8 bits reached it within 1.25x
# dense's steps and 1/10 of its bytes (docs/record/adamw-screening.md).
ADAM_OPTIONS: dict[str, dict[str, Any]] = {
    "topk": {"ratio": 0.07, "values": "int8", "indices": "delta8"},
    "topk+int8": {"ratio": 0.07, "indices": "delta8"},
    "local-topk": {"ratio": 0.07, "values": "int8"},  # its index list is a bitmap at 7 %
    # one threshold over the bucket: per layer (the papers') took 1.32x dense's steps (dct-dp)
    # or missed the target (laplace); over the bucket 1.22-1.24x. The Laplace fit alone
    # passed about 3 % of the entries: its density control holds the mean at 7 %
    "dct-dp": {"ratio": 0.07, "values": "int8", "indices": "delta8", "scope": "bucket"},
    "laplace": {"ratio": 0.07, "values": "int8", "indices": "delta8", "scope": "bucket",
                "gain": 0.05},
    # the leader's indices, values all-reduced at 16 bits, ScaleCom's low-pass filter: 1.38x
    # dense's steps at 1/8.2 of its bytes, short of both lines, but 1 % missed the target
    "clt-k": {"ratio": 0.07, "values": "fp16", "beta": 0.1},
    # rank 8: 1.32x dense's steps at 1/6.5 of its bytes, short of both lines; rank 2 (the
    # default for SGD) ended 10 % above dense's loss after 1,500 steps, not reaching it
    "powersgd": {"rank": 8},
}


def default_options(optimizer: torch.optim.Optimizer, scheme: Scheme) -> dict[str, Any]:
    """The options ``scheme`` takes under ``optimizer``'s family (:data:`ADAM_OPTIONS`):
    all of them where ``schemes.build`` was given none of them, else none (what a user
    chose is never mixed with what is chosen for them). Empty for other optimisers and for
    a scheme not built by name."""
    if not isinstance(optimizer, ADAMS) or scheme.origin is None:
        return {}
    options = ADAM_OPTIONS.get(scheme.origin[0], {})
    return {} if scheme.given & options.keys() else dict(options)


def follow(optimizer: torch.optim.Optimizer, scheme: Scheme) -> tuple[Scheme, dict[str, Any]]:
    """``scheme`` rebuilt with :func:`default_options`, and those options; ``scheme`` itself
    and ``{}`` where there are none. Rebuilt by :func:`~thinwire.schemes.rebuild` (its state
    is not carried), so call it before the scheme has run or loaded state (``register``
    does)."""
    options = default_options(optimizer, scheme)
    if not options:
        return scheme, {}
    return rebuild(scheme, **options), options


def prepare(optimizer: torch.optim.Optimizer | None, scheme: Scheme,
            warmup: int | None) -> tuple[Scheme, dict[str, Any], int]:
    """What a front door (``thinwire.ddp.register``, ``thinwire.fsdp.register``) installs:
    ``scheme`` with the optimiser family's options (:func:`follow`) and warm-up
    (:func:`default_warmup`, unless ``warmup`` is given), the options chosen and the
    warm-up's length. Options or a warm-up other than the scheme's own go into its config:
    the scheme is rebuilt with them (:func:`~thinwire.schemes.rebuild`), so call this
    before it has run or loaded state.

    Raises:
        ValueError: ``warmup`` is not an integer >= 0; a rebuild of a scheme that has
            launched or loaded state (the rebuild would lose it); a warm-up for a scheme
            not built by ``schemes.build`` (it has nothing to be rebuilt from).
    """
    chosen: dict[str, Any] = {}
    given = scheme
    if optimizer is not None:
        scheme, chosen = follow(optimizer, scheme)
    if warmup is None:
        warmup = scheme.warmup_steps if optimizer is None else default_warmup(optimizer, scheme)
    validate_warmup(warmup)
    if warmup != scheme.warmup_steps:
        scheme = rebuild(scheme, **{WARMUP: warmup})
    if scheme is not given and given.started:
        spelled = ", ".join(f"{key}={value!r}" for key, value in {**chosen, WARMUP: warmup}.items())
        raise ValueError("the scheme has launched or loaded state already, which rebuilding "
                         f"it with {spelled} would lose: register it before its first step "
                         "and load its state after, or build it with those options")
    return scheme, chosen, warmup


def announce(optimizer: torch.optim.Optimizer, target: Any, chosen: Mapping[str, Any],
             warmup: int, logger: logging.Logger, *, rule: str = "auto",
             feedback: str = "auto") -> Coupling:
    """:func:`couple`, with what :func:`prepare` chose in the result's ``reason``, logged in
    one line to ``logger``."""
    coupled = couple(optimizer, target, rule=rule, feedback=feedback)
    spelled = ", ".join(f"{key}={value!r}" for key, value in chosen.items())
    coupling = dataclasses.replace(
        coupled, warmup=warmup, options=dict(chosen), reason=coupled.reason
        + (f"; the first {warmup} steps averaged dense" if warmup else "")
        + (f"; sends {spelled}, the {type(optimizer).__name__} defaults (give any to "
           "choose them yourself)" if chosen else ""))
    logger.info("%s: %s coupled by rule %r: %s", logger.name,
                fingerprint(scheme_of(target))["scheme"], coupled.rule, coupling.reason)
    return coupling
